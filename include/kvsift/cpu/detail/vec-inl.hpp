#pragma once
/// Per-ISA float vectors for the CPU kernels. Included only by src/cpu/*_{scalar,avx2,avx512}.cpp, each
/// compiled with its own ISA flags; everything here is a template on SimdLevel, so every instantiation is
/// a distinct symbol and no ISA-specific code can be picked up by another translation unit.

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvsift/core/dtype.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu::detail {
namespace KVSIFT_CPU_ISA {  // this level's own symbols (instantiate-inl.hpp)

template <SimdLevel L>
struct Vec;

template <>
struct Vec<SimdLevel::scalar> {
  static constexpr int kWidth = 1;
  using V = float;
  static V zero() { return 0.0f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static V load(const half* p) {
    // Exact binary16 -> binary32 widening, written locally so that this TU inlines no shared helper.
    const std::uint32_t h = p->bits, sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    std::uint32_t bits;
    if (exp == 0x1fu) {
      bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
      bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else {
      float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
      return sign ? -v : v;
    }
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static V load(const bfloat16* p) {
    const std::uint32_t bits = std::uint32_t(p->bits) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  }
  static void store(float* p, V v) { *p = v; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static float reduce_sum(V v) { return v; }
  static float reduce_max(V v) { return v; }
  static V exp2(V x) { return std::exp2(x); }
};

/// 2^x for x <= 0 (softmax weights): round-to-nearest split x = n + f, |f| <= 1/2, a degree-6 polynomial
/// for 2^f (relative error ~1e-7), and n added to the exponent; x < -126 (and -inf) gives exactly 0.
template <class V, class Ops>
inline V exp2_nonpositive(V x) {
  const V clamped = Ops::max(x, Ops::set1(-126.0f));
  const V n = Ops::round(clamped);
  const V f = Ops::sub(clamped, n);
  V p = Ops::set1(1.5403530393381606e-4f);
  p = Ops::fma(p, f, Ops::set1(1.3333558146428443e-3f));
  p = Ops::fma(p, f, Ops::set1(9.6181291076284772e-3f));
  p = Ops::fma(p, f, Ops::set1(5.5504108664821580e-2f));
  p = Ops::fma(p, f, Ops::set1(2.4022650695910071e-1f));
  p = Ops::fma(p, f, Ops::set1(6.9314718055994531e-1f));
  p = Ops::fma(p, f, Ops::set1(1.0f));
  return Ops::zero_where_below(Ops::scale_by_pow2(p, n), x, -126.0f);
}

#if KVSIFT_CPU_HAS_AVX2
template <>
struct Vec<SimdLevel::avx2> {
  static constexpr int kWidth = 8;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load(const bfloat16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V scale_by_pow2(V p, V n) {
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  }
  static V zero_where_below(V v, V x, float bound) {
    return _mm256_and_ps(v, _mm256_cmp_ps(x, _mm256_set1_ps(bound), _CMP_GE_OQ));
  }
  static float reduce_sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float reduce_max(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V exp2(V x) { return exp2_nonpositive<V, Vec>(x); }
};

#endif

#if KVSIFT_CPU_HAS_AVX512
template <>
struct Vec<SimdLevel::avx512> {
  static constexpr int kWidth = 16;
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const bfloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V scale_by_pow2(V p, V n) {
    const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
  }
  static V zero_where_below(V v, V x, float bound) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(bound), _CMP_GE_OQ), v);
  }
  static float reduce_sum(V v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static V exp2(V x) { return exp2_nonpositive<V, Vec>(x); }
};

#endif

/// Rounds fp32 to the storage type (nearest even), with the ISA's own instructions where it has them.
template <SimdLevel L, class T>
T store_as(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, half>) {
#if KVSIFT_CPU_HAS_AVX2
    if constexpr (L != SimdLevel::scalar) return half{static_cast<std::uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT))};
#endif
    return float_to_half(x);
  } else {
    std::uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return bfloat16{static_cast<std::uint16_t>((bits >> 16) | 0x40u)};
    return bfloat16{static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16)};
  }
}

}  // namespace KVSIFT_CPU_ISA
using namespace KVSIFT_CPU_ISA;
}  // namespace kvsift::cpu::detail
