// cuda::kmeans_batched: every problem's points to fp32 (one launch), every problem's greedy k-means++ seeding
// (one launch, a CTA per problem running the loop over centroids), then per Lloyd step the batched assignment
// (kernels/kmeans.cu), one segment_mean over every problem's clusters and a finishing launch (cosine
// normalization, reseeding), or per mini-batch step a draw-and-assign launch, an update launch and, with reseed,
// the finishing launch over the drawn points. The per-problem math is core/kmeans_batched.hpp's, which the CPU runs too: a
// thread owns a seeding segment and a warp a group, so every sum runs in the order the CPU runs it.
#include "kvsift/core/kmeans_seeding.hpp"
#include "kvsift/cuda/detail/kmeans_batched_launch.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

using kvsift::detail::kSeedCandidatesPerPass;
using kvsift::detail::kSeedGroup;
using kvsift::detail::kSeedGroups;
using kvsift::detail::kSeedSegments;
static_assert(kBatchedKMeansThreads == kSeedGroups * 32 && kSeedGroup == 32, "a thread per segment, a warp per group");

constexpr int kPrepareThreads = 256;
constexpr int kMaxCandidates = 64;  ///< 2 + ln k < 24 for every k < 2^31
constexpr unsigned kFullMask = 0xffffffffu;

/// Row i of problem blockIdx.y to fp32, normalized for cosine: cpu::kmeans_batched's step 1.
template <class T>
__global__ void prepare_batched_points(BatchedMatrixView<const T> in, bool cosine, float* out) {
  const std::int64_t i = std::int64_t(blockIdx.x) * kPrepareThreads + threadIdx.x;
  if (i >= in.rows) return;
  const T* src = in.row(blockIdx.y, i);
  float* dst = out + (std::int64_t(blockIdx.y) * in.rows + i) * in.cols;
  for (int c = 0; c < in.cols; ++c) dst[c] = to_float_device(src[c]);
  if (cosine) kvsift::detail::normalize_row(dst, in.cols);
}

/// The sum over a warp's lanes in lane order (every lane gets it): a group's sum, as the CPU adds it.
__device__ __forceinline__ double warp_sum_in_order(double value) {
  double sum = 0.0;
#pragma unroll
  for (int j = 0; j < 32; ++j) sum += __shfl_sync(kFullMask, value, j);
  return sum;
}

