// CUDA inverted lists (cuda/inverted_lists.hpp). The union: the chosen lists' entries into one fixed segment per
// row, CUB's segmented sort by id, then one CTA per row keeps the first of each run of equal ids. A row of at most
// kBlockUnionItems entries (CTKVR's C' = 4 lists of 2560) is one launch instead: on sm_90 a cluster of 8 CTAs per
// row, each holding an eighth of the entries, writes the distinct ids in order from bitmaps of windows of 262,144
// ids; before sm_90 a CTA per row loads its entries into registers and writes its distinct ids in order from a
// bitmap of them in shared memory (ids below 262,144), or sorts them with a block radix sort over only the bits its
// largest id needs and writes the first of each run. An append after the union (UnionAppend, CTKVR's unindexed
// tokens) is written by the cluster in its launch, else by append_range's launch after the union's. The FIFO
// replacement: a CTA per row; scores are rounded to T by core/dtype.hpp's conversion (constexpr, so callable
// here), which gives the CPU's bits, NaN's too (CUDA's intrinsic writes another NaN payload).
#include <cooperative_groups.h>
#include <cub/block/block_discontinuity.cuh>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/cuda/detail/inverted_lists_launch.hpp"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/detail/rerank_launch.hpp"

namespace kvsift::cuda::detail {
namespace {

constexpr int kFillThreads = 256;
constexpr int kCompactThreads = 256;
constexpr int kCompactItems = 4;
constexpr int kReplaceThreads = 512;  // a CTA copies a list of up to a few thousand ids
constexpr int kBlockUnionThreads = 1024;
constexpr int kBlockUnionPerThread = kBlockUnionItems / kBlockUnionThreads;
static_assert(kBlockUnionPerThread * kBlockUnionThreads == kBlockUnionItems);
/// Rows whose kept ids are all below this go through a bitmap of the ids in shared memory (the sort's storage), not
/// the sort: CTKVR's 4 lists of 2560 at 128K took 30.4 us sorted on the H200.
constexpr std::int32_t kBlockUnionBitmapWords = 8192;
constexpr int kBlockUnionWordsPerThread = kBlockUnionBitmapWords / kBlockUnionThreads;
/// union_lists_cluster's shape: 8 CTAs of 256 threads a row, each thread 5 entries and at most 4 words of its
/// rank's eighth of a window's bitmap.
constexpr int kClusterUnionRanks = 8;
constexpr int kClusterUnionThreads = 256;

using kvsift::detail::kAbsentListEntry;

/// A reduction row is valid when its slot, length and chosen count are (cuda/inverted_lists.hpp); the count of its
/// segment is then chosen count * list_capacity.
template <class T>
__device__ bool reduction_row_valid(const ListReductionParams<T>& p, std::int64_t row, std::int32_t chosen_count) {
  const std::int64_t b = row / p.chosen.kv_heads;
  const std::int32_t slot = p.slots[b];
  return slot >= 0 && slot < p.lists.slots && p.lengths[b] >= 0 && chosen_count >= 0 &&
         chosen_count <= p.chosen.capacity;
}

/// One thread per entry of every row's segment: entry k is position k % list_capacity of chosen list k /
/// list_capacity. Entries past a row's end are neither written nor sorted.
template <class T>
__global__ void fill_list_entries(ListReductionParams<T> p, ListReductionBuffers buf) {
  programmatic_start();  // the chosen lists (launched as a programmatic dependent: launch.cuh)
  const std::int64_t total = p.rows * p.segment;
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / p.segment;
    const std::int32_t k = std::int32_t(e % p.segment);
    const std::int32_t chosen_count = p.chosen.counts[row];
    const bool valid = reduction_row_valid(p, row, chosen_count);
    if (k == 0) {
      buf.segment_begin[row] = std::int32_t(row * p.segment);
      buf.segment_end[row] = std::int32_t(row * p.segment) + (valid ? chosen_count * p.lists.list_capacity : 0);
    }
    const std::int32_t i = k / p.lists.list_capacity, position = k % p.lists.list_capacity;
    if (!valid || i >= chosen_count) continue;
    const std::int64_t b = row / p.chosen.kv_heads, h = row % p.chosen.kv_heads;
    const std::int32_t slot = p.slots[b], l = p.chosen.indices[row * p.chosen.capacity + i];
    std::int32_t key = kAbsentListEntry;
    if (l >= 0 && l < p.lists.lists) {
      const std::int32_t list_count = p.lists.count(slot, h, l);
      if (list_count >= 0 && list_count <= p.lists.list_capacity && position < list_count) {
        const std::int32_t id = p.lists.list_ids(slot, h, l)[position];
        if (kvsift::detail::list_entry_kept(id, p.lengths[b], p.window)) key = id;
      }
    }
    buf.keys_in[e] = key;
  }
}

/// One CTA per row over its sorted segment: the first entry of each run of equal ids (absent entries sort last)
/// is written at its rank among runs.
template <class T>
__global__ void __launch_bounds__(kCompactThreads) compact_list_entries(ListReductionParams<T> p,
                                                                         ListReductionBuffers buf) {
  programmatic_start();  // the sorted segments
  using BlockScan = cub::BlockScan<std::int32_t, kCompactThreads>;
  __shared__ typename BlockScan::TempStorage scan;
  const std::int64_t row = blockIdx.x;
  const std::int32_t chosen_count = p.chosen.counts[row];
  if (!reduction_row_valid(p, row, chosen_count)) {
    if (threadIdx.x == 0) p.out.counts[row] = -1;
    return;
  }
  const std::int32_t n = chosen_count * p.lists.list_capacity;
  const std::int32_t* keys = buf.keys_out + row * p.segment;
  std::int32_t* dst = p.out.indices + row * p.out.capacity;
  float* weights = p.out.log_weights != nullptr ? p.out.log_weights + row * p.out.capacity : nullptr;
  std::int32_t written = 0;
  for (std::int32_t tile = 0; tile < n; tile += kCompactThreads * kCompactItems) {
    const std::int32_t first = tile + std::int32_t(threadIdx.x) * kCompactItems;
    std::int32_t key[kCompactItems];
    bool head[kCompactItems];
    std::int32_t heads = 0;
#pragma unroll
    for (int j = 0; j < kCompactItems; ++j) {
      const std::int32_t i = first + j;
      key[j] = i < n ? keys[i] : kAbsentListEntry;
      head[j] = key[j] != kAbsentListEntry && (i == 0 || keys[i - 1] != key[j]);
      heads += head[j];
    }
    std::int32_t position = 0, total = 0;
    BlockScan(scan).ExclusiveSum(heads, position, total);
#pragma unroll
    for (int j = 0; j < kCompactItems; ++j) {
      if (!head[j]) continue;
      const std::int32_t at = written + position++;
      dst[at] = key[j];
      if (weights != nullptr) weights[at] = 0.0f;
    }
    written += total;
    __syncthreads();  // the scan storage is reused by the next tile
  }
  if (threadIdx.x == 0) p.out.counts[row] = written;
}

/// A union's dropped entry (an unchosen or short list's slot, an id the window or the length drops).
constexpr std::uint32_t kDropped = 0xffffffffu;

/// A valid row's entries k = entry(j), j < kItems, of its segment (position k % list_capacity of chosen list
/// chosen_row[k / list_capacity]) into keys: each one's id, or kDropped. Returns the largest kept id + 1, 0 when
/// none.
template <int kItems, class T, class Entry>
__device__ __forceinline__ std::uint32_t load_segment(const ListReductionParams<T>& p, std::int64_t row,
                                                      const std::int32_t* chosen_row, std::int32_t chosen_count,
                                                      Entry entry, std::uint32_t (&keys)[kItems]) {
  const std::int64_t b = row / p.chosen.kv_heads, h = row % p.chosen.kv_heads;
  const std::int32_t slot = p.slots[b], length = p.lengths[b], capacity = p.lists.list_capacity;
  const std::int32_t n = chosen_count * capacity;
  std::uint32_t top = 0;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const std::int32_t k = entry(j);
    keys[j] = kDropped;
    if (k >= n) continue;
    const std::int32_t l = chosen_row[k / capacity], position = k % capacity;
    if (l < 0 || l >= p.lists.lists) continue;
    const std::int32_t list_count = p.lists.count(slot, h, l);
    if (list_count < 0 || list_count > capacity || position >= list_count) continue;
    const std::int32_t id = p.lists.list_ids(slot, h, l)[position];
    if (!kvsift::detail::list_entry_kept(id, length, p.window)) continue;
    keys[j] = std::uint32_t(id);
    top = max(top, std::uint32_t(id) + 1);
  }
  return top;
}

