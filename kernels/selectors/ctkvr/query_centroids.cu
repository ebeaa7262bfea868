// CTKVR's query centroids on CUDA (selectors/ctkvr/cuda/query_centroids.hpp): scores of a step's queries against
// the stored centroids, and the store of a prefill's normalised queries. 16-bit centroids of 64, 128 or 256
// channels are scored on tensor cores (cuda/detail/head_rows_mma.cuh), others by dots split over 8 lanes and fixed
// shuffle trees (cuda/detail/group_dot.cuh): results do not depend on scheduling; no atomics.
#include <cmath>
#include <cstdint>

#include "kvsift/core/supported_values.hpp"
#include "kvsift/cuda/detail/group_dot.cuh"
#include "kvsift/cuda/detail/head_rows_mma.cuh"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/dtype.cuh"
#include "kvsift/selectors/ctkvr/cuda/detail/query_centroids_launch.hpp"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCentroidsPerBlock = 64;  ///< centroids scored per block: a batch-1 step still fills the GPU

/// Whether centroid_scores_kernel takes T's products on tensor cores: 16-bit centroids of kHeadDim channels
/// (kHeadDim 0: any head_dim, on CUDA cores).
template <class T, int kHeadDim>
inline constexpr bool kCentroidsOnTensorCores = sizeof(T) == 2 && kHeadDim > 0;

/// The block's centroids on CUDA cores: the group's unit queries in shared memory, then 8 lanes per centroid (4
/// centroids per warp at once, octet_dot_part).
template <class T>
__device__ __forceinline__ void cuda_core_centroid_scores(const QueryView<const T>& q,
                                                          const QueryCentroidsView<const T>& centroids,
                                                          std::int32_t slot, std::int32_t b, std::int32_t g,
                                                          std::int32_t group, std::int32_t begin, std::int32_t end,
                                                          std::int32_t count, float* out) {
  __shared__ float q_s[kGroupDotMaxGroup * kGroupDotMaxHeadDim];
  const std::int32_t d = q.head_dim;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  for (std::int32_t j = warp; j < group; j += kWarps) {
    const T* x = q.row(b, g * group + j);
    float* xs = q_s + j * d;
    float sq = 0.0f;
    for (int i = lane; i < d; i += 32) {
      xs[i] = to_float_device(x[i]);
      sq = fmaf(xs[i], xs[i], sq);
    }
    sq = warp_sum(sq);
    const float scale = kvsift::detail::inverse_norm(sq);
    for (int i = lane; i < d; i += 32) xs[i] *= scale;
  }
  __syncthreads();
  const int sub = lane / 8, sublane = lane % 8;
  // c0 depends on the warp only, so every lane of a warp takes each iteration (the shuffles need them all).
  for (std::int32_t c0 = begin + warp * 4; c0 < end; c0 += kWarps * 4) {
    const std::int32_t c = c0 + sub;
    const bool mine = c < end && c < count;
    float best = -INFINITY;
    for (std::int32_t j = 0; j < group; ++j) {
      const float part = mine ? octet_dot_part(q_s + j * d, centroids.row(slot, g * group + j, c), d, sublane) : 0.0f;
      best = max_nan(best, octet_sum(part));
    }
    if (c < end && sublane == 0) out[c] = mine ? best : -INFINITY;
  }
}

