// Score tables on CUDA: the shape checks shared with the CPU (selectors/csattention/detail/score_tables_checks.hpp, device contents
// unread), the kernels' own limits, one workspace layout per primitive, then the launchers of
// kernels/score_tables.cu.
#include "kvsift/selectors/csattention/cuda/score_tables.hpp"

#include <algorithm>
#include <climits>

#include "kvsift/selectors/csattention/detail/score_tables_checks.hpp"
#include "kvsift/selectors/csattention/detail/score_tables_instances.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/selectors/csattention/cuda/detail/score_tables_launch.hpp"

namespace kvsift::cuda {
namespace {

/// table_scores_sparse ranks its entries with an int32 scan: every entry of a call must have an int32 index.
void check_sparse_items(const char* where, std::int64_t rows, std::int64_t per_row, const char* what) {
  KVSIFT_CHECK(rows * per_row <= INT32_MAX, where, "rows * {} (= {} * {}) exceeds 2^31 - 1 entries", what, rows,
               per_row);
}

/// The single layout behind store_table_lists_workspace_bytes and the carving of store_table_lists: the sort's
/// buffers for min(rows, kTableListSortRows) rows.
detail::TableListBuffers layout_table_lists(WorkspaceLayout& layout, std::int64_t rows, std::int32_t tokens) {
  const std::size_t items = checked_mul(std::size_t(std::min(rows, detail::kTableListSortRows)), std::size_t(tokens),
                                        "cuda store_table_lists workspace");
  detail::TableListBuffers b;
  for (int i = 0; i < 2; ++i) {
    b.keys[i] = layout.allocate<std::uint32_t>(items, "sort keys");
    b.columns[i] = layout.allocate<std::int32_t>(items, "columns");
  }
  KVSIFT_CUDA_CHECK(detail::table_list_sort_bytes(rows, tokens, &b.cub_temp_bytes));
  b.cub_temp = layout.allocate<std::byte>(b.cub_temp_bytes, "cub_temp");
  return b;
}

/// A token order (TokenOrderView) the kernels can read: its arrays present, its ranges in [1, kMaxTableTokenRanges].
template <class U>
void check_token_order(const char* where, const char* name, const TokenOrderView<U>& order) {
  KVSIFT_CHECK(order.entries != nullptr && order.offsets != nullptr && order.prompt != nullptr, where,
               "{} is empty (entries, offsets or prompt a null pointer): the dense reduction reads the base lists in "
               "token order (cuda::order_table_lists builds it)",
               name);
  KVSIFT_CHECK(order.ranges >= 1 && order.ranges <= kMaxTableTokenRanges, where,
               "{}.ranges (= {}) is outside [1, {}]", name, order.ranges, kMaxTableTokenRanges);
}

detail::DenseTableBuffers layout_dense(WorkspaceLayout& layout, std::int64_t rows, std::int32_t max_tokens) {
  const std::int64_t parts = detail::dense_parts_bound(max_tokens);
  return {layout.allocate<std::int32_t>(checked_mul(std::size_t(rows), std::size_t(parts), "cuda table_scores_dense"),
                                        "candidate counts"),
          parts};
}

detail::SparseTableBuffers layout_sparse(WorkspaceLayout& layout, std::int64_t rows, std::int32_t segment) {
  const std::size_t items = checked_mul(std::size_t(rows), std::size_t(segment), "cuda table_scores_sparse workspace");
  detail::SparseTableBuffers b;
  for (int i = 0; i < 2; ++i) {
    b.keys[i] = layout.allocate<std::uint64_t>(items, "entry keys");
    b.ordinals[i] = layout.allocate<std::int32_t>(items + 1, "entry ordinals");
  }
  b.values = layout.allocate<std::int64_t>(items, "entry values");
  KVSIFT_CUDA_CHECK(detail::table_scores_sparse_cub_bytes(rows, segment, &b.cub_temp_bytes));
  b.cub_temp = layout.allocate<std::byte>(b.cub_temp_bytes, "cub_temp");
  return b;
}

detail::TableScoresParams table_scores_params(const ScoreTablesView<const std::int32_t>& tables,
                                              const SelectionView& chosen, const TableScoreOptions& options,
                                              std::int32_t heads_per_row,
                                              const std::int32_t* d_slots, const std::int32_t* d_lengths,
                                              const AttentionWindow& window, const LengthBudget& budget,
                                              std::int32_t* d_row_k) {
  return {.tables = tables,
          .chosen = chosen,
          .options = options,
          .heads_per_row = heads_per_row,
          .slots = d_slots,
          .lengths = d_lengths,
          .window = window,
          .budget = budget,
          .row_k = d_row_k,
          .rows = std::int64_t(chosen.batch) * chosen.kv_heads};
}

}  // namespace

template <class T>
void subspace_scores(const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                     std::int32_t list_count, const KVCache<const T>& cache, std::int32_t row,
                     std::int32_t token_begin, std::int32_t tokens, const MatrixView<float>& out, const Context& ctx) {
  constexpr const char* where = "cuda::subspace_scores";
  cache.visit([&](const auto& kv) { validate(kv, where, "cache", MemorySpace::device); });
  kvsift::detail::check_subspace_scores<T>(where, base, table_head, list_begin, list_count, cache, row, token_begin,
                                           tokens, out);
  const std::int64_t blocks =
      detail::subspace_scores_blocks(base.centroids_per_subspace, list_begin, list_count, tokens);
  KVSIFT_CHECK(blocks <= INT32_MAX, where, "lists [{}, {} + {}) over {} tokens need {} CTAs, more than 2^31 - 1",
               list_begin, list_begin, list_count, tokens, blocks);
  cache.visit([&](const auto& kv) {
    KVSIFT_CUDA_CHECK(detail::launch_subspace_scores(base, table_head, list_begin, list_count, kv, row, token_begin,
                                                     tokens, out, ctx.stream));
  });
}

std::size_t store_table_lists_workspace_bytes(std::int32_t list_rows, std::int32_t tokens, const Context&) {
  constexpr const char* where = "cuda::store_table_lists_workspace_bytes";
  KVSIFT_CHECK(list_rows > 0 && tokens >= 0, where, "list_rows (= {}) must be positive and tokens (= {}) >= 0",
               list_rows, tokens);
  WorkspaceLayout counting;
  layout_table_lists(counting, list_rows, tokens);
  return counting.bytes();
}

void store_table_lists(const MatrixView<const float>& scores, std::int32_t tokens, std::int32_t keep,
                       const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                       std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cuda::store_table_lists";
  kvsift::detail::check_store_table_lists(where, scores, tokens, keep, base, table_head, list_begin);
  WorkspaceLayout layout(workspace, where);
  const detail::TableListBuffers buffers = layout_table_lists(layout, scores.rows, tokens);
  KVSIFT_CUDA_CHECK(
      detail::launch_store_table_lists(scores, tokens, keep, base, table_head, list_begin, buffers, ctx.stream));
}

void order_table_lists(const BaseTablesView& base, std::int32_t tokens, const Context& ctx) {
  constexpr const char* where = "cuda::order_table_lists";
  kvsift::detail::check_base_tables(where, base);
  check_token_order(where, "base.token_order", base.token_order);
  KVSIFT_CHECK(tokens >= 0 && tokens <= std::int64_t(base.token_order.ranges) * kTableTokenRange, where,
               "tokens (= {}) is outside [0, base.token_order.ranges * {} = {}]", tokens, kTableTokenRange,
               std::int64_t(base.token_order.ranges) * kTableTokenRange);
  KVSIFT_CUDA_CHECK(detail::launch_order_table_lists(base, tokens, ctx.stream));
}

template <class T>
void append_tables(const ScoreTablesView<std::int32_t>& tables, const KVCache<const T>& cache,
                   const std::int32_t* d_slots, const std::int32_t* d_lengths, const Context& ctx) {
  constexpr const char* where = "cuda::append_tables";
  cache.visit([&](const auto& kv) { validate(kv, where, "cache", MemorySpace::device); });
  kvsift::detail::check_append_tables<T>(where, tables, cache, d_slots, d_lengths, MemorySpace::device);
  cache.visit([&](const auto& kv) {
    KVSIFT_CUDA_CHECK(detail::launch_append_tables(tables, kv, d_slots, d_lengths, ctx.stream));
  });
}

template <class T>
void nearest_centroids(const QueryView<const T>& q, const ScoreTablesView<const std::int32_t>& tables,
                       const std::int32_t* d_slots, std::int32_t probes, const SelectionView& chosen,
                       std::int32_t* d_weights, const Context& ctx) {
  kvsift::detail::check_nearest_centroids("cuda::nearest_centroids", q, tables, d_slots, probes, chosen,
                                          MemorySpace::device);
  KVSIFT_CUDA_CHECK(detail::launch_nearest_centroids(q, tables, d_slots, probes, chosen, d_weights, ctx.stream));
}

std::size_t table_scores_dense_workspace_bytes(std::int64_t rows, std::int32_t heads_per_row, std::int32_t max_tokens,
                                               const Context&) {
  KVSIFT_CHECK(rows > 0 && heads_per_row > 0 && max_tokens >= 0, "cuda::table_scores_dense_workspace_bytes",
               "rows (= {}) and heads_per_row (= {}) must be positive, max_tokens (= {}) >= 0", rows, heads_per_row,
               max_tokens);
  WorkspaceLayout counting;
  layout_dense(counting, rows, max_tokens);
  return counting.bytes();
}

void table_scores_dense(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                        const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* d_slots,
                        const std::int32_t* d_lengths, const AttentionWindow& window, const LengthBudget& budget, const MatrixView<float>& scores,
                        std::int32_t* d_row_k, std::int32_t max_tokens, std::span<std::byte> workspace,
                        const Context& ctx) {
  constexpr const char* where = "cuda::table_scores_dense";
  kvsift::detail::check_table_scores(where, tables, chosen, options, heads_per_row, d_slots, d_lengths, window, budget,
                                     scores, max_tokens, d_row_k, MemorySpace::device);
  KVSIFT_CHECK(max_tokens >= 0, where, "max_tokens (= {}) is negative", max_tokens);
  check_token_order(where, "tables.token_order", tables.token_order);
  const detail::TableScoresParams params =
      table_scores_params(tables, chosen, options, heads_per_row, d_slots, d_lengths, window, budget, d_row_k);
  WorkspaceLayout layout(workspace, where);
  const detail::DenseTableBuffers buffers = layout_dense(layout, params.rows, max_tokens);
  const detail::DenseTablePlan plan = detail::plan_dense_tables(params.rows, max_tokens, multiprocessor_count(),
                                                                std::size_t(max_shared_memory_per_block()) / 2);
  KVSIFT_CHECK(params.rows * plan.parts <= INT32_MAX, where,
               "chosen.batch * kv_heads (= {} * {}) over {} tokens needs more than 2^31 - 1 CTAs", chosen.batch,
               chosen.kv_heads, max_tokens);
  KVSIFT_CUDA_CHECK(detail::launch_table_scores_dense(params, scores, max_tokens, plan, buffers, ctx.stream));
}

std::int64_t table_scores_sparse_capacity(std::int32_t chosen_capacity, std::int32_t length, const Context&) {
  return std::int64_t(chosen_capacity) * length;
}

std::size_t table_scores_sparse_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity, std::int32_t length,
                                                const Context&) {
  constexpr const char* where = "cuda::table_scores_sparse_workspace_bytes";
  KVSIFT_CHECK(rows > 0 && chosen_capacity > 0 && length > 0, where,
               "rows (= {}), chosen_capacity (= {}) and length (= {}) must be positive", rows, chosen_capacity, length);
  const std::int64_t segment = table_scores_sparse_capacity(chosen_capacity, length);
  check_sparse_items(where, rows, segment, "chosen_capacity * length");
  WorkspaceLayout counting;
  layout_sparse(counting, rows, std::int32_t(segment));
  return counting.bytes();
}

