// KV gathers on the CPU: checks (core/detail/gather_checks.hpp, shared with CUDA), then row copies. The
// difference gather walks each row's current tokens once, finding kept ones by binary search in the previous
// row (both ascending), and hands the new ones the free slots of a bitmap in ascending order.
#include "kvsift/cpu/gather.hpp"

#include <algorithm>
#include <bit>

#include "kvsift/core/detail/gather_checks.hpp"
#include "kvsift/core/detail/gather_instances.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"

namespace kvsift::cpu {
namespace {

template <class T>
void copy_kv_row(const KVCache<const T>& src, std::int64_t b, std::int64_t h, std::int64_t token, const KVCache<T>& dst,
                 std::int64_t slot) {
  const std::int32_t d = src.head_dim();
  std::copy_n(src.k_row(b, h, token), d, dst.k_row(b, h, slot));
  std::copy_n(src.v_row(b, h, token), d, dst.v_row(b, h, slot));
}

std::int64_t difference_workers(std::int64_t rows, const ThreadPool* pool) {
  return std::max<std::int64_t>(1, std::min<std::int64_t>(rows, pool != nullptr ? pool->size() : 1));
}

/// The single layout behind gather_kv_difference_workspace_bytes and the run's carving.
std::uint64_t* layout_difference(WorkspaceLayout& layout, std::int64_t workers, std::int32_t resident_capacity) {
  const std::size_t words = (std::size_t(resident_capacity) + 63) / 64;
  return layout.allocate<std::uint64_t>(checked_mul(std::size_t(workers), words, "cpu gather_kv_difference workspace"),
                                        "slot_bitmaps");
}

}  // namespace

template <class T>
void gather_kv(const KVCache<const T>& src, const SelectionView& rows, const KVCache<T>& dst, const Context& ctx) {
  kvsift::detail::check_gather_kv("cpu::gather_kv", src, rows, dst, MemorySpace::host);
  parallel_for(ctx.pool, std::int64_t(rows.batch) * rows.kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / rows.kv_heads, h = row % rows.kv_heads;
      const std::int32_t* tokens = rows.row(b, h);
      for (std::int32_t i = 0; i < rows.count(b, h); ++i) copy_kv_row(src, b, h, tokens[i], dst, i);
    }
  });
}

template <class T>
void gather_keys(const KVCache<const T>& src, const SelectionView& rows, const SequenceView<T>& dst,
                 const Context& ctx) {
  kvsift::detail::check_gather_keys("cpu::gather_keys", src, rows, dst, MemorySpace::host);
  parallel_for(ctx.pool, std::int64_t(rows.batch) * rows.kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / rows.kv_heads, h = row % rows.kv_heads;
      const std::int32_t* tokens = rows.row(b, h);
      for (std::int32_t i = 0; i < rows.count(b, h); ++i) {
        std::copy_n(src.k_row(b, h, tokens[i]), src.head_dim(), dst.row(b, h, i));
      }
    }
  });
}

std::size_t gather_kv_difference_workspace_bytes(std::int32_t batch, std::int32_t kv_heads,
                                                 std::int32_t current_capacity, std::int32_t resident_capacity,
                                                 const Context& ctx) {
  KVSIFT_CHECK(batch > 0 && kv_heads > 0 && current_capacity > 0 && resident_capacity > 0,
               "cpu::gather_kv_difference_workspace_bytes",
               "batch (= {}), kv_heads (= {}), current_capacity (= {}) and resident_capacity (= {}) must be positive",
               batch, kv_heads, current_capacity, resident_capacity);
  WorkspaceLayout counting;
  layout_difference(counting, difference_workers(std::int64_t(batch) * kv_heads, ctx.pool), resident_capacity);
  return counting.bytes();
}

template <class T>
void gather_kv_difference(const KVCache<const T>& src, const SelectionView& previous,
                          const std::int32_t* previous_slots, const SelectionView& current,
                          std::int32_t* current_slots, const ContiguousKVView<T>& resident, std::int32_t* copied,
                          std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cpu::gather_kv_difference";
  kvsift::detail::check_gather_difference(where, src, previous, previous_slots, current, current_slots, resident,
                                          copied, MemorySpace::device);
  const std::int64_t rows = std::int64_t(current.batch) * current.kv_heads;
  const std::int64_t workers = difference_workers(rows, ctx.pool);
  const std::int64_t words = (std::int64_t(resident.capacity) + 63) / 64;
  WorkspaceLayout layout(workspace, where);
  std::uint64_t* const bitmaps = layout_difference(layout, workers, resident.capacity);
  std::fill_n(bitmaps, words, 0);
  kvsift::detail::check_gather_difference(where, src, previous, previous_slots, current, current_slots, resident,
                                          copied, MemorySpace::host,
                                          std::span<std::uint64_t>(bitmaps, std::size_t(words)));
  const KVCache<T> dst(resident);
  parallel_for_shares(ctx.pool, rows, workers, [&](std::int64_t worker, std::int64_t row) {
    std::uint64_t* const used = bitmaps + worker * words;
    const std::int64_t b = row / current.kv_heads, h = row % current.kv_heads;
    const std::int32_t* prev = previous.row(b, h);
    const std::int32_t* prev_slots = previous_slots + row * previous.capacity;
    const std::int32_t* cur = current.row(b, h);
    std::int32_t* const cur_slots = current_slots + row * current.capacity;
    const std::int32_t prev_count = previous.count(b, h), cur_count = current.count(b, h);
    std::fill_n(used, words, 0);
    for (std::int32_t j = 0; j < cur_count; ++j) {
      const std::int32_t* found = std::lower_bound(prev, prev + prev_count, cur[j]);
      const bool kept = found != prev + prev_count && *found == cur[j];
      cur_slots[j] = kept ? prev_slots[found - prev] : -1;
      if (kept) used[cur_slots[j] / 64] |= std::uint64_t(1) << (cur_slots[j] % 64);
    }
    std::int32_t fresh = 0;
    std::int64_t word = 0;  // the free-slot scan only moves forward: new tokens take ascending slots
    for (std::int32_t j = 0; j < cur_count; ++j) {
      if (cur_slots[j] >= 0) continue;
      while (used[word] == ~std::uint64_t(0)) ++word;  // a free slot exists: at most capacity tokens, all distinct
      const std::int32_t slot = std::int32_t(word * 64 + std::countr_one(used[word]));
      used[word] |= std::uint64_t(1) << (slot % 64);
      cur_slots[j] = slot;
      copy_kv_row(src, b, h, cur[j], dst, slot);
      ++fresh;
    }
    copied[row] = fresh;
  });
}

KVSIFT_STORAGE_TYPES(KVSIFT_GATHER_INSTANCES)

}  // namespace kvsift::cpu
