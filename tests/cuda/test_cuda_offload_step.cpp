// DecodeStep<S, placement::MiddleOnGpu> (step/split_step.hpp): a CPU selector over a pinned host cache, its
// selection copied to the GPU, the selected rows gathered there from the pinned host cache, the window attended
// from the device cache, both merged on the GPU. Against the fp64 reference of sparse attention over the step's own
// selection and the window, at every step of growing sequences (the selector's append sees each new token):
// OracleTopK, Quest and CSAttention, contiguous and paged host caches, GQA groups 1 and 4, fp16 and bf16. The
// device cache's middle rows are NaN (only the window may be read there), the workspace is poisoned once and the
// output before each step. Then log-weights and bad rows, and every refusal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/csattention/csattention.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/step/split_step.hpp"
#include "second_source_check.hpp"

namespace kvsift::test {

// Defined in tests/step/test_hybrid_step.cpp (one definition per program): TwoSources on the CPU copies by memcpy.
template <>
void copy_to_context<cpu::Context>(void* dst, const void* src, std::size_t bytes, const cpu::Context&);

namespace {

// The placement takes CPU selectors only, at compile time.
template <class S>
concept Offloadable = requires { typename DecodeStep<S, placement::MiddleOnGpu>; };
static_assert(Offloadable<OracleTopK<half, cpu::Context>>);
static_assert(!Offloadable<OracleTopK<half, cuda::Context>>, "a CUDA selector must not build an offload step");
static_assert(!Offloadable<Quest<bfloat16, cuda::Context>>, "a CUDA selector must not build an offload step");

constexpr AttentionWindow kWindow{.sink = 4, .recent = 32};
constexpr std::int32_t kBatch = 2, kKvHeads = 2, kHeadDim = 128, kTokens = 600, kSteps = 3, kPrefillQueries = 16;

enum class Method { oracle, quest, csattention };
const char* method_name(Method m) {
  return m == Method::oracle ? "OracleTopK" : m == Method::quest ? "Quest" : "CSAttention";
}

class OffloadStep : public GpuTest {};

/// The host cache at the given lengths, in pinned memory the step may read from the GPU: contiguous (the
/// problem's arrays, lengths rewritten per step) or paged (each sequence's first pages of the problem's full page
/// table, rewritten per step).
template <class T>
class PinnedHostCache {
 public:
  PinnedHostCache(const HostDecodeProblem<T>& p, std::int32_t page_size)
      : p_(p), page_size_(page_size), k_(page_size == 0 ? p.k : p.k_pages), v_(page_size == 0 ? p.v : p.v_pages),
        lengths_(p.kv_values.seq_lens), indptr_(page_size == 0 ? std::vector<std::int32_t>{0} : p.paged_values->indptr),
        indices_(page_size == 0 ? std::vector<std::int32_t>{0} : p.paged_values->indices),
        last_(p.kv_values.seq_lens) {}

  /// Sets every sequence's length (the GPU must have finished with the previous step's table).
  KVCache<T> at(const std::vector<std::int32_t>& lengths) {
    std::copy(lengths.begin(), lengths.end(), lengths_.data());
    if (page_size_ == 0) {
      return ContiguousKVView<T>::packed(k_.data(), v_.data(), p_.spec.batch, p_.spec.kv_heads, p_.spec.tokens,
                                         p_.spec.head_dim, lengths_.data());
    }
    const HostPagedKV& full = *p_.paged_values;
    indptr_.data()[0] = 0;
    for (std::size_t b = 0; b < lengths.size(); ++b) {
      const std::int32_t pages = (lengths[b] + page_size_ - 1) / page_size_;
      std::copy_n(full.indices.begin() + full.indptr[b], pages, indices_.data() + indptr_.data()[b]);
      indptr_.data()[b + 1] = indptr_.data()[b] + pages;
      last_.data()[b] = lengths[b] - (pages - 1) * page_size_;
    }
    return p_.writable_paged(k_.data(), v_.data(), indptr_.data(), indices_.data(), last_.data());
  }

