// CPU primitives shared by the selectors: GEMV scores, gather, dedup, top-K, RoPE rows, k-means.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <string>

#include "attention_check.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/simd.hpp"
#include "kvsift/cpu/topk.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::Random;

using CpuPrimitives = test::SeededTest;

TEST_F(CpuPrimitives, GemvScoresMatchFp64Dots) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const auto check = [&]<class T>(T) {
    const std::int32_t n = rng.uniform_int(1, 500), d = rng.uniform_int(1, 200);
    const auto values = test::to_storage<T>(rng.normal(std::size_t(n) * (d + 3)));  // row stride d + 3
    const auto q = rng.normal(d);
    std::vector<float> scores(n, test::kPoison);
    cpu::ThreadPool pool(3);
    cpu::gemv_scores<T>(q, MatrixView<const T>{values.data(), n, d, d + 3}, 0.5f, scores, &pool);
    for (std::int32_t i = 0; i < n; ++i) {
      double want = 0;
      for (std::int32_t c = 0; c < d; ++c) want += double(q[c]) * to_float(values[std::size_t(i) * (d + 3) + c]);
      ASSERT_NEAR(scores[i], 0.5 * want, 1e-5 * (1 + std::abs(want)) * std::sqrt(double(d))) << i;
    }
  };
  for (cpu::SimdLevel level : {cpu::SimdLevel::scalar, cpu::SimdLevel::avx2, cpu::SimdLevel::avx512}) {
    if (level > cpu::detected_simd_level()) continue;
    cpu::ScopedSimdLevel force(level);
    SCOPED_TRACE(std::string(cpu::simd_level_name(level)));
    check(float{});
    check(half{});
    check(bfloat16{});
  }
}

TEST_F(CpuPrimitives, GatherCopiesRowsAndRefusesBadIndices) {
  const auto src = rng.normal(50 * 7);
  std::vector<float> dst(4 * 7, test::kPoison);
  const std::vector<std::int32_t> idx = {49, 0, 13, 13};
  cpu::gather_rows<float>(MatrixView<const float>::packed(src.data(), 50, 7), idx, MatrixView<float>::packed(dst.data(), 4, 7));
  for (std::size_t i = 0; i < idx.size(); ++i) {
    for (int c = 0; c < 7; ++c) EXPECT_EQ(dst[i * 7 + c], src[std::size_t(idx[i]) * 7 + c]);
  }
  const std::vector<std::int32_t> bad = {3, 50};
  test::expect_error(
      [&] {
        cpu::gather_rows<float>(MatrixView<const float>::packed(src.data(), 50, 7), bad,
                                MatrixView<float>::packed(dst.data(), 4, 7));
      },
      "indices[1] (= 50) is outside [0, src.rows = 50)");
}

TEST_F(CpuPrimitives, SortUniqueKeepsEachIndexOnceAscending) {
  std::vector<std::int32_t> idx(300);
  for (auto& i : idx) i = rng.uniform_int(0, 99);
  const std::set<std::int32_t> expected(idx.begin(), idx.end());
  const std::size_t n = cpu::sort_unique(idx);
  EXPECT_EQ(std::vector<std::int32_t>(idx.begin(), idx.begin() + n), std::vector<std::int32_t>(expected.begin(), expected.end()));
}

/// kvsift's ranking rule, stated independently of the implementation: NaN first, then higher score, on equal
/// scores the smaller index first.
bool ranks_before(float a, std::int32_t ia, float b, std::int32_t ib) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

TEST_F(CpuPrimitives, TopKAgreesWithAFullSortUnderTheTieRule) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::vector<std::uint64_t> scratch;
  for (int trial = 0; trial < 20; ++trial) {
    const std::int32_t n = rng.uniform_int(1, 3000), k = rng.uniform_int(0, n);
    std::vector<float> scores(n);
    for (auto& s : scores) s = float(rng.uniform_int(-20, 20));  // many ties
    if (n > 3) scores[n / 2] = NAN;
    if (n > 5) scores[n / 3] = -INFINITY;
    if (n > 7) scores[n / 5] = -0.0f;  // equal to +0.0 under the rule
    std::vector<std::int32_t> order(n), out(k);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) { return ranks_before(scores[a], a, scores[b], b); });
    std::vector<std::int32_t> expected(order.begin(), order.begin() + k);
    std::sort(expected.begin(), expected.end());
    cpu::topk_indices(scores, k, out, scratch);
    EXPECT_EQ(out, expected) << "n " << n << " k " << k;
  }
}

