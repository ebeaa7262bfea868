#pragma once
/// The CPU backend of algorithms written once for both backends (selectors, the decode step): every shared
/// primitive with a cpu::Context as its last argument. An algorithm calls them unqualified, and
/// argument-dependent lookup on its context type picks the CPU's functions or cuda/backend.hpp's, whose
/// arguments are the same. A primitive that takes the context itself (cpu/rope.hpp, cpu/segment_mean.hpp,
/// cpu/kmeans.hpp, cpu/inverted_lists.hpp, cpu/gather.hpp) is reached through its include here; the others
/// through this file's overloads, each a forward to the primitive documented in its own header, where the cache
/// arrives as a KVCache and is dispatched to the primitive's contiguous or paged instantiation, once. A forward
/// must not keep the primitive's own signature: it would define the primitive as a call of itself.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/cpu/cache_ops.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/decode.hpp"
#include "kvsift/cpu/gather.hpp"
#include "kvsift/cpu/inverted_lists.hpp"
#include "kvsift/cpu/kmeans.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/rerank.hpp"
#include "kvsift/cpu/rope.hpp"
#include "kvsift/cpu/segment_mean.hpp"
#include "kvsift/cpu/topk.hpp"

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
inline void mass_budgets(const MatrixView<const float>& scores, const std::int32_t* counts, const MassBudget& budget,
                         std::int32_t* row_k, const Context& ctx) {
  cpu::mass_budgets(scores, counts, budget, row_k, ctx.pool);
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
                         const std::int32_t* lengths, const AttentionWindow& window, std::int32_t* counts_before,
                         const Context&) {
  cpu::append_range(rows, slots, first, lengths, window, counts_before);
}

}  // namespace kvsift::cpu

// Each selector's own calls, after the shared ones above, which they use: its primitives, which take the context
// last (selectors/<name>/cpu/), and what it does over them, written once over the context (selectors/<name>/backend.hpp,
// where it has one). This file gathers them, so that including it gives an algorithm the whole backend.
#include "kvsift/selectors/quest/cpu/page_bounds.hpp"
#include "kvsift/selectors/quest/backend.hpp"
#include "kvsift/selectors/ctkvr/cpu/query_centroids.hpp"
#include "kvsift/selectors/csattention/cpu/score_tables.hpp"
#include "kvsift/selectors/a2ats/cpu/vq.hpp"
#include "kvsift/selectors/centroid_kv/cpu/merge_store.hpp"
#include "kvsift/selectors/specontext/cpu/score_rows.hpp"
