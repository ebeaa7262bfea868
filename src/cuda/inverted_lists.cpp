// Inverted lists on CUDA: the shape checks shared with the CPU (core/detail/inverted_lists_checks.hpp, device
// contents unread), the union's one workspace layout, then the launchers of kernels/inverted_lists.cu.
#include "kvsift/cuda/inverted_lists.hpp"

#include <climits>

#include "kvsift/core/detail/inverted_lists_checks.hpp"
#include "kvsift/core/detail/inverted_lists_instances.hpp"
#include "kvsift/core/detail/rerank_checks.hpp"
#include "kvsift/core/detail/topk_rows_checks.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/inverted_lists_launch.hpp"
#include "kvsift/cuda/topk.hpp"

namespace kvsift::cuda {
namespace {

/// The single layout behind list_reduction_workspace_bytes and the carving of union_lists.
detail::ListReductionBuffers layout_reduction(WorkspaceLayout& layout, std::int64_t rows, std::int32_t segment) {
  const std::size_t items = checked_mul(std::size_t(rows), std::size_t(segment), "cuda list reduction workspace");
  detail::ListReductionBuffers b;
  b.keys_in = layout.allocate<std::int32_t>(items, "keys_in");
  b.keys_out = layout.allocate<std::int32_t>(items, "keys_out");
  b.segment_begin = layout.allocate<std::int32_t>(std::size_t(rows), "segment_begin");
  b.segment_end = layout.allocate<std::int32_t>(std::size_t(rows), "segment_end");
  KVSIFT_CUDA_CHECK(detail::list_reduction_cub_bytes(rows, segment, &b.cub_temp_bytes));
  b.cub_temp = layout.allocate<std::byte>(b.cub_temp_bytes, "cub_temp");
  return b;
}

/// The single layout behind recall_lists_workspace_bytes and the carving of recall_lists: the top-k's, the union's.
struct RecallScratch {
  std::span<std::byte> topk, reduction;
};
RecallScratch layout_recall(WorkspaceLayout& layout, std::int64_t rows, std::int32_t columns,
                            std::int32_t chosen_capacity, std::int32_t list_capacity) {
  RecallScratch s;
  s.topk = layout.span(topk_rows_workspace_bytes(rows, columns, chosen_capacity, {}), "recall top-k");
  s.reduction = layout.span(list_reduction_workspace_bytes(rows, chosen_capacity, list_capacity), "recall union");
  return s;
}

/// The union's params (shapes checked).
template <class T>
detail::ListReductionParams<T> reduction_params(const InvertedListsView<const T>& lists, const SelectionView& chosen,
                                                const std::int32_t* d_slots, const std::int32_t* d_lengths,
                                                const AttentionWindow& window, const UnionAppend& append,
                                                const SelectionView& out, const char* where) {
  kvsift::detail::check_list_reduction(where, lists, chosen, d_slots, d_lengths, window, out, MemorySpace::device);
  if (append.first != nullptr) kvsift::detail::check_append_range(where, out, d_slots, append.first, d_lengths, window);
  KVSIFT_CHECK(std::int64_t(chosen.batch) * chosen.kv_heads <= INT32_MAX, where,
               "chosen.batch * kv_heads (= {} * {}) exceeds 2^31 - 1 CTAs", chosen.batch, chosen.kv_heads);
  return {.lists = lists,
          .chosen = chosen,
          .slots = d_slots,
          .lengths = d_lengths,
          .window = window,
          .out = out,
          .append = append,
          .recall = {},
          .rows = std::int64_t(chosen.batch) * chosen.kv_heads,
          .segment = chosen.capacity * lists.list_capacity};
}

}  // namespace

std::size_t recall_lists_workspace_bytes(std::int64_t rows, std::int32_t columns, std::int32_t chosen_capacity,
                                         std::int32_t list_capacity, const Context&) {
  WorkspaceLayout counting;
  layout_recall(counting, rows, columns, chosen_capacity, list_capacity);
  return counting.bytes();
}

std::size_t list_reduction_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity,
                                           std::int32_t list_capacity, const Context&) {
  constexpr const char* where = "cuda::list_reduction_workspace_bytes";
  KVSIFT_CHECK(rows > 0 && chosen_capacity > 0 && list_capacity > 0, where,
               "rows (= {}), chosen_capacity (= {}) and list_capacity (= {}) must be positive", rows, chosen_capacity,
               list_capacity);
  KVSIFT_CHECK(rows * chosen_capacity * std::int64_t(list_capacity) <= INT32_MAX, where,
               "rows * chosen_capacity * list_capacity (= {} * {} * {}) exceeds 2^31 - 1 entries", rows,
               chosen_capacity, list_capacity);
  WorkspaceLayout counting;
  layout_reduction(counting, rows, chosen_capacity * list_capacity);
  return counting.bytes();
}

