// CUDA top-K, two ways (cuda/topk.hpp, TopKAlgorithm): CUB radix sorts of every (row, score) key, and
// a radix select that reads the scores a fixed number of times and sorts nothing.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "kvsift/cuda/detail/primitives_kernels.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;

/// Orderable key of a score for an ascending order that puts the best first: larger scores give smaller
/// keys, NaN the largest key (ranks below every number); -0 and +0 are one score. cpu::rank_key's high half.
__device__ __forceinline__ std::uint32_t descending_key(float score) {
  if (isnan(score)) return 0xffffffffu;
  const std::uint32_t bits = score == 0.0f ? 0u : __float_as_uint(score);
  const std::uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ~ascending;
}

// ---- sort ---------------------------------------------------------------------------------------------

int bits_for(std::int64_t values) {
  int bits = 0;
  while ((std::int64_t(1) << bits) < values) ++bits;
  return bits;
}

__global__ void make_sort_keys(MatrixView<const float> scores, unsigned long long* keys, std::int32_t* values) {
  const std::int64_t total = scores.rows * std::int64_t(scores.cols);
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total; i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / scores.cols;
    const std::int32_t col = std::int32_t(i % scores.cols);
    keys[i] = (static_cast<unsigned long long>(row) << 32) | descending_key(scores.row(row)[col]);
    values[i] = col;
  }
}

__global__ void pick_sorted(std::int64_t rows, std::int32_t n, std::int32_t k, const std::int32_t* sorted_values,
                            unsigned long long* chosen) {
  const std::int64_t total = rows * k;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total; i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / k;
    chosen[i] = (static_cast<unsigned long long>(row) << 32) | std::uint32_t(sorted_values[row * n + i % k]);
  }
}

__global__ void strip_rows(std::int64_t total, const unsigned long long* chosen, std::int32_t* indices) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total; i += std::int64_t(gridDim.x) * blockDim.x) {
    indices[i] = std::int32_t(chosen[i] & 0xffffffffu);
  }
}

// ---- select -------------------------------------------------------------------------------------------
//
// Grid (rows, chunks): CTA (r, c) owns scores [c * chunk_size, (c + 1) * chunk_size) of row r.
// 1. Three histogram passes over 11, 11 and 10 key bits, most significant first. Each CTA counts the keys
//    that match the row's resolved prefix by their next digit, adds its counts to the row's histogram, and
//    the last CTA of the row to finish (a ticket taken after a fence) finds the digit holding the
//    remaining-th key, extends the prefix, and zeroes the histogram and the ticket for the next pass.
// 2. A counting pass: per chunk, keys better than the K-th best key T and keys equal to it.
// 3. A writing pass: each CTA places its chosen indices at their final, ascending positions: index i goes
//    to (better keys before i) + min(keys equal to T before i, remaining); equal keys are taken in index
//    order, which is the tie rule.

constexpr int pass_bits(int pass) { return pass < 2 ? 11 : 10; }
constexpr int pass_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
static_assert(pass_shift(0) == pass_bits(1) + pass_bits(2) && pass_shift(1) == pass_bits(2) && pass_bits(0) + pass_shift(0) == 32);
constexpr int kItemsPerThread = 4;  // writing pass: consecutive scores per thread and tile

__global__ void __launch_bounds__(kThreads) select_reset(std::int64_t rows, std::int32_t k, TopKSelectBuffers b) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < rows * kSelectBins;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    b.histograms[i] = 0;
    if (i < rows) {
      b.state[i] = SelectRowState{0u, k};
      b.tickets[i] = 0;
    }
  }
}

struct ChunkRange {
  std::int32_t begin, end;
};
__device__ __forceinline__ ChunkRange chunk_range(std::int32_t n, std::int32_t chunk_size) {
  const std::int32_t begin = std::int32_t(blockIdx.y) * chunk_size;
  return {begin, min(n, begin + chunk_size)};
}