/// The ids of a bitmap word's set bits (bit i: id base + i) below `limit`, ascending, at dst[position] on (weight 0
/// where weights are kept), position advanced past them.
__device__ __forceinline__ void write_bit_ids(std::uint32_t bits, std::uint32_t base, std::uint32_t limit,
                                              std::int32_t* dst, float* weights, std::int32_t& position) {
  for (; bits != 0; bits &= bits - 1) {
    const std::uint32_t id = base + std::uint32_t(__ffs(bits) - 1);
    if (id >= limit) return;  // ascending: the word's other ids are past the limit too
    dst[position] = std::int32_t(id);
    if (weights != nullptr) weights[position] = 0.0f;
    ++position;
  }
}

/// The union of one row of at most kBlockUnionItems entries: each thread loads entries [t * kPerThread, (t + 1) *
/// kPerThread) of the row's segment (the chosen lists one after another). Where every kept id is below 32 *
/// kBlockUnionBitmapWords, each sets its id's bit in a bitmap, and each thread writes the ids of a run of words in
/// order at the rank a block scan of the runs' bit counts gives. Else dropped entries become a sentinel above every
/// kept id, a block radix sort over the bits of the largest kept id orders them, and the first entry of each run of
/// equal ids is written at its rank.
template <class T>
__global__ void __launch_bounds__(kBlockUnionThreads) union_lists_block(ListReductionParams<T> p) {
  programmatic_start();  // the chosen lists (launched as a programmatic dependent: launch.cuh)
  using Sort = cub::BlockRadixSort<std::uint32_t, kBlockUnionThreads, kBlockUnionPerThread>;
  using Reduce = cub::BlockReduce<std::uint32_t, kBlockUnionThreads>;
  using Heads = cub::BlockDiscontinuity<std::uint32_t, kBlockUnionThreads>;
  using Scan = cub::BlockScan<std::int32_t, kBlockUnionThreads>;
  __shared__ union {
    typename Sort::TempStorage sort;
    typename Reduce::TempStorage reduce;
    typename Heads::TempStorage heads;
    typename Scan::TempStorage scan;
    std::uint32_t bitmap[kBlockUnionBitmapWords];
  } storage;
  static_assert(sizeof(storage.bitmap) <= sizeof(typename Sort::TempStorage), "the bitmap adds no shared memory");
  __shared__ std::uint32_t largest;
  const std::int64_t row = blockIdx.x;
  const std::int32_t chosen_count = p.chosen.counts[row];
  if (!reduction_row_valid(p, row, chosen_count)) {
    if (threadIdx.x == 0) p.out.counts[row] = -1;
    return;  // the whole CTA
  }
  std::uint32_t keys[kBlockUnionPerThread];
  const std::uint32_t top =
      load_segment(p, row, p.chosen.indices + row * p.chosen.capacity, chosen_count,
                   [](int j) { return std::int32_t(threadIdx.x) * kBlockUnionPerThread + j; }, keys);
  const std::uint32_t block_top =
      Reduce(storage.reduce).Reduce(top, [](std::uint32_t a, std::uint32_t c) { return a > c ? a : c; });
  if (threadIdx.x == 0) largest = block_top;
  __syncthreads();
  const std::uint32_t bound = largest;  // every kept id < bound
  if (bound == 0) {
    if (threadIdx.x == 0) p.out.counts[row] = 0;
    return;
  }
  std::int32_t* dst = p.out.indices + row * p.out.capacity;
  float* weights = p.out.log_weights != nullptr ? p.out.log_weights + row * p.out.capacity : nullptr;
  if (bound <= 32u * kBlockUnionBitmapWords) {
    const std::int32_t words = std::int32_t((bound + 31) / 32);
    for (std::int32_t w = std::int32_t(threadIdx.x); w < words; w += kBlockUnionThreads) storage.bitmap[w] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kBlockUnionPerThread; ++j) {
      if (keys[j] != kDropped) atomicOr(&storage.bitmap[keys[j] / 32], 1u << (keys[j] % 32));
    }
    __syncthreads();
    const std::int32_t first = std::int32_t(threadIdx.x) * kBlockUnionWordsPerThread;
    std::uint32_t run[kBlockUnionWordsPerThread];
    std::int32_t ids = 0;
#pragma unroll
    for (int j = 0; j < kBlockUnionWordsPerThread; ++j) {
      run[j] = first + j < words ? storage.bitmap[first + j] : 0u;
      ids += __popc(run[j]);
    }
    __syncthreads();  // the bitmap is read: the scan reuses its storage
    std::int32_t position = 0, total = 0;
    Scan(storage.scan).ExclusiveSum(ids, position, total);
#pragma unroll
    for (int j = 0; j < kBlockUnionWordsPerThread; ++j) {
      write_bit_ids(run[j], std::uint32_t(first + j) * 32u, 0xffffffffu, dst, weights, position);
    }
    if (threadIdx.x == 0) p.out.counts[row] = total;
    return;
  }
  // Dropped entries become the sentinel 2^bits - 1 >= bound, which sorts after every kept id.
  const int bits = 32 - __clz(bound);
  const std::uint32_t sentinel = bits == 32 ? kDropped : (1u << bits) - 1u;
