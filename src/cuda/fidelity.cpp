#include "kvsift/eval/cuda_fidelity.hpp"

#include <cuda_runtime_api.h>

#include "kvsift/core/error.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/eval/detail/fidelity_backend.hpp"

namespace kvsift {

template std::vector<BasicSelectorEntry<cuda::Context>> reference_selectors<cuda::Context>();
template std::vector<BasicSelectorEntry<cuda::Context>> method_selectors<cuda::Context>();
template std::vector<BasicSelectorEntry<cuda::Context>> rerank_selectors<cuda::Context>(std::int32_t);
template std::vector<BasicSelectorEntry<cuda::Context>> csattention_variants<cuda::Context>();
template std::vector<BasicSelectorEntry<cuda::Context>> a2ats_selectors<cuda::Context>(
    const std::string&, std::shared_ptr<const A2atsCodebooks>, bool, std::int32_t);

namespace cuda {
namespace {

/// Copies in the stream's order (cudaMemcpyDefault: either side may be host memory, unified addressing tells
/// which); wait() synchronizes the stream before the host reads what came back.
struct StreamCopy {
  static void copy(void* dst, const void* src, std::size_t bytes, const Context& ctx) {
    if (bytes > 0) KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ctx.stream));
  }
  static void wait(const Context& ctx) { KVSIFT_CUDA_CHECK(cudaStreamSynchronize(ctx.stream)); }
};

}  // namespace

std::unique_ptr<FidelityBackend> fidelity_backend(std::vector<SelectorEntry> selectors, const Context& ctx) {
  KVSIFT_CHECK(device_available(), "cuda::fidelity_backend", "no CUDA device on this machine");
  return std::make_unique<kvsift::detail::SelectorBackend<Context, StreamCopy>>("cuda", std::move(selectors), ctx);
}

}  // namespace cuda
}  // namespace kvsift
