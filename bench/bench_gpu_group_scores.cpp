// cuda::group_scores at the selectors' decode-step shape: q_heads 32, kv_heads 8, head_dim 128, bf16 keys, raw
// and softmax scores reduced by max. GB/s counts the key bytes (each row read once) over the call's GPU time;
// the softmax path also writes and reads back q_heads * N * 4 bytes of logits per sequence.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>

#include "gpu_bench.hpp"
#include "kvsift/cuda/primitives.hpp"

namespace {

using kvsift::bench::bfloat16;
using kvsift::bench::Device;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr std::size_t kL2RotationBytes = std::size_t(256) << 20;  // inputs rotate over > 5x the H100's 50 MB L2

void BM_CudaGroupScores(benchmark::State& state) {
  const int tokens = int(state.range(0)), batch = int(state.range(1));
  const kvsift::GroupScoreOptions options{.reduce = kvsift::GroupReduce::max, .softmax = state.range(2) != 0};
  const std::size_t k_elems = std::size_t(batch) * kKvHeads * tokens * kHeadDim;
  const int copies = int(std::max<std::size_t>(1, (kL2RotationBytes + k_elems * 2 - 1) / (k_elems * 2)));
  Device<bfloat16> k(k_elems * copies), q(std::size_t(batch) * kQHeads * kHeadDim);
  Device<float> scores(std::size_t(batch) * kKvHeads * tokens);
  kvsift::bench::fill_random(k.ptr, k_elems * copies, 1);
  kvsift::bench::fill_random(q.ptr, std::size_t(batch) * kQHeads * kHeadDim, 3);
  const auto qv = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim);
  const auto sv = kvsift::MatrixView<float>::packed(scores.ptr, std::int64_t(batch) * kKvHeads, tokens);
  const std::size_t ws_bytes = kvsift::cuda::group_scores_workspace_bytes(batch, kQHeads, kKvHeads, tokens, options);
  Device<std::byte> ws(std::max<std::size_t>(ws_bytes, 256));
  kvsift::bench::time_calls(state, [&](int i, cudaStream_t stream) {
    const bfloat16* keys = k.ptr + std::size_t(i % copies) * k_elems;
    const auto kv = kvsift::ContiguousKVView<const bfloat16>::packed(keys, keys, batch, kKvHeads, tokens, kHeadDim);
    kvsift::cuda::group_scores(qv, kv, sv, options, {ws.ptr, ws_bytes}, stream);
  });
  const double key_bytes = double(k_elems) * sizeof(bfloat16);
  state.counters["GB/s"] = benchmark::Counter(key_bytes * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes"] = key_bytes;
}
BENCHMARK(BM_CudaGroupScores)
    ->ArgsProduct({{32768, 131072}, {1, 8}, {0, 1}})
    ->ArgNames({"N", "batch", "softmax"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

}  // namespace
