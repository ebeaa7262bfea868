// Every CPU workspace API through tests/workspace_check.hpp (issue 19): its size query, a buffer one block
// short and a misaligned one (refused, nothing written), the exact size with 0xff and 0x00 contents (the same
// bytes); the result then against an independent reference (fp64 or scalar, written here or in the shared
// selector checks).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <string>
#include <utility>

#include "gather_problem.hpp"
#include "inverted_lists_problem.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/selectors/streaming_llm/streaming_llm.hpp"
#include "kvsift/step/decode_step.hpp"
#include "selector_check.hpp"
#include "workspace_check.hpp"

namespace kvsift::test {
namespace {

constexpr AttentionWindow kWindow{4, 16};

class CpuWorkspaces : public SeededTest {};

/// Scalar top-k of one score row's candidates [lo, hi): higher score first, then the smaller index.
std::vector<std::int32_t> scalar_top_k(const float* scores, std::int32_t lo, std::int32_t hi, std::int32_t k) {
  std::vector<std::int32_t> ids(std::size_t(std::max(0, hi - lo)));
  std::iota(ids.begin(), ids.end(), lo);
  std::sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) {
    return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
  });
  ids.resize(std::min<std::size_t>(ids.size(), std::size_t(k)));
  return ids;
}

TEST_F(CpuWorkspaces, TopKRows) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t batch = 3, kv_heads = 2, max_tokens = 300, k = 20;
  const AttentionWindow window{2, 5};
  cpu::ThreadPool pool(3);
  for (cpu::ThreadPool* p : {static_cast<cpu::ThreadPool*>(nullptr), &pool}) {
    for (const std::int32_t heads_per_row : {1, 2}) {
      SCOPED_TRACE(testing::Message() << "pool " << (p ? p->size() : 0) << " heads_per_row " << heads_per_row);
      const std::int64_t score_rows = std::int64_t(batch) * kv_heads * heads_per_row;
      const auto scores = rng.normal(std::size_t(score_rows) * max_tokens);
      std::vector<std::int32_t> lengths(batch);
      for (auto& l : lengths) l = rng.uniform_int(0, max_tokens);
      HostSelection out(batch, kv_heads, heads_per_row * k, /*with_weights=*/true);
      const TopKRowsOptions options{.window = window, .heads_per_row = heads_per_row};
      const auto view = MatrixView<const float>::packed(scores.data(), score_rows, max_tokens);
      check_workspace(
          cpu::topk_rows_workspace_bytes(score_rows, max_tokens, k, options, p),
          [&](std::span<std::byte> ws) { cpu::topk_rows(view, lengths.data(), k, options, out.view, ws, p); },
          [&] { return bytes_of(out.indices, out.counts, out.log_weights); },
          [&] {
            std::fill(out.indices.begin(), out.indices.end(), kPoisonIndex);
            std::fill(out.counts.begin(), out.counts.end(), kPoisonIndex);
            std::fill(out.log_weights.begin(), out.log_weights.end(), kPoison);
          });
      for (std::int32_t b = 0; b < batch; ++b) {
        const std::int32_t lo = window.sink_end(lengths[b]), hi = window.recent_begin(lengths[b]);
        for (std::int32_t g = 0; g < kv_heads; ++g) {
          const std::int32_t s = b * kv_heads + g;
          std::set<std::int32_t> want;
          for (std::int32_t r = s * heads_per_row; r < (s + 1) * heads_per_row; ++r) {
            for (const std::int32_t t : scalar_top_k(scores.data() + std::size_t(r) * max_tokens, lo, hi, k)) want.insert(t);
          }
          const std::int32_t capacity = heads_per_row * k;
          ASSERT_EQ(out.counts[s], std::int32_t(want.size())) << "row " << s;
          const auto begin = out.indices.begin() + std::ptrdiff_t(s) * capacity;
          EXPECT_EQ(std::vector<std::int32_t>(begin, begin + out.counts[s]),
                    std::vector<std::int32_t>(want.begin(), want.end()))
              << "row " << s;
          for (std::int32_t i = 0; i < out.counts[s]; ++i) EXPECT_EQ(out.log_weights[std::size_t(s) * capacity + i], 0.0f);
        }
      }
    }
  }
}

