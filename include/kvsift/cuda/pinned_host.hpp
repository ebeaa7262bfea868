#pragma once
/// PinnedHostCheck: the check that a cache's host arrays are memory the GPU reads in place (page-locked by
/// cudaMallocHost, cudaHostAlloc or cudaHostRegister, or managed), done once per array. The placements that read
/// an offloaded cache from the GPU (OffloadDecodeStep, GpuSelectHybridStep, cuda::HybridDecoder, ElasticKV) keep
/// one per cache they read and call it on every step: a pointer equal to the one last found readable for that
/// field is not queried again (the query, cudaPointerGetAttributes, is a driver call). Memory unpinned and
/// reused at the same address is not noticed. Not thread-safe: one per step object, as the steps are.

#include <array>
#include <cstddef>
#include <string_view>

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
    if (arrays == Arrays::kv_and_tables) {
      require_field(2, kv.page_indptr, "page_indptr", where, cache);
      require_field(3, kv.page_indices, "page_indices", where, cache);
      require_field(4, kv.last_page_len, "last_page_len", where, cache);
    }
  }
  template <class T>
  void require(const KVCache<const T>& cache, Arrays arrays, const char* where, std::string_view name) {
    cache.visit([&](const auto& kv) { require(kv, arrays, where, name); });
  }

 private:
  void require_field(std::size_t field, const void* p, const char* field_name, const char* where,
                     std::string_view cache);

  std::array<const void*, 5> known_{};  ///< per field, the pointer last found readable (null: none yet)
};

}  // namespace kvsift::cuda
