#pragma once
/// The workspace and launchers of cuda::kmeans_batched (kernels/kmeans_batched.cu; the assignment kernel lives in
/// kernels/kmeans.cu). Launchers return the launch status and never throw.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/core/kmeans_batched.hpp"
#include "kvsift/cuda/detail/segment_mean_launch.hpp"

namespace kvsift::cuda::detail {

struct BatchedKMeansBuffers {
  float* points;         ///< [problems, n, dim]: fp32, normalized for cosine
  float* nearest;        ///< [problems, n]: seeding distances; reseed keys
  std::int32_t* counts;  ///< [problems, clusters]; mini-batch: 1 once a cluster has drawn a point
  // Full-batch steps only (else null):
  std::int32_t* keys;    ///< [problems, n]: p * clusters + assignment, the update's segments
  SegmentMeanBuffers segment_mean;  ///< over problems * n rows and problems * clusters segments
  // Mini-batch steps only (else null):
  std::int32_t* drawn;          ///< [problems, batch_size]: the step's points
  std::int32_t* drawn_nearest;  ///< [problems, batch_size]: their nearest centroids
  double* absorbed;             ///< [problems, clusters]: the weight each centroid has absorbed
};

/// Threads of the seeding and finishing kernels: a segment per thread (core/kmeans_batched.hpp).
inline constexpr int kBatchedKMeansThreads = kvsift::detail::kSeedSegments;

/// Every problem's nearest centroid per point (cpu::assign_nearest's ranking and ties), blockIdx.y the
/// problem: assignment[p * n + i] = the local id; keys, when not null, [p * n + i] = p * centroids.rows + that id.
cudaError_t launch_assign_nearest_batched(const BatchedMatrixView<const float>& points,
                                          const BatchedMatrixView<const float>& centroids, bool cosine,
                                          std::int32_t* assignment, std::int32_t* keys, cudaStream_t stream);

/// The whole of cuda::kmeans_batched, stream-ordered: points and weights as the caller gave them, a validated
/// config, centroids [problems, clusters, dim] and assignment [problems, n] packed.
template <class T>
cudaError_t launch_kmeans_batched(const BatchedMatrixView<const T>& points, const float* weights,
                                  const BatchedKMeansConfig& config, float* centroids, std::int32_t* assignment,
                                  const BatchedKMeansBuffers& buffers, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
