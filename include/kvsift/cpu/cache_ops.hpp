#pragma once
/// CPU operations on the engine's KV cache that the decode step runs around a selector: each batch row's
/// length, writing a step's new token, an empty selection, and the first non-finite key (a prepare's check).
/// Host memory. cuda/cache_ops.hpp is the twin.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvsift/core/detail/cache_ops_checks.hpp"
#include "kvsift/core/dtype.hpp"
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
                 "length in [1, page_size], or with seq_lens the pages of the row's page table)",
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

/// The first non-finite key (NaN, +inf or -inf) of the cache's rows, in (b, h, t, i) order: rows b <
/// cache.batch(), kv heads h, tokens t < lengths[b] (a length <= 0 scans nothing; a longer one than row b's
/// storage holds reads past it), channels i < head_dim. Writes out[0..4) = {b, h, t, i} of that element, or four
/// -1 when every scanned key is finite. lengths: [cache.batch()], out: 4 int32; host memory. Stops at the
/// offender; a finite cache is read once, on the calling thread.
template <class T>
void first_nonfinite_key(const KVCache<const T>& cache, const std::int32_t* lengths, std::int32_t* out) {
  constexpr const char* where = "cpu::first_nonfinite_key";
  KVSIFT_CHECK(out != nullptr, where, "out must be non-null");
  KVSIFT_CHECK(cache.batch() <= 0 || lengths != nullptr, where, "lengths must be non-null");
  std::fill_n(out, 4, -1);
  const auto nonfinite = [](T x) {  // exponent all ones
    if constexpr (std::is_same_v<T, half>) return (x.bits & 0x7c00u) == 0x7c00u;
    else if constexpr (std::is_same_v<T, bfloat16>) return (x.bits & 0x7f80u) == 0x7f80u;
    else return !std::isfinite(to_float(x));
  };
  for (std::int32_t b = 0; b < cache.batch(); ++b) {
    for (std::int32_t h = 0; h < cache.kv_heads(); ++h) {
      for (std::int32_t t = 0; t < lengths[b]; ++t) {
        const T* row = cache.k_row(b, h, t);
        const T* bad = std::find_if(row, row + cache.head_dim(), nonfinite);
        if (bad != row + cache.head_dim()) {
          out[0] = b, out[1] = h, out[2] = t, out[3] = std::int32_t(bad - row);
          return;
        }
      }
    }
  }
}

/// Every row of `out` selects nothing (counts 0).
inline void clear_counts(const SelectionView& out) {
  std::fill_n(out.counts, std::int64_t(out.batch) * out.kv_heads, 0);
}

}  // namespace kvsift::cpu
