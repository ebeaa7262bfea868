#pragma once
/// Launchers of the decode and merge kernels, defined in kernels/*.cu and called by the host entry points
/// (src/cuda/decode.cpp) after validation. They return the launch status and never throw.

#include <cuda_runtime_api.h>

#include "kvsift/cuda/detail/decode_params.hpp"
#include "kvsift/core/dtype.hpp"

namespace kvsift::cuda::detail {

/// Launches the decode kernel for p (grid from p's shape), as a programmatic dependent of the stream's
/// previous kernel when `programmatic`, and, when p.num_splits > 1, the split merge.
template <class T>
cudaError_t launch_decode(const DecodeParams<T>& p, cudaStream_t stream, bool programmatic);

/// Validation mode: checks every selection row's count and indices (range, duplicates) on the device and
/// writes the smallest offending row to *p.first_bad_row (left as is when every row is valid).
template <class T>
cudaError_t launch_check_selection(const DecodeParams<T>& p, cudaStream_t stream);

template <class TI, class TO>
cudaError_t launch_merge_states(const MergeParams<TI, TO>& p, cudaStream_t stream);

extern template cudaError_t launch_decode<half>(const DecodeParams<half>&, cudaStream_t, bool);
extern template cudaError_t launch_decode<bfloat16>(const DecodeParams<bfloat16>&, cudaStream_t, bool);
extern template cudaError_t launch_check_selection<half>(const DecodeParams<half>&, cudaStream_t);
extern template cudaError_t launch_check_selection<bfloat16>(const DecodeParams<bfloat16>&, cudaStream_t);
extern template cudaError_t launch_merge_states<half, half>(const MergeParams<half, half>&, cudaStream_t);
extern template cudaError_t launch_merge_states<bfloat16, bfloat16>(const MergeParams<bfloat16, bfloat16>&,
                                                                    cudaStream_t);
extern template cudaError_t launch_merge_states<float, float>(const MergeParams<float, float>&, cudaStream_t);
extern template cudaError_t launch_merge_states<float, half>(const MergeParams<float, half>&, cudaStream_t);
extern template cudaError_t launch_merge_states<float, bfloat16>(const MergeParams<float, bfloat16>&, cudaStream_t);

}  // namespace kvsift::cuda::detail
