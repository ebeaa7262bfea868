// SpeContext's decode step (selectors/specontext/step.hpp) on the GPU in the model shape: 32 layers, q_heads 32,
// kv_heads 8, head_dim 128, bf16, every sequence N tokens, B = 2048, all KV on the GPU. A call is one whole decode
// step of the model's attention: mode 0 (SpeContext) the retrieval head's selection (append + select) and the sparse
// attention of all 32 layers over that one selection and the current token (window 0 + 1, the paper's); mode 1
// (dense) 32 layers of kvsift's dense decode; mode 2 the head's selection alone; mode 5 mode 0 with a rerank per
// layer (the head selects 4 x 2048, each layer keeps its best 2048: SpeContextStepConfig::rerank). cuDNN SDPA on the same shapes is
// bench/sdpa_baseline.py (one layer; x 32 for the model). Timed by time_calls (gpu_bench.hpp): graph replays (the
// manual time) and eager calls (eager_us). pdl 0: every attention launched without programmatic dependent launch;
// between 1: a projection GEMM (projection_gemm.hpp) after every layer, 32 per step, as a model's other kernels
// sit between its attention calls (the time is then per step with its 32 GEMMs; BM_ProjectionGemm x 32 subtracts).
//
// Layer caches: 32 distinct ones where they fit in 48 GB; otherwise (128K, batch 8: 4.3 GB a layer) the 32 layers
// cycle over as many distinct caches as fit (counter `distinct`), which times as 32 distinct layers would: each
// layer's K/V exceed the 50 MB L2 many times, so no layer finds the previous one's rows in it. The head's query,
// key and prompt keys are random (the head model is outside kvsift); its owned K cache is [batch, 8, N, 128] bf16.
//
// BM_SpeContextOffload: the last layers' KV in pinned host memory (selectors/specontext/offload.hpp), as many as the
// planner (selectors/specontext/offload_planner.hpp, algorithm 2) offloads at N for a GPU of gpu_GB GB holding Llama-3.1-8B's
// weights (16.06 GB bf16; the retrieval head made of the model's own projections, M_D = 0; factor 1.3, the +1 head
// layer, alpha = 4). Selections persist as measured on captures (docs/specontext.md): each step keeps 85% of the
// last one's tokens per (sequence, kv head): a ring of 16 synthetic selections (a window of B tokens sliding by
// 15% of B over 16 * 0.15 B random distinct tokens, so step 15 -> 0 keeps 85% too) written over the head's own
// selection before the copies (the LayersOnHost step's load), so every layer attends it. mode 3: the step (head
// selection, copies of the offloaded layers on a side stream, the attention of all 32 layers: GPU layers from the
// GPU caches, offloaded ones from their resident rows); mode 4: the copies alone (the side stream's update joined
// back, nothing else). huge_pages 1: the host caches in transparent huge pages registered with CUDA (PinnedHost)
// instead of cudaMallocHost's. Counters: offloaded, rows and MB moved per step (K and V of every offloaded layer),
// kept.
// The copying hidden behind attention: (mode 4 + mode 0 - mode 3) / mode 4 at the same N and batch.
// BM_PinnedGather: one offloaded layer's copies alone as cuda::gather_kv, from cudaMallocHost or huge pages, the same
// rows each call or fresh ones (the copies' rate against the host pages' translation).
#include <benchmark/benchmark.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "gpu_bench.hpp"
#include "projection_gemm.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/specontext/specontext.hpp"
#include "kvsift/selectors/specontext/offload_planner.hpp"
#include "kvsift/selectors/specontext/offload.hpp"
#include "kvsift/selectors/specontext/step.hpp"

namespace {

using kvsift::bfloat16;
using namespace kvsift::bench;
using Cuda = kvsift::cuda::Context;

constexpr int kLayers = 32, kQHeads = 32, kKvHeads = 8, kHeadDim = 128, kBudget = 2048;
enum Mode : int { kSpeContext = 0, kDense = 1, kSelectOnly = 2, kOffloaded = 3, kCopiesOnly = 4, kReranked = 5 };
/// kReranked: the head selects kRerankFactor x kBudget, each layer keeps its best kBudget (SpeContextStepConfig::rerank).
constexpr std::int32_t kRerankFactor = 4;

/// The model's layer caches, the head's inputs and a prepared SpeContext step.
struct Model {
  std::int64_t n;
  int batch, distinct;
  std::vector<std::unique_ptr<Device<bfloat16>>> k, v;
  Device<std::int32_t> lengths, slots;
  Device<bfloat16> q_r, k_r, q, o;
  Device<float> lse;
  std::unique_ptr<kvsift::SpeContextStep<bfloat16, Cuda>> step;  ///< null once moved into an offloaded placement
  std::size_t workspace_bytes = 0;
  std::unique_ptr<Device<std::byte>> workspace;

