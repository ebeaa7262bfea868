// The decode step's selection beyond positions, on the CPU: a selector's log-weights reach the attention through
// the step's workspace, and a second source (a selector-owned compressed cache attended whole) is merged with the
// primary selection by LSE. Against an fp64 reference over window ∪ selection ∪ weighted second rows written in
// the tests (second_source_check.hpp); contiguous and paged caches, fp16 and bf16, slots out of order.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "attention_check.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/step/decode_step.hpp"
#include "second_source_check.hpp"

namespace kvsift::test {

template <>
void copy_to_context<cpu::Context>(void* dst, const void* src, std::size_t bytes, const cpu::Context&) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

namespace {

using SecondSourceStep = SeededTest;

/// One step's problem: the cache, slots out of order (max_slots 4 for 3 rows), the primary weights table and
/// the second source.
template <class T>
struct StepProblem {
  static constexpr std::int32_t kBudget = 40, kSecondRows = 8, kMaxSlots = 4;
  HostDecodeProblem<T> p;
  std::vector<std::int32_t> slots{2, 0, 3};
  std::vector<float> weights;
  SecondSourceData<T> second;
  SelectorLimits limits;
  DecodeStepConfig config;

  StepProblem(Random& rng, std::int32_t page_size)
      : p(rng, CaseSpec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .tokens = 700, .k = 0,
                        .page_size = page_size, .log_weights = false}),
        second(make_second_source<T>(rng, p.kv_values, slots, kMaxSlots, 3, kSecondRows)),
        limits{.max_slots = kMaxSlots, .max_tokens = 700, .q_heads = 8, .kv_heads = 2, .head_dim = 64},
        config{.attention = {.window = {4, 16}}, .max_batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 64,
               .max_seq_len = 700} {
    weights.resize(std::size_t(3) * 2 * kBudget);
    for (float& w : weights) w = rng.uniform(-2.0f, 2.0f);
  }
  KVCache<T> cache() {
    if (p.spec.page_size == 0) {
      return ContiguousKVView<T>::packed(p.k.data(), p.v.data(), 3, 2, 700, 64, p.kv_values.seq_lens.data());
    }
    const auto v = p.paged();
    return PagedKVView<T>{p.k_pages.data(), p.v_pages.data(), v.page_indptr, v.page_indices, v.last_page_len, v.batch,
                          v.kv_heads, v.head_dim, v.page_size, v.num_pages, v.page_stride, v.token_stride,
                          v.head_stride};
  }
  template <bool Weights, bool Second>
  TwoSources<T, cpu::Context, Weights, Second> selector(const cpu::Context& ctx) const {
    return {limits, kBudget, 3, weights, second, ctx};
  }
  /// Prepares the sequences, then runs one step on a poisoned workspace into a poisoned output; returns O (as
  /// TO), LSE and the selection.
  template <class TO, class Step>
  std::tuple<std::vector<TO>, std::vector<float>, SelectionView> run(Step& step, cpu::Array<std::byte>& workspace,
                                                                      const cpu::Context& ctx) {
    step.prepare({.cache = cache(), .slots = slots.data()}, ctx);
    std::memset(workspace.data(), 0xff, workspace.size());
    std::vector<TO> o(p.q.size());
    std::memset(o.data(), 0xff, o.size() * sizeof(TO));
    std::vector<float> lse(std::size_t(3) * 8, kPoison);
    step.run(StepInputs<T>{.q = p.q_view(), .cache = cache(), .slots = slots.data()},
             StateView<TO>::packed(o.data(), lse.data(), 3, 8, 64), workspace.bytes(), ctx);
    return {o, lse, step.selection(workspace.bytes(), 3)};
  }
  HostState reference(const SelectionView& s, bool weighted, bool with_second) const {
    const std::vector<std::int32_t> indices(s.indices, s.indices + std::size_t(3) * 2 * s.capacity);
    const std::vector<std::int32_t> counts(s.counts, s.counts + 6);
    return two_source_reference(p.q, 8, p.kv_values, config.attention.window, indices, counts, s.capacity,
                                weighted ? &weights : nullptr, with_second ? &second : nullptr, slots,
                                1.0 / std::sqrt(64.0));
  }
};

template <class T, bool Weights, bool Second>
void expect_step_matches_reference(Random& rng, std::int32_t page_size) {
  SCOPED_TRACE(fmt::format("{} page_size {} weights {} second source {}", dtype_label<T>(), page_size, Weights, Second));
  StepProblem<T> sp(rng, page_size);
  const cpu::Context ctx{};
  DecodeStep step(sp.template selector<Weights, Second>(ctx), sp.config, ctx);
  cpu::Array<std::byte> workspace(step.workspace_bytes());
  const auto [o, lse, selection] = sp.template run<T>(step, workspace, ctx);
  EXPECT_EQ(selection.log_weights != nullptr, Weights) << "the selection has log-weights iff the selector writes them";
  if (Weights) {
    for (std::size_t i = 0; i < sp.weights.size(); ++i) ASSERT_EQ(selection.log_weights[i], sp.weights[i]) << i;
  }
  for (std::int32_t r = 0; r < 6; ++r) ASSERT_EQ(selection.counts[r], StepProblem<T>::kBudget) << "row " << r;
  expect_close(o, lse, sp.reference(selection, Weights, Second), "step output");
  // An fp32 output: the merge writes it directly, unrounded.
  const auto [o32, lse32, unused] = sp.template run<float>(step, workspace, ctx);
  const HostState ref = sp.reference(selection, Weights, Second);
  for (std::size_t i = 0; i < o32.size(); ++i) ASSERT_NEAR(o32[i], ref.o[i], 1e-4) << "fp32 O " << i;
  for (std::size_t i = 0; i < lse32.size(); ++i) ASSERT_NEAR(lse32[i], ref.lse[i], 1e-4) << "fp32 LSE " << i;
}

TEST_F(SecondSourceStep, WeightsAndSecondSourceMatchTheReference) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const std::int32_t page_size : {0, 16}) {
    expect_step_matches_reference<half, true, false>(rng, page_size);
    expect_step_matches_reference<half, false, true>(rng, page_size);
    expect_step_matches_reference<half, true, true>(rng, page_size);
    expect_step_matches_reference<bfloat16, true, false>(rng, page_size);
    expect_step_matches_reference<bfloat16, false, true>(rng, page_size);
    expect_step_matches_reference<bfloat16, true, true>(rng, page_size);
  }
}

