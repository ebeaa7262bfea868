// CUDA top-K by CUB radix sorts of every (row, score) key (cuda/topk.hpp, TopKAlgorithm::radix_sort); the
// radix select is topk_rows' kernel (kernels/topk_rows.cu).
#include <cub/device/device_radix_sort.cuh>

#include "kvsift/core/ranking.hpp"
#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/detail/topk_launch.hpp"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;

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
    keys[i] = (static_cast<unsigned long long>(row) << 32) | rank_word(scores.row(row)[col]);
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

}  // namespace kvsift::cuda::detail
