// Every CPU workspace API through tests/workspace_check.hpp (issue 19): its size query, a buffer one block
// short and a misaligned one (refused, nothing written), the exact size with 0xff and 0x00 contents (the same
// bytes); the result then against an independent reference (fp64 or scalar, written here or in the shared
// selector checks).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <utility>

#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/oracle_topk.hpp"
#include "kvsift/selectors/quest.hpp"
#include "kvsift/selectors/streaming_llm.hpp"
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
  SelectShape shape() const { return {3, 8, 2, 64, p.spec.tokens}; }
  const std::int32_t* lengths() const { return p.kv_values.seq_lens.data(); }

  /// The selector's append and select through the driver; returns the selection.
  template <class S>
  HostSelection check(S& selector) {
    selector.prepare({.cache = cache(), .slots = slots.data()}, ctx);
    check_workspace(
        selector.append_workspace_bytes(shape(), ctx),
        [&](std::span<std::byte> ws) {
          selector.append({.cache = cache(), .slots = slots.data(), .lengths = lengths()}, ws, ctx);
        },
        [] { return std::vector<std::byte>{}; }, [] {});
    // capacity >= 1 as DecodeStep sizes it, so that StreamingLLM's (0) rows still have non-null arrays
    HostSelection sel(3, 2, std::max(1, selector.capacity()), /*with_weights=*/false);
    check_workspace(
        selector.select_workspace_bytes(shape(), ctx),
        [&](std::span<std::byte> ws) {
          selector.select({.q = p.q_view(), .cache = cache(), .slots = slots.data(), .lengths = lengths(),
                           .attention = {.window = kWindow}},
                          sel.view, ws, ctx);
        },
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
  const HostSelection sel = f.check(selector);
  expect_oracle_selection(f.p, sel.indices, sel.counts, 32, 32, kWindow, 1.0 / std::sqrt(64.0));
}

TEST_F(CpuWorkspaces, QuestSelectAndAppend) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  SelectorFixture f(rng);
  Quest<bfloat16, cpu::Context> selector(f.limits(), {.budget = 64, .page_size = 16});
  const HostSelection sel = f.check(selector);
  expect_quest_selection(f.p, sel.indices, sel.counts, 64, 4, 16, kWindow);
}

TEST_F(CpuWorkspaces, StreamingLLMSelectAndAppend) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  SelectorFixture f(rng);
  StreamingLLM<bfloat16, cpu::Context> selector(f.limits());
  const HostSelection sel = f.check(selector);
  EXPECT_EQ(sel.counts, std::vector<std::int32_t>(6, 0));
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
