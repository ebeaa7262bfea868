#pragma once
/// The CPU backend of algorithms written once for both backends (selectors, the decode step): every shared
/// primitive with a cpu::Context as its last argument. An algorithm calls them unqualified, and
/// argument-dependent lookup on its context type picks this file's overloads or cuda/backend.hpp's, whose
/// arguments are the same. Each overload forwards to the primitive documented in its own header; the cache
/// arrives as a KVCache and is dispatched to the primitive's contiguous or paged instantiation here, once.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/detail/page_bounds_checks.hpp"
#include "kvsift/core/detail/select_pages_in_steps.hpp"
#include "kvsift/core/page_bounds_view.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/cpu/cache_ops.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/decode.hpp"
#include "kvsift/cpu/gather.hpp"
#include "kvsift/cpu/inverted_lists.hpp"
#include "kvsift/cpu/kmeans.hpp"
#include "kvsift/cpu/merge_store.hpp"
#include "kvsift/cpu/page_bounds.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/query_centroids.hpp"
#include "kvsift/cpu/rerank.hpp"
#include "kvsift/cpu/rope.hpp"
#include "kvsift/cpu/score_rows.hpp"
#include "kvsift/cpu/score_tables.hpp"
#include "kvsift/cpu/segment_mean.hpp"
#include "kvsift/cpu/topk.hpp"
#include "kvsift/cpu/vq.hpp"

namespace kvsift::cpu {

constexpr bool backend_included(const Context*) { return true; }  // selectors/selector.hpp BackendIncluded

/// Threads whose scratch a workspace query sizes (a run on more is refused by the decode step).
inline std::int32_t workspace_threads(const Context& ctx) { return ctx.pool != nullptr ? std::int32_t(ctx.pool->size()) : 1; }

template <class T>
void sequence_lengths(const KVCache<const T>& cache, std::int32_t* lengths, const Context&) {
  cpu::sequence_lengths(cache, lengths);
}
template <class T>
void write_step_kv(const KVCache<T>& cache, const HeadsView<const T>& k, const HeadsView<const T>& v, const Context&) {
  cpu::write_step_kv(cache, k, v);
}
inline void clear_counts(const SelectionView& out, const Context&) { cpu::clear_counts(out); }
/// out[0..4) = {b, h, t, i} of the cache's first non-finite key among tokens t < lengths[b], or four -1
/// (cpu/cache_ops.hpp). lengths and out: context (host) memory.
template <class T>
void first_nonfinite_key(const KVCache<const T>& cache, const std::int32_t* lengths, std::int32_t* out, const Context&) {
  cpu::first_nonfinite_key(cache, lengths, out);
}

/// Copies n values between context memory and the host: a selector's prepare reading lengths and page tables
/// (never append or select, where the CUDA twin's synchronization would break graph capture).
template <class V>
void copy_to_host(const V* src, std::size_t n, V* dst, const Context&) {
  std::copy_n(src, n, dst);
}
template <class V>
void copy_from_host(const V* src, std::size_t n, V* dst, const Context&) {
  std::copy_n(src, n, dst);
}
/// A copy between two arrays of the context's memory, in the context's order: no synchronization, graph capturable.
template <class V>
void copy_within(const V* src, std::size_t n, V* dst, const Context&) {
  std::copy_n(src, n, dst);
}
/// copy_within of `rows` rows of `width` elements, the rows `src_stride` and `dst_stride` elements apart.
template <class V>
void copy_rows_within(const V* src, std::int64_t src_stride, V* dst, std::int64_t dst_stride, std::int64_t width,
                      std::int64_t rows, const Context&) {
  for (std::int64_t r = 0; r < rows; ++r) std::copy_n(src + r * src_stride, width, dst + r * dst_stride);
}

inline std::size_t group_scores_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                                std::int32_t max_tokens, const GroupScoreOptions& options,
                                                const Context&) {
  return cpu::group_scores_workspace_bytes(batch, q_heads, kv_heads, max_tokens, options);
}
template <class T>
void group_scores(const QueryView<const T>& q, const KVCache<const T>& cache, const MatrixView<float>& scores,
                  const GroupScoreOptions& options, std::span<std::byte> workspace, const Context& ctx) {
  cache.visit([&](const auto& kv) { cpu::group_scores(q, kv, scores, options, workspace, ctx.pool); });
}

