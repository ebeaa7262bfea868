#pragma once
/// Argument checks of the inverted-list functions, shared by cpu/inverted_lists.hpp and cuda/inverted_lists.hpp
/// so both backends refuse the same inputs in the same words. Shape checks read only the views' fields; content
/// checks (slots, lengths, chosen list ids, list counts, cursors) read the arrays and run only where they are
/// host memory (MemorySpace::host: the CPU backend). The CUDA backend defines instead what a bad device value
/// does (cuda/inverted_lists.hpp).

#include <climits>
#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/inverted_lists.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::detail {

template <class T>
void check_inverted_lists(const char* where, const InvertedListsView<T>& lists) {
  check_pointer(where, "lists", "ids", lists.ids);
  check_pointer(where, "lists", "counts", lists.counts);
  check_positive(where, "lists", "slots", lists.slots);
  check_positive(where, "lists", "kv_heads", lists.kv_heads);
  check_positive(where, "lists", "lists", lists.lists);
  check_positive(where, "lists", "list_capacity", lists.list_capacity);
  const double entries = double(lists.slots) * lists.kv_heads * lists.lists * lists.list_capacity;
  KVSIFT_CHECK(entries <= 0x1p62, where, "lists [{}, {}, {}, {}] has more than 2^62 entries", lists.slots,
               lists.kv_heads, lists.lists, lists.list_capacity);
}

/// The selection-shaped rows a list function reads (chosen lists, new entries): arrays set, batch and capacity
/// positive (kv_heads is checked against the lists').
inline void check_selection_rows(const char* where, const char* name, const SelectionView& rows) {
  check_pointer(where, name, "indices", rows.indices);
  check_pointer(where, name, "counts", rows.counts);
  check_positive(where, name, "batch", rows.batch);
  check_positive(where, name, "capacity", rows.capacity);
}

/// recall_lists' score rows: one per selection row, one column per list at most (checked before its top-k, so
/// that a pick past the lists is refused before anything is written).
template <class T>
void check_recall_scores(const char* where, const MatrixView<const float>& scores, const InvertedListsView<T>& lists,
                         const SelectionView& chosen) {
  KVSIFT_CHECK(scores.rows == std::int64_t(chosen.batch) * chosen.kv_heads, where,
               "scores.rows (= {}) must equal chosen.batch * chosen.kv_heads (= {} * {}): a score row per selection row",
               scores.rows, chosen.batch, chosen.kv_heads);
  KVSIFT_CHECK(scores.cols <= lists.lists, where, "scores.cols (= {}) exceeds lists.lists (= {}): a column scores a list",
               scores.cols, lists.lists);
}

/// slots[b] in [0, slot_count) for every batch row; with `distinct`, no slot twice (two rows updating one slot's
/// lists would race).
inline void check_list_slots(const char* where, const std::int32_t* slots, std::int32_t batch, std::int32_t slot_count,
                             bool distinct) {
  for (std::int32_t b = 0; b < batch; ++b) {
    KVSIFT_CHECK(slots[b] >= 0 && slots[b] < slot_count, where, "slots[{}] (= {}) is outside [0, lists.slots = {})",
                 b, slots[b], slot_count);
    for (std::int32_t other = 0; distinct && other < b; ++other) {
      KVSIFT_CHECK(slots[other] != slots[b], where, "slots[{}] (= {}) repeats slots[{}]: each batch row owns its slot",
                   b, slots[b], other);
    }
  }
}

/// A list's count in [0, list_capacity] (host memory).
template <class T>
void check_list_count(const char* where, const InvertedListsView<T>& lists, std::int64_t slot, std::int64_t h,
                      std::int64_t l) {
  const std::int32_t count = lists.count(slot, h, l);
  KVSIFT_CHECK(count >= 0 && count <= lists.list_capacity, where,
               "lists.counts (= {}) of slot {}, kv_head {}, list {} is outside [0, list_capacity = {}]", count, slot,
               h, l, lists.list_capacity);
}

