// cuda::kmeans_batched at the selectors' prefill shapes, bf16 input. BM_CudaKMeansBatched: CSAttention's
// subspace clustering of one layer's prefill queries (8 kv heads x 8 subspaces of 16 columns, read in place
// from the [n, 8 * 128] query matrix; cosine, C = 128, 10 Lloyd steps, reseeding), its prepare at 128K tokens
// (8 subspaces of one kv head's 4 query heads: 4 x 128K points each) with full-batch and mini-batch steps
// (batch_size 4096, 16384), and A2ATS's offline codebooks (8 heads, dim 128, L2, C = 1024). Counter `fit`: the
// result's mean cosine of a point and its centroid (cosine) or mean squared distance (L2), over every point,
// so that mini-batch rows show what they give up. One call is tens to hundreds of milliseconds, so each
// iteration times one call with events (manual time), after a warm-up call.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "gpu_bench.hpp"
#include "kvsift/cuda/kmeans.hpp"

namespace {

using kvsift::bench::bfloat16;
using kvsift::bench::Device;

template <class T>
std::vector<T> download(const T* d_data, std::size_t count) {
  std::vector<T> host(count);
  KVSIFT_CUDA_CHECK(cudaMemcpy(host.data(), d_data, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

/// The `fit` counter of a result: per point, its cosine with its centroid (cosine) or its squared distance to it.
double mean_fit(const kvsift::BatchedMatrixView<const bfloat16>& d_points, const float* d_centroids,
                const std::int32_t* d_assignment, std::int32_t clusters, bool cosine) {
  const std::int64_t n = d_points.rows, columns = d_points.row_stride;
  const std::int32_t dim = d_points.cols;
  const auto points = download(d_points.data, std::size_t(n * columns));
  const auto centroids = download(d_centroids, std::size_t(d_points.problems) * clusters * dim);
  const auto assignment = download(d_assignment, std::size_t(d_points.problems) * n);
  double total = 0.0;
  for (std::int64_t p = 0; p < d_points.problems; ++p) {
    for (std::int64_t i = 0; i < n; ++i) {
      const float* c = &centroids[(p * clusters + assignment[p * n + i]) * dim];
      double dot = 0.0, xx = 0.0, cc = 0.0, sq = 0.0;
      for (std::int32_t j = 0; j < dim; ++j) {
        const double x = kvsift::bfloat16_to_float(points[i * columns + p * d_points.problem_stride + j]);
        dot += x * c[j], xx += x * x, cc += double(c[j]) * c[j], sq += (x - c[j]) * (x - c[j]);
      }
      total += cosine ? dot / std::sqrt(xx * cc) : sq;
    }
  }
  return total / double(d_points.problems * n);
}

/// Args: problems, n, dim, clusters, iterations, cosine, batch_size (problems * dim columns per row: the
/// subspace layout).
void BM_CudaKMeansBatched(benchmark::State& state) {
  const auto problems = std::int32_t(state.range(0));
  const std::int64_t n = state.range(1);
  const auto dim = std::int32_t(state.range(2));
  const kvsift::BatchedKMeansConfig config{
      .clusters = std::int32_t(state.range(3)),
      .iterations = std::int32_t(state.range(4)),
      .metric = state.range(5) != 0 ? kvsift::KMeansMetric::cosine : kvsift::KMeansMetric::l2,
      .seed = 1,
      .empty = kvsift::EmptyCluster::reseed,
      .batch_size = std::int32_t(state.range(6))};
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
  state.counters["fit"] = mean_fit(view, centroids.ptr, assignment.ptr, config.clusters, state.range(5) != 0);
}
BENCHMARK(BM_CudaKMeansBatched)
    ->Args({64, 32768, 16, 128, 10, 1, 0})  // CSAttention: 8 kv heads x 8 subspaces
    ->Args({64, 32768, 16, 128, 0, 1, 0})   // its seeding alone
    ->Args({8, 524288, 16, 128, 10, 1, 0})  // CSAttention's prepare at 128K: 8 subspaces of 4 x 128K points
    ->Args({8, 524288, 16, 128, 10, 1, 4096})
    ->Args({8, 524288, 16, 128, 10, 1, 16384})
    ->Args({8, 524288, 16, 128, 0, 1, 0})   // its seeding alone
    ->Args({8, 32768, 128, 1024, 10, 0, 0}) // A2ATS offline codebooks
    ->Args({8, 32768, 128, 1024, 0, 0, 0})
    ->ArgNames({"P", "n", "dim", "C", "iters", "cosine", "batch"})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

}  // namespace