  Model(std::int64_t n_, int batch_, bool pdl, bool rerank = false)
      : n(n_), batch(batch_), distinct(std::clamp(int(48e9 / (2.0 * double(elements()) * sizeof(bfloat16))), 1, kLayers)),
        lengths(batch_), slots(batch_), q_r(std::size_t(batch_) * kQHeads * kHeadDim),
        k_r(std::size_t(batch_) * kKvHeads * kHeadDim), q(std::size_t(batch_) * kQHeads * kHeadDim),
        o(std::size_t(batch_) * kQHeads * kHeadDim), lse(std::size_t(batch_) * kQHeads) {
    for (int l = 0; l < distinct; ++l) {
      k.push_back(std::make_unique<Device<bfloat16>>(elements()));
      v.push_back(std::make_unique<Device<bfloat16>>(elements()));
      fill_random(k.back()->ptr, elements(), 17 * l + 1);
      fill_random(v.back()->ptr, elements(), 17 * l + 2);
    }
    fill_random(q_r.ptr, std::size_t(batch) * kQHeads * kHeadDim, 91);
    fill_random(k_r.ptr, std::size_t(batch) * kKvHeads * kHeadDim, 92);
    fill_random(q.ptr, std::size_t(batch) * kQHeads * kHeadDim, 93);
    std::vector<std::int32_t> host_lengths(static_cast<std::size_t>(batch), std::int32_t(n));
    std::vector<std::int32_t> host_slots(static_cast<std::size_t>(batch));
    for (int b = 0; b < batch; ++b) host_slots[std::size_t(b)] = b;
    KVSIFT_CUDA_CHECK(cudaMemcpy(lengths.ptr, host_lengths.data(), batch * sizeof(std::int32_t), cudaMemcpyHostToDevice));
    KVSIFT_CUDA_CHECK(cudaMemcpy(slots.ptr, host_slots.data(), batch * sizeof(std::int32_t), cudaMemcpyHostToDevice));
    const kvsift::SelectorLimits limits{.max_slots = batch, .max_tokens = std::int32_t(n), .q_heads = kQHeads,
                                        .kv_heads = kKvHeads, .head_dim = kHeadDim};
    kvsift::SpeContextConfig config{.budget = rerank ? kRerankFactor * kBudget : kBudget,
                                    .rope = kvsift::specontext_yarn_rope(500000.0, 64.0, 2048)};
    step = std::make_unique<kvsift::SpeContextStep<bfloat16, Cuda>>(
        kvsift::SpeContext<bfloat16, Cuda>(limits, config, Cuda{}),
        kvsift::SpeContextStepConfig{.step = {.max_batch = batch, .q_heads = kQHeads, .kv_heads = kKvHeads,
                                              .head_dim = kHeadDim, .max_seq_len = std::int32_t(n),
                                              .programmatic_launch = pdl},
                                     .layers = kLayers,
                                     .rerank = {.budget = rerank ? kBudget : 0}},
        Cuda{});
    workspace_bytes = step->workspace_bytes();
    workspace = std::make_unique<Device<std::byte>>(workspace_bytes);
    // The head's prompt keys: layer 0's K stands in for them (random values, the head's shape).
    step->prepare({.cache = cache(0).as_const(), .slots = slots.ptr,
                   .k_pre_rope = kvsift::SequenceView<const bfloat16>::packed(k[0]->ptr, batch, kKvHeads, std::int32_t(n),
                                                                               kHeadDim)},
                  Cuda{});
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::size_t elements() const { return std::size_t(batch) * kKvHeads * std::size_t(n) * kHeadDim; }
  kvsift::KVCache<bfloat16> cache(int layer) const {
    const int c = layer % distinct;
    return kvsift::ContiguousKVView<bfloat16>::packed(k[std::size_t(c)]->ptr, v[std::size_t(c)]->ptr, batch, kKvHeads,
                                                      std::int32_t(n), kHeadDim, lengths.ptr);
  }
  std::span<std::byte> ws() const { return {workspace->ptr, workspace_bytes}; }
  kvsift::SpeContextHeadInputs<bfloat16> head_inputs() const {
    return {.q = kvsift::QueryView<const bfloat16>::packed(q_r.ptr, batch, kQHeads, kHeadDim),
            .k = kvsift::HeadsView<const bfloat16>::packed(k_r.ptr, batch, kKvHeads, kHeadDim),
            .cache = cache(0).as_const(), .slots = slots.ptr};
  }
  void select(cudaStream_t stream) { step->select(head_inputs(), ws(), Cuda{stream}); }
  void attend(int layer, cudaStream_t stream) {
    step->attend({.q = kvsift::QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim), .cache = cache(layer),
                  .layer = layer},
                 kvsift::StateView<bfloat16>::packed(o.ptr, lse.ptr, batch, kQHeads, kHeadDim), ws(), Cuda{stream});
  }
};

void BM_SpeContextStep(benchmark::State& state) {
  const int mode = int(state.range(0));
  const std::int64_t n = state.range(1);
  const int batch = int(state.range(2));
  const bool pdl = state.range(3) != 0;
  Model model(n, batch, pdl, mode == kReranked);
  std::unique_ptr<ProjectionGemm> between;
  if (state.range(4) != 0) between = std::make_unique<ProjectionGemm>(batch);
  const auto qv = kvsift::QueryView<const bfloat16>::packed(model.q.ptr, batch, kQHeads, kHeadDim);
  const auto out = kvsift::StateView<bfloat16>::packed(model.o.ptr, model.lse.ptr, batch, kQHeads, kHeadDim);
  const kvsift::cuda::DecodeOptions dense_options{.programmatic_launch = pdl};
  const std::size_t dense_bytes =
      kvsift::cuda::dense_decode_workspace_bytes(qv, model.cache(0).as_const().contiguous, dense_options);
  Device<std::byte> dense_ws(std::max<std::size_t>(dense_bytes, 256));
  time_calls(state, [&](int i, cudaStream_t stream) {
    if (mode != kDense) model.select(stream);
    if (mode == kSelectOnly) return;
    for (int l = 0; l < kLayers; ++l) {
      if (mode == kSpeContext || mode == kReranked) {
        model.attend(l, stream);
      } else {
        kvsift::cuda::dense_decode(qv, model.cache(l).as_const().contiguous, out, {dense_ws.ptr, dense_bytes}, stream,
                                   dense_options);
      }
      if (between) (*between)(i * kLayers + l, stream);
    }
  });
  state.SetLabel(mode == kSpeContext ? "SpeContext"
                 : mode == kReranked ? "SpeContext + rerank"
                 : mode == kDense    ? "dense"
                                     : "head select");
  state.counters["distinct"] = model.distinct;
  state.counters["head_cache_MB"] = double(model.step->selector().index_bytes().device) / 1e6;
  if (mode == kSelectOnly || between) return;
  // The bytes a step must read: the head's keys (SpeContext) and every layer's attended K/V rows; with the rerank,
  // every layer's candidates' keys too.
  const double rows = double(batch) * kKvHeads, row_bytes = kHeadDim * sizeof(bfloat16);
  const double reranked = mode == kReranked ? kLayers * rows * double(kRerankFactor * kBudget) * row_bytes : 0.0;
  const double bytes = mode == kDense ? kLayers * rows * double(n) * 2 * row_bytes
                                      : rows * double(n) * row_bytes + kLayers * rows * (kBudget + 1) * 2 * row_bytes +
                                            reranked;
  state.counters["GB/s"] = benchmark::Counter(bytes * double(state.iterations()), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_SpeContextStep)
    ->ArgsProduct({{kSpeContext, kDense, kReranked}, {131072, 32768}, {1, 8}, {1}, {0}})
    ->ArgsProduct({{kSpeContext}, {8192, 524288, 1048576}, {1}, {1}, {0}})  // the context sweep
    ->ArgsProduct({{kSelectOnly}, {131072, 32768}, {1, 8}, {1}, {0}})
    ->ArgsProduct({{kSpeContext}, {131072}, {32}, {1}, {0}})  // batch 32: the step against its byte floor
    ->ArgsProduct({{kSpeContext, kDense}, {131072}, {1, 8}, {0}, {0}})  // PDL off
    ->ArgsProduct({{kSpeContext, kDense}, {131072}, {1, 8}, {1}, {1}})  // a GEMM between layers
    ->ArgNames({"mode", "N", "batch", "pdl", "between"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

/// The planner's offloaded layers for the model above on a GPU of `gpu_gb` GB at `n` tokens, `batch` requests.
kvsift::OffloadPlan planned(std::int64_t n, int batch, std::int64_t gpu_gb) {
  const kvsift::OffloadPlannerParams params{.gpu_bytes = gpu_gb * 1'000'000'000,
                                            .model_bytes = 16'060'000'000,
                                            .layers = kLayers,
                                            .kv_heads = kKvHeads,
                                            .head_dim = kHeadDim,
                                            .group = kQHeads / kKvHeads,
                                            .requests = batch,
                                            .budget = kBudget};
  return kvsift::plan_offload(kvsift::sequence_thresholds(params), n);
}

/// Pinned host memory: cudaMallocHost's, or (huge) 2 MiB-aligned memory advised into transparent huge pages,
/// touched, then registered with CUDA, so that the GPU may translate the copies' scattered rows through fewer, larger
/// pages (experiments.md#specontext-offload-overlap-h200).
struct PinnedHost {
  static constexpr std::size_t kHuge = std::size_t(2) << 20;
  void* ptr = nullptr;
  bool huge;
  PinnedHost(std::size_t bytes, bool huge_pages) : huge(huge_pages) {
    if (!huge) {
      KVSIFT_CUDA_CHECK(cudaMallocHost(&ptr, bytes));
      return;
    }
    ptr = std::aligned_alloc(kHuge, (bytes + kHuge - 1) / kHuge * kHuge);
    if (ptr == nullptr) throw std::bad_alloc();
    madvise(ptr, bytes, MADV_HUGEPAGE);  // advice: without THP the pages stay 4 KiB, and the run says so by its time
    std::memset(ptr, 0, bytes);
    KVSIFT_CUDA_CHECK(cudaHostRegister(ptr, bytes, cudaHostRegisterDefault));
  }
  PinnedHost(const PinnedHost&) = delete;
  PinnedHost& operator=(const PinnedHost&) = delete;
  ~PinnedHost() {
    if (huge) {
      cudaHostUnregister(ptr);
      std::free(ptr);
    } else {
      cudaFreeHost(ptr);
    }
  }
  bfloat16* data() const { return static_cast<bfloat16*>(ptr); }
};

/// Model with its last plan.offloaded layers' KV in pinned host memory (copies of the GPU caches' values) and the
/// ring of synthetic selections.
struct OffloadedModel {
  static constexpr int kRing = 16;
  static constexpr std::int32_t kShift = kBudget * 15 / 100;  // tokens replaced per step: 85% kept
  Model model;
  int first;
  std::vector<std::unique_ptr<PinnedHost>> host_k, host_v;
  std::int32_t* host_lengths = nullptr;
  std::vector<kvsift::KVCache<const bfloat16>> host_caches;
  std::unique_ptr<kvsift::SpeContextStep<bfloat16, Cuda, kvsift::placement::LayersOnHost>> offload;
  Device<std::int32_t> ring_indices, ring_counts;
  cudaStream_t side = nullptr;

  OffloadedModel(std::int64_t n, int batch, int offloaded, bool huge_pages)
      : model(n, batch, true),
        first(kLayers - offloaded),
        ring_indices(std::size_t(kRing) * batch * kKvHeads * kBudget),
        ring_counts(std::size_t(kRing) * batch * kKvHeads) {
    KVSIFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_lengths), batch * sizeof(std::int32_t)));
    std::fill(host_lengths, host_lengths + batch, std::int32_t(n));
    const std::size_t bytes = model.elements() * sizeof(bfloat16);
    for (int l = first; l < kLayers; ++l) {
      host_k.push_back(std::make_unique<PinnedHost>(bytes, huge_pages));
      host_v.push_back(std::make_unique<PinnedHost>(bytes, huge_pages));
      const kvsift::ContiguousKVView<bfloat16> gpu = model.cache(l).contiguous;
      KVSIFT_CUDA_CHECK(cudaMemcpy(host_k.back()->data(), gpu.k, bytes, cudaMemcpyDeviceToHost));
      KVSIFT_CUDA_CHECK(cudaMemcpy(host_v.back()->data(), gpu.v, bytes, cudaMemcpyDeviceToHost));
      host_caches.emplace_back(host_cache(l).as_const());
    }
    offload = std::make_unique<kvsift::SpeContextStep<bfloat16, Cuda, kvsift::placement::LayersOnHost>>(
        std::move(*model.step), offloaded);
    model.step.reset();
    KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    // The ring: per (sequence, kv head) a pool of kRing * kShift distinct middle tokens in random order; selection
    // j is the pool's window [j * kShift, j * kShift + B) (cyclic), ascending.
    const std::size_t rows = std::size_t(batch) * kKvHeads;
    std::vector<std::int32_t> indices(std::size_t(kRing) * rows * kBudget), counts(std::size_t(kRing) * rows, kBudget);
    std::mt19937 rng(7);
    std::vector<std::int32_t> tokens(std::size_t(n) - 1);
    const std::size_t pool = std::size_t(kRing) * kShift;
    for (std::size_t r = 0; r < rows; ++r) {
      std::iota(tokens.begin(), tokens.end(), 0);
      for (std::size_t i = 0; i < pool; ++i) std::swap(tokens[i], tokens[i + rng() % (tokens.size() - i)]);
      for (int j = 0; j < kRing; ++j) {
        std::int32_t* row = indices.data() + (std::size_t(j) * rows + r) * kBudget;
        for (std::int32_t m = 0; m < kBudget; ++m) row[m] = tokens[(std::size_t(j) * kShift + std::size_t(m)) % pool];
        std::sort(row, row + kBudget);
      }
    }
    KVSIFT_CUDA_CHECK(cudaMemcpy(ring_indices.ptr, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice));
    KVSIFT_CUDA_CHECK(cudaMemcpy(ring_counts.ptr, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice));
  }
  ~OffloadedModel() {
    offload.reset();
    cudaStreamDestroy(side);
    cudaFreeHost(host_lengths);
  }
  kvsift::KVCache<bfloat16> host_cache(int layer) const {
    const std::size_t j = std::size_t(layer - first);
    return kvsift::ContiguousKVView<bfloat16>::packed(host_k[j]->data(), host_v[j]->data(), model.batch, kKvHeads,
                                                      std::int32_t(model.n), kHeadDim, host_lengths);
  }
  /// Selection i % kRing over the step's, then the offloaded layers' copies on the side stream.
  void load(int i, cudaStream_t stream) {
    const kvsift::SelectionView sel = offload->selection(model.ws(), model.batch);
    const std::size_t rows = std::size_t(model.batch) * kKvHeads, j = std::size_t(i % kRing);
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(sel.indices, ring_indices.ptr + j * rows * kBudget, rows * kBudget * 4,
                                      cudaMemcpyDeviceToDevice, stream));
    KVSIFT_CUDA_CHECK(
        cudaMemcpyAsync(sel.counts, ring_counts.ptr + j * rows, rows * 4, cudaMemcpyDeviceToDevice, stream));
    offload->load(model.batch, model.slots.ptr, host_caches, model.ws(), {Cuda{stream}, side});
  }
  void step(int i, cudaStream_t stream) {
    offload->local_step().select(model.head_inputs(), model.ws(), Cuda{stream});
    load(i, stream);
    const auto q = kvsift::QueryView<const bfloat16>::packed(model.q.ptr, model.batch, kQHeads, kHeadDim);
    const auto token = kvsift::HeadsView<const bfloat16>::packed(model.k_r.ptr, model.batch, kKvHeads, kHeadDim);
    const auto out = kvsift::StateView<bfloat16>::packed(model.o.ptr, model.lse.ptr, model.batch, kQHeads, kHeadDim);
    for (int l = 0; l < kLayers; ++l) {
      if (l < first) {  // as Model::attend
        offload->attend({.q = q, .cache = model.cache(l), .layer = l}, out, model.ws(), {Cuda{stream}, side});
      } else {  // the step's token (the head's k_r stands in for its K and V) written to the host cache
        offload->attend({.q = q, .cache = host_cache(l), .k = token, .v = token, .layer = l}, out, model.ws(),
                        {Cuda{stream}, side});
      }
    }
  }
  void copies_only(int i, cudaStream_t stream) {
    load(i, stream);
    for (int l = 0; l < kLayers - first; ++l) offload->elastic().wait(l, stream);
  }
};

