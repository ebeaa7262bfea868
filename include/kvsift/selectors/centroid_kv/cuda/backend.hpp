#pragma once
/// CentroidKV's merge store, CUDA overloads: what the selector, written once for both backends, calls unqualified
/// (argument-dependent lookup on cuda::Context). cuda/backend.hpp includes this file;
/// selectors/centroid_kv/cpu/backend.hpp is the CPU twin. Each overload forwards to the primitive documented in its own
/// header.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/backend.hpp"  // the shared overloads (which include this file at their end)
#include "kvsift/cuda/context.hpp"
#include "kvsift/selectors/centroid_kv/cuda/merge_store.hpp"
#include "kvsift/selectors/centroid_kv/merge_store.hpp"

namespace kvsift::cuda {

template <class T>
void merge_store_load(const KVCache<const T>& cache, const std::int32_t* slots, const MergeStoreView<T>& store,
                      const Context& ctx) {
  cuda::merge_store_load(cache, slots, store, ctx.stream);
}
inline std::size_t merge_round_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity,
                                               const Context&) {
  return cuda::merge_round_workspace_bytes(batch, kv_heads, capacity);
}
template <class T>
void merge_round(const MergeStoreView<T>& store, const std::int32_t* slots, std::int32_t batch,
                 const std::int32_t* budgets, const MergeRoundParams& params, std::span<std::byte> workspace,
                 const Context& ctx) {
  cuda::merge_round(store, slots, batch, budgets, params, workspace, ctx.stream);
}
template <class T>
void merge_store_append(const KVCache<const T>& cache, const std::int32_t* slots, const std::int32_t* lengths,
                        const MergeStoreView<T>& store, const Context& ctx) {
  cuda::merge_store_append(cache, slots, lengths, store, ctx.stream);
}
template <class T>
void merge_store_copy(const MergeStoreView<const T>& src, const std::int32_t* src_slots, const MergeStoreView<T>& dst,
                      const std::int32_t* dst_slots, std::int32_t batch, const Context& ctx) {
  cuda::merge_store_copy(src, src_slots, dst, dst_slots, batch, ctx.stream);
}
template <class T>
void merge_store_selection(const MergeStoreView<const T>& store, const std::int32_t* slots, const SelectionView& out,
                           const Context& ctx) {
  cuda::merge_store_selection(store, slots, out, ctx.stream);
}

}  // namespace kvsift::cuda
