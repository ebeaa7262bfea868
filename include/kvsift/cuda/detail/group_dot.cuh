#pragma once
/// Warp-level pieces of the GQA-group dot products that the rerank kernels (kernels/rerank.cu) and CTKVR's query
/// centroids (kernels/selectors/ctkvr/query_centroids.cu) share: sums and NaN-keeping maxima over a warp in a fixed
/// shuffle order, and a dot product split over 8 lanes. Results do not depend on scheduling.
#include <cstdint>

#include "kvsift/attention/state.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}
/// The warp's maximum that keeps NaN (attention/state.hpp max_nan, the CPU's rule).
__device__ __forceinline__ float warp_max_nan(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = max_nan(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

/// Lane `sublane`'s share of dot(q, row) when 8 lanes split a row of d elements: a contiguous span of d / 8
/// elements, read 16 bytes at a time where the span and the row allow it (d a multiple of 64 for 16-bit types, of
/// 32 for fp32, the row 16-byte aligned), else dims sublane, sublane + 8, ... one by one. q: fp32 (shared memory).
/// The caller adds the 8 shares with a 3-step shuffle tree.
template <class T>
__device__ __forceinline__ float octet_dot_part(const float* q, const T* row, int d, int sublane) {
  constexpr int kPerLoad = int(16 / sizeof(T));
  const int span = d / 8;
  float s = 0.0f;
  if (d % 8 == 0 && span % kPerLoad == 0 && reinterpret_cast<std::uintptr_t>(row) % 16 == 0) {
    const T* p = row + sublane * span;
    const float* x = q + sublane * span;
    for (int i = 0; i < span; i += kPerLoad) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p + i);
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < kPerLoad; ++e) s = fmaf(x[i + e], to_float_device(v[e]), s);
    }
    return s;
  }
  for (int c = sublane; c < d; c += 8) s = fmaf(q[c], to_float_device(row[c]), s);
  return s;
}
__device__ __forceinline__ float octet_sum(float part) {
#pragma unroll
  for (int offset = 4; offset > 0; offset /= 2) part += __shfl_xor_sync(0xffffffffu, part, offset);
  return part;
}

}  // namespace kvsift::cuda::detail
