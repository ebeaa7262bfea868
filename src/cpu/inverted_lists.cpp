// Inverted lists on the CPU: checks (core/detail/inverted_lists_checks.hpp, shared with CUDA), then plain loops.
// The reductions sort (id, entry ordinal) keys, so equal ids keep the entries' order and the sums add in the
// order the CUDA twin's stable segmented sort gives: the two agree bit for bit.
#include "kvsift/cpu/inverted_lists.hpp"

#include <algorithm>

#include "kvsift/core/detail/inverted_lists_checks.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"

namespace kvsift::cpu {
namespace {

/// Threads of a reduction: each takes a contiguous run of selection rows and its own key scratch.
std::int64_t reduction_workers(std::int64_t rows, const ThreadPool* pool) {
  return std::max<std::int64_t>(1, std::min<std::int64_t>(rows, pool != nullptr ? pool->size() : 1));
}

/// The single layout behind list_reduction_workspace_bytes and the carving of the reductions.
std::uint64_t* layout_reduction(WorkspaceLayout& layout, std::int64_t workers, std::int32_t chosen_capacity,
                                std::int32_t list_capacity) {
  constexpr const char* what = "cpu list reduction workspace";
  const std::size_t segment = checked_mul(std::size_t(chosen_capacity), std::size_t(list_capacity), what);
  return layout.allocate<std::uint64_t>(checked_mul(std::size_t(workers), segment, what), "entry_keys");
}

/// union_lists (sums == nullptr) and reduce_lists_by_key.
template <class T>
void reduce_lists(const char* where, const InvertedListsView<const T>& lists, const SelectionView& chosen,
                  const std::int32_t* slots, const std::int32_t* lengths, const AttentionWindow& window,
                  const SelectionView& out, const MatrixView<float>* sums, std::span<std::byte> workspace,
                  ThreadPool* pool) {
  detail::check_list_reduction(where, lists, chosen, slots, lengths, window, out, sums, MemorySpace::host);
  const std::int64_t rows = std::int64_t(chosen.batch) * chosen.kv_heads;
  const std::int64_t workers = reduction_workers(rows, pool);
  const std::int64_t segment = std::int64_t(chosen.capacity) * lists.list_capacity;
  WorkspaceLayout layout(workspace, where);
  std::uint64_t* const scratch = layout_reduction(layout, workers, chosen.capacity, lists.list_capacity);
  parallel_for(pool, workers, [&](std::int64_t worker_begin, std::int64_t worker_end) {
    for (std::int64_t worker = worker_begin; worker < worker_end; ++worker) {
      std::uint64_t* const keys = scratch + worker * segment;
      for (std::int64_t row = worker * rows / workers; row < (worker + 1) * rows / workers; ++row) {
        const std::int64_t b = row / chosen.kv_heads, h = row % chosen.kv_heads;
        const std::int32_t* picked = chosen.row(b, h);
        std::int64_t n = 0;
        for (std::int32_t i = 0; i < chosen.count(b, h); ++i) {
          const std::int32_t* ids = lists.list_ids(slots[b], h, picked[i]);
          for (std::int32_t p = 0; p < lists.count(slots[b], h, picked[i]); ++p) {
            if (!detail::list_entry_kept(ids[p], lengths[b], window)) continue;
            keys[n++] = std::uint64_t(ids[p]) << 32 | std::uint32_t(std::int64_t(i) * lists.list_capacity + p);
          }
        }
        std::sort(keys, keys + n);
        std::int32_t* const dst = out.row(b, h);
        float* const weights = out.weights_row(b, h);
        float* const sum_row = sums != nullptr ? sums->row(row) : nullptr;
        std::int32_t count = 0;
        for (std::int64_t j = 0; j < n; ++count) {
          const std::int32_t id = std::int32_t(keys[j] >> 32);
          float sum = 0.0f;
          for (; j < n && std::int32_t(keys[j] >> 32) == id; ++j) {
            if (sum_row == nullptr) continue;
            const std::uint32_t ordinal = std::uint32_t(keys[j]);
            const std::int32_t i = std::int32_t(ordinal / std::uint32_t(lists.list_capacity));
            sum += to_float(lists.list_scores(slots[b], h, picked[i])[ordinal % std::uint32_t(lists.list_capacity)]);
          }
          dst[count] = id;
          if (weights != nullptr) weights[count] = 0.0f;
          if (sum_row != nullptr) sum_row[count] = sum;
        }
        out.counts[row] = count;
      }
    }
  });
}

}  // namespace

std::size_t list_reduction_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity, std::int32_t list_capacity,
                                           bool /*with_scores*/, const ThreadPool* pool) {
  constexpr const char* where = "cpu::list_reduction_workspace_bytes";
  KVSIFT_CHECK(rows > 0 && chosen_capacity > 0 && list_capacity > 0, where,
               "rows (= {}), chosen_capacity (= {}) and list_capacity (= {}) must be positive", rows, chosen_capacity,
               list_capacity);
  WorkspaceLayout counting;
  layout_reduction(counting, reduction_workers(rows, pool), chosen_capacity, list_capacity);
  return counting.bytes();
}

