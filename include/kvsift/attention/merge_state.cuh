#pragma once
/// Device-side LSE merge of partial attention states, shared by the split-K epilogue of decode and the
/// standalone merge_states kernel. One thread block merges one (sequence, head) row.

#include <cuda_runtime.h>

#include <cmath>

#include "kvsift/attention/decode_params.hpp"
#include "kvsift/attention/state.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {

/// Merges `n` partials of one row: lse_of(i) gives LSE_i (natural log), o_of(i, c) element c of O_i.
/// Threads of the block split the head_dim channels; every thread computes the (cheap) weights itself.
template <class LseOf, class OOf, class WriteO, class WriteLse>
__device__ void merge_row(int n, int head_dim, LseOf lse_of, OOf o_of, WriteO write_o, WriteLse write_lse) {
  float lse_max = negative_infinity<float>();
  for (int i = 0; i < n; ++i) lse_max = fmaxf(lse_max, lse_of(i));
  float weight_sum = 0.0f;
  for (int i = 0; i < n; ++i) weight_sum += state_weight(lse_of(i), lse_max);
  for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) {
      const float w = state_weight(lse_of(i), lse_max);
      if (w != 0.0f) acc += w * o_of(i, c);
    }
    write_o(c, weight_sum == 0.0f ? 0.0f : acc / weight_sum);
  }
  if (threadIdx.x == 0) write_lse(merged_lse(lse_max, weight_sum));
}

/// Split-K epilogue: merges the num_splits fp32 partials of each (sequence, q head) into the output.
template <class T>
__global__ void merge_splits_kernel(const __grid_constant__ DecodeParams<T> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the decode grid's partials are complete and visible
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
