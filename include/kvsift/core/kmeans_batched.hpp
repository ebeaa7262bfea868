#pragma once
/// The per-problem math of batched k-means (cpu/kmeans.hpp, cuda/kmeans.hpp), written once for host and
/// device so that both backends compute the same bits: the batched points view, the seeding's distances and
/// its fixed summation order, the draw of a candidate, the centroid normalization and the reseed order.
///
/// The seeding's sums follow one fixed tree, independent of the backend and the thread count: a problem's n
/// points are cut into kSeedSegments segments of ceil(n / kSeedSegments) consecutive points; a segment's sum
/// runs in ascending point order; kSeedGroup consecutive segments form a group, whose sum runs in ascending
/// segment order; the total runs over the groups in order. The CUDA kernel maps a segment to a thread and a
/// group to a warp; the CPU runs the same loops. Every product-and-add is an explicit fused multiply-add, so
/// neither compiler may contract differently.
///
/// The mini-batch mode (BatchedKMeansConfig::batch_size) is written here whole: its draws, its nearest centroid
/// and its centroid step are per-point or per-cluster functions over fixed orders, so the backends agree on its
/// centroids and assignments bit for bit, ties included.

#include <cmath>
#include <cstdint>

#include "kvsift/core/config.hpp"
#include "kvsift/core/kmeans_seeding.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

/// How k-means compares points with centroids (cpu::kmeans_batched, cuda::kmeans_batched, cpu::assign_nearest).
enum class KMeansMetric : std::uint8_t {
  l2,      ///< nearest centroid by squared Euclidean distance; centroid = mean
  cosine,  ///< largest cosine similarity; points and centroids are compared normalized, centroid = normalized mean
};

/// What becomes of a cluster left with no points by a k-means update.
enum class EmptyCluster : std::uint8_t {
  keep,    ///< it keeps its previous centroid
  reseed,  ///< it moves onto a point far from its own centroid (see cpu::kmeans_batched)
};

/// The configuration of cpu::kmeans_batched and cuda::kmeans_batched. In namespace kvsift (not cpu), so that
/// argument-dependent lookup of a CUDA call never reaches the CPU overloads.
struct BatchedKMeansConfig {
  std::int32_t clusters = 0;     ///< per problem, in [1, points per problem]
  std::int32_t iterations = 10;  ///< Lloyd steps, a fixed count (no early stop)
  KMeansMetric metric = KMeansMetric::l2;
  std::uint64_t seed = 0;  ///< problem p draws from seed + p
  EmptyCluster empty = EmptyCluster::keep;
  /// Points per problem that each step draws (mini-batch k-means, Sculley 2010), >= 0. 0, or >= the points per
  /// problem: full-batch Lloyd steps (a batch as large as the problem is the full batch, bit for bit, which is
  /// exact and no dearer than drawing n points with replacement, which would miss about 1/e of them). Otherwise
  /// step t draws batch_size points per problem uniformly with replacement (detail::minibatch_point, from
  /// seed + p and t), assigns them, and moves each centroid that drew weight W (its drawn points' weights) to
  /// (v c + sum of its drawn w x) / (v + W), v += W, where v, the weight the centroid has absorbed since the
  /// seeding, starts at 0: Sculley's per-centroid learning rate 1 / v, a batch at a time. See cpu::kmeans_batched.
  std::int32_t batch_size = 0;
};

namespace detail {

inline constexpr int kSeedSegments = 1024;  ///< segments per problem of the seeding's sums (a CUDA block's threads)
inline constexpr int kSeedGroup = 32;       ///< segments per group (a warp)
inline constexpr int kSeedGroups = kSeedSegments / kSeedGroup;
/// Candidates whose distances one pass over the points computes (registers per CUDA thread); 2 + ln k stays
/// below it for k < 2981, larger k take more passes.
inline constexpr int kSeedCandidatesPerPass = 8;

/// a * b + c rounded once, the same on host and device (float or double).
template <class F>
KVSIFT_HOST_DEVICE inline F fused_multiply_add(F a, F b, F c) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(F) == 4) return __fmaf_rn(a, b, c);
  else return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

/// Problem p's seed: problem p of a batch draws as problem 0 of a batch with seed + p.
KVSIFT_HOST_DEVICE constexpr std::uint64_t batched_kmeans_seed(std::uint64_t seed, std::int64_t problem) {
  return seed + std::uint64_t(problem);
}

