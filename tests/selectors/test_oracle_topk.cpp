#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "kvsift/eval/metrics.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/eval/synthetic_workload.hpp"
#include "kvsift/selectors/oracle_topk.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::HostSelection;
using test::HostState;

TEST(OracleTopK, FullBudgetEqualsDenseAttention) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  test::Random rng(seed);
  const std::int32_t batch = 2, q_heads = 8, kv_heads = 2, n = 211, d = 64;
  test::HostKV kv(rng, batch, kv_heads, n, d);
  const auto q = rng.normal(std::size_t(batch) * q_heads * d);
  const auto pq = rng.normal(std::size_t(batch) * q_heads * n * d);
  const auto qv = QueryView<const float>::packed(q.data(), batch, q_heads, d);
  OracleTopK oracle({.budget = n, .sink = 4, .recent = 16});
  oracle.prepare({SequenceView<const float>::packed(pq.data(), batch, q_heads, n, d), kv.view()});
  HostSelection sel(batch, kv_heads, n, true);
  oracle.select(qv, sel.view);
  for (std::int32_t r = 0; r < batch * kv_heads; ++r) {
    EXPECT_EQ(sel.counts[r], n);
    for (std::int32_t i = 0; i < n; ++i) EXPECT_EQ(sel.indices[std::size_t(r) * n + i], i);
  }
  HostState dense(batch, q_heads, d), sparse(batch, q_heads, d);
  reference::dense_decode(qv, kv.view(), dense.view);
  reference::sparse_decode(qv, kv.view(), sel.view, sparse.view);
  EXPECT_EQ(dense.o, sparse.o);
  EXPECT_EQ(dense.lse, sparse.lse);
  EXPECT_DOUBLE_EQ(attention_mass_recall(qv, kv.view(), sel.view), 1.0);
}

TEST(OracleTopK, SequencesShorterThanTheBudgetGetEveryToken) {
  test::Random rng(test::test_seed());
  const std::int32_t q_heads = 4, kv_heads = 2, d = 16, budget = 12;
  test::HostKV kv(rng, 3, kv_heads, 40, d, {0, 7, 40});  // ragged: empty, shorter than the budget, longer
  const auto q = rng.normal(std::size_t(3) * q_heads * d);
  const auto pq = rng.normal(std::size_t(3) * q_heads * 40 * d);
  OracleTopK oracle({.budget = budget, .sink = 2, .recent = 2});
  oracle.prepare({SequenceView<const float>::packed(pq.data(), 3, q_heads, 40, d), kv.view()});
  HostSelection sel(3, kv_heads, budget, true);
  oracle.select(QueryView<const float>::packed(q.data(), 3, q_heads, d), sel.view);
  for (std::int32_t h = 0; h < kv_heads; ++h) {
    EXPECT_EQ(sel.view.count(0, h), 0);
    ASSERT_EQ(sel.view.count(1, h), 7);
    for (std::int32_t i = 0; i < 7; ++i) {
      EXPECT_EQ(sel.view.row(1, h)[i], i);
      EXPECT_EQ(sel.view.weights_row(1, h)[i], 0.0f);
    }
    EXPECT_EQ(sel.view.count(2, h), budget);
  }
  HostState out(3, q_heads, d), dense(3, q_heads, d);
  reference::sparse_decode(QueryView<const float>::packed(q.data(), 3, q_heads, d), kv.view(), sel.view, out.view);
  reference::dense_decode(QueryView<const float>::packed(q.data(), 3, q_heads, d), kv.view(), dense.view);
  for (std::int32_t i = 0; i < 2 * q_heads; ++i) EXPECT_EQ(out.lse[i], dense.lse[i]);  // sequences 0 and 1: all kept
}

