// DecodeStep<S, placement::MiddleOnCpu> with a CPU selector: the selector over a pinned host cache, the window
// attended on the GPU, the selection on the CPU, merged on the GPU. Against the local placement of the same selector
// on the same data: the same selection bit for bit (the same CPU code), and an output that is the fp64 reference's
// over window and selection; contiguous and paged host caches; a poisoned workspace.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/step/decode_step.hpp"
#include "kvsift/step/split_step.hpp"
#include "second_source_check.hpp"
#include "selector_check.hpp"

namespace kvsift::test {

template <>
void copy_to_context<cpu::Context>(void* dst, const void* src, std::size_t bytes, const cpu::Context&) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

namespace {

class HybridStep : public GpuTest {};

template <template <class, class> class Selector, class Config>
void expect_hybrid_equals_cpu_placement(Random& rng, std::int32_t page_size, const Config& selector_config) {
  using T = bfloat16;
  const CaseSpec spec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128, .tokens = 900, .k = 0,
                      .page_size = page_size, .log_weights = false};
  SCOPED_TRACE(describe(spec));
  HostDecodeProblem<T> p(rng, spec);
  std::vector<std::int32_t> slots(spec.batch);
  std::iota(slots.begin(), slots.end(), 0);
  const SelectorLimits limits{.max_slots = spec.batch, .max_tokens = spec.tokens, .q_heads = spec.q_heads,
                              .kv_heads = spec.kv_heads, .head_dim = spec.head_dim};
  const DecodeStepConfig config{.attention = {.window = {4, 64}}, .max_batch = spec.batch, .q_heads = spec.q_heads,
                                .kv_heads = spec.kv_heads, .head_dim = spec.head_dim, .max_seq_len = spec.tokens};
  const cpu::Context cpu{};
  // The host cache, pinned: the problem's contiguous or paged arrays.
  const PinnedBuffer<T> host_k(page_size == 0 ? p.k : p.k_pages), host_v(page_size == 0 ? p.v : p.v_pages);
  const KVCache<T> host_cache =
      page_size == 0
          ? KVCache<T>(ContiguousKVView<T>::packed(host_k.data(), host_v.data(), spec.batch, spec.kv_heads, spec.tokens,
                                                   spec.head_dim, p.kv_values.seq_lens.data()))
          : KVCache<T>(p.writable_paged(host_k.data(), host_v.data(), p.paged_values->indptr.data(),
                                        p.paged_values->indices.data(), p.paged_values->last_len.data()));
  // The device cache: every row (the decoder reads the window's only).
  const DeviceBuffer<T> d_k(p.k), d_v(p.v), d_q(p.q);
  const DeviceBuffer<std::int32_t> d_lengths(p.kv_values.seq_lens);
  const KVCache<const T> device_cache = ContiguousKVView<const T>::packed(
      d_k.data(), d_v.data(), spec.batch, spec.kv_heads, spec.tokens, spec.head_dim, d_lengths.data());

  // The CPU placement: the expected selection.
  DecodeStep cpu_step(Selector<T, cpu::Context>(limits, selector_config), config, cpu);
  cpu_step.prepare({.cache = host_cache, .slots = slots.data()}, cpu);
  cpu::Array<std::byte> workspace(cpu_step.workspace_bytes());
  std::vector<T> o_cpu(std::size_t(spec.batch) * spec.q_heads * spec.head_dim);
  std::vector<float> lse_cpu(std::size_t(spec.batch) * spec.q_heads);
  std::vector<T> k_copy = page_size == 0 ? p.k : p.k_pages, v_copy = page_size == 0 ? p.v : p.v_pages;
  const KVCache<T> mutable_host =
      page_size == 0
          ? KVCache<T>(ContiguousKVView<T>::packed(k_copy.data(), v_copy.data(), spec.batch, spec.kv_heads, spec.tokens,
                                                   spec.head_dim, p.kv_values.seq_lens.data()))
          : [&] {
              auto v = p.paged(k_copy.data(), v_copy.data(), p.paged_values->indptr.data(), p.paged_values->indices.data(),
                               p.paged_values->last_len.data());
              return KVCache<T>(PagedKVView<T>{k_copy.data(), v_copy.data(), v.page_indptr, v.page_indices, v.last_page_len,
                                               v.batch, v.kv_heads, v.head_dim, v.page_size, v.num_pages, v.page_stride,
                                               v.token_stride, v.head_stride});
            }();
  cpu_step.run(StepInputs<T>{.q = p.q_view(), .cache = mutable_host, .slots = slots.data()},
               StateView<T>::packed(o_cpu.data(), lse_cpu.data(), spec.batch, spec.q_heads, spec.head_dim),
               workspace.bytes(), cpu);
  const SelectionView want = cpu_step.selection(workspace.bytes(), spec.batch);

