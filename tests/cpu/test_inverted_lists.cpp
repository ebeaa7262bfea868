// Inverted lists on the CPU (cpu/inverted_lists.hpp) against references written from the contracts: the union
// is the std::set of kept ids (inverted_lists_problem.hpp, shared with the workspace tests), replace a plain FIFO.
// Ragged lengths (0 included), windows, empty and full lists, ids repeated across lists and outside the sequence,
// lists chosen twice, permuted slots, fp32 and fp16 scores, with and without a pool; every refusal has its message
// checked.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <vector>

#include "inverted_lists_problem.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/inverted_lists.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::ListsProblem;
using test::Random;
using test::reference_union;

/// A 256-byte aligned host workspace.
struct Workspace {
  explicit Workspace(std::size_t bytes) : storage(bytes) {}
  std::span<std::byte> span() { return storage.bytes(); }
  cpu::Array<std::byte> storage;
};

template <class T>
void check_union(Random& rng, bool weights, cpu::ThreadPool* pool) {
  SCOPED_TRACE(testing::Message() << (weights ? "weights" : "") << (pool ? " pool" : ""));
  ListsProblem<T> p(rng, 4, 2, 7, 9, 4, 40);
  const std::int32_t capacity = p.chosen.view.capacity * p.list_capacity + rng.uniform_int(0, 3);
  test::HostSelection out(p.batch, p.kv_heads, capacity, weights);
  Workspace ws(cpu::list_reduction_workspace_bytes(std::int64_t(p.batch) * p.kv_heads, p.chosen.view.capacity,
                                                   p.list_capacity, pool));
  cpu::union_lists(p.view().as_const(), p.chosen.view, p.slots.data(), p.lengths.data(), p.window, out.view,
                   ws.span(), pool);
  const auto expected = reference_union(p);
  for (std::size_t r = 0; r < expected.size(); ++r) {
    ASSERT_EQ(out.counts[r], std::int32_t(expected[r].size())) << "row " << r;
    std::int32_t i = 0;
    for (const std::int32_t id : expected[r]) {  // ascending, as the union is written
      const std::size_t at = r * capacity + i++;
      EXPECT_EQ(out.indices[at], id) << "row " << r;
      if (weights) {
        EXPECT_EQ(out.log_weights[at], 0.0f);
      }
    }
    for (std::int32_t j = i; j < capacity; ++j) {
      EXPECT_EQ(out.indices[r * capacity + j], test::kPoisonIndex) << "written past the count";
    }
  }
}

/// UnionAppend's result written from the contracts: per row the union's ids (the set reference over p.chosen) below
/// the range [max(first[slot], sink_end), recent_begin), then the range; counts_before the union's sizes.
template <class T>
void expect_union_then_append(const ListsProblem<T>& p, const std::vector<std::int32_t>& first,
                              const std::vector<std::int32_t>& counts_before, const test::HostSelection& out) {
  const auto expected = reference_union(p);
  const auto capacity = std::int64_t(out.view.capacity);
  for (std::size_t r = 0; r < expected.size(); ++r) {
    const std::size_t b = r / std::size_t(p.kv_heads);
    const std::int32_t length = p.lengths[b];
    const std::int32_t begin = std::max(first[std::size_t(p.slots[b])], p.window.sink_end(length));
    std::vector<std::int32_t> want;
    for (const std::int32_t id : expected[r]) {
      if (id < begin) want.push_back(id);
    }
    for (std::int32_t t = begin; t < p.window.recent_begin(length); ++t) want.push_back(t);
    EXPECT_EQ(counts_before[r], std::int32_t(expected[r].size())) << "row " << r;
    ASSERT_EQ(out.counts[r], std::int32_t(want.size())) << "row " << r;
    EXPECT_EQ(std::vector<std::int32_t>(out.indices.begin() + std::int64_t(r) * capacity,
                                        out.indices.begin() + std::int64_t(r) * capacity + std::int64_t(want.size())),
              want)
        << "row " << r;
  }
}

class InvertedLists : public test::SeededTest {};

