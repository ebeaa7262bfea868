// split_budget (attention/budget_split.hpp): the window shrinks with small budgets, the selection keeps at least
// 5/8 of K, the preferred window stands at large K; bad arguments are refused naming them.
#include <gtest/gtest.h>

#include <cstdint>

#include "kvsift/attention/budget_split.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

TEST(BudgetSplit, TheWindowShrinksWithTheBudgetAndTheSelectionKeepsFiveEighths) {
  const AttentionWindow preferred{4, 64};
  // K: {sink, recent, selection} worked out by hand.
  const struct {
    std::int32_t k, sink, recent, selection;
  } cases[] = {{1, 0, 0, 1}, {7, 0, 1, 6}, {10, 1, 2, 7}, {21, 2, 5, 14}, {51, 4, 12, 35}, {255, 4, 63, 188},
               {256, 4, 64, 188}, {2048, 4, 64, 1980}};
  for (const auto& c : cases) {
    const BudgetSplit split = split_budget(c.k, preferred);
    EXPECT_EQ(split.window.sink, c.sink) << c.k;
    EXPECT_EQ(split.window.recent, c.recent) << c.k;
    EXPECT_EQ(split.selection, c.selection) << c.k;
  }
  for (std::int32_t k = 1; k <= 5000; ++k) {
    for (const AttentionWindow p : {AttentionWindow{}, AttentionWindow{4, 64}, AttentionWindow{0, 64},
                                    AttentionWindow{4, k}, AttentionWindow{100, 1000}}) {
      const BudgetSplit split = split_budget(k, p);
      ASSERT_EQ(split.window.sink + split.window.recent + split.selection, k) << k;
      ASSERT_GE(8 * std::int64_t(split.selection), 5 * std::int64_t(k)) << k;
      ASSERT_LE(split.window.sink, p.sink);
      ASSERT_LE(split.window.recent, p.recent);
    }
  }
  // A recent window as large as K means "a quarter of K" (CTKVR's arrangement in the fidelity harness).
  EXPECT_EQ(split_budget(100, {4, 100}).window.recent, 25);
}

TEST(BudgetSplit, BadArgumentsAreRefused) {
  test::expect_error([] { split_budget(0, {4, 64}); }, {"split_budget", "k (= 0) must be >= 1"});
  test::expect_error([] { split_budget(-5, {}); }, {"split_budget", "k (= -5) must be >= 1"});
  test::expect_error([] { split_budget(64, {-1, 64}); },
                     {"split_budget", "preferred.sink (= -1) and preferred.recent (= 64) must be >= 0"});
}

}  // namespace
}  // namespace kvsift
