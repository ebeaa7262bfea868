// CUDA score tables (selectors/csattention/cuda/score_tables.hpp). Every value the CPU computes is computed here by the same rule:
// dot products are __fmaf_rn in ascending element order from 0 (the CPU's std::fma), rounded by the shared
// table_score; centroids rank by rank_key; the streaming insert is selectors/csattention/score_tables.hpp's insert_table_key run by
// one thread per list; the reductions add fixed-point integers, which are exact and so independent of the order
// the atomics or the sort leave them in. Conversions to fp16 go through core/dtype.hpp's (constexpr, so callable
// here) where a stored value is written, so the bits are the CPU's.
#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
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

/// Another CTA's shared variable in this cluster (the CTA's own below sm_90, where clusters are of one CTA).
template <class V>
__device__ __forceinline__ V* cluster_shared(V* local, std::uint32_t rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(local, rank);
#else
  return local;
#endif
}

/// A chosen list as the dense scan reads it: its entries and what each adds (an empty list where it adds
/// nothing).
struct DenseList {
  ChosenList list;
  EntryValue value;
};

/// A cluster per (row, window) of cluster << key_shift tokens; CTA `rank` owns tokens [begin, begin + keys) of
/// the window, begin = window_begin + rank * keys. Per query-head block, the cluster's CTAs share every chosen
/// list's entries (entry e to CTA e / kDenseThreads % cluster) and add each kept entry of the window into its
/// owner's int64 sum (64-bit atomics, exact in any order), marking the entry's token in its own bitmap of the
/// window; after the block, each owner folds its sums into its running maximum, rounded to fp32 (rounding is
/// monotonic, so the maximum of the rounded sums is the rounded maximum the CPU computes) and clears them. At the
/// end each owner ORs its tokens' bits from every CTA's bitmap: the tokens in some chosen list. Every operation on
/// another CTA's shared memory costs about the same whatever its width (H200, 128K, batch 1: the step took 198 us
/// with a remote flag store per entry besides the add, 134 without it, 278 with the add as three 32-bit adds), so
/// an entry costs one. Then every owned token below the length gets its score and the CTA's candidate count goes
/// to counts; dense_row_k sums them.
__global__ void __launch_bounds__(kDenseThreads)
    dense_window_scores(TableScoresParams p, MatrixView<float> scores, std::int32_t max_tokens, DenseTablePlan plan,
                        DenseTableBuffers buf) {
  using Reduce = cub::BlockReduce<std::int32_t, kDenseThreads>;
  __shared__ typename Reduce::TempStorage reduce;
  extern __shared__ __align__(16) unsigned char dense_smem[];
  auto* lists = reinterpret_cast<DenseList*>(dense_smem);
  auto* sums = reinterpret_cast<unsigned long long*>(lists + kDenseLists);
  const std::int32_t keys = 1 << plan.key_shift;
  auto* best = reinterpret_cast<float*>(sums + keys);
  auto* seen = reinterpret_cast<std::uint32_t*>(best + keys);  // a bit per token of the window
  const std::int32_t seen_words = (plan.cluster << plan.key_shift) / 32;
  const ClusterGroup cluster;
  const auto rank = std::uint32_t(blockIdx.x % unsigned(plan.cluster));  // a 1-D cluster's block rank
  const std::int64_t part = blockIdx.x / unsigned(plan.cluster);  // row * windows + window
  const std::int64_t row = part / plan.windows;
  const std::int64_t window_begin = (part % plan.windows) * plan.cluster << plan.key_shift;
  const TableRow r = table_row(p, row, max_tokens);
  if (!r.valid || window_begin >= r.length) return;  // the whole cluster
  for (std::int32_t k = std::int32_t(threadIdx.x); k < keys; k += kDenseThreads) {
    sums[k] = 0;
    best[k] = -INFINITY;
  }
  for (std::int32_t w = std::int32_t(threadIdx.x); w < seen_words; w += kDenseThreads) seen[w] = 0;
  // Kept entries of the window: [lo, hi), the window's tokens inside the middle (list_entry_kept).
  const std::int32_t lo = std::int32_t(max(window_begin, std::int64_t(p.window.sink_end(r.length))));
  const std::int32_t hi = std::int32_t(min(window_begin + (std::int64_t(plan.cluster) << plan.key_shift),
                                           std::int64_t(p.window.recent_begin(r.length))));
  const std::int32_t per_block = r.count / p.heads_per_row;
  const std::int32_t first = std::int32_t(rank) * kDenseThreads + std::int32_t(threadIdx.x);
  const std::int32_t stride = plan.cluster * kDenseThreads;
  cluster.sync();  // every CTA's sums are cleared before any other adds to them
  for (std::int32_t i0 = 0; i0 < r.count; i0 += kDenseLists) {
    const std::int32_t n = min(kDenseLists, r.count - i0);
    __syncthreads();  // the previous group's lists are read
    for (std::int32_t q = std::int32_t(threadIdx.x); q < n; q += kDenseThreads) {
      DenseList d{chosen_list(p.tables, r, p.chosen.indices[row * p.chosen.capacity + i0 + q]), {}};
      d.value = entry_value(p, d.list, row, i0 + q);
      if (!d.value.valid) d.list = {};
      lists[q] = d;
    }
    __syncthreads();
    for (std::int32_t q = 0; q < n; ++q) {
      const DenseList d = lists[q];
      const std::int32_t entries = d.list.entries();
      for (std::int32_t e0 = first; e0 < entries; e0 += 4 * stride) {
        std::int32_t ids[4];
        half values[4] = {};
#pragma unroll
        for (int u = 0; u < 4; ++u) {  // the loads first, all in flight
          const std::int32_t e = e0 + u * stride;
          ids[u] = e < entries ? d.list.id(e) : -1;
          if (e < entries) values[u] = d.list.score(e);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (ids[u] < lo || ids[u] >= hi) continue;
          const std::int32_t offset = std::int32_t(ids[u] - window_begin);
          const std::uint32_t owner = std::uint32_t(offset >> plan.key_shift);
          const std::int32_t key = offset & (keys - 1);
          const auto add = static_cast<unsigned long long>(d.value(values[u]));  // two's complement
          atomicAdd(plan.cluster == 1 ? sums + key : cluster_shared(sums + key, owner), add);
          atomicOr(seen + offset / 32, 1u << (offset % 32));
        }
      }
      if ((i0 + q + 1) % per_block != 0) continue;  // the block's last list: fold its sums
      cluster.sync();  // every add of the block is done
      for (std::int32_t k = std::int32_t(threadIdx.x); k < keys; k += kDenseThreads) {
        best[k] = fmaxf(best[k], kvsift::fixed_to_float(static_cast<std::int64_t>(sums[k])));
        sums[k] = 0;
      }
      if (i0 + q + 1 < r.count) cluster.sync();  // cleared before the next block adds (none after the last)
    }
  }
  // Every CTA's bitmap is complete (the last block's cluster barrier, or the first one where no list was chosen): the
  // owned words become the OR of every CTA's (only this CTA reads or writes its own range), and the barrier after
  // keeps each CTA's bitmap readable until the cluster has read it.
  const std::int32_t own_words = keys / 32, own_first = std::int32_t(rank) * own_words;
  for (std::int32_t w = std::int32_t(threadIdx.x); w < own_words; w += kDenseThreads) {
    std::uint32_t bits = 0;
    for (std::uint32_t c = 0; c < std::uint32_t(plan.cluster); ++c) bits |= *cluster_shared(seen + own_first + w, c);
    seen[own_first + w] = bits;
  }
  cluster.sync();
  const std::int64_t begin = window_begin + (std::int64_t(rank) << plan.key_shift);
  const std::int32_t owned = std::int32_t(max(std::int64_t(0), min(std::int64_t(keys), r.length - begin)));
  float* dst = scores.row(row) + begin;
  std::int32_t candidates = 0;
  for (std::int32_t k = std::int32_t(threadIdx.x); k < owned; k += kDenseThreads) {
    const bool listed = (seen[own_first + k / 32] >> (k % 32) & 1u) != 0;
    dst[k] = listed ? best[k] : -INFINITY;
    candidates += listed;
  }
  const std::int32_t total = Reduce(reduce).Sum(candidates);
  if (threadIdx.x == 0) buf.counts[row * buf.parts + (part % plan.windows) * plan.cluster + rank] = total;
}

