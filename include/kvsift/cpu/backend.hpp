#pragma once
/// The CPU backend of algorithms written once for both backends (selectors, the decode step): every shared
/// primitive with a cpu::Context as its last argument. An algorithm calls them unqualified, and
/// argument-dependent lookup on its context type picks this file's overloads or cuda/backend.hpp's, whose
/// arguments are the same. Each overload forwards to the primitive documented in its own header; the cache
/// arrives as a KVCache and is dispatched to the primitive's contiguous or paged instantiation here, once.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/page_bounds_view.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/cpu/cache_ops.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/decode.hpp"
#include "kvsift/cpu/page_bounds.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/topk.hpp"

namespace kvsift::cpu {

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

}  // namespace kvsift::cpu
