// Batched k-means on the CPU (cpu/kmeans.hpp): the per-problem math of core/kmeans_batched.hpp in plain loops
// (the CUDA kernels map its segments to threads and its groups to warps), the assignment by the SIMD assigner
// of cpu::assign_nearest, the update by one segment_mean over every problem's clusters.
#include "kvsift/cpu/kmeans.hpp"

#include <algorithm>
#include <array>
#include <cmath>

#include "kvsift/core/detail/kmeans_checks.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kmeans_seeding.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/segment_mean.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu {
namespace {

using kvsift::detail::kSeedGroup;
using kvsift::detail::kSeedGroups;
using kvsift::detail::kSeedSegments;

struct BatchedKMeansWorkspace {
  float* points;        ///< [problems, n, dim]: fp32, normalized for cosine
  float* nearest;       ///< [problems, n]: seeding distances; reseed keys
  std::int32_t* keys;   ///< [problems, n]: p * clusters + assignment, the update's segments
  std::int32_t* counts; ///< [problems, clusters]; mini-batch: 1 once a cluster has drawn a point
  std::span<std::byte> segment_mean;
  float* panels;        ///< [problems, panel_floats]: each problem's centroids packed for the assigner
  std::size_t panel_floats;
  // keys, segment_mean and panels serve the full batch only; the rest below the mini-batch only (else null).
  std::int32_t* drawn;        ///< [problems, batch]: the step's points
  std::int32_t* drawn_nearest;  ///< [problems, batch]: their nearest centroids
  double* absorbed;           ///< [problems, clusters]: the weight each centroid has absorbed
  double* sums;               ///< [problems, clusters, dim + 1]: the step's weighted sums, then its weight
};

BatchedKMeansWorkspace layout_batched_kmeans(WorkspaceLayout& layout, std::int32_t problems, std::int64_t n,
                                             std::int32_t dim, const BatchedKMeansConfig& config) {
  constexpr const char* what = "batched k-means workspace";
  const std::int32_t clusters = config.clusters;
  const std::size_t rows = checked_mul(std::size_t(problems), std::size_t(n), what);
  const std::size_t segments = checked_mul(std::size_t(problems), std::size_t(clusters), what);
  BatchedKMeansWorkspace ws{};
  ws.points = layout.allocate<float>(checked_mul(rows, std::size_t(dim), what), "kmeans_batched points");
  ws.nearest = layout.allocate<float>(rows, "kmeans_batched nearest distances");
  ws.counts = layout.allocate<std::int32_t>(segments, "kmeans_batched cluster counts");
  if (kvsift::detail::is_minibatch(config.batch_size, n)) {
    const std::size_t drawn = checked_mul(std::size_t(problems), std::size_t(config.batch_size), what);
    ws.drawn = layout.allocate<std::int32_t>(drawn, "kmeans_batched drawn points");
    ws.drawn_nearest = layout.allocate<std::int32_t>(drawn, "kmeans_batched drawn points' centroids");
    ws.absorbed = layout.allocate<double>(segments, "kmeans_batched absorbed weights");
    ws.sums = layout.allocate<double>(checked_mul(segments, std::size_t(dim) + 1, what), "kmeans_batched step sums");
    return ws;
  }
  ws.keys = layout.allocate<std::int32_t>(rows, "kmeans_batched update keys");
  ws.segment_mean =
      layout.span(segment_mean_workspace_bytes(std::int64_t(rows), std::int32_t(segments)), "kmeans_batched segment_mean");
  ws.panel_floats = checked_mul(std::size_t(detail::score_panel_padded(clusters)), std::size_t(dim) + 1, what);
  ws.panels = layout.allocate<float>(checked_mul(std::size_t(problems), ws.panel_floats, what), "kmeans_batched panels");
  return ws;
}

/// The segments' offsets (group offset, then the group's earlier segments in order) and the total (the groups
/// in order): the CUDA seeding kernel's warp loops, in the same order.
double seed_offsets(const std::array<double, kSeedSegments>& totals, std::array<double, kSeedSegments>& offsets) {
  double group_offset = 0.0;
  for (int g = 0; g < kSeedGroups; ++g) {
    double group_sum = 0.0, running = group_offset;
    for (int j = 0; j < kSeedGroup; ++j) {
      offsets[g * kSeedGroup + j] = running;
      running += totals[g * kSeedGroup + j];
      group_sum += totals[g * kSeedGroup + j];
    }
    group_offset += group_sum;
  }
  return group_offset;
}

/// Greedy k-means++ seeding of one problem (cpu/kmeans.hpp step 2): x [n, dim] fp32, weights [n] or null,
/// centroids [clusters, dim] out, nearest [n] scratch.
void seed_problem(const float* x, const float* weights, std::int64_t n, std::int32_t dim, bool cosine,
                  std::int32_t clusters, std::uint64_t seed, float* centroids, float* nearest) {
  using namespace kvsift::detail;
  const int per_step = kmeans_candidates_per_step(clusters);
  std::array<double, kSeedSegments> totals{}, offsets{};
  std::array<std::int64_t, 64> candidates{};  // 2 + ln k < 24 for every k < 2^31
  std::array<double, 64> potentials{};
  std::int64_t chosen = kmeans_first_point(seed, n);
  std::copy_n(x + chosen * dim, dim, centroids);
  for (std::int32_t c = 1; c < clusters; ++c) {
    const float* previous = centroids + std::int64_t(c - 1) * dim;
    for (int s = 0; s < kSeedSegments; ++s) {
      const SeedSegment seg = seed_segment(n, s);
      double total = 0.0;
      for (std::int64_t i = seg.begin; i < seg.end; ++i) {
        const float d = kmeans_distance(x + i * dim, previous, dim, cosine);
        nearest[i] = c == 1 ? d : min_distance(nearest[i], d);
        total = add_potential(total, weights, i, nearest[i]);
      }
      totals[s] = total;
    }
    const double total = seed_offsets(totals, offsets);
    int drawn = 1, best = 0;
    if (total > 0.0) {
      drawn = per_step;
      for (int t = 0; t < drawn; ++t) {
        candidates[t] = draw_seed_candidate(offsets.data(), totals.data(), nearest, weights, n,
                                            kmeans_draw_target(seed, std::uint32_t(c), std::uint32_t(t), total));
      }
      for (int first = 0; first < drawn; first += kSeedCandidatesPerPass) {
        const int count = std::min(kSeedCandidatesPerPass, drawn - first);
        std::array<double, kSeedCandidatesPerPass> sums{};
        for (int g = 0; g < kSeedGroups; ++g) {
          std::array<double, kSeedCandidatesPerPass> group{};
          for (int j = 0; j < kSeedGroup; ++j) {
            const SeedSegment seg = seed_segment(n, g * kSeedGroup + j);
            std::array<double, kSeedCandidatesPerPass> partial{};
            for (std::int64_t i = seg.begin; i < seg.end; ++i) {
              for (int t = 0; t < count; ++t) {
                const float d = kmeans_distance(x + i * dim, x + candidates[first + t] * dim, dim, cosine);
                partial[t] = add_potential(partial[t], weights, i, min_distance(nearest[i], d));
              }
            }
            for (int t = 0; t < count; ++t) group[t] += partial[t];
          }
          for (int t = 0; t < count; ++t) sums[t] += group[t];
        }
        for (int t = 0; t < count; ++t) potentials[first + t] = sums[t];
      }
      for (int t = 1; t < drawn; ++t) {
        if (potentials[t] < potentials[best]) best = t;
      }
    } else {
      candidates[0] = (chosen + 1) % n;  // every point's potential is 0: the next point in order
    }
    chosen = candidates[best];
    std::copy_n(x + chosen * dim, dim, centroids + std::int64_t(c) * dim);
  }
}

/// EmptyCluster::reseed for one problem: its clusters with counts 0, in ascending id, take rows in the reseed
/// order (core/kmeans_batched.hpp). Row r is point ids[r] (r without ids): its key is the point's weight times
/// its distance to centroid assignment[r], and ties go to the smaller point, so a point drawn twice serves once.
void reseed_problem(const float* x, const float* weights, const std::int32_t* ids, std::int64_t rows, std::int32_t dim,
                    bool cosine, std::int32_t clusters, const std::int32_t* assignment, const std::int32_t* counts,
                    float* centroids, float* keys) {
  using namespace kvsift::detail;
  if (std::find(counts, counts + clusters, 0) == counts + clusters) return;
  for (std::int64_t r = 0; r < rows; ++r) keys[r] = reseed_key(x, weights, ids, r, centroids, assignment, dim, cosine);
  ReseedPick previous{-1, INFINITY};
  for (std::int32_t c = 0; c < clusters; ++c) {
    if (counts[c] != 0) continue;
    const ReseedPick best = next_reseed_pick(keys, ids, 0, rows, previous);
    if (best.point < 0) return;  // every point taken (or NaN keys)
    std::copy_n(x + best.point * dim, dim, centroids + std::int64_t(c) * dim);
    previous = best;
  }
}

/// Step 3's end for one problem: cosine centroids normalized, empty clusters reseeded.
void finish_problem(const float* x, const float* weights, std::int64_t n, std::int32_t dim, bool cosine, bool reseed,
                    std::int32_t clusters, const std::int32_t* assignment, const std::int32_t* counts, float* centroids,
                    float* keys) {
  for (std::int32_t c = 0; c < clusters && cosine; ++c) {
    if (counts[c] > 0) kvsift::detail::normalize_row(centroids + std::int64_t(c) * dim, dim);
  }
  if (reseed) reseed_problem(x, weights, nullptr, n, dim, cosine, clusters, assignment, counts, centroids, keys);
}

/// One mini-batch step's update of one problem (BatchedKMeansConfig::batch_size): the drawn points' weights and
/// weighted sums per centroid in batch order, then each centroid that drew weight moves to its running weighted
/// mean and, for cosine, is normalized. counts: set to 1 for every centroid that draws a point.
void minibatch_update(const float* x, const float* weights, std::int32_t batch, std::int32_t dim, bool cosine,
                      std::int32_t clusters, const std::int32_t* drawn, const std::int32_t* drawn_nearest,
                      std::int32_t* counts, double* absorbed, double* sums, float* centroids) {
  using namespace kvsift::detail;
  const std::int64_t stride = std::int64_t(dim) + 1;
  std::fill_n(sums, clusters * stride, 0.0);
  for (std::int32_t b = 0; b < batch; ++b) {
    const std::int64_t i = drawn[b];
    const float w = weights == nullptr ? 1.0f : weights[i];
    double* sum = sums + drawn_nearest[b] * stride;
    for (std::int32_t j = 0; j < dim; ++j) sum[j] = add_minibatch_sum(sum[j], w, x[i * dim + j]);
    sum[dim] += double(w);
    counts[drawn_nearest[b]] = 1;
  }
  for (std::int32_t c = 0; c < clusters; ++c) {
    const double* sum = sums + c * stride;
    if (!(sum[dim] > 0.0)) continue;  // no weight drawn: the centroid stays
    const double after = absorbed[c] + sum[dim];
    float* centroid = centroids + std::int64_t(c) * dim;
    for (std::int32_t j = 0; j < dim; ++j) centroid[j] = minibatch_channel(centroid[j], absorbed[c], sum[j], after);
    absorbed[c] = after;
    if (cosine) normalize_row(centroid, dim);
  }
}

/// Points per assignment work item.
constexpr std::int64_t kAssignRows = 1024;

}  // namespace