/// One CTA per problem: greedy k-means++ seeding (cpu/kmeans.hpp step 2). Thread s owns segment s; each step
/// makes two passes over the points: nearest distances updated with the previous centroid and the segments'
/// potentials, then the drawn candidates' potentials (kSeedCandidatesPerPass at a time).
__global__ void __launch_bounds__(kBatchedKMeansThreads, 1)
    seed_batched(const float* all_points, const float* all_weights, std::int64_t n, std::int32_t dim, bool cosine,
                 std::int32_t clusters, std::int32_t per_step, std::uint64_t seed, float* all_centroids,
                 float* all_nearest) {
  using namespace kvsift::detail;
  extern __shared__ float candidate_rows[];  // [kSeedCandidatesPerPass, dim]
  __shared__ double totals[kSeedSegments], offsets[kSeedSegments], group_sums[kSeedGroups];
  __shared__ double group_potentials[kSeedGroups][kSeedCandidatesPerPass], potentials[kMaxCandidates];
  __shared__ std::int64_t candidates[kMaxCandidates];

  const int s = int(threadIdx.x), lane = s % 32, group = s / 32;
  const std::int64_t p = blockIdx.x;
  const float* x = all_points + p * n * dim;
  const float* weights = all_weights == nullptr ? nullptr : all_weights + p * n;
  float* centroids = all_centroids + p * clusters * dim;
  float* nearest = all_nearest + p * n;
  const SeedSegment seg = seed_segment(n, s);
  const std::uint64_t problem_seed = batched_kmeans_seed(seed, p);

  std::int64_t chosen = kmeans_first_point(problem_seed, n);
  for (int j = s; j < dim; j += kBatchedKMeansThreads) centroids[j] = x[chosen * dim + j];
  for (std::int32_t c = 1; c < clusters; ++c) {
    __syncthreads();  // centroid c - 1 is written; the last step's candidates and potentials are read
    const float* previous = centroids + std::int64_t(c - 1) * dim;
    double total_s = 0.0;
    for (std::int64_t i = seg.begin; i < seg.end; ++i) {
      const float d = kmeans_distance(x + i * dim, previous, dim, cosine);
      const float v = c == 1 ? d : min_distance(nearest[i], d);
      nearest[i] = v;
      total_s = add_potential(total_s, weights, i, v);
    }
    const double group_sum = warp_sum_in_order(total_s);
    if (lane == 0) group_sums[group] = group_sum;
    __syncthreads();
    double group_offset = 0.0, total = 0.0;
    for (int g = 0; g < kSeedGroups; ++g) {
      if (g < group) group_offset += group_sums[g];
      total += group_sums[g];
    }
    double running = group_offset;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const double earlier = __shfl_sync(kFullMask, total_s, j);
      if (j < lane) running += earlier;
    }
    offsets[s] = running;
    totals[s] = total_s;
    __syncthreads();  // offsets, totals and the nearest distances are complete

    const int drawn = total > 0.0 ? per_step : 1;
    if (s < drawn) {
      candidates[s] = total > 0.0 ? draw_seed_candidate(offsets, totals, nearest, weights, n,
                                                        kmeans_draw_target(problem_seed, std::uint32_t(c),
                                                                           std::uint32_t(s), total))
                                  : (chosen + 1) % n;  // every point's potential is 0: the next point in order
    }
    __syncthreads();
    int best = 0;
    if (drawn > 1) {
      for (int first = 0; first < drawn; first += kSeedCandidatesPerPass) {
        const int count = min(kSeedCandidatesPerPass, drawn - first);
        for (int e = s; e < count * dim; e += kBatchedKMeansThreads) {
          candidate_rows[e] = x[candidates[first + e / dim] * dim + e % dim];
        }
        __syncthreads();
        double partial[kSeedCandidatesPerPass] = {};
        for (std::int64_t i = seg.begin; i < seg.end; ++i) {
          const float own = nearest[i];
#pragma unroll
          for (int t = 0; t < kSeedCandidatesPerPass; ++t) {
            if (t < count) {
              const float d = kmeans_distance(x + i * dim, candidate_rows + t * dim, dim, cosine);
              partial[t] = add_potential(partial[t], weights, i, min_distance(own, d));
            }
          }
        }
#pragma unroll
        for (int t = 0; t < kSeedCandidatesPerPass; ++t) {
          if (t < count) {
            const double sum = warp_sum_in_order(partial[t]);
            if (lane == 0) group_potentials[group][t] = sum;
          }
        }
        __syncthreads();
        if (s < count) {
          double sum = 0.0;
          for (int g = 0; g < kSeedGroups; ++g) sum += group_potentials[g][s];
          potentials[first + s] = sum;
        }
        __syncthreads();  // potentials complete; candidate_rows and group_potentials free again
      }
      for (int t = 1; t < drawn; ++t) {
        if (potentials[t] < potentials[best]) best = t;
      }
    }
    chosen = candidates[best];
    for (int j = s; j < dim; j += kBatchedKMeansThreads) centroids[std::int64_t(c) * dim + j] = x[chosen * dim + j];
  }
}

