// The reference selectors (OracleTopK, Quest, StreamingLLM) and the rerank stage (selectors/rerank.hpp) on the CPU,
// through the decode step: selections against fp64 references of their scores, outputs against the fp64 reference
// attention over window and selection, on contiguous and paged bf16 and fp16 caches with ragged lengths; the steps
// append tokens; every refused input.
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <numeric>

#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/selectors/rerank.hpp"
#include "kvsift/selectors/streaming_llm/streaming_llm.hpp"
#include "kvsift/step/decode_step.hpp"
#include "selector_check.hpp"

namespace kvsift::test {
namespace {

constexpr AttentionWindow kWindow{4, 16};

/// A workspace of `bytes` bytes, poisoned (its contents must not matter).
cpu::Array<std::byte> poisoned_workspace(std::size_t bytes) {
  cpu::Array<std::byte> workspace(bytes);
  std::fill_n(workspace.data(), bytes, std::byte{0xff});
  return workspace;
}

template <class T>
class CpuSelectors : public SeededTest {};
using StorageTypes = testing::Types<bfloat16, half>;
TYPED_TEST_SUITE(CpuSelectors, StorageTypes);

/// A problem, its cache as the step sees it (mutable views over the problem's own arrays), and slots.
template <class T>
struct StepFixture {
  HostDecodeProblem<T> p;
  std::vector<std::int32_t> slots;
  StepFixture(Random& rng, const CaseSpec& spec) : p(rng, spec), slots(std::size_t(spec.batch)) {
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng.engine);  // any row may live in any slot
  }
  KVCache<T> cache() {
    if (p.spec.page_size == 0) {
      return ContiguousKVView<T>::packed(p.k.data(), p.v.data(), p.spec.batch, p.spec.kv_heads, p.spec.tokens,
                                         p.spec.head_dim, p.kv_values.seq_lens.data());
    }
    const auto& h = p.paged_values->view;
    return PagedKVView<T>{p.k_pages.data(), p.v_pages.data(), p.paged_values->indptr.data(),
                          p.paged_values->indices.data(), p.paged_values->last_len.data(), h.batch, h.kv_heads,
                          h.head_dim, h.page_size, h.num_pages, h.page_stride, h.token_stride, h.head_stride};
  }
  SelectorLimits limits() const { return case_limits(p.spec); }
  DecodeStepConfig config(const AttentionWindow& window) const { return case_step_config(p.spec, window); }
};

struct HostSelectionCopy {
  std::vector<std::int32_t> indices, counts;
};

/// One step of `step` on fixture f (after prepare); returns the selection, and checks the step's output against
/// the reference attention over window and selection.
template <class Step, class T>
HostSelectionCopy run_step(Step& step, StepFixture<T>& f, cpu::Array<std::byte>& workspace, const cpu::Context& ctx,
                           const StepInputs<T>& extra = {}) {
  const auto& c = f.p.spec;
  HostState out(c.batch, c.q_heads, c.head_dim);
  std::vector<T> o(out.o.size(), from_float<T>(kPoison));
  StepInputs<T> in = extra;
  in.q = f.p.q_view();
  in.cache = f.cache();
  in.slots = f.slots.data();
  step.run(in, StateView<T>::packed(o.data(), out.lse.data(), c.batch, c.q_heads, c.head_dim), workspace.bytes(), ctx);
  const SelectionView sel = step.selection(workspace.bytes(), c.batch);
  HostState ref(c.batch, c.q_heads, c.head_dim);
  AttentionOptions attention = step.config().attention;
  attention.selection_page_size = step.selection_page_size();  // tokens, or a page-level selection's pages
  reference::sparse_decode(f.p.q_view(), f.p.kv_values.view(), sel, ref.view, attention);
  expect_close<T>(o, out.lse, ref, "step output");
  return {{sel.indices, sel.indices + std::size_t(sel.batch) * sel.kv_heads * sel.capacity},
          {sel.counts, sel.counts + std::size_t(sel.batch) * sel.kv_heads}};
}

TYPED_TEST(CpuSelectors, OracleTopKIsTheExactTopKOfTheMiddle) {
  using T = TypeParam;
  cpu::ThreadPool pool(3);
  for (const std::int32_t page_size : {0, 16}) {
    for (const std::int32_t tokens : {40, 700}) {
      const CaseSpec spec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .tokens = tokens, .k = 0,
                          .page_size = page_size, .log_weights = false};
      SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
      StepFixture<T> f(this->rng, spec);
      const cpu::Context ctx{&pool};
      const std::int32_t budget = 32;
      DecodeStep step(OracleTopK<T, cpu::Context>(f.limits(), {.budget = budget}), f.config(kWindow), ctx);
      step.prepare({.cache = f.cache(), .slots = f.slots.data()}, ctx);
      auto workspace = poisoned_workspace(step.workspace_bytes());
      const auto sel = run_step(step, f, workspace, ctx);
      expect_oracle_selection(f.p, sel.indices, sel.counts, budget, budget, kWindow, 1.0 / std::sqrt(64.0));
    }
  }
}

