// CUDA primitives: top-K (CUB radix sorts), GEMV scores, row gather, batched RoPE; instantiated for the
// storage types the selectors use.
#include <cub/device/device_radix_sort.cuh>

#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;

int bits_for(std::int64_t values) {
  int bits = 0;
  while ((std::int64_t(1) << bits) < values) ++bits;
  return bits;
}

/// Orderable key of a score for an ascending sort that puts the best first: larger scores give smaller
/// keys, NaN the largest key (ranks below every number).
__device__ std::uint32_t descending_key(float score) {
  if (isnan(score)) return 0xffffffffu;
  const std::uint32_t bits = score == 0.0f ? 0u : __float_as_uint(score);  // -0 and +0 are equal scores
  const std::uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ~ascending;
}

__global__ void make_topk_keys(MatrixView<const float> scores, unsigned long long* keys, std::int32_t* values) {
  const std::int64_t total = scores.rows * std::int64_t(scores.cols);
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total; i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / scores.cols;
    const std::int32_t col = std::int32_t(i % scores.cols);
    keys[i] = (static_cast<unsigned long long>(row) << 32) | descending_key(scores.row(row)[col]);
    values[i] = col;
  }
}

__global__ void pick_topk(std::int64_t rows, std::int32_t n, std::int32_t k, const std::int32_t* sorted_values,
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

unsigned grid_for(std::int64_t items) {
  return unsigned(std::min<std::int64_t>((items + kThreads - 1) / kThreads, 65535 * 8));
}

template <class T>
__global__ void gemv_scores_kernel(const float* q, MatrixView<const T> rows, float scale, float* scores) {
  const std::int64_t warp = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows.rows) return;
  const T* row = rows.row(warp);
  float sum = 0.0f;
  for (int c = lane; c < rows.cols; c += 32) sum = fmaf(q[c], to_float_device(row[c]), sum);
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) scores[warp] = scale * sum;
}

template <class T>
__global__ void gather_rows_kernel(MatrixView<const T> src, const std::int32_t* indices, std::int64_t count, MatrixView<T> dst) {
  const std::int64_t total = count * src.cols;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total; i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / src.cols;
    const int c = int(i % src.cols);
    dst.row(r)[c] = src.row(indices[r])[c];
  }
}

__global__ void rope_rows_kernel(MatrixView<float> rows, const std::int64_t* positions, RopeConfig rope, bool inverse) {
  const int rotary = rope.resolved_rotary_dim(rows.cols), half = rotary / 2;
  const std::int64_t total = rows.rows * half;
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < total; e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t r = e / half;
    const int i = int(e % half);
    const double inv_freq = pow(rope.theta, -2.0 * i / rotary);
    const double angle = (inverse ? -1.0 : 1.0) * double(positions[r]) * inv_freq;
    double s, c;
    sincos(angle, &s, &c);
    const int a = rope.layout == RopeLayout::neox ? i : 2 * i;
    const int b = rope.layout == RopeLayout::neox ? i + half : 2 * i + 1;
    float* x = rows.row(r);
    const double xa = x[a], xb = x[b];
    x[a] = float(xa * c - xb * s);
    x[b] = float(xa * s + xb * c);
  }
}

}  // namespace

cudaError_t topk_cub_bytes(std::int64_t rows, std::int32_t n, std::int32_t k, std::size_t* first_sort,
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

cudaError_t launch_topk(const MatrixView<const float>& scores, std::int32_t k, std::int32_t* indices,
                        const TopKBuffers& b, cudaStream_t stream) {
  const std::int64_t total = scores.rows * std::int64_t(scores.cols), chosen = scores.rows * std::int64_t(k);
  const int end_bit = 32 + bits_for(scores.rows);
  make_topk_keys<<<grid_for(total), kThreads, 0, stream>>>(scores, b.keys_in, b.values_in);
  if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  std::size_t bytes = b.cub_temp_bytes;
  if (cudaError_t s = cub::DeviceRadixSort::SortPairs(b.cub_temp, bytes, b.keys_in, b.keys_out, b.values_in,
                                                      b.values_out, total, 0, end_bit, stream);
      s != cudaSuccess) {
    return s;
  }
  if (chosen == 0) return cudaSuccess;
  pick_topk<<<grid_for(chosen), kThreads, 0, stream>>>(scores.rows, scores.cols, k, b.values_out, b.chosen_in);
  if (cudaError_t s = cudaGetLastError(); s != cudaSuccess) return s;
  bytes = b.cub_temp_bytes;
  if (cudaError_t s = cub::DeviceRadixSort::SortKeys(b.cub_temp, bytes, b.chosen_in, b.chosen_out, chosen, 0, end_bit, stream);
      s != cudaSuccess) {
    return s;
  }
  strip_rows<<<grid_for(chosen), kThreads, 0, stream>>>(chosen, b.chosen_out, indices);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_gemv_scores(const float* q, const MatrixView<const T>& rows, float scale, float* scores,
                               cudaStream_t stream) {
  const std::int64_t threads = rows.rows * 32;
  gemv_scores_kernel<T><<<unsigned((threads + kThreads - 1) / kThreads), kThreads, 0, stream>>>(q, rows, scale, scores);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_gather_rows(const MatrixView<const T>& src, const std::int32_t* indices, std::int64_t count,
                               const MatrixView<T>& dst, cudaStream_t stream) {
  gather_rows_kernel<T><<<grid_for(count * src.cols), kThreads, 0, stream>>>(src, indices, count, dst);
  return cudaGetLastError();
}

cudaError_t launch_apply_rope_rows(const MatrixView<float>& rows, const std::int64_t* positions, const RopeConfig& rope,
                                   bool inverse, cudaStream_t stream) {
  rope_rows_kernel<<<grid_for(rows.rows * (rope.resolved_rotary_dim(rows.cols) / 2)), kThreads, 0, stream>>>(
      rows, positions, rope, inverse);
  return cudaGetLastError();
}

#define KVSIFT_INSTANTIATE(T)                                                                                    \
  template cudaError_t launch_gemv_scores<T>(const float*, const MatrixView<const T>&, float, float*, cudaStream_t); \
  template cudaError_t launch_gather_rows<T>(const MatrixView<const T>&, const std::int32_t*, std::int64_t,      \
                                             const MatrixView<T>&, cudaStream_t);
KVSIFT_INSTANTIATE(float)
KVSIFT_INSTANTIATE(half)
KVSIFT_INSTANTIATE(bfloat16)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
