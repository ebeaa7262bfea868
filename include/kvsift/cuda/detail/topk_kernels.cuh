#pragma once
/// The slice kernel of cuda::topk_rows (the held kernel, detail/topk_held_kernels.cuh, serves rows that fit a
/// cluster's registers): one thread-block cluster per score row finds
/// the threshold with LaneHistogramSelect and writes the chosen indices with BlockRadixSelect::emit over the
/// row's middle, its CTAs each holding a contiguous slice; a second kernel unites the rows of a GQA group
/// (heads_per_row > 1). Launched by kernels/topk_rows.cu.

#include <cuda_runtime.h>

#include <cstdint>

#include "kvsift/core/ranking.hpp"
#include "kvsift/cuda/detail/block_select.cuh"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/topk_launch.hpp"

namespace kvsift::cuda::detail {

/// The part of a score row the select kernel needs: its selection row, its k and its candidates. A row whose
/// length or k lies outside its range (device inputs, unchecked before the launch) is invalid.
struct TopKRowJob {
  std::int64_t selection_row;
  std::int32_t lo, hi;  ///< the middle [window.sink_end(len), window.recent_begin(len))
  std::int32_t picks;   ///< min(k_s, hi - lo)
  bool valid;

  __device__ static TopKRowJob of(const TopKRowsParams& p, std::int64_t score_row) {
    TopKRowJob job{};
    job.selection_row = score_row / p.heads_per_row;
    const std::int32_t length = p.lengths[job.selection_row / p.out.kv_heads];
    const std::int32_t k = p.row_k != nullptr ? p.row_k[job.selection_row] : p.k;
    job.valid = length >= 0 && length <= p.scores.cols && k >= 0 && k <= p.k;
    if (!job.valid) return job;
    job.lo = p.window.sink_end(length);
    job.hi = p.window.recent_begin(length);
    job.picks = min(k, job.hi - job.lo);
    return job;
  }
};

/// Where a selection row's picks are written as ids (TopKRowsOptions::ids): its row of the table, or nullptr
/// (positions written as they are).
__device__ __forceinline__ const std::int32_t* row_ids(const TopKRowsParams& p, std::int64_t selection_row) {
  return p.ids != nullptr ? p.ids + selection_row * p.ids_stride : nullptr;
}

/// What a pick at row position `position` writes: the position, or the row's id there.
__device__ __forceinline__ std::int32_t picked_id(const std::int32_t* ids, std::int32_t position) {
  return ids != nullptr ? __ldg(ids + position) : position;
}

/// BlockRadixSelect::find with the same digits, passes, decisions and result, its histogram counted in 32
/// copies, one per warp lane ([bin][lane]: a warp's 32 increments hit 32 distinct words in 32 distinct banks).
/// Why: the first digit of a rank word is the sign and the top of the exponent, so continuous scores fall in a
/// handful of its 256 bins, and a warp's shared atomics on one word are serialized. Measured on the H100
/// (2026-11-27, together with the 16-byte slice loads and the union below): 32 rows of 128K 95 -> 94 µs, 64
/// rows (slices read from L2) 113 -> 110 µs, but 1 and 8 rows 2-3.5 µs slower; so the serialization is not
/// the select's main cost. The copies cost 33 KiB of shared memory more than BlockRadixSelect, so scoring
/// kernels that fuse a select keep the small one. kThreads: a multiple of 256 (kParts threads sum a bin).
template <int kThreads>
class LaneHistogramSelect {
  using Base = BlockRadixSelect<kThreads>;
  static constexpr int kBins = Base::kBins;
  static constexpr int kRadixBits = Base::kRadixBits;
  static constexpr int kPasses = Base::kPasses;
  static constexpr int kLanes = 32;
  static constexpr int kParts = kThreads / kBins;
  static constexpr int kCopiesPerPart = kLanes / kParts;
  static_assert(kThreads % kBins == 0 && kLanes % kParts == 0, "whole bins per thread group");
  using BlockScan = cub::BlockScan<std::uint32_t, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;

 public:
  struct TempStorage {
    std::uint32_t copies[kBins * kLanes];  ///< [bin][lane]; all zero between passes (the summing threads clear them)
    /// The CTA's sums, read by the other CTAs of the group; double-buffered as BlockRadixSelect's.
    std::uint32_t histogram[2][kBins];
    RadixDecision decision;
    typename BlockScan::TempStorage scan;
  };