TEST_F(InvertedLists, UnionMatchesSetReference) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(3);
  for (int repeat = 0; repeat < 20; ++repeat) {
    for (cpu::ThreadPool* pl : {static_cast<cpu::ThreadPool*>(nullptr), &pool}) {
      check_union<float>(rng, repeat % 2 == 0, pl);
      check_union<half>(rng, repeat % 2 == 1, pl);
    }
  }
}

// UnionAppend: the union, then each slot's middle tokens from first[slot] on after the union's ids below them
// (append_range's contract), counts_before the union's sizes; a row that would pass the capacity is refused.
TEST_F(InvertedLists, UnionWithAnAppendKeepsTheIdsBelowTheRangeThenTheRange) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (int repeat = 0; repeat < 20; ++repeat) {
    ListsProblem<float> p(rng, 4, 2, 7, 9, 4, 40);
    const std::int32_t capacity = p.chosen.view.capacity * p.list_capacity + 40;
    std::vector<std::int32_t> first(std::size_t(p.slot_count));
    for (auto& f : first) f = rng.uniform_int(0, 42);
    test::HostSelection out(p.batch, p.kv_heads, capacity, true);
    std::vector<std::int32_t> counts_before(std::size_t(p.batch) * p.kv_heads, -7);
    Workspace ws(cpu::list_reduction_workspace_bytes(std::int64_t(p.batch) * p.kv_heads, p.chosen.view.capacity,
                                                     p.list_capacity, nullptr));
    cpu::union_lists(p.view().as_const(), p.chosen.view, p.slots.data(), p.lengths.data(), p.window,
                     UnionAppend{.first = first.data(), .counts_before = counts_before.data()}, out.view, ws.span());
    expect_union_then_append(p, first, counts_before, out);
  }
  // No room for the range: append_range's refusal.
  ListsProblem<float> p(rng, 2, 1, 3, 4, 2, 400);
  p.lengths = {400, 400};
  const std::vector<std::int32_t> first(std::size_t(p.slot_count), 0);
  test::HostSelection out(p.batch, p.kv_heads, p.chosen.view.capacity * p.list_capacity, false);
  Workspace ws(cpu::list_reduction_workspace_bytes(2, p.chosen.view.capacity, p.list_capacity, nullptr));
  test::expect_error(
      [&] {
        cpu::union_lists(p.view().as_const(), p.chosen.view, p.slots.data(), p.lengths.data(), p.window,
                         UnionAppend{.first = first.data()}, out.view, ws.span());
      },
      "kvsift::cpu::append_range: row 0 holds");
}

// recall_lists: each score row's k best lists (reference_choice, written from the contract: NaN first, ties to the
// smaller column) into chosen, poisoned first, then the union of exactly those lists (the set reference over that
// choice) with an append; ragged columns (0 included), ties, infinities and NaN; with and without a pool.
TEST_F(InvertedLists, RecallChoosesTheBestListsThenUnitesThem) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(3);
  for (int repeat = 0; repeat < 20; ++repeat) {
    const std::int32_t k = rng.uniform_int(1, 5), lists = rng.uniform_int(k, 12);
    ListsProblem<float> p(rng, 4, 2, lists, 9, k, 40);
    const test::RecallScores scores(rng, p.batch, p.kv_heads, rng.uniform_int(1, lists));
    const std::int32_t rows = p.batch * p.kv_heads, capacity = k * p.list_capacity + 40;
    std::vector<std::int32_t> first(std::size_t(p.slot_count));
    for (auto& f : first) f = rng.uniform_int(0, 42);
    test::HostSelection chosen(p.batch, p.kv_heads, k, false), out(p.batch, p.kv_heads, capacity, true);
    std::vector<std::int32_t> counts_before(std::size_t(rows), -7);
    cpu::ThreadPool* pl = repeat % 2 == 0 ? nullptr : &pool;
    Workspace ws(cpu::recall_lists_workspace_bytes(rows, scores.cols, k, p.list_capacity, pl));
    cpu::recall_lists(scores.view(), scores.columns.data(), p.view().as_const(), chosen.view, p.slots.data(),
                      p.lengths.data(), p.window, UnionAppend{.first = first.data(), .counts_before = counts_before.data()},
                      out.view, ws.span(), pl);
    std::fill(p.chosen.indices.begin(), p.chosen.indices.end(), test::kPoisonIndex);
    test::reference_choice(scores, p.kv_heads, k, p.chosen);
    ASSERT_EQ(chosen.counts, p.chosen.counts);
    ASSERT_EQ(chosen.indices, p.chosen.indices);  // past each count: still the poison
    expect_union_then_append(p, first, counts_before, out);
  }
}

