#pragma once
/// The CUDA backend of algorithms written once for both backends (selectors, the decode step): every shared
/// primitive with a cuda::Context as its last argument, the same arguments as cpu/backend.hpp's (see there for
/// how an algorithm reaches them). Device memory; stream-ordered; no allocation, no host sync.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/page_bounds_view.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cuda/cache_ops.hpp"
#include "kvsift/cuda/context.hpp"
#include "kvsift/cuda/decode.hpp"
#include "kvsift/cuda/page_bounds.hpp"
#include "kvsift/cuda/primitives.hpp"
#include "kvsift/cuda/topk.hpp"

namespace kvsift::cuda {

/// Threads whose scratch a workspace query sizes: none on the GPU (the device's SMs are fixed).
inline std::int32_t workspace_threads(const Context&) { return 0; }

template <class T>
void sequence_lengths(const KVCache<const T>& cache, std::int32_t* lengths, const Context& ctx) {
  cuda::sequence_lengths(cache, lengths, ctx.stream);
}
template <class T>
void write_step_kv(const KVCache<T>& cache, const HeadsView<const T>& k, const HeadsView<const T>& v,
                   const Context& ctx) {
  cuda::write_step_kv(cache, k, v, ctx.stream);
}
inline void clear_counts(const SelectionView& out, const Context& ctx) { cuda::clear_counts(out, ctx.stream); }

inline std::size_t group_scores_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                                std::int32_t max_tokens, const cpu::GroupScoreOptions& options,
                                                const Context&) {
  return cuda::group_scores_workspace_bytes(batch, q_heads, kv_heads, max_tokens, options);
}
template <class T>
void group_scores(const QueryView<const T>& q, const KVCache<const T>& cache, const MatrixView<float>& scores,
                  const cpu::GroupScoreOptions& options, std::span<std::byte> workspace, const Context& ctx) {
  cache.visit([&](const auto& kv) { cuda::group_scores(q, kv, scores, options, workspace, ctx.stream); });
}

inline std::size_t topk_rows_workspace_bytes(std::int64_t score_rows, std::int32_t max_tokens, std::int32_t k,
                                             const TopKRowsOptions& options, const Context&) {
  return cuda::topk_rows_workspace_bytes(score_rows, max_tokens, k, options);
}
inline void topk_rows(const MatrixView<const float>& scores, const std::int32_t* lengths, std::int32_t k,
                      const TopKRowsOptions& options, const SelectionView& out, std::span<std::byte> workspace,
                      const Context& ctx) {
  cuda::topk_rows(scores, lengths, k, options, out, workspace, ctx.stream);
}

template <class T>
void build_page_bounds(const KVCache<const T>& cache, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                       const Context& ctx) {
  cache.visit([&](const auto& kv) { cuda::build_page_bounds(kv, slots, bounds, ctx.stream); });
}
template <class T>
void append_page_bounds(const KVCache<const T>& cache, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                        const Context& ctx) {
  cache.visit([&](const auto& kv) { cuda::append_page_bounds(kv, slots, bounds, ctx.stream); });
}
template <class T>
void page_scores(const QueryView<const T>& q, const PageBoundsView<const T>& bounds, const std::int32_t* slots,
                 const std::int32_t* lengths, const AttentionWindow& window, const MatrixView<float>& scores,
                 std::int32_t* page_counts, const Context& ctx) {
  cuda::page_scores(q, bounds, slots, lengths, window, scores, page_counts, ctx.stream);
}
inline void expand_pages(const SelectionView& pages, std::int32_t page_size, const std::int32_t* lengths,
                         const AttentionWindow& window, const SelectionView& out, const Context& ctx) {
  cuda::expand_pages(pages, page_size, lengths, window, out, ctx.stream);
}

/// Sparse decode of the window and the selection, O in the storage type or fp32 (TO).
inline std::size_t sparse_decode_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                                 std::int32_t head_dim, std::int32_t capacity,
                                                 std::int32_t /*max_seq_len*/, const AttentionOptions& attention,
                                                 bool validate_indices, const Context&) {
  return cuda::sparse_decode_workspace_bytes(
      SparseDecodeShape{batch, q_heads, kv_heads, head_dim, capacity},
      DecodeOptions{.attention = attention, .validate_indices = validate_indices});
}
template <class T, class TO>
void sparse_decode(const QueryView<const T>& q, const KVCache<const T>& cache, const SelectionView& selection,
                   const StateView<TO>& out, const AttentionOptions& attention, bool validate_indices,
                   bool programmatic_launch, std::span<std::byte> workspace, const Context& ctx) {
  const DecodeOptions options{
      .attention = attention, .validate_indices = validate_indices, .programmatic_launch = programmatic_launch};
  cache.visit([&](const auto& kv) { cuda::sparse_decode(q, kv, selection, out, workspace, ctx.stream, options); });
}

}  // namespace kvsift::cuda
