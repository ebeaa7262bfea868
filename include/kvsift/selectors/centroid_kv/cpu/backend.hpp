#pragma once
/// CentroidKV's merge store, CPU overloads: what the selector, written once for both backends, calls unqualified
/// (argument-dependent lookup on cpu::Context). cpu/backend.hpp includes this file;
/// selectors/centroid_kv/cuda/backend.hpp is the CUDA twin. Each overload forwards to the primitive documented in its
/// own header.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/backend.hpp"  // the shared overloads (which include this file at their end)
#include "kvsift/cpu/context.hpp"
#include "kvsift/selectors/centroid_kv/cpu/merge_store.hpp"
#include "kvsift/selectors/centroid_kv/merge_store.hpp"

namespace kvsift::cpu {

template <class T>
void merge_store_load(const KVCache<const T>& cache, const std::int32_t* slots, const MergeStoreView<T>& store,
                      const Context& ctx) {
  cpu::merge_store_load(cache, slots, store, ctx.pool);
}
inline std::size_t merge_round_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity,
                                               const Context& ctx) {
  return cpu::merge_round_workspace_bytes(batch, kv_heads, capacity, ctx.pool);
}
template <class T>
void merge_round(const MergeStoreView<T>& store, const std::int32_t* slots, std::int32_t batch,
                 const std::int32_t* budgets, const MergeRoundParams& params, std::span<std::byte> workspace,
                 const Context& ctx) {
  cpu::merge_round(store, slots, batch, budgets, params, workspace, ctx.pool);
}
template <class T>
void merge_store_append(const KVCache<const T>& cache, const std::int32_t* slots, const std::int32_t* lengths,
                        const MergeStoreView<T>& store, const Context& ctx) {
  cpu::merge_store_append(cache, slots, lengths, store, ctx.pool);
}
template <class T>
void merge_store_copy(const MergeStoreView<const T>& src, const std::int32_t* src_slots, const MergeStoreView<T>& dst,
                      const std::int32_t* dst_slots, std::int32_t batch, const Context& ctx) {
  cpu::merge_store_copy(src, src_slots, dst, dst_slots, batch, ctx.pool);
}
template <class T>
void merge_store_selection(const MergeStoreView<const T>& store, const std::int32_t* slots, const SelectionView& out,
                           const Context& ctx) {
  cpu::merge_store_selection(store, slots, out, ctx.pool);
}

}  // namespace kvsift::cpu
