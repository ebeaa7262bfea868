// The fidelity harness. First its definitions, pinned on small built captures against values worked out by
// hand or by an independent fp64 loop here: the query attends its own token, rows are per layer with p10/p90
// tails, output error is per query head, the evaluated positions span the decoded range. Then thresholds on
// the committed real capture (SmolLM2-135M, 512 tokens of GPL-3, layers 3 and 15) that a broken selector,
// metric or harness fails. Last, backends in lockstep (FidelityBackend): two CPU backends agree token for token,
// and a backend whose selections differ is reported with the mass they move, worked out by hand. (CPU against
// CUDA: tests/cuda/test_cuda_fidelity.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kvsift/eval/capture.hpp"
#include "kvsift/eval/fidelity.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/selectors/streaming_llm/streaming_llm.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

const Capture& capture() {
  static const Capture c = read_capture(std::string(KVSIFT_TEST_DATA_DIR) + "/gpl3_512_l3_l15.kvscap");
  return c;
}

const FidelityRow& row_for(const std::vector<FidelityRow>& rows, const std::string& selector, double budget,
                           std::int32_t layer) {
  for (const auto& r : rows) {
    if (r.selector == selector && r.budget == budget && r.layer == layer) return r;
  }
  throw std::runtime_error("no row for " + selector);
}

// ---- built captures -------------------------------------------------------------------------------------

/// One layer of a built capture in fp32, [token][head][channel]; stored as fp16 by make_capture.
struct LayerData {
  std::int32_t layer;
  std::vector<float> q, k, v;
};

Capture make_capture(std::int32_t tokens, std::int32_t q_heads, std::int32_t kv_heads, std::int32_t head_dim,
                     const std::vector<LayerData>& layers) {
  Capture c;
  c.model = "built";
  c.text_id = "test";
  c.tokens = tokens;
  c.q_heads = q_heads;
  c.kv_heads = kv_heads;
  c.head_dim = head_dim;
  const auto narrow = [](const std::vector<float>& x) {
    std::vector<half> out(x.size());
    std::transform(x.begin(), x.end(), out.begin(), [](float f) { return float_to_half(f); });
    return out;
  };
  for (const auto& l : layers) {
    c.layers.push_back(
        {.layer = l.layer, .q_pre = {}, .q = narrow(l.q), .k_pre = {}, .k = narrow(l.k), .v = narrow(l.v)});
  }
  return c;
}

using Any = AnySelector<half, cpu::Context>;

/// The last K tokens of [0, p] (a window of recent tokens alone), and the first K (a sink only, never the own
/// token).
SelectorEntry recent_entry() {
  return {"Recent", [](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
            return SelectorSetup{Any(StreamingLLM<half, cpu::Context>(limits)), {0, k}};
          }};
}
SelectorEntry oldest_entry() {
  return {"Oldest", [](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
            return SelectorSetup{Any(StreamingLLM<half, cpu::Context>(limits)), {k, 0}};
          }};
}
SelectorEntry oracle_entry() {
  return {"OracleTopK", [](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
            return SelectorSetup{Any(OracleTopK<half, cpu::Context>(limits, {.budget = k}))};
          }};
}

/// The q-quantile by linear interpolation between order statistics (numpy's default).
double quantile(std::vector<double> x, double q) {
  std::sort(x.begin(), x.end());
  const double h = q * double(x.size() - 1);
  const auto lo = std::size_t(h);
  return lo + 1 < x.size() ? x[lo] + (h - double(lo)) * (x[lo + 1] - x[lo]) : x[lo];
}
double mean_of(const std::vector<double>& x) { return std::accumulate(x.begin(), x.end(), 0.0) / double(x.size()); }

/// The default logit scale, 1 / sqrt(head_dim) rounded to fp32 as AttentionOptions holds it (exact 1 / sqrt(d)
/// would move the weights by ~1e-8 relative).
double logit_scale(std::int32_t head_dim) { return double(1.0f / std::sqrt(float(head_dim))); }

/// An independent fp64 scoring of a selection that keeps the last K tokens of [0, p], at the given positions of
/// one layer of a built capture: per (position, query head) mass recall and output error, the pooled error
/// per position (one norm over all heads), and per (position, kv head) the id recall against the top-K of
/// max-over-the-group softmax weights.
struct Expected {
  std::vector<double> mass, error, pooled_error, id_recall;
};

