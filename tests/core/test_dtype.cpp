#include <gtest/gtest.h>

#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "kvsift/core/dtype.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

// The x86 F16C converter is an independent, hardware reference for IEEE binary16 rounding.
__attribute__((target("f16c"))) std::uint16_t f16c_from_float(float f) {
  return static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float f16c_to_float(std::uint16_t h) { return _cvtsh_ss(h); }

TEST(DType, HalfConversionMatchesF16cOnRandomAndEdgeValues) {
  if (!__builtin_cpu_supports("f16c")) GTEST_SKIP() << "this CPU has no F16C to compare against";
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  test::Random rng(seed);
  std::vector<float> values = {0.0f, -0.0f, 1.0f, 65504.0f, 65519.0f, 65520.0f, 1e-8f, 2.98e-8f, 5.96e-8f,
                               6.1e-5f, 6.103515625e-05f, INFINITY, -INFINITY};
  for (int i = 0; i < 200000; ++i) {
    // Random bit patterns across the whole float range, and values around the half range.
    values.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng.engine())));
    values.push_back(rng.uniform(-1.0f, 1.0f) * std::ldexp(1.0f, rng.uniform_int(-26, 17)));
  }
  for (float f : values) {
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f))));
      continue;
    }
    ASSERT_EQ(float_to_half(f).bits, f16c_from_float(f)) << "value " << f;
  }
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const float expected = f16c_to_float(static_cast<std::uint16_t>(bits));
    const float got = half_to_float(half{static_cast<std::uint16_t>(bits)});
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got), std::bit_cast<std::uint32_t>(expected)) << "bits " << bits;
    }
  }
}

TEST(DType, Bfloat16RoundsToNearestEven) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  test::Random rng(seed);
  for (int i = 0; i < 200000; ++i) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(rng.engine()));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(f))));
      continue;
    }
    // Independent rule: the nearest of the two bf16 neighbours, the even one on a tie.
    const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t down = x & 0xffff0000u, up = down + 0x10000u;
    // Past the largest finite bf16 the upper neighbour is inf, at the distance of 2^128 (IEEE overflow rule).
    const auto magnitude = [](std::uint32_t bits) {
      const float v = std::bit_cast<float>(bits);
      return std::isinf(v) ? std::copysign(std::ldexp(1.0, 128), double(v)) : double(v);
    };
    const double dd = std::abs(double(f) - magnitude(down));
    const double du = std::abs(magnitude(up) - double(f));
    std::uint32_t expected = dd < du ? down : (du < dd ? up : (((down >> 16) & 1u) ? up : down));
    if (std::isinf(std::bit_cast<float>(down))) expected = down;
    ASSERT_EQ(std::uint32_t(float_to_bfloat16(f).bits) << 16, expected) << "value " << f;
  }
  EXPECT_EQ(bfloat16_to_float(float_to_bfloat16(1.0f)), 1.0f);
  EXPECT_EQ(bfloat16_to_float(float_to_bfloat16(-3.0f)), -3.0f);
}

}  // namespace
}  // namespace kvsift
