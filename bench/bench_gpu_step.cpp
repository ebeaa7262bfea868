// The decode step (step/decode_step.hpp) of the reference selectors on the GPU, per layer, in the issue's
// shape: q_heads 32, kv_heads 8, head_dim 128, bf16, every sequence N tokens long, a selection of 2048 middle
// tokens plus the window 4 + 64. BM_Step times DecodeStep::run (the selector's append and select, then sparse
// attention over window and selection) as a CUDA graph replay and eagerly (time_calls), with PDL on and off;
// with between:1, a projection GEMM (bench/projection_gemm.hpp) follows every step, as a model's other kernels
// do, and the time is per (step, GEMM) pair: BM_ProjectionGemm (the GEMM alone) subtracts out.
// BM_StepStage times each of its kernels alone, in the same way, so the stages add up to the step. Dense
// decode and cuDNN SDPA on the same shapes are BM_DenseDecode and bench/sdpa_baseline.py.
//
// The engine's token write is not in the step here (StepInputs without k, v): every call folds the same last
// token into Quest's bounds again, which costs what a new token's fold costs.
//
// Inputs rotate over `layers` independent caches (each with its own selector), as consecutive layers of a
// model do, so that what one call reads is not in L2 for the next: enough layers that the bytes a step reads
// exceed 256 MB, as far as 40 GB of caches allow. Counters: layers, and GB/s of the bytes a step must read
// (the selector's index or keys, and the selected and window K/V rows); CSAttention's `union`, the mean number of
// distinct kept keys a row's chosen lists hold (once, after the timed steps). A²ATS (method 4) selects K = 3% of N
// per query head over random codebooks (a2ats_bench_codebooks.hpp), united over the group (sort:0) or by the group's
// maximum (sort:1); its GB/s counts the codes, the codebook and the rows attended, measured after the timed steps
// (`selected`: the mean selection per kv head; `touched`: window + selection over N, the paper's sparsity).
// Method 5 is Quest proposing kRerankFactor x 2048 tokens for the rerank stage (selectors/rerank.hpp), which keeps
// 2048: its cost against method 0 is the stage's (the proposals' keys read once more, their scores, a top-k).
// Method 6 is method 0 with DecodeStepConfig::page_selections: Quest writes its pages and the attention kernel
// attends their middle tokens (no expansion launch).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "a2ats_bench_codebooks.hpp"
#include "gpu_bench.hpp"
#include "projection_gemm.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/a2ats/a2ats.hpp"
#include "kvsift/selectors/csattention/csattention.hpp"
#include "kvsift/selectors/ctkvr/ctkvr.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/rerank.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/step/decode_step.hpp"
#include "kvsift/step/split_step.hpp"

