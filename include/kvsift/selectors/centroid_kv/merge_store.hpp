#pragma once
/// The merge store: CentroidKV's compressed cache (docs/centroidkv.md), per (slot, kv head) a pool of `capacity`
/// K/V slots and the row's entries in sequence order, and the rules of chunked soft matching shared by
/// selectors/centroid_kv/cpu/merge_store.hpp and selectors/centroid_kv/cuda/merge_store.hpp (the view does not say where its memory lives).
///
/// A row (slot s, kv head h; row index s * kv_heads + h) holds count[row] entries. `order` of the row is a
/// permutation of [0, capacity): its first count values are the slots of the live entries in sequence order, the
/// rest are the free slots. So an append writes the new K/V into slot order[count] and increments count; a merge
/// round overwrites each merged B entry in its own slot and partitions `order` stably (survivors, then the slots it
/// freed in sequence order, then the free slots it had). K/V rows never move: compaction moves int32 slots and the
/// degrees that travel with them. degree and log_degree are per order position (degree[i] belongs to the entry
/// order[i]); those of free positions are unspecified.
///
/// One merge round over a row of count s, budget B (per slot) and the params (sinks n1, recent n2, chunk c,
/// ratio r, trigger):
///   - the row takes part only when s >= B + trigger (prefill: trigger 1; decoding: g) and s > n1 + n2;
///   - the middle, order positions [n1, s - n2), splits into chunks of c consecutive positions from n1 (the last
///     one may be shorter); in a chunk, local positions 0, 2, 4, ... form set B and 1, 3, 5, ... set A (the
///     alternating partition, CentroidKV's theorem A.1);
///   - every A entry links to the B entry of its chunk with the highest cosine similarity of their keys (fp32 from
///     the storage type; a key of zero norm has similarity 0 to every key; ties: the earlier B entry);
///   - m = min(floor(r * links), s - B) links are merged, links = the number of A entries of all chunks: the m with
///     the highest similarity (ties: the earlier A entry);
///   - a B entry and the A entries of its merged links become one entry in the B entry's slot: K and V the
///     degree-weighted means (fp32 sums in sequence order, the B entry first, rounded once to the storage type),
///     degree the sum, log_degree = log(degree) (fp32). Unmerged entries stay as they are; the merged A entries
///     leave, and count becomes s - m.
/// Results are deterministic; the CPU and CUDA twins make the same merges except where two similarities are within
/// fp32 rounding of each other.
///
/// An eviction (merge_store_evict: CentroidKV's window fallback, a slot whose budget is below the merge's minimum)
/// drops one entry instead of merging: a row of slot s with sinks[s] >= 0 and count >= budgets[s] (so that an
/// append would take it past B) loses the entry at order position sinks[s], the oldest after the kept first ones;
/// the later positions' order, degree and log_degree move down by one, the freed slot goes to position count - 1
/// (where the next append writes), and count - 1. K/V rows do not move.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvsift/core/config.hpp"
#include "kvsift/core/slot_grid.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

/// The store of every (slot, kv head): k, v [slots, kv_heads, capacity, head_dim] by slot; order, degree,
/// log_degree [slots, kv_heads, capacity] by order position; count [slots, kv_heads]. All packed. The K/V arrays
/// are laid out as the pages of a head-major paged cache (page = one slot's rows of one sequence, page_size =
/// capacity), so the store is attended through a PagedKVView whose page table is the step's slots.
template <class T>
struct MergeStoreView {
  using index_type = std::conditional_t<std::is_const_v<T>, const std::int32_t, std::int32_t>;
  using weight_type = std::conditional_t<std::is_const_v<T>, const float, float>;

  T* k = nullptr;
  T* v = nullptr;
  index_type* order = nullptr;
  index_type* degree = nullptr;
  weight_type* log_degree = nullptr;
  index_type* count = nullptr;
  std::int32_t slots = 0;
  std::int32_t kv_heads = 0;
  std::int32_t capacity = 0;
  std::int32_t head_dim = 0;

  /// The grid of K and V; order, degree and log_degree are the same grid with rows of one element.
  KVSIFT_HOST_DEVICE SlotGrid grid() const { return {slots, kv_heads, capacity, head_dim}; }
  KVSIFT_HOST_DEVICE std::int64_t row(std::int64_t slot, std::int64_t h) const { return grid().block(slot, h); }
  /// K and V of slot `s` (a pool slot, not an order position) of a row.
  KVSIFT_HOST_DEVICE T* k_slot(std::int64_t row, std::int64_t s) const { return k + grid().offset(row, s); }
  KVSIFT_HOST_DEVICE T* v_slot(std::int64_t row, std::int64_t s) const { return v + grid().offset(row, s); }
  KVSIFT_HOST_DEVICE index_type* row_order(std::int64_t row) const { return order + grid().row_index(row, 0); }
  KVSIFT_HOST_DEVICE index_type* row_degree(std::int64_t row) const { return degree + grid().row_index(row, 0); }
  KVSIFT_HOST_DEVICE weight_type* row_log_degree(std::int64_t row) const { return log_degree + grid().row_index(row, 0); }

