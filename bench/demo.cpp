// kvsift demo: how much of exact attention a sparse selection keeps, and what one decode step costs with
// kvsift's own kernels, on synthetic long-context workloads shaped like real attention (see
// include/kvsift/eval/synthetic_workload.hpp); then the fidelity harness on a real-model capture.
//
// Times are per decode step (batch 1, all heads), bf16 K/V/Q storage, fp32 accumulation, medians of a few
// calls: dense attention, and the decode step (step/decode_step.hpp: the selector's append and select, then
// sparse attention over the window and the selection) of each selector, with the attention floor (sparse
// attention alone over the same selection). The selectors so far are the references: the exact OracleTopK,
// which scores every key (it costs more than dense attention and is the quality upper bound, not a speed
// path), and Quest (page bounds). Each retrieval selector joins this table as it lands. With a GPU, a last table
// times dense decode and the Quest and OracleTopK steps at an engine's shape (q 32 / kv 8 / head_dim 128, budget
// 2048) as CUDA graph replays: where selection pays.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "kvsift/eval/metrics.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/selection_buffer.hpp"
#include "kvsift/eval/synthetic_workload.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/decode.hpp"
#include "kvsift/cpu/simd.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "kvsift/eval/fidelity.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/step/decode_step.hpp"
#include "../tools/cli_list.hpp"

#if defined(KVSIFT_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "kvsift/cuda/backend.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/decode.hpp"
#endif

namespace {

using kvsift::bfloat16;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

/// Median wall time of fn in ms, after one warm-up call: at least `min_calls` calls, more (up to 101) for
/// short calls, so that each figure takes about 30 ms of calls and one preempted call does not move it.
template <class F>
double median_ms(int min_calls, F&& fn) {
  auto start = Clock::now();
  fn();
  const double warm_ms = ms_since(start);
  const int calls = std::clamp(int(30.0 / std::max(warm_ms, 1e-3)), min_calls, 101) | 1;
  std::vector<double> ms(calls);
  for (auto& m : ms) {
    start = Clock::now();
    fn();
    m = ms_since(start);
  }
  std::nth_element(ms.begin(), ms.begin() + calls / 2, ms.end());
  return ms[calls / 2];
}

std::vector<bfloat16> to_bf16(const std::vector<float>& x) {
  std::vector<bfloat16> y(x.size());
  std::transform(x.begin(), x.end(), y.begin(), kvsift::float_to_bfloat16);
  return y;
}

/// Host workspace for the CPU decode's split-K, aligned as the decode requires.
struct HostWorkspace {
  std::unique_ptr<std::byte, decltype(&std::free)> data{nullptr, &std::free};
  std::size_t bytes = 0;
  explicit HostWorkspace(std::size_t n) : bytes(n) {
    constexpr std::size_t a = kvsift::WorkspaceLayout::kAlignment;
    if (n > 0) data.reset(static_cast<std::byte*>(std::aligned_alloc(a, (n + a - 1) / a * a)));
  }
  std::span<std::byte> span() const { return {data.get(), bytes}; }
};

double needle_recall(const kvsift::SyntheticWorkload& w, const kvsift::SelectionView& sel) {
  std::int32_t found = 0, total = 0;
  for (std::int32_t g = 0; g < w.config.kv_heads; ++g) {
    const std::set<std::int32_t> chosen(sel.row(0, g), sel.row(0, g) + sel.count(0, g));
    for (std::int32_t i = 0; i < w.config.needles; ++i, ++total) {
      found += chosen.count(w.needle_positions[g * w.config.needles + i]) ? 1 : 0;
    }
  }
  return double(found) / total;
}

/// One row of the synthetic table: quality of the selection, CPU times, and GPU times where measured.
struct Row {
  std::string selector;
  std::int32_t tokens = 0, k = 0;
  double budget = 0, mass_recall = 0, error = 0, needles = 0;
  double dense_ms = 0, step_ms = 0, attend_ms = 0;
  double gpu_dense_us = -1, gpu_step_us = -1, gpu_attend_us = -1;  ///< < 0: not measured
};

/// The sink + recent window every step attends (the synthetic workload's sinks and the last 32 tokens).
kvsift::AttentionWindow demo_window(const kvsift::SyntheticWorkloadConfig& c) { return {c.sink_tokens, 32}; }

/// The window's tokens and a selection as one selection without a window (for the quality metrics).
kvsift::SelectionBuffer attended_set(const kvsift::SelectionView& sel, const kvsift::AttentionWindow& window,
                                     std::int32_t tokens) {
  kvsift::SelectionBuffer all(1, sel.kv_heads, window.size(tokens) + sel.capacity, false);
  for (std::int32_t g = 0; g < sel.kv_heads; ++g) {
    std::int32_t* row = all.view().row(0, g);
    std::int32_t n = 0;
    for (std::int32_t t = 0; t < window.sink_end(tokens); ++t) row[n++] = t;
    for (std::int32_t i = 0; i < sel.count(0, g); ++i) row[n++] = sel.row(0, g)[i];
    for (std::int32_t t = window.recent_begin(tokens); t < tokens; ++t) row[n++] = t;
    all.view().counts[g] = n;
  }
  return all;
}

#if defined(KVSIFT_WITH_CUDA)
/// The CUDA kernels on the same bf16 data: GPU time per call from CUDA graph replays (median_us).
class GpuTimer {
 public:
  /// Empty when this build has CUDA but the machine has no usable GPU.
  static std::string unavailable_reason() {
    return kvsift::cuda::device_available() ? std::string() : "skipped: no CUDA device on this machine";
  }
  static std::string device_name() {
    cudaDeviceProp prop{};
    int device = 0;
    KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
    KVSIFT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    return prop.name;
  }

