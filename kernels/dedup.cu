// CUDA index deduplication (cuda::sort_unique): a CUB segmented sort of each row's entries, then one CTA per
// row keeps the first of every run of equal values.
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_sort.cuh>

#include "kvsift/cuda/detail/primitives_kernels.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kItemsPerThread = 4;

/// Row r's segment is [r * capacity, r * capacity + count); a row whose count is outside [0, capacity] gets
/// an empty segment and is reported by sort_unique_rows.
__global__ void segment_bounds(std::int64_t rows, std::int32_t capacity, const std::int32_t* counts,
                               std::int32_t* begin, std::int32_t* end) {
  for (std::int64_t r = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; r < rows; r += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int32_t count = counts[r];
    begin[r] = std::int32_t(r * capacity);
    end[r] = begin[r] + (count >= 0 && count <= capacity ? count : 0);
  }
}

__global__ void __launch_bounds__(kThreads) unique_rows(const std::int32_t* sorted, std::int32_t capacity,
                                                        const std::int32_t* counts, std::int32_t* indices,
                                                        std::int32_t* unique_counts) {
  using BlockScan = cub::BlockScan<std::int32_t, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  const std::int64_t row = blockIdx.x;
  const std::int32_t count = counts[row];
  if (count < 0 || count > capacity) {
    if (threadIdx.x == 0) unique_counts[row] = -1;
    return;
  }
  const std::int32_t* in = sorted + row * capacity;
  std::int32_t* out = indices + row * capacity;
  std::int32_t written = 0;
  for (std::int32_t tile = 0; tile < count; tile += kThreads * kItemsPerThread) {
    const std::int32_t first = tile + int(threadIdx.x) * kItemsPerThread;
    std::int32_t values[kItemsPerThread];
    std::int32_t keep = 0;
#pragma unroll
    for (int j = 0; j < kItemsPerThread; ++j) {
      const std::int32_t i = first + j;
      values[j] = i < count ? in[i] : 0;
      keep += i < count && (i == 0 || in[i - 1] != values[j]);
    }
    std::int32_t position = 0, total = 0;
    BlockScan(scan_storage).ExclusiveSum(keep, position, total);
#pragma unroll
    for (int j = 0; j < kItemsPerThread; ++j) {
      const std::int32_t i = first + j;
      if (i < count && (i == 0 || in[i - 1] != values[j])) out[written + position++] = values[j];
    }
    written += total;
    __syncthreads();  // scan_storage is reused by the next tile
  }
  if (threadIdx.x == 0) unique_counts[row] = written;
}

}  // namespace

cudaError_t sort_unique_cub_bytes(std::int64_t rows, std::int32_t capacity, std::size_t* bytes) {
  return cub::DeviceSegmentedSort::SortKeys(nullptr, *bytes, static_cast<const std::int32_t*>(nullptr),
                                            static_cast<std::int32_t*>(nullptr), rows * capacity, rows,
                                            static_cast<const std::int32_t*>(nullptr),
                                            static_cast<const std::int32_t*>(nullptr));
}

cudaError_t launch_sort_unique(std::int32_t* indices, std::int64_t rows, std::int32_t capacity,
                               const std::int32_t* counts, std::int32_t* unique_counts, const SortUniqueBuffers& b,
                               cudaStream_t stream) {
  segment_bounds<<<grid_stride_blocks(rows, kThreads), kThreads, 0, stream>>>(rows, capacity, counts, b.segment_begin,
                                                                              b.segment_end);
  if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  std::size_t bytes = b.cub_temp_bytes;
  if (cudaError_t s = cub::DeviceSegmentedSort::SortKeys(b.cub_temp, bytes, static_cast<const std::int32_t*>(indices),
                                                         b.sorted, rows * capacity, rows,
                                                         static_cast<const std::int32_t*>(b.segment_begin),
                                                         static_cast<const std::int32_t*>(b.segment_end), stream);
      s != cudaSuccess) {
    return s;
  }
  unique_rows<<<unsigned(rows), kThreads, 0, stream>>>(b.sorted, capacity, counts, indices, unique_counts);
  return cudaGetLastError();
}

}  // namespace kvsift::cuda::detail
