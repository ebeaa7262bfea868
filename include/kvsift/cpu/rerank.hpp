#pragma once
/// Reranking candidates on the CPU: the decode query's GQA group scores over a selection of candidate tokens
/// (CTKVR's rerank of its recalled keys), the map from a top-K over those scores back to token ids, and a token
/// range added to candidate rows. Host
/// memory; no allocation; deterministic and independent of the thread count.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cpu {

/// Bytes of host workspace candidate_scores needs for `rows` candidate rows (batch * kv_heads) of up to
/// `capacity` candidates, groups of `group` query heads: group_scores' softmax buffers over `capacity` tokens,
/// each head's logits (4 * rows * group * capacity bytes) and its partial maxima and sums per chunk of 2048.
std::size_t candidate_scores_workspace_bytes(std::int64_t rows, std::int32_t group, std::int32_t capacity);

/// group_scores (cpu/primitives.hpp) over a row's candidates instead of every token: for row (b, g) and
/// candidate i < candidates.count(b, g), token t = candidates.row(b, g)[i],
///   s_h,i = sm_scale * q_h . k_t (fp32, ascending dimensions) for the group's query heads h,
///   scores.row(b * kv_heads + g)[i] = reduce over h of s_h,i, or with options.softmax of exp(s_h,i - LSE_h),
///   LSE_h over the row's candidates (softmax over the recalled set, CTKVR's rerank).
/// Entries past the count are not written. kv contiguous or paged (its batch, kv_heads = candidates' shape);
/// scores [batch * kv_heads, >= candidates.capacity] fp32. Refused: a count outside [0, capacity], a candidate
/// outside [0, seq_len(b)). workspace: candidate_scores_workspace_bytes(rows, q_heads / kv_heads, capacity).
/// group_scores' kernels (SIMD, a key row read once per tile of 8 heads, bf16 dot products on AVX-512 BF16),
/// the work split in chunks of 2048 candidates of a row on `pool`: the sums are taken per chunk, so the result is
/// the same for every thread count. Implemented in src/cpu/primitives.cpp with group_scores.
template <class T, class KV>
void candidate_scores(const QueryView<const T>& q, const KV& kv, const SelectionView& candidates,
                      const GroupScoreOptions& options, const MatrixView<float>& scores, std::span<std::byte> workspace,
                      ThreadPool* pool = nullptr);

/// out.row(b, h)[i] = ids.row(b, h)[positions.row(b, h)[i]] for i < positions.count(b, h), and out's counts
/// those of positions: a top-K over candidate positions (topk_rows on candidate_scores' matrix) back to the
/// candidates' token ids, in the positions' order (ascending positions over ascending ids stay ascending).
/// Log-weights, if out has them, 0. out may be positions itself (in place). Refused: shapes that differ, a count
/// outside [0, capacity], a position outside [0, ids.count(b, h)).
void remap_selection(const SelectionView& positions, const SelectionView& ids, const SelectionView& out);

/// Every row (b, h) of `rows` (ascending ids) gets the middle tokens from first[slots[b]] on appended, [begin,
/// end) with begin = max(first[slots[b]], window.sink_end(len)), end = window.recent_begin(len), len = lengths[b],
/// after dropping its entries >= begin (so the row stays ascending and distinct): the tokens no index holds, those
/// that left the attention window after the slot's index was built (CTKVR's rerank candidates). An empty range
/// only drops. Log-weights, if rows has them, 0 for the appended entries. slots, lengths [batch]; first [slots].
/// counts_before, if non-null, [batch * kv_heads] receives each row's count as it came in (CTKVR's union sizes,
/// kept without a copy of its own). Refused: a count outside [0, capacity], a negative length, a row that would
/// pass its capacity.
void append_range(const SelectionView& rows, const std::int32_t* slots, const std::int32_t* first,
                  const std::int32_t* lengths, const AttentionWindow& window, std::int32_t* counts_before);

}  // namespace kvsift::cpu
