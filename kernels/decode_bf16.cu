// Instantiates the CUDA decode-attention and merge launchers for bfloat16 storage: head_dim {64, 128} x GQA tile
// {1, 2, 4, 8} (see launch_decode in decode.cuh). Host entry points live in src/cuda/decode.cpp.
#include "kvsift/attention/decode.cuh"

namespace kvsift::cuda::detail {
template cudaError_t launch_decode<bfloat16>(const DecodeParams<bfloat16>&, cudaStream_t);
template cudaError_t decode_ctas_per_sm<bfloat16>(int, int, int*);
template cudaError_t launch_merge_states<bfloat16>(const MergeParams<bfloat16>&, cudaStream_t);
}  // namespace kvsift::cuda::detail