TEST_F(CpuWorkspaces, GroupScores) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t batch = 2, q_heads = 6, kv_heads = 2, head_dim = 32, capacity = 150, cols = 160;
  const HostKV kv(rng, batch, kv_heads, capacity, head_dim,
                  {rng.uniform_int(1, capacity), rng.uniform_int(1, capacity)});
  const auto q = rng.normal(std::size_t(batch) * q_heads * head_dim);
  const auto q_view = QueryView<const float>::packed(q.data(), batch, q_heads, head_dim);
  const std::int64_t rows = std::int64_t(batch) * kv_heads;
  std::vector<float> scores(std::size_t(rows) * cols);
  cpu::ThreadPool pool(3);
  const double scale = 1.0 / std::sqrt(double(head_dim));
  for (const bool softmax : {false, true}) {
    for (const auto reduce : {GroupReduce::max, GroupReduce::sum}) {
      SCOPED_TRACE(testing::Message() << "softmax " << softmax << " reduce " << int(reduce));
      const GroupScoreOptions options{.reduce = reduce, .softmax = softmax};
      check_workspace(
          cpu::group_scores_workspace_bytes(batch, q_heads, kv_heads, cols, options),
          [&](std::span<std::byte> ws) {
            cpu::group_scores(q_view, kv.view(), MatrixView<float>::packed(scores.data(), rows, cols), options, ws,
                              &pool);
          },
          [&] { return bytes_of(scores); }, [&] { std::fill(scores.begin(), scores.end(), kPoison); });
      const std::int32_t group = q_heads / kv_heads;
      for (std::int32_t b = 0; b < batch; ++b) {
        const std::int32_t len = kv.seq_lens[b];
        for (std::int32_t g = 0; g < kv_heads; ++g) {
          std::vector<double> want(std::size_t(len), reduce == GroupReduce::max ? -INFINITY : 0.0);
          for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
            std::vector<double> s(static_cast<std::size_t>(len));
            for (std::int32_t t = 0; t < len; ++t) {
              double dot = 0;
              for (std::int32_t i = 0; i < head_dim; ++i) {
                dot += double(q[(std::size_t(b) * q_heads + h) * head_dim + i]) * kv.view().k_row(b, g, t)[i];
              }
              s[t] = scale * dot;
            }
            if (softmax) {
              const double m = *std::max_element(s.begin(), s.end());
              double z = 0;
              for (const double x : s) z += std::exp(x - m);
              for (double& x : s) x = std::exp(x - m) / z;
            }
            for (std::int32_t t = 0; t < len; ++t) {
              want[t] = reduce == GroupReduce::max ? std::max(want[t], s[t]) : want[t] + s[t];
            }
          }
          for (std::int32_t t = 0; t < len; ++t) {
            // fp32 dot products of 32 terms and, with softmax, fp32 exponentials: a few ulps of the inputs' scale
            EXPECT_NEAR(scores[std::size_t(b * kv_heads + g) * cols + t], want[t], 1e-5 * (1 + std::abs(want[t])))
                << "row " << b * kv_heads + g << " token " << t;
          }
        }
      }
    }
  }
}

TEST_F(CpuWorkspaces, UnionLists) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(3);
  for (cpu::ThreadPool* tp : {static_cast<cpu::ThreadPool*>(nullptr), &pool}) {
    SCOPED_TRACE(testing::Message() << "pool " << (tp ? tp->size() : 0));
    ListsProblem<half> p(rng, 4, 2, 7, 9, 4, 60);
    const auto lists = p.view().as_const();
    const std::int32_t rows = p.batch * p.kv_heads, capacity = p.chosen.view.capacity * p.list_capacity;
    HostSelection out(p.batch, p.kv_heads, capacity, /*with_weights=*/true);
    check_workspace(
        cpu::list_reduction_workspace_bytes(rows, p.chosen.view.capacity, p.list_capacity, tp),
        [&](std::span<std::byte> ws) {
          cpu::union_lists(lists, p.chosen.view, p.slots.data(), p.lengths.data(), p.window, out.view, ws, tp);
        },
        [&] { return bytes_of(out.indices, out.counts, out.log_weights); },
        [&] {
          std::fill(out.indices.begin(), out.indices.end(), kPoisonIndex);
          std::fill(out.counts.begin(), out.counts.end(), kPoisonIndex);
          std::fill(out.log_weights.begin(), out.log_weights.end(), kPoison);
        });
    const auto want = reference_union(p);
    for (std::int32_t r = 0; r < rows; ++r) {
      ASSERT_EQ(out.counts[r], std::int32_t(want[r].size())) << "row " << r;
      std::size_t at = std::size_t(r) * capacity;
      for (const std::int32_t id : want[r]) {
        EXPECT_EQ(out.indices[at], id) << "row " << r;
        EXPECT_EQ(out.log_weights[at], 0.0f) << "row " << r;
        ++at;
      }
    }
  }
}