std::int64_t detail::score_panel_padded(std::int64_t count) {
  constexpr std::int64_t kPad = ScorePanel::kPanelPadding;
  return (count + kPad - 1) / kPad * kPad;
}

detail::ScorePanel detail::pack_score_panel(const MatrixView<const float>& vectors, bool with_half_norms, float* tiles,
                                            float* offsets) {
  constexpr std::int64_t kPad = ScorePanel::kPanelPadding;
  ScorePanel panel;
  panel.dim = vectors.cols;
  panel.count = vectors.rows;
  panel.padded = score_panel_padded(vectors.rows);
  std::fill_n(tiles, panel.padded * vectors.cols, 0.0f);
  std::fill_n(offsets, panel.padded, 0.0f);
  for (std::int64_t c = 0; c < vectors.rows; ++c) {
    float norm = 0.0f;
    float* tile_column = tiles + (c / kPad) * vectors.cols * kPad + c % kPad;
    for (std::int32_t j = 0; j < vectors.cols; ++j) {
      const float x = vectors.row(c)[j];
      tile_column[std::int64_t(j) * kPad] = x;
      norm += x * x;
    }
    if (with_half_norms) offsets[c] = -0.5f * norm;
  }
  panel.tiles = tiles;
  panel.offsets = offsets;
  return panel;
}