/// Points [begin, end) of segment s of n points.
struct SeedSegment {
  std::int64_t begin, end;
};
KVSIFT_HOST_DEVICE inline SeedSegment seed_segment(std::int64_t n, int s) {
  const std::int64_t length = (n + kSeedSegments - 1) / kSeedSegments;
  const std::int64_t begin = s * length < n ? s * length : n;
  return {begin, begin + length < n ? begin + length : n};
}

/// The seeding's distance of two fp32 rows (points normalized for cosine): sum of squared differences (L2, no
/// cancellation) or 1 - dot clamped at 0 (cosine), fp32 fused multiply-adds in ascending channel order.
KVSIFT_HOST_DEVICE inline float kmeans_distance(const float* x, const float* c, std::int32_t dim, bool cosine) {
  float sum = 0.0f;
  if (cosine) {
    for (std::int32_t j = 0; j < dim; ++j) sum = fused_multiply_add<float>(x[j], c[j], sum);
    return sum < 1.0f ? 1.0f - sum : 0.0f;
  }
  for (std::int32_t j = 0; j < dim; ++j) {
    const float diff = x[j] - c[j];
    sum = fused_multiply_add<float>(diff, diff, sum);
  }
  return sum;
}

/// The smaller of two distances (the first if neither is smaller).
KVSIFT_HOST_DEVICE inline float min_distance(float a, float b) { return b < a ? b : a; }

/// The seeding potential of a point: weight * distance, accumulated in fp64.
KVSIFT_HOST_DEVICE inline double add_potential(double sum, const float* weights, std::int64_t i, float distance) {
  return fused_multiply_add<double>(weights == nullptr ? 1.0 : double(weights[i]), double(distance), sum);
}

/// The candidate a draw `target` in [0, total) picks: the last segment whose offset is <= target (stepping back
/// over segments of zero mass), then the first point of it whose running potential exceeds target (its last
/// point if rounding leaves none). offsets/totals: the segments' potential offsets and sums [kSeedSegments];
/// nearest: [n] distances to the nearest centroid so far.
KVSIFT_HOST_DEVICE inline std::int64_t draw_seed_candidate(const double* offsets, const double* totals, const float* nearest,
                                                           const float* weights, std::int64_t n, double target) {
  int low = 0, high = kSeedSegments;  // first segment whose offset exceeds target
  while (low < high) {
    const int mid = (low + high) / 2;
    if (offsets[mid] > target) {
      high = mid;
    } else {
      low = mid + 1;
    }
  }
  int s = low > 0 ? low - 1 : 0;
  while (s > 0 && !(totals[s] > 0.0)) --s;
  const SeedSegment seg = seed_segment(n, s);
  double running = offsets[s];
  for (std::int64_t i = seg.begin; i < seg.end; ++i) {
    running = add_potential(running, weights, i, nearest[i]);
    if (running > target) return i;
  }
  return seg.end > seg.begin ? seg.end - 1 : 0;
}

/// Scales a row to unit norm (sum of squares in fp64, ascending); a zero row stays.
KVSIFT_HOST_DEVICE inline void normalize_row(float* x, std::int32_t dim) {
  double square_sum = 0.0;
  for (std::int32_t j = 0; j < dim; ++j) {
    square_sum = fused_multiply_add<double>(double(x[j]), double(x[j]), square_sum);
  }
  if (square_sum == 0.0) return;
  const float inverse = float(1.0 / sqrt(square_sum));
  for (std::int32_t j = 0; j < dim; ++j) x[j] *= inverse;
}

/// The reseed order of points: larger key (weight * distance to the assigned centroid) first, then smaller
/// index. A point comes after (key, index) = (prev_key, prev) when this is true.
KVSIFT_HOST_DEVICE inline bool reseed_after(float key, std::int64_t i, float prev_key, std::int64_t prev) {
  return key < prev_key || (key == prev_key && i > prev);
}
/// Whether (key, i) precedes (best_key, best) in the reseed order (best = -1: nothing yet).
KVSIFT_HOST_DEVICE inline bool reseed_before(float key, std::int64_t i, float best_key, std::int64_t best) {
  return best < 0 || key > best_key || (key == best_key && i < best);
}