/// One gather_kv_difference step after a first one (so that tokens are kept, dropped and added) on a contiguous
/// and a paged source, against gather_problem.hpp's ResidentSlots and the source's rows.
TEST_F(CpuWorkspaces, GatherKvDifference) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::vector<std::int32_t> lens = {50, 7, 64};
  const std::int32_t batch = 3, kv_heads = 2, d = 8, cap = 10, resident_cap = 12, rows = batch * kv_heads;
  const HostKV src(rng, batch, kv_heads, 64, d, lens);
  const HostPagedKV src_paged(src, 16, false, rng);
  HostKV resident(rng, batch, kv_heads, resident_cap, d);
  const auto res_view = ContiguousKVView<float>::packed(resident.k.data(), resident.v.data(), batch, kv_heads,
                                                        resident_cap, d);
  HostSelection prev(batch, kv_heads, cap, false), cur(batch, kv_heads, cap, false);
  std::fill(prev.counts.begin(), prev.counts.end(), 0);
  std::vector<std::int32_t> prev_slots(prev.indices.size(), kPoisonIndex), cur_slots(prev_slots), copied(rows);
  ResidentSlots reference(rows, resident_cap);
  {  // the first step, from an empty previous selection
    next_selection(rng, prev, cur, lens);
    cpu::Array<std::byte> ws(cpu::gather_kv_difference_workspace_bytes(batch, kv_heads, cap, resident_cap));
    cpu::gather_kv_difference(KVCache<const float>(src.view()), prev.view, prev_slots.data(), cur.view,
                              cur_slots.data(), res_view, copied.data(), ws.bytes());
    reference.step(cur);
    prev.indices = cur.indices;
    prev.counts = cur.counts;
    prev_slots = cur_slots;
  }
  next_selection(rng, prev, cur, lens);
  const auto want = reference.step(cur);
  const auto resident_k = resident.k, resident_v = resident.v;
  cpu::ThreadPool pool(2);
  for (const bool paged : {false, true}) {
    for (cpu::ThreadPool* tp : {static_cast<cpu::ThreadPool*>(nullptr), &pool}) {
      SCOPED_TRACE(testing::Message() << (paged ? "paged" : "contiguous") << " source, pool " << (tp ? tp->size() : 0));
      const KVCache<const float> source =
          paged ? KVCache<const float>(src_paged.view) : KVCache<const float>(src.view());
      check_workspace(
          cpu::gather_kv_difference_workspace_bytes(batch, kv_heads, cap, resident_cap, tp),
          [&](std::span<std::byte> ws) {
            cpu::gather_kv_difference(source, prev.view, prev_slots.data(), cur.view, cur_slots.data(), res_view,
                                      copied.data(), ws, tp);
          },
          [&] { return bytes_of(cur_slots, copied, resident.k, resident.v); },
          [&] {  // the resident buffer is updated in place: restored, as it was after the first step
            std::fill(cur_slots.begin(), cur_slots.end(), kPoisonIndex);
            std::fill(copied.begin(), copied.end(), kPoisonIndex);
            resident.k = resident_k;
            resident.v = resident_v;
          });
      EXPECT_EQ(copied, want.copied);
      ASSERT_EQ(cur_slots, want.slots);
      for (std::int32_t r = 0; r < rows; ++r) {
        const std::int32_t b = r / kv_heads, h = r % kv_heads;
        for (std::int32_t i = 0; i < cur.counts[r]; ++i) {
          const std::int32_t t = cur.indices[std::size_t(r) * cap + i], slot = cur_slots[std::size_t(r) * cap + i];
          EXPECT_TRUE(std::equal(res_view.k_row(b, h, slot), res_view.k_row(b, h, slot) + d, src.view().k_row(b, h, t)))
              << "row " << r << " token " << t;
          EXPECT_TRUE(std::equal(res_view.v_row(b, h, slot), res_view.v_row(b, h, slot) + d, src.view().v_row(b, h, t)))
              << "row " << r << " token " << t;
        }
      }
    }
  }
}

