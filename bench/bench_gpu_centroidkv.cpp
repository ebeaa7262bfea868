// CentroidKV on the GPU (selectors/centroid_kv/centroid_kv.hpp, selectors/centroid_kv/cuda/merge_store.hpp), per layer, in the shape:
// q_heads 32, kv_heads 8, head_dim 128, bf16, every sequence N tokens long, R = 0.25 (B = N / 4), the paper's
// defaults (16 sinks, 64 recent, chunk 256, r 0.8 - 0.2 j >= 0.2, decode-time round once s >= B + 64).
//   - BM_CentroidKVPrepare: the prefill compression of a layer, as the selector's prepare runs it on buffers
//     allocated once: load into the prompt-sized store, the rounds (a host function of N), the copy into the
//     selector-sized store; CUDA events around the whole, and once per stage (load_ms, rounds_ms, copy_ms).
//     Random keys: the merges' choice does not change the work.
//   - BM_CentroidKVRound: one decode-time round. merging:1, every row at s = B + 64 (it merges 64 links): the
//     counts are reset before each round by a 4-byte-per-row copy that the time includes; merging:0, s = B (the
//     no-op round every other decode step launches).
//   - BM_CentroidKVStep: DecodeStep::run (the round, the append, the selection of the whole store, the attention
//     over it with log-weights), timed as BM_Step (time_calls: graph replays, eager_us); the store grows by a
//     token per call and a round merges every 64th, so the time averages the rounds in. Layers share one engine
//     cache (the step reads one token of it) and rotate their stores past 256 MB. freed_MB: the engine cache's K/V
//     bytes minus the selector's (index_bytes), per layer. Dense decode on the same shapes: BM_DenseDecode
//     (bench_decode.cpp); cuDNN SDPA: bench/sdpa_baseline.py.
//   - BM_CentroidKVStepStage: each launch group of that step alone, timed the same way, after the prefill (s = B):
//     stage 0 the decode-time round (a no-op at s = B), 1 the append (after a 4-byte-per-row reset of the counts,
//     which the time includes, so that the rows never fill), 2 the select (clear of the empty primary's counts,
//     the store's selection), 3 the attention of the empty primary selection, 4 the attention of the store, 5 the
//     LSE merge of the two partials. Stages 0, 1 and 3 are what a step spends besides attending the store.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <span>
#include <vector>

#include "gpu_bench.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/centroid_kv/centroid_kv.hpp"
#include "kvsift/step/decode_step.hpp"

