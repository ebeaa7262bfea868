#pragma once
/// Random inverted lists for the CPU and CUDA inverted-list tests: ragged list counts (empty and full lists),
/// ids that repeat across lists and fall outside the sequences (negative, past the length, in the window),
/// optional scores (which the union must ignore and replace_list writes), batch rows in a random subset of the
/// slots, and chosen list ids per row; and the union's reference. For recall_lists: score rows over the lists and
/// the reference choice.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <set>
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
  std::vector<std::int32_t> fifo_begin;  ///< empty: no pinned lists
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
      for (auto& s : scores) s = from_float<T>(rng.uniform(-4.0f, 4.0f));
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
  /// Pins the lists below a random fifo_begin per slot and moves the cursors into each slot's FIFO.
  void pin(Random& rng) {
    fifo_begin.resize(std::size_t(slot_count));
    for (std::int32_t slot = 0; slot < slot_count; ++slot) {
      const std::int32_t begin = rng.uniform_int(0, lists - 1);
      fifo_begin[std::size_t(slot)] = begin;
      for (std::int32_t h = 0; h < kv_heads; ++h) cursors[std::size_t(slot) * kv_heads + h] = rng.uniform_int(begin, lists - 1);
    }
  }
  /// The FIFO's rule, written from the contract: the next list, or from the last back to the slot's first.
  std::int32_t next_cursor(std::int32_t slot, std::int32_t l) const {
    if (l + 1 < lists) return l + 1;
    return fifo_begin.empty() ? 0 : fifo_begin[std::size_t(slot)];
  }
  InvertedListsView<T> view() {
    return {ids.data(), scores.empty() ? nullptr : scores.data(), counts.data(), cursors.data(),
            slot_count, kv_heads, lists, list_capacity, fifo_begin.empty() ? nullptr : fifo_begin.data()};
  }
};

/// union_lists' reference, written from the contract: per selection row, the set of kept ids of the chosen lists
/// (std::set iterates them ascending, the union's order).
template <class T>
std::vector<std::set<std::int32_t>> reference_union(const ListsProblem<T>& p) {
  std::vector<std::set<std::int32_t>> rows(std::size_t(p.batch) * p.kv_heads);
  for (std::int32_t b = 0; b < p.batch; ++b) {
    const std::int32_t len = p.lengths[b];
    const std::int32_t lo = std::min(p.window.sink, len), hi = std::max(lo, len - p.window.recent);
    for (std::int32_t h = 0; h < p.kv_heads; ++h) {
      const std::size_t r = std::size_t(b) * p.kv_heads + h;
      for (std::int32_t i = 0; i < p.chosen.counts[r]; ++i) {
        const std::int32_t l = p.chosen.indices[r * p.chosen.view.capacity + i];
        const std::size_t list = (std::size_t(p.slots[b]) * p.kv_heads + h) * p.lists + l;
        for (std::int32_t e = 0; e < p.counts[list]; ++e) {
          const std::int32_t id = p.ids[list * p.list_capacity + e];
          if (id >= lo && id < hi) rows[r].insert(id);
        }
      }
    }
  }
  return rows;
}

/// recall_lists' score rows [batch * kv_heads, cols] and columns [batch]: uniform scores with ties (a few repeated
/// values), -inf, +inf, -0 and +0, and NaN in about one row of four; columns from 0 to cols, often cols.
struct RecallScores {
  std::int32_t cols;
  std::vector<float> scores;
  std::vector<std::int32_t> columns;

  RecallScores(Random& rng, std::int32_t batch, std::int32_t kv_heads, std::int32_t cols_) : cols(cols_) {
    const float kInf = std::numeric_limits<float>::infinity();
    const float repeated[] = {0.25f, -1.5f, 0.0f, -0.0f};
    scores.resize(std::size_t(batch) * kv_heads * cols);
    for (std::size_t r = 0; r < scores.size() / std::size_t(cols); ++r) {
      const bool nans = rng.uniform_int(0, 3) == 0;
      for (std::int32_t c = 0; c < cols; ++c) {
        const int kind = rng.uniform_int(0, 19);
        float& s = scores[r * std::size_t(cols) + std::size_t(c)];
        s = kind < 4 ? repeated[kind] : kind == 4 ? -kInf : kind == 5 ? kInf : rng.uniform(-2.0f, 2.0f);
        if (nans && kind == 6) s = std::numeric_limits<float>::quiet_NaN();
      }
    }
    for (std::int32_t b = 0; b < batch; ++b) columns.push_back(rng.uniform_int(0, 1) == 0 ? cols : rng.uniform_int(0, cols));
  }
  MatrixView<const float> view() const { return MatrixView<const float>::packed(scores.data(), std::int64_t(scores.size() / std::size_t(cols)), cols); }
};

/// recall_lists' choice written from the contract: per selection row the min(k, columns[b]) best columns (NaN
/// first, then the higher score, equal scores to the smaller column; -0 equals +0), ascending, into chosen.
inline void reference_choice(const RecallScores& s, std::int32_t kv_heads, std::int32_t k, HostSelection& chosen) {
  const std::size_t rows = s.scores.size() / std::size_t(s.cols);
  for (std::size_t r = 0; r < rows; ++r) {
    const float* row = s.scores.data() + r * std::size_t(s.cols);
    std::vector<std::int32_t> order(std::size_t(s.columns[r / std::size_t(kv_heads)]));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      const bool nan_a = std::isnan(row[a]), nan_b = std::isnan(row[b]);
      if (nan_a || nan_b) return nan_a && !nan_b;
      return row[a] > row[b];
    });
    order.resize(std::min(order.size(), std::size_t(k)));
    std::sort(order.begin(), order.end());
    std::copy(order.begin(), order.end(), chosen.indices.begin() + std::ptrdiff_t(r * std::size_t(k)));
    chosen.counts[r] = std::int32_t(order.size());
  }
}

}  // namespace kvsift::test
