// The reference selectors (OracleTopK, Quest, StreamingLLM) on the CPU, through the decode step: selections
// against fp64 references of their scores, outputs against the fp64 reference attention over window and
// selection, on contiguous and paged bf16 and fp16 caches with ragged lengths; the steps append tokens; every
// refused input.
#include <gtest/gtest.h>

#include <memory>
#include <numeric>

#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/oracle_topk.hpp"
#include "kvsift/selectors/quest.hpp"
#include "kvsift/selectors/streaming_llm.hpp"
#include "kvsift/step/decode_step.hpp"
#include "selector_check.hpp"

namespace kvsift::test {
namespace {

constexpr AttentionWindow kWindow{4, 16};

/// A 256-byte aligned host workspace of `bytes` bytes, poisoned.
class HostWorkspace {
 public:
  explicit HostWorkspace(std::size_t bytes) : storage_(bytes + WorkspaceLayout::kAlignment, std::byte{0xff}) {
    void* base = storage_.data();
    std::size_t space = storage_.size();
    span_ = {static_cast<std::byte*>(std::align(WorkspaceLayout::kAlignment, bytes, base, space)), bytes};
  }
  std::span<std::byte> span() const { return span_; }

 private:
  std::vector<std::byte> storage_;
  std::span<std::byte> span_;
};

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
  SelectorLimits limits() const {
    return {.max_slots = p.spec.batch, .max_tokens = p.spec.tokens, .q_heads = p.spec.q_heads,
            .kv_heads = p.spec.kv_heads, .head_dim = p.spec.head_dim};
  }
  DecodeStepConfig config(const AttentionWindow& window) const {
    return {.attention = {.window = window}, .max_batch = p.spec.batch, .q_heads = p.spec.q_heads,
            .kv_heads = p.spec.kv_heads, .head_dim = p.spec.head_dim, .max_seq_len = p.spec.tokens};
  }
};

struct HostSelectionCopy {
  std::vector<std::int32_t> indices, counts;
};

/// One step of `step` on fixture f (after prepare); returns the selection, and checks the step's output against
/// the reference attention over window and selection.
template <class Step, class T>
HostSelectionCopy run_step(Step& step, StepFixture<T>& f, const HostWorkspace& workspace, const cpu::Context& ctx,
                           const StepInputs<T>& extra = {}) {
  const auto& c = f.p.spec;
  HostState out(c.batch, c.q_heads, c.head_dim);
  std::vector<T> o(out.o.size(), from_float<T>(kPoison));
  StepInputs<T> in = extra;
  in.q = f.p.q_view();
  in.cache = f.cache();
  in.slots = f.slots.data();
  step.run(in, StateView<T>::packed(o.data(), out.lse.data(), c.batch, c.q_heads, c.head_dim), workspace.span(), ctx);
  const SelectionView sel = step.selection(workspace.span(), c.batch, ctx);
  HostState ref(c.batch, c.q_heads, c.head_dim);
  reference::sparse_decode(f.p.q_view(), f.p.kv_values.view(), sel, ref.view, step.config().attention);
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
      step.prepare({.cache = f.cache().as_const(), .slots = f.slots.data()}, ctx);
      const HostWorkspace workspace(step.workspace_bytes());
      const auto sel = run_step(step, f, workspace, ctx);
      expect_oracle_selection(f.p, sel.indices, sel.counts, budget, budget, kWindow, 1.0 / std::sqrt(64.0));
    }
  }
}

TYPED_TEST(CpuSelectors, QuestTakesTheBestPagesWhole) {
  using T = TypeParam;
  for (const std::int32_t page_size : {0, 16}) {
    const CaseSpec spec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .tokens = 600, .k = 0,
                        .page_size = page_size, .log_weights = false};
    SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
    StepFixture<T> f(this->rng, spec);
    const cpu::Context ctx{};
    DecodeStep step(Quest<T, cpu::Context>(f.limits(), {.budget = 100, .page_size = 8}), f.config(kWindow), ctx);
    EXPECT_EQ(step.selector().capacity(), 96);  // 12 whole pages of 8
    step.prepare({.cache = f.cache().as_const(), .slots = f.slots.data()}, ctx);
    const HostWorkspace workspace(step.workspace_bytes());
    const auto sel = run_step(step, f, workspace, ctx);
    expect_quest_selection(f.p, sel.indices, sel.counts, 96, 12, 8, kWindow);
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
  step.prepare({.cache = f.cache().as_const(), .slots = f.slots.data()}, ctx);
  const HostWorkspace workspace(step.workspace_bytes());
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
  step.prepare({.cache = f.cache().as_const(), .slots = f.slots.data()}, ctx);
  const HostWorkspace workspace(step.workspace_bytes());
  const auto sel = run_step(step, f, workspace, ctx);
  for (const std::int32_t count : sel.counts) EXPECT_EQ(count, 0);
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
  expect_error([&] { Oracle(bad, {.budget = 8}); }, "limits.max_tokens (= 0) must be positive");
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
  const HostWorkspace workspace(selector.select_workspace_bytes({2, 4, 2, 64, 64}, {}));
  selector.select(in, out, workspace.span(), {});
  EXPECT_EQ(counts, (std::vector<std::int32_t>{8, 8, 8, 8}));
  const std::vector<std::int32_t> bad_slots{2, 0};
  auto wrong = in;
  wrong.slots = bad_slots.data();
  expect_error([&] { selector.select(wrong, out, workspace.span(), {}); },
               "slots[0] (= 2) is outside [0, limits.max_slots = 2)");
  wrong = in;
  wrong.q.heads = 2;
  expect_error([&] { selector.select(wrong, out, workspace.span(), {}); },
               "in.q [2, 2, 64] != [batch = 2, q_heads = 4, head_dim = 64]");
  wrong = in;
  wrong.attention.window.sink = -1;
  expect_error([&] { selector.select(wrong, out, workspace.span(), {}); }, "in.attention.window.sink");
  auto small = out;
  small.capacity = 7;
  expect_error([&] { selector.select(in, small, workspace.span(), {}); },
               "out.capacity (= 7) is smaller than the selector's capacity (= 8)");
  expect_error([&] { selector.select(in, out, workspace.span().first(workspace.span().size() - 256), {}); },
               "workspace too small");
}

}  // namespace
}  // namespace kvsift::test