#pragma unroll
  for (int j = 0; j < kBlockUnionPerThread; ++j) keys[j] = keys[j] == kDropped ? sentinel : keys[j];
  Sort(storage.sort).Sort(keys, 0, bits);
  __syncthreads();
  int flags[kBlockUnionPerThread];
  Heads(storage.heads).FlagHeads(flags, keys, [](std::uint32_t a, std::uint32_t c) { return a != c; });
  std::int32_t heads = 0;
#pragma unroll
  for (int j = 0; j < kBlockUnionPerThread; ++j) {
    flags[j] = flags[j] && keys[j] != sentinel;
    heads += flags[j];
  }
  __syncthreads();
  std::int32_t position = 0, total = 0;
  Scan(storage.scan).ExclusiveSum(heads, position, total);
#pragma unroll
  for (int j = 0; j < kBlockUnionPerThread; ++j) {
    if (!flags[j]) continue;
    dst[position] = std::int32_t(keys[j]);
    if (weights != nullptr) weights[position] = 0.0f;
    ++position;
  }
  if (threadIdx.x == 0) p.out.counts[row] = total;
}

/// recall_lists' choice in the cluster's launch (p.recall): the best picks = min(chosen.capacity, columns[b]) columns
/// of the row's score row by rank_key (NaN first, then the higher score, ties to the smaller column: topk_rows'
/// picks), one pass over the CTA's registers and one barrier per pick, the last pick's key the next pass's floor.
/// Every rank of the cluster finds the same picks (each reads the row, from L2 past the first): no cluster barrier,
/// no distributed shared memory. `picked` (shared) gets them in pick order; a rank with `writes` writes the row's
/// chosen lists ascending (topk_rows' order), their log-weights 0 where chosen has them, and its count. A row whose columns lie outside [0, scores.cols] gets
/// -1 (topk_rows' invalid row), as its union does.
template <class T>
__device__ std::int32_t recall_chosen(const ListReductionParams<T>& p, std::int64_t row, bool writes,
                                      std::int32_t* picked) {
  constexpr int kThreads = kClusterUnionThreads, kWarps = kThreads / 32;
  constexpr int kItems = kRecallFusedColumns / kThreads;
  static_assert(kItems * kThreads == kRecallFusedColumns);
  __shared__ std::uint64_t warp_best[2][kWarps];  // alternate: a warp one pick ahead writes the other
  const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const std::int32_t columns = p.recall.columns[row / p.chosen.kv_heads];
  if (columns < 0 || columns > p.recall.scores.cols) {
    if (writes && tid == 0) p.chosen.counts[row] = -1;
    return -1;
  }
  const std::int32_t picks = min(p.chosen.capacity, columns);
  const float* scores = p.recall.scores.row(row);
  std::uint32_t word[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int column = j * kThreads + tid;
    word[j] = column < columns ? rank_word(__ldg(scores + column)) : 0u;
  }
  std::uint64_t floor = 0;  // every key below it is picked
  for (std::int32_t pick = 0; pick < picks; ++pick) {
    std::uint64_t best = ~std::uint64_t(0);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int column = j * kThreads + tid;
      const std::uint64_t key = std::uint64_t(word[j]) << 32 | std::uint32_t(column);
      if (column < columns && key >= floor) best = min(best, key);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) best = min(best, __shfl_xor_sync(0xffffffffu, best, offset));
    if (lane == 0) warp_best[pick & 1][warp] = best;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) best = min(best, warp_best[pick & 1][w]);
    if (tid == 0) picked[pick] = std::int32_t(best & 0xffffffffu);
    floor = best + 1;
  }
  __syncthreads();  // the picks
  if (writes) {
    if (tid < picks) {  // each pick at its rank among the picks' columns
      std::int32_t at = 0;
      for (std::int32_t i = 0; i < picks; ++i) at += picked[i] < picked[tid];
      p.chosen.indices[row * p.chosen.capacity + at] = picked[tid];
      if (p.chosen.log_weights != nullptr) p.chosen.log_weights[row * p.chosen.capacity + at] = 0.0f;
    }
    if (tid == 0) p.chosen.counts[row] = picks;
  }
  return picks;
}