namespace {

using kvsift::bfloat16;
using namespace kvsift::bench;
using Cuda = kvsift::cuda::Context;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kBudget = 2048, kPageSize = 16;
constexpr kvsift::AttentionWindow kWindow{4, 64};
enum Method : int { kQuest = 0, kOracle = 1, kCtkvr = 2, kCsattention = 3, kA2ats = 4, kQuestRerank = 5, kQuestPages = 6 };
/// Quest's proposals per kept token under the rerank stage (method 5).
constexpr int kRerankFactor = 4;
/// CTKVR at the paper's defaults: rho' = 1024, rho = 2560, C = min(2048, N / 16), C' = 4.
constexpr int kCtkvrBudget = 1024, kCtkvrCentroids = 2048;
/// CTKVR's max_unindexed: an engine's generation bound (the benchmark steps at the prefill's length, so none of it is
/// used); it sizes the candidates at C' rho + 4096 where max_seq_len made them C' rho + N.
constexpr int kCtkvrMaxUnindexed = 4096;
/// CSAttention's prefill queries (W >= C = 128).
constexpr int kCsattentionQueries = 1024;

const char* method_name(int m) {
  return m == kQuest          ? "Quest"
         : m == kOracle       ? "OracleTopK"
         : m == kCtkvr        ? "CTKVR"
         : m == kCsattention  ? "CSAttention"
         : m == kQuestRerank  ? "Quest + rerank"
         : m == kQuestPages   ? "Quest, pages attended directly"
                              : "A2ATS";
}

/// CSAttention's list length at N tokens (defaults: alpha = 0.2, m = 8, C = 128, tables per kv head).
/// L at the default alpha, or at alpha_percent / 100 when it is not 0 (BM_Step's "alpha" argument).
double csattention_list(std::int64_t n, std::int64_t alpha_percent = 0) {
  const double alpha = alpha_percent > 0 ? double(alpha_percent) / 100 : kvsift::CsattentionConfig{}.list_fraction;
  return std::min(std::floor(alpha * double(n)), 32768.0);
}

/// The bytes one step must read: the selector's index or keys, and the K/V rows it attends.
double step_bytes(int method, std::int64_t n, int batch, std::int64_t alpha_percent) {
  const double rows = double(batch) * kKvHeads;
  if (method == kCtkvr) {  // the centroids of every query head, the recalled keys (at most C' rho), the attended rows
    const double centroids = double(batch) * kQHeads * kCtkvrCentroids * kHeadDim * sizeof(bfloat16);
    const double recalled = rows * 4.0 * 2.5 * kCtkvrBudget * kHeadDim * sizeof(bfloat16);
    return centroids + recalled + rows * (kCtkvrBudget + kWindow.sink + kWindow.recent) * kHeadDim * 2.0 * sizeof(bfloat16);
  }
  if (method == kA2ats) {  // codes, the codebook (bf16), and until measured a selection of 3% N per kv head
    const double codebook = double(kKvHeads) * 4096 * kHeadDim * sizeof(bfloat16);
    return rows * double(n) * 2 + codebook +
           rows * (std::floor(0.03 * double(n)) + kWindow.sink + kWindow.recent) * kHeadDim * 2.0 * sizeof(bfloat16);
  }
  if (method == kCsattention) {  // each query head's 8 chosen lists (int32 id, fp16 score), the rho = 5% attended rows
    const double lists = double(batch) * kQHeads * 8 * csattention_list(n, alpha_percent) * 6;
    return lists + rows * (0.05 * double(n) + kWindow.sink) * kHeadDim * 2.0 * sizeof(bfloat16);
  }
  const double attended = rows * (kBudget + kWindow.sink + kWindow.recent) * kHeadDim * 2.0 * sizeof(bfloat16);
  const double pages = rows * double((n + kPageSize - 1) / kPageSize) * 2 * kHeadDim * sizeof(bfloat16);
  if (method == kQuestRerank) {  // the bounds, then the proposals' keys for their exact scores
    return pages + rows * double(kRerankFactor) * kBudget * kHeadDim * sizeof(bfloat16) + attended;
  }
  const double index = method == kQuest || method == kQuestPages ? pages : rows * double(n) * kHeadDim * sizeof(bfloat16);
  return index + attended;
}

/// Every sequence n tokens long, batch row b in slot b.
void upload_full_batch(std::int64_t n, int batch, std::int32_t* d_lengths, std::int32_t* d_slots) {
  std::vector<std::int32_t> lengths(batch, std::int32_t(n)), slots(batch);
  for (int b = 0; b < batch; ++b) slots[b] = b;
  KVSIFT_CUDA_CHECK(cudaMemcpy(d_lengths, lengths.data(), batch * sizeof(std::int32_t), cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(cudaMemcpy(d_slots, slots.data(), batch * sizeof(std::int32_t), cudaMemcpyHostToDevice));
}

/// One layer: its cache, lengths, slots, and a prepared decode step of the method.
template <class Selector>
struct Layer {
  std::int64_t n;
  int batch;
  Device<bfloat16> k, v;
  Device<std::int32_t> lengths, slots;
  kvsift::DecodeStep<Selector> step;
  double prepare_ms = 0;  ///< the selector's prepare of the whole batch, host-timed

  Layer(Selector selector, std::int64_t n_, int batch_, bool pdl, std::uint64_t seed, bool page_selections)
      : n(n_), batch(batch_), k(elements()), v(elements()), lengths(batch_), slots(batch_),
        step(std::move(selector),
             {.attention = {.window = kWindow}, .max_batch = batch_, .q_heads = kQHeads, .kv_heads = kKvHeads,
              .head_dim = kHeadDim, .max_seq_len = std::int32_t(n_), .programmatic_launch = pdl,
              .page_selections = page_selections},
             Cuda{}) {
    fill_random(k.ptr, elements(), seed);
    fill_random(v.ptr, elements(), seed + 1);
    upload_full_batch(n, batch, lengths.ptr, slots.ptr);
    kvsift::PrefillInputs<bfloat16> prefill{.cache = cache().as_const(), .slots = slots.ptr};
    std::unique_ptr<Device<bfloat16>> queries;
    if constexpr (std::is_same_v<Selector, kvsift::Ctkvr<bfloat16, Cuda>> ||
                  std::is_same_v<Selector, kvsift::Csattention<bfloat16, Cuda>>) {  // the last W prefill queries
      const std::int32_t w = std::is_same_v<Selector, kvsift::Ctkvr<bfloat16, Cuda>>
                                 ? std::min<std::int32_t>(kCtkvrCentroids, std::int32_t(n / 16))
                                 : kCsattentionQueries;
      queries = std::make_unique<Device<bfloat16>>(std::size_t(batch) * kQHeads * w * kHeadDim);
      fill_random(queries->ptr, std::size_t(batch) * kQHeads * w * kHeadDim, seed + 2);
      prefill.queries = kvsift::SequenceView<const bfloat16>::packed(queries->ptr, batch, kQHeads, w, kHeadDim);
    }
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const auto begin = std::chrono::steady_clock::now();
    step.prepare(prefill, Cuda{});
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    prepare_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
  }
  std::size_t elements() const { return std::size_t(batch) * kKvHeads * std::size_t(n) * kHeadDim; }
  kvsift::KVCache<bfloat16> cache() const {
    return kvsift::ContiguousKVView<bfloat16>::packed(k.ptr, v.ptr, batch, kKvHeads, std::int32_t(n), kHeadDim,
                                                      lengths.ptr);
  }
};

int layers_for(int method, std::int64_t n, int batch, std::int64_t alpha_percent) {
  // A CTKVR layer also keeps its lists (kv_heads * C * 2.5 rho' int32 per sequence: 168 MB); a CSAttention layer
  // its tables (kv_heads * m * C lists of L entries, 6 bytes each, and a 1024-entry overlay: 1.3 GB at 128K).
  const double index_bytes =
      method == kCtkvr        ? double(batch) * kKvHeads * kCtkvrCentroids * 2.5 * kCtkvrBudget * 4
      : method == kCsattention ? double(batch) * kKvHeads * 8 * 128 * (csattention_list(n, alpha_percent) + 1024) * 6
      : method == kA2ats       ? double(batch) * kKvHeads * double(n) * 2 + double(n) * kHeadDim * 4
                               : 0.0;
  const double cache_bytes = 2.0 * batch * kKvHeads * double(n) * kHeadDim * sizeof(bfloat16) + index_bytes;
  const int wanted = int(std::ceil(double(std::size_t(256) << 20) / step_bytes(method, n, batch, alpha_percent)));
  const int fit = std::max(1, int(40e9 / cache_bytes));
  return std::clamp(wanted, 1, fit);
}

kvsift::SelectorLimits limits(std::int64_t n, int batch) {
  return {.max_slots = batch, .max_tokens = std::int32_t(n), .q_heads = kQHeads, .kv_heads = kKvHeads,
          .head_dim = kHeadDim};
}

template <class Selector, class Make>
void run_step_benchmark(benchmark::State& state, int method, Make make_selector) {
  const std::int64_t n = state.range(1);
  const int batch = int(state.range(2));
  const bool pdl = state.range(3) != 0;
  std::unique_ptr<ProjectionGemm> between;
  if (state.range(4) != 0) between = std::make_unique<ProjectionGemm>(batch);
  const int layers = layers_for(method, n, batch, state.range(7));
  std::vector<std::unique_ptr<Layer<Selector>>> stack;
  for (int l = 0; l < layers; ++l) {
    stack.push_back(std::make_unique<Layer<Selector>>(make_selector(), n, batch, pdl, 17 * l + 1, method == kQuestPages));
  }
  Device<bfloat16> q(std::size_t(batch) * kQHeads * kHeadDim), o(std::size_t(batch) * kQHeads * kHeadDim);
  Device<float> lse(std::size_t(batch) * kQHeads);
  fill_random(q.ptr, std::size_t(batch) * kQHeads * kHeadDim, 99);
  Device<std::byte> workspace(stack.front()->step.workspace_bytes());
  const auto qv = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim);
  const auto out = kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, batch, kQHeads, kHeadDim);
  const double seconds = time_calls(state, [&](int i, cudaStream_t stream) {
    auto& layer = *stack[std::size_t(i) % stack.size()];
    layer.step.run({.q = qv, .cache = layer.cache(), .slots = layer.slots.ptr}, out,
                   {workspace.ptr, layer.step.workspace_bytes()}, Cuda{stream});
    if (between) (*between)(i, stream);
  });
  state.SetLabel(method_name(method));
  state.counters["layers"] = layers;
  state.counters["prepare_ms"] = stack.front()->prepare_ms;
  if constexpr (std::is_same_v<Selector, kvsift::Ctkvr<bfloat16, Cuda>>) {
    // The last step's union of the recalled lists over rho * C' (the paper's deduplication coefficient; random
    // keys here, so the lists barely overlap).
    const auto& ctkvr = stack.back()->step.selector();
    std::vector<std::int32_t> unions(std::size_t(batch) * kKvHeads);
    KVSIFT_CUDA_CHECK(cudaMemcpy(unions.data(), ctkvr.last_union_sizes(), unions.size() * sizeof(std::int32_t),
                                 cudaMemcpyDeviceToHost));
    double sum = 0;
    for (const std::int32_t u : unions) sum += u;
    state.counters["union_over_rhoC"] = sum / double(unions.size()) /
                                        (double(ctkvr.config().list_size) * ctkvr.config().recalled_centroids);
  }
  if constexpr (std::is_same_v<Selector, kvsift::Csattention<bfloat16, Cuda>>) {
    // The mean union of a row's chosen lists (its group's heads'), their kept entries: the dense reduction's
    // candidate count with an unbounded budget, once, on the last layer's tables as the timed steps left them.
    const auto& selector = stack.back()->step.selector();
    const auto tables = selector.index_tables();
    const std::int32_t capacity = kQHeads / kKvHeads * selector.config().subspaces * selector.config().probes;
    const std::int64_t rows = std::int64_t(batch) * kKvHeads;
    Device<std::int32_t> chosen(static_cast<std::size_t>(rows * capacity)), counts(static_cast<std::size_t>(rows)),
        row_k(static_cast<std::size_t>(rows));
    Device<float> scores(std::size_t(rows) * std::size_t(n));
    const std::size_t ws_bytes = kvsift::cuda::table_scores_dense_workspace_bytes(rows, kQHeads / kKvHeads, std::int32_t(n));
    Device<std::byte> ws(ws_bytes);
    const kvsift::SelectionView chosen_view{chosen.ptr, counts.ptr, nullptr, batch, kKvHeads, capacity};
    const auto& layer = *stack.back();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the timed steps' stream is done
    kvsift::cuda::nearest_centroids(qv, tables, layer.slots.ptr, selector.config().probes, chosen_view, nullptr,
                                    nullptr);
    kvsift::cuda::table_scores_dense(tables, chosen_view, {}, kQHeads / kKvHeads, layer.slots.ptr, layer.lengths.ptr,
                                     kWindow, {.fraction = 1, .maximum = std::int32_t(n)},
                                     kvsift::MatrixView<float>::packed(scores.ptr, rows, std::int32_t(n)), row_k.ptr,
                                     std::int32_t(n), {ws.ptr, ws_bytes}, nullptr);
    std::vector<std::int32_t> unions(static_cast<std::size_t>(rows));
    KVSIFT_CUDA_CHECK(cudaMemcpy(unions.data(), row_k.ptr, unions.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    double sum = 0;
    for (const std::int32_t u : unions) sum += u;
    state.counters["union"] = sum / double(unions.size());
  }
  double bytes = step_bytes(method, n, batch, state.range(7));
  if constexpr (std::is_same_v<Selector, kvsift::A2ats<bfloat16, Cuda>>) {
    // The last step's selection sizes (in the workspace until the next run), then the bytes with them.
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const kvsift::SelectionView selection =
        stack.front()->step.selection({workspace.ptr, stack.front()->step.workspace_bytes()}, batch);
    std::vector<std::int32_t> counts(std::size_t(batch) * kKvHeads);
    KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), selection.counts, counts.size() * sizeof(std::int32_t),
                                 cudaMemcpyDeviceToHost));
    double selected = 0;
    for (const std::int32_t c : counts) selected += c;
    selected /= double(counts.size());
    state.counters["selected"] = selected;
    state.counters["touched"] = (selected + kWindow.sink + kWindow.recent) / double(n);
    const double rows = double(batch) * kKvHeads;
    bytes = rows * double(n) * 2 + double(kKvHeads) * 4096 * kHeadDim * sizeof(bfloat16) +
            rows * (selected + kWindow.sink + kWindow.recent) * kHeadDim * 2.0 * sizeof(bfloat16);
  }
  if (between) return;  // the pair's time is not the step's: no bandwidth counter
  state.counters["GB/s"] = benchmark::Counter(bytes * double(state.iterations()), benchmark::Counter::kIsRate);
  if (bytes > 0) report_latency_model(state, bytes, seconds);
}

