// CUDA k-means: the assignment (cuda::assign_nearest, and cuda::kmeans_batched's for all problems in one launch:
// the nearest centroid of every point, ranked as the CPU assigner ranks them, x.c - |c|^2 / 2 for L2, x.c for
// cosine; ties: smaller id), and the whole of
// cuda::kmeans around it (seeding and centroid updates as cpu::kmeans does them, see launch_kmeans).
#include <cub/device/device_scan.cuh>

#include "kvsift/core/kmeans_seeding.hpp"
#include "kvsift/cuda/detail/kmeans_batched_launch.hpp"
#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/detail/segment_mean_launch.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

// A CTA scores a tile of 64 points against every centroid, 64 centroids and 32 channels at a time; each of
// its 256 threads holds a 4 x 4 block of dot products in registers.
constexpr int kTile = 64;
constexpr int kChannels = 32;
constexpr int kBlock = 4;
constexpr int kAssignThreads = (kTile / kBlock) * (kTile / kBlock);

/// Loads rows [first, first + kTile) x channels [channel, channel + kChannels) of `m` into `tile`, zeros past
/// the ends. The row pitch kChannels + 1 keeps the threads' column reads on distinct banks.
__device__ void load_tile(const MatrixView<const float>& m, std::int64_t first, int channel,
                          float (&tile)[kTile][kChannels + 1]) {
  for (int i = threadIdx.x; i < kTile * kChannels; i += kAssignThreads) {
    const int r = i / kChannels, c = i % kChannels;
    const bool inside = first + r < m.rows && channel + c < m.cols;
    tile[r][c] = inside ? m.row(first + r)[channel + c] : 0.0f;
  }
}

/// Orders (score, id) candidates: higher score first, then smaller id.
__device__ __forceinline__ bool better(float score, int id, float best_score, int best_id) {
  return score > best_score || (score == best_score && id < best_id);
}

/// blockIdx.y: the problem (one for cuda::assign_nearest, many for cuda::kmeans_batched).
__global__ void __launch_bounds__(kAssignThreads) assign_nearest_kernel(BatchedMatrixView<const float> all_points,
                                                                          BatchedMatrixView<const float> all_centroids,
                                                                          bool cosine, std::int32_t* assignment,
                                                                          std::int32_t* keys) {
  const MatrixView<const float> points = all_points.problem(blockIdx.y);
  const MatrixView<const float> centroids = all_centroids.problem(blockIdx.y);
  const std::int64_t problem_offset = std::int64_t(blockIdx.y) * points.rows;
  __shared__ float point_tile[kTile][kChannels + 1];
  __shared__ float centroid_tile[kTile][kChannels + 1];
  const int ty = threadIdx.x / (kTile / kBlock), tx = threadIdx.x % (kTile / kBlock);
  const std::int64_t first_point = std::int64_t(blockIdx.x) * kTile;

  float best[kBlock];
  int best_id[kBlock];
#pragma unroll
  for (int i = 0; i < kBlock; ++i) best[i] = -INFINITY, best_id[i] = 0;

  for (std::int64_t first_centroid = 0; first_centroid < centroids.rows; first_centroid += kTile) {
    float dot[kBlock][kBlock] = {};
    float norm[kBlock] = {};
    for (int channel = 0; channel < points.cols; channel += kChannels) {
      __syncthreads();  // the previous tiles are consumed
      load_tile(points, first_point, channel, point_tile);
      load_tile(centroids, first_centroid, channel, centroid_tile);
      __syncthreads();
#pragma unroll 8
      for (int c = 0; c < kChannels; ++c) {
        float x[kBlock], y[kBlock];
#pragma unroll
        for (int i = 0; i < kBlock; ++i) x[i] = point_tile[ty * kBlock + i][c], y[i] = centroid_tile[tx * kBlock + i][c];
#pragma unroll
        for (int j = 0; j < kBlock; ++j) {
          norm[j] = fmaf(y[j], y[j], norm[j]);
#pragma unroll
          for (int i = 0; i < kBlock; ++i) dot[i][j] = fmaf(x[i], y[j], dot[i][j]);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
      const std::int64_t id = first_centroid + tx * kBlock + j;
      if (id >= centroids.rows) break;
#pragma unroll
      for (int i = 0; i < kBlock; ++i) {
        const float score = cosine ? dot[i][j] : dot[i][j] - 0.5f * norm[j];
        if (better(score, int(id), best[i], best_id[i])) best[i] = score, best_id[i] = int(id);
      }
    }
  }
  // The 16 threads sharing a point row are 16 consecutive lanes of one warp.
#pragma unroll
  for (int i = 0; i < kBlock; ++i) {
#pragma unroll
    for (int offset = 1; offset < kTile / kBlock; offset *= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, best[i], offset);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id[i], offset);
      if (better(other, other_id, best[i], best_id[i])) best[i] = other, best_id[i] = other_id;
    }
    const std::int64_t point = first_point + ty * kBlock + i;
    if (tx == 0 && point < points.rows) {
      assignment[problem_offset + point] = best_id[i];
      if (keys != nullptr) keys[problem_offset + point] = std::int32_t(blockIdx.y * centroids.rows + best_id[i]);
    }
  }
}

