#pragma once
// A CtkvrProblem's sequence on the device, as the CUDA CTKVR and CSAttention tests prepare and decode it: its cache
// contiguous or in shuffled NHD pages of 16 tokens (the page table grown by the engine each step), its prefill
// queries and its slot.
#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "ctkvr_problem.hpp"
#include "cuda/gpu_test.hpp"

namespace kvsift::test {

struct CtkvrDeviceCache {
  static constexpr std::int32_t kPage = 16;

  /// The problem's keys and values uploaded (paged: in pages shuffled by `engine`), its length p.length.
  CtkvrDeviceCache(const CtkvrProblem& p, bool paged_layout, std::mt19937_64& engine)
      : paged(paged_layout), pages(p.capacity / kPage), k(p.k.size()), v(p.v.size()), queries(p.prefill_q), length(1),
        slot(std::vector<std::int32_t>{0}), indptr(2), indices(std::size_t(pages)), last(1), order(std::size_t(pages)) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), engine);
    indices.upload(order);
    std::vector<half> k_host(p.k.size()), v_host(p.v.size());
    for (std::int32_t h = 0; h < p.kv_heads; ++h) {
      for (std::int32_t t = 0; t < p.capacity; ++t) {
        const std::size_t from = (std::size_t(h) * p.capacity + t) * p.head_dim;
        const std::size_t to =
            paged ? ((std::size_t(order[t / kPage]) * kPage + t % kPage) * p.kv_heads + h) * p.head_dim : from;
        std::copy_n(p.k.begin() + from, p.head_dim, k_host.begin() + to);
        std::copy_n(p.v.begin() + from, p.head_dim, v_host.begin() + to);
      }
    }
    k.upload(k_host);
    v.upload(v_host);
    grow(p.length);
  }
  /// The engine's length and page table for a sequence of `len` tokens.
  void grow(std::int32_t len) {
    length.upload({len});
    const std::int32_t used = (len + kPage - 1) / kPage;
    indptr.upload({0, used});
    last.upload({len - (used - 1) * kPage});
  }
  KVCache<half> view(const CtkvrProblem& p) const {
    if (!paged) {
      return ContiguousKVView<half>::packed(k.data(), v.data(), 1, p.kv_heads, p.capacity, p.head_dim, length.data());
    }
    return PagedKVView<half>{.k_pages = k.data(), .v_pages = v.data(), .page_indptr = indptr.data(),
                             .page_indices = indices.data(), .last_page_len = last.data(), .batch = 1,
                             .kv_heads = p.kv_heads, .head_dim = p.head_dim, .page_size = kPage, .num_pages = pages,
                             .page_stride = std::int64_t(kPage) * p.kv_heads * p.head_dim,
                             .token_stride = std::int64_t(p.kv_heads) * p.head_dim, .head_stride = p.head_dim};
  }
  /// prepare's inputs: the cache at its current length, slot 0, the problem's prefill queries.
  PrefillInputs<half> prefill(const CtkvrProblem& p) const {
    return {.cache = view(p), .slots = slot.data(),
            .queries = SequenceView<const half>::packed(queries.data(), 1, p.q_heads, p.queries, p.head_dim)};
  }

  bool paged;
  std::int32_t pages;
  DeviceBuffer<half> k, v, queries;
  DeviceBuffer<std::int32_t> length, slot;  // the engine's [1] length; the sequence's slot, 0
  DeviceBuffer<std::int32_t> indptr, indices, last;
  std::vector<std::int32_t> order;
};

}  // namespace kvsift::test
