#pragma once
/// Inverted lists: per (slot, kv head), `lists` bounded lists of token ids with optional scores. CTKVR keeps one
/// list per query centroid (the top-rho keys of that centroid, ids only), recalls the union of the lists its query
/// chose and replaces its lists first in, first out. Backend-neutral: the view and the per-entry rules below are
/// shared by cpu/inverted_lists.hpp and cuda/inverted_lists.hpp (the view does not say where its memory lives).
/// CSAttention keeps its scored lists in its own score tables (selectors/csattention/score_tables.hpp), which use
/// the per-entry rules but not the view.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/config.hpp"
#include "kvsift/core/slot_grid.hpp"

/// The key score types inverted lists are built for (both backends' explicit instantiations).
#define KVSIFT_LIST_STORAGE_TYPES(X) X(float) X(half)

namespace kvsift {

/// Lists of every (slot, kv head): ids [slots, kv_heads, lists, list_capacity] int32, scores (optional, same
/// shape, T = float or half; replace_list writes them), counts [slots, kv_heads, lists] (list l holds entries [0,
/// counts[l]), in no particular order), cursors (optional, [slots, kv_heads]: the list replace_list overwrites
/// next, FIFO over [fifo_begin[slot], lists)). All packed. A const T makes every array read-only (the union's
/// input).
template <class T>
struct InvertedListsView {
  using index_type = std::conditional_t<std::is_const_v<T>, const std::int32_t, std::int32_t>;

  index_type* ids = nullptr;
  T* scores = nullptr;           ///< nullptr: lists without scores; the union never reads them
  index_type* counts = nullptr;
  index_type* cursors = nullptr;  ///< nullptr: no FIFO state (replace_list refuses it)
  std::int32_t slots = 0;
  std::int32_t kv_heads = 0;
  std::int32_t lists = 0;
  std::int32_t list_capacity = 0;
  /// Optional [slots]: the first list of each slot's FIFO. replace_list's cursor wraps from lists - 1 to it, so
  /// lists below it are never replaced (CTKVR's pinned prefill centroids); nullptr: 0.
  index_type* fifo_begin = nullptr;

  /// The cursor after replace_list overwrote list l of `slot`.
  KVSIFT_HOST_DEVICE std::int32_t next_cursor(std::int64_t slot, std::int32_t l) const {
    return l + 1 < lists ? l + 1 : fifo_begin != nullptr ? fifo_begin[slot] : 0;
  }
  /// The grid of ids and scores; counts are the same grid with rows of one element.
  KVSIFT_HOST_DEVICE SlotGrid grid() const { return {slots, kv_heads, lists, list_capacity}; }
  /// Index of list l of (slot, h) in counts.
  KVSIFT_HOST_DEVICE std::int64_t list_index(std::int64_t slot, std::int64_t h, std::int64_t l) const {
    return grid().row_index(slot, h, l);
  }
  KVSIFT_HOST_DEVICE index_type* list_ids(std::int64_t slot, std::int64_t h, std::int64_t l) const {
    return ids + grid().offset(slot, h, l);
  }
  KVSIFT_HOST_DEVICE T* list_scores(std::int64_t slot, std::int64_t h, std::int64_t l) const {
    return scores ? scores + grid().offset(slot, h, l) : nullptr;
  }
  KVSIFT_HOST_DEVICE index_type& count(std::int64_t slot, std::int64_t h, std::int64_t l) const {
    return counts[list_index(slot, h, l)];
  }

  /// Entries of a shape (ids, and scores if any, each hold this many; counts hold slots * kv_heads * lists).
  static constexpr std::size_t entries(std::int32_t slots, std::int32_t kv_heads, std::int32_t lists,
                                       std::int32_t list_capacity) {
    return SlotGrid{slots, kv_heads, lists, list_capacity}.elements();
  }
  constexpr InvertedListsView<const T> as_const() const
    requires(!std::is_const_v<T>)
  {
    return {ids, scores, counts, cursors, slots, kv_heads, lists, list_capacity, fifo_begin};
  }
};

/// union_lists' optional second part (CTKVR's unindexed tokens): with `first` ([slots], each slot's index boundary)
/// each row's middle tokens from first[slot] on are appended after the union's entries there are dropped, and
/// counts_before (optional, [rows]) gets each row's union count: what append_range(out, slots, first, lengths,
/// window, counts_before) does after the union, in the same call (CUDA: in the union's launch where the union takes
/// one on sm_90). In the backend's memory.
struct UnionAppend {
  const std::int32_t* first = nullptr;
  std::int32_t* counts_before = nullptr;
};

namespace detail {

/// Key of a dropped or absent entry in a sort of list entries (the CUDA union's, CSAttention's score tables'):
/// above every token id (ids are < 2^31 - 1, since a length is at most 2^31 - 1), so it sorts last.
inline constexpr std::int32_t kAbsentListEntry = 0x7fffffff;

/// Whether a list entry is a candidate of a sequence of `length` tokens: inside [0, length) and outside the
/// attention window (which sparse decode attends anyway).
KVSIFT_HOST_DEVICE constexpr bool list_entry_kept(std::int32_t id, std::int32_t length, const AttentionWindow& window) {
  return id >= window.sink_end(length) && id < window.recent_begin(length);
}

/// The middle tokens of a sequence of `length` tokens from `first` on, [max(first, sink_end), recent_begin): the
/// tokens an index built when the sequence had `first` tokens (less its recent window) does not hold.
struct TokenRange {
  std::int32_t begin, end;
};
KVSIFT_HOST_DEVICE constexpr TokenRange unindexed_range(std::int32_t first, std::int32_t length,
                                                         const AttentionWindow& window) {
  const std::int32_t sinks = window.sink_end(length);
  return {first > sinks ? first : sinks, window.recent_begin(length)};
}

/// The bounded lists' order (core/ranking.hpp's rule): a is below b when its score is lower, NaN above every
/// number (a NaN-scored token enters its lists and is selected: NaN never vanishes), and on equal scores (or both
/// NaN) when its id is larger (the newer token: ids are positions).
KVSIFT_HOST_DEVICE constexpr bool list_entry_below(float score_a, std::int32_t id_a, float score_b, std::int32_t id_b) {
  const bool nan_a = score_a != score_a, nan_b = score_b != score_b;
  if (nan_a != nan_b) return nan_b;
  if (!nan_a && score_a != score_b) return score_a < score_b;
  return id_a > id_b;
}

}  // namespace detail

}  // namespace kvsift
