// StreamingLLM and Quest, the reference selectors of the fidelity harness: exact selections against
// independent brute force, the Quest bound, and refused bad inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "kvsift/selectors/oracle_topk.hpp"
#include "kvsift/selectors/quest.hpp"
#include "kvsift/selectors/streaming_llm.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::HostSelection;

struct Problem {
  std::uint64_t seed = test::test_seed();
  test::Random rng{seed};
  std::int32_t batch = 2, q_heads = 6, kv_heads = 2, n = 203, d = 32;
  test::HostKV kv{rng, batch, kv_heads, n, d, {203, 150}};
  std::vector<float> prefill_q = rng.normal(std::size_t(batch) * q_heads * n * d);
  std::vector<float> q = rng.normal(std::size_t(batch) * q_heads * d);
  PrefillInputs<float> prefill() const {
    return {SequenceView<const float>::packed(prefill_q.data(), batch, q_heads, n, d), kv.view()};
  }
  QueryView<const float> query() const { return QueryView<const float>::packed(q.data(), batch, q_heads, d); }
};

std::vector<std::int32_t> row_of(const HostSelection& sel, std::int32_t r) {
  const auto* first = sel.indices.data() + std::size_t(r) * sel.view.capacity;
  return {first, first + sel.counts[r]};
}

TEST(StreamingLLM, KeepsTheSinkAndTheMostRecentTokens) {
  Problem p;
  SCOPED_TRACE(testing::Message() << "seed " << p.seed);
  StreamingLLM selector({.budget = 40, .sink = 4});
  selector.prepare(p.prefill());
  HostSelection sel(p.batch, p.kv_heads, 40, true);
  selector.select(p.query(), sel.view);
  for (std::int32_t b = 0; b < p.batch; ++b) {
    std::vector<std::int32_t> expected = {0, 1, 2, 3};
    for (std::int32_t t = p.kv.seq_lens[b] - 36; t < p.kv.seq_lens[b]; ++t) expected.push_back(t);
    for (std::int32_t g = 0; g < p.kv_heads; ++g) EXPECT_EQ(row_of(sel, b * p.kv_heads + g), expected);
  }
  // After two appended tokens the window moves with the sequence; a sequence shorter than the budget
  // selects all its tokens.
  const auto token = p.rng.normal(std::size_t(p.batch) * p.kv_heads * p.d);
  const auto step = AppendInputs<float>{HeadsView<const float>::packed(token.data(), p.batch, p.kv_heads, p.d),
                                        HeadsView<const float>::packed(token.data(), p.batch, p.kv_heads, p.d),
                                        p.query()};
  selector.append(step);
  selector.append(step);
  selector.select(p.query(), sel.view);
  EXPECT_EQ(row_of(sel, 0).back(), 204);
  EXPECT_EQ(row_of(sel, 0)[4], 205 - 36);
  StreamingLLM wide({.budget = 400, .sink = 4});
  wide.prepare(p.prefill());
  HostSelection all(p.batch, p.kv_heads, 400, false);
  wide.select(p.query(), all.view);
  std::vector<std::int32_t> every(150);
  std::iota(every.begin(), every.end(), 0);
  EXPECT_EQ(row_of(all, 2), every);
}

TEST(Quest, SelectsTheBestPagesByAnUpperBoundOfTheirScores) {
  Problem p;
  SCOPED_TRACE(testing::Message() << "seed " << p.seed);
  constexpr std::int32_t kPage = 16, kBudget = 70;  // 4 whole pages
  Quest selector({.budget = kBudget, .page_size = kPage});
  selector.prepare(p.prefill());
  HostSelection sel(p.batch, p.kv_heads, kBudget, true);
  selector.select(p.query(), sel.view);
  const std::int32_t group = p.q_heads / p.kv_heads;
  for (std::int32_t b = 0; b < p.batch; ++b) {
    const std::int32_t n = p.kv.seq_lens[b], pages = (n + kPage - 1) / kPage;
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      // Brute force, in fp64: each page's bound from its keys, and that no key's dot product exceeds it.
      std::vector<std::pair<double, std::int32_t>> ranked;
      for (std::int32_t page = 0; page < pages; ++page) {
        double bound = -INFINITY;
        for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qh = p.q.data() + (std::size_t(b) * p.q_heads + h) * p.d;
          double page_bound = 0.0, best_dot = -INFINITY;
          for (std::int32_t c = 0; c < p.d; ++c) {
            double lo = INFINITY, hi = -INFINITY;
            for (std::int32_t t = page * kPage; t < std::min(n, (page + 1) * kPage); ++t) {
              lo = std::min<double>(lo, p.kv.view().k_row(b, g, t)[c]);
              hi = std::max<double>(hi, p.kv.view().k_row(b, g, t)[c]);
            }
            page_bound += std::max(qh[c] * lo, qh[c] * hi);
          }
          for (std::int32_t t = page * kPage; t < std::min(n, (page + 1) * kPage); ++t) {
            double dot = 0.0;
            for (std::int32_t c = 0; c < p.d; ++c) dot += double(qh[c]) * p.kv.view().k_row(b, g, t)[c];
            best_dot = std::max(best_dot, dot);
          }
          EXPECT_LE(best_dot, page_bound + 1e-4);
          bound = std::max(bound, page_bound);
        }
        ranked.push_back({-bound, page});
      }
      std::sort(ranked.begin(), ranked.end());
      std::set<std::int32_t> expected;
      for (std::int32_t i = 0; i < kBudget / kPage; ++i) {
        for (std::int32_t t = ranked[i].second * kPage; t < std::min(n, (ranked[i].second + 1) * kPage); ++t) expected.insert(t);
      }
      const auto got = row_of(sel, b * p.kv_heads + g);
      EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
      EXPECT_EQ(std::set<std::int32_t>(got.begin(), got.end()), expected) << "batch " << b << " kv head " << g;
      for (std::int32_t i = 0; i < sel.counts[b * p.kv_heads + g]; ++i) {
        EXPECT_EQ(sel.log_weights[std::size_t(b * p.kv_heads + g) * kBudget + i], 0.0f);
      }
    }
  }
}