// ---- k-means ---------------------------------------------------------------------------------------------
// cpu::kmeans's steps, each made to give the CPU's values where the CPU's own order of operations can be
// followed at no cost: the fp32 copy and its normalization (one thread per row, sequential double sum), the
// seeding's draws (core/kmeans_seeding.hpp) and the centroid sums (segment_mean, shared with the CPU: points in
// ascending order within each cluster, in double). Dot products and the seeding's sums run in another order than on the CPU, so a
// candidate or an assignment on the edge of a tie may differ.

constexpr int kKMeansThreads = kKMeansDistanceThreads;  // every k-means kernel's block size
constexpr int kKMeansWarps = kKMeansThreads / 32;
constexpr int kKMeansMaxCandidates = 24;  ///< 2 + ln k for every k < 2^31

template <class T>
__global__ void prepare_points(MatrixView<const T> in, bool cosine, float* out, float* norms) {
  const int d = in.cols;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < in.rows;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const T* src = in.row(i);
    float* dst = out + i * d;
    for (int c = 0; c < d; ++c) dst[c] = to_float_device(src[c]);
    if (cosine) kvsift::detail::normalize_row(dst, d);
    float norm = 0.0f;  // in fp32 and unfused, as the CPU sums it
    for (int c = 0; c < d; ++c) norm = __fadd_rn(norm, __fmul_rn(dst[c], dst[c]));
    norms[i] = norm;
  }
}

__global__ void fill_seeding_state(std::int64_t n, double* nearest) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * blockDim.x) {
    nearest[i] = INFINITY;
  }
}

/// The candidates for centroid `centroid`: for the first, the seed's point; then per trial the first point
/// whose prefix sum exceeds the drawn target, or, when every point already coincides with a centroid, the
/// point after the last one chosen (one candidate).
__global__ void draw_candidates(const double* prefix, std::int64_t n, std::uint64_t seed, std::int32_t centroid,
                                std::int32_t per_step, std::int32_t* candidates, std::int32_t* step) {
  const int trial = int(threadIdx.x);
  if (trial >= per_step) return;
  std::int64_t candidate = 0;
  std::int32_t drawn = 1;
  if (centroid == 0) {
    candidate = kvsift::detail::kmeans_first_point(seed, n);
  } else if (const double total = prefix[n - 1]; total > 0.0) {
    const double target = kvsift::detail::kmeans_draw_target(seed, std::uint32_t(centroid), std::uint32_t(trial), total);
    std::int64_t low = 0, high = n;  // first index in [0, n) whose prefix exceeds target, else n
    while (low < high) {
      const std::int64_t mid = (low + high) / 2;
      if (prefix[mid] > target) {
        high = mid;
      } else {
        low = mid + 1;
      }
    }
    candidate = min(low, n - 1);
    drawn = per_step;
  } else {
    candidate = (step[2] + 1) % n;
  }
  candidates[trial] = std::int32_t(candidate);
  if (trial == 0) step[0] = drawn;
}

