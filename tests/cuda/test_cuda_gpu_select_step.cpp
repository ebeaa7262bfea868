// The GPU-select / CPU-attend placement (step/gpu_select_step.hpp, A²ATS's §4.3): a CUDA selector appends and
// selects on the GPU, its selection is copied to pinned host memory, the CPU attends it over the pinned host cache
// while the GPU attends the window from the device cache, merged on the GPU. Against the fp64 reference of sparse
// attention over the step's own selection (and its log-weights) and the window, at every step of growing sequences:
// OracleTopK, Quest and a selector writing log-weights, contiguous and paged host caches, GQA groups 1 and 4, fp16 and
// bf16. The device cache's middle V rows are NaN (the GPU attends only the window; the selectors read keys) and the
// host cache's sink rows are NaN (the CPU attends only the selection); outputs are poisoned before each step. Then
// every refusal.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/step/gpu_select_step.hpp"
#include "second_source_check.hpp"

namespace kvsift::test {

// Defined in tests/cuda/test_cuda_second_source.cpp (one definition per program).
template <>
void copy_to_context<cuda::Context>(void* dst, const void* src, std::size_t bytes, const cuda::Context& ctx);

namespace {

// The placement takes CUDA selectors only, at compile time.
template <class S>
concept GpuSelectable = requires { typename GpuSelectHybridStep<S>; };
static_assert(GpuSelectable<OracleTopK<half, cuda::Context>>);
static_assert(!GpuSelectable<OracleTopK<half, cpu::Context>>, "a CPU selector must not build a GPU-select step");

constexpr AttentionWindow kWindow{.sink = 4, .recent = 32};
constexpr std::int32_t kBatch = 2, kKvHeads = 2, kHeadDim = 128, kTokens = 640, kSteps = 3, kBudget = 48;

enum class Method { oracle, quest, weighted };
const char* method_name(Method m) {
  return m == Method::oracle ? "OracleTopK" : m == Method::quest ? "Quest" : "OracleTopK with log-weights";
}

/// The pinned host cache at the given lengths: contiguous (the problem's rows, its lengths rewritten per step) or
/// paged (each sequence's first pages of the problem's page table, rewritten per step). The sink rows are NaN.
template <class T>
class HostCache {
 public:
  HostCache(const HostDecodeProblem<T>& p, std::int32_t page_size)
      : p_(p), page_size_(page_size), k_(with_nan_sinks(p, page_size == 0 ? p.k : p.k_pages)),
        v_(with_nan_sinks(p, page_size == 0 ? p.v : p.v_pages)), lengths_(p.kv_values.seq_lens) {}

  KVCache<const T> at(const std::vector<std::int32_t>& lengths) {
    lengths_ = lengths;
    if (page_size_ == 0) {
      return ContiguousKVView<const T>::packed(k_.data(), v_.data(), p_.spec.batch, p_.spec.kv_heads, p_.spec.tokens,
                                               p_.spec.head_dim, lengths_.data());
    }
    const HostPagedKV& full = *p_.paged_values;
    indptr_.assign(1, 0);
    indices_.clear();
    last_.clear();
    for (std::size_t b = 0; b < lengths.size(); ++b) {
      const std::int32_t pages = (lengths[b] + page_size_ - 1) / page_size_;
      indices_.insert(indices_.end(), full.indices.begin() + full.indptr[b], full.indices.begin() + full.indptr[b] + pages);
      indptr_.push_back(indptr_.back() + pages);
      last_.push_back(lengths[b] - (pages - 1) * page_size_);
    }
    return p_.paged(k_.data(), v_.data(), indptr_.data(), indices_.data(), last_.data());
  }

 private:
  std::vector<T> with_nan_sinks(const HostDecodeProblem<T>& p, std::vector<T> rows) const {
    const T nan = from_float<T>(std::numeric_limits<float>::quiet_NaN());
    const KVCache<const T> layout = page_size_ == 0 ? KVCache<const T>(p.contiguous()) : KVCache<const T>(p.paged());
    for (std::int32_t b = 0; b < p.spec.batch; ++b) {
      for (std::int32_t h = 0; h < p.spec.kv_heads; ++h) {
        for (std::int32_t t = 0; t < kWindow.sink; ++t) {
          const T* row = layout.k_row(b, h, t);
          const std::ptrdiff_t at = row - (page_size_ == 0 ? p.k.data() : p.k_pages.data());
          std::fill_n(rows.begin() + at, p.spec.head_dim, nan);
        }
      }
    }
    return rows;
  }