  /// Elements of K (and of V) and of order (and degree, log_degree) of a shape.
  static constexpr std::size_t kv_elements(std::int32_t slots, std::int32_t kv_heads, std::int32_t capacity,
                                           std::int32_t head_dim) {
    return SlotGrid{slots, kv_heads, capacity, head_dim}.elements();
  }
  static constexpr std::size_t entries(std::int32_t slots, std::int32_t kv_heads, std::int32_t capacity) {
    return SlotGrid{slots, kv_heads, capacity}.elements();
  }
  constexpr MergeStoreView<const T> as_const() const
    requires(!std::is_const_v<T>)
  {
    return {k, v, order, degree, log_degree, count, slots, kv_heads, capacity, head_dim};
  }
};

/// Largest head_dim of a store (the CPU matching's tile bound; the kernels' too).
inline constexpr std::int32_t kMergeMaxHeadDim = 256;
/// Longest chunk (params.chunk) the CUDA matching kernel takes: a chunk's 128 A by 128 B similarities live in one
/// CTA (cuda::kMergeMaxChunk). Here so that CentroidKV refuses a longer one at construction on a device context.
inline constexpr std::int32_t kMergeMaxDeviceChunk = 256;

/// One merge round's parameters (host values). CentroidKV: sinks 16, recent 64, chunk 256; ratio r_j of the
/// schedule; trigger 1 at prefill (merge while s > B), g at decoding (merge once s >= B + g).
struct MergeRoundParams {
  std::int32_t sinks = 16;
  std::int32_t recent = 64;
  std::int32_t chunk = 256;
  float ratio = 0.8f;
  std::int32_t trigger = 1;
};

namespace detail {

/// The chunk structure of one row of `count` entries (the rules above), shared by both backends.
struct MergeChunks {
  std::int32_t middle_begin = 0;  ///< first order position of the middle
  std::int32_t middle_end = 0;    ///< one past its last
  std::int32_t chunk = 1;

  KVSIFT_HOST_DEVICE static MergeChunks of(std::int32_t count, const MergeRoundParams& p) {
    const std::int32_t end = count - p.recent;
    return {p.sinks, end > p.sinks ? end : p.sinks, p.chunk};
  }
  KVSIFT_HOST_DEVICE std::int32_t chunks() const { return (middle_end - middle_begin + chunk - 1) / chunk; }
  KVSIFT_HOST_DEVICE std::int32_t chunk_begin(std::int32_t j) const { return middle_begin + j * chunk; }
  KVSIFT_HOST_DEVICE std::int32_t chunk_size(std::int32_t j) const {
    const std::int32_t left = middle_end - chunk_begin(j);
    return left < chunk ? left : chunk;
  }
  /// A entries (odd local positions) of the whole middle: the number of links.
  KVSIFT_HOST_DEVICE std::int32_t links() const {
    const std::int32_t full = (middle_end - middle_begin) / chunk;
    const std::int32_t tail = (middle_end - middle_begin) - full * chunk;
    return full * (chunk / 2) + tail / 2;
  }
};

/// Links a round merges in a row of `count` entries and budget `budget`: 0 unless the row takes part.
KVSIFT_HOST_DEVICE inline std::int32_t merge_round_links(std::int32_t count, std::int32_t budget,
                                                         const MergeRoundParams& p) {
  if (count < budget + p.trigger || count <= p.sinks + p.recent) return 0;
  const MergeChunks c = MergeChunks::of(count, p);
  const auto by_ratio = std::int32_t(std::floor(double(p.ratio) * double(c.links())));
  const std::int32_t excess = count - budget;
  return by_ratio < excess ? by_ratio : excess;
}

/// Whether merge_store_evict drops an entry of a row of `count` entries, budget `budget`, keeping its first `sinks`
/// (-1: never).
KVSIFT_HOST_DEVICE inline bool merge_store_evicts(std::int32_t count, std::int32_t budget, std::int32_t sinks) {
  return sinks >= 0 && count >= budget && count > sinks;
}

}  // namespace detail

/// The store's K/V as the paged cache a decode step attends: batch row b is the page of slot slots[b] (one page of
/// `capacity` rows per slot, page_size = capacity), so a selection of pool slots (merge_store_selection) indexes
/// it directly. page_indptr [batch + 1] = 0, 1, ..., batch and last_page_len [batch] = capacity are the caller's
/// constant arrays, in the memory of the store (as slots).
template <class T>
KVSIFT_HOST_DEVICE PagedKVView<const T> merge_store_paged_view(const MergeStoreView<T>& store, const std::int32_t* slots,
                                                               const std::int32_t* page_indptr,
                                                               const std::int32_t* last_page_len, std::int32_t batch) {
  return {store.k,
          store.v,
          page_indptr,
          slots,
          last_page_len,
          batch,
          store.kv_heads,
          store.head_dim,
          store.capacity,
          store.slots,
          std::int64_t(store.kv_heads) * store.capacity * store.head_dim,
          store.head_dim,
          std::int64_t(store.capacity) * store.head_dim};
}

}  // namespace kvsift
