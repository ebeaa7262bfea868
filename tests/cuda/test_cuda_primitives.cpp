// CUDA primitives against their CPU twins: GEMV scores, gather, RoPE rows, deduplication, k-means (assignment,
// and the whole clustering on the device). Top-K: test_cuda_topk.cpp.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cuda/primitives.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::Random;

using CudaPrimitives = test::GpuTest;

TEST_F(CudaPrimitives, GemvAndGatherAgreeWithTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t n = 3001, d = 128;
  const auto rows_f = rng.normal(std::size_t(n) * d);
  const auto rows = test::to_storage<bfloat16>(rows_f);
  const auto q = rng.normal(d);
  std::vector<float> cpu_scores(n);
  cpu::gemv_scores<bfloat16>(q, MatrixView<const bfloat16>::packed(rows.data(), n, d), 0.3f, cpu_scores);
  DeviceBuffer<bfloat16> d_rows(rows);
  DeviceBuffer<float> d_q(q), d_scores(n);
  d_scores.poison();
  cuda::gemv_scores<bfloat16>(d_q.data(), MatrixView<const bfloat16>::packed(d_rows.data(), n, d), 0.3f, d_scores.data(), nullptr);
  const auto gpu_scores = d_scores.download();
  for (std::int32_t i = 0; i < n; ++i) ASSERT_NEAR(gpu_scores[i], cpu_scores[i], 1e-4 * (1 + std::abs(cpu_scores[i])));

  std::vector<std::int32_t> idx(500);
  for (auto& i : idx) i = rng.uniform_int(0, n - 1);
  DeviceBuffer<std::int32_t> d_idx(idx);
  DeviceBuffer<bfloat16> d_dst(idx.size() * d);
  d_dst.poison();
  cuda::gather_rows<bfloat16>(MatrixView<const bfloat16>::packed(d_rows.data(), n, d), d_idx.data(), 500,
                              MatrixView<bfloat16>::packed(d_dst.data(), 500, d), nullptr);
  const auto gathered = d_dst.download();
  for (std::size_t r = 0; r < idx.size(); ++r) {
    for (std::int32_t c = 0; c < d; ++c) ASSERT_EQ(gathered[r * d + c].bits, rows[std::size_t(idx[r]) * d + c].bits);
  }
}

TEST_F(CudaPrimitives, SortUniqueEqualsTheCpuDedupPerRow) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int64_t rows = 37;
  const std::int32_t capacity = 3000;
  std::vector<std::int32_t> indices(std::size_t(rows) * capacity), counts(rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    counts[r] = r == 0 ? 0 : r == 1 ? capacity : r == 2 ? 1 : rng.uniform_int(0, capacity);
    const std::int32_t range = rng.uniform_int(1, 4000);  // small ranges repeat a lot
    for (std::int32_t i = 0; i < capacity; ++i) indices[std::size_t(r) * capacity + i] = rng.uniform_int(0, range);
  }
  counts[5] = -1;            // bad counts: reported, row untouched
  counts[6] = capacity + 1;
  DeviceBuffer<std::int32_t> d_indices(indices), d_counts(counts), d_unique(rows);
  d_unique.poison();
  const std::size_t bytes = cuda::sort_unique_workspace_bytes(rows, capacity);
  DeviceBuffer<std::byte> ws(bytes);
  ws.poison();
  cuda::sort_unique(d_indices.data(), rows, capacity, d_counts.data(), d_unique.data(), {ws.data(), bytes}, nullptr);
  const auto got = d_indices.download();
  const auto unique = d_unique.download();
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto row_begin = indices.begin() + r * capacity;
    if (r == 5 || r == 6) {
      EXPECT_EQ(unique[r], -1) << "row " << r;
      EXPECT_TRUE(std::equal(row_begin, row_begin + capacity, got.begin() + r * capacity)) << "row " << r;
      continue;
    }
    std::vector<std::int32_t> expected(row_begin, row_begin + counts[r]);
    expected.resize(cpu::sort_unique(expected));
    ASSERT_EQ(unique[r], std::int32_t(expected.size())) << "row " << r;
    ASSERT_EQ(std::vector<std::int32_t>(got.begin() + r * capacity, got.begin() + r * capacity + unique[r]), expected)
        << "row " << r;
  }
}

/// x.c - |c|^2 / 2 (L2) or x.c in fp64: the ranking both assigners approximate.
double assignment_score(const float* x, const float* c, std::int32_t d, cpu::KMeansMetric metric) {
  double dot = 0.0, norm = 0.0;
  for (std::int32_t j = 0; j < d; ++j) dot += double(x[j]) * c[j], norm += double(c[j]) * c[j];
  return metric == cpu::KMeansMetric::cosine ? dot : dot - 0.5 * norm;
}

