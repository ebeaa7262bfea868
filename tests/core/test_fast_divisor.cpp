// FastDivisor (core/fast_divisor.hpp) against the division operator: every divisor up to 4096 and the powers of
// two, on the numerators where a multiply-high's rounding could go wrong (multiples of d and their neighbours, the
// top of the range) and on random ones.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "kvsift/core/fast_divisor.hpp"

namespace kvsift {
namespace {

TEST(FastDivisor, EqualsDivisionOverTheWholeRange) {
  std::mt19937_64 engine(20261129);
  std::uniform_int_distribution<std::uint32_t> any(0, 0x7fffffffu);
  std::vector<std::uint32_t> divisors;
  for (std::uint32_t d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (std::uint32_t shift = 13; shift < 31; ++shift) divisors.push_back(1u << shift);
  divisors.push_back(0x7fffffffu);
  for (const std::uint32_t d : divisors) {
    const FastDivisor fast(d);
    std::vector<std::uint32_t> numerators{0, 1, 0x7fffffffu, 0x7ffffffeu, 0x7fffffffu / d * d};
    for (std::uint32_t k = 1; k < 64; ++k) {
      const std::uint64_t multiple = std::uint64_t(d) * (std::uint64_t(k) * 0x7fffffffu / 64 / d);
      for (const std::int64_t delta : {-1, 0, 1}) {
        const std::int64_t n = std::int64_t(multiple) + delta;
        if (n >= 0 && n <= 0x7fffffff) numerators.push_back(std::uint32_t(n));
      }
    }
    for (int i = 0; i < 200; ++i) numerators.push_back(any(engine));
    for (const std::uint32_t n : numerators) ASSERT_EQ(fast.quotient(n), n / d) << n << " / " << d;
  }
}

}  // namespace
}  // namespace kvsift
