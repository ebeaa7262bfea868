#pragma once
/// Per-ISA kernels of the CPU primitives (cpu/primitives.hpp): defined in primitives-inl.hpp, instantiated
/// only in src/cpu/primitives_<level>.cpp, dispatched once per call from src/cpu/primitives.cpp.

#include <cstdint>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/detail/decode_kernels.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu::detail {

/// group_scores (cpu/primitives.hpp) cuts each (sequence, kv head) row into chunks of this many tokens, one
/// work item each. The chunk is fixed, not derived from the thread count, because the softmax path sums each
/// head's exponentials chunk by chunk: the results then depend on no thread count. A multiple of the token
/// block (kTokenBlock, decode_kernels.hpp), so blocks never straddle chunks.
inline constexpr std::int32_t kScoreChunk = 2048;
static_assert(kScoreChunk % kTokenBlock == 0);

/// Everything one group_scores call needs. Rows are (sequence, kv head) pairs, row = b * kv_heads + g; a work
/// item is one chunk of one row, item = row * chunks + chunk.
template <class T, class KV>
struct GroupScoreJob {
  QueryView<const T> q;
  KV kv;
  MatrixView<float> scores;  ///< [rows, >= longest sequence]
  std::int32_t group = 1;    ///< query heads per kv head
  float scale = 1.0f;        ///< resolved sm_scale
  bool sum = false;          ///< reduce over the group by sum (else by max)
  bool softmax = false;      ///< reduce softmax weights (else raw logits)
  std::int32_t chunks = 1;   ///< per row: ceil(scores.cols / kScoreChunk)
  std::int32_t heads_per_row = 0;  ///< softmax: heads reduced into each score row (0: the whole group)
  float* logits = nullptr;     ///< softmax: [rows, group, scores.cols], scaled logits (natural units)
  float* chunk_max = nullptr;  ///< softmax: [rows, chunks, group], each chunk's largest logit per head
  float* chunk_sum = nullptr;  ///< softmax: [rows, chunks, group], sum over the chunk of exp(logit - chunk_max)
  /// Optional (cpu::candidate_scores): row r scores its candidates instead of every token, position t being
  /// token ids[r * id_stride + t] for t < counts[r].
  const std::int32_t* ids = nullptr;
  const std::int32_t* counts = nullptr;
  std::int64_t id_stride = 0;

  /// Positions the row scores: its candidates, or every token of sequence b.
  std::int32_t length(std::int64_t row, std::int64_t b) const { return ids != nullptr ? counts[row] : kv.seq_len(b); }
  /// The token at position t of the row.
  std::int32_t token(std::int64_t row, std::int32_t t) const { return ids != nullptr ? ids[row * id_stride + t] : t; }
};

/// Phase 1 of group_scores, work items [begin, end): every head's logits of the item's tokens, each key row
/// read once per tile of kHeadTile heads. Raw: reduced over the group straight into job.scores. Softmax:
/// written to job.logits, with the chunk's maximum and exponential sum per head (NaN once a logit is NaN or
/// +inf). use_bf16_dot selects vdpbf16ps (avx512, bfloat16 storage, head_dim a multiple of 32).
template <SimdLevel L, class T, class KV>
void group_logits_items(const GroupScoreJob<T, KV>& job, std::int64_t begin, std::int64_t end, bool use_bf16_dot);

/// Phase 2 of group_scores (softmax only), work items [begin, end): each head's LSE from its row's chunk
/// partials, then the weights exp(logit - LSE) reduced over the group into job.scores; a row where some head
/// has no finite LSE gets NaN.
template <SimdLevel L, class T, class KV>
void group_softmax_items(const GroupScoreJob<T, KV>& job, std::int64_t begin, std::int64_t end);

/// scores[i] = scale * dot(q, rows.row(i)) for i in [begin, end).
template <SimdLevel L, class T>
void gemv_rows(const float* q, const MatrixView<const T>& rows, float scale, float* scores, std::int64_t begin,
               std::int64_t end);

/// Vectors packed for blocked scoring (as a GEMM packs its B operand): column c holds one vector, and tiles
/// of kPanelPadding columns are stored one after another, each channel-major, so element j of column c is
/// at tiles[((c / kPanelPadding) * dim + j) * kPanelPadding + c % kPanelPadding]; a block of columns then
/// reads contiguous memory. Columns past `count` (up to `padded`) are zero. Every score of column c starts
/// from offsets[c] (e.g. -|c|^2 / 2 for L2 nearest-centroid ranking).
struct ScorePanel {
  static constexpr std::int64_t kPanelPadding = 32;  ///< a multiple of every level's block of columns
  const float* tiles = nullptr;
  const float* offsets = nullptr;
  std::int32_t dim = 0;
  std::int64_t count = 0;
  std::int64_t padded = 0;
};

/// scores[r * score_stride + c] = offsets[c] + rows.row(r) . column c, for every row and the columns
/// [column_begin, column_end) (column_begin a multiple of kPanelPadding).
template <SimdLevel L>
void score_rows(const MatrixView<const float>& rows, const ScorePanel& panel, float* scores, std::int64_t score_stride,
                std::int64_t column_begin, std::int64_t column_end);

/// assignment[i] = the column with the largest score for point i (ties: smaller column), i in [begin, end).
template <SimdLevel L>
void assign_rows(const MatrixView<const float>& points, const ScorePanel& panel, std::int32_t* assignment,
                 std::int64_t begin, std::int64_t end);

}  // namespace kvsift::cpu::detail
