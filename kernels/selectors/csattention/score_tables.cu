// CUDA score tables (selectors/csattention/cuda/score_tables.hpp). Every value the CPU computes is computed here by the same rule:
// dot products are __fmaf_rn in ascending element order from 0 (the CPU's std::fma), rounded by the shared
// table_score; centroids rank by rank_key; the streaming insert is selectors/csattention/score_tables.hpp's insert_table_key run by
// one thread per list; the reductions add fixed-point integers, which are exact and so independent of the order
// the atomics or the sort leave them in. Conversions to fp16 go through core/dtype.hpp's (constexpr, so callable
// here) where a stored value is written, so the bits are the CPU's.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kvsift/core/inverted_lists.hpp"
#include "kvsift/cuda/detail/block_select.cuh"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/selectors/csattention/cuda/detail/score_tables_launch.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kScoreThreads = kSubspaceScoreThreads;
constexpr int kScoreLists = kSubspaceScoreLists;
constexpr int kStreamThreads = 256;  ///< the grid-stride kernels
constexpr int kProbeThreads = 256;
constexpr int kProbeWarps = kProbeThreads / 32;

using kvsift::detail::kAbsentListEntry;

__device__ __forceinline__ std::int64_t max64(std::int64_t a, std::int64_t b) { return a > b ? a : b; }

// ---- subspace_scores ----------------------------------------------------------------------------------------

