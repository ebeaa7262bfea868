#pragma once
/// Query centroids: per (slot, query head) up to `capacity` unit-norm query vectors that stand for a region of
/// the context (CTKVR keeps the last prefill queries and, with its dynamic update, recent decode queries; list l
/// of an inverted-lists view belongs to centroid l). Backend-neutral: the view and the per-entry rules shared by
/// selectors/ctkvr/cpu/query_centroids.hpp and selectors/ctkvr/cuda/query_centroids.hpp (and device code: no fmt here; the argument checks are
/// selectors/ctkvr/detail/query_centroids_checks.hpp).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvsift/core/config.hpp"
#include "kvsift/core/slot_grid.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

/// Centroids [slots, q_heads, capacity, head_dim] (packed) in T; counts [slots]: slot s uses centroids
/// [0, counts[s]). A const T makes both read-only.
template <class T>
struct QueryCentroidsView {
  using count_type = std::conditional_t<std::is_const_v<T>, const std::int32_t, std::int32_t>;

  T* data = nullptr;
  count_type* counts = nullptr;
  std::int32_t slots = 0;
  std::int32_t q_heads = 0;
  std::int32_t capacity = 0;
  std::int32_t head_dim = 0;

  KVSIFT_HOST_DEVICE SlotGrid grid() const { return {slots, q_heads, capacity, head_dim}; }
  KVSIFT_HOST_DEVICE T* row(std::int64_t slot, std::int64_t h, std::int64_t c) const {
    return data + grid().offset(slot, h, c);
  }
  static constexpr std::size_t elements(std::int32_t slots, std::int32_t q_heads, std::int32_t capacity,
                                        std::int32_t head_dim) {
    return SlotGrid{slots, q_heads, capacity, head_dim}.elements();
  }
  constexpr QueryCentroidsView<const T> as_const() const
    requires(!std::is_const_v<T>)
  {
    return {data, counts, slots, q_heads, capacity, head_dim};
  }
};

namespace detail {

/// 1 / |x| for a squared norm, 0 for a zero vector (its cosine to anything is taken as 0, not NaN).
KVSIFT_HOST_DEVICE inline float inverse_norm(float squared_norm) {
  return squared_norm > 0.0f ? 1.0f / sqrtf(squared_norm) : 0.0f;
}

}  // namespace detail
}  // namespace kvsift