/// A row of at most kBlockUnionItems entries on a cluster of kClusterUnionRanks CTAs (sm_90). On one CTA the union
/// is a chain of dependent steps at ~16 cycles an instruction on 8 SMs (22 us for 10,240 entries a row at 128K,
/// batch 1, H200). Here each rank loads an eighth of the entries (rank r, thread t, item j: entry (j R + r) T + t,
/// so a warp reads consecutive entries of one list), and the cluster's largest kept id gives the bound. Then per
/// window of 32 kBlockUnionBitmapWords ids (one window up to 262,144 tokens; a cluster barrier first, as no rank
/// may touch another's shared memory before every rank has started): each rank sets the bits of its entries
/// in its own bitmap of the window; after a cluster barrier rank r owns an eighth of the window's words, ORs each
/// over every rank's bitmap and places its ids by a block scan of its threads' bit counts; each rank sends its
/// total to every rank, and after a second barrier (no rank reads another's bitmap past it) a rank's ids start
/// after the totals of the ranks below it and of the windows before. The totals alternate between two buffers: a
/// rank one window ahead writes the other. With p.append, the union's ids from the appended range's first token on
/// are counted (the union's count goes to counts_before) but not written, so the range's tokens, written by the
/// ranks in shares after the last window, follow the ids below it: the same entries as append_range after the
/// union, with no position written twice. A rank's ids below the range ride in the block scan's upper 16 bits.
template <class T>
__global__ void __launch_bounds__(kClusterUnionThreads) union_lists_cluster(ListReductionParams<T> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  programmatic_start();  // the chosen lists (launched as a programmatic dependent: launch.cuh)
  using Reduce = cub::BlockReduce<std::uint32_t, kClusterUnionThreads>;
  using Scan = cub::BlockScan<std::int32_t, kClusterUnionThreads>;
  constexpr int kRanks = kClusterUnionRanks, kThreads = kClusterUnionThreads;
  constexpr int kPerThread = kBlockUnionItems / (kRanks * kThreads);
  constexpr int kWordsPerThread = kBlockUnionBitmapWords / (kRanks * kThreads);
  constexpr std::uint32_t kWindowIds = 32u * kBlockUnionBitmapWords;
  static_assert(kPerThread * kRanks * kThreads == kBlockUnionItems);
  __shared__ std::uint32_t bitmap[kBlockUnionBitmapWords];
  __shared__ typename Reduce::TempStorage reduce;
  __shared__ typename Scan::TempStorage scan;
  __shared__ std::uint32_t rank_top[kRanks];       // each rank's largest kept id + 1, sent by that rank
  __shared__ std::int32_t rank_total[2][kRanks];  // each rank's ids in a window, sent by that rank
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int rank = int(cluster.block_rank()), tid = int(threadIdx.x);
  const std::int64_t row = blockIdx.x / kRanks;
  __shared__ std::int32_t recalled[kRecallFusedChosen];
  const bool recall = p.recall.scores.data != nullptr;
  const std::int32_t chosen_count = recall ? recall_chosen(p, row, rank == 0, recalled) : p.chosen.counts[row];
  const std::int32_t* chosen_row = recall ? recalled : p.chosen.indices + row * p.chosen.capacity;
  if (!reduction_row_valid(p, row, chosen_count)) {  // the same for every rank: the whole cluster returns
    if (rank == 0 && tid == 0) {
      p.out.counts[row] = -1;
      if (p.append.counts_before != nullptr) p.append.counts_before[row] = -1;
    }
    return;
  }
  static_assert(kBlockUnionItems < (1 << 16), "two counts in one scan");
  const std::int64_t b = row / p.chosen.kv_heads;
  // The appended range; without one, every id is below its begin.
  const kvsift::detail::TokenRange range =
      p.append.first != nullptr ? kvsift::detail::unindexed_range(p.append.first[p.slots[b]], p.lengths[b], p.window)
                                : kvsift::detail::TokenRange{0x7fffffff, 0x7fffffff};
  const std::uint32_t range_begin = std::uint32_t(range.begin);
  std::uint32_t keys[kPerThread];
  const std::uint32_t top =
      load_segment(p, row, chosen_row, chosen_count, [&](int j) { return (j * kRanks + rank) * kThreads + tid; }, keys);
  const std::uint32_t cta_top = Reduce(reduce).Reduce(top, [](std::uint32_t a, std::uint32_t c) { return a > c ? a : c; });
  cluster.sync();  // every rank has started: its shared memory may be written
  if (tid < kRanks) cluster.map_shared_rank(rank_top, tid)[rank] = __shfl_sync(0xffu, cta_top, 0);
  cluster.sync();  // every rank's maximum has arrived: the bound is the same on every rank
  std::uint32_t bound = 0;
#pragma unroll
  for (int r = 0; r < kRanks; ++r) bound = max(bound, rank_top[r]);
  std::int32_t* dst = p.out.indices + row * p.out.capacity;
  float* weights = p.out.log_weights != nullptr ? p.out.log_weights + row * p.out.capacity : nullptr;
  std::int32_t written = 0, written_below = 0;  // the ids of the windows before; those below the range
  int parity = 0;
  for (std::uint32_t window = 0; window < bound; window += kWindowIds, parity ^= 1) {
    const std::int32_t words = std::int32_t(min((bound - window + 31) / 32, std::uint32_t(kBlockUnionBitmapWords)));
    for (std::int32_t w = tid; w < words; w += kThreads) bitmap[w] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const std::uint32_t x = keys[j] - window;  // wraps past kWindowIds for ids below the window
      if (keys[j] != kDropped && x < kWindowIds) atomicOr(&bitmap[x / 32], 1u << (x % 32));
    }
    cluster.sync();  // every rank's bitmap of the window is complete and visible to the cluster
    // This rank's words [first, last), per_thread contiguous ones a thread, in order.
    const std::int32_t per_rank = (words + kRanks - 1) / kRanks, per_thread = (per_rank + kThreads - 1) / kThreads;
    const std::int32_t first = rank * per_rank, last = min(words, first + per_rank), mine = first + tid * per_thread;
    std::uint32_t run[kWordsPerThread];
    std::int32_t ids = 0, ids_below = 0;  // this thread's ids; of them, those below the range
#pragma unroll
    for (int j = 0; j < kWordsPerThread; ++j) {
      run[j] = 0;
      if (j >= per_thread || mine + j >= last) continue;
#pragma unroll
      for (int r = 0; r < kRanks; ++r) run[j] |= cluster.map_shared_rank(bitmap, r)[mine + j];
      ids += __popc(run[j]);
      const std::uint32_t base = window + std::uint32_t(mine + j) * 32u;  // the id of the word's bit 0
      const std::uint32_t below_mask =
          base >= range_begin ? 0u : range_begin - base >= 32u ? ~0u : (1u << (range_begin - base)) - 1u;
      ids_below += __popc(run[j] & below_mask);
    }
    std::int32_t position = 0, total = 0;  // both counts: ids below the range << 16 | ids
    Scan(scan).ExclusiveSum(ids_below << 16 | ids, position, total);
    if (tid < kRanks) cluster.map_shared_rank(&rank_total[parity][0], tid)[rank] = total;
    cluster.sync();  // every rank's total has arrived; no rank reads another's bitmap of this window any more
    std::int32_t below = 0, window_total = 0;
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      below += r < rank ? rank_total[parity][r] : 0;
      window_total += rank_total[parity][r];
    }
    position = (position & 0xffff) + written + (below & 0xffff);
