#pragma once
/// Kernels and launchers of the CUDA primitives (cuda/primitives.hpp). Launchers return the launch status
/// and never throw; src/cuda/primitives.cpp validates and calls them.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kvsift/core/views.hpp"
#include "kvsift/cuda/detail/segment_mean_launch.hpp"

namespace kvsift::cuda::detail {

/// Blocks of `threads` for a grid-stride loop over `items` (capped: the loop covers the rest).
inline unsigned grid_stride_blocks(std::int64_t items, int threads) {
  return unsigned(std::clamp<std::int64_t>((items + threads - 1) / threads, 1, 65535 * 8));
}

// ---- scoring, gather ------------------------------------------------------------------------------

template <class T>
cudaError_t launch_gemv_scores(const float* q, const MatrixView<const T>& rows, float scale, float* scores,
                               cudaStream_t stream);

template <class T>
cudaError_t launch_gather_rows(const MatrixView<const T>& src, const std::int32_t* indices, std::int64_t count,
                               const MatrixView<T>& dst, cudaStream_t stream);

// ---- k-means assignment ---------------------------------------------------------------------------------

/// assignment[i] = argmax_c x_i.c - |c|^2 / 2 (L2) or x_i.c (cosine); ties: smaller id.
cudaError_t launch_assign_nearest(const MatrixView<const float>& points, const MatrixView<const float>& centroids,
                                  bool cosine, std::int32_t* assignment, cudaStream_t stream);

// ---- k-means on the device ------------------------------------------------------------------------------

/// What one k-means run keeps on the device besides its outputs.
struct KMeansBuffers {
  float* points;                 ///< [n, dim]: fp32 copy of the input, rows normalized for cosine
  float* norms;                  ///< [n]: squared norms of those rows
  double* nearest;               ///< [n]: seeding, distance of each point to its nearest centroid so far
  double* prefix;                ///< [n]: inclusive prefix sums of nearest
  double* distances;             ///< [candidates_per_step, n]: this step's candidates to every point
  double* potentials;            ///< [distance_blocks, candidates_per_step]: per-block sums of min(nearest, distance)
  std::int32_t* candidates;      ///< [candidates_per_step]
  std::int32_t* step;            ///< [3]: candidates drawn this step, slot chosen, point chosen
  std::int32_t* counts;          ///< [clusters]: points per cluster after an update
  SegmentMeanBuffers segment_mean;  ///< the centroid updates' workspace
  void* cub_temp;
  std::size_t cub_temp_bytes;
  std::int32_t candidates_per_step;
  std::int32_t distance_blocks;
};

/// Threads (one per point) and blocks of the seeding's distance kernel: a function of n only, so that its
/// per-block sums, and with them the choice between candidates, do not depend on the GPU.
inline constexpr int kKMeansDistanceThreads = 256;
inline std::int32_t kmeans_distance_blocks(std::int64_t n) {
  return std::int32_t((n + kKMeansDistanceThreads - 1) / kKMeansDistanceThreads);
}

/// Temporary storage of the seeding's CUB prefix sum.
cudaError_t kmeans_cub_bytes(std::int64_t n, std::size_t* bytes);

/// The whole of cuda::kmeans: seeding, `iterations` Lloyd steps and the final assignment, stream-ordered.
template <class T>
cudaError_t launch_kmeans(const MatrixView<const T>& points, std::int32_t clusters, std::int32_t iterations, bool cosine,
                          std::uint64_t seed, const MatrixView<float>& centroids, std::int32_t* assignment,
                          const KMeansBuffers& buffers, cudaStream_t stream);

// ---- deduplication --------------------------------------------------------------------------------------

cudaError_t sort_unique_cub_bytes(std::int64_t rows, std::int32_t capacity, std::size_t* bytes);

struct SortUniqueBuffers {
  std::int32_t* sorted;         ///< [rows, capacity]
  std::int32_t* segment_begin;  ///< [rows]
  std::int32_t* segment_end;    ///< [rows]
  void* cub_temp;
  std::size_t cub_temp_bytes;
};

cudaError_t launch_sort_unique(std::int32_t* indices, std::int64_t rows, std::int32_t capacity,
                               const std::int32_t* counts, std::int32_t* unique_counts, const SortUniqueBuffers& buffers,
                               cudaStream_t stream);

}  // namespace kvsift::cuda::detail
