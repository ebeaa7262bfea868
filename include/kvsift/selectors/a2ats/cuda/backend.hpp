#pragma once
/// A²ATS's codebook quantization, lookup tables and code scan, CUDA overloads: what the selector, written once for both
/// backends, calls unqualified (argument-dependent lookup on cuda::Context). cuda/backend.hpp includes this file;
/// selectors/a2ats/cpu/backend.hpp is the CPU twin. Each overload forwards to the primitive documented in its own
/// header.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/backend.hpp"  // the shared overloads (which include this file at their end)
#include "kvsift/cuda/context.hpp"
#include "kvsift/selectors/a2ats/cuda/vq.hpp"
#include "kvsift/selectors/a2ats/vq.hpp"

namespace kvsift::cuda {

inline void vq_codeword_norms(const MatrixView<const float>& centroids, float* norms, const Context& ctx) {
  cuda::vq_codeword_norms(centroids, norms, ctx.stream);
}
inline std::size_t vq_encode_workspace_bytes(std::int32_t codewords, std::int32_t head_dim, const Context&) {
  return cuda::vq_encode_workspace_bytes(codewords, head_dim);
}
template <class T>
void vq_encode(const HeadsView<const T>& keys, const VqEncodeCodebook& codebook, const VqCodesView<std::uint16_t>& codes,
               const VqCodeDestination& destination, std::span<std::byte> workspace, const Context& ctx) {
  cuda::vq_encode(keys, codebook, codes, destination, workspace, ctx.stream);
}
template <class T>
void vq_lut(const QueryView<const T>& q, const VqCodebook<T>& codebook, const MatrixView<float>& lut, const Context& ctx) {
  cuda::vq_lut(q, codebook, lut, ctx.stream);
}
inline void vq_code_scan(const MatrixView<const float>& lut, std::int32_t batch,
                         const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots,
                         const std::int32_t* lengths, const MatrixView<float>& scores, const VqScanOptions& options,
                         const Context& ctx) {
  cuda::vq_code_scan(lut, batch, codes, slots, lengths, scores, options, ctx.stream);
}
inline std::size_t vq_lut_scan_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                               std::int32_t codewords, std::int32_t head_dim, const Context&) {
  return cuda::vq_lut_scan_workspace_bytes(batch, q_heads, kv_heads, codewords, head_dim);
}
template <class T>
void vq_lut_scan(const QueryView<const T>& q, const VqCodebook<T>& codebook,
                 const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots, const std::int32_t* lengths,
                 const MatrixView<float>& scores, const VqScanOptions& options, std::span<std::byte> workspace,
                 const Context& ctx) {
  cuda::vq_lut_scan(q, codebook, codes, slots, lengths, scores, options, workspace, ctx.stream);
}

}  // namespace kvsift::cuda