/// A reseed candidate: a point and its key (point -1: none). Trivial, so a CUDA kernel may hold it in shared
/// memory.
struct ReseedPick {
  std::int64_t point;
  float key;
};
KVSIFT_HOST_DEVICE constexpr ReseedPick no_reseed_pick() { return {-1, 0.0f}; }
/// The reseed key of row r (point ids[r], or r without ids): the point's weight times its distance to the
/// centroid of its cluster assignment[r].
KVSIFT_HOST_DEVICE inline float reseed_key(const float* x, const float* weights, const std::int32_t* ids,
                                           std::int64_t r, const float* centroids, const std::int32_t* assignment,
                                           std::int32_t dim, bool cosine) {
  const std::int64_t i = ids == nullptr ? r : std::int64_t(ids[r]);
  return (weights == nullptr ? 1.0f : weights[i]) *
         kmeans_distance(x + i * dim, centroids + std::int64_t(assignment[r]) * dim, dim, cosine);
}
/// The first point of rows [begin, end) in the reseed order that comes after `previous` (the last one taken).
KVSIFT_HOST_DEVICE inline ReseedPick next_reseed_pick(const float* keys, const std::int32_t* ids, std::int64_t begin,
                                                      std::int64_t end, const ReseedPick& previous) {
  ReseedPick best = no_reseed_pick();
  for (std::int64_t r = begin; r < end; ++r) {
    const std::int64_t i = ids == nullptr ? r : std::int64_t(ids[r]);
    if (reseed_after(keys[r], i, previous.key, previous.point) && reseed_before(keys[r], i, best.key, best.point)) {
      best = {i, keys[r]};
    }
  }
  return best;
}

/// Whether kmeans_batched runs mini-batch steps on problems of n points (BatchedKMeansConfig::batch_size).
KVSIFT_HOST_DEVICE constexpr bool is_minibatch(std::int32_t batch_size, std::int64_t n) {
  return batch_size > 0 && batch_size < n;
}

/// Point `slot` of step `iteration`'s batch of a problem of n points drawing from problem_seed
/// (batched_kmeans_seed): uniform over [0, n) with replacement (modulo bias below n / 2^64). A stream of its own:
/// the salt keeps it apart from the seeding's draws of the same seed.
KVSIFT_HOST_DEVICE constexpr std::int64_t minibatch_point(std::uint64_t problem_seed, std::int32_t iteration,
                                                          std::int32_t slot, std::int64_t n) {
  constexpr std::uint64_t kSalt = 0x6d696e6962617463ull;  // "minibatc"
  const std::uint64_t word = mix64(mix64(problem_seed ^ kSalt) ^ ((std::uint64_t(std::uint32_t(iteration)) << 32) |
                                                                   std::uint32_t(slot)));
  return std::int64_t(word % std::uint64_t(n));
}

/// The mini-batch assignment: the centroid (of k rows [k, dim]) nearest to x, by the largest dot product
/// (cosine; both normalized) or the smallest sum of squared differences (L2), fp32 fused multiply-adds in
/// ascending channel order; ties: the smaller id.
KVSIFT_HOST_DEVICE inline std::int32_t nearest_centroid(const float* x, const float* centroids, std::int32_t k,
                                                        std::int32_t dim, bool cosine) {
  std::int32_t best = 0;
  float best_score = 0.0f;
  for (std::int32_t c = 0; c < k; ++c) {
    const float* y = centroids + std::int64_t(c) * dim;
    float score = 0.0f;
    if (cosine) {
      for (std::int32_t j = 0; j < dim; ++j) score = fused_multiply_add<float>(x[j], y[j], score);
      score = -score;  // ranked smallest first, as the L2 distance
    } else {
      for (std::int32_t j = 0; j < dim; ++j) {
        const float diff = x[j] - y[j];
        score = fused_multiply_add<float>(diff, diff, score);
      }
    }
    if (c == 0 || score < best_score) best = c, best_score = score;
  }
  return best;
}

/// A drawn point's term in its centroid's weighted sum of one channel, accumulated in fp64 in batch order (the
/// fp32 product is exact there).
KVSIFT_HOST_DEVICE inline double add_minibatch_sum(double sum, float weight, float value) {
  return fused_multiply_add<double>(double(weight), double(value), sum);
}

/// One channel of a centroid's mini-batch step: (absorbed * c + sum) / (absorbed + batch weight), rounded once.
/// absorbed = 0 (the first weight the centroid draws) gives the drawn points' weighted mean.
KVSIFT_HOST_DEVICE inline float minibatch_channel(float c, double absorbed, double sum, double absorbed_after) {
  return float(fused_multiply_add<double>(absorbed, double(c), sum) / absorbed_after);
}

}  // namespace detail
}  // namespace kvsift