/// The Quest tests' problem: 600 tokens, GQA 8/2, head_dim 64, a contiguous cache (page_size 0) or a paged one.
CaseSpec quest_case(std::int32_t page_size) {
  return {.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .tokens = 600, .k = 0, .page_size = page_size,
          .log_weights = false};
}

TYPED_TEST(CpuSelectors, QuestTakesTheBestPagesWhole) {
  using T = TypeParam;
  for (const std::int32_t page_size : {0, 16}) {
    const CaseSpec spec = quest_case(page_size);
    SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
    StepFixture<T> f(this->rng, spec);
    const cpu::Context ctx{};
    DecodeStep step(Quest<T, cpu::Context>(f.limits(), {.budget = 100, .page_size = 8}), f.config(kWindow), ctx);
    EXPECT_EQ(step.selector().capacity(), 96);  // 12 whole pages of 8
    step.prepare({.cache = f.cache(), .slots = f.slots.data()}, ctx);
    auto workspace = poisoned_workspace(step.workspace_bytes());
    const auto sel = run_step(step, f, workspace, ctx);
    expect_quest_selection(f.p, sel.indices, sel.counts, 96, 12, 8, kWindow);
  }
}

/// config.page_selections: Quest writes its pages and the step attends their middle tokens (run_step: against the
/// fp64 reference over those pages); the pages are the token step's pages, in its order.
TYPED_TEST(CpuSelectors, QuestsPagesAreAttendedWithoutExpansion) {
  using T = TypeParam;
  for (const std::int32_t page_size : {0, 16}) {
    const CaseSpec spec = quest_case(page_size);
    SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
    StepFixture<T> f(this->rng, spec);
    const cpu::Context ctx{};
    const QuestConfig quest{.budget = 100, .page_size = 8};
    DecodeStep tokens(Quest<T, cpu::Context>(f.limits(), quest), f.config(kWindow), ctx);
    DecodeStepConfig config = f.config(kWindow);
    config.page_selections = true;
    DecodeStep pages(Quest<T, cpu::Context>(f.limits(), quest), config, ctx);
    EXPECT_EQ(tokens.selection_page_size(), 1);
    EXPECT_EQ(pages.selection_page_size(), 8);
    for (auto* step : {&tokens, &pages}) step->prepare({.cache = f.cache(), .slots = f.slots.data()}, ctx);
    auto token_workspace = poisoned_workspace(tokens.workspace_bytes());
    auto page_workspace = poisoned_workspace(pages.workspace_bytes());
    const auto want = run_step(tokens, f, token_workspace, ctx);
    const auto got = run_step(pages, f, page_workspace, ctx);
    const SelectionView page_view = pages.selection(page_workspace.bytes(), spec.batch);
    ASSERT_EQ(page_view.capacity, 12);  // pages per row
    expect_pages_expand_to_tokens(f.p, got, 12, 8, want, 96, kWindow);
  }
}

TYPED_TEST(CpuSelectors, RerankedQuestKeepsTheBestOfQuestsCandidatesByTheExactScore) {
  using T = TypeParam;
  for (const std::int32_t page_size : {0, 16}) {
    const CaseSpec spec = quest_case(page_size);
    SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
    StepFixture<T> f(this->rng, spec);
    cpu::ThreadPool pool(2);
    const cpu::Context ctx{&pool};
    const QuestConfig proposer{.budget = 128, .page_size = 8};
    // Quest alone gives the candidates: the same inputs give the reranked step's proposer the same selection.
    DecodeStep quest(Quest<T, cpu::Context>(f.limits(), proposer), f.config(kWindow), ctx);
    quest.prepare({.cache = f.cache(), .slots = f.slots.data()}, ctx);
    auto quest_workspace = poisoned_workspace(quest.workspace_bytes());
    const auto candidates = run_step(quest, f, quest_workspace, ctx);
    const std::int32_t budget = 32;
    DecodeStep step(Reranked(Quest<T, cpu::Context>(f.limits(), proposer), {.budget = budget}), f.config(kWindow),
                    ctx);
    EXPECT_EQ(step.selector().capacity(), budget);
    EXPECT_EQ(step.selector().name(), "Quest + rerank");
    step.prepare({.cache = f.cache(), .slots = f.slots.data()}, ctx);
    auto workspace = poisoned_workspace(step.workspace_bytes());
    const auto sel = run_step(step, f, workspace, ctx);  // the output against the reference attention too
    for (std::int32_t b = 0; b < spec.batch; ++b) {
      for (std::int32_t g = 0; g < spec.kv_heads; ++g) {
        const std::int32_t row = b * spec.kv_heads + g;
        const auto proposed = selection_row(candidates.indices, candidates.counts, row, proposer.budget);
        const auto scores = rerank_scores(f.p, b, g, proposed, 1.0 / std::sqrt(64.0));
        double top = 0;
        for (const auto& [id, score] : scores) top = std::max(top, score);
        expect_top_k(selection_row(sel.indices, sel.counts, row, budget), scores, budget, 1e-4 * top,
                     fmt::format("row ({}, {})", b, g));
      }
    }
    // RerankConfig::mass: each row keeps the top-k of its exact scores with k the fewest that hold p of the row's
    // mass (at least the floor, at most the budget and, with budget_fraction, the length's budget).
    for (const RerankConfig config : {RerankConfig{.budget = 48, .mass = 0.3},
                                      RerankConfig{.budget = 48, .mass = 0.6, .floor = 8},
                                      RerankConfig{.budget = 48, .budget_fraction = 0.05, .mass = 1.0, .floor = 2}}) {
      SCOPED_TRACE(describe(spec) + fmt::format(" mass {} floor {} fraction {} seed {}", config.mass, config.floor,
                                                config.budget_fraction, this->seed));
      DecodeStep adaptive(Reranked(Quest<T, cpu::Context>(f.limits(), proposer), config), f.config(kWindow), ctx);
      adaptive.prepare({.cache = f.cache(), .slots = f.slots.data()}, ctx);
      auto adaptive_workspace = poisoned_workspace(adaptive.workspace_bytes());
      const auto kept = run_step(adaptive, f, adaptive_workspace, ctx);  // against the reference attention too
      expect_reranked_mass_rows(f.p, candidates, proposer.budget, kept, config, 1.0 / std::sqrt(64.0));
    }
  }
}

