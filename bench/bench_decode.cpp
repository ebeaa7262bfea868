// CUDA decode-attention benchmarks: dense (the FlashDecoding-style baseline) and sparse over random or
// clustered selections, timed with CUDA events, with the device-to-device copy bandwidth measured in the
// same run as the ceiling. Counters: us (median of repetitions is taken by the runner), GB/s of bytes
// touched (K and V rows read, Q read, O written), and that as a fraction of the measured copy bandwidth.
// BM_DenseInterleaved puts a projection-sized cuBLAS GEMM between dense decode calls, as a model step puts
// other kernels between attention calls; BM_ProjectionGemm times that GEMM alone the same way.
#include <benchmark/benchmark.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <numeric>
#include <random>
#include <vector>

#include "kvsift/cuda/decode.hpp"
#include "kvsift/step/hybrid_decoder.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "kvsift/cuda/check.hpp"
#include "gpu_bench.hpp"
#include "projection_gemm.hpp"

namespace {

using kvsift::bfloat16;
using namespace kvsift::bench;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128;

void BM_CopyBandwidth(benchmark::State& state) {
  const std::size_t bytes = std::size_t(1) << 30;
  Device<std::byte> a(bytes), b(bytes);
  KVSIFT_CUDA_CHECK(cudaMemset(a.ptr, 1, bytes));
  EventTimer timer;
  for (auto _ : state) {
    state.SetIterationTime(timer.seconds([&] { KVSIFT_CUDA_CHECK(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice)); }));
  }
  state.counters["GB/s"] = benchmark::Counter(double(2 * bytes) * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CopyBandwidth)->UseManualTime()->Unit(benchmark::kMicrosecond)->Iterations(20);

/// A short device-to-device copy timed like the decode calls (graph replays, sources rotating over more
/// than L2): what the memory system delivers to a call that moves only a few MB, ramp-up included. 4 and 32
/// MiB copies move 8 and 64 MiB, the traffic of sparse K = 2048 at batch 1 and 8.
void BM_ShortCopy(benchmark::State& state) {
  const std::size_t bytes = std::size_t(state.range(0)) << 20;
  const int copies = copies_for(bytes);
  Device<std::byte> src(bytes * copies), dst(bytes * copies);
  KVSIFT_CUDA_CHECK(cudaMemset(src.ptr, 1, bytes * copies));
  time_calls(state, [&](int i, cudaStream_t stream) {
    const std::size_t offset = std::size_t(i % copies) * bytes;
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst.ptr + offset, src.ptr + offset, bytes, cudaMemcpyDeviceToDevice, stream));
  });
  state.counters["GB/s"] = benchmark::Counter(double(2 * bytes) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes"] = double(2 * bytes);
}
BENCHMARK(BM_ShortCopy)->Arg(4)->Arg(32)->ArgName("MiB")->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.1);

