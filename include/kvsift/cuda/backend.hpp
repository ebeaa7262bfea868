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
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/kmeans_batched.hpp"
#include "kvsift/cuda/cache_ops.hpp"
#include "kvsift/cuda/context.hpp"
#include "kvsift/cuda/decode.hpp"
#include "kvsift/cuda/gather.hpp"
#include "kvsift/cuda/inverted_lists.hpp"
#include "kvsift/cuda/kmeans.hpp"
#include "kvsift/cuda/primitives.hpp"
#include "kvsift/cuda/rope.hpp"
#include "kvsift/cuda/rerank.hpp"
#include "kvsift/cuda/segment_mean.hpp"
#include "kvsift/cuda/topk.hpp"

namespace kvsift::cuda {

constexpr bool backend_included(const Context*) { return true; }  // selectors/selector.hpp BackendIncluded

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
/// out[0..4) = {b, h, t, i} of the cache's first non-finite key among tokens t < lengths[b], or four -1
/// (cuda/cache_ops.hpp). lengths and out: context (device) memory, out 8-byte aligned; stream-ordered, no host
/// sync: read out after synchronizing (copy_to_host).
template <class T>
void first_nonfinite_key(const KVCache<const T>& cache, const std::int32_t* lengths, std::int32_t* out,
                         const Context& ctx) {
  cuda::first_nonfinite_key(cache, lengths, out, ctx.stream);
}

/// Copies n values between context (device) memory and the host, then synchronizes the stream: for a selector's
/// prepare only (lengths, page tables), never append or select.
template <class V>
void copy_to_host(const V* src, std::size_t n, V* dst, const Context& ctx) {
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(V), cudaMemcpyDefault, ctx.stream));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
}
template <class V>
void copy_from_host(const V* src, std::size_t n, V* dst, const Context& ctx) {
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(V), cudaMemcpyDefault, ctx.stream));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));  // src may be gone when the copy would run
}
/// A copy between two arrays of the context's memory, in the context's order: no synchronization, graph capturable.
template <class V>
void copy_within(const V* src, std::size_t n, V* dst, const Context& ctx) {
  if (n > 0) KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * sizeof(V), cudaMemcpyDeviceToDevice, ctx.stream));
}
/// copy_within of `rows` rows of `width` elements, the rows `src_stride` and `dst_stride` elements apart.
template <class V>
void copy_rows_within(const V* src, std::int64_t src_stride, V* dst, std::int64_t dst_stride, std::int64_t width,
                      std::int64_t rows, const Context& ctx) {
  if (width > 0 && rows > 0) {
    KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(dst, std::size_t(dst_stride) * sizeof(V), src, std::size_t(src_stride) * sizeof(V),
                                        std::size_t(width) * sizeof(V), std::size_t(rows), cudaMemcpyDeviceToDevice,
                                        ctx.stream));
  }
}

inline std::size_t group_scores_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                                std::int32_t max_tokens, const GroupScoreOptions& options,
                                                const Context&) {
  return cuda::group_scores_workspace_bytes(batch, q_heads, kv_heads, max_tokens, options);
}
template <class T>
void group_scores(const QueryView<const T>& q, const KVCache<const T>& cache, const MatrixView<float>& scores,
                  const GroupScoreOptions& options, std::span<std::byte> workspace, const Context& ctx) {
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
inline void length_budgets(const std::int32_t* lengths, std::int32_t batch, std::int32_t heads, const LengthBudget& budget,
                           std::int32_t* row_k, const Context& ctx) {
  cuda::length_budgets(lengths, batch, heads, budget, row_k, ctx.stream);
}
inline void mass_budgets(const MatrixView<const float>& scores, const std::int32_t* counts, const MassBudget& budget,
                         std::int32_t* row_k, const Context& ctx) {
  cuda::mass_budgets(scores, counts, budget, row_k, ctx.stream);
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

/// The LSE merge of partial states (a decode step's primary and second-source partials) into `out`.
template <class TI, class TO>
void merge_states(std::span<const StateView<const TI>> partials, const StateView<TO>& out, const Context& ctx) {
  cuda::merge_states<TI, TO>(partials, out, ctx.stream);
}

// Rerank (cuda/rerank.hpp).
inline std::size_t candidate_scores_workspace_bytes(std::int64_t rows, std::int32_t group, std::int32_t capacity,
                                                    const Context&) {
  return cuda::candidate_scores_workspace_bytes(rows, group, capacity);
}
template <class T>
void candidate_scores(const QueryView<const T>& q, const KVCache<const T>& cache, const SelectionView& candidates,
                      const GroupScoreOptions& options, const MatrixView<float>& scores, std::span<std::byte> workspace,
                      const Context& ctx) {
  cache.visit([&](const auto& kv) { cuda::candidate_scores(q, kv, candidates, options, scores, workspace, ctx.stream); });
}
inline void remap_selection(const SelectionView& positions, const SelectionView& ids, const SelectionView& out,
                            const Context& ctx) {
  cuda::remap_selection(positions, ids, out, ctx.stream);
}
inline void append_range(const SelectionView& rows, const std::int32_t* slots, const std::int32_t* first,
                         const std::int32_t* lengths, const AttentionWindow& window, std::int32_t* counts_before,
                         const Context& ctx) {
  cuda::append_range(rows, slots, first, lengths, window, counts_before, ctx.stream);
}

}  // namespace kvsift::cuda

// Each selector's own calls, after the shared ones above, which they use: its primitives, which take the context
// last (selectors/<name>/cuda/), and what it does over them, written once over the context (selectors/<name>/backend.hpp,
// where it has one). This file gathers them, so that including it gives an algorithm the whole backend.
#include "kvsift/selectors/quest/cuda/page_bounds.hpp"
#include "kvsift/selectors/quest/backend.hpp"
#include "kvsift/selectors/ctkvr/cuda/query_centroids.hpp"
#include "kvsift/selectors/csattention/cuda/score_tables.hpp"
#include "kvsift/selectors/a2ats/cuda/vq.hpp"
#include "kvsift/selectors/centroid_kv/cuda/merge_store.hpp"
#include "kvsift/selectors/specontext/cuda/score_rows.hpp"
