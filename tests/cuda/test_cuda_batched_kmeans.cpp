// cuda::kmeans_batched against its CPU twin (whose tests check it against an fp64 reference): the seeding bit
// for bit (iterations = 0), and after Lloyd steps the same centroids and assignment unless a point sits within
// rounding of a tie (the assigners' fp32 dot products sum in other orders); P in {1, 3, 64}, weights, reseeding,
// strided subspace views, fp16/bf16; mini-batch steps bit for bit on any data (batch_size >= n: the full batch);
// the workspace API with a graph replay; refusals before any device call.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/kmeans.hpp"
#include "kvsift/cuda/kmeans.hpp"
#include "test_util.hpp"
#include "workspace_check.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;

struct Result {
  std::vector<float> centroids;
  std::vector<std::int32_t> assignment;
};

/// A host problem set: values [problems, n, row_stride] with the problems' columns at problem * dim.
struct Problems {
  std::int32_t problems;
  std::int64_t n;
  std::int32_t dim;
  std::vector<float> values;  ///< [n, problems * dim]: the subspace layout of a query matrix
  std::vector<float> weights;

  template <class T>
  BatchedMatrixView<const T> view(const T* data) const {
    return {data, problems, n, dim, dim, std::int64_t(problems) * dim};
  }
};

Problems make_problems(test::Random& rng, std::int32_t problems, std::int64_t n, std::int32_t dim, bool weighted) {
  Problems p{problems, n, dim, rng.normal(std::size_t(problems) * n * dim), {}};
  if (weighted) {
    p.weights.resize(std::size_t(problems) * n);
    for (float& w : p.weights) w = rng.uniform(0.0f, 2.0f);
  }
  return p;
}

template <class T>
Result on_cpu(const Problems& p, const std::vector<T>& values, const BatchedKMeansConfig& config) {
  Result r{std::vector<float>(std::size_t(p.problems) * config.clusters * p.dim),
           std::vector<std::int32_t>(std::size_t(p.problems) * p.n)};
  cpu::Array<std::byte> ws(cpu::batched_kmeans_workspace_bytes(p.problems, p.n, p.dim, config));
  cpu::ThreadPool pool(2);
  cpu::kmeans_batched(p.view(values.data()), p.weights.empty() ? nullptr : p.weights.data(), config, r.centroids.data(),
                      r.assignment.data(), ws.bytes(), &pool);
  return r;
}

template <class T>
Result on_gpu(const Problems& p, const std::vector<T>& values, const BatchedKMeansConfig& config) {
  DeviceBuffer<T> d_values(values);
  DeviceBuffer<float> d_weights(p.weights);
  DeviceBuffer<float> centroids(std::size_t(p.problems) * config.clusters * p.dim);
  DeviceBuffer<std::int32_t> assignment(std::size_t(p.problems) * p.n);
  DeviceBuffer<std::byte> ws(cuda::batched_kmeans_workspace_bytes(p.problems, p.n, p.dim, config));
  centroids.poison(), assignment.poison(), ws.poison();
  cuda::kmeans_batched(p.view<T>(d_values.data()), p.weights.empty() ? nullptr : d_weights.data(), config,
                       centroids.data(), assignment.data(), std::span<std::byte>(ws.data(), ws.size()), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  return {centroids.download(), assignment.download()};
}

/// Planted blobs (test::planted_clusters) per problem, rows shuffled: k-means with k = blobs has no point near a
/// tie, so both backends must agree bit for bit after Lloyd steps too.
Problems planted_problems(test::Random& rng, std::int32_t problems, std::int32_t blobs, std::int32_t per, std::int32_t dim,
                          bool weighted) {
  const std::int64_t n = std::int64_t(blobs) * per;
  Problems p = make_problems(rng, problems, n, dim, weighted);
  for (int prob = 0; prob < problems; ++prob) {
    const auto blob_points = test::planted_clusters(rng, blobs, per, dim).first;
    std::vector<std::int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng.engine);
    for (std::int64_t i = 0; i < n; ++i) {
      std::copy_n(&blob_points[std::size_t(order[i]) * dim], dim, &p.values[(std::size_t(i) * problems + prob) * dim]);
    }
  }
  return p;
}

