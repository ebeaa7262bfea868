#pragma once
/// Reductions of score rows on the CPU: max_score_rows, the element-wise maximum of consecutive groups of score
/// rows (SpeContext's batch-level mode: one score row per sequence, the maximum over its kv heads' rows, each
/// already the maximum over that kv head's query heads). The twin of selectors/specontext/cuda/score_rows.hpp, equal bit for bit (a
/// maximum rounds nothing). Host memory; no allocation.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvsift/attention/state.hpp"
#include "kvsift/selectors/specontext/detail/score_rows_checks.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// out.row(r)[t] = max over j < group of scores.row(r * group + j)[t], for t < min(lengths[r], out.cols), NaN where
/// any of them is NaN (attention/state.hpp max_nan: NaN never vanishes; fmax would let a number win); columns at or
/// past that are not written (the scores there are not read: top-K reads a row's first lengths[r] columns). A
/// negative length writes nothing.
/// Refused: group <= 0, scores.rows != out.rows * group, different or non-positive columns, null pointers. Runs on
/// the calling thread (a pass over rows that a step has already reduced); the context is the backends' call shape.
inline void max_score_rows(const MatrixView<const float>& scores, std::int32_t group, const std::int32_t* lengths,
                           const MatrixView<float>& out, const Context& = {}) {
  kvsift::detail::check_max_score_rows("cpu::max_score_rows", scores, group, lengths, out);
  for (std::int64_t r = 0; r < out.rows; ++r) {
    const std::int32_t n = std::clamp(lengths[r], 0, out.cols);
    float* dst = out.row(r);
    const float* first = scores.row(r * group);
    std::copy_n(first, n, dst);
    for (std::int32_t j = 1; j < group; ++j) {
      const float* src = scores.row(r * group + j);
      for (std::int32_t t = 0; t < n; ++t) dst[t] = max_nan(dst[t], src[t]);
    }
  }
}

}  // namespace kvsift::cpu
