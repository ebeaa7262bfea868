// DecodeStep<S, placement::MiddleOnCpu> with a GPU selector (step/split_step.hpp, A²ATS's §4.3): it appends and
// selects on the GPU, its selection is copied to pinned host memory, the CPU attends it over the pinned host cache
// while the GPU attends the window from the device cache, merged on the GPU. Against the fp64 reference of sparse
// attention over the step's own selection (and its log-weights) and the window, at every step of growing sequences:
// OracleTopK, Quest and a selector writing log-weights, contiguous and paged host caches, GQA groups 1 and 4, fp16 and
// bf16. The device cache's middle V rows are NaN (the GPU attends only the window; the selectors read keys) and the
// host cache's sink rows are NaN (the CPU attends only the selection); the workspace is poisoned once, the outputs
// before each step. Then every refusal.
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
#include "kvsift/step/split_step.hpp"
#include "second_source_check.hpp"

namespace kvsift::test {

// Defined in tests/cuda/test_cuda_second_source.cpp (one definition per program).
template <>
void copy_to_context<cuda::Context>(void* dst, const void* src, std::size_t bytes, const cuda::Context& ctx);

namespace {

// The placement takes selectors of both backends; MiddleOnGpu only CPU ones, at compile time.
template <class S, class P>
concept Placeable = requires { typename DecodeStep<S, P>; };
static_assert(Placeable<OracleTopK<half, cuda::Context>, placement::MiddleOnCpu>);
static_assert(Placeable<OracleTopK<half, cpu::Context>, placement::MiddleOnCpu>);
static_assert(!Placeable<OracleTopK<half, cuda::Context>, placement::MiddleOnGpu>,
              "a GPU selector's middle on the GPU is the local placement");

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
  const KVCache<T> device_cache =
      ContiguousKVView<T>::packed(d_k.data(), d_v.data(), kBatch, kKvHeads, kTokens, kHeadDim, d_lengths.data());
  HostCache<T> host(p, page_size);

  std::vector<float> weights(std::size_t(kBatch) * kKvHeads * kBudget);
  for (float& w : weights) w = rng.uniform(-2.0f, 2.0f);
  const SplitContext split{.gpu = gpu, .cpu = {&pool}};
  const auto run_steps = [&](auto selector) {
    DecodeStep<decltype(selector), placement::MiddleOnCpu> step(std::move(selector), config, split);
    step.prepare({.cache = device_cache, .slots = d_slots.data()}, gpu);
    const SplitBuffers workspace(step.workspace_bytes());
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
      step.run({.q = QueryView<const T>::packed(d_q.data(), kBatch, q_heads, kHeadDim), .cache = device_cache,
                .slots = d_slots.data(), .host_cache = host.at(now)},
               StateView<T>::packed(d_o.data(), d_lse.data(), kBatch, q_heads, kHeadDim), workspace.view(), split);
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());

