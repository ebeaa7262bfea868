#include "kvsift/cpu/primitives.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>

#include "kvsift/core/detail/rerank_checks.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kmeans_seeding.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/detail/primitives_kernels.hpp"
#include "kvsift/cpu/kmeans.hpp"
#include "kvsift/cpu/rerank.hpp"
#include "kvsift/cpu/segment_mean.hpp"
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

void check_heads_per_row(const char* where, std::int32_t group, const GroupScoreOptions& options) {
  if (options.heads_per_row == 0) return;
  KVSIFT_CHECK(options.heads_per_row > 0 && group % options.heads_per_row == 0, where,
               "options.heads_per_row (= {}) must divide the group (q_heads / kv_heads = {})", options.heads_per_row,
               group);
  KVSIFT_CHECK(options.softmax, where, "options.heads_per_row (= {}) needs options.softmax", options.heads_per_row);
}

void check_group_reduce(const char* where, const GroupScoreOptions& options) {
  KVSIFT_CHECK(options.reduce == GroupReduce::max || options.reduce == GroupReduce::sum, where,
               "options.reduce (= {}) is neither GroupReduce::max nor GroupReduce::sum", int(options.reduce));
}

}  // namespace

void detail::check_group_scores_shape(const char* where, std::int32_t batch, std::int32_t q_heads,
                                      std::int32_t kv_heads, std::int32_t max_tokens, const GroupScoreOptions& options) {
  KVSIFT_CHECK(batch > 0 && q_heads > 0 && kv_heads > 0 && max_tokens > 0, where,
               "batch (= {}), q_heads (= {}), kv_heads (= {}) and max_tokens (= {}) must be positive", batch, q_heads,
               kv_heads, max_tokens);
  KVSIFT_CHECK(q_heads % kv_heads == 0, where, "q_heads (= {}) is not a multiple of kv_heads (= {})", q_heads, kv_heads);
  check_group_reduce(where, options);
  check_heads_per_row(where, q_heads / kv_heads, options);
}

template <class T, class KV>
void detail::check_group_scores(const char* where, const QueryView<const T>& q, const KV& kv,
                                const MatrixView<float>& scores, const GroupScoreOptions& options,
                                MemorySpace contents) {
  validate(q, where, "q");
  validate(kv, where, "kv", contents);
  validate(scores, where, "scores");
  check_query_matches_kv(where, q, kv);
  check_group_reduce(where, options);
  const std::int32_t group = q.heads / kv.kv_heads;
  check_heads_per_row(where, group, options);
  const std::int32_t per_row = options.score_rows_per_row(group);
  KVSIFT_CHECK(per_row > 1 || scores.rows == std::int64_t(kv.batch) * kv.kv_heads, where,
               "scores.rows (= {}) != kv.batch * kv.kv_heads (= {} * {})", scores.rows, kv.batch, kv.kv_heads);
  KVSIFT_CHECK(scores.rows == std::int64_t(kv.batch) * kv.kv_heads * per_row, where,
               "scores.rows (= {}) != kv.batch * kv.kv_heads * score rows per kv head (= {} * {} * {})", scores.rows,
               kv.batch, kv.kv_heads, per_row);
  for (std::int32_t b = 0; b < kv.batch && contents == MemorySpace::host; ++b) {
    KVSIFT_CHECK(kv.seq_len(b) <= scores.cols, where, "scores.cols (= {}) < kv.seq_len({}) (= {})", scores.cols, b,
                 kv.seq_len(b));
  }
}

std::size_t group_scores_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                         std::int32_t max_tokens, const GroupScoreOptions& options) {
  detail::check_group_scores_shape("cpu::group_scores_workspace_bytes", batch, q_heads, kv_heads, max_tokens, options);
  WorkspaceLayout counting;
  layout_group_scores(counting, std::int64_t(batch) * kv_heads, q_heads / kv_heads, max_tokens, options);
  return counting.bytes();
}

