// CTKVR on the CPU (selectors/ctkvr/ctkvr.hpp) through a DecodeStep, against fp64 references written here:
// - with C' = C and lists holding every middle token, the selection is the top-budget of the softmax over the
//   middle, max over the group (OracleTopK on the same candidate set), at every step, also after decoded tokens
//   left the recent window (they stay candidates) and after the dynamic update replaced lists; GQA and not;
// - lists never hold window tokens; a short union gives fewer ids; the dynamic update stores each query as a
//   centroid in FIFO order across wrap-around and grows the count over spare columns;
// - every refused configuration and prefill.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/ctkvr/ctkvr.hpp"
#include "kvsift/step/decode_step.hpp"
#include "ctkvr_problem.hpp"
#include "selector_check.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::Random;
using test::CtkvrProblem;
using test::kCtkvrWindow;
using Selector = Ctkvr<half, cpu::Context>;

/// Steps `steps` decode tokens; calls check(step index, query, selection) after each.
template <class Check>
void decode(CtkvrProblem& p, DecodeStep<Selector>& step, Random& rng, std::int32_t steps, Check check) {
  cpu::Array<std::byte> workspace(step.workspace_bytes());
  std::vector<float> o(std::size_t(p.q_heads) * p.head_dim), lse(p.q_heads);
  for (std::int32_t s = 0; s < steps; ++s) {
    ++p.length;
    const std::vector<half> q = test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim));
    const std::vector<half> nk = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
    const std::vector<half> nv = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
    step.run({.q = QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim), .cache = p.cache(),
              .k = HeadsView<const half>::packed(nk.data(), 1, p.kv_heads, p.head_dim),
              .v = HeadsView<const half>::packed(nv.data(), 1, p.kv_heads, p.head_dim), .slots = &p.slot},
             StateView<float>::packed(o.data(), lse.data(), 1, p.q_heads, p.head_dim), workspace.bytes(), {});
    check(s, q, step.selection(workspace.bytes(), 1));
  }
}

class CpuCtkvr : public test::SeededTest, public ::testing::WithParamInterface<std::int32_t> {};
INSTANTIATE_TEST_SUITE_P(Groups, CpuCtkvr, ::testing::Values(1, 4));

TEST_P(CpuCtkvr, WholeListsGiveTheTopOfTheMiddleAtEveryStep) {
  SCOPED_TRACE(seed);
  const std::int32_t group = GetParam();
  CtkvrProblem p(rng, 2 * group, 2, 120, 16);
  const std::int32_t budget = 20;
  DecodeStep step(Selector(p.limits(), {.budget = budget, .list_size = p.middle(), .centroids = 6, .max_centroids = 6,
                                        .recalled_centroids = 6}),
                  p.config(), {});
  step.prepare(p.prefill(), {});
  // Lists never hold window tokens.
  const auto lists = step.selector().index_lists();
  for (std::int32_t g = 0; g < p.kv_heads; ++g) {
    for (std::int32_t l = 0; l < 6; ++l) {
      ASSERT_EQ(lists.count(0, g, l), p.middle());
      for (std::int32_t i = 0; i < lists.count(0, g, l); ++i) {
        const std::int32_t id = lists.list_ids(0, g, l)[i];
        EXPECT_TRUE(id >= kCtkvrWindow.sink && id < p.prompt - kCtkvrWindow.recent) << id;
      }
    }
  }
  // Ten steps: decoded tokens leave the recent window of 4 and the update replaces lists, all along.
  decode(p, step, rng, 10, [&](std::int32_t s, const std::vector<half>& q, const SelectionView& sel) {
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      const std::vector<std::int32_t> chosen(sel.row(0, g), sel.row(0, g) + sel.count(0, g));
      test::expect_top_k(chosen, test::middle_softmax(p, q, g), budget, 1e-5, fmt::format("step {} kv head {}", s, g));
    }
  });
}

TEST_P(CpuCtkvr, BudgetFractionFollowsTheLength) {
  SCOPED_TRACE(seed);
  const std::int32_t group = GetParam();
  // 10% of 121..126 tokens is 12; 20% is 24..25, cut to the budget of 20.
  for (const double fraction : {0.1, 0.2}) {
    CtkvrProblem p(rng, 2 * group, 2, 120, 16);
    DecodeStep step(Selector(p.limits(), {.budget = 20, .list_size = p.middle(), .centroids = 6, .max_centroids = 6,
                                          .recalled_centroids = 6, .budget_fraction = fraction}),
                    p.config(), {});
    step.prepare(p.prefill(), {});
    decode(p, step, rng, 6, [&](std::int32_t s, const std::vector<half>& q, const SelectionView& sel) {
      const auto k = std::min<std::int32_t>(std::int32_t(std::floor(fraction * p.length)), 20);
      for (std::int32_t g = 0; g < p.kv_heads; ++g) {
        const std::vector<std::int32_t> chosen(sel.row(0, g), sel.row(0, g) + sel.count(0, g));
        test::expect_top_k(chosen, test::middle_softmax(p, q, g), k, 1e-5,
                           fmt::format("fraction {} step {} kv head {}", fraction, s, g));
      }
    });
  }
}

