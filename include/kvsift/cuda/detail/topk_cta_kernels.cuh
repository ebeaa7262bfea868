#pragma once
/// topk_rows' one-CTA kernel (kernels/topk_rows.cu): for rows whose middle one CTA's registers hold (kThreads x
/// kItems words: Quest's pages, a rerank's candidates), the threshold in few block barriers and no cluster. The held
/// kernel (topk_held_kernels.cuh) serves such rows from a cluster with a candidate stage and a generic pass loop:
/// Nsight Compute over Quest's 8 rows of 8192 pages (H200, 2026-11-29) counted ~1440 instructions per warp at 13.5
/// cycles each, its time spread over cluster barriers, gathers and bookkeeping rather than one hot spot. Here:
///   0. the row's lowest and highest typical word (not NaN, not -inf; one barrier, per-warp results in shared
///      memory): where the k-th word is typical, the leading bits the two share are every candidate's, and the
///      first digit starts below them (scores of one magnitude, like Quest's page bounds, share sign and exponent);
///   1. passes of kCtaRadixBits-bit digits over the words that match the prefix so far: shared atomics into the
///      bins, a barrier, each thread reads and clears its kBins / kThreads consecutive bins, a block scan of their
///      sums (one barrier: every warp scans the warp totals itself) finds the bin of the k-th word, a barrier
///      publishes it; until the bin holds exactly the words still to take or the word is whole (at most three
///      passes; two for 8192 distinct scores);
///   2. emit_held_words: a block scan of (better, tied) counts writes every chosen index in ascending order, ties
///      at the threshold to the smaller index, the same set and order as the held kernel and cpu::topk_rows.

#include <cuda_runtime.h>

#include <cstdint>

#include "kvsift/core/ranking.hpp"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/topk_held_kernels.cuh"

namespace kvsift::cuda::detail {

/// Digit width of the one-CTA kernel's passes: 2048 bins, two per thread of a 1024-thread CTA.
inline constexpr int kCtaRadixBits = 11;
// kNegativeInfinityWord (topk_held_kernels.cuh) is not a typical word: Quest scores the pages inside its window
// -inf; counted among the common bits, these few words would leave none, and the first digit (sign, exponent) would
// put the row's real scores into a handful of bins whose shared atomics serialize.

/// Grid: one CTA per score row; the plan guarantees kThreads * kItems >= scores.cols. Dynamic shared memory: the
/// word source's.
template <int kThreads, int kItems, class Words = ScoreWords>
__global__ void __launch_bounds__(kThreads)
    topk_rows_cta(const __grid_constant__ TopKRowsParams p, const __grid_constant__ Words words) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kGroups = kItems / kHeldVec<kItems>;
  constexpr int kBins = 1 << kCtaRadixBits;
  constexpr int kBinsPerThread = kBins / kThreads;
  static_assert(kWarps == 32, "a warp scans the warp totals: one lane per warp");
  static_assert(kBins % kThreads == 0 && kItems % kHeldVec<kItems> == 0 && kGroups <= kWarps, "shape");
  static_assert(kThreads * kHeldVec<kItems> < 65536, "16-bit packed counts per group");
  __shared__ std::uint32_t bins[kBins];
  __shared__ std::uint32_t warp_low[kWarps], warp_high[kWarps], warp_counts[kWarps], warp_total[kWarps];
  __shared__ __align__(16) std::uint32_t scan_buffer[kGroups * 32];
  __shared__ std::uint32_t decision[3];  // the k-th word's bin, the words before it, the words in it

  programmatic_start();  // the scores, lengths and budgets
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const std::int64_t score_row = blockIdx.x;
  const HeldRow row = start_held_row(p, score_row, 0, 1);
  if (row.finished) return;
  const TopKRowJob& job = row.job;
  extern __shared__ __align__(16) unsigned char cta_words_smem[];  // the word source's
  std::uint32_t word[kItems];
  words.template load<kThreads>(p, score_row, job.lo, job.hi - job.lo, word, cta_words_smem);
#pragma unroll
  for (int e = 0; e < kBinsPerThread; ++e) bins[tid * kBinsPerThread + e] = 0;

