// CPU benchmarks: a STREAM-style triad (this machine's memory bandwidth, bytes read + written) and CPU sparse
// decode over a 128K-token host cache (q_heads 32, kv_heads 8, head_dim 128) for K in {1024, 4096, 16384},
// bf16 and fp16, 1..all threads, at the detected SIMD level and at scalar, over random selections (and, at
// K = 16384, clustered ones) that rotate between calls, and with the rows in cache (the compute ceiling).
// GB/s counts bytes touched: the selected K and V rows, indices, Q and O. The selection primitives
// (cpu::group_scores, cpu::topk_rows, and the two as one selection step) over 32K and 128K tokens of the same
// cache, K = 2048, on 1 thread and all.
#include <benchmark/benchmark.h>

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <random>
#include <thread>
#include <vector>

#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/decode.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/topk.hpp"
#include "kvsift/selectors/a2ats/cpu/vq.hpp"
#include "kvsift/cpu/simd.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace {

using namespace kvsift;

void BM_StreamTriad(benchmark::State& state) {
  const int threads = int(state.range(0));
  const std::size_t n = std::size_t(1) << 26;  // 3 x 256 MiB, far past the caches
  std::vector<float> a(n, 1.0f), b(n, 2.0f), c(n, 3.0f);
  cpu::ThreadPool pool(threads);
  for (auto _ : state) {
    pool.parallel_for(std::int64_t(n), [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) a[i] = b[i] + 3.0f * c[i];
    });
    benchmark::DoNotOptimize(a.data());
  }
  state.counters["GB/s"] = benchmark::Counter(3.0 * n * sizeof(float) * state.iterations(), benchmark::Counter::kIsRate);
}

/// A never-freed array of random values, backed by transparent huge pages where the kernel allows.
template <class T>
T* huge_page_array(std::size_t count, std::uint64_t seed) {
  constexpr std::size_t kHugePage = std::size_t(2) << 20;
  const std::size_t bytes = (count * sizeof(T) + kHugePage - 1) / kHugePage * kHugePage;
  T* data = static_cast<T*>(std::aligned_alloc(kHugePage, bytes));
  madvise(data, bytes, MADV_HUGEPAGE);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist;
  for (std::size_t i = 0; i < count; ++i) data[i] = from_float<T>(dist(rng));
  return data;
}

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kTokens = 131072;

/// The host cache (2 x 256 MiB per dtype, shared by all runs) on transparent huge pages, as an engine's
/// offloaded KV would be: with 4 KiB pages nearly every gathered row is also a TLB miss.
template <class T>
std::pair<const T*, const T*> host_cache() {
  static const std::size_t elems = std::size_t(kKvHeads) * kTokens * kHeadDim;
  static const T* k_cache = huge_page_array<T>(elems, 1);
  static const T* v_cache = huge_page_array<T>(elems, 2);
  return {k_cache, v_cache};
}

/// k_sel distinct tokens per kv head, each row sorted (as selectors hand them over): uniform over the context,
/// or clustered in runs of 32 consecutive tokens (as cluster- and page-based selectors return them).
std::vector<std::int32_t> make_selection(int k_sel, bool clustered, std::mt19937_64& rng) {
  constexpr int kRun = 32;
  const int units = clustered ? kTokens / kRun : kTokens, picks = clustered ? (k_sel + kRun - 1) / kRun : k_sel;
  std::vector<std::int32_t> pool(units), indices(std::size_t(kKvHeads) * k_sel);
  std::iota(pool.begin(), pool.end(), 0);
  for (int h = 0; h < kKvHeads; ++h) {
    for (int i = 0; i < picks; ++i) std::swap(pool[i], pool[i + rng() % (units - i)]);
    std::sort(pool.begin(), pool.begin() + picks);
    std::int32_t* row = indices.data() + std::size_t(h) * k_sel;
    for (int i = 0; i < k_sel; ++i) row[i] = clustered ? pool[i / kRun] * kRun + i % kRun : pool[i];
  }
  return indices;
}

