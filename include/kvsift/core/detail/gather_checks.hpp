#pragma once
/// Argument checks of the KV gathers, shared by cpu/gather.hpp and cuda/gather.hpp so both backends refuse the
/// same inputs in the same words. Shape checks read only the views' fields; content checks (counts, token ids,
/// resident slots, the cache's lengths) read the arrays and run only where they are host memory
/// (MemorySpace::host: the CPU backend). The CUDA backend defines instead what a bad device value does.

#include <cstdint>
#include <span>

#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::detail {

/// Most rows of a resident buffer row that gather_kv_difference takes: the CUDA kernel keeps a bitmap of a
/// row's slots and its prefix counts in shared memory (16 KiB at this bound); SpeContext's budgets are a few
/// thousand.
inline constexpr std::int32_t kMaxResidentSlots = 65536;

template <class T>
void validate_cache(const KVCache<T>& cache, const char* where, const char* name, MemorySpace contents) {
  cache.visit([&](const auto& kv) { validate(kv, where, name, contents); });
}

template <class S, class D>
void check_same_heads(const char* where, const char* src_name, const KVCache<S>& src, const char* dst_name,
                      const KVCache<D>& dst) {
  KVSIFT_CHECK(src.batch() == dst.batch() && src.kv_heads() == dst.kv_heads() && src.head_dim() == dst.head_dim(),
               where, "{} is [batch = {}, kv_heads = {}, head_dim = {}], {} [batch = {}, kv_heads = {}, head_dim = {}]",
               src_name, src.batch(), src.kv_heads(), src.head_dim(), dst_name, dst.batch(), dst.kv_heads(),
               dst.head_dim());
}

inline void check_selection_shape(const char* where, const char* name, const SelectionView& s, std::int32_t batch,
                                  std::int32_t kv_heads) {
  check_pointer(where, name, "indices", s.indices);
  check_pointer(where, name, "counts", s.counts);
  check_positive(where, name, "capacity", s.capacity);
  KVSIFT_CHECK(s.batch == batch && s.kv_heads == kv_heads, where,
               "{} is [batch = {}, kv_heads = {}], the cache [batch = {}, kv_heads = {}]", name, s.batch, s.kv_heads,
               batch, kv_heads);
}

/// gather_kv: rows [src.batch, kv_heads], every row's entries to slots [0, count) of dst.
template <class T>
void check_gather_kv(const char* where, const KVCache<const T>& src, const SelectionView& rows, const KVCache<T>& dst,
                     MemorySpace contents) {
  validate_cache(src, where, "src", contents);
  validate_cache(dst, where, "dst", contents);
  check_same_heads(where, "src", src, "dst", dst);
  check_selection_shape(where, "rows", rows, src.batch(), src.kv_heads());
  if (contents != MemorySpace::host) return;
  for (std::int32_t b = 0; b < rows.batch; ++b) {
    for (std::int32_t h = 0; h < rows.kv_heads; ++h) {
      check_selection_count(where, "rows", b, h, rows.count(b, h), rows.capacity);
      KVSIFT_CHECK(rows.count(b, h) <= dst.seq_len(b), where,
                   "rows.counts (= {}) at batch {}, kv_head {} exceeds the slots of dst's row (dst.seq_len({}) = {})",
                   rows.count(b, h), b, h, b, dst.seq_len(b));
      check_selection_entries(where, "rows", b, h, rows.row(b, h), rows.count(b, h), src.seq_len(b));
    }
  }
}

/// gather_keys: rows [src.batch, kv_heads], every row's entries to tokens [0, count) of dst [batch, kv_heads,
/// tokens, head_dim].
template <class T>
void check_gather_keys(const char* where, const KVCache<const T>& src, const SelectionView& rows,
                       const SequenceView<T>& dst, MemorySpace contents) {
  validate_cache(src, where, "src", contents);
  validate(dst, where, "dst");
  KVSIFT_CHECK(src.batch() == dst.batch && src.kv_heads() == dst.heads && src.head_dim() == dst.head_dim, where,
               "src is [batch = {}, kv_heads = {}, head_dim = {}], dst [batch = {}, heads = {}, head_dim = {}]",
               src.batch(), src.kv_heads(), src.head_dim(), dst.batch, dst.heads, dst.head_dim);
  check_selection_shape(where, "rows", rows, src.batch(), src.kv_heads());
  if (contents != MemorySpace::host) return;
  for (std::int32_t b = 0; b < rows.batch; ++b) {
    for (std::int32_t h = 0; h < rows.kv_heads; ++h) {
      check_selection_count(where, "rows", b, h, rows.count(b, h), rows.capacity);
      KVSIFT_CHECK(rows.count(b, h) <= dst.tokens, where,
                   "rows.counts (= {}) at batch {}, kv_head {} exceeds dst's rows (dst.tokens = {})", rows.count(b, h),
                   b, h, dst.tokens);
      check_selection_entries(where, "rows", b, h, rows.row(b, h), rows.count(b, h), src.seq_len(b));
    }
  }
}