namespace {

using kvsift::bfloat16;
using namespace kvsift::bench;
using Cuda = kvsift::cuda::Context;
using Selector = kvsift::CentroidKV<bfloat16, Cuda>;

constexpr int kQHeads = 32, kKvHeads = 8, kHeadDim = 128;
constexpr float kRatio = 0.25f;

std::int32_t store_capacity(std::int64_t n, const kvsift::CentroidKVConfig& c) {
  return std::int32_t(std::ceil(double(c.budget_ratio) * double(n))) + c.interval;
}

/// A store's arrays for `slots` rows of `capacity` entries, device memory.
struct StoreBuffers {
  Device<bfloat16> k, v;
  Device<std::int32_t> order, degree, count;
  Device<float> log_degree;
  std::int32_t slots, capacity;
  StoreBuffers(std::int32_t slots_, std::int32_t capacity_)
      : k(kv_size(slots_, capacity_)), v(kv_size(slots_, capacity_)), order(entries(slots_, capacity_)),
        degree(entries(slots_, capacity_)), count(std::size_t(slots_) * kKvHeads),
        log_degree(entries(slots_, capacity_)), slots(slots_), capacity(capacity_) {}
  static std::size_t kv_size(std::int32_t slots, std::int32_t capacity) {
    return kvsift::MergeStoreView<bfloat16>::kv_elements(slots, kKvHeads, capacity, kHeadDim);
  }
  static std::size_t entries(std::int32_t slots, std::int32_t capacity) {
    return kvsift::MergeStoreView<bfloat16>::entries(slots, kKvHeads, capacity);
  }
  kvsift::MergeStoreView<bfloat16> view() const {
    return {k.ptr, v.ptr, order.ptr, degree.ptr, log_degree.ptr, count.ptr, slots, kKvHeads, capacity, kHeadDim};
  }
};

/// The engine's cache: every sequence n tokens, batch row b in slot b.
struct Cache {
  std::int64_t n;
  int batch;
  Device<bfloat16> k, v;
  Device<std::int32_t> lengths, slots;
  Cache(std::int64_t n_, int batch_)
      : n(n_), batch(batch_), k(elements()), v(elements()), lengths(batch_), slots(batch_) {
    fill_random(k.ptr, elements(), 1);
    fill_random(v.ptr, elements(), 2);
    const std::vector<std::int32_t> l(static_cast<std::size_t>(batch), static_cast<std::int32_t>(n));
    std::vector<std::int32_t> s(static_cast<std::size_t>(batch));
    for (int b = 0; b < batch; ++b) s[std::size_t(b)] = b;
    KVSIFT_CUDA_CHECK(cudaMemcpy(lengths.ptr, l.data(), l.size() * 4, cudaMemcpyHostToDevice));
    KVSIFT_CUDA_CHECK(cudaMemcpy(slots.ptr, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
  }
  std::size_t elements() const { return std::size_t(batch) * kKvHeads * std::size_t(n) * kHeadDim; }
  double kv_bytes() const { return 2.0 * double(elements()) * sizeof(bfloat16); }
  kvsift::KVCache<bfloat16> cache() const {
    return kvsift::ContiguousKVView<bfloat16>::packed(k.ptr, v.ptr, batch, kKvHeads, std::int32_t(n), kHeadDim,
                                                      lengths.ptr);
  }
};

/// The prefill compression of one layer (CentroidKV::prepare's device work, its buffers allocated once).
struct Prefill {
  const Cache& cache;
  kvsift::CentroidKVConfig config{.budget_ratio = kRatio};
  std::vector<kvsift::MergeRoundParams> schedule;
  std::int32_t rounds, budget;
  StoreBuffers temp, store;
  Device<std::int32_t> budgets;
  Device<std::byte> workspace;
  std::size_t workspace_bytes;

  explicit Prefill(const Cache& c)
      : cache(c), schedule(kvsift::detail::centroid_kv_prefill_schedule("bench", config, std::int32_t(c.n))),
        rounds(std::int32_t(schedule.size())),
        budget(kvsift::detail::centroid_kv_budget(config, std::int32_t(c.n))), temp(c.batch, std::int32_t(c.n)),
        store(c.batch, store_capacity(c.n, config)), budgets(std::size_t(c.batch)),
        workspace(kvsift::cuda::merge_round_workspace_bytes(c.batch, kKvHeads, std::int32_t(c.n))),
        workspace_bytes(kvsift::cuda::merge_round_workspace_bytes(c.batch, kKvHeads, std::int32_t(c.n))) {
    const std::vector<std::int32_t> b(std::size_t(c.batch), budget);
    KVSIFT_CUDA_CHECK(cudaMemcpy(budgets.ptr, b.data(), b.size() * 4, cudaMemcpyHostToDevice));
  }
  void load(cudaStream_t stream) const {
    kvsift::cuda::merge_store_load(cache.cache().as_const(), cache.slots.ptr, temp.view(), stream);
  }
  void merge(cudaStream_t stream) const {
    for (const kvsift::MergeRoundParams& round : schedule) {
      kvsift::cuda::merge_round(temp.view(), cache.slots.ptr, cache.batch, budgets.ptr, round,
                                {workspace.ptr, workspace_bytes}, stream);
    }
  }
  void copy(cudaStream_t stream) const {
    kvsift::cuda::merge_store_copy(temp.view().as_const(), cache.slots.ptr, store.view(), cache.slots.ptr, cache.batch,
                                   stream);
  }
};

double event_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

void BM_CentroidKVPrepare(benchmark::State& state) {
  const Cache cache(state.range(0), int(state.range(1)));
  const Prefill prefill(cache);
  EventTimer timer;
  for (int i = 0; i < 2; ++i) prefill.load(nullptr), prefill.merge(nullptr), prefill.copy(nullptr);  // warm-up
  for (auto _ : state) {
    state.SetIterationTime(timer.seconds([&] {
      prefill.load(nullptr);
      prefill.merge(nullptr);
      prefill.copy(nullptr);
    }));
  }
  cudaEvent_t e[4];
  for (auto& x : e) KVSIFT_CUDA_CHECK(cudaEventCreate(&x));
  KVSIFT_CUDA_CHECK(cudaEventRecord(e[0]));
  prefill.load(nullptr);
  KVSIFT_CUDA_CHECK(cudaEventRecord(e[1]));
  prefill.merge(nullptr);
  KVSIFT_CUDA_CHECK(cudaEventRecord(e[2]));
  prefill.copy(nullptr);
  KVSIFT_CUDA_CHECK(cudaEventRecord(e[3]));
  KVSIFT_CUDA_CHECK(cudaEventSynchronize(e[3]));
  state.counters["load_ms"] = event_ms(e[0], e[1]);
  state.counters["rounds_ms"] = event_ms(e[1], e[2]);
  state.counters["copy_ms"] = event_ms(e[2], e[3]);
  for (auto& x : e) KVSIFT_CUDA_CHECK(cudaEventDestroy(x));
  std::vector<std::int32_t> counts(std::size_t(cache.batch) * kKvHeads);
  KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), prefill.store.count.ptr, counts.size() * 4, cudaMemcpyDeviceToHost));
  state.counters["rounds"] = prefill.rounds;
  state.counters["count_over_B"] = double(*std::max_element(counts.begin(), counts.end())) / prefill.budget;
}
BENCHMARK(BM_CentroidKVPrepare)
    ->ArgsProduct({{32768, 131072}, {1, 8}})
    ->ArgNames({"N", "batch"})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.1);