/// The seeding bit for bit (iterations = 0). After Lloyd steps: with `separated` data (no point near a tie) bit
/// for bit too; otherwise a tie broken differently in some step can move points and centroids from then on, so
/// the GPU's result is checked for itself: every point at its nearest GPU centroid up to kTieMargin (fp64), and
/// the k-means objective within 1% of the CPU's.
template <class T>
void expect_gpu_equals_cpu(const Problems& p, const BatchedKMeansConfig& config, bool separated) {
  const std::vector<T> values = test::to_storage<T>(p.values);
  auto seeding = config;
  seeding.iterations = 0;
  const Result cpu0 = on_cpu(p, values, seeding), gpu0 = on_gpu(p, values, seeding);
  ASSERT_TRUE(test::same_bytes(gpu0.centroids, cpu0.centroids)) << "the seeding differs";
  const Result want = on_cpu(p, values, config), got = on_gpu(p, values, config);
  if (separated) {
    EXPECT_TRUE(test::same_bytes(got.centroids, want.centroids));
    EXPECT_TRUE(test::same_bytes(got.assignment, want.assignment));
    return;
  }
  constexpr double kTieMargin = 1e-4;  // fp32 scores of O(10) size, summed in other orders
  const int d = p.dim, k = config.clusters;
  const bool cosine = config.metric == KMeansMetric::cosine;
  double objective[2] = {0, 0};
  for (std::int32_t prob = 0; prob < p.problems; ++prob) {
    for (std::int64_t i = 0; i < p.n; ++i) {
      std::vector<double> x(d);
      double norm = 0;
      for (int j = 0; j < d; ++j) x[j] = to_float(values[(std::size_t(i) * p.problems + prob) * d + j]), norm += x[j] * x[j];
      for (int j = 0; j < d && cosine; ++j) x[j] /= std::sqrt(norm);
      const auto score = [&](const Result& r, std::int32_t c) {
        double dot = 0, cn = 0;
        for (int j = 0; j < d; ++j) {
          const double cj = r.centroids[(std::size_t(prob) * k + c) * d + j];
          dot += x[j] * cj, cn += cj * cj;
        }
        return cosine ? dot : dot - 0.5 * cn;
      };
      double best = -std::numeric_limits<double>::infinity();
      for (int c = 0; c < k; ++c) best = std::max(best, score(got, c));
      const std::int32_t a = got.assignment[std::size_t(prob) * p.n + i];
      ASSERT_TRUE(a >= 0 && a < k) << "problem " << prob << " point " << i;
      EXPECT_LT(best - score(got, a), kTieMargin) << "problem " << prob << " point " << i;
      const double w = p.weights.empty() ? 1.0 : p.weights[std::size_t(prob) * p.n + i];
      objective[0] -= w * score(got, a);
      objective[1] -= w * score(want, want.assignment[std::size_t(prob) * p.n + i]);
    }
  }
  EXPECT_NEAR(objective[0], objective[1], 0.01 * std::abs(objective[1]) + 1e-6);
}

class CudaBatchedKMeans : public test::GpuTest {};

TEST_F(CudaBatchedKMeans, EqualsTheCpuAcrossProblemCounts) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const int problems : {1, 3, 64}) {
    for (const auto metric : {KMeansMetric::l2, KMeansMetric::cosine}) {
      SCOPED_TRACE(testing::Message() << "problems " << problems << " metric " << int(metric));
      const BatchedKMeansConfig config{.clusters = 24, .iterations = 6, .metric = metric, .seed = seed,
                                       .empty = problems == 64 ? EmptyCluster::reseed : EmptyCluster::keep};
      expect_gpu_equals_cpu<float>(make_problems(rng, problems, 700 + rng.uniform_int(0, 2000), 16, problems != 3), config,
                                   false);
      auto blobs = config;
      blobs.clusters = 6;
      expect_gpu_equals_cpu<float>(planted_problems(rng, problems, 6, 50 + rng.uniform_int(0, 30), 16, problems != 3),
                                   blobs, true);
    }
  }
}

TEST_F(CudaBatchedKMeans, EqualsTheCpuForWideRowsAndStorageTypes) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const Problems p = make_problems(rng, 2, 1500, 128, true);
  const BatchedKMeansConfig config{.clusters = 40, .iterations = 4, .metric = KMeansMetric::cosine, .seed = seed};
  expect_gpu_equals_cpu<half>(p, config, false);
  expect_gpu_equals_cpu<bfloat16>(p, config, false);
  expect_gpu_equals_cpu<bfloat16>(planted_problems(rng, 2, 10, 60, 128, true), {.clusters = 10, .iterations = 4, .seed = seed},
                                  true);
  // dim not a multiple of 4; fewer points than segments (segments of one point and empty ones)
  expect_gpu_equals_cpu<float>(make_problems(rng, 5, 333, 7, false), {.clusters = 9, .iterations = 3, .seed = seed}, false);
}

