#pragma once
/// The argument checks of the cache operations that the CPU and CUDA twins share (cpu/cache_ops.hpp,
/// cuda/cache_ops.hpp).

#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/validate.hpp"

namespace kvsift::detail {

/// write_step_kv: k and v are [batch, kv_heads, head_dim] of the cache.
template <class T>
void check_step_kv(const char* where, const KVCache<T>& cache, const HeadsView<const T>& k,
                   const HeadsView<const T>& v) {
  validate(k, where, "k");
  validate(v, where, "v");
  KVSIFT_CHECK(k.batch == cache.batch() && k.heads == cache.kv_heads() && k.head_dim == cache.head_dim() &&
                   v.batch == k.batch && v.heads == k.heads && v.head_dim == k.head_dim,
               where, "k [{}, {}, {}] and v [{}, {}, {}] must both be [batch = {}, kv_heads = {}, head_dim = {}]",
               k.batch, k.heads, k.head_dim, v.batch, v.heads, v.head_dim, cache.batch(), cache.kv_heads(),
               cache.head_dim());
}

}  // namespace kvsift::detail
