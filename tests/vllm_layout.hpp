#pragma once
/// vLLM's paged KV cache in host memory, built as vLLM lays it out, for the tests of PagedKVView's block-table form
/// (core/views.hpp): a contiguous cache's tokens copied into blocks of block_size tokens with
/// - NHD, K and V separate: key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_size];
/// - NHD interleaved (vLLM's FlashInfer backend): kv_cache [num_blocks, 2, block_size, num_kv_heads, head_size];
/// - HND: [num_blocks, num_kv_heads, block_size, head_size] each;
/// - HND interleaved: [num_blocks, 2, num_kv_heads, block_size, head_size];
/// block_tables [batch, max_blocks] (int32; each row's blocks in order, then garbage) and seq_lens [batch].
/// Element addresses are computed here from those shapes, independently of the view's strides. Blocks are assigned
/// in shuffled order, a few are left unused, and every element that holds no token is NaN.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"
#include "test_util.hpp"

namespace kvsift::test {

enum class VllmLayout { nhd, nhd_interleaved, hnd, hnd_interleaved };

inline const char* vllm_layout_name(VllmLayout layout) {
  switch (layout) {
    case VllmLayout::nhd: return "NHD";
    case VllmLayout::nhd_interleaved: return "NHD, K and V interleaved";
    case VllmLayout::hnd: return "HND";
    case VllmLayout::hnd_interleaved: return "HND, K and V interleaved";
  }
  return "?";
}
constexpr VllmLayout kVllmLayouts[] = {VllmLayout::nhd, VllmLayout::nhd_interleaved, VllmLayout::hnd,
                                       VllmLayout::hnd_interleaved};

template <class T>
struct VllmCache {
  VllmLayout layout;
  std::int32_t batch, kv_heads, head_dim, block_size, max_blocks, num_blocks;
  std::vector<T> key_cache, value_cache;  ///< interleaved layouts: key_cache is kv_cache, value_cache is empty
  std::vector<std::int32_t> block_tables, seq_lens;