TEST_F(CudaBatchedKMeans, ReseedsEmptyClustersAsTheCpu) {
  // Three locations, four copies each, k = 4: the fourth centroid copies a location a smaller id holds.
  Problems p{2, 12, 2, {}, {}};
  for (int i = 0; i < 12; ++i) {
    for (int prob = 0; prob < 2; ++prob) p.values.push_back(float(i % 3) * 10.0f), p.values.push_back(float(i % 3 == 2) * 7.0f);
  }
  // Cosine: e1 x 4, e2 x 4 and a zero row, at distance 1 from every centroid: two clusters end up empty, and
  // reseeding gives them the zero row (largest key) and then point 0 (test_batched_kmeans.cpp).
  Problems z{3, 9, 2, {}, {}};
  for (int i = 0; i < 9; ++i) {
    for (int prob = 0; prob < 3; ++prob) z.values.push_back(i < 4 ? 1.0f : 0.0f), z.values.push_back(i >= 4 && i < 8 ? 1.0f : 0.0f);
  }
  for (const auto empty : {EmptyCluster::keep, EmptyCluster::reseed}) {
    for (const auto metric : {KMeansMetric::l2, KMeansMetric::cosine}) {
      const Problems& data = metric == KMeansMetric::l2 ? p : z;
      const BatchedKMeansConfig config{.clusters = 4, .iterations = 3, .metric = metric, .seed = seed, .empty = empty};
      const Result want = on_cpu(data, data.values, config), got = on_gpu(data, data.values, config);
      EXPECT_TRUE(test::same_bytes(got.centroids, want.centroids)) << int(empty) << " " << int(metric);
      EXPECT_TRUE(test::same_bytes(got.assignment, want.assignment)) << int(empty) << " " << int(metric);
    }
  }
}

/// Mini-batch steps run core/kmeans_batched.hpp's functions in the same orders on both backends: equal bytes on
/// any data, ties included.
template <class T>
void expect_minibatch_equals_cpu(const Problems& p, const BatchedKMeansConfig& config) {
  const std::vector<T> values = test::to_storage<T>(p.values);
  const Result want = on_cpu(p, values, config), got = on_gpu(p, values, config);
  EXPECT_TRUE(test::same_bytes(got.centroids, want.centroids)) << "centroids, batch " << config.batch_size;
  EXPECT_TRUE(test::same_bytes(got.assignment, want.assignment)) << "assignment, batch " << config.batch_size;
}

TEST_F(CudaBatchedKMeans, MiniBatchEqualsTheCpuBitForBit) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const int problems : {1, 3, 64}) {
    for (const auto metric : {KMeansMetric::l2, KMeansMetric::cosine}) {
      SCOPED_TRACE(testing::Message() << "problems " << problems << " metric " << int(metric));
      // Batches of one slot, of several update chunks (1024 slots), and small enough to leave clusters unreached.
      const std::int32_t batch = problems == 1 ? 1 : problems == 3 ? 1000 + rng.uniform_int(0, 2000) : 40;
      const BatchedKMeansConfig config{.clusters = 24, .iterations = 6, .metric = metric, .seed = seed,
                                       .empty = problems == 1 ? EmptyCluster::keep : EmptyCluster::reseed,
                                       .batch_size = batch};
      expect_minibatch_equals_cpu<float>(make_problems(rng, problems, 3000 + rng.uniform_int(0, 1000), 16, problems != 3),
                                         config);
    }
  }
}

TEST_F(CudaBatchedKMeans, MiniBatchEqualsTheCpuForWideRowsAndStorageTypes) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  // dim 128, k 100: the centroids (50 KiB) exceed the shared-memory stage and are read from global memory.
  const Problems wide = make_problems(rng, 2, 2500, 128, true);
  const BatchedKMeansConfig config{.clusters = 100, .iterations = 4, .metric = KMeansMetric::cosine, .seed = seed,
                                   .empty = EmptyCluster::reseed, .batch_size = 700};
  expect_minibatch_equals_cpu<half>(wide, config);
  expect_minibatch_equals_cpu<bfloat16>(wide, {.clusters = 40, .iterations = 4, .seed = seed, .batch_size = 333});
  // dim not a multiple of 4 or 32; fewer points than the reseed kernel's segments
  expect_minibatch_equals_cpu<float>(make_problems(rng, 5, 333, 7, true),
                                     {.clusters = 9, .iterations = 5, .seed = seed, .empty = EmptyCluster::reseed,
                                      .batch_size = 17});
}

