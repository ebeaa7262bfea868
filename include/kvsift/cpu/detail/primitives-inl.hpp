#pragma once
/// Bodies of the per-ISA primitive kernels (see primitives_kernels.hpp), written once over Vec<L>.

#include <algorithm>
#include <limits>

#include "kvsift/cpu/detail/decode-inl.hpp"
#include "kvsift/cpu/detail/primitives_kernels.hpp"

namespace kvsift::cpu::detail {

template <SimdLevel L, class T>
void gemv_rows(const float* q, const MatrixView<const T>& rows, float scale, float* scores, std::int64_t begin,
               std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) scores[i] = scale * dot<L>(q, rows.row(i), rows.cols);
}

namespace KVSIFT_CPU_ISA {  // this level's own symbols (instantiate-inl.hpp)

/// Rows and columns of one register block: kBlockRows rows times two vectors of columns, held in
/// 2 * kBlockRows accumulators; per channel, kBlockRows broadcasts and two column loads feed 2 * kBlockRows
/// FMAs, and no horizontal reduction is needed (the columns are the vector lanes).
inline constexpr int kBlockRows = 4;
template <SimdLevel L>
inline constexpr int kBlockColumns = 2 * Vec<L>::kWidth;

/// out[r][c] = offsets[c0 + c] + x[r] . column (c0 + c), for the kBlockRows rows x and kBlockColumns columns.
template <SimdLevel L>
inline void score_block(const float* const (&x)[kBlockRows], const ScorePanel& panel, std::int64_t c0,
                        float (&out)[kBlockRows][kBlockColumns<L>]) {
  using V = Vec<L>;
  static_assert(ScorePanel::kPanelPadding % kBlockColumns<L> == 0);
  typename V::V acc[kBlockRows][2];
  const typename V::V offset0 = V::load(panel.offsets + c0), offset1 = V::load(panel.offsets + c0 + V::kWidth);
  for (int r = 0; r < kBlockRows; ++r) acc[r][0] = offset0, acc[r][1] = offset1;
  constexpr std::int64_t kTile = ScorePanel::kPanelPadding;
  const float* column = panel.tiles + (c0 / kTile) * panel.dim * kTile + c0 % kTile;
  for (std::int32_t j = 0; j < panel.dim; ++j, column += kTile) {
    const typename V::V c_lo = V::load(column), c_hi = V::load(column + V::kWidth);
    for (int r = 0; r < kBlockRows; ++r) {
      const typename V::V xr = V::set1(x[r][j]);
      acc[r][0] = V::fma(xr, c_lo, acc[r][0]);
      acc[r][1] = V::fma(xr, c_hi, acc[r][1]);
    }
  }
  for (int r = 0; r < kBlockRows; ++r) {
    V::store(&out[r][0], acc[r][0]);
    V::store(&out[r][V::kWidth], acc[r][1]);
  }
}

/// Row pointers of the block starting at `first`; rows past `end` repeat the last row (results unused).
inline void block_rows(const MatrixView<const float>& rows, std::int64_t first, std::int64_t end,
                       const float* (&x)[kBlockRows]) {
  for (int r = 0; r < kBlockRows; ++r) x[r] = rows.row(std::min(first + r, end - 1));
}

}  // namespace KVSIFT_CPU_ISA
using namespace KVSIFT_CPU_ISA;

template <SimdLevel L>
void score_rows(const MatrixView<const float>& rows, const ScorePanel& panel, float* scores, std::int64_t score_stride,
                std::int64_t column_begin, std::int64_t column_end) {
  float out[kBlockRows][kBlockColumns<L>];
  const float* x[kBlockRows];
  for (std::int64_t first = 0; first < rows.rows; first += kBlockRows) {
    block_rows(rows, first, rows.rows, x);
    for (std::int64_t c0 = column_begin; c0 < column_end; c0 += kBlockColumns<L>) {
      score_block<L>(x, panel, c0, out);
      const std::int64_t columns = std::min<std::int64_t>(kBlockColumns<L>, column_end - c0);
      for (std::int64_t r = first; r < std::min(first + kBlockRows, rows.rows); ++r) {
        std::copy_n(out[r - first], columns, scores + r * score_stride + c0);
      }
    }
  }
}

template <SimdLevel L>
void assign_rows(const MatrixView<const float>& points, const ScorePanel& panel, std::int32_t* assignment,
                 std::int64_t begin, std::int64_t end) {
  float out[kBlockRows][kBlockColumns<L>];
  const float* x[kBlockRows];
  for (std::int64_t first = begin; first < end; first += kBlockRows) {
    block_rows(points, first, end, x);
    float best[kBlockRows];
    std::int32_t best_id[kBlockRows] = {};
    std::fill_n(best, kBlockRows, -std::numeric_limits<float>::infinity());
    for (std::int64_t c0 = 0; c0 < panel.count; c0 += kBlockColumns<L>) {
      score_block<L>(x, panel, c0, out);
      const int columns = int(std::min<std::int64_t>(kBlockColumns<L>, panel.count - c0));
      for (int r = 0; r < kBlockRows; ++r) {
        for (int c = 0; c < columns; ++c) {
          if (out[r][c] > best[r]) {  // strict: on a tie the smaller id stays
            best[r] = out[r][c];
            best_id[r] = std::int32_t(c0 + c);
          }
        }
      }
    }
    for (std::int64_t i = first; i < std::min(first + kBlockRows, end); ++i) assignment[i] = best_id[i - first];
  }
}

}  // namespace kvsift::cpu::detail