TEST(OracleTopK, SelectsTheExactTopScoresWithSinkAndRecentKept) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  test::Random rng(seed);
  const std::int32_t q_heads = 4, kv_heads = 1, n = 300, d = 32, budget = 40, sink = 3, recent = 5;
  test::HostKV kv(rng, 1, kv_heads, n, d);
  const auto q = rng.normal(std::size_t(q_heads) * d);
  const auto qv = QueryView<const float>::packed(q.data(), 1, q_heads, d);
  OracleTopK oracle({.budget = budget, .sink = sink, .recent = recent});
  const auto pq = rng.normal(std::size_t(q_heads) * n * d);
  oracle.prepare({SequenceView<const float>::packed(pq.data(), 1, q_heads, n, d), kv.view()});
  HostSelection sel(1, kv_heads, budget, false);
  oracle.select(qv, sel.view);
  ASSERT_EQ(sel.counts[0], budget);
  const std::set<std::int32_t> chosen(sel.indices.begin(), sel.indices.end());
  ASSERT_EQ(chosen.size(), std::size_t(budget));
  EXPECT_TRUE(std::is_sorted(sel.indices.begin(), sel.indices.end()));
  for (std::int32_t t = 0; t < sink; ++t) EXPECT_TRUE(chosen.count(t));
  for (std::int32_t t = n - recent; t < n; ++t) EXPECT_TRUE(chosen.count(t));

  // Independent scores: max over the 4 query heads of the softmax weight, in long double.
  std::vector<long double> score(n, 0);
  for (std::int32_t h = 0; h < q_heads; ++h) {
    std::vector<long double> logit(n);
    for (std::int32_t t = 0; t < n; ++t) {
      long double s = 0;
      for (std::int32_t c = 0; c < d; ++c) s += (long double)q[h * d + c] * kv.k[std::size_t(t) * d + c];
      logit[t] = s / std::sqrt((long double)d);
    }
    const long double m = *std::max_element(logit.begin(), logit.end());
    long double z = 0;
    for (auto l : logit) z += std::exp(l - m);
    for (std::int32_t t = 0; t < n; ++t) score[t] = std::max(score[t], std::exp(logit[t] - m) / z);
  }
  std::vector<std::int32_t> middle;
  for (std::int32_t t = sink; t < n - recent; ++t) middle.push_back(t);
  std::sort(middle.begin(), middle.end(), [&](auto a, auto b) { return score[a] > score[b]; });
  // The oracle ranks fp32 scores: tokens whose exact scores lie within fp32 rounding of the K-th may trade
  // places (kNearTie, relative: a few ulps of the exponentials and the sums); every other rank is exact.
  constexpr long double kNearTie = 1e-5L;
  const std::int32_t k_middle = budget - sink - recent;
  const long double kth = score[middle[k_middle - 1]];
  const auto near_tie = [&](std::int32_t t) { return std::abs(score[t] - kth) <= kNearTie * kth; };
  for (std::int32_t i = 0; i < k_middle; ++i) {
    EXPECT_TRUE(chosen.count(middle[i]) || near_tie(middle[i])) << "rank " << i;
  }
  for (std::size_t i = k_middle; i < middle.size(); ++i) {
    EXPECT_FALSE(chosen.count(middle[i]) && !near_tie(middle[i])) << "rank " << i;
  }
}

TEST(OracleTopK, AppendedTokensBecomeSelectable) {
  const auto seed = test::test_seed();
  test::Random rng(seed);
  const std::int32_t q_heads = 2, kv_heads = 1, n = 50, d = 16;
  test::HostKV kv(rng, 1, kv_heads, n, d);
  const auto pq = rng.normal(std::size_t(q_heads) * n * d);
  OracleTopK oracle({.budget = 1});
  oracle.prepare({SequenceView<const float>::packed(pq.data(), 1, q_heads, n, d), kv.view()});
  const auto q = rng.normal(std::size_t(q_heads) * d);
  // The new key is a large multiple of the query sum, so it dominates every other token.
  std::vector<float> k_new(d), v_new = rng.normal(d);
  for (std::int32_t c = 0; c < d; ++c) k_new[c] = 50.0f * (q[c] + q[d + c]);
  oracle.append({HeadsView<const float>::packed(k_new.data(), 1, 1, d), HeadsView<const float>::packed(v_new.data(), 1, 1, d),
                 QueryView<const float>::packed(q.data(), 1, q_heads, d)});
  HostSelection sel(1, 1, 1, false);
  oracle.select(QueryView<const float>::packed(q.data(), 1, q_heads, d), sel.view);
  EXPECT_EQ(sel.indices[0], n);
  EXPECT_EQ(oracle.index_bytes(), std::size_t(n + 1) * d * sizeof(float));
}

TEST(AnySelector, WrapsOracleTopK) {
  test::Random rng(test::test_seed());
  const std::int32_t n = 64, d = 16;
  test::HostKV kv(rng, 1, 1, n, d);
  const auto pq = rng.normal(std::size_t(n) * d);
  const auto q = rng.normal(d);
  AnySelector<> any(OracleTopK({.budget = 8}));
  OracleTopK direct({.budget = 8});
  EXPECT_EQ(any.name(), "OracleTopK");
  const PrefillInputs<> prefill{SequenceView<const float>::packed(pq.data(), 1, 1, n, d), kv.view()};
  any.prepare(prefill);
  direct.prepare(prefill);
  HostSelection a(1, 1, 8, false), b(1, 1, 8, false);
  any.select(QueryView<const float>::packed(q.data(), 1, 1, d), a.view);
  direct.select(QueryView<const float>::packed(q.data(), 1, 1, d), b.view);
  EXPECT_EQ(a.indices, b.indices);
  EXPECT_EQ(any.index_bytes(), direct.index_bytes());
}