/// The block's centroids on tensor cores (cuda/detail/head_rows_mma.cuh): warp w takes the n-tile of centroids
/// [begin + 8 w, begin + 8 w + 8) for every head of the group, the rows of 16 / (kHeadDim / 32) heads loaded at
/// once; A holds the group's raw queries, so head j's centroids against head j's query are row j of C, read from
/// the lanes that hold it (l / 4 = j % 8) and scaled by that query's inverse norm (fp32, as the CUDA-core path
/// normalises it). The other rows of C are the other heads' queries against head j's centroids: unused, one mma
/// for 8 centroids still replaces ~110 instructions of the CUDA-core path.
template <class T, int kHeadDim>
__device__ __forceinline__ void tensor_core_centroid_scores(const QueryView<const T>& q,
                                                            const QueryCentroidsView<const T>& centroids,
                                                            std::int32_t slot, std::int32_t b, std::int32_t g,
                                                            std::int32_t group, std::int32_t begin, std::int32_t end,
                                                            std::int32_t count, float* out) {
  constexpr int kPairs = kHeadDim / 32;
  constexpr int kHeadsInFlight = 16 / kPairs;  ///< 16 pieces of 16 bytes a lane
  static_assert(kCentroidsPerBlock == 8 * kWarps, "a warp per n-tile of the block's centroids");
  __shared__ __align__(16) std::uint16_t q_bits[16 * head_rows_stride(kHeadDim)];
  __shared__ float inverse_norms[kGroupDotMaxGroup];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, n = lane / 4, t = lane % 4;
  stage_head_rows<kThreads>(q, b, g * group, group, kHeadDim, q_bits);
  for (std::int32_t j = warp; j < group; j += kWarps) {
    const T* x = q.row(b, g * group + j);
    float sq = 0.0f;
    for (int i = lane; i < kHeadDim; i += 32) sq = fmaf(to_float_device(x[i]), to_float_device(x[i]), sq);
    sq = warp_sum(sq);
    if (lane == 0) inverse_norms[j] = kvsift::detail::inverse_norm(sq);
  }
  __syncthreads();
  const std::int32_t c0 = begin + 8 * warp, c = c0 + n;  // c: the centroid whose pieces this lane loads
  if (c0 >= end) return;  // the whole warp; no block barrier follows
  const bool mine = c < end && c < count;
  float best[2] = {-INFINITY, -INFINITY};  // centroids c0 + 2t, c0 + 2t + 1
  for (std::int32_t j0 = 0; j0 < group; j0 += kHeadsInFlight) {
    uint4 piece[kHeadsInFlight][kPairs];
#pragma unroll
    for (int u = 0; u < kHeadsInFlight; ++u) {
      load_row_pieces(mine && j0 + u < group ? centroids.row(slot, g * group + j0 + u, c) : nullptr, t, piece[u]);
    }
    float acc[kHeadsInFlight][4] = {};
    mma_head_rows<T>(q_bits, n, t, piece, acc);
#pragma unroll
    for (int u = 0; u < kHeadsInFlight; ++u) {
      const std::int32_t j = j0 + u;
      if (j >= group) break;  // the same for the whole warp
      const int holder = (j % 8) * 4 + t;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float own = __shfl_sync(0xffffffffu, j < 8 ? acc[u][e] : acc[u][2 + e], holder);
        best[e] = max_nan(best[e], own * inverse_norms[j]);
      }
    }
  }
  if (n != 0) return;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const std::int32_t column = c0 + 2 * t + e;
    if (column < end) out[column] = column < count ? best[e] : -INFINITY;
  }
}

/// Block (row = b * kv_heads + g, chunk of kCentroidsPerBlock centroids): each centroid's cosine with its head's
/// query, the maximum over the group; -inf past the slot's count, NaN over a row with a bad slot or count. Chunks
/// spread a batch-1 step over the GPU's SMs.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    centroid_scores_kernel(QueryView<const T> q, QueryCentroidsView<const T> centroids, const std::int32_t* slots,
                           std::int32_t kv_heads, MatrixView<float> scores) {
  programmatic_wait();  // the queries and centroids (a programmatic dependent: launch.cuh); many waves at batch 8
  const std::int64_t row = blockIdx.x;
  const std::int32_t b = std::int32_t(row / kv_heads), g = std::int32_t(row % kv_heads);
  const std::int32_t group = q.heads / kv_heads;
  const std::int32_t begin = std::int32_t(blockIdx.y) * kCentroidsPerBlock;
  const std::int32_t end = min(begin + kCentroidsPerBlock, centroids.capacity);
  const std::int32_t slot = slots[b];
  const bool bad_slot = slot < 0 || slot >= centroids.slots;
  const std::int32_t count = bad_slot ? -1 : centroids.counts[slot];
  float* out = scores.row(row);
  if (bad_slot || count < 0 || count > centroids.capacity) {  // the same for the whole block
    for (std::int32_t c = begin + std::int32_t(threadIdx.x); c < end; c += kThreads) out[c] = __int_as_float(0x7fffffff);
    return;
  }
  if constexpr (kCentroidsOnTensorCores<T, kHeadDim>) {
    tensor_core_centroid_scores<T, kHeadDim>(q, centroids, slot, b, g, group, begin, end, count, out);
  } else {
    cuda_core_centroid_scores(q, centroids, slot, b, g, group, begin, end, count, out);
  }
}

