// The reference selectors on CUDA through the decode step: the same checks as the CPU's (selections against
// fp64 references of their scores, with candidates within a stated epsilon of the k-th score free to trade
// places; outputs against the fp64 reference attention), on contiguous and paged bf16 and fp16 caches; and
// several decode steps (token write, append, select, attend) captured in a CUDA graph and replayed, equal bit
// for bit to the eager run.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

#include "gpu_test.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/selectors/rerank.hpp"
#include "kvsift/selectors/streaming_llm/streaming_llm.hpp"
#include "kvsift/step/decode_step.hpp"
#include "selector_check.hpp"

namespace kvsift::test {
namespace {

constexpr AttentionWindow kWindow{4, 16};

template <class T>
class CudaSelectors : public GpuTest {};
using StorageTypes = testing::Types<bfloat16, half>;
TYPED_TEST_SUITE(CudaSelectors, StorageTypes);

/// A host problem and its device copy: queries, the cache (contiguous or paged), slots.
template <class T>
struct DeviceFixture {
  HostDecodeProblem<T> p;
  std::vector<std::int32_t> slots;
  DeviceBuffer<T> q, k, v;
  DeviceBuffer<std::int32_t> seq_lens, indptr, page_indices, last_len, d_slots;

  DeviceFixture(Random& rng, const CaseSpec& spec) : p(rng, spec), slots(std::size_t(spec.batch)) {
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng.engine);
    q = DeviceBuffer<T>(p.q);
    k = DeviceBuffer<T>(spec.page_size == 0 ? p.k : p.k_pages);
    v = DeviceBuffer<T>(spec.page_size == 0 ? p.v : p.v_pages);
    seq_lens = DeviceBuffer<std::int32_t>(p.kv_values.seq_lens);
    if (spec.page_size > 0) {
      indptr = DeviceBuffer<std::int32_t>(p.paged_values->indptr);
      page_indices = DeviceBuffer<std::int32_t>(p.paged_values->indices);
      last_len = DeviceBuffer<std::int32_t>(p.paged_values->last_len);
    }
    d_slots = DeviceBuffer<std::int32_t>(slots);
  }
  KVCache<T> cache() const {
    const auto& c = p.spec;
    if (c.page_size == 0) {
      return ContiguousKVView<T>::packed(k.data(), v.data(), c.batch, c.kv_heads, c.tokens, c.head_dim, seq_lens.data());
    }
    const auto& h = p.paged_values->view;
    return PagedKVView<T>{k.data(), v.data(), indptr.data(), page_indices.data(), last_len.data(), h.batch,
                          h.kv_heads, h.head_dim, h.page_size, h.num_pages, h.page_stride, h.token_stride, h.head_stride};
  }
  QueryView<const T> q_view() const { return QueryView<const T>::packed(q.data(), p.spec.batch, p.spec.q_heads, p.spec.head_dim); }
  SelectorLimits limits() const { return case_limits(p.spec); }
  DecodeStepConfig config() const { return case_step_config(p.spec, kWindow); }
};

struct StepResult {
  std::vector<std::int32_t> indices, counts;
};

/// prepare + one step; checks the output against the reference over window and selection; returns the selection.
template <class Step, class T>
StepResult run_step(Step& step, DeviceFixture<T>& f, const cuda::Context& ctx) {
  const auto& c = f.p.spec;
  step.prepare({.cache = f.cache(), .slots = f.d_slots.data()}, ctx);
  DeviceBuffer<std::byte> workspace(step.workspace_bytes());
  workspace.poison();
  DeviceBuffer<T> o(std::size_t(c.batch) * c.q_heads * c.head_dim);
  DeviceBuffer<float> lse(std::size_t(c.batch) * c.q_heads);
  o.poison();
  lse.poison();
  step.run(StepInputs<T>{.q = f.q_view(), .cache = f.cache(), .slots = f.d_slots.data()},
           StateView<T>::packed(o.data(), lse.data(), c.batch, c.q_heads, c.head_dim),
           {workspace.data(), workspace.size()}, ctx);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  const SelectionView d_sel = step.selection({workspace.data(), workspace.size()}, c.batch);
  StepResult r;
  r.indices.resize(std::size_t(c.batch) * c.kv_heads * d_sel.capacity);
  r.counts.resize(std::size_t(c.batch) * c.kv_heads);
  KVSIFT_CUDA_CHECK(cudaMemcpy(r.indices.data(), d_sel.indices, r.indices.size() * 4, cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(r.counts.data(), d_sel.counts, r.counts.size() * 4, cudaMemcpyDeviceToHost));
  const SelectionView h_sel{r.indices.data(), r.counts.data(), nullptr, c.batch, c.kv_heads, d_sel.capacity};
  HostState ref(c.batch, c.q_heads, c.head_dim);
  AttentionOptions attention = step.config().attention;
  attention.selection_page_size = step.selection_page_size();  // tokens, or a page-level selection's pages
  reference::sparse_decode(f.p.q_view(), f.p.kv_values.view(), h_sel, ref.view, attention);
  expect_close<T>(o.download(), lse.download(), ref, "step output");
  return r;
}

TYPED_TEST(CudaSelectors, OracleTopKIsTheExactTopKOfTheMiddle) {
  using T = TypeParam;
  for (const std::int32_t page_size : {0, 16}) {
    for (const std::int32_t tokens : {40, 3000}) {
      const CaseSpec spec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128, .tokens = tokens, .k = 0,
                          .page_size = page_size, .log_weights = false};
      SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
      DeviceFixture<T> f(this->rng, spec);
      const cuda::Context ctx{};
      DecodeStep step(OracleTopK<T, cuda::Context>(f.limits(), {.budget = 64}), f.config(), ctx);
      const auto sel = run_step(step, f, ctx);
      expect_oracle_selection(f.p, sel.indices, sel.counts, 64, 64, kWindow, 1.0 / std::sqrt(128.0));
    }
  }
}

TYPED_TEST(CudaSelectors, QuestTakesTheBestPagesWhole) {
  using T = TypeParam;
  for (const std::int32_t page_size : {0, 16}) {
    const CaseSpec spec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128, .tokens = 3000, .k = 0,
                        .page_size = page_size, .log_weights = false};
    SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
    DeviceFixture<T> f(this->rng, spec);
    const cuda::Context ctx{};
    DecodeStep step(Quest<T, cuda::Context>(f.limits(), {.budget = 256, .page_size = 16}), f.config(), ctx);
    const auto sel = run_step(step, f, ctx);
    expect_quest_selection(f.p, sel.indices, sel.counts, 256, 16, 16, kWindow);
  }
}

