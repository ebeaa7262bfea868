#pragma once
/// A merge store in host vectors for the merge-store tests (tests/cpu/test_merge_store.cpp,
/// tests/cuda/test_cuda_merge_store.cpp): the CPU primitives' store, and the round trip of the device's.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvsift/selectors/centroid_kv/merge_store.hpp"
#include "workspace_check.hpp"

namespace kvsift::test {

/// Every array starts poisoned with 0xff bytes, as DeviceBuffer::poison: NaN K/V and log-degrees, -1 indices.
template <class T>
struct HostStore {
  std::int32_t slots, kv_heads, capacity, head_dim;
  std::vector<T> k, v;
  std::vector<std::int32_t> order, degree, count;
  std::vector<float> log_degree;

  HostStore(std::int32_t slots_, std::int32_t kv_heads_, std::int32_t capacity_, std::int32_t head_dim_)
      : slots(slots_), kv_heads(kv_heads_), capacity(capacity_), head_dim(head_dim_),
        k(MergeStoreView<T>::kv_elements(slots, kv_heads, capacity, head_dim)), v(k.size()),
        order(MergeStoreView<T>::entries(slots, kv_heads, capacity)), degree(order.size()),
        count(std::size_t(slots) * kv_heads), log_degree(order.size()) {
    poison(k, v, order, degree, count, log_degree);
  }
  MergeStoreView<T> view() {
    return {k.data(), v.data(), order.data(), degree.data(), log_degree.data(), count.data(),
            slots,    kv_heads, capacity,     head_dim};
  }
  std::vector<std::byte> bytes() const { return bytes_of(k, v, order, degree, log_degree, count); }

 private:
  template <class... V>
  static void poison(V&... arrays) {
    (std::memset(arrays.data(), 0xff, arrays.size() * sizeof(arrays[0])), ...);
  }
};

}  // namespace kvsift::test