TYPED_TEST(CpuSelectors, QuestFoldsEachStepsTokenIntoItsPage) {
  // A contiguous cache growing by one token per step: the step writes the token (k, v) at the new last
  // position, Quest's append folds it into its page bounds, and the selection sees it.
  using T = TypeParam;
  const CaseSpec spec{.batch = 2, .q_heads = 4, .kv_heads = 2, .head_dim = 64, .tokens = 300, .k = 0,
                      .page_size = 0, .log_weights = false, .random_lengths = false};
  SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
  StepFixture<T> f(this->rng, spec);
  f.p.kv_values.seq_lens = {250, 263};  // the prefill; each step adds a token
  const cpu::Context ctx{};
  DecodeStep step(Quest<T, cpu::Context>(f.limits(), {.budget = 64, .page_size = 16}), f.config(kWindow), ctx);
  step.prepare({.cache = f.cache(), .slots = f.slots.data()}, ctx);
  auto workspace = poisoned_workspace(step.workspace_bytes());
  for (int s = 0; s < 20; ++s) {
    SCOPED_TRACE(fmt::format("step {}", s));
    for (auto& len : f.p.kv_values.seq_lens) ++len;
    // The token: large fresh keys (so that they move page bounds), also written into the reference's copy.
    const auto k_new = to_storage<T>(this->rng.normal(std::size_t(spec.batch) * spec.kv_heads * spec.head_dim, 3.0f));
    const auto v_new = to_storage<T>(this->rng.normal(k_new.size()));
    for (std::int32_t b = 0; b < spec.batch; ++b) {
      for (std::int32_t h = 0; h < spec.kv_heads; ++h) {
        const std::size_t t = std::size_t(f.p.kv_values.seq_lens[b] - 1);
        for (std::int32_t i = 0; i < spec.head_dim; ++i) {
          const std::size_t src = (std::size_t(b) * spec.kv_heads + h) * spec.head_dim + i;
          const std::size_t dst = ((std::size_t(b) * spec.kv_heads + h) * spec.tokens + t) * spec.head_dim + i;
          f.p.kv_values.k[dst] = to_float(k_new[src]);
          f.p.kv_values.v[dst] = to_float(v_new[src]);
        }
      }
    }
    f.p.q = to_storage<T>(this->rng.normal(std::size_t(spec.batch) * spec.q_heads * spec.head_dim));
    const auto sel = run_step(step, f, workspace, ctx,
                              {.k = HeadsView<const T>::packed(k_new.data(), spec.batch, spec.kv_heads, spec.head_dim),
                               .v = HeadsView<const T>::packed(v_new.data(), spec.batch, spec.kv_heads, spec.head_dim)});
    for (std::size_t i = 0; i < f.p.k.size(); ++i) {
      ASSERT_EQ(to_float(f.p.k[i]), f.p.kv_values.k[i]) << "the step did not write the token's key, element " << i;
    }
    expect_quest_selection(f.p, sel.indices, sel.counts, 64, 4, 16, kWindow);
    if (this->HasFatalFailure()) return;
  }
}

