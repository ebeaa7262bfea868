#pragma once
/// CPU primitives shared by every selector (no selector writes its own): scoring the decode query's GQA
/// groups against the KV cache, and the nearest-centroid assignment. Top-K lives in cpu/topk.hpp, RoPE in
/// cpu/rope.hpp, segment means in cpu/segment_mean.hpp, batched k-means in cpu/kmeans.hpp.
/// Host memory. Deterministic: the same inputs give the same outputs, whatever the thread count.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/kmeans_batched.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cpu {

/// Bytes of host workspace (256-byte aligned) group_scores needs for a batch of `batch` sequences with
/// q_heads query and kv_heads KV heads, scored into a matrix of max_tokens = scores.cols columns: 0 without
/// options.softmax, else the softmax path's logits, 4 * batch * q_heads * max_tokens bytes, plus two floats
/// per (row, head, chunk of 2048 tokens). Independent of the thread count (so are the results).
std::size_t group_scores_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                         std::int32_t max_tokens, const GroupScoreOptions& options);

/// Scores every cached token for every GQA group of the decode query: for each row (sequence b, kv head g),
/// row = b * kv_heads + g, and token t < kv.seq_len(b),
///   s_h,t = sm_scale * q_h . k_t for the group's query heads h in [g * group, (g + 1) * group),
///           group = q_heads / kv_heads (fp32 accumulation; the fp32 dot products' rounding depends on the SIMD
///           level, and bf16 storage uses vdpbf16ps where the CPU has it and head_dim % 32 == 0),
///   scores.row(row)[t] = reduce over h of s_h,t, or with options.softmax of exp(s_h,t - LSE_h), LSE_h the
///           natural-log log-sum-exp of head h's logits over the row's tokens [0, seq_len(b)).
/// Sum reduces heads in ascending order. Each key row is read once per tile of 8 heads of a group (once for
/// groups up to 8); V is never read.
///
/// Shapes: q [batch, q_heads, head_dim] in the storage type T (half, bfloat16, or float for references and
/// tests), head_dim <= 256; kv contiguous or paged (ContiguousKVView<const T>, PagedKVView<const T>) with the
/// same batch and head_dim, q_heads a multiple of kv_heads; scores [batch * kv_heads, >= every seq_len] fp32.
/// Entries past seq_len(b) are not written; an empty sequence writes nothing. All memory is host memory.
///
/// NaN never vanishes (as attention/state.hpp): a NaN in q, k or sm_scale gives NaN scores (raw: the tokens
/// whose logit is NaN, through max as through sum; softmax: the whole row, as does a +inf logit or a head
/// whose logits are all -inf, since that head has no softmax).
///
/// workspace: group_scores_workspace_bytes(batch, q_heads, kv_heads, scores.cols, options) bytes, 256-byte
/// aligned; its contents need not be initialized, and a smaller buffer is refused. Threads: (row, chunk of
/// 2048 tokens) items on `pool` (nullptr: the calling thread); the chunking is fixed, so the results are
/// identical for every thread count. No allocation. Reentrant with distinct workspaces and outputs.
template <class T, class KV>
void group_scores(const QueryView<const T>& q, const KV& kv, const MatrixView<float>& scores,
                  const GroupScoreOptions& options, std::span<std::byte> workspace, ThreadPool* pool = nullptr);

/// Fills assignment[i] with the nearest centroid of point i under the metric (core/kmeans_batched.hpp; ties:
/// smaller id), ranked by x.c - |c|^2 / 2 (L2) or x.c (cosine) with SIMD dot products, so points almost exactly
/// between two centroids may resolve differently at different SIMD levels. Points are fp32 [n, dim] (normalized
/// for cosine), centroids [k, dim]; host memory. Points in parallel on `pool` (nullptr: the calling thread).
void assign_nearest(const MatrixView<const float>& points, const MatrixView<const float>& centroids, KMeansMetric metric,
                    std::span<std::int32_t> assignment, ThreadPool* pool = nullptr);

}  // namespace kvsift::cpu
