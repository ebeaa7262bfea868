// Instantiates the CUDA decode-attention and merge launchers for half storage: head_dim {64, 128} x GQA tile
// {1, 2, 4, 8} (see launch_decode in decode.cuh). Host entry points live in src/cuda/decode.cpp.
#include "kvsift/attention/decode.cuh"

namespace kvsift::cuda::detail {
template cudaError_t launch_decode<half>(const DecodeParams<half>&, cudaStream_t);
template cudaError_t decode_ctas_per_sm<half>(int, int, int*);
template cudaError_t launch_merge_states<half>(const MergeParams<half>&, cudaStream_t);
}  // namespace kvsift::cuda::detail
