#pragma once
/// vq_topk_rows' composed form (vq_lut_scan into a score matrix, then topk_rows) with its workspace layout, which
/// CUDA takes where its other forms do not apply (selectors/a2ats/cuda/vq.hpp). The backend's primitives are found
/// through the context's namespace: include the backend's header (cuda/backend.hpp) before instantiating.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/ranking.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/a2ats/detail/vq_checks.hpp"
#include "kvsift/selectors/a2ats/vq.hpp"

namespace kvsift::detail {

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