TYPED_TEST(CpuSelectors, StreamingLLMAttendsTheWindowAlone) {
  using T = TypeParam;
  const CaseSpec spec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .tokens = 200, .k = 0,
                      .page_size = 16, .log_weights = false};
  SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
  StepFixture<T> f(this->rng, spec);
  const cpu::Context ctx{};
  DecodeStep step(StreamingLLM<T, cpu::Context>(f.limits()), f.config(kWindow), ctx);
  step.prepare({.cache = f.cache(), .slots = f.slots.data()}, ctx);
  auto workspace = poisoned_workspace(step.workspace_bytes());
  const auto sel = run_step(step, f, workspace, ctx);
  for (const std::int32_t count : sel.counts) EXPECT_EQ(count, 0);
  // Its capacity is 0: a selection of capacity 0 needs no index array.
  std::vector<std::int32_t> lengths(f.p.kv_values.seq_lens), counts(std::size_t(spec.batch) * spec.kv_heads, 5);
  step.selector().select({.q = f.p.q_view(), .cache = f.cache(), .slots = f.slots.data(), .lengths = lengths.data()},
                         SelectionView{nullptr, counts.data(), nullptr, spec.batch, spec.kv_heads, 0}, {}, ctx);
  EXPECT_EQ(counts, std::vector<std::int32_t>(counts.size(), 0));
}

TYPED_TEST(CpuSelectors, EveryBatchUpToMaxBatchRunsOnTheWorkspacePlannedOnce) {
  // Fewer rows split more on a pool (8 rows of 4 kv heads x 2 batch on 16 threads take 2 splits, 6 rows take 8):
  // the plan covers every batch size, and each one's output is the reference's over window and selection.
  using T = TypeParam;
  cpu::ThreadPool pool(16);
  const cpu::Context ctx{&pool};
  const CaseSpec spec{.batch = 4, .q_heads = 4, .kv_heads = 2, .head_dim = 64, .tokens = 3000, .k = 0,
                      .page_size = 0, .log_weights = false};
  SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
  StepFixture<T> f(this->rng, spec);
  DecodeStep step(OracleTopK<T, cpu::Context>(f.limits(), {.budget = 1024}), f.config(kWindow), ctx);
  step.prepare({.cache = f.cache(), .slots = f.slots.data()}, ctx);
  auto workspace = poisoned_workspace(step.workspace_bytes());
  for (std::int32_t batch = 1; batch <= spec.batch; ++batch) {
    SCOPED_TRACE(fmt::format("batch {}", batch));
    // The first `batch` rows of the problem: views over the same arrays with a smaller batch.
    KVCache<T> cache = f.cache();
    cache.contiguous.batch = batch;
    auto q = f.p.q_view();
    q.batch = batch;
    HostState out(batch, spec.q_heads, spec.head_dim);
    std::vector<T> o(out.o.size(), from_float<T>(kPoison));
    step.run(StepInputs<T>{.q = q, .cache = cache, .slots = f.slots.data()},
             StateView<T>::packed(o.data(), out.lse.data(), batch, spec.q_heads, spec.head_dim), workspace.bytes(), ctx);
    const SelectionView sel = step.selection(workspace.bytes(), batch);
    HostState ref(batch, spec.q_heads, spec.head_dim);
    auto kv = f.p.kv_values.view();
    kv.batch = batch;
    reference::sparse_decode(q, kv, sel, ref.view, step.config().attention);
    expect_close<T>(o, out.lse, ref, "step output");
  }
  // A pool larger than the plan's is refused by name; a smaller one runs.
  cpu::ThreadPool bigger(20);
  HostState out(spec.batch, spec.q_heads, spec.head_dim);
  std::vector<T> o(out.o.size());
  const auto run_on = [&](cpu::ThreadPool* p) {
    step.run(StepInputs<T>{.q = f.p.q_view(), .cache = f.cache(), .slots = f.slots.data()},
             StateView<T>::packed(o.data(), out.lse.data(), spec.batch, spec.q_heads, spec.head_dim), workspace.bytes(),
             cpu::Context{p});
  };
  expect_error([&] { run_on(&bigger); }, "the context has 20 threads, the step was planned for 16");
  cpu::ThreadPool smaller(3);
  run_on(&smaller);
  run_on(nullptr);
}