// recall_lists' own refusals (topk_rows' and union_lists' are theirs, tested with them): a score row per selection
// row, no column past the lists; nothing is written.
TEST_F(InvertedLists, RecallRefusesScoresThatDoNotMatchTheLists) {
  ListsProblem<float> p(rng, 2, 2, 4, 5, 3, 30);
  const test::RecallScores scores(rng, p.batch, p.kv_heads, 4);
  test::HostSelection chosen(p.batch, p.kv_heads, 3, false), out(p.batch, p.kv_heads, 15, false);
  Workspace ws(cpu::recall_lists_workspace_bytes(4, 4, 3, 5));
  const auto run = [&](const MatrixView<const float>& s, InvertedListsView<const float> lists) {
    cpu::recall_lists(s, scores.columns.data(), lists, chosen.view, p.slots.data(), p.lengths.data(), p.window,
                      UnionAppend{}, out.view, ws.span());
  };
  auto fewer_rows = scores.view();
  fewer_rows.rows = 3;
  test::expect_error([&] { run(fewer_rows, p.view().as_const()); },
                     {"cpu::recall_lists", "scores.rows (= 3) must equal chosen.batch * chosen.kv_heads (= 2 * 2)"});
  auto fewer_lists = p.view().as_const();
  fewer_lists.lists = 3;
  test::expect_error([&] { run(scores.view(), fewer_lists); },
                     {"cpu::recall_lists", "scores.cols (= 4) exceeds lists.lists (= 3)"});
  EXPECT_TRUE(std::all_of(chosen.counts.begin(), chosen.counts.end(), [](std::int32_t c) { return c == test::kPoisonIndex; }));
  EXPECT_TRUE(std::all_of(out.counts.begin(), out.counts.end(), [](std::int32_t c) { return c == test::kPoisonIndex; }));
  run(scores.view(), p.view().as_const());  // the valid call runs
  EXPECT_NE(chosen.counts[0], test::kPoisonIndex);
}

TEST_F(InvertedLists, UnionOfListsWithoutScores) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  ListsProblem<half> p(rng, 3, 2, 5, 6, 3, 30, false);
  test::HostSelection out(p.batch, p.kv_heads, 3 * 6, false);
  Workspace ws(cpu::list_reduction_workspace_bytes(std::int64_t(p.batch) * p.kv_heads, 3, 6));
  cpu::union_lists(p.view().as_const(), p.chosen.view, p.slots.data(), p.lengths.data(), p.window, out.view,
                   ws.span());
  const auto expected = reference_union(p);
  for (std::size_t r = 0; r < expected.size(); ++r) {
    const std::set<std::int32_t> got(out.indices.begin() + r * 18, out.indices.begin() + r * 18 + out.counts[r]);
    EXPECT_EQ(got, expected[r]) << "row " << r;
  }
}