/// config.page_selections (the CPU test's twin): Quest writes its pages (one launch less) and the step attends their
/// middle tokens (run_step: against the fp64 reference over those pages); the pages are the token step's, in order.
TYPED_TEST(CudaSelectors, QuestsPagesAreAttendedWithoutExpansion) {
  using T = TypeParam;
  for (const std::int32_t page_size : {0, 16}) {
    const CaseSpec spec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128, .tokens = 3000, .k = 0,
                        .page_size = page_size, .log_weights = false};
    SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
    DeviceFixture<T> f(this->rng, spec);
    const cuda::Context ctx{};
    DecodeStep tokens(Quest<T, cuda::Context>(f.limits(), {.budget = 256, .page_size = 16}), f.config(), ctx);
    DecodeStepConfig config = f.config();
    config.page_selections = true;
    DecodeStep pages(Quest<T, cuda::Context>(f.limits(), {.budget = 256, .page_size = 16}), config, ctx);
    ASSERT_EQ(pages.selection_page_size(), 16);
    const auto want = run_step(tokens, f, ctx);
    const auto got = run_step(pages, f, ctx);
    ASSERT_EQ(got.indices.size(), std::size_t(spec.batch) * spec.kv_heads * 16);  // 16 pages per row
    expect_pages_expand_to_tokens(f.p, got, 16, 16, want, 256, kWindow);
  }
}