#pragma unroll
    for (int j = 0; j < kWordsPerThread; ++j) {
      write_bit_ids(run[j], window + std::uint32_t(mine + j) * 32u, range_begin, dst, weights, position);
    }
    written += window_total & 0xffff;
    written_below += window_total >> 16;
    __syncthreads();  // the scan storage is reused by the next window
  }
  if (p.append.first == nullptr) {
    if (rank == 0 && tid == 0) p.out.counts[row] = written;
    return;
  }
  // append_range after the union: the range's tokens after the ids below it, unless they pass the capacity.
  const std::int64_t added = max(std::int64_t(0), std::int64_t(range.end) - range.begin);
  const bool fits = written_below + added <= p.out.capacity;
  if (rank == 0 && tid == 0) {
    if (p.append.counts_before != nullptr) p.append.counts_before[row] = written;
    p.out.counts[row] = fits ? std::int32_t(written_below + added) : -1;
  }
  if (!fits) return;
  for (std::int64_t i = std::int64_t(rank) * kThreads + tid; i < added; i += kRanks * kThreads) {
    dst[written_below + i] = std::int32_t(range.begin + i);
    if (weights != nullptr) weights[written_below + i] = 0.0f;
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // launched only where built_for_sm90 holds
#endif
}

/// One CTA per row: every thread reads the cursor before thread 0 advances it (the barrier between).
template <class T>
__global__ void __launch_bounds__(kReplaceThreads) replace_list_kernel(InvertedListsView<T> lists,
                                                                        const std::int32_t* slots,
                                                                        SelectionView entries,
                                                                        MatrixView<const float> scores,
                                                                        std::int32_t* replaced) {
  programmatic_start();  // the new list and its scores
  const std::int64_t row = blockIdx.x, b = row / entries.kv_heads, h = row % entries.kv_heads;
  const std::int32_t slot = slots[b], count = entries.counts[row];
  const bool slot_ok = slot >= 0 && slot < lists.slots;
  const std::int32_t l = slot_ok ? lists.cursors[std::int64_t(slot) * lists.kv_heads + h] : -1;
  const std::int32_t begin = slot_ok && lists.fifo_begin != nullptr ? lists.fifo_begin[slot] : 0;
  if (!slot_ok || count < 0 || count > entries.capacity || l < 0 || l >= lists.lists || begin < 0 ||
      begin >= lists.lists) {
    if (threadIdx.x == 0 && replaced != nullptr) replaced[row] = -1;
    return;  // the whole CTA
  }
  __syncthreads();
  const std::int32_t* src = entries.indices + row * entries.capacity;
  std::int32_t* dst = lists.list_ids(slot, h, l);
  T* dst_scores = lists.list_scores(slot, h, l);
  for (std::int32_t i = threadIdx.x; i < count; i += kReplaceThreads) {
    dst[i] = src[i];
    if (dst_scores != nullptr) dst_scores[i] = kvsift::from_float<T>(scores.row(row)[i]);
  }
  if (threadIdx.x == 0) {
    lists.count(slot, h, l) = count;
    lists.cursors[std::int64_t(slot) * lists.kv_heads + h] = lists.next_cursor(slot, l);
    if (replaced != nullptr) replaced[row] = l;
  }
}

}  // namespace

