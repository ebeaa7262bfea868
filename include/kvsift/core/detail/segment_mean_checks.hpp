#pragma once
/// The argument checks that cpu/segment_mean.hpp and cuda/segment_mean.hpp share.

#include <climits>
#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::detail {

inline void check_segment_mean_shape(const char* where, std::int64_t rows, std::int32_t segments) {
  KVSIFT_CHECK(rows >= 1 && rows <= INT32_MAX, where, "rows (= {}) is outside [1, 2^31 - 1]", rows);
  KVSIFT_CHECK(segments >= 1, where, "segments (= {}) must be positive", segments);
}

template <class T>
void check_segment_mean(const char* where, const MatrixView<const T>& rows, const std::int32_t* assignment,
                        std::int32_t segments, const MatrixView<float>& means, const std::int32_t* counts) {
  validate(rows, where, "rows");
  check_segment_mean_shape(where, rows.rows, segments);
  validate(means, where, "means");
  KVSIFT_CHECK(means.rows == segments && means.cols == rows.cols, where,
               "means is [{}, {}]; expected [segments = {}, rows.cols = {}]", means.rows, means.cols, segments, rows.cols);
  KVSIFT_CHECK(assignment != nullptr && counts != nullptr, where, "assignment and counts must be non-null");
}

}  // namespace kvsift::detail
