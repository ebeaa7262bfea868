#pragma once
/// Device conversions between kvsift's storage types and fp32, and unpacking of 16-byte vectors.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvsift/core/dtype.hpp"

namespace kvsift::cuda {

__device__ __forceinline__ float to_float_device(float x) { return x; }
__device__ __forceinline__ float to_float_device(half x) { return __half2float(__ushort_as_half(x.bits)); }
__device__ __forceinline__ float to_float_device(bfloat16 x) { return __uint_as_float(std::uint32_t(x.bits) << 16); }

template <class T>
__device__ __forceinline__ T from_float_device(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, half>) {
    return half{__half_as_ushort(__float2half_rn(x))};
  } else {
    return bfloat16{__bfloat16_as_ushort(__float2bfloat16_rn(x))};
  }
}

/// Eight 16-bit storage elements packed in 16 bytes, widened to fp32.
template <class T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&out)[8]) {
  const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, half>) {
      __half2 pair;
      std::memcpy(&pair, &words[i], sizeof(pair));
      const float2 f = __half22float2(pair);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    } else {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  }
}

}  // namespace kvsift::cuda
