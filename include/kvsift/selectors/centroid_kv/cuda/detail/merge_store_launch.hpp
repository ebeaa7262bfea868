#pragma once
/// Launchers of the merge store's kernels (selectors/centroid_kv/cuda/merge_store.hpp), for the host code in src/selectors/centroid_kv/cuda/merge_store.cpp;
/// kernels in kernels/merge_store.cu. Launchers return the launch status and never throw.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/core/kv_cache.hpp"
#include "kvsift/selectors/centroid_kv/merge_store.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

/// One round's arguments and workspace. Workspace rows are the call's rows r = b * kv_heads + h (not store rows).
template <class T>
struct MergeRoundLaunch {
  MergeStoreView<T> store;
  const std::int32_t* slots;
  const std::int32_t* budgets;
  MergeRoundParams params;
  std::int32_t batch;
  std::int32_t max_links;   ///< capacity / 2: the most links a row can have (workspace row stride)
  std::int32_t max_chunks;  ///< chunks of a full row
  std::int32_t blocks_per_row;  ///< the round kernels' CTAs per row (each loops over chunks)
  std::int32_t* counts;     ///< [rows] the row's count when the round began (-1: a bad row or slot)
  std::int32_t* merges;     ///< [rows] links the row merges (topk_rows' row_k)
  std::int32_t* lengths;    ///< [rows] links of a merging row, else 0 (topk_rows' lengths)
  float* similarity;        ///< [rows, max_links] per link (A entry, in sequence order), its best similarity
  std::uint8_t* target;     ///< [rows, max_links] per link, its B entry's index in the chunk's B set
  std::int32_t* chosen;     ///< [rows, max_links] the merged links, ascending (topk_rows' output)
  std::int32_t* chosen_counts;  ///< [rows]
  std::int32_t* order;          ///< [rows, capacity] the merge kernel's copy of order, degree and log_degree,
  std::int32_t* degree;         ///< merged degrees included, which the compaction scatters back
  float* log_degree;
};

/// The matching: every merging row's links (similarity, target), and merges / lengths / counts of every row.
template <class T>
cudaError_t launch_merge_match(const MergeRoundLaunch<T>& p, cudaStream_t stream);
/// After topk_rows filled chosen: the merges, then the compaction.
template <class T>
cudaError_t launch_merge_apply(const MergeRoundLaunch<T>& p, cudaStream_t stream);

template <class T>
cudaError_t launch_merge_store_load(const KVCache<const T>& cache, const std::int32_t* slots,
                                    const MergeStoreView<T>& store, cudaStream_t stream);
template <class T>
cudaError_t launch_merge_store_append(const KVCache<const T>& cache, const std::int32_t* slots,
                                      const std::int32_t* lengths, const MergeStoreView<T>& store, cudaStream_t stream);
template <class T>
cudaError_t launch_merge_store_evict(const MergeStoreView<T>& store, const std::int32_t* slots, std::int32_t batch,
                                     const std::int32_t* budgets, const std::int32_t* sinks, cudaStream_t stream);
template <class T>
cudaError_t launch_merge_store_copy(const MergeStoreView<const T>& src, const std::int32_t* src_slots,
                                    const MergeStoreView<T>& dst, const std::int32_t* dst_slots, std::int32_t batch,
                                    cudaStream_t stream);
template <class T>
cudaError_t launch_merge_store_selection(const MergeStoreView<const T>& store, const std::int32_t* slots,
                                         const SelectionView& out, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