TEST_F(CudaBatchedKMeans, MiniBatchOfAtLeastNIsTheFullBatch) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const Problems p = planted_problems(rng, 3, 6, 40, 16, true);
  const BatchedKMeansConfig full{.clusters = 6, .iterations = 4, .metric = KMeansMetric::cosine, .seed = seed,
                                 .empty = EmptyCluster::reseed};
  const Result want = on_gpu(p, p.values, full);
  for (const std::int32_t batch : {std::int32_t(p.n), std::int32_t(p.n) + 1}) {
    auto config = full;
    config.batch_size = batch;
    const Result got = on_gpu(p, p.values, config);
    EXPECT_TRUE(test::same_bytes(got.centroids, want.centroids)) << batch;
    EXPECT_TRUE(test::same_bytes(got.assignment, want.assignment)) << batch;
  }
}

TEST_F(CudaBatchedKMeans, WorkspaceQueryRunAndGraphReplay) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const Problems p = make_problems(rng, 8, 1000, 16, true);
  for (const std::int32_t batch : {0, 100}) {
    const BatchedKMeansConfig config{.clusters = 32, .iterations = 3, .metric = KMeansMetric::cosine, .seed = seed,
                                     .empty = EmptyCluster::reseed, .batch_size = batch};
    DeviceBuffer<float> values(p.values), weights(p.weights);
    DeviceBuffer<float> centroids(std::size_t(p.problems) * config.clusters * p.dim);
    DeviceBuffer<std::int32_t> assignment(std::size_t(p.problems) * p.n);
    test::check_device_workspace(
        cuda::batched_kmeans_workspace_bytes(p.problems, p.n, p.dim, config),
        [&](std::span<std::byte> ws, cudaStream_t stream) {
          cuda::kmeans_batched(p.view<float>(values.data()), weights.data(), config, centroids.data(), assignment.data(), ws,
                               stream);
        },
        [&] { return test::bytes_of(centroids.download(), assignment.download()); },
        [&] { centroids.poison(), assignment.poison(); });
  }
}

TEST(CudaBatchedKMeansBadInput, RefusedBeforeAnyDeviceCall) {
  // Host arrays stand in for device ones: every call here is refused before it reaches the device.
  std::vector<float> x(2 * 20 * 4), c(2 * 3 * 4);
  std::vector<std::int32_t> a(2 * 20);
  alignas(256) static std::byte workspace[256];
  const std::span<std::byte> ws(workspace, sizeof(workspace));
  const auto view = BatchedMatrixView<const float>::packed(x.data(), 2, 20, 4);
  const BatchedKMeansConfig ok{.clusters = 3};
  test::expect_error([&] { cuda::kmeans_batched(view, nullptr, {.clusters = 21}, c.data(), a.data(), ws, nullptr); },
                     {"cuda::kmeans_batched", "config.clusters (= 21) is outside [1, n = 20]"});
  test::expect_error([&] { cuda::kmeans_batched(view, nullptr, {.clusters = 3, .batch_size = -1}, c.data(), a.data(), ws, nullptr); },
                     {"cuda::kmeans_batched", "config.batch_size (= -1) must be >= 0"});
  test::expect_error([] { cuda::batched_kmeans_workspace_bytes(2, 20, 4, {.clusters = 3, .batch_size = -2}); },
                     {"cuda::batched_kmeans_workspace_bytes", "config.batch_size (= -2) must be >= 0"});
  test::expect_error([&] { cuda::kmeans_batched(view, nullptr, ok, nullptr, a.data(), ws, nullptr); },
                     "centroids is a null pointer");
  test::expect_error([&] { cuda::kmeans_batched(view, nullptr, ok, c.data(), nullptr, ws, nullptr); },
                     "assignment is a null pointer");
  test::expect_error(
      [&] { cuda::kmeans_batched(view, reinterpret_cast<const float*>(workspace + 2), ok, c.data(), a.data(), ws, nullptr); },
      "is not 4-byte aligned");
  test::expect_error([&] { cuda::kmeans_batched(view, nullptr, ok, c.data(), a.data(), ws.first(0), nullptr); },
                     "workspace too small");
  test::expect_error([] { cuda::batched_kmeans_workspace_bytes(65536, 4, 4, {.clusters = 3}); },
                     {"cuda::batched_kmeans_workspace_bytes", "problems (= 65536) exceeds 65535"});
  test::expect_error([] { cuda::batched_kmeans_workspace_bytes(0, 4, 4, {.clusters = 3}); }, "problems (= 0) must be >= 1");
  test::expect_error([] { cuda::batched_kmeans_workspace_bytes(1, 4, 300, {.clusters = 3}); }, "dim (= 300) is outside [1, 256]");
}

}  // namespace
}  // namespace kvsift
