#pragma once
/// The launchers of cuda::vq_encode's kernels (kernels/selectors/a2ats/vq_encode.cu). They return the launch status and never throw;
/// src/selectors/a2ats/cuda/vq.cpp checks the arguments first (and that codebook.centroids is 16-byte aligned) and picks the kernel.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/core/views.hpp"
#include "kvsift/selectors/a2ats/vq.hpp"

namespace kvsift::cuda::detail {

/// Rows up to which the few-rows kernel encodes: below one tensor-core row tile (256 keys), that kernel would run
/// one block per kv head, each streaming its kv head's whole codebook.
inline constexpr std::int64_t kVqEncodeFewRows = 256;
inline constexpr std::int32_t kVqEncodeGroupRows = 8;  ///< rows per block of the few-rows kernel
inline constexpr std::int32_t kVqEncodeChunk = 64;     ///< codewords per shared-memory stage of the few-rows kernel
inline constexpr std::int32_t kVqEncodeMaxSplit = 8;   ///< blocks per cluster (portable size on sm_90)

template <class T>
cudaError_t launch_vq_encode_mma(const HeadsView<const T>& keys, const VqEncodeCodebook& codebook,
                                 const VqCodesView<std::uint16_t>& codes, const VqCodeDestination& destination,
                                 cudaStream_t stream);

/// The few-rows kernel: each (group of kVqEncodeGroupRows rows, kv head) split over `split` blocks (at most
/// kVqEncodeMaxSplit), one cluster, each block a slice of the codewords; split 1 where the kernel was built for
/// no sm_90 (then each block streams its kv head's whole codebook).
template <class T>
cudaError_t launch_vq_encode_few(const HeadsView<const T>& keys, const VqEncodeCodebook& codebook,
                                 const VqCodesView<std::uint16_t>& codes, const VqCodeDestination& destination,
                                 std::int32_t split, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
