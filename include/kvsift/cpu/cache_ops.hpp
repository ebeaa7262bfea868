#pragma once
/// CPU operations on the engine's KV cache that the decode step runs around a selector: each batch row's
/// length, writing a step's new token, and an empty selection. Host memory. cuda/cache_ops.hpp is the twin.

#include <algorithm>
#include <cstdint>

#include "kvsift/core/detail/cache_ops_checks.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cpu {

/// lengths[b] = cache.seq_len(b) for every batch row b (lengths: [cache.batch()]).
template <class T>
void sequence_lengths(const KVCache<const T>& cache, std::int32_t* lengths) {
  for (std::int32_t b = 0; b < cache.batch(); ++b) lengths[b] = cache.seq_len(b);
}

/// Writes each batch row's step token, k and v [batch, kv_heads, head_dim], at position cache.seq_len(b) - 1:
/// the cache's lengths already count the token (the engine grew them, or its page table). A row of length 0
/// has no room and is refused, before any row is written.
template <class T>
void write_step_kv(const KVCache<T>& cache, const HeadsView<const T>& k, const HeadsView<const T>& v) {
  constexpr const char* where = "cpu::write_step_kv";
  kvsift::detail::check_step_kv(where, cache, k, v);
  for (std::int32_t b = 0; b < cache.batch(); ++b) {  // every row first: a refusal writes nothing
    KVSIFT_CHECK(cache.seq_len(b) > 0, where, "cache.seq_len({}) is 0: the cache has no position for the step's token",
                 b);
    KVSIFT_CHECK(cache.seq_len_fits(b), where,
                 "cache.seq_len({}) (= {}) does not fit the cache's storage (contiguous capacity, or the last page's "
                 "length in [1, page_size])",
                 b, cache.seq_len(b));
  }
  for (std::int32_t b = 0; b < cache.batch(); ++b) {
    const std::int32_t t = cache.seq_len(b) - 1;
    for (std::int32_t h = 0; h < cache.kv_heads(); ++h) {
      std::copy_n(k.row(b, h), k.head_dim, cache.k_row(b, h, t));
      std::copy_n(v.row(b, h), v.head_dim, cache.v_row(b, h, t));
    }
  }
}

/// Every row of `out` selects nothing (counts 0).
inline void clear_counts(const SelectionView& out) {
  std::fill_n(out.counts, std::int64_t(out.batch) * out.kv_heads, 0);
}

}  // namespace kvsift::cpu