/// Four selections that calls take in turn, so that consecutive calls gather different rows: at K = 16384
/// the four cover ~40% of the 512 MiB cache, more than any last-level cache holds.
class RotatingSelections {
 public:
  RotatingSelections(int k_sel, bool clustered, std::mt19937_64& rng) {
    for (auto& set : sets_) set = make_selection(k_sel, clustered, rng);
  }
  std::int32_t* next() { return sets_[calls_++ % sets_.size()].data(); }

 private:
  std::array<std::vector<std::int32_t>, 4> sets_;
  std::size_t calls_ = 0;
};

/// Bytes one batch-1 decode call touches with k_sel rows per kv head: K and V rows, indices, Q and O.
template <class T>
double decode_bytes_touched(int k_sel) {
  return (2.0 * kHeadDim * sizeof(T) + 4.0) * kKvHeads * k_sel + 2.0 * kQHeads * kHeadDim * sizeof(T);
}

template <class T>
void BM_CpuSparseDecode(benchmark::State& state) {
  const int k_sel = int(state.range(0)), threads = int(state.range(1));
  const bool scalar = state.range(2) != 0, clustered = state.range(3) != 0;
  const auto [k_cache, v_cache] = host_cache<T>();
  std::mt19937_64 rng(2);
  std::vector<T> q(kQHeads * kHeadDim), o(q.size());
  for (auto& x : q) x = from_float<T>(std::normal_distribution<float>()(rng));
  std::vector<float> lse(kQHeads);
  RotatingSelections selections(k_sel, clustered, rng);
  std::vector<std::int32_t> counts(kKvHeads, k_sel);
  const auto kv = ContiguousKVView<const T>::packed(k_cache, v_cache, 1, kKvHeads, kTokens, kHeadDim);
  const auto out = StateView<T>::packed(o.data(), lse.data(), 1, kQHeads, kHeadDim);
  cpu::ThreadPool pool(threads);
  // The workspace lets the 8 rows (batch 1 x 8 kv heads) split over more than 8 threads.
  const std::size_t ws_bytes = cpu::decode_workspace_bytes(1, kQHeads, kKvHeads, kHeadDim, &pool);
  constexpr std::size_t kAlign = WorkspaceLayout::kAlignment;  // aligned_alloc wants a nonzero multiple of it
  std::byte* workspace = static_cast<std::byte*>(std::aligned_alloc(kAlign, (ws_bytes / kAlign + 1) * kAlign));
  std::optional<cpu::ScopedSimdLevel> force;
  if (scalar) force.emplace(cpu::SimdLevel::scalar);
  for (auto _ : state) {
    const SelectionView sel{selections.next(), counts.data(), nullptr, 1, kKvHeads, k_sel};
    cpu::sparse_decode(QueryView<const T>::packed(q.data(), 1, kQHeads, kHeadDim), kv, sel, out, {}, &pool,
                       {workspace, ws_bytes});
    benchmark::DoNotOptimize(o.data());
  }
  state.counters["GB/s"] =
      benchmark::Counter(decode_bytes_touched<T>(k_sel) * state.iterations(), benchmark::Counter::kIsRate);
  state.SetLabel(std::string(cpu::simd_level_name(cpu::active_simd_level())));
  std::free(workspace);
}