/// Block (group of kScoreLists centroids c0.. of subspace s, tile of kScoreThreads tokens), flattened as group *
/// token_blocks + tile. A thread reads its key's sub-vector once and keeps one accumulator per centroid, each
/// taking its FMAs in ascending element order. Groups cover whole subspaces; rows outside the range are skipped.
template <class KV>
__global__ void __launch_bounds__(kScoreThreads)
    subspace_scores_kernel(BaseTablesView base, std::int32_t table_head, std::int32_t list_begin,
                           std::int32_t list_count, KV kv, std::int32_t row, std::int32_t token_begin,
                           std::int32_t tokens, MatrixView<float> out, std::int32_t first_subspace,
                           std::int32_t groups_per_subspace, std::int32_t token_blocks) {
  const std::int32_t tile = std::int32_t(blockIdx.x % unsigned(token_blocks));
  const std::int32_t group = std::int32_t(blockIdx.x / unsigned(token_blocks));
  const std::int32_t t = tile * kScoreThreads + std::int32_t(threadIdx.x);
  const std::int32_t centroids = base.centroids_per_subspace;
  const std::int32_t s = first_subspace + group / groups_per_subspace;
  const std::int32_t c0 = group % groups_per_subspace * kScoreLists;
  const std::int32_t first_row = s * centroids + c0 - list_begin;  // out row of centroid c0
  if (t >= tokens || first_row + kScoreLists <= 0 || first_row >= list_count) return;
  const float* centroid[kScoreLists];
#pragma unroll
  for (int i = 0; i < kScoreLists; ++i) {  // past the subspace's last centroid: a valid one, its result unused
    const std::int64_t c = min(c0 + i, centroids - 1);
    centroid[i] = base.centroids + ((std::int64_t(table_head) * base.subspaces + s) * centroids + c) * base.width;
  }
  const std::int64_t token = std::int64_t(token_begin) + t;
  const bool inside = token < kv.seq_len(row);
  float acc[kScoreLists] = {};
  if (inside) {
    const auto* key = kv.k_row(row, table_head * kv.kv_heads / base.table_heads, token);
    const std::int32_t head_dim = base.subspaces * base.width;
    for (std::int32_t j = 0; j < base.width; ++j) {
      const float x = to_float_device(key[subspace_channel(base.split, s, j, base.width, head_dim)]);
#pragma unroll
      for (int i = 0; i < kScoreLists; ++i) acc[i] = __fmaf_rn(centroid[i][j], x, acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < kScoreLists; ++i) {
    const std::int32_t r = first_row + i;
    if (c0 + i < centroids && r >= 0 && r < list_count) {
      out.row(r)[t] = inside ? kvsift::table_score(acc[i]) : __int_as_float(0x7fffffff);
    }
  }
}

// ---- store_table_lists --------------------------------------------------------------------------------------

/// The rank key of a score: the fp16 bits of its table score mapped so that ascending order is higher first (-0
/// as +0). table_score has no NaN and no infinity, so 16 bits order every value rank_key orders.
__device__ __forceinline__ std::uint16_t table_rank_key(float score) {
  std::uint32_t bits = kvsift::float_to_half(kvsift::table_score(score)).bits;
  bits = bits == 0x8000u ? 0u : bits;
  const std::uint32_t ascending = (bits & 0x8000u) != 0 ? ~bits & 0xffffu : bits | 0x8000u;
  return std::uint16_t(~ascending & 0xffffu);
}

constexpr int kListSelectThreads = 512;
using ListSelect = BlockRadixSelect<kListSelectThreads>;

/// A CTA per list row r of a chunk (scores row row_begin + r): its columns' rank keys into its own stretch of
/// keys[1] (free until the sort), then the best `kept` of them by BlockRadixSelect, ties to the smaller column
/// (the ranking's rule), written in column order at r * kept as (r << 16 | rank key, column): the stable sort
/// that follows keeps that order among equal keys.
__global__ void __launch_bounds__(kListSelectThreads)
    select_table_lists(MatrixView<const float> scores, std::int32_t tokens, std::int32_t kept, std::int64_t row_begin,
                       TableListBuffers buf) {
  __shared__ typename ListSelect::TempStorage temp;
  const std::int64_t r = blockIdx.x;
  const float* row = scores.row(row_begin + r);
  std::uint16_t* row_keys = reinterpret_cast<std::uint16_t*>(buf.keys[1]) + r * tokens;
  for (std::int32_t i = std::int32_t(threadIdx.x); i < tokens; i += kListSelectThreads) {
    row_keys[i] = table_rank_key(row[i]);
  }
  __syncthreads();
  const auto word_at = [&](std::int32_t i) { return std::uint32_t(row_keys[i]) << 16; };
  ListSelect select(temp);
  const SelectThreshold threshold = select.find(word_at, tokens, std::uint32_t(kept), SingleBlock{});
  select.emit(
      word_at, tokens, threshold,
      [&](std::int32_t i, std::uint32_t position) {
        const std::int64_t at = r * kept + position;
        buf.keys[0][at] = std::uint32_t(r) << 16 | row_keys[i];
        buf.columns[0][at] = i;
      },
      SingleBlock{});
}

/// Entry p < kept of list row r of a chunk from its sorted columns (columns[r * kept + p]); the count once per row
/// (also when nothing is kept, when columns is not read).
__global__ void __launch_bounds__(kStreamThreads)
    write_table_lists(MatrixView<const float> scores, std::int32_t kept, BaseTablesView base,
                      std::int64_t first_list, std::int64_t row_begin, std::int64_t rows, const std::int32_t* columns) {
  const std::int32_t span = max(kept, 1);
  const std::int64_t total = rows * span;
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / span;
    const std::int32_t p = std::int32_t(e % span);
    const std::int64_t list = first_list + row_begin + r;
    if (p == 0) base.counts[list] = kept;
    if (p >= kept) continue;
    const std::int32_t column = columns[r * kept + p];
    base.ids[list * base.length + p] = column;
    base.scores[list * base.length + p] =
        kvsift::float_to_half(kvsift::table_score(scores.row(row_begin + r)[column]));
  }
}

// ---- append_tables ------------------------------------------------------------------------------------------

/// check_slot_list's rule (selectors/csattention/detail/score_tables_checks.hpp), on device values.
__device__ __forceinline__ bool table_list_consistent(std::int32_t count, std::int32_t evicted, std::int32_t size,
                                                      std::int32_t length, std::int32_t capacity) {
  return count >= 0 && count <= length && evicted >= 0 && evicted <= count && size >= 0 && size <= capacity &&
         size <= evicted;
}

/// One thread per (batch row, table head, list), lists fastest: a warp shares one key.
template <class KV>
__global__ void __launch_bounds__(kStreamThreads)
    append_tables_kernel(ScoreTablesView<std::int32_t> t, KV kv, const std::int32_t* slots,
                         const std::int32_t* lengths) {
  const std::int32_t lists = t.lists();
  const std::int64_t items = std::int64_t(kv.batch) * t.table_heads * lists;
  for (std::int64_t item = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; item < items;
       item += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int32_t l = std::int32_t(item % lists), h = std::int32_t(item / lists % t.table_heads);
    const std::int64_t b = item / lists / t.table_heads;
    const std::int32_t slot = slots[b];
    if (slot < 0 || slot >= t.slots) continue;
    const std::int32_t base = t.slot_base[slot], length = lengths[b];
    if (base < 0 || base >= t.bases || length < 1 || length > kv.seq_len(b)) continue;
    const std::int64_t own = t.list_index(slot, h, l);
    std::int32_t evicted = t.evicted[own], size = t.overlay_sizes[own];
    const std::int32_t count = t.base_counts[t.list_index(base, h, l)];
    if (!table_list_consistent(count, evicted, size, t.length, t.overlay_capacity)) continue;
    const std::int32_t s = l / t.centroids_per_subspace, head_dim = t.head_dim();
    const float* centroid = t.centroid(base, h, s, l % t.centroids_per_subspace);
    const auto* key = kv.k_row(b, h * kv.kv_heads / t.table_heads, length - 1);
    float dot = 0.0f;
    for (std::int32_t j = 0; j < t.width; ++j) {
      dot = __fmaf_rn(centroid[j], to_float_device(key[subspace_channel(t.split, s, j, t.width, head_dim)]), dot);
    }
    const bool entered = kvsift::detail::insert_table_key(
        t.base_ids + t.base_entry(base, h, l), t.base_scores + t.base_entry(base, h, l), count, evicted,
        t.overlay_ids + t.overlay_entry(slot, h, l), t.overlay_scores + t.overlay_entry(slot, h, l), size,
        t.overlay_capacity, length - 1, kvsift::table_score(dot), [](half x) { return kvsift::half_to_float(x); },
        [](float x) { return kvsift::float_to_half(x); });
    if (entered) {
      t.evicted[own] = evicted;
      t.overlay_sizes[own] = size;
    }
  }
}

// ---- nearest_centroids --------------------------------------------------------------------------------------

/// A warp per (b, query head h, subspace s), items in that order. Each round, lane i scores centroid c0 + i; a key's
/// place in the merged order is the number of keys below it among the round's and the best so far (keys are
/// distinct: they hold the centroid index), so the merge is one scatter into the other buffer, truncated at
/// `probes`.
template <class T>
__global__ void __launch_bounds__(kProbeThreads)
    nearest_centroids_kernel(QueryView<const T> q, ScoreTablesView<const std::int32_t> t, const std::int32_t* slots,
                             std::int32_t probes, SelectionView chosen, std::int32_t* weights) {
  __shared__ unsigned long long best_keys[kProbeWarps][2][kMaxTableProbes];
  constexpr unsigned long long kNone = ~0ull;  // above every rank key (indices < 2^31)
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const std::int64_t items = std::int64_t(q.batch) * q.heads * t.subspaces;
  const std::int32_t group = q.heads / chosen.kv_heads, centroids = t.centroids_per_subspace;
  for (std::int64_t item = std::int64_t(blockIdx.x) * kProbeWarps + warp; item < items;
       item += std::int64_t(gridDim.x) * kProbeWarps) {  // uniform across the warp
    const std::int32_t s = std::int32_t(item % t.subspaces), h = std::int32_t(item / t.subspaces % q.heads);
    const std::int64_t b = item / t.subspaces / q.heads;
    const std::int32_t g = h / group, j = h % group, slot = slots[b];
    const std::int32_t base = slot >= 0 && slot < t.slots ? t.slot_base[slot] : -1;
    if (base < 0 || base >= t.bases) {
      if (j == 0 && s == 0 && lane == 0) chosen.counts[chosen.row_index(b, g)] = -1;
      continue;
    }
    const std::int32_t table_head = h / (q.heads / t.table_heads), head_dim = t.head_dim();
    const T* x = q.row(b, h);
    unsigned long long* best = best_keys[warp][0];
    unsigned long long* next = best_keys[warp][1];
    std::int32_t held = 0;
    for (std::int32_t c0 = 0; c0 < centroids; c0 += 32) {
      const std::int32_t c = c0 + lane;
      unsigned long long key = kNone;
      if (c < centroids) {
        const float* centroid = t.centroid(base, table_head, s, c);
        float dot = 0.0f;
        for (std::int32_t e = 0; e < t.width; ++e) {
          dot = __fmaf_rn(centroid[e], to_float_device(x[subspace_channel(t.split, s, e, t.width, head_dim)]), dot);
        }
        key = rank_key(dot, c);
      }
      std::int32_t place = 0;  // among the round's keys and the best so far
      for (int i = 0; i < 32; ++i) place += __shfl_sync(0xffffffffu, key, i) < key;
      for (std::int32_t i = 0; i < held; ++i) place += best[i] < key;
      for (std::int32_t i0 = 0; i0 < held; i0 += 32) {  // the best so far move down past the round's keys below
        const std::int32_t i = i0 + lane;
        const unsigned long long kept = i < held ? best[i] : kNone;
        std::int32_t below = 0;
        for (int k = 0; k < 32; ++k) below += __shfl_sync(0xffffffffu, key, k) < kept;
        if (i < held && i + below < probes) next[i + below] = kept;
      }
      if (key != kNone && place < probes) next[place] = key;
      held = min(probes, held + min(32, centroids - c0));
      __syncwarp();  // next is complete, and every read of best is done before the next round writes it
      unsigned long long* const swap = best;
      best = next;
      next = swap;
    }
    std::int32_t* dst = chosen.row(b, g) + (j * t.subspaces + s) * probes;
    const std::int32_t first_list = table_head * t.lists() + s * centroids;
    for (std::int32_t p = lane; p < probes; p += 32) dst[p] = first_list + std::int32_t(best[p] & 0xffffffffu);
    if (weights != nullptr) {  // every lane sums the squares in the CPU's order
      float square_sum = 0.0f;
      for (std::int32_t e = 0; e < t.width; ++e) {
        const float v = to_float_device(x[subspace_channel(t.split, s, e, t.width, head_dim)]);
        square_sum = __fmaf_rn(v, v, square_sum);
      }
      const std::int32_t weight = table_weight(__fsqrt_rn(square_sum));
      std::int32_t* w = weights + chosen.row_index(b, g) * chosen.capacity + (j * t.subspaces + s) * probes;
      for (std::int32_t p = lane; p < probes; p += 32) w[p] = weight;
    }
    if (j == 0 && s == 0 && lane == 0) chosen.counts[chosen.row_index(b, g)] = group * t.subspaces * probes;
    __syncwarp();  // best is read before the next item writes it
  }
}

// ---- the chosen lists' reductions ---------------------------------------------------------------------------

/// A selection row's device values, and whether the reductions take it (selectors/csattention/cuda/score_tables.hpp's rules).
struct TableRow {
  std::int32_t slot, base, length, count;
  bool valid;
};
__device__ TableRow table_row(const TableScoresParams& p, std::int64_t row, std::int32_t max_length) {
  const std::int64_t b = row / p.chosen.kv_heads;
  TableRow r{p.slots[b], -1, p.lengths[b], p.chosen.counts[row], false};
  if (r.slot < 0 || r.slot >= p.tables.slots) return r;
  r.base = p.tables.slot_base[r.slot];
  r.valid = r.base >= 0 && r.base < p.tables.bases && r.length >= 0 && r.length <= max_length && r.count >= 0 &&
            r.count <= p.chosen.capacity && r.count % p.heads_per_row == 0;
  return r;
}

/// One chosen list of a valid row: base entries [0, kept), then overlay entries; empty when the list id or its
/// counts are out of range.
struct ChosenList {
  const std::int32_t* base_ids = nullptr;
  const half* base_scores = nullptr;
  const std::int32_t* overlay_ids = nullptr;
  const half* overlay_scores = nullptr;
  std::int32_t kept = 0, size = 0;

  __device__ std::int32_t entries() const { return kept + size; }
  __device__ std::int64_t floor() const {
    return kvsift::detail::list_floor(base_ids, base_scores, kept, overlay_ids, overlay_scores, size,
                                      [](half x) { return to_float_device(x); });
  }
  __device__ std::int32_t id(std::int32_t i) const { return i < kept ? base_ids[i] : overlay_ids[i - kept]; }
  __device__ half score(std::int32_t i) const { return i < kept ? base_scores[i] : overlay_scores[i - kept]; }
};
__device__ ChosenList chosen_list(const ScoreTablesView<const std::int32_t>& t, const TableRow& r, std::int32_t id) {
  ChosenList list;
  const std::int32_t lists = t.lists();
  if (id < 0 || id >= t.table_heads * lists) return list;
  const std::int32_t h = id / lists, l = id % lists;
  const std::int64_t own = t.list_index(r.slot, h, l);
  const std::int32_t count = t.base_counts[t.list_index(r.base, h, l)], evicted = t.evicted[own];
  const std::int32_t size = t.overlay_sizes[own];
  if (!table_list_consistent(count, evicted, size, t.length, t.overlay_capacity)) return list;
  list.base_ids = t.base_ids + t.base_entry(r.base, h, l);
  list.base_scores = t.base_scores + t.base_entry(r.base, h, l);
  list.overlay_ids = t.overlay_ids + t.overlay_entry(r.slot, h, l);
  list.overlay_scores = t.overlay_scores + t.overlay_entry(r.slot, h, l);
  list.kept = count - evicted;
  list.size = size;
  return list;
}

/// What chosen list i of a row adds per entry: weight * (fixed score - floor) (TableScoreOptions). A weight outside
/// [0, kMaxTableWeight] makes the list contribute nothing (valid false).
struct EntryValue {
  std::int64_t weight = 0, floor = 0;
  bool valid = false;
  __device__ std::int64_t operator()(half score) const {
    return weight * (kvsift::fixed_score(to_float_device(score)) - floor);
  }
};
__device__ EntryValue entry_value(const TableScoresParams& p, const ChosenList& list, std::int64_t row,
                                  std::int32_t i) {
  const std::int32_t weight =
      p.options.weights != nullptr ? p.options.weights[row * p.chosen.capacity + i] : kTableWeightOne;
  if (weight < 0 || weight > kMaxTableWeight) return {};
  return {weight, p.options.from_floor ? list.floor() : 0, true};
}

/// A chosen list as a dense CTA reads it: the entries of the CTA's token ranges in the base's token order, then,
/// where the CTA's tokens reach past the prompt, the list's overlay; what each entry adds; and the lowest kept base
/// entry (cut), below which a token-order entry is evicted.
struct DenseRangeList {
  const std::uint32_t* entries = nullptr;
  const std::int32_t* overlay_ids = nullptr;
  const half* overlay_scores = nullptr;
  std::int32_t base_items = 0, items = 0;
  float cut_score = 0.0f;
  std::int32_t cut_id = 0;
  bool cut = false;
  EntryValue value;
};

/// Chosen list i of a valid row for the CTA owning token ranges [range_begin, range_end).
__device__ DenseRangeList dense_range_list(const TableScoresParams& p, const TableRow& r, std::int64_t row,
                                           std::int32_t i, std::int32_t range_begin, std::int32_t range_end,
                                           bool past_prompt) {
  DenseRangeList d;
  const ScoreTablesView<const std::int32_t>& t = p.tables;
  const std::int32_t id = p.chosen.indices[row * p.chosen.capacity + i];
  const ChosenList list = chosen_list(t, r, id);
  d.value = entry_value(p, list, row, i);
  if (!d.value.valid || list.base_ids == nullptr) return d;  // an empty list adds nothing
  const std::int64_t ordinal = t.list_index(r.base, id / t.lists(), id % t.lists());
  if (list.kept > 0 && range_begin < range_end) {
    const std::int32_t* offsets = t.token_order.offsets + ordinal * (t.token_order.ranges + 1);
    const std::int32_t first = min(max(offsets[range_begin], 0), t.length);
    const std::int32_t last = min(max(offsets[range_end], first), t.length);
    d.entries = t.token_order.entries + ordinal * t.length + first;
    d.base_items = last - first;
    if (list.kept < t.base_counts[ordinal]) {
      d.cut = true;
      d.cut_score = to_float_device(list.base_scores[list.kept - 1]);
      d.cut_id = list.base_ids[list.kept - 1];
    }
  }
  d.items = d.base_items;
  if (past_prompt) {
    d.overlay_ids = list.overlay_ids;
    d.overlay_scores = list.overlay_scores;
    d.items += list.size;
  }
  return d;
}

/// The token-order entry no list holds (its score bits a NaN, which table_score never stores): an empty slot.
constexpr std::uint32_t kNoTokenEntry = 0xffffffffu;

/// Adds a chosen list's entry (token id, score) to its token's sum where the token is in the part's middle [lo,
/// hi) and the entry is not evicted (below the list's cut): a plain read-modify-write for a base entry (a list's
/// base entries are distinct tokens: within one list no two threads meet), an atomic one for an overlay entry.
template <bool kOverlay>
__device__ __forceinline__ void add_dense_entry(const DenseRangeList& d, std::int32_t id, half score, std::int32_t lo,
                                                std::int32_t hi, std::int32_t begin, unsigned long long* sums,
                                                std::uint8_t* listed) {
  if (id < lo || id >= hi) return;
  if (!kOverlay && d.cut && kvsift::detail::table_entry_below(to_float_device(score), id, d.cut_score, d.cut_id)) return;
  const std::int32_t key = id - begin;
  const auto add = static_cast<unsigned long long>(d.value(score));  // two's complement
  if constexpr (kOverlay) {
    atomicAdd(sums + key, add);
  } else {
    sums[key] += add;
  }
  listed[key] = 1;
}
__device__ __forceinline__ void add_token_entry(const DenseRangeList& d, std::uint32_t entry, std::int32_t high,
                                                std::int32_t lo, std::int32_t hi, std::int32_t begin,
                                                unsigned long long* sums, std::uint8_t* listed) {
  if (entry == kNoTokenEntry) return;
  half score;
  score.bits = std::uint16_t(entry >> 16);
  add_dense_entry<false>(d, high | std::int32_t(entry & 0xffffu), score, lo, hi, begin, sums, listed);
}

/// A CTA per (row, part), owning the part's 1 << key_shift tokens [begin, begin + keys) in shared memory. Per
/// chunk of kDenseLists chosen lists, the lists' device values into shared memory; per query-head block, list by
/// list, every entry of the CTA's token ranges (and of the overlay where its tokens reach past the prompt) in the
/// window's middle adds its value to its token's int64 sum (exact integers: the same sum in any
/// order) and marks the token listed; after the block, the sums fold into the running maximum as fp32
/// (rounding is monotonic: the maximum of the rounded sums is the rounded maximum the CPU computes) and clear. At
/// the end every owned token below the length gets its score (-inf where no list holds it) and the CTA's candidate
/// count goes to counts; dense_row_k sums them. A CTA reads its own ranges' entries alone and writes nothing
/// remote: a row's entries are read once over all its CTAs. (A 64-bit add to shared memory is a compare-and-swap
/// loop on sm_90, so the base entries add without atomics, list after list; H200, 128K: the atomic form took
/// 1795 us at batch 32.)
__global__ void __launch_bounds__(kDenseThreads, kDenseCtasPerSm)
    dense_range_scores(TableScoresParams p, MatrixView<float> scores, std::int32_t max_tokens, DenseTablePlan plan,
                       DenseTableBuffers buf) {
  using Reduce = cub::BlockReduce<std::int32_t, kDenseThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ DenseRangeList lists[kDenseLists];
  extern __shared__ __align__(16) unsigned char dense_smem[];
  const std::int32_t keys = 1 << plan.key_shift;
  auto* sums = reinterpret_cast<unsigned long long*>(dense_smem);
  auto* best = reinterpret_cast<float*>(sums + keys);
  auto* listed = reinterpret_cast<std::uint8_t*>(best + keys);
  const std::int64_t row = blockIdx.x / unsigned(plan.parts);
  const std::int32_t part = std::int32_t(blockIdx.x % unsigned(plan.parts));
  const std::int32_t begin = part << plan.key_shift;
  const TableRow r = table_row(p, row, max_tokens);
  if (!r.valid || begin >= r.length) return;
  for (std::int32_t k = std::int32_t(threadIdx.x); k < keys; k += kDenseThreads) {
    sums[k] = 0;
    best[k] = -INFINITY;
    listed[k] = 0;
  }
  // Kept entries of the part: [lo, hi), its tokens inside the middle (list_entry_kept).
  const std::int32_t lo = max(begin, p.window.sink_end(r.length));
  const std::int32_t hi = std::int32_t(min(std::int64_t(begin) + keys, std::int64_t(p.window.recent_begin(r.length))));
  const TokenOrderView<const std::uint32_t>& order = p.tables.token_order;
  const std::int32_t range_begin = min(begin / kTableTokenRange, order.ranges);
  const std::int32_t range_end = min((begin + keys) / kTableTokenRange, order.ranges);
  const bool past_prompt = std::int64_t(begin) + keys > order.prompt[r.base];
  const std::int32_t high = begin & ~0xffff;
  const std::int32_t per_block = r.count / p.heads_per_row;
  for (std::int32_t i0 = 0; i0 < r.count; i0 += kDenseLists) {
    const std::int32_t n = min(kDenseLists, r.count - i0);
    __syncthreads();  // the previous chunk's lists are read (and, first, the part's sums cleared)
    for (std::int32_t q = std::int32_t(threadIdx.x); q < n; q += kDenseThreads) {
      lists[q] = dense_range_list(p, r, row, i0 + q, range_begin, range_end, past_prompt);
    }
    __syncthreads();
    for (std::int32_t qa = 0; qa < n;) {  // the chunk's lists block by block
      const std::int32_t qb = min(n, qa + per_block - (i0 + qa) % per_block);
      // kDenseAhead lists at a time: the first kDenseSlots * kDenseThreads entries of each loaded together (all in
      // flight), then list by list, a barrier apart, each thread adds its entries of the list.
      for (std::int32_t q0 = qa; q0 < qb; q0 += kDenseAhead) {
        std::uint32_t slots[kDenseAhead][kDenseSlots];
#pragma unroll
        for (int a = 0; a < kDenseAhead; ++a) {
#pragma unroll
          for (int k = 0; k < kDenseSlots; ++k) {
            const std::int32_t e = k * kDenseThreads + std::int32_t(threadIdx.x);
            slots[a][k] = q0 + a < qb && e < lists[q0 + a].base_items ? lists[q0 + a].entries[e] : kNoTokenEntry;
          }
        }
#pragma unroll
        for (int a = 0; a < kDenseAhead; ++a) {
          if (q0 + a >= qb) break;
          const DenseRangeList& d = lists[q0 + a];
#pragma unroll
          for (int k = 0; k < kDenseSlots; ++k) add_token_entry(d, slots[a][k], high, lo, hi, begin, sums, listed);
          for (std::int32_t e = kDenseSlots * kDenseThreads + std::int32_t(threadIdx.x); e < d.base_items;
               e += kDenseThreads) {
            add_token_entry(d, d.entries[e], high, lo, hi, begin, sums, listed);
          }
          for (std::int32_t e = d.base_items + std::int32_t(threadIdx.x); e < d.items; e += kDenseThreads) {
            add_dense_entry<true>(d, d.overlay_ids[e - d.base_items], d.overlay_scores[e - d.base_items], lo, hi, begin,
                                  sums, listed);
          }
          __syncthreads();  // the list's adds are done before the next list's
        }
      }
      qa = qb;
      if ((i0 + qb) % per_block != 0) continue;  // the block goes on in the next chunk
      __syncthreads();  // every add of the block is done
      for (std::int32_t k = std::int32_t(threadIdx.x); k < keys; k += kDenseThreads) {
        best[k] = fmaxf(best[k], kvsift::fixed_to_float(static_cast<std::int64_t>(sums[k])));
        sums[k] = 0;
      }
      __syncthreads();
    }
  }
  __syncthreads();
  const std::int32_t owned = min(keys, r.length - begin);
  float* dst = scores.row(row) + begin;
  std::int32_t candidates = 0;
  for (std::int32_t k = std::int32_t(threadIdx.x); k < owned; k += kDenseThreads) {
    dst[k] = listed[k] != 0 ? best[k] : -INFINITY;
    candidates += listed[k];
  }
  const std::int32_t total = Reduce(reduce).Sum(candidates);
  if (threadIdx.x == 0) buf.counts[row * buf.parts + part] = total;
}

/// A thread per row: row_k from the sum of its CTAs' counts over the parts below its length (-1 for a bad row).
__global__ void __launch_bounds__(kStreamThreads)
    dense_row_k(TableScoresParams p, std::int32_t max_tokens, DenseTablePlan plan, DenseTableBuffers buf) {
  for (std::int64_t row = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; row < p.rows;
       row += std::int64_t(gridDim.x) * blockDim.x) {
    const TableRow r = table_row(p, row, max_tokens);
    if (!r.valid) {
      p.row_k[row] = -1;
      continue;
    }
    const std::int64_t part_keys = std::int64_t(1) << plan.key_shift;
    const std::int64_t parts = (r.length + part_keys - 1) / part_keys;
    std::int32_t total = 0;
    for (std::int64_t q = 0; q < parts; ++q) total += buf.counts[row * buf.parts + q];
    p.row_k[row] = min(p.budget(r.length), total);
  }
}

// ---- order_table_lists ------------------------------------------------------------------------------------------

/// A CTA per list of the base (table head major): its entries counted per token range in shared memory, the counts
/// scanned into the list's offsets, then each entry placed at its range's cursor (a shared atomic: the order within
/// a range is whatever the atomics leave, which no reader depends on: the dense sums are exact in any order). An id
/// outside [0, ranges * kTableTokenRange) is left out.
__global__ void __launch_bounds__(kOrderThreads) order_table_lists_kernel(BaseTablesView base, std::int32_t tokens) {
  using Scan = cub::BlockScan<std::int32_t, kOrderThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ std::int32_t carry;
  extern __shared__ std::int32_t range_cursor[];  // [ranges]: the counts, then the next free entry of each range
  const TokenOrderView<std::uint32_t>& order = base.token_order;
  const std::int32_t ranges = order.ranges, limit = ranges * kTableTokenRange;
  const std::int64_t list = blockIdx.x;
  const std::int32_t count = min(max(base.counts[list], 0), base.length);
  const std::int32_t* ids = base.ids + list * base.length;
  const half* scores = base.scores + list * base.length;
  std::int32_t* offsets = order.offsets + list * (ranges + 1);
  std::uint32_t* entries = order.entries + list * base.length;
  if (blockIdx.x == 0 && threadIdx.x == 0) *order.prompt = tokens;
  for (std::int32_t q = std::int32_t(threadIdx.x); q < ranges; q += kOrderThreads) range_cursor[q] = 0;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (std::int32_t e = std::int32_t(threadIdx.x); e < count; e += kOrderThreads) {
    const std::int32_t id = ids[e];
    if (id >= 0 && id < limit) atomicAdd(range_cursor + id / kTableTokenRange, 1);
  }
  __syncthreads();
  for (std::int32_t q0 = 0; q0 < ranges; q0 += kOrderThreads) {
    const std::int32_t q = q0 + std::int32_t(threadIdx.x);
    std::int32_t first = 0, total = 0;
    Scan(scan).ExclusiveSum(q < ranges ? range_cursor[q] : 0, first, total);
    first += carry;
    if (q < ranges) {
      offsets[q] = first;
      range_cursor[q] = first;
    }
    __syncthreads();  // every thread has read carry (and the scan's storage is free again)
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) offsets[ranges] = carry;
  for (std::int32_t e = std::int32_t(threadIdx.x); e < count; e += kOrderThreads) {
    const std::int32_t id = ids[e];
    if (id < 0 || id >= limit) continue;
    entries[atomicAdd(range_cursor + id / kTableTokenRange, 1)] = token_order_entry(scores[e].bits, id);
  }
}

/// One thread per entry of every row's segment: entry k is position k % length of chosen list k / length. Kept
/// entries get key row << 31 | id and their value; every other entry (past the row's chosen lists, of a list that
/// contributes nothing, of a bad row) the id kAbsentListEntry, which sorts after the row's kept ones.
__global__ void __launch_bounds__(kStreamThreads)
    fill_sparse_entries(TableScoresParams p, std::int32_t segment, SparseTableBuffers buf) {
  const std::int64_t total = p.rows * segment;
  const std::int32_t length = p.tables.length;
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / segment;
    const std::int32_t k = std::int32_t(e % segment);
    const std::int32_t i = k / length, position = k % length;
    const TableRow r = table_row(p, row, INT_MAX);
    std::int32_t id = kAbsentListEntry;
    if (r.valid && i < r.count) {
      const ChosenList list = chosen_list(p.tables, r, p.chosen.indices[row * p.chosen.capacity + i]);
      const EntryValue value = entry_value(p, list, row, i);
      if (value.valid && position < list.entries() &&
          kvsift::detail::list_entry_kept(list.id(position), r.length, p.window)) {
        id = list.id(position);
        buf.values[e] = value(list.score(position));
      }
    }
    buf.keys[0][e] = std::uint64_t(row) << 31 | std::uint32_t(id);
    buf.ordinals[0][e] = k;
  }
}