/// A bf16 problem of one sequence whose selection plus window holds 1120 tokens: on a pool of 4 the CPU decode
/// splits the row 4 ways (256 tokens per split at least), so its workspace is not empty.
HostDecodeProblem<bfloat16> long_row_problem(Random& rng) {
  return HostDecodeProblem<bfloat16>(rng, CaseSpec{.batch = 1, .q_heads = 4, .kv_heads = 1, .head_dim = 64,
                                                   .tokens = 1300, .k = 1100, .page_size = 0, .log_weights = true,
                                                   .random_lengths = false, .window = kWindow});
}

template <class Call>
void check_decode(HostDecodeProblem<bfloat16>& p, std::size_t bytes, Call decode, const HostState& ref) {
  const auto& c = p.spec;
  std::vector<bfloat16> o(std::size_t(c.batch) * c.q_heads * c.head_dim);
  std::vector<float> lse(std::size_t(c.batch) * c.q_heads);
  const auto out = StateView<bfloat16>::packed(o.data(), lse.data(), c.batch, c.q_heads, c.head_dim);
  check_workspace(
      bytes, [&](std::span<std::byte> ws) { decode(out, ws); }, [&] { return bytes_of(o, lse); },
      [&] {
        std::fill(o.begin(), o.end(), from_float<bfloat16>(kPoison));
        std::fill(lse.begin(), lse.end(), kPoison);
      });
  expect_close<bfloat16>(o, lse, ref, "decode output");
}

TEST_F(CpuWorkspaces, SparseDecode) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  auto p = long_row_problem(rng);
  const auto& c = p.spec;
  const HostState ref = p.reference(/*sparse=*/true);
  const cpu::DecodeOptions options{.attention = {.window = c.window}};
  cpu::ThreadPool pool(4);
  for (cpu::ThreadPool* tp : {&pool, static_cast<cpu::ThreadPool*>(nullptr)}) {
    SCOPED_TRACE(testing::Message() << "pool " << (tp ? tp->size() : 0));
    check_decode(p, cpu::decode_workspace_bytes(c.batch, c.q_heads, c.kv_heads, c.head_dim, tp),
                 [&](const StateView<bfloat16>& out, std::span<std::byte> ws) {
                   cpu::sparse_decode(p.q_view(), p.contiguous(), p.selection(), out, options, tp, ws);
                 },
                 ref);
  }
}

TEST_F(CpuWorkspaces, DenseDecode) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  auto p = long_row_problem(rng);
  const auto& c = p.spec;
  const HostState ref = p.reference(/*sparse=*/false);
  cpu::ThreadPool pool(4);
  for (cpu::ThreadPool* tp : {&pool, static_cast<cpu::ThreadPool*>(nullptr)}) {
    SCOPED_TRACE(testing::Message() << "pool " << (tp ? tp->size() : 0));
    check_decode(p, cpu::decode_workspace_bytes(c.batch, c.q_heads, c.kv_heads, c.head_dim, tp),
                 [&](const StateView<bfloat16>& out, std::span<std::byte> ws) {
                   cpu::dense_decode(p.q_view(), p.contiguous(), out, {}, tp, ws);
                 },
                 ref);
  }
}

/// A selector's inputs over a host problem (contiguous bf16 cache, ragged lengths, shuffled slots).
struct SelectorFixture {
  HostDecodeProblem<bfloat16> p;
  std::vector<std::int32_t> slots;
  cpu::ThreadPool pool{3};
  cpu::Context ctx{&pool};