// config.max_unindexed bounds the candidates: the selection stays the top of the middle while the decoded tokens
// past the index (one per step past the prompt's recent boundary) fit, the workspace shrinks, the capacity is C'
// lists plus the bound, and the step past the bound is refused by name before the index changes.
TEST_P(CpuCtkvr, MaxUnindexedBoundsTheCandidatesAndRefusesAStepPastIt) {
  SCOPED_TRACE(seed);
  const std::int32_t group = GetParam();
  CtkvrProblem p(rng, 2 * group, 2, 120, 16);
  const CtkvrConfig config{.budget = 20, .list_size = p.middle(), .centroids = 6, .max_centroids = 6,
                           .recalled_centroids = 6};
  CtkvrConfig bounded = config;
  bounded.max_unindexed = 5;
  DecodeStep step(Selector(p.limits(), bounded), p.config(), {});
  EXPECT_LT(step.workspace_bytes(), DecodeStep(Selector(p.limits(), config), p.config(), {}).workspace_bytes());
  EXPECT_EQ(step.selector().candidate_capacity(p.capacity), 6 * p.middle() + 5);
  EXPECT_EQ(step.selector().candidate_capacity(3), 6 * p.middle() + 3) << "a bound past max_seq_len takes max_seq_len";
  step.prepare(p.prefill(), {});
  decode(p, step, rng, 5, [&](std::int32_t s, const std::vector<half>& q, const SelectionView& sel) {
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      const std::vector<std::int32_t> chosen(sel.row(0, g), sel.row(0, g) + sel.count(0, g));
      test::expect_top_k(chosen, test::middle_softmax(p, q, g), 20, 1e-5, fmt::format("step {} kv head {}", s, g));
    }
  });
  const std::int32_t length = p.length;
  const auto no_check = [](std::int32_t, const std::vector<half>&, const SelectionView&) {};
  test::expect_error([&] { decode(p, step, rng, 1, no_check); },
                     fmt::format("sequence 0 (slot {}, length {}) holds 6 middle tokens past its index: more than "
                                 "config.max_unindexed (= 5)",
                                 p.slot, length + 1));
}

TEST_P(CpuCtkvr, UnionSizesCountTheRecalledListsDistinctIds) {
  SCOPED_TRACE(seed);
  const std::int32_t group = GetParam();
  CtkvrProblem p(rng, 2 * group, 2, 120, 16);
  const std::int32_t columns = 6, recalled = 2, list_size = 30;
  DecodeStep step(Selector(p.limits(), {.budget = 16, .list_size = list_size, .centroids = columns,
                                        .max_centroids = columns, .recalled_centroids = recalled,
                                        .dynamic_update = false}),
                  p.config(), {});
  step.prepare(p.prefill(), {});
  decode(p, step, rng, 4, [&](std::int32_t s, const std::vector<half>& q, const SelectionView&) {
    const auto centroids = step.selector().index_centroids();
    const auto lists = step.selector().index_lists();
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      // fp64: each column's cosine to the query, max over the group; the best `recalled` columns' lists.
      std::vector<std::pair<double, std::int32_t>> ranked;
      for (std::int32_t c = 0; c < columns; ++c) {
        double best = -2;
        for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
          double dot = 0, qq = 0, cc = 0;
          for (std::int32_t i = 0; i < p.head_dim; ++i) {
            const double x = to_float(q[std::size_t(h) * p.head_dim + i]), y = to_float(centroids.row(0, h, c)[i]);
            dot += x * y;
            qq += x * x;
            cc += y * y;
          }
          best = std::max(best, dot / std::sqrt(qq * cc));
        }
        ranked.emplace_back(-best, c);
      }
      std::sort(ranked.begin(), ranked.end());
      std::set<std::int32_t> distinct;
      for (std::int32_t r = 0; r < recalled; ++r) {
        const std::int32_t c = ranked[std::size_t(r)].second;
        for (std::int32_t i = 0; i < lists.count(0, g, c); ++i) {
          const std::int32_t id = lists.list_ids(0, g, c)[i];
          if (id >= kCtkvrWindow.sink_end(p.length) && id < kCtkvrWindow.recent_begin(p.length)) distinct.insert(id);
        }
      }
      EXPECT_EQ(step.selector().last_union_sizes()[g], std::int32_t(distinct.size())) << "step " << s << " kv head " << g;
      EXPECT_LE(std::int32_t(distinct.size()), recalled * list_size);
    }
  });
}