__device__ __forceinline__ bool is_absent(std::uint64_t key) { return (key & 0x7fffffffu) == kAbsentListEntry; }

/// flags[e] = 1 where sorted entry e starts a run of equal keys (a candidate: row and id), 0 elsewhere and at
/// flags[items], so that the scan's positions[items] is the total.
__global__ void __launch_bounds__(kStreamThreads)
    flag_sparse_runs(const std::uint64_t* keys, std::int64_t items, std::int32_t* flags) {
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e <= items;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    flags[e] = e < items && !is_absent(keys[e]) && (e == 0 || keys[e - 1] != keys[e]);
  }
}

/// The score of the run of equal keys from sorted entry e: per query-head block (ascending within the run: the
/// stable sort keeps the ordinals' order) the sum of its values, the max over the blocks, 0 for a block without
/// the id. `per_block`: entries of one block's chosen lists (their count * length).
__device__ std::int64_t run_score(const std::uint64_t* keys, const std::int32_t* ordinals, const std::int64_t* values,
                                  std::int64_t e, std::int64_t items, std::int32_t per_block,
                                  std::int32_t heads_per_row) {
  const std::uint64_t key = keys[e];
  std::int64_t best = LLONG_MIN, sum = 0;
  std::int32_t block = -1, blocks = 0;
  for (; e < items && keys[e] == key; ++e) {
    const std::int32_t k = ordinals[e];
    if (k / per_block != block) {
      if (blocks > 0) best = max64(best, sum);
      block = k / per_block;
      sum = 0;
      ++blocks;
    }
    sum += values[k];
  }
  best = max64(best, sum);
  return blocks < heads_per_row ? max64(best, 0) : best;
}

