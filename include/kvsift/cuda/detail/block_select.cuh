#pragma once
/// BlockRadixSelect: the k best of a set of rank words (core/ranking.hpp) held by one CTA, or spread over the
/// CTAs of a thread-block cluster, as a block collective in CUB's style (a class template with TempStorage).
/// It finds the threshold of the k best by radix histogram passes, and then writes the chosen items in index
/// order, so that the output is ascending and ties at the threshold go to the smaller index (kvsift's ranking
/// rule). A scoring kernel can call it on the words it just computed, fusing score and select; topk_rows is
/// built on it (detail/topk_kernels.cuh).
///
/// The CTAs of a group each own a contiguous slice of the items, in group rank order. `Group` is
/// SingleBlock (one CTA) or ClusterGroup (the CTAs of this cluster, histograms summed through distributed
/// shared memory). Every thread of every CTA in the group must make the same calls: they hold barriers.

#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>

namespace kvsift::cuda::detail {

/// One CTA: the group's sums are the CTA's own values.
struct SingleBlock {
  __device__ void sync() const { __syncthreads(); }
  __device__ std::uint32_t rank() const { return 0; }
  __device__ std::uint32_t sum(const std::uint32_t* local) const { return *local; }
  __device__ std::uint32_t sum_before(const std::uint32_t* local) const { return 0; }
  __device__ void finish() const {}
};

/// The CTAs of this thread-block cluster, at most 16 (sm_90; a cluster of one CTA elsewhere, or in a launch without
/// clusters): sync() is a cluster barrier (it orders shared-memory writes before it against distributed reads
/// after it), sums read the same shared variable of every CTA, of_rank maps a shared variable to another CTA's.
/// finish() keeps each CTA's shared memory alive until no CTA reads it; arrive() and wait() are its two halves
/// for a kernel with work between them (this CTA is done reading the others; the others are done with it).
struct ClusterGroup {
  __device__ void sync() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (size() > 1) {
      cooperative_groups::this_cluster().sync();
      return;
    }
#endif
    __syncthreads();
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __device__ std::uint32_t rank() const { return cooperative_groups::this_cluster().block_rank(); }
  __device__ std::uint32_t size() const { return cooperative_groups::this_cluster().num_blocks(); }
#else
  __device__ std::uint32_t rank() const { return 0; }
  __device__ std::uint32_t size() const { return 1; }
#endif
  __device__ std::uint32_t sum(const std::uint32_t* local) const { return sum_ranks(local, size()); }
  __device__ std::uint32_t sum_before(const std::uint32_t* local) const { return sum_ranks(local, rank()); }
  __device__ void finish() const {
    if (size() > 1) sync();
  }
  __device__ void arrive() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (size() > 1) asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
  }
  __device__ void wait() const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (size() > 1) asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
  }
  template <class U>
  __device__ const U* of_rank(const U* local, std::uint32_t rank) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (size() > 1) return cooperative_groups::this_cluster().map_shared_rank(const_cast<U*>(local), rank);
#endif
    return local;
  }
  /// The sum of *local over the CTAs of rank < ranks. Unrolled to the largest cluster, so that the remote
  /// loads are all in flight before the first one returns.
  __device__ std::uint32_t sum_ranks(const std::uint32_t* local, std::uint32_t ranks) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    constexpr std::uint32_t kMaxClusterSize = 16;
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    std::uint32_t values[kMaxClusterSize];
#pragma unroll
    for (std::uint32_t r = 0; r < kMaxClusterSize; ++r) {
      values[r] = r < ranks ? *cluster.map_shared_rank(const_cast<std::uint32_t*>(local), r) : 0u;
    }
    std::uint32_t total = 0;
#pragma unroll
    for (std::uint32_t r = 0; r < kMaxClusterSize; ++r) total += values[r];
    return total;
#else
    return ranks > 0 ? *local : 0u;
#endif
  }
};

/// Which items are chosen: those whose masked word is below `prefix` (better), and of those equal to it
/// (tied at the threshold), the first `take_equal` of the group in index order.
struct SelectThreshold {
  std::uint32_t prefix = 0;
  std::uint32_t mask = 0;
  std::uint32_t take_equal = 0;

  /// Every one of `items` items (mask 0: all are tied, all taken).
  static __device__ SelectThreshold all(std::uint32_t items) { return {0u, 0u, items}; }
  __device__ bool better(std::uint32_t word) const { return (word & mask) < prefix; }
  __device__ bool equal(std::uint32_t word) const { return (word & mask) == prefix; }
};

/// A radix pass's decision, in shared memory for every thread of the CTA.
struct RadixDecision {
  std::uint32_t digit, before, in_digit;
};

/// The decision of one radix pass, shared by BlockRadixSelect::find and LaneHistogramSelect::find
/// (detail/topk_kernels.cuh): from this CTA's counts of the pass's kBins digits (`histogram`, summed over the
/// group), the digit that holds the `remaining`-th best item. Narrows the threshold `t` to it and counts
/// `remaining` down by the items of better digits; true when every item of that digit is taken (the threshold
/// needs no more bits: the same in every CTA). Every thread of the CTA calls it (a block scan and a barrier).
template <class BlockScan, int kBins, class Group>
__device__ bool choose_radix_digit(const std::uint32_t* histogram, int shift, const Group& group,
                                   typename BlockScan::TempStorage& scan, RadixDecision& decision, SelectThreshold& t,
                                   std::uint32_t& remaining) {
  const std::uint32_t in_bin = threadIdx.x < kBins ? group.sum(&histogram[threadIdx.x]) : 0u;
  std::uint32_t before = 0;
  BlockScan(scan).ExclusiveSum(in_bin, before);
  if (threadIdx.x < kBins && before < remaining && remaining <= before + in_bin) {
    decision = {std::uint32_t(threadIdx.x), before, in_bin};
  }
  __syncthreads();
  t.prefix |= decision.digit << shift;
  t.mask |= std::uint32_t(kBins - 1) << shift;
  remaining -= decision.before;
  return decision.in_digit == remaining;
}