  GpuTimer(const std::vector<bfloat16>& q, const std::vector<bfloat16>& k, const std::vector<bfloat16>& v,
           const kvsift::SyntheticWorkloadConfig& c)
      : c_(c), q_(upload(q)), k_(upload(k)), v_(upload(v)), o_(alloc<bfloat16>(q.size())), lse_(alloc<float>(c.q_heads)) {
    KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    KVSIFT_CUDA_CHECK(cudaEventCreate(&start_));
    KVSIFT_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~GpuTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaStreamDestroy(stream_);
    for (void* p : owned_) cudaFree(p);
  }
  GpuTimer(const GpuTimer&) = delete;
  GpuTimer& operator=(const GpuTimer&) = delete;

  double dense_us() {
    const std::size_t bytes = kvsift::cuda::dense_decode_workspace_bytes(query(), kv());
    std::byte* ws = workspace(bytes);
    return median_us([&] { kvsift::cuda::dense_decode(query(), kv(), out(), {ws, bytes}, stream_); });
  }
  /// One CUDA decode step of a selector (prepared on the whole cache) per call; `page_selections`: a selector's
  /// pages attended directly (DecodeStepConfig::page_selections).
  template <class Selector>
  double step_us(Selector selector, const kvsift::AttentionWindow& window, bool page_selections = false) {
    const std::int32_t slot = 0;
    auto* d_slot = upload(std::vector<std::int32_t>{slot});
    auto* d_length = upload(std::vector<std::int32_t>{c_.tokens});
    const kvsift::cuda::Context ctx{stream_};
    kvsift::DecodeStep step(std::move(selector),
                            {.attention = {.window = window}, .max_batch = 1, .q_heads = c_.q_heads,
                             .kv_heads = c_.kv_heads, .head_dim = c_.head_dim, .max_seq_len = c_.tokens,
                             .page_selections = page_selections},
                            ctx);
    const auto cache = kvsift::ContiguousKVView<bfloat16>::packed(k_, v_, c_.batch, c_.kv_heads, c_.tokens, c_.head_dim,
                                                                   d_length);
    step.prepare({.cache = cache, .slots = d_slot}, ctx);
    std::byte* ws = workspace(step.workspace_bytes());
    return median_us([&] {
      step.run(kvsift::StepInputs<bfloat16>{.q = query(), .cache = cache, .slots = d_slot}, out(),
               {ws, step.workspace_bytes()}, ctx);
    });
  }

  double sparse_us(const kvsift::SelectionView& host_sel, const kvsift::AttentionWindow& window) {
    const std::size_t rows = std::size_t(c_.batch) * c_.kv_heads;
    auto* idx = alloc<std::int32_t>(rows * host_sel.capacity);
    auto* counts = alloc<std::int32_t>(rows);
    KVSIFT_CUDA_CHECK(cudaMemcpy(idx, host_sel.indices, rows * host_sel.capacity * 4, cudaMemcpyHostToDevice));
    KVSIFT_CUDA_CHECK(cudaMemcpy(counts, host_sel.counts, rows * 4, cudaMemcpyHostToDevice));
    const kvsift::SelectionView sel{idx, counts, nullptr, c_.batch, c_.kv_heads, host_sel.capacity};
    const kvsift::cuda::DecodeOptions options{.attention = {.window = window}};
    const std::size_t bytes = kvsift::cuda::sparse_decode_workspace_bytes(query(), kv(), sel, options);
    std::byte* ws = workspace(bytes);
    return median_us([&] { kvsift::cuda::sparse_decode(query(), kv(), sel, out(), {ws, bytes}, stream_, options); });
  }

