#pragma once
/// The argument checks of topk_rows that the CPU and CUDA twins share (cpu/topk.hpp, cuda/topk.hpp): the same
/// refusals with the same words on both backends. Values in the backend's memory (lengths, row_k) are checked
/// by each backend where it can read them.

#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/validate.hpp"

namespace kvsift::detail {

inline void check_topk_rows_shape(const char* where, std::int64_t score_rows, std::int32_t max_tokens, std::int32_t k,
                                  const TopKRowsOptions& options) {
  KVSIFT_CHECK(score_rows > 0 && max_tokens > 0, where, "score_rows (= {}) and max_tokens (= {}) must be positive",
               score_rows, max_tokens);
  KVSIFT_CHECK(k > 0, where, "k (= {}) must be positive", k);
  KVSIFT_CHECK(options.heads_per_row >= 1, where, "options.heads_per_row (= {}) must be >= 1", options.heads_per_row);
  KVSIFT_CHECK(!options.nan_marks_row || options.heads_per_row == 1, where,
               "options.nan_marks_row needs options.heads_per_row == 1 (it is {})", options.heads_per_row);
  validate(options.window, where, "options.window");
  if (options.ids != nullptr) {
    KVSIFT_CHECK(options.heads_per_row == 1, where, "options.ids needs options.heads_per_row == 1 (it is {})",
                 options.heads_per_row);
    KVSIFT_CHECK(options.ids_stride >= max_tokens, where,
                 "options.ids_stride (= {}) < max_tokens (= {}): a row's ids must cover every position", options.ids_stride,
                 max_tokens);
  }
}

/// The lengths pointer (named `lengths_name`) and the output rows of `score_rows` scores rows (checked shape).
inline void check_topk_rows_output(const char* where, std::int64_t score_rows, const std::int32_t* lengths,
                                   const char* lengths_name, std::int32_t k, const TopKRowsOptions& options,
                                   const SelectionView& out) {
  KVSIFT_CHECK(lengths != nullptr, where, "{} is a null pointer", lengths_name);
  KVSIFT_CHECK(out.indices != nullptr && out.counts != nullptr, where, "out.indices and out.counts must be non-null");
  const std::int32_t heads = options.heads_per_row;
  KVSIFT_CHECK(out.batch > 0 && out.kv_heads > 0 && score_rows == std::int64_t(out.batch) * out.kv_heads * heads, where,
               "scores.rows (= {}) != out.batch * out.kv_heads * options.heads_per_row (= {} * {} * {})", score_rows,
               out.batch, out.kv_heads, heads);
  KVSIFT_CHECK(std::int64_t(out.capacity) >= std::int64_t(heads) * k, where,
               "out.capacity (= {}) < options.heads_per_row * k (= {} * {})", out.capacity, heads, k);
  if (options.ids != nullptr) {  // the picks are written while the table is read (on CUDA by other threads)
    const std::int64_t rows = std::int64_t(out.batch) * out.kv_heads;
    const auto ids_begin = reinterpret_cast<std::uintptr_t>(options.ids);
    const auto ids_end = reinterpret_cast<std::uintptr_t>(options.ids + rows * options.ids_stride);
    const auto out_begin = reinterpret_cast<std::uintptr_t>(out.indices);
    const auto out_end = reinterpret_cast<std::uintptr_t>(out.indices + rows * out.capacity);
    KVSIFT_CHECK(ids_end <= out_begin || out_end <= ids_begin, where,
                 "options.ids [{} rows of {}] overlaps out.indices [{} rows of {}]: the table must not be the output",
                 rows, options.ids_stride, rows, out.capacity);
  }
}

/// A topk_rows call: the scores, the shape, the lengths pointer (named `lengths_name`) and the output rows.
inline void check_topk_rows_call(const char* where, const MatrixView<const float>& scores, const std::int32_t* lengths,
                                 const char* lengths_name, std::int32_t k, const TopKRowsOptions& options,
                                 const SelectionView& out) {
  validate(scores, where, "scores");
  check_topk_rows_shape(where, scores.rows, scores.cols, k, options);
  check_topk_rows_output(where, scores.rows, lengths, lengths_name, k, options, out);
}

/// The values a host backend reads before it ranks: every lengths[b] in [0, max_tokens] (named `bound`) and every
/// options.row_k[s] in [0, k].
inline void check_topk_rows_host_values(const char* where, const std::int32_t* lengths, const SelectionView& out,
                                        std::int32_t max_tokens, const char* bound, std::int32_t k,
                                        const TopKRowsOptions& options) {
  for (std::int32_t b = 0; b < out.batch; ++b) {
    KVSIFT_CHECK(lengths[b] >= 0 && lengths[b] <= max_tokens, where, "lengths[{}] (= {}) is outside [0, {} = {}]", b,
                 lengths[b], bound, max_tokens);
  }
  if (options.row_k == nullptr) return;
  for (std::int64_t s = 0; s < std::int64_t(out.batch) * out.kv_heads; ++s) {
    KVSIFT_CHECK(options.row_k[s] >= 0 && options.row_k[s] <= k, where, "options.row_k[{}] (= {}) is outside [0, k = {}]",
                 s, options.row_k[s], k);
  }
}

/// A length_budgets call: its budget and its shape (the lengths live in the backend's memory).
inline void check_length_budgets(const char* where, const std::int32_t* lengths, std::int32_t batch, std::int32_t heads,
                                 const LengthBudget& budget, const std::int32_t* row_k) {
  KVSIFT_CHECK(lengths != nullptr && row_k != nullptr, where, "lengths and row_k must be non-null");
  KVSIFT_CHECK(batch > 0 && heads > 0, where, "batch (= {}) and heads (= {}) must be positive", batch, heads);
  KVSIFT_CHECK(budget.fraction > 0 && budget.fraction <= 1, where, "budget.fraction (= {}) is outside (0, 1]",
               budget.fraction);
  KVSIFT_CHECK(budget.minimum >= 0 && budget.minimum <= budget.maximum, where,
               "budget.minimum (= {}) is outside [0, budget.maximum = {}]", budget.minimum, budget.maximum);
  KVSIFT_CHECK(budget.reserved >= 0, where, "budget.reserved (= {}) must be >= 0", budget.reserved);
}

/// A mass_budgets call: the scores, the pointers and the budget (counts and limits live in the backend's memory).
inline void check_mass_budgets(const char* where, const MatrixView<const float>& scores, const std::int32_t* counts,
                               const MassBudget& budget, const std::int32_t* row_k) {
  validate(scores, where, "scores");
  KVSIFT_CHECK(scores.rows > 0 && scores.cols > 0, where, "scores [{}, {}] must have rows and columns", scores.rows,
               scores.cols);
  KVSIFT_CHECK(scores.cols <= kMassMaxCandidates, where,
               "scores.cols (= {}) exceeds {} candidates per row (the fixed-point sums must stay below 2^63)",
               scores.cols, kMassMaxCandidates);
  KVSIFT_CHECK(counts != nullptr && row_k != nullptr, where, "counts and row_k must be non-null");
  KVSIFT_CHECK(budget.mass > 0 && budget.mass <= 1, where, "budget.mass (= {}) is outside (0, 1]", budget.mass);
  KVSIFT_CHECK(budget.floor >= 1, where, "budget.floor (= {}) must be >= 1", budget.floor);
  KVSIFT_CHECK(budget.maximum >= budget.floor, where, "budget.maximum (= {}) is below budget.floor (= {})",
               budget.maximum, budget.floor);
}

}  // namespace kvsift::detail
