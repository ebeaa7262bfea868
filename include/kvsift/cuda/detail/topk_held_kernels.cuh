#pragma once
/// topk_rows' held kernel (kernels/topk_rows.cu): for rows whose middle fits a cluster's registers, each CTA of the
/// row's cluster loads its slice once (coalesced 16-byte loads where aligned) and keeps it in registers as rank
/// words (core/ranking.hpp: smaller word, better score). Rows one CTA holds go to the one-CTA kernel
/// (topk_cta_kernels.cuh): here a cluster has at least 2 CTAs. Steps, with two cluster barriers in the usual case:
///   1. an 8-bit histogram of the words' top digit per CTA; cluster barrier; every CTA reads all the cluster's
///      histograms over distributed shared memory and finds the same threshold digit, and per CTA the counts
///      better than and inside the threshold bin;
///   2. when the bin holds at most kHeldCandidates items (~3K of 128K normal scores): each CTA copies its bin's
///      words to its shared memory; cluster barrier; every CTA pulls all the lists and finishes the threshold
///      alone (12-bit passes over the candidates, then one warp ranks the last <= 32), with only CTA barriers;
///      else one more 8-bit cluster pass per digit, until the bin is small or the word is whole;
///   3. emit: a block scan of (better, tied) counts per thread places every chosen index in ascending order, ties
///      at the threshold to the smaller index: the same set and order as BlockRadixSelect (detail/block_select.cuh)
///      and cpu::topk_rows.
/// Measured on the H200 against the slice kernel (topk_kernels.cuh), k = 2048 of 131072: 13.4 against 19.7 µs
/// for 1 row, 17.1 against 24.0 µs for 8 (docs/experiments.md#topk-cluster-prototype).
/// Seeded (TopKRowsOptions::seed, a guess at the row's k-th best score, e.g. the previous step's): before step 1
/// each CTA copies its words at or above the seed's word into its bin copy; one cluster barrier later every CTA
/// knows their number, and where it lies in [picks, kHeldCandidates] these words are the candidates of step 2
/// (every pick is among them: the k-th best word is at or above the seed's), with no cluster histogram pass.
/// Otherwise (a guess too high or far too low) the kernel goes on as unseeded: the same picks, one cluster
/// barrier later.

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvsift/core/ranking.hpp"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/detail/topk_kernels.cuh"

namespace kvsift::cuda::detail {

/// Words of a CTA's threshold-bin copy (the candidates' buffer): a bin with more items takes another cluster pass.
inline constexpr int kHeldCandidates = 6144;
/// A word no rank_word is (NaN's is 0, -inf's 0xff800000): the padding of a CTA's registers past its slice.
inline constexpr std::uint32_t kNoWord = 0xffffffffu;

/// rank_word(-inf): the largest word of a number.
inline constexpr std::uint32_t kNegativeInfinityWord = 0xff800000u;

/// Dynamic shared memory of the held kernel: this CTA's bin copy, read by the cluster.
inline constexpr std::size_t topk_held_smem_bytes() { return (kHeldCandidates + 4) * sizeof(std::uint32_t); }

/// kComponents independent exclusive sums over the CTA (one warp per component), with their totals; two barriers.
/// `buffer` holds kComponents x 32 words; consecutive calls alternate between two buffers (no trailing barrier).
template <int kThreads, int kComponents>
__device__ __forceinline__ void held_block_scan(const std::uint32_t (&value)[kComponents],
                                                std::uint32_t (&exclusive)[kComponents],
                                                std::uint32_t (&total)[kComponents], std::uint32_t* buffer) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kComponents <= kWarps, "one warp per component");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  std::uint32_t x[kComponents];