/// One CTA per problem, after an update: with `normalize`, the cosine centroids it moved (counts > 0); then with
/// reseed the empty clusters (counts 0), in ascending id, each take the next row in the reseed order
/// (core/kmeans_batched.hpp), one block-wide selection per empty cluster. The problem's `rows` rows are its
/// points, or with ids (mini-batch) its drawn points ids[r]; keys and ties go by point index, as on the CPU.
__global__ void __launch_bounds__(kBatchedKMeansThreads, 1)
    finish_batched(const float* all_points, const float* all_weights, const std::int32_t* all_ids, std::int64_t n,
                   std::int64_t rows, std::int32_t dim, bool cosine, bool normalize, bool reseed, std::int32_t clusters,
                   const std::int32_t* all_assignment, const std::int32_t* all_counts, float* all_centroids,
                   float* all_keys) {
  using namespace kvsift::detail;
  __shared__ ReseedPick warp_picks[kSeedGroups];
  __shared__ ReseedPick winner;

  const int s = int(threadIdx.x), lane = s % 32, group = s / 32;
  const std::int64_t p = blockIdx.x;
  const float* x = all_points + p * n * dim;
  const float* weights = all_weights == nullptr ? nullptr : all_weights + p * n;
  const std::int32_t* ids = all_ids == nullptr ? nullptr : all_ids + p * rows;
  const std::int32_t* assignment = all_assignment + p * rows;
  const std::int32_t* counts = all_counts + p * clusters;
  float* centroids = all_centroids + p * clusters * dim;
  float* keys = all_keys + p * rows;

  int any_empty = 0;
  for (std::int32_t c = s; c < clusters; c += kBatchedKMeansThreads) {
    if (normalize && counts[c] > 0) normalize_row(centroids + std::int64_t(c) * dim, dim);
    any_empty |= counts[c] == 0;
  }
  if (__syncthreads_or(any_empty) == 0 || !reseed) return;  // also the barrier after the normalization

  const SeedSegment seg = seed_segment(rows, s);
  for (std::int64_t r = seg.begin; r < seg.end; ++r) {
    keys[r] = reseed_key(x, weights, ids, r, centroids, assignment, dim, cosine);
  }
  __syncthreads();
  ReseedPick previous{-1, INFINITY};
  for (std::int32_t c = 0; c < clusters; ++c) {
    if (counts[c] != 0) continue;
    ReseedPick best = next_reseed_pick(keys, ids, seg.begin, seg.end, previous);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      const ReseedPick other{__shfl_xor_sync(kFullMask, best.point, offset),
                             __shfl_xor_sync(kFullMask, best.key, offset)};
      if (other.point >= 0 && reseed_before(other.key, other.point, best.key, best.point)) best = other;
    }
    if (lane == 0) warp_picks[group] = best;
    __syncthreads();
    if (s == 0) {
      best = no_reseed_pick();
      for (int g = 0; g < kSeedGroups; ++g) {
        const ReseedPick& pick = warp_picks[g];
        if (pick.point >= 0 && reseed_before(pick.key, pick.point, best.key, best.point)) best = pick;
      }
      winner = best;
    }
    __syncthreads();
    if (winner.point < 0) return;  // every point taken (or NaN keys)
    for (int j = s; j < dim; j += kBatchedKMeansThreads) {
      centroids[std::int64_t(c) * dim + j] = x[winner.point * dim + j];
    }
    previous = winner;
  }
}

// ---- mini-batch steps (BatchedKMeansConfig::batch_size): core/kmeans_batched.hpp's functions per drawn point
// and per cluster, each cluster's sums in batch order, so the CPU's loops give the same bits.

constexpr int kNearestThreads = 256;
/// Centroid floats staged in shared memory (the default dynamic limit); larger panels are read from global.
constexpr std::int64_t kStagedCentroidFloats = 48 * 1024 / sizeof(float);
constexpr int kUpdateChunk = 1024;  ///< batch slots an update CTA stages at a time

/// Slot b of problem blockIdx.y: with draw, the point minibatch_point(seed + p, iteration, b), recorded in
/// drawn; without, point b. out[p * rows + b] = its nearest centroid (nearest_centroid).
__global__ void __launch_bounds__(kNearestThreads)
    nearest_minibatch(const float* all_points, std::int64_t n, std::int32_t dim, bool cosine, std::int32_t clusters,
                      const float* all_centroids, bool staged, std::int64_t rows, bool draw, std::uint64_t seed,
                      std::int32_t iteration, std::int32_t* all_drawn, std::int32_t* all_out) {
  extern __shared__ float staged_centroids[];  // [clusters, dim] when staged
  const std::int64_t p = blockIdx.y;
  const float* centroids = all_centroids + p * clusters * dim;
  if (staged) {
    for (std::int64_t e = threadIdx.x; e < std::int64_t(clusters) * dim; e += kNearestThreads) {
      staged_centroids[e] = centroids[e];
    }
    __syncthreads();
    centroids = staged_centroids;
  }
  const std::int64_t b = std::int64_t(blockIdx.x) * kNearestThreads + threadIdx.x;
  if (b >= rows) return;
  std::int64_t i = b;
  if (draw) {
    i = kvsift::detail::minibatch_point(kvsift::detail::batched_kmeans_seed(seed, p), iteration, std::int32_t(b), n);
    all_drawn[p * rows + b] = std::int32_t(i);
  }
  all_out[p * rows + b] = kvsift::detail::nearest_centroid(all_points + (p * n + i) * dim, centroids, clusters, dim, cosine);
}

