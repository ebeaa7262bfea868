#pragma once
/// Device conversions between kvsift's storage types and fp32.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
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

}  // namespace kvsift::cuda