TYPED_TEST(CpuSelectors, SequencesJoinAndLeaveTheirSlots) {
  // Continuous batching: 4 slots; a step over the sequences in slots {2, 0, 3}, then one over slot 1 alone; slot
  // 1 is released and prepared again for a new sequence, whose selection then follows its own keys.
  using T = TypeParam;
  const CaseSpec spec{.batch = 4, .q_heads = 4, .kv_heads = 2, .head_dim = 64, .tokens = 700, .k = 0,
                      .page_size = 0, .log_weights = false};
  SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
  const cpu::Context ctx{};
  const QuestConfig config{.budget = 64, .page_size = 16};
  const SelectorLimits limits{.max_slots = 4, .max_tokens = spec.tokens, .q_heads = spec.q_heads,
                              .kv_heads = spec.kv_heads, .head_dim = spec.head_dim};
  DecodeStep step(Quest<T, cpu::Context>(limits, config),
                  {.attention = {.window = kWindow}, .max_batch = 4, .q_heads = spec.q_heads, .kv_heads = spec.kv_heads,
                   .head_dim = spec.head_dim, .max_seq_len = spec.tokens},
                  ctx);
  auto workspace = poisoned_workspace(step.workspace_bytes());
  // Each sequence is a one-row problem in its slot.
  const auto one_row = [&](std::int32_t slot) {
    auto problem = std::make_unique<StepFixture<T>>(this->rng, CaseSpec{.batch = 1, .q_heads = spec.q_heads,
                                                                         .kv_heads = spec.kv_heads, .head_dim = spec.head_dim,
                                                                         .tokens = spec.tokens, .k = 0, .page_size = 0,
                                                                         .log_weights = false});
    problem->slots = {slot};
    step.prepare({.cache = problem->cache(), .slots = problem->slots.data()}, ctx);
    return problem;
  };
  std::vector<std::unique_ptr<StepFixture<T>>> live;
  for (const std::int32_t slot : {2, 0, 3, 1}) live.push_back(one_row(slot));
  const auto step_and_check = [&](StepFixture<T>& seq) {
    const auto sel = run_step(step, seq, workspace, ctx);
    expect_quest_selection(seq.p, sel.indices, sel.counts, 64, 4, 16, kWindow);
  };
  for (auto& seq : live) step_and_check(*seq);
  const std::vector<std::int32_t> leaving{1};
  step.release(leaving);
  live[3] = one_row(1);  // a new sequence in the freed slot: its own bounds, not the old sequence's
  step_and_check(*live[3]);
  step_and_check(*live[0]);  // the others are untouched
}

TEST(DecodeStepRefusals, BadConfigurationsAndInputs) {
  using Oracle = OracleTopK<bfloat16, cpu::Context>;
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 64, .q_heads = 4, .kv_heads = 2, .head_dim = 64};
  const DecodeStepConfig good{.max_batch = 2, .q_heads = 4, .kv_heads = 2, .head_dim = 64, .max_seq_len = 64};
  auto bad = good;
  bad.max_batch = 0;
  expect_error([&] { DecodeStep(Oracle(limits, {.budget = 8}), bad, {}); }, "config.max_batch (= 0) must be positive");
  bad = good;
  bad.max_seq_len = 0;
  expect_error([&] { DecodeStep(Oracle(limits, {.budget = 8}), bad, {}); }, "config.max_seq_len (= 0) must be positive");
  bad = good;
  bad.attention.window.recent = -2;
  expect_error([&] { DecodeStep(Oracle(limits, {.budget = 8}), bad, {}); }, "config.attention.window");
  bad = good;
  bad.attention.selection_page_size = 16;
  expect_error([&] { DecodeStep(Oracle(limits, {.budget = 8}), bad, {}); },
               "config.attention.selection_page_size (= 16) must be 1: the step attends a selector's pages by itself");
  bad = good;
  const std::int32_t row_map[2] = {1, 0};
  bad.attention.selection_rows = row_map;
  expect_error([&] { DecodeStep(Oracle(limits, {.budget = 8}), bad, {}); },
               "config.attention.selection_rows is set: the step's selections are by batch row");
  bad = good;
  bad.max_batch = 3;  // more rows than the selector has slots
  expect_error([&] { DecodeStep(Oracle(limits, {.budget = 8}), bad, {}); }, "shape.batch (= 3) is outside [1, limits.max_slots = 2]");

  DecodeStep step(Oracle(limits, {.budget = 8}), good, {});
  std::vector<bfloat16> k(2 * 2 * 64 * 64, from_float<bfloat16>(0.25f)), q(3 * 4 * 64, from_float<bfloat16>(0.5f));
  std::vector<std::int32_t> lens{64, 30}, slots{0, 1};
  const KVCache<bfloat16> cache = ContiguousKVView<bfloat16>::packed(k.data(), k.data(), 2, 2, 64, 64, lens.data());
  std::vector<bfloat16> o(3 * 4 * 64);
  std::vector<float> lse(3 * 4);
  const auto out = StateView<bfloat16>::packed(o.data(), lse.data(), 2, 4, 64);
  auto workspace = poisoned_workspace(step.workspace_bytes());
  const StepInputs<bfloat16> in{.q = QueryView<const bfloat16>::packed(q.data(), 2, 4, 64), .cache = cache,
                                .slots = slots.data()};
  step.prepare({.cache = cache, .slots = slots.data()}, {});
  step.run(in, out, workspace.bytes(), {});
  // A selector asked for pages it does not write (OracleTopK selects tokens).
  expect_error(
      [&] {
        step.selector().select({.q = in.q, .cache = cache, .slots = slots.data(), .lengths = lens.data(),
                                .attention = {.selection_page_size = 16}, .max_seq_len = 64},
                               step.selection(workspace.bytes(), 2), {}, {});
      },
      "in.attention.selection_page_size (= 16) is neither 1 (tokens) nor the selector's page size (none: it selects "
      "tokens)");
  // A row map means nothing to a selector, which writes its selection by batch row.
  expect_error(
      [&] {
        step.selector().select({.q = in.q, .cache = cache, .slots = slots.data(), .lengths = lens.data(),
                                .attention = {.selection_rows = slots.data()}, .max_seq_len = 64},
                               step.selection(workspace.bytes(), 2), {}, {});
      },
      "in.attention.selection_rows is set: a selector writes its selection by batch row, with no row map");
  auto wrong = in;
  wrong.q.batch = 3;
  expect_error([&] { step.run(wrong, out, workspace.bytes(), {}); }, "in.q.batch (= 3) is outside [1, config.max_batch = 2]");
  wrong = in;
  wrong.q.batch = 1;
  expect_error([&] { step.run(wrong, out, workspace.bytes(), {}); }, "in.cache batch (= 2) != in.q.batch (= 1)");
  wrong = in;
  wrong.k = HeadsView<const bfloat16>::packed(k.data(), 2, 2, 64);
  expect_error([&] { step.run(wrong, out, workspace.bytes(), {}); }, "in.k and in.v must be given together");
  wrong.v = HeadsView<const bfloat16>::packed(k.data(), 2, 1, 64);
  expect_error([&] { step.run(wrong, out, workspace.bytes(), {}); },
               "k [2, 2, 64] and v [2, 1, 64] must both be [batch = 2, kv_heads = 2, head_dim = 64]");
  expect_error([&] { step.run(in, out, workspace.bytes().first(step.workspace_bytes() - 256), {}); },
               "workspace too small");
  expect_error([&] { (void)step.selection(workspace.bytes(), 3); }, "batch (= 3) is outside [1, config.max_batch = 2]");
}