 private:
  template <class T>
  T* alloc(std::size_t n) {
    void* p = nullptr;
    KVSIFT_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(n * sizeof(T), 256)));
    owned_.push_back(p);
    return static_cast<T*>(p);
  }
  template <class T>
  T* upload(const std::vector<T>& x) {
    T* d = alloc<T>(x.size());
    KVSIFT_CUDA_CHECK(cudaMemcpy(d, x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
  }
  std::byte* workspace(std::size_t bytes) { return alloc<std::byte>(bytes); }
  kvsift::QueryView<const bfloat16> query() const {
    return kvsift::QueryView<const bfloat16>::packed(q_, c_.batch, c_.q_heads, c_.head_dim);
  }
  kvsift::ContiguousKVView<const bfloat16> kv() const {
    return kvsift::ContiguousKVView<const bfloat16>::packed(k_, v_, c_.batch, c_.kv_heads, c_.tokens, c_.head_dim);
  }
  kvsift::StateView<bfloat16> out() const {
    return kvsift::StateView<bfloat16>::packed(o_, lse_, c_.batch, c_.q_heads, c_.head_dim);
  }
  /// GPU time per call as engines run a step: kCallsPerGraph calls captured once in a CUDA graph, the median of
  /// kReplays replays divided by the calls (launch costs amortized as in a captured decode loop).
  template <class F>
  double median_us(F&& call) {
    constexpr int kCallsPerGraph = 16, kReplays = 20;
    for (int i = 0; i < 3; ++i) call();  // module load, occupancy query, per-device attributes: before capture
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaGraph_t graph = nullptr;
    KVSIFT_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kCallsPerGraph; ++i) call();
    KVSIFT_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t replay = nullptr;
    KVSIFT_CUDA_CHECK(cudaGraphInstantiate(&replay, graph, 0));
    KVSIFT_CUDA_CHECK(cudaGraphLaunch(replay, stream_));  // the first replay uploads the graph
    std::vector<double> us(kReplays);
    for (auto& u : us) {
      KVSIFT_CUDA_CHECK(cudaEventRecord(start_, stream_));
      KVSIFT_CUDA_CHECK(cudaGraphLaunch(replay, stream_));
      KVSIFT_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      KVSIFT_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      u = ms * 1e3 / kCallsPerGraph;
    }
    KVSIFT_CUDA_CHECK(cudaGraphExecDestroy(replay));
    KVSIFT_CUDA_CHECK(cudaGraphDestroy(graph));
    std::nth_element(us.begin(), us.begin() + kReplays / 2, us.end());
    return us[kReplays / 2];
  }

  kvsift::SyntheticWorkloadConfig c_;
  std::vector<void*> owned_;
  bfloat16 *q_, *k_, *v_, *o_;
  float* lse_;
  cudaStream_t stream_{};
  cudaEvent_t start_{}, stop_{};
};
#endif