 private:
  const HostDecodeProblem<T>& p_;
  std::int32_t page_size_;
  PinnedBuffer<T> k_, v_;
  PinnedBuffer<std::int32_t> lengths_, indptr_, indices_, last_;
};

template <class T>
AnySelector<T, cpu::Context> make_selector(Method method, const SelectorLimits& limits) {
  switch (method) {
    case Method::oracle:
      return AnySelector<T, cpu::Context>(OracleTopK<T, cpu::Context>(limits, {.budget = 48}));
    case Method::quest:
      return AnySelector<T, cpu::Context>(Quest<T, cpu::Context>(limits, {.budget = 64, .page_size = 16}));
    case Method::csattention:
      break;
  }
  return AnySelector<T, cpu::Context>(Csattention<T, cpu::Context>(
      limits, {.centroids = 8, .list_fraction = 0.25, .keep_fraction = 0.2, .overlay_capacity = 64, .prepare_chunk = 16}));
}

template <class T>
void expect_offload_equals_reference(Random& rng, Method method, std::int32_t page_size, std::int32_t group) {
  const std::int32_t q_heads = kKvHeads * group;
  const CaseSpec spec{.batch = kBatch, .q_heads = q_heads, .kv_heads = kKvHeads, .head_dim = kHeadDim,
                      .tokens = kTokens, .k = 0, .page_size = page_size, .log_weights = false,
                      .random_lengths = false};
  SCOPED_TRACE(fmt::format("{} {} {}", method_name(method), dtype_label<T>(), describe(spec)));
  HostDecodeProblem<T> p(rng, spec);
  // Each sequence's prompt, then kSteps decode tokens.
  std::vector<std::int32_t> lengths(kBatch);
  for (auto& l : lengths) l = rng.uniform_int(kTokens / 2, kTokens - kSteps);
  std::vector<std::int32_t> slots(kBatch);
  std::iota(slots.begin(), slots.end(), 0);
  cpu::ThreadPool pool(2);
  const cpu::Context cpu{&pool};
  const SelectorLimits limits{.max_slots = kBatch, .max_tokens = kTokens, .q_heads = q_heads, .kv_heads = kKvHeads,
                              .head_dim = kHeadDim};
  const DecodeStepConfig config{.attention = {.window = kWindow}, .max_batch = kBatch, .q_heads = q_heads,
                                .kv_heads = kKvHeads, .head_dim = kHeadDim, .max_seq_len = kTokens};
  PinnedHostCache<T> host(p, page_size);

  // The device cache: the window's rows are right, the first step's middle (middle at every later step) is NaN.
  std::vector<T> dk = p.k, dv = p.v;
  const T nan = to_storage<T>(std::vector<float>{std::numeric_limits<float>::quiet_NaN()})[0];
  for (std::int32_t b = 0; b < kBatch; ++b) {
    const std::int32_t first = lengths[b] + 1;
    for (std::int32_t h = 0; h < kKvHeads; ++h) {
      for (std::int32_t t = kWindow.sink_end(first); t < kWindow.recent_begin(first); ++t) {
        const std::size_t at = ((std::size_t(b) * kKvHeads + h) * kTokens + t) * kHeadDim;
        std::fill_n(dk.begin() + at, kHeadDim, nan);
        std::fill_n(dv.begin() + at, kHeadDim, nan);
      }
    }
  }
  const DeviceBuffer<T> d_k(dk), d_v(dv);
  DeviceBuffer<std::int32_t> d_lengths(lengths);
  const KVCache<const T> device_cache =
      ContiguousKVView<const T>::packed(d_k.data(), d_v.data(), kBatch, kKvHeads, kTokens, kHeadDim, d_lengths.data());

  const SplitContext split{.cpu = cpu};
  DecodeStep<AnySelector<T, cpu::Context>, placement::MiddleOnGpu> step(make_selector<T>(method, limits), config, split);
  const SplitBuffers workspace(step.workspace_bytes());
  const std::vector<T> prefill_q = to_storage<T>(rng.normal(std::size_t(kBatch) * q_heads * kPrefillQueries * kHeadDim));
  step.prepare({.cache = host.at(lengths), .slots = slots.data(),
                .queries = SequenceView<const T>::packed(prefill_q.data(), kBatch, q_heads, kPrefillQueries, kHeadDim)},
               cpu);
  DeviceBuffer<T> d_q(p.q.size()), d_o(p.q.size());
  DeviceBuffer<float> d_lse(std::size_t(kBatch) * q_heads);
  for (std::int32_t s = 1; s <= kSteps; ++s) {
    SCOPED_TRACE(fmt::format("step {}", s));
    for (auto& l : lengths) ++l;  // the engine wrote the token to both caches
    d_lengths.upload(lengths);
    p.q = to_storage<T>(rng.normal(p.q.size()));
    d_q.upload(p.q);
    d_o.poison();
    d_lse.poison();
    step.run({.q = p.q_view(), .cache = host.at(lengths), .slots = slots.data(),
              .q_device = QueryView<const T>::packed(d_q.data(), kBatch, q_heads, kHeadDim), .device_cache = device_cache},
             StateView<T>::packed(d_o.data(), d_lse.data(), kBatch, q_heads, kHeadDim), workspace.view(), split);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());

    const SelectionView got = step.selection(workspace.view());
    std::size_t selected = 0;
    std::int32_t longest = 0;
    for (std::int32_t r = 0; r < kBatch * kKvHeads; ++r) {
      selected += std::size_t(got.counts[r]);
      longest = std::max(longest, got.counts[r]);
    }
    ASSERT_GT(longest, 0) << "the selector chose nothing: the gather is not exercised";
    const StepStats& stats = step.last_step_stats();
    EXPECT_EQ(stats.gathered_kv_bytes, selected * 2 * kHeadDim * sizeof(T));
    EXPECT_EQ(stats.to_device_bytes, std::size_t(kBatch) * kKvHeads * (1 + std::size_t(longest)) * sizeof(std::int32_t));
    HostState ref(kBatch, q_heads, kHeadDim);
    reference::sparse_decode(p.q_view(),
                             ContiguousKVView<const float>::packed(p.kv_values.k.data(), p.kv_values.v.data(), kBatch,
                                                                   kKvHeads, kTokens, kHeadDim, lengths.data()),
                             got, ref.view, config.attention);
    expect_close<T>(d_o.download(), d_lse.download(), ref, "offload step output");
  }
}

template <class T>
void expect_every_layout_and_group(Random& rng, std::uint64_t seed, Method method) {
  for (const std::int32_t page_size : {0, 16}) {
    for (const std::int32_t group : {1, 4}) {
      SCOPED_TRACE(fmt::format("seed {}", seed));
      expect_offload_equals_reference<T>(rng, method, page_size, group);
    }
  }
}

TEST_F(OffloadStep, OracleTopKEqualsTheReference) {
  expect_every_layout_and_group<half>(rng, seed, Method::oracle);
  expect_every_layout_and_group<bfloat16>(rng, seed, Method::oracle);
}

TEST_F(OffloadStep, QuestEqualsTheReference) {
  expect_every_layout_and_group<half>(rng, seed, Method::quest);
  expect_every_layout_and_group<bfloat16>(rng, seed, Method::quest);
}

TEST_F(OffloadStep, CsattentionEqualsTheReference) {
  expect_every_layout_and_group<half>(rng, seed, Method::csattention);
  expect_every_layout_and_group<bfloat16>(rng, seed, Method::csattention);
}

// A selector's log-weights reach the GPU's attention of the staging rows; a row whose count is -1 gets NaN in O and
// LSE of its query heads after the merge, the other rows the fp64 reference over window, selection and weights.
// fp32 output (a partial for a later merge).
TEST_F(OffloadStep, WeightsAndBadCountRows) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = bfloat16;
  constexpr std::int32_t kQHeads = 8, kBudget = 48;
  HostDecodeProblem<T> p(rng, CaseSpec{.batch = kBatch, .q_heads = kQHeads, .kv_heads = kKvHeads, .head_dim = kHeadDim,
                                       .tokens = kTokens, .k = 0, .page_size = 0, .log_weights = false});
  const std::vector<std::int32_t> slots{1, 0};
  std::vector<float> weights(std::size_t(kBatch) * kKvHeads * kBudget);
  for (float& w : weights) w = rng.uniform(-2.0f, 2.0f);
  const std::int32_t bad_row = rng.uniform_int(0, kBatch * kKvHeads - 1);
  struct MarksARowBad : TwoSources<T, cpu::Context, true, false> {
    MarksARowBad(const TwoSources& inner, std::int32_t row) : TwoSources(inner), bad_row(row) {}
    void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> ws, const cpu::Context& ctx) {
      TwoSources::select(in, out, ws, ctx);
      out.counts[bad_row] = -1;
    }
    std::int32_t bad_row;
  };
  const cpu::Context cpu{};
  const SelectorLimits limits{.max_slots = kBatch, .max_tokens = kTokens, .q_heads = kQHeads, .kv_heads = kKvHeads,
                              .head_dim = kHeadDim};
  const DecodeStepConfig config{.attention = {.window = kWindow}, .max_batch = kBatch, .q_heads = kQHeads,
                                .kv_heads = kKvHeads, .head_dim = kHeadDim, .max_seq_len = kTokens};
  PinnedHostCache<T> host(p, 0);
  const DeviceBuffer<T> d_k(p.k), d_v(p.v), d_q(p.q);
  const DeviceBuffer<std::int32_t> d_lengths(p.kv_values.seq_lens);
  const KVCache<const T> device_cache =
      ContiguousKVView<const T>::packed(d_k.data(), d_v.data(), kBatch, kKvHeads, kTokens, kHeadDim, d_lengths.data());
  const SplitContext split{.cpu = cpu};
  DecodeStep<MarksARowBad, placement::MiddleOnGpu> step(
      MarksARowBad(TwoSources<T, cpu::Context, true, false>(limits, kBudget, kBatch, weights, {}, cpu), bad_row), config,
      split);
  step.prepare({.cache = host.at(p.kv_values.seq_lens), .slots = slots.data()}, cpu);
  const SplitBuffers workspace(step.workspace_bytes());
  DeviceBuffer<float> d_o(p.q.size()), d_lse(std::size_t(kBatch) * kQHeads);
  d_o.poison();
  d_lse.poison();
  step.run({.q = p.q_view(), .cache = host.at(p.kv_values.seq_lens), .slots = slots.data(),
            .q_device = QueryView<const T>::packed(d_q.data(), kBatch, kQHeads, kHeadDim), .device_cache = device_cache},
           StateView<float>::packed(d_o.data(), d_lse.data(), kBatch, kQHeads, kHeadDim), workspace.view(), split);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const SelectionView s = step.selection(workspace.view());
  ASSERT_NE(s.log_weights, nullptr);
  std::vector<std::int32_t> indices(s.indices, s.indices + std::size_t(kBatch) * kKvHeads * kBudget);
  std::vector<std::int32_t> counts(s.counts, s.counts + kBatch * kKvHeads);
  ASSERT_EQ(counts[std::size_t(bad_row)], -1);
  counts[std::size_t(bad_row)] = 0;  // the reference of the other rows
  const HostState ref = two_source_reference<T>(p.q, kQHeads, p.kv_values, kWindow, indices, counts, kBudget, &weights,
                                                nullptr, slots, 1.0 / std::sqrt(double(kHeadDim)));
  const std::vector<float> o = d_o.download(), lse = d_lse.download();
  // 4e-3: the GPU kernel rounds the probabilities to bf16 for the P.V product (relative 2^-9); 1e-3 failed one
  // seed by 1.1e-3 on the H100 (2026-11-27), as the hybrid step's test allows 5e-3.
  expect_state_with_bad_row(o, lse, ref, kBatch * kQHeads, kQHeads / kKvHeads, kHeadDim, bad_row, 4e-3f);
}

