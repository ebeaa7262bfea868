// Instantiates the standalone LSE merge of fp32 states (fp32 partials from decode with an fp32 output, the CPU
// side of hybrid decode) into fp32, half or bfloat16.
#include "kvsift/cuda/detail/decode_kernels.cuh"

namespace kvsift::cuda::detail {
template cudaError_t launch_merge_states<float, float>(const MergeParams<float, float>&, cudaStream_t);
template cudaError_t launch_merge_states<float, half>(const MergeParams<float, half>&, cudaStream_t);
template cudaError_t launch_merge_states<float, bfloat16>(const MergeParams<float, bfloat16>&, cudaStream_t);
}  // namespace kvsift::cuda::detail