// The CPU test's twin (tests/selectors/test_selectors.cpp): with RerankConfig::mass each row keeps the top-k of
// its exact scores, k the fewest that hold p of the row's mass (mass_budgets on the device).
TYPED_TEST(CudaSelectors, RerankedQuestWithMassKeepsTheFewestBestThatHoldIt) {
  using T = TypeParam;
  for (const std::int32_t page_size : {0, 16}) {
    const CaseSpec spec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128, .tokens = 3000, .k = 0,
                        .page_size = page_size, .log_weights = false};
    DeviceFixture<T> f(this->rng, spec);
    const cuda::Context ctx{};
    const QuestConfig proposer{.budget = 512, .page_size = 16};
    DecodeStep quest(Quest<T, cuda::Context>(f.limits(), proposer), f.config(), ctx);
    const auto candidates = run_step(quest, f, ctx);
    for (const RerankConfig config : {RerankConfig{.budget = 128, .mass = 0.3},
                                      RerankConfig{.budget = 128, .mass = 0.6, .floor = 16},
                                      RerankConfig{.budget = 128, .budget_fraction = 0.02, .mass = 1.0, .floor = 2}}) {
      SCOPED_TRACE(describe(spec) + fmt::format(" mass {} floor {} fraction {} seed {}", config.mass, config.floor,
                                                config.budget_fraction, this->seed));
      DecodeStep step(Reranked(Quest<T, cuda::Context>(f.limits(), proposer), config), f.config(), ctx);
      const auto sel = run_step(step, f, ctx);
      expect_reranked_mass_rows(f.p, candidates, proposer.budget, sel, config, 1.0 / std::sqrt(128.0));
    }
  }
}

// The life cycle on CUDA: a step's slots are device values, which DecodeStep checks against the selector's slot
// states with validate_indices (selectors/detail/slot_states.hpp); release (host slots) refuses a slot without
// a sequence on every path; prepare (which reads the slots on the host) marks them.
TYPED_TEST(CudaSelectors, ValidatingStepsRefuseSlotsWithoutASequence) {
  using T = TypeParam;
  SCOPED_TRACE(testing::Message() << "seed " << this->seed);
  DeviceFixture<T> f(this->rng, CaseSpec{.batch = 2, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .tokens = 600,
                                         .k = 0, .page_size = 0, .log_weights = false});
  const auto& c = f.p.spec;
  const cuda::Context ctx{};
  DecodeStepConfig config = f.config();
  config.validate_indices = true;
  DecodeStep step(OracleTopK<T, cuda::Context>(f.limits(), {.budget = 32}), config, ctx);
  DeviceBuffer<std::byte> workspace(step.workspace_bytes());
  DeviceBuffer<T> o(std::size_t(c.batch) * c.q_heads * c.head_dim);
  DeviceBuffer<float> lse(std::size_t(c.batch) * c.q_heads);
  const auto run = [&] {
    workspace.poison();
    step.run(StepInputs<T>{.q = f.q_view(), .cache = f.cache(), .slots = f.d_slots.data()},
             StateView<T>::packed(o.data(), lse.data(), c.batch, c.q_heads, c.head_dim),
             {workspace.data(), workspace.size()}, ctx);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
  };
  expect_error(run, {"DecodeStep::run: in.slots[0] (= " + std::to_string(f.slots[0]) +
                     ") holds no prepared sequence of the selector (OracleTopK)"});
  expect_error([&] { step.release(std::vector<std::int32_t>{0}); },
               {"OracleTopK::release: slots[0] (= 0) holds no sequence: it was never prepared"});
  step.prepare({.cache = f.cache(), .slots = f.d_slots.data()}, ctx);
  EXPECT_TRUE(step.selector().prepared(0) && step.selector().prepared(1));
  run();
  step.release(std::vector<std::int32_t>{f.slots[1]});
  expect_error(run, {"in.slots[1] (= " + std::to_string(f.slots[1]) + ") holds no prepared sequence"});
  expect_error([&] { step.release(std::vector<std::int32_t>{f.slots[1]}); }, {"it was released"});
}

TYPED_TEST(CudaSelectors, StreamingLLMAttendsTheWindowAlone) {
  using T = TypeParam;
  const CaseSpec spec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128, .tokens = 500, .k = 0,
                      .page_size = 16, .log_weights = false};
  SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
  DeviceFixture<T> f(this->rng, spec);
  const cuda::Context ctx{};
  DecodeStep step(StreamingLLM<T, cuda::Context>(f.limits()), f.config(), ctx);
  const auto sel = run_step(step, f, ctx);
  for (const std::int32_t count : sel.counts) EXPECT_EQ(count, 0);
}

