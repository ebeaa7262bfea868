#include "kvsift/cpu/primitives.hpp"

#include <type_traits>
#include <vector>

#include "kvsift/core/detail/group_scores_checks.hpp"
#include "kvsift/core/detail/rerank_checks.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/detail/primitives_kernels.hpp"
#include "kvsift/cpu/kmeans.hpp"
#include "kvsift/cpu/rerank.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu {
namespace {

/// Owns a detail::ScorePanel: the rows of `vectors` packed in tiles, and per-column score offsets.
class OwnedScorePanel {
 public:
  /// with_half_norms: offsets -|v|^2 / 2 (L2 nearest-centroid ranking); otherwise 0 (plain dot products).
  OwnedScorePanel(const MatrixView<const float>& vectors, bool with_half_norms)
      : tiles_(std::size_t(detail::score_panel_padded(vectors.rows)) * std::size_t(vectors.cols)),
        offsets_(std::size_t(detail::score_panel_padded(vectors.rows))),
        panel_(detail::pack_score_panel(vectors, with_half_norms, tiles_.data(), offsets_.data())) {}
  const detail::ScorePanel& panel() const { return panel_; }

 private:
  std::vector<float> tiles_, offsets_;
  detail::ScorePanel panel_;
};

/// The softmax path's buffers of group_scores: the single layout behind group_scores_workspace_bytes and
/// the carving in group_scores.
struct GroupScoreWorkspace {
  float* logits = nullptr;
  float* chunk_max = nullptr;
  float* chunk_sum = nullptr;
};

std::int32_t score_chunks(std::int32_t max_tokens) {
  return std::int32_t((std::int64_t(max_tokens) + detail::kScoreChunk - 1) / detail::kScoreChunk);
}

GroupScoreWorkspace layout_group_scores(WorkspaceLayout& layout, std::int64_t rows, std::int32_t group,
                                        std::int32_t max_tokens, const GroupScoreOptions& options) {
  GroupScoreWorkspace ws;
  if (!options.softmax) return ws;
  constexpr const char* what = "cpu group_scores workspace";
  const std::size_t heads = checked_mul(std::size_t(rows), std::size_t(group), what);
  ws.logits = layout.allocate<float>(checked_mul(heads, std::size_t(max_tokens), what), "logits");
  const std::size_t partials = checked_mul(heads, std::size_t(score_chunks(max_tokens)), what);
  ws.chunk_max = layout.allocate<float>(partials, "chunk_max");
  ws.chunk_sum = layout.allocate<float>(partials, "chunk_sum");
  return ws;
}

/// Both phases of a group_scores job (its logits, then with softmax the weights), at the active SIMD level, in
/// work items of one chunk of one row on `pool`.
template <class T, class KV>
void run_group_scores(const detail::GroupScoreJob<T, KV>& job, std::int64_t rows, ThreadPool* pool) {
  const std::int64_t items = rows * job.chunks;
  with_simd_level([&]<SimdLevel L>() {
    const bool bf16_dot = L == SimdLevel::avx512 && std::is_same_v<T, bfloat16> && cpu_has_avx512_bf16();
    parallel_for(pool, items, [&](std::int64_t begin, std::int64_t end) {
      detail::group_logits_items<L, T, KV>(job, begin, end, bf16_dot);
    });
    if (!job.softmax) return;
    parallel_for(pool, items, [&](std::int64_t begin, std::int64_t end) {
      detail::group_softmax_items<L, T, KV>(job, begin, end);
    });
  });
}

}  // namespace

std::size_t group_scores_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                         std::int32_t max_tokens, const GroupScoreOptions& options) {
  return kvsift::detail::group_scores_bytes("cpu::group_scores_workspace_bytes", batch, q_heads, kv_heads, max_tokens,
                                            options, layout_group_scores);
}

template <class T, class KV>
void group_scores(const QueryView<const T>& q, const KV& kv, const MatrixView<float>& scores,
                  const GroupScoreOptions& options, std::span<std::byte> workspace, ThreadPool* pool) {
  constexpr const char* where = "cpu::group_scores";
  kvsift::detail::check_group_scores(where, q, kv, scores, options, MemorySpace::host);
  KVSIFT_CHECK(q.head_dim <= detail::kMaxHeadDim, where, "head_dim (= {}) exceeds the CPU kernels' limit of {}",
               q.head_dim, detail::kMaxHeadDim);
  const std::int64_t rows = std::int64_t(kv.batch) * kv.kv_heads;
  detail::GroupScoreJob<T, KV> job{.q = q,
                                   .kv = kv,
                                   .scores = scores,
                                   .group = q.heads / kv.kv_heads,
                                   .scale = AttentionOptions{.sm_scale = options.sm_scale}.resolved_scale(q.head_dim),
                                   .sum = options.reduce == GroupReduce::sum,
                                   .softmax = options.softmax,
                                   .chunks = score_chunks(scores.cols),
                                   .heads_per_row = options.heads_per_row};
  WorkspaceLayout layout(workspace, where);
  const GroupScoreWorkspace ws = layout_group_scores(layout, rows, job.group, scores.cols, options);
  job.logits = ws.logits;
  job.chunk_max = ws.chunk_max;
  job.chunk_sum = ws.chunk_sum;
  run_group_scores(job, rows, pool);
}