void BM_SpeContextOffload(benchmark::State& state) {
  const int mode = int(state.range(0));
  const std::int64_t n = state.range(1);
  const int batch = int(state.range(2));
  const kvsift::OffloadPlan plan = planned(n, batch, state.range(3));
  if (plan.offloaded == 0) {
    state.SkipWithError("the planner offloads no layer at this length and memory");
    return;
  }
  OffloadedModel m(n, batch, plan.offloaded, state.range(4) != 0);
  const auto call = [&](int i, cudaStream_t stream) {
    if (mode == kOffloaded) {
      m.step(i, stream);
    } else {
      m.copies_only(i, stream);
    }
  };
  time_calls(state, call);
  // One steady step's copies (ring selection 1 after 0), read back outside the timing.
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  call(0, stream);
  call(1, stream);
  const kvsift::ElasticStats stats = m.offload->elastic().last_step_stats(stream);
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  state.SetLabel(mode == kOffloaded ? "SpeContext offloaded step" : "offloaded layers' copies alone");
  state.counters["offloaded"] = plan.offloaded;
  state.counters["rows_per_step"] = double(stats.rows);
  state.counters["MB_per_step"] = double(stats.bytes) / 1e6;
  state.counters["kept"] = 1.0 - double(stats.rows_per_layer) / (double(batch) * kKvHeads * kBudget);
}
BENCHMARK(BM_SpeContextOffload)
    ->ArgsProduct({{kOffloaded, kCopiesOnly}, {131072}, {1}, {36, 32}, {0}})
    ->ArgsProduct({{kOffloaded, kCopiesOnly}, {131072}, {1}, {36}, {1}})  // the host caches in huge pages
    ->ArgNames({"mode", "N", "batch", "gpu_GB", "huge_pages"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

/// cuda::gather_kv from pinned host memory, one layer's copies: K and V of 8 kv heads x 131072 tokens (268 MB
/// each; cudaMallocHost's, or huge pages), 307 random tokens per kv head per call (SpeContext's offloaded layer at
/// 128K, batch 1: 2456 rows), the same selection every call (fresh 0) or one of 64 (fresh 1: other host pages each
/// call). GB/s: the rows' K and V bytes per call over its GPU time. Against 44 GB/s of a bare gather that reads the
/// same rows each call, it tells whether the copies' rate is the translation of fresh host pages.
void BM_PinnedGather(benchmark::State& state) {
  constexpr std::int32_t kTokens = 131072, kRows = 307, kSelections = 64;
  const bool huge = state.range(0) != 0, fresh = state.range(1) != 0;
  const std::size_t bytes = std::size_t(kKvHeads) * kTokens * kHeadDim * sizeof(bfloat16);
  const PinnedHost k(bytes, huge), v(bytes, huge);
  Device<bfloat16> dst_k(std::size_t(kKvHeads) * kRows * kHeadDim), dst_v(std::size_t(kKvHeads) * kRows * kHeadDim);
  std::vector<std::int32_t> indices(std::size_t(kSelections) * kKvHeads * kRows);
  const std::vector<std::int32_t> counts(std::size_t(kSelections) * kKvHeads, kRows);
  std::mt19937 rng(11);
  for (std::size_t row = 0; row < counts.size(); ++row) {
    std::int32_t* r = indices.data() + row * kRows;
    for (std::int32_t m = 0; m < kRows; ++m) r[m] = std::int32_t(rng() % kTokens);
    std::sort(r, r + kRows);
  }
  Device<std::int32_t> d_indices(indices.size()), d_counts(counts.size());
  KVSIFT_CUDA_CHECK(cudaMemcpy(d_indices.ptr, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(cudaMemcpy(d_counts.ptr, counts.data(), counts.size() * 4, cudaMemcpyHostToDevice));
  const auto src = kvsift::ContiguousKVView<const bfloat16>::packed(k.data(), v.data(), 1, kKvHeads, kTokens, kHeadDim);
  const auto dst = kvsift::ContiguousKVView<bfloat16>::packed(dst_k.ptr, dst_v.ptr, 1, kKvHeads, kRows, kHeadDim);
  const double seconds = time_calls(state, [&](int i, cudaStream_t stream) {
    const std::size_t j = fresh ? std::size_t(i % kSelections) : 0;
    const kvsift::SelectionView selection{d_indices.ptr + j * kKvHeads * kRows, d_counts.ptr + j * kKvHeads, nullptr,
                                          1, kKvHeads, kRows};
    kvsift::cuda::gather_kv(kvsift::KVCache<const bfloat16>(src), selection, kvsift::KVCache<bfloat16>(dst),
                            Cuda{stream});
  });
  state.counters["GB/s"] = seconds > 0 ? 2.0 * kKvHeads * kRows * kHeadDim * sizeof(bfloat16) / seconds / 1e9 : 0.0;
}
BENCHMARK(BM_PinnedGather)
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->ArgNames({"huge_pages", "fresh"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

}  // namespace