template <int kThreads, int kItemsPerThread = 4>
class BlockRadixSelect {
 public:
  static constexpr int kRadixBits = 8;
  static constexpr int kBins = 1 << kRadixBits;
  static constexpr int kPasses = 32 / kRadixBits;
  static constexpr int kTile = kThreads * kItemsPerThread;
  static_assert(kThreads >= kBins && kThreads % 32 == 0, "one thread per histogram bin");
  static_assert(kTile < (1 << 16), "a tile's counts are packed in 16 bits");

 private:
  using BlockScan = cub::BlockScan<std::uint32_t, kThreads>;
  using BlockReduce = cub::BlockReduce<unsigned long long, kThreads>;

 public:
  struct TempStorage {
    /// Double-buffered: a pass clears one buffer while other CTAs may still read the previous pass's.
    std::uint32_t histogram[2][kBins];
    std::uint32_t better;  ///< this CTA's items better than the threshold, then tied with it
    std::uint32_t equal;
    RadixDecision decision;
    std::uint32_t group_better, group_equal;
    union {
      typename BlockScan::TempStorage scan;
      typename BlockReduce::TempStorage reduce;
    };
  };

  __device__ explicit BlockRadixSelect(TempStorage& storage) : temp_(storage) {}

  /// The threshold of the k best of the group's items (rank-word order: smaller words first); this CTA
  /// holds `count` of them, word_at(i) for i < count. Requires 1 <= k <= the group's item count.
  /// Ends with the group's threshold in every thread of every CTA.
  template <class WordAt, class Group>
  __device__ SelectThreshold find(WordAt word_at, std::int32_t count, std::uint32_t k, const Group& group) {
    SelectThreshold t;
    std::uint32_t remaining = k;
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass) {
      std::uint32_t* histogram = temp_.histogram[pass & 1];
      const int shift = 32 - kRadixBits * (pass + 1);
      if (threadIdx.x < kBins) histogram[threadIdx.x] = 0;
      __syncthreads();
#pragma unroll 4
      for (std::int32_t i = threadIdx.x; i < count; i += kThreads) {
        const std::uint32_t word = word_at(i);
        if (((word ^ t.prefix) & t.mask) == 0) atomicAdd(&histogram[(word >> shift) & (kBins - 1)], 1u);
      }
      group.sync();
      if (choose_radix_digit<BlockScan, kBins>(histogram, shift, group, temp_.scan, temp_.decision, t, remaining)) {
        break;
      }
    }
    t.take_equal = remaining;
    return t;
  }

  /// Calls out(i, position) for each chosen item i < count of this CTA, with its position among the
  /// group's chosen items in index order (CTA rank, then i): positions are 0, 1, ... over the group.
  /// Every CTA of the group calls it with the same threshold; it ends with group.finish() (no CTA returns
  /// while another may read its shared memory).
  template <class WordAt, class Emit, class Group>
  __device__ void emit(WordAt word_at, std::int32_t count, const SelectThreshold& t, Emit out, const Group& group) {
    // This CTA's counts, then the group's before it.
    unsigned long long mine = 0;  // better in the low half, equal in the high half
#pragma unroll 4
    for (std::int32_t i = threadIdx.x; i < count; i += kThreads) {
      const std::uint32_t word = word_at(i);
      mine += t.better(word) ? 1ull : t.equal(word) ? (1ull << 32) : 0ull;
    }
    __syncthreads();  // temp_.scan of find() is done with before temp_.reduce reuses it
    mine = BlockReduce(temp_.reduce).Sum(mine);
    if (threadIdx.x == 0) {
      temp_.better = std::uint32_t(mine);
      temp_.equal = std::uint32_t(mine >> 32);
    }
    group.sync();
    if (threadIdx.x == 0) {
      temp_.group_better = group.sum_before(&temp_.better);
      temp_.group_equal = group.sum_before(&temp_.equal);
    }
    __syncthreads();
    std::uint32_t better = temp_.group_better, equal = temp_.group_equal;
#pragma unroll 1
    for (std::int32_t tile = 0; tile < count; tile += kTile) {
      const std::int32_t first = tile + std::int32_t(threadIdx.x) * kItemsPerThread;
      std::uint32_t words[kItemsPerThread];
      std::uint32_t packed = 0;  // better + (equal << 16)
#pragma unroll
      for (int j = 0; j < kItemsPerThread; ++j) {
        words[j] = first + j < count ? word_at(first + j) : 0u;
        if (first + j < count) packed += t.better(words[j]) ? 1u : t.equal(words[j]) ? 0x10000u : 0u;
      }
      std::uint32_t prefix = 0, total = 0;
      __syncthreads();  // the previous tile's scan (or the reduce above) is done with temp_.scan
      BlockScan(temp_.scan).ExclusiveSum(packed, prefix, total);
      std::uint32_t better_before = better + (prefix & 0xffffu), equal_before = equal + (prefix >> 16);
#pragma unroll
      for (int j = 0; j < kItemsPerThread; ++j) {
        if (first + j >= count) break;
        if (t.better(words[j])) {
          out(first + j, better_before + min(equal_before, t.take_equal));
          ++better_before;
        } else if (t.equal(words[j])) {
          if (equal_before < t.take_equal) out(first + j, better_before + equal_before);
          ++equal_before;
        }
      }
      better += total & 0xffffu;
      equal += total >> 16;
    }
    group.finish();
  }

 private:
  TempStorage& temp_;
};

}  // namespace kvsift::cuda::detail