/// A warp per (b, h, i): the query normalised in fp32, rounded to T.
template <class T>
__global__ void __launch_bounds__(kThreads)
    store_centroids_kernel(SequenceView<const T> queries, const std::int32_t* slots, const std::int32_t* first,
                           std::int32_t kv_heads, QueryCentroidsView<T> centroids) {
  programmatic_start();  // the queries and the columns
  const std::int64_t item = std::int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = int(threadIdx.x) % 32;
  const std::int64_t per_row = std::int64_t(queries.heads) * queries.tokens;
  if (item >= std::int64_t(queries.batch) * per_row) return;  // whole warps leave together
  const std::int32_t b = std::int32_t(item / per_row), h = std::int32_t(item % per_row / queries.tokens),
                     i = std::int32_t(item % queries.tokens);
  const std::int32_t group = queries.heads / kv_heads, slot = slots[b];
  const std::int32_t column = (first != nullptr ? first[std::int64_t(b) * kv_heads + h / group] : 0) + i;
  if (slot < 0 || slot >= centroids.slots || column < 0 || column >= centroids.capacity) return;
  const T* x = queries.row(b, h, i);
  float sq = 0.0f;
  for (int j = lane; j < queries.head_dim; j += 32) sq = fmaf(to_float_device(x[j]), to_float_device(x[j]), sq);
  const float scale = kvsift::detail::inverse_norm(warp_sum(sq));
  T* out = centroids.row(slot, h, column);
  for (int j = lane; j < queries.head_dim; j += 32) out[j] = from_float_device<T>(to_float_device(x[j]) * scale);
  if (h == 0 && i == queries.tokens - 1 && lane == 0) {  // one writer per slot
    std::int32_t end = queries.tokens;
    for (std::int32_t g = 0; first != nullptr && g < kv_heads; ++g) end = max(end, first[std::int64_t(b) * kv_heads + g] + queries.tokens);
    centroids.counts[slot] = max(centroids.counts[slot], end);
  }
}

}  // namespace

template <class T>
cudaError_t launch_centroid_scores(const QueryView<const T>& q, const QueryCentroidsView<const T>& centroids,
                                   const std::int32_t* slots, std::int32_t kv_heads, const MatrixView<float>& scores,
                                   cudaStream_t stream) {
  const dim3 grid(unsigned(scores.rows), unsigned((centroids.capacity + kCentroidsPerBlock - 1) / kCentroidsPerBlock));
  const LaunchShape shape{.grid = grid, .block = dim3(kThreads), .stream = stream, .programmatic = true};
  if constexpr (sizeof(T) == 2) {
    cudaError_t status = cudaSuccess;
    if (dispatch_value<kCudaAttentionHeadDims>(q.head_dim, [&]<int kHeadDim>() {
          status = launch(centroid_scores_kernel<T, kHeadDim>, shape, q, centroids, slots, kv_heads, scores);
        })) {
      return status;
    }
  }
  return launch(centroid_scores_kernel<T, 0>, shape, q, centroids, slots, kv_heads, scores);
}

template <class T>
cudaError_t launch_store_centroids(const SequenceView<const T>& queries, const std::int32_t* slots,
                                   const std::int32_t* first, std::int32_t kv_heads,
                                   const QueryCentroidsView<T>& centroids, cudaStream_t stream) {
  const std::int64_t items = std::int64_t(queries.batch) * queries.heads * queries.tokens;
  return launch(store_centroids_kernel<T>,
                {.grid = dim3(unsigned((items + kWarps - 1) / kWarps)), .block = dim3(kThreads), .stream = stream,
                 .programmatic = true},
                queries, slots, first, kv_heads, centroids);
}

#define KVSIFT_INSTANTIATE(T)                                                                                         \
  template cudaError_t launch_centroid_scores<T>(const QueryView<const T>&, const QueryCentroidsView<const T>&,      \
                                                 const std::int32_t*, std::int32_t, const MatrixView<float>&,         \
                                                 cudaStream_t);                                                       \
  template cudaError_t launch_store_centroids<T>(const SequenceView<const T>&, const std::int32_t*,                  \
                                                 const std::int32_t*, std::int32_t, const QueryCentroidsView<T>&,     \
                                                 cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