Expected score_recent(const Capture& c, std::size_t layer, const std::vector<std::int32_t>& positions, std::int32_t k) {
  const CaptureLayer& l = c.layers[layer];
  const std::int32_t d = c.head_dim, group = c.q_heads / c.kv_heads;
  const auto at = [](const std::vector<half>& x, std::size_t i) { return double(to_float(x[i])); };
  Expected out;
  for (const std::int32_t p : positions) {
    const std::int32_t n = p + 1, first_kept = std::max(0, n - k);
    double diff2 = 0.0, ref2 = 0.0;
    std::vector<std::vector<double>> weight(std::size_t(c.q_heads), std::vector<double>(std::size_t(n)));
    for (std::int32_t h = 0; h < c.q_heads; ++h) {
      const std::int32_t g = h / group;
      std::vector<double>& w = weight[std::size_t(h)];
      for (std::int32_t t = 0; t < n; ++t) {
        double dot = 0.0;
        for (std::int32_t i = 0; i < d; ++i) {
          dot += at(l.q, (std::size_t(p) * c.q_heads + h) * d + i) * at(l.k, (std::size_t(t) * c.kv_heads + g) * d + i);
        }
        w[std::size_t(t)] = dot * logit_scale(d);
      }
      const double max_logit = *std::max_element(w.begin(), w.end());
      for (double& x : w) x = std::exp(x - max_logit);
      double total = 0.0, kept = 0.0;
      std::vector<double> o_ref(std::size_t(d), 0.0), o_sel(std::size_t(d), 0.0);
      for (std::int32_t t = 0; t < n; ++t) {
        total += w[std::size_t(t)];
        if (t >= first_kept) kept += w[std::size_t(t)];
      }
      for (std::int32_t t = 0; t < n; ++t) {
        for (std::int32_t i = 0; i < d; ++i) {
          const double v = at(l.v, (std::size_t(t) * c.kv_heads + g) * d + i);
          o_ref[std::size_t(i)] += w[std::size_t(t)] / total * v;
          if (t >= first_kept) o_sel[std::size_t(i)] += w[std::size_t(t)] / kept * v;
        }
      }
      double head_diff2 = 0.0, head_ref2 = 0.0;
      for (std::int32_t i = 0; i < d; ++i) {
        head_diff2 += (o_sel[std::size_t(i)] - o_ref[std::size_t(i)]) * (o_sel[std::size_t(i)] - o_ref[std::size_t(i)]);
        head_ref2 += o_ref[std::size_t(i)] * o_ref[std::size_t(i)];
      }
      out.mass.push_back(kept / total);
      out.error.push_back(std::sqrt(head_diff2 / head_ref2));
      diff2 += head_diff2;
      ref2 += head_ref2;
    }
    out.pooled_error.push_back(std::sqrt(diff2 / ref2));
    for (std::int32_t g = 0; g < c.kv_heads; ++g) {
      std::vector<float> score(std::size_t(n), 0.0f);
      for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
        const auto& w = weight[std::size_t(h)];
        const double total = std::accumulate(w.begin(), w.end(), 0.0);
        for (std::int32_t t = 0; t < n; ++t) {
          score[std::size_t(t)] = std::max(score[std::size_t(t)], float(w[std::size_t(t)] / total));
        }
      }
      std::vector<std::int32_t> order(static_cast<std::size_t>(n));
      std::iota(order.begin(), order.end(), 0);  // a stable sort keeps the smaller index first among ties
      std::stable_sort(order.begin(), order.end(),
                       [&](std::int32_t a, std::int32_t b) { return score[std::size_t(a)] > score[std::size_t(b)]; });
      const std::int32_t top = std::min(k, n);
      const auto hits =
          std::count_if(order.begin(), order.begin() + top, [&](std::int32_t t) { return t >= first_kept; });
      out.id_recall.push_back(double(hits) / top);
    }
  }
  return out;
}