template <class T, class KV>
void group_scores(const QueryView<const T>& q, const KV& kv, const MatrixView<float>& scores,
                  const GroupScoreOptions& options, std::span<std::byte> workspace, ThreadPool* pool) {
  constexpr const char* where = "cpu::group_scores";
  detail::check_group_scores(where, q, kv, scores, options, MemorySpace::host);
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

template <class T>
void gemv_scores(std::span<const float> q, const MatrixView<const T>& rows, float scale, std::span<float> scores,
                 ThreadPool* pool) {
  constexpr const char* where = "cpu::gemv_scores";
  validate(rows, where, "rows");
  KVSIFT_CHECK(q.size() == std::size_t(rows.cols), where, "q.size() (= {}) != rows.cols (= {})", q.size(), rows.cols);
  KVSIFT_CHECK(scores.size() >= std::size_t(rows.rows), where, "scores.size() (= {}) < rows.rows (= {})", scores.size(),
               rows.rows);
  with_simd_level([&]<SimdLevel L>() {
    parallel_for(pool, rows.rows, [&](std::int64_t begin, std::int64_t end) {
      detail::gemv_rows<L, T>(q.data(), rows, scale, scores.data(), begin, end);
    });
  });
}

template <class T>
void gather_rows(const MatrixView<const T>& src, std::span<const std::int32_t> indices, const MatrixView<T>& dst) {
  constexpr const char* where = "cpu::gather_rows";
  validate(src, where, "src");
  validate(dst, where, "dst");
  KVSIFT_CHECK(dst.cols == src.cols, where, "dst.cols (= {}) != src.cols (= {})", dst.cols, src.cols);
  KVSIFT_CHECK(dst.rows >= std::int64_t(indices.size()), where, "dst.rows (= {}) < number of indices (= {})", dst.rows,
               indices.size());
  for (std::size_t i = 0; i < indices.size(); ++i) {
    KVSIFT_CHECK(indices[i] >= 0 && indices[i] < src.rows, where, "indices[{}] (= {}) is outside [0, src.rows = {})", i,
                 indices[i], src.rows);
    std::copy_n(src.row(indices[i]), src.cols, dst.row(std::int64_t(i)));
  }
}

std::size_t sort_unique(std::span<std::int32_t> indices) {
  std::sort(indices.begin(), indices.end());
  return std::size_t(std::unique(indices.begin(), indices.end()) - indices.begin());
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

void detail::check_kmeans_config(const char* where, std::int64_t points, const KMeansConfig& config) {
  KVSIFT_CHECK(config.clusters >= 1 && config.clusters <= points, where, "config.clusters (= {}) is outside [1, points = {}]",
               config.clusters, points);
  KVSIFT_CHECK(config.iterations >= 0, where, "config.iterations (= {}) must be >= 0", config.iterations);
}

template <class T>
KMeansResult kmeans(const MatrixView<const T>& points, const KMeansConfig& config, const KMeansAssigner& assigner,
                    ThreadPool* pool) {
  constexpr const char* where = "cpu::kmeans";
  validate(points, where, "points");
  detail::check_kmeans_config(where, points.rows, config);
  const std::int64_t n = points.rows;
  const std::int32_t d = points.cols, k = config.clusters;
  std::vector<float> x(std::size_t(n) * d);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int32_t c = 0; c < d; ++c) x[std::size_t(i) * d + c] = to_float(points.row(i)[c]);
    if (config.metric == KMeansMetric::cosine) kvsift::detail::normalize_row(&x[std::size_t(i) * d], d);
  }
  const auto xs = MatrixView<const float>::packed(x.data(), n, d);

  // Greedy k-means++ seeding (as scikit-learn does): each next centroid is the best, by the resulting total
  // distance, of 2 + ln(k) candidates drawn with probability proportional to their distance to the nearest
  // centroid so far. Plain k-means++ seeds two centroids in one well-separated cluster with a probability of
  // about a percent; the greedy draw makes that vanishingly rare. Sums are in double. The draws are those of
  // cuda::kmeans (core/kmeans_seeding.hpp), and a candidate is found as there: the first point whose prefix sum
  // exceeds the drawn target.
  KMeansResult result;
  result.centroids.resize(std::size_t(k) * d);
  const int candidates_per_step = kvsift::detail::kmeans_candidates_per_step(k);
  const auto points_count = static_cast<std::size_t>(n);
  // Distances from every point to a few candidate points at once: one blocked pass over a channel-major copy
  // of the points (the candidates are the block's rows), threaded over ranges of points; then the points'
  // squared norms turn dot products into distances.
  const OwnedScorePanel all_points(xs, /*with_half_norms=*/false);
  std::vector<float> norms(points_count);
  for (std::int64_t i = 0; i < n; ++i) {
    norms[i] = 0.0f;
    for (std::int32_t c = 0; c < d; ++c) norms[i] += xs.row(i)[c] * xs.row(i)[c];
  }
  std::vector<float> candidate_rows(std::size_t(candidates_per_step) * d), dots(std::size_t(candidates_per_step) * points_count);
  std::vector<std::vector<double>> candidate_distances(static_cast<std::size_t>(candidates_per_step),
                                                       std::vector<double>(points_count));
  const auto distances_to = [&](std::span<const std::int64_t> candidates) {
    for (std::size_t t = 0; t < candidates.size(); ++t) std::copy_n(xs.row(candidates[t]), d, &candidate_rows[t * d]);
    const auto rows = MatrixView<const float>::packed(candidate_rows.data(), std::int64_t(candidates.size()), d);
    constexpr std::int64_t kPad = detail::ScorePanel::kPanelPadding;
    with_simd_level([&]<SimdLevel L>() {
      parallel_for(pool, (n + kPad - 1) / kPad, [&](std::int64_t begin, std::int64_t end) {
        detail::score_rows<L>(rows, all_points.panel(), dots.data(), n, begin * kPad, std::min(end * kPad, n));
      });
    });
    for (std::size_t t = 0; t < candidates.size(); ++t) {
      const float* dot = &dots[t * points_count];
      const double own_norm = norms[candidates[t]];
      for (std::int64_t i = 0; i < n; ++i) {
        const double dist = config.metric == KMeansMetric::cosine ? 1.0 - dot[i] : double(norms[i]) - 2.0 * dot[i] + own_norm;
        candidate_distances[t][i] = std::max(0.0, dist);
      }
    }
  };
  std::vector<double> nearest(points_count), trial(points_count), best_trial(points_count), prefix(points_count);
  std::int64_t chosen = kvsift::detail::kmeans_first_point(config.seed, n);
  distances_to(std::span<const std::int64_t>(&chosen, 1));
  nearest = candidate_distances[0];
  std::copy_n(xs.row(chosen), d, &result.centroids[0]);
  std::vector<std::int64_t> candidates;
  for (std::int32_t c = 1; c < k; ++c) {
    std::partial_sum(nearest.begin(), nearest.end(), prefix.begin());
    const double total = prefix.back();
    std::int64_t best = (chosen + 1) % n;  // every point coincides with a centroid: take the next in order
    candidates.clear();
    for (int trial_index = 0; trial_index < candidates_per_step && total > 0.0; ++trial_index) {
      const double target = kvsift::detail::kmeans_draw_target(config.seed, std::uint32_t(c), std::uint32_t(trial_index), total);
      const auto first_above = std::upper_bound(prefix.begin(), prefix.end(), target) - prefix.begin();
      candidates.push_back(std::min<std::int64_t>(first_above, n - 1));
    }
    if (candidates.empty()) candidates.push_back(best);
    distances_to(candidates);
    if (total > 0.0) {
      double best_potential = std::numeric_limits<double>::infinity();
      for (std::size_t t = 0; t < candidates.size(); ++t) {
        double potential = 0.0;
        for (std::int64_t i = 0; i < n; ++i) potential += trial[i] = std::min(nearest[i], candidate_distances[t][i]);
        if (potential < best_potential) {
          best_potential = potential;
          best = candidates[t];
          best_trial.swap(trial);
        }
      }
      nearest.swap(best_trial);
    } else {
      for (std::int64_t i = 0; i < n; ++i) nearest[i] = std::min(nearest[i], candidate_distances[0][i]);
    }
    chosen = best;
    std::copy_n(xs.row(chosen), d, &result.centroids[std::size_t(c) * d]);
  }

  result.assignment.resize(std::size_t(n));
  const auto assign = [&] {
    const auto cs = MatrixView<const float>::packed(result.centroids.data(), k, d);
    if (assigner) {
      assigner(xs, cs, config.metric, result.assignment);
    } else {
      assign_nearest(xs, cs, config.metric, result.assignment, pool);
    }
  };
  // Each centroid becomes the mean of its points (segment_mean: fp64 sums in ascending point order, as
  // cuda::kmeans's update); an empty cluster keeps its centroid.
  const auto centroid_rows = MatrixView<float>::packed(result.centroids.data(), k, d);
  Array<std::byte> update_workspace(segment_mean_workspace_bytes(n, k));
  std::vector<std::int32_t> counts(static_cast<std::size_t>(k));
  for (std::int32_t it = 0; it < config.iterations; ++it) {
    assign();
    segment_mean(xs, result.assignment.data(), k, nullptr, centroid_rows, counts.data(), update_workspace.bytes(), pool);
    for (std::int32_t c = 0; c < k && config.metric == KMeansMetric::cosine; ++c) {
      if (counts[c] > 0) kvsift::detail::normalize_row(centroid_rows.row(c), d);
    }
  }
  assign();  // the returned assignment matches the returned centroids
  return result;
}

