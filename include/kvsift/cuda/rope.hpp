#pragma once
/// RoPE on CUDA: cpu/rope.hpp's twin, with the same arguments but the context and the same results (bit for bit
/// from the same table; a table built on the GPU may differ from the CPU's in the last bit of a few entries,
/// where the device's fp64 pow, log, cos or sin round differently from the host's). Device memory (positions,
/// deltas and the table too); one launch each, no allocation, no host sync; stream-ordered and CUDA-graph
/// capturable. Positions live on the device, so they cannot be checked before the launch: a row whose position
/// or |delta| is outside [0, table.positions) is written as NaN in its rotary channels.

#include <cstdint>

#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

void build_rope_table(const RopeConfig& config, const RopeTableView& table, const Context& ctx);

template <class T>
void apply_rope(const HeadsView<T>& x, const std::int32_t* d_positions, const RopeTableView& table, bool inverse,
                const Context& ctx);

/// cpu::apply_rope's position-offset form: row b at d_positions[b] + position_offset.
template <class T>
void apply_rope(const HeadsView<T>& x, const std::int32_t* d_positions, std::int32_t position_offset,
                const RopeTableView& table, bool inverse, const Context& ctx);

template <class T>
void apply_rope(const MatrixView<T>& rows, const std::int32_t* d_positions, const RopeTableView& table, bool inverse,
                const Context& ctx);

/// cpu::rotate_to_position's contract (target checked on the host); a row whose position d_positions[b] +
/// position_offset is negative or whose |target - position| is not below table.positions gets NaN.
template <class T>
void rotate_to_position(const HeadsView<T>& x, const std::int32_t* d_positions, std::int32_t position_offset,
                        std::int32_t target, const RopeTableView& table, const Context& ctx);

}  // namespace kvsift::cuda
