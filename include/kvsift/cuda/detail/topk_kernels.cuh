#pragma once
/// Kernels of cuda::topk_rows (and cuda::topk's radix select): one thread-block cluster per score row runs
/// BlockRadixSelect over the row's middle, its CTAs each holding a contiguous slice; a second kernel unites
/// the rows of a GQA group (heads_per_row > 1). Launched by kernels/topk_rows.cu.

#include <cuda_runtime.h>

#include <cstdint>

#include "kvsift/core/ranking.hpp"
#include "kvsift/cuda/detail/block_select.cuh"
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
    const std::int32_t length = p.lengths != nullptr ? p.lengths[job.selection_row / p.out.kv_heads] : p.scores.cols;
    const std::int32_t k = p.row_k != nullptr ? p.row_k[job.selection_row] : p.k;
    job.valid = length >= 0 && length <= p.scores.cols && k >= 0 && k <= p.k;
    if (!job.valid) return job;
    job.lo = p.window.sink_end(length);
    job.hi = p.window.recent_begin(length);
    job.picks = min(k, job.hi - job.lo);
    return job;
  }
};

/// Grid: score rows * cluster CTAs along x, clusters of `cluster` consecutive CTAs (one per score row).
/// Dynamic shared memory: launch.smem_words rank words of this CTA's slice.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) topk_rows_select(const __grid_constant__ TopKRowsParams p) {
  using Select = BlockRadixSelect<kThreads>;
  __shared__ typename Select::TempStorage temp;
  extern __shared__ std::uint32_t slice_words[];
  const std::int32_t cluster = p.launch.cluster;
  const std::int64_t score_row = blockIdx.x / cluster;
  const std::int32_t rank = std::int32_t(blockIdx.x % cluster);  // the cluster's block rank: clusters tile x
  const TopKRowJob job = TopKRowJob::of(p, score_row);
  const bool grouped = p.heads_per_row > 1;
  std::int32_t* const count_out = grouped ? p.pick_counts + score_row
                                  : p.out.counts != nullptr ? p.out.counts + job.selection_row
                                                            : nullptr;
  // Everything below depends on the score row alone, so each cluster takes the same branches.
  if (!job.valid) {
    if (rank == 0 && threadIdx.x == 0 && count_out != nullptr) *count_out = -1;
    return;
  }
  if (rank == 0 && threadIdx.x == 0 && count_out != nullptr) *count_out = job.picks;
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
  const bool cached = p.launch.smem_words > 0;
  if (cached) {
    for (std::int32_t i = threadIdx.x; i < count; i += kThreads) slice_words[i] = rank_word(scores[i]);
    __syncthreads();
  }
  const auto word_at = [&](std::int32_t i) { return cached ? slice_words[i] : rank_word(__ldg(scores + i)); };
  const auto out = [&](std::int32_t i, std::uint32_t position) {
    indices[position] = begin + i;
    if (weights != nullptr) weights[position] = 0.0f;
  };
  Select select(temp);
  const ClusterGroup group{};
  const SelectThreshold threshold =
      job.picks == middle ? SelectThreshold::all(std::uint32_t(middle)) : select.find(word_at, count, job.picks, group);
  select.emit(word_at, count, threshold, out, group);
}

/// heads_per_row > 1: selection row blockIdx.x gets the union of its score rows' picks, ascending, through a
/// bitmap of its middle (in dynamic shared memory, or p.union_bits where p.union_bits is set).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) topk_rows_union(const __grid_constant__ TopKRowsParams p) {
  using BlockScan = cub::BlockScan<std::uint32_t, kThreads>;
  __shared__ typename BlockScan::TempStorage scan;
  __shared__ bool invalid;
  extern __shared__ std::uint32_t shared_bits[];
  const std::int64_t s = blockIdx.x;
  const std::int64_t first_row = s * p.heads_per_row;
  if (threadIdx.x == 0) invalid = false;
  __syncthreads();
  for (std::int32_t h = threadIdx.x; h < p.heads_per_row; h += kThreads) {
    if (p.pick_counts[first_row + h] < 0) invalid = true;
  }
  __syncthreads();
  if (invalid) {
    if (threadIdx.x == 0) p.out.counts[s] = -1;
    return;
  }
  // Every score row of s has the same middle (one sequence) and valid counts, so the job is valid.
  const TopKRowJob job = TopKRowJob::of(p, first_row);
  const std::int32_t base = job.lo / 32;
  const std::int32_t words = job.hi > job.lo ? (job.hi + 31) / 32 - base : 0;
  std::uint32_t* const bits = p.union_bits != nullptr ? p.union_bits + s * p.union_words : shared_bits;
  for (std::int32_t w = threadIdx.x; w < words; w += kThreads) bits[w] = 0;
  __syncthreads();
  for (std::int32_t h = 0; h < p.heads_per_row; ++h) {
    const std::int32_t* const picks = p.picks + (first_row + h) * p.k;
    const std::int32_t picked = p.pick_counts[first_row + h];
    for (std::int32_t i = threadIdx.x; i < picked; i += kThreads) {
      const std::int32_t token = picks[i];
      atomicOr(&bits[token / 32 - base], 1u << (token % 32));
    }
  }
  __syncthreads();
  // Each thread a run of consecutive words: positions follow from a scan of the runs' bit counts.
  const std::int32_t per_thread = (words + kThreads - 1) / kThreads;
  const std::int32_t w_begin = min(words, std::int32_t(threadIdx.x) * per_thread), w_end = min(words, w_begin + per_thread);
  std::uint32_t mine = 0;
  for (std::int32_t w = w_begin; w < w_end; ++w) mine += __popc(bits[w]);
  std::uint32_t position = 0, total = 0;
  BlockScan(scan).ExclusiveSum(mine, position, total);
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

}  // namespace kvsift::cuda::detail
