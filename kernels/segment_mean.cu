// Segment means on CUDA (cuda/segment_mean.hpp): rows sorted by segment with a stable radix sort, each
// segment's bounds found in the sorted keys, then one thread per (segment, column) sums the segment's rows in
// ascending order in fp64, as cpu::segment_mean does: the results are the CPU's, bit for bit.
#include <cub/device/device_radix_sort.cuh>

#include <bit>

#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/detail/segment_mean_launch.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kMeanThreads = 128;  ///< columns per block of the mean kernel

__global__ void segment_keys(std::int64_t n, const std::int32_t* assignment, std::int32_t segments, std::int32_t* keys,
                             std::int32_t* row_ids) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n; i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int32_t s = assignment[i];
    keys[i] = s >= 0 && s < segments ? s : segments;
    row_ids[i] = std::int32_t(i);
  }
}

/// bounds[s] and bounds[segments + s]: segment s's range in the sorted keys (zeroed before: empty stays [0, 0)).
__global__ void segment_bounds(std::int64_t n, std::int32_t segments, const std::int32_t* sorted, std::int32_t* bounds) {
  for (std::int64_t p = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; p < n; p += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int32_t s = sorted[p];
    if (s == segments) continue;
    if (p == 0 || sorted[p - 1] != s) bounds[s] = std::int32_t(p);
    if (p == n - 1 || sorted[p + 1] != s) bounds[segments + s] = std::int32_t(p + 1);
  }
}

/// Block (s, column tile): thread j sums column j of segment s's rows; each thread also sums the weights, in
/// the same order (the CPU's), so no block-level exchange is needed.
template <class T>
__global__ void __launch_bounds__(kMeanThreads)
    segment_means(MatrixView<const T> rows, std::int32_t segments, const std::int32_t* members,
                  const std::int32_t* bounds, const float* weights, MatrixView<float> means, std::int32_t* counts) {
  const std::int32_t s = std::int32_t(blockIdx.x);
  const std::int32_t begin = bounds[s], end = bounds[segments + s];
  if (blockIdx.y == 0 && threadIdx.x == 0) counts[s] = end - begin;
  const std::int32_t c = std::int32_t(blockIdx.y) * kMeanThreads + std::int32_t(threadIdx.x);
  if (end <= begin || c >= rows.cols) return;
  // kUnroll rows' loads are issued before their additions, which stay in ascending row order: memory-level
  // parallelism for long segments without changing a bit of the sums.
  constexpr int kUnroll = 8;
  double total = 0.0, sum = 0.0;
  std::int32_t m = begin;
  for (; m + kUnroll <= end; m += kUnroll) {
    double w[kUnroll], x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int32_t i = members[m + u];
      w[u] = weights == nullptr ? 1.0 : double(weights[i]);
      x[u] = double(to_float_device(rows.row(i)[c]));
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) total += w[u], sum += w[u] * x[u];
  }
  for (; m < end; ++m) {
    const std::int32_t i = members[m];
    const double w = weights == nullptr ? 1.0 : double(weights[i]);
    total += w;
    sum += w * double(to_float_device(rows.row(i)[c]));
  }
  if (total != 0.0) means.row(s)[c] = float(sum / total);
}

}  // namespace

cudaError_t segment_mean_cub_bytes(std::int64_t rows, std::int32_t segments, std::size_t* bytes) {
  const int end_bit = std::max(1, int(std::bit_width(unsigned(segments))));
  return cub::DeviceRadixSort::SortPairs(nullptr, *bytes, static_cast<const std::int32_t*>(nullptr),
                                         static_cast<std::int32_t*>(nullptr), static_cast<const std::int32_t*>(nullptr),
                                         static_cast<std::int32_t*>(nullptr), int(rows), 0, end_bit);
}

template <class T>
cudaError_t launch_segment_mean(const MatrixView<const T>& rows, const std::int32_t* assignment, std::int32_t segments,
                                const float* weights, const MatrixView<float>& means, std::int32_t* counts,
                                const SegmentMeanBuffers& b, cudaStream_t stream) {
  const std::int64_t n = rows.rows;
  const unsigned blocks = grid_stride_blocks(n, kThreads);
  segment_keys<<<blocks, kThreads, 0, stream>>>(n, assignment, segments, b.keys, b.row_ids);
  if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  // Keys reach `segments` (rows in no segment), so its bit width bounds the sort's bits.
  const int end_bit = std::max(1, int(std::bit_width(unsigned(segments))));
  std::size_t sort_bytes = b.cub_temp_bytes;
  if (cudaError_t s = cub::DeviceRadixSort::SortPairs(b.cub_temp, sort_bytes, static_cast<const std::int32_t*>(b.keys),
                                                      b.sorted_keys, static_cast<const std::int32_t*>(b.row_ids),
                                                      b.members, int(n), 0, end_bit, stream);
      s != cudaSuccess) {
    return s;
  }
  if (cudaError_t s = cudaMemsetAsync(b.bounds, 0, 2 * std::size_t(segments) * sizeof(std::int32_t), stream);
      s != cudaSuccess) {
    return s;
  }
  segment_bounds<<<blocks, kThreads, 0, stream>>>(n, segments, b.sorted_keys, b.bounds);
  const dim3 grid(unsigned(segments), unsigned((rows.cols + kMeanThreads - 1) / kMeanThreads));
  segment_means<T><<<grid, kMeanThreads, 0, stream>>>(rows, segments, b.members, b.bounds, weights, means, counts);
  return cudaGetLastError();
}

#define KVSIFT_INSTANTIATE(T)                                                                                        \
  template cudaError_t launch_segment_mean<T>(const MatrixView<const T>&, const std::int32_t*, std::int32_t,         \
                                              const float*, const MatrixView<float>&, std::int32_t*,                 \
                                              const SegmentMeanBuffers&, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
