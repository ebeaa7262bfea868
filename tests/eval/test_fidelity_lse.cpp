// The fidelity harness's LSE error (eval/fidelity.hpp FidelityRow::lse_error, fidelity_error_markdown), on the
// GPL-3 test capture: zero where the step attends every token, at least -log of the mean mass recall where a
// selector drops tokens (Jensen: the error is -log of the mass recall per (position, head), and -log is convex).
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvsift/cpu/backend.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/eval/fidelity.hpp"

namespace kvsift {
namespace {

const Capture& capture() {
  static const Capture c = read_capture(std::string(KVSIFT_TEST_DATA_DIR) + "/gpl3_512_l3_l15.kvscap");
  return c;
}

const FidelityRow& row_for(const std::vector<FidelityRow>& rows, const std::string& selector, std::int32_t layer) {
  for (const auto& r : rows) {
    if (r.selector == selector && r.layer == layer) return r;
  }
  throw std::runtime_error("no row for " + selector);
}

TEST(FidelityLse, ZeroWhereEveryTokenIsAttended) {
  // One decode position, 511, at a budget of all 512 tokens; CentroidKV's store then holds every token with
  // degree 1 (R = 1, no round merges).
  std::vector<SelectorEntry> selectors = reference_selectors<cpu::Context>();
  for (auto& e : centroid_kv_selectors<cpu::Context>(511.0 / 512)) selectors.push_back(std::move(e));
  const auto result = evaluate_fidelity(capture(), selectors, {.budgets = {1.0}, .decode_positions = 1,
                                                               .prefill = 511.0 / 512});
  for (const std::int32_t layer : {3, 15}) {
    for (const char* name : {"OracleTopK", "StreamingLLM", "CentroidKV", "CentroidKV 4+16"}) {
      const FidelityRow& r = row_for(result.rows, name, layer);
      ASSERT_TRUE(r.refused.empty()) << name << ": " << r.refused;
      EXPECT_LT(r.lse_error_p90, 1e-5) << name << ", layer " << layer;
      EXPECT_LE(r.lse_error, r.lse_error_p90 + 1e-12) << name;
    }
  }
}

TEST(FidelityLse, AtLeastMinusLogOfTheMeanMassRecallAndPrintedOnlyByTheErrorTable) {
  const auto result = evaluate_fidelity(capture(), reference_selectors<cpu::Context>(),
                                        {.budgets = {0.25}, .decode_positions = 8, .prefill = 0.5});
  for (const std::int32_t layer : {3, 15}) {
    for (const char* name : {"OracleTopK", "StreamingLLM"}) {
      const FidelityRow& r = row_for(result.rows, name, layer);
      ASSERT_TRUE(r.refused.empty()) << name << ": " << r.refused;
      EXPECT_GT(r.lse_error, 0.0) << name;
      // fp32 attention against the fp64 mass: a small slack.
      EXPECT_GE(r.lse_error, -std::log(r.mass_recall) - 1e-4) << name << ", layer " << layer;
    }
  }
  const std::string table = fidelity_error_markdown(result.rows);
  EXPECT_NE(table.find("| LSE error | LSE error p90 |"), std::string::npos);
  EXPECT_EQ(fidelity_markdown(result).find("LSE"), std::string::npos) << "the shared table is unchanged";
}

}  // namespace
}  // namespace kvsift
