// cuda::kmeans_batched at the selectors' prefill shapes, bf16 input. BM_CudaKMeansBatched: CSAttention's
// subspace clustering of one layer's prefill queries (8 kv heads x 8 subspaces of 16 columns, read in place
// from the [n, 8 * 128] query matrix; cosine, C = 128, 10 Lloyd steps, reseeding) and A2ATS's offline codebooks
// (8 heads, dim 128, L2, C = 1024). BM_CudaKMeansSingle: today's one-problem cuda::kmeans at A2ATS's shape, once
// per head, for comparison. One call is tens to hundreds of milliseconds, so each iteration times one call
// with events (manual time), after a warm-up call.
#include <benchmark/benchmark.h>

#include <cstddef>
#include <vector>

#include "gpu_bench.hpp"
#include "kvsift/cuda/kmeans.hpp"
#include "kvsift/cuda/primitives.hpp"

namespace {

using kvsift::bench::bfloat16;
using kvsift::bench::Device;

/// Args: problems, n, dim, clusters, iterations, cosine (problems * dim columns per row: the subspace layout).
void BM_CudaKMeansBatched(benchmark::State& state) {
  const auto problems = std::int32_t(state.range(0));
  const std::int64_t n = state.range(1);
  const auto dim = std::int32_t(state.range(2));
  const kvsift::BatchedKMeansConfig config{
      .clusters = std::int32_t(state.range(3)),
      .iterations = std::int32_t(state.range(4)),
      .metric = state.range(5) != 0 ? kvsift::cpu::KMeansMetric::cosine : kvsift::cpu::KMeansMetric::l2,
      .seed = 1,
      .empty = kvsift::EmptyCluster::reseed};
  const std::size_t elems = std::size_t(problems) * n * dim;
  Device<bfloat16> points(elems);
  Device<float> centroids(std::size_t(problems) * config.clusters * dim);
  Device<std::int32_t> assignment(std::size_t(problems) * n);
  const std::size_t bytes = kvsift::cuda::batched_kmeans_workspace_bytes(problems, n, dim, config);
  Device<std::byte> workspace(bytes);
  kvsift::bench::fill_random(points.ptr, elems, 1);
  const kvsift::BatchedMatrixView<const bfloat16> view{points.ptr, problems, n, dim, dim, std::int64_t(problems) * dim};
  const auto call = [&] {
    kvsift::cuda::kmeans_batched(view, nullptr, config, centroids.ptr, assignment.ptr, {workspace.ptr, bytes}, nullptr);
  };
  call();
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  kvsift::bench::EventTimer timer;
  for (auto _ : state) state.SetIterationTime(timer.seconds(call));
  state.counters["workspace_MB"] = double(bytes) / 1e6;
}
BENCHMARK(BM_CudaKMeansBatched)
    ->Args({64, 32768, 16, 128, 10, 1})  // CSAttention: 8 kv heads x 8 subspaces
    ->Args({64, 32768, 16, 128, 0, 1})   // its seeding alone
    ->Args({8, 32768, 128, 1024, 10, 0}) // A2ATS offline codebooks
    ->Args({8, 32768, 128, 1024, 0, 0})
    ->ArgNames({"P", "n", "dim", "C", "iters", "cosine"})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

/// Today's cuda::kmeans, one call per problem (A2ATS's shape: P heads one after another).
void BM_CudaKMeansSingle(benchmark::State& state) {
  const auto problems = std::int32_t(state.range(0));
  const std::int64_t n = state.range(1);
  const auto dim = std::int32_t(state.range(2));
  const kvsift::cpu::KMeansConfig config{.clusters = std::int32_t(state.range(3)),
                                         .iterations = std::int32_t(state.range(4)), .seed = 1};
  const std::size_t elems = std::size_t(problems) * n * dim;
  Device<bfloat16> points(elems);
  Device<float> centroids(std::size_t(config.clusters) * dim);
  Device<std::int32_t> assignment{std::size_t(n)};
  const std::size_t bytes = kvsift::cuda::kmeans_workspace_bytes(n, dim, config);
  Device<std::byte> workspace(bytes);
  kvsift::bench::fill_random(points.ptr, elems, 1);
  const auto call = [&] {
    for (std::int32_t p = 0; p < problems; ++p) {
      kvsift::cuda::kmeans(kvsift::MatrixView<const bfloat16>::packed(points.ptr + std::size_t(p) * n * dim, n, dim), config,
                           kvsift::MatrixView<float>::packed(centroids.ptr, config.clusters, dim), assignment.ptr,
                           {workspace.ptr, bytes}, nullptr);
    }
  };
  call();
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  kvsift::bench::EventTimer timer;
  for (auto _ : state) state.SetIterationTime(timer.seconds(call));
}
BENCHMARK(BM_CudaKMeansSingle)
    ->Args({8, 32768, 128, 1024, 10})
    ->Args({64, 32768, 16, 128, 10})  // CSAttention's sizes (L2: cuda::kmeans takes no reseed policy)
    ->ArgNames({"P", "n", "dim", "C", "iters"})
    ->UseManualTime()
    ->Iterations(2)
    ->Unit(benchmark::kMillisecond);

}  // namespace
