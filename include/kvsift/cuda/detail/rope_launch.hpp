#pragma once
/// Launchers of cuda/rope.hpp's kernels (kernels/rope.cu). They return the launch status and never throw;
/// src/cuda/rope.cpp validates and calls them.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

/// What row b's value v = values[b] says: p = v + offset is a position to rotate to (back from it with inverse;
/// negative: out of range), or a position to rotate from to `target` (by target - p; a negative p is out of range).
enum class RopeAmountKind : std::uint8_t { position, to_target };
struct RopeAmounts {
  const std::int32_t* values = nullptr;  ///< [batch], device memory
  RopeAmountKind kind = RopeAmountKind::position;
  std::int32_t offset = 0;
  std::int32_t target = 0;  ///< to_target only
};

cudaError_t launch_build_rope_table(const RopeConfig& config, const RopeTableView& table, cudaStream_t stream);

/// Rotates the vectors of row b (vectors.row(p, b) for every problem p: a row's heads) as amounts says for b;
/// `inverse` turns the rotation back, and the result is multiplied by `scale`. A row whose rotation the table does
/// not hold gets NaN in its rotary channels.
template <class T>
cudaError_t launch_rope(const BatchedMatrixView<T>& vectors, const RopeAmounts& amounts, const RopeTableView& table,
                        bool inverse, double scale, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