  const HostDecodeProblem<T>& p_;
  std::int32_t page_size_;
  PinnedBuffer<T> k_, v_;
  std::vector<std::int32_t> lengths_, indptr_, indices_, last_;
};

template <class T>
void expect_step_equals_reference(Random& rng, Method method, std::int32_t page_size, std::int32_t group) {
  const std::int32_t q_heads = kKvHeads * group;
  const CaseSpec spec{.batch = kBatch, .q_heads = q_heads, .kv_heads = kKvHeads, .head_dim = kHeadDim,
                      .tokens = kTokens, .k = 0, .page_size = page_size, .log_weights = false,
                      .random_lengths = false};
  SCOPED_TRACE(fmt::format("{} {} {}", method_name(method), dtype_label<T>(), describe(spec)));
  HostDecodeProblem<T> p(rng, spec);
  std::vector<std::int32_t> lengths(kBatch);
  for (auto& l : lengths) l = rng.uniform_int(kTokens / 2, kTokens - kSteps);
  const std::vector<std::int32_t> slots{1, 0};
  const SelectorLimits limits{.max_slots = kBatch, .max_tokens = kTokens, .q_heads = q_heads, .kv_heads = kKvHeads,
                              .head_dim = kHeadDim};
  const DecodeStepConfig config{.attention = {.window = kWindow}, .max_batch = kBatch, .q_heads = q_heads,
                                .kv_heads = kKvHeads, .head_dim = kHeadDim, .max_seq_len = kTokens};
  cpu::ThreadPool pool(2);
  const cuda::Context gpu{nullptr};

  // The device cache: every key (the selectors read them), V only in the window (the first step's middle is NaN,
  // and stays middle as the sequences grow).
  std::vector<T> dv = p.v;
  const T nan = from_float<T>(std::numeric_limits<float>::quiet_NaN());
  for (std::int32_t b = 0; b < kBatch; ++b) {
    const std::int32_t first = lengths[b] + 1;
    for (std::int32_t h = 0; h < kKvHeads; ++h) {
      for (std::int32_t t = kWindow.sink_end(first); t < kWindow.recent_begin(first); ++t) {
        std::fill_n(dv.begin() + ((std::size_t(b) * kKvHeads + h) * kTokens + t) * kHeadDim, kHeadDim, nan);
      }
    }
  }
  const DeviceBuffer<T> d_k(p.k), d_v(dv);
  DeviceBuffer<std::int32_t> d_lengths(lengths);
  const DeviceBuffer<std::int32_t> d_slots(slots);
  const KVCache<const T> device_cache =
      ContiguousKVView<const T>::packed(d_k.data(), d_v.data(), kBatch, kKvHeads, kTokens, kHeadDim, d_lengths.data());
  HostCache<T> host(p, page_size);

  std::vector<float> weights(std::size_t(kBatch) * kKvHeads * kBudget);
  for (float& w : weights) w = rng.uniform(-2.0f, 2.0f);
  const auto run_steps = [&](auto selector) {
    GpuSelectHybridStep step(std::move(selector), config, gpu, &pool);
    step.prepare({.cache = device_cache, .slots = d_slots.data()}, gpu);
    DeviceBuffer<T> d_q(p.q.size()), d_o(p.q.size());
    DeviceBuffer<float> d_lse(std::size_t(kBatch) * q_heads);
    for (std::int32_t s = 1; s <= kSteps; ++s) {
      SCOPED_TRACE(fmt::format("step {}", s));
      std::vector<std::int32_t> now = lengths;
      for (auto& l : now) l += s;  // the engine wrote the token to both caches
      d_lengths.upload(now);
      p.q = to_storage<T>(rng.normal(p.q.size()));
      d_q.upload(p.q);
      d_o.poison();
      d_lse.poison();
      step.run({.q = QueryView<const T>::packed(d_q.data(), kBatch, q_heads, kHeadDim), .device_cache = device_cache,
                .host_cache = host.at(now), .slots = d_slots.data()},
               StateView<T>::packed(d_o.data(), d_lse.data(), kBatch, q_heads, kHeadDim), gpu);
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());

      const SelectionView got = step.selection();
      const auto full = ContiguousKVView<const float>::packed(p.kv_values.k.data(), p.kv_values.v.data(), kBatch,
                                                              kKvHeads, kTokens, kHeadDim, now.data());
      check_selection_contents(got, full, "test", "the step's selection", /*refuse_duplicates=*/true, kWindow);
      const std::int32_t longest = *std::max_element(got.counts, got.counts + kBatch * kKvHeads);
      ASSERT_GT(longest, 0) << "the selector chose nothing: the CPU's part is not exercised";
      EXPECT_EQ(got.log_weights != nullptr, method == Method::weighted);
      HostState ref(kBatch, q_heads, kHeadDim);
      reference::sparse_decode(p.q_view(), full, got, ref.view, config.attention);
      expect_close<T>(d_o.download(), d_lse.download(), ref, "GPU-select step output");
    }
    const std::size_t rows = std::size_t(kBatch) * kKvHeads, weight_copies = method == Method::weighted ? 2 : 1;
    EXPECT_EQ(step.bytes_per_step().to_host,
              rows * 4 * (1 + weight_copies * std::size_t(step.selector().capacity())) + p.q.size() * sizeof(T));
    EXPECT_EQ(step.bytes_per_step().to_device, std::size_t(kBatch) * q_heads * (kHeadDim + 1) * sizeof(float));
    const GpuSelectStepTimes& times = step.last_step_times();
    EXPECT_GT(times.select, 0.0);
    EXPECT_GT(times.cpu_attention, 0.0);
    EXPECT_GE(times.total, times.select + times.cpu_attention);
  };
  switch (method) {
    case Method::oracle:
      run_steps(OracleTopK<T, cuda::Context>(limits, {.budget = kBudget}));
      break;
    case Method::quest:
      run_steps(Quest<T, cuda::Context>(limits, {.budget = 64, .page_size = 16}));
      break;
    case Method::weighted:
      run_steps(TwoSources<T, cuda::Context, true, false>(limits, kBudget, kBatch, weights, {}, gpu));
      break;
  }
}

class GpuSelectStep : public GpuTest {};

template <class T>
void expect_every_layout_and_group(Random& rng, std::uint64_t seed, Method method) {
  for (const std::int32_t page_size : {0, 16}) {
    for (const std::int32_t group : {1, 4}) {
      SCOPED_TRACE(fmt::format("seed {}", seed));
      expect_step_equals_reference<T>(rng, method, page_size, group);
    }
  }
}

TEST_F(GpuSelectStep, OracleTopKEqualsTheReference) {
  expect_every_layout_and_group<half>(rng, seed, Method::oracle);
  expect_every_layout_and_group<bfloat16>(rng, seed, Method::oracle);
}

TEST_F(GpuSelectStep, QuestEqualsTheReference) {
  expect_every_layout_and_group<half>(rng, seed, Method::quest);
  expect_every_layout_and_group<bfloat16>(rng, seed, Method::quest);
}

TEST_F(GpuSelectStep, LogWeightsReachTheCpu) {
  expect_every_layout_and_group<bfloat16>(rng, seed, Method::weighted);
}

// A selector with a second source is refused at construction (its rows would need a third partial).
TEST_F(GpuSelectStep, ASelectorWithASecondSourceIsRefused) {
  const cuda::Context gpu{nullptr};
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 64, .q_heads = 4, .kv_heads = 1, .head_dim = 64};
  const HostKV kv(rng, 2, 1, 64, 64);
  const std::vector<std::int32_t> slots{0, 1};
  const SecondSourceData<half> second = make_second_source<half>(rng, kv, slots, 2, 2, 4);
  using Selector = TwoSources<half, cuda::Context, false, true>;
  expect_error(
      [&] {
        GpuSelectHybridStep step(Selector(limits, 8, 2, {}, second, gpu),
                                 {.attention = {.window = {4, 16}}, .max_batch = 2, .q_heads = 4, .kv_heads = 1,
                                  .head_dim = 64, .max_seq_len = 64},
                                 gpu);
      },
      "GpuSelectHybridStep: the selector (TwoSources) has a second source (second_source_capacity() = 4), which this "
      "placement does not attend: run it with DecodeStep on the GPU");
}

