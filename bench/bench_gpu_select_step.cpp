// A GPU selector in DecodeStep<S, placement::MiddleOnCpu> (step/split_step.hpp, A²ATS's §4.3): the selector appends and selects on
// the GPU, its selection (and the query) crosses to pinned host memory, `threads` host threads attend it over the
// pinned host copy of the whole cache while the GPU attends the window (4 + 64) from the device cache, merged on the
// GPU. The selector is A²ATS at its defaults (K = 3% per query head, union over the group; random codebooks,
// a2ats_bench_codebooks.hpp), so the GPU reads the codes, not the keys. Issue shape: q_heads 32, kv_heads 8, head_dim 128, bf16, one layer, every sequence
// N tokens long; each timed step re-selects for the same last token (no engine writes here).
//
// Time: host wall clock of run() and a stream synchronization, per step. Counters, per step: select_us, the GPU's
// lengths + append + select and the copies to the host, waited for (the GPU select time as the host sees it);
// cpu_attention_us, the host's attention of the selection; merge_us, the rest (enqueueing, the window's and the
// merge's tail after the CPU is done); PCIe_MB, both directions (StepStats' to_host_bytes and to_device_bytes).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "a2ats_bench_codebooks.hpp"
#include "gpu_bench.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/a2ats/a2ats.hpp"
#include "kvsift/step/split_step.hpp"

namespace {

using kvsift::bfloat16;
using namespace kvsift::bench;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr kvsift::AttentionWindow kWindow{4, 64};

void BM_GpuSelectStep(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const int batch = int(state.range(1)), threads = int(state.range(2));
  const std::size_t elements = std::size_t(batch) * kKvHeads * std::size_t(n) * kHeadDim;
  const std::size_t queries = std::size_t(batch) * kQHeads * kHeadDim;
  Device<bfloat16> k(elements), v(elements), q(queries), o(queries);
  Device<float> lse(std::size_t(batch) * kQHeads);
  Device<std::int32_t> lengths(batch), slots(batch);
  fill_random(k.ptr, elements, 1);
  fill_random(v.ptr, elements, 2);
  fill_random(q.ptr, queries, 99);
  // The host side: the whole cache in pinned memory (the CPU attends from it), its lengths in host memory.
  kvsift::cuda::PinnedArray<bfloat16> host_k(elements), host_v(elements);
  KVSIFT_CUDA_CHECK(cudaMemcpy(host_k.data(), k.ptr, elements * sizeof(bfloat16), cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(host_v.data(), v.ptr, elements * sizeof(bfloat16), cudaMemcpyDeviceToHost));
  std::vector<std::int32_t> host_lengths(static_cast<std::size_t>(batch), std::int32_t(n)), host_slots(host_lengths);
  for (int b = 0; b < batch; ++b) host_slots[std::size_t(b)] = b;
  KVSIFT_CUDA_CHECK(cudaMemcpy(lengths.ptr, host_lengths.data(), batch * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(cudaMemcpy(slots.ptr, host_slots.data(), batch * sizeof(std::int32_t), cudaMemcpyHostToDevice));

  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvsift::cuda::Context gpu{stream};
  kvsift::cpu::ThreadPool pool(threads);
  const kvsift::SelectorLimits limits{.max_slots = batch, .max_tokens = std::int32_t(n), .q_heads = kQHeads,
                                      .kv_heads = kKvHeads, .head_dim = kHeadDim};
  const kvsift::SplitContext split{.gpu = gpu, .cpu = {&pool}};
  using Selector = kvsift::A2ats<bfloat16, kvsift::cuda::Context>;
  kvsift::DecodeStep<Selector, kvsift::placement::MiddleOnCpu> step(
      Selector(limits, {}, a2ats_bench_codebooks(kKvHeads, kHeadDim), gpu),
      {.attention = {.window = kWindow}, .max_batch = batch, .q_heads = kQHeads, .kv_heads = kKvHeads,
       .head_dim = kHeadDim, .max_seq_len = std::int32_t(n)},
      split);
  SplitBlocks blocks(step.workspace_bytes());
  const kvsift::StepInputs<bfloat16> in{
      .q = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim),
      .cache = kvsift::ContiguousKVView<bfloat16>::packed(k.ptr, v.ptr, batch, kKvHeads, std::int32_t(n), kHeadDim,
                                                          lengths.ptr),
      .slots = slots.ptr,
      .host_cache = kvsift::ContiguousKVView<const bfloat16>::packed(host_k.data(), host_v.data(), batch, kKvHeads,
                                                                     std::int32_t(n), kHeadDim, host_lengths.data())};
  step.prepare({.cache = in.cache, .slots = slots.ptr}, gpu);
  const auto out = kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, batch, kQHeads, kHeadDim);
  for (int i = 0; i < 2; ++i) step.run(in, out, blocks.view(), split);  // warm-up
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  double select = 0, cpu = 0, wall = 0;
  for (auto _ : state) {
    const auto begin = std::chrono::steady_clock::now();
    step.run(in, out, blocks.view(), split);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    state.SetIterationTime(seconds);
    wall += seconds;
    select += step.last_step_stats().select_seconds;
    cpu += step.last_step_stats().cpu_attention_seconds;
  }
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  const double steps = double(std::max<std::int64_t>(1, state.iterations()));
  const kvsift::StepStats& stats = step.last_step_stats();
  state.counters["select_us"] = select / steps * 1e6;
  state.counters["cpu_attention_us"] = cpu / steps * 1e6;
  state.counters["merge_us"] = (wall - select - cpu) / steps * 1e6;
  state.counters["PCIe_MB"] = double(stats.to_host_bytes + stats.to_device_bytes) / 1e6;
  state.SetLabel("A2ATS GPU select, CPU attention");
}
BENCHMARK(BM_GpuSelectStep)
    ->ArgsProduct({{32768, 131072}, {1}, {16}})
    ->ArgNames({"N", "batch", "threads"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.2);

}  // namespace