/// union_lists: `out` receives the union of the lists `chosen` names.
template <class T>
void check_list_reduction(const char* where, const InvertedListsView<const T>& lists, const SelectionView& chosen,
                          const std::int32_t* slots, const std::int32_t* lengths, const AttentionWindow& window,
                          const SelectionView& out, MemorySpace contents) {
  check_inverted_lists(where, lists);
  check_selection_rows(where, "chosen", chosen);
  check_pointer(where, "out", "indices", out.indices);
  check_pointer(where, "out", "counts", out.counts);
  KVSIFT_CHECK(slots != nullptr, where, "slots is a null pointer");
  KVSIFT_CHECK(lengths != nullptr, where, "lengths is a null pointer");
  validate(window, where, "window");
  KVSIFT_CHECK(chosen.kv_heads == lists.kv_heads, where, "chosen.kv_heads (= {}) != lists.kv_heads (= {})",
               chosen.kv_heads, lists.kv_heads);
  KVSIFT_CHECK(out.batch == chosen.batch && out.kv_heads == chosen.kv_heads, where,
               "out is [batch = {}, kv_heads = {}], chosen [batch = {}, kv_heads = {}]", out.batch, out.kv_heads,
               chosen.batch, chosen.kv_heads);
  const std::int64_t segment = std::int64_t(chosen.capacity) * lists.list_capacity;
  KVSIFT_CHECK(out.capacity >= segment, where, "out.capacity (= {}) < chosen.capacity * lists.list_capacity (= {} * {})",
               out.capacity, chosen.capacity, lists.list_capacity);
  KVSIFT_CHECK(std::int64_t(chosen.batch) * chosen.kv_heads * segment <= INT32_MAX, where,
               "chosen.batch * kv_heads * capacity * lists.list_capacity (= {} * {} * {} * {}) exceeds 2^31 - 1 entries",
               chosen.batch, chosen.kv_heads, chosen.capacity, lists.list_capacity);
  if (contents != MemorySpace::host) return;
  check_list_slots(where, slots, chosen.batch, lists.slots, false);
  for (std::int32_t b = 0; b < chosen.batch; ++b) {
    KVSIFT_CHECK(lengths[b] >= 0, where, "lengths[{}] (= {}) is negative", b, lengths[b]);
    for (std::int32_t h = 0; h < chosen.kv_heads; ++h) {
      check_selection_count(where, "chosen", b, h, chosen.count(b, h), chosen.capacity);
      for (std::int32_t i = 0; i < chosen.count(b, h); ++i) {
        const std::int32_t l = chosen.row(b, h)[i];
        KVSIFT_CHECK(l >= 0 && l < lists.lists, where,
                     "chosen.indices[{}] (= {}) at batch {}, kv_head {} is outside [0, lists.lists = {})", i, l, b, h,
                     lists.lists);
        check_list_count(where, lists, slots[b], h, l);
      }
    }
  }
}

/// replace_list: entries [batch, kv_heads, capacity <= list_capacity], scores [batch * kv_heads, >= capacity] when
/// the lists have scores, replaced [batch * kv_heads] optional.
template <class T>
void check_replace_list(const char* where, const InvertedListsView<T>& lists, const std::int32_t* slots,
                        const SelectionView& entries, const MatrixView<const float>& scores, MemorySpace contents) {
  check_inverted_lists(where, lists);
  check_pointer(where, "lists", "cursors", lists.cursors);
  check_selection_rows(where, "entries", entries);
  KVSIFT_CHECK(slots != nullptr, where, "slots is a null pointer");
  KVSIFT_CHECK(entries.kv_heads == lists.kv_heads, where, "entries.kv_heads (= {}) != lists.kv_heads (= {})",
               entries.kv_heads, lists.kv_heads);
  KVSIFT_CHECK(entries.capacity <= lists.list_capacity, where,
               "entries.capacity (= {}) exceeds lists.list_capacity (= {})", entries.capacity, lists.list_capacity);
  KVSIFT_CHECK((lists.scores != nullptr) == (scores.data != nullptr), where,
               "lists.scores is {} but scores.data is {}: new entries carry scores exactly when the lists keep them",
               lists.scores ? "set" : "null", scores.data ? "set" : "null");
  if (scores.data != nullptr) {
    validate(scores, where, "scores");
    KVSIFT_CHECK(scores.rows == std::int64_t(entries.batch) * entries.kv_heads && scores.cols >= entries.capacity,
                 where, "scores is [{}, {}], not [entries.batch * kv_heads = {}, >= entries.capacity = {}]", scores.rows,
                 scores.cols, std::int64_t(entries.batch) * entries.kv_heads, entries.capacity);
  }
  if (contents != MemorySpace::host) return;
  check_list_slots(where, slots, entries.batch, lists.slots, true);
  for (std::int32_t b = 0; b < entries.batch; ++b) {
    if (lists.fifo_begin != nullptr) {
      const std::int32_t begin = lists.fifo_begin[slots[b]];
      KVSIFT_CHECK(begin >= 0 && begin < lists.lists, where,
                   "lists.fifo_begin (= {}) of slot {} is outside [0, lists.lists = {})", begin, slots[b], lists.lists);
    }
    for (std::int32_t h = 0; h < entries.kv_heads; ++h) {
      check_selection_count(where, "entries", b, h, entries.count(b, h), entries.capacity);
      const std::int32_t cursor = lists.cursors[std::int64_t(slots[b]) * lists.kv_heads + h];
      KVSIFT_CHECK(cursor >= 0 && cursor < lists.lists, where,
                   "lists.cursors (= {}) of slot {}, kv_head {} is outside [0, lists.lists = {})", cursor, slots[b], h,
                   lists.lists);
    }
  }
}

}  // namespace kvsift::detail