  __device__ explicit LaneHistogramSelect(TempStorage& storage) : temp_(storage) {}

  /// BlockRadixSelect::find's contract.
  template <class WordAt, class Group>
  __device__ SelectThreshold find(WordAt word_at, std::int32_t count, std::uint32_t k, const Group& group) {
    const std::uint32_t lane = threadIdx.x % kLanes;
    for (std::int32_t i = threadIdx.x; i < kBins * kLanes; i += kThreads) temp_.copies[i] = 0;
    __syncthreads();
    SelectThreshold t;
    std::uint32_t remaining = k;
#pragma unroll 1
    for (int pass = 0; pass < kPasses; ++pass) {
      const int shift = 32 - kRadixBits * (pass + 1);
#pragma unroll 4
      for (std::int32_t i = threadIdx.x; i < count; i += kThreads) {
        const std::uint32_t word = word_at(i);
        if (((word ^ t.prefix) & t.mask) == 0) atomicAdd(&temp_.copies[((word >> shift) & (kBins - 1)) * kLanes + lane], 1u);
      }
      __syncthreads();
      {
        // kParts consecutive threads per bin; the copies rotated by the bin put a warp's reads in 32 banks.
        const std::uint32_t bin = threadIdx.x / kParts, part = threadIdx.x % kParts;
        std::uint32_t sum = 0;
#pragma unroll
        for (int j = 0; j < kCopiesPerPart; ++j) {
          std::uint32_t& copy = temp_.copies[bin * kLanes + part * kCopiesPerPart + (j + bin) % kCopiesPerPart];
          sum += copy;
          copy = 0;
        }
#pragma unroll
        for (int offset = 1; offset < kParts; offset *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        if (part == 0) temp_.histogram[pass & 1][bin] = sum;
      }
      group.sync();
      if (choose_radix_digit<BlockScan, kBins>(temp_.histogram[pass & 1], shift, group, temp_.scan, temp_.decision, t,
                                               remaining)) {
        break;
      }
    }
    t.take_equal = remaining;
    return t;
  }

 private:
  TempStorage& temp_;
};

/// Grid: score rows * cluster CTAs along x, clusters of `cluster` consecutive CTAs (one per score row).
/// Dynamic shared memory: up to launch.smem_words rank words of this CTA's slice.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) topk_rows_select(const __grid_constant__ TopKRowsParams p) {
  using Select = BlockRadixSelect<kThreads>;
  using Find = LaneHistogramSelect<kThreads>;
  // Not one union: a CTA's emit writes temp while slower CTAs of its cluster may still read find_temp.
  __shared__ typename Select::TempStorage temp;
  __shared__ typename Find::TempStorage find_temp;
  extern __shared__ std::uint32_t slice_words[];
  programmatic_start();  // the scores, lengths and budgets
  const std::int32_t cluster = p.launch.cluster;
  const std::int64_t score_row = blockIdx.x / cluster;
  const std::int32_t rank = std::int32_t(blockIdx.x % cluster);  // the cluster's block rank: clusters tile x
  const TopKRowJob job = TopKRowJob::of(p, score_row);
  const bool grouped = p.heads_per_row > 1;
  // Grouped rows write no count: the union takes job.picks (the same for every score row of a selection row).
  std::int32_t* const count_out = grouped ? nullptr : p.out.counts + job.selection_row;
  // Everything below depends on the score row alone, so each cluster takes the same branches.
  if (!job.valid) {
    if (rank == 0 && threadIdx.x == 0 && count_out != nullptr) *count_out = -1;
    return;
  }
  // With nan_marks_row the count waits for the NaN scan below (a row with no pick reads nothing: count 0).
  if (rank == 0 && threadIdx.x == 0 && count_out != nullptr && (!p.nan_marks_row || job.picks == 0)) {
    *count_out = job.picks;
  }
  if (job.picks == 0) return;
  std::int32_t* const indices =
      grouped ? p.picks + score_row * p.k : p.out.indices + job.selection_row * p.out.capacity;
  float* const weights = grouped || p.out.log_weights == nullptr
                             ? nullptr
                             : p.out.log_weights + job.selection_row * p.out.capacity;