inline std::size_t topk_rows_workspace_bytes(std::int64_t score_rows, std::int32_t max_tokens, std::int32_t k,
                                             const TopKRowsOptions& options, const Context& ctx) {
  return cpu::topk_rows_workspace_bytes(score_rows, max_tokens, k, options, ctx.pool);
}
inline void topk_rows(const MatrixView<const float>& scores, const std::int32_t* lengths, std::int32_t k,
                      const TopKRowsOptions& options, const SelectionView& out, std::span<std::byte> workspace,
                      const Context& ctx) {
  cpu::topk_rows(scores, lengths, k, options, out, workspace, ctx.pool);
}
inline void length_budgets(const std::int32_t* lengths, std::int32_t batch, std::int32_t heads, const LengthBudget& budget,
                           std::int32_t* row_k, const Context& ctx) {
  cpu::length_budgets(lengths, batch, heads, budget, row_k);
}
inline void max_score_rows(const MatrixView<const float>& scores, std::int32_t group, const std::int32_t* lengths,
                           const MatrixView<float>& out, const Context&) {
  cpu::max_score_rows(scores, group, lengths, out);
}

template <class T>
void build_page_bounds(const KVCache<const T>& cache, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                       const Context& ctx) {
  cache.visit([&](const auto& kv) { cpu::build_page_bounds(kv, slots, bounds, ctx.pool); });
}
template <class T>
void append_page_bounds(const KVCache<const T>& cache, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                        const Context& ctx) {
  cache.visit([&](const auto& kv) { cpu::append_page_bounds(kv, slots, bounds, ctx.pool); });
}
template <class T>
void page_scores(const QueryView<const T>& q, const PageBoundsView<const T>& bounds, const std::int32_t* slots,
                 const std::int32_t* lengths, const AttentionWindow& window, const MatrixView<float>& scores,
                 std::int32_t* page_counts, const Context& ctx) {
  cpu::page_scores(q, bounds, slots, lengths, window, scores, page_counts, ctx.pool);
}
inline void expand_pages(const SelectionView& pages, std::int32_t page_size, const std::int32_t* lengths,
                         const AttentionWindow& window, const SelectionView& out, const Context& ctx) {
  cpu::expand_pages(pages, page_size, lengths, window, out, ctx.pool);
}
/// Quest's selection: page scores of sequences of up to max_pages pages (<= bounds.max_pages: the planned
/// bound), the best pages_per_row pages, their middle tokens (three primitives).
inline std::size_t select_pages_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t max_pages,
                                                std::int32_t pages_per_row, const Context& ctx) {
  return kvsift::detail::select_pages_in_steps_workspace_bytes(batch, kv_heads, max_pages, pages_per_row, ctx);
}
template <class T>
void select_pages(const QueryView<const T>& q, const PageBoundsView<const T>& bounds, const std::int32_t* slots,
                  const std::int32_t* lengths, const AttentionWindow& window, std::int32_t max_pages,
                  std::int32_t pages_per_row, const SelectionView& out, std::span<std::byte> workspace,
                  const Context& ctx) {
  kvsift::detail::check_select_pages("cpu::select_pages", q, bounds, slots, lengths, window, max_pages, pages_per_row,
                                     out);
  kvsift::detail::select_pages_in_steps(q, bounds, slots, lengths, window, max_pages, pages_per_row, out, workspace,
                                        ctx);
}

