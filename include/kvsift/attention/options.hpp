#pragma once
#include <cmath>
#include <cstdint>

#include "kvsift/core/config.hpp"

namespace kvsift {

/// The tokens sparse decode attends besides its selection, in the same pass (StreamingLLM's attention sinks
/// and recent window): the first `sink` and the last `recent` tokens of each sequence. For a sequence of
/// `length` tokens the window is [0, sink_end) ∪ [recent_begin, length), disjoint even when length < sink +
/// recent; selections then list tokens of the middle [sink_end, recent_begin) only (a window token listed
/// again is attended twice; validation modes refuse it). Token positions are absolute, as everywhere.
struct AttentionWindow {
  std::int32_t sink = 0;
  std::int32_t recent = 0;

  KVSIFT_HOST_DEVICE constexpr bool empty() const { return sink == 0 && recent == 0; }
  KVSIFT_HOST_DEVICE constexpr std::int32_t sink_end(std::int32_t length) const { return sink < length ? sink : length; }
  KVSIFT_HOST_DEVICE constexpr std::int32_t recent_begin(std::int32_t length) const {
    const std::int32_t first = length - recent;
    return first > sink_end(length) ? first : sink_end(length);
  }
  /// Tokens the window attends in a sequence of `length`.
  KVSIFT_HOST_DEVICE constexpr std::int32_t size(std::int32_t length) const {
    return sink_end(length) + length - recent_begin(length);
  }
  /// Position of window entry i (0 <= i < size(length)): the sink tokens, then the recent ones, ascending.
  KVSIFT_HOST_DEVICE constexpr std::int32_t token(std::int32_t i, std::int32_t length) const {
    const std::int32_t sinks = sink_end(length);
    return i < sinks ? i : recent_begin(length) + (i - sinks);
  }
};

/// The selection row that batch row b attends: selection_rows[b] (AttentionOptions::selection_rows), -1 where that
/// is outside [0, selection_batch); b without a map.
KVSIFT_HOST_DEVICE constexpr std::int64_t attended_selection_row(const std::int32_t* selection_rows, std::int64_t b,
                                                                 std::int32_t selection_batch) {
  if (selection_rows == nullptr) return b;
  const std::int32_t row = selection_rows[b];
  return row >= 0 && row < selection_batch ? row : -1;
}

/// Options shared by every decode-attention entry point (reference, CPU, CUDA).
struct AttentionOptions {
  /// Logit scale applied to q.k; 0 selects the default 1/sqrt(head_dim).
  float sm_scale = 0.0f;
  /// Sparse decode only: tokens attended besides the selection, in the same launch (dense decode refuses a
  /// non-empty window: it attends every token).
  AttentionWindow window{};
  /// Sparse decode only: what a selection entry names. 1: a token. P > 1: a page id p, the P tokens
  /// [p * P, (p + 1) * P), of which those of the middle [window.sink_end, window.recent_begin) of the sequence
  /// are attended (a page's window tokens come from the window, its tokens at or past seq_len are none): a
  /// page-level selection, as Quest's top pages, attended with no expansion into tokens. A row's count is its
  /// pages, its log-weights one per page. Dense decode refuses P != 1.
  std::int32_t selection_page_size = 1;
  /// Sparse decode only: an optional row map, [batch] in the selection's memory. Batch row b attends selection row
  /// selection_rows[b] (its count, entries, log-weights and attend_all of every kv head) instead of row b, so a
  /// selection kept per slot is read in place, with no per-step copy (CentroidKV's store: its order, counts and
  /// log-degrees by slot). The selection's batch is then its own rows (the slots), any number >= 1; a value outside
  /// [0, selection.batch) marks the batch row bad, as a bad count does (NaN output; validation modes refuse it by
  /// name). nullptr: row b. Dense decode refuses a map.
  const std::int32_t* selection_rows = nullptr;

  float resolved_scale(std::int32_t head_dim) const {
    return sm_scale != 0.0f ? sm_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  }
};

}  // namespace kvsift