#if defined(KVSIFT_WITH_CUDA)
/// The GPU at an engine's shape: q_heads 32, kv_heads 8, head_dim 128, bf16, batch 1, a budget of 2048 tokens
/// (128 Quest pages of 16) besides a window of 4 sinks and the last 64 tokens, on random keys and values (the
/// times do not depend on them); CUDA graph replays. Where a selector's whole step (append, select, attend) is
/// cheaper than kvsift's dense decode, selection pays.
void engine_shape_gpu_table(const std::vector<std::int32_t>& contexts) {
  constexpr std::int32_t kBudget = 2048;
  constexpr kvsift::AttentionWindow kWindow{4, 64};
  fmt::print("\nGPU at an engine's shape (q_heads 32, kv_heads 8, head_dim 128, bf16, batch 1; budget {} + window {} + "
             "{}; random K/V), {}; CUDA graphs of 16 calls, median of 20 replays\n\n",
             kBudget, kWindow.sink, kWindow.recent, GpuTimer::device_name());
  fmt::print("{:>8} | {:>9} | {:>17} | {:>17} | {:>17}\n", "context", "dense us", "Quest step us", "Quest pages us",
             "OracleTopK us");
  std::mt19937 engine(2026);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (std::int32_t tokens : contexts) {
    const kvsift::SyntheticWorkloadConfig c{.tokens = tokens, .q_heads = 32, .kv_heads = 8, .head_dim = 128};
    const auto random_bf16 = [&](std::size_t n) {
      std::vector<bfloat16> x(n);
      for (auto& e : x) e = kvsift::float_to_bfloat16(value(engine));
      return x;
    };
    const std::size_t kv_elements = std::size_t(c.kv_heads) * std::size_t(tokens) * std::size_t(c.head_dim);
    GpuTimer gpu(random_bf16(std::size_t(c.q_heads) * c.head_dim), random_bf16(kv_elements), random_bf16(kv_elements), c);
    const kvsift::SelectorLimits limits{.max_tokens = tokens, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
                                        .head_dim = c.head_dim};
    using Cuda = kvsift::cuda::Context;
    const kvsift::QuestConfig quest{.budget = kBudget, .page_size = 16};
    const double dense = gpu.dense_us();
    const double quest_tokens = gpu.step_us(kvsift::Quest<bfloat16, Cuda>(limits, quest), kWindow);
    const double quest_pages = gpu.step_us(kvsift::Quest<bfloat16, Cuda>(limits, quest), kWindow, true);
    const double oracle = gpu.step_us(kvsift::OracleTopK<bfloat16, Cuda>(limits, {.budget = kBudget}), kWindow);
    const auto cell = [&](double us) { return fmt::format("{:.1f} ({:.2f}x)", us, dense / us); };
    fmt::print("{:>8} | {:>9.1f} | {:>17} | {:>17} | {:>17}\n", tokens, dense, cell(quest_tokens), cell(quest_pages),
               cell(oracle));
  }
  fmt::print("(x: dense / step; above 1x the selector's step is faster than dense attention)\n");
}
#endif

/// The real-data table: the fidelity harness (OracleTopK, StreamingLLM, Quest) on the committed capture.
/// Its 512 tokens are short: a prefill of 3/4 (384 tokens) keeps 5% of the context above one Quest page of
/// 16 tokens, so budgets here are 5/10/20% (K = 19, 38, 77).
void real_data_table(const std::string& path) {
  const kvsift::Capture c = kvsift::read_capture(path);
  const kvsift::FidelityOptions options{.budgets = {0.05, 0.10, 0.20}, .decode_positions = 32, .prefill = 0.75};
  fmt::print("\nReal attention: {} ({} tokens of {}), layers", c.model, c.tokens, c.text_id);
  for (const auto& l : c.layers) fmt::print(" {}", l.layer);
  fmt::print("; q_heads {}, kv_heads {}, head_dim {}; prefill {} tokens, then {} decode positions spread over the "
             "rest; per layer: mean, p10 and p90 over (position, head)\n\n",
             c.q_heads, c.kv_heads, c.head_dim, std::lround(options.prefill * c.tokens), options.decode_positions);
  fmt::print("{}", kvsift::fidelity_markdown(kvsift::evaluate_fidelity(c, kvsift::reference_selectors(), options)));
}

}  // namespace

