// Instantiates the CUDA decode-attention and merge launchers for half storage: head_dim {64, 128, 256} x
// {4, 8} warps per CTA, eight not at 256 (see with_decode_kernel in cuda/detail/decode_kernels.cuh). Host entry points live in
// src/cuda/decode.cpp.
#include "kvsift/cuda/detail/decode_kernels.cuh"

namespace kvsift::cuda::detail {
template cudaError_t launch_decode<half>(const DecodeParams<half>&, cudaStream_t, bool);
template cudaError_t launch_check_selection<half>(const DecodeParams<half>&, cudaStream_t);
template cudaError_t launch_merge_states<half, half>(const MergeParams<half, half>&, cudaStream_t);
}  // namespace kvsift::cuda::detail