  explicit SelectorFixture(Random& rng)
      : p(rng, CaseSpec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .tokens = 500, .k = 0,
                        .page_size = 0, .log_weights = false}),
        slots(3) {
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng.engine);
  }
  KVCache<const bfloat16> cache() const { return p.contiguous(); }
  SelectorLimits limits() const {
    return {.max_slots = 3, .max_tokens = p.spec.tokens, .q_heads = 8, .kv_heads = 2, .head_dim = 64};
  }
  SelectShape shape(std::int32_t max_seq_len) const { return {3, 8, 2, 64, max_seq_len}; }
  const std::int32_t* lengths() const { return p.kv_values.seq_lens.data(); }
  std::int32_t longest() const { return *std::max_element(p.kv_values.seq_lens.begin(), p.kv_values.seq_lens.end()); }
  SelectInputs<bfloat16> select_inputs(std::int32_t max_seq_len) const {
    return {.q = p.q_view(), .cache = cache(), .slots = slots.data(), .lengths = lengths(),
            .attention = {.window = kWindow}, .max_seq_len = max_seq_len};
  }

  /// The selector's append and select through the driver, planned for sequences of up to max_seq_len tokens;
  /// returns the selection.
  template <class S>
  HostSelection check(S& selector, std::int32_t max_seq_len) {
    selector.prepare({.cache = cache(), .slots = slots.data()}, ctx);
    check_workspace(
        selector.append_workspace_bytes(shape(max_seq_len), ctx),
        [&](std::span<std::byte> ws) {
          selector.append({.cache = cache(), .slots = slots.data(), .lengths = lengths()}, ws, ctx);
        },
        [] { return std::vector<std::byte>{}; }, [] {});
    // capacity >= 1 as DecodeStep sizes it, so that StreamingLLM's (0) rows still have non-null arrays
    HostSelection sel(3, 2, std::max(1, selector.capacity()), /*with_weights=*/false);
    check_workspace(
        selector.select_workspace_bytes(shape(max_seq_len), ctx),
        [&](std::span<std::byte> ws) { selector.select(select_inputs(max_seq_len), sel.view, ws, ctx); },
        [&] { return bytes_of(sel.indices, sel.counts); },
        [&] {
          std::fill(sel.indices.begin(), sel.indices.end(), kPoisonIndex);
          std::fill(sel.counts.begin(), sel.counts.end(), kPoisonIndex);
        });
    return sel;
  }
};

TEST_F(CpuWorkspaces, OracleTopKSelectAndAppend) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  SelectorFixture f(rng);
  OracleTopK<bfloat16, cpu::Context> selector(f.limits(), {.budget = 32});
  const HostSelection sel = f.check(selector, f.p.spec.tokens);
  expect_oracle_selection(f.p, sel.indices, sel.counts, 32, 32, kWindow, 1.0 / std::sqrt(64.0));
}

TEST_F(CpuWorkspaces, QuestSelectAndAppend) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  SelectorFixture f(rng);
  Quest<bfloat16, cpu::Context> selector(f.limits(), {.budget = 64, .page_size = 16});
  const HostSelection sel = f.check(selector, f.p.spec.tokens);
  expect_quest_selection(f.p, sel.indices, sel.counts, 64, 4, 16, kWindow);
}

TEST_F(CpuWorkspaces, StreamingLLMSelectAndAppend) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  SelectorFixture f(rng);
  StreamingLLM<bfloat16, cpu::Context> selector(f.limits());
  const HostSelection sel = f.check(selector, f.p.spec.tokens);
  EXPECT_EQ(sel.counts, std::vector<std::int32_t>(6, 0));
}

/// A select planned for fewer tokens than its selector's limit (SelectShape::max_seq_len): the workspace of a
/// selector built for that many, less than the limit's, the selection the reference's; a sequence one token (or,
/// for Quest, one page) past the bound is refused by its length, never cut.
template <class Make>
HostSelection check_planned_bound(SelectorFixture& f, Make make, std::int32_t page_size, const char* refusal) {
  const std::int32_t longest = f.longest();
  SelectorLimits wide = f.limits(), tight = f.limits();
  wide.max_tokens = 2 * f.p.spec.tokens;
  tight.max_tokens = longest;
  auto selector = make(wide);
  EXPECT_EQ(selector.select_workspace_bytes(f.shape(longest), f.ctx),
            make(tight).select_workspace_bytes(f.shape(longest), f.ctx));
  EXPECT_LT(selector.select_workspace_bytes(f.shape(longest), f.ctx),
            selector.select_workspace_bytes(f.shape(0), f.ctx))
      << "0 plans for limits.max_tokens";
  const HostSelection sel = f.check(selector, longest);

  // A bound one page (Quest) or one token (OracleTopK) short of the longest sequence: the first row past it is
  // refused, named by its length.
  const std::int32_t short_bound = (longest - 1) / page_size * page_size;
  const auto& lens = f.p.kv_values.seq_lens;
  const auto past = std::find_if(lens.begin(), lens.end(), [&](std::int32_t len) {
    return (len + page_size - 1) / page_size > short_bound / page_size;
  });
  cpu::Array<std::byte> ws(selector.select_workspace_bytes(f.shape(short_bound), f.ctx));
  HostSelection out(3, 2, std::max(1, selector.capacity()), false);
  expect_error([&] { selector.select(f.select_inputs(short_bound), out.view, ws.bytes(), f.ctx); },
               {refusal, fmt::format("(= {})", *past)});
  expect_error([&] { (void)selector.select_workspace_bytes(f.shape(wide.max_tokens + 1), f.ctx); },
               fmt::format("shape.max_seq_len (= {}) is outside [0, limits.max_tokens = {}]", wide.max_tokens + 1,
                           wide.max_tokens));
  expect_error([&] { selector.select(f.select_inputs(-1), out.view, ws.bytes(), f.ctx); },
               fmt::format("in.max_seq_len (= -1) is outside [0, limits.max_tokens = {}]", wide.max_tokens));
  return sel;
}

