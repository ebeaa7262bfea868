#pragma once
/// RoPE on the CPU on the storage types (core/rope.hpp has the configuration, the scalings and the table
/// view): fill a cos/sin table once per config, then rotate query heads or key rows in place by their positions,
/// undo that, or rotate by a signed position delta. The twin of cuda/rope.hpp, with the same arguments but the
/// context and the same results, bit for bit from the same table (the rotation: core/rope.hpp rope_rotate_pair,
/// one fp32 rounding and one to the storage type). Host memory; no allocation; every argument is checked,
/// positions included. Threads: rows on ctx.pool (nullptr: the calling thread); results do not depend on it.

#include <cstdint>

#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// Fills table.cos and table.sin for positions [0, table.positions) (fp64 angles, rounded once). The table
/// must be RopeTableView::make(config, head_dim, positions, ...) for some head_dim: its layout and attention
/// factor are the config's. Refused: an invalid config, positions <= 0, null arrays.
void build_rope_table(const RopeConfig& config, const RopeTableView& table, const Context& ctx = {});

/// Rotates every head vector of batch row b of x [batch, heads, head_dim] to position positions[b] (times the
/// table's attention factor), or with inverse undoes that rotation (divided by it). fp32 math, x in half,
/// bfloat16 or float, rounded once to T. Refused: a position outside [0, table.positions), a table rotary_dim
/// above head_dim, null pointers.
template <class T>
void apply_rope(const HeadsView<T>& x, const std::int32_t* positions, const RopeTableView& table, bool inverse,
                const Context& ctx = {});

/// The same with row b at position positions[b] + position_offset: the sequences' lengths serve as positions
/// (the step's token sits at lengths[b] - 1: position_offset = -1), a chunk of consecutive tokens reads one iota
/// array (position_offset = the chunk's first). Refused as above, for the offset positions.
template <class T>
void apply_rope(const HeadsView<T>& x, const std::int32_t* positions, std::int32_t position_offset,
                const RopeTableView& table, bool inverse, const Context& ctx = {});

/// The same on the rows of a matrix [rows, head_dim] (keys; one position per row).
template <class T>
void apply_rope(const MatrixView<T>& rows, const std::int32_t* positions, const RopeTableView& table, bool inverse,
                const Context& ctx = {});

/// Rotates every head vector of batch row b, already rotated to its position p_b = positions[b] +
/// position_offset, to position `target`: a rotation by target - p_b (negative: back; the attention factor x
/// carries is left as is).
/// A²ATS's q R_b for the step's queries: positions = the lengths, position_offset = -1, target = b, with no
/// delta array to compute first. Refused: target < 0, a p_b < 0, |target - p_b| >= table.positions.
template <class T>
void rotate_to_position(const HeadsView<T>& x, const std::int32_t* positions, std::int32_t position_offset,
                        std::int32_t target, const RopeTableView& table, const Context& ctx = {});

}  // namespace kvsift::cpu
