#pragma once
/// Inverted lists on the GPU, the twin of cpu/inverted_lists.hpp (read its contracts; the differences are here).
/// Device memory for every pointer and view; stream-ordered; no allocation, no host sync; CUDA-graph capturable;
/// deterministic; reentrant with distinct outputs and workspaces. Results equal the CPU's bit for bit: the union
/// is a set of ids, ascending; scores stored by replace_list are rounded by core/dtype.hpp's conversion on both,
/// NaN bits included.
///
/// Shapes are checked on the host before the launch as on the CPU; the arrays' contents (slots, lengths, chosen
/// list ids and counts, list counts, cursors, ids) live on the device and are not, so each function defines what
/// a bad value does, and none reads or writes out of bounds:
/// - union_lists: a row whose slot is outside [0, lists.slots), whose length is negative or whose chosen count is
///   outside [0, chosen.capacity] gets out count -1 and no entries; a chosen list id outside [0, lists.lists), or
///   a chosen list whose count is outside [0, list_capacity], contributes nothing.
/// - replace_list: a row whose slot is outside [0, lists.slots), whose entries count is outside [0,
///   entries.capacity] or whose cursor or fifo_begin is outside [0, lists.lists) changes nothing and gets
///   replaced = -1; two rows
///   naming one slot race.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/inverted_lists.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

/// Device workspace of union_lists (shapes only): for rows * chosen_capacity * list_capacity entries, their keys
/// twice, segment offsets and CUB's segmented-sort scratch (the sorted path's; sized whichever path runs). The
/// context, for the CPU's call shape, does not change it.
std::size_t list_reduction_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity, std::int32_t list_capacity,
                                           const Context& = {});

/// cpu::union_lists. Rows of up to 10,240 entries (chosen.capacity * list_capacity): one launch, on sm_90 a cluster
/// of 8 CTAs per row merging bitmaps of windows of 262,144 ids, before it a CTA per row (a bitmap, or a sort of its
/// entries in registers). Larger: three launches, the chosen lists' entries into fixed segments of
/// chosen.capacity * list_capacity keys per row (dropped and absent entries get a key above every id), CUB's
/// segmented sort, then one CTA per row keeps the first of each run of equal ids. workspace:
/// list_reduction_workspace_bytes(batch * kv_heads, chosen.capacity, lists.list_capacity).
/// With `append.first` (UnionAppend), then cuda::append_range's contract (a row whose entries below the range and
/// the range pass its capacity gets count -1): on sm_90 in the cluster's launch (each rank writes the union's ids
/// below the range and a share of the range), else an append_range launch after the union.
template <class T>
void union_lists(const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* d_slots,
                 const std::int32_t* d_lengths, const AttentionWindow& window, const UnionAppend& append,
                 const SelectionView& out, std::span<std::byte> workspace, const Context& ctx);
template <class T>
void union_lists(const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* d_slots,
                 const std::int32_t* d_lengths, const AttentionWindow& window, const SelectionView& out,
                 std::span<std::byte> workspace, const Context& ctx) {
  union_lists(lists, chosen, d_slots, d_lengths, window, UnionAppend{}, out, workspace, ctx);
}

/// Device workspace of recall_lists: topk_rows' then list_reduction's (the composition's; the one launch uses none).
std::size_t recall_lists_workspace_bytes(std::int64_t rows, std::int32_t columns, std::int32_t chosen_capacity,
                                         std::int32_t list_capacity, const Context& = {});

/// cpu::recall_lists. On sm_90, for score rows of at most 2048 columns, at most 16 chosen lists and a union of one
/// launch (chosen.capacity * list_capacity <= 10,240): one launch, the union's cluster (each of a row's 8 CTAs
/// finds the row's picks itself: a pass over the row in registers and a CTA barrier per pick). Else topk_rows'
/// launch, then union_lists'. Device-value rules: topk_rows' for columns (a row outside [0, scores.cols] gets chosen
/// count -1), then union_lists'.
template <class T>
void recall_lists(const MatrixView<const float>& scores, const std::int32_t* d_columns,
                  const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* d_slots,
                  const std::int32_t* d_lengths, const AttentionWindow& window, const UnionAppend& append,
                  const SelectionView& out, std::span<std::byte> workspace, const Context& ctx);

/// cpu::replace_list. One launch, one CTA per row; replaced may be nullptr.
template <class T>
void replace_list(const InvertedListsView<T>& lists, const std::int32_t* d_slots, const SelectionView& entries,
                  const MatrixView<const float>& scores, std::int32_t* d_replaced, const Context& ctx);

}  // namespace kvsift::cuda