TEST_F(CpuCtkvr, AShortUnionGivesFewerIds) {
  SCOPED_TRACE(seed);
  CtkvrProblem p(rng, 4, 2, 100, 8);
  for (std::int32_t h = 0; h < p.q_heads; ++h) {  // every centroid the same query: every list the same
    for (std::int32_t t = 1; t < p.queries; ++t) {
      std::copy_n(p.prefill_q.begin() + std::size_t(h * p.queries) * p.head_dim, p.head_dim,
                  p.prefill_q.begin() + std::size_t(h * p.queries + t) * p.head_dim);
    }
  }
  DecodeStep step(Selector(p.limits(), {.budget = 16, .list_size = 8, .centroids = 4, .max_centroids = 4,
                                        .recalled_centroids = 2, .dynamic_update = false}),
                  p.config(), {});
  step.prepare(p.prefill(), {});
  decode(p, step, rng, 1, [&](std::int32_t, const std::vector<half>&, const SelectionView& sel) {
    // Union: the one list's 8 tokens and the token that left the recent window after prefill.
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      EXPECT_EQ(sel.count(0, g), 9);
      EXPECT_EQ(step.selector().last_union_sizes()[g], 8);
    }
  });
}

TEST_F(CpuCtkvr, DynamicUpdateStoresQueriesInFifoOrder) {
  SCOPED_TRACE(seed);
  CtkvrProblem p(rng, 4, 2, 100, 8);
  // Two prefill centroids in three columns: the first update fills the spare column, then the oldest go.
  DecodeStep step(Selector(p.limits(), {.budget = 8, .list_size = 8, .centroids = 2, .max_centroids = 3,
                                        .recalled_centroids = 2}),
                  p.config(), {});
  step.prepare(p.prefill(), {});
  EXPECT_EQ(step.selector().index_centroids().counts[0], 2);
  decode(p, step, rng, 5, [&](std::int32_t s, const std::vector<half>& q, const SelectionView&) {
    const auto centroids = step.selector().index_centroids();
    const std::int32_t column = (2 + s) % 3;
    EXPECT_EQ(centroids.counts[0], 3);
    EXPECT_EQ(step.selector().index_lists().cursors[0], (column + 1) % 3);
    for (std::int32_t h = 0; h < p.q_heads; ++h) {
      double norm = 0;
      for (std::int32_t i = 0; i < p.head_dim; ++i) norm += std::pow(to_float(q[std::size_t(h) * p.head_dim + i]), 2);
      for (std::int32_t i = 0; i < p.head_dim; ++i) {
        EXPECT_NEAR(to_float(centroids.row(0, h, column)[i]), to_float(q[std::size_t(h) * p.head_dim + i]) / std::sqrt(norm),
                    2e-3)
            << "step " << s << " head " << h;
      }
    }
    EXPECT_EQ(step.selector().index_lists().count(0, 0, column), 8);
  });
}

TEST_F(CpuCtkvr, PinnedPrefillCentroidsOutliveTheUpdates) {
  SCOPED_TRACE(seed);
  CtkvrProblem p(rng, 4, 2, 100, 8);
  // Two prefill centroids pinned in four columns: the updates cycle over columns 2 and 3 alone.
  DecodeStep step(Selector(p.limits(), {.budget = 8, .list_size = 8, .centroids = 2, .max_centroids = 4,
                                        .recalled_centroids = 2, .pin_prefill_centroids = true}),
                  p.config(), {});
  step.prepare(p.prefill(), {});
  const auto index = step.selector().index_centroids();
  const std::vector<half> centroids(index.data, index.data + QueryCentroidsView<half>::elements(1, p.q_heads, 4, p.head_dim));
  const auto lists = step.selector().index_lists();
  const std::vector<std::int32_t> ids(lists.ids, lists.ids + std::size_t(p.kv_heads) * 4 * 8);
  const std::vector<std::int32_t> counts(lists.counts, lists.counts + std::size_t(p.kv_heads) * 4);
  decode(p, step, rng, 7, [&](std::int32_t s, const std::vector<half>&, const SelectionView&) {
    const std::int32_t column = 2 + s % 2;
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      EXPECT_EQ(lists.cursors[g], column == 3 ? 2 : 3) << "step " << s;
      EXPECT_EQ(lists.count(0, g, column), 8);
      for (std::int32_t c = 0; c < 2; ++c) {  // the prefill's lists, unchanged
        const std::size_t l = std::size_t(g) * 4 + std::size_t(c);
        EXPECT_EQ(lists.counts[l], counts[l]);
        EXPECT_TRUE(std::equal(ids.begin() + l * 8, ids.begin() + l * 8 + counts[l], lists.ids + l * 8)) << c;
      }
    }
    for (std::int32_t h = 0; h < p.q_heads; ++h) {  // and the prefill's centroids
      for (std::int32_t c = 0; c < 2; ++c) {
        EXPECT_TRUE(test::same_bytes(std::vector<half>(index.row(0, h, c), index.row(0, h, c) + p.head_dim),
                                     std::vector<half>(centroids.begin() + (index.row(0, h, c) - index.data),
                                                       centroids.begin() + (index.row(0, h, c) - index.data) + p.head_dim)));
      }
    }
  });
}

