#pragma once
/// KVCache<T>: the engine's KV cache as one value, contiguous or paged, usable on host and device. Selectors
/// and the decode step read the cache in place through it (no copy of the keys); the primitives they call are
/// templates on the concrete view, reached through visit(), so a selector is instantiated once per storage
/// type, not once per layout.

#include <cstdint>
#include <utility>

#include "kvsift/core/config.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

enum class KVLayout : std::uint8_t { contiguous, paged };

template <class T>
struct KVCache {
  KVLayout layout = KVLayout::contiguous;
  ContiguousKVView<T> contiguous{};  ///< valid when layout == contiguous
  PagedKVView<T> paged{};            ///< valid when layout == paged

  constexpr KVCache() = default;
  constexpr KVCache(const ContiguousKVView<T>& view) : layout(KVLayout::contiguous), contiguous(view) {}  // NOLINT
  constexpr KVCache(const PagedKVView<T>& view) : layout(KVLayout::paged), paged(view) {}                // NOLINT

  KVSIFT_HOST_DEVICE bool is_paged() const { return layout == KVLayout::paged; }
  KVSIFT_HOST_DEVICE std::int32_t batch() const { return is_paged() ? paged.batch : contiguous.batch; }
  KVSIFT_HOST_DEVICE std::int32_t kv_heads() const { return is_paged() ? paged.kv_heads : contiguous.kv_heads; }
  KVSIFT_HOST_DEVICE std::int32_t head_dim() const { return is_paged() ? paged.head_dim : contiguous.head_dim; }
  /// Reads the cache's own length arrays: memory of the cache's side (device for a device cache).
  KVSIFT_HOST_DEVICE std::int32_t seq_len(std::int64_t b) const {
    return is_paged() ? paged.seq_len(b) : contiguous.seq_len(b);
  }
  KVSIFT_HOST_DEVICE T* k_row(std::int64_t b, std::int64_t h, std::int64_t t) const {
    return is_paged() ? paged.k_row(b, h, t) : contiguous.k_row(b, h, t);
  }
  KVSIFT_HOST_DEVICE T* v_row(std::int64_t b, std::int64_t h, std::int64_t t) const {
    return is_paged() ? paged.v_row(b, h, t) : contiguous.v_row(b, h, t);
  }

  /// Calls f with the concrete view (ContiguousKVView<T> or PagedKVView<T>): host code dispatching to a
  /// primitive instantiated per layout.
  template <class F>
  decltype(auto) visit(F&& f) const {
    return is_paged() ? std::forward<F>(f)(paged) : std::forward<F>(f)(contiguous);
  }

  /// The same cache, read-only.
  constexpr KVCache<const T> as_const() const
    requires(!std::is_const_v<T>)
  {
    KVCache<const T> c;
    c.layout = layout;
    c.contiguous = {contiguous.k,         contiguous.v,            contiguous.seq_lens,     contiguous.batch,
                    contiguous.kv_heads,  contiguous.capacity,     contiguous.head_dim,     contiguous.batch_stride,
                    contiguous.head_stride, contiguous.token_stride};
    c.paged = {paged.k_pages,  paged.v_pages,  paged.page_indptr, paged.page_indices, paged.last_page_len,
               paged.batch,    paged.kv_heads, paged.head_dim,    paged.page_size,    paged.num_pages,
               paged.page_stride, paged.token_stride, paged.head_stride};
    return c;
  }
};

}  // namespace kvsift
