// Reranking candidates on the CPU (cpu/rerank.hpp): the remap back to token ids and the unindexed range.
// candidate_scores is group_scores' job over candidate ids, in src/cpu/primitives.cpp.
#include "kvsift/cpu/rerank.hpp"

#include <algorithm>

#include "kvsift/core/detail/rerank_checks.hpp"
#include "kvsift/core/inverted_lists.hpp"

namespace kvsift::cpu {

void remap_selection(const SelectionView& positions, const SelectionView& ids, const SelectionView& out) {
  constexpr const char* where = "cpu::remap_selection";
  kvsift::detail::check_remap_selection(where, positions, ids, out);
  const std::int64_t rows = std::int64_t(positions.batch) * positions.kv_heads;
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int32_t count = positions.counts[row], available = ids.counts[row];
    KVSIFT_CHECK(count >= 0 && count <= positions.capacity, where,
                 "positions.counts[{}] (= {}) is outside [0, capacity = {}]", row, count, positions.capacity);
    KVSIFT_CHECK(available >= 0 && available <= ids.capacity, where, "ids.counts[{}] (= {}) is outside [0, capacity = {}]",
                 row, available, ids.capacity);
    const std::int32_t* p = positions.indices + row * positions.capacity;
    const std::int32_t* from = ids.indices + row * ids.capacity;
    std::int32_t* to = out.indices + row * out.capacity;
    float* weights = out.log_weights != nullptr ? out.log_weights + row * out.capacity : nullptr;
    for (std::int32_t i = 0; i < count; ++i) {
      KVSIFT_CHECK(p[i] >= 0 && p[i] < available, where, "position {} of row {} (= {}) is outside [0, ids.count = {})",
                   i, row, p[i], available);
      to[i] = from[p[i]];  // in place: p[i] is read before to[i] (the same entry) is written
      if (weights != nullptr) weights[i] = 0.0f;
    }
    out.counts[row] = count;
  }
}

void append_range(const SelectionView& rows, const std::int32_t* slots, const std::int32_t* first,
                  const std::int32_t* lengths, const AttentionWindow& window, std::int32_t* counts_before) {
  constexpr const char* where = "cpu::append_range";
  kvsift::detail::check_append_range(where, rows, slots, first, lengths, window);
  for (std::int64_t row = 0; row < std::int64_t(rows.batch) * rows.kv_heads; ++row) {
    const std::int64_t b = row / rows.kv_heads;
    std::int32_t count = rows.counts[row];
    KVSIFT_CHECK(count >= 0 && count <= rows.capacity, where, "rows.counts[{}] (= {}) is outside [0, capacity = {}]",
                 row, count, rows.capacity);
    KVSIFT_CHECK(lengths[b] >= 0, where, "lengths[{}] (= {}) is negative", b, lengths[b]);
    if (counts_before != nullptr) counts_before[row] = count;
    const kvsift::detail::TokenRange range = kvsift::detail::unindexed_range(first[slots[b]], lengths[b], window);
    std::int32_t* ids = rows.indices + row * rows.capacity;
    count = std::int32_t(std::lower_bound(ids, ids + count, range.begin) - ids);
    const std::int64_t added = std::max<std::int64_t>(0, std::int64_t(range.end) - range.begin);
    KVSIFT_CHECK(count + added <= rows.capacity, where,
                 "row {} holds {} entries below {} and the range adds {}: more than its capacity ({})", row, count,
                 range.begin, added, rows.capacity);
    float* weights = rows.log_weights != nullptr ? rows.log_weights + row * rows.capacity : nullptr;
    for (std::int64_t i = 0; i < added; ++i) {
      ids[count + i] = std::int32_t(range.begin + i);
      if (weights != nullptr) weights[count + i] = 0.0f;
    }
    rows.counts[row] = std::int32_t(count + added);
  }
}

}  // namespace kvsift::cpu
