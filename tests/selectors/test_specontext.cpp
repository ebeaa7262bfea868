// SpeContext on the CPU: the retrieval head's selection (owned and engine-kept paged head caches, per kv head and
// batch-level) against an fp64 brute force with its own YaRN RoPE, short sequences, the multi-layer step's outputs
// against fp64 sparse attention over each layer's cache with the one selection, max_score_rows, and every refusal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>

#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/specontext/groups.hpp"
#include "kvsift/selectors/specontext/specontext.hpp"
#include "kvsift/selectors/specontext/step.hpp"
#include "specontext_problem.hpp"

namespace kvsift::test {
namespace {

static_assert(KVSelector<SpeContext<bfloat16, cpu::Context>>);

cpu::Array<std::byte> poisoned(std::size_t bytes) {
  cpu::Array<std::byte> w(bytes);
  std::fill_n(w.data(), bytes, std::byte{0xff});
  return w;
}

template <class T>
class CpuSpeContext : public SeededTest {};
using StorageTypes = testing::Types<bfloat16, half>;
TYPED_TEST_SUITE(CpuSpeContext, StorageTypes);

/// A problem on the CPU: the layer caches (layer 0's lengths serve the head), the head's pages when the engine
/// keeps them, and the views the selector and the step take.
template <class T>
struct CpuFixture {
  SpeContextProblem<T> p;
  std::vector<std::int32_t> seq_lens;  ///< the layers' lengths: the prompts', then the step's
  std::vector<T> head_pages;       ///< the engine's paged head cache
  std::vector<T> head_contiguous;  ///< the engine's contiguous head cache
  typename SpeContextProblem<T>::PageTable table;
  /// With use_block_table(): the head's pages as vLLM's block table [batch, block_table_stride] (each row's pages,
  /// then garbage) with seq_lens, PagedKVView's block-table form, in place of the CSR table.
  std::vector<std::int32_t> block_table;
  std::int64_t block_table_stride = 0;
  cpu::Context ctx{};