void BM_CentroidKVRound(benchmark::State& state) {
  const Cache cache(state.range(0), int(state.range(1)));
  const Prefill prefill(cache);
  prefill.load(nullptr), prefill.merge(nullptr), prefill.copy(nullptr);
  const bool merging = state.range(2) != 0;
  const std::vector<std::int32_t> counts(std::size_t(cache.batch) * kKvHeads, prefill.budget + (merging ? 64 : 0));
  Device<std::int32_t> reset(counts.size());
  KVSIFT_CUDA_CHECK(cudaMemcpy(reset.ptr, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice));
  const std::size_t bytes = kvsift::cuda::merge_round_workspace_bytes(cache.batch, kKvHeads, prefill.store.capacity);
  Device<std::byte> workspace(bytes);
  const auto params = kvsift::detail::centroid_kv_decode_params(prefill.config);
  time_calls(state, [&](int, cudaStream_t stream) {
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(prefill.store.count.ptr, reset.ptr, counts.size() * 4, cudaMemcpyDeviceToDevice,
                                      stream));
    kvsift::cuda::merge_round(prefill.store.view(), cache.slots.ptr, cache.batch, prefill.budgets.ptr, params,
                              {workspace.ptr, bytes}, stream);
  });
}
BENCHMARK(BM_CentroidKVRound)
    ->ArgsProduct({{32768, 131072}, {1, 8}, {0, 1}})
    ->ArgNames({"N", "batch", "merging"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

/// A decode step's selector limits, the bytes it reads (the store's K/V, all attended) and the layers that rotate
/// the stores past 256 MB.
struct StepShape {
  kvsift::CentroidKVConfig config;
  kvsift::SelectorLimits limits;
  double step_bytes;
  int layers;
  StepShape(std::int64_t n, int batch)
      : config{.budget_ratio = kRatio},
        limits{.max_slots = batch, .max_tokens = std::int32_t(n), .q_heads = kQHeads, .kv_heads = kKvHeads,
               .head_dim = kHeadDim},
        step_bytes(2.0 * batch * kKvHeads * double(store_capacity(n, config)) * kHeadDim * sizeof(bfloat16)),
        layers(std::clamp(int(std::ceil(double(std::size_t(256) << 20) / step_bytes)), 1, 8)) {}
};

void BM_CentroidKVStep(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const int batch = int(state.range(1));
  const Cache cache(n, batch);
  const StepShape shape(n, batch);
  const auto& [config, limits, step_bytes, layers] = shape;
  const kvsift::DecodeStepConfig step_config{.max_batch = batch, .q_heads = kQHeads, .kv_heads = kKvHeads,
                                             .head_dim = kHeadDim, .max_seq_len = std::int32_t(n)};
  std::vector<std::unique_ptr<kvsift::DecodeStep<Selector>>> stack;
  for (int l = 0; l < layers; ++l) {
    stack.push_back(
        std::make_unique<kvsift::DecodeStep<Selector>>(Selector(limits, config, Cuda{}), step_config, Cuda{}));
    stack.back()->prepare({.cache = cache.cache().as_const(), .slots = cache.slots.ptr}, Cuda{});
  }
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  Device<bfloat16> q(std::size_t(batch) * kQHeads * kHeadDim), o(std::size_t(batch) * kQHeads * kHeadDim);
  Device<float> lse(std::size_t(batch) * kQHeads);
  fill_random(q.ptr, std::size_t(batch) * kQHeads * kHeadDim, 99);
  const std::size_t workspace_bytes = stack.front()->workspace_bytes();
  Device<std::byte> workspace(workspace_bytes);
  const auto qv = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim);
  const auto out = kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, batch, kQHeads, kHeadDim);
  time_calls(state, [&](int i, cudaStream_t stream) {
    stack[std::size_t(i) % stack.size()]->run({.q = qv, .cache = cache.cache(), .slots = cache.slots.ptr}, out,
                                             {workspace.ptr, workspace_bytes}, Cuda{stream});
  });
  const kvsift::IndexBytes index = stack.front()->selector().index_bytes();
  state.counters["layers"] = layers;
  state.counters["store_MB"] = double(index.device) / 1e6;
  state.counters["freed_MB"] = (cache.kv_bytes() - double(index.device)) / 1e6;
  state.counters["GB/s"] = benchmark::Counter(step_bytes * double(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CentroidKVStep)
    ->ArgsProduct({{32768, 131072}, {1, 8}})
    ->ArgsProduct({{8192, 524288, 1048576}, {1}})  // the context sweep
    ->ArgsProduct({{131072}, {32}})                 // batch 32: the step against its byte floor
    ->ArgNames({"N", "batch"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

/// The selector's store, to drive its rounds and appends one launch group at a time (the bench owns the selector).
kvsift::MergeStoreView<bfloat16> writable(const Selector& selector) {
  const kvsift::MergeStoreView<const bfloat16> s = selector.store();
  return {const_cast<bfloat16*>(s.k),         const_cast<bfloat16*>(s.v),     const_cast<std::int32_t*>(s.order),
          const_cast<std::int32_t*>(s.degree), const_cast<float*>(s.log_degree), const_cast<std::int32_t*>(s.count),
          s.slots,                             s.kv_heads,                        s.capacity,
          s.head_dim};
}

void BM_CentroidKVStepStage(benchmark::State& state) {
  const int stage = int(state.range(0));
  const std::int64_t n = state.range(1);
  const int batch = int(state.range(2));
  const Cache cache(n, batch);
  const StepShape shape(n, batch);
  const auto& [config, limits, step_bytes, layers] = shape;
  std::vector<std::unique_ptr<Selector>> stack;
  for (int l = 0; l < layers; ++l) {
    stack.push_back(std::make_unique<Selector>(limits, config, Cuda{}));
    stack.back()->prepare({.cache = cache.cache().as_const(), .slots = cache.slots.ptr}, Cuda{});
  }
  const std::int32_t capacity = stack.front()->second_source_capacity();
  const std::size_t rows = std::size_t(batch) * kKvHeads;
  Device<std::int32_t> saved_counts(rows * stack.size());  // each layer's counts at s = B, for the append's reset
  for (std::size_t l = 0; l < stack.size(); ++l) {
    KVSIFT_CUDA_CHECK(
        cudaMemcpy(saved_counts.ptr + l * rows, stack[l]->store().count, rows * 4, cudaMemcpyDeviceToDevice));
  }
  Device<bfloat16> q(std::size_t(batch) * kQHeads * kHeadDim), o(std::size_t(batch) * kQHeads * kHeadDim);
  Device<float> partial_o(2 * std::size_t(batch) * kQHeads * kHeadDim), partial_lse(2 * std::size_t(batch) * kQHeads),
      lse(std::size_t(batch) * kQHeads);
  Device<std::int32_t> primary_indices(rows), primary_counts(rows);
  fill_random(q.ptr, std::size_t(batch) * kQHeads * kHeadDim, 99);
  const std::size_t ws_bytes = std::max(
      kvsift::cuda::merge_round_workspace_bytes(batch, kKvHeads, capacity),
      kvsift::cuda::sparse_decode_workspace_bytes(batch, kQHeads, kKvHeads, kHeadDim, capacity, std::int32_t(n), {},
                                                  false, Cuda{}));
  Device<std::byte> ws(ws_bytes);
  const std::span<std::byte> workspace(ws.ptr, ws_bytes);
  const auto qv = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim);
  // The step's primary selection: capacity 1 (DecodeStep's least; sparse decode takes no empty one), counts 0.
  const kvsift::SelectionView primary{primary_indices.ptr, primary_counts.ptr, nullptr, batch, kKvHeads, 1};
  const kvsift::StateView<float> partials[] = {
      kvsift::StateView<float>::packed(partial_o.ptr, partial_lse.ptr, batch, kQHeads, kHeadDim),
      kvsift::StateView<float>::packed(partial_o.ptr + std::size_t(batch) * kQHeads * kHeadDim,
                                       partial_lse.ptr + std::size_t(batch) * kQHeads, batch, kQHeads, kHeadDim)};
  const kvsift::StateView<const float> merged[] = {partials[0].as_const(), partials[1].as_const()};
  const auto out = kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, batch, kQHeads, kHeadDim);
  const kvsift::SelectInputs<bfloat16> in{
      .q = qv, .cache = cache.cache().as_const(), .slots = cache.slots.ptr, .lengths = cache.lengths.ptr};
  for (auto& selector : stack) selector->select(in, primary, {}, Cuda{});  // stages 3 and 4 read the selections
  const auto round_params = kvsift::detail::centroid_kv_decode_params(config);
  time_calls(state, [&](int i, cudaStream_t stream) {
    const std::size_t l = std::size_t(i) % stack.size();
    const Selector& selector = *stack[l];
    const Cuda ctx{stream};
    switch (stage) {
      case 0:
        kvsift::cuda::merge_round(writable(selector), cache.slots.ptr, batch, selector.budgets(), round_params,
                                  workspace, stream);
        break;
      case 1:
        KVSIFT_CUDA_CHECK(cudaMemcpyAsync(writable(selector).count, saved_counts.ptr + l * rows, rows * 4,
                                          cudaMemcpyDeviceToDevice, stream));
        kvsift::cuda::merge_store_append(in.cache, cache.slots.ptr, cache.lengths.ptr, writable(selector), stream);
        break;
      case 2: stack[l]->select(in, primary, {}, ctx); break;
      case 3: kvsift::cuda::sparse_decode(qv, in.cache, primary, partials[0], {}, false, true, workspace, ctx); break;
      case 4: {
        const kvsift::SecondSource<bfloat16> second = selector.second_source(in);
        kvsift::cuda::sparse_decode(qv, second.cache, second.selection, partials[1], {}, false, true, workspace, ctx);
        break;
      }
      default: kvsift::cuda::merge_states(std::span<const kvsift::StateView<const float>>(merged), out, ctx);
    }
  });
  state.counters["layers"] = layers;
}
BENCHMARK(BM_CentroidKVStepStage)
    ->ArgsProduct({{0, 1, 2, 3, 4, 5}, {32768, 131072}, {1, 8}})
    ->ArgNames({"stage", "N", "batch"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

}  // namespace
