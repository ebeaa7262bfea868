// The fidelity harness on the committed real capture (SmolLM2-135M, 512 tokens of GPL-3, layers 3 and 15):
// thresholds that a broken selector, metric or harness fails.
#include <gtest/gtest.h>

#include <string>

#include "kvsift/core/capture.hpp"
#include "kvsift/selectors/fidelity.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

const Capture& capture() {
  static const Capture c = read_capture(std::string(KVSIFT_TEST_DATA_DIR) + "/gpl3_512_l3_l15.kvscap");
  return c;
}

const FidelityRow& row_for(const std::vector<FidelityRow>& rows, const std::string& selector, double budget) {
  for (const auto& r : rows) {
    if (r.selector == selector && r.budget == budget) return r;
  }
  throw std::runtime_error("no row for " + selector);
}

TEST(Fidelity, FullBudgetKeepsAllAttention) {
  // One decode position: a budget of 100% is every token before it.
  const auto rows = evaluate_fidelity(capture(), reference_selectors(), {.budgets = {1.0}, .decode_positions = 1});
  for (const char* name : {"OracleTopK", "StreamingLLM"}) {
    const auto& r = row_for(rows, name, 1.0);
    EXPECT_NEAR(r.mass_recall, 1.0, 1e-9) << name;
    EXPECT_NEAR(r.id_recall, 1.0, 1e-12) << name;
    EXPECT_LT(r.output_error, 1e-6) << name;
    EXPECT_NEAR(r.mean_selected, 511.0, 1e-9) << name;
  }
  // Quest floors the budget to whole pages: 31 of the 32 (the last holds 15 tokens).
  const auto& quest = row_for(rows, "Quest", 1.0);
  EXPECT_LE(quest.mean_selected, 511.0);
  EXPECT_GE(quest.mean_selected, 511.0 - 16);
  EXPECT_LT(quest.mass_recall, 1.0);
}

TEST(Fidelity, OracleBoundsEveryReferenceAndRetrievalBeatsRecencyAtLargerBudgets) {
  const std::vector<double> budgets = {0.05, 0.1, 0.2};
  const auto rows = evaluate_fidelity(capture(), reference_selectors(), {.budgets = budgets, .decode_positions = 32});
  ASSERT_EQ(rows.size(), budgets.size() * 3);
  double previous_oracle = 0.0;
  for (const double budget : budgets) {
    const auto& oracle = row_for(rows, "OracleTopK", budget);
    const auto& streaming = row_for(rows, "StreamingLLM", budget);
    const auto& quest = row_for(rows, "Quest", budget);
    EXPECT_TRUE(oracle.refused.empty() && streaming.refused.empty() && quest.refused.empty());
    EXPECT_NEAR(oracle.id_recall, 1.0, 1e-12);  // a mean of ones
    EXPECT_EQ(oracle.mean_selected, oracle.budget_tokens);
    EXPECT_GT(oracle.mass_recall, previous_oracle);  // more budget, more mass
    previous_oracle = oracle.mass_recall;
    for (const auto* other : {&streaming, &quest}) {
      EXPECT_LE(other->mass_recall, oracle.mass_recall + 1e-12) << other->selector << " at " << budget;
      EXPECT_LT(other->id_recall, 1.0) << other->selector << " at " << budget;
      EXPECT_GT(other->output_error, oracle.output_error) << other->selector << " at " << budget;
      EXPECT_LE(other->mean_selected, other->budget_tokens);
    }
  }
  // Real attention is concentrated: the oracle's 5% already holds most of the mass.
  EXPECT_GT(row_for(rows, "OracleTopK", 0.05).mass_recall, 0.7);
  // Query-aware page retrieval overtakes the query-blind window once a budget holds several pages.
  EXPECT_GT(row_for(rows, "Quest", 0.2).mass_recall, row_for(rows, "StreamingLLM", 0.2).mass_recall);
}

TEST(Fidelity, RefusedBudgetsAndBadOptionsAreReported) {
  const auto rows = evaluate_fidelity(capture(), reference_selectors(), {.budgets = {0.01}, .decode_positions = 8});
  EXPECT_NE(row_for(rows, "Quest", 0.01).refused.find("smaller than one page"), std::string::npos);
  EXPECT_NE(fidelity_markdown(rows).find("| Quest | 1% | 5 | refused: "), std::string::npos) << fidelity_markdown(rows);
  test::expect_error([] { evaluate_fidelity(capture(), reference_selectors(), {.budgets = {0.0}}); },
                     "budget fraction 0 is outside (0, 1]");
  test::expect_error([] { evaluate_fidelity(capture(), reference_selectors(), {.decode_positions = 512}); },
                     "options.decode_positions (= 512) is outside [1, tokens = 512)");
}

}  // namespace
}  // namespace kvsift