TEST(CpuCacheOps, LengthsTokenWriteAndEmptySelection) {
  // Contiguous and paged: the step's token lands at position seq_len - 1 of each row and nowhere else; a row of
  // length 0 is refused before anything is written.
  test::Random rng(test_seed());
  HostKV values(rng, 3, 2, 40, 16, {40, 17, 1});
  for (const bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "contiguous");
    HostKV copy = values;
    std::unique_ptr<HostPagedKV> pages;
    KVCache<float> cache = ContiguousKVView<float>::packed(copy.k.data(), copy.v.data(), 3, 2, 40, 16, copy.seq_lens.data());
    if (paged) {
      pages = std::make_unique<HostPagedKV>(values, 8, false, rng);
      const auto& v = pages->view;
      cache = PagedKVView<float>{pages->k_pages.data(), pages->v_pages.data(), v.page_indptr, v.page_indices,
                                 v.last_page_len, v.batch, v.kv_heads, v.head_dim, v.page_size, v.num_pages,
                                 v.page_stride, v.token_stride, v.head_stride};
    }
    std::vector<std::int32_t> lengths(3, -1);
    cpu::sequence_lengths(KVCache<const float>(cache), lengths.data());
    EXPECT_EQ(lengths, (std::vector<std::int32_t>{40, 17, 1}));
    const std::vector<float> new_k = rng.normal(3 * 2 * 16), new_v = rng.normal(3 * 2 * 16);
    std::vector<float> before_k, after_k;
    for (std::int32_t b = 0; b < 3; ++b)
      for (std::int32_t h = 0; h < 2; ++h)
        for (std::int32_t t = 0; t < lengths[b]; ++t) before_k.insert(before_k.end(), cache.k_row(b, h, t), cache.k_row(b, h, t) + 16);
    cpu::write_step_kv(cache, HeadsView<const float>::packed(new_k.data(), 3, 2, 16),
                       HeadsView<const float>::packed(new_v.data(), 3, 2, 16));
    std::size_t i = 0;
    for (std::int32_t b = 0; b < 3; ++b) {
      for (std::int32_t h = 0; h < 2; ++h) {
        for (std::int32_t t = 0; t < lengths[b]; ++t, i += 16) {
          const float* want_k = t == lengths[b] - 1 ? new_k.data() + (b * 2 + h) * 16 : before_k.data() + i;
          EXPECT_TRUE(std::equal(want_k, want_k + 16, cache.k_row(b, h, t))) << b << " " << h << " " << t;
        }
        const float* want_v = new_v.data() + (b * 2 + h) * 16;
        EXPECT_TRUE(std::equal(want_v, want_v + 16, cache.v_row(b, h, lengths[b] - 1))) << b << " " << h;
      }
    }
  }
  // A row of length 0 has no position for the token: refused, and no row is written.
  HostKV empty_row(rng, 2, 1, 8, 16, {5, 0});
  const std::vector<float> before = empty_row.k;
  const std::vector<float> k = rng.normal(2 * 16);
  const KVCache<float> cache = ContiguousKVView<float>::packed(empty_row.k.data(), empty_row.v.data(), 2, 1, 8, 16,
                                                               empty_row.seq_lens.data());
  expect_error([&] { cpu::write_step_kv(cache, HeadsView<const float>::packed(k.data(), 2, 1, 16),
                                        HeadsView<const float>::packed(k.data(), 2, 1, 16)); },
               "cache.seq_len(1) is 0: the cache has no position for the step's token");
  EXPECT_EQ(empty_row.k, before);
  // A length past the storage (contiguous capacity 8; a page of 4 holding 5) would write another row's memory:
  // refused, nothing written.
  std::vector<std::int32_t> too_long{5, 9};
  const KVCache<float> overlong = ContiguousKVView<float>::packed(empty_row.k.data(), empty_row.v.data(), 2, 1, 8, 16,
                                                                  too_long.data());
  expect_error([&] { cpu::write_step_kv(overlong, HeadsView<const float>::packed(k.data(), 2, 1, 16),
                                        HeadsView<const float>::packed(k.data(), 2, 1, 16)); },
               "cache.seq_len(1) (= 9) does not fit the cache's storage");
  const std::vector<std::int32_t> indptr{0, 1, 2}, pages{0, 1}, last{3, 5};
  const KVCache<float> overfull_page = PagedKVView<float>{
      .k_pages = empty_row.k.data(), .v_pages = empty_row.v.data(), .page_indptr = indptr.data(),
      .page_indices = pages.data(), .last_page_len = last.data(), .batch = 2, .kv_heads = 1, .head_dim = 16,
      .page_size = 4, .num_pages = 2, .page_stride = 4 * 16, .token_stride = 16, .head_stride = 4 * 16};
  expect_error([&] { cpu::write_step_kv(overfull_page, HeadsView<const float>::packed(k.data(), 2, 1, 16),
                                        HeadsView<const float>::packed(k.data(), 2, 1, 16)); },
               "cache.seq_len(1) (= 5) does not fit the cache's storage");
  EXPECT_EQ(empty_row.k, before);
  std::vector<std::int32_t> counts(6, 7);
  cpu::clear_counts(SelectionView{nullptr, counts.data(), nullptr, 3, 2, 4});
  EXPECT_EQ(counts, std::vector<std::int32_t>(6, 0));
}