/// One CTA per (cluster blockIdx.x, problem blockIdx.y), a thread per channel: the cluster's drawn points' weight
/// and weighted sums in batch order, then its move to the running weighted mean (cpu/kmeans.hpp), normalized
/// for cosine by one thread as the CPU does it; counts[c] = 1 once it draws a point.
__global__ void update_minibatch(const float* all_points, const float* all_weights, std::int64_t n, std::int32_t dim,
                                 bool cosine, std::int32_t clusters, std::int32_t batch, const std::int32_t* all_drawn,
                                 const std::int32_t* all_nearest, std::int32_t* all_counts, double* all_absorbed,
                                 float* all_centroids) {
  using namespace kvsift::detail;
  __shared__ std::int32_t members[kUpdateChunk];  // the chunk's drawn points, -1 for another cluster's
  const std::int64_t p = blockIdx.y;
  const std::int32_t c = std::int32_t(blockIdx.x), j = std::int32_t(threadIdx.x);
  const float* x = all_points + p * n * dim;
  const float* weights = all_weights == nullptr ? nullptr : all_weights + p * n;
  const std::int32_t* drawn = all_drawn + p * batch;
  const std::int32_t* nearest = all_nearest + p * batch;
  double weight = 0.0, sum = 0.0;
  bool reached = false;
  for (std::int32_t first = 0; first < batch; first += kUpdateChunk) {
    const int count = min(kUpdateChunk, batch - first);
    __syncthreads();  // the previous chunk is consumed
    for (int e = threadIdx.x; e < count; e += blockDim.x) members[e] = nearest[first + e] == c ? drawn[first + e] : -1;
    __syncthreads();
    for (int e = 0; e < count; ++e) {
      const std::int64_t i = members[e];
      if (i < 0) continue;
      const float w = weights == nullptr ? 1.0f : weights[i];
      if (j < dim) sum = add_minibatch_sum(sum, w, x[i * dim + j]);
      weight += double(w);
      reached = true;
    }
  }
  const std::int64_t row = p * clusters + c;
  if (reached && j == 0) all_counts[row] = 1;
  if (!(weight > 0.0)) return;  // no weight drawn: the centroid stays (uniform over the CTA)
  float* centroid = all_centroids + row * dim;
  const double absorbed = all_absorbed[row], after = absorbed + weight;
  if (j < dim) centroid[j] = minibatch_channel(centroid[j], absorbed, sum, after);
  __syncthreads();  // the row is written; absorbed is read
  if (j == 0) {
    all_absorbed[row] = after;
    if (cosine) normalize_row(centroid, dim);
  }
}

__global__ void reset_minibatch(std::int64_t count, std::int32_t* counts, double* absorbed) {
  const std::int64_t e = std::int64_t(blockIdx.x) * kNearestThreads + threadIdx.x;
  if (e < count) counts[e] = 0, absorbed[e] = 0.0;
}