// A row of the second source that copies a cache token with weight log 2 weighs as that token attended twice:
// the step's output equals sparse decode over window and selection with that token listed twice (the kernels
// attend a duplicate once per occurrence).
TEST_F(SecondSourceStep, AWeightOfLogTwoIsTheRowAttendedTwice) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = bfloat16;
  StepProblem<T> sp(rng, 0);
  // Every listed second row: a copy of one token of its sequence, weight log 2.
  sp.second.counts = {1, 1};
  std::vector<std::int32_t> copied(6);
  for (std::int32_t b = 0; b < 3; ++b) {
    for (std::int32_t g = 0; g < 2; ++g) {
      const std::int32_t t = rng.uniform_int(0, sp.p.kv_values.seq_lens[b] - 1);
      copied[std::size_t(b) * 2 + g] = t;
      const std::size_t from = ((std::size_t(b) * 2 + g) * 700 + t) * 64;
      const std::size_t to = ((std::size_t(sp.slots[b]) * 2 + g) * StepProblem<T>::kSecondRows) * 64;
      std::copy_n(sp.p.k.begin() + std::ptrdiff_t(from), 64, sp.second.k.begin() + std::ptrdiff_t(to));
      std::copy_n(sp.p.v.begin() + std::ptrdiff_t(from), 64, sp.second.v.begin() + std::ptrdiff_t(to));
      sp.second.log_weights[(std::size_t(b) * 2 + g) * StepProblem<T>::kSecondRows] = std::log(2.0f);
    }
  }
  const cpu::Context ctx{};
  DecodeStep step(sp.selector<false, true>(ctx), sp.config, ctx);
  cpu::Array<std::byte> workspace(step.workspace_bytes());
  const auto [o, lse, selection] = sp.run<float>(step, workspace, ctx);
  // The same tokens through one sparse decode without a window: per row the window's tokens, the selection,
  // then the copied token twice.
  const AttentionWindow window = sp.config.attention.window;
  const std::int32_t capacity = window.sink + window.recent + selection.capacity + 2;
  std::vector<std::int32_t> indices(std::size_t(6) * capacity, kPoisonIndex), counts(6);
  for (std::int32_t b = 0; b < 3; ++b) {
    const std::int32_t len = sp.p.kv_values.seq_lens[b];
    for (std::int32_t g = 0; g < 2; ++g) {
      const std::size_t row = std::size_t(b) * 2 + g;
      std::int32_t* out = &indices[row * capacity];
      for (std::int32_t i = 0; i < window.size(len); ++i) *out++ = window.token(i, len);
      out = std::copy_n(selection.row(b, g), selection.count(b, g), out);
      *out++ = copied[row];
      *out++ = copied[row];
      counts[row] = std::int32_t(out - &indices[row * capacity]);
    }
  }
  std::vector<float> o2(o.size(), kPoison), lse2(lse.size(), kPoison);
  cpu::sparse_decode(sp.p.q_view(), sp.p.contiguous(), SelectionView{indices.data(), counts.data(), nullptr, 3, 2, capacity},
                     StateView<float>::packed(o2.data(), lse2.data(), 3, 8, 64));
  for (std::size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(o[i], o2[i], 2e-6) << "O " << i;
  for (std::size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], lse2[i], 2e-6) << "LSE " << i;
}

