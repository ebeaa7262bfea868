#pragma once
/// CSAttention's score tables, CPU overloads: what the selector, written once for both backends, calls unqualified
/// (argument-dependent lookup on cpu::Context). cpu/backend.hpp includes this file;
/// selectors/csattention/cuda/backend.hpp is the CUDA twin. Each overload forwards to the primitive documented in its
/// own header.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/backend.hpp"  // the shared overloads (which include this file at their end)
#include "kvsift/cpu/context.hpp"
#include "kvsift/selectors/csattention/cpu/score_tables.hpp"
#include "kvsift/selectors/csattention/score_tables.hpp"

namespace kvsift::cpu {

template <class T>
void subspace_scores(const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                     std::int32_t list_count, const KVCache<const T>& cache, std::int32_t row,
                     std::int32_t token_begin, std::int32_t tokens, const MatrixView<float>& out, const Context& ctx) {
  cpu::subspace_scores(base, table_head, list_begin, list_count, cache, row, token_begin, tokens, out, ctx.pool);
}
inline std::size_t store_table_lists_workspace_bytes(std::int32_t list_rows, std::int32_t tokens, const Context& ctx) {
  return cpu::store_table_lists_workspace_bytes(list_rows, tokens, ctx.pool);
}
inline void store_table_lists(const MatrixView<const float>& scores, std::int32_t tokens, std::int32_t keep,
                              const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                              std::span<std::byte> workspace, const Context& ctx) {
  cpu::store_table_lists(scores, tokens, keep, base, table_head, list_begin, workspace, ctx.pool);
}
template <class T>
void append_tables(const ScoreTablesView<std::int32_t>& tables, const KVCache<const T>& cache,
                   const std::int32_t* slots, const std::int32_t* lengths, const Context& ctx) {
  cpu::append_tables(tables, cache, slots, lengths, ctx.pool);
}
template <class T>
void nearest_centroids(const QueryView<const T>& q, const ScoreTablesView<const std::int32_t>& tables,
                       const std::int32_t* slots, std::int32_t probes, const SelectionView& chosen,
                       std::int32_t* weights, const Context& ctx) {
  cpu::nearest_centroids(q, tables, slots, probes, chosen, weights, ctx.pool);
}
inline std::size_t table_scores_dense_workspace_bytes(std::int64_t rows, std::int32_t heads_per_row,
                                                      std::int32_t max_tokens, const Context& ctx) {
  return cpu::table_scores_dense_workspace_bytes(rows, heads_per_row, max_tokens, ctx.pool);
}
inline void table_scores_dense(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                               const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* slots, const std::int32_t* lengths,
                               const AttentionWindow& window, const LengthBudget& budget,
                               const MatrixView<float>& scores, std::int32_t* row_k, std::int32_t max_tokens,
                               std::span<std::byte> workspace, const Context& ctx) {
  cpu::table_scores_dense(tables, chosen, options, heads_per_row, slots, lengths, window, budget, scores, row_k, max_tokens,
                          workspace, ctx.pool);
}
inline std::int64_t table_scores_sparse_capacity(std::int32_t chosen_capacity, std::int32_t length, const Context&) {
  return cpu::table_scores_sparse_capacity(chosen_capacity, length);
}
inline std::size_t table_scores_sparse_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity,
                                                       std::int32_t length, const Context& ctx) {
  return cpu::table_scores_sparse_workspace_bytes(rows, chosen_capacity, length, ctx.pool);
}
inline void table_scores_sparse(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                                const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* slots, const std::int32_t* lengths,
                                const AttentionWindow& window, const LengthBudget& budget, const SelectionView& out,
                                const MatrixView<float>& sums, std::int32_t* row_k, std::span<std::byte> workspace,
                                const Context& ctx) {
  cpu::table_scores_sparse(tables, chosen, options, heads_per_row, slots, lengths, window, budget, out, sums, row_k, workspace,
                           ctx.pool);
}

}  // namespace kvsift::cpu
