#pragma once
/// The merge store's primitives on the CPU (selectors/centroid_kv/merge_store.hpp holds the store, the round's rules and the helpers
/// both backends share; selectors/centroid_kv/cuda/merge_store.hpp is the twin, with the same arguments but the context). Host memory, host
/// values everywhere (counts, slots, budgets and lengths are read and checked). Rows are (slots[b], h) for batch
/// row b < batch and every kv head h. No allocation; results are deterministic and independent of the thread
/// count; each primitive runs its rows (or, for a round's matching, its chunks) on ctx.pool (nullptr: the caller).

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/kv_cache.hpp"
#include "kvsift/selectors/centroid_kv/merge_store.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// Batch row b's prompt (cache.seq_len(b) tokens, <= store.capacity) into row (slots[b], h) of the store for every
/// kv head: token t in slot t, order identity over the whole row, degree 1 and log_degree 0 for the prompt's
/// positions, count = seq_len. Refuses a longer prompt, naming the row and both lengths.
template <class T>
void merge_store_load(const KVCache<const T>& cache, const std::int32_t* slots, const MergeStoreView<T>& store,
                      const Context& ctx = {});

/// Bytes of workspace (256-byte aligned, contents irrelevant) merge_round needs for `batch` rows of kv_heads heads
/// in a store of `capacity` entries per row, with ctx.pool's threads: per row five arrays of capacity 4-byte values
/// (similarities, links, inverse key norms, the ranked links, the freed slots) and per thread the matching's fixed
/// tiles (about 150 KB).
std::size_t merge_round_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity,
                                        const Context& ctx = {});

/// One merge round (selectors/centroid_kv/merge_store.hpp's rules) over the rows (slots[b], h), b < batch, budget budgets[slots[b]]
/// (budgets has an entry per slot of the store). A row merges detail::merge_round_links(count, budget, params)
/// links, decided from its own count, so rows of one batch may do nothing. The cosine matching runs per (row,
/// chunk) on the pool with the SIMD level's blocked dot products (cpu/simd.hpp; its fp32 rounding may order two
/// near-equal similarities differently at another level), the ranking, merges and compaction per row. A NaN
/// similarity ranks below every other. Refuses: a row whose count is outside [0, capacity], a slot outside
/// [0, store.slots) or twice (detail::check_distinct_slots), a bad params (detail::check_merge_round_params), a workspace smaller than
/// merge_round_workspace_bytes(batch, store.kv_heads, store.capacity, ctx).
template <class T>
void merge_round(const MergeStoreView<T>& store, const std::int32_t* slots, std::int32_t batch,
                 const std::int32_t* budgets, const MergeRoundParams& params, std::span<std::byte> workspace,
                 const Context& ctx = {});

/// The token at lengths[b] - 1 of cache row b into slot order[count] of every row (slots[b], h): degree 1,
/// log_degree 0, count + 1. Refuses a full row (count == capacity), naming slot and head, and a slot twice.
template <class T>
void merge_store_append(const KVCache<const T>& cache, const std::int32_t* slots, const std::int32_t* lengths,
                        const MergeStoreView<T>& store, const Context& ctx = {});

/// The eviction (selectors/centroid_kv/merge_store.hpp's rules) over the rows (slots[b], h), b < batch: a row of slot
/// s with detail::merge_store_evicts(count, budgets[s], sinks[s]) drops its entry at order position sinks[s];
/// others are untouched. budgets and sinks have an entry per slot of the store. Refuses a slot outside [0,
/// store.slots) or twice, a row whose count is outside [0, capacity], a null budgets or sinks.
template <class T>
void merge_store_evict(const MergeStoreView<T>& store, const std::int32_t* slots, std::int32_t batch,
                       const std::int32_t* budgets, const std::int32_t* sinks, const Context& ctx = {});

/// The live entries of (src_slots[b], h) of src into (dst_slots[b], h) of dst, b < batch: in sequence order at
/// slots 0 .. count - 1 (order identity over the whole row, so the free slots follow ascending), with their
/// degrees. Refuses a count above dst.capacity, naming the row, and a dst slot twice. (The end of a prefill: from the prompt-sized store
/// into the selector's.) src and dst may not overlap.
template <class T>
void merge_store_copy(const MergeStoreView<const T>& src, const std::int32_t* src_slots, const MergeStoreView<T>& dst,
                      const std::int32_t* dst_slots, std::int32_t batch, const Context& ctx = {});

/// Selection row (b, h) = order[0 .. count) of the store's row (slots[b], h) (pool slots: token indices of the
/// store's paged view, selectors/centroid_kv/merge_store.hpp merge_store_paged_view), log_weights = its log_degree[0 .. count),
/// counts = count; out.batch rows. Refuses out.capacity < store.capacity, out.kv_heads != store.kv_heads and
/// out.log_weights == nullptr.
template <class T>
void merge_store_selection(const MergeStoreView<const T>& store, const std::int32_t* slots, const SelectionView& out,
                           const Context& ctx = {});

}  // namespace kvsift::cpu