TEST(FidelityDefinitions, TheQueryAttendsItsOwnToken) {
  // 4 tokens, one head of dim 2; tokens [0, 3) are the prefill, position 3 is decoded. Its query (4, 0)
  // matches its own key (4, 0) and no other (keys (0, 1)): logits 16 / sqrt(2) for itself, 0 for the rest,
  // so the own token carries e^(16 / sqrt 2) / (3 + e^(16 / sqrt 2)) = 0.99996 of the mass. K = 0.25 x 4 = 1.
  const Capture c = make_capture(4, 1, 1, 2,
                                 {{.layer = 0,
                                   .q = {0, 1, 0, 1, 0, 1, 4, 0},
                                   .k = {0, 1, 0, 1, 0, 1, 4, 0},
                                   .v = {1, 0, 1, 0, 1, 0, 0, 1}}});
  const std::vector<SelectorEntry> selectors = {recent_entry(), oldest_entry(), oracle_entry()};
  const auto result = evaluate_fidelity(c, selectors, {.budgets = {0.25}, .decode_positions = 1, .prefill = 0.75});
  ASSERT_EQ(result.first_position, 3);
  ASSERT_EQ(result.positions, std::vector<std::int32_t>{3});
  const double own = std::exp(16.0 * logit_scale(2)), total = 3.0 + own;
  // The output is (3 v_0 + own v_3) / total = (3, own) / total; selecting only the own token gives v_3 = (0, 1).
  const double ref_x = 3.0 / total, ref_y = own / total;
  const double own_error = std::hypot(ref_x, 1.0 - ref_y) / std::hypot(ref_x, ref_y);
  const double oldest_error = std::hypot(1.0 - ref_x, ref_y) / std::hypot(ref_x, ref_y);

  const auto& recent = row_for(result.rows, "Recent", 0.25, 0);  // the newest token is the query's own
  EXPECT_EQ(recent.budget_tokens, 1);
  EXPECT_NEAR(recent.mass_recall, own / total, 1e-12);
  EXPECT_GT(recent.mass_recall, 0.99);
  EXPECT_NEAR(recent.output_error, own_error, 1e-6);
  EXPECT_NEAR(recent.id_recall, 1.0, 1e-12);  // the oracle's top-1 is the own token
  const auto& oldest = row_for(result.rows, "Oldest", 0.25, 0);  // a selection without it
  EXPECT_NEAR(oldest.mass_recall, 1.0 / total, 1e-12);
  EXPECT_LT(oldest.mass_recall, 0.5);
  EXPECT_NEAR(oldest.output_error, oldest_error, 1e-6);
  EXPECT_NEAR(oldest.id_recall, 0.0, 1e-12);
  const auto& oracle = row_for(result.rows, "OracleTopK", 0.25, 0);  // its candidates include the own token
  EXPECT_NEAR(oracle.mass_recall, own / total, 1e-12);
}

