#pragma once
/// vq_topk_rows' pieces shared by both backends (selectors/a2ats/{cpu,cuda}/vq.hpp): its checks, its workspace
/// layout and the composed form (vq_lut_scan into a score matrix, then topk_rows), which the CPU always takes and
/// CUDA takes where its fused form does not apply. The backend's primitives are found through the context's
/// namespace: include the backend's header (cpu/backend.hpp, cuda/backend.hpp) before instantiating.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/error.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/a2ats/vq.hpp"

namespace kvsift::detail {

/// Score rows per batch row: one per kv head with scan.group_max, else one per query head (their union).
inline std::int32_t vq_topk_score_heads(const VqTopKShape& shape) {
  return shape.scan.group_max ? shape.kv_heads : shape.q_heads;
}

/// topk_rows' heads_per_row for the shape: 1 with scan.group_max, else the group.
inline std::int32_t vq_topk_heads_per_row(const VqTopKShape& shape) {
  return shape.scan.group_max ? 1 : shape.q_heads / shape.kv_heads;
}

/// Positive sizes, q_heads a multiple of kv_heads (the rest is checked by the primitives the run calls).
inline void check_vq_topk_shape(const char* where, const VqTopKShape& s) {
  KVSIFT_CHECK(s.batch > 0 && s.kv_heads > 0 && s.q_heads > 0 && s.q_heads % s.kv_heads == 0, where,
               "batch (= {}), q_heads (= {}) and kv_heads (= {}) must be positive, q_heads a multiple of kv_heads",
               s.batch, s.q_heads, s.kv_heads);
  KVSIFT_CHECK(s.max_tokens > 0, where, "max_tokens (= {}) must be positive", s.max_tokens);
}

/// The shape must be the arguments' (batch, heads, codewords, head_dim), and the options must name the shape's
/// topk_rows: heads_per_row as vq_topk_heads_per_row says.
template <class T>
void check_vq_topk_call(const char* where, const QueryView<const T>& q, const VqCodebook<T>& codebook,
                        const VqTopKShape& s, const TopKRowsOptions& options) {
  check_vq_topk_shape(where, s);
  KVSIFT_CHECK(s.batch == q.batch && s.q_heads == q.heads && s.kv_heads == codebook.kv_heads &&
                   s.codewords == codebook.codewords && s.head_dim == q.head_dim,
               where,
               "shape (batch {}, q_heads {}, kv_heads {}, codewords {}, head_dim {}) is not the arguments' (q: batch {}, "
               "heads {}, head_dim {}; codebook: kv_heads {}, codewords {})",
               s.batch, s.q_heads, s.kv_heads, s.codewords, s.head_dim, q.batch, q.heads, q.head_dim,
               codebook.kv_heads, codebook.codewords);
  KVSIFT_CHECK(options.heads_per_row == vq_topk_heads_per_row(s), where,
               "options.heads_per_row (= {}) must be {} ({}: q_heads {}, kv_heads {})", options.heads_per_row,
               vq_topk_heads_per_row(s), s.scan.group_max ? "1 with scan.group_max" : "the group without it",
               s.q_heads, s.kv_heads);
}

/// The composed form's buffers: the score matrix [batch * score heads, max_tokens], vq_lut_scan's and topk_rows'
/// scratch.
struct VqTopKBuffers {
  MatrixView<float> scores;
  std::span<std::byte> scan, topk;
};

/// The one layout behind vq_topk_rows' workspace query and its run, on both backends.
template <class Context>
VqTopKBuffers vq_topk_layout(WorkspaceLayout& layout, const VqTopKShape& s, const Context& ctx) {
  const std::int64_t rows = std::int64_t(s.batch) * vq_topk_score_heads(s);
  VqTopKBuffers b;
  float* scores = layout.allocate<float>(checked_mul(std::size_t(rows), std::size_t(s.max_tokens), "vq_topk_rows scores"),
                                         "vq_topk_rows scores");
  b.scores = MatrixView<float>::packed(scores, rows, s.max_tokens);
  b.scan = layout.span(vq_lut_scan_workspace_bytes(s.batch, s.q_heads, s.kv_heads, s.codewords, s.head_dim, ctx),
                       "vq_topk_rows scan scratch");
  b.topk = layout.span(topk_rows_workspace_bytes(rows, s.max_tokens, s.k, {.heads_per_row = vq_topk_heads_per_row(s)}, ctx),
                       "vq_topk_rows top-k scratch");
  return b;
}

/// vq_lut_scan into b.scores, then topk_rows.
template <class T, class Context>
void vq_topk_rows_composed(const QueryView<const T>& q, const VqCodebook<T>& codebook,
                           const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots,
                           const std::int32_t* lengths, const VqTopKShape& shape, const TopKRowsOptions& options,
                           const SelectionView& out, const VqTopKBuffers& b, const Context& ctx) {
  vq_lut_scan(q, codebook, codes, slots, lengths, b.scores, shape.scan, b.scan, ctx);
  const MatrixView<const float> scores{b.scores.data, b.scores.rows, b.scores.cols, b.scores.row_stride};
  topk_rows(scores, lengths, shape.k, options, out, b.topk, ctx);
}

}  // namespace kvsift::detail
