// The assignment step of CUDA batched k-means (cuda::kmeans_batched): the nearest centroid of every point of
// every problem in one launch, ranked as the CPU assigner (cpu::assign_nearest) ranks them, x.c - |c|^2 / 2 for
// L2, x.c for cosine; ties: smaller id.
#include "kvsift/cuda/detail/kmeans_batched_launch.hpp"

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

/// blockIdx.y: the problem.
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

}  // namespace

cudaError_t launch_assign_nearest_batched(const BatchedMatrixView<const float>& points,
                                          const BatchedMatrixView<const float>& centroids, bool cosine,
                                          std::int32_t* assignment, std::int32_t* keys, cudaStream_t stream) {
  const dim3 blocks(unsigned((points.rows + kTile - 1) / kTile), unsigned(points.problems));
  assign_nearest_kernel<<<blocks, kAssignThreads, 0, stream>>>(points, centroids, cosine, assignment, keys);
  return cudaGetLastError();
}

}  // namespace kvsift::cuda::detail