/// Mini-batch steps and the final assignment, after the seeding (launch_kmeans_batched).
cudaError_t launch_minibatch_steps(const float* points, const float* weights, std::int32_t problems, std::int64_t n,
                                   std::int32_t dim, const BatchedKMeansConfig& config, float* centroids,
                                   std::int32_t* assignment, const BatchedKMeansBuffers& b, cudaStream_t stream) {
  const bool cosine = config.metric == KMeansMetric::cosine, reseed = config.empty == EmptyCluster::reseed;
  const std::int32_t k = config.clusters, batch = config.batch_size;
  const std::int64_t segments = std::int64_t(problems) * k;
  reset_minibatch<<<unsigned((segments + kNearestThreads - 1) / kNearestThreads), kNearestThreads, 0, stream>>>(
      segments, b.counts, b.absorbed);
  const bool staged = std::int64_t(k) * dim <= kStagedCentroidFloats;
  const std::size_t staged_bytes = staged ? std::size_t(k) * dim * sizeof(float) : 0;
  const auto nearest = [&](std::int64_t rows, bool draw, std::int32_t iteration, std::int32_t* out) {
    const dim3 blocks(unsigned((rows + kNearestThreads - 1) / kNearestThreads), unsigned(problems));
    nearest_minibatch<<<blocks, kNearestThreads, staged_bytes, stream>>>(points, n, dim, cosine, k, centroids, staged, rows,
                                                                         draw, config.seed, iteration, b.drawn, out);
  };
  const unsigned channel_threads = unsigned((dim + 31) / 32 * 32);
  for (std::int32_t it = 0; it < config.iterations; ++it) {
    nearest(batch, true, it, b.drawn_nearest);
    update_minibatch<<<dim3(unsigned(k), unsigned(problems)), channel_threads, 0, stream>>>(
        points, weights, n, dim, cosine, k, batch, b.drawn, b.drawn_nearest, b.counts, b.absorbed, centroids);
    if (reseed) {
      finish_batched<<<unsigned(problems), kBatchedKMeansThreads, 0, stream>>>(
          points, weights, b.drawn, n, batch, dim, cosine, false, true, k, b.drawn_nearest, b.counts, centroids, b.nearest);
    }
    if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  }
  nearest(n, false, 0, assignment);
  return cudaGetLastError();
}

}  // namespace

template <class T>
cudaError_t launch_kmeans_batched(const BatchedMatrixView<const T>& points, const float* weights,
                                  const BatchedKMeansConfig& config, float* centroids, std::int32_t* assignment,
                                  const BatchedKMeansBuffers& b, cudaStream_t stream) {
  const std::int32_t problems = points.problems, dim = points.cols, clusters = config.clusters;
  const std::int64_t n = points.rows;
  const bool cosine = config.metric == KMeansMetric::cosine, reseed = config.empty == EmptyCluster::reseed;
  const dim3 prepare_blocks(unsigned((n + kPrepareThreads - 1) / kPrepareThreads), unsigned(problems));
  prepare_batched_points<<<prepare_blocks, kPrepareThreads, 0, stream>>>(points, cosine, b.points);
  const std::int32_t per_step = kvsift::detail::kmeans_candidates_per_step(clusters);
  const std::size_t candidate_bytes = std::size_t(kSeedCandidatesPerPass) * std::size_t(dim) * sizeof(float);
  seed_batched<<<unsigned(problems), kBatchedKMeansThreads, candidate_bytes, stream>>>(
      b.points, weights, n, dim, cosine, clusters, per_step, config.seed, centroids, b.nearest);
  if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  if (kvsift::detail::is_minibatch(config.batch_size, n)) {
    return launch_minibatch_steps(b.points, weights, problems, n, dim, config, centroids, assignment, b, stream);
  }

  const auto fp32_points = BatchedMatrixView<const float>::packed(b.points, problems, n, dim);
  const auto fp32_centroids = BatchedMatrixView<const float>::packed(centroids, problems, clusters, dim);
  const auto all_points = MatrixView<const float>::packed(b.points, problems * n, dim);
  const auto all_centroids = MatrixView<float>::packed(centroids, std::int64_t(problems) * clusters, dim);
  for (std::int32_t it = 0; it < config.iterations; ++it) {
    if (cudaError_t s = launch_assign_nearest_batched(fp32_points, fp32_centroids, cosine, assignment, b.keys, stream);
        s != cudaSuccess) {
      return s;
    }
    if (cudaError_t s = launch_segment_mean(all_points, b.keys, problems * clusters, weights, all_centroids, b.counts,
                                            b.segment_mean, stream);
        s != cudaSuccess) {
      return s;
    }
    if (cosine || reseed) {
      finish_batched<<<unsigned(problems), kBatchedKMeansThreads, 0, stream>>>(
          b.points, weights, nullptr, n, n, dim, cosine, cosine, reseed, clusters, assignment, b.counts, centroids,
          b.nearest);
      if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
    }
  }
  return launch_assign_nearest_batched(fp32_points, fp32_centroids, cosine, assignment, nullptr, stream);
}

#define KVSIFT_INSTANTIATE(T)                                                                                         \
  template cudaError_t launch_kmeans_batched<T>(const BatchedMatrixView<const T>&, const float*,                      \
                                                const BatchedKMeansConfig&, float*, std::int32_t*,                    \
                                                const BatchedKMeansBuffers&, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
