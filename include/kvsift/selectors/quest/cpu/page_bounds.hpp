#pragma once
/// Page bounds on the CPU (Quest's index; selectors/quest/page_bounds_view.hpp): build from the cache, fold in the step's
/// token, score pages for the decode query, expand chosen pages into token selections. The twin of
/// selectors/quest/cuda/page_bounds.hpp, with the same arguments but the context, and the same results (page_scores: within fp32
/// summation order). Host memory. No allocation; deterministic and independent of the thread count; reentrant
/// with distinct outputs. Every argument is checked, array contents included (slots, lengths, page ids).

#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/selectors/quest/page_bounds_view.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// For each batch row b < kv.batch (its bounds in slot slots[b]), kv head h and page p < ceil(kv.seq_len(b) /
/// page_size): the channel-wise minimum and maximum of the keys of tokens [p * page_size, min(len, (p + 1) *
/// page_size)). Pages past the sequence are not written. A NaN key makes its page's lo and hi NaN in that channel.
/// kv: ContiguousKVView<const T> or PagedKVView<const T> (any cache page size; it need not be bounds.page_size),
/// kv_heads and head_dim equal to the bounds'. Refused: a slot outside [0, bounds.slots) or repeated, a sequence
/// longer than bounds.max_pages * page_size. Threads: (row, page) items on ctx.pool (nullptr: the calling thread).
template <class T, KVCacheView KV>
void build_page_bounds(const KV& kv, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                       const Context& ctx = {});

/// The step's token: the cache already holds it at t = kv.seq_len(b) - 1; it is folded into page t / page_size
/// of slot slots[b] (a token starting a page, t % page_size == 0, sets lo = hi = k). An empty sequence changes
/// nothing. Same shapes and refusals as build_page_bounds. Threads: rows (b, h) on ctx.pool.
template <class T, KVCacheView KV>
void append_page_bounds(const KV& kv, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                        const Context& ctx = {});

/// Page scores of the decode query: for batch row b (bounds of slot slots[b], len = lengths[b] tokens, P =
/// ceil(len / page_size) pages), kv head g and page p < P,
///   scores.row(b * kv_heads + g)[p] = max over the group's query heads h in [g * group, (g + 1) * group),
///                                     group = q.heads / kv_heads, of sum_c max(q_hc * lo_c, q_hc * hi_c),
/// fp32 products and sums in channel order (the CUDA twin sums in another order). A page whose every token lies
/// in the attention window ([0, window.sink_end(len)) or [window.recent_begin(len), len)) gets -inf: it has
/// nothing to select (a page partly in the window keeps its score). page_counts[b] = P; entries past P are not
/// written. NaN in q or in a page's bounds gives that page NaN (unless the window gives it -inf).
/// Bounds are as build writes them (lo <= hi per channel). Shapes: q [batch, q_heads, head_dim], q_heads a
/// multiple of bounds.kv_heads; scores [batch * kv_heads, >= P]; slots, lengths, page_counts [batch]. Refused: a
/// slot outside [0, bounds.slots), a length outside [0, bounds.max_pages * page_size] or with more pages than
/// scores.cols. Threads: rows on ctx.pool; each bound is read once per query head tile of the group.
template <class T>
void page_scores(const QueryView<const T>& q, const PageBoundsView<const T>& bounds, const std::int32_t* slots,
                 const std::int32_t* lengths, const AttentionWindow& window, const MatrixView<float>& scores,
                 std::int32_t* page_counts, const Context& ctx = {});

/// Chosen pages to tokens: for each selection row (b, g) of `pages` (ascending page ids, top-K's output), out's
/// row gets the tokens of those pages, ascending, less the window's tokens and tokens >= lengths[b], and its
/// count; log-weights, if out has them, 0 for the written entries. Entries past the count are not written.
/// Refused: out.capacity < pages.capacity * page_size, another batch or kv_heads, a count outside [0,
/// pages.capacity], a page id outside [0, ceil(lengths[b] / page_size)) or not above the previous one.
void expand_pages(const SelectionView& pages, std::int32_t page_size, const std::int32_t* lengths,
                  const AttentionWindow& window, const SelectionView& out, const Context& ctx = {});

}  // namespace kvsift::cpu
