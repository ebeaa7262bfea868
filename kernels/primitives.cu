// CUDA primitives: GEMV scores, row gather; instantiated for the storage types the selectors
// use. Top-K is in topk.cu, k-means assignment in kmeans.cu, deduplication in dedup.cu, RoPE in
// rope.cu.
#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;

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

}  // namespace

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
  gather_rows_kernel<T><<<grid_stride_blocks(count * src.cols, kThreads), kThreads, 0, stream>>>(src, indices, count, dst);
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
