#pragma once
/// The argument checks of batched k-means that cpu/kmeans.hpp and cuda/kmeans.hpp share: the same refusals with
/// the same words on both backends. Weights in the backend's memory are checked by each backend where it can
/// read them.

#include <climits>
#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/core/kmeans_batched.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::detail {

/// problems >= 1, n in [1, 2^31) with problems * n < 2^31, dim in [1, 256], clusters in [1, n], iterations >= 0,
/// a known metric and empty-cluster policy, batch_size >= 0.
inline void check_batched_kmeans_shape(const char* where, std::int32_t problems, std::int64_t n, std::int32_t dim,
                                       const BatchedKMeansConfig& config) {
  KVSIFT_CHECK(problems >= 1, where, "problems (= {}) must be >= 1", problems);
  KVSIFT_CHECK(n >= 1 && n <= INT32_MAX, where, "n (= {}) is outside [1, 2^31)", n);
  KVSIFT_CHECK(std::int64_t(problems) * n <= INT32_MAX, where, "problems * n (= {} * {}) exceeds 2^31 - 1", problems, n);
  KVSIFT_CHECK(dim >= 1 && dim <= 256, where, "dim (= {}) is outside [1, 256]", dim);
  KVSIFT_CHECK(config.clusters >= 1 && config.clusters <= n, where, "config.clusters (= {}) is outside [1, n = {}]",
               config.clusters, n);
  KVSIFT_CHECK(std::int64_t(problems) * config.clusters <= INT32_MAX, where,
               "problems * config.clusters (= {} * {}) exceeds 2^31 - 1", problems, config.clusters);
  KVSIFT_CHECK(config.iterations >= 0, where, "config.iterations (= {}) must be >= 0", config.iterations);
  KVSIFT_CHECK(config.metric == KMeansMetric::l2 || config.metric == KMeansMetric::cosine, where,
               "config.metric (= {}) is neither KMeansMetric::l2 nor KMeansMetric::cosine", int(config.metric));
  KVSIFT_CHECK(config.empty == EmptyCluster::keep || config.empty == EmptyCluster::reseed, where,
               "config.empty (= {}) is neither EmptyCluster::keep nor EmptyCluster::reseed", int(config.empty));
  KVSIFT_CHECK(config.batch_size >= 0, where, "config.batch_size (= {}) must be >= 0 (0: full batch)", config.batch_size);
}

/// The shape checks, plus: points is a valid view (problem_stride >= 0), weights (if any) 4-byte aligned,
/// centroids and assignment non-null.
template <class T>
void check_batched_kmeans(const char* where, const BatchedMatrixView<const T>& points, const float* weights,
                          const BatchedKMeansConfig& config, const float* centroids, const std::int32_t* assignment) {
  check_batched_kmeans_shape(where, points.problems, points.rows, points.cols, config);
  validate(points.problem(0), where, "points");
  KVSIFT_CHECK(points.problem_stride >= 0, where, "points.problem_stride (= {}) must be >= 0", points.problem_stride);
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(weights) % alignof(float) == 0, where,
               "weights ({}) is not {}-byte aligned", static_cast<const void*>(weights), alignof(float));
  KVSIFT_CHECK(centroids != nullptr, where, "centroids is a null pointer");
  KVSIFT_CHECK(assignment != nullptr, where, "assignment is a null pointer");
}

}  // namespace kvsift::detail