template <class T>
void union_lists(const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* d_slots,
                 const std::int32_t* d_lengths, const AttentionWindow& window, const UnionAppend& append,
                 const SelectionView& out, std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cuda::union_lists";
  const detail::ListReductionParams<T> params =
      reduction_params(lists, chosen, d_slots, d_lengths, window, append, out, where);
  WorkspaceLayout layout(workspace, where);
  const detail::ListReductionBuffers buffers = layout_reduction(layout, params.rows, params.segment);
  KVSIFT_CUDA_CHECK(detail::launch_list_reduction(params, buffers, ctx.stream));
}

template <class T>
void recall_lists(const MatrixView<const float>& scores, const std::int32_t* d_columns,
                  const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* d_slots,
                  const std::int32_t* d_lengths, const AttentionWindow& window, const UnionAppend& append,
                  const SelectionView& out, std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cuda::recall_lists";
  kvsift::detail::check_recall_scores(where, scores, lists, chosen);
  kvsift::detail::check_topk_rows_call(where, scores, d_columns, "d_columns", chosen.capacity, {}, chosen);
  detail::ListReductionParams<T> params =
      reduction_params(lists, chosen, d_slots, d_lengths, window, append, out, where);
  WorkspaceLayout layout(workspace, where);
  const RecallScratch w = layout_recall(layout, scores.rows, scores.cols, chosen.capacity, lists.list_capacity);
  bool fused = false;
  KVSIFT_CUDA_CHECK(detail::recall_fuses<T>(scores.cols, chosen.capacity, params.segment, &fused));
  if (fused) {  // the top-k in the union's launch
    params.recall = {.scores = scores, .columns = d_columns};
    KVSIFT_CUDA_CHECK(detail::launch_list_reduction(params, detail::ListReductionBuffers{}, ctx.stream));
    return;
  }
  topk_rows(scores, d_columns, chosen.capacity, TopKRowsOptions{}, chosen, w.topk, ctx.stream);
  union_lists(lists, chosen, d_slots, d_lengths, window, append, out, w.reduction, ctx);
}

template <class T>
void replace_list(const InvertedListsView<T>& lists, const std::int32_t* d_slots, const SelectionView& entries,
                  const MatrixView<const float>& scores, std::int32_t* d_replaced, const Context& ctx) {
  constexpr const char* where = "cuda::replace_list";
  kvsift::detail::check_replace_list(where, lists, d_slots, entries, scores, MemorySpace::device);
  KVSIFT_CHECK(std::int64_t(entries.batch) * entries.kv_heads <= INT32_MAX, where,
               "entries.batch * kv_heads (= {} * {}) exceeds 2^31 - 1 CTAs", entries.batch, entries.kv_heads);
  KVSIFT_CUDA_CHECK(detail::launch_replace_list(lists, d_slots, entries, scores, d_replaced, ctx.stream));
}

KVSIFT_LIST_STORAGE_TYPES(KVSIFT_INVERTED_LISTS_INSTANCES)

}  // namespace kvsift::cuda