  CpuFixture(Random& rng, const SpeContextSpec& spec) : p(rng, spec), seq_lens(p.prompt_lengths) {
    if (spec.head_page_size > 0) {
      head_pages.assign(std::size_t(p.head_num_pages) * spec.head_page_size * spec.kv_heads * spec.head_dim,
                        from_float<T>(kPoison));
      table = p.page_table(seq_lens);
    }
    if (spec.head_contiguous) {
      head_contiguous.assign(std::size_t(spec.batch) * spec.kv_heads * spec.max_tokens * spec.head_dim,
                             from_float<T>(kPoison));
    }
  }
  bool engine() const { return p.spec.head_page_size > 0 || p.spec.head_contiguous; }
  void use_block_table() {
    std::size_t widest = 0;
    for (const auto& pages : p.head_pages) widest = std::max(widest, pages.size());
    block_table_stride = std::int64_t(widest) + 1;
    block_table.assign(std::size_t(p.spec.batch) * std::size_t(block_table_stride), -1);
    for (std::size_t b = 0; b < p.head_pages.size(); ++b) {
      std::copy(p.head_pages[b].begin(), p.head_pages[b].end(), block_table.begin() + std::ptrdiff_t(b * block_table_stride));
      block_table[(b + 1) * std::size_t(block_table_stride) - 1] = p.head_num_pages + 7;  // garbage past every row
    }
  }
  void to_step() {
    seq_lens = p.lengths;
    if (p.spec.head_page_size > 0) table = p.page_table(seq_lens);
  }
  KVCache<T> layer(std::int32_t l) {
    const auto& s = p.spec;
    return ContiguousKVView<T>::packed(p.layer_k[std::size_t(l)].data(), p.layer_v[std::size_t(l)].data(), s.batch,
                                       s.kv_heads, s.max_tokens, s.head_dim, seq_lens.data());
  }
  /// The cache the selector reads lengths from (and, engine-kept, the head's).
  KVCache<const T> head_input() {
    const auto& s = p.spec;
    if (s.head_contiguous) {
      return ContiguousKVView<const T>::packed(head_contiguous.data(), head_contiguous.data(), s.batch, s.kv_heads,
                                               s.max_tokens, s.head_dim, seq_lens.data());
    }
    if (s.head_page_size == 0) return layer(0);
    PagedKVView<const T> view = p.head_view(head_pages.data(), table).as_const();
    if (block_table_stride > 0) {
      view.page_indptr = nullptr;
      view.last_page_len = nullptr;
      view.page_indices = block_table.data();
      view.block_table_stride = block_table_stride;
      view.seq_lens = seq_lens.data();
    }
    return view;
  }
  SpeContextConfig config(std::int32_t budget, SpeContextMode mode) const {
    return {.budget = budget, .mode = mode,
            .head_cache = engine() ? SpeContextHeadCache::engine : SpeContextHeadCache::owned, .rope = test_head_rope()};
  }
  PrefillInputs<T> prefill() {
    const auto& s = p.spec;
    return {.cache = head_input(), .slots = p.slots.data(),
            .k_pre_rope = SequenceView<const T>::packed(p.k_r.data(), s.batch, s.kv_heads, s.max_tokens, s.head_dim)};
  }
  HeadsView<const T> k_step() const {
    return HeadsView<const T>::packed(p.k_step.data(), p.spec.batch, p.spec.kv_heads, p.spec.head_dim);
  }
  QueryView<const T> q_r() const {
    return QueryView<const T>::packed(p.q_r.data(), p.spec.batch, p.spec.q_heads, p.spec.head_dim);
  }
};

/// prepare, then one step (append + select) of a selector; returns the selection.
template <class T>
HostSelection run_selector(CpuFixture<T>& f, SpeContext<T, cpu::Context>& s, const AttentionWindow& window) {
  const auto& c = f.p.spec;
  s.prepare(f.prefill(), f.ctx);
  f.to_step();
  const SelectShape shape{c.batch, c.q_heads, c.kv_heads, c.head_dim, 0};
  auto append_ws = poisoned(s.append_workspace_bytes(shape, f.ctx));
  auto select_ws = poisoned(s.select_workspace_bytes(shape, f.ctx));
  const KVCache<const T> cache = f.head_input();
  s.append({.cache = cache, .slots = f.p.slots.data(), .lengths = f.seq_lens.data(), .k_pre_rope = f.k_step()},
           append_ws.bytes(), f.ctx);
  HostSelection out(c.batch, c.kv_heads, s.capacity(), false);
  s.select({.q = f.q_r(), .cache = cache, .slots = f.p.slots.data(), .lengths = f.seq_lens.data(),
            .attention = {.window = window}},
           out.view, select_ws.bytes(), f.ctx);
  return out;
}

/// The head cache's rotated keys equal the reference's (fp64 rotation rounded to T) within 2 ulps of T (the two
/// round to neighbours; kvsift's fp32 table and rotation add under an ulp), plus an absolute term of a few fp32
/// ulps of the row's scale for elements the rotation nearly cancels.
template <class T>
void expect_head_keys(const SpeContextProblem<T>& p, const KVCache<const T>& head) {
  const double eps_t = std::is_same_v<T, float> ? 0x1p-23 : std::is_same_v<T, half> ? 0x1p-10 : 0x1p-7;
  const std::int32_t d = p.spec.head_dim;
  std::int64_t far = 0;
  for (std::int32_t b = 0; b < p.spec.batch; ++b) {
    for (std::int32_t g = 0; g < p.spec.kv_heads; ++g) {
      for (std::int32_t t = 0; t < p.lengths[std::size_t(b)]; ++t) {
        const auto want = p.rotated_key(b, g, t);
        double scale = 0;
        for (const double w : want) scale = std::max(scale, std::abs(w));
        const T* got = head.visit([&](const auto& v) { return v.k_row(b, g, t); });
        for (std::int32_t c = 0; c < d; ++c) {
          const double diff = std::abs(to_float(got[c]) - want[std::size_t(c)]);
          if (!(diff <= 2 * eps_t * std::abs(want[std::size_t(c)]) + 8 * 0x1p-24 * scale)) ++far;
        }
      }
    }
  }
  EXPECT_EQ(far, 0) << "head keys differ from the reference rotation by more than 2 ulps";
}

TYPED_TEST(CpuSpeContext, HeadSelectionEqualsBruteForce) {
  using T = TypeParam;
  SCOPED_TRACE(this->seed);
  for (const bool batch_level : {false, true}) {
    for (const AttentionWindow window : {specontext_window({}), specontext_window({4, 64})}) {
      // owned, engine-kept paged (CSR), engine-kept contiguous, engine-kept paged as a vLLM block table
      for (const std::int32_t cache_kind : {0, 1, 2, 3}) {
        CpuFixture<T> f(this->rng, {.head_page_size = cache_kind == 1 || cache_kind == 3 ? 16 : 0,
                                    .head_contiguous = cache_kind == 2});
        if (cache_kind == 3) f.use_block_table();
        const SpeContextMode mode = batch_level ? SpeContextMode::batch_level : SpeContextMode::per_kv_head;
        SpeContext<T, cpu::Context> s(f.p.limits(), f.config(24, mode), f.ctx);
        const HostSelection out = run_selector(f, s, window);
        const char* kinds[] = {"owned", "engine paged", "engine contiguous", "engine block table"};
        const std::string what = fmt::format("{} window {}+{} {}", batch_level ? "batch-level" : "per kv head",
                                             window.sink, window.recent, kinds[cache_kind]);
        expect_head_selection(f.p, out.indices, out.counts, s.capacity(), 24, window, batch_level, what);
        const KVCache<const T> head = s.head_cache(f.head_input(), f.p.slots.data(), f.seq_lens.data(), f.p.spec.batch);
        expect_head_keys(f.p, head);
      }
    }
  }
}

/// Through AnySelector (the type-erased interface the fidelity harness drives): the same selection as the selector
/// called directly on the same problem.
TYPED_TEST(CpuSpeContext, AnySelectorDrivesIt) {
  using T = TypeParam;
  SCOPED_TRACE(this->seed);
  CpuFixture<T> f(this->rng, {});
  CpuFixture<T> g = f;  // the same problem, its own lengths
  SpeContext<T, cpu::Context> direct(f.p.limits(), f.config(24, SpeContextMode::per_kv_head), f.ctx);
  const HostSelection want = run_selector(f, direct, specontext_window({}));
  AnySelector<T, cpu::Context> any(SpeContext<T, cpu::Context>(g.p.limits(), g.config(24, SpeContextMode::per_kv_head), g.ctx));
  EXPECT_EQ(any.name(), "SpeContext");
  EXPECT_EQ(any.capacity(), 24);
  const auto& c = g.p.spec;
  any.prepare(g.prefill(), g.ctx);
  g.to_step();
  const SelectShape shape{c.batch, c.q_heads, c.kv_heads, c.head_dim, 0};
  auto append_ws = poisoned(any.append_workspace_bytes(shape, g.ctx));
  auto select_ws = poisoned(any.select_workspace_bytes(shape, g.ctx));
  any.append({.cache = g.head_input(), .slots = g.p.slots.data(), .lengths = g.seq_lens.data(), .k_pre_rope = g.k_step()},
             append_ws.bytes(), g.ctx);
  HostSelection got(c.batch, c.kv_heads, any.capacity(), false);
  any.select({.q = g.q_r(), .cache = g.head_input(), .slots = g.p.slots.data(), .lengths = g.seq_lens.data(),
              .attention = {.window = specontext_window({})}},
             got.view, select_ws.bytes(), g.ctx);
  EXPECT_EQ(got.counts, want.counts);
  EXPECT_EQ(got.indices, want.indices);
}

TYPED_TEST(CpuSpeContext, ShortSequencesSelectEverything) {
  using T = TypeParam;
  SCOPED_TRACE(this->seed);
  for (const bool batch_level : {false, true}) {
    CpuFixture<T> f(this->rng, {.max_tokens = 128, .min_length = 3, .max_length = 100});
    SpeContext<T, cpu::Context> s(f.p.limits(),
                                  f.config(120, batch_level ? SpeContextMode::batch_level : SpeContextMode::per_kv_head),
                                  f.ctx);
    const AttentionWindow window = specontext_window({});
    const HostSelection out = run_selector(f, s, window);
    for (std::int32_t b = 0; b < f.p.spec.batch; ++b) {
      std::vector<std::int32_t> all(std::size_t(f.p.lengths[std::size_t(b)] - 1));  // every token but the window's
      std::iota(all.begin(), all.end(), 0);
      for (std::int32_t g = 0; g < f.p.spec.kv_heads; ++g) {
        EXPECT_EQ(selection_row(out.indices, out.counts, b * f.p.spec.kv_heads + g, s.capacity()), all)
            << "row (" << b << ", " << g << ")";
      }
    }
  }
}

TYPED_TEST(CpuSpeContext, StepAttendsEveryLayerWithTheOneSelection) {
  using T = TypeParam;
  SCOPED_TRACE(this->seed);
  for (const AttentionWindow window : {AttentionWindow{}, AttentionWindow{4, 64}}) {
    for (const std::int32_t page_size : {0, 32}) {
      CpuFixture<T> f(this->rng, {.head_page_size = page_size});
      const auto& c = f.p.spec;
      SpeContextStep<T, cpu::Context> step(
          SpeContext<T, cpu::Context>(f.p.limits(), f.config(32, SpeContextMode::per_kv_head), f.ctx),
          {.step = {.attention = {.window = window}, .max_batch = c.batch, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
                    .head_dim = c.head_dim, .max_seq_len = c.max_tokens},
           .layers = c.layers},
          f.ctx);
      auto ws = poisoned(step.workspace_bytes());
      step.prepare(f.prefill(), f.ctx);
      f.to_step();
      step.select({.q = f.q_r(), .k = f.k_step(), .cache = f.head_input(), .slots = f.p.slots.data()}, ws.bytes(), f.ctx);
      const SelectionView sel = step.selection(ws.bytes(), c.batch);
      const std::vector<std::int32_t> indices(sel.indices, sel.indices + std::size_t(c.batch) * c.kv_heads * sel.capacity);
      const std::vector<std::int32_t> counts(sel.counts, sel.counts + std::size_t(c.batch) * c.kv_heads);
      const AttentionWindow effective = step.attention().window;
      EXPECT_EQ(effective.recent, std::max(window.recent, 1));
      expect_head_selection(f.p, indices, counts, sel.capacity, 32, effective, false, "step");
      for (std::int32_t l = 0; l < c.layers; ++l) {
        HostState out(c.batch, c.q_heads, c.head_dim);
        std::vector<T> o(out.o.size(), from_float<T>(kPoison));
        const std::size_t step_at = std::size_t(l) * c.batch * c.kv_heads * c.head_dim;
        step.attend({.q = QueryView<const T>::packed(f.p.layer_q.data() + std::size_t(l) * c.batch * c.q_heads * c.head_dim,
                                                     c.batch, c.q_heads, c.head_dim),
                     .cache = f.layer(l),
                     .k = HeadsView<const T>::packed(f.p.step_k.data() + step_at, c.batch, c.kv_heads, c.head_dim),
                     .v = HeadsView<const T>::packed(f.p.step_v.data() + step_at, c.batch, c.kv_heads, c.head_dim),
                     .layer = l},
                    StateView<T>::packed(o.data(), out.lse.data(), c.batch, c.q_heads, c.head_dim), ws.bytes(), f.ctx);
        expect_close(o, out.lse, f.p.attention(l, indices, counts, sel.capacity, effective),
                     fmt::format("layer {} window {}+{}", l, window.sink, window.recent));
      }
    }
  }
}

/// config.rerank: every layer keeps the best K of the step's selection (c x K = 4 x 8 candidates) by its own exact
/// scores (fp64: the layer's group softmax over the candidates, max over the group) and attends those, against
/// fp64 attention; a second step without the rerank attends the whole selection as before.
TYPED_TEST(CpuSpeContext, RerankPerLayerKeepsEachLayersBestCandidates) {
  using T = TypeParam;
  SCOPED_TRACE(this->seed);
  constexpr std::int32_t kCandidates = 32, kKept = 8;
  CpuFixture<T> f(this->rng, {});
  const auto& c = f.p.spec;
  const AttentionWindow window{4, 16};
  SpeContextStep<T, cpu::Context> step(
      SpeContext<T, cpu::Context>(f.p.limits(), f.config(kCandidates, SpeContextMode::per_kv_head), f.ctx),
      {.step = {.attention = {.window = window}, .max_batch = c.batch, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
                .head_dim = c.head_dim, .max_seq_len = c.max_tokens},
       .layers = c.layers,
       .rerank = {.budget = kKept}},
      f.ctx);
  ASSERT_NE(step.rerank(), nullptr);
  EXPECT_EQ(step.rerank()->budget, kKept);
  EXPECT_EQ(step.capacity(), kCandidates);
  auto ws = poisoned(step.workspace_bytes());
  step.prepare(f.prefill(), f.ctx);
  f.to_step();
  step.select({.q = f.q_r(), .k = f.k_step(), .cache = f.head_input(), .slots = f.p.slots.data()}, ws.bytes(), f.ctx);
  const SelectionView sel = step.selection(ws.bytes(), c.batch);
  const std::int32_t rows = c.batch * c.kv_heads;
  for (std::int32_t l = 0; l < c.layers; ++l) {
    SCOPED_TRACE(fmt::format("layer {}", l));
    HostState out(c.batch, c.q_heads, c.head_dim);
    std::vector<T> o(out.o.size(), from_float<T>(kPoison));
    const T* q = f.p.layer_q.data() + std::size_t(l) * c.batch * c.q_heads * c.head_dim;
    const std::size_t step_at = std::size_t(l) * c.batch * c.kv_heads * c.head_dim;
    step.attend({.q = QueryView<const T>::packed(q, c.batch, c.q_heads, c.head_dim),
                 .cache = f.layer(l),
                 .k = HeadsView<const T>::packed(f.p.step_k.data() + step_at, c.batch, c.kv_heads, c.head_dim),
                 .v = HeadsView<const T>::packed(f.p.step_v.data() + step_at, c.batch, c.kv_heads, c.head_dim),
                 .layer = l},
                StateView<T>::packed(o.data(), out.lse.data(), c.batch, c.q_heads, c.head_dim), ws.bytes(), f.ctx);
    const SelectionView kept = step.reranked_selection(ws.bytes(), c.batch);
    ASSERT_EQ(kept.capacity, kKept);
    const std::vector<std::int32_t> kept_indices(kept.indices, kept.indices + std::size_t(rows) * kKept);
    const std::vector<std::int32_t> kept_counts(kept.counts, kept.counts + rows);
    for (std::int32_t b = 0; b < c.batch; ++b) {
      for (std::int32_t g = 0; g < c.kv_heads; ++g) {
        const std::int32_t row = b * c.kv_heads + g;
        const std::vector<std::int32_t> candidates(sel.indices + std::size_t(row) * sel.capacity,
                                                   sel.indices + std::size_t(row) * sel.capacity + sel.counts[row]);
        ASSERT_GT(candidates.size(), std::size_t(kKept));  // every row has more candidates than it keeps
        const auto scores = f.p.layer_rerank_scores(l, b, g, candidates);
        double top = 0;
        for (const auto& [id, score] : scores) top = std::max(top, score);
        expect_top_k({kept.indices + std::size_t(row) * kKept, kept.indices + std::size_t(row) * kKept + kept.counts[row]},
                     scores, kKept, 1e-4 * top, fmt::format("row ({}, {})", b, g));
      }
    }
    expect_close(o, out.lse, f.p.attention(l, kept_indices, kept_counts, kKept, step.attention().window),
                 fmt::format("layer {}", l));
    // The same candidates given back (a selection kept from an earlier select): the same kept rows and output, bit
    // for bit (the layer's token is written already). Validated, a candidate past its sequence is refused.
    std::vector<std::int32_t> given_indices(sel.indices, sel.indices + std::size_t(rows) * sel.capacity);
    std::vector<std::int32_t> given_counts(sel.counts, sel.counts + rows);
    const SelectionView given{given_indices.data(), given_counts.data(), nullptr, c.batch, c.kv_heads, sel.capacity};
    std::vector<T> again(o.size(), from_float<T>(kPoison));
    std::vector<float> again_lse(out.lse.size(), kPoison);
    const SpeContextLayerInputs<T> layer_in{.q = QueryView<const T>::packed(q, c.batch, c.q_heads, c.head_dim),
                                            .cache = f.layer(l), .layer = l};
    step.attend_candidates(layer_in, given, StateView<T>::packed(again.data(), again_lse.data(), c.batch, c.q_heads,
                                                                 c.head_dim),
                           ws.bytes(), f.ctx, /*validate_indices=*/true);
    EXPECT_EQ(std::memcmp(again.data(), o.data(), o.size() * sizeof(T)), 0);
    EXPECT_EQ(std::memcmp(again_lse.data(), out.lse.data(), out.lse.size() * sizeof(float)), 0);
    const SelectionView kept_again = step.reranked_selection(ws.bytes(), c.batch);
    EXPECT_TRUE(std::equal(kept_indices.begin(), kept_indices.end(), kept_again.indices));
    given_indices[0] = f.p.lengths[0] + 5;
    expect_error([&] {
      step.attend_candidates(layer_in, given, StateView<T>::packed(again.data(), again_lse.data(), c.batch, c.q_heads,
                                                                   c.head_dim),
                             ws.bytes(), f.ctx, /*validate_indices=*/true);
    }, {"is outside [0, seq_len"});
  }
}

/// SpeContextGroups: three heads (three synthetic heads over the same sequences) for the groups {0}, {1, 2} and {3}
/// of four layers: each group's selection is its own head's top B (fp64 brute force), each layer's output is fp64
/// attention over its group's selection (with a rerank per layer, over that layer's kept rows); a layer of another
/// group than the last select's, a group out of range, attend after a release and bad configurations are refused.
TYPED_TEST(CpuSpeContext, GroupsAttendEachLayerWithItsHeadsSelection) {
  using T = TypeParam;
  SCOPED_TRACE(this->seed);
  static constexpr std::int32_t kBudget = 32, kKept = 8;
  CpuFixture<T> f(this->rng, {.layers = 4});
  const auto& c = f.p.spec;
  const std::vector<SpeContextProblem<T>> heads{f.p, f.p.with_new_head(this->rng), f.p.with_new_head(this->rng)};
  const std::vector<std::int32_t> first_layers{0, 1, 3};
  const AttentionWindow window{4, 16};
  const auto make_heads = [&](std::int32_t count, std::int32_t budget) {
    std::vector<SpeContext<T, cpu::Context>> h;
    for (std::int32_t g = 0; g < count; ++g) {
      h.emplace_back(f.p.limits(), f.config(budget, SpeContextMode::per_kv_head), f.ctx);
    }
    return h;
  };
  const SpeContextStepConfig step_config{
      .step = {.attention = {.window = window}, .max_batch = c.batch, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
               .head_dim = c.head_dim, .max_seq_len = c.max_tokens},
      .layers = c.layers};
  for (const std::int32_t rerank : {0, kKept}) {
    SCOPED_TRACE(fmt::format("rerank {}", rerank));
    f.seq_lens = f.p.prompt_lengths;
    SpeContextStepConfig config = step_config;
    config.rerank.budget = rerank;
    SpeContextGroups<T, cpu::Context> groups(make_heads(3, kBudget), {.step = config, .first_layers = first_layers},
                                             f.ctx);
    ASSERT_EQ(groups.groups(), 3);
    EXPECT_EQ(groups.layers(), 4);
    EXPECT_EQ(std::vector<std::int32_t>({groups.group_of(0), groups.group_of(1), groups.group_of(2), groups.group_of(3)}),
              std::vector<std::int32_t>({0, 1, 1, 2}));
    EXPECT_EQ(groups.first_layer(2), 3);
    auto ws = poisoned(groups.workspace_bytes());
    for (std::int32_t g = 0; g < 3; ++g) {
      const auto& h = heads[std::size_t(g)];
      groups.prepare(g,
                     {.cache = f.head_input(), .slots = f.p.slots.data(),
                      .k_pre_rope = SequenceView<const T>::packed(h.k_r.data(), c.batch, c.kv_heads, c.max_tokens,
                                                                  c.head_dim)},
                     f.ctx);
    }
    f.to_step();
    const AttentionWindow effective = groups.step(0).attention().window;
    for (std::int32_t g = 0; g < 3; ++g) {
      SCOPED_TRACE(fmt::format("group {}", g));
      const auto& h = heads[std::size_t(g)];
      groups.select(g,
                    {.q = QueryView<const T>::packed(h.q_r.data(), c.batch, c.q_heads, c.head_dim),
                     .k = HeadsView<const T>::packed(h.k_step.data(), c.batch, c.kv_heads, c.head_dim),
                     .cache = f.head_input(), .slots = f.p.slots.data()},
                    ws.bytes(), f.ctx);
      const SelectionView sel = groups.step(g).selection(ws.bytes(), c.batch);
      const std::vector<std::int32_t> indices(sel.indices, sel.indices + std::size_t(c.batch) * c.kv_heads * sel.capacity);
      const std::vector<std::int32_t> counts(sel.counts, sel.counts + std::size_t(c.batch) * c.kv_heads);
      expect_head_selection(h, indices, counts, sel.capacity, kBudget, effective, false, "its head's");
      for (std::int32_t l = 0; l < c.layers; ++l) {
        HostState out(c.batch, c.q_heads, c.head_dim);
        std::vector<T> o(out.o.size(), from_float<T>(kPoison));
        const std::size_t step_at = std::size_t(l) * c.batch * c.kv_heads * c.head_dim;
        const SpeContextLayerInputs<T> in{
            .q = QueryView<const T>::packed(f.p.layer_q.data() + std::size_t(l) * c.batch * c.q_heads * c.head_dim,
                                           c.batch, c.q_heads, c.head_dim),
            .cache = f.layer(l),
            .k = HeadsView<const T>::packed(f.p.step_k.data() + step_at, c.batch, c.kv_heads, c.head_dim),
            .v = HeadsView<const T>::packed(f.p.step_v.data() + step_at, c.batch, c.kv_heads, c.head_dim),
            .layer = l};
        const auto state = StateView<T>::packed(o.data(), out.lse.data(), c.batch, c.q_heads, c.head_dim);
        if (groups.group_of(l) != g) {
          expect_error([&] { groups.attend(in, state, ws.bytes(), f.ctx); },
                       {fmt::format("in.layer (= {}) is in group {}", l, groups.group_of(l)),
                        fmt::format("the last select was group {}'s", g)});
          continue;
        }
        groups.attend(in, state, ws.bytes(), f.ctx);
        if (rerank == 0) {
          expect_close(o, out.lse, f.p.attention(l, indices, counts, sel.capacity, effective), fmt::format("layer {}", l));
        } else {
          const SelectionView kept = groups.step(g).reranked_selection(ws.bytes(), c.batch);
          const std::int32_t rows = c.batch * c.kv_heads;
          for (std::int32_t row = 0; row < rows; ++row) {  // the kept rows are the selection's own
            for (std::int32_t i = 0; i < kept.counts[row]; ++i) {
              const std::int32_t t = kept.indices[std::size_t(row) * kKept + i];
              ASSERT_NE(std::find(indices.begin() + std::ptrdiff_t(row) * sel.capacity,
                                  indices.begin() + std::ptrdiff_t(row) * sel.capacity + counts[std::size_t(row)], t),
                        indices.begin() + std::ptrdiff_t(row) * sel.capacity + counts[std::size_t(row)])
                  << "layer " << l << " row " << row << " kept " << t << ", not in its group's selection";
            }
          }
          expect_close(o, out.lse,
                       f.p.attention(l, std::vector<std::int32_t>(kept.indices, kept.indices + std::size_t(rows) * kKept),
                                     std::vector<std::int32_t>(kept.counts, kept.counts + rows), kKept, effective),
                       fmt::format("layer {}", l));
        }
      }
    }
    const SpeContextLayerInputs<T> layer0{.q = QueryView<const T>::packed(f.p.layer_q.data(), c.batch, c.q_heads, c.head_dim),
                                          .cache = f.layer(0), .layer = 0};
    HostState out(c.batch, c.q_heads, c.head_dim);
    std::vector<T> o(out.o.size());
    const auto state = StateView<T>::packed(o.data(), out.lse.data(), c.batch, c.q_heads, c.head_dim);
    expect_error([&] { groups.select(3, {}, ws.bytes(), f.ctx); }, {"SpeContextGroups::select", "group (= 3) is outside [0, 3)"});
    expect_error([&] { groups.step(-1); }, {"group (= -1) is outside [0, 3)"});
    expect_error([&] { (void)groups.group_of(4); }, {"layer (= 4) is outside [0, 4)"});
    groups.release(std::span<const std::int32_t>(f.p.slots));
    expect_error([&] { groups.attend(layer0, state, ws.bytes(), f.ctx); }, {"no selection to attend"});
    expect_error([&] { groups.release(std::span<const std::int32_t>(f.p.slots)); },
                 {fmt::format("slot {} is not prepared in head 0", f.p.slots[0])});
  }
  // Bad configurations.
  const auto refused = [&](std::int32_t count, std::vector<std::int32_t> first, const std::string& part,
                           std::int32_t budget_of_last) {
    auto h = make_heads(count - 1, kBudget);
    h.emplace_back(f.p.limits(), f.config(budget_of_last, SpeContextMode::per_kv_head), f.ctx);
    expect_error([&] { SpeContextGroups<T, cpu::Context>(std::move(h), {.step = step_config, .first_layers = first}, f.ctx); },
                 {part});
  };
  refused(2, {1, 3}, "config.first_layers (size 2) must start with layer 0", kBudget);
  refused(3, {0, 2, 2}, "config.first_layers[2] (= 2) must lie in (2, config.step.layers = 4)", kBudget);
  refused(2, {0, 4}, "config.first_layers[1] (= 4) must lie in (0, config.step.layers = 4)", kBudget);
  refused(2, {0, 1, 3}, "2 heads for 3 groups", kBudget);
  refused(2, {0, 2}, "head 1 (max_slots", kBudget / 2);
}

TEST(CpuMaxScoreRows, EqualsScalarMaxAndRefusesBadShapes) {
  Random rng(test_seed());
  const std::int32_t rows = 3, group = 4, cols = 50;
  const auto scores = rng.normal(std::size_t(rows) * group * cols);
  const std::vector<std::int32_t> lengths = {50, 17, 0};
  std::vector<float> out(std::size_t(rows) * cols, kPoison);
  cpu::max_score_rows(MatrixView<const float>::packed(scores.data(), rows * group, cols), group, lengths.data(),
                      MatrixView<float>::packed(out.data(), rows, cols));
  for (std::int32_t r = 0; r < rows; ++r) {
    for (std::int32_t t = 0; t < cols; ++t) {
      const float got = out[std::size_t(r) * cols + t];
      if (t >= lengths[std::size_t(r)]) {
        EXPECT_TRUE(std::isnan(got)) << "column past the length written";
        continue;
      }
      float want = -INFINITY;
      for (std::int32_t j = 0; j < group; ++j) want = std::max(want, scores[(std::size_t(r) * group + j) * cols + t]);
      EXPECT_EQ(got, want);
    }
  }
  const auto in = MatrixView<const float>::packed(scores.data(), rows * group, cols);
  expect_error([&] { cpu::max_score_rows(in, 0, lengths.data(), MatrixView<float>::packed(out.data(), rows, cols)); },
               {"group (= 0)"});
  expect_error([&] { cpu::max_score_rows(in, 3, lengths.data(), MatrixView<float>::packed(out.data(), rows, cols)); },
               {"scores.rows (= 12)"});
  expect_error([&] { cpu::max_score_rows(in, group, nullptr, MatrixView<float>::packed(out.data(), rows, cols)); },
               {"must be non-null"});
}

// NaN in the retrieval head's query never vanishes: its softmax weights are NaN, and the rows it scores get count
// -1 (sparse decode then writes NaN there, as dense attention over a NaN score would), per kv head, or for the
// whole sequence in batch_level mode; the other rows select as before.
TEST(CpuSpeContextNan, ANanHeadQueryMarksTheRowsItScores) {
  Random rng(test_seed());
  using T = bfloat16;
  for (const SpeContextMode mode : {SpeContextMode::per_kv_head, SpeContextMode::batch_level}) {
    SCOPED_TRACE(mode == SpeContextMode::per_kv_head ? "per_kv_head" : "batch_level");
    CpuFixture<T> f(rng, {});
    const auto& c = f.p.spec;
    const std::int32_t group = c.q_heads / c.kv_heads;
    // Batch row 1, query head `group` (kv head 1's first), one channel.
    f.p.q_r[(std::size_t(1) * c.q_heads + group) * c.head_dim + 3] = from_float<T>(std::numeric_limits<float>::quiet_NaN());
    SpeContext<T, cpu::Context> s(f.p.limits(), f.config(16, mode), f.ctx);
    const HostSelection out = run_selector(f, s, specontext_window({}));
    for (std::int32_t b = 0; b < c.batch; ++b) {
      for (std::int32_t g = 0; g < c.kv_heads; ++g) {
        const bool marked = b == 1 && (g == 1 || mode == SpeContextMode::batch_level);
        const std::int32_t count = out.counts[std::size_t(b) * c.kv_heads + g];
        if (marked) {
          EXPECT_EQ(count, -1) << "row (" << b << ", " << g << ")";
        } else {
          EXPECT_EQ(count, 16) << "row (" << b << ", " << g << ")";
        }
      }
    }
  }
}

TEST(CpuSpeContextBadInput, RefusesEveryBadArgument) {
  Random rng(test_seed());
  using T = bfloat16;
  CpuFixture<T> f(rng, {});
  const auto& c = f.p.spec;
  const SpeContextConfig config = f.config(16, SpeContextMode::per_kv_head);
  expect_error([&] { SpeContext<T, cpu::Context>(f.p.limits(), {.budget = 0}, f.ctx); }, {"config.budget (= 0)"});
  expect_error([&] { SpeContext<T, cpu::Context>(f.p.limits(), {.budget = -3}, f.ctx); }, {"config.budget (= -3)"});
  expect_error([&] { SpeContext<T, cpu::Context>(f.p.limits(), {.budget = c.max_tokens + 1}, f.ctx); }, {"config.budget"});
  expect_error([&] { SpeContext<T, cpu::Context>(f.p.limits(), {.budget = 16, .mode = SpeContextMode(7)}, f.ctx); }, {"config.mode"});
  expect_error([&] { SpeContext<T, cpu::Context>(f.p.limits(), {.budget = 16, .sm_scale = -1.0f}, f.ctx); }, {"config.sm_scale"});
  expect_error([&] { SpeContext<T, cpu::Context>(f.p.limits(), {.budget = 16, .rope = {.rotary_dim = 3}}, f.ctx); },
               {"config.rope.rotary_dim (= 3)"});
  // The head's head counts must be the model's.
  SelectorLimits other = f.p.limits();
  other.q_heads = c.q_heads * 2;
  expect_error(
      [&] {
        SpeContextStep<T, cpu::Context>(SpeContext<T, cpu::Context>(other, config, f.ctx),
                                        {.step = {.max_batch = c.batch, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
                                                  .head_dim = c.head_dim, .max_seq_len = c.max_tokens},
                                         .layers = 2},
                                        f.ctx);
      },
      {"retrieval head has q_heads 8", "must be equal"});
  expect_error(
      [&] {
        SpeContextStep<T, cpu::Context>(SpeContext<T, cpu::Context>(f.p.limits(), config, f.ctx),
                                        {.step = {.max_batch = c.batch, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
                                                  .head_dim = c.head_dim, .max_seq_len = c.max_tokens},
                                         .layers = 0},
                                        f.ctx);
      },
      {"config.layers (= 0)"});
  // The rerank per layer: K past the selector's budget, entries, a negative K, a bad stage config; the kept
  // selection asked of a step without it.
  const auto step_with = [&](const RerankConfig& rerank) {
    return SpeContextStep<T, cpu::Context>(SpeContext<T, cpu::Context>(f.p.limits(), config, f.ctx),
                                           {.step = {.max_batch = c.batch, .q_heads = c.q_heads,
                                                     .kv_heads = c.kv_heads, .head_dim = c.head_dim,
                                                     .max_seq_len = c.max_tokens},
                                            .layers = 2,
                                            .rerank = rerank},
                                           f.ctx);
  };
  expect_error([&] { step_with({.budget = config.budget + 1}); },
               {"SpeContextStep", fmt::format("config.rerank.budget (= {}) exceeds the selector's budget (= {})",
                                              config.budget + 1, config.budget)});
  expect_error([&] { step_with({.budget = 4, .entries = 2}); }, {"config.rerank.entries (= 2) must be 0"});
  expect_error([&] { step_with({.budget = 4, .budget_fraction = 0.1}); },
               {"config.rerank.budget_fraction (= 0.1) must be 0"});
  expect_error([&] { step_with({.budget = -1}); }, {"config.rerank.budget (= -1) must be >= 0"});
  expect_error([&] { step_with({.mass = 0.5}); },
               {"config.rerank (budget_fraction 0, entries 0, mass 0.5, floor 1) is set with config.rerank.budget = 0"});
  expect_error([&] { step_with({.budget = 4, .mass = 2}); }, {"RerankStage", "config.mass (= 2) is outside [0, 1]"});
  {
    auto plain = step_with({});
    EXPECT_EQ(plain.rerank(), nullptr);
    auto ws = poisoned(plain.workspace_bytes());
    expect_error([&] { plain.reranked_selection(ws.bytes(), 1); }, {"config.rerank.budget is 0"});
  }

  SpeContext<T, cpu::Context> s(f.p.limits(), config, f.ctx);
  // prepare: no head keys, too short, a prompt past max_tokens.
  PrefillInputs<T> bad = f.prefill();
  bad.k_pre_rope = {};
  expect_error([&] { s.prepare(bad, f.ctx); }, {"in.k_pre_rope", "must be given"});
  bad = f.prefill();
  bad.k_pre_rope.tokens = 5;
  expect_error([&] { s.prepare(bad, f.ctx); }, {"in.k_pre_rope is [2, 2, 5, 64]"});
  bad = f.prefill();
  bad.k_pre_rope.heads = 1;
  expect_error([&] { s.prepare(bad, f.ctx); }, {"in.k_pre_rope is [2, 1,"});
  {
    SpeContextProblem<T> shorter(rng, {.max_tokens = 64, .min_length = 60, .max_length = 64});
    std::vector<std::int32_t> long_lengths(std::size_t(c.batch), 100);
    const KVCache<const T> cache = ContiguousKVView<const T>::packed(f.p.layer_k[0].data(), f.p.layer_v[0].data(),
                                                                     c.batch, c.kv_heads, c.max_tokens, c.head_dim,
                                                                     long_lengths.data());
    SpeContext<T, cpu::Context> small(shorter.limits(), {.budget = 8}, f.ctx);
    std::vector<std::int32_t> slots = {0, 1};
    expect_error([&] { small.prepare({.cache = cache, .slots = slots.data(), .k_pre_rope = f.prefill().k_pre_rope}, f.ctx); },
                 {"prompt (100 tokens) exceeds limits.max_tokens (= 64)"});
  }
  s.prepare(f.prefill(), f.ctx);
  AnySelector<T, cpu::Context> any(SpeContext<T, cpu::Context>(f.p.limits(), config, f.ctx));
  any.prepare(f.prefill(), f.ctx);
  f.to_step();
  const SelectShape shape{c.batch, c.q_heads, c.kv_heads, c.head_dim, 0};
  auto append_ws = poisoned(s.append_workspace_bytes(shape, f.ctx));
  auto select_ws = poisoned(s.select_workspace_bytes(shape, f.ctx));
  const AppendInputs<T> append{.cache = f.head_input(), .slots = f.p.slots.data(), .lengths = f.seq_lens.data(),
                               .k_pre_rope = f.k_step()};
  AppendInputs<T> a = append;
  a.k_pre_rope = {};
  expect_error([&] { s.append(a, append_ws.bytes(), f.ctx); }, {"in.k_pre_rope", "must be given"});
  a = append;
  a.k_pre_rope.heads = 1;  // a head with fewer kv heads than the model
  expect_error([&] { s.append(a, append_ws.bytes(), f.ctx); }, {"in.k_pre_rope is [2, 1, 64]", "kv_heads = 2"});
  a = append;
  std::vector<std::int32_t> past = f.seq_lens;
  past[1] = c.max_tokens + 1;  // a position past max_tokens
  a.lengths = past.data();
  expect_error([&] { s.append(a, append_ws.bytes(), f.ctx); }, {"outside the table's positions [0, 256)"});
  expect_error([&] { s.append(append, std::span<std::byte>(append_ws.data(), 8), f.ctx); }, {"SpeContext::append"});
  s.append(append, append_ws.bytes(), f.ctx);
  HostSelection out(c.batch, c.kv_heads, s.capacity(), false);
  const SelectInputs<T> select{.q = f.q_r(), .cache = f.head_input(), .slots = f.p.slots.data(),
                               .lengths = f.seq_lens.data(), .attention = {.window = specontext_window({})}};
  SelectInputs<T> in = select;
  in.q.heads = c.q_heads / 2;  // a head with fewer query heads than the model
  expect_error([&] { s.select(in, out.view, select_ws.bytes(), f.ctx); }, {"in.q [2, 2, 64]", "q_heads = 4"});
  in = select;
  in.lengths = past.data();
  expect_error([&] { s.select(in, out.view, select_ws.bytes(), f.ctx); }, {"outside the table's positions"});
  HostSelection small_out(c.batch, c.kv_heads, s.capacity() - 1, false);
  expect_error([&] { s.select(select, small_out.view, select_ws.bytes(), f.ctx); }, {"out.capacity (= 15)"});
  for (const AttentionWindow no_recent : {AttentionWindow{}, AttentionWindow{4, 0}}) {
    in = select;  // the step's own token neither selected nor attended: refused, on any path (AnySelector too)
    in.attention.window = no_recent;
    expect_error([&] { s.select(in, out.view, select_ws.bytes(), f.ctx); },
                 {"in.attention.window.recent (= 0) must be >= 1", "specontext_window"});
    expect_error([&] { any.select(in, out.view, select_ws.bytes(), f.ctx); }, {"in.attention.window.recent (= 0)"});
  }
  expect_error([&] { s.release(std::vector<std::int32_t>{f.p.max_slots}); }, {"slots[0] (= 3)"});
}

}  // namespace
}  // namespace kvsift::test