  const std::int32_t middle = job.hi - job.lo, slice = (middle + cluster - 1) / cluster;
  const std::int32_t begin = job.lo + min(middle, rank * slice);
  const std::int32_t count = min(job.hi, begin + slice) - begin;
  const float* const scores = p.scores.row(score_row) + begin;
  // The first `cached` scores of the slice as rank words in shared memory, the rest read from L2 on each pass
  // (a slice longer than the GPU's shared memory, e.g. 2 CTAs per row of 128K).
  const std::int32_t cached = min(count, p.launch.smem_words);
  // nan_marks_row: whether this CTA's slice holds a NaN (rank word 0, core/ranking.hpp), seen as the words are
  // made (no pass of its own over shared memory: measured on the H200, a separate pass cost 1-3 us at 1-8 rows and
  // 7 us at 64 rows of 128K); written before find and emit, whose cluster barriers order it against rank 0's remote
  // read at the end.
  __shared__ std::uint32_t slice_has_nan;
  {
    // 16-byte loads, kLoads of them in flight per thread before the first store (the slice is the CTA's whole
    // input).
    constexpr int kLoads = 4;
    const std::int32_t skew = std::int32_t(reinterpret_cast<std::uintptr_t>(scores) / sizeof(float) % 4);
    const std::int32_t head = min(cached, (4 - skew) % 4), vectors = (cached - head) / 4, tail = head + 4 * vectors;
    const float4* const in = reinterpret_cast<const float4*>(scores + head);
    std::uint32_t least = ~0u;  // this thread's smallest word: 0 where it met a NaN
    for (std::int32_t v = threadIdx.x; v < vectors; v += kThreads * kLoads) {
      float4 f[kLoads];
#pragma unroll
      for (int j = 0; j < kLoads; ++j) f[j] = v + j * kThreads < vectors ? __ldg(in + v + j * kThreads) : float4{};
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        if (v + j * kThreads < vectors) {
          const std::uint32_t w0 = rank_word(f[j].x), w1 = rank_word(f[j].y), w2 = rank_word(f[j].z),
                              w3 = rank_word(f[j].w);
          std::uint32_t* const to = slice_words + head + 4 * (v + j * kThreads);
          to[0] = w0;
          to[1] = w1;
          to[2] = w2;
          to[3] = w3;
          least = min(least, min(min(w0, w1), min(w2, w3)));
        }
      }
    }
    if (std::int32_t(threadIdx.x) < head) {
      const std::uint32_t w = rank_word(scores[threadIdx.x]);
      slice_words[threadIdx.x] = w;
      least = min(least, w);
    }
    if (std::int32_t(threadIdx.x) < cached - tail) {
      const std::uint32_t w = rank_word(scores[tail + threadIdx.x]);
      slice_words[tail + threadIdx.x] = w;
      least = min(least, w);
    }
    if (p.nan_marks_row) {
      // The part of the slice past shared memory, read from L2 once more.
      for (std::int32_t i = cached + threadIdx.x; i < count; i += kThreads) least = min(least, rank_word(__ldg(scores + i)));
      const bool any = __syncthreads_or(least == 0u) != 0;
      if (threadIdx.x == 0) slice_has_nan = any ? 1u : 0u;
    } else {
      __syncthreads();
    }
  }
  const auto word_at = [&](std::int32_t i) { return i < cached ? slice_words[i] : rank_word(__ldg(scores + i)); };
  const std::int32_t* const ids = row_ids(p, job.selection_row);  // nullptr when grouped: ids need heads_per_row 1
  const auto out = [&](std::int32_t i, std::uint32_t position) {
    indices[position] = picked_id(ids, begin + i);
    if (weights != nullptr) weights[position] = 0.0f;
  };
  const ClusterGroup group{};
  const SelectThreshold threshold = job.picks == middle ? SelectThreshold::all(std::uint32_t(middle))
                                                        : Find(find_temp).find(word_at, count, job.picks, group);
  Select(temp).emit(word_at, count, threshold, out, group);
  if (p.nan_marks_row) {
    if (rank == 0 && threadIdx.x == 0 && count_out != nullptr) {
      *count_out = group.sum(&slice_has_nan) > 0 ? -1 : job.picks;
    }
    group.finish();  // every CTA's flag stays readable until rank 0 has read it
  }
}