#pragma unroll
  for (int m = 0; m < kComponents; ++m) x[m] = warp_inclusive_sum(value[m]);
  if (lane == 31) {
#pragma unroll
    for (int m = 0; m < kComponents; ++m) buffer[m * 32 + warp] = x[m];
  }
  __syncthreads();
  if (warp < kComponents) {
    buffer[warp * 32 + lane] = warp_inclusive_sum(lane < kWarps ? buffer[warp * 32 + lane] : 0u);
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < kComponents; ++m) {
    exclusive[m] = (warp > 0 ? buffer[m * 32 + warp - 1] : 0u) + x[m] - value[m];
    total[m] = buffer[m * 32 + kWarps - 1];
  }
}

/// Item j of a thread's kItems words (slots of 4; fewer than 4 words: one slot) is slice index
/// (j / 4 * kThreads + thread) * 4 + j % 4: each warp instruction reads consecutive 16-byte vectors.
template <int kItems>
inline constexpr int kHeldVec = kItems < 4 ? kItems : 4;

/// A score row's job and where its picks go: the start every held kernel shares. `finished`: nothing to rank
/// (an invalid row, no picks, or the whole middle, written here by the row's `size` CTAs). Rank 0 writes the
/// count, except that with nan_marks_row a row with picks to rank gets it after the NaN flags are read.
struct HeldRow {
  TopKRowJob job;
  std::int32_t* count_out;  ///< nullptr for a score row of a group (heads_per_row > 1)
  std::int32_t* indices;
  const std::int32_t* ids;  ///< the row's ids its picks are written as (TopKRowsOptions::ids), or nullptr
  float* weights;           ///< nullptr where none are asked for
  bool finished;
};

__device__ inline HeldRow start_held_row(const TopKRowsParams& p, std::int64_t score_row, int rank, int size) {
  HeldRow row{};
  row.job = TopKRowJob::of(p, score_row);
  const TopKRowJob& job = row.job;
  const bool grouped = p.heads_per_row > 1;
  const int tid = threadIdx.x, threads = blockDim.x;
  row.count_out = grouped ? nullptr : p.out.counts + job.selection_row;
  row.finished = true;
  if (!job.valid) {
    if (rank == 0 && tid == 0 && row.count_out != nullptr) *row.count_out = -1;
    return row;
  }
  if (rank == 0 && tid == 0 && row.count_out != nullptr && (!p.nan_marks_row || job.picks == 0)) {
    *row.count_out = job.picks;
  }
  if (job.picks == 0) return row;
  row.indices = grouped ? p.picks + score_row * p.k : p.out.indices + job.selection_row * p.out.capacity;
  row.ids = row_ids(p, job.selection_row);
  row.weights =
      grouped || p.out.log_weights == nullptr ? nullptr : p.out.log_weights + job.selection_row * p.out.capacity;
  const std::int32_t middle = job.hi - job.lo;
  if (job.picks == middle && !p.nan_marks_row) {  // the whole middle, nothing to rank
    for (std::int32_t i = rank * threads + tid; i < middle; i += size * threads) {
      row.indices[i] = picked_id(row.ids, job.lo + i);
      if (row.weights != nullptr) row.weights[i] = 0.0f;
    }
    return row;
  }
  row.finished = false;
  return row;
}

