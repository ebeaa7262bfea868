#pragma once
/// Division by a runtime divisor without an integer division instruction, for index arithmetic in kernels' address
/// paths: n / d of 0 <= n < 2^31 as a multiply-high and a shift (Granlund and Montgomery, "Division by invariant
/// integers using multiplication", 1994; the method of CUTLASS's FastDivmod). The multiplier is computed once, on
/// the host.

#include <cstdint>

#include "kvsift/core/config.hpp"

namespace kvsift {

struct FastDivisor {
  std::uint32_t divisor = 1;
  std::uint32_t multiplier = 0;  ///< ceil(2^(31 + ceil(log2 d)) / d); 0 for d = 1
  std::uint32_t shift = 0;       ///< ceil(log2 d) - 1

  FastDivisor() = default;
  /// d >= 1.
  explicit FastDivisor(std::uint32_t d) : divisor(d) {
    if (d <= 1) return;
    std::uint32_t log2 = 0;
    while ((std::uint64_t(1) << log2) < d) ++log2;
    multiplier = std::uint32_t(((std::uint64_t(1) << (31 + log2)) + d - 1) / d);
    shift = log2 - 1;
  }
  /// n / divisor, for n < 2^31.
  KVSIFT_HOST_DEVICE std::uint32_t quotient(std::uint32_t n) const {
    if (divisor == 1) return n;
#if defined(__CUDA_ARCH__)
    return __umulhi(n, multiplier) >> shift;
#else
    return std::uint32_t((std::uint64_t(n) * multiplier) >> 32) >> shift;
#endif
  }
};

}  // namespace kvsift
