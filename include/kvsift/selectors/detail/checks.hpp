#pragma once
/// Checks every selector makes of its limits and of each call's inputs, written once so that all of them
/// refuse bad inputs with the same messages.

#include <cstdint>
#include <span>

#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift::detail {

inline void check_limits(const char* where, const SelectorLimits& limits) {
  KVSIFT_CHECK(limits.max_slots > 0, where, "limits.max_slots (= {}) must be positive", limits.max_slots);
  KVSIFT_CHECK(limits.max_tokens > 0, where, "limits.max_tokens (= {}) must be positive", limits.max_tokens);
  KVSIFT_CHECK(limits.kv_heads > 0 && limits.q_heads > 0 && limits.q_heads % limits.kv_heads == 0, where,
               "limits.q_heads (= {}) must be a positive multiple of limits.kv_heads (= {})", limits.q_heads,
               limits.kv_heads);
  KVSIFT_CHECK(limits.head_dim > 0, where, "limits.head_dim (= {}) must be positive", limits.head_dim);
}

/// A step's shape against the limits (workspace queries).
inline void check_shape(const char* where, const SelectorLimits& limits, const SelectShape& shape) {
  KVSIFT_CHECK(shape.batch > 0 && shape.batch <= limits.max_slots, where,
               "shape.batch (= {}) is outside [1, limits.max_slots = {}]", shape.batch, limits.max_slots);
  KVSIFT_CHECK(shape.q_heads == limits.q_heads && shape.kv_heads == limits.kv_heads &&
                   shape.head_dim == limits.head_dim,
               where, "shape heads/head_dim ({}, {}, {}) != limits ({}, {}, {})", shape.q_heads, shape.kv_heads,
               shape.head_dim, limits.q_heads, limits.kv_heads, limits.head_dim);
  KVSIFT_CHECK(shape.max_seq_len >= 0 && shape.max_seq_len <= limits.max_tokens, where,
               "shape.max_seq_len (= {}) is outside [0, limits.max_tokens = {}]", shape.max_seq_len,
               limits.max_tokens);
}

/// The cache of a call against the limits; returns its batch. Slots in host memory are checked too (on the
/// device they are trusted, as every device-side value).
template <class T>
std::int32_t check_cache(const char* where, const SelectorLimits& limits, const KVCache<const T>& cache,
                         const std::int32_t* slots, MemorySpace memory) {
  KVSIFT_CHECK(cache.batch() > 0 && cache.batch() <= limits.max_slots, where,
               "cache batch (= {}) is outside [1, limits.max_slots = {}]", cache.batch(), limits.max_slots);
  KVSIFT_CHECK(cache.kv_heads() == limits.kv_heads && cache.head_dim() == limits.head_dim, where,
               "cache kv_heads (= {}) / head_dim (= {}) != limits ({}, {})", cache.kv_heads(), cache.head_dim(),
               limits.kv_heads, limits.head_dim);
  KVSIFT_CHECK(slots != nullptr, where, "slots must be non-null");
  if (memory == MemorySpace::host) {
    for (std::int32_t b = 0; b < cache.batch(); ++b) {
      KVSIFT_CHECK(slots[b] >= 0 && slots[b] < limits.max_slots, where,
                   "slots[{}] (= {}) is outside [0, limits.max_slots = {})", b, slots[b], limits.max_slots);
    }
  }
  return cache.batch();
}

/// A select call's query and output against the limits and the cache; capacity: the selector's.
template <class T>
void check_select(const char* where, const SelectorLimits& limits, const SelectInputs<T>& in,
                  const SelectionView& out, std::int32_t capacity, MemorySpace memory) {
  const std::int32_t batch = check_cache(where, limits, in.cache, in.slots, memory);
  validate(in.q, where, "in.q");
  KVSIFT_CHECK(in.q.batch == batch && in.q.heads == limits.q_heads && in.q.head_dim == limits.head_dim, where,
               "in.q [{}, {}, {}] != [batch = {}, q_heads = {}, head_dim = {}]", in.q.batch, in.q.heads,
               in.q.head_dim, batch, limits.q_heads, limits.head_dim);
  KVSIFT_CHECK(in.lengths != nullptr, where, "in.lengths must be non-null");
  validate(in.attention.window, where, "in.attention.window");
  KVSIFT_CHECK(out.counts != nullptr && (out.indices != nullptr || out.capacity == 0), where,
               "out.counts, and out.indices unless out.capacity is 0, must be non-null");
  KVSIFT_CHECK(out.batch == batch && out.kv_heads == limits.kv_heads, where,
               "out [batch = {}, kv_heads = {}] != [{}, {}]", out.batch, out.kv_heads, batch, limits.kv_heads);
  KVSIFT_CHECK(out.capacity >= capacity, where, "out.capacity (= {}) is smaller than the selector's capacity (= {})",
               out.capacity, capacity);
}

/// The token columns of a select workspace sized for a bound on the sequences' lengths (SelectShape::max_seq_len
/// in a query, SelectInputs::max_seq_len in select: one function, so that the two cannot disagree).
/// name: the argument's name, for the refusal.
inline std::int32_t planned_tokens(const char* where, const char* name, const SelectorLimits& limits,
                                   std::int32_t max_seq_len) {
  KVSIFT_CHECK(max_seq_len >= 0 && max_seq_len <= limits.max_tokens, where,
               "{} (= {}) is outside [0, limits.max_tokens = {}]", name, max_seq_len, limits.max_tokens);
  return max_seq_len > 0 ? max_seq_len : limits.max_tokens;
}

}  // namespace kvsift::detail