// run() refuses inputs whose batches disagree or exceed the plan, a pool larger than the planned one, and a host
// cache the GPU cannot read, naming them, before any work.
TEST_F(OffloadStep, RefusesMismatchedInputs) {
  using T = half;
  constexpr std::int32_t kQHeads = 4;
  HostDecodeProblem<T> p(rng, CaseSpec{.batch = kBatch, .q_heads = kQHeads, .kv_heads = kKvHeads, .head_dim = kHeadDim,
                                       .tokens = 64, .k = 0, .page_size = 0, .log_weights = false});
  const std::vector<std::int32_t> slots{0, 1};
  const cpu::Context cpu{};
  const SelectorLimits limits{.max_slots = kBatch, .max_tokens = 64, .q_heads = kQHeads, .kv_heads = kKvHeads,
                              .head_dim = kHeadDim};
  const SplitContext split{.cpu = cpu};
  DecodeStep<OracleTopK<T, cpu::Context>, placement::MiddleOnGpu> step(
      OracleTopK<T, cpu::Context>(limits, {.budget = 8}),
      {.attention = {.window = {4, 8}}, .max_batch = kBatch, .q_heads = kQHeads, .kv_heads = kKvHeads,
       .head_dim = kHeadDim, .max_seq_len = 64},
      split);
  const SplitBuffers buffers(step.workspace_bytes());
  const SplitWorkspace workspace = buffers.view();
  PinnedHostCache<T> host(p, 0);
  const DeviceBuffer<T> d_k(p.k), d_v(p.v), d_q(p.q);
  const DeviceBuffer<std::int32_t> d_lengths(p.kv_values.seq_lens);
  DeviceBuffer<T> d_o(p.q.size());
  DeviceBuffer<float> d_lse(std::size_t(kBatch) * kQHeads);
  const StepInputs<T> in{
      .q = p.q_view(),
      .cache = host.at(p.kv_values.seq_lens),
      .slots = slots.data(),
      .q_device = QueryView<const T>::packed(d_q.data(), kBatch, kQHeads, kHeadDim),
      .device_cache = ContiguousKVView<const T>::packed(d_k.data(), d_v.data(), kBatch, kKvHeads, 64, kHeadDim,
                                                        d_lengths.data())};
  const auto out = StateView<T>::packed(d_o.data(), d_lse.data(), kBatch, kQHeads, kHeadDim);
  step.prepare({.cache = in.cache, .slots = slots.data()}, cpu);
  step.run(in, out, workspace, split);  // the inputs as given are fine
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());

  StepInputs<T> one_device_row = in;
  one_device_row.q_device.batch = 1;
  expect_error([&] { step.run(one_device_row, out, workspace, split); },
               "DecodeStep<MiddleOnGpu>::run: in.q_device.batch (= 1) and in.device_cache's batch (= 2) must be the "
               "run's batch (= 2)");
  StepInputs<T> short_device_cache = in;
  short_device_cache.device_cache.contiguous.batch = 1;
  expect_error([&] { step.run(short_device_cache, out, workspace, split); },
               "in.q_device.batch (= 2) and in.device_cache's batch (= 1) must be the run's batch (= 2)");
  StepInputs<T> three_rows = in;
  three_rows.q.batch = 3;
  expect_error([&] { step.run(three_rows, out, workspace, split); },
               "DecodeStep<MiddleOnGpu>::run: in.q.batch (= 3) is outside [1, config.max_batch = 2]");
  StepInputs<T> with_token = in;
  with_token.k = HeadsView<const T>::packed(d_q.data(), kBatch, kKvHeads, kHeadDim);
  expect_error([&] { step.run(with_token, out, workspace, split); },
               "DecodeStep<MiddleOnGpu>::run: in.k or in.v is set: a split step reads caches the engine has written "
               "the step's token to");
  StepInputs<T> with_host_cache = in;
  with_host_cache.host_cache = in.cache;
  expect_error([&] { step.run(with_host_cache, out, workspace, split); },
               "in.host_cache is set: a CPU selector's host cache is in.cache, its device cache in.device_cache");

  cpu::ThreadPool pool(2);
  expect_error([&] { step.run(in, out, workspace, SplitContext{.cpu = cpu::Context{&pool}}); },
               "DecodeStep<MiddleOnGpu>::run: the context has 2 threads, the step was planned for 1");

  // The problem's own host vectors: pageable, which the GPU cannot read; and a pageable host block.
  std::vector<T> pageable_k = p.k, pageable_v = p.v;
  StepInputs<T> pageable = in;
  pageable.cache = ContiguousKVView<T>::packed(pageable_k.data(), pageable_v.data(), kBatch, kKvHeads, 64, kHeadDim,
                                               host.at(p.kv_values.seq_lens).contiguous.seq_lens);
  expect_error([&] { step.run(pageable, out, workspace, split); },
               {"DecodeStep<MiddleOnGpu>::run: in.cache's k (", ") is not pinned host memory"});
  cpu::Array<std::byte> pageable_block(step.workspace_bytes().host);
  expect_error([&] { step.run(in, out, {.device = workspace.device, .host = pageable_block.bytes()}, split); },
               {"DecodeStep<MiddleOnGpu>::run: workspace.host's data (", ") is not pinned host memory"});
  expect_error([&] { step.run(in, out, {.device = workspace.device.first(64), .host = workspace.host}, split); },
               "workspace too small");
}