/// A thread per row: row_k from the sum of its CTAs' counts over the windows below its length (-1 for a bad row).
__global__ void __launch_bounds__(kStreamThreads)
    dense_row_k(TableScoresParams p, std::int32_t max_tokens, DenseTablePlan plan, DenseTableBuffers buf) {
  for (std::int64_t row = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; row < p.rows;
       row += std::int64_t(gridDim.x) * blockDim.x) {
    const TableRow r = table_row(p, row, max_tokens);
    if (!r.valid) {
      p.row_k[row] = -1;
      continue;
    }
    const std::int64_t window_keys = std::int64_t(plan.cluster) << plan.key_shift;
    const std::int64_t parts = (r.length + window_keys - 1) / window_keys * plan.cluster;
    std::int32_t total = 0;
    for (std::int64_t q = 0; q < parts; ++q) total += buf.counts[row * buf.parts + q];
    p.row_k[row] = min(p.budget(r.length), total);
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

DenseTablePlan plan_dense_tables(std::int64_t rows, std::int32_t max_tokens, std::int32_t cluster,
                                 int multiprocessors, std::size_t smem_limit) {
  DenseTablePlan plan;
  plan.cluster = cluster;
  if (rows == 0 || max_tokens == 0) return plan;
  const std::size_t list_bytes = kDenseLists * sizeof(DenseList);
  int max_shift = 0;  // the largest range that fits, at least kDenseMinKeys
  while ((std::size_t(1) << (max_shift + 1)) * kDenseKeyBytes + list_bytes <= smem_limit) ++max_shift;
  while ((std::int32_t(1) << max_shift) < kDenseMinKeys) ++max_shift;
  const auto windows_for = [&](int shift) {
    const std::int64_t window = std::int64_t(cluster) << shift;
    return (std::int64_t(max_tokens) + window - 1) / window;
  };
  // Narrower ranges (more windows: each reads the row's lists again) while the grid fits twice the multiprocessors.
  int shift = max_shift;
  while ((std::int32_t(1) << (shift - 1)) >= kDenseMinKeys &&
         rows * windows_for(shift - 1) * cluster <= 2 * std::int64_t(multiprocessors)) {
    --shift;
  }
  // The smallest power-of-two range that still needs no more windows.
  const std::int64_t windows = windows_for(shift);
  while (shift > 5 && windows_for(shift - 1) == windows) --shift;
  plan.windows = std::int32_t(windows);
  plan.key_shift = shift;
  plan.smem_bytes = list_bytes + (std::size_t(1) << shift) * kDenseKeyBytes;
  return plan;
}

cudaError_t dense_tables_cluster(std::int32_t* cluster) {
  // Clusters exist only in code compiled for sm_90 or later: PTX of an older architecture JIT-compiled for a
  // newer GPU runs with clusters of one.
  bool sm90 = false;
  if (cudaError_t s = built_for_sm90<dense_window_scores>(&sm90); s != cudaSuccess) return s;
  *cluster = sm90 ? kDenseClusterMax : 1;
  return cudaSuccess;
}

cudaError_t launch_table_scores_dense(const TableScoresParams& p, const MatrixView<float>& scores,
                                      std::int32_t max_tokens, const DenseTablePlan& plan,
                                      const DenseTableBuffers& buf, cudaStream_t stream) {
  if (plan.windows > 0) {
    if (cudaError_t s = open_shared_memory<dense_window_scores>(); s != cudaSuccess) return s;
    if (cudaError_t s = launch(dense_window_scores,
                               {.grid = dim3(unsigned(p.rows * plan.windows * plan.cluster)), .block = dim3(kDenseThreads),
                                .smem = plan.smem_bytes, .stream = stream, .cluster = plan.cluster},
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