std::size_t candidate_scores_workspace_bytes(std::int64_t rows, std::int32_t group, std::int32_t capacity) {
  kvsift::detail::check_candidate_scores_shape("cpu::candidate_scores_workspace_bytes", rows, group, capacity);
  WorkspaceLayout counting;
  layout_group_scores(counting, rows, group, capacity, {.softmax = true});
  return counting.bytes();
}

template <class T, class KV>
void candidate_scores(const QueryView<const T>& q, const KV& kv, const SelectionView& candidates,
                      const GroupScoreOptions& options, const MatrixView<float>& scores, std::span<std::byte> workspace,
                      ThreadPool* pool) {
  constexpr const char* where = "cpu::candidate_scores";
  kvsift::detail::check_candidate_scores(where, q, kv, candidates, options, scores, MemorySpace::host);
  KVSIFT_CHECK(q.head_dim <= detail::kMaxHeadDim, where, "head_dim (= {}) exceeds the CPU kernels' limit of {}",
               q.head_dim, detail::kMaxHeadDim);
  const std::int64_t rows = std::int64_t(q.batch) * kv.kv_heads;
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int32_t b = std::int32_t(row / kv.kv_heads), count = candidates.counts[row];
    KVSIFT_CHECK(count >= 0 && count <= candidates.capacity, where,
                 "candidates.counts[{}] (= {}) is outside [0, capacity = {}]", row, count, candidates.capacity);
    const std::int32_t* ids = candidates.indices + row * candidates.capacity;
    for (std::int32_t i = 0; i < count; ++i) {
      KVSIFT_CHECK(ids[i] >= 0 && ids[i] < kv.seq_len(b), where,
                   "candidate {} of row {} (= {}) is outside [0, seq_len = {})", i, row, ids[i], kv.seq_len(b));
    }
  }
  // group_scores' job over the candidates: each row's positions indirect through its ids. The score rows are
  // cut to the capacity, which sizes the workspace.
  detail::GroupScoreJob<T, KV> job{.q = q,
                                   .kv = kv,
                                   .scores = {scores.data, rows, candidates.capacity, scores.row_stride},
                                   .group = q.heads / kv.kv_heads,
                                   .scale = AttentionOptions{.sm_scale = options.sm_scale}.resolved_scale(q.head_dim),
                                   .sum = options.reduce == GroupReduce::sum,
                                   .softmax = options.softmax,
                                   .chunks = score_chunks(candidates.capacity),
                                   .ids = candidates.indices,
                                   .counts = candidates.counts,
                                   .id_stride = candidates.capacity};
  WorkspaceLayout layout(workspace, where);
  const GroupScoreWorkspace ws = layout_group_scores(layout, rows, job.group, candidates.capacity, {.softmax = true});
  job.logits = ws.logits;
  job.chunk_max = ws.chunk_max;
  job.chunk_sum = ws.chunk_sum;
  run_group_scores(job, rows, pool);
}

void assign_nearest(const MatrixView<const float>& points, const MatrixView<const float>& centroids, KMeansMetric metric,
                    std::span<std::int32_t> assignment, ThreadPool* pool) {
  constexpr const char* where = "cpu::assign_nearest";
  validate(points, where, "points");
  validate(centroids, where, "centroids");
  KVSIFT_CHECK(points.cols == centroids.cols, where, "points.cols (= {}) != centroids.cols (= {})", points.cols,
               centroids.cols);
  KVSIFT_CHECK(assignment.size() >= std::size_t(points.rows), where, "assignment.size() (= {}) < points.rows (= {})",
               assignment.size(), points.rows);
  const OwnedScorePanel ranked(centroids, /*with_half_norms=*/metric == KMeansMetric::l2);
  with_simd_level([&]<SimdLevel L>() {
    parallel_for(pool, points.rows, [&](std::int64_t begin, std::int64_t end) {
      detail::assign_rows<L>(points, ranked.panel(), assignment.data(), begin, end);
    });
  });
}

#define KVSIFT_INSTANTIATE_GROUP_SCORES(T, KV)                                                                  \
  template void group_scores<T, KV>(const QueryView<const T>&, const KV&, const MatrixView<float>&,                \
                                    const GroupScoreOptions&, std::span<std::byte>, ThreadPool*);
KVSIFT_GROUP_SCORE_TYPES(KVSIFT_INSTANTIATE_GROUP_SCORES)
#define KVSIFT_INSTANTIATE_CANDIDATE_SCORES(T, KV)                                                               \
  template void candidate_scores<T, KV>(const QueryView<const T>&, const KV&, const SelectionView&,              \
                                        const GroupScoreOptions&, const MatrixView<float>&, std::span<std::byte>, \
                                        ThreadPool*);
KVSIFT_GROUP_SCORE_TYPES(KVSIFT_INSTANTIATE_CANDIDATE_SCORES)
#undef KVSIFT_INSTANTIATE_CANDIDATE_SCORES
#undef KVSIFT_INSTANTIATE_GROUP_SCORES

}  // namespace kvsift::cpu
