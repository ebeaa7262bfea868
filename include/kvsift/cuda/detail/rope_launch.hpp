#pragma once
/// Launchers of cuda/rope.hpp's kernels (kernels/rope.cu). They return the launch status and never throw;
/// src/cuda/rope.cpp validates and calls them.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/core/rope.hpp"

namespace kvsift::cuda::detail {

/// Vectors to rotate: batch rows of `heads` vectors each; amounts[b] rotates every vector of row b.
template <class T>
struct RopeRows {
  T* data = nullptr;
  std::int64_t batch = 0;
  std::int32_t heads = 0;
  std::int64_t batch_stride = 0;
  std::int64_t head_stride = 0;
};

cudaError_t launch_build_rope_table(const RopeConfig& config, const RopeTableView& table, cudaStream_t stream);

/// Rotates row b's vectors by amounts[b]: a position (`delta` false; negative ones are out of range) or a signed
/// delta; `inverse` turns the rotation back, and the result is multiplied by `scale`.
template <class T>
cudaError_t launch_rope(const RopeRows<T>& rows, const std::int32_t* amounts, const RopeTableView& table, bool delta,
                        bool inverse, double scale, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
