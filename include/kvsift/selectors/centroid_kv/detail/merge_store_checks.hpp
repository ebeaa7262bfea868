#pragma once
/// The argument checks the merge store's CPU and CUDA twins share (src/selectors/centroid_kv/cpu/merge_store.cpp,
/// src/selectors/centroid_kv/cuda/merge_store.cpp): the same refusals with the same words on both backends. Host code only (fmt), so
/// selectors/centroid_kv/merge_store.hpp stays includable by kernels. Values in the backend's memory (counts, slots) are checked by
/// each backend where it can read them.

#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/selectors/centroid_kv/merge_store.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::detail {

/// The checks every merge-store primitive makes of a store view: non-null arrays, positive shapes, head_dim <= 256
/// (the CPU matching's tile bound; the kernels' too).
template <class T>
void check_merge_store(const char* where, const char* name, const MergeStoreView<T>& store) {
  KVSIFT_CHECK(store.k != nullptr && store.v != nullptr && store.order != nullptr && store.degree != nullptr &&
                   store.log_degree != nullptr && store.count != nullptr,
               where, "{}: every array (k, v, order, degree, log_degree, count) must be non-null", name);
  KVSIFT_CHECK(store.slots > 0 && store.kv_heads > 0 && store.capacity > 0, where,
               "{}: slots (= {}), kv_heads (= {}) and capacity (= {}) must be positive", name, store.slots,
               store.kv_heads, store.capacity);
  KVSIFT_CHECK(store.head_dim > 0 && store.head_dim <= kMergeMaxHeadDim, where, "{}: head_dim (= {}) is outside [1, {}]",
               name, store.head_dim, kMergeMaxHeadDim);
}

/// The checks of a round's parameters.
inline void check_merge_round_params(const char* where, const MergeRoundParams& p) {
  KVSIFT_CHECK(p.sinks >= 0 && p.recent >= 0, where, "params.sinks (= {}) and params.recent (= {}) must be >= 0",
               p.sinks, p.recent);
  KVSIFT_CHECK(p.chunk >= 2, where, "params.chunk (= {}) must be >= 2 (a chunk pairs A with B entries)", p.chunk);
  KVSIFT_CHECK(p.ratio >= 0.0f && p.ratio <= 1.0f, where, "params.ratio (= {}) is outside [0, 1]", p.ratio);
  KVSIFT_CHECK(p.trigger >= 1, where, "params.trigger (= {}) must be >= 1", p.trigger);
}

/// Host slots of a call that writes the rows it names (merge_round, merge_store_append, merge_store_copy's dst,
/// CentroidKV::prepare): no slot twice, else two rows (threads, CTAs) would merge or append into one store row at
/// once. Quadratic in batch, without allocation (batch is a step's, at most a few hundred). CUDA's primitives read
/// their slots on the device only and trust the step's (as every selector does).
inline void check_distinct_slots(const char* where, const char* name, const std::int32_t* slots, std::int32_t batch) {
  for (std::int32_t b = 1; b < batch; ++b) {
    for (std::int32_t a = 0; a < b; ++a) {
      KVSIFT_CHECK(slots[a] != slots[b], where, "{}[{}] and {}[{}] are both slot {}: each row of a call must be distinct",
                   name, a, name, b, slots[b]);
    }
  }
}

/// A cache read into (load) or appended from (append) a store: the store's kv_heads and head_dim, a batch.
template <class T, class U>
void check_cache_matches(const char* where, const KVCache<const T>& cache, const MergeStoreView<U>& store) {
  KVSIFT_CHECK(cache.kv_heads() == store.kv_heads && cache.head_dim() == store.head_dim, where,
               "cache kv_heads (= {}) / head_dim (= {}) != the store's ({}, {})", cache.kv_heads(), cache.head_dim(),
               store.kv_heads, store.head_dim);
  KVSIFT_CHECK(cache.batch() > 0, where, "cache batch (= {}) must be positive", cache.batch());
}

/// merge_store_evict's store, batch and per-slot arrays.
template <class T>
void check_merge_store_evict(const char* where, const MergeStoreView<T>& store, std::int32_t batch,
                             const std::int32_t* budgets, const std::int32_t* sinks) {
  check_merge_store(where, "store", store);
  KVSIFT_CHECK(batch > 0, where, "batch (= {}) must be positive", batch);
  KVSIFT_CHECK(budgets != nullptr && sinks != nullptr, where, "budgets and sinks must be non-null");
}

/// merge_store_copy's shapes: two stores of the same kv_heads and head_dim, a batch.
template <class T, class U>
void check_merge_store_copy(const char* where, const MergeStoreView<T>& src, const MergeStoreView<U>& dst,
                            std::int32_t batch) {
  check_merge_store(where, "src", src);
  check_merge_store(where, "dst", dst);
  KVSIFT_CHECK(src.kv_heads == dst.kv_heads && src.head_dim == dst.head_dim, where,
               "src kv_heads (= {}) / head_dim (= {}) != dst's ({}, {})", src.kv_heads, src.head_dim, dst.kv_heads,
               dst.head_dim);
  KVSIFT_CHECK(batch > 0, where, "batch (= {}) must be positive", batch);
}

/// merge_store_selection's store and output: log-weights, the store's kv_heads, room for its capacity.
template <class T>
void check_merge_store_selection(const char* where, const MergeStoreView<T>& store, const SelectionView& out) {
  check_merge_store(where, "store", store);
  KVSIFT_CHECK(out.indices != nullptr && out.counts != nullptr && out.log_weights != nullptr, where,
               "out.indices, out.counts and out.log_weights must be non-null");
  KVSIFT_CHECK(out.batch > 0 && out.kv_heads == store.kv_heads && out.capacity >= store.capacity, where,
               "out [batch = {}, kv_heads = {}, capacity = {}] must have batch > 0, the store's kv_heads (= {}) and "
               "capacity >= the store's (= {})",
               out.batch, out.kv_heads, out.capacity, store.kv_heads, store.capacity);
}

}  // namespace kvsift::detail
