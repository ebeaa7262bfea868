#pragma once
/// The argument checks (shapes, not array contents) that cpu/rerank.hpp and cuda/rerank.hpp share.

#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::detail {

/// q [batch, q_heads, head_dim] against kv (contents in `contents` memory), candidates [batch, kv_heads, >= 1],
/// scores [batch * kv_heads, >= candidates.capacity].
template <class T, class KV>
void check_candidate_scores(const char* where, const QueryView<const T>& q, const KV& kv, const SelectionView& candidates,
                            const GroupScoreOptions& options, const MatrixView<float>& scores, MemorySpace contents) {
  validate(q, where, "q");
  validate(kv, where, "kv", contents);
  validate(scores, where, "scores");
  KVSIFT_CHECK(candidates.indices != nullptr && candidates.counts != nullptr, where,
               "candidates.indices and candidates.counts must be non-null");
  KVSIFT_CHECK(q.batch == kv.batch && q.head_dim == kv.head_dim && kv.kv_heads >= 1 && q.heads % kv.kv_heads == 0,
               where, "q [{}, {}, {}] does not match kv (batch {}, kv_heads {}, head_dim {})", q.batch, q.heads,
               q.head_dim, kv.batch, kv.kv_heads, kv.head_dim);
  KVSIFT_CHECK(candidates.batch == q.batch && candidates.kv_heads == kv.kv_heads && candidates.capacity >= 1, where,
               "candidates is [{}, {}, {}]; expected [batch = {}, kv_heads = {}, >= 1]", candidates.batch,
               candidates.kv_heads, candidates.capacity, q.batch, kv.kv_heads);
  const std::int64_t rows = std::int64_t(q.batch) * kv.kv_heads;
  KVSIFT_CHECK(scores.rows == rows && scores.cols >= candidates.capacity, where,
               "scores is [{}, {}]; expected [batch * kv_heads = {}, >= candidates.capacity = {}]", scores.rows,
               scores.cols, rows, candidates.capacity);
  KVSIFT_CHECK(options.reduce == GroupReduce::max || options.reduce == GroupReduce::sum, where,
               "options.reduce is not a GroupReduce");
}

inline void check_candidate_scores_shape(const char* where, std::int64_t rows, std::int32_t group, std::int32_t capacity) {
  KVSIFT_CHECK(rows >= 1 && group >= 1 && capacity >= 1, where,
               "rows (= {}), group (= {}) and capacity (= {}) must be positive", rows, group, capacity);
}

/// positions, ids and out with one row each per (batch, kv head), out at least as wide as positions.
inline void check_remap_selection(const char* where, const SelectionView& positions, const SelectionView& ids,
                                  const SelectionView& out) {
  KVSIFT_CHECK(positions.indices != nullptr && positions.counts != nullptr && ids.indices != nullptr &&
                   ids.counts != nullptr && out.indices != nullptr && out.counts != nullptr,
               where, "positions, ids and out must have indices and counts");
  const std::int64_t rows = std::int64_t(positions.batch) * positions.kv_heads;
  KVSIFT_CHECK(std::int64_t(ids.batch) * ids.kv_heads == rows && std::int64_t(out.batch) * out.kv_heads == rows, where,
               "positions has {} rows, ids {}, out {}: one row each", rows, std::int64_t(ids.batch) * ids.kv_heads,
               std::int64_t(out.batch) * out.kv_heads);
  KVSIFT_CHECK(out.capacity >= positions.capacity, where, "out.capacity (= {}) < positions.capacity (= {})",
               out.capacity, positions.capacity);
}

inline void check_append_range(const char* where, const SelectionView& rows, const std::int32_t* slots,
                               const std::int32_t* first, const std::int32_t* lengths, const AttentionWindow& window) {
  KVSIFT_CHECK(rows.indices != nullptr && rows.counts != nullptr && slots != nullptr && first != nullptr &&
                   lengths != nullptr,
               where, "rows (indices, counts), slots, first and lengths must be non-null");
  validate(window, where, "window");
  KVSIFT_CHECK(rows.batch >= 0 && rows.kv_heads >= 1 && rows.capacity >= 1, where,
               "rows is [{}, {}, {}]: batch >= 0, kv_heads and capacity >= 1", rows.batch, rows.kv_heads, rows.capacity);
}

}  // namespace kvsift::detail