TEST_F(CudaPrimitives, AssignNearestPicksTheBestCentroidAsTheCpuDoes) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const auto metric : {cpu::KMeansMetric::l2, cpu::KMeansMetric::cosine}) {
    // 72 channels and 130 centroids leave partial tiles in both directions.
    const std::int32_t n = 3001, k = 130, d = 72;
    auto points = rng.normal(std::size_t(n) * d), centroids = rng.normal(std::size_t(k) * d);
    const auto pv = MatrixView<const float>::packed(points.data(), n, d);
    const auto cv = MatrixView<const float>::packed(centroids.data(), k, d);
    std::vector<std::int32_t> cpu_assignment(n);
    cpu::assign_nearest(pv, cv, metric, cpu_assignment);
    DeviceBuffer<float> d_points(points), d_centroids(centroids);
    DeviceBuffer<std::int32_t> d_assignment(n);
    d_assignment.poison();
    cuda::assign_nearest(MatrixView<const float>::packed(d_points.data(), n, d),
                         MatrixView<const float>::packed(d_centroids.data(), k, d), metric, d_assignment.data(), nullptr);
    const auto gpu_assignment = d_assignment.download();
    int differ = 0;
    for (std::int32_t i = 0; i < n; ++i) {
      ASSERT_GE(gpu_assignment[i], 0);
      ASSERT_LT(gpu_assignment[i], k);
      double best = -INFINITY;
      for (std::int32_t c = 0; c < k; ++c) best = std::max(best, assignment_score(pv.row(i), cv.row(c), d, metric));
      const double chosen = assignment_score(pv.row(i), cv.row(gpu_assignment[i]), d, metric);
      ASSERT_GE(chosen, best - 1e-4 * (1.0 + std::abs(best))) << "point " << i;  // fp32 rounding only
      differ += gpu_assignment[i] != cpu_assignment[i];
    }
    EXPECT_LE(differ, n / 500) << "points assigned differently from the CPU";
  }
}

TEST_F(CudaPrimitives, KMeansWithTheGpuAssignerEqualsTheCpuKMeans) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t k = 12, per = 150, d = 64;
  const auto [points, truth] = test::planted_clusters(rng, k, per, d);
  const auto view = MatrixView<const float>::packed(points.data(), std::int64_t(k) * per, d);
  for (const auto metric : {cpu::KMeansMetric::l2, cpu::KMeansMetric::cosine}) {
    const cpu::KMeansConfig config{.clusters = k, .iterations = 8, .metric = metric, .seed = seed};
    cuda::DeviceKMeansAssigner gpu;
    const auto on_gpu = cpu::kmeans<float>(view, config, std::ref(gpu));
    const auto on_cpu = cpu::kmeans<float>(view, config);
    EXPECT_EQ(on_gpu.assignment, on_cpu.assignment);
    EXPECT_EQ(on_gpu.centroids, on_cpu.centroids);  // same assignments: the CPU's updates are bit-identical
  }
}

/// cuda::kmeans on device copies of `points`, with poisoned outputs and workspace.
struct DeviceKMeansRun {
  std::vector<float> centroids;
  std::vector<std::int32_t> assignment;
};
template <class T>
DeviceKMeansRun run_device_kmeans(const std::vector<T>& points, std::int32_t n, std::int32_t d,
                                  const cpu::KMeansConfig& config) {
  DeviceBuffer<T> d_points(points);
  DeviceBuffer<float> d_centroids(std::size_t(config.clusters) * d);
  DeviceBuffer<std::int32_t> d_assignment(n);
  const std::size_t bytes = cuda::kmeans_workspace_bytes(n, d, config);
  DeviceBuffer<std::byte> ws(bytes);
  d_centroids.poison();
  d_assignment.poison();
  ws.poison();
  cuda::kmeans(MatrixView<const T>::packed(d_points.data(), n, d), config,
               MatrixView<float>::packed(d_centroids.data(), config.clusters, d), d_assignment.data(), {ws.data(), bytes},
               nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  return {d_centroids.download(), d_assignment.download()};
}

TEST_F(CudaPrimitives, KMeansOnTheDeviceEqualsTheCpuKMeans) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t k = 12, per = 150, d = 64, n = k * per;
  const auto [points, truth] = test::planted_clusters(rng, k, per, d);
  const auto view = MatrixView<const float>::packed(points.data(), n, d);
  for (const auto metric : {cpu::KMeansMetric::l2, cpu::KMeansMetric::cosine}) {
    const cpu::KMeansConfig config{.clusters = k, .iterations = 8, .metric = metric, .seed = seed};
    const auto on_cpu = cpu::kmeans<float>(view, config);
    const auto on_gpu = run_device_kmeans(points, n, d, config);
    EXPECT_EQ(on_gpu.assignment, on_cpu.assignment);
    EXPECT_EQ(on_gpu.centroids, on_cpu.centroids);  // same seeds and assignments: sums in the CPU's order
  }
}