TEST_F(CpuWorkspaces, OracleTopKPlannedForFewerTokens) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  SelectorFixture f(rng);
  const HostSelection sel = check_planned_bound(
      f, [](const SelectorLimits& l) { return OracleTopK<bfloat16, cpu::Context>(l, {.budget = 32}); }, 1,
      "scores.cols");
  expect_oracle_selection(f.p, sel.indices, sel.counts, 32, 32, kWindow, 1.0 / std::sqrt(64.0));
}

TEST_F(CpuWorkspaces, QuestPlannedForFewerTokens) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  SelectorFixture f(rng);
  const HostSelection sel = check_planned_bound(
      f, [](const SelectorLimits& l) { return Quest<bfloat16, cpu::Context>(l, {.budget = 64, .page_size = 16}); },
      16, "pages, more than scores.cols");
  expect_quest_selection(f.p, sel.indices, sel.counts, 64, 4, 16, kWindow);
}

TEST_F(CpuWorkspaces, DecodeStep) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  SelectorFixture f(rng);
  auto& p = f.p;
  const auto& c = p.spec;
  const DecodeStepConfig config{.attention = {.window = kWindow}, .max_batch = c.batch, .q_heads = c.q_heads,
                                .kv_heads = c.kv_heads, .head_dim = c.head_dim, .max_seq_len = c.tokens};
  DecodeStep step(OracleTopK<bfloat16, cpu::Context>(f.limits(), {.budget = 32}), config, f.ctx);
  step.prepare({.cache = f.cache(), .slots = f.slots.data()}, f.ctx);
  const StepInputs<bfloat16> in{
      .q = p.q_view(),
      .cache = ContiguousKVView<bfloat16>::packed(p.k.data(), p.v.data(), c.batch, c.kv_heads, c.tokens, c.head_dim,
                                                  p.kv_values.seq_lens.data()),
      .slots = f.slots.data()};
  std::vector<bfloat16> o(std::size_t(c.batch) * c.q_heads * c.head_dim);
  std::vector<float> lse(std::size_t(c.batch) * c.q_heads);
  const auto out = StateView<bfloat16>::packed(o.data(), lse.data(), c.batch, c.q_heads, c.head_dim);
  const auto poison = [&] {
    std::fill(o.begin(), o.end(), from_float<bfloat16>(kPoison));
    std::fill(lse.begin(), lse.end(), kPoison);
  };
  const auto result = check_workspace(
      step.workspace_bytes(), [&](std::span<std::byte> ws) { step.run(in, out, ws, f.ctx); },
      [&] { return bytes_of(o, lse); }, poison);

  // The selection lives in the workspace: one more run over a workspace kept here shows it, for the references.
  cpu::Array<std::byte> workspace(step.workspace_bytes());
  poison();
  step.run(in, out, workspace.bytes(), f.ctx);
  expect_same_bytes(bytes_of(o, lse), result, "a run over the test's own workspace vs the driver's runs");
  const SelectionView sel = step.selection(workspace.bytes(), c.batch);
  const std::vector<std::int32_t> indices(sel.indices, sel.indices + std::size_t(c.batch) * c.kv_heads * sel.capacity);
  const std::vector<std::int32_t> counts(sel.counts, sel.counts + std::size_t(c.batch) * c.kv_heads);
  expect_oracle_selection(p, indices, counts, sel.capacity, 32, kWindow, 1.0 / std::sqrt(64.0));
  HostState ref(c.batch, c.q_heads, c.head_dim);
  reference::sparse_decode(p.q_view(), p.kv_values.view(), sel, ref.view, config.attention);
  expect_close<bfloat16>(o, lse, ref, "step output");
}

}  // namespace
}  // namespace kvsift::test