/// One thread per sorted entry: a run's first entry writes the candidate at its rank in the row (the scan of the
/// flags) with the run's score; a row's first entry writes the row's count and row_k (-1 for a bad row).
__global__ void __launch_bounds__(kStreamThreads)
    write_sparse_candidates(TableScoresParams p, SelectionView out, MatrixView<float> sums, std::int32_t segment,
                            const std::uint64_t* keys, const std::int32_t* ordinals, const std::int64_t* values,
                            const std::int32_t* flags, const std::int32_t* positions) {
  const std::int64_t items = p.rows * segment;
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < items;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / segment, first = row * segment;
    if (e == first) {
      const TableRow r = table_row(p, row, INT_MAX);
      const std::int32_t count = positions[first + segment] - positions[first];
      out.counts[row] = r.valid ? count : -1;
      p.row_k[row] = r.valid ? min(p.budget(r.length), count) : -1;
    }
    if (flags[e] == 0) continue;
    const std::int64_t at = row * out.capacity + (positions[e] - positions[first]);
    out.indices[at] = std::int32_t(keys[e] & 0x7fffffffu);
    if (out.log_weights != nullptr) out.log_weights[at] = 0.0f;
    const std::int32_t count = p.chosen.counts[row];  // a run exists only in a valid row
    const std::int32_t per_block = count / p.heads_per_row * p.tables.length;
    sums.row(row)[at - row * out.capacity] = kvsift::fixed_to_float(
        run_score(keys, ordinals, values + first, e, items, per_block, p.heads_per_row));
  }
}

}  // namespace