TEST(FidelityDefinitions, PerLayerRowsWithTailsAndPerHeadErrorAtSpreadPositions) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  test::Random rng(seed);
  constexpr std::int32_t kTokens = 40, kQHeads = 4, kKVHeads = 2, kDim = 8;
  const std::size_t q_size = std::size_t(kTokens) * kQHeads * kDim, kv_size = std::size_t(kTokens) * kKVHeads * kDim;
  // Layer 5: random queries and keys, plus a channel that favours recent tokens (query > 1, key 0.1 t), so its
  // rows differ from layer 9's; kv head 0's values are one large vector at every token (any selection
  // reproduces its output exactly), kv head 1's are small and random. The pooled norm is then dominated by
  // heads 0-1 with no error, while the per-head mean weighs heads 2-3's error as much.
  LayerData random{.layer = 5, .q = rng.normal(q_size), .k = rng.normal(kv_size), .v = rng.normal(kv_size, 0.5f)};
  for (std::size_t i = 0; i < q_size; i += kDim) random.q[i] = 1.0f + std::abs(random.q[i]);
  for (std::size_t i = 0; i < kv_size; i += kDim) random.k[i] = 0.1f * float(i / (kKVHeads * kDim));
  const std::vector<float> large = rng.normal(kDim, 16.0f);
  for (std::int32_t t = 0; t < kTokens; ++t) {
    std::copy(large.begin(), large.end(), random.v.begin() + std::size_t(t) * kKVHeads * kDim);
  }
  // Layer 9: zero keys, so every query attends uniformly: the last K of p + 1 tokens hold K / (p + 1).
  const LayerData uniform{
      .layer = 9, .q = rng.normal(q_size), .k = std::vector<float>(kv_size, 0.0f), .v = rng.normal(kv_size)};
  const Capture c = make_capture(kTokens, kQHeads, kKVHeads, kDim, {random, uniform});

  const std::vector<SelectorEntry> selectors = {recent_entry(), oracle_entry()};
  const auto result =
      evaluate_fidelity(c, selectors, {.budgets = {0.25, 0.5}, .decode_positions = 5, .prefill = 0.5});
  // Prefill [0, 20); 5 positions over the decoded 20..39, both ends included: 20 + round(i * 19 / 4).
  EXPECT_EQ(result.first_position, 20);
  const std::vector<std::int32_t> positions = {20, 25, 30, 34, 39};
  EXPECT_EQ(result.positions, positions);
  // One row per (layer, budget, selector), layers in capture order.
  ASSERT_EQ(result.rows.size(), 2u * 2u * 2u);
  EXPECT_EQ(result.rows.front().layer, 5);
  EXPECT_EQ(result.rows.back().layer, 9);

  for (const double budget : {0.25, 0.5}) {
    const std::int32_t k = budget == 0.25 ? 5 : 11;  // round(budget x 21), the context at position 20
    SCOPED_TRACE(testing::Message() << "K " << k);
    // Uniform layer, by hand: K / (p + 1) for every head.
    const auto& flat = row_for(result.rows, "Recent", budget, 9);
    EXPECT_EQ(flat.budget_tokens, k);
    // All ties: the oracle's top-K are the first K tokens, which share max(0, 2K - p - 1) with the last K.
    std::vector<double> by_hand, id_by_hand;
    for (const std::int32_t p : positions) {
      by_hand.insert(by_hand.end(), kQHeads, double(k) / (p + 1));
      id_by_hand.push_back(double(std::max(0, 2 * k - p - 1)) / k);
    }
    EXPECT_NEAR(flat.mass_recall, mean_of(by_hand), 1e-12);
    EXPECT_NEAR(flat.mass_recall_p10, quantile(by_hand, 0.1), 1e-12);
    EXPECT_NEAR(flat.mass_recall_p90, quantile(by_hand, 0.9), 1e-12);
    EXPECT_NEAR(flat.id_recall, mean_of(id_by_hand), 1e-12);
    EXPECT_NEAR(row_for(result.rows, "OracleTopK", budget, 9).mass_recall, mean_of(by_hand), 1e-12);

    for (std::size_t layer = 0; layer < 2; ++layer) {
      const std::int32_t id = c.layers[layer].layer;
      SCOPED_TRACE(testing::Message() << "layer " << id);
      const Expected e = score_recent(c, layer, positions, k);
      const auto& r = row_for(result.rows, "Recent", budget, id);
      EXPECT_NEAR(r.mass_recall, mean_of(e.mass), 1e-9);
      EXPECT_NEAR(r.mass_recall_p10, quantile(e.mass, 0.1), 1e-9);
      EXPECT_NEAR(r.mass_recall_p90, quantile(e.mass, 0.9), 1e-9);
      EXPECT_NEAR(r.output_error, mean_of(e.error), 1e-5);  // outputs are fp32
      EXPECT_NEAR(r.output_error_p90, quantile(e.error, 0.9), 1e-5);
      EXPECT_NEAR(r.id_recall, mean_of(e.id_recall), 1e-12);
      EXPECT_NEAR(r.mean_selected, k, 1e-12);
    }
    // The data tells the definitions apart: the layers differ, and on layer 5 the pooled norm is far below
    // the per-head mean the harness reports.
    const Expected e5 = score_recent(c, 0, positions, k);
    EXPECT_GT(std::abs(row_for(result.rows, "Recent", budget, 5).mass_recall - flat.mass_recall), 0.01);
    EXPECT_GT(row_for(result.rows, "Recent", budget, 5).output_error, 3 * mean_of(e5.pooled_error));
  }
}

TEST(FidelityDefinitions, PositionsSpanTheDecodedRange) {
  const Capture& c = capture();  // 512 tokens
  const std::vector<SelectorEntry> none;
  // Every decode position when N equals their number; the last one when N = 1.
  auto all = evaluate_fidelity(c, none, {.budgets = {0.5}, .decode_positions = 16, .prefill = 496.0 / 512});
  std::vector<std::int32_t> every(16);
  std::iota(every.begin(), every.end(), 496);
  EXPECT_EQ(all.positions, every);
  EXPECT_EQ(evaluate_fidelity(c, none, {.decode_positions = 1}).positions, std::vector<std::int32_t>{511});
  // The default: prefill half the tokens, 64 positions from 256 to 511, gaps of 4 or 5.
  const auto spread = evaluate_fidelity(c, none, {});
  ASSERT_EQ(spread.positions.size(), 64u);
  EXPECT_EQ(spread.first_position, 256);
  EXPECT_EQ(spread.positions.front(), 256);
  EXPECT_EQ(spread.positions.back(), 511);
  for (std::size_t i = 1; i < spread.positions.size(); ++i) {
    const std::int32_t gap = spread.positions[i] - spread.positions[i - 1];
    EXPECT_TRUE(gap == 4 || gap == 5) << i << ": " << gap;
  }
  EXPECT_NE(fidelity_markdown(spread).find("Prefill: tokens [0, 256); 64 positions evaluated, evenly spread over the "
                                           "decoded positions 256..511"),
            std::string::npos);
}