TEST_F(CpuPrimitives, KMeansRecoversPlantedClustersAndIsDeterministic) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const auto& [metric, level] : {std::pair{cpu::KMeansMetric::l2, cpu::SimdLevel::scalar},
                                      std::pair{cpu::KMeansMetric::cosine, cpu::SimdLevel::avx2},
                                      std::pair{cpu::KMeansMetric::l2, cpu::SimdLevel::avx512},
                                      std::pair{cpu::KMeansMetric::cosine, cpu::SimdLevel::avx512}}) {
    if (level > cpu::detected_simd_level()) continue;
    cpu::ScopedSimdLevel force(level);
    SCOPED_TRACE(std::string(cpu::simd_level_name(level)));
    const std::int32_t k = 6, per = 40, d = 32;
    const auto [points, truth] = test::planted_clusters(rng, k, per, d);
    const auto view = MatrixView<const float>::packed(points.data(), k * per, d);
    const cpu::KMeansConfig config{.clusters = k, .iterations = 15, .metric = metric, .seed = seed};
    cpu::ThreadPool pool(3);
    const auto a = cpu::kmeans<float>(view, config, {}, &pool);
    const auto b = cpu::kmeans<float>(view, config);
    EXPECT_EQ(a.centroids, b.centroids);  // same seed, any thread count: the same result
    EXPECT_EQ(a.assignment, b.assignment);
    // Every planted cluster maps to one found cluster and vice versa (k-means++ on well-separated data).
    std::map<std::int32_t, std::set<std::int32_t>> found_for_true, true_for_found;
    for (std::size_t i = 0; i < truth.size(); ++i) {
      found_for_true[truth[i]].insert(a.assignment[i]);
      true_for_found[a.assignment[i]].insert(truth[i]);
    }
    for (const auto& [t, f] : found_for_true) EXPECT_EQ(f.size(), 1u) << "planted cluster " << t << " metric " << int(metric);
    EXPECT_EQ(true_for_found.size(), std::size_t(k));
    if (metric == cpu::KMeansMetric::cosine) {
      for (std::int32_t c = 0; c < k; ++c) {
        double norm = 0;
        for (std::int32_t j = 0; j < d; ++j) norm += std::pow(a.centroids[std::size_t(c) * d + j], 2);
        EXPECT_NEAR(norm, 1.0, 1e-5);
      }
    }
  }
}

TEST_F(CpuPrimitives, KMeansUsesTheGivenAssignerAndRefusesTooManyClusters) {
  const auto [points, truth] = test::planted_clusters(rng, 3, 10, 8);
  const auto view = MatrixView<const float>::packed(points.data(), 30, 8);
  int calls = 0;
  const cpu::KMeansAssigner counting = [&](const MatrixView<const float>& p, const MatrixView<const float>& c,
                                           cpu::KMeansMetric m, std::span<std::int32_t> out) {
    ++calls;
    cpu::assign_nearest(p, c, m, out);
  };
  const auto with = cpu::kmeans<float>(view, {.clusters = 3, .iterations = 4, .seed = 7}, counting);
  const auto without = cpu::kmeans<float>(view, {.clusters = 3, .iterations = 4, .seed = 7});
  EXPECT_EQ(calls, 5);  // one per iteration, one final
  EXPECT_EQ(with.assignment, without.assignment);
  test::expect_error([&] { cpu::kmeans<float>(view, {.clusters = 31}); },
                     "config.clusters (= 31) is outside [1, points = 30]");
}

}  // namespace
}  // namespace kvsift