std::size_t batched_kmeans_workspace_bytes(std::int32_t problems, std::int64_t n, std::int32_t dim,
                                           const BatchedKMeansConfig& config, const Context&) {
  kvsift::detail::check_batched_kmeans_shape("cpu::batched_kmeans_workspace_bytes", problems, n, dim, config);
  WorkspaceLayout counting;
  layout_batched_kmeans(counting, problems, n, dim, config);
  return counting.bytes();
}

template <class T>
void kmeans_batched(const BatchedMatrixView<const T>& points, const float* weights, const BatchedKMeansConfig& config,
                    float* centroids, std::int32_t* assignment, std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cpu::kmeans_batched";
  kvsift::detail::check_batched_kmeans(where, points, weights, config, centroids, assignment);
  const std::int32_t problems = points.problems, dim = points.cols, k = config.clusters;
  const std::int64_t n = points.rows;
  for (std::int64_t i = 0; weights != nullptr && i < problems * n; ++i) {
    KVSIFT_CHECK(std::isfinite(weights[i]) && weights[i] >= 0.0f, where,
                 "weights[{}] (= {}) is not a finite value >= 0 (problem {}, point {})", i, weights[i], i / n, i % n);
  }
  WorkspaceLayout layout(workspace, where);
  const BatchedKMeansWorkspace ws = layout_batched_kmeans(layout, problems, n, dim, config);
  const bool cosine = config.metric == KMeansMetric::cosine;
  const auto problem_points = [&](std::int64_t p) { return ws.points + p * n * dim; };
  const auto problem_weights = [&](std::int64_t p) { return weights == nullptr ? nullptr : weights + p * n; };
  const auto problem_centroids = [&](std::int64_t p) { return centroids + p * k * dim; };

  const std::int64_t row_items = (n + kAssignRows - 1) / kAssignRows;
  parallel_for(ctx.pool, problems * row_items, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int64_t p = item / row_items, first = item % row_items * kAssignRows;
      for (std::int64_t i = first; i < std::min(n, first + kAssignRows); ++i) {
        const T* src = points.row(p, i);
        float* dst = problem_points(p) + i * dim;
        for (std::int32_t c = 0; c < dim; ++c) dst[c] = to_float(src[c]);
        if (cosine) kvsift::detail::normalize_row(dst, dim);
      }
    }
  });
  parallel_for(ctx.pool, problems, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t p = begin; p < end; ++p) {
      seed_problem(problem_points(p), problem_weights(p), n, dim, cosine, k,
                   kvsift::detail::batched_kmeans_seed(config.seed, p), problem_centroids(p), ws.nearest + p * n);
    }
  });

  const auto assign = [&] {
    parallel_for(ctx.pool, problems, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t p = begin; p < end; ++p) {
        float* panel = ws.panels + p * ws.panel_floats;
        detail::pack_score_panel(MatrixView<const float>::packed(problem_centroids(p), k, dim), !cosine, panel,
                                 panel + detail::score_panel_padded(k) * dim);
      }
    });
    with_simd_level([&]<SimdLevel L>() {
      parallel_for(ctx.pool, problems * row_items, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t item = begin; item < end; ++item) {
          const std::int64_t p = item / row_items, first = item % row_items * kAssignRows, last = std::min(n, first + kAssignRows);
          const float* panel = ws.panels + p * ws.panel_floats;
          const detail::ScorePanel ranked{.tiles = panel, .offsets = panel + detail::score_panel_padded(k) * dim,
                                          .dim = dim, .count = k, .padded = detail::score_panel_padded(k)};
          std::int32_t* out = assignment + p * n;
          detail::assign_rows<L>(MatrixView<const float>::packed(problem_points(p), n, dim), ranked, out, first, last);
          for (std::int64_t i = first; i < last; ++i) ws.keys[p * n + i] = std::int32_t(p * k + out[i]);
        }
      });
    });
  };
  const bool reseed = config.empty == EmptyCluster::reseed;
  if (!kvsift::detail::is_minibatch(config.batch_size, n)) {
    const auto all_points = MatrixView<const float>::packed(ws.points, problems * n, dim);
    const auto all_centroids = MatrixView<float>::packed(centroids, std::int64_t(problems) * k, dim);
    for (std::int32_t it = 0; it < config.iterations; ++it) {
      assign();
      segment_mean(all_points, ws.keys, problems * k, weights, all_centroids, ws.counts, ws.segment_mean, ctx);
      parallel_for(ctx.pool, problems, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t p = begin; p < end; ++p) {
          finish_problem(problem_points(p), problem_weights(p), n, dim, cosine, reseed, k, assignment + p * n,
                         ws.counts + p * k, problem_centroids(p), ws.nearest + p * n);
        }
      });
    }
    assign();
    return;
  }

  // Mini-batch steps: the core/kmeans_batched.hpp functions, per drawn point and per cluster, as the CUDA kernels.
  const std::int32_t batch = config.batch_size;
  std::fill_n(ws.counts, std::int64_t(problems) * k, 0);
  std::fill_n(ws.absorbed, std::int64_t(problems) * k, 0.0);
  for (std::int32_t it = 0; it < config.iterations; ++it) {
    parallel_for(ctx.pool, problems, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t p = begin; p < end; ++p) {
        const std::uint64_t problem_seed = kvsift::detail::batched_kmeans_seed(config.seed, p);
        std::int32_t* drawn = ws.drawn + p * batch;
        std::int32_t* drawn_nearest = ws.drawn_nearest + p * batch;
        for (std::int32_t b = 0; b < batch; ++b) {
          drawn[b] = std::int32_t(kvsift::detail::minibatch_point(problem_seed, it, b, n));
          drawn_nearest[b] = kvsift::detail::nearest_centroid(problem_points(p) + std::int64_t(drawn[b]) * dim,
                                                              problem_centroids(p), k, dim, cosine);
        }
        minibatch_update(problem_points(p), problem_weights(p), batch, dim, cosine, k, drawn, drawn_nearest,
                         ws.counts + p * k, ws.absorbed + p * k, ws.sums + p * k * (std::int64_t(dim) + 1),
                         problem_centroids(p));
        if (reseed) {
          reseed_problem(problem_points(p), problem_weights(p), drawn, batch, dim, cosine, k, drawn_nearest,
                         ws.counts + p * k, problem_centroids(p), ws.nearest + p * n);
        }
      }
    });
  }
  parallel_for(ctx.pool, problems * row_items, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int64_t p = item / row_items, first = item % row_items * kAssignRows;
      for (std::int64_t i = first; i < std::min(n, first + kAssignRows); ++i) {
        assignment[p * n + i] =
            kvsift::detail::nearest_centroid(problem_points(p) + i * dim, problem_centroids(p), k, dim, cosine);
      }
    }
  });
}

#define KVSIFT_INSTANTIATE(T)                                                                                     \
  template void kmeans_batched<T>(const BatchedMatrixView<const T>&, const float*, const BatchedKMeansConfig&,    \
                                  float*, std::int32_t*, std::span<std::byte>, const Context&);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cpu