TEST(Quest, AppendedTokensWidenTheLastPage) {
  Problem p;
  SCOPED_TRACE(testing::Message() << "seed " << p.seed);
  // A key far larger than every other, appended to sequence 1 (length 150, page 9 partly filled), puts its
  // page first for a query aligned with it.
  Quest selector({.budget = 16, .page_size = 16});
  selector.prepare(p.prefill());
  std::vector<float> token(std::size_t(p.batch) * p.kv_heads * p.d, 0.01f);
  std::fill_n(token.begin() + std::size_t(1 * p.kv_heads + 0) * p.d, p.d, 100.0f);
  selector.append({HeadsView<const float>::packed(token.data(), p.batch, p.kv_heads, p.d),
                   HeadsView<const float>::packed(token.data(), p.batch, p.kv_heads, p.d), p.query()});
  std::vector<float> q(p.q.size(), 1.0f);
  HostSelection sel(p.batch, p.kv_heads, 16, false);
  selector.select(QueryView<const float>::packed(q.data(), p.batch, p.q_heads, p.d), sel.view);
  std::vector<std::int32_t> last_page(151 - 144);
  std::iota(last_page.begin(), last_page.end(), 144);
  EXPECT_EQ(row_of(sel, 1 * p.kv_heads + 0), last_page);
}

TEST(ReferenceSelectorsBadInput, AreRefused) {
  using test::expect_error;
  Problem p;
  expect_error([] { StreamingLLM({.budget = 0}); }, "config.budget (= 0) must be positive");
  expect_error([] { StreamingLLM({.budget = 8, .sink = 9}); }, "config.sink (= 9) is outside [0, budget = 8]");
  expect_error([] { Quest({.budget = 10, .page_size = 16}); }, "config.budget (= 10) is smaller than one page (page_size = 16)");
  expect_error([] { Quest({.budget = 10, .page_size = 0}); }, "config.page_size (= 0) must be positive");
  Quest quest({.budget = 32});
  HostSelection small(p.batch, p.kv_heads, 31, false), right(p.batch, p.kv_heads, 32, false);
  expect_error([&] { quest.select(p.query(), right.view); }, "Quest::select: prepare() has not been called");
  quest.prepare(p.prefill());
  expect_error([&] { quest.select(p.query(), small.view); }, "out.capacity (= 31) is smaller than budget (= 32)");
  const auto odd_q = QueryView<const float>::packed(p.q.data(), p.batch, 5, p.d);
  expect_error([&] { quest.select(odd_q, right.view); }, "q.heads (= 5) is not a multiple of kv_heads (= 2)");
  std::vector<float> token(std::size_t(p.batch) * 3 * p.d, 1.0f);
  const auto wrong = HeadsView<const float>::packed(token.data(), p.batch, 3, p.d);
  expect_error([&] { quest.append({wrong, wrong, p.query()}); }, "k shape [2, 3, 32] != prepared [batch = 2, kv_heads = 2, head_dim = 32]");
  std::vector<float> fine(std::size_t(p.batch) * p.kv_heads * p.d, 1.0f);
  const auto right_kv = HeadsView<const float>::packed(fine.data(), p.batch, p.kv_heads, p.d);
  const auto narrow_v = HeadsView<const float>::packed(fine.data(), p.batch, p.kv_heads, p.d / 2);
  expect_error([&] { quest.append({right_kv, narrow_v, p.query()}); },
               "v shape [2, 2, 16] != prepared [batch = 2, kv_heads = 2, head_dim = 32]");
  expect_error([&] { quest.append({right_kv, right_kv, odd_q}); },
               "q shape [2, 5, 32] does not fit prepared [batch = 2, kv_heads = 2, head_dim = 32]");
  expect_error([&] { quest.append({right_kv, right_kv, QueryView<const float>{}}); }, "q.data is a null pointer");
  expect_error([&] { OracleTopK({.budget = 4}).append({right_kv, right_kv, p.query()}); },
               "OracleTopK::append: prepare() has not been called");
}

}  // namespace
}  // namespace kvsift