TEST(CpuCtkvrIndex, IndexBytesCountCentroidsListsAndTheirState) {
  // The paper's shape at one slot: 32 query heads of 128 in half, 8 kv heads, 2048 columns of rho = 2560 ids.
  const Selector s({.max_slots = 1, .max_tokens = 131072, .q_heads = 32, .kv_heads = 8, .head_dim = 128},
                   {.budget = 1024});
  const std::size_t centroids = 32u * 2048 * 128 * sizeof(half), lists = 8u * 2048 * 2560 * 4;
  const std::size_t state = 4 * (1 + 8 * 2048 + 8 + 1 + 1);  // centroid count, list counts, cursors, FIFO start, boundary
  EXPECT_EQ(s.index_bytes().host, centroids + lists + state);
  EXPECT_EQ(s.index_bytes().device, 0u);
  EXPECT_EQ(centroids + lists + state, 184614956u);  // docs/ctkvr.md's index table
}

TEST_F(CpuCtkvr, BadConfigurationsAndPrefillsAreRefused) {
  CtkvrProblem p(rng, 4, 2, 100, 8);
  const SelectorLimits limits = p.limits();
  test::expect_error([&] { Selector(limits, {.budget = 0}); }, "config.budget (= 0) must be positive");
  test::expect_error([&] { Selector(limits, {.budget = 64, .list_size = 8, .recalled_centroids = 4}); },
                     "config.budget (rho' = 64) exceeds list_size * recalled_centroids (rho * C' = 8 * 4)");
  test::expect_error([&] { Selector(limits, {.budget = 8, .max_centroids = 4, .recalled_centroids = 5}); },
                     "config.recalled_centroids (C' = 5) is outside [1, max_centroids = 4]");
  test::expect_error([&] { Selector(limits, {.budget = 8, .centroids = 9, .max_centroids = 8}); },
                     "config.centroids (= 9) is outside [0, max_centroids = 8]");
  const auto prepare = [&](const CtkvrConfig& c) {
    DecodeStep step(Selector(limits, c), p.config(), {});
    step.prepare(p.prefill(), {});
  };
  test::expect_error([&] { prepare({.budget = 8, .list_size = 8, .centroids = 9, .max_centroids = 16}); },
                     "in.queries holds 8 queries per head; CTKVR needs the last C = 9");
  test::expect_error([&] { prepare({.budget = 8, .list_size = 8, .centroids = 2, .recalled_centroids = 3}); },
                     "config.recalled_centroids (C' = 3) exceeds the sequence's centroids (C = 2)");
  test::expect_error([&] { prepare({.budget = 8, .list_size = 93, .centroids = 2, .recalled_centroids = 1}); },
                     "config.list_size (rho = 93) is larger than sequence 0's middle (92 of its 100 tokens");
  test::expect_error([&] {
    prepare({.budget = 8, .list_size = 8, .centroids = 4, .max_centroids = 4, .pin_prefill_centroids = true});
  }, "config.pin_prefill_centroids leaves the dynamic update no column: sequence 0 has C = 4 centroids and "
     "config.max_centroids is 4");
  {  // a selection smaller than the budget
    Selector selector(limits, {.budget = 8, .list_size = 8, .centroids = 2, .recalled_centroids = 2});
    selector.prepare(p.prefill(), {});
    std::vector<std::int32_t> ids(2 * 7), counts(2);
    const std::vector<half> q(std::size_t(p.q_heads) * p.head_dim, half{});
    test::expect_error([&] {
      selector.select({.q = QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim), .cache = p.cache(),
                       .slots = &p.slot, .lengths = &p.length, .attention = {.window = kCtkvrWindow}},
                      SelectionView{ids.data(), counts.data(), nullptr, 1, p.kv_heads, 7}, {}, {});
    }, "out.capacity (= 7)");
  }
  test::expect_error([&] { Selector(limits, {.budget = 8, .budget_fraction = 1.5}); },
                     "config.budget_fraction (= 1.5) is outside [0, 1] (0: a fixed budget)");
  test::expect_error([&] { Selector(limits, {.budget = 8, .budget_fraction = -0.1}); },
                     "config.budget_fraction (= -0.1) is outside [0, 1]");
  test::expect_error([&] { Selector(limits, {.budget = 8, .max_unindexed = -1}); },
                     "config.max_unindexed (= -1) must not be negative (0: max_seq_len)");
}

}  // namespace
}  // namespace kvsift
