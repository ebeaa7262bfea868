// Instantiates the standalone LSE merge for fp32 states (the CPU side of hybrid decode produces fp32).
#include "kvsift/cuda/detail/decode_kernels.cuh"

namespace kvsift::cuda::detail {
template cudaError_t launch_merge_states<float>(const MergeParams<float>&, cudaStream_t);
}  // namespace kvsift::cuda::detail