/// Sparse decode of the window and the selection, O in the storage type or fp32 (TO); the workspace depends on
/// the batch and the pool's threads.
inline std::size_t sparse_decode_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                                 std::int32_t head_dim, std::int32_t /*capacity*/,
                                                 std::int32_t /*max_seq_len*/, const AttentionOptions& /*attention*/,
                                                 bool /*validate_indices*/, const Context& ctx) {
  return cpu::decode_workspace_bytes(batch, q_heads, kv_heads, head_dim, ctx.pool);
}
template <class T, class TO>
void sparse_decode(const QueryView<const T>& q, const KVCache<const T>& cache, const SelectionView& selection,
                   const StateView<TO>& out, const AttentionOptions& attention, bool validate_indices,
                   bool /*programmatic_launch*/, std::span<std::byte> workspace, const Context& ctx) {
  const DecodeOptions options{.attention = attention, .validate_indices = validate_indices};
  cache.visit([&](const auto& kv) { cpu::sparse_decode(q, kv, selection, out, options, ctx.pool, workspace); });
}

/// The LSE merge of partial states (a decode step's primary and second-source partials) into `out`.
template <class TI, class TO>
void merge_states(std::span<const StateView<const TI>> partials, const StateView<TO>& out, const Context&) {
  cpu::merge_states<TI, TO>(partials, out);
}

// RoPE (core/rope.hpp, cpu/rope.hpp).
inline void build_rope_table(const RopeConfig& config, const RopeTableView& table, const Context& ctx) {
  cpu::build_rope_table(config, table, ctx.pool);
}
template <class T>
void apply_rope(const HeadsView<T>& x, const std::int32_t* positions, const RopeTableView& table, bool inverse,
                const Context& ctx) {
  cpu::apply_rope(x, positions, table, inverse, ctx.pool);
}
template <class T>
void apply_rope(const MatrixView<T>& rows, const std::int32_t* positions, const RopeTableView& table, bool inverse,
                const Context& ctx) {
  cpu::apply_rope(rows, positions, table, inverse, ctx.pool);
}
template <class T>
void rotate_by_delta(const HeadsView<T>& x, const std::int32_t* deltas, const RopeTableView& table, const Context& ctx) {
  cpu::rotate_by_delta(x, deltas, table, ctx.pool);
}
template <class T>
void apply_rope(const HeadsView<T>& x, const std::int32_t* positions, std::int32_t position_offset,
                const RopeTableView& table, bool inverse, const Context& ctx) {
  cpu::apply_rope(x, positions, position_offset, table, inverse, ctx.pool);
}
template <class T>
void rotate_to_position(const HeadsView<T>& x, const std::int32_t* positions, std::int32_t position_offset,
                        std::int32_t target, const RopeTableView& table, const Context& ctx) {
  cpu::rotate_to_position(x, positions, position_offset, target, table, ctx.pool);
}

// Segment mean (cpu/segment_mean.hpp).
inline std::size_t segment_mean_workspace_bytes(std::int64_t rows, std::int32_t segments, const Context&) {
  return cpu::segment_mean_workspace_bytes(rows, segments);
}
template <class T>
void segment_mean(const MatrixView<const T>& rows, const std::int32_t* assignment, std::int32_t segments,
                  const float* weights, const MatrixView<float>& means, std::int32_t* counts,
                  std::span<std::byte> workspace, const Context& ctx) {
  cpu::segment_mean(rows, assignment, segments, weights, means, counts, workspace, ctx.pool);
}

// Query centroids (core/query_centroids.hpp, cpu/query_centroids.hpp).
template <class T>
void centroid_scores(const QueryView<const T>& q, const QueryCentroidsView<const T>& centroids, const std::int32_t* slots,
                     std::int32_t kv_heads, const MatrixView<float>& scores, const Context& ctx) {
  cpu::centroid_scores(q, centroids, slots, kv_heads, scores, ctx.pool);
}
template <class T>
void store_centroids(const SequenceView<const T>& queries, const std::int32_t* slots, const std::int32_t* first,
                     std::int32_t kv_heads, const QueryCentroidsView<T>& centroids, const Context& ctx) {
  cpu::store_centroids(queries, slots, first, kv_heads, centroids, ctx.pool);
}