void BM_Step(benchmark::State& state) {
  const std::int64_t n = state.range(1);
  const int batch = int(state.range(2));
  if (state.range(0) == kQuest || state.range(0) == kQuestPages) {
    using Selector = kvsift::Quest<bfloat16, Cuda>;
    run_step_benchmark<Selector>(state, Method(state.range(0)), [&] {
      return Selector(limits(n, batch), {.budget = kBudget, .page_size = kPageSize});
    });
  } else if (state.range(0) == kQuestRerank) {
    using Selector = kvsift::Reranked<kvsift::Quest<bfloat16, Cuda>>;
    run_step_benchmark<Selector>(state, kQuestRerank, [&] {
      return Selector(kvsift::Quest<bfloat16, Cuda>(limits(n, batch),
                                                    {.budget = kRerankFactor * kBudget, .page_size = kPageSize}),
                      {.budget = kBudget});
    });
  } else if (state.range(0) == kOracle) {
    using Selector = kvsift::OracleTopK<bfloat16, Cuda>;
    run_step_benchmark<Selector>(state, kOracle, [&] { return Selector(limits(n, batch), {.budget = kBudget}); });
  } else if (state.range(0) == kCtkvr) {
    using Selector = kvsift::Ctkvr<bfloat16, Cuda>;
    run_step_benchmark<Selector>(state, kCtkvr, [&] {
      return Selector(limits(n, batch),
                      {.budget = kCtkvrBudget, .max_centroids = kCtkvrCentroids, .max_unindexed = kCtkvrMaxUnindexed});
    });
  } else if (state.range(0) == kA2ats) {  // K = 3% per query head; range(6): 0 union, 1 group maximum
    using Selector = kvsift::A2ats<bfloat16, Cuda>;
    run_step_benchmark<Selector>(state, kA2ats, [&] {
      const kvsift::A2atsConfig config{.group_rule = state.range(6) == 0 ? kvsift::A2atsGroupRule::union_of_heads
                                                                         : kvsift::A2atsGroupRule::group_max};
      return Selector(limits(n, batch), config, a2ats_bench_codebooks(kKvHeads, kHeadDim), Cuda{});
    });
  } else {  // CSAttention at its defaults; search period P = range(5), reduce = range(6) (0 dense, 1 sort), alpha
            // range(7) percent (0: the default)
    using Selector = kvsift::Csattention<bfloat16, Cuda>;
    run_step_benchmark<Selector>(state, kCsattention, [&] {
      kvsift::CsattentionConfig config;
      config.search_period = std::int32_t(state.range(5));
      config.reduce = state.range(6) == 0 ? kvsift::CsattentionReduce::dense : kvsift::CsattentionReduce::sort;
      if (state.range(7) > 0) config.list_fraction = double(state.range(7)) / 100;
      return Selector(limits(n, batch), config);
    });
  }
}
BENCHMARK(BM_Step)
    ->ArgsProduct({{kQuest, kOracle}, {32768, 131072}, {1, 8}, {0, 1}, {0}, {1}, {0}, {0}})
    ->ArgsProduct({{kQuest, kOracle}, {8192, 524288, 1048576}, {1, 8}, {1}, {0}, {1}, {0}, {0}})  // the context sweep
    ->ArgsProduct({{kQuestRerank, kQuestPages}, {32768, 131072}, {1, 8}, {1}, {0}, {1}, {0}, {0}})
    ->ArgsProduct({{kQuest}, {32768, 131072}, {1, 8}, {0, 1}, {1}, {1}, {0}, {0}})
    ->ArgsProduct({{kCtkvr}, {32768, 131072}, {1, 8}, {1}, {0}, {1}, {0}, {0}})
    ->ArgsProduct({{kCtkvr, kCsattention}, {8192, 524288, 1048576}, {1}, {1}, {0}, {1}, {0}, {0}})  // the sweep
    ->ArgsProduct({{kA2ats}, {8192, 524288, 1048576}, {1}, {1}, {0}, {1}, {0, 1}, {0}})              // the sweep
    ->ArgsProduct({{kCsattention}, {32768, 131072}, {1, 8}, {1}, {0}, {1, 4, 8}, {0}, {0}})
    ->ArgsProduct({{kCsattention}, {32768, 131072}, {1, 8}, {1}, {0}, {1}, {1}, {0}})
    ->ArgsProduct({{kCsattention}, {131072}, {1, 8}, {0}, {0, 1}, {1}, {0}, {0}})  // PDL off; kernels between
    ->ArgsProduct({{kCsattention}, {131072}, {1, 8}, {1}, {0}, {1}, {0}, {5, 20, 40}})  // the alpha sweep
    ->ArgsProduct({{kA2ats}, {32768, 131072}, {1, 8}, {1}, {0}, {1}, {0, 1}, {0}})
    ->ArgsProduct({{kA2ats}, {65536, 131072}, {2, 4}, {1}, {0}, {1}, {0, 1}, {0}})  // the count select's forms
    ->ArgsProduct({{kA2ats}, {131072}, {1, 8}, {0}, {0, 1}, {1}, {0}, {0}})  // PDL off; kernels between
    ->ArgsProduct({{kQuest, kCtkvr, kCsattention, kQuestRerank}, {131072}, {32}, {1}, {0}, {1}, {0}, {0}})  // batch 32:
    ->ArgsProduct({{kA2ats}, {131072}, {32}, {1}, {0}, {1}, {0, 1}, {0}})  // each step against its byte floor
    ->ArgNames({"method", "N", "batch", "pdl", "between", "P", "sort", "alpha"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

/// The step's kernels one at a time, on the same shapes and data as BM_Step: Quest's append (page bounds of the
/// new token), page scores, top-K of pages, page expansion; OracleTopK's group scores (softmax, max) and top-K
/// of tokens; the sparse attention over window and selection that both end with; and Quest's prepare (the
/// page bounds of every token, once per prefill; target <= 1 ms per layer at 128K), and Quest's selection as the
/// step runs it (select_pages: the three stages back to back, gaps included). Inputs that a step reads
/// cold (page bounds, keys, the selected K/V rows) rotate over layers as in BM_Step; what a step's previous
/// kernel has just written (scores, selections) stays hot, as in the step. Counters, the latency model: MB (the
/// bytes the stage must move, stage_bytes), floor_us (those bytes at the copy bandwidth), x_floor (time / floor)
/// and launches (kernels, memsets and copies per call in the captured graph).
enum Stage : int { kAppend, kPageScores, kPageTopK, kExpand, kGroupScores, kTokenTopK, kAttend, kPrepare, kSelectPages };
const char* stage_name(int s) {
  static const char* names[] = {"quest_append", "quest_page_scores", "quest_topk_pages", "quest_expand_pages",
                                "oracle_group_scores", "oracle_topk_tokens", "sparse_attention", "quest_prepare",
                                "quest_select_pages"};
  return names[s];
}

/// The bytes a stage must move at least (reads and writes of its inputs and outputs, once each; bf16 keys, fp32
/// scores, int32 indices), the latency model's numerator: the floor is these bytes at the copy bandwidth.
double stage_bytes(int stage, std::int64_t n, int batch) {
  const double rows = double(batch) * kKvHeads, key = kHeadDim * 2.0, pages = double((n + kPageSize - 1) / kPageSize);
  const double page_k = kBudget / kPageSize, query = double(batch) * kQHeads * key;
  const double page_scores = rows * pages * (2 * key) + query + rows * pages * 4;
  const double page_topk = rows * pages * 4 + rows * page_k * 4;
  const double expand = rows * page_k * 4 + rows * kBudget * 4;
  switch (stage) {
    case kAppend: return rows * (key + 2 * (2 * key));  // the new key; its page's bounds read and written
    case kPageScores: return page_scores;
    case kPageTopK: return page_topk;
    case kExpand: return expand;
    case kGroupScores: return rows * n * key + query + 2 * double(batch) * kQHeads * n * 4 + rows * n * 4;  // logits out and in
    case kTokenTopK: return rows * n * 4 + rows * kBudget * 4;
    case kAttend:
      return rows * (kBudget + kWindow.sink + kWindow.recent) * 2 * key + rows * kBudget * 4 + 2 * query;
    case kPrepare: return rows * n * key + rows * pages * 2 * key;
    case kSelectPages: return page_scores + page_topk + expand;
  }
  return 0;
}

struct StageLayer {
  std::int64_t n;
  int batch;
  Device<bfloat16> k, v, bounds;
  Device<std::int32_t> lengths, slots;
  StageLayer(std::int64_t n_, int batch_, std::uint64_t seed)
      : n(n_), batch(batch_), k(elements()), v(elements()), bounds(bounds_elements()),
        lengths(batch_), slots(batch_) {
    fill_random(k.ptr, elements(), seed);
    fill_random(v.ptr, elements(), seed + 1);
    upload_full_batch(n, batch, lengths.ptr, slots.ptr);
    kvsift::cuda::build_page_bounds(cache().contiguous, slots.ptr, bounds_view(), nullptr);
  }
  std::size_t elements() const { return std::size_t(batch) * kKvHeads * std::size_t(n) * kHeadDim; }
  std::int32_t pages() const { return std::int32_t((n + kPageSize - 1) / kPageSize); }
  std::size_t bounds_elements() const { return std::size_t(batch) * kKvHeads * std::size_t(pages()) * 2 * kHeadDim; }
  kvsift::PageBoundsView<bfloat16> bounds_view_of(bfloat16* data) const {
    return {data, batch, kKvHeads, pages(), kHeadDim, kPageSize};
  }
  kvsift::PageBoundsView<bfloat16> bounds_view() const { return bounds_view_of(bounds.ptr); }
  kvsift::KVCache<const bfloat16> cache() const {
    return kvsift::ContiguousKVView<const bfloat16>::packed(k.ptr, v.ptr, batch, kKvHeads, std::int32_t(n), kHeadDim,
                                                            lengths.ptr);
  }
};

void BM_StepStage(benchmark::State& state) {
  const int stage = int(state.range(0));
  const std::int64_t n = state.range(1);
  const int batch = int(state.range(2));
  const bool quest = stage <= kExpand || stage == kPrepare || stage == kSelectPages;
  const int layers = layers_for(quest ? kQuest : kOracle, n, batch, 0);
  std::vector<std::unique_ptr<StageLayer>> stack;
  for (int l = 0; l < layers; ++l) stack.push_back(std::make_unique<StageLayer>(n, batch, 31 * l + 5));
  const std::int64_t rows = std::int64_t(batch) * kKvHeads;
  const std::int32_t pages = stack.front()->pages(), page_k = kBudget / kPageSize;
  Device<bfloat16> q(std::size_t(batch) * kQHeads * kHeadDim), o(std::size_t(batch) * kQHeads * kHeadDim);
  Device<float> lse(std::size_t(batch) * kQHeads), page_scores(std::size_t(rows) * pages), scores(std::size_t(rows) * n);
  Device<std::int32_t> page_counts(batch), page_idx(std::size_t(rows) * page_k), page_picks(rows),
      token_idx(std::size_t(rows) * kBudget), token_counts(rows);
  fill_random(q.ptr, std::size_t(batch) * kQHeads * kHeadDim, 99);
  const auto qv = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim);
  const kvsift::SelectionView page_sel{page_idx.ptr, page_picks.ptr, nullptr, batch, kKvHeads, page_k};
  const kvsift::SelectionView token_sel{token_idx.ptr, token_counts.ptr, nullptr, batch, kKvHeads, kBudget};
  const kvsift::GroupScoreOptions softmax{.reduce = kvsift::GroupReduce::max, .softmax = true};
  const std::size_t ws_bytes = std::max(
      {kvsift::cuda::topk_rows_workspace_bytes(rows, std::int32_t(n), kBudget, {.window = kWindow}),
       kvsift::cuda::topk_rows_workspace_bytes(rows, pages, page_k, {}),
       kvsift::select_pages_workspace_bytes(batch, kKvHeads, pages, page_k, Cuda{}),
       kvsift::cuda::group_scores_workspace_bytes(batch, kQHeads, kKvHeads, std::int32_t(n), softmax),
       kvsift::cuda::sparse_decode_workspace_bytes(
           kvsift::cuda::SparseDecodeShape{batch, kQHeads, kKvHeads, kHeadDim, kBudget},
           {.attention = {.window = kWindow}}),
       std::size_t(256)});
  Device<std::byte> ws(ws_bytes);
  const std::span<std::byte> workspace(ws.ptr, ws_bytes);
  const auto page_matrix = kvsift::MatrixView<float>::packed(page_scores.ptr, rows, pages);
  const auto score_matrix = kvsift::MatrixView<float>::packed(scores.ptr, rows, std::int32_t(n));
  const auto out = kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, batch, kQHeads, kHeadDim);
  const auto run_stage = [&](int which, const StageLayer& layer, cudaStream_t stream) {
    switch (which) {
      case kAppend:
        kvsift::cuda::append_page_bounds(layer.cache().contiguous, layer.slots.ptr, layer.bounds_view(), stream);
        break;
      case kPageScores:
        kvsift::cuda::page_scores(qv, layer.bounds_view().as_const(), layer.slots.ptr, layer.lengths.ptr, kWindow,
                                  page_matrix, page_counts.ptr, stream);
        break;
      case kPageTopK:
        kvsift::cuda::topk_rows(kvsift::MatrixView<const float>::packed(page_scores.ptr, rows, pages), page_counts.ptr, page_k, {}, page_sel, workspace, stream);
        break;
      case kExpand:
        kvsift::cuda::expand_pages(page_sel, kPageSize, layer.lengths.ptr, kWindow, token_sel, stream);
        break;
      case kGroupScores:
        layer.cache().visit([&](const auto& kv) { kvsift::cuda::group_scores(qv, kv, score_matrix, softmax, workspace, stream); });
        break;
      case kTokenTopK:
        kvsift::cuda::topk_rows(kvsift::MatrixView<const float>::packed(scores.ptr, rows, std::int32_t(n)), layer.lengths.ptr, kBudget, {.window = kWindow}, token_sel, workspace,
                                stream);
        break;
      case kSelectPages:
        kvsift::select_pages(qv, layer.bounds_view().as_const(), layer.slots.ptr, layer.lengths.ptr, kWindow, pages, page_k,
                             kvsift::PagesOut::tokens, token_sel, workspace, Cuda{stream});
        break;
      case kPrepare:  // Quest's prefill: the page bounds of the whole sequence
        kvsift::cuda::build_page_bounds(layer.cache().contiguous, layer.slots.ptr, layer.bounds_view(), stream);
        break;
      case kAttend:
        layer.cache().visit([&](const auto& kv) {
          kvsift::cuda::sparse_decode(qv, kv, token_sel, out, workspace, stream, {.attention = {.window = kWindow}});
        });
        break;
    }
  };
  // A real selection for the later stages: Quest's whole chain once.
  for (int which : {kPageScores, kPageTopK, kExpand}) run_stage(which, *stack.front(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const double seconds =
      time_calls(state, [&](int i, cudaStream_t stream) { run_stage(stage, *stack[std::size_t(i) % stack.size()], stream); });
  report_latency_model(state, stage_bytes(stage, n, batch), seconds);
  state.SetLabel(stage_name(stage));
  state.counters["layers"] = layers;
}
BENCHMARK(BM_StepStage)
    ->ArgsProduct({{kAppend, kPageScores, kPageTopK, kExpand, kGroupScores, kTokenTopK, kAttend, kPrepare, kSelectPages},
                   {32768, 131072}, {1, 8}})
    ->ArgNames({"stage", "N", "batch"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

/// Ctkvr::prepare of one sequence's layer at the paper's defaults (C = min(2048, N / 16) centroids, rho = 2560
/// over N keys): prepare_chunk centroids scored per pass (group_scores with softmax and max over the group over
/// the sequence broadcast to the chunk, then topk_rows of the chunk's rows). Host wall clock of prepare and a
/// synchronization; the target is 25 ms at 128K.
void BM_CtkvrPrepare(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const int chunk = int(state.range(1));
  const std::size_t elements = std::size_t(kKvHeads) * std::size_t(n) * kHeadDim;
  Device<bfloat16> k(elements), v(elements);
  Device<std::int32_t> lengths(1), slots(1);
  fill_random(k.ptr, elements, 1);
  fill_random(v.ptr, elements, 2);
  upload_full_batch(n, 1, lengths.ptr, slots.ptr);
  const std::int32_t w = std::min<std::int32_t>(kCtkvrCentroids, std::int32_t(n / 16));
  Device<bfloat16> queries(std::size_t(kQHeads) * w * kHeadDim);
  fill_random(queries.ptr, std::size_t(kQHeads) * w * kHeadDim, 3);
  kvsift::Ctkvr<bfloat16, Cuda> selector(limits(n, 1), {.budget = kCtkvrBudget, .max_centroids = kCtkvrCentroids,
                                                        .prepare_chunk = chunk});
  const kvsift::PrefillInputs<bfloat16> in{
      .cache = kvsift::ContiguousKVView<const bfloat16>::packed(k.ptr, v.ptr, 1, kKvHeads, std::int32_t(n), kHeadDim,
                                                                lengths.ptr),
      .slots = slots.ptr,
      .queries = kvsift::SequenceView<const bfloat16>::packed(queries.ptr, 1, kQHeads, w, kHeadDim),
      .attention = {.window = kWindow}};
  for (auto _ : state) {
    const auto begin = std::chrono::steady_clock::now();
    selector.prepare(in, Cuda{});
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  state.SetLabel("CTKVR prepare");
}
BENCHMARK(BM_CtkvrPrepare)
    ->ArgsProduct({{32768, 131072}, {32, 128, 512}})
    ->ArgNames({"N", "chunk"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(2);

/// Csattention::prepare of one sequence's layer at its defaults (m = 8, C = 128, alpha = 0.2, tables per kv head,
/// 10 Lloyd steps over W = 1024 prefill queries of each group's 4 heads): per kv head the batched k-means of its 8
/// subspaces, then per chunk of lists the partial scores over the N keys and their top L. Host wall clock of
/// prepare and a synchronization; the target is 25 ms at 128K.
void BM_CsattentionPrepare(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const int chunk = int(state.range(1));
  const std::size_t elements = std::size_t(kKvHeads) * std::size_t(n) * kHeadDim;
  Device<bfloat16> k(elements), v(elements);
  Device<std::int32_t> lengths(1), slots(1);
  fill_random(k.ptr, elements, 1);
  fill_random(v.ptr, elements, 2);
  upload_full_batch(n, 1, lengths.ptr, slots.ptr);
  Device<bfloat16> queries(std::size_t(kQHeads) * kCsattentionQueries * kHeadDim);
  fill_random(queries.ptr, std::size_t(kQHeads) * kCsattentionQueries * kHeadDim, 3);
  kvsift::CsattentionConfig config;
  config.prepare_chunk = chunk;
  kvsift::Csattention<bfloat16, Cuda> selector(limits(n, 1), config);
  const kvsift::PrefillInputs<bfloat16> in{
      .cache = kvsift::ContiguousKVView<const bfloat16>::packed(k.ptr, v.ptr, 1, kKvHeads, std::int32_t(n), kHeadDim,
                                                                lengths.ptr),
      .slots = slots.ptr,
      .queries = kvsift::SequenceView<const bfloat16>::packed(queries.ptr, 1, kQHeads, kCsattentionQueries, kHeadDim),
      .attention = {.window = kWindow}};
  for (auto _ : state) {
    const auto begin = std::chrono::steady_clock::now();
    selector.prepare(in, Cuda{});
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  state.SetLabel("CSAttention prepare");
  state.counters["index_MB"] = double(selector.index_bytes().device) / 1e6;
}
BENCHMARK(BM_CsattentionPrepare)
    ->ArgsProduct({{32768, 131072}, {128, 1024}})
    ->ArgNames({"N", "chunk"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(2);

/// A2ats::prepare of one sequence's layer: the code of each of the N keys of the 8 kv heads (4096 codewords, d 128),
/// from the engine's pre-RoPE keys (pre:1) or from the post-RoPE cache rotated back (pre:0). Host wall clock of
/// prepare and a synchronization; the target is 5 ms at 128K.
void BM_A2atsPrepare(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const bool pre_rope = state.range(1) != 0;
  const std::size_t elements = std::size_t(kKvHeads) * std::size_t(n) * kHeadDim;
  Device<bfloat16> k(elements), v(elements), k_pre(pre_rope ? elements : 0);
  Device<std::int32_t> lengths(1), slots(1);
  fill_random(k.ptr, elements, 1);
  fill_random(v.ptr, elements, 2);
  if (pre_rope) fill_random(k_pre.ptr, elements, 3);
  upload_full_batch(n, 1, lengths.ptr, slots.ptr);
  kvsift::A2ats<bfloat16, Cuda> selector(limits(n, 1), {}, a2ats_bench_codebooks(kKvHeads, kHeadDim), Cuda{});
  kvsift::PrefillInputs<bfloat16> in{
      .cache = kvsift::ContiguousKVView<const bfloat16>::packed(k.ptr, v.ptr, 1, kKvHeads, std::int32_t(n), kHeadDim,
                                                                lengths.ptr),
      .slots = slots.ptr,
      .attention = {.window = kWindow}};
  if (pre_rope) {  // [batch, kv_heads, n, d]: the cache's layout
    in.k_pre_rope = kvsift::SequenceView<const bfloat16>::packed(k_pre.ptr, 1, kKvHeads, std::int32_t(n), kHeadDim);
  }
  for (auto _ : state) {
    const auto begin = std::chrono::steady_clock::now();
    selector.prepare(in, Cuda{});
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  state.SetLabel("A2ATS prepare");
  const kvsift::A2atsIndexBytes parts = selector.index_parts();
  state.counters["codes_MB"] = double(parts.codes) / 1e6;
  state.counters["codebooks_MB"] = double(parts.codebooks) / 1e6;
  state.counters["rope_table_MB"] = double(parts.rope_table) / 1e6;
}
BENCHMARK(BM_A2atsPrepare)
    ->ArgsProduct({{32768, 131072}, {0, 1}})
    ->ArgNames({"N", "pre"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);

/// CTKVR in the paper's hybrid placement (DecodeStep<Ctkvr<T, cuda::Context>, placement::MiddleOnCpu>, its host
/// stage): index and recall on the GPU, rerank and the selection's attention on `threads` host threads over a
/// pinned host copy of the cache, the window (4 + 64) on the GPU, merged there. One layer (the host cache is the
/// point, not L2), every sequence N tokens long. Time: host wall clock of run() and a stream synchronization.
/// Counters (µs per step, host clock): select_us, the recall as the host waits for its candidates plus the CPU's
/// rerank and the update's enqueue; cpu_attention_us, the CPU's attention; merge_us, the rest (the window's attention
/// runs beside the CPU's).
void BM_CtkvrHybrid(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const int batch = int(state.range(1)), threads = int(state.range(2));
  const std::size_t elements = std::size_t(batch) * kKvHeads * std::size_t(n) * kHeadDim;
  Device<bfloat16> k(elements), v(elements), q(std::size_t(batch) * kQHeads * kHeadDim), o(std::size_t(batch) * kQHeads * kHeadDim);
  Device<float> lse(std::size_t(batch) * kQHeads);
  Device<std::int32_t> lengths(batch), slots(batch);
  fill_random(k.ptr, elements, 1);
  fill_random(v.ptr, elements, 2);
  fill_random(q.ptr, std::size_t(batch) * kQHeads * kHeadDim, 99);
  upload_full_batch(n, batch, lengths.ptr, slots.ptr);
  kvsift::cuda::PinnedArray<bfloat16> host_k(elements), host_v(elements);
  KVSIFT_CUDA_CHECK(cudaMemcpy(host_k.data(), k.ptr, elements * sizeof(bfloat16), cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(host_v.data(), v.ptr, elements * sizeof(bfloat16), cudaMemcpyDeviceToHost));
  const std::vector<std::int32_t> host_lengths(static_cast<std::size_t>(batch), static_cast<std::int32_t>(n));

  kvsift::cpu::ThreadPool pool(threads);
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const kvsift::SplitContext split{.gpu = {stream}, .cpu = {&pool}};
  using Selector = kvsift::Ctkvr<bfloat16, Cuda>;
  kvsift::DecodeStep<Selector, kvsift::placement::MiddleOnCpu> step(
      Selector(limits(n, batch), {.budget = kCtkvrBudget, .max_centroids = kCtkvrCentroids}),
      {.attention = {.window = kWindow}, .max_batch = batch, .q_heads = kQHeads, .kv_heads = kKvHeads,
       .head_dim = kHeadDim, .max_seq_len = std::int32_t(n)},
      split);
  SplitBlocks blocks(step.workspace_bytes());
  const auto device_cache =
      kvsift::ContiguousKVView<bfloat16>::packed(k.ptr, v.ptr, batch, kKvHeads, std::int32_t(n), kHeadDim, lengths.ptr);
  const std::int32_t w = std::min<std::int32_t>(kCtkvrCentroids, std::int32_t(n / 16));
  Device<bfloat16> queries(std::size_t(batch) * kQHeads * w * kHeadDim);
  fill_random(queries.ptr, std::size_t(batch) * kQHeads * w * kHeadDim, 3);
  step.prepare({.cache = device_cache, .slots = slots.ptr,
                .queries = kvsift::SequenceView<const bfloat16>::packed(queries.ptr, batch, kQHeads, w, kHeadDim)},
               Cuda{stream});
  const kvsift::StepInputs<bfloat16> in{
      .q = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim),
      .cache = device_cache,
      .slots = slots.ptr,
      .host_cache = kvsift::ContiguousKVView<const bfloat16>::packed(host_k.data(), host_v.data(), batch, kKvHeads,
                                                                     std::int32_t(n), kHeadDim, host_lengths.data())};
  const auto out = kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, batch, kQHeads, kHeadDim);
  for (int i = 0; i < 2; ++i) step.run(in, out, blocks.view(), split);  // warm-up
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  double select = 0, cpu_attention = 0, wall = 0;
  for (auto _ : state) {
    const auto begin = std::chrono::steady_clock::now();
    step.run(in, out, blocks.view(), split);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    state.SetIterationTime(seconds);
    wall += seconds;
    select += step.last_step_stats().select_seconds;
    cpu_attention += step.last_step_stats().cpu_attention_seconds;
  }
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  const double per_step = 1e6 / double(std::max<std::int64_t>(1, state.iterations()));
  state.counters["select_us"] = select * per_step;
  state.counters["cpu_attention_us"] = cpu_attention * per_step;
  state.counters["merge_us"] = (wall - select - cpu_attention) * per_step;
  state.SetLabel("CTKVR hybrid");
}
BENCHMARK(BM_CtkvrHybrid)
    ->ArgsProduct({{32768, 131072}, {1, 8}, {4, 16}})
    ->ArgNames({"N", "batch", "threads"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.2);

}  // namespace
