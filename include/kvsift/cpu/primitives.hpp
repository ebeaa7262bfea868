#pragma once
/// CPU primitives shared by every selector (no selector writes its own): scoring a query against many
/// vectors, gathering rows, index deduplication, k-means, batched RoPE. Top-K lives in cpu/topk.hpp.
/// Host memory. Deterministic: the same inputs (and seed) give the same outputs, whatever the thread count.

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cpu {

/// scores[i] = scale * dot(q, rows.row(i)) for every row (fp32 accumulation); q has rows.cols entries.
template <class T>
void gemv_scores(std::span<const float> q, const MatrixView<const T>& rows, float scale, std::span<float> scores,
                 ThreadPool* pool = nullptr);

/// dst.row(i) = src.row(indices[i]); indices must be in [0, src.rows).
template <class T>
void gather_rows(const MatrixView<const T>& src, std::span<const std::int32_t> indices, const MatrixView<T>& dst);

/// Sorts indices ascending and removes repeats; returns the number of distinct indices, which now lead.
std::size_t sort_unique(std::span<std::int32_t> indices);

/// Rotates each row of `rows` (head_dim = rows.cols) for its position (positions[i]), or undoes it.
void apply_rope_rows(const MatrixView<float>& rows, std::span<const std::int64_t> positions, const RopeConfig& rope,
                     bool inverse = false);

enum class KMeansMetric : std::uint8_t {
  l2,      ///< nearest centroid by squared Euclidean distance; centroid = mean
  cosine,  ///< largest cosine similarity; points and centroids are compared normalized, centroid = normalized mean
};

struct KMeansConfig {
  std::int32_t clusters = 0;
  std::int32_t iterations = 10;  ///< fixed count (no early stop), so cost and result are predictable
  KMeansMetric metric = KMeansMetric::l2;
  std::uint64_t seed = 0;        ///< the seeding draws from this seed only
};

struct KMeansResult {
  std::vector<float> centroids;        ///< [clusters, dim]
  std::vector<std::int32_t> assignment;  ///< [points]: the nearest centroid (ties: smaller id)
};

/// Fills assignment[i] with the nearest centroid of point i under the metric (ties: smaller id). The CPU
/// assigner ranks centroids by x.c - |c|^2 / 2 (L2) or x.c (cosine) with SIMD dot products, so points almost
/// exactly between two centroids may resolve differently at different SIMD levels. Points are
/// fp32 [n, dim] (normalized for cosine), centroids [k, dim]. The CPU assigner is cpu::assign_nearest; a
/// backend may pass its own (e.g. a GPU one), which is how one k-means serves every backend.
using KMeansAssigner = std::function<void(const MatrixView<const float>& points, const MatrixView<const float>& centroids,
                                          KMeansMetric metric, std::span<std::int32_t> assignment)>;

void assign_nearest(const MatrixView<const float>& points, const MatrixView<const float>& centroids, KMeansMetric metric,
                    std::span<std::int32_t> assignment, ThreadPool* pool = nullptr);

/// k-means with greedy k-means++ seeding (2 + ln k candidates per centroid) and a fixed number of Lloyd
/// iterations. An empty cluster keeps its previous centroid. Deterministic for a given seed, whose draws are
/// those of cuda::kmeans (core/kmeans_seeding.hpp). clusters must be in [1, points.rows].
template <class T>
KMeansResult kmeans(const MatrixView<const T>& points, const KMeansConfig& config, const KMeansAssigner& assigner = {},
                    ThreadPool* pool = nullptr);

namespace detail {
/// The checks of a k-means configuration that cpu::kmeans and cuda::kmeans share: clusters in [1, points],
/// iterations >= 0.
void check_kmeans_config(const char* where, std::int64_t points, const KMeansConfig& config);
}  // namespace detail

}  // namespace kvsift::cpu
