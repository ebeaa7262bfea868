#pragma once
/// Page-bounds problems shared by the CPU tests (tests/cpu/test_page_bounds.cpp, against fp64 and raw-key
/// references) and the CUDA tests (tests/cuda/test_cuda_page_bounds.cpp, against the CPU twin): a cache of random
/// keys exactly representable in T, contiguous and paged (shuffled pages), its batch rows in a random subset of
/// the slots, bounds poisoned with kUntouched; and random page selections for expand_pages.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvsift/selectors/quest/detail/page_bounds_checks.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/selectors/quest/page_bounds_view.hpp"
#include "test_util.hpp"

namespace kvsift::test {

/// What an unwritten bound or score holds: a value no function writes (bounds are key values, which are normal
/// draws of magnitude < 10; scores are sums of products of those).
constexpr float kUntouched = -7777.0f;

template <class T>
struct PageBoundsProblem {
  HostKV kv;  ///< keys as floats, already rounded to T
  HostPagedKV paged;
  std::vector<T> k, v, paged_k, paged_v;
  std::vector<std::int32_t> slots;  ///< batch row b's slot
  std::int32_t slot_count, max_pages, page_size;
  std::vector<T> bounds;  ///< [slot_count, kv_heads, max_pages, 2, head_dim], kUntouched

  /// page_size: the bounds' pages; cache_page_size and hnd: the paged cache's; extra_slots: slots no row uses.
  PageBoundsProblem(Random& rng, const std::vector<std::int32_t>& lens, std::int32_t kv_heads, std::int32_t head_dim,
                    std::int32_t page_size_, std::int32_t cache_page_size, bool hnd, std::int32_t extra_slots)
      : kv(make_kv(rng, lens, kv_heads, head_dim)),
        paged(kv, cache_page_size, hnd, rng),
        k(to_storage<T>(kv.k)),
        v(to_storage<T>(kv.v)),
        paged_k(to_storage<T>(paged.k_pages)),
        paged_v(to_storage<T>(paged.v_pages)),
        slot_count(kv.batch + extra_slots),
        max_pages(std::int32_t(detail::page_count(kv.capacity, page_size_))),
        page_size(page_size_) {
    slots.resize(slot_count);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng.engine);
    slots.resize(kv.batch);
    bounds.assign(PageBoundsView<T>::bytes(slot_count, kv_heads, max_pages, head_dim) / sizeof(T),
                  from_float<T>(kUntouched));
  }

  static HostKV make_kv(Random& rng, const std::vector<std::int32_t>& lens, std::int32_t kv_heads,
                        std::int32_t head_dim) {
    const std::int32_t capacity = std::max(1, *std::max_element(lens.begin(), lens.end()));
    HostKV kv(rng, std::int32_t(lens.size()), kv_heads, capacity, head_dim, lens);
    for (float& x : kv.k) x = to_float(from_float<T>(x));
    return kv;
  }
  /// The contiguous cache over K/V storage and lengths given (the host's, or device copies).
  ContiguousKVView<const T> contiguous(const T* k_data, const T* v_data, const std::int32_t* seq_lens) const {
    const auto f = kv.view();
    return {k_data, v_data, seq_lens, f.batch, f.kv_heads, f.capacity, f.head_dim,
            f.batch_stride, f.head_stride, f.token_stride};
  }
  ContiguousKVView<const T> contiguous() const { return contiguous(k.data(), v.data(), kv.seq_lens.data()); }
  /// The paged cache over pages and tables given (the host's, or device copies).
  PagedKVView<const T> paged_view(const T* k_pages, const T* v_pages, const std::int32_t* indptr,
                                  const std::int32_t* indices, const std::int32_t* last) const {
    const auto& f = paged.view;
    return {k_pages, v_pages, indptr, indices, last, f.batch, f.kv_heads, f.head_dim, f.page_size, f.num_pages,
            f.page_stride, f.token_stride, f.head_stride};
  }
  PagedKVView<const T> paged_view() const {
    return paged_view(paged_k.data(), paged_v.data(), paged.indptr.data(), paged.indices.data(),
                      paged.last_len.data());
  }
  PageBoundsView<T> view(T* data) {
    return PageBoundsView<T>::packed(data, slot_count, kv.kv_heads, max_pages, kv.head_dim, page_size);
  }
  PageBoundsView<T> view() { return view(bounds.data()); }
  /// The batch row in slot s, or -1.
  std::int32_t row_of(std::int32_t s) const {
    const auto it = std::find(slots.begin(), slots.end(), s);
    return it == slots.end() ? -1 : std::int32_t(it - slots.begin());
  }
};

/// Ascending random page ids per selection row, up to `capacity` of each row's pages.
inline HostSelection random_pages(Random& rng, const std::vector<std::int32_t>& lens, std::int32_t kv_heads,
                                  std::int32_t capacity, std::int32_t page_size) {
  HostSelection pages(std::int32_t(lens.size()), kv_heads, capacity, false);
  for (std::int32_t b = 0; b < std::int32_t(lens.size()); ++b) {
    const std::int32_t total = std::int32_t(detail::page_count(lens[b], page_size));
    for (std::int32_t g = 0; g < kv_heads; ++g) {
      std::vector<std::int32_t> ids(total);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng.engine);
      ids.resize(std::min(total, rng.uniform_int(0, capacity)));
      std::sort(ids.begin(), ids.end());
      std::copy(ids.begin(), ids.end(), pages.view.row(b, g));
      pages.view.counts[pages.view.row_index(b, g)] = std::int32_t(ids.size());
    }
  }
  return pages;
}

}  // namespace kvsift::test