cudaError_t list_reduction_cub_bytes(std::int64_t rows, std::int32_t segment, std::size_t* bytes) {
  return cub::DeviceSegmentedSort::SortKeys(nullptr, *bytes, static_cast<const std::int32_t*>(nullptr),
                                            static_cast<std::int32_t*>(nullptr), rows * segment, rows,
                                            static_cast<const std::int32_t*>(nullptr),
                                            static_cast<const std::int32_t*>(nullptr));
}

namespace {

/// The append of a union that took no cluster launch (p.append.first set): append_range's own launch after it.
template <class T>
cudaError_t append_after_union(const ListReductionParams<T>& p, cudaStream_t stream) {
  if (p.append.first == nullptr) return cudaSuccess;
  return launch_append_range(p.out, p.slots, p.append.first, p.lengths, p.window, p.append.counts_before, stream);
}

}  // namespace

template <class T>
cudaError_t recall_fuses(std::int32_t columns, std::int32_t chosen_capacity, std::int32_t segment, bool* fused) {
  *fused = false;
  if (columns > kRecallFusedColumns || chosen_capacity > kRecallFusedChosen || segment > kBlockUnionItems) {
    return cudaSuccess;
  }
  return built_for_sm90<union_lists_cluster<T>>(fused);
}

template <class T>
cudaError_t launch_list_reduction(const ListReductionParams<T>& p, const ListReductionBuffers& buf,
                                  cudaStream_t stream) {
  if (p.recall.scores.data != nullptr) {
    bool fused = false;
    if (cudaError_t s = recall_fuses<T>(p.recall.scores.cols, p.chosen.capacity, p.segment, &fused); s != cudaSuccess) {
      return s;
    }
    if (!fused) return cudaErrorInvalidValue;
  }
  if (p.segment <= kBlockUnionItems) {
    bool sm90 = false;
    if (cudaError_t s = built_for_sm90<union_lists_cluster<T>>(&sm90); s != cudaSuccess) return s;
    if (sm90) {  // the append, if any, and recall_lists' choice, in the same launch
      return launch(union_lists_cluster<T>,
                    {.grid = dim3(unsigned(p.rows * kClusterUnionRanks)), .block = dim3(kClusterUnionThreads),
                     .stream = stream, .cluster = kClusterUnionRanks, .programmatic = true},
                    p);
    }
    if (cudaError_t s = launch(union_lists_block<T>,
                               {.grid = dim3(unsigned(p.rows)), .block = dim3(kBlockUnionThreads), .stream = stream,
                                .programmatic = true},
                               p);
        s != cudaSuccess) {
      return s;
    }
    return append_after_union(p, stream);
  }
  const std::int64_t items = p.rows * p.segment;
  if (cudaError_t s = launch(fill_list_entries<T>, {.grid = dim3(grid_stride_blocks(items, kFillThreads)),
                                                    .block = dim3(kFillThreads), .stream = stream, .programmatic = true},
                             p, buf);
      s != cudaSuccess) {
    return s;
  }
  std::size_t bytes = buf.cub_temp_bytes;
  const cudaError_t sorted = cub::DeviceSegmentedSort::SortKeys(
      buf.cub_temp, bytes, static_cast<const std::int32_t*>(buf.keys_in), buf.keys_out, items, p.rows,
      static_cast<const std::int32_t*>(buf.segment_begin), static_cast<const std::int32_t*>(buf.segment_end), stream);
  if (sorted != cudaSuccess) return sorted;
  if (cudaError_t s = launch(compact_list_entries<T>, {.grid = dim3(unsigned(p.rows)), .block = dim3(kCompactThreads),
                                                      .stream = stream, .programmatic = true},
                             p, buf);
      s != cudaSuccess) {
    return s;
  }
  return append_after_union(p, stream);
}

template <class T>
cudaError_t launch_replace_list(const InvertedListsView<T>& lists, const std::int32_t* slots,
                                const SelectionView& entries, const MatrixView<const float>& scores,
                                std::int32_t* replaced, cudaStream_t stream) {
  return launch(replace_list_kernel<T>,
                {.grid = dim3(unsigned(std::int64_t(entries.batch) * entries.kv_heads)), .block = dim3(kReplaceThreads),
                 .stream = stream, .programmatic = true},
                lists, slots, entries, scores, replaced);
}

#define KVSIFT_INSTANTIATE(T)                                                                                       \
  template cudaError_t recall_fuses<T>(std::int32_t, std::int32_t, std::int32_t, bool*);                            \
  template cudaError_t launch_list_reduction<T>(const ListReductionParams<T>&, const ListReductionBuffers&,          \
                                                cudaStream_t);                                                      \
  template cudaError_t launch_replace_list<T>(const InvertedListsView<T>&, const std::int32_t*, const SelectionView&, \
                                              const MatrixView<const float>&, std::int32_t*, cudaStream_t);
KVSIFT_LIST_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