TEST_F(CudaPrimitives, KMeansSeedingOnTheDeviceDrawsTheCpuCentroids) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  // Unclustered points with four coordinates of +-1 and the rest 0 (normalized: +-0.5): every distance, dot
  // product and prefix sum is exact in both backends, whatever their summation order, so both must draw the
  // same candidates and choose the same ones, exact ties included (first candidate, smaller centroid id).
  const std::int32_t n = 3001, k = 130, d = 72, nonzeros = 4;
  std::vector<float> points(std::size_t(n) * d, 0.0f);
  for (std::int32_t i = 0; i < n; ++i) {
    for (int placed = 0; placed < nonzeros;) {
      float& x = points[std::size_t(i) * d + rng.uniform_int(0, d - 1)];
      if (x == 0.0f) x = rng.uniform_int(0, 1) != 0 ? 1.0f : -1.0f, ++placed;
    }
  }
  const auto view = MatrixView<const float>::packed(points.data(), n, d);
  for (const auto metric : {cpu::KMeansMetric::l2, cpu::KMeansMetric::cosine}) {
    SCOPED_TRACE(metric == cpu::KMeansMetric::l2 ? "l2" : "cosine");
    const cpu::KMeansConfig config{.clusters = k, .iterations = 0, .metric = metric, .seed = seed};
    const auto on_cpu = cpu::kmeans<float>(view, config);
    const auto on_gpu = run_device_kmeans(points, n, d, config);
    EXPECT_EQ(on_gpu.centroids, on_cpu.centroids);
    EXPECT_EQ(on_gpu.assignment, on_cpu.assignment);
  }
}

TEST_F(CudaPrimitives, KMeansOnTheDeviceUpdatesToTheMeansAndIsDeterministic) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t n = 5000, k = 64, d = 128;
  const auto normal = rng.normal(std::size_t(n) * d);
  std::vector<bfloat16> points(normal.size());
  std::vector<double> x(normal.size());  // the points as the k-means sees them, in fp64
  for (std::size_t e = 0; e < normal.size(); ++e) points[e] = float_to_bfloat16(normal[e]), x[e] = double(bfloat16_to_float(points[e]));
  for (const auto metric : {cpu::KMeansMetric::l2, cpu::KMeansMetric::cosine}) {
    SCOPED_TRACE(metric == cpu::KMeansMetric::l2 ? "l2" : "cosine");
    std::vector<double> xs = x;
    if (metric == cpu::KMeansMetric::cosine) {
      for (std::int32_t i = 0; i < n; ++i) {
        double norm = 0.0;
        for (std::int32_t j = 0; j < d; ++j) norm += xs[std::size_t(i) * d + j] * xs[std::size_t(i) * d + j];
        for (std::int32_t j = 0; j < d; ++j) xs[std::size_t(i) * d + j] /= std::sqrt(norm);
      }
    }
    // One Lloyd step after the seeding: each centroid is the fp64 mean of the points the seeds drew to it.
    const auto seeded = run_device_kmeans(points, n, d, {.clusters = k, .iterations = 0, .metric = metric, .seed = seed});
    const auto stepped = run_device_kmeans(points, n, d, {.clusters = k, .iterations = 1, .metric = metric, .seed = seed});
    std::vector<double> sums(std::size_t(k) * d, 0.0);
    std::vector<std::int32_t> counts(k, 0);
    for (std::int32_t i = 0; i < n; ++i) {
      const std::int32_t c = seeded.assignment[i];
      ASSERT_GE(c, 0);
      ASSERT_LT(c, k);
      ++counts[c];
      for (std::int32_t j = 0; j < d; ++j) sums[std::size_t(c) * d + j] += xs[std::size_t(i) * d + j];
    }
    for (std::int32_t c = 0; c < k; ++c) {
      std::vector<double> mean(d);
      double norm = 0.0;
      for (std::int32_t j = 0; j < d; ++j) {
        mean[j] = counts[c] == 0 ? seeded.centroids[std::size_t(c) * d + j] : sums[std::size_t(c) * d + j] / counts[c];
        norm += mean[j] * mean[j];
      }
      for (std::int32_t j = 0; j < d; ++j) {
        const double expected = metric == cpu::KMeansMetric::cosine ? mean[j] / std::sqrt(norm) : mean[j];
        ASSERT_NEAR(stepped.centroids[std::size_t(c) * d + j], expected, 1e-5 * (1.0 + std::abs(expected)))
            << "cluster " << c << " (" << counts[c] << " points) channel " << j;
      }
    }
    // The returned assignment is the nearest centroid of each point, within fp32 rounding.
    const auto again = run_device_kmeans(points, n, d, {.clusters = k, .iterations = 1, .metric = metric, .seed = seed});
    EXPECT_EQ(again.centroids, stepped.centroids);
    EXPECT_EQ(again.assignment, stepped.assignment);
    std::vector<float> xs_float(xs.begin(), xs.end());
    for (std::int32_t i = 0; i < n; ++i) {
      double best = -INFINITY;
      for (std::int32_t c = 0; c < k; ++c) {
        best = std::max(best, assignment_score(&xs_float[std::size_t(i) * d], &stepped.centroids[std::size_t(c) * d], d, metric));
      }
      const double chosen =
          assignment_score(&xs_float[std::size_t(i) * d], &stepped.centroids[std::size_t(stepped.assignment[i]) * d], d, metric);
      ASSERT_GE(chosen, best - 1e-4 * (1.0 + std::abs(best))) << "point " << i;
    }
  }
}