  // ---- the lowest and highest typical word (neither NaN's nor -inf's), and how many words are NaN or typical
  std::uint32_t low = kNoWord, high = 0, counts = 0;  // counts: NaN words | typical words << 16
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    if (word[j] == 0u) {
      counts += 1u;
    } else if (word[j] != kNoWord && word[j] != kNegativeInfinityWord) {
      low = min(low, word[j]);
      high = max(high, word[j]);
      counts += 1u << 16;
    }
  }
  low = __reduce_min_sync(0xffffffffu, low);
  high = __reduce_max_sync(0xffffffffu, high);
  counts = __reduce_add_sync(0xffffffffu, counts);
  if (lane == 0) {
    warp_low[warp] = low;
    warp_high[warp] = high;
    warp_counts[warp] = counts;
  }
  __syncthreads();
  const std::uint32_t lowest = __reduce_min_sync(0xffffffffu, warp_low[lane]);
  const std::uint32_t highest = __reduce_max_sync(0xffffffffu, warp_high[lane]);
  const std::uint32_t row_counts = __reduce_add_sync(0xffffffffu, warp_counts[lane]);
  const std::uint32_t nans = row_counts & 0xffffu, typical = row_counts >> 16, picks = std::uint32_t(job.picks);
  if (p.nan_marks_row && tid == 0 && row.count_out != nullptr) *row.count_out = nans > 0 ? -1 : job.picks;

  // ---- the threshold: the k-th smallest word, as (prefix, mask), and how many words equal to it to take. Where it
  // is a typical word, the digits start below the leading bits every typical word shares (a NaN's word, 0, then
  // never matches the prefix and counts as better; -inf's words only where they share it). Else from the top.
  int bits = lowest == highest ? 32 : __clz(lowest ^ highest);
  std::uint32_t mask = bits == 0 ? 0u : ~0u << (32 - bits);
  std::uint32_t prefix = lowest & mask, remaining = picks - nans;
  if (typical == 0 || picks <= nans || picks > nans + typical || prefix == 0u) {
    bits = 0;
    mask = 0u;
    prefix = 0u;
    remaining = picks;
  }
  while (bits < 32) {
    const int width = min(kCtaRadixBits, 32 - bits);
    const int shift = 32 - bits - width;
    const std::uint32_t digit_mask = (1u << width) - 1u;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (word[j] != kNoWord && (word[j] & mask) == prefix) atomicAdd(&bins[(word[j] >> shift) & digit_mask], 1u);
    }
    __syncthreads();  // the histogram is complete
    std::uint32_t count[kBinsPerThread], sum = 0;
#pragma unroll
    for (int e = 0; e < kBinsPerThread; ++e) {
      count[e] = bins[tid * kBinsPerThread + e];
      bins[tid * kBinsPerThread + e] = 0;  // this thread alone reads these bins: cleared for the next pass
      sum += count[e];
    }
    const std::uint32_t inclusive = warp_inclusive_sum(sum);
    if (lane == 31) warp_total[warp] = inclusive;
    __syncthreads();  // the warp totals
    std::uint32_t before_warp = lane < warp ? warp_total[lane] : 0u;
    before_warp = __reduce_add_sync(0xffffffffu, before_warp);
    std::uint32_t before = before_warp + inclusive - sum;
    if (before < remaining && remaining <= before + sum) {
#pragma unroll
      for (int e = 0; e < kBinsPerThread; ++e) {
        if (before < remaining && remaining <= before + count[e]) {
          decision[0] = std::uint32_t(tid * kBinsPerThread + e);
          decision[1] = before;
          decision[2] = count[e];
        }
        before += count[e];
      }
    }
    __syncthreads();  // the decision; every read of warp_total is done before the next pass writes it
    prefix |= decision[0] << shift;
    mask |= digit_mask << shift;
    remaining -= decision[1];
    bits += width;
    if (decision[2] == remaining) break;  // every word left in the bin is taken: the threshold need not be whole
  }
  emit_held_words<kThreads>(word, mask, prefix, remaining, 0u, 0u, job.lo, row.indices, row.ids, row.weights,
                            scan_buffer);
}

}  // namespace kvsift::cuda::detail