/// Dense decode calls back to back, or with `between` (a ProjectionGemm) after each call when given: then a
/// graph holds 16 (decode, GEMM) pairs and the time is per pair.
void dense_decode_bench(benchmark::State& state, int tokens, int batch, const kvsift::cuda::DecodeOptions& options,
                        ProjectionGemm* between = nullptr) {
  const std::size_t kv_elems = std::size_t(batch) * kKvHeads * tokens * kHeadDim;
  const int copies = copies_for(2 * kv_elems * sizeof(bfloat16));
  Device<bfloat16> k(kv_elems * copies), v(kv_elems * copies), q(std::size_t(batch) * kQHeads * kHeadDim),
      o(std::size_t(batch) * kQHeads * kHeadDim);
  Device<float> lse(std::size_t(batch) * kQHeads);
  fill_random(k.ptr, kv_elems * copies, 1);
  fill_random(v.ptr, kv_elems * copies, 2);
  fill_random(q.ptr, std::size_t(batch) * kQHeads * kHeadDim, 3);
  const auto qv = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim);
  const auto out = kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, batch, kQHeads, kHeadDim);
  const auto kv_of = [&](int copy) {
    return kvsift::ContiguousKVView<const bfloat16>::packed(k.ptr + copy * kv_elems, v.ptr + copy * kv_elems, batch,
                                                            kKvHeads, tokens, kHeadDim);
  };
  const std::size_t ws_bytes = kvsift::cuda::dense_decode_workspace_bytes(qv, kv_of(0), options);
  Device<std::byte> ws(std::max<std::size_t>(ws_bytes, 256));
  time_calls(state, [&](int i, cudaStream_t stream) {
    kvsift::cuda::dense_decode(qv, kv_of(i % copies), out, {ws.ptr, ws_bytes}, stream, options);
    if (between != nullptr) (*between)(i, stream);
  });
  if (between != nullptr) return;  // the pair's time is not the decode's: no bandwidth counters
  const double bytes = 2.0 * kv_elems * sizeof(bfloat16) + 2.0 * batch * kQHeads * kHeadDim * sizeof(bfloat16);
  state.counters["GB/s"] = benchmark::Counter(bytes * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes"] = bytes;
}
void BM_DenseDecode(benchmark::State& state) {
  dense_decode_bench(state, int(state.range(0)), int(state.range(1)),
                     {.num_splits = std::int32_t(state.range(2)),
                      .cta_warps = std::int32_t(state.range(4)),
                      .programmatic_launch = state.range(3) != 0});
}
/// The same call on fresh allocations, instance after instance: how much the buffers' placement moves it.
void BM_DensePlacement(benchmark::State& state) {
  const Device<std::byte> shift(std::size_t(state.range(2)) * (6 << 20) + 1);  // moves the next allocations
  dense_decode_bench(state, int(state.range(0)), int(state.range(1)), {});
}
BENCHMARK(BM_DensePlacement)
    ->ArgsProduct({{131072}, {1}, {0, 1, 2, 3}})
    ->ArgNames({"N", "batch", "instance"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);
/// splits 0: kvsift's own split planning; the sweeps show what that choice costs. pdl 0: the decode kernel
/// launched without programmatic dependent launch (DecodeOptions::programmatic_launch), for comparison.
/// warps 0: the CTA shape kvsift chooses for the GPU (8 warps on sm_90); 4: the shape of GPUs with less
/// shared memory per block, for comparison.
BENCHMARK(BM_DenseDecode)
    ->ArgsProduct({{8192, 32768, 131072, 524288, 1048576}, {1, 8}, {0}, {1}, {0}})
    ->ArgsProduct({{32768}, {1}, {8, 33}, {1}, {0}})
    ->ArgsProduct({{131072}, {8}, {1, 4}, {1}, {0}})
    ->ArgsProduct({{32768, 131072}, {1, 8}, {0}, {0}, {0}})
    ->ArgsProduct({{32768, 131072}, {1, 8}, {0}, {1}, {4}})
    ->ArgNames({"N", "batch", "splits", "pdl", "warps"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

/// Dense decode with a projection GEMM after every call (graph: decode, GEMM, decode, GEMM, ...): GPU time
/// per (decode, GEMM) pair. With pdl 1 the decode kernel is launched as a programmatic dependent of the
/// GEMM: it can start before the GEMM ends only if cuBLAS's kernel signals early
/// (griddepcontrol.launch_dependents), which kvsift does not control; pdl 0 is measured beside it.
/// bench/report.py subtracts BM_ProjectionGemm (the GEMM alone, timed the same way) to get the decode's share.
void BM_DenseInterleaved(benchmark::State& state) {
  ProjectionGemm gemm(int(state.range(1)));
  dense_decode_bench(state, int(state.range(0)), int(state.range(1)), {.programmatic_launch = state.range(2) != 0}, &gemm);
}
BENCHMARK(BM_DenseInterleaved)
    ->ArgsProduct({{32768, 131072}, {1, 8}, {0, 1}})
    ->ArgNames({"N", "batch", "pdl"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

/// The projection GEMM alone, 16 calls per graph (weights rotating over more than L2), for BM_DenseInterleaved.
void BM_ProjectionGemm(benchmark::State& state) {
  ProjectionGemm gemm(int(state.range(0)));
  time_calls(state, [&](int i, cudaStream_t stream) { gemm(i, stream); });
}
BENCHMARK(BM_ProjectionGemm)->Arg(1)->Arg(8)->ArgName("batch")->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.1);

/// Sparse decode over K indices per (sequence, kv head) of a 128K-token cache: random (uniform over the
/// context) or clustered (runs of 32 consecutive tokens, as cluster- or page-based selectors return).
void BM_SparseDecode(benchmark::State& state) {
  const int k_sel = int(state.range(0)), batch = int(state.range(1));
  const bool clustered = state.range(2) != 0;
  // window:1 adds the attention window of the benchmarks (sink 4 + recent 64) to the K selected.
  // merge: DecodeOptions::split_merge (0 automatic, 1 cluster, 2 kernel), split CTAs merging in their cluster or in
  // a second kernel. Forced clusters at batch 1 only: the H200 holds 15 clusters of 8 and 30 of 4 decode CTAs, fewer
  // than batch 2's 16 rows of 8 splits and batch 4's 32 rows of 4, which SplitMerge::cluster refuses.
  const kvsift::AttentionWindow window = state.range(6) != 0 ? kvsift::AttentionWindow{4, 64} : kvsift::AttentionWindow{};
  const kvsift::cuda::DecodeOptions options{.attention = {.window = window},
                                            .num_splits = std::int32_t(state.range(3)),
                                            .cta_warps = std::int32_t(state.range(5)),
                                            .programmatic_launch = state.range(4) != 0,
                                            .split_merge = kvsift::cuda::SplitMerge(state.range(7))};
  const int tokens = 131072;
  const int middle = window.recent_begin(tokens) - window.sink_end(tokens);  // where selections are drawn
  const std::size_t kv_elems = std::size_t(batch) * kKvHeads * tokens * kHeadDim;
  Device<bfloat16> k(kv_elems), v(kv_elems), q(std::size_t(batch) * kQHeads * kHeadDim), o(std::size_t(batch) * kQHeads * kHeadDim);
  Device<float> lse(std::size_t(batch) * kQHeads);
  fill_random(k.ptr, kv_elems, 1);
  fill_random(v.ptr, kv_elems, 2);
  fill_random(q.ptr, std::size_t(batch) * kQHeads * kHeadDim, 3);
  // Several selection sets (different tokens) rotate so that L2 holds none of the next step's rows.
  const int sets = 16;
  const std::size_t rows = std::size_t(batch) * kKvHeads;
  std::vector<std::int32_t> host_idx(rows * k_sel * sets), host_counts(rows, k_sel);
  std::mt19937_64 rng(7);
  std::vector<std::int32_t> pool(middle);
  std::iota(pool.begin(), pool.end(), window.sink_end(tokens));
  for (std::size_t r = 0; r < rows * sets; ++r) {
    std::int32_t* dst = host_idx.data() + r * k_sel;
    if (clustered) {
      const int runs = (k_sel + 31) / 32;
      std::vector<std::int32_t> starts(middle / 32);
      std::iota(starts.begin(), starts.end(), 0);
      std::shuffle(starts.begin(), starts.end(), rng);
      std::sort(starts.begin(), starts.begin() + runs);
      for (int i = 0; i < k_sel; ++i) dst[i] = window.sink_end(tokens) + starts[i / 32] * 32 + i % 32;
    } else {  // partial Fisher-Yates: the first k_sel entries of pool become a uniform random subset
      for (int i = 0; i < k_sel; ++i) std::swap(pool[i], pool[i + rng() % (middle - i)]);
      std::copy_n(pool.begin(), k_sel, dst);
      std::sort(dst, dst + k_sel);
    }
  }
  Device<std::int32_t> idx(host_idx.size()), counts(rows);
  KVSIFT_CUDA_CHECK(cudaMemcpy(idx.ptr, host_idx.data(), host_idx.size() * 4, cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(cudaMemcpy(counts.ptr, host_counts.data(), rows * 4, cudaMemcpyHostToDevice));
  const auto qv = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim);
  const auto kv = kvsift::ContiguousKVView<const bfloat16>::packed(k.ptr, v.ptr, batch, kKvHeads, tokens, kHeadDim);
  const auto out = kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, batch, kQHeads, kHeadDim);
  const auto sel_of = [&](int set) {
    return kvsift::SelectionView{idx.ptr + std::size_t(set) * rows * k_sel, counts.ptr, nullptr, batch, kKvHeads, k_sel};
  };
  const std::size_t ws_bytes = kvsift::cuda::sparse_decode_workspace_bytes(qv, kv, sel_of(0), options);
  Device<std::byte> ws(std::max<std::size_t>(ws_bytes, 256));
  time_calls(state, [&](int i, cudaStream_t stream) {
    kvsift::cuda::sparse_decode(qv, kv, sel_of(i % sets), out, {ws.ptr, ws_bytes}, stream, options);
  });
  const int attended = k_sel + window.size(tokens);
  const double bytes = 2.0 * rows * attended * kHeadDim * sizeof(bfloat16) + rows * k_sel * 4.0 +
                       2.0 * batch * kQHeads * kHeadDim * sizeof(bfloat16);
  state.counters["GB/s"] = benchmark::Counter(bytes * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes"] = bytes;
}
BENCHMARK(BM_SparseDecode)
    ->ArgsProduct({{256, 1024, 2048, 8192}, {1, 8}, {0, 1}, {0}, {1}, {0}, {0}, {0}})
    ->ArgsProduct({{2048}, {1}, {0}, {8, 32}, {1}, {0}, {0}, {0}})
    ->ArgsProduct({{2048, 4096, 8192}, {8}, {0}, {1, 2, 4}, {1}, {0}, {0}, {0}})
    ->ArgsProduct({{256, 2048}, {1, 8}, {0}, {0}, {0}, {0}, {0}, {0}})
    ->ArgsProduct({{256, 2048, 8192}, {1, 8}, {0}, {0}, {1}, {4}, {0}, {0}})
    ->ArgsProduct({{2048}, {1, 8}, {0}, {0}, {1}, {0}, {1}, {0}})
    ->ArgsProduct({{2048}, {2, 4}, {0}, {0}, {1}, {0}, {1}, {0, 2}})
    ->ArgsProduct({{2048}, {1}, {0}, {0}, {1}, {0}, {1}, {1, 2}})
    ->ArgNames({"K", "batch", "clustered", "splits", "pdl", "warps", "window", "merge"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

/// Hybrid decode step: window (sink 4 + recent 1024) attended on the GPU from the device cache, 2% of the
/// middle selected (absolute positions) and attended on the CPU with all host threads from a pinned host
/// cache, merged on the GPU. Counters: the step's wall time (manual time), its CPU part, the window's GPU
/// time alone.
void BM_HybridDecode(benchmark::State& state) {
  const int tokens = int(state.range(0));
  constexpr int kSink = 4, kRecent = 1024;
  const kvsift::AttentionWindow window{kSink, kRecent};
  const int middle = tokens - kSink - kRecent, k_sel = middle / 50;
  // Both caches hold every position (absolute indices); the GPU reads only the window's rows, the CPU only
  // the selected middle rows.
  const std::size_t cache_elems = std::size_t(kKvHeads) * tokens * kHeadDim;
  Device<bfloat16> dk(cache_elems), dv(cache_elems), q(kQHeads * kHeadDim), o(kQHeads * kHeadDim);
  Device<float> lse(kQHeads);
  fill_random(dk.ptr, cache_elems, 1);
  fill_random(dv.ptr, cache_elems, 2);
  fill_random(q.ptr, kQHeads * kHeadDim, 3);
  bfloat16 *hk = nullptr, *hv = nullptr;
  KVSIFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&hk), cache_elems * sizeof(bfloat16)));
  KVSIFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&hv), cache_elems * sizeof(bfloat16)));
  std::mt19937_64 rng(5);
  std::normal_distribution<float> dist;
  for (std::size_t i = 0; i < cache_elems; ++i) {
    hk[i] = kvsift::float_to_bfloat16(dist(rng));
    hv[i] = kvsift::float_to_bfloat16(dist(rng));
  }
  std::vector<bfloat16> q_host(kQHeads * kHeadDim);
  KVSIFT_CUDA_CHECK(cudaMemcpy(q_host.data(), q.ptr, q_host.size() * sizeof(bfloat16), cudaMemcpyDeviceToHost));
  std::vector<std::int32_t> pool(middle), idx(std::size_t(kKvHeads) * k_sel), counts(kKvHeads, k_sel);
  std::iota(pool.begin(), pool.end(), kSink);
  for (int h = 0; h < kKvHeads; ++h) {
    for (int i = 0; i < k_sel; ++i) std::swap(pool[i], pool[i + rng() % (middle - i)]);
    std::copy_n(pool.begin(), k_sel, idx.begin() + std::size_t(h) * k_sel);
    std::sort(idx.begin() + std::size_t(h) * k_sel, idx.begin() + std::size_t(h + 1) * k_sel);
  }
  const std::vector<std::int32_t> seq_lens{tokens};
  Device<std::int32_t> d_seq_lens(1), d_empty(2 * kKvHeads);
  KVSIFT_CUDA_CHECK(cudaMemcpy(d_seq_lens.ptr, seq_lens.data(), sizeof(std::int32_t), cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(cudaMemset(d_empty.ptr, 0, 2 * kKvHeads * sizeof(std::int32_t)));
  kvsift::cpu::ThreadPool threads(int(std::max(1u, std::thread::hardware_concurrency())));
  kvsift::cuda::HybridDecoder<bfloat16> decoder(
      {.batch = 1, .q_heads = kQHeads, .kv_heads = kKvHeads, .head_dim = kHeadDim, .attention = {.window = window}},
      &threads);
  const auto qd = kvsift::QueryView<const bfloat16>::packed(q.ptr, 1, kQHeads, kHeadDim);
  const auto qh = kvsift::QueryView<const bfloat16>::packed(q_host.data(), 1, kQHeads, kHeadDim);
  const auto dev = kvsift::ContiguousKVView<const bfloat16>::packed(dk.ptr, dv.ptr, 1, kKvHeads, tokens, kHeadDim,
                                                                    d_seq_lens.ptr);
  const auto host = kvsift::ContiguousKVView<const bfloat16>::packed(hk, hv, 1, kKvHeads, tokens, kHeadDim,
                                                                     seq_lens.data());
  const kvsift::SelectionView sel{idx.data(), counts.data(), nullptr, 1, kKvHeads, k_sel};
  const auto out = kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, 1, kQHeads, kHeadDim);
  SplitBlocks blocks(decoder.workspace_bytes());
  // The window's GPU time alone: the decoder's own call (the window and an empty selection).
  const kvsift::SelectionView empty{d_empty.ptr + kKvHeads, d_empty.ptr, nullptr, 1, kKvHeads, 1};
  const kvsift::cuda::DecodeOptions window_options{.attention = {.window = window}};
  const std::size_t ws_bytes = kvsift::cuda::sparse_decode_workspace_bytes(qd, dev, empty, window_options);
  Device<std::byte> ws(std::max<std::size_t>(ws_bytes, 256));
  EventTimer timer;
  double gpu_seconds = 1e9;
  for (int i = 0; i < 20; ++i) {
    gpu_seconds = std::min(gpu_seconds, timer.seconds([&] {
      kvsift::cuda::sparse_decode(qd, dev, empty, out, {ws.ptr, ws_bytes}, nullptr, window_options);
    }));
  }
  double cpu_total = 0.0;
  for (int warm = 0; warm < 2; ++warm) decoder.decode(qd, qh, dev, host, sel, out, blocks.view(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    decoder.decode(qd, qh, dev, host, sel, out, blocks.view(), nullptr);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(nullptr));
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    cpu_total += decoder.last_step_times().cpu_seconds;
  }
  const double cpu_seconds = cpu_total / double(state.iterations());
  state.counters["cpu_us"] = cpu_seconds * 1e6;
  state.counters["gpu_window_us"] = gpu_seconds * 1e6;
  state.counters["K"] = k_sel;
  cudaFreeHost(hk);
  cudaFreeHost(hv);
}
BENCHMARK(BM_HybridDecode)->Arg(32768)->Arg(131072)->ArgName("N")->UseManualTime()->Unit(benchmark::kMicrosecond)->MinTime(0.2);

}  // namespace

int main(int argc, char** argv) {
  if (!kvsift::cuda::device_available()) {
    std::fprintf(stderr, "kvsift_bench_decode: no CUDA device; nothing to measure\n");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