template <int Pass>
__global__ void __launch_bounds__(kThreads) select_histogram(MatrixView<const float> scores, TopKSelectBuffers b) {
  using BlockScan = cub::BlockScan<std::uint32_t, kThreads>;
  __shared__ std::uint32_t local[kSelectBins];
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ bool last;
  const std::int64_t row = blockIdx.x;
  constexpr int shift = pass_shift(Pass), bins = 1 << pass_bits(Pass), per_thread = bins / kThreads;
  constexpr std::uint32_t decided = Pass == 0 ? 0u : ~0u << (shift + pass_bits(Pass));
  const SelectRowState state = b.state[row];
  for (int i = threadIdx.x; i < bins; i += kThreads) local[i] = 0;
  __syncthreads();
  const float* s = scores.row(row);
  const auto [begin, end] = chunk_range(scores.cols, b.chunk_size);
#pragma unroll 4
  for (std::int32_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const std::uint32_t key = descending_key(s[i]);
    if (((key ^ state.prefix) & decided) == 0) atomicAdd(&local[(key >> shift) & (bins - 1)], 1u);
  }
  __syncthreads();
  std::uint32_t* histogram = b.histograms + row * kSelectBins;
  for (int i = threadIdx.x; i < bins; i += kThreads) {
    if (local[i] != 0) atomicAdd(&histogram[i], local[i]);
  }
  __threadfence();  // this CTA's counts are visible before its ticket is
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&b.tickets[row], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();

  // The last CTA: each thread scans a run of per_thread consecutive bins.
  std::uint32_t counts[per_thread];
  std::uint32_t run = 0;
#pragma unroll
  for (int j = 0; j < per_thread; ++j) {
    counts[j] = __ldcg(&histogram[threadIdx.x * per_thread + j]);
    run += counts[j];
  }
  std::uint32_t before = 0;
  BlockScan(scan_storage).ExclusiveSum(run, before);
  const std::uint32_t wanted = std::uint32_t(state.remaining);
#pragma unroll
  for (int j = 0; j < per_thread; ++j) {
    if (before < wanted && before + counts[j] >= wanted) {
      const std::uint32_t digit = std::uint32_t(threadIdx.x * per_thread + j);
      b.state[row] = SelectRowState{state.prefix | (digit << shift), std::int32_t(wanted - before)};
    }
    before += counts[j];
  }
  for (int i = threadIdx.x; i < bins; i += kThreads) histogram[i] = 0;
  if (threadIdx.x == 0) b.tickets[row] = 0;
}

__global__ void __launch_bounds__(kThreads) select_count(MatrixView<const float> scores, TopKSelectBuffers b) {
  using BlockReduce = cub::BlockReduce<std::uint32_t, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage[2];
  const std::int64_t row = blockIdx.x;
  const std::uint32_t threshold = b.state[row].prefix;
  const float* s = scores.row(row);
  const auto [begin, end] = chunk_range(scores.cols, b.chunk_size);
  std::uint32_t better = 0, equal = 0;
#pragma unroll 4
  for (std::int32_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const std::uint32_t key = descending_key(s[i]);
    better += key < threshold;
    equal += key == threshold;
  }
  better = BlockReduce(reduce_storage[0]).Sum(better);
  equal = BlockReduce(reduce_storage[1]).Sum(equal);
  if (threadIdx.x == 0) {
    std::uint32_t* out = b.chunk_counts + (row * b.chunks + blockIdx.y) * 2;
    out[0] = better;
    out[1] = equal;
  }
}

__global__ void __launch_bounds__(kThreads) select_write(MatrixView<const float> scores, std::int32_t k,
                                                          TopKSelectBuffers b, std::int32_t* indices) {
  using BlockReduce = cub::BlockReduce<std::uint32_t, kThreads>;
  using BlockScan = cub::BlockScan<std::uint32_t, kThreads>;
  __shared__ typename BlockReduce::TempStorage reduce_storage[2];
  __shared__ typename BlockScan::TempStorage scan_storage;
  const std::int64_t row = blockIdx.x;
  const SelectRowState state = b.state[row];
  const std::uint32_t threshold = state.prefix, taken_equal = std::uint32_t(state.remaining);

  // Counts of the chunks before this one.
  std::uint32_t better = 0, equal = 0;
  for (int c = threadIdx.x; c < int(blockIdx.y); c += kThreads) {
    better += b.chunk_counts[(row * b.chunks + c) * 2];
    equal += b.chunk_counts[(row * b.chunks + c) * 2 + 1];
  }
  __shared__ std::uint32_t chunk_base[2];
  better = BlockReduce(reduce_storage[0]).Sum(better);
  equal = BlockReduce(reduce_storage[1]).Sum(equal);
  if (threadIdx.x == 0) chunk_base[0] = better, chunk_base[1] = equal;
  __syncthreads();
  better = chunk_base[0];
  equal = chunk_base[1];

  const float* s = scores.row(row);
  std::int32_t* out = indices + row * k;
  const auto [begin, end] = chunk_range(scores.cols, b.chunk_size);
  constexpr int kTile = kThreads * kItemsPerThread;
  // Counts are packed as better + (equal << 16); a tile holds at most 1024 of either.
  for (std::int32_t tile = begin; tile < end; tile += kTile) {
    const std::int32_t first = tile + int(threadIdx.x) * kItemsPerThread;
    std::uint32_t keys[kItemsPerThread];
    std::uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < kItemsPerThread; ++j) {
      keys[j] = first + j < end ? descending_key(s[first + j]) : 0xffffffffu;
      if (first + j < end) mine += keys[j] < threshold ? 1u : keys[j] == threshold ? 0x10000u : 0u;
    }
    std::uint32_t prefix = 0, total = 0;
    BlockScan(scan_storage).ExclusiveSum(mine, prefix, total);
    std::uint32_t better_before = better + (prefix & 0xffffu), equal_before = equal + (prefix >> 16);
#pragma unroll
    for (int j = 0; j < kItemsPerThread; ++j) {
      if (first + j >= end) break;
      if (keys[j] < threshold) {
        out[better_before + min(equal_before, taken_equal)] = first + j;
        ++better_before;
      } else if (keys[j] == threshold) {
        if (equal_before < taken_equal) out[better_before + equal_before] = first + j;
        ++equal_before;
      }
    }
    better += total & 0xffffu;
    equal += total >> 16;
    __syncthreads();  // scan_storage is reused by the next tile
  }
}

}  // namespace

