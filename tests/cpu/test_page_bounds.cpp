// Page bounds on the CPU (selectors/quest/cpu/page_bounds.hpp) against references written here from the raw keys: the bounds
// are the fp64 min and max of each page's keys, the scores fp64 sums of max(q * lo, q * hi) maxed over the
// GQA group, the windowed pages decided token by token, the expansion token by token. Slots are permuted
// (continuous batching), lengths ragged (0, partial last pages, full pages), caches contiguous and paged, in
// fp32, fp16 and bf16; every refused input has its message checked.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kvsift/selectors/quest/page_bounds_view.hpp"
#include "kvsift/selectors/quest/cpu/page_bounds.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "page_bounds_problem.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::kUntouched;
using test::Random;

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

/// page_bounds_problem.hpp's problem with an NHD paged cache and 3 unused slots by default.
template <class T>
struct Problem : test::PageBoundsProblem<T> {
  Problem(Random& rng, const std::vector<std::int32_t>& lens, std::int32_t kv_heads, std::int32_t head_dim,
          std::int32_t page_size, std::int32_t cache_page_size, std::int32_t extra_slots = 3)
      : test::PageBoundsProblem<T>(rng, lens, kv_heads, head_dim, page_size, cache_page_size, /*hnd=*/false,
                                   extra_slots) {}
};

