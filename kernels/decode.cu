// Instantiates the decode family's launchers for every entry of its lists (core/dtype.hpp
// KVSIFT_DECODE_STORAGE_TYPES, KVSIFT_STORAGE_TYPES for the fp32 merges' outputs): per storage type, decode attention at head_dim
// {64, 128, 256} x {4, 8} warps per CTA (eight not at 256; with_decode_kernel in cuda/detail/decode_kernels.cuh),
// its validation pass and its same-type merge; the merges of fp32 partials. Host entry points: src/cuda/decode.cpp.
#include "kvsift/cuda/detail/decode_kernels.cuh"

namespace kvsift::cuda::detail {

#define KVSIFT_DECODE_INSTANTIATE(T) KVSIFT_DECODE_LAUNCHERS(, T)
#define KVSIFT_MERGE_FP32_INSTANTIATE(TO) KVSIFT_MERGE_FP32_LAUNCHER(, TO)
KVSIFT_DECODE_STORAGE_TYPES(KVSIFT_DECODE_INSTANTIATE)
KVSIFT_STORAGE_TYPES(KVSIFT_MERGE_FP32_INSTANTIATE)
#undef KVSIFT_DECODE_INSTANTIATE
#undef KVSIFT_MERGE_FP32_INSTANTIATE

}  // namespace kvsift::cuda::detail