cudaError_t topk_sort_cub_bytes(std::int64_t rows, std::int32_t n, std::int32_t k, std::size_t* first_sort,
                                std::size_t* second_sort) {
  const int row_bits = bits_for(rows);
  cudaError_t status = cub::DeviceRadixSort::SortPairs(nullptr, *first_sort, static_cast<unsigned long long*>(nullptr),
                                                       static_cast<unsigned long long*>(nullptr),
                                                       static_cast<std::int32_t*>(nullptr),
                                                       static_cast<std::int32_t*>(nullptr), rows * n, 0, 32 + row_bits);
  if (status != cudaSuccess) return status;
  return cub::DeviceRadixSort::SortKeys(nullptr, *second_sort, static_cast<unsigned long long*>(nullptr),
                                        static_cast<unsigned long long*>(nullptr), rows * k, 0, 32 + row_bits);
}

cudaError_t launch_topk_sort(const MatrixView<const float>& scores, std::int32_t k, std::int32_t* indices,
                             const TopKSortBuffers& b, cudaStream_t stream) {
  const std::int64_t total = scores.rows * std::int64_t(scores.cols), chosen = scores.rows * std::int64_t(k);
  const int end_bit = 32 + bits_for(scores.rows);
  make_sort_keys<<<grid_stride_blocks(total, kThreads), kThreads, 0, stream>>>(scores, b.keys_in, b.values_in);
  if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  std::size_t bytes = b.cub_temp_bytes;
  if (cudaError_t s = cub::DeviceRadixSort::SortPairs(b.cub_temp, bytes, b.keys_in, b.keys_out, b.values_in,
                                                      b.values_out, total, 0, end_bit, stream);
      s != cudaSuccess) {
    return s;
  }
  if (chosen == 0) return cudaSuccess;
  pick_sorted<<<grid_stride_blocks(chosen, kThreads), kThreads, 0, stream>>>(scores.rows, scores.cols, k, b.values_out,
                                                                             b.chosen_in);
  if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  bytes = b.cub_temp_bytes;
  if (cudaError_t s = cub::DeviceRadixSort::SortKeys(b.cub_temp, bytes, b.chosen_in, b.chosen_out, chosen, 0, end_bit, stream);
      s != cudaSuccess) {
    return s;
  }
  strip_rows<<<grid_stride_blocks(chosen, kThreads), kThreads, 0, stream>>>(chosen, b.chosen_out, indices);
  return cudaGetLastError();
}

cudaError_t launch_topk_select(const MatrixView<const float>& scores, std::int32_t k, std::int32_t* indices,
                               const TopKSelectBuffers& b, cudaStream_t stream) {
  if (k == 0) return cudaSuccess;
  select_reset<<<grid_stride_blocks(scores.rows * kSelectBins, kThreads), kThreads, 0, stream>>>(scores.rows, k, b);
  const dim3 grid(unsigned(scores.rows), unsigned(b.chunks));
  select_histogram<0><<<grid, kThreads, 0, stream>>>(scores, b);
  select_histogram<1><<<grid, kThreads, 0, stream>>>(scores, b);
  select_histogram<2><<<grid, kThreads, 0, stream>>>(scores, b);
  select_count<<<grid, kThreads, 0, stream>>>(scores, b);
  select_write<<<grid, kThreads, 0, stream>>>(scores, k, b, indices);
  return cudaGetLastError();
}

}  // namespace kvsift::cuda::detail
