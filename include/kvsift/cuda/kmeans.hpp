#pragma once
/// Batched k-means on CUDA: cpu/kmeans.hpp's twin, with the same arguments but the context. Device memory
/// (points, weights, centroids, assignment, workspace); no allocation, no host sync; stream-ordered and
/// CUDA-graph capturable; deterministic (fixed summation orders, no float atomics). Argument checks:
/// core/detail/kmeans_checks.hpp.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/kmeans_batched.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

/// Bytes of device workspace: the points in fp32 (4 * problems * n * dim), the seeding's distances and the
/// clusters' counts (4 * problems * (n + clusters)), and for full-batch steps the update's keys (4 * problems * n)
/// and segment_mean's workspace over problems * n rows, for mini-batch steps the drawn points and their
/// centroids (8 * problems * batch_size) and the absorbed weights (8 * problems * clusters).
std::size_t batched_kmeans_workspace_bytes(std::int32_t problems, std::int64_t n, std::int32_t dim,
                                           const BatchedKMeansConfig& config, const Context& = {});

/// cpu::kmeans_batched's contract (steps, mini-batch steps, weights, empty-cluster rules, outputs), on the
/// device; the seeding's choices equal the CPU's bit for bit, and so do the mini-batch steps' results; full-batch
/// steps' assignments and centroids do unless a point sits within fp32 rounding of a tie between two centroids.
/// Weights are read on the device, so their values are not checked: they must be finite and >= 0.
/// problems <= 65535.
///
/// Launches: one to convert the points, one for the whole seeding (a CTA of 1024 threads per problem loops
/// over the centroids: per centroid two passes over the problem's points and 2 + ln k candidate draws), then per
/// Lloyd step the assignment of every point of every problem (one launch), segment_mean over every problem's
/// clusters (four launches and a memset), and, for cosine or reseed, one launch normalizing and reseeding; a
/// final assignment. Mini-batch steps (config.batch_size in [1, n)): one launch to reset the absorbed weights,
/// then per step one drawing and assigning the batch (a thread per drawn point, the problem's centroids in
/// shared memory when they fit 48 KiB), one updating the centroids (a CTA per cluster, a thread per channel,
/// each scanning the batch in order) and with reseed one reseeding from the batch (a CTA per problem); a final
/// assignment by a thread per point. Their centroids and assignments equal the CPU's bit for bit.
template <class T>
void kmeans_batched(const BatchedMatrixView<const T>& points, const float* d_weights, const BatchedKMeansConfig& config,
                    float* d_centroids, std::int32_t* d_assignment, std::span<std::byte> workspace, const Context& ctx);

}  // namespace kvsift::cuda
