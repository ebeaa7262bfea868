#pragma once
/// Batched k-means on the CPU: many small independent problems (layers x heads x subspaces) in one call, with
/// optional sample weights. The twin of cuda/kmeans.hpp, with the same arguments but the pool, and the same
/// seeding bits (core/kmeans_batched.hpp). Host memory; caller workspace, no allocation; deterministic and
/// independent of the thread count. The single large problem of offline clustering keeps cpu::kmeans
/// (cpu/primitives.hpp).

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/kmeans_batched.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/detail/primitives_kernels.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cpu {

/// Bytes of host workspace (256-byte aligned): the points in fp32 (4 * problems * n * dim), the seeding's
/// distances, the update's keys and counts, the segment means' workspace and the problems' centroid panels.
std::size_t batched_kmeans_workspace_bytes(std::int32_t problems, std::int64_t n, std::int32_t dim,
                                           const BatchedKMeansConfig& config);

/// k-means of each problem p < points.problems, independently: problem p's points are points.row(p, i), i < n =
/// points.rows, dim = points.cols, with weight w_i = weights[p * n + i] (1 with weights == nullptr).
///   1. Points are converted to fp32 and, for cosine, normalized (spherical k-means).
///   2. Greedy k-means++ seeding (as cpu::kmeans): centroid 0 is the point drawn by kmeans_first_point; each
///      next one is the best, by total potential sum_i w_i min(D_i, d(x_i, y)), of 2 + ln k candidates y drawn
///      with probability proportional to w_i D_i (D_i: distance to the nearest centroid so far; d: squared L2, or
///      1 - cosine), with the draws of core/kmeans_seeding.hpp from seed + p. When every point's potential is 0,
///      the next centroid is the point after the last chosen. Distances in fp32, sums in fp64, in the fixed
///      order of core/kmeans_batched.hpp.
///   3. `iterations` Lloyd steps: each point to its nearest centroid (ranked as cpu::assign_nearest; ties:
///      smaller id), then each centroid the weighted mean of its points (segment_mean: fp64, ascending point
///      order), normalized for cosine. A cluster whose points all weigh 0 keeps its centroid; one with no points
///      keeps it too, or with EmptyCluster::reseed takes a point: the problem's empty clusters, in ascending id, take the points in
///      descending order of w_i d(x_i, c_{a_i}) (their weighted distance to their own updated centroid; ties:
///      smaller index), one point each, so no point serves two clusters in one step. A reseeded centroid may
///      still end up empty where it duplicates another centroid (ties go to the smaller id).
///   4. A final assignment, so the returned assignment matches the returned centroids.
/// centroids: [problems, clusters, dim] fp32, packed; assignment: [problems, n] packed. Weights: [problems, n]
/// packed, finite and >= 0 (refused otherwise), or nullptr.
///
/// Same results as cuda::kmeans_batched: the seeding bit for bit; assignments and centroids unless a point sits
/// within fp32 rounding of a tie between two centroids (the backends' dot products sum in other orders), which
/// can then change what follows. With pool: problems in parallel for the seeding, (problem, rows) items for the
/// assignment, segments for the update; the results do not depend on the thread count.
///
/// Costs per problem: seeding k (2 + ln k + 2) n dim fp32 FMAs, each Lloyd step k n dim (assignment) + n dim.
template <class T>
void kmeans_batched(const BatchedMatrixView<const T>& points, const float* weights, const BatchedKMeansConfig& config,
                    float* centroids, std::int32_t* assignment, std::span<std::byte> workspace,
                    ThreadPool* pool = nullptr);

namespace detail {
/// The checks both backends share: problems >= 1, n in [1, 2^31) with problems * n < 2^31, dim in [1, 256],
/// clusters in [1, n], iterations >= 0, a known metric and empty-cluster policy.
void check_batched_kmeans_shape(const char* where, std::int32_t problems, std::int64_t n, std::int32_t dim,
                                const BatchedKMeansConfig& config);
/// The shape checks, plus: points is a valid view (problem_stride >= 0), weights (if any) 4-byte aligned,
/// centroids and assignment non-null.
template <class T>
void check_batched_kmeans(const char* where, const BatchedMatrixView<const T>& points, const float* weights,
                          const BatchedKMeansConfig& config, const float* centroids, const std::int32_t* assignment);

/// Packs `vectors` into a ScorePanel over caller storage: tiles [padded * dim] and offsets [padded] floats,
/// padded = vectors.rows rounded up to ScorePanel::kPanelPadding; offsets -|v|^2 / 2 with with_half_norms, else 0.
ScorePanel pack_score_panel(const MatrixView<const float>& vectors, bool with_half_norms, float* tiles, float* offsets);
std::int64_t score_panel_padded(std::int64_t count);
}  // namespace detail

}  // namespace kvsift::cpu
