#pragma once
/// Page bounds, Quest's index (Tang et al., 2024): keys are grouped in pages of `page_size` consecutive tokens,
/// and each page keeps the channel-wise minimum and maximum of its keys. For a query q, a page's bound
///   sum_c max(q_c * min_c, q_c * max_c)
/// is at least q . k for every key k of the page. Backend-neutral: the view and the per-element math below are
/// shared by selectors/quest/cpu/page_bounds.hpp and selectors/quest/cuda/page_bounds.hpp (the view does not say where its memory lives).

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/config.hpp"
#include "kvsift/core/slot_grid.hpp"

namespace kvsift {

/// What select_pages writes: the chosen pages' middle tokens, or the page ids (a page-level selection,
/// AttentionOptions::selection_page_size).
enum class PagesOut : std::uint8_t { tokens, pages };

/// Bounds of every (slot, kv head, page): [slots, kv_heads, max_pages, 2, head_dim], packed, per page the
/// channel-wise minimum (lo) then maximum (hi). Stored in the cache's storage type T: the minimum and maximum
/// of T keys are T values, so nothing is rounded. A slot holds one sequence (continuous batching: batch rows
/// map to slots through a `slots` array); its pages cover tokens [0, max_pages * page_size).
template <class T>
struct PageBoundsView {
  T* data = nullptr;
  std::int32_t slots = 0;
  std::int32_t kv_heads = 0;
  std::int32_t max_pages = 0;
  std::int32_t head_dim = 0;
  std::int32_t page_size = 0;

  /// A page's row holds lo then hi.
  KVSIFT_HOST_DEVICE SlotGrid grid() const { return {slots, kv_heads, max_pages, 2 * std::int64_t(head_dim)}; }
  KVSIFT_HOST_DEVICE T* lo(std::int64_t slot, std::int64_t h, std::int64_t page) const {
    return data + grid().offset(slot, h, page);
  }
  /// The maximum follows the minimum: hi(...) == lo(...) + head_dim.
  KVSIFT_HOST_DEVICE T* hi(std::int64_t slot, std::int64_t h, std::int64_t page) const {
    return lo(slot, h, page) + head_dim;
  }
  /// Tokens one slot's pages cover.
  KVSIFT_HOST_DEVICE std::int64_t max_tokens() const { return std::int64_t(max_pages) * page_size; }

  static constexpr PageBoundsView packed(T* data, std::int32_t slots, std::int32_t kv_heads, std::int32_t max_pages,
                                         std::int32_t head_dim, std::int32_t page_size) {
    return {data, slots, kv_heads, max_pages, head_dim, page_size};
  }
  /// Bytes of the bounds of a shape (the index's size). The checks of every page-bounds function refuse a
  /// view whose element count exceeds 2^62, so for any accepted view this does not overflow.
  static constexpr std::size_t bytes(std::int32_t slots, std::int32_t kv_heads, std::int32_t max_pages,
                                     std::int32_t head_dim) {
    return SlotGrid{slots, kv_heads, max_pages, 2 * std::int64_t(head_dim)}.elements() * sizeof(T);
  }
  /// The same bounds, read-only (page_scores' input).
  constexpr PageBoundsView<const T> as_const() const
    requires(!std::is_const_v<T>)
  {
    return {data, slots, kv_heads, max_pages, head_dim, page_size};
  }
};

namespace detail {

/// Pages of a sequence of `length` tokens.
KVSIFT_HOST_DEVICE constexpr std::int64_t page_count(std::int64_t length, std::int32_t page_size) {
  return (length + page_size - 1) / page_size;
}

/// Tokens of page `page` that lie in the middle [window.sink_end(length), window.recent_begin(length)) of a
/// sequence of `length` tokens, as [*first, *last) (empty when *first >= *last): the tokens a selection may
/// list. Page ids outside [0, pages) give an empty range.
KVSIFT_HOST_DEVICE constexpr void page_middle(std::int64_t page, std::int32_t page_size, std::int32_t length,
                                              const AttentionWindow& window, std::int64_t* first, std::int64_t* last) {
  const std::int64_t begin = page * page_size, end = begin + page_size;
  const std::int64_t lo = window.sink_end(length), hi = window.recent_begin(length);
  *first = begin > lo ? begin : lo;
  *last = end < hi ? end : hi;
}

/// Whether key value k replaces the running minimum lo (resp. maximum, called with both negated by the
/// caller's comparison): k is smaller, or NaN. A NaN stays once taken (nothing compares below it), so a NaN
/// key makes its page's bounds, and with them its scores, NaN: NaN never vanishes.
KVSIFT_HOST_DEVICE constexpr bool replaces_min(float k, float lo) { return k < lo || k != k; }
KVSIFT_HOST_DEVICE constexpr bool replaces_max(float k, float hi) { return k > hi || k != k; }

/// One channel's term of a page bound, max(q * lo, q * hi): for lo <= hi (as build writes them) the larger
/// product is the one with hi when q >= 0 and with lo otherwise, and rounding keeps that order, so one
/// multiply gives max's exact result. NaN in q gives NaN; NaN in lo or hi is the caller's separate check
/// (bound_is_nan), which one test per channel makes cheaper than a NaN-propagating max per head.
KVSIFT_HOST_DEVICE constexpr float bound_factor(float q, float lo, float hi) { return q >= 0.0f ? hi : lo; }
KVSIFT_HOST_DEVICE constexpr bool bound_is_nan(float lo, float hi) { return lo != lo || hi != hi; }

/// max over a group's heads that keeps NaN (fmaxf would drop it).
KVSIFT_HOST_DEVICE constexpr float max_keep_nan(float running, float x) { return (x > running || x != x) ? x : running; }

}  // namespace detail

}  // namespace kvsift
