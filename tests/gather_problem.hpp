#pragma once
/// Selections for the CPU and CUDA gather tests (cpu/gather.hpp, cuda/gather.hpp) and gather_kv_difference's
/// slots written from its contract with std::map and std::set, shared by both backends' tests and the workspace
/// tests: a selection row of batch row b holds distinct ascending tokens of [0, lens[b]); a difference step keeps
/// part of the last selection and adds random tokens.

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <numeric>
#include <set>
#include <utility>
#include <vector>

#include "test_util.hpp"

namespace kvsift::test {

/// Distinct ascending tokens of [0, len), min(len, n) of them.
inline std::vector<std::int32_t> random_tokens(Random& rng, std::int32_t len, std::int32_t n) {
  std::vector<std::int32_t> all(len);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng.engine);
  all.resize(std::min(len, n));
  std::sort(all.begin(), all.end());
  return all;
}

/// Every row of `rows` (batch row r / kv_heads, of lens[r / kv_heads] tokens): a random number of random tokens,
/// up to the capacity; entries past the count keep their contents.
inline void random_rows(Random& rng, HostSelection& rows, const std::vector<std::int32_t>& lens) {
  const std::int32_t capacity = rows.view.capacity;
  for (std::int32_t r = 0; r < rows.view.batch * rows.view.kv_heads; ++r) {
    const auto t = random_tokens(rng, lens[r / rows.view.kv_heads], rng.uniform_int(0, capacity));
    std::copy(t.begin(), t.end(), rows.indices.begin() + std::ptrdiff_t(r) * capacity);
    rows.counts[r] = std::int32_t(t.size());
  }
}

/// The next step's selection of a difference problem into `current` (previous's shape): each token of
/// `previous` kept with probability 3/4, random tokens of the row's sequence added up to a random count (at most
/// the capacity), entries past the count poisoned.
inline void next_selection(Random& rng, const HostSelection& previous, HostSelection& current,
                           const std::vector<std::int32_t>& lens) {
  const std::int32_t cap = current.view.capacity, kv_heads = current.view.kv_heads;
  for (std::int32_t r = 0; r < current.view.batch * kv_heads; ++r) {
    std::set<std::int32_t> next;
    for (std::int32_t i = 0; i < previous.counts[r]; ++i) {
      if (rng.uniform_int(0, 3) != 0) next.insert(previous.indices[std::size_t(r) * cap + i]);
    }
    const std::int32_t want = rng.uniform_int(0, cap);
    for (const std::int32_t t : random_tokens(rng, lens[r / kv_heads], cap)) {
      if (std::int32_t(next.size()) >= want) break;
      next.insert(t);
    }
    while (std::int32_t(next.size()) > cap) next.erase(std::prev(next.end()));
    const auto row = current.indices.begin() + std::ptrdiff_t(r) * cap;
    std::fill(row, row + cap, kPoisonIndex);
    std::copy(next.begin(), next.end(), row);
    current.counts[r] = std::int32_t(next.size());
  }
}

/// gather_kv_difference's slot assignment from its contract, step by step: a token also resident keeps its
/// slot; the new tokens, ascending, take the free slots of [0, resident_capacity), ascending.
class ResidentSlots {
 public:
  ResidentSlots(std::int32_t rows, std::int32_t resident_capacity)
      : where_(std::size_t(rows)), resident_capacity_(resident_capacity) {}

  /// The slot of every entry of `current` (its layout; entries past a count kPoisonIndex) and each row's number
  /// of new tokens; `current` then is the resident selection.
  struct Step {
    std::vector<std::int32_t> slots, copied;
  };
  Step step(const HostSelection& current) {
    const std::int32_t cap = current.view.capacity;
    Step out{std::vector<std::int32_t>(current.indices.size(), kPoisonIndex),
             std::vector<std::int32_t>(where_.size(), 0)};
    for (std::size_t r = 0; r < where_.size(); ++r) {
      const auto row = current.indices.begin() + std::ptrdiff_t(r) * cap;
      const std::set<std::int32_t> tokens(row, row + current.counts[r]);
      std::map<std::int32_t, std::int32_t> next;
      std::set<std::int32_t> free_slots;
      for (std::int32_t slot = 0; slot < resident_capacity_; ++slot) free_slots.insert(slot);
      for (const std::int32_t t : tokens) {
        if (where_[r].count(t)) {
          next[t] = where_[r][t];
          free_slots.erase(where_[r][t]);
        }
      }
      for (const std::int32_t t : tokens) {
        if (next.count(t)) continue;
        next[t] = *free_slots.begin();
        free_slots.erase(free_slots.begin());
        ++out.copied[r];
      }
      for (std::int32_t i = 0; i < current.counts[r]; ++i) out.slots[r * cap + i] = next[row[i]];
      where_[r] = std::move(next);
    }
    return out;
  }

 private:
  std::vector<std::map<std::int32_t, std::int32_t>> where_;  ///< per row, token -> slot
  std::int32_t resident_capacity_;
};

}  // namespace kvsift::test