  /// The tokens [0, src.seq_len(b)) of every row of `src`; each block-table row has room for `room` tokens
  /// (>= every length; 0: src.capacity) plus `extra_entries` entries, the blocks past a row's length garbage.
  VllmCache(const ContiguousKVView<const T>& src, std::int32_t block_size_, VllmLayout layout_, Random& rng,
            std::int32_t room = 0, std::int32_t extra_entries = 2)
      : layout(layout_), batch(src.batch), kv_heads(src.kv_heads), head_dim(src.head_dim), block_size(block_size_) {
    max_blocks = blocks_of(room > 0 ? room : src.capacity) + extra_entries;
    std::int32_t used = 0;
    for (std::int32_t b = 0; b < batch; ++b) {
      seq_lens.push_back(src.seq_len(b));
      used += blocks_of(seq_lens.back());
    }
    num_blocks = used + 5;  // unused blocks, so that the ids do not simply cover [0, num_blocks)
    std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng.engine);
    block_tables.resize(std::size_t(batch) * max_blocks);
    std::size_t next = 0;
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t i = 0; i < max_blocks; ++i) {
        std::int32_t& entry = block_tables[std::size_t(b) * max_blocks + i];
        entry = i < blocks_of(seq_lens[b]) ? ids[next++] : garbage(rng);
      }
    }
    const std::size_t elements = std::size_t(num_blocks) * block_size * kv_heads * head_dim;
    const T nan = from_float<T>(std::numeric_limits<float>::quiet_NaN());
    key_cache.assign(interleaved() ? 2 * elements : elements, nan);
    value_cache.assign(interleaved() ? 0 : elements, nan);
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t h = 0; h < kv_heads; ++h) {
        for (std::int32_t t = 0; t < seq_lens[b]; ++t) {
          std::copy_n(src.k_row(b, h, t), head_dim, k_at(b, h, t));
          std::copy_n(src.v_row(b, h, t), head_dim, v_at(b, h, t));
        }
      }
    }
  }

  static T* data_or_null(std::vector<T>& x) { return x.empty() ? nullptr : x.data(); }
  bool interleaved() const { return layout == VllmLayout::nhd_interleaved || layout == VllmLayout::hnd_interleaved; }
  bool hnd() const { return layout == VllmLayout::hnd || layout == VllmLayout::hnd_interleaved; }
  std::int32_t blocks_of(std::int32_t tokens) const { return (tokens + block_size - 1) / block_size; }
  /// A value of an unused block-table entry: out of range or any block, as vLLM leaves it.
  std::int32_t garbage(Random& rng) const {
    switch (rng.uniform_int(0, 3)) {
      case 0: return -1;
      case 1: return std::numeric_limits<std::int32_t>::max();
      case 2: return rng.uniform_int(std::numeric_limits<std::int32_t>::min(), -2);
      default: return rng.uniform_int(num_blocks, num_blocks + 1000);
    }
  }

  /// The element of (block, slot in it, kv head, channel 0), of V when `value`, from vLLM's tensor shapes.
  std::size_t element(std::int32_t block, std::int32_t slot, std::int32_t h, bool value) const {
    const std::size_t n = std::size_t(block), s = std::size_t(slot), g = std::size_t(h), bs = std::size_t(block_size),
                      kvh = std::size_t(kv_heads), d = std::size_t(head_dim), kv = value ? 1 : 0;
    switch (layout) {
      case VllmLayout::nhd: return ((n * bs + s) * kvh + g) * d;                           // [N, bs, kvh, d]
      case VllmLayout::nhd_interleaved: return (((n * 2 + kv) * bs + s) * kvh + g) * d;   // [N, 2, bs, kvh, d]
      case VllmLayout::hnd: return ((n * kvh + g) * bs + s) * d;                           // [N, kvh, bs, d]
      case VllmLayout::hnd_interleaved: return (((n * 2 + kv) * kvh + g) * bs + s) * d;   // [N, 2, kvh, bs, d]
    }
    return 0;
  }
  std::int32_t block_of(std::int32_t b, std::int32_t t) const {
    return block_tables[std::size_t(b) * max_blocks + std::size_t(t / block_size)];
  }
  T* k_at(std::int32_t b, std::int32_t h, std::int32_t t) {
    return key_cache.data() + element(block_of(b, t), t % block_size, h, false);
  }
  T* v_at(std::int32_t b, std::int32_t h, std::int32_t t) {
    std::vector<T>& values = interleaved() ? key_cache : value_cache;
    return values.data() + element(block_of(b, t), t % block_size, h, true);
  }

  /// The view of the blocks at (k_data, v_data or, interleaved, k_data alone) with the given table and lengths:
  /// host arrays here, device copies in GPU tests.
  template <class U>
  PagedKVView<U> view_over(U* k_data, U* v_data, const std::int32_t* tables, const std::int32_t* lens) const {
    const PageLayout page = hnd() ? PageLayout::hnd : PageLayout::nhd;
    if (interleaved()) {
      return PagedKVView<U>::vllm_interleaved(k_data, tables, lens, batch, max_blocks, num_blocks, block_size,
                                              kv_heads, head_dim, page);
    }
    return PagedKVView<U>::vllm(k_data, v_data, tables, lens, batch, max_blocks, num_blocks, block_size, kv_heads,
                                head_dim, page);
  }
  PagedKVView<T> view() {
    return view_over<T>(key_cache.data(), data_or_null(value_cache), block_tables.data(), seq_lens.data());
  }

  /// The same blocks as a CSR page table (FlashInfer's form): each row's first ceil(seq_len / block_size) blocks.
  struct Csr {
    std::vector<std::int32_t> indptr{0}, indices, last;
  };
  Csr csr() const {
    Csr c;
    for (std::int32_t b = 0; b < batch; ++b) {
      const std::int32_t pages = blocks_of(seq_lens[b]);
      for (std::int32_t i = 0; i < pages; ++i) c.indices.push_back(block_tables[std::size_t(b) * max_blocks + i]);
      c.indptr.push_back(c.indptr.back() + pages);
      c.last.push_back(pages == 0 ? 0 : seq_lens[b] - (pages - 1) * block_size);
    }
    if (c.indices.empty()) c.indices.push_back(0);  // a non-null array
    return c;
  }
  /// `view` with the CSR table `c` in place of its block table.
  template <class U>
  static PagedKVView<U> as_csr(PagedKVView<U> view, const Csr& c) {
    view.page_indptr = c.indptr.data();
    view.page_indices = c.indices.data();
    view.last_page_len = c.last.data();
    view.block_table_stride = 0;
    view.seq_lens = nullptr;
    return view;
  }
};

}  // namespace kvsift::test
