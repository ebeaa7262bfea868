#pragma once
/// What the CUDA kernel files share: the grid of a grid-stride loop, a warp's inclusive sum.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace kvsift::cuda::detail {

/// Blocks of `threads` for a grid-stride loop over `items` (capped: the loop covers the rest).
inline unsigned grid_stride_blocks(std::int64_t items, int threads) {
  return unsigned(std::clamp<std::int64_t>((items + threads - 1) / threads, 1, 65535 * 8));
}

/// The sum of x over lanes 0 .. this lane of a full warp (every lane calls).
template <class T>
__device__ __forceinline__ T warp_inclusive_sum(T x) {
  const int lane = int(threadIdx.x & 31);
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const T y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  return x;
}

}  // namespace kvsift::cuda::detail