template <class KV>
cudaError_t launch_subspace_scores(const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                                   std::int32_t list_count, const KV& kv, std::int32_t row, std::int32_t token_begin,
                                   std::int32_t tokens, const MatrixView<float>& out, cudaStream_t stream) {
  const std::int32_t centroids = base.centroids_per_subspace;
  const std::int32_t groups = (centroids + kScoreLists - 1) / kScoreLists;
  const auto token_blocks = std::int32_t((std::int64_t(tokens) + kScoreThreads - 1) / kScoreThreads);
  const std::int64_t blocks = subspace_scores_blocks(centroids, list_begin, list_count, tokens);
  subspace_scores_kernel<KV><<<unsigned(blocks), kScoreThreads, 0, stream>>>(
      base, table_head, list_begin, list_count, kv, row, token_begin, tokens, out, list_begin / centroids, groups,
      token_blocks);
  return cudaGetLastError();
}

namespace {

/// The key bits a radix sort of keys (row, value) orders: the value's `value_bits` and enough for `rows` rows.
int row_keyed_end_bit(int value_bits, std::int64_t rows) {
  int bits = value_bits;
  while ((std::int64_t(1) << (bits - value_bits)) < rows) ++bits;
  return bits;
}
/// A list sort orders the rank key (16 bits) and the row.
int table_list_end_bit(std::int64_t rows) { return row_keyed_end_bit(16, rows); }
/// The sparse sort's keys: the id (31 bits) and the row.
constexpr int kSparseIdBits = 31;

}  // namespace