template <class T>
void check_replace(Random& rng, bool with_scores, bool pinned, cpu::ThreadPool* pool) {
  ListsProblem<T> p(rng, 3, 2, 4, 6, 1, 50, with_scores);
  if (pinned) p.pin(rng);
  auto ids = p.ids, counts = p.counts, cursors = p.cursors;
  auto scores = p.scores;
  for (std::int32_t step = 0; step < 9; ++step) {
    const std::int32_t cap = rng.uniform_int(1, p.list_capacity);
    test::HostSelection entries(p.batch, p.kv_heads, cap, false);
    std::vector<float> s(entries.indices.size());
    for (std::size_t r = 0; r < entries.counts.size(); ++r) {
      entries.counts[r] = rng.uniform_int(0, cap);
      for (std::int32_t i = 0; i < cap; ++i) entries.indices[r * cap + i] = rng.uniform_int(0, 1000);
    }
    for (auto& x : s) x = rng.uniform(-4.0f, 4.0f);
    std::vector<std::int32_t> replaced(entries.counts.size(), test::kPoisonIndex);
    const auto score_view = with_scores ? MatrixView<const float>::packed(s.data(), std::int64_t(entries.counts.size()), cap)
                                        : MatrixView<const float>{};
    cpu::replace_list(p.view(), p.slots.data(), entries.view, score_view, replaced.data(), pool);
    for (std::int32_t b = 0; b < p.batch; ++b) {
      for (std::int32_t h = 0; h < p.kv_heads; ++h) {
        const std::size_t r = std::size_t(b) * p.kv_heads + h;
        std::int32_t& cursor = cursors[std::size_t(p.slots[b]) * p.kv_heads + h];
        const std::size_t list = (std::size_t(p.slots[b]) * p.kv_heads + h) * p.lists + cursor;
        EXPECT_EQ(replaced[r], cursor);
        counts[list] = entries.counts[r];
        for (std::int32_t i = 0; i < entries.counts[r]; ++i) {
          ids[list * p.list_capacity + i] = entries.indices[r * cap + i];
          if (with_scores) scores[list * p.list_capacity + i] = from_float<T>(s[r * cap + i]);
        }
        cursor = p.next_cursor(p.slots[b], cursor);
      }
    }
    ASSERT_EQ(p.ids, ids);
    ASSERT_EQ(p.counts, counts);
    ASSERT_EQ(p.cursors, cursors);
    ASSERT_TRUE(test::same_bytes(p.scores, scores));
  }
}

TEST_F(InvertedLists, ReplaceListIsAFifoOverTheLists) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(2);
  for (int repeat = 0; repeat < 5; ++repeat) {
    for (const bool pinned : {false, true}) {
      check_replace<float>(rng, true, pinned, nullptr);
      check_replace<half>(rng, true, pinned, &pool);
      check_replace<half>(rng, false, pinned, nullptr);
    }
  }
}

