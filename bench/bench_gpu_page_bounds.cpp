// Quest's page bounds on the GPU at the selectors' decode-step shape: q_heads 32, kv_heads 8, head_dim 128, bf16,
// page_size 16. BM_CudaPageScores scores every page of N tokens for each sequence of the batch (GB/s counts the
// bounds' bytes, each read once, over the call's GPU time; the bounds rotate over copies larger than L2, so each
// call reads HBM); BM_CudaAppendPageBounds folds one decode step's token into the bounds (one small launch).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <vector>

#include "gpu_bench.hpp"
#include "kvsift/selectors/quest/cuda/page_bounds.hpp"

namespace {

using kvsift::bench::bfloat16;
using kvsift::bench::Device;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kPageSize = 16;
constexpr std::size_t kL2RotationBytes = std::size_t(256) << 20;  // > 5x the H100's 50 MB L2

/// Slot b holds batch row b; every sequence holds `tokens` tokens.
struct Sequences {
  Device<std::int32_t> slots, lengths;
  Sequences(int batch, int tokens) : slots(std::size_t(batch)), lengths(std::size_t(batch)) {
    std::vector<std::int32_t> s(batch), l(batch, tokens);
    std::iota(s.begin(), s.end(), 0);
    KVSIFT_CUDA_CHECK(cudaMemcpy(slots.ptr, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
    KVSIFT_CUDA_CHECK(cudaMemcpy(lengths.ptr, l.data(), l.size() * 4, cudaMemcpyHostToDevice));
  }
};

void BM_CudaPageScores(benchmark::State& state) {
  const int tokens = int(state.range(0)), batch = int(state.range(1)), pages = tokens / kPageSize;
  const std::size_t bound_elems =
      kvsift::PageBoundsView<bfloat16>::bytes(batch, kKvHeads, pages, kHeadDim) / sizeof(bfloat16);
  const int copies = int(std::max<std::size_t>(1, (kL2RotationBytes + bound_elems * 2 - 1) / (bound_elems * 2)));
  Device<bfloat16> bounds(bound_elems * copies), q(std::size_t(batch) * kQHeads * kHeadDim);
  Device<float> scores(std::size_t(batch) * kKvHeads * pages);
  Device<std::int32_t> page_counts{std::size_t(batch)};
  kvsift::bench::fill_random(bounds.ptr, bound_elems * copies, 1);
  kvsift::bench::fill_random(q.ptr, std::size_t(batch) * kQHeads * kHeadDim, 3);
  const Sequences seqs(batch, tokens);
  const auto qv = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim);
  const auto sv = kvsift::MatrixView<float>::packed(scores.ptr, std::int64_t(batch) * kKvHeads, pages);
  const kvsift::AttentionWindow window{4, 64};
  kvsift::bench::time_calls(state, [&](int i, cudaStream_t stream) {
    const auto bv = kvsift::PageBoundsView<const bfloat16>::packed(bounds.ptr + std::size_t(i % copies) * bound_elems,
                                                                   batch, kKvHeads, pages, kHeadDim, kPageSize);
    kvsift::cuda::page_scores(qv, bv, seqs.slots.ptr, seqs.lengths.ptr, window, sv, page_counts.ptr, stream);
  });
  const double bytes = double(bound_elems) * sizeof(bfloat16);
  state.counters["GB/s"] = benchmark::Counter(bytes * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes"] = bytes;
}
BENCHMARK(BM_CudaPageScores)
    ->ArgsProduct({{32768, 131072}, {1, 8}})
    ->ArgNames({"N", "batch"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

void BM_CudaAppendPageBounds(benchmark::State& state) {
  const int tokens = int(state.range(0)), batch = int(state.range(1)), pages = tokens / kPageSize;
  const std::size_t k_elems = std::size_t(batch) * kKvHeads * tokens * kHeadDim;
  const std::size_t bound_elems =
      kvsift::PageBoundsView<bfloat16>::bytes(batch, kKvHeads, pages, kHeadDim) / sizeof(bfloat16);
  Device<bfloat16> k(k_elems), bounds(bound_elems);
  kvsift::bench::fill_random(k.ptr, k_elems, 1);
  kvsift::bench::fill_random(bounds.ptr, bound_elems, 2);
  const Sequences seqs(batch, tokens - 5);  // mid-page: the min/max update, not a page start
  const auto kv = kvsift::ContiguousKVView<const bfloat16>::packed(k.ptr, k.ptr, batch, kKvHeads, tokens, kHeadDim,
                                                                  seqs.lengths.ptr);
  const auto bv = kvsift::PageBoundsView<bfloat16>::packed(bounds.ptr, batch, kKvHeads, pages, kHeadDim, kPageSize);
  kvsift::bench::time_calls(state, [&](int, cudaStream_t stream) {
    kvsift::cuda::append_page_bounds(kv, seqs.slots.ptr, bv, stream);
  });
}
BENCHMARK(BM_CudaAppendPageBounds)
    ->ArgsProduct({{32768, 131072}, {1, 8}})
    ->ArgNames({"N", "batch"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

}  // namespace