// ---- the committed real capture ---------------------------------------------------------------------------

TEST(Fidelity, FullBudgetKeepsAllAttention) {
  // One decode position, 511: a budget of 100% is the 512 tokens it attends (its own included).
  const auto result = evaluate_fidelity(capture(), reference_selectors(),
                                        {.budgets = {1.0}, .decode_positions = 1, .prefill = 511.0 / 512});
  ASSERT_EQ(result.positions, std::vector<std::int32_t>{511});
  for (const std::int32_t layer : {3, 15}) {
    for (const char* name : {"OracleTopK", "StreamingLLM"}) {
      const auto& r = row_for(result.rows, name, 1.0, layer);
      EXPECT_EQ(r.budget_tokens, 512);
      EXPECT_NEAR(r.mass_recall, 1.0, 1e-9) << name;
      EXPECT_NEAR(r.mass_recall_p10, 1.0, 1e-9) << name;
      EXPECT_NEAR(r.id_recall, 1.0, 1e-12) << name;
      EXPECT_LT(r.output_error_p90, 1e-6) << name;
      EXPECT_NEAR(r.mean_selected, 512.0, 1e-9) << name;
    }
    // Quest: a window of 4 + 64 and 27 whole pages of 16 (the 444 tokens left hold 27): the pages overlapping the
    // window's edges are kept less their window tokens, so a page's worth at most goes unattended.
    const auto& quest = row_for(result.rows, "Quest", 1.0, layer);
    EXPECT_EQ(quest.budget_tokens, 512);
    EXPECT_GT(quest.mass_recall, 0.99);
    EXPECT_LT(quest.mass_recall, 1.0);
    EXPECT_LE(quest.mean_selected, 512.0);
    EXPECT_GE(quest.mean_selected, 512.0 - 16);
  }
}

TEST(Fidelity, OracleBoundsEveryReferenceAndRetrievalBeatsRecencyAtLargerBudgets) {
  // Prefill [0, 384): K = 19, 39, 77 for 5/10/20%; 32 positions over 384..511.
  const std::vector<double> budgets = {0.05, 0.1, 0.2};
  const auto result = evaluate_fidelity(capture(), reference_selectors(),
                                        {.budgets = budgets, .decode_positions = 32, .prefill = 0.75});
  ASSERT_EQ(result.rows.size(), 2 * budgets.size() * 3);
  for (const std::int32_t layer : {3, 15}) {
    SCOPED_TRACE(testing::Message() << "layer " << layer);
    double previous_oracle = 0.0;
    for (const double budget : budgets) {
      const auto& oracle = row_for(result.rows, "OracleTopK", budget, layer);
      const auto& streaming = row_for(result.rows, "StreamingLLM", budget, layer);
      const auto& quest = row_for(result.rows, "Quest", budget, layer);
      EXPECT_TRUE(oracle.refused.empty() && streaming.refused.empty() && quest.refused.empty());
      EXPECT_NEAR(oracle.id_recall, 1.0, 1e-12);  // a mean of ones: the harness ranks as OracleTopK does
      EXPECT_EQ(oracle.mean_selected, oracle.budget_tokens);
      EXPECT_GT(oracle.mass_recall, previous_oracle);  // more budget, more mass
      previous_oracle = oracle.mass_recall;
      for (const auto* r : {&oracle, &streaming, &quest}) {
        EXPECT_LE(r->mass_recall_p10, r->mass_recall) << r->selector;
        EXPECT_LE(r->mass_recall, r->mass_recall_p90) << r->selector;
      }
      for (const auto* other : {&streaming, &quest}) {
        EXPECT_LE(other->mass_recall, oracle.mass_recall + 1e-12) << other->selector << " at " << budget;
        EXPECT_LT(other->id_recall, 1.0) << other->selector << " at " << budget;
        EXPECT_GT(other->output_error, oracle.output_error) << other->selector << " at " << budget;
        EXPECT_LE(other->mean_selected, other->budget_tokens);
      }
    }
    // Real attention is concentrated: the oracle's 5% already holds most of the mass.
    EXPECT_GT(row_for(result.rows, "OracleTopK", 0.05, layer).mass_recall, 0.6);
  }
  // Per layer, what the pooled mean hid: on layer 3 the recent window keeps little of the mass, and query-aware
  // page retrieval overtakes it once a budget holds several pages.
  EXPECT_LT(row_for(result.rows, "StreamingLLM", 0.2, 3).mass_recall, 0.5);
  EXPECT_GT(row_for(result.rows, "Quest", 0.2, 3).mass_recall,
            row_for(result.rows, "StreamingLLM", 0.2, 3).mass_recall);
}