      const SelectionView got = step.selection(workspace.view());
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
    const StepStats& stats = step.last_step_stats();
    EXPECT_EQ(stats.to_host_bytes,
              rows * 4 * (1 + weight_copies * std::size_t(step.selector().capacity())) + p.q.size() * sizeof(T));
    EXPECT_EQ(stats.to_device_bytes, std::size_t(kBatch) * q_heads * (kHeadDim + 1) * sizeof(float));
    EXPECT_EQ(stats.gathered_kv_bytes, 0u);
    EXPECT_GT(stats.select_seconds, 0.0);
    EXPECT_GT(stats.cpu_attention_seconds, 0.0);
    EXPECT_GE(stats.call_seconds, stats.select_seconds + stats.cpu_attention_seconds);
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
        DecodeStep<Selector, placement::MiddleOnCpu> step(Selector(limits, 8, 2, {}, second, gpu),
                                                          {.attention = {.window = {4, 16}}, .max_batch = 2,
                                                           .q_heads = 4, .kv_heads = 1, .head_dim = 64,
                                                           .max_seq_len = 64},
                                                          SplitContext{.gpu = gpu});
      },
      "DecodeStep<MiddleOnCpu>: the selector (TwoSources) has a second source (second_source_capacity() = 4), which "
      "this placement does not attend: run it with DecodeStep in placement::Local");
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
  const SplitContext split{.gpu = gpu};
  DecodeStep<OracleTopK<T, cuda::Context>, placement::MiddleOnCpu> step(
      OracleTopK<T, cuda::Context>(limits, {.budget = 8}),
      {.attention = {.window = {4, 8}}, .max_batch = kBatch, .q_heads = kQHeads, .kv_heads = kKvHeads,
       .head_dim = kHeadDim, .max_seq_len = 64},
      split);
  const SplitBuffers buffers(step.workspace_bytes());
  const SplitWorkspace workspace = buffers.view();
  HostCache<T> host(p, 0);
  const DeviceBuffer<T> d_k(p.k), d_v(p.v), d_q(p.q);
  const DeviceBuffer<std::int32_t> d_lengths(p.kv_values.seq_lens), d_slots(std::vector<std::int32_t>{0, 1});
  DeviceBuffer<T> d_o(p.q.size());
  DeviceBuffer<float> d_lse(std::size_t(kBatch) * kQHeads);
  const StepInputs<T> in{
      .q = QueryView<const T>::packed(d_q.data(), kBatch, kQHeads, kHeadDim),
      .cache = ContiguousKVView<T>::packed(d_k.data(), d_v.data(), kBatch, kKvHeads, 64, kHeadDim, d_lengths.data()),
      .slots = d_slots.data(),
      .host_cache = host.at(p.kv_values.seq_lens)};
  const auto out = StateView<T>::packed(d_o.data(), d_lse.data(), kBatch, kQHeads, kHeadDim);
  step.prepare({.cache = in.cache, .slots = d_slots.data()}, gpu);
  step.run(in, out, workspace, split);  // the inputs as given are fine
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());

  constexpr const char* where = "DecodeStep<MiddleOnCpu>::run: ";
  const auto refused = [&](const StepInputs<T>& bad, const std::string& message) {
    expect_error([&] { step.run(bad, out, workspace, split); }, message);
  };
  StepInputs<T> one_row = in;
  one_row.q.batch = 1;
  refused(one_row, fmt::format("{}in.q.batch (= 1) must be config.max_batch (= 2)", where));
  StepInputs<T> one_host_row = in;
  one_host_row.host_cache.contiguous.batch = 1;
  refused(one_host_row, fmt::format("{}in.host_cache's batch (= 1) must be the run's (= 2)", where));
  StepInputs<T> one_device_row = in;
  one_device_row.cache.contiguous.batch = 1;
  refused(one_device_row, "in.q.batch (= 2) and in.cache's batch (= 1) must be the run's batch (= 2)");
  StepInputs<T> with_device_views = in;
  with_device_views.device_cache = in.cache;
  refused(with_device_views, "in.q_device or in.device_cache is set: a GPU selector's in.q and in.cache are the device's");
  StepInputs<T> fewer_heads = in;
  fewer_heads.q.heads = 2;
  fewer_heads.q.batch_stride = 2 * fewer_heads.q.head_stride;
  refused(fewer_heads, fmt::format("{}in.q has 2 heads of head_dim 128; the step was planned for 4 and 128", where));
  StepInputs<T> gapped = in;
  gapped.q.batch_stride += 8;
  refused(gapped, fmt::format("{}in.q.batch_stride (= 520) must be heads * head_stride (= 512)", where));
  StepInputs<T> no_slots = in;
  no_slots.slots = nullptr;
  refused(no_slots, fmt::format("{}in.slots is a null pointer", where));
  // The host side and the output, refused before the search changes the selector.
  std::vector<T> pageable_k(p.k), pageable_v(p.v);
  StepInputs<T> pageable = in;
  pageable.host_cache.contiguous.k = pageable_k.data();
  pageable.host_cache.contiguous.v = pageable_v.data();
  expect_error([&] { step.run(pageable, out, workspace, split); },
               {"DecodeStep<MiddleOnCpu>::run: in.host_cache's k (", ") is not pinned host memory"});
  StepInputs<T> other_heads = in;
  other_heads.host_cache.contiguous.kv_heads = kKvHeads + 1;
  refused(other_heads, fmt::format("{}in.host_cache", where));
  auto short_out = out;
  short_out.heads = kQHeads - 1;
  expect_error([&] { step.run(in, short_out, workspace, split); }, fmt::format("{}out is [2, 3, 128]", where));
  std::vector<std::byte> pageable_block(step.workspace_bytes().host + WorkspaceLayout::kAlignment);
  const std::size_t skip = (WorkspaceLayout::kAlignment -
                            reinterpret_cast<std::uintptr_t>(pageable_block.data()) % WorkspaceLayout::kAlignment) %
                           WorkspaceLayout::kAlignment;
  expect_error(
      [&] {
        step.run(in, out, {.device = workspace.device, .host = std::span<std::byte>(pageable_block).subspan(skip)},
                 split);
      },
      {"DecodeStep<MiddleOnCpu>::run: workspace.host's data (", ") is not pinned host memory"});
}

// Refused at construction, before any device work (these run without a GPU).
TEST(GpuSelectStepBadInput, RefusesAnEmptyPlan) {
  const cuda::Context gpu{nullptr};
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 64, .q_heads = 4, .kv_heads = 1, .head_dim = 64};
  const DecodeStepConfig config{.attention = {.window = {4, 16}}, .max_batch = 2, .q_heads = 4, .kv_heads = 1,
                                .head_dim = 64, .max_seq_len = 64};
  DecodeStepConfig no_rows = config;
  no_rows.max_batch = 0;
  using Step = DecodeStep<OracleTopK<half, cuda::Context>, placement::MiddleOnCpu>;
  expect_error([&] { Step step(OracleTopK<half, cuda::Context>(limits, {.budget = 8}), no_rows, SplitContext{.gpu = gpu}); },
               "DecodeStep<MiddleOnCpu>: config.max_batch (= 0) must be positive");
  DecodeStepConfig no_length = config;
  no_length.max_seq_len = 0;
  expect_error(
      [&] { Step step(OracleTopK<half, cuda::Context>(limits, {.budget = 8}), no_length, SplitContext{.gpu = gpu}); },
      "DecodeStep<MiddleOnCpu>: config.max_seq_len (= 0) must be positive");
}

}  // namespace
}  // namespace kvsift::test
