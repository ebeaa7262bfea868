#pragma once
/// The tensor-core product every 16-bit kernel shares: one mma.sync m16n8k16 with fp32 accumulators (sm_80 and
/// later). Fragment layouts are PTX's: lane l holds rows l / 4 and l / 4 + 8 of A and C, column l / 4 of B, and
/// the k pairs 2 (l % 4) and 2 (l % 4) + 8 of each k-step.
#include <cuda_runtime.h>

#include <type_traits>

#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {

/// d += a * b for one m16n8k16 tile, inputs in T (half or bfloat16), fp32 accumulators.
template <class T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (std::is_same_v<T, half>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

}  // namespace kvsift::cuda::detail