TEST(Fidelity, RerankEntriesKeepTheirBudgetAndMoreMassThanTheirProposers) {
  // Prefill [0, 256): K = 51 at 20%; 32 positions over 256..511. The rerank keeps its entry's tokens, never beats
  // the oracle, and at 20% beats its proposer alone (layers 3 / 15: Quest 0.475 / 0.498, with the rerank 0.827 /
  // 0.826; CSAttention 0.828 / 0.729, with it 0.878 / 0.845; OracleTopK 0.885 / 0.873).
  auto selectors = reference_selectors();
  for (auto& e : method_selectors()) selectors.push_back(std::move(e));
  for (auto& e : rerank_selectors(4)) selectors.push_back(std::move(e));
  const auto result = evaluate_fidelity(capture(), selectors, {.budgets = {0.2}, .decode_positions = 32, .prefill = 0.5});
  for (const std::int32_t layer : {3, 15}) {
    SCOPED_TRACE(testing::Message() << "layer " << layer);
    const auto& oracle = row_for(result.rows, "OracleTopK", 0.2, layer);
    for (const auto& [proposer, reranked] : {std::pair{"Quest", "Quest + rerank"},
                                             std::pair{"CSAttention", "CSAttention + rerank"}}) {
      const auto& alone = row_for(result.rows, proposer, 0.2, layer);
      const auto& r = row_for(result.rows, reranked, 0.2, layer);
      ASSERT_TRUE(r.refused.empty()) << r.refused;
      EXPECT_LE(r.mean_selected, r.budget_tokens) << reranked;
      EXPECT_LE(r.mass_recall, oracle.mass_recall + 1e-12) << reranked;
      EXPECT_GT(r.mass_recall, alone.mass_recall + 0.03) << reranked << " against " << proposer;
      EXPECT_GT(r.mass_recall, 0.75) << reranked;
    }
  }
  // The adaptive budget keeps at most as many tokens as the fixed one, and holds no more mass than it.
  for (const std::int32_t layer : {3, 15}) {
    const auto& fixed = row_for(result.rows, "Quest + rerank", 0.2, layer);
    const auto& adaptive = row_for(result.rows, "Quest + rerank (p 0.9)", 0.2, layer);
    ASSERT_TRUE(adaptive.refused.empty()) << adaptive.refused;
    EXPECT_LE(adaptive.mean_selected, fixed.mean_selected + 1e-9) << "layer " << layer;
    EXPECT_LE(adaptive.mass_recall, fixed.mass_recall + 1e-9) << "layer " << layer;
    EXPECT_GT(adaptive.mean_selected, 0) << "layer " << layer;
  }
  EXPECT_THROW(rerank_selectors(0), Error);
}

TEST(Fidelity, RefusedBudgetsAndBadOptionsAreReported) {
  // Prefill [0, 256): 1% is K = 3 tokens, less than a page of 16 (the reference entry's Quest shrinks its pages).
  auto selectors = reference_selectors();
  selectors.push_back({"Quest 16", [](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
                         return BasicSelectorSetup<cpu::Context>{
                             AnySelector<half, cpu::Context>(Quest<half, cpu::Context>(limits, {.budget = k}))};
                       }});
  const auto result = evaluate_fidelity(capture(), selectors, {.budgets = {0.01}, .decode_positions = 8});
  EXPECT_NE(row_for(result.rows, "Quest 16", 0.01, 3).refused.find("smaller than one page"), std::string::npos);
  EXPECT_TRUE(row_for(result.rows, "Quest", 0.01, 3).refused.empty());
  const std::string table = fidelity_markdown(result);
  EXPECT_NE(table.find("| 15 | Quest 16 | 1% | 3 | refused: "), std::string::npos) << table;
  EXPECT_NE(table.find("K = budget x 257, the context at the first decode position"), std::string::npos) << table;
  test::expect_error([] { evaluate_fidelity(capture(), reference_selectors(), {.budgets = {0.0}}); },
                     "budget fraction 0 is outside (0, 1]");
  test::expect_error([] { evaluate_fidelity(capture(), reference_selectors(), {.decode_positions = 257}); },
                     "options.decode_positions (= 257) is outside [1, decoded positions = 256]");
  test::expect_error([] { evaluate_fidelity(capture(), reference_selectors(), {.prefill = 1.0}); },
                     "options.prefill (= 1) leaves no prefill or no decode position");
  Capture truncated = capture();
  truncated.layers[1].v.pop_back();
  test::expect_error([&] { evaluate_fidelity(truncated, reference_selectors(), {}); },
                     "layer 15: q, k, v hold 294912, 98304, 98303 values");
}