// Rerank (cpu/rerank.hpp).
inline std::size_t candidate_scores_workspace_bytes(std::int64_t rows, std::int32_t group, std::int32_t capacity,
                                                    const Context&) {
  return cpu::candidate_scores_workspace_bytes(rows, group, capacity);
}
template <class T>
void candidate_scores(const QueryView<const T>& q, const KVCache<const T>& cache, const SelectionView& candidates,
                      const GroupScoreOptions& options, const MatrixView<float>& scores, std::span<std::byte> workspace,
                      const Context& ctx) {
  cache.visit([&](const auto& kv) { cpu::candidate_scores(q, kv, candidates, options, scores, workspace, ctx.pool); });
}
inline void remap_selection(const SelectionView& positions, const SelectionView& ids, const SelectionView& out,
                            const Context&) {
  cpu::remap_selection(positions, ids, out);
}
inline void append_range(const SelectionView& rows, const std::int32_t* slots, const std::int32_t* first,
                         const std::int32_t* lengths, const AttentionWindow& window, const Context&) {
  cpu::append_range(rows, slots, first, lengths, window);
}

// Inverted lists (core/inverted_lists.hpp, cpu/inverted_lists.hpp).
inline std::size_t list_reduction_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity,
                                                  std::int32_t list_capacity, bool with_scores, const Context& ctx) {
  return cpu::list_reduction_workspace_bytes(rows, chosen_capacity, list_capacity, with_scores, ctx.pool);
}
template <class T>
void union_lists(const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* slots,
                 const std::int32_t* lengths, const AttentionWindow& window, const SelectionView& out,
                 std::span<std::byte> workspace, const Context& ctx) {
  cpu::union_lists(lists, chosen, slots, lengths, window, out, workspace, ctx.pool);
}
template <class T>
void reduce_lists_by_key(const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* slots,
                         const std::int32_t* lengths, const AttentionWindow& window, const SelectionView& out,
                         const MatrixView<float>& sums, std::span<std::byte> workspace, const Context& ctx) {
  cpu::reduce_lists_by_key(lists, chosen, slots, lengths, window, out, sums, workspace, ctx.pool);
}
template <class T>
void try_insert_lists(const InvertedListsView<T>& lists, const std::int32_t* slots, const std::int32_t* ids,
                      const MatrixView<const float>& scores, const Context& ctx) {
  cpu::try_insert_lists(lists, slots, ids, scores, ctx.pool);
}
template <class T>
void replace_list(const InvertedListsView<T>& lists, const std::int32_t* slots, const SelectionView& entries,
                  const MatrixView<const float>& scores, std::int32_t* replaced, const Context& ctx) {
  cpu::replace_list(lists, slots, entries, scores, replaced, ctx.pool);
}

// Score tables (core/score_tables.hpp, cpu/score_tables.hpp).
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

// KV gathers (cpu/gather.hpp).
template <class T>
void gather_kv(const KVCache<const T>& src, const SelectionView& rows, const KVCache<T>& dst, const Context& ctx) {
  cpu::gather_kv(src, rows, dst, ctx.pool);
}
inline std::size_t gather_kv_difference_workspace_bytes(std::int32_t batch, std::int32_t kv_heads,
                                                        std::int32_t current_capacity, std::int32_t resident_capacity,
                                                        const Context& ctx) {
  return cpu::gather_kv_difference_workspace_bytes(batch, kv_heads, current_capacity, resident_capacity, ctx.pool);
}
template <class T>
void gather_kv_difference(const KVCache<const T>& src, const SelectionView& previous, const std::int32_t* previous_slots,
                          const SelectionView& current, std::int32_t* current_slots, const ContiguousKVView<T>& resident,
                          std::int32_t* copied, std::span<std::byte> workspace, const Context& ctx) {
  cpu::gather_kv_difference(src, previous, previous_slots, current, current_slots, resident, copied, workspace, ctx.pool);
}

// Batched k-means over many small problems (cpu/kmeans.hpp).
inline std::size_t batched_kmeans_workspace_bytes(std::int32_t problems, std::int64_t n, std::int32_t dim,
                                                  const BatchedKMeansConfig& config, const Context&) {
  return cpu::batched_kmeans_workspace_bytes(problems, n, dim, config);
}
template <class T>
void kmeans_batched(const BatchedMatrixView<const T>& points, const float* weights, const BatchedKMeansConfig& config,
                    float* centroids, std::int32_t* assignment, std::span<std::byte> workspace, const Context& ctx) {
  cpu::kmeans_batched(points, weights, config, centroids, assignment, workspace, ctx.pool);
}