cudaError_t table_list_sort_bytes(std::int64_t rows, std::int32_t tokens, std::size_t* bytes) {
  const std::int64_t chunk = std::min(rows, kTableListSortRows);
  cub::DoubleBuffer<std::uint32_t> keys(nullptr, nullptr);
  cub::DoubleBuffer<std::int32_t> columns(nullptr, nullptr);
  return cub::DeviceRadixSort::SortPairs(nullptr, *bytes, keys, columns, chunk * tokens, 0, table_list_end_bit(chunk));
}

cudaError_t launch_store_table_lists(const MatrixView<const float>& scores, std::int32_t tokens, std::int32_t keep,
                                     const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                                     const TableListBuffers& buf, cudaStream_t stream) {
  const std::int32_t kept = std::min(keep, tokens);
  const std::int64_t first_list = std::int64_t(table_head) * base.lists() + list_begin;
  if (tokens == 0) {  // every count 0
    write_table_lists<<<grid_stride_blocks(scores.rows, kStreamThreads), kStreamThreads, 0, stream>>>(
        scores, kept, base, first_list, 0, scores.rows, nullptr);
    return cudaGetLastError();
  }
  const int end_bit = table_list_end_bit(std::min(scores.rows, kTableListSortRows));
  for (std::int64_t row_begin = 0; row_begin < scores.rows; row_begin += kTableListSortRows) {
    const std::int64_t rows = std::min(scores.rows - row_begin, kTableListSortRows), items = rows * kept;
    select_table_lists<<<unsigned(rows), kListSelectThreads, 0, stream>>>(scores, tokens, kept, row_begin, buf);
    if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
    cub::DoubleBuffer<std::uint32_t> keys(buf.keys[0], buf.keys[1]);
    cub::DoubleBuffer<std::int32_t> columns(buf.columns[0], buf.columns[1]);
    std::size_t bytes = buf.cub_temp_bytes;
    if (cudaError_t s = cub::DeviceRadixSort::SortPairs(buf.cub_temp, bytes, keys, columns, items, 0, end_bit, stream);
        s != cudaSuccess) {
      return s;
    }
    write_table_lists<<<grid_stride_blocks(rows * kept, kStreamThreads), kStreamThreads, 0, stream>>>(
        scores, kept, base, first_list, row_begin, rows, columns.Current());
    if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  }
  return cudaSuccess;
}