/// This thread's rank words of the `count` scores at `scores` (kHeldVec's layout; 16-byte loads where aligned),
/// kNoWord past them.
template <int kThreads, int kItems>
__device__ __forceinline__ void load_held_words(const float* scores, std::int32_t count,
                                                std::uint32_t (&word)[kItems]) {
  constexpr int kVec = kHeldVec<kItems>;
  constexpr int kGroups = kItems / kVec;
  const int tid = threadIdx.x;
  const auto load_scalar = [&] {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int i = (g * kThreads + tid) * kVec;
#pragma unroll
      for (int q = 0; q < kVec; ++q) word[kVec * g + q] = i + q < count ? rank_word(__ldg(scores + i + q)) : kNoWord;
    }
  };
  if constexpr (kVec != 4) {
    load_scalar();
  } else if ((reinterpret_cast<std::uintptr_t>(scores) & 15) != 0) {
    load_scalar();
  } else {
    float4 f[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int i = (g * kThreads + tid) * kVec;
      f[g] = i + 4 <= count ? __ldg(reinterpret_cast<const float4*>(scores + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int i = (g * kThreads + tid) * kVec;
      if (i + 4 <= count) {
        word[kVec * g + 0] = rank_word(f[g].x);
        word[kVec * g + 1] = rank_word(f[g].y);
        word[kVec * g + 2] = rank_word(f[g].z);
        word[kVec * g + 3] = rank_word(f[g].w);
      } else {
#pragma unroll
        for (int q = 0; q < kVec; ++q) word[kVec * g + q] = i + q < count ? rank_word(__ldg(scores + i + q)) : kNoWord;
      }
    }
  }
}

/// kHeldVec's layout of word_at(i) for i < count, kNoWord past count: a word source's loop where it computes words.
template <int kThreads, int kItems, class WordAt>
__device__ __forceinline__ void held_words_from(std::int32_t count, const WordAt& word_at,
                                                std::uint32_t (&word)[kItems]) {
  constexpr int kVec = kHeldVec<kItems>;
  constexpr int kGroups = kItems / kVec;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int i = (g * kThreads + int(threadIdx.x)) * kVec;
#pragma unroll
    for (int q = 0; q < kVec; ++q) word[kVec * g + q] = i + q < count ? word_at(i + q) : kNoWord;
  }
}

/// Where the one-CTA and held kernels get a score row's rank words. ScoreWords reads p.scores (topk_rows); a
/// selector's source computes them instead (A²ATS's code scan, kernels/selectors/a2ats/vq.cu VqWords), so that no
/// score row is written and read back. A source has smem_bytes() (host: its dynamic shared memory) and
/// load<kThreads>(p, score_row, first, count, word, smem): the words of row indices [first, first + count) in
/// kHeldVec's layout, kNoWord past count. Every thread of the CTA calls load (it may hold block barriers).
struct ScoreWords {
  std::size_t smem_bytes() const { return 0; }
  template <int kThreads, int kItems>
  __device__ __forceinline__ void load(const TopKRowsParams& p, std::int64_t score_row, std::int32_t first,
                                       std::int32_t count, std::uint32_t (&word)[kItems], unsigned char*) const {
    load_held_words<kThreads>(p.scores.row(score_row) + first, count, word);
  }
};