/// Distances of every point to every candidate (a thread per point, all candidates at once from shared
/// memory), and per block and candidate the sum of min(nearest, distance), in a fixed order.
__global__ void __launch_bounds__(kKMeansThreads)
    candidate_distances(const float* points, const float* norms, std::int64_t n, std::int32_t d, bool cosine,
                        const std::int32_t* candidates, std::int32_t per_step, const double* nearest, double* distances,
                        double* potentials) {
  extern __shared__ float candidate_rows[];  // [d][per_step]: a channel's candidates side by side
  __shared__ double warp_potentials[kKMeansWarps][kKMeansMaxCandidates];
  for (int e = threadIdx.x; e < per_step * d; e += blockDim.x) {
    candidate_rows[e] = points[std::int64_t(candidates[e % per_step]) * d + e / per_step];
  }
  __syncthreads();
  const std::int64_t i = std::int64_t(blockIdx.x) * kKMeansThreads + threadIdx.x;
  const bool inside = i < n;
  float dot[kKMeansMaxCandidates] = {};
  const auto accumulate = [&](float x, int c) {
#pragma unroll
    for (int t = 0; t < kKMeansMaxCandidates; ++t) {
      if (t < per_step) dot[t] = fmaf(x, candidate_rows[c * per_step + t], dot[t]);
    }
  };
  if (inside) {
    const float* x = points + i * d;
    if (d % 4 == 0) {  // rows are then 16-byte aligned
      for (int c = 0; c < d; c += 4) {
        const float4 x4 = *reinterpret_cast<const float4*>(x + c);
        accumulate(x4.x, c), accumulate(x4.y, c + 1), accumulate(x4.z, c + 2), accumulate(x4.w, c + 3);
      }
    } else {
      for (int c = 0; c < d; ++c) accumulate(x[c], c);
    }
  }
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const double own_nearest = inside ? nearest[i] : 0.0, own_norm = inside ? double(norms[i]) : 0.0;
#pragma unroll
  for (int t = 0; t < kKMeansMaxCandidates; ++t) {
    if (t >= per_step) break;
    double contribution = 0.0;
    if (inside) {
      const double distance =
          fmax(0.0, cosine ? 1.0 - dot[t] : own_norm - 2.0 * dot[t] + double(norms[candidates[t]]));
      distances[t * n + i] = distance;
      contribution = fmin(own_nearest, distance);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) contribution += __shfl_down_sync(0xffffffffu, contribution, offset);
    if (lane == 0) warp_potentials[warp][t] = contribution;
  }
  __syncthreads();
  if (threadIdx.x < per_step) {
    double sum = 0.0;
    for (int w = 0; w < kKMeansWarps; ++w) sum += warp_potentials[w][threadIdx.x];
    potentials[blockIdx.x * per_step + threadIdx.x] = sum;
  }
}

/// One warp: the candidate whose potential is smallest (the first of equals), made centroid `centroid`.
__global__ void choose_candidate(const double* potentials, std::int32_t blocks, std::int32_t per_step,
                                 const std::int32_t* candidates, std::int32_t* step, const float* points, std::int32_t d,
                                 float* centroid_row) {
  const int lane = int(threadIdx.x);
  const int drawn = step[0];
  double potential = INFINITY;
  if (lane < drawn) {
    potential = 0.0;
    for (int b = 0; b < blocks; ++b) potential += potentials[b * per_step + lane];
  }
  int best = 0;
  double best_potential = __shfl_sync(0xffffffffu, potential, 0);
  for (int t = 1; t < drawn; ++t) {
    const double other = __shfl_sync(0xffffffffu, potential, t);
    if (other < best_potential) best_potential = other, best = t;
  }
  const std::int32_t chosen = candidates[best];
  for (int c = lane; c < d; c += 32) centroid_row[c] = points[std::int64_t(chosen) * d + c];
  if (lane == 0) step[1] = best, step[2] = chosen;
}

__global__ void update_nearest(std::int64_t n, const double* distances, const std::int32_t* step, double* nearest) {
  const double* chosen = distances + std::int64_t(step[1]) * n;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * blockDim.x) {
    nearest[i] = fmin(nearest[i], chosen[i]);
  }
}

/// One block per cluster: a centroid that segment_mean just updated (a cluster with points) is normalized, in
/// double and sequentially as on the CPU.
__global__ void normalize_centroids(const std::int32_t* counts, MatrixView<float> centroids) {
  const int c = blockIdx.x;
  if (threadIdx.x != 0 || counts[c] == 0) return;
  kvsift::detail::normalize_row(centroids.row(c), centroids.cols);
}

}  // namespace

cudaError_t kmeans_cub_bytes(std::int64_t n, std::size_t* bytes) {
  return cub::DeviceScan::InclusiveSum(nullptr, *bytes, static_cast<const double*>(nullptr), static_cast<double*>(nullptr),
                                       n);
}