// Codebook quantization, lookup tables and code scan (cpu/vq.hpp).
inline void vq_codeword_norms(const MatrixView<const float>& centroids, float* norms, const Context& ctx) {
  cpu::vq_codeword_norms(centroids, norms, ctx.pool);
}
inline std::size_t vq_encode_workspace_bytes(std::int32_t codewords, std::int32_t head_dim, const Context& ctx) {
  return cpu::vq_encode_workspace_bytes(codewords, head_dim, ctx.pool);
}
template <class T>
void vq_encode(const HeadsView<const T>& keys, const VqEncodeCodebook& codebook, const VqCodesView<std::uint16_t>& codes,
               const VqCodeDestination& destination, std::span<std::byte> workspace, const Context& ctx) {
  cpu::vq_encode(keys, codebook, codes, destination, workspace, ctx.pool);
}
template <class T>
void vq_lut(const QueryView<const T>& q, const VqCodebook<T>& codebook, const MatrixView<float>& lut, const Context& ctx) {
  cpu::vq_lut(q, codebook, lut, ctx.pool);
}
inline void vq_code_scan(const MatrixView<const float>& lut, std::int32_t batch,
                         const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots,
                         const std::int32_t* lengths, const MatrixView<float>& scores, const VqScanOptions& options,
                         const Context& ctx) {
  cpu::vq_code_scan(lut, batch, codes, slots, lengths, scores, options, ctx.pool);
}
inline std::size_t vq_lut_scan_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                               std::int32_t codewords, std::int32_t head_dim, const Context& ctx) {
  return cpu::vq_lut_scan_workspace_bytes(batch, q_heads, kv_heads, codewords, head_dim, ctx.pool);
}
template <class T>
void vq_lut_scan(const QueryView<const T>& q, const VqCodebook<T>& codebook,
                 const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots, const std::int32_t* lengths,
                 const MatrixView<float>& scores, const VqScanOptions& options, std::span<std::byte> workspace,
                 const Context& ctx) {
  cpu::vq_lut_scan(q, codebook, codes, slots, lengths, scores, options, workspace, ctx.pool);
}

// The merge store (core/merge_store.hpp, cpu/merge_store.hpp).
template <class T>
void merge_store_load(const KVCache<const T>& cache, const std::int32_t* slots, const MergeStoreView<T>& store,
                      const Context& ctx) {
  cpu::merge_store_load(cache, slots, store, ctx.pool);
}
inline std::size_t merge_round_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity,
                                               const Context& ctx) {
  return cpu::merge_round_workspace_bytes(batch, kv_heads, capacity, ctx.pool);
}
template <class T>
void merge_round(const MergeStoreView<T>& store, const std::int32_t* slots, std::int32_t batch,
                 const std::int32_t* budgets, const MergeRoundParams& params, std::span<std::byte> workspace,
                 const Context& ctx) {
  cpu::merge_round(store, slots, batch, budgets, params, workspace, ctx.pool);
}
template <class T>
void merge_store_append(const KVCache<const T>& cache, const std::int32_t* slots, const std::int32_t* lengths,
                        const MergeStoreView<T>& store, const Context& ctx) {
  cpu::merge_store_append(cache, slots, lengths, store, ctx.pool);
}
template <class T>
void merge_store_copy(const MergeStoreView<const T>& src, const std::int32_t* src_slots, const MergeStoreView<T>& dst,
                      const std::int32_t* dst_slots, std::int32_t batch, const Context& ctx) {
  cpu::merge_store_copy(src, src_slots, dst, dst_slots, batch, ctx.pool);
}
template <class T>
void merge_store_selection(const MergeStoreView<const T>& store, const std::int32_t* slots, const SelectionView& out,
                           const Context& ctx) {
  cpu::merge_store_selection(store, slots, out, ctx.pool);
}

}  // namespace kvsift::cpu