// ---- backends in lockstep -----------------------------------------------------------------------------------

/// A capture of `tokens` random tokens (4 query heads on 2 kv heads of dim 16), two layers.
Capture random_capture(test::Random& rng, std::int32_t tokens) {
  const std::size_t q_size = std::size_t(tokens) * 4 * 16, kv_size = std::size_t(tokens) * 2 * 16;
  std::vector<LayerData> layers;
  for (const std::int32_t id : {2, 4}) {
    layers.push_back({.layer = id, .q = rng.normal(q_size, 2.0f), .k = rng.normal(kv_size), .v = rng.normal(kv_size)});
  }
  return make_capture(tokens, 4, 2, 16, layers);
}

bool same_row(const FidelityRow& a, const FidelityRow& b) {
  return a.layer == b.layer && a.selector == b.selector && a.budget == b.budget &&
         a.budget_tokens == b.budget_tokens && a.refused == b.refused && a.mass_recall == b.mass_recall &&
         a.mass_recall_p10 == b.mass_recall_p10 && a.mass_recall_p90 == b.mass_recall_p90 &&
         a.output_error == b.output_error && a.output_error_p90 == b.output_error_p90 && a.id_recall == b.id_recall &&
         a.mean_selected == b.mean_selected;
}

class FidelityBackends : public test::SeededTest {};

TEST_F(FidelityBackends, TwoCpuBackendsInLockstepGiveTheRowsOfOneAndNoMismatch) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const Capture c = random_capture(rng, 96);
  // Prefill [0, 48): K = 5 (Quest: a window of 0 + 1, 4 pages of one token), 20 (2 + 5, 13 pages of one token); 12
  // positions.
  const FidelityOptions options{.budgets = {0.1, 0.4}, .decode_positions = 12, .prefill = 0.5};
  const auto alone = evaluate_fidelity(c, reference_selectors(), options);
  const auto a = fidelity_backend(reference_selectors()), b = fidelity_backend(reference_selectors());
  FidelityBackend* const backends[] = {a.get(), b.get()};
  const auto both = evaluate_fidelity(c, backends, options);
  ASSERT_EQ(both.results.size(), 2u);
  ASSERT_EQ(both.differences.size(), 1u);
  ASSERT_EQ(alone.rows.size(), 2u * 2u * 3u);
  for (const auto& result : both.results) {
    EXPECT_EQ(result.backend, "cpu");
    EXPECT_EQ(result.positions, alone.positions);
    ASSERT_EQ(result.rows.size(), alone.rows.size());
    for (std::size_t i = 0; i < alone.rows.size(); ++i) {
      EXPECT_TRUE(same_row(result.rows[i], alone.rows[i])) << alone.rows[i].selector << " row " << i;
    }
  }
  EXPECT_TRUE(alone.rows[2].refused.empty()) << alone.rows[2].refused;  // Quest at K = 5 has room to choose
  const BackendDifference& d = both.differences[0];
  EXPECT_TRUE(d.mismatches.empty());
  EXPECT_TRUE(d.refusals.empty());
  EXPECT_EQ(d.max_mass(), 0.0);
  // 2 layers x 2 budgets x 3 selectors x 12 positions x 2 kv heads.
  EXPECT_EQ(d.selections, 2 * 6 * 12 * 2);
  EXPECT_EQ(fidelity_markdown(d), "cpu against cpu: all 288 selections (layer, budget, selector, evaluated position, "
                                  "kv head) attended the same tokens.\n");
}

