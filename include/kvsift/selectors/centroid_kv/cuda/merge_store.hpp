#pragma once
/// The merge store's primitives on the GPU, the twin of selectors/centroid_kv/cpu/merge_store.hpp (read its contracts; the differences
/// are here). Same arguments, with the CUDA context (its stream) instead of the CPU's. Device memory everywhere (store, slots, budgets,
/// lengths, the cache's length arrays, workspace); stream-ordered; no allocation, no host sync; CUDA-graph
/// capturable; deterministic.
///
/// Device values cannot be refused before the launch, so what the CPU refuses marks the row instead: count = -1
/// (a store row) or out count -1 (a selection row), which sparse decode turns into NaN output (core/views.hpp).
/// - merge_store_load: a prompt longer than the capacity gives count -1;
/// - merge_store_append: a full row, a row of count outside [0, capacity) or a length outside [1, seq_len] gives
///   count -1 (nothing is written); a row of count -1 stays -1;
/// - merge_store_evict: a row of count outside [0, capacity] is untouched (so -1 stays -1);
/// - merge_store_copy: a src count outside [0, min(src.capacity, dst.capacity)] gives dst count -1;
/// - merge_store_selection: a count outside [0, capacity] gives out count -1;
/// - merge_round: a row of count outside [0, capacity] sits the round out (so -1 stays -1).
/// A slot outside [0, store.slots) (device value) makes its rows untouched; the selection's rows get count -1.
///
/// The round runs where the CPU's does the same arithmetic except for the order of fp32 sums: similarities come
/// from tensor-core dot products for half and bfloat16 (fp32 accumulation), so two links whose similarities lie
/// within fp32 rounding of each other may rank (or link) the other way round than on the CPU; merged means use
/// the CPU's exact sums (sequence order, B first, no fused multiply-add) and division.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/kv_cache.hpp"
#include "kvsift/selectors/centroid_kv/merge_store.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

/// Longest chunk (params.chunk) the matching kernel takes: a chunk's 128 A by 128 B similarities live in one CTA.
inline constexpr std::int32_t kMergeMaxChunk = kMergeMaxDeviceChunk;

/// cpu::merge_store_load. One launch, a warp per (row, slot).
template <class T>
void merge_store_load(const KVCache<const T>& cache, const std::int32_t* d_slots, const MergeStoreView<T>& store,
                      const Context& ctx);

/// Device workspace (256-byte aligned) of merge_round for `batch` rows of kv_heads heads in a store of `capacity`
/// entries per row: per row capacity / 2 link similarities, targets and ranked links, and capacity order
/// positions' order, degree and log-degree (the compaction is out of place), about 18 bytes per entry. The context
/// does not change it: it is there for the CPU's call shape.
std::size_t merge_round_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity,
                                        const Context& = {});

/// cpu::merge_round, plus the refusal of params.chunk > kMergeMaxChunk, less that of a slot twice (the slots are
/// device values: the step's are trusted, as by every selector; append and copy likewise). Every row decides on the device whether it
/// takes part (merge_round_links of its count and budget), so a decode-time round can be launched every step and
/// costs a few microseconds where no row merges. Launches: the matching (a CTA per (row, chunk): the chunk's keys
/// through shared memory, the A x B dot products on tensor cores for half / bfloat16, SIMT fp32 for float, the
/// argmax per A entry), the ranking (cuda::topk_rows over each row's links, the row's own k = m), the merges (a
/// CTA per (row, chunk): each B entry's chosen A entries, in sequence order, into its slot) and the compaction (a
/// CTA per (row, chunk): the stable partition of order and the degrees from the copy the merge kernel left in the
/// workspace).
template <class T>
void merge_round(const MergeStoreView<T>& store, const std::int32_t* d_slots, std::int32_t batch,
                 const std::int32_t* d_budgets, const MergeRoundParams& params, std::span<std::byte> workspace,
                 const Context& ctx);

/// cpu::merge_store_append. One launch, a warp per row.
template <class T>
void merge_store_append(const KVCache<const T>& cache, const std::int32_t* d_slots, const std::int32_t* d_lengths,
                        const MergeStoreView<T>& store, const Context& ctx);

/// cpu::merge_store_evict, less the refusal of a slot twice. One launch, a warp per row; a row decides on the device
/// whether it evicts (detail::merge_store_evicts), so it can be launched every step.
template <class T>
void merge_store_evict(const MergeStoreView<T>& store, const std::int32_t* d_slots, std::int32_t batch,
                       const std::int32_t* d_budgets, const std::int32_t* d_sinks, const Context& ctx);

/// cpu::merge_store_copy. One launch, a warp per (row, dst slot).
template <class T>
void merge_store_copy(const MergeStoreView<const T>& src, const std::int32_t* d_src_slots, const MergeStoreView<T>& dst,
                      const std::int32_t* d_dst_slots, std::int32_t batch, const Context& ctx);

/// cpu::merge_store_selection. One launch, a thread per (row, position).
template <class T>
void merge_store_selection(const MergeStoreView<const T>& store, const std::int32_t* d_slots, const SelectionView& out,
                           const Context& ctx);

}  // namespace kvsift::cuda
