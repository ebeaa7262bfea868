#pragma once
/// Random inverted lists for the CPU and CUDA inverted-list tests: ragged list counts (empty and full lists),
/// ids that repeat across lists and fall outside the sequences (negative, past the length, in the window),
/// scores exactly representable in T, batch rows in a random subset of the slots, and chosen list ids per row.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/inverted_lists.hpp"
#include "test_util.hpp"

namespace kvsift::test {

template <class T>
struct ListsProblem {
  std::int32_t slot_count, kv_heads, lists, list_capacity, batch;
  std::vector<std::int32_t> ids, counts, cursors;
  std::vector<T> scores;
  std::vector<std::int32_t> slots, lengths;
  AttentionWindow window;
  HostSelection chosen;

  ListsProblem(Random& rng, std::int32_t batch_, std::int32_t kv_heads_, std::int32_t lists_, std::int32_t capacity,
               std::int32_t chosen_capacity, std::int32_t max_len, bool with_scores = true)
      : slot_count(batch_ + 2), kv_heads(kv_heads_), lists(lists_), list_capacity(capacity), batch(batch_),
        chosen(batch_, kv_heads_, chosen_capacity, false) {
    const std::size_t entries = InvertedListsView<T>::entries(slot_count, kv_heads, lists, list_capacity);
    ids.resize(entries);
    for (auto& id : ids) id = rng.uniform_int(-2, max_len + 3);
    counts.resize(std::size_t(slot_count) * kv_heads * lists);
    for (auto& c : counts) {
      const int kind = rng.uniform_int(0, 5);
      c = kind == 0 ? 0 : kind == 1 ? list_capacity : rng.uniform_int(0, list_capacity);
    }
    cursors.resize(std::size_t(slot_count) * kv_heads);
    for (auto& c : cursors) c = rng.uniform_int(0, lists - 1);
    if (with_scores) {
      scores.resize(entries);
      // A few distinct values, so that equal ids and equal scores both occur.
      for (auto& s : scores) s = from_float<T>(float(rng.uniform_int(-8, 8)) * 0.375f + rng.uniform(-1.0f, 1.0f));
    }
    slots.resize(slot_count);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng.engine);
    slots.resize(batch);
    for (std::int32_t b = 0; b < batch; ++b) lengths.push_back(b == 0 ? 0 : rng.uniform_int(1, max_len));
    window = {rng.uniform_int(0, 3), rng.uniform_int(0, 5)};
    for (std::int32_t r = 0; r < batch * kv_heads; ++r) {
      const std::int32_t n = rng.uniform_int(0, chosen_capacity);
      for (std::int32_t i = 0; i < n; ++i) chosen.indices[std::size_t(r) * chosen_capacity + i] = rng.uniform_int(0, lists - 1);
      chosen.counts[r] = n;
    }
  }
  InvertedListsView<T> view() {
    return {ids.data(), scores.empty() ? nullptr : scores.data(), counts.data(), cursors.data(),
            slot_count, kv_heads, lists, list_capacity};
  }
};

}  // namespace kvsift::test
