// CUDA group scores (cuda::group_scores): the kernels of cuda/detail/group_scores_kernels.cuh, instantiated once
// for every (storage type, cache view) of the CPU twin's list.
#include "kvsift/cuda/detail/group_scores_kernels.cuh"

namespace kvsift::cuda::detail {

#define KVSIFT_INSTANTIATE(T, KV) \
  template cudaError_t launch_group_scores<T, KV>(const GroupScoreParams<T, KV>&, cudaStream_t);
KVSIFT_GROUP_SCORE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