#define KVSIFT_INSTANTIATE_GROUP_SCORES(T, KV)                                                                  \
  template void group_scores<T, KV>(const QueryView<const T>&, const KV&, const MatrixView<float>&,                \
                                    const GroupScoreOptions&, std::span<std::byte>, ThreadPool*);                  \
  template void detail::check_group_scores<T, KV>(const char*, const QueryView<const T>&, const KV&,               \
                                                  const MatrixView<float>&, const GroupScoreOptions&, MemorySpace);
KVSIFT_GROUP_SCORE_TYPES(KVSIFT_INSTANTIATE_GROUP_SCORES)
#define KVSIFT_INSTANTIATE_CANDIDATE_SCORES(T, KV)                                                               \
  template void candidate_scores<T, KV>(const QueryView<const T>&, const KV&, const SelectionView&,              \
                                        const GroupScoreOptions&, const MatrixView<float>&, std::span<std::byte>, \
                                        ThreadPool*);
KVSIFT_GROUP_SCORE_TYPES(KVSIFT_INSTANTIATE_CANDIDATE_SCORES)
#undef KVSIFT_INSTANTIATE_CANDIDATE_SCORES
#undef KVSIFT_INSTANTIATE_GROUP_SCORES

#define KVSIFT_INSTANTIATE(T)                                                                                      \
  template void gemv_scores<T>(std::span<const float>, const MatrixView<const T>&, float, std::span<float>, ThreadPool*); \
  template void gather_rows<T>(const MatrixView<const T>&, std::span<const std::int32_t>, const MatrixView<T>&);    \
  template KMeansResult kmeans<T>(const MatrixView<const T>&, const KMeansConfig&, const KMeansAssigner&, ThreadPool*);
KVSIFT_INSTANTIATE(float)
KVSIFT_INSTANTIATE(half)
KVSIFT_INSTANTIATE(bfloat16)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cpu