TEST(CpuSelectorRefusals, RerankConfigurations) {
  using QuestCpu = Quest<bfloat16, cpu::Context>;
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 256, .q_heads = 4, .kv_heads = 2, .head_dim = 64};
  const auto quest = [&] { return QuestCpu(limits, {.budget = 64, .page_size = 16}); };
  expect_error([&] { Reranked(quest(), {.budget = 0}); }, {"Reranked", "config.budget (= 0) must be positive"});
  expect_error([&] { Reranked(quest(), {.budget = 65}); },
               {"Reranked", "config.budget (= 65) exceeds the proposer's capacity (= 64)", "build Quest with"});
  expect_error([&] { Reranked(quest(), {.budget = 16, .entries = 4}); },
               {"Reranked", "config.entries (= 4) must be 0"});
  expect_error([&] { Reranked(quest(), {.budget = 16, .budget_fraction = 1.5}); },
               "config.budget_fraction (= 1.5) is outside [0, 1]");
  expect_error([&] { Reranked(quest(), {.budget = 16, .budget_fraction = std::nan("")}); },
               "config.budget_fraction (= nan) is outside [0, 1]");
  expect_error([&] { Reranked(quest(), {.budget = 16, .mass = 1.5}); }, "config.mass (= 1.5) is outside [0, 1] (0: off)");
  expect_error([&] { Reranked(quest(), {.budget = 16, .mass = -0.1}); }, "config.mass (= -0.1) is outside [0, 1]");
  expect_error([&] { Reranked(quest(), {.budget = 16, .mass = std::nan("")}); }, "config.mass (= nan) is outside [0, 1]");
  expect_error([&] { Reranked(quest(), {.budget = 16, .mass = 0.6, .floor = 0}); },
               {"Reranked", "config.floor (= 0) is outside [1, config.budget = 16]"});
  expect_error([&] { Reranked(quest(), {.budget = 16, .mass = 0.6, .floor = 17}); },
               "config.floor (= 17) is outside [1, config.budget = 16]");
  expect_error([&] { RerankStage<bfloat16, cpu::Context>(limits, {.budget = 8, .mass = 2}); },
               {"RerankStage", "config.mass (= 2) is outside [0, 1]"});
  const RerankStage<bfloat16, cpu::Context> stage(limits, {.budget = 8});
  std::vector<std::int32_t> indices(2 * 2 * 8), counts(4);
  const SelectionView short_out{indices.data(), counts.data(), nullptr, 2, 2, 4};
  expect_error([&] { stage.run({}, {}, nullptr, {}, {}, short_out, {}, {}, {}); },
               {"RerankStage::run", "out.capacity (= 4) < config.budget (= 8)"});
  const SelectionView out{indices.data(), counts.data(), nullptr, 2, 2, 8};
  expect_error([&] { stage.run({}, {}, nullptr, {}, {}, out, out, {}, {}); },
               {"RerankStage::run", "entries (capacity 8) given with config.entries = 0"});
  // run's parts, which a caller may run on two streams, refuse the same by their own names.
  expect_error([&] { stage.keep(nullptr, {}, short_out, {}, {}); },
               {"RerankStage::keep", "out.capacity (= 4) < config.budget (= 8)"});
  expect_error([&] { stage.keep_entries({}, out, {}, {}); },
               {"RerankStage::keep_entries", "entries (capacity 8) given with config.entries = 0"});
  const RerankStage<bfloat16, cpu::Context> with_entries(limits, {.budget = 8, .entries = 16});
  expect_error([&] { with_entries.keep_entries({}, out, {}, {}); },
               {"RerankStage::keep_entries", "entries (capacity 8) given with config.entries = 16"});
}

