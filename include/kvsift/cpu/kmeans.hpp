#pragma once
/// Batched k-means on the CPU: many small independent problems (layers x heads x subspaces) in one call, with
/// optional sample weights. The twin of cuda/kmeans.hpp, with the same arguments but the context, and the same
/// seeding bits (core/kmeans_batched.hpp). Host memory; caller workspace, no allocation; deterministic and
/// independent of the thread count. Argument checks: core/detail/kmeans_checks.hpp.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/kmeans_batched.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/detail/primitives_kernels.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// Bytes of host workspace (256-byte aligned): the points in fp32 (4 * problems * n * dim), the seeding's
/// distances, the clusters' counts, and for full-batch steps the update's keys, the segment means' workspace and
/// the problems' centroid panels, for mini-batch steps the drawn points and their centroids
/// (8 * problems * batch_size) and the clusters' sums (8 * problems * clusters * (dim + 2)).
std::size_t batched_kmeans_workspace_bytes(std::int32_t problems, std::int64_t n, std::int32_t dim,
                                           const BatchedKMeansConfig& config, const Context& = {});

/// k-means of each problem p < points.problems, independently: problem p's points are points.row(p, i), i < n =
/// points.rows, dim = points.cols, with weight w_i = weights[p * n + i] (1 with weights == nullptr).
///   1. Points are converted to fp32 and, for cosine, normalized (spherical k-means).
///   2. Greedy k-means++ seeding: centroid 0 is the point drawn by kmeans_first_point; each
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
/// Mini-batch steps (config.batch_size in [1, n); BatchedKMeansConfig::batch_size) replace step 3 and 4: step t
/// draws batch_size points per problem with replacement (detail::minibatch_point(seed + p, t, slot)) and gives
/// each its nearest centroid (detail::nearest_centroid: ranked by 1 - cosine or the squared L2 distance itself;
/// ties: smaller id). Each centroid c that drew weight W_c > 0 (the sum of its drawn points' w, a point drawn twice
/// counting twice) becomes (v_c c + sum of its drawn w_i x_i) / (v_c + W_c), then v_c += W_c, with v_c = 0 after
/// the seeding (the first draws replace the seed by their weighted mean); sums in fp64 in batch order; normalized
/// for cosine. One that drew only weight 0 stays. With EmptyCluster::reseed, the clusters that no drawn point has
/// yet reached take the step's drawn points in the reseed order (keys w_i d(x_i, c_{a_i}) after the update; a
/// point drawn twice serves once); they keep v_c = 0. The final assignment uses detail::nearest_centroid too.
/// centroids: [problems, clusters, dim] fp32, packed; assignment: [problems, n] packed. Weights: [problems, n]
/// packed, finite and >= 0 (refused otherwise), or nullptr.
///
/// Same results as cuda::kmeans_batched: the seeding bit for bit; with mini-batch steps everything bit for bit;
/// with full-batch steps assignments and centroids unless a point sits within fp32 rounding of a tie between two
/// centroids (the backends' dot products sum in other orders), which can then change what follows. With ctx.pool:
/// problems in parallel for the seeding and the mini-batch steps, (problem, rows) items for the assignment,
/// segments for the full-batch update; the results do not depend on the thread count.
///
/// Costs per problem: seeding k (2 + ln k + 2) n dim fp32 FMAs, each Lloyd step k n dim (assignment) + n dim,
/// each mini-batch step batch_size (k + 1) dim (scalar here, unlike the SIMD full-batch assigner), the final
/// assignment k n dim.
template <class T>
void kmeans_batched(const BatchedMatrixView<const T>& points, const float* weights, const BatchedKMeansConfig& config,
                    float* centroids, std::int32_t* assignment, std::span<std::byte> workspace,
                    const Context& ctx = {});

namespace detail {
/// Packs `vectors` into a ScorePanel over caller storage: tiles [padded * dim] and offsets [padded] floats,
/// padded = vectors.rows rounded up to ScorePanel::kPanelPadding; offsets -|v|^2 / 2 with with_half_norms, else 0.
ScorePanel pack_score_panel(const MatrixView<const float>& vectors, bool with_half_norms, float* tiles, float* offsets);
std::int64_t score_panel_padded(std::int64_t count);
}  // namespace detail

}  // namespace kvsift::cpu
