#pragma once
/// Batched k-means on CUDA: cpu/kmeans.hpp's twin, with the same arguments but the stream. Device memory
/// (points, weights, centroids, assignment, workspace); no allocation, no host sync; stream-ordered and
/// CUDA-graph capturable; deterministic (fixed summation orders, no float atomics).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/kmeans_batched.hpp"
#include "kvsift/cpu/kmeans.hpp"

namespace kvsift::cuda {

/// Bytes of device workspace: the points in fp32 (4 * problems * n * dim), the seeding's distances, the
/// update's keys and counts (4 * problems * (2n + clusters)) and segment_mean's workspace over problems * n rows.
std::size_t batched_kmeans_workspace_bytes(std::int32_t problems, std::int64_t n, std::int32_t dim,
                                           const BatchedKMeansConfig& config);

/// cpu::kmeans_batched's contract (steps, weights, empty-cluster rules, outputs), on the device; the seeding's
/// choices equal the CPU's bit for bit, the assignments and centroids unless a point sits within fp32 rounding
/// of a tie between two centroids. Weights are read on the device, so their values are not checked: they must
/// be finite and >= 0. problems <= 65535.
///
/// Launches: one to convert the points, one for the whole seeding (a CTA of 1024 threads per problem loops
/// over the centroids: per centroid two passes over the problem's points and 2 + ln k candidate draws), then per
/// Lloyd step the assignment of every point of every problem (one launch), segment_mean over every problem's
/// clusters (four launches and a memset), and, for cosine or reseed, one launch normalizing and reseeding; a
/// final assignment.
template <class T>
void kmeans_batched(const BatchedMatrixView<const T>& points, const float* d_weights, const BatchedKMeansConfig& config,
                    float* d_centroids, std::int32_t* d_assignment, std::span<std::byte> workspace, cudaStream_t stream);

}  // namespace kvsift::cuda