// Selectors that write no log-weights and have no second source pay nothing: the same workspace as before
// (lengths, selection, scratch), no log-weights array, and no partials.
TEST_F(SecondSourceStep, PlainSelectorsPayNothing) {
  StepProblem<half> sp(rng, 0);
  const cpu::Context ctx{};
  DecodeStep plain(sp.selector<false, false>(ctx), sp.config, ctx);
  DecodeStep oracle(OracleTopK<half, cpu::Context>(sp.limits, {.budget = StepProblem<half>::kBudget}), sp.config, ctx);
  DecodeStep weighted(sp.selector<true, false>(ctx), sp.config, ctx);
  DecodeStep two(sp.selector<false, true>(ctx), sp.config, ctx);
  EXPECT_EQ(plain.workspace_bytes(), oracle.workspace_bytes());
  EXPECT_GE(weighted.workspace_bytes(), plain.workspace_bytes() + std::size_t(3) * 2 * StepProblem<half>::kBudget * 4);
  EXPECT_GE(two.workspace_bytes(), plain.workspace_bytes() + 2 * std::size_t(3) * 8 * 65 * 4);
  cpu::Array<std::byte> workspace(oracle.workspace_bytes());
  EXPECT_EQ(oracle.selection(workspace.bytes(), 3).log_weights, nullptr);
}

// AnySelector forwards the log-weights and the second source: the same output, bit for bit, as the selector
// itself; wrapping a selector without them answers false / 0 and refuses second_source.
TEST_F(SecondSourceStep, AnySelectorForwardsWeightsAndSecondSource) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  StepProblem<half> sp(rng, 16);
  const cpu::Context ctx{};
  DecodeStep direct(sp.selector<true, true>(ctx), sp.config, ctx);
  DecodeStep erased(AnySelector<half, cpu::Context>(sp.selector<true, true>(ctx)), sp.config, ctx);
  EXPECT_EQ(direct.workspace_bytes(), erased.workspace_bytes());
  cpu::Array<std::byte> ws_direct(direct.workspace_bytes()), ws_erased(erased.workspace_bytes());
  const auto [o1, lse1, s1] = sp.run<half>(direct, ws_direct, ctx);
  const auto [o2, lse2, s2] = sp.run<half>(erased, ws_erased, ctx);
  EXPECT_TRUE(same_bytes(o1, o2));
  EXPECT_TRUE(same_bytes(lse1, lse2));
  const AnySelector<half, cpu::Context> plain(OracleTopK<half, cpu::Context>(sp.limits, {.budget = 8}));
  EXPECT_FALSE(plain.writes_log_weights());
  EXPECT_EQ(plain.second_source_capacity(), 0);
  expect_error([&] { (void)plain.second_source({}); },
               "AnySelector::second_source: the wrapped selector (OracleTopK) has no second source");
}

// With validate_indices the second source's selection is checked too (over its paged store, whose page table
// is the slots) and passes; the output is the unvalidated one, bit for bit.
TEST_F(SecondSourceStep, ValidationModeChecksAndAcceptsBothSelections) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  StepProblem<bfloat16> sp(rng, 16);
  const cpu::Context ctx{};
  DecodeStep plain(sp.selector<true, true>(ctx), sp.config, ctx);
  DecodeStepConfig validating_config = sp.config;
  validating_config.validate_indices = true;
  DecodeStep validating(sp.selector<true, true>(ctx), validating_config, ctx);
  cpu::Array<std::byte> ws_plain(plain.workspace_bytes()), ws_validating(validating.workspace_bytes());
  const auto [o1, lse1, s1] = sp.run<bfloat16>(plain, ws_plain, ctx);
  const auto [o2, lse2, s2] = sp.run<bfloat16>(validating, ws_validating, ctx);
  EXPECT_TRUE(same_bytes(o1, o2));
  EXPECT_TRUE(same_bytes(lse1, lse2));
}

// The step checks the second source's views against its own shapes before attending.
TEST_F(SecondSourceStep, BadInputSecondSourceViewsAreRefused) {
  StepProblem<half> sp(rng, 0);
  const cpu::Context ctx{};
  std::vector<half> o(sp.p.q.size());
  std::vector<float> lse(24);
  // A selector whose second source's selection has one row too many.
  struct WrongBatch : TwoSources<half, cpu::Context, false, true> {
    using TwoSources::TwoSources;
    SecondSource<half> second_source(const SelectInputs<half>& in) const {
      SecondSource<half> s = TwoSources::second_source(in);
      s.selection.batch += 1;
      return s;
    }
  };
  DecodeStep wrong(WrongBatch(sp.limits, StepProblem<half>::kBudget, 3, sp.weights, sp.second, ctx), sp.config, ctx);
  cpu::Array<std::byte> ws(wrong.workspace_bytes());
  wrong.prepare({.cache = sp.cache(), .slots = sp.slots.data()}, ctx);
  expect_error(
      [&] {
        wrong.run(StepInputs<half>{.q = sp.p.q_view(), .cache = sp.cache(), .slots = sp.slots.data()},
                  StateView<half>::packed(o.data(), lse.data(), 3, 8, 64), ws.bytes(), ctx);
      },
      "DecodeStep::run: the second source's cache batch (= 3) and selection batch (= 4, with no row map) must be "
      "the step's batch (= 3)");
}

}  // namespace
}  // namespace kvsift::test
