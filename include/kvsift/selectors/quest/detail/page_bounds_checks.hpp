#pragma once
/// Argument checks of the page-bounds functions, shared by selectors/quest/cpu/page_bounds.hpp and selectors/quest/cuda/page_bounds.hpp so
/// both backends refuse the same inputs in the same words. Shape checks read only the views' fields; content
/// checks (slots, lengths, page ids) read the arrays and run only where they are host memory
/// (MemorySpace::host: the CPU backend). The CUDA backend defines instead what a bad device value does.

#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/selectors/quest/page_bounds_view.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::detail {

/// Alignment of PageBoundsView::data: the CUDA kernels read a page's bounds in 16-byte vectors.
inline constexpr std::uintptr_t kPageBoundsAlignment = 16;

template <class T>
void check_page_bounds_view(const char* where, const PageBoundsView<T>& bounds) {
  check_pointer(where, "bounds", "data", bounds.data);
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(bounds.data) % kPageBoundsAlignment == 0, where,
               "bounds.data ({}) is not {}-byte aligned", static_cast<const void*>(bounds.data), kPageBoundsAlignment);
  check_positive(where, "bounds", "slots", bounds.slots);
  check_positive(where, "bounds", "kv_heads", bounds.kv_heads);
  check_positive(where, "bounds", "max_pages", bounds.max_pages);
  check_positive(where, "bounds", "head_dim", bounds.head_dim);
  check_positive(where, "bounds", "page_size", bounds.page_size);
  // Every element index fits int64 with room to spare (and PageBoundsView::bytes does not overflow).
  const double elements = double(bounds.slots) * bounds.kv_heads * bounds.max_pages * 2.0 * bounds.head_dim;
  KVSIFT_CHECK(elements <= 0x1p62, where, "bounds [{}, {}, {}, 2, {}] has more than 2^62 elements", bounds.slots,
               bounds.kv_heads, bounds.max_pages, bounds.head_dim);
  KVSIFT_CHECK(bounds.max_tokens() <= INT32_MAX, where,
               "bounds.max_pages * page_size (= {} * {}) exceeds 2^31 - 1 tokens", bounds.max_pages, bounds.page_size);
}

/// slots[b] of every batch row in [0, bounds.slots); with `distinct`, no slot twice (two rows writing one
/// slot's bounds would race).
inline void check_slots(const char* where, const std::int32_t* slots, std::int32_t batch, std::int32_t slot_count,
                        bool distinct) {
  for (std::int32_t b = 0; b < batch; ++b) {
    KVSIFT_CHECK(slots[b] >= 0 && slots[b] < slot_count, where, "slots[{}] (= {}) is outside [0, bounds.slots = {})", b,
                 slots[b], slot_count);
    for (std::int32_t other = 0; distinct && other < b; ++other) {
      KVSIFT_CHECK(slots[other] != slots[b], where, "slots[{}] (= {}) repeats slots[{}]: each batch row owns its slot",
                   b, slots[b], other);
    }
  }
}

/// build_page_bounds and append_page_bounds.
template <class T, KVCacheView KV>
void check_page_bounds_update(const char* where, const KV& kv, const std::int32_t* slots,
                              const PageBoundsView<T>& bounds, MemorySpace contents) {
  validate(kv, where, "kv", contents);
  check_page_bounds_view(where, bounds);
  KVSIFT_CHECK(kv.kv_heads == bounds.kv_heads, where, "kv.kv_heads (= {}) != bounds.kv_heads (= {})", kv.kv_heads,
               bounds.kv_heads);
  KVSIFT_CHECK(kv.head_dim == bounds.head_dim, where, "kv.head_dim (= {}) != bounds.head_dim (= {})", kv.head_dim,
               bounds.head_dim);
  KVSIFT_CHECK(slots != nullptr, where, "slots is a null pointer");
  if (contents != MemorySpace::host) return;
  check_slots(where, slots, kv.batch, bounds.slots, true);
  for (std::int32_t b = 0; b < kv.batch; ++b) {
    KVSIFT_CHECK(kv.seq_len(b) <= bounds.max_tokens(), where,
                 "kv.seq_len({}) (= {}) exceeds the tokens bounds.max_pages * page_size (= {} * {}) covers", b,
                 kv.seq_len(b), bounds.max_pages, bounds.page_size);
  }
}

