#pragma once
/// The indexing of the selectors' per-slot stores (query centroids, the merge store, inverted lists, page bounds,
/// score tables): packed arrays [slots, heads, rows, width], per (slot, head) `rows` rows of `width` elements.
/// Each store builds its grid from its own fields and indexes through it, so the offset math and the element
/// count are written once. POD, usable on host and device.

#include <cstddef>
#include <cstdint>

#include "kvsift/core/config.hpp"

namespace kvsift {

struct SlotGrid {
  std::int32_t slots = 0;
  std::int32_t heads = 0;
  std::int32_t rows = 0;   ///< per (slot, head)
  std::int64_t width = 1;  ///< elements per row (int64: a page-bounds row holds 2 * head_dim)

  /// Index of (slot, head h) among the slots * heads blocks of rows.
  KVSIFT_HOST_DEVICE std::int64_t block(std::int64_t slot, std::int64_t h) const { return slot * heads + h; }
  /// Index of row i of block b among all rows.
  KVSIFT_HOST_DEVICE std::int64_t row_index(std::int64_t b, std::int64_t i) const { return b * rows + i; }
  KVSIFT_HOST_DEVICE std::int64_t row_index(std::int64_t slot, std::int64_t h, std::int64_t i) const {
    return row_index(block(slot, h), i);
  }
  /// Element offset of row i of block b, and of row i of (slot, head h).
  KVSIFT_HOST_DEVICE std::int64_t offset(std::int64_t b, std::int64_t i) const { return row_index(b, i) * width; }
  KVSIFT_HOST_DEVICE std::int64_t offset(std::int64_t slot, std::int64_t h, std::int64_t i) const {
    return row_index(slot, h, i) * width;
  }
  /// Elements of the whole array. The stores' checks bound their shapes, so this does not overflow.
  constexpr std::size_t elements() const {
    return std::size_t(slots) * std::size_t(heads) * std::size_t(rows) * std::size_t(width);
  }
};

}  // namespace kvsift