/// Every bound of `bounds` against the min and max of the raw keys of the first lens[b] tokens of each row;
/// every other entry untouched.
template <class T>
void expect_bounds_of(const Problem<T>& p, const std::vector<T>& bounds, const std::vector<std::int32_t>& lens,
                      const std::string& what) {
  const std::int32_t d = p.kv.head_dim;
  const auto view = PageBoundsView<const T>::packed(bounds.data(), p.slot_count, p.kv.kv_heads, p.max_pages, d,
                                                    p.page_size);
  const auto keys = p.kv.view();
  std::int64_t mismatches = 0;
  for (std::int32_t s = 0; s < p.slot_count; ++s) {
    const std::int32_t b = p.row_of(s);
    for (std::int32_t h = 0; h < p.kv.kv_heads; ++h) {
      for (std::int32_t page = 0; page < p.max_pages; ++page) {
        const std::int32_t first = page * p.page_size, last = b < 0 ? 0 : std::min(lens[b], first + p.page_size);
        for (std::int32_t c = 0; c < d; ++c) {
          const T lo = view.lo(s, h, page)[c], hi = view.hi(s, h, page)[c];
          if (first >= last) {
            mismatches += !same_bits(lo, from_float<T>(kUntouched)) || !same_bits(hi, from_float<T>(kUntouched));
            continue;
          }
          double want_lo = INFINITY, want_hi = -INFINITY;
          for (std::int32_t t = first; t < last; ++t) {
            want_lo = std::min<double>(want_lo, keys.k_row(b, h, t)[c]);
            want_hi = std::max<double>(want_hi, keys.k_row(b, h, t)[c]);
          }
          mismatches += double(to_float(lo)) != want_lo || double(to_float(hi)) != want_hi;
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << what;
}

template <class T>
void check_build(Random& rng, bool paged, cpu::ThreadPool* pool) {
  const std::vector<std::int32_t> lens = {37, 0, 16, 1, 130, 48};
  for (std::int32_t page_size : {16, 5}) {
    Problem<T> p(rng, lens, 3, 24, page_size, 8);
    SCOPED_TRACE(testing::Message() << "page_size " << page_size << (paged ? " paged" : " contiguous"));
    if (paged) {
      cpu::build_page_bounds(p.paged_view(), p.slots.data(), p.view(), pool);
    } else {
      cpu::build_page_bounds(p.contiguous(), p.slots.data(), p.view(), pool);
    }
    expect_bounds_of(p, p.bounds, lens, "build");
  }
}

TEST(CpuPageBounds, BuildIsTheMinAndMaxOfEachPagesKeys) {
  Random rng(test::test_seed());
  cpu::ThreadPool pool(3);
  for (bool paged : {false, true}) {
    check_build<float>(rng, paged, nullptr);
    check_build<half>(rng, paged, &pool);
    check_build<bfloat16>(rng, paged, &pool);
  }
}

/// Grows every sequence one token per step (the cache already holds the token, as in a decode step) across
/// several page boundaries: after each append the bounds equal the reference of the grown lengths.
template <class T>
void check_append(Random& rng, bool paged) {
  const std::vector<std::int32_t> full = {40, 23, 31};
  const std::vector<std::int32_t> start = {13, 0, 16};  // mid-page, empty, a page just filled
  Problem<T> p(rng, full, 2, 16, 8, 4);
  std::vector<std::int32_t> lens = start;
  // The contiguous view reads lengths from kv.seq_lens; the paged one from its page table, rebuilt per step.
  p.kv.seq_lens = lens;
  cpu::build_page_bounds(p.contiguous(), p.slots.data(), p.view());
  for (int step = 0; step < 24; ++step) {
    for (std::size_t b = 0; b < lens.size(); ++b) lens[b] = std::min(full[b], lens[b] + 1);
    p.kv.seq_lens = lens;
    if (paged) {
      std::vector<std::int32_t> last_len(lens.size()), indptr = p.paged.indptr;
      auto view = p.paged_view();
      // Same pages, fewer tokens in use: page counts and last-page lengths of the grown lengths.
      for (std::size_t b = 0; b < lens.size(); ++b) {
        const std::int32_t pages = std::int32_t(detail::page_count(lens[b], view.page_size));
        indptr[b + 1] = indptr[b] + pages;
        last_len[b] = pages == 0 ? 0 : lens[b] - (pages - 1) * view.page_size;
      }
      std::vector<std::int32_t> indices;
      for (std::size_t b = 0; b < lens.size(); ++b) {
        const std::int32_t pages = indptr[b + 1] - indptr[b];
        indices.insert(indices.end(), p.paged.indices.begin() + p.paged.indptr[b],
                       p.paged.indices.begin() + p.paged.indptr[b] + pages);
      }
      view.page_indptr = indptr.data();
      view.page_indices = indices.data();
      view.last_page_len = last_len.data();
      cpu::append_page_bounds(view, p.slots.data(), p.view());
    } else {
      cpu::append_page_bounds(p.contiguous(), p.slots.data(), p.view());
    }
    expect_bounds_of(p, p.bounds, lens, "append step " + std::to_string(step));
  }
}

TEST(CpuPageBounds, AppendFoldsTheStepsTokenAcrossPageBoundaries) {
  Random rng(test::test_seed());
  for (bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "contiguous");
    check_append<float>(rng, paged);
    check_append<half>(rng, paged);
    check_append<bfloat16>(rng, paged);
  }
}

/// Page scores against fp64: for group sizes 1, 4 and 8, with and without windows, ragged lengths.
template <class T>
void check_scores(Random& rng, std::int32_t group, const AttentionWindow& window, cpu::ThreadPool* pool) {
  const std::vector<std::int32_t> lens = {0, 1, 50, 64, 17, 100};
  const std::int32_t kv_heads = 2, d = 32, ps = 8, batch = std::int32_t(lens.size());
  Problem<T> p(rng, lens, kv_heads, d, ps, 16);
  cpu::build_page_bounds(p.contiguous(), p.slots.data(), p.view(), pool);
  const std::int32_t q_heads = kv_heads * group;
  auto q_f = rng.normal(std::size_t(batch) * q_heads * d);
  for (float& x : q_f) x = to_float(from_float<T>(x));
  const auto q_t = test::to_storage<T>(q_f);
  const std::int32_t cols = p.max_pages + 2;
  std::vector<float> scores(std::size_t(batch) * kv_heads * cols, kUntouched);
  std::vector<std::int32_t> counts(batch, test::kPoisonIndex);
  cpu::page_scores(QueryView<const T>::packed(q_t.data(), batch, q_heads, d), p.view().as_const(), p.slots.data(),
                   p.kv.seq_lens.data(), window, MatrixView<float>::packed(scores.data(), batch * kv_heads, cols),
                   counts.data(), pool);
  const auto keys = p.kv.view();
  for (std::int32_t b = 0; b < batch; ++b) {
    const std::int32_t len = lens[b], pages = (len + ps - 1) / ps;
    ASSERT_EQ(counts[b], pages) << "batch " << b;
    for (std::int32_t g = 0; g < kv_heads; ++g) {
      const float* row = scores.data() + (std::size_t(b) * kv_heads + g) * cols;
      for (std::int32_t page = 0; page < cols; ++page) {
        SCOPED_TRACE(testing::Message() << "batch " << b << " kv head " << g << " page " << page);
        if (page >= pages) {
          EXPECT_EQ(row[page], kUntouched);
          continue;
        }
        const std::int32_t first = page * ps, last = std::min(len, first + ps);
        bool all_window = true;
        for (std::int32_t t = first; t < last; ++t) all_window &= t < window.sink || t >= len - window.recent;
        if (all_window) {
          EXPECT_EQ(row[page], -INFINITY);
          continue;
        }
        double want = -INFINITY, scale = 0;
        for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qh = q_f.data() + (std::size_t(b) * q_heads + h) * d;
          double sum = 0, abs_sum = 0;
          for (std::int32_t c = 0; c < d; ++c) {
            double lo = INFINITY, hi = -INFINITY;
            for (std::int32_t t = first; t < last; ++t) {
              lo = std::min<double>(lo, keys.k_row(b, g, t)[c]);
              hi = std::max<double>(hi, keys.k_row(b, g, t)[c]);
            }
            sum += std::max(qh[c] * lo, qh[c] * hi);
            abs_sum += std::abs(qh[c]) * std::max(std::abs(lo), std::abs(hi));
          }
          want = std::max(want, sum);
          scale = std::max(scale, abs_sum);
        }
        // fp32 products and a d-term fp32 sum: d roundings of at most 2^-24 of the running magnitude.
        EXPECT_NEAR(row[page], want, d * 0x1p-24 * scale + 1e-30);
      }
    }
  }
}

TEST(CpuPageBounds, ScoresAreTheGroupsLargestBoundOutsideTheWindow) {
  Random rng(test::test_seed());
  cpu::ThreadPool pool(2);
  for (std::int32_t group : {1, 4, 8}) {
    for (const AttentionWindow window : {AttentionWindow{}, AttentionWindow{4, 20}, AttentionWindow{9, 0},
                                         AttentionWindow{0, 8}, AttentionWindow{60, 60}}) {
      SCOPED_TRACE(testing::Message() << "group " << group << " window " << window.sink << "+" << window.recent);
      check_scores<float>(rng, group, window, nullptr);
      check_scores<half>(rng, group, window, &pool);
      check_scores<bfloat16>(rng, group, window, &pool);
    }
  }
}

TEST(CpuPageBounds, NanInTheQueryOrAKeyGivesNanScores) {
  Random rng(test::test_seed());
  const std::int32_t kv_heads = 2, group = 2, d = 16, ps = 4;
  Problem<float> p(rng, {20, 20}, kv_heads, d, ps, 4, 0);
  // A NaN key in row 1, kv head 0, token 9 (page 2).
  const_cast<float*>(p.kv.view().k_row(1, 0, 9))[3] = NAN;
  p.k = test::to_storage<float>(p.kv.k);
  cpu::build_page_bounds(p.contiguous(), p.slots.data(), p.view());
  auto q = rng.normal(std::size_t(2) * kv_heads * group * d);
  q[std::size_t(0 * kv_heads * group + 3) * d + 5] = NAN;  // row 0, query head 3 (kv head 1)
  std::vector<float> scores(std::size_t(2) * kv_heads * 5);
  std::vector<std::int32_t> counts(2);
  const AttentionWindow window{4, 0};  // page 0 is all window: -inf whatever its score
  cpu::page_scores(QueryView<const float>::packed(q.data(), 2, kv_heads * group, d), p.view().as_const(),
                   p.slots.data(), p.kv.seq_lens.data(), window, MatrixView<float>::packed(scores.data(), 4, 5),
                   counts.data());
  for (std::int32_t row = 0; row < 4; ++row) {
    for (std::int32_t page = 0; page < 5; ++page) {
      const float s = scores[std::size_t(row) * 5 + page];
      const bool nan = page > 0 && (row == 1 || (row == 2 && page == 2));
      SCOPED_TRACE(testing::Message() << "row " << row << " page " << page);
      if (page == 0) EXPECT_EQ(s, -INFINITY);
      else EXPECT_EQ(std::isnan(s), nan) << s;
    }
  }
}

/// Expansion against a token-by-token reference, with and without log-weights.
TEST(CpuPageBounds, ExpandListsThePagesTokensOutsideTheWindow) {
  Random rng(test::test_seed());
  cpu::ThreadPool pool(2);
  const std::int32_t batch = 4, kv_heads = 3, cap_pages = 6, ps = 8;
  const std::vector<std::int32_t> lens = {0, 7, 45, 64};
  for (const AttentionWindow window : {AttentionWindow{}, AttentionWindow{3, 10}, AttentionWindow{0, 17}}) {
    for (bool weights : {false, true}) {
      const test::HostSelection pages = test::random_pages(rng, lens, kv_heads, cap_pages, ps);
      test::HostSelection out(batch, kv_heads, cap_pages * ps + 1, weights);
      cpu::expand_pages(pages.view, ps, lens.data(), window, out.view, &pool);
      for (std::int32_t b = 0; b < batch; ++b) {
        for (std::int32_t g = 0; g < kv_heads; ++g) {
          std::vector<std::int32_t> want;
          for (std::int32_t i = 0; i < pages.view.count(b, g); ++i) {
            for (std::int32_t t = pages.view.row(b, g)[i] * ps; t < (pages.view.row(b, g)[i] + 1) * ps; ++t) {
              if (t < lens[b] && t >= window.sink && t < lens[b] - window.recent) want.push_back(t);
            }
          }
          const std::int32_t n = out.view.count(b, g);
          ASSERT_EQ(std::vector<std::int32_t>(out.view.row(b, g), out.view.row(b, g) + n), want) << b << " " << g;
          EXPECT_EQ(out.view.row(b, g)[n], test::kPoisonIndex);
          if (weights) {
            for (std::int32_t i = 0; i < n; ++i) EXPECT_EQ(out.view.weights_row(b, g)[i], 0.0f);
            EXPECT_TRUE(std::isnan(out.view.weights_row(b, g)[n]));
          }
        }
      }
    }
  }
}

// quest_page_size: the preferred size halved until the budget holds kQuestMinPages pages (values worked out by hand),
// and over a range: a power-of-two fraction of the preferred size, at least 16 pages or a page of one token, and never
// halved past what 16 pages need.
TEST(QuestPageSize, SmallBudgetsGetFinerPagesNotFewer) {
  const struct {
    std::int32_t budget, preferred, page_size;
  } cases[] = {{1, 16, 1}, {14, 16, 1}, {31, 16, 1}, {32, 16, 2}, {35, 16, 2}, {64, 16, 4}, {128, 16, 8},
               {255, 16, 8}, {256, 16, 16}, {1980, 16, 16}, {100, 12, 6}, {192, 12, 12}, {5, 1, 1}};
  for (const auto& c : cases) EXPECT_EQ(quest_page_size(c.budget, c.preferred), c.page_size) << c.budget;
  for (std::int32_t budget = 1; budget <= 4096; ++budget) {
    const std::int32_t p = quest_page_size(budget);
    ASSERT_TRUE(p >= 1 && p <= 16 && 16 % p == 0) << budget;
    ASSERT_TRUE(p == 1 || budget >= kQuestMinPages * p) << budget;
    ASSERT_TRUE(p == 16 || budget < kQuestMinPages * 2 * p) << budget;
  }
  test::expect_error([] { quest_page_size(0); }, "quest_page_size: budget (= 0) must be >= 1");
  test::expect_error([] { quest_page_size(10, 0); }, "quest_page_size: preferred (= 0) must be >= 1");
}

TEST(CpuPageBoundsBadInput, UpdatesRefuseBadShapesSlotsAndLengths) {
  Random rng(test::test_seed());
  Problem<float> p(rng, {10, 20}, 2, 16, 4, 4, 1);
  const auto kv = p.contiguous();
  const auto build = [&](const PageBoundsView<float>& bounds, const std::int32_t* slots) {
    cpu::build_page_bounds(kv, slots, bounds);
  };
  const auto good = p.view();
  std::int32_t bad_slot[] = {0, 3}, repeated[] = {1, 1};
  test::expect_error([&] { build(good, nullptr); }, {"cpu::build_page_bounds", "slots is a null pointer"});
  test::expect_error([&] { build(good, bad_slot); }, "slots[1] (= 3) is outside [0, bounds.slots = 3)");
  test::expect_error([&] { cpu::append_page_bounds(kv, bad_slot, good); },
                     {"cpu::append_page_bounds", "slots[1] (= 3) is outside [0, bounds.slots = 3)"});
  test::expect_error([&] { build(good, repeated); }, "slots[1] (= 1) repeats slots[0]");
  auto bounds = good;
  bounds.data = nullptr;
  test::expect_error([&] { build(bounds, p.slots.data()); }, "bounds.data is a null pointer");
  bounds = good;
  bounds.data = good.data + 1;
  test::expect_error([&] { build(bounds, p.slots.data()); }, "is not 16-byte aligned");
  using Field = std::int32_t PageBoundsView<float>::*;
  const std::pair<Field, const char*> fields[] = {
      {&PageBoundsView<float>::slots, "slots"}, {&PageBoundsView<float>::max_pages, "max_pages"},
      {&PageBoundsView<float>::page_size, "page_size"}};
  for (const auto& [field, name] : fields) {
    bounds = good;
    bounds.*field = 0;
    test::expect_error([&] { build(bounds, p.slots.data()); }, fmt::format("bounds.{} (= 0) must be positive", name));
  }
  bounds = good;
  bounds.kv_heads = 3;
  test::expect_error([&] { build(bounds, p.slots.data()); }, "kv.kv_heads (= 2) != bounds.kv_heads (= 3)");
  bounds = good;
  bounds.head_dim = 8;
  test::expect_error([&] { build(bounds, p.slots.data()); }, "kv.head_dim (= 16) != bounds.head_dim (= 8)");
  bounds = good;
  bounds.max_pages = 4;  // 16 tokens: row 1 holds 20
  test::expect_error([&] { build(bounds, p.slots.data()); },
                     "kv.seq_len(1) (= 20) exceeds the tokens bounds.max_pages * page_size (= 4 * 4) covers");
  bounds = good;
  bounds.slots = INT32_MAX;
  bounds.max_pages = 1 << 28;
  test::expect_error([&] { build(bounds, p.slots.data()); }, "has more than 2^62 elements");
  bounds = good;
  bounds.max_pages = 1 << 30;
  test::expect_error([&] { build(bounds, p.slots.data()); }, "bounds.max_pages * page_size (= 1073741824 * 4) exceeds");
  auto short_kv = kv;
  short_kv.batch = 0;
  test::expect_error([&] { cpu::build_page_bounds(short_kv, p.slots.data(), good); }, "kv.batch (= 0) must be positive");
}

TEST(CpuPageBoundsBadInput, ScoresRefuseBadShapesSlotsAndLengths) {
  const std::int32_t d = 16;
  alignas(16) static float bounds_data[2 * 2 * 4 * 2 * d];
  const auto bounds = PageBoundsView<const float>::packed(bounds_data, 2, 2, 4, d, 8);
  std::vector<float> q(2 * 4 * d), scores(4 * 4);
  std::int32_t slots[] = {0, 1}, lens[] = {32, 0}, counts[2];
  const auto run = [&](std::int32_t q_heads, std::int32_t q_dim, std::int64_t rows, std::int32_t cols,
                       const std::int32_t* s, const std::int32_t* l, std::int32_t* c, AttentionWindow w = {}) {
    cpu::page_scores(QueryView<const float>::packed(q.data(), 2, q_heads, q_dim), bounds, s, l, w,
                     MatrixView<float>::packed(scores.data(), rows, cols), c);
  };
  test::expect_error([&] { run(4, 8, 4, 4, slots, lens, counts); },
                     {"cpu::page_scores", "q.head_dim (= 8) != bounds.head_dim (= 16)"});
  test::expect_error([&] { run(3, d, 4, 4, slots, lens, counts); }, "q.heads (= 3) is not a multiple of bounds.kv_heads (= 2)");
  test::expect_error([&] { run(4, d, 3, 4, slots, lens, counts); }, "scores.rows (= 3) != q.batch * bounds.kv_heads (= 2 * 2)");
  test::expect_error([&] { run(4, d, 4, 4, nullptr, lens, counts); }, "slots is a null pointer");
  test::expect_error([&] { run(4, d, 4, 4, slots, nullptr, counts); }, "lengths is a null pointer");
  test::expect_error([&] { run(4, d, 4, 4, slots, lens, nullptr); }, "page_counts is a null pointer");
  test::expect_error([&] { run(4, d, 4, 4, slots, lens, counts, {-1, 0}); }, "window.sink (= -1) and window.recent (= 0) must be >= 0");
  std::int32_t far_slot[] = {2, 0};
  test::expect_error([&] { run(4, d, 4, 4, far_slot, lens, counts); }, "slots[0] (= 2) is outside [0, bounds.slots = 2)");
  std::int32_t long_len[] = {33, 0}, negative_len[] = {0, -1};
  test::expect_error([&] { run(4, d, 4, 4, slots, long_len, counts); },
                     "lengths[0] (= 33) is outside [0, bounds.max_pages * page_size = 32]");
  test::expect_error([&] { run(4, d, 4, 4, slots, negative_len, counts); }, "lengths[1] (= -1) is outside");
  test::expect_error([&] { run(4, d, 4, 3, slots, lens, counts); }, "lengths[0] (= 32) has 4 pages, more than scores.cols (= 3)");
}

TEST(CpuPageBoundsBadInput, ExpandRefusesBadShapesCountsAndPageIds) {
  test::HostSelection pages(2, 2, 3, false), out(2, 2, 3 * 4, false);
  std::fill(pages.counts.begin(), pages.counts.end(), 1);
  std::fill(pages.indices.begin(), pages.indices.end(), 0);
  std::int32_t lens[] = {10, 10};
  const auto run = [&](const SelectionView& in, std::int32_t ps, const std::int32_t* l, const SelectionView& o,
                       AttentionWindow w = {}) { cpu::expand_pages(in, ps, l, w, o); };
  run(pages.view, 4, lens, out.view);  // the baseline is accepted
  auto small = out.view;
  small.capacity = 11;
  test::expect_error([&] { run(pages.view, 4, lens, small); },
                     {"cpu::expand_pages", "out.capacity (= 11) < pages.capacity * page_size (= 3 * 4)"});
  auto other = out.view;
  other.kv_heads = 1;
  test::expect_error([&] { run(pages.view, 4, lens, other); }, "out is [batch = 2, kv_heads = 1], pages [batch = 2, kv_heads = 2]");
  test::expect_error([&] { run(pages.view, 0, lens, out.view); }, "page_size (= 0) must be positive");
  test::expect_error([&] { run(pages.view, 4, nullptr, out.view); }, "lengths is a null pointer");
  test::expect_error([&] { run(pages.view, 4, lens, out.view, {0, -2}); }, "window.recent (= -2) must be >= 0");
  std::int32_t negative[] = {10, -1};
  test::expect_error([&] { run(pages.view, 4, negative, out.view); }, "lengths[1] (= -1) is negative");
  pages.counts[3] = 4;
  test::expect_error([&] { run(pages.view, 4, lens, out.view); },
                     "pages.counts (= 4) at batch 1, kv_head 1 is outside [0, capacity = 3]");
  pages.counts[3] = 1;
  pages.indices[2 * 3] = 3;  // batch 1, kv head 0: 10 tokens have pages 0..2
  test::expect_error([&] { run(pages.view, 4, lens, out.view); },
                     "pages.indices[0] (= 3) at batch 1, kv_head 0 is outside [0, pages of lengths[1] = 3)");
  pages.indices[2 * 3] = 1;
  pages.counts[2] = 2;
  pages.indices[2 * 3 + 1] = 1;
  test::expect_error([&] { run(pages.view, 4, lens, out.view); },
                     "pages.indices[1] (= 1) at batch 1, kv_head 0 does not exceed pages.indices[0] (= 1)");
}

}  // namespace
}  // namespace kvsift
