#pragma once
/// Per-ISA kernels of the CPU primitives (cpu/primitives.hpp): defined in primitives-inl.hpp, instantiated
/// only in src/cpu/primitives_<level>.cpp, dispatched once per call from src/cpu/primitives.cpp.

#include <cstdint>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu::detail {

/// scores[i] = scale * dot(q, rows.row(i)) for i in [begin, end).
template <SimdLevel L, class T>
void gemv_rows(const float* q, const MatrixView<const T>& rows, float scale, float* scores, std::int64_t begin,
               std::int64_t end);

/// Vectors packed for blocked scoring (as a GEMM packs its B operand): column c holds one vector, and tiles
/// of kPanelPadding columns are stored one after another, each channel-major, so element j of column c is
/// at tiles[((c / kPanelPadding) * dim + j) * kPanelPadding + c % kPanelPadding]; a block of columns then
/// reads contiguous memory. Columns past `count` (up to `padded`) are zero. Every score of column c starts
/// from offsets[c] (e.g. -|c|^2 / 2 for L2 nearest-centroid ranking).
struct ScorePanel {
  static constexpr std::int64_t kPanelPadding = 32;  ///< a multiple of every level's block of columns
  const float* tiles = nullptr;
  const float* offsets = nullptr;
  std::int32_t dim = 0;
  std::int64_t count = 0;
  std::int64_t padded = 0;
};

/// scores[r * score_stride + c] = offsets[c] + rows.row(r) . column c, for every row and the columns
/// [column_begin, column_end) (column_begin a multiple of kPanelPadding).
template <SimdLevel L>
void score_rows(const MatrixView<const float>& rows, const ScorePanel& panel, float* scores, std::int64_t score_stride,
                std::int64_t column_begin, std::int64_t column_end);

/// assignment[i] = the column with the largest score for point i (ties: smaller column), i in [begin, end).
template <SimdLevel L>
void assign_rows(const MatrixView<const float>& points, const ScorePanel& panel, std::int32_t* assignment,
                 std::int64_t begin, std::int64_t end);

}  // namespace kvsift::cpu::detail