int main(int argc, char** argv) try {
  // `kvsift_demo --quick` runs only the smallest context, for smoke tests; it has no other option.
  bool quick = false;
  kvsift::bench::Arguments args("kvsift_demo", argc, argv);
  while (args.next()) {
    if (args.is("--quick")) {
      quick = true;
    } else {
      args.refuse();
    }
  }
  const std::vector<std::int32_t> contexts = quick ? std::vector<std::int32_t>{8192} : std::vector<std::int32_t>{8192, 32768, 131072};
  const std::vector<double> budgets = {0.01, 0.02, 0.05};
  const int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  kvsift::cpu::ThreadPool pool(threads);

  std::string gpu_skipped = "skipped: this build has no CUDA backend (nvcc was not found at configure time)";
#if defined(KVSIFT_WITH_CUDA)
  gpu_skipped = GpuTimer::unavailable_reason();
#endif

  fmt::print("kvsift demo: synthetic long-context decode, batch 1, q_heads 8, kv_heads 2, head_dim 128, RoPE theta 5e5\n");
  fmt::print("Selectors: OracleTopK (exact top-K by softmax weight) and Quest (pages of 16), each in a decode step with the\n"
             "window of the sink tokens and the last 32; K counts the window\n\n");

  std::vector<Row> rows;
  for (std::int32_t tokens : contexts) {
    const auto w = kvsift::make_synthetic_workload({.tokens = tokens, .seed = 2026});
    const auto& c = w.config;
    // Quality is measured in fp64 on the fp32 workload (the reference attention), so it shows what the
    // selection keeps, not bf16 rounding.
    std::vector<float> o_dense(std::size_t(c.q_heads) * c.head_dim), lse_dense(c.q_heads);
    kvsift::reference::dense_decode(w.query(), w.kv(),
                                    kvsift::StateView<float>::packed(o_dense.data(), lse_dense.data(), 1, c.q_heads, c.head_dim));

    // Times: kvsift's CPU kernels on bf16 copies, on all of this machine's threads.
    const auto q16 = to_bf16(w.q);
    auto k16 = to_bf16(w.k), v16 = to_bf16(w.v);
    const auto q = kvsift::QueryView<const bfloat16>::packed(q16.data(), 1, c.q_heads, c.head_dim);
    const auto kv = kvsift::ContiguousKVView<const bfloat16>::packed(k16.data(), v16.data(), 1, c.kv_heads, tokens, c.head_dim);
    std::vector<bfloat16> o16(o_dense.size());
    std::vector<float> lse16(c.q_heads);
    const auto out16 = kvsift::StateView<bfloat16>::packed(o16.data(), lse16.data(), 1, c.q_heads, c.head_dim);
    const HostWorkspace ws(kvsift::cpu::decode_workspace_bytes(1, c.q_heads, c.kv_heads, c.head_dim, &pool));
    const double dense_ms = median_ms(5, [&] { kvsift::cpu::dense_decode(q, kv, out16, {}, &pool, ws.span()); });
#if defined(KVSIFT_WITH_CUDA)
    std::unique_ptr<GpuTimer> gpu;
    if (gpu_skipped.empty()) gpu = std::make_unique<GpuTimer>(q16, k16, v16, c);
    const double gpu_dense_us = gpu ? gpu->dense_us() : -1;
#endif

    const std::int32_t length = tokens, slot = 0;
    const kvsift::AttentionWindow window = demo_window(c);
    const auto cache = kvsift::ContiguousKVView<bfloat16>::packed(k16.data(), v16.data(), 1, c.kv_heads, tokens,
                                                                   c.head_dim, &length);
    const kvsift::cpu::Context cpu{&pool};
    const kvsift::SelectorLimits limits{.max_tokens = tokens, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
                                        .head_dim = c.head_dim};
    for (double budget : budgets) {
      const auto k = static_cast<std::int32_t>(budget * tokens);
      const std::int32_t middle = k - window.size(tokens);  // the window counts against the budget
      const auto measure = [&](const std::string& name, auto selector) {
        Row r{.selector = name, .tokens = tokens, .k = k, .budget = budget, .dense_ms = dense_ms};
        kvsift::DecodeStep step(std::move(selector),
                                {.attention = {.window = window}, .max_batch = 1, .q_heads = c.q_heads,
                                 .kv_heads = c.kv_heads, .head_dim = c.head_dim, .max_seq_len = tokens},
                                cpu);
        step.prepare({.cache = cache, .slots = &slot}, cpu);
        kvsift::cpu::Array<std::byte> step_ws(step.workspace_bytes());
        const kvsift::StepInputs<bfloat16> in{.q = q, .cache = cache, .slots = &slot};
        r.step_ms = median_ms(3, [&] { step.run(in, out16, step_ws.bytes(), cpu); });
        const kvsift::SelectionView sel = step.selection(step_ws.bytes(), 1);
        const kvsift::cpu::DecodeOptions attend_options{.attention = {.window = window}};
        r.attend_ms = median_ms(5, [&] { kvsift::cpu::sparse_decode(q, kv, sel, out16, attend_options, &pool, ws.span()); });

        const kvsift::SelectionBuffer all = attended_set(sel, window, tokens);
        std::vector<float> o(o_dense.size()), lse(lse_dense.size());
        kvsift::reference::sparse_decode(w.query(), w.kv(), all.view(),
                                         kvsift::StateView<float>::packed(o.data(), lse.data(), 1, c.q_heads, c.head_dim));
        r.mass_recall = kvsift::attention_mass_recall(w.query(), w.kv(), all.view());
        r.error = kvsift::relative_l2_error(o, o_dense);
        r.needles = needle_recall(w, all.view());
#if defined(KVSIFT_WITH_CUDA)
        if (gpu) {
          r.gpu_dense_us = gpu_dense_us;
          r.gpu_attend_us = gpu->sparse_us(sel, window);
        }
#endif
        rows.push_back(r);
      };
      measure("OracleTopK", kvsift::OracleTopK<bfloat16, kvsift::cpu::Context>(limits, {.budget = middle}));
      measure("Quest", kvsift::Quest<bfloat16, kvsift::cpu::Context>(limits, {.budget = middle, .page_size = 16}));
#if defined(KVSIFT_WITH_CUDA)
      if (gpu) {
        using Cuda = kvsift::cuda::Context;
        rows[rows.size() - 2].gpu_step_us = gpu->step_us(kvsift::OracleTopK<bfloat16, Cuda>(limits, {.budget = middle}), window);
        rows.back().gpu_step_us =
            gpu->step_us(kvsift::Quest<bfloat16, Cuda>(limits, {.budget = middle, .page_size = 16}), window);
      }
#endif
    }
  }

  fmt::print("Quality (fp64 reference attention on the fp32 workload):\n");
  fmt::print("  mass recall = exact softmax mass of the selected tokens; error = ||O_sparse - O_dense|| / ||O_dense||;\n");
  fmt::print("  needles = planted strongest tokens found\n");
  fmt::print("CPU time per decode step: kvsift::cpu kernels, bf16 K/V, {} threads, {} SIMD; medians of 3-101 calls\n",
             threads, kvsift::cpu::simd_level_name(kvsift::cpu::active_simd_level()));
  fmt::print("  step = DecodeStep::run (append, select, attend the window and the selection); attend = the attention alone\n\n");
  fmt::print("{:>10} {:>8} {:>6} {:>5} | {:>7} {:>8} {:>7} | {:>8} {:>8} {:>9} {:>8}\n", "selector", "context", "budget",
             "K", "recall", "error", "needles", "dense ms", "step ms", "attend ms", "/ dense");
  for (const Row& r : rows) {
    fmt::print("{:>10} {:>8} {:>5.0f}% {:>5} | {:>7.4f} {:>8.2e} {:>6.0f}% | {:>8.2f} {:>8.2f} {:>9.3f} {:>7.2f}x\n",
               r.selector, r.tokens, 100 * r.budget, r.k, r.mass_recall, r.error, 100 * r.needles, r.dense_ms,
               r.step_ms, r.attend_ms, r.step_ms / r.dense_ms);
  }
  fmt::print("\nThe exact oracle reads every key to score it, so its step costs more than dense attention (the\n"
             "'/ dense' column is above 1x): it is the quality upper bound, not a speed path. Quest reads page bounds\n"
             "(1/8 of the keys' bytes at pages of 16); the attend column is the floor of any selector's step.\n");

  fmt::print("\nGPU time per decode step: ");
  if (!gpu_skipped.empty()) {
    fmt::print("{}\n", gpu_skipped);
  } else {
#if defined(KVSIFT_WITH_CUDA)
    fmt::print("kvsift::cuda kernels on {}, same bf16 data; CUDA graphs of 16 calls, median of 20 replays\n",
               GpuTimer::device_name());
    fmt::print("  step = a CUDA DecodeStep; attend = the attention alone\n\n");
    fmt::print("{:>10} {:>8} {:>6} {:>5} | {:>9} {:>8} {:>10} {:>13}\n", "selector", "context", "budget", "K", "dense us",
               "step us", "attend us", "step / dense");
    for (const Row& r : rows) {
      fmt::print("{:>10} {:>8} {:>5.0f}% {:>5} | {:>9.1f} {:>8.1f} {:>10.1f} {:>13.2f}\n", r.selector, r.tokens,
                 100 * r.budget, r.k, r.gpu_dense_us, r.gpu_step_us, r.gpu_attend_us, r.gpu_step_us / r.gpu_dense_us);
    }
    engine_shape_gpu_table(contexts);
#endif
  }
  real_data_table(KVSIFT_DEMO_CAPTURE);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvsift_demo: %s\n", e.what());
  return 1;
}