TEST_F(CudaPrimitives, KMeansRefusesAWorkspaceTooSmall) {
  const std::int32_t n = 100, d = 16;
  DeviceBuffer<float> points(std::size_t(n) * d), centroids(std::size_t(4) * d);
  DeviceBuffer<std::int32_t> assignment(n);
  const cpu::KMeansConfig config{.clusters = 4};
  const std::size_t bytes = cuda::kmeans_workspace_bytes(n, d, config);
  DeviceBuffer<std::byte> ws(bytes);
  test::expect_error(
      [&] {
        cuda::kmeans(MatrixView<const float>::packed(points.data(), n, d), config,
                     MatrixView<float>::packed(centroids.data(), 4, d), assignment.data(), {ws.data(), bytes / 2}, nullptr);
      },
      {"cuda::kmeans", "workspace too small", "needs bytes"});
}

TEST(CudaPrimitivesBadInput, RefusedBeforeAnyDeviceCall) {
  test::expect_error([] { cuda::sort_unique_workspace_bytes(0, 10); }, "rows (= 0) and capacity (= 10) must be positive");
  test::expect_error([] { cuda::sort_unique_workspace_bytes(1 << 20, 1 << 12); }, "exceeds 2^31 - 1");
  std::vector<float> p(40), c(30);
  test::expect_error(
      [&] {
        cuda::assign_nearest(MatrixView<const float>::packed(p.data(), 5, 8), MatrixView<const float>::packed(c.data(), 5, 6),
                             cpu::KMeansMetric::l2, nullptr, nullptr);
      },
      "points.cols (= 8) != centroids.cols (= 6)");
  test::expect_error(
      [&] {
        std::int32_t out[5];
        cuda::assign_nearest(MatrixView<const float>::packed(p.data(), 5, 8), MatrixView<const float>::packed(c.data(), 3, 8),
                             static_cast<cpu::KMeansMetric>(7), out, nullptr);
      },
      "unknown KMeansMetric (7)");
  const auto kmeans = [&](std::int64_t n, std::int32_t d, const cpu::KMeansConfig& config, std::int64_t centroid_rows,
                          std::int32_t* assignment) {
    cuda::kmeans(MatrixView<const float>::packed(p.data(), n, d), config,
                 MatrixView<float>::packed(c.data(), centroid_rows, d), assignment, {}, nullptr);
  };
  std::int32_t out[5];
  test::expect_error([&] { kmeans(5, 8, {.clusters = 0}, 1, out); }, "config.clusters (= 0) is outside [1, points = 5]");
  test::expect_error([&] { kmeans(5, 8, {.clusters = 6}, 6, out); }, "config.clusters (= 6) is outside [1, points = 5]");
  test::expect_error([&] { kmeans(5, 8, {.clusters = 2, .iterations = -1}, 2, out); },
                     "config.iterations (= -1) must be >= 0");
  test::expect_error([&] { kmeans(5, 8, {.clusters = 2, .metric = static_cast<cpu::KMeansMetric>(9)}, 2, out); },
                     "unknown KMeansMetric (9)");
  test::expect_error([&] { kmeans(5, 8, {.clusters = 2}, 3, out); }, "centroids are [3, 8]; expected [clusters = 2, dim = 8]");
  test::expect_error([&] { kmeans(5, 8, {.clusters = 2}, 2, nullptr); }, "d_assignment is a null pointer");
  test::expect_error([] { cuda::kmeans_workspace_bytes(1000, 4096, {.clusters = 100}); },
                     {"dim (= 4096) is too large", "6 seeding candidates' rows need 98304 bytes"});
}

}  // namespace
}  // namespace kvsift
