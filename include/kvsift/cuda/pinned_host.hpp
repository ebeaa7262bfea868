#pragma once
/// PinnedHostCheck: the check that a cache's host arrays are memory the GPU reads in place (page-locked by
/// cudaMallocHost, cudaHostAlloc or cudaHostRegister, or managed), done once per array (and that of a workspace's host
/// block, which copies read and write asynchronously). The placements that read
/// an offloaded cache from the GPU (DecodeStep's split placements, cuda::HybridDecoder, ElasticKV) keep
/// one per cache they read and call it on every step: a pointer equal to the one last found readable for that
/// field is not queried again (the query, cudaPointerGetAttributes, is a driver call). Memory unpinned and
/// reused at the same address is not noticed. Not thread-safe: one per step object, as the steps are.

#include <array>
#include <cstddef>
#include <memory>
#include <string_view>
#include <type_traits>

#include <cuda_runtime_api.h>

#include "kvsift/core/kv_cache.hpp"

namespace kvsift::cuda {

class PinnedHostCheck {
 public:
  /// Which arrays: K and V only (a CPU reads the lengths or page table), or also the lengths or page table.
  enum class Arrays { kv, kv_and_tables };

  /// Refuses, naming where, `cache` ("<cache>'s <field> (<pointer>) is not pinned host memory ..."), the first array
  /// the device cannot read in place. Null arrays pass (the views' own validation names them).
  template <class T>
  void require(const ContiguousKVView<const T>& kv, Arrays arrays, const char* where, std::string_view cache) {
    require_field(0, kv.k, "k", where, cache);
    require_field(1, kv.v, "v", where, cache);
    if (arrays == Arrays::kv_and_tables) require_field(2, kv.seq_lens, "seq_lens", where, cache);
  }
  template <class T>
  void require(const PagedKVView<const T>& kv, Arrays arrays, const char* where, std::string_view cache) {
    require_field(0, kv.k_pages, "k_pages", where, cache);
    require_field(1, kv.v_pages, "v_pages", where, cache);
    if (arrays == Arrays::kv_and_tables) {  // only the arrays the view's form reads (views.hpp)
      if (!kv.is_block_table()) require_field(2, kv.page_indptr, "page_indptr", where, cache);
      require_field(3, kv.page_indices, "page_indices", where, cache);
      if (kv.seq_lens == nullptr) require_field(4, kv.last_page_len, "last_page_len", where, cache);
      require_field(6, kv.seq_lens, "seq_lens", where, cache);
    }
  }
  template <class T>
  void require(const KVCache<const T>& cache, Arrays arrays, const char* where, std::string_view name) {
    cache.visit([&](const auto& kv) { require(kv, arrays, where, name); });
  }
  /// A block the step copies from or to asynchronously (a workspace's host block, named `name`).
  void require(const void* block, const char* where, std::string_view name) {
    require_field(5, block, "data", where, name);
  }

 private:
  void require_field(std::size_t field, const void* p, const char* field_name, const char* where,
                     std::string_view cache);

  /// Per field, the pointer last found readable (null: none yet): 0 k / k_pages, 1 v / v_pages, 2 seq_lens /
  /// page_indptr, 3 page_indices, 4 last_page_len, 5 a workspace block, 6 a paged view's seq_lens.
  std::array<const void*, 7> known_{};
};

/// The fence between the stream's asynchronous copies out of (or into) a pinned host block and the host's next
/// write of that block: record() after enqueuing the copies, wait() before writing the block again (at once when
/// nothing is recorded, else until the stream has passed the copies: normally long done). Owns one event
/// (cudaEventDisableTiming), created by the constructor. Not thread-safe: one per step object, as the steps are.
class HostBlockFence {
 public:
  HostBlockFence();
  void record(cudaStream_t stream);
  void wait();

 private:
  struct Destroy {
    void operator()(cudaEvent_t event) const;
  };
  std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, Destroy> event_;
  bool pending_ = false;
};

}  // namespace kvsift::cuda