template <class T>
void check_page_scores(const char* where, const QueryView<const T>& q, const PageBoundsView<const T>& bounds,
                       const std::int32_t* slots, const std::int32_t* lengths, const AttentionWindow& window,
                       const MatrixView<float>& scores, const std::int32_t* page_counts, MemorySpace contents) {
  validate(q, where, "q");
  check_page_bounds_view(where, bounds);
  validate(scores, where, "scores");
  validate(window, where, "window");
  KVSIFT_CHECK(q.head_dim == bounds.head_dim, where, "q.head_dim (= {}) != bounds.head_dim (= {})", q.head_dim,
               bounds.head_dim);
  KVSIFT_CHECK(q.heads % bounds.kv_heads == 0, where, "q.heads (= {}) is not a multiple of bounds.kv_heads (= {})",
               q.heads, bounds.kv_heads);
  KVSIFT_CHECK(scores.rows == std::int64_t(q.batch) * bounds.kv_heads, where,
               "scores.rows (= {}) != q.batch * bounds.kv_heads (= {} * {})", scores.rows, q.batch, bounds.kv_heads);
  KVSIFT_CHECK(slots != nullptr, where, "slots is a null pointer");
  KVSIFT_CHECK(lengths != nullptr, where, "lengths is a null pointer");
  KVSIFT_CHECK(page_counts != nullptr, where, "page_counts is a null pointer");
  if (contents != MemorySpace::host) return;
  check_slots(where, slots, q.batch, bounds.slots, false);
  for (std::int32_t b = 0; b < q.batch; ++b) {
    KVSIFT_CHECK(lengths[b] >= 0 && lengths[b] <= bounds.max_tokens(), where,
                 "lengths[{}] (= {}) is outside [0, bounds.max_pages * page_size = {}]", b, lengths[b],
                 bounds.max_tokens());
    KVSIFT_CHECK(page_count(lengths[b], bounds.page_size) <= scores.cols, where,
                 "lengths[{}] (= {}) has {} pages, more than scores.cols (= {})", b, lengths[b],
                 page_count(lengths[b], bounds.page_size), scores.cols);
  }
}

/// select_pages, on both backends: page_scores' arguments but the scores, the planned pages per sequence, the
/// pages chosen per row, and out. The
/// contents are checked by the primitives that the CPU composes; the CUDA kernel defines what a bad device value
/// does (selectors/quest/cuda/page_bounds.hpp).
template <class T>
void check_select_pages(const char* where, const QueryView<const T>& q, const PageBoundsView<const T>& bounds,
                        const std::int32_t* slots, const std::int32_t* lengths, const AttentionWindow& window,
                        std::int32_t max_pages, std::int32_t pages_per_row, PagesOut what,
                        const SelectionView& out) {
  validate(q, where, "q");
  check_page_bounds_view(where, bounds);
  validate(window, where, "window");
  KVSIFT_CHECK(q.head_dim == bounds.head_dim, where, "q.head_dim (= {}) != bounds.head_dim (= {})", q.head_dim,
               bounds.head_dim);
  KVSIFT_CHECK(q.heads % bounds.kv_heads == 0, where, "q.heads (= {}) is not a multiple of bounds.kv_heads (= {})",
               q.heads, bounds.kv_heads);
  KVSIFT_CHECK(slots != nullptr, where, "slots is a null pointer");
  KVSIFT_CHECK(lengths != nullptr, where, "lengths is a null pointer");
  KVSIFT_CHECK(max_pages > 0 && max_pages <= bounds.max_pages, where,
               "max_pages (= {}) is outside [1, bounds.max_pages = {}]", max_pages, bounds.max_pages);
  KVSIFT_CHECK(pages_per_row > 0, where, "pages_per_row (= {}) must be positive", pages_per_row);
  check_pointer(where, "out", "indices", out.indices);
  check_pointer(where, "out", "counts", out.counts);
  KVSIFT_CHECK(out.batch == q.batch && out.kv_heads == bounds.kv_heads, where,
               "out is [batch = {}, kv_heads = {}], q.batch = {} and bounds.kv_heads = {}", out.batch, out.kv_heads,
               q.batch, bounds.kv_heads);
  if (what == PagesOut::pages) {
    KVSIFT_CHECK(out.capacity >= pages_per_row, where, "out.capacity (= {}) < pages_per_row (= {}) (out lists pages)",
                 out.capacity, pages_per_row);
    KVSIFT_CHECK(out.log_weights == nullptr, where, "out.log_weights must be null: pages have no log-weights");
  } else {
    KVSIFT_CHECK(std::int64_t(out.capacity) >= std::int64_t(pages_per_row) * bounds.page_size, where,
                 "out.capacity (= {}) < pages_per_row * page_size (= {} * {})", out.capacity, pages_per_row,
                 bounds.page_size);
  }
}

