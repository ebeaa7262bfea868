// CSAttention's CPU<->GPU mode (DecodeStep<S, placement::MiddleOnGpu>, step/split_step.hpp): the search on `threads` host threads over a pinned host copy
// of the cache, the selection copied to the GPU, the selected K/V rows gathered there from the pinned host cache over
// PCIe, the window (4 + 64) attended from the device cache, merged on the GPU. CSAttention at its defaults (m = 8,
// C = 128, alpha = 0.2, rho = 5%, P = 1, tables per kv head) in the shape: q_heads 32, kv_heads 8, head_dim
// 128, bf16, one layer, every sequence N tokens long. The prompt's index is built once (prepare, on the host, over
// 1024 prefill queries); every timed step appends the same last token again (no engine writes here), which costs
// what a new token's insert costs.
//
// Time: host wall clock of run() and a stream synchronization, per step. Counters, per step: select_us, the host's
// lengths + append + select; gpu_us, the rest of the step as the host sees it (enqueueing and finishing the copies,
// the gather, the staging rows' attention and the merge; the window's attention runs during the search); PCIe_MB,
// the selection copied by cudaMemcpyAsync plus the K/V rows the gather reads from the pinned host cache;
// gather_GB/s, those K/V bytes over gpu_us (a lower bound on the gather's rate); prepare_s, the layer's prepare.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "gpu_bench.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/csattention/csattention.hpp"
#include "kvsift/step/split_step.hpp"

namespace {

using kvsift::bfloat16;
using namespace kvsift::bench;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kPrefillQueries = 1024;
constexpr kvsift::AttentionWindow kWindow{4, 64};

void BM_OffloadStep(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const int batch = int(state.range(1)), threads = int(state.range(2));
  const std::size_t elements = std::size_t(batch) * kKvHeads * std::size_t(n) * kHeadDim;
  const std::size_t queries = std::size_t(batch) * kQHeads * kHeadDim;
  const std::size_t prefill = std::size_t(batch) * kQHeads * kPrefillQueries * kHeadDim;
  Device<bfloat16> k(elements), v(elements), q(queries), o(queries);
  Device<float> lse(std::size_t(batch) * kQHeads);
  Device<std::int32_t> lengths(batch);
  fill_random(k.ptr, elements, 1);
  fill_random(v.ptr, elements, 2);
  fill_random(q.ptr, queries, 99);
  // The host side: the cache (pinned: the GPU gathers from it), its lengths (pinned likewise), queries, slots.
  kvsift::cuda::PinnedArray<bfloat16> host_k(elements), host_v(elements), host_q(queries), host_prefill(prefill);
  kvsift::cuda::PinnedArray<std::int32_t> host_lengths(static_cast<std::size_t>(batch));
  {
    Device<bfloat16> device_prefill(prefill);
    fill_random(device_prefill.ptr, prefill, 3);
    KVSIFT_CUDA_CHECK(cudaMemcpy(host_prefill.data(), device_prefill.ptr, prefill * sizeof(bfloat16), cudaMemcpyDeviceToHost));
  }
  KVSIFT_CUDA_CHECK(cudaMemcpy(host_k.data(), k.ptr, elements * sizeof(bfloat16), cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(host_v.data(), v.ptr, elements * sizeof(bfloat16), cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(host_q.data(), q.ptr, queries * sizeof(bfloat16), cudaMemcpyDeviceToHost));
  std::vector<std::int32_t> host_slots(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) {
    host_lengths.data()[b] = std::int32_t(n);
    host_slots[std::size_t(b)] = b;
  }
  KVSIFT_CUDA_CHECK(cudaMemcpy(lengths.ptr, host_lengths.data(), batch * sizeof(std::int32_t), cudaMemcpyHostToDevice));

  kvsift::cpu::ThreadPool pool(threads);
  const kvsift::cpu::Context cpu{&pool};
  const kvsift::SelectorLimits limits{.max_slots = batch, .max_tokens = std::int32_t(n), .q_heads = kQHeads,
                                      .kv_heads = kKvHeads, .head_dim = kHeadDim};
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvsift::SplitContext split{.gpu = {stream}, .cpu = cpu};
  using Selector = kvsift::Csattention<bfloat16, kvsift::cpu::Context>;
  kvsift::DecodeStep<Selector, kvsift::placement::MiddleOnGpu> step(
      Selector(limits, {}),
      {.attention = {.window = kWindow}, .max_batch = batch, .q_heads = kQHeads, .kv_heads = kKvHeads,
       .head_dim = kHeadDim, .max_seq_len = std::int32_t(n)},
      split);
  SplitBlocks blocks(step.workspace_bytes());
  const kvsift::SplitWorkspace workspace = blocks.view();
  const kvsift::StepInputs<bfloat16> in{
      .q = kvsift::QueryView<const bfloat16>::packed(host_q.data(), batch, kQHeads, kHeadDim),
      .cache = kvsift::ContiguousKVView<bfloat16>::packed(host_k.data(), host_v.data(), batch, kKvHeads, std::int32_t(n),
                                                          kHeadDim, host_lengths.data()),
      .slots = host_slots.data(),
      .q_device = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim),
      .device_cache = kvsift::ContiguousKVView<const bfloat16>::packed(k.ptr, v.ptr, batch, kKvHeads, std::int32_t(n),
                                                                       kHeadDim, lengths.ptr)};
  const auto prepare_begin = std::chrono::steady_clock::now();
  step.prepare({.cache = in.cache, .slots = host_slots.data(),
                .queries = kvsift::SequenceView<const bfloat16>::packed(host_prefill.data(), batch, kQHeads,
                                                                        kPrefillQueries, kHeadDim)},
               cpu);
  const double prepare_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - prepare_begin).count();

  const auto out = kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, batch, kQHeads, kHeadDim);
  for (int i = 0; i < 2; ++i) step.run(in, out, workspace, split);  // warm-up
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  double select = 0, wall = 0, pcie = 0, kv = 0;
  for (auto _ : state) {
    const auto begin = std::chrono::steady_clock::now();
    step.run(in, out, workspace, split);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    state.SetIterationTime(seconds);
    const kvsift::StepStats& stats = step.last_step_stats();
    wall += seconds;
    select += stats.select_seconds;
    pcie += double(stats.to_device_bytes + stats.gathered_kv_bytes);
    kv += double(stats.gathered_kv_bytes);
  }
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  const double steps = double(std::max<std::int64_t>(1, state.iterations()));
  state.counters["select_us"] = select / steps * 1e6;
  state.counters["gpu_us"] = (wall - select) / steps * 1e6;
  state.counters["PCIe_MB"] = pcie / steps / 1e6;
  state.counters["gather_GB/s"] = kv / (wall - select) / 1e9;
  state.counters["prepare_s"] = prepare_s;
  state.SetLabel("CSAttention offload");
}
BENCHMARK(BM_OffloadStep)
    ->ArgsProduct({{32768, 131072}, {1}, {16}})
    ->ArgNames({"N", "batch", "threads"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.2);

}  // namespace