void table_scores_sparse(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                         const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* d_slots,
                         const std::int32_t* d_lengths, const AttentionWindow& window, const LengthBudget& budget, const SelectionView& out,
                         const MatrixView<float>& sums, std::int32_t* d_row_k, std::span<std::byte> workspace,
                         const Context& ctx) {
  constexpr const char* where = "cuda::table_scores_sparse";
  const std::int64_t segment = table_scores_sparse_capacity(chosen.capacity, tables.length);
  kvsift::detail::check_table_scores(where, tables, chosen, options, heads_per_row, d_slots, d_lengths, window, budget,
                                     sums, out.capacity, d_row_k, MemorySpace::device);
  kvsift::detail::check_sparse_out(where, out, chosen, heads_per_row, segment);
  const detail::TableScoresParams params =
      table_scores_params(tables, chosen, options, heads_per_row, d_slots, d_lengths, window, budget, d_row_k);
  check_sparse_items(where, params.rows, segment, "chosen.capacity * tables.length");
  WorkspaceLayout layout(workspace, where);
  const detail::SparseTableBuffers buffers = layout_sparse(layout, params.rows, std::int32_t(segment));
  KVSIFT_CUDA_CHECK(detail::launch_table_scores_sparse(params, out, sums, std::int32_t(segment), buffers, ctx.stream));
}

KVSIFT_STORAGE_TYPES(KVSIFT_SCORE_TABLES_INSTANCES)

}  // namespace kvsift::cuda
