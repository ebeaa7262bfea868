#pragma once
/// What a slot of score tables (selectors/csattention/score_tables.hpp) reads, as plain host values that compare with ==: its base
/// (centroids; per list the count and the entries below it) and its overlay (per list the evictions, the size and
/// the heap's entries below it). Storage indices and unused entries are left out, so that two selectors compare
/// by contents wherever their pools placed a base. Shared by the CPU and CUDA CSAttention tests (host views only:
/// the CUDA test copies its tables first).

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kvsift/selectors/csattention/score_tables.hpp"

namespace kvsift::test {

struct BaseContents {
  std::vector<float> centroids;
  std::vector<std::int32_t> counts, ids;
  std::vector<std::uint16_t> scores;
  bool operator==(const BaseContents&) const = default;
};
struct OverlayContents {
  std::vector<std::int32_t> evicted, sizes, ids;
  std::vector<std::uint16_t> scores;
  bool operator==(const OverlayContents&) const = default;
};

inline BaseContents base_contents(const ScoreTablesView<const std::int32_t>& t, std::int32_t slot) {
  const std::int32_t base = t.slot_base[slot];
  EXPECT_TRUE(base >= 0 && base < t.bases) << "slot " << slot << " reads storage " << base;
  BaseContents c;
  if (base < 0 || base >= t.bases) return c;
  const float* centroids = t.centroid(base, 0, 0, 0);
  c.centroids.assign(centroids, centroids + std::size_t(t.table_heads) * t.lists() * t.width);
  for (std::int32_t h = 0; h < t.table_heads; ++h) {
    for (std::int32_t l = 0; l < t.lists(); ++l) {
      const std::int32_t count = t.base_counts[t.list_index(base, h, l)];
      c.counts.push_back(count);
      for (std::int32_t p = 0; p < count; ++p) {
        c.ids.push_back(t.base_ids[t.base_entry(base, h, l) + p]);
        c.scores.push_back(t.base_scores[t.base_entry(base, h, l) + p].bits);
      }
    }
  }
  return c;
}

inline OverlayContents overlay_contents(const ScoreTablesView<const std::int32_t>& t, std::int32_t slot) {
  OverlayContents c;
  for (std::int32_t h = 0; h < t.table_heads; ++h) {
    for (std::int32_t l = 0; l < t.lists(); ++l) {
      const std::int64_t list = t.list_index(slot, h, l);
      c.evicted.push_back(t.evicted[list]);
      c.sizes.push_back(t.overlay_sizes[list]);
      for (std::int32_t p = 0; p < t.overlay_sizes[list]; ++p) {
        c.ids.push_back(t.overlay_ids[t.overlay_entry(slot, h, l) + p]);
        c.scores.push_back(t.overlay_scores[t.overlay_entry(slot, h, l) + p].bits);
      }
    }
  }
  return c;
}

/// Slot a of `x` and slot b of `y` read the same base and overlay.
inline void expect_same_slot(const ScoreTablesView<const std::int32_t>& x, std::int32_t a,
                             const ScoreTablesView<const std::int32_t>& y, std::int32_t b, const std::string& when) {
  EXPECT_TRUE(base_contents(x, a) == base_contents(y, b)) << when << ": the bases differ";
  EXPECT_TRUE(overlay_contents(x, a) == overlay_contents(y, b)) << when << ": the overlays differ";
}

}  // namespace kvsift::test
