#pragma once
/// Inverted lists on the CPU (core/inverted_lists.hpp): the union of the lists a query chose (CTKVR's recall) and
/// the FIFO replacement of one list (CTKVR's update). The twin of cuda/inverted_lists.hpp, with the same
/// arguments but the pool and the same results, bit for bit.
/// Host memory. No allocation; deterministic and independent of the thread count; reentrant with distinct
/// outputs and workspaces. Every argument is checked, array contents included (slots, lengths, list ids, counts).
/// T: float or half (the lists' score type; lists without scores may use either).

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/inverted_lists.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// Bytes of host workspace of union_lists for `rows` selection rows (batch * kv_heads) choosing up to
/// `chosen_capacity` lists of `list_capacity` entries: 4 * chosen_capacity * list_capacity bytes (the kept ids,
/// sorted in place) for each of min(rows, threads) threads. A run on a larger pool than the query's is refused.
std::size_t list_reduction_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity, std::int32_t list_capacity,
                                           const Context& ctx = {});

/// The union of the chosen lists (CTKVR's recall): for selection row (b, h), the lists chosen.row(b, h)[0,
/// count) of slot slots[b], kv head h; out.row(b, h) receives every distinct id of their entries that lies in
/// the middle of the sequence, [window.sink_end(len), window.recent_begin(len)) with len = lengths[b] (ids of
/// the window, at or past the length, or negative are dropped), ascending, and out.counts its number. The union
/// is written whole (a rerank follows): out.capacity >= chosen.capacity * lists.list_capacity bounds any row.
/// A list chosen twice counts once. Log-weights, if out has them, 0 for the written entries; entries past the
/// count are not written. Scores are not read.
/// Shapes: chosen and out [batch, lists.kv_heads]; slots and lengths [batch]. Refused: a slot outside [0,
/// lists.slots), a negative length, a chosen count outside [0, chosen.capacity], a list id outside [0,
/// lists.lists), a chosen list's count outside [0, list_capacity], more than 2^31 - 1 entries in all.
/// workspace: list_reduction_workspace_bytes(batch * kv_heads, chosen.capacity, lists.list_capacity, pool).
/// With `append.first` set, then append_range(out, slots, append.first, lengths, window, append.counts_before)
/// (core/inverted_lists.hpp UnionAppend; its refusals are append_range's).
template <class T>
void union_lists(const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* slots,
                 const std::int32_t* lengths, const AttentionWindow& window, const UnionAppend& append,
                 const SelectionView& out, std::span<std::byte> workspace, const Context& ctx = {});
template <class T>
void union_lists(const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* slots,
                 const std::int32_t* lengths, const AttentionWindow& window, const SelectionView& out,
                 std::span<std::byte> workspace, const Context& ctx = {}) {
  union_lists(lists, chosen, slots, lengths, window, UnionAppend{}, out, workspace, ctx);
}

/// Bytes of host workspace of recall_lists: topk_rows' for `rows` score rows of `columns` and k = chosen_capacity,
/// then union_lists' (each 256-byte aligned).
std::size_t recall_lists_workspace_bytes(std::int64_t rows, std::int32_t columns, std::int32_t chosen_capacity,
                                         std::int32_t list_capacity, const Context& ctx = {});

/// CTKVR's recall: topk_rows(scores, columns, chosen.capacity, TopKRowsOptions{}, chosen) then union_lists(lists,
/// chosen, slots, lengths, window, append, out): each row's chosen.capacity best lists by its score row [batch *
/// kv_heads, lists], written to chosen (indices and counts, as topk_rows writes them), and the union of their
/// entries. `columns` [batch]: each batch row's scored lists (topk_rows' lengths). Refused first, writing nothing:
/// scores.rows other than batch * kv_heads, scores.cols > lists.lists; then topk_rows' refusals (nothing written)
/// and union_lists' (which read chosen's contents, so chosen is written by then; out is not). One call because CUDA
/// makes it one launch (cuda/inverted_lists.hpp); the results are the same.
/// workspace: recall_lists_workspace_bytes(batch * kv_heads, scores.cols, chosen.capacity, lists.list_capacity, ctx).
template <class T>
void recall_lists(const MatrixView<const float>& scores, const std::int32_t* columns,
                  const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* slots,
                  const std::int32_t* lengths, const AttentionWindow& window, const UnionAppend& append,
                  const SelectionView& out, std::span<std::byte> workspace, const Context& ctx = {});

/// CTKVR's FIFO update: for selection row (b, h) the list l = lists.cursors[slots[b] * kv_heads + h] of slot
/// slots[b], kv head h, is overwritten by entries.row(b, h)[0, count) (and, when the lists keep scores, their
/// scores.row(b * kv_heads + h), rounded to T), its count set, and the cursor advanced to l + 1, or from the last
/// list back to lists.fifo_begin[slot] (0 without fifo_begin);
/// replaced[b * kv_heads + h] = l when replaced is given (the caller replaces the matching centroid). Entries are
/// copied as they are (no filter, no order). Refused: a slot outside [0, lists.slots) or repeated, an entries count
/// outside [0, entries.capacity], a cursor or fifo_begin outside [0, lists.lists), entries.capacity > list_capacity, scores
/// given exactly when the lists have none.
template <class T>
void replace_list(const InvertedListsView<T>& lists, const std::int32_t* slots, const SelectionView& entries,
                  const MatrixView<const float>& scores, std::int32_t* replaced, const Context& ctx = {});

}  // namespace kvsift::cpu
