#pragma once
/// Device-side LSE merge of partial attention states, shared by the split-K epilogue of decode and the
/// standalone merge_states kernel. One thread block merges one (sequence, head) row.

#include <cuda_runtime.h>

#include <cmath>

#include "kvsift/attention/decode_params.hpp"
#include "kvsift/attention/state.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {

inline constexpr int kMergeThreads = 256;  ///< block size of both merge kernels

/// Reduces one value per thread over the block (blockDim.x a multiple of 32, at most 1024); every thread gets
/// the result. `scratch` holds 32 floats; the call ends with the block synchronized.
template <class Op>
__device__ float block_reduce(float value, Op op, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = value;
  __syncthreads();
  value = scratch[0];
  for (int w = 1; w < warps; ++w) value = op(value, scratch[w]);
  __syncthreads();
  return value;
}

/// Merges `n` partials of one row with the whole block: lse_of(i) gives LSE_i (natural log), o_of(i, c)
/// element c of O_i. The maximum and the weights are computed once, in parallel over the partials, and staged
/// in shared memory. Then the block is split into `groups` of head_dim threads (one channel each) that take
/// every groups-th partial, issuing kLoadsInFlight independent O loads per round trip: the rows are in L2 but
/// a chain of dependent loads per partial would make the merge latency-bound. An empty partial (weight 0)
/// contributes exactly nothing: its O is selected away, never multiplied, so garbage in it cannot leak.
template <class LseOf, class OOf, class WriteO, class WriteLse>
__device__ void merge_row(int n, int head_dim, LseOf lse_of, OOf o_of, WriteO write_o, WriteLse write_lse) {
  constexpr int kChunk = 256;  // partials whose weights are staged at a time
  constexpr int kLoadsInFlight = 8;
  constexpr int kMaxChannelsPerThread = 4;  // head_dim <= 4 * kMergeThreads (checked by the launchers)
  __shared__ float scratch[32];
  __shared__ float weights[kChunk];
  __shared__ float group_sums[kMergeThreads];

  float lse_max = negative_infinity<float>();
  for (int i = threadIdx.x; i < n; i += blockDim.x) lse_max = fmaxf(lse_max, lse_of(i));
  lse_max = block_reduce(lse_max, [](float a, float b) { return fmaxf(a, b); }, scratch);
  float weight_sum = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) weight_sum += state_weight(lse_of(i), lse_max);
  weight_sum = block_reduce(weight_sum, [](float a, float b) { return a + b; }, scratch);

  const int groups = max(1, int(blockDim.x) / head_dim);
  const int group = head_dim >= int(blockDim.x) ? 0 : int(threadIdx.x) / head_dim;
  const bool accumulates = group < groups;
  float acc[kMaxChannelsPerThread] = {};
  for (int first = 0; first < n; first += kChunk) {
    const int count = min(kChunk, n - first);
    for (int i = threadIdx.x; i < count; i += blockDim.x) weights[i] = state_weight(lse_of(first + i), lse_max);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kMaxChannelsPerThread; ++r) {
      const int c = (groups > 1 ? int(threadIdx.x) % head_dim : int(threadIdx.x)) + r * int(blockDim.x);
      if (!accumulates || c >= head_dim) break;
      for (int i0 = group; i0 < count; i0 += groups * kLoadsInFlight) {
        float o[kLoadsInFlight];
#pragma unroll
        for (int k = 0; k < kLoadsInFlight; ++k) {
          const int i = i0 + k * groups;
          o[k] = i < count ? o_of(first + i, c) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < kLoadsInFlight; ++k) {
          const int i = i0 + k * groups;
          const float w = i < count ? weights[i] : 0.0f;
          acc[r] = w != 0.0f ? fmaf(w, o[k], acc[r]) : acc[r];
        }
      }
    }
    __syncthreads();
  }
  if (groups > 1) {  // then head_dim < blockDim.x and each thread holds one channel
    if (accumulates) group_sums[threadIdx.x] = acc[0];
    __syncthreads();
    if (group == 0) {
      for (int g = 1; g < groups; ++g) acc[0] += group_sums[g * head_dim + threadIdx.x];
    }
  }
  if (group == 0) {
#pragma unroll
    for (int r = 0; r < kMaxChannelsPerThread; ++r) {
      const int c = int(threadIdx.x) + r * int(blockDim.x);
      if (c < head_dim) write_o(c, weight_sum == 0.0f ? 0.0f : acc[r] / weight_sum);
    }
  }
  if (threadIdx.x == 0) write_lse(merged_lse(lse_max, weight_sum));
}

/// Split-K epilogue: merges the num_splits fp32 partials of each (sequence, q head) into the output.
template <class T>
__global__ void merge_splits_kernel(const __grid_constant__ DecodeParams<T> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the decode grid's partials are complete and visible
  asm volatile("griddepcontrol.launch_dependents;");   // the stream's next decode may be scheduled
#endif
  const int b = blockIdx.x / p.q.heads, h = blockIdx.x % p.q.heads;
  const std::int64_t row = (std::int64_t(b) * p.q.heads + h) * p.num_splits;
  const float* lse = p.partial_lse + row;
  const float* o = p.partial_o + row * p.q.head_dim;
  T* out = p.out.o_row(b, h);
  merge_row(
      p.num_splits, p.q.head_dim, [&](int i) { return lse[i]; },
      [&](int i, int c) { return o[std::int64_t(i) * p.q.head_dim + c]; },
      [&](int c, float v) { out[c] = from_float_device<T>(v); }, [&](float v) { p.out.lse_at(b, h) = v; });
}

template <class T>
__global__ void merge_states_kernel(const __grid_constant__ MergeParams<T> p) {
  const int b = blockIdx.x / p.out.heads, h = blockIdx.x % p.out.heads;
  T* out = p.out.o_row(b, h);
  merge_row(
      p.num_partials, p.out.head_dim, [&](int i) { return p.partials[i].lse_at(b, h); },
      [&](int i, int c) { return to_float_device(p.partials[i].o_row(b, h)[c]); },
      [&](int c, float v) { out[c] = from_float_device<T>(v); }, [&](float v) { p.out.lse_at(b, h) = v; });
}

}  // namespace kvsift::cuda::detail