// run() refuses inputs whose batches differ from the plan, a query of other heads or with uneven head rows, and no
// slots, naming them, before any work.
TEST_F(GpuSelectStep, RefusesMismatchedInputs) {
  using T = half;
  constexpr std::int32_t kQHeads = 4;
  HostDecodeProblem<T> p(rng, CaseSpec{.batch = kBatch, .q_heads = kQHeads, .kv_heads = kKvHeads, .head_dim = kHeadDim,
                                       .tokens = 64, .k = 0, .page_size = 0, .log_weights = false});
  const cuda::Context gpu{nullptr};
  const SelectorLimits limits{.max_slots = kBatch, .max_tokens = 64, .q_heads = kQHeads, .kv_heads = kKvHeads,
                              .head_dim = kHeadDim};
  GpuSelectHybridStep step(OracleTopK<T, cuda::Context>(limits, {.budget = 8}),
                           {.attention = {.window = {4, 8}}, .max_batch = kBatch, .q_heads = kQHeads,
                            .kv_heads = kKvHeads, .head_dim = kHeadDim, .max_seq_len = 64},
                           gpu);
  HostCache<T> host(p, 0);
  const DeviceBuffer<T> d_k(p.k), d_v(p.v), d_q(p.q);
  const DeviceBuffer<std::int32_t> d_lengths(p.kv_values.seq_lens), d_slots(std::vector<std::int32_t>{0, 1});
  DeviceBuffer<T> d_o(p.q.size());
  DeviceBuffer<float> d_lse(std::size_t(kBatch) * kQHeads);
  const GpuSelectStepInputs<T> in{
      .q = QueryView<const T>::packed(d_q.data(), kBatch, kQHeads, kHeadDim),
      .device_cache = ContiguousKVView<const T>::packed(d_k.data(), d_v.data(), kBatch, kKvHeads, 64, kHeadDim,
                                                        d_lengths.data()),
      .host_cache = host.at(p.kv_values.seq_lens),
      .slots = d_slots.data()};
  const auto out = StateView<T>::packed(d_o.data(), d_lse.data(), kBatch, kQHeads, kHeadDim);
  step.prepare({.cache = in.device_cache, .slots = d_slots.data()}, gpu);
  step.run(in, out, gpu);  // the inputs as given are fine
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());

  GpuSelectStepInputs<T> one_row = in;
  one_row.q.batch = 1;
  expect_error([&] { step.run(one_row, out, gpu); },
               "GpuSelectHybridStep::run: in.q.batch (= 1) and the caches' batches (device 2, host 2) must be "
               "config.max_batch (= 2)");
  GpuSelectStepInputs<T> one_host_row = in;
  one_host_row.host_cache.contiguous.batch = 1;
  expect_error([&] { step.run(one_host_row, out, gpu); }, "the caches' batches (device 2, host 1)");
  GpuSelectStepInputs<T> fewer_heads = in;
  fewer_heads.q.heads = 2;
  expect_error([&] { step.run(fewer_heads, out, gpu); },
               "GpuSelectHybridStep::run: in.q has 2 heads of head_dim 128; the step was planned for 4 and 128");
  GpuSelectStepInputs<T> gapped = in;
  gapped.q.batch_stride += 8;
  expect_error([&] { step.run(gapped, out, gpu); },
               "GpuSelectHybridStep::run: in.q.batch_stride (= 520) must be heads * head_stride (= 512)");
  GpuSelectStepInputs<T> no_slots = in;
  no_slots.slots = nullptr;
  expect_error([&] { step.run(no_slots, out, gpu); }, "GpuSelectHybridStep::run: in.slots is a null pointer");
  // The host side and the output, refused before the search changes the selector.
  std::vector<T> pageable_k(p.k), pageable_v(p.v);
  GpuSelectStepInputs<T> pageable = in;
  pageable.host_cache.contiguous.k = pageable_k.data();
  pageable.host_cache.contiguous.v = pageable_v.data();
  expect_error([&] { step.run(pageable, out, gpu); },
               {"GpuSelectHybridStep::run: in.host_cache's k (", ") is not pinned host memory"});
  GpuSelectStepInputs<T> other_heads = in;
  other_heads.host_cache.contiguous.kv_heads = kKvHeads + 1;
  expect_error([&] { step.run(other_heads, out, gpu); }, "GpuSelectHybridStep::run: in.host_cache");
  auto short_out = out;
  short_out.heads = kQHeads - 1;
  expect_error([&] { step.run(in, short_out, gpu); }, "GpuSelectHybridStep::run: out is [2, 3, 128]");
}

// Refused at construction, before any device work (these run without a GPU).
TEST(GpuSelectStepBadInput, RefusesAnEmptyPlan) {
  const cuda::Context gpu{nullptr};
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 64, .q_heads = 4, .kv_heads = 1, .head_dim = 64};
  const DecodeStepConfig config{.attention = {.window = {4, 16}}, .max_batch = 2, .q_heads = 4, .kv_heads = 1,
                                .head_dim = 64, .max_seq_len = 64};
  DecodeStepConfig no_rows = config;
  no_rows.max_batch = 0;
  expect_error([&] { GpuSelectHybridStep step(OracleTopK<half, cuda::Context>(limits, {.budget = 8}), no_rows, gpu); },
               "GpuSelectHybridStep: config.max_batch (= 0) must be positive");
  DecodeStepConfig no_length = config;
  no_length.max_seq_len = 0;
  expect_error(
      [&] { GpuSelectHybridStep step(OracleTopK<half, cuda::Context>(limits, {.budget = 8}), no_length, gpu); },
      "GpuSelectHybridStep: config.max_seq_len (= 0) must be positive");
}

}  // namespace
}  // namespace kvsift::test