template <class T>
void union_lists(const InvertedListsView<const T>& lists, const SelectionView& chosen, const std::int32_t* slots,
                 const std::int32_t* lengths, const AttentionWindow& window, const SelectionView& out,
                 std::span<std::byte> workspace, ThreadPool* pool) {
  reduce_lists("cpu::union_lists", lists, chosen, slots, lengths, window, out, nullptr, workspace, pool);
}

template <class T>
void reduce_lists_by_key(const InvertedListsView<const T>& lists, const SelectionView& chosen,
                         const std::int32_t* slots, const std::int32_t* lengths, const AttentionWindow& window,
                         const SelectionView& out, const MatrixView<float>& sums, std::span<std::byte> workspace,
                         ThreadPool* pool) {
  reduce_lists("cpu::reduce_lists_by_key", lists, chosen, slots, lengths, window, out, &sums, workspace, pool);
}

template <class T>
void replace_list(const InvertedListsView<T>& lists, const std::int32_t* slots, const SelectionView& entries,
                  const MatrixView<const float>& scores, std::int32_t* replaced, ThreadPool* pool) {
  detail::check_replace_list("cpu::replace_list", lists, slots, entries, scores, MemorySpace::host);
  parallel_for(pool, std::int64_t(entries.batch) * entries.kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / entries.kv_heads, h = row % entries.kv_heads;
      std::int32_t& cursor = lists.cursors[std::int64_t(slots[b]) * lists.kv_heads + h];
      const std::int32_t l = cursor, count = entries.count(b, h);
      std::copy_n(entries.row(b, h), count, lists.list_ids(slots[b], h, l));
      if (T* const dst = lists.list_scores(slots[b], h, l)) {
        const float* src = scores.row(row);
        for (std::int32_t i = 0; i < count; ++i) dst[i] = from_float<T>(src[i]);
      }
      lists.count(slots[b], h, l) = count;
      cursor = lists.next_cursor(slots[b], l);
      if (replaced != nullptr) replaced[row] = l;
    }
  });
}

#define KVSIFT_INSTANTIATE(T)                                                                                        \
  template void union_lists<T>(const InvertedListsView<const T>&, const SelectionView&, const std::int32_t*,          \
                               const std::int32_t*, const AttentionWindow&, const SelectionView&, std::span<std::byte>, \
                               ThreadPool*);                                                                         \
  template void reduce_lists_by_key<T>(const InvertedListsView<const T>&, const SelectionView&, const std::int32_t*,  \
                                       const std::int32_t*, const AttentionWindow&, const SelectionView&,             \
                                       const MatrixView<float>&, std::span<std::byte>, ThreadPool*);                 \
  template void replace_list<T>(const InvertedListsView<T>&, const std::int32_t*, const SelectionView&,               \
                                const MatrixView<const float>&, std::int32_t*, ThreadPool*);
KVSIFT_LIST_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cpu
