// RoPE kernels (cuda/rope.hpp): the cos/sin table and the rotations, one thread per (vector, pair), on
// core/rope.hpp's math shared with the CPU.
#include <cmath>

#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/detail/rope_launch.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;

/// Each block evaluates the inverse frequencies once into shared memory ([pairs] doubles), then fills entries.
__global__ void rope_table_kernel(RopeConfig config, RopeTableView table) {
  extern __shared__ double inv_freq[];
  const std::int32_t half = table.pairs();
  for (std::int32_t i = threadIdx.x; i < half; i += blockDim.x) inv_freq[i] = config.inv_freq(i, table.rotary_dim);
  __syncthreads();
  const std::int64_t total = std::int64_t(table.positions) * half;
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    rope_table_entry(inv_freq[e % half], std::int32_t(e / half), table.cos[e], table.sin[e]);
  }
}

template <class T>
__global__ void rope_kernel(RopeRows<T> rows, const std::int32_t* amounts, RopeTableView table, bool delta,
                            bool inverse, double scale) {
  const std::int32_t half = table.pairs();
  const std::int64_t total = rows.batch * rows.heads * half;
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int32_t i = std::int32_t(e % half);
    const std::int64_t vector = e / half, b = vector / rows.heads, h = vector % rows.heads;
    const std::int32_t amount = amounts[b];
    float c = 0.0f, s = 0.0f;
    const bool inside = (delta || amount >= 0) && rope_lookup(table, amount, inverse, i, c, s);
    std::int32_t a = 0, pair_b = 0;
    rope_pair(table.layout, i, half, a, pair_b);
    T* v = rows.data + b * rows.batch_stride + h * rows.head_stride;
    float xa = NAN, xb = NAN;
    if (inside) {
      xa = to_float_device(v[a]), xb = to_float_device(v[pair_b]);
      rope_rotate_pair(xa, xb, c, s, scale);
    }
    v[a] = from_float_device<T>(xa);
    v[pair_b] = from_float_device<T>(xb);
  }
}

}  // namespace

cudaError_t launch_build_rope_table(const RopeConfig& config, const RopeTableView& table, cudaStream_t stream) {
  const std::size_t shared = std::size_t(table.pairs()) * sizeof(double);
  rope_table_kernel<<<grid_stride_blocks(std::int64_t(table.positions) * table.pairs(), kThreads), kThreads, shared,
                      stream>>>(config, table);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_rope(const RopeRows<T>& rows, const std::int32_t* amounts, const RopeTableView& table, bool delta,
                        bool inverse, double scale, cudaStream_t stream) {
  rope_kernel<T><<<grid_stride_blocks(rows.batch * rows.heads * table.pairs(), kThreads), kThreads, 0, stream>>>(
      rows, amounts, table, delta, inverse, scale);
  return cudaGetLastError();
}

#define KVSIFT_INSTANTIATE(T)                                                                                        \
  template cudaError_t launch_rope<T>(const RopeRows<T>&, const std::int32_t*, const RopeTableView&, bool, bool, \
                                      double, cudaStream_t);
KVSIFT_INSTANTIATE(float)
KVSIFT_INSTANTIATE(half)
KVSIFT_INSTANTIATE(bfloat16)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