TEST(CpuSelectorRefusals, BadConfigurationsAndInputs) {
  using Oracle = OracleTopK<bfloat16, cpu::Context>;
  using QuestCpu = Quest<bfloat16, cpu::Context>;
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 64, .q_heads = 4, .kv_heads = 2, .head_dim = 64};
  expect_error([&] { Oracle(limits, {.budget = 0}); }, "config.budget (= 0) must be positive");
  expect_error([&] { QuestCpu(limits, {.budget = 8, .page_size = 16}); },
               "config.budget (= 8) is smaller than one page (page_size = 16)");
  expect_error([&] { QuestCpu(limits, {.budget = 8, .page_size = 0}); }, "config.page_size (= 0) must be positive");
  auto bad = limits;
  bad.q_heads = 3;
  expect_error([&] { Oracle(bad, {.budget = 8}); },
               "limits.q_heads (= 3) must be a positive multiple of limits.kv_heads (= 2)");
  bad = limits;
  bad.max_slots = 0;
  expect_error([&] { Oracle(bad, {.budget = 8}); }, "limits.max_slots (= 0) must be positive");
  bad = limits;
  bad.max_tokens = 0;
  expect_error([&] { Oracle(bad, {.budget = 8}); }, "limits.max_tokens (= 0) is outside [1, 2^30 = 1073741824]");
  bad.max_tokens = std::numeric_limits<std::int32_t>::max();  // sums of token counts would overflow int32
  expect_error([&] { Oracle(bad, {.budget = 8}); }, "limits.max_tokens (= 2147483647) is outside [1, 2^30");
  Oracle selector(limits, {.budget = 8});
  expect_error([&] { (void)selector.select_workspace_bytes({3, 4, 2, 64, 64}, {}); },
               "shape.batch (= 3) is outside [1, limits.max_slots = 2]");
  expect_error([&] { (void)selector.select_workspace_bytes({1, 4, 2, 64, 65}, {}); },
               "shape.max_seq_len (= 65) is outside [0, limits.max_tokens = 64]");

  // A valid select call, then one thing wrong at a time.
  std::vector<bfloat16> k(2 * 2 * 64 * 64), q(2 * 4 * 64);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = from_float<bfloat16>(float(i % 7) - 3.0f);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = from_float<bfloat16>(float(i % 5) - 2.0f);
  std::vector<std::int32_t> lens{64, 30}, slots{1, 0}, indices(2 * 2 * 8), counts(4, -1);
  const KVCache<const bfloat16> cache =
      ContiguousKVView<const bfloat16>::packed(k.data(), k.data(), 2, 2, 64, 64, lens.data());
  const SelectInputs<bfloat16> in{.q = QueryView<const bfloat16>::packed(q.data(), 2, 4, 64), .cache = cache,
                                  .slots = slots.data(), .lengths = lens.data()};
  const SelectionView out{indices.data(), counts.data(), nullptr, 2, 2, 8};
  auto workspace = poisoned_workspace(selector.select_workspace_bytes({2, 4, 2, 64, 64}, {}));
  selector.prepare({.cache = cache, .slots = slots.data()}, {});
  selector.select(in, out, workspace.bytes(), {});
  EXPECT_EQ(counts, (std::vector<std::int32_t>{8, 8, 8, 8}));
  const std::vector<std::int32_t> bad_slots{2, 0};
  auto wrong = in;
  wrong.slots = bad_slots.data();
  expect_error([&] { selector.select(wrong, out, workspace.bytes(), {}); },
               "slots[0] (= 2) is outside [0, limits.max_slots = 2)");
  wrong = in;
  wrong.q.heads = 2;
  expect_error([&] { selector.select(wrong, out, workspace.bytes(), {}); },
               "in.q [2, 2, 64] != [batch = 2, q_heads = 4, head_dim = 64]");
  wrong = in;
  wrong.attention.window.sink = -1;
  expect_error([&] { selector.select(wrong, out, workspace.bytes(), {}); }, "in.attention.window.sink");
  auto small = out;
  small.capacity = 7;
  expect_error([&] { selector.select(in, small, workspace.bytes(), {}); },
               "out.capacity (= 7) is smaller than the selector's capacity (= 8)");
  expect_error([&] { selector.select(in, out, workspace.bytes().first(workspace.bytes().size() - 256), {}); },
               "workspace too small");
}

}  // namespace
}  // namespace kvsift::test