/// Several decode steps of Quest and of OracleTopK (the engine's length update, the step's token write,
/// append, select, attend) captured in one CUDA graph: two replays give bit for bit the eager run's outputs.
template <class T, template <class, class> class Selector, class Config>
void expect_graph_replays_equal_eager(Random& rng, const Config& config) {
  const CaseSpec spec{.batch = 2, .q_heads = 8, .kv_heads = 2, .head_dim = 128, .tokens = 2048, .k = 0,
                      .page_size = 0, .log_weights = false, .random_lengths = false};
  constexpr int kSteps = 4;
  DeviceFixture<T> f(rng, spec);
  const std::vector<std::int32_t> prefill{1500, 1777};
  std::vector<std::int32_t> lengths_per_step;  // [kSteps, batch]: the engine's lengths at each step
  for (int s = 1; s <= kSteps; ++s) {
    for (const std::int32_t len : prefill) lengths_per_step.push_back(len + s);
  }
  const DeviceBuffer<std::int32_t> d_lengths_per_step(lengths_per_step), d_prefill(prefill);
  const auto new_k = to_storage<T>(rng.normal(std::size_t(kSteps) * spec.batch * spec.kv_heads * spec.head_dim));
  const auto new_v = to_storage<T>(rng.normal(new_k.size()));
  const auto queries = to_storage<T>(rng.normal(std::size_t(kSteps) * spec.batch * spec.q_heads * spec.head_dim));
  const DeviceBuffer<T> d_new_k(new_k), d_new_v(new_v), d_queries(queries);
  const DeviceBuffer<T> k0(f.p.k), v0(f.p.v);

  const test::Stream stream;
  const cuda::Context ctx{stream};
  DecodeStep step(Selector<T, cuda::Context>(f.limits(), config), f.config(), ctx);
  DeviceBuffer<std::byte> workspace(step.workspace_bytes());
  const std::size_t o_elems = std::size_t(spec.batch) * spec.q_heads * spec.head_dim;
  DeviceBuffer<T> o(kSteps * o_elems);
  DeviceBuffer<float> lse(std::size_t(kSteps) * spec.batch * spec.q_heads);

  const auto reset = [&] {  // the prefill state: cache contents and lengths, the selector's index, poisoned outputs
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(f.k.data(), k0.data(), k0.size() * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(f.v.data(), v0.data(), v0.size() * sizeof(T), cudaMemcpyDeviceToDevice, stream));
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(f.seq_lens.data(), d_prefill.data(), prefill.size() * 4, cudaMemcpyDeviceToDevice, stream));
    step.prepare({.cache = f.cache(), .slots = f.d_slots.data()}, ctx);
    KVSIFT_CUDA_CHECK(cudaMemsetAsync(o.data(), 0xff, o.size() * sizeof(T), stream));
    KVSIFT_CUDA_CHECK(cudaMemsetAsync(lse.data(), 0xff, lse.size() * sizeof(float), stream));
    KVSIFT_CUDA_CHECK(cudaMemsetAsync(workspace.data(), 0xff, workspace.size(), stream));
  };
  const auto steps = [&] {
    for (int s = 0; s < kSteps; ++s) {
      KVSIFT_CUDA_CHECK(cudaMemcpyAsync(f.seq_lens.data(), d_lengths_per_step.data() + s * spec.batch,
                                        spec.batch * 4, cudaMemcpyDeviceToDevice, stream));
      const std::size_t kv_off = std::size_t(s) * spec.batch * spec.kv_heads * spec.head_dim;
      step.run(StepInputs<T>{.q = QueryView<const T>::packed(d_queries.data() + s * o_elems, spec.batch, spec.q_heads, spec.head_dim),
                             .cache = f.cache(),
                             .k = HeadsView<const T>::packed(d_new_k.data() + kv_off, spec.batch, spec.kv_heads, spec.head_dim),
                             .v = HeadsView<const T>::packed(d_new_v.data() + kv_off, spec.batch, spec.kv_heads, spec.head_dim),
                             .slots = f.d_slots.data()},
               StateView<T>::packed(o.data() + s * o_elems, lse.data() + s * spec.batch * spec.q_heads, spec.batch,
                                    spec.q_heads, spec.head_dim),
               {workspace.data(), workspace.size()}, ctx);
    }
  };
  reset();
  steps();
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto eager_o = o.download();
  const auto eager_lse = lse.download();
  {
    // The eager run's last step is exact attention over the window and its selection, on the cache holding
    // every step's token at its position (which the step wrote).
    const SelectionView d_sel = step.selection({workspace.data(), workspace.size()}, spec.batch);
    std::vector<std::int32_t> indices(std::size_t(spec.batch) * spec.kv_heads * d_sel.capacity), counts(std::size_t(spec.batch) * spec.kv_heads);
    KVSIFT_CUDA_CHECK(cudaMemcpy(indices.data(), d_sel.indices, indices.size() * 4, cudaMemcpyDeviceToHost));
    KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), d_sel.counts, counts.size() * 4, cudaMemcpyDeviceToHost));
    HostKV final_kv = f.p.kv_values;
    for (int s = 0; s < kSteps; ++s) {
      for (std::int32_t b = 0; b < spec.batch; ++b) {
        for (std::int32_t h = 0; h < spec.kv_heads; ++h) {
          const std::size_t src = ((std::size_t(s) * spec.batch + b) * spec.kv_heads + h) * spec.head_dim;
          const std::size_t dst = ((std::size_t(b) * spec.kv_heads + h) * spec.tokens + prefill[b] + s) * spec.head_dim;
          for (std::int32_t i = 0; i < spec.head_dim; ++i) {
            final_kv.k[dst + i] = to_float(new_k[src + i]);
            final_kv.v[dst + i] = to_float(new_v[src + i]);
          }
        }
      }
    }
    final_kv.seq_lens = {prefill[0] + kSteps, prefill[1] + kSteps};
    const std::vector<T> last_q(queries.begin() + std::ptrdiff_t(kSteps - 1) * o_elems, queries.end());
    HostState ref(spec.batch, spec.q_heads, spec.head_dim);
    reference::sparse_decode(QueryView<const T>::packed(last_q.data(), spec.batch, spec.q_heads, spec.head_dim),
                             final_kv.view(),
                             SelectionView{indices.data(), counts.data(), nullptr, spec.batch, spec.kv_heads, d_sel.capacity},
                             ref.view, step.config().attention);
    const std::vector<T> last_o(eager_o.begin() + std::ptrdiff_t(kSteps - 1) * o_elems, eager_o.end());
    const std::vector<float> last_lse(eager_lse.end() - std::ptrdiff_t(spec.batch) * spec.q_heads, eager_lse.end());
    expect_close<T>(last_o, last_lse, ref, "the eager run's last step");
  }

  reset();
  const test::CapturedGraph graph(stream, [&] {
    steps();
  });
  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE(fmt::format("replay {}", replay));
    if (replay > 0) reset();
    graph.launch();
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto graph_o = o.download();
    const auto graph_lse = lse.download();
    ASSERT_EQ(0, std::memcmp(graph_o.data(), eager_o.data(), graph_o.size() * sizeof(T)));
    ASSERT_EQ(0, std::memcmp(graph_lse.data(), eager_lse.data(), graph_lse.size() * sizeof(float)));
  }
}

TYPED_TEST(CudaSelectors, QuestStepsCapturedInAGraphReplayAsEager) {
  SCOPED_TRACE(fmt::format("seed {}", this->seed));
  expect_graph_replays_equal_eager<TypeParam, Quest>(this->rng, QuestConfig{.budget = 256, .page_size = 16});
}

TYPED_TEST(CudaSelectors, OracleTopKStepsCapturedInAGraphReplayAsEager) {
  SCOPED_TRACE(fmt::format("seed {}", this->seed));
  expect_graph_replays_equal_eager<TypeParam, OracleTopK>(this->rng, OracleTopKConfig{.budget = 256});
}

}  // namespace
}  // namespace kvsift::test