/// One row of a difference gather's selection (host memory): ids strictly ascending, inside [0, seq_len).
inline void check_ascending_row(const char* where, const char* name, std::int64_t b, std::int64_t h,
                                const std::int32_t* idx, std::int32_t count, std::int32_t seq_len) {
  check_selection_entries(where, name, b, h, idx, count, seq_len);
  for (std::int32_t i = 1; i < count; ++i) {
    KVSIFT_CHECK(idx[i] > idx[i - 1], where,
                 "{}.indices[{}] (= {}) at batch {}, kv_head {} does not exceed {}.indices[{}] (= {}): rows must be "
                 "ascending and distinct",
                 name, i, idx[i], b, h, name, i - 1, idx[i - 1]);
  }
}

/// gather_kv_difference's shapes; `seen` (host contents only) is a bitmap of resident.capacity bits, all clear,
/// for the distinct-slot check, cleared again on return.
template <class T>
void check_gather_difference(const char* where, const KVCache<const T>& src, const SelectionView& previous,
                             const std::int32_t* previous_slots, const SelectionView& current,
                             const std::int32_t* current_slots, const ContiguousKVView<T>& resident,
                             const std::int32_t* copied, MemorySpace contents, std::span<std::uint64_t> seen = {}) {
  validate_cache(src, where, "src", contents);
  validate(resident, where, "resident", MemorySpace::device);  // its seq_lens are not read: every slot is a row
  check_same_heads(where, "src", src, "resident", KVCache<T>(resident));
  check_selection_shape(where, "previous", previous, src.batch(), src.kv_heads());
  check_selection_shape(where, "current", current, src.batch(), src.kv_heads());
  KVSIFT_CHECK(previous_slots != nullptr, where, "previous_slots is a null pointer");
  KVSIFT_CHECK(current_slots != nullptr, where, "current_slots is a null pointer");
  KVSIFT_CHECK(copied != nullptr, where, "copied is a null pointer");
  KVSIFT_CHECK(previous_slots != current_slots, where,
               "previous_slots and current_slots are one array: the slots of the last step are read while this "
               "step's are written (keep two and swap them per step)");
  KVSIFT_CHECK(resident.capacity >= current.capacity, where, "resident.capacity (= {}) < current.capacity (= {})",
               resident.capacity, current.capacity);
  KVSIFT_CHECK(resident.capacity <= kMaxResidentSlots, where, "resident.capacity (= {}) exceeds {} slots",
               resident.capacity, kMaxResidentSlots);
  if (contents != MemorySpace::host) return;
  for (std::int32_t b = 0; b < src.batch(); ++b) {
    for (std::int32_t h = 0; h < src.kv_heads(); ++h) {
      check_selection_count(where, "previous", b, h, previous.count(b, h), previous.capacity);
      check_selection_count(where, "current", b, h, current.count(b, h), current.capacity);
      KVSIFT_CHECK(previous.count(b, h) <= resident.capacity, where,
                   "previous.counts (= {}) at batch {}, kv_head {} exceeds resident.capacity (= {})",
                   previous.count(b, h), b, h, resident.capacity);
      check_ascending_row(where, "previous", b, h, previous.row(b, h), previous.count(b, h), src.seq_len(b));
      check_ascending_row(where, "current", b, h, current.row(b, h), current.count(b, h), src.seq_len(b));
      const std::int32_t* slots = previous_slots + previous.row_index(b, h) * previous.capacity;
      for (std::int32_t i = 0; i < previous.count(b, h); ++i) {
        const std::int32_t s = slots[i];
        KVSIFT_CHECK(s >= 0 && s < resident.capacity, where,
                     "previous_slots[{}] (= {}) at batch {}, kv_head {} is outside [0, resident.capacity = {})", i, s, b,
                     h, resident.capacity);
        const bool repeated = (seen[s / 64] >> (s % 64)) & 1u;
        if (repeated) {
          for (std::int32_t j = 0; j < i; ++j) seen[slots[j] / 64] = 0;
        }
        KVSIFT_CHECK(!repeated, where, "previous_slots[{}] (= {}) at batch {}, kv_head {} repeats an earlier slot", i,
                     s, b, h);
        seen[s / 64] |= std::uint64_t(1) << (s % 64);
      }
      for (std::int32_t i = 0; i < previous.count(b, h); ++i) seen[slots[i] / 64] = 0;
    }
  }
}

}  // namespace kvsift::detail