  // The split placement.
  const SplitContext split{.cpu = cpu};
  DecodeStep<Selector<T, cpu::Context>, placement::MiddleOnCpu> hybrid(Selector<T, cpu::Context>(limits, selector_config),
                                                                       config, split);
  hybrid.prepare({.cache = host_cache, .slots = slots.data()}, cpu);
  const SplitBuffers hybrid_workspace(hybrid.workspace_bytes());
  DeviceBuffer<T> d_o(o_cpu.size());
  DeviceBuffer<float> d_lse(lse_cpu.size());
  d_o.poison();
  d_lse.poison();
  hybrid.run({.q = p.q_view(), .cache = host_cache, .slots = slots.data(),
              .q_device = QueryView<const T>::packed(d_q.data(), spec.batch, spec.q_heads, spec.head_dim),
              .device_cache = device_cache},
             StateView<T>::packed(d_o.data(), d_lse.data(), spec.batch, spec.q_heads, spec.head_dim),
             hybrid_workspace.view(), split);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const SelectionView got = hybrid.selection(hybrid_workspace.view());
  for (std::int32_t r = 0; r < spec.batch * spec.kv_heads; ++r) {
    ASSERT_EQ(got.counts[r], want.counts[r]) << "row " << r;
    for (std::int32_t i = 0; i < got.counts[r]; ++i) {
      ASSERT_EQ(got.indices[std::size_t(r) * got.capacity + i], want.indices[std::size_t(r) * want.capacity + i])
          << "row " << r << " entry " << i;
    }
  }
  HostState ref(spec.batch, spec.q_heads, spec.head_dim);
  reference::sparse_decode(p.q_view(), p.kv_values.view(), got, ref.view, config.attention);
  expect_close<T>(d_o.download(), d_lse.download(), ref, "hybrid step output");
}

TEST_F(HybridStep, QuestEqualsTheCpuPlacement) {
  for (const std::int32_t page_size : {0, 16}) {
    SCOPED_TRACE(fmt::format("seed {} page_size {}", seed, page_size));
    expect_hybrid_equals_cpu_placement<Quest>(rng, page_size, QuestConfig{.budget = 256, .page_size = 16});
  }
}

TEST_F(HybridStep, OracleTopKEqualsTheCpuPlacement) {
  for (const std::int32_t page_size : {0, 16}) {
    SCOPED_TRACE(fmt::format("seed {} page_size {}", seed, page_size));
    expect_hybrid_equals_cpu_placement<OracleTopK>(rng, page_size, OracleTopKConfig{.budget = 128});
  }
}

// A selector's log-weights reach the CPU's attention of the selection; a row whose count a primitive marked -1
// (here: the selector's wrapper) gets NaN in O and LSE of its query heads after the merge, the other rows the
// fp64 reference over window, selection and weights. The output starts at 0, so a row left unwritten fails.
TEST_F(HybridStep, WeightsAndBadCountRows) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = half;
  constexpr std::int32_t kBatch = 3, kQHeads = 8, kKvHeads = 2, kHeadDim = 128, kTokens = 800, kBudget = 48;
  HostDecodeProblem<T> p(rng, CaseSpec{.batch = kBatch, .q_heads = kQHeads, .kv_heads = kKvHeads, .head_dim = kHeadDim,
                                       .tokens = kTokens, .k = 0, .page_size = 0, .log_weights = false});
  const std::vector<std::int32_t> slots{1, 2, 0};
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
  const DecodeStepConfig config{.attention = {.window = {4, 16}}, .max_batch = kBatch, .q_heads = kQHeads,
                                .kv_heads = kKvHeads, .head_dim = kHeadDim, .max_seq_len = kTokens};
  const PinnedBuffer<T> host_k(p.k), host_v(p.v);
  const KVCache<T> host_cache = ContiguousKVView<T>::packed(host_k.data(), host_v.data(), kBatch, kKvHeads, kTokens,
                                                            kHeadDim, p.kv_values.seq_lens.data());
  const DeviceBuffer<T> d_k(p.k), d_v(p.v), d_q(p.q);
  const DeviceBuffer<std::int32_t> d_lengths(p.kv_values.seq_lens);
  const KVCache<const T> device_cache =
      ContiguousKVView<const T>::packed(d_k.data(), d_v.data(), kBatch, kKvHeads, kTokens, kHeadDim, d_lengths.data());
  const SplitContext split{.cpu = cpu};
  DecodeStep<MarksARowBad, placement::MiddleOnCpu> hybrid(
      MarksARowBad(TwoSources<T, cpu::Context, true, false>(limits, kBudget, kBatch, weights, {}, cpu), bad_row), config,
      split);
  hybrid.prepare({.cache = host_cache, .slots = slots.data()}, cpu);
  const SplitBuffers workspace(hybrid.workspace_bytes());
  DeviceBuffer<T> d_o(p.q.size());
  DeviceBuffer<float> d_lse(std::size_t(kBatch) * kQHeads);
  KVSIFT_CUDA_CHECK(cudaMemset(d_o.data(), 0, d_o.size() * sizeof(T)));
  KVSIFT_CUDA_CHECK(cudaMemset(d_lse.data(), 0, d_lse.size() * sizeof(float)));
  hybrid.run({.q = p.q_view(), .cache = host_cache, .slots = slots.data(),
              .q_device = QueryView<const T>::packed(d_q.data(), kBatch, kQHeads, kHeadDim), .device_cache = device_cache},
             StateView<T>::packed(d_o.data(), d_lse.data(), kBatch, kQHeads, kHeadDim), workspace.view(), split);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const SelectionView s = hybrid.selection(workspace.view());
  ASSERT_NE(s.log_weights, nullptr);
  std::vector<std::int32_t> indices(s.indices, s.indices + std::size_t(kBatch) * kKvHeads * kBudget);
  std::vector<std::int32_t> counts(s.counts, s.counts + kBatch * kKvHeads);
  ASSERT_EQ(counts[std::size_t(bad_row)], -1);
  counts[std::size_t(bad_row)] = 0;  // the reference of the other rows
  const HostState ref = two_source_reference<T>(p.q, kQHeads, p.kv_values, config.attention.window, indices, counts,
                                                kBudget, &weights, nullptr, slots, 1.0 / std::sqrt(double(kHeadDim)));
  const std::vector<T> o = d_o.download();
  const std::vector<float> lse = d_lse.download();
  expect_state_with_bad_row(o, lse, ref, kBatch * kQHeads, kQHeads / kKvHeads, kHeadDim, bad_row, 5e-3f);
}

// The hybrid placement attends no second source: a selector with one is refused at construction, before any
// device work.
TEST(HybridStepBadInput, ASelectorWithASecondSourceIsRefused) {
  Random rng(test_seed());
  const cpu::Context cpu{};
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 64, .q_heads = 4, .kv_heads = 1, .head_dim = 64};
  const HostKV kv(rng, 2, 1, 64, 64);
  const std::vector<std::int32_t> slots{0, 1};
  const SecondSourceData<half> second = make_second_source<half>(rng, kv, slots, 2, 2, 4);
  using Selector = TwoSources<half, cpu::Context, false, true>;
  expect_error(
      [&] {
        DecodeStep<Selector, placement::MiddleOnCpu> step(Selector(limits, 8, 2, {}, second, cpu),
                                                          {.attention = {.window = {4, 16}}, .max_batch = 2,
                                                           .q_heads = 4, .kv_heads = 1, .head_dim = 64,
                                                           .max_seq_len = 64},
                                                          SplitContext{.cpu = cpu});
      },
      "DecodeStep<MiddleOnCpu>: the selector (TwoSources) has a second source (second_source_capacity() = 4), which "
      "this placement does not attend: run it with DecodeStep in placement::Local");
}

}  // namespace
}  // namespace kvsift::test
