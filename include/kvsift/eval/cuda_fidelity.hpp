#pragma once
/// The fidelity harness (eval/fidelity.hpp) on CUDA: selector entries of AnySelector<half, cuda::Context>, each
/// run in a CUDA DecodeStep on one stream over the capture layer copied to device memory, through the same
/// evaluation loop, metrics and tables as the CPU's. Only the decode steps run on the GPU; the exact references,
/// the oracle's ranking and the scores stay on the host (fp64), and at each evaluated position the step's output
/// and selection are copied back (a stream synchronization, as a harness may). In kvsift::cuda (link kvsift::cuda).

#include <memory>
#include <vector>

#include "kvsift/cuda/context.hpp"
#include "kvsift/eval/fidelity.hpp"

namespace kvsift {

extern template std::vector<BasicSelectorEntry<cuda::Context>> reference_selectors<cuda::Context>();
extern template std::vector<BasicSelectorEntry<cuda::Context>> method_selectors<cuda::Context>();
extern template std::vector<BasicSelectorEntry<cuda::Context>> rerank_selectors<cuda::Context>(std::int32_t);
extern template std::vector<BasicSelectorEntry<cuda::Context>> csattention_variants<cuda::Context>();
extern template std::vector<BasicSelectorEntry<cuda::Context>> a2ats_selectors<cuda::Context>(
    const std::string&, std::shared_ptr<const A2atsCodebooks>, bool, std::int32_t);

namespace cuda {

using SelectorEntry = BasicSelectorEntry<Context>;

/// The CUDA backend ("cuda"): each step a CUDA DecodeStep of AnySelector<half, cuda::Context> on ctx.stream. The
/// layer (q, k, v) is copied to the device once per layer (load), each step's workspace and output are allocated
/// when the step is made. Throws kvsift::Error when the machine has no CUDA device.
std::unique_ptr<FidelityBackend> fidelity_backend(std::vector<SelectorEntry> selectors, const Context& ctx = {});

}  // namespace cuda
}  // namespace kvsift
