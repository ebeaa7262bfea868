#pragma once
/// What the CUDA kernel files share: the grid of a grid-stride loop.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace kvsift::cuda::detail {

/// Blocks of `threads` for a grid-stride loop over `items` (capped: the loop covers the rest).
inline unsigned grid_stride_blocks(std::int64_t items, int threads) {
  return unsigned(std::clamp<std::int64_t>((items + threads - 1) / threads, 1, 65535 * 8));
}

}  // namespace kvsift::cuda::detail
