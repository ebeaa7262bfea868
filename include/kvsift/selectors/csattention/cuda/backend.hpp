#pragma once
/// CSAttention's score tables, CUDA overloads: what the selector, written once for both backends, calls unqualified
/// (argument-dependent lookup on cuda::Context). cuda/backend.hpp includes this file;
/// selectors/csattention/cpu/backend.hpp is the CPU twin. Each overload forwards to the primitive documented in its own
/// header.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/backend.hpp"  // the shared overloads (which include this file at their end)
#include "kvsift/cuda/context.hpp"
#include "kvsift/selectors/csattention/cuda/score_tables.hpp"
#include "kvsift/selectors/csattention/score_tables.hpp"

namespace kvsift::cuda {

template <class T>
void subspace_scores(const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                     std::int32_t list_count, const KVCache<const T>& cache, std::int32_t row,
                     std::int32_t token_begin, std::int32_t tokens, const MatrixView<float>& out, const Context& ctx) {
  cache.visit([&](const auto& kv) {
    cuda::subspace_scores(base, table_head, list_begin, list_count, kv, row, token_begin, tokens, out, ctx.stream);
  });
}
inline std::size_t store_table_lists_workspace_bytes(std::int32_t list_rows, std::int32_t tokens, const Context&) {
  return cuda::store_table_lists_workspace_bytes(list_rows, tokens);
}
inline void store_table_lists(const MatrixView<const float>& scores, std::int32_t tokens, std::int32_t keep,
                              const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                              std::span<std::byte> workspace, const Context& ctx) {
  cuda::store_table_lists(scores, tokens, keep, base, table_head, list_begin, workspace, ctx.stream);
}
template <class T>
void append_tables(const ScoreTablesView<std::int32_t>& tables, const KVCache<const T>& cache,
                   const std::int32_t* slots, const std::int32_t* lengths, const Context& ctx) {
  cache.visit([&](const auto& kv) { cuda::append_tables(tables, kv, slots, lengths, ctx.stream); });
}
template <class T>
void nearest_centroids(const QueryView<const T>& q, const ScoreTablesView<const std::int32_t>& tables,
                       const std::int32_t* slots, std::int32_t probes, const SelectionView& chosen,
                       std::int32_t* weights, const Context& ctx) {
  cuda::nearest_centroids(q, tables, slots, probes, chosen, weights, ctx.stream);
}
inline std::size_t table_scores_dense_workspace_bytes(std::int64_t rows, std::int32_t heads_per_row,
                                                      std::int32_t max_tokens, const Context&) {
  return cuda::table_scores_dense_workspace_bytes(rows, heads_per_row, max_tokens);
}
inline void table_scores_dense(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                               const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* slots,
                               const std::int32_t* lengths, const AttentionWindow& window, const LengthBudget& budget,
                               const MatrixView<float>& scores, std::int32_t* row_k, std::int32_t max_tokens,
                               std::span<std::byte> workspace, const Context& ctx) {
  cuda::table_scores_dense(tables, chosen, options, heads_per_row, slots, lengths, window, budget, scores, row_k,
                           max_tokens, workspace, ctx.stream);
}
inline std::int64_t table_scores_sparse_capacity(std::int32_t chosen_capacity, std::int32_t length, const Context&) {
  return cuda::table_scores_sparse_capacity(chosen_capacity, length);
}
inline std::size_t table_scores_sparse_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity,
                                                       std::int32_t length, const Context&) {
  return cuda::table_scores_sparse_workspace_bytes(rows, chosen_capacity, length);
}
inline void table_scores_sparse(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                                const TableScoreOptions& options, std::int32_t heads_per_row,
                                const std::int32_t* slots, const std::int32_t* lengths, const AttentionWindow& window,
                                const LengthBudget& budget, const SelectionView& out, const MatrixView<float>& sums,
                                std::int32_t* row_k, std::span<std::byte> workspace, const Context& ctx) {
  cuda::table_scores_sparse(tables, chosen, options, heads_per_row, slots, lengths, window, budget, out, sums, row_k,
                            workspace, ctx.stream);
}

}  // namespace kvsift::cuda