/// Writes this CTA's chosen words' indices in ascending index order: words whose masked bits are below `prefix`
/// (better), and of those equal to it (tied) the first `take_tied` of the row in index order. `better` and `tied`:
/// the row's better and tied words before this CTA's slice, whose first word is row index `first_index`. A block
/// scan of (better, tied) counts per thread places every index: the same set and order as BlockRadixSelect
/// (detail/block_select.cuh) and cpu::topk_rows. An index is written as ids[index] where `ids` is given (HeldRow):
/// the words are classified into two bit masks first, so their registers hold the ids, whose loads are issued
/// before the scan and wait behind its two barriers (the stores that follow may alias them as far as the compiler
/// knows, so loads issued between the stores would each wait for the store before). `scan_buffer`:
/// held_block_scan's, kItems / kHeldVec x 32 words.
template <int kThreads, int kItems>
__device__ __forceinline__ void emit_held_words(const std::uint32_t (&word)[kItems], std::uint32_t mask,
                                                std::uint32_t prefix, std::uint32_t take_tied, std::uint32_t better,
                                                std::uint32_t tied, std::int32_t first_index, std::int32_t* indices,
                                                const std::int32_t* ids, float* weights, std::uint32_t* scan_buffer) {
  constexpr int kVec = kHeldVec<kItems>;
  constexpr int kGroups = kItems / kVec;
  static_assert(kItems <= 32, "one bit per item");
  const int tid = threadIdx.x;
  const auto index_of = [&](int j) { return first_index + ((j / kVec) * kThreads + tid) * kVec + j % kVec; };
  std::uint32_t better_bits = 0, tied_bits = 0;  // bit j: item j is better than the threshold, or tied with it
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const std::uint32_t x = word[j];
    better_bits |= (x != kNoWord && (x & mask) < prefix ? 1u : 0u) << j;
    tied_bits |= (x != kNoWord && (x & mask) == prefix ? 1u : 0u) << j;
  }
  std::int32_t id[kItems];  // what each item writes if chosen
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    id[j] = ids != nullptr && ((better_bits | tied_bits) >> j & 1u) ? __ldg(ids + index_of(j)) : index_of(j);
  }
  std::uint32_t packed[kGroups], exclusive[kGroups], total[kGroups];
  constexpr std::uint32_t kGroupBits = (1u << kVec) - 1u;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    packed[g] = std::uint32_t(__popc(better_bits >> (kVec * g) & kGroupBits)) |
                std::uint32_t(__popc(tied_bits >> (kVec * g) & kGroupBits)) << 16;
  }
  held_block_scan<kThreads, kGroups>(packed, exclusive, total, scan_buffer);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    std::uint32_t at_better = better + (exclusive[g] & 0xffffu), at_tied = tied + (exclusive[g] >> 16);
    if (packed[g] != 0) {
#pragma unroll
      for (int q = 0; q < kVec; ++q) {
        const int j = kVec * g + q;
        std::int32_t at = -1;
        if (better_bits >> j & 1u) {
          at = std::int32_t(at_better + min(at_tied, take_tied));
          ++at_better;
        } else if (tied_bits >> j & 1u) {
          if (at_tied < take_tied) at = std::int32_t(at_better + at_tied);
          ++at_tied;
        }
        if (at >= 0) {
          indices[at] = id[j];
          if (weights != nullptr) weights[at] = 0.0f;
        }
      }
    }
    better += total[g] & 0xffffu;
    tied += total[g] >> 16;
  }
}