/// The kernel's compute ceiling on one thread: 256 rows per kv head, scattered over its first 512 tokens (1 MiB
/// of K and V on few pages), the same selection every call, so that rows come from the caches. Against it,
/// the sparse decode figures above say how much of a thread's time goes to misses.
template <class T>
void BM_CpuDecodeInCache(benchmark::State& state) {
  constexpr int kRows = 256, kSpan = 512;  // kSpan and the stride 37 are coprime: distinct tokens
  const auto [k_cache, v_cache] = host_cache<T>();
  std::mt19937_64 rng(3);
  std::vector<T> q(kQHeads * kHeadDim), o(q.size());
  for (auto& x : q) x = from_float<T>(std::normal_distribution<float>()(rng));
  std::vector<float> lse(kQHeads);
  std::vector<std::int32_t> indices(std::size_t(kKvHeads) * kRows), counts(kKvHeads, kRows);
  for (std::size_t i = 0; i < indices.size(); ++i) indices[i] = std::int32_t(i % kRows * 37 % kSpan);
  const auto kv = ContiguousKVView<const T>::packed(k_cache, v_cache, 1, kKvHeads, kTokens, kHeadDim);
  const SelectionView sel{indices.data(), counts.data(), nullptr, 1, kKvHeads, kRows};
  const auto out = StateView<T>::packed(o.data(), lse.data(), 1, kQHeads, kHeadDim);
  for (auto _ : state) {
    cpu::sparse_decode(QueryView<const T>::packed(q.data(), 1, kQHeads, kHeadDim), kv, sel, out);
    benchmark::DoNotOptimize(o.data());
  }
  state.counters["GB/s"] =
      benchmark::Counter(decode_bytes_touched<T>(kRows) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["ns/row"] = benchmark::Counter(double(kKvHeads) * kRows * state.iterations(),
                                                benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.SetLabel(std::string(cpu::simd_level_name(cpu::active_simd_level())));
}
BENCHMARK(BM_CpuDecodeInCache<bfloat16>)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CpuDecodeInCache<half>)->Unit(benchmark::kMicrosecond);

/// MiB of this process's memory on transparent huge pages (/proc/self/smaps_rollup), -1 if unknown: says
/// whether the kernel granted the huge pages the host cache asks for.
double anon_huge_page_mib() {
  std::ifstream smaps("/proc/self/smaps_rollup");
  for (std::string line; std::getline(smaps, line);) {
    if (line.rfind("AnonHugePages:", 0) == 0) return std::stod(line.substr(14)) / 1024.0;
  }
  return -1.0;
}

/// The ceiling for gathering scattered rows on this host: the same K and V rows as BM_CpuSparseDecode (bf16,
/// K = 16384 per kv head, random, the same rotating sets), one 8-byte load per 64-byte line and no
/// arithmetic, prefetched kPrefetch tokens ahead into L2 as the decode kernel does, the (kv head, token)
/// pairs spread evenly over all threads.
void BM_GatherProbe(benchmark::State& state) {
  const int k_sel = 16384, threads = int(state.range(0));
  constexpr int kPrefetch = 16, kRowBytes = kHeadDim * 2;
  const auto [k_cache, v_cache] = host_cache<bfloat16>();
  std::mt19937_64 rng(2);
  RotatingSelections selections(k_sel, false, rng);
  cpu::ThreadPool pool(threads);
  std::vector<std::uint64_t> sums(threads * 8);
  const std::int32_t* indices = nullptr;
  const auto row_of = [&](const bfloat16* cache, std::int64_t i) {
    return reinterpret_cast<const char*>(cache + ((i / k_sel) * kTokens + indices[i]) * kHeadDim);
  };
  const std::int64_t total = std::int64_t(kKvHeads) * k_sel;
  for (auto _ : state) {
    indices = selections.next();
    pool.parallel_for(total, [&](std::int64_t begin, std::int64_t end) {
      std::uint64_t sum = 0;
      for (std::int64_t i = begin; i < end; ++i) {
        if (i + kPrefetch < end) {
          for (int line = 0; line < kRowBytes; line += 64) {
            __builtin_prefetch(row_of(k_cache, i + kPrefetch) + line, 0, 2);
            __builtin_prefetch(row_of(v_cache, i + kPrefetch) + line, 0, 2);
          }
        }
        for (int line = 0; line < kRowBytes; line += 64) {
          sum += *reinterpret_cast<const std::uint64_t*>(row_of(k_cache, i) + line);
          sum += *reinterpret_cast<const std::uint64_t*>(row_of(v_cache, i) + line);
        }
      }
      sums[(begin * threads / total) * 8] = sum;
    });
    benchmark::DoNotOptimize(sums.data());
  }
  state.counters["GB/s"] =
      benchmark::Counter(2.0 * total * kRowBytes * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["thp_MiB"] = anon_huge_page_mib();
}

constexpr std::int32_t kSelectK = 2048;

/// Workspace buffers for the selection benchmarks: 256-byte aligned, never freed (one per shape).
std::span<std::byte> aligned_workspace(std::size_t bytes) {
  constexpr std::size_t kAlign = WorkspaceLayout::kAlignment;  // aligned_alloc wants a nonzero multiple of it
  return {static_cast<std::byte*>(std::aligned_alloc(kAlign, (bytes / kAlign + 1) * kAlign)), bytes};
}

/// cpu::group_scores of the batch-1 decode query (32 query heads, 8 kv heads, head_dim 128, bf16) against the
/// first `tokens` tokens of the host cache: raw logits or softmax weights, reduced by max over each group.
/// GB/s counts the K rows read (V is never read) and the scores written.
void BM_CpuGroupScores(benchmark::State& state) {
  const std::int32_t tokens = std::int32_t(state.range(0)), threads = std::int32_t(state.range(1));
  const bool softmax = state.range(2) != 0;
  const auto [k_cache, v_cache] = host_cache<bfloat16>();
  std::mt19937_64 rng(5);
  std::vector<bfloat16> q(kQHeads * kHeadDim);
  for (auto& x : q) x = from_float<bfloat16>(std::normal_distribution<float>()(rng));
  const std::int32_t lengths[1] = {tokens};
  const auto kv = ContiguousKVView<const bfloat16>::packed(k_cache, v_cache, 1, kKvHeads, kTokens, kHeadDim, lengths);
  std::vector<float> scores(std::size_t(kKvHeads) * tokens);
  const GroupScoreOptions options{.reduce = GroupReduce::max, .softmax = softmax};
  const auto workspace = aligned_workspace(cpu::group_scores_workspace_bytes(1, kQHeads, kKvHeads, tokens, options));
  cpu::ThreadPool pool(threads);
  for (auto _ : state) {
    cpu::group_scores(QueryView<const bfloat16>::packed(q.data(), 1, kQHeads, kHeadDim), kv,
                      MatrixView<float>::packed(scores.data(), kKvHeads, tokens), options, workspace, &pool);
    benchmark::DoNotOptimize(scores.data());
  }
  state.counters["GB/s"] = benchmark::Counter(double(kKvHeads) * tokens * (kHeadDim * 2 + 4) * state.iterations(),
                                              benchmark::Counter::kIsRate);
  state.SetLabel(std::string(cpu::simd_level_name(cpu::active_simd_level())));
}

/// cpu::topk_rows: the 2048 best of each of 8 rows of `tokens` normal scores (batch 1 x 8 kv heads), with no
/// window.
void BM_CpuTopKRows(benchmark::State& state) {
  const std::int32_t tokens = std::int32_t(state.range(0)), threads = std::int32_t(state.range(1));
  std::mt19937_64 rng(6);
  std::normal_distribution<float> dist;
  std::vector<float> scores(std::size_t(kKvHeads) * tokens);
  for (auto& x : scores) x = dist(rng);
  std::vector<std::int32_t> indices(std::size_t(kKvHeads) * kSelectK), counts(kKvHeads);
  const SelectionView out{indices.data(), counts.data(), nullptr, 1, kKvHeads, kSelectK};
  cpu::ThreadPool pool(threads);
  const auto workspace = aligned_workspace(cpu::topk_rows_workspace_bytes(kKvHeads, tokens, kSelectK, {}, &pool));
  const std::int32_t lengths[1] = {tokens};
  for (auto _ : state) {
    cpu::topk_rows(MatrixView<const float>::packed(scores.data(), kKvHeads, tokens), lengths, kSelectK, {}, out,
                   workspace, &pool);
    benchmark::DoNotOptimize(indices.data());
  }
}

/// One exact selection step as OracleTopK takes it: group_scores (softmax, max) then topk_rows of 2048 per kv
/// head among the middle of a 4-sink, 64-recent window, one workspace for both.
void BM_CpuSelectStep(benchmark::State& state) {
  const std::int32_t tokens = std::int32_t(state.range(0)), threads = std::int32_t(state.range(1));
  const auto [k_cache, v_cache] = host_cache<bfloat16>();
  std::mt19937_64 rng(7);
  std::vector<bfloat16> q(kQHeads * kHeadDim);
  for (auto& x : q) x = from_float<bfloat16>(std::normal_distribution<float>()(rng));
  const std::int32_t lengths[1] = {tokens};
  const auto kv = ContiguousKVView<const bfloat16>::packed(k_cache, v_cache, 1, kKvHeads, kTokens, kHeadDim, lengths);
  std::vector<float> scores(std::size_t(kKvHeads) * tokens);
  std::vector<std::int32_t> indices(std::size_t(kKvHeads) * kSelectK), counts(kKvHeads);
  const SelectionView out{indices.data(), counts.data(), nullptr, 1, kKvHeads, kSelectK};
  const GroupScoreOptions options{.reduce = GroupReduce::max, .softmax = true};
  cpu::ThreadPool pool(threads);
  const auto workspace = aligned_workspace(std::max(cpu::group_scores_workspace_bytes(1, kQHeads, kKvHeads, tokens, options),
                                                    cpu::topk_rows_workspace_bytes(kKvHeads, tokens, kSelectK, {.window = {4, 64}}, &pool)));
  for (auto _ : state) {
    cpu::group_scores(QueryView<const bfloat16>::packed(q.data(), 1, kQHeads, kHeadDim), kv,
                      MatrixView<float>::packed(scores.data(), kKvHeads, tokens), options, workspace, &pool);
    cpu::topk_rows(MatrixView<const float>::packed(scores.data(), kKvHeads, tokens), lengths, kSelectK, {.window = {4, 64}}, out,
                   workspace, &pool);
    benchmark::DoNotOptimize(indices.data());
  }
  state.SetLabel(std::string(cpu::simd_level_name(cpu::active_simd_level())));
}

/// A²ATS's selection on the CPU, union rule (q 32 / kv 8 heads, head_dim 128, 4096 random codewords, uniform codes,
/// K 3% per query head, a 4-sink, 64-recent window): composed 1, vq_lut_scan's scores then topk_rows (the form
/// before vq_topk_rows); 0, vq_topk_rows (a count per code, thresholds from the codewords, one walk).
void BM_CpuVqTopKRows(benchmark::State& state) {
  const std::int32_t tokens = std::int32_t(state.range(0)), threads = std::int32_t(state.range(1));
  const bool composed = state.range(2) != 0;
  constexpr std::int32_t kCodewords = 4096;
  const std::int32_t k = tokens * 3 / 100;
  std::mt19937_64 rng(8);
  std::vector<bfloat16> q(kQHeads * kHeadDim), codebook(std::size_t(kKvHeads) * kCodewords * kHeadDim);
  for (auto& x : q) x = from_float<bfloat16>(std::normal_distribution<float>()(rng));
  for (auto& x : codebook) x = from_float<bfloat16>(std::normal_distribution<float>()(rng));
  std::vector<std::uint16_t> codes(std::size_t(kKvHeads) * tokens);
  for (auto& c : codes) c = std::uint16_t(rng() % kCodewords);
  const std::int32_t slots[1] = {0}, lengths[1] = {tokens};
  const auto qv = QueryView<const bfloat16>::packed(q.data(), 1, kQHeads, kHeadDim);
  const VqCodebook<bfloat16> book{codebook.data(), kKvHeads, kCodewords, kHeadDim};
  const auto cv = VqCodesView<const std::uint16_t>::packed(codes.data(), 1, kKvHeads, tokens);
  const std::int32_t group = kQHeads / kKvHeads, capacity = group * k;
  std::vector<std::int32_t> indices(std::size_t(kKvHeads) * capacity), counts(kKvHeads);
  const SelectionView out{indices.data(), counts.data(), nullptr, 1, kKvHeads, capacity};
  const TopKRowsOptions options{.window = {4, 64}, .heads_per_row = group};
  cpu::ThreadPool pool(threads);
  const VqTopKShape shape{.batch = 1, .q_heads = kQHeads, .kv_heads = kKvHeads, .codewords = kCodewords,
                          .head_dim = kHeadDim, .max_tokens = tokens, .k = k};
  std::vector<float> scores(composed ? std::size_t(kQHeads) * tokens : 0);
  const auto workspace = aligned_workspace(
      composed ? std::max(cpu::vq_lut_scan_workspace_bytes(1, kQHeads, kKvHeads, kCodewords, kHeadDim, &pool),
                          cpu::topk_rows_workspace_bytes(kQHeads, tokens, k, options, &pool))
               : cpu::vq_topk_rows_workspace_bytes(shape, &pool));
  for (auto _ : state) {
    if (composed) {
      const auto view = MatrixView<float>::packed(scores.data(), kQHeads, tokens);
      cpu::vq_lut_scan(qv, book, cv, slots, lengths, view, {}, workspace, &pool);
      cpu::topk_rows(MatrixView<const float>::packed(scores.data(), kQHeads, tokens), lengths, k, options, out,
                     workspace, &pool);
    } else {
      cpu::vq_topk_rows(qv, book, cv, slots, lengths, shape, options, out, workspace, &pool);
    }
    benchmark::DoNotOptimize(indices.data());
  }
  state.SetLabel(std::string(cpu::simd_level_name(cpu::active_simd_level())));
}

/// 32K and 128K tokens, on 1 thread and on all; with_softmax: raw and softmax scores.
void selection_shapes(benchmark::internal::Benchmark* b, bool with_softmax) {
  const int all = int(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> thread_counts{1};
  if (all > 1) thread_counts.push_back(all);
  for (int tokens : {32768, 131072}) {
    for (int threads : thread_counts) {
      if (!with_softmax) {
        b->Args({tokens, threads});
        continue;
      }
      b->Args({tokens, threads, 0});
      b->Args({tokens, threads, 1});
    }
  }
}
BENCHMARK(BM_CpuGroupScores)->Apply([](auto* b) { selection_shapes(b, true); })->ArgNames({"tokens", "threads", "softmax"})->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CpuTopKRows)->Apply([](auto* b) { selection_shapes(b, false); })->ArgNames({"tokens", "threads"})->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CpuSelectStep)->Apply([](auto* b) { selection_shapes(b, false); })->ArgNames({"tokens", "threads"})->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CpuVqTopKRows)
    ->ArgsProduct({{32768, 131072}, {1, int(std::max(1u, std::thread::hardware_concurrency()))}, {0, 1}})
    ->ArgNames({"tokens", "threads", "composed"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void thread_counts(benchmark::internal::Benchmark* b, bool with_k) {
  const int all = int(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<int> threads{1};
  for (int t = 2; t < all; t *= 2) threads.push_back(t);
  if (all > 1) threads.push_back(all);
  for (int t : threads) {
    if (!with_k) {
      b->Arg(t);
      continue;
    }
    for (int k : {1024, 4096, 16384}) {
      b->Args({k, t, 0, 0});
      if (t == 1) b->Args({k, t, 1, 0});  // scalar baseline, single thread
    }
    b->Args({16384, t, 0, 1});
  }
}

BENCHMARK(BM_StreamTriad)->Apply([](auto* b) { thread_counts(b, false); })->ArgName("threads")->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_GatherProbe)->Apply([](auto* b) { thread_counts(b, false); })->ArgName("threads")->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CpuSparseDecode<bfloat16>)->Apply([](auto* b) { thread_counts(b, true); })->ArgNames({"K", "threads", "scalar", "clustered"})->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CpuSparseDecode<half>)->Apply([](auto* b) { thread_counts(b, true); })->ArgNames({"K", "threads", "scalar", "clustered"})->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
