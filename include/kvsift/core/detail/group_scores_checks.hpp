#pragma once
/// The argument checks of group_scores that cpu/primitives.hpp and cuda/primitives.hpp share (each backend adds
/// its own head_dim and memory rules): the same refusals with the same words on both backends.

#include <cstddef>
#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/core/workspace.hpp"

namespace kvsift::detail {

/// options.heads_per_row is 0, or (with options.softmax) a positive divisor of the group.
inline void check_group_scores_heads_per_row(const char* where, std::int32_t group, const GroupScoreOptions& options) {
  if (options.heads_per_row == 0) return;
  KVSIFT_CHECK(options.heads_per_row > 0 && group % options.heads_per_row == 0, where,
               "options.heads_per_row (= {}) must divide the group (q_heads / kv_heads = {})", options.heads_per_row,
               group);
  KVSIFT_CHECK(options.softmax, where, "options.heads_per_row (= {}) needs options.softmax", options.heads_per_row);
}

inline void check_group_scores_reduce(const char* where, const GroupScoreOptions& options) {
  KVSIFT_CHECK(options.reduce == GroupReduce::max || options.reduce == GroupReduce::sum, where,
               "options.reduce (= {}) is neither GroupReduce::max nor GroupReduce::sum", int(options.reduce));
}

/// The arguments of group_scores_workspace_bytes.
inline void check_group_scores_shape(const char* where, std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                     std::int32_t max_tokens, const GroupScoreOptions& options) {
  KVSIFT_CHECK(batch > 0 && q_heads > 0 && kv_heads > 0 && max_tokens > 0, where,
               "batch (= {}), q_heads (= {}), kv_heads (= {}) and max_tokens (= {}) must be positive", batch, q_heads,
               kv_heads, max_tokens);
  KVSIFT_CHECK(q_heads % kv_heads == 0, where, "q_heads (= {}) is not a multiple of kv_heads (= {})", q_heads, kv_heads);
  check_group_scores_reduce(where, options);
  check_group_scores_heads_per_row(where, q_heads / kv_heads, options);
}

/// group_scores_workspace_bytes of either backend: the checked shape's scratch as the backend's
/// layout(counting, rows, group, max_tokens, options) carves it.
template <class Layout>
std::size_t group_scores_bytes(const char* where, std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                               std::int32_t max_tokens, const GroupScoreOptions& options, Layout layout) {
  check_group_scores_shape(where, batch, q_heads, kv_heads, max_tokens, options);
  WorkspaceLayout counting;
  layout(counting, std::int64_t(batch) * kv_heads, q_heads / kv_heads, max_tokens, options);
  return counting.bytes();
}

/// A group_scores call: q, kv and scores are valid views (kv's lengths and page tables are read only where
/// `contents` is host memory), q matches kv, scores has one row per (sequence, kv head) (times the score rows
/// per row of options.heads_per_row), options.reduce is known, and, with host contents, every sequence fits in
/// scores.cols.
template <class T, class KV>
void check_group_scores(const char* where, const QueryView<const T>& q, const KV& kv, const MatrixView<float>& scores,
                        const GroupScoreOptions& options, MemorySpace contents) {
  validate(q, where, "q");
  validate(kv, where, "kv", contents);
  validate(scores, where, "scores");
  check_query_matches_kv(where, q, kv);
  check_group_scores_reduce(where, options);
  const std::int32_t group = q.heads / kv.kv_heads;
  check_group_scores_heads_per_row(where, group, options);
  const std::int32_t per_row = options.score_rows_per_row(group);
  KVSIFT_CHECK(per_row > 1 || scores.rows == std::int64_t(kv.batch) * kv.kv_heads, where,
               "scores.rows (= {}) != kv.batch * kv.kv_heads (= {} * {})", scores.rows, kv.batch, kv.kv_heads);
  KVSIFT_CHECK(scores.rows == std::int64_t(kv.batch) * kv.kv_heads * per_row, where,
               "scores.rows (= {}) != kv.batch * kv.kv_heads * score rows per kv head (= {} * {} * {})", scores.rows,
               kv.batch, kv.kv_heads, per_row);
  for (std::int32_t b = 0; b < kv.batch && contents == MemorySpace::host; ++b) {
    KVSIFT_CHECK(kv.seq_len(b) <= scores.cols, where, "scores.cols (= {}) < kv.seq_len({}) (= {})", scores.cols, b,
                 kv.seq_len(b));
  }
}

}  // namespace kvsift::detail
