// Instantiates the decode family's launchers for every entry of its lists (core/dtype.hpp
// KVSIFT_DECODE_STORAGE_TYPES, KVSIFT_STORAGE_TYPES for the fp32 merges' outputs): per storage type, decode attention at head_dim
// {64, 128, 256} x {4, 8} warps per CTA (eight not at 256; with_decode_kernel in cuda/detail/decode_kernels.cuh),
// its validation pass and its same-type merge; the merges of fp32 partials; the cluster capacity that plans the
// cluster merge. Host entry points: src/cuda/decode.cpp.
#include "kvsift/cuda/detail/decode_kernels.cuh"

namespace kvsift::cuda::detail {

cudaError_t decode_cluster_capacity(DecodeClusterCapacity* capacity) {
  capacity->fill(0);
  constexpr auto kernel = decode_attention_kernel<128, bfloat16, kDecodeMaxWarps, true>;
  bool sm90 = false;
  if (const cudaError_t s = built_for_sm90<kernel>(&sm90); s != cudaSuccess || !sm90) return s;
  if (const cudaError_t s = open_shared_memory<kernel>(); s != cudaSuccess) return s;
  for (int size = 2; size <= kClusterMergeMaxSplits; ++size) {
    max_active_clusters<kernel>(size, 32 * kDecodeMaxWarps, decode_shared_bytes(128, kDecodeMaxWarps),
                                &(*capacity)[std::size_t(size)]);
  }
  return cudaSuccess;
}

#define KVSIFT_DECODE_INSTANTIATE(T) KVSIFT_DECODE_LAUNCHERS(, T)
#define KVSIFT_MERGE_FP32_INSTANTIATE(TO) KVSIFT_MERGE_FP32_LAUNCHER(, TO)
KVSIFT_DECODE_STORAGE_TYPES(KVSIFT_DECODE_INSTANTIATE)
KVSIFT_STORAGE_TYPES(KVSIFT_MERGE_FP32_INSTANTIATE)
#undef KVSIFT_DECODE_INSTANTIATE
#undef KVSIFT_MERGE_FP32_INSTANTIATE

}  // namespace kvsift::cuda::detail