/// Grid: score rows * cluster CTAs along x, clusters of p.launch.cluster consecutive CTAs (one per score row); the
/// plan guarantees cluster * kThreads * kItems >= scores.cols. Dynamic shared memory: topk_held_smem_bytes(), then
/// the word source's.
template <int kThreads, int kItems, class Words = ScoreWords>
__global__ void __launch_bounds__(kThreads)
    topk_rows_held(const __grid_constant__ TopKRowsParams p, const __grid_constant__ Words words) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kVec = kHeldVec<kItems>;
  constexpr int kGroups = kItems / kVec;
  constexpr int kMaxCluster = 16;
  static_assert(kThreads >= 256 && kThreads % 32 == 0 && kItems % kVec == 0 && kGroups <= kWarps, "shape");
  static_assert(kThreads * kVec < 65536, "16-bit packed counts per group");
  __shared__ __align__(16) std::uint32_t histogram[2][256];                      // read by the cluster
  __shared__ __align__(16) std::uint32_t bins[kMaxCluster * 256];                 // the cluster's histograms, then bins
  __shared__ __align__(16) std::uint32_t candidates[kHeldCandidates + 4 * kMaxCluster];  // every CTA's bin copy
  __shared__ __align__(16) std::uint32_t scan_buffer[2][(kGroups > 1 ? kGroups : 1) * 32];
  __shared__ std::uint32_t before_bin[kMaxCluster], in_bin_of[kMaxCluster];
  __shared__ std::uint32_t offsets[kMaxCluster + 1];
  __shared__ std::uint32_t last_few[32];
  __shared__ std::uint32_t decision[3];
  __shared__ std::uint32_t cursor, few_cursor;
  __shared__ std::uint32_t slice_has_nan;  // read by rank 0 with nan_marks_row
  // Seeded: this CTA's words at or above the seed and the lowest of them, read by the cluster.
  __shared__ std::uint32_t seeded_count, seeded_lowest;
  // Per source rank, its bin copy's candidates better than / tied with the threshold (the gathered case).
  __shared__ std::uint32_t better_in_bin[kMaxCluster], tied_in_bin[kMaxCluster];
  extern __shared__ __align__(16) std::uint32_t bin_copy[];  // this CTA's bin, read by the cluster

  programmatic_start();  // the scores, lengths and budgets
  const ClusterGroup cluster;  // a cluster of p.launch.cluster CTAs
  const int size = p.launch.cluster;
  const int rank = int(blockIdx.x % size);  // clusters tile x
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const std::int64_t score_row = blockIdx.x / size;
  const HeldRow row = start_held_row(p, score_row, rank, size);
  if (row.finished) return;
  const TopKRowJob& job = row.job;
  std::int32_t* const count_out = row.count_out;
  std::int32_t* const indices = row.indices;
  float* const weights = row.weights;
  const std::int32_t middle = job.hi - job.lo;
  const std::int32_t slice = ((middle + size - 1) / size + 3) & ~3;
  const std::int32_t begin = min(middle, rank * slice);
  const std::int32_t count = min(middle, begin + slice) - begin;
  std::uint32_t word[kItems];
  words.template load<kThreads>(p, score_row, job.lo + begin, count, word,
                                reinterpret_cast<unsigned char*>(bin_copy) + topk_held_smem_bytes());
  for (int i = tid; i < 512; i += kThreads) (&histogram[0][0])[i] = 0;
  if (tid < kMaxCluster) {
    better_in_bin[tid] = 0;
    tied_in_bin[tid] = 0;
  }
  if (tid == 0) {
    cursor = 0;
    few_cursor = 0;
  }
  if (p.nan_marks_row) {
    // NaN's word is 0; written before the first cluster barrier, read by rank 0 after it.
    bool nan = false;
#pragma unroll
    for (int j = 0; j < kItems; ++j) nan = nan || word[j] == 0u;
    const bool any = __syncthreads_or(nan) != 0;
    if (tid == 0) slice_has_nan = any ? 1u : 0u;
  } else {
    __syncthreads();
  }

  const auto write_nan_count = [&] {  // rank 0, after the first cluster barrier: every slice's NaN flag is set
    if (p.nan_marks_row && rank == 0 && tid == 0 && count_out != nullptr) {
      std::uint32_t nan = 0;
      for (int q = 0; q < size; ++q) nan |= *cluster.of_rank(&slice_has_nan, q);
      *count_out = nan != 0 ? -1 : job.picks;
    }
  };
  // This CTA's words that `chosen` accepts, copied into bin_copy in no particular order (one shared atomic per
  // warp) while they fit; returns after a block barrier, with their number in `cursor`.
  const auto copy_to_bin = [&](auto chosen) {
    std::uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) mine += chosen(word[j]) ? 1u : 0u;
    std::uint32_t inclusive = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const std::uint32_t y = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += y;
    }
    std::uint32_t warp_base = 0;
    if (lane == 31 && inclusive > 0) warp_base = atomicAdd(&cursor, inclusive);
    std::uint32_t position = __shfl_sync(0xffffffffu, warp_base, 31) + inclusive - mine;
    if (mine > 0) {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        if (chosen(word[j])) {
          if (position < std::uint32_t(kHeldCandidates)) bin_copy[position] = word[j];
          ++position;
        }
      }
    }
    __syncthreads();
  };

  // The top byte is the first digit: leading bits common to the row would need one more cluster barrier to find
  // (measured: it cost more than it saved).
  int scan_turn = 0, bits = 0, pass = 0;
  std::uint32_t mask = 0u, prefix = 0u, remaining = std::uint32_t(job.picks), in_bin = 0;
  bool gathered = false;
  // ---- seeded: the words at or above the seed's word as the candidates, where there are enough and they fit
  const bool seeded = p.seed != nullptr;
  // The seed's word moved down the ranking by kSeedSlack units (2^-5 of a number's magnitude, ~3%): a seed taken
  // from the previous step sits as often just above the k-th word as below it, and a guess too high costs the
  // unseeded passes.
  const std::uint32_t seed_word =
      seeded ? min(rank_word(p.seed[job.selection_row]), kNegativeInfinityWord - kSeedSlack) + kSeedSlack : 0u;
  bool by_seed = false;
  if (seeded) {
    if (tid == 0) seeded_lowest = kNoWord;
    std::uint32_t lowest = kNoWord;
#pragma unroll
    for (int j = 0; j < kItems; ++j) lowest = min(lowest, word[j]);
    lowest = __reduce_min_sync(0xffffffffu, lowest);
    copy_to_bin([&](std::uint32_t x) { return x != kNoWord && x <= seed_word; });  // barriers after seeded_lowest
    if (lane == 0 && lowest != kNoWord) atomicMin(&seeded_lowest, lowest);
    const std::uint32_t own = cursor;
    // Padded to 4 words with kNoWord, which step 2 counts in a bin past every number's and never takes.
    if (own <= std::uint32_t(kHeldCandidates) && tid < int(((own + 3) & ~3u) - own)) bin_copy[own + tid] = kNoWord;
    if (tid == 0) seeded_count = own;
    cluster.sync();  // every CTA's count, lowest word and copy are complete
    write_nan_count();
    if (tid < size) {
      in_bin_of[tid] = *cluster.of_rank(&seeded_count, tid);
      offsets[tid] = *cluster.of_rank(&seeded_lowest, tid);  // the offsets are computed later
    }
    __syncthreads();
    std::uint32_t total = 0, row_lowest = kNoWord;
    for (int q = 0; q < size; ++q) {
      total += in_bin_of[q];
      row_lowest = min(row_lowest, offsets[q]);
    }
    by_seed = total >= std::uint32_t(job.picks) && total <= std::uint32_t(kHeldCandidates);
    if (by_seed) {
      // Every candidate lies in [row_lowest, seed_word]: step 2's digits start below the bits the two share,
      // unless those are all ones (the kNoWord padding would then match the prefix).
      bits = row_lowest == seed_word ? 32 : __clz(row_lowest ^ seed_word);
      mask = bits == 0 ? 0u : ~0u << (32 - bits);
      prefix = seed_word & mask;
      if (prefix == mask) bits = 0, mask = 0u, prefix = 0u;
      if (tid < size) before_bin[tid] = 0;
      gathered = true;
    } else if (tid == 0) {
      cursor = 0;  // for the unseeded copy; the passes below barrier before it
    }
    __syncthreads();  // offsets[] and cursor are free again
  }
  // ---- cluster passes: digits of up to 8 bits below the prefix, one cluster barrier each
  while (!by_seed) {
    const int width = min(8, 32 - bits);
    const int shift = 32 - bits - width;
    const std::uint32_t digit_mask = (1u << width) - 1u;
    std::uint32_t* const h = histogram[pass & 1];
    if (pass >= 2) {
      if (tid < 256) h[tid] = 0;
      __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (word[j] != kNoWord && (word[j] & mask) == prefix) atomicAdd(&h[(word[j] >> shift) & digit_mask], 1u);
    }
    cluster.sync();  // every CTA's histogram of this pass is complete
    if (pass == 0 && !seeded) write_nan_count();
    for (int t = tid; t < size * 64; t += kThreads) {  // all-gather, 16-byte remote loads
      const int q = t >> 6, v = t & 63;
      reinterpret_cast<uint4*>(bins)[t] = reinterpret_cast<const uint4*>(cluster.of_rank(&h[0], q))[v];
    }
    __syncthreads();
    std::uint32_t c[1] = {0u}, exclusive[1], total[1];
    if (tid < 256) {
      for (int q = 0; q < size; ++q) c[0] += bins[q * 256 + tid];
    }
    held_block_scan<kThreads, 1>(c, exclusive, total, scan_buffer[scan_turn]);
    scan_turn ^= 1;
    if (tid < 256 && exclusive[0] < remaining && remaining <= exclusive[0] + c[0]) {
      decision[0] = tid;
      decision[1] = exclusive[0];
      decision[2] = c[0];
    }
    __syncthreads();
    const std::uint32_t digit = decision[0], before = decision[1];
    in_bin = decision[2];
    for (int q = warp; q < size; q += kWarps) {
      std::uint32_t s = 0;
      for (std::uint32_t b = lane; b < digit; b += 32) s += bins[q * 256 + b];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (lane == 0) {
        before_bin[q] = (pass > 0 ? before_bin[q] : 0u) + s;
        in_bin_of[q] = bins[q * 256 + digit];
      }
    }
    __syncthreads();
    prefix |= digit << shift;
    mask |= digit_mask << shift;
    remaining -= before;
    bits += width;
    ++pass;
    if (in_bin == remaining || bits == 32) break;  // threshold found without candidates
    if (in_bin <= std::uint32_t(kHeldCandidates)) {
      gathered = true;
      break;
    }
  }

  if (gathered) {
    if (!by_seed) {
      // This CTA's bin into bin_copy (it fits: the bin holds at most kHeldCandidates words), padded to 4 words
      // with a word that never matches the prefix.
      copy_to_bin([&](std::uint32_t x) { return x != kNoWord && (x & mask) == prefix; });
      const std::uint32_t pad = prefix ^ 0x80000000u;
      const std::uint32_t own = in_bin_of[rank];
      if (tid < int(((own + 3) & ~3u) - own)) bin_copy[own + tid] = pad;
    }
    if (tid == 0) {
      std::uint32_t o = 0;
      for (int q = 0; q < size; ++q) {
        offsets[q] = o;
        o += (in_bin_of[q] + 3) & ~3u;
      }
      offsets[size] = o;
    }
    if (by_seed) {
      __syncthreads();  // the offsets; every copy was complete at the seeded cluster barrier
    } else {
      cluster.sync();  // every CTA's bin copy is complete
    }
    const std::uint32_t vectors = offsets[size] / 4;
    for (std::uint32_t v = tid; v < vectors; v += kThreads) {  // pull every copy, 16-byte remote loads
      int q = 0;
      while (q + 1 < size && offsets[q + 1] <= 4 * v) ++q;
      const uint4* from = reinterpret_cast<const uint4*>(cluster.of_rank(&bin_copy[0], q));
      reinterpret_cast<uint4*>(candidates)[v] = from[v - offsets[q] / 4];
    }
    cluster.arrive();  // done reading the others
    __syncthreads();
    // ---- the rest of the threshold from the candidates, in this CTA alone
    const std::uint32_t n = offsets[size];
    int done_bits = bits;
    while (done_bits < 32) {
      const int width = min(12, 32 - done_bits);
      const int shift = 32 - done_bits - width;
      const std::uint32_t digits = 1u << width;
      for (std::uint32_t i = tid; i < digits; i += kThreads) bins[i] = 0;
      __syncthreads();
      for (std::uint32_t i = tid; i < n; i += kThreads) {
        const std::uint32_t x = candidates[i];
        if ((x & mask) == prefix) atomicAdd(&bins[(x >> shift) & (digits - 1)], 1u);
      }
      __syncthreads();
      const std::uint32_t per_thread = digits >= kThreads ? digits / kThreads : 1u;
      const std::uint32_t first = tid * per_thread;
      std::uint32_t s[1] = {0u}, exclusive[1], total[1];
      if (first < digits) {
        for (std::uint32_t e = 0; e < per_thread; ++e) s[0] += bins[first + e];
      }
      held_block_scan<kThreads, 1>(s, exclusive, total, scan_buffer[scan_turn]);
      scan_turn ^= 1;
      if (first < digits && exclusive[0] < remaining && remaining <= exclusive[0] + s[0]) {
        std::uint32_t cumulative = exclusive[0];
        for (std::uint32_t e = 0; e < per_thread; ++e) {
          const std::uint32_t cc = bins[first + e];
          if (remaining <= cumulative + cc) {
            decision[0] = first + e;
            decision[1] = cumulative;
            decision[2] = cc;
            break;
          }
          cumulative += cc;
        }
      }
      __syncthreads();
      prefix |= decision[0] << shift;
      mask |= (digits - 1) << shift;
      remaining -= decision[1];
      const std::uint32_t left = decision[2];
      done_bits += width;
      if (done_bits == 32) break;
      // Every word left in the bin is taken. Seeded, only where the whole bin lies at or above the seed: the
      // words of the row beyond the seed are in no copy, and the emit below takes a bin's words in index order.
      if (left == remaining && (!by_seed || (prefix | ~mask) <= seed_word)) break;
      if (left <= 32) {
        // Few left: one warp ranks them directly.
        for (std::uint32_t i = tid; i < n; i += kThreads) {
          const std::uint32_t x = candidates[i];
          if ((x & mask) == prefix) last_few[atomicAdd(&few_cursor, 1u)] = x;
        }
        __syncthreads();
        if (warp == 0) {
          const std::uint32_t x = lane < int(left) ? last_few[lane] : kNoWord;
          std::uint32_t less = 0, less_or_equal = 0;
#pragma unroll
          for (int m = 0; m < 32; ++m) {
            const std::uint32_t y = __shfl_sync(0xffffffffu, x, m);
            if (m < int(left)) {
              less += y < x ? 1u : 0u;
              less_or_equal += y <= x ? 1u : 0u;
            }
          }
          if (lane < int(left) && less < remaining && remaining <= less_or_equal) {  // equal lanes write equal values
            decision[0] = x;
            decision[1] = less;
          }
        }
        __syncthreads();
        prefix = decision[0];
        mask = 0xffffffffu;
        remaining -= decision[1];
        break;
      }
    }
    // Per source rank: its candidates better than / tied with the threshold. Each rank's copy goes to
    // kWarps / size warps (one warp per rank alone took 40% of a one-CTA row's time when its bin held the whole
    // row), 32 candidates a step, two shared atomics per warp.
    const int parts = max(1, kWarps / size);
    for (int task = warp; task < size * parts; task += kWarps) {
      const int q = task / parts, part = task % parts;
      const std::uint32_t end = offsets[q] + in_bin_of[q];
      std::uint32_t better = 0, tied = 0;
      for (std::uint32_t b = offsets[q] + 32u * std::uint32_t(part); b < end; b += 32u * std::uint32_t(parts)) {
        const std::uint32_t i = b + lane;
        const std::uint32_t x = i < end ? candidates[i] & mask : kNoWord;
        better += __popc(__ballot_sync(0xffffffffu, i < end && x < prefix));
        tied += __popc(__ballot_sync(0xffffffffu, i < end && x == prefix));
      }
      if (lane == 0 && (better | tied) != 0) {
        atomicAdd(&better_in_bin[q], better);
        atomicAdd(&tied_in_bin[q], tied);
      }
    }
    __syncthreads();
  } else {
    cluster.arrive();  // the others may still read this CTA's histogram
  }

  // ---- emit in ascending index order; ties at the threshold: the first `take_tied` in index order
  const std::uint32_t take_tied = remaining;
  std::uint32_t better = 0, tied = 0;
  for (int q = 0; q < rank; ++q) {
    better += before_bin[q] + better_in_bin[q];  // better_in_bin: 0 unless gathered
    tied += gathered ? tied_in_bin[q] : in_bin_of[q];
  }
  emit_held_words<kThreads>(word, mask, prefix, take_tied, better, tied, job.lo + begin, indices, row.ids, weights,
                            scan_buffer[scan_turn]);
  cluster.wait();
}

}  // namespace kvsift::cuda::detail