inline void check_expand_pages(const char* where, const SelectionView& pages, std::int32_t page_size,
                               const std::int32_t* lengths, const AttentionWindow& window, const SelectionView& out,
                               MemorySpace contents) {
  check_pointer(where, "pages", "indices", pages.indices);
  check_pointer(where, "pages", "counts", pages.counts);
  check_positive(where, "pages", "batch", pages.batch);
  check_positive(where, "pages", "kv_heads", pages.kv_heads);
  check_positive(where, "pages", "capacity", pages.capacity);
  check_pointer(where, "out", "indices", out.indices);
  check_pointer(where, "out", "counts", out.counts);
  KVSIFT_CHECK(page_size > 0, where, "page_size (= {}) must be positive", page_size);
  KVSIFT_CHECK(lengths != nullptr, where, "lengths is a null pointer");
  validate(window, where, "window");
  KVSIFT_CHECK(out.batch == pages.batch && out.kv_heads == pages.kv_heads, where,
               "out is [batch = {}, kv_heads = {}], pages [batch = {}, kv_heads = {}]", out.batch, out.kv_heads,
               pages.batch, pages.kv_heads);
  KVSIFT_CHECK(std::int64_t(out.capacity) >= std::int64_t(pages.capacity) * page_size, where,
               "out.capacity (= {}) < pages.capacity * page_size (= {} * {})", out.capacity, pages.capacity,
               page_size);
  if (contents != MemorySpace::host) return;
  for (std::int32_t b = 0; b < pages.batch; ++b) {
    KVSIFT_CHECK(lengths[b] >= 0, where, "lengths[{}] (= {}) is negative", b, lengths[b]);
    const std::int64_t page_limit = page_count(lengths[b], page_size);
    for (std::int32_t g = 0; g < pages.kv_heads; ++g) {
      check_selection_count(where, "pages", b, g, pages.count(b, g), pages.capacity);
      const std::int32_t* row = pages.row(b, g);
      for (std::int32_t i = 0; i < pages.count(b, g); ++i) {
        KVSIFT_CHECK(row[i] >= 0 && row[i] < page_limit, where,
                     "pages.indices[{}] (= {}) at batch {}, kv_head {} is outside [0, pages of lengths[{}] = {})", i,
                     row[i], b, g, b, page_limit);
        KVSIFT_CHECK(i == 0 || row[i] > row[i - 1], where,
                     "pages.indices[{}] (= {}) at batch {}, kv_head {} does not exceed pages.indices[{}] (= {}): "
                     "page ids must be ascending and distinct",
                     i, row[i], b, g, i - 1, row[i - 1]);
      }
    }
  }
}

}  // namespace kvsift::detail