TEST(SyntheticWorkload, NeedlesCarryAttentionAndTheOracleFindsThem) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const SyntheticWorkloadConfig config{.tokens = 4096, .seed = seed};
  const auto w = make_synthetic_workload(config);
  // Needles outscore every non-sink token for every query head by construction, so a budget of
  // sinks + needles holds them all.
  const std::int32_t budget = config.sink_tokens + config.needles;
  OracleTopK oracle({.budget = budget});
  oracle.prepare({{}, w.kv()});
  HostSelection sel(1, config.kv_heads, budget, false);
  oracle.select(w.query(), sel.view);
  for (std::int32_t g = 0; g < config.kv_heads; ++g) {
    const std::set<std::int32_t> chosen(sel.view.row(0, g), sel.view.row(0, g) + budget);
    for (std::int32_t i = 0; i < config.needles; ++i) {
      EXPECT_TRUE(chosen.count(w.needle_positions[g * config.needles + i])) << "needle " << i << " of kv head " << g;
    }
  }
  // Sinks attract attention: on average each carries over 20x the mass of a uniformly attended token.
  HostSelection sinks(1, config.kv_heads, config.sink_tokens, false);
  for (std::int32_t g = 0; g < config.kv_heads; ++g) {
    std::iota(sinks.view.row(0, g), sinks.view.row(0, g) + config.sink_tokens, 0);
    sinks.counts[g] = config.sink_tokens;
  }
  EXPECT_GT(attention_mass_recall(w.query(), w.kv(), sinks.view) / config.sink_tokens, 20.0 / config.tokens);
  // Concentrated but not trivial attention: 1% of the tokens hold most of the mass, and more budget keeps more.
  double previous = 0.0;
  for (double fraction : {0.01, 0.02, 0.05}) {
    const auto k = static_cast<std::int32_t>(fraction * config.tokens);
    OracleTopK at_budget({.budget = k});
    at_budget.prepare({{}, w.kv()});
    HostSelection s(1, config.kv_heads, k, false);
    at_budget.select(w.query(), s.view);
    const double recall = attention_mass_recall(w.query(), w.kv(), s.view);
    EXPECT_GT(recall, fraction == 0.01 ? 0.5 : previous) << "budget " << fraction;
    EXPECT_LE(recall, 1.0 + 1e-12);
    previous = recall;
  }
  // Pre-RoPE keys rotate into the post-RoPE ones.
  std::vector<float> k(w.k_pre_rope.begin() + 100 * 128, w.k_pre_rope.begin() + 101 * 128);
  apply_rope(k.data(), 128, 100, config.rope);
  for (std::int32_t c = 0; c < 128; ++c) EXPECT_NEAR(k[c], w.k[100 * 128 + c], 1e-4f);
}

TEST(Rope, InverseUndoesAndRelativePositionsAreInvariant) {
  test::Random rng(test::test_seed());
  for (RopeLayout layout : {RopeLayout::neox, RopeLayout::interleaved}) {
    const RopeConfig cfg{.theta = 10000.0, .rotary_dim = 48, .layout = layout};
    auto q = rng.normal(64), k = rng.normal(64);
    auto x = q;
    apply_rope(x.data(), 64, 1234, cfg);
    for (std::int32_t c = 48; c < 64; ++c) EXPECT_EQ(x[c], q[c]);  // past rotary_dim: untouched
    apply_rope(x.data(), 64, 1234, cfg, true);
    for (std::int32_t c = 0; c < 64; ++c) EXPECT_NEAR(x[c], q[c], 1e-4f);
    // q_m . k_n depends on m - n only.
    const auto dot_at = [&](std::int64_t m, std::int64_t n) {
      auto a = q, b = k;
      apply_rope(a.data(), 64, m, cfg);
      apply_rope(b.data(), 64, n, cfg);
      double s = 0;
      for (std::int32_t c = 0; c < 64; ++c) s += double(a[c]) * b[c];
      return s;
    };
    EXPECT_NEAR(dot_at(500, 200), dot_at(1300, 1000), 1e-3);
  }
}

}  // namespace
}  // namespace kvsift