TEST_F(InvertedLists, BadInputIsRefused) {
  ListsProblem<float> p(rng, 2, 2, 4, 5, 3, 30);
  const auto lists = p.view();
  test::HostSelection out(p.batch, p.kv_heads, 15, false);
  Workspace ws(cpu::list_reduction_workspace_bytes(std::int64_t(p.batch) * p.kv_heads, 3, 5));
  const auto run_union = [&](InvertedListsView<const float> l, const SelectionView& chosen, const SelectionView& o,
                             std::span<std::byte> w) {
    cpu::union_lists(l, chosen, p.slots.data(), p.lengths.data(), p.window, o, w);
  };
  run_union(lists.as_const(), p.chosen.view, out.view, ws.span());  // the valid call runs

  auto small = out.view;
  small.capacity = 14;
  test::expect_error([&] { run_union(lists.as_const(), p.chosen.view, small, ws.span()); },
                     {"cpu::union_lists", "out.capacity (= 14) < chosen.capacity * lists.list_capacity (= 3 * 5)"});
  auto no_ids = lists.as_const();
  no_ids.ids = nullptr;
  test::expect_error([&] { run_union(no_ids, p.chosen.view, out.view, ws.span()); }, "lists.ids is a null pointer");
  test::expect_error([&] { run_union(lists.as_const(), p.chosen.view, out.view, ws.span().first(64)); },
                     "workspace too small");
  const std::int32_t saved_slot = p.slots[1];
  p.slots[1] = p.slot_count;
  test::expect_error([&] { run_union(lists.as_const(), p.chosen.view, out.view, ws.span()); },
                     fmt::format("slots[1] (= {}) is outside [0, lists.slots = {})", p.slot_count, p.slot_count));
  p.slots[1] = saved_slot;
  p.lengths[1] = -1;
  test::expect_error([&] { run_union(lists.as_const(), p.chosen.view, out.view, ws.span()); },
                     "lengths[1] (= -1) is negative");
  p.lengths[1] = 5;
  p.chosen.counts[0] = 4;
  test::expect_error([&] { run_union(lists.as_const(), p.chosen.view, out.view, ws.span()); },
                     "chosen.counts (= 4) at batch 0, kv_head 0 is outside [0, capacity = 3]");
  p.chosen.counts[0] = 1;
  p.chosen.indices[0] = 4;
  test::expect_error([&] { run_union(lists.as_const(), p.chosen.view, out.view, ws.span()); },
                     "chosen.indices[0] (= 4) at batch 0, kv_head 0 is outside [0, lists.lists = 4)");
  p.chosen.indices[0] = 2;
  const std::size_t list = (std::size_t(p.slots[0]) * p.kv_heads + 0) * p.lists + 2;
  p.counts[list] = 6;
  test::expect_error([&] { run_union(lists.as_const(), p.chosen.view, out.view, ws.span()); },
                     fmt::format("lists.counts (= 6) of slot {}, kv_head 0, list 2 is outside [0, list_capacity = 5]",
                                 p.slots[0]));
  p.counts[list] = 5;
  auto other_heads = p.chosen.view;
  other_heads.kv_heads = 1;
  test::expect_error([&] { run_union(lists.as_const(), other_heads, out.view, ws.span()); },
                     "chosen.kv_heads (= 1) != lists.kv_heads (= 2)");

  test::expect_error([&] { cpu::list_reduction_workspace_bytes(0, 3, 5); }, "rows (= 0)");

  // replace_list
  test::HostSelection entries(p.batch, p.kv_heads, 5, false);
  std::fill(entries.counts.begin(), entries.counts.end(), 2);
  std::fill(entries.indices.begin(), entries.indices.end(), 1);
  const std::vector<float> s(entries.indices.size(), 1.0f);
  const auto e_scores = MatrixView<const float>::packed(s.data(), 4, 2);
  const auto e_scores5 = MatrixView<const float>::packed(s.data(), 4, 5);
  test::expect_error([&] { cpu::replace_list(lists, p.slots.data(), entries.view, MatrixView<const float>{}, nullptr); },
                     {"cpu::replace_list", "lists.scores is set but scores.data is null"});
  test::expect_error([&] { cpu::replace_list(lists, p.slots.data(), entries.view, e_scores, nullptr); },
                     "scores is [4, 2], not [entries.batch * kv_heads = 4, >= entries.capacity = 5]");
  auto no_cursors = lists;
  no_cursors.cursors = nullptr;
  test::expect_error([&] { cpu::replace_list(no_cursors, p.slots.data(), entries.view, e_scores5, nullptr); },
                     "lists.cursors is a null pointer");
  test::HostSelection wide(p.batch, p.kv_heads, 6, false);
  test::expect_error([&] { cpu::replace_list(lists, p.slots.data(), wide.view, e_scores5, nullptr); },
                     "entries.capacity (= 6) exceeds lists.list_capacity (= 5)");
  p.cursors[std::size_t(p.slots[1]) * p.kv_heads + 1] = 4;
  test::expect_error([&] { cpu::replace_list(lists, p.slots.data(), entries.view, e_scores5, nullptr); },
                     fmt::format("lists.cursors (= 4) of slot {}, kv_head 1 is outside [0, lists.lists = 4)", p.slots[1]));
  p.cursors[std::size_t(p.slots[1]) * p.kv_heads + 1] = 0;
  std::vector<std::int32_t> fifo_begin(std::size_t(p.slot_count), 0);
  fifo_begin[std::size_t(p.slots[0])] = 4;
  auto pinned = lists;
  pinned.fifo_begin = fifo_begin.data();
  test::expect_error([&] { cpu::replace_list(pinned, p.slots.data(), entries.view, e_scores5, nullptr); },
                     fmt::format("lists.fifo_begin (= 4) of slot {} is outside [0, lists.lists = 4)", p.slots[0]));
  entries.counts[3] = 6;
  test::expect_error([&] { cpu::replace_list(lists, p.slots.data(), entries.view, e_scores5, nullptr); },
                     "entries.counts (= 6) at batch 1, kv_head 1 is outside [0, capacity = 5]");
}

}  // namespace
}  // namespace kvsift
