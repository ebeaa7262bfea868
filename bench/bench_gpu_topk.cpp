// cuda::topk_rows: the k best of each of `rows` score rows of N normal scores (every sequence N long, no
// window, one k for all), as graph replays (the benchmark's time) and eager calls (eager_us). heads_per_row 4
// unites groups of 4 score rows (A²ATS's per-query-head top-K over a GQA group of 4), a second launch.
// Targets on the H100 (docs/primitives.md): k = 2048 of 131072 in <= 10 us for 1 row, <= 20 us for 8.
// A²ATS's decode step at 128K (q 32 / kv 8, K = 3% = 3932 per row): 32 score rows united by 4 (batch 1) and 256
// (batch 8); the group-max rule's 8 and 64 rows of one head each (issue 23: ~10 us for the whole top-k at batch 1).
// nan_marks_row 1: OracleTopK's and SpeContext's option (a row with a NaN candidate gets count -1), whose cost is
// one more pass over each CTA's slice and a cluster read of the flags.
// seeded 1: TopKRowsOptions::seed from the previous step, a row of the same scores plus N(0, 0.1) noise (about 85% of
// its k = 2048 of 131072 still selected); seeded 2: a seed of +inf (no candidate: the unseeded passes after one
// more cluster barrier, the cost of a wrong guess).
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gpu_bench.hpp"
#include "kvsift/cuda/topk.hpp"

namespace kvsift::bench {
namespace {

void BM_CudaTopKRows(benchmark::State& state) {
  const std::int32_t n = std::int32_t(state.range(0)), rows = std::int32_t(state.range(1));
  const std::int32_t k = std::int32_t(state.range(2)), heads_per_row = std::int32_t(state.range(3));
  const bool nan_marks_row = state.range(4) != 0;
  const int seeded = int(state.range(5));
  const std::int32_t selection_rows = rows / heads_per_row;
  std::vector<float> host(std::size_t(rows) * n);
  std::mt19937_64 rng(11);
  std::normal_distribution<float> dist;
  for (auto& x : host) x = dist(rng);
  Device<float> scores(host.size());
  KVSIFT_CUDA_CHECK(cudaMemcpy(scores.ptr, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  // The previous step's k-th best score of each selection row (its first score row).
  std::vector<float> host_seed(std::size_t(selection_rows), INFINITY);
  if (seeded == 1) {
    std::normal_distribution<float> noise(0.0f, 0.1f);
    for (std::int32_t s = 0; s < selection_rows; ++s) {
      std::vector<float> previous(host.begin() + std::int64_t(s) * heads_per_row * n,
                                  host.begin() + (std::int64_t(s) * heads_per_row + 1) * n);
      for (float& x : previous) x += noise(rng);
      std::nth_element(previous.begin(), previous.begin() + (k - 1), previous.end(), std::greater<float>());
      host_seed[std::size_t(s)] = previous[std::size_t(k - 1)];
    }
  }
  Device<float> seed(host_seed.size());
  KVSIFT_CUDA_CHECK(
      cudaMemcpy(seed.ptr, host_seed.data(), host_seed.size() * sizeof(float), cudaMemcpyHostToDevice));
  const std::vector<std::int32_t> host_lengths(std::size_t(selection_rows), n);  // batch = selection rows, 1 kv head
  Device<std::int32_t> lengths(host_lengths.size());
  KVSIFT_CUDA_CHECK(cudaMemcpy(lengths.ptr, host_lengths.data(), host_lengths.size() * sizeof(std::int32_t),
                               cudaMemcpyHostToDevice));
  const std::int32_t capacity = heads_per_row * k;
  Device<std::int32_t> indices{std::size_t(selection_rows) * capacity}, counts{std::size_t(selection_rows)};
  const SelectionView out{indices.ptr, counts.ptr, nullptr, selection_rows, 1, capacity};
  const TopKRowsOptions options{.heads_per_row = heads_per_row,
                                .nan_marks_row = nan_marks_row,
                                .seed = seeded != 0 ? seed.ptr : nullptr};
  const std::size_t bytes = cuda::topk_rows_workspace_bytes(rows, n, k, options);
  Device<std::byte> workspace(std::max<std::size_t>(bytes, 1));
  time_calls(state, [&](int, cudaStream_t stream) {
    cuda::topk_rows(MatrixView<const float>::packed(scores.ptr, rows, n), lengths.ptr, k, options, out,
                    {workspace.ptr, bytes}, stream);
  });
}
BENCHMARK(BM_CudaTopKRows)
    ->ArgsProduct({{8192, 32768, 131072}, {1, 8, 64}, {128, 2048}, {1}, {0, 1}, {0}})
    ->ArgsProduct({{8192, 32768, 131072}, {8}, {128, 2048}, {4}, {0}, {0}})
    ->ArgsProduct({{131072}, {8, 64}, {3932}, {1}, {0}, {0}})
    ->ArgsProduct({{131072}, {32, 256}, {3932}, {4}, {0}, {0}})
    ->ArgsProduct({{65536, 131072}, {1, 8}, {2048}, {1}, {0, 1}, {1, 2}})
    ->ArgNames({"N", "rows", "K", "heads_per_row", "nan_marks_row", "seeded"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

}  // namespace
}  // namespace kvsift::bench
