#pragma once
// Shared by the GPU benchmark files of kvsift_bench_decode: device buffers, event timing, random bf16 data and
// time_calls, which times a call as a CUDA graph replay and eagerly, as bench/sdpa_baseline.py times PyTorch.
#include <benchmark/benchmark.h>

#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/context.hpp"
#include "kvsift/step/hybrid_decoder.hpp"

namespace kvsift::bench {

using kvsift::bfloat16;

inline constexpr std::size_t kL2FlushBytes = std::size_t(256) << 20;  // rotate inputs over > 5x the 50 MB L2

/// Enough copies of an input of `bytes` that consecutive iterations never hit in L2.
inline int copies_for(std::size_t bytes) { return int(std::max<std::size_t>(1, (kL2FlushBytes + bytes - 1) / bytes)); }

template <class T>
struct Device {
  T* ptr = nullptr;
  explicit Device(std::size_t n) { KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T))); }
  ~Device() { cudaFree(ptr); }
  Device(const Device&) = delete;
};

/// A split step's or cuda::HybridDecoder's workspace: a device block and a pinned host block of the planned bytes.
struct SplitBlocks {
  explicit SplitBlocks(const SplitWorkspaceBytes& bytes)
      : bytes_(bytes), device(std::max<std::size_t>(bytes.device, 1)), host(bytes.host) {}
  SplitWorkspace view() { return {{device.ptr, bytes_.device}, {host.data(), bytes_.host}}; }

 private:
  SplitWorkspaceBytes bytes_;
  Device<std::byte> device;
  cuda::PinnedArray<std::byte> host;
};

struct EventTimer {
  cudaEvent_t start, stop;
  EventTimer() {
    KVSIFT_CUDA_CHECK(cudaEventCreate(&start));
    KVSIFT_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~EventTimer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  template <class F>
  double seconds(F&& f) {
    KVSIFT_CUDA_CHECK(cudaEventRecord(start));
    f();
    KVSIFT_CUDA_CHECK(cudaEventRecord(stop));
    KVSIFT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms * 1e-3;
  }
};

/// Fills bf16 data with random normal values (never zeros: zeros can run faster than real data). A 32 MiB
/// random pattern is uploaded once and tiled by device-to-device copies; the tiles start at different offsets.
inline void fill_random(bfloat16* d_data, std::size_t n, std::uint64_t seed) {
  constexpr std::size_t kPattern = std::size_t(1) << 24;
  static const bfloat16* d_pattern = [] {
    std::mt19937_64 rng(2026);
    std::normal_distribution<float> dist;
    std::vector<bfloat16> p(kPattern);
    for (auto& x : p) x = kvsift::float_to_bfloat16(dist(rng));
    bfloat16* d = nullptr;  // lives as long as the process
    KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d), kPattern * sizeof(bfloat16)));
    KVSIFT_CUDA_CHECK(cudaMemcpy(d, p.data(), kPattern * sizeof(bfloat16), cudaMemcpyHostToDevice));
    return d;
  }();
  std::size_t shift = seed * 7919;
  for (std::size_t off = 0; off < n; off += kPattern / 2, shift += 104729) {
    const std::size_t count = std::min(kPattern / 2, n - off);
    KVSIFT_CUDA_CHECK(cudaMemcpy(d_data + off, d_pattern + shift % (kPattern / 2), count * sizeof(bfloat16),
                                 cudaMemcpyDeviceToDevice));
  }
}

/// The device's copy bandwidth in bytes per second: a 1 GiB device-to-device copy (2 GiB moved), the best of
/// three, measured once per process. A stage's floor is its bytes over it (report_latency_model).
inline double copy_bandwidth() {
  static const double bandwidth = [] {
    const std::size_t bytes = std::size_t(1) << 30;
    Device<std::byte> a(bytes), b(bytes);
    KVSIFT_CUDA_CHECK(cudaMemset(a.ptr, 1, bytes));
    EventTimer timer;
    double best = 0;
    for (int i = 0; i < 4; ++i) {  // the first is a warm-up
      const double s = timer.seconds([&] { KVSIFT_CUDA_CHECK(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice)); });
      if (i > 0) best = std::max(best, double(2 * bytes) / s);
    }
    return best;
  }();
  return bandwidth;
}

/// The latency model's counters of a call that must move `bytes` (read and written) and took `seconds` (GPU time
/// per call, time_calls' result): MB, the floor in µs at the copy bandwidth, and the time over the floor (1.0:
/// the call costs what its bytes cost). time_calls sets the launches per call.
inline void report_latency_model(benchmark::State& state, double bytes, double seconds) {
  const double floor_us = bytes / copy_bandwidth() * 1e6;
  state.counters["MB"] = bytes * 1e-6;
  state.counters["floor_us"] = floor_us;
  if (floor_us > 0 && seconds > 0) state.counters["x_floor"] = seconds * 1e6 / floor_us;
}

