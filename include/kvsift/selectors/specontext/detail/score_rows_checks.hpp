#pragma once
/// The host checks of max_score_rows (selectors/specontext/cpu/score_rows.hpp, selectors/specontext/cuda/score_rows.hpp), one function for both backends.

#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::detail {

inline void check_max_score_rows(const char* where, const MatrixView<const float>& scores, std::int32_t group,
                                 const std::int32_t* lengths, const MatrixView<float>& out) {
  KVSIFT_CHECK(group > 0, where, "group (= {}) must be positive", group);
  KVSIFT_CHECK(out.rows > 0 && scores.rows == out.rows * group, where,
               "scores.rows (= {}) must be out.rows (= {}) * group (= {}), out.rows positive", scores.rows, out.rows,
               group);
  KVSIFT_CHECK(scores.cols == out.cols && out.cols > 0, where, "scores.cols (= {}) != out.cols (= {}), or not positive",
               scores.cols, out.cols);
  KVSIFT_CHECK(scores.data != nullptr && out.data != nullptr && lengths != nullptr, where,
               "scores.data, out.data and lengths must be non-null");
  KVSIFT_CHECK(scores.row_stride >= scores.cols && out.row_stride >= out.cols, where,
               "row strides (scores {}, out {}) must be at least the columns (= {})", scores.row_stride,
               out.row_stride, out.cols);
}

}  // namespace kvsift::detail