TEST(FidelityBackendsByHand, DifferingSelectionsAndRefusalsAreReportedWithTheMassTheyMove) {
  // The 4-token capture of TheQueryAttendsItsOwnToken: at position 3 the own token holds own / total of the mass,
  // each other token 1 / total. Under one name the first backend keeps the newest token, the second the oldest:
  // they attend {3} and {0}, moving the mass recall by (own - 1) / total. "Page" is Quest (refused at K = 1) on
  // the first and the newest token on the second.
  const Capture c = make_capture(4, 1, 1, 2,
                                 {{.layer = 0,
                                   .q = {0, 1, 0, 1, 0, 1, 4, 0},
                                   .k = {0, 1, 0, 1, 0, 1, 4, 0},
                                   .v = {1, 0, 1, 0, 1, 0, 0, 1}}});
  const auto named = [](SelectorEntry e, std::string name) {
    e.name = std::move(name);
    return e;
  };
  const SelectorEntry quest{"Page", [](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
                              return SelectorSetup{Any(Quest<half, cpu::Context>(limits, {.budget = k, .page_size = 16}))};
                            }};
  const auto first = fidelity_backend({named(recent_entry(), "Keep"), quest});
  const auto second = fidelity_backend({named(oldest_entry(), "Keep"), named(recent_entry(), "Page")});
  FidelityBackend* const backends[] = {first.get(), second.get()};
  const auto got = evaluate_fidelity(c, backends, {.budgets = {0.25}, .decode_positions = 1, .prefill = 0.75});
  ASSERT_EQ(got.differences.size(), 1u);
  const BackendDifference& d = got.differences[0];
  EXPECT_EQ(d.selections, 1);  // "Page" ran on the second backend only: not compared
  ASSERT_EQ(d.mismatches.size(), 1u);
  const SelectionMismatch& m = d.mismatches[0];
  EXPECT_EQ(m.layer, 0);
  EXPECT_EQ(m.selector, "Keep");
  EXPECT_EQ(m.budget, 0.25);
  EXPECT_EQ(m.position, 3);
  EXPECT_EQ(m.kv_head, 0);
  EXPECT_EQ(m.only_first, std::vector<std::int32_t>{3});
  EXPECT_EQ(m.only_this, std::vector<std::int32_t>{0});
  const double own = std::exp(16.0 * logit_scale(2)), total = 3.0 + own;
  EXPECT_NEAR(m.mass, (own - 1.0) / total, 1e-12);
  EXPECT_EQ(d.max_mass(), m.mass);
  // The rows' mass recalls differ by exactly that.
  EXPECT_NEAR(row_for(got.results[0].rows, "Keep", 0.25, 0).mass_recall -
                  row_for(got.results[1].rows, "Keep", 0.25, 0).mass_recall,
              m.mass, 1e-12);
  ASSERT_EQ(d.refusals.size(), 1u);
  EXPECT_EQ(d.refusals[0].rfind("layer 0, Page, 25%: refused on cpu only (kvsift::Quest: config.budget (= 1) is "
                                "smaller than one page", 0),
            0u)
      << d.refusals[0];
  const std::string line = fidelity_markdown(d);
  EXPECT_NE(line.find("cpu against cpu: 1 of 1 selections (layer, budget, selector, evaluated position, kv head) "
                      "attended other tokens (2 tokens in one set only), moving a (position, query head)'s mass recall "
                      "by at most 1;"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("layer 0, Keep, 25%: 1 (1)"), std::string::npos) << line;
  EXPECT_NE(line.find("; refused by one backend only: layer 0, Page, 25%: refused on cpu only"), std::string::npos)
      << line;
}

TEST(FidelityBackendsByHand, BackendListsThatCannotBeComparedAreRefused) {
  const Capture& c = capture();
  const auto a = fidelity_backend(reference_selectors());
  const auto fewer = fidelity_backend({oracle_entry()});
  const auto renamed = fidelity_backend({recent_entry(), oldest_entry(), oracle_entry()});
  test::expect_error([&] { evaluate_fidelity(c, std::span<FidelityBackend* const>{}, {}); }, "no backend given");
  FidelityBackend* const with_null[] = {a.get(), nullptr};
  test::expect_error([&] { evaluate_fidelity(c, with_null, {}); }, "backends[1] is null");
  FidelityBackend* const different_count[] = {a.get(), fewer.get()};
  test::expect_error([&] { evaluate_fidelity(c, different_count, {}); }, "backend cpu holds 1 selectors, backend cpu holds 3");
  FidelityBackend* const different_names[] = {a.get(), renamed.get()};
  test::expect_error([&] { evaluate_fidelity(c, different_names, {}); },
                     "selector 0 is Recent on backend cpu but OracleTopK on backend cpu");
}

}  // namespace
}  // namespace kvsift