template <class KV>
cudaError_t launch_append_tables(const ScoreTablesView<std::int32_t>& tables, const KV& kv,
                                 const std::int32_t* slots, const std::int32_t* lengths, cudaStream_t stream) {
  const std::int64_t items = std::int64_t(kv.batch) * tables.table_heads * tables.lists();
  append_tables_kernel<KV><<<grid_stride_blocks(items, kStreamThreads), kStreamThreads, 0, stream>>>(tables, kv, slots,
                                                                                                     lengths);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_nearest_centroids(const QueryView<const T>& q, const ScoreTablesView<const std::int32_t>& tables,
                                     const std::int32_t* slots, std::int32_t probes, const SelectionView& chosen,
                                     std::int32_t* weights, cudaStream_t stream) {
  const std::int64_t warps = std::int64_t(q.batch) * q.heads * tables.subspaces;
  nearest_centroids_kernel<T><<<grid_stride_blocks(warps * 32, kProbeThreads), kProbeThreads, 0, stream>>>(
      q, tables, slots, probes, chosen, weights);
  return cudaGetLastError();
}

DenseTablePlan plan_dense_tables(std::int64_t rows, std::int32_t max_tokens, int multiprocessors,
                                 std::size_t smem_limit) {
  DenseTablePlan plan;
  if (rows == 0 || max_tokens == 0) return plan;
  const auto parts_for = [&](int shift) {
    return std::int32_t((std::int64_t(max_tokens) + (std::int64_t(1) << shift) - 1) >> shift);
  };
  int shift = 10;
  static_assert(kTableTokenRange == 1 << 10);
  while (shift < kDenseMaxShift && (std::size_t(2) << shift) * kDenseKeyBytes <= smem_limit &&
         rows * parts_for(shift) > std::int64_t(kDenseCtasPerSm) * multiprocessors) {
    ++shift;
  }
  plan.parts = parts_for(shift);
  plan.key_shift = shift;
  plan.smem_bytes = (std::size_t(1) << shift) * kDenseKeyBytes;
  return plan;
}

cudaError_t launch_order_table_lists(const BaseTablesView& base, std::int32_t tokens, cudaStream_t stream) {
  const std::int64_t lists = std::int64_t(base.table_heads) * base.lists();
  const std::size_t smem = std::size_t(base.token_order.ranges) * sizeof(std::int32_t);
  if (cudaError_t s = open_shared_memory<order_table_lists_kernel>(); s != cudaSuccess) return s;
  order_table_lists_kernel<<<unsigned(lists), kOrderThreads, smem, stream>>>(base, tokens);
  return cudaGetLastError();
}

cudaError_t launch_table_scores_dense(const TableScoresParams& p, const MatrixView<float>& scores,
                                      std::int32_t max_tokens, const DenseTablePlan& plan,
                                      const DenseTableBuffers& buf, cudaStream_t stream) {
  if (plan.parts > 0) {
    if (cudaError_t s = open_shared_memory<dense_range_scores>(); s != cudaSuccess) return s;
    if (cudaError_t s = launch(dense_range_scores,
                               {.grid = dim3(unsigned(p.rows * plan.parts)), .block = dim3(kDenseThreads),
                                .smem = plan.smem_bytes, .stream = stream},
                               p, scores, max_tokens, plan, buf);
        s != cudaSuccess) {
      return s;
    }
  }
  dense_row_k<<<grid_stride_blocks(p.rows, kStreamThreads), kStreamThreads, 0, stream>>>(p, max_tokens, plan, buf);
  return cudaGetLastError();
}

cudaError_t table_scores_sparse_cub_bytes(std::int64_t rows, std::int32_t segment, std::size_t* bytes) {
  const std::int64_t items = rows * segment;
  cub::DoubleBuffer<std::uint64_t> keys(nullptr, nullptr);
  cub::DoubleBuffer<std::int32_t> ordinals(nullptr, nullptr);
  std::size_t sort_bytes = 0, scan_bytes = 0;
  if (cudaError_t s = cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys, ordinals, items, 0,
                                                      row_keyed_end_bit(kSparseIdBits, rows));
      s != cudaSuccess) {
    return s;
  }
  const cudaError_t s = cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, static_cast<const std::int32_t*>(nullptr),
                                                      static_cast<std::int32_t*>(nullptr), items + 1);
  *bytes = sort_bytes > scan_bytes ? sort_bytes : scan_bytes;
  return s;
}