// Refused at construction, before any device work (these run without a GPU): a selector with a second source, and
// a configuration without rows or lengths.
TEST(OffloadStepBadInput, ASelectorWithASecondSourceIsRefused) {
  Random rng(test_seed());
  const cpu::Context cpu{};
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 64, .q_heads = 4, .kv_heads = 1, .head_dim = 64};
  const HostKV kv(rng, 2, 1, 64, 64);
  const std::vector<std::int32_t> slots{0, 1};
  const SecondSourceData<half> second = make_second_source<half>(rng, kv, slots, 2, 2, 4);
  using Selector = TwoSources<half, cpu::Context, false, true>;
  expect_error(
      [&] {
        DecodeStep<Selector, placement::MiddleOnGpu> step(Selector(limits, 8, 2, {}, second, cpu),
                                                          {.attention = {.window = {4, 16}}, .max_batch = 2,
                                                           .q_heads = 4, .kv_heads = 1, .head_dim = 64,
                                                           .max_seq_len = 64},
                                                          SplitContext{.cpu = cpu});
      },
      "DecodeStep<MiddleOnGpu>: the selector (TwoSources) has a second source (second_source_capacity() = 4), which "
      "this placement does not attend: run it with DecodeStep in placement::Local");
}

TEST(OffloadStepBadInput, RefusesAnEmptyPlan) {
  const cpu::Context cpu{};
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 64, .q_heads = 4, .kv_heads = 1, .head_dim = 64};
  const DecodeStepConfig config{.attention = {.window = {4, 16}}, .max_batch = 2, .q_heads = 4, .kv_heads = 1,
                                .head_dim = 64, .max_seq_len = 64};
  DecodeStepConfig no_rows = config;
  no_rows.max_batch = 0;
  using Step = DecodeStep<OracleTopK<half, cpu::Context>, placement::MiddleOnGpu>;
  const SplitContext split{.cpu = cpu};
  expect_error([&] { Step step(OracleTopK<half, cpu::Context>(limits, {.budget = 8}), no_rows, split); },
               "DecodeStep<MiddleOnGpu>: config.max_batch (= 0) must be positive");
  DecodeStepConfig no_length = config;
  no_length.max_seq_len = 0;
  expect_error([&] { Step step(OracleTopK<half, cpu::Context>(limits, {.budget = 8}), no_length, split); },
               "DecodeStep<MiddleOnGpu>: config.max_seq_len (= 0) must be positive");
}

}  // namespace
}  // namespace kvsift::test
