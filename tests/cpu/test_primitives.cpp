// CPU primitives shared by the selectors: the nearest-centroid assignment (cpu::assign_nearest). group_scores
// and topk_rows are tested in test_selection_primitives.cpp, batched k-means in test_batched_kmeans.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/simd.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using CpuPrimitives = test::SeededTest;

/// x.c - |c|^2 / 2 (L2) or x.c in fp64: the ranking the assigner approximates in fp32.
double assignment_score(const float* x, const float* c, std::int32_t d, KMeansMetric metric) {
  double dot = 0.0, norm = 0.0;
  for (std::int32_t j = 0; j < d; ++j) dot += double(x[j]) * c[j], norm += double(c[j]) * c[j];
  return metric == KMeansMetric::cosine ? dot : dot - 0.5 * norm;
}

TEST_F(CpuPrimitives, AssignNearestPicksTheBestCentroidAtEverySimdLevel) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  // 72 channels and 130 centroids leave partial blocks in both directions.
  const std::int32_t n = 1001, k = 130, d = 72;
  const auto points = rng.normal(std::size_t(n) * d), centroids = rng.normal(std::size_t(k) * d);
  const auto pv = MatrixView<const float>::packed(points.data(), n, d);
  const auto cv = MatrixView<const float>::packed(centroids.data(), k, d);
  for (const cpu::SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    SCOPED_TRACE(std::string(cpu::simd_level_name(level)));
    for (const auto metric : {KMeansMetric::l2, KMeansMetric::cosine}) {
      std::vector<std::int32_t> alone(n, -1), pooled(n, -1);
      cpu::assign_nearest(pv, cv, metric, alone);
      cpu::ThreadPool pool(3);
      cpu::assign_nearest(pv, cv, metric, pooled, &pool);
      EXPECT_EQ(alone, pooled);  // any thread count: the same result
      for (std::int32_t i = 0; i < n; ++i) {
        ASSERT_GE(alone[i], 0);
        ASSERT_LT(alone[i], k);
        double best = -INFINITY;
        for (std::int32_t c = 0; c < k; ++c) best = std::max(best, assignment_score(pv.row(i), cv.row(c), d, metric));
        const double chosen = assignment_score(pv.row(i), cv.row(alone[i]), d, metric);
        ASSERT_GE(chosen, best - 1e-4 * (1.0 + std::abs(best))) << "point " << i;  // fp32 rounding only
      }
    }
  }
}

TEST_F(CpuPrimitives, AssignNearestBreaksTiesTowardTheSmallerIdAndRefusesBadShapes) {
  // Centroids 1 and 3 are equal: every point nearest to them goes to 1.
  const std::vector<float> centroids = {0, 0, 4, 4, -4, 4, 4, 4};
  const std::vector<float> points = {3, 3, 0, 1, 5, 4};
  const auto cv = MatrixView<const float>::packed(centroids.data(), 4, 2);
  std::vector<std::int32_t> out(3, -1);
  cpu::assign_nearest(MatrixView<const float>::packed(points.data(), 3, 2), cv, KMeansMetric::l2, out);
  EXPECT_EQ(out, (std::vector<std::int32_t>{1, 0, 1}));
  test::expect_error(
      [&] { cpu::assign_nearest(MatrixView<const float>::packed(points.data(), 2, 3), cv, KMeansMetric::l2, out); },
      "points.cols (= 3) != centroids.cols (= 2)");
  std::vector<std::int32_t> small(2);
  test::expect_error(
      [&] { cpu::assign_nearest(MatrixView<const float>::packed(points.data(), 3, 2), cv, KMeansMetric::l2, small); },
      "assignment.size() (= 2) < points.rows (= 3)");
}

}  // namespace
}  // namespace kvsift
