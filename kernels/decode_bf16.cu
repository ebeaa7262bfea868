// Instantiates the CUDA decode-attention and merge launchers for bfloat16 storage: head_dim {64, 128, 256} x
// {4, 8} warps per CTA, eight not at 256 (see with_decode_kernel in cuda/detail/decode_kernels.cuh). Host entry points live in
// src/cuda/decode.cpp.
#include "kvsift/cuda/detail/decode_kernels.cuh"

namespace kvsift::cuda::detail {
template cudaError_t launch_decode<bfloat16>(const DecodeParams<bfloat16>&, cudaStream_t, bool);
template cudaError_t launch_check_selection<bfloat16>(const DecodeParams<bfloat16>&, cudaStream_t);
template cudaError_t launch_merge_states<bfloat16, bfloat16>(const MergeParams<bfloat16, bfloat16>&, cudaStream_t);
}  // namespace kvsift::cuda::detail