template <class T>
cudaError_t launch_kmeans(const MatrixView<const T>& input, std::int32_t clusters, std::int32_t iterations, bool cosine,
                          std::uint64_t seed, const MatrixView<float>& centroids, std::int32_t* assignment,
                          const KMeansBuffers& b, cudaStream_t stream) {
  const std::int64_t n = input.rows;
  const std::int32_t d = input.cols, per_step = b.candidates_per_step;
  const unsigned point_blocks = grid_stride_blocks(n, kKMeansThreads);
  const auto points = MatrixView<const float>::packed(b.points, n, d);
  prepare_points<<<point_blocks, kKMeansThreads, 0, stream>>>(input, cosine, b.points, b.norms);
  fill_seeding_state<<<point_blocks, kKMeansThreads, 0, stream>>>(n, b.nearest);
  if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;

  const std::size_t candidate_bytes = std::size_t(per_step) * d * sizeof(float);
  for (std::int32_t c = 0; c < clusters; ++c) {
    std::size_t scan_bytes = b.cub_temp_bytes;
    if (c > 0) {
      if (cudaError_t s = cub::DeviceScan::InclusiveSum(b.cub_temp, scan_bytes, static_cast<const double*>(b.nearest),
                                                        b.prefix, n, stream);
          s != cudaSuccess) {
        return s;
      }
    }
    draw_candidates<<<1, 32, 0, stream>>>(b.prefix, n, seed, c, per_step, b.candidates, b.step);
    candidate_distances<<<b.distance_blocks, kKMeansThreads, candidate_bytes, stream>>>(
        b.points, b.norms, n, d, cosine, b.candidates, per_step, b.nearest, b.distances, b.potentials);
    choose_candidate<<<1, 32, 0, stream>>>(b.potentials, b.distance_blocks, per_step, b.candidates, b.step, b.points, d,
                                           centroids.row(c));
    update_nearest<<<point_blocks, kKMeansThreads, 0, stream>>>(n, b.distances, b.step, b.nearest);
    if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  }

  const auto centroid_view = MatrixView<const float>{centroids.data, centroids.rows, centroids.cols, centroids.row_stride};
  for (std::int32_t it = 0; it < iterations; ++it) {
    if (cudaError_t s = launch_assign_nearest(points, centroid_view, cosine, assignment, stream); s != cudaSuccess) return s;
    if (cudaError_t s = launch_segment_mean(points, assignment, clusters, nullptr, centroids, b.counts, b.segment_mean, stream);
        s != cudaSuccess) {
      return s;
    }
    if (cosine) normalize_centroids<<<unsigned(clusters), 32, 0, stream>>>(b.counts, centroids);
    if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  }
  return launch_assign_nearest(points, centroid_view, cosine, assignment, stream);
}

#define KVSIFT_INSTANTIATE(T)                                                                                          \
  template cudaError_t launch_kmeans<T>(const MatrixView<const T>&, std::int32_t, std::int32_t, bool, std::uint64_t, \
                                        const MatrixView<float>&, std::int32_t*, const KMeansBuffers&, cudaStream_t);
KVSIFT_INSTANTIATE(float)
KVSIFT_INSTANTIATE(half)
KVSIFT_INSTANTIATE(bfloat16)
#undef KVSIFT_INSTANTIATE

cudaError_t launch_assign_nearest_batched(const BatchedMatrixView<const float>& points,
                                          const BatchedMatrixView<const float>& centroids, bool cosine,
                                          std::int32_t* assignment, std::int32_t* keys, cudaStream_t stream) {
  const dim3 blocks(unsigned((points.rows + kTile - 1) / kTile), unsigned(points.problems));
  assign_nearest_kernel<<<blocks, kAssignThreads, 0, stream>>>(points, centroids, cosine, assignment, keys);
  return cudaGetLastError();
}

cudaError_t launch_assign_nearest(const MatrixView<const float>& points, const MatrixView<const float>& centroids,
                                  bool cosine, std::int32_t* assignment, cudaStream_t stream) {
  const auto one = [](const MatrixView<const float>& m) {
    return BatchedMatrixView<const float>{m.data, 1, m.rows, m.cols, 0, m.row_stride};
  };
  return launch_assign_nearest_batched(one(points), one(centroids), cosine, assignment, nullptr, stream);
}

}  // namespace kvsift::cuda::detail