cudaError_t launch_table_scores_sparse(const TableScoresParams& p, const SelectionView& out,
                                       const MatrixView<float>& sums, std::int32_t segment,
                                       const SparseTableBuffers& buf, cudaStream_t stream) {
  const std::int64_t items = p.rows * segment;
  fill_sparse_entries<<<grid_stride_blocks(items, kStreamThreads), kStreamThreads, 0, stream>>>(p, segment, buf);
  if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  cub::DoubleBuffer<std::uint64_t> keys(buf.keys[0], buf.keys[1]);
  cub::DoubleBuffer<std::int32_t> ordinals(buf.ordinals[0], buf.ordinals[1]);
  std::size_t bytes = buf.cub_temp_bytes;
  if (cudaError_t s = cub::DeviceRadixSort::SortPairs(buf.cub_temp, bytes, keys, ordinals, items, 0,
                                                      row_keyed_end_bit(kSparseIdBits, p.rows), stream);
      s != cudaSuccess) {
    return s;
  }
  // The spare buffers after the sort: the run flags in the ordinals' (items + 1 long), their scan in the keys'.
  std::int32_t* flags = ordinals.Alternate();
  auto* positions = reinterpret_cast<std::int32_t*>(keys.Alternate());
  flag_sparse_runs<<<grid_stride_blocks(items + 1, kStreamThreads), kStreamThreads, 0, stream>>>(keys.Current(), items,
                                                                                                 flags);
  if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  bytes = buf.cub_temp_bytes;
  if (cudaError_t s = cub::DeviceScan::ExclusiveSum(buf.cub_temp, bytes, static_cast<const std::int32_t*>(flags),
                                                    positions, items + 1, stream);
      s != cudaSuccess) {
    return s;
  }
  write_sparse_candidates<<<grid_stride_blocks(items, kStreamThreads), kStreamThreads, 0, stream>>>(
      p, out, sums, segment, keys.Current(), ordinals.Current(), buf.values, flags, positions);
  return cudaGetLastError();
}

#define KVSIFT_INSTANTIATE(T)                                                                                        \
  template cudaError_t launch_subspace_scores<ContiguousKVView<const T>>(                                           \
      const BaseTablesView&, std::int32_t, std::int32_t, std::int32_t, const ContiguousKVView<const T>&,             \
      std::int32_t, std::int32_t, std::int32_t, const MatrixView<float>&, cudaStream_t);                            \
  template cudaError_t launch_subspace_scores<PagedKVView<const T>>(                                                \
      const BaseTablesView&, std::int32_t, std::int32_t, std::int32_t, const PagedKVView<const T>&, std::int32_t,    \
      std::int32_t, std::int32_t, const MatrixView<float>&, cudaStream_t);                                          \
  template cudaError_t launch_append_tables<ContiguousKVView<const T>>(                                             \
      const ScoreTablesView<std::int32_t>&, const ContiguousKVView<const T>&, const std::int32_t*,                   \
      const std::int32_t*, cudaStream_t);                                                                            \
  template cudaError_t launch_append_tables<PagedKVView<const T>>(const ScoreTablesView<std::int32_t>&,             \
                                                                  const PagedKVView<const T>&, const std::int32_t*, \
                                                                  const std::int32_t*, cudaStream_t);               \
  template cudaError_t launch_nearest_centroids<T>(const QueryView<const T>&,                                      \
                                                   const ScoreTablesView<const std::int32_t>&, const std::int32_t*,  \
                                                   std::int32_t, const SelectionView&, std::int32_t*, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