/// Kernels, memsets and copies per call in a captured graph of `calls` calls: the launches a call costs.
inline double launches_per_call(cudaGraph_t graph, int calls) {
  std::size_t count = 0;
  KVSIFT_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  KVSIFT_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  std::size_t launches = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    KVSIFT_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    launches += type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemset || type == cudaGraphNodeTypeMemcpy;
  }
  return double(launches) / calls;
}

/// Times `call(i)` two ways. The benchmark's manual time is the GPU time per call, from replays of a CUDA
/// graph holding kCallsPerGraph calls (no host gaps, as an engine replaying graphs sees it). The counter
/// eager_us times direct calls exactly as bench/sdpa_baseline.py times PyTorch SDPA: events around each of
/// kEagerCalls back-to-back calls, no synchronization between them, the median; where a call is shorter
/// than its host launch path, the host's time shows in it. The counter launches: kernels, memsets and copies
/// per call in the captured graph. Returns the mean GPU time per call (seconds) of the replays.
///
/// With the environment variable KVSIFT_PROFILE_ONE_STEP set, it runs one eager call after the warm-up, alone in
/// the NVTX range "kvsift step", marks the benchmark skipped and returns 0: bench/stage_table.py profiles that
/// call's kernels one by one (Nsight Compute) into a per-kernel table of bytes, floor and time. (Google Benchmark
/// runs a benchmark several times to size its iterations; skipping keeps the range to one call.)
constexpr int kCallsPerGraph = 16;
constexpr int kEagerCalls = 50;
template <class Call>
double time_calls(benchmark::State& state, Call&& call) {
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  EventTimer timer;
  for (int i = 0; i < 3; ++i) call(i, stream);  // warm-up: module load, occupancy query
  if (std::getenv("KVSIFT_PROFILE_ONE_STEP") != nullptr) {
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    nvtxRangePushA("kvsift step");
    call(3, stream);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    nvtxRangePop();
    KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
    state.SkipWithError("KVSIFT_PROFILE_ONE_STEP: one eager call in the NVTX range 'kvsift step', no timing");
    return 0.0;
  }
  std::vector<cudaEvent_t> starts(kEagerCalls), stops(kEagerCalls);
  for (int i = 0; i < kEagerCalls; ++i) {
    KVSIFT_CUDA_CHECK(cudaEventCreate(&starts[i]));
    KVSIFT_CUDA_CHECK(cudaEventCreate(&stops[i]));
  }
  for (int i = 0; i < kEagerCalls; ++i) {
    KVSIFT_CUDA_CHECK(cudaEventRecord(starts[i], stream));
    call(i, stream);
    KVSIFT_CUDA_CHECK(cudaEventRecord(stops[i], stream));
  }
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> eager(kEagerCalls);
  for (int i = 0; i < kEagerCalls; ++i) {
    float ms = 0;
    KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&ms, starts[i], stops[i]));
    eager[i] = ms * 1e3;
    KVSIFT_CUDA_CHECK(cudaEventDestroy(starts[i]));
    KVSIFT_CUDA_CHECK(cudaEventDestroy(stops[i]));
  }
  std::nth_element(eager.begin(), eager.begin() + kEagerCalls / 2, eager.end());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  KVSIFT_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kCallsPerGraph; ++i) call(i, stream);
  KVSIFT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  state.counters["launches"] = launches_per_call(graph, kCallsPerGraph);
  KVSIFT_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  KVSIFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  double total_s = 0;
  for (auto _ : state) {
    KVSIFT_CUDA_CHECK(cudaEventRecord(timer.start, stream));
    KVSIFT_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    KVSIFT_CUDA_CHECK(cudaEventRecord(timer.stop, stream));
    KVSIFT_CUDA_CHECK(cudaEventSynchronize(timer.stop));
    float ms = 0;
    KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&ms, timer.start, timer.stop));
    state.SetIterationTime(ms * 1e-3 / kCallsPerGraph);
    total_s += ms * 1e-3 / kCallsPerGraph;
  }

  state.counters["eager_us"] = eager[kEagerCalls / 2];
  KVSIFT_CUDA_CHECK(cudaGraphExecDestroy(exec));
  KVSIFT_CUDA_CHECK(cudaGraphDestroy(graph));
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return state.iterations() > 0 ? total_s / double(state.iterations()) : 0.0;
}

}  // namespace kvsift::bench
