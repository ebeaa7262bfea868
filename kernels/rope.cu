// RoPE kernels (cuda/rope.hpp): the cos/sin table and the rotations, one thread per (vector, pair), on
// core/rope.hpp's math shared with the CPU.
#include <cmath>

#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/detail/rope_launch.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;

/// Each block evaluates the inverse frequencies once into shared memory ([pairs] doubles), then fills entries.
__global__ void rope_table_kernel(RopeConfig config, RopeTableView table) {
  programmatic_start_if_one_wave();  // a programmatic dependent (launch.cuh)
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

/// Row b's rotation (to a position, or from one to the target) and whether its position is one: launch_rope's
/// RopeAmounts rule.
__device__ bool row_rotation(const RopeAmounts& amounts, std::int64_t b, std::int64_t& rotation) {
  const std::int64_t p = std::int64_t(amounts.values[b]) + amounts.offset;
  rotation = amounts.kind == RopeAmountKind::to_target ? std::int64_t(amounts.target) - p : p;
  return p >= 0;
}

template <class T>
__global__ void rope_kernel(BatchedMatrixView<T> vectors, RopeAmounts amounts, RopeTableView table, bool inverse,
                            double scale) {
  programmatic_start_if_one_wave();  // the vectors (a programmatic dependent: launch.cuh)
  const std::int32_t half = table.pairs();
  const std::int64_t total = vectors.rows * vectors.problems * half;
  for (std::int64_t e = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int32_t i = std::int32_t(e % half);
    const std::int64_t vector = e / half, b = vector / vectors.problems, h = vector % vectors.problems;
    std::int64_t rotation = 0;
    float c = 0.0f, s = 0.0f;
    const bool inside = row_rotation(amounts, b, rotation) && rope_lookup(table, rotation, inverse, i, c, s);
    std::int32_t a = 0, pair_b = 0;
    rope_pair(table.layout, i, half, a, pair_b);
    T* v = vectors.row(h, b);
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
  return launch(rope_table_kernel,
                {.grid = dim3(grid_stride_blocks(std::int64_t(table.positions) * table.pairs(), kThreads)),
                 .block = dim3(kThreads), .smem = shared, .stream = stream, .programmatic = true},
                config, table);
}

template <class T>
cudaError_t launch_rope(const BatchedMatrixView<T>& vectors, const RopeAmounts& amounts, const RopeTableView& table,
                        bool inverse, double scale, cudaStream_t stream) {
  const std::int64_t pairs = vectors.rows * vectors.problems * table.pairs();
  return launch(rope_kernel<T>,
                {.grid = dim3(grid_stride_blocks(pairs, kThreads)), .block = dim3(kThreads), .stream = stream,
                 .programmatic = true},
                vectors, amounts, table, inverse, scale);
}

#define KVSIFT_INSTANTIATE(T)                                                                                     \
  template cudaError_t launch_rope<T>(const BatchedMatrixView<T>&, const RopeAmounts&, const RopeTableView&, bool, \
                                      double, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
