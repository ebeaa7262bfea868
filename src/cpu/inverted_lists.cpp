// Inverted lists on the CPU: checks (core/detail/inverted_lists_checks.hpp, shared with CUDA), then plain loops.
// The union sorts a row's kept ids and keeps one of each: a set, so any sort gives the CUDA twin's result.
#include "kvsift/cpu/inverted_lists.hpp"

#include <algorithm>

#include "kvsift/core/detail/inverted_lists_checks.hpp"
#include "kvsift/core/detail/inverted_lists_instances.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/rerank.hpp"
#include "kvsift/cpu/topk.hpp"

namespace kvsift::cpu {
namespace {

/// Threads of the union: each takes a contiguous run of selection rows and its own id scratch.
std::int64_t reduction_workers(std::int64_t rows, const ThreadPool* pool) {
  return std::max<std::int64_t>(1, std::min<std::int64_t>(rows, pool != nullptr ? pool->size() : 1));
}

/// The single layout behind list_reduction_workspace_bytes and the carving of union_lists.
std::int32_t* layout_reduction(WorkspaceLayout& layout, std::int64_t workers, std::int32_t chosen_capacity,
                               std::int32_t list_capacity) {
  constexpr const char* what = "cpu list reduction workspace";
  const std::size_t segment = checked_mul(std::size_t(chosen_capacity), std::size_t(list_capacity), what);
  return layout.allocate<std::int32_t>(checked_mul(std::size_t(workers), segment, what), "entry_ids");
}

/// The single layout behind recall_lists_workspace_bytes and the carving of recall_lists: the top-k's, the union's.
struct RecallScratch {
  std::span<std::byte> topk, reduction;
};
RecallScratch layout_recall(WorkspaceLayout& layout, std::int64_t rows, std::int32_t columns,
                            std::int32_t chosen_capacity, std::int32_t list_capacity, const Context& ctx) {
  RecallScratch s;
  s.topk = layout.span(topk_rows_workspace_bytes(rows, columns, chosen_capacity, {}, ctx.pool), "recall top-k");
  s.reduction = layout.span(list_reduction_workspace_bytes(rows, chosen_capacity, list_capacity, ctx), "recall union");
  return s;
}

}  // namespace

std::size_t recall_lists_workspace_bytes(std::int64_t rows, std::int32_t columns, std::int32_t chosen_capacity,
                                         std::int32_t list_capacity, const Context& ctx) {
  WorkspaceLayout counting;
  layout_recall(counting, rows, columns, chosen_capacity, list_capacity, ctx);
  return counting.bytes();
}

template <class T>
void recall_lists(const MatrixView<const float>& scores, const std::int32_t* columns,
                  const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* slots,
                  const std::int32_t* lengths, const AttentionWindow& window, const UnionAppend& append,
                  const SelectionView& out, std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cpu::recall_lists";
  kvsift::detail::check_recall_scores(where, scores, lists, chosen);
  WorkspaceLayout layout(workspace, where);
  const RecallScratch w = layout_recall(layout, scores.rows, scores.cols, chosen.capacity, lists.list_capacity, ctx);
  topk_rows(scores, columns, chosen.capacity, TopKRowsOptions{}, chosen, w.topk, ctx.pool);
  union_lists(lists, chosen, slots, lengths, window, append, out, w.reduction, ctx);
}

std::size_t list_reduction_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity, std::int32_t list_capacity,
                                           const Context& ctx) {
  constexpr const char* where = "cpu::list_reduction_workspace_bytes";
  KVSIFT_CHECK(rows > 0 && chosen_capacity > 0 && list_capacity > 0, where,
               "rows (= {}), chosen_capacity (= {}) and list_capacity (= {}) must be positive", rows, chosen_capacity,
               list_capacity);
  WorkspaceLayout counting;
  layout_reduction(counting, reduction_workers(rows, ctx.pool), chosen_capacity, list_capacity);
  return counting.bytes();
}

template <class T>
void union_lists(const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* slots,
                 const std::int32_t* lengths, const AttentionWindow& window, const UnionAppend& append,
                 const SelectionView& out, std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cpu::union_lists";
  kvsift::detail::check_list_reduction(where, lists, chosen, slots, lengths, window, out, MemorySpace::host);
  const std::int64_t rows = std::int64_t(chosen.batch) * chosen.kv_heads;
  const std::int64_t workers = reduction_workers(rows, ctx.pool);
  const std::int64_t segment = std::int64_t(chosen.capacity) * lists.list_capacity;
  WorkspaceLayout layout(workspace, where);
  std::int32_t* const scratch = layout_reduction(layout, workers, chosen.capacity, lists.list_capacity);
  parallel_for_shares(ctx.pool, rows, workers, [&](std::int64_t worker, std::int64_t row) {
    std::int32_t* const kept = scratch + worker * segment;
    const std::int64_t b = row / chosen.kv_heads, h = row % chosen.kv_heads;
    const std::int32_t* picked = chosen.row(b, h);
    std::int32_t* end = kept;
    for (std::int32_t i = 0; i < chosen.count(b, h); ++i) {
      const std::int32_t* ids = lists.list_ids(slots[b], h, picked[i]);
      end = std::copy_if(ids, ids + lists.count(slots[b], h, picked[i]), end,
                         [&](std::int32_t id) { return kvsift::detail::list_entry_kept(id, lengths[b], window); });
    }
    std::sort(kept, end);
    end = std::unique(kept, end);
    const auto count = std::int32_t(end - kept);
    std::copy(kept, end, out.row(b, h));
    if (float* const weights = out.weights_row(b, h)) std::fill_n(weights, count, 0.0f);
    out.counts[row] = count;
  });
  if (append.first != nullptr) append_range(out, slots, append.first, lengths, window, append.counts_before);
}

template <class T>
void replace_list(const InvertedListsView<T>& lists, const std::int32_t* slots, const SelectionView& entries,
                  const MatrixView<const float>& scores, std::int32_t* replaced, const Context& ctx) {
  kvsift::detail::check_replace_list("cpu::replace_list", lists, slots, entries, scores, MemorySpace::host);
  parallel_for(ctx.pool, std::int64_t(entries.batch) * entries.kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / entries.kv_heads, h = row % entries.kv_heads;
      std::int32_t& cursor = lists.cursors[std::int64_t(slots[b]) * lists.kv_heads + h];
      const std::int32_t l = cursor, count = entries.count(b, h);
      std::copy_n(entries.row(b, h), count, lists.list_ids(slots[b], h, l));
      if (T* const dst = lists.list_scores(slots[b], h, l)) {
        const float* src = scores.row(row);
        for (std::int32_t i = 0; i < count; ++i) dst[i] = from_float<T>(src[i]);
      }
      lists.count(slots[b], h, l) = count;
      cursor = lists.next_cursor(slots[b], l);
      if (replaced != nullptr) replaced[row] = l;
    }
  });
}

KVSIFT_LIST_STORAGE_TYPES(KVSIFT_INVERTED_LISTS_INSTANCES)

}  // namespace kvsift::cpu