/// The body of topk_rows_union for selection row blockIdx.x (valid job) with its bitmap at `bits`.
template <int kThreads, class Scan>
__device__ __forceinline__ void topk_rows_unite(const TopKRowsParams& p, const TopKRowJob& job, std::uint32_t* bits,
                                                typename Scan::TempStorage& scan) {
  const std::int64_t s = blockIdx.x;
  const std::int32_t base = job.lo / 32;
  const std::int32_t words = job.hi > job.lo ? (job.hi + 31) / 32 - base : 0;
  for (std::int32_t w = threadIdx.x; w < words; w += kThreads) bits[w] = 0;
  __syncthreads();
  constexpr int kLoads = 8;
  const std::int32_t picked = job.picks;
  const std::int32_t all = p.heads_per_row * picked;  // pick f: head f / picked, entry f % picked (<= out.capacity)
  const std::int32_t* const picks = p.picks + s * p.heads_per_row * p.k;
  for (std::int32_t f = threadIdx.x; f < all; f += kThreads * kLoads) {
    std::int32_t token[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const std::int32_t g = f + j * kThreads;
      token[j] = g < all ? picks[std::int64_t(g / picked) * p.k + g % picked] : -1;
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      if (token[j] >= 0) atomicOr(&bits[token[j] / 32 - base], 1u << (token[j] % 32));
    }
  }
  __syncthreads();
  // Each thread a run of consecutive words: positions follow from a scan of the runs' bit counts.
  const std::int32_t per_thread = (words + kThreads - 1) / kThreads;
  const std::int32_t w_begin = min(words, std::int32_t(threadIdx.x) * per_thread), w_end = min(words, w_begin + per_thread);
  std::uint32_t mine = 0;
  for (std::int32_t w = w_begin; w < w_end; ++w) mine += __popc(bits[w]);
  std::uint32_t position = 0, total = 0;
  Scan(scan).ExclusiveSum(mine, position, total);
  std::int32_t* const indices = p.out.indices + s * p.out.capacity;
  float* const weights = p.out.log_weights != nullptr ? p.out.log_weights + s * p.out.capacity : nullptr;
  for (std::int32_t w = w_begin; w < w_end; ++w) {
    for (std::uint32_t word = bits[w]; word != 0; word &= word - 1) {
      indices[position] = (base + w) * 32 + __ffs(word) - 1;
      if (weights != nullptr) weights[position] = 0.0f;
      ++position;
    }
  }
  if (threadIdx.x == 0) p.out.counts[s] = std::int32_t(total);
}

/// heads_per_row > 1: selection row blockIdx.x gets the union of its score rows' picks, ascending, through a
/// bitmap of its middle (in dynamic shared memory, or p.union_bits where p.union_bits is set). Every score row
/// of the selection row has job.picks picks (one length, one k_s). The picks are loaded kLoads per thread
/// before the first bitmap update, and the bitmap's accesses name their memory space. ncu on the H100, 8 rows
/// of 4 x 3932 picks: 41 µs before, 29 µs with both; the rest is likely the output loop (one thread per run of
/// words, divergent, its stores uncoalesced).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) topk_rows_union(const __grid_constant__ TopKRowsParams p) {
  // Warp scans: 0.1 KiB of shared memory at 1024 threads, where the raking scan's 4 KiB would push the largest
  // bitmap in shared memory past the 48 KiB available without opt-in.
  using BlockScan = cub::BlockScan<std::uint32_t, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ typename BlockScan::TempStorage scan;
  extern __shared__ std::uint32_t shared_bits[];
  programmatic_start();  // the select kernel's picks
  const std::int64_t s = blockIdx.x;
  const std::int64_t first_row = s * p.heads_per_row;
  const TopKRowJob job = TopKRowJob::of(p, first_row);
  if (!job.valid) {
    if (threadIdx.x == 0) p.out.counts[s] = -1;
    return;
  }
  // Two calls, each inlined with a pointer of one memory space: shared-memory atomics and loads where the bitmap
  // is in shared memory (a pointer that may be either makes them generic, much slower).
  if (p.union_bits != nullptr) {
    topk_rows_unite<kThreads, BlockScan>(p, job, p.union_bits + s * p.union_words, scan);
  } else {
    topk_rows_unite<kThreads, BlockScan>(p, job, shared_bits, scan);
  }
}

}  // namespace kvsift::cuda::detail
