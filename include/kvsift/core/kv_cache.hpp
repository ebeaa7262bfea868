#pragma once
/// KVCache<T>: the engine's KV cache as one value, contiguous or paged, usable on host and device. Selectors
/// and the decode step read the cache in place through it (no copy of the keys); the primitives they call are
/// templates on the concrete view, reached through visit(), so a selector is instantiated once per storage
/// type, not once per layout.

#include <cstdint>
#include <type_traits>
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
  /// Whether row b's length agrees with its storage: contiguous, seq_len(b) <= capacity; paged by last_page_len, the
  /// last page holds 1 .. page_size tokens (or the row has no pages); paged by seq_lens (the block-table form, or CSR
  /// with seq_lens), the length is >= 0 and its pages are within the row's page-table entries. A length is a device
  /// value the host cannot check: the CUDA step's token write skips a row that fails this rather than write into
  /// another row's memory.
  KVSIFT_HOST_DEVICE bool seq_len_fits(std::int64_t b) const {
    if (!is_paged()) return contiguous.seq_len(b) <= contiguous.capacity;
    if (paged.seq_lens != nullptr) {
      const std::int64_t n = paged.seq_lens[b];
      return n >= 0 && (n + paged.page_size - 1) / paged.page_size <= paged.page_entries(b);
    }
    const bool has_pages = paged.page_indptr[b + 1] > paged.page_indptr[b];
    return !has_pages || (paged.last_page_len[b] >= 1 && paged.last_page_len[b] <= paged.page_size);
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

  /// A writable cache converts to a read-only one (the step writes the token, the selectors read).
  template <class U>
    requires std::is_same_v<T, const U>
  constexpr KVCache(const KVCache<U>& other)  // NOLINT: implicit, as T* converts to const T*
      : layout(other.layout), contiguous(other.contiguous.as_const()), paged(other.paged.as_const()) {}
  /// A writable view converts to a read-only cache directly.
  template <class U>
    requires std::is_same_v<T, const U>
  constexpr KVCache(const ContiguousKVView<U>& view) : KVCache(KVCache<U>(view)) {}  // NOLINT
  template <class U>
    requires std::is_same_v<T, const U>
  constexpr KVCache(const PagedKVView<U>& view) : KVCache(KVCache<U>(view)) {}  // NOLINT

  /// The same cache, read-only.
  constexpr KVCache<const T> as_const() const
    requires(!std::is_const_v<T>)
  {
    return KVCache<const T>(*this);
  }
};

}  // namespace kvsift
