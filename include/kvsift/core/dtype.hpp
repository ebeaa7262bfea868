#pragma once
/// Storage element types (fp32, fp16, bf16), their traits, and exact host conversions.
/// `half` and `bfloat16` are 16-bit storage types with the bit layout of CUDA's __half / __nv_bfloat16, so
/// device code may reinterpret pointers to them. Arithmetic always happens in fp32 (or wider).

#include <array>
#include <bit>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "kvsift/core/config.hpp"
#include "kvsift/core/enum_names.hpp"

/// The instance lists. Each calls X for every type (or type and cache view) a family is built for, and is the one
/// list its explicit instantiations, extern declarations and call-shape tests are generated from: a type added
/// to a list is built, declared and tested at once, on both backends.
/// Every storage type: the primitives (kernels/*.cu, src/**.cpp).
#define KVSIFT_STORAGE_TYPES(X) X(float) X(half) X(bfloat16)
/// The decode attention family's storage types (no fp32 KV cache): decode, its validation pass, the merges.
#define KVSIFT_DECODE_STORAGE_TYPES(X) X(half) X(bfloat16)
/// X(T, KV) for both cache views of storage type T (core/views.hpp).
#define KVSIFT_KV_VIEWS_OF(T, X) X(T, ContiguousKVView<const T>) X(T, PagedKVView<const T>)
/// The decode attention family's (storage type, cache view) pairs.
#define KVSIFT_DECODE_TYPES(X) KVSIFT_KV_VIEWS_OF(half, X) KVSIFT_KV_VIEWS_OF(bfloat16, X)
/// merge_states' (partials, output) pairs: every storage type to itself, and fp32 partials to a 16-bit output.
#define KVSIFT_MERGE_TYPES(X) X(float, float) X(half, half) X(bfloat16, bfloat16) X(float, half) X(float, bfloat16)
/// group_scores' and candidate_scores' (storage type, cache view) pairs.
#define KVSIFT_GROUP_SCORE_TYPES(X) \
  KVSIFT_KV_VIEWS_OF(float, X) KVSIFT_KV_VIEWS_OF(half, X) KVSIFT_KV_VIEWS_OF(bfloat16, X)

namespace kvsift {

enum class DType : std::uint8_t { f32, f16, bf16 };

inline constexpr std::array<std::string_view, 3> kDTypeNames{"f32", "f16", "bf16"};
constexpr std::string_view dtype_name(DType t) { return enum_name(kDTypeNames, t); }

struct half {
  std::uint16_t bits;
};
struct bfloat16 {
  std::uint16_t bits;
};
static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2);

/// IEEE binary16 from fp32, round to nearest even; overflow gives inf, NaN stays NaN.
constexpr half float_to_half(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return {static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u))};
  }
  if (abs >= 0x477ff000u) return {static_cast<std::uint16_t>(sign | 0x7c00u)};  // rounds to >= 65520
  if (abs < 0x38800000u) {  // result is subnormal or zero: shift the mantissa (with hidden bit) into place
    if (abs < 0x33000000u) return {static_cast<std::uint16_t>(sign)};
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;  // value = mant * 2^(exp-150); a subnormal half counts 2^-24
    std::uint32_t h = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return {static_cast<std::uint16_t>(sign | h)};
  }
  std::uint32_t h = ((abs - 0x38000000u) >> 13);
  const std::uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return {static_cast<std::uint16_t>(sign | h)};
}

constexpr float half_to_float(half h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h.bits & 0x8000u) << 16;
  const std::uint32_t exp = (h.bits >> 10) & 0x1fu;
  std::uint32_t mant = h.bits & 0x3ffu;
  if (exp == 0x1fu) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);
    // subnormal: value = mant * 2^-24
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

/// bfloat16 from fp32, round to nearest even; NaN stays NaN.
constexpr bfloat16 float_to_bfloat16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return {static_cast<std::uint16_t>((x >> 16) | 0x40u)};
  const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return {static_cast<std::uint16_t>((x + rounding) >> 16)};
}

constexpr float bfloat16_to_float(bfloat16 b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b.bits) << 16);
}

template <class T>
struct DTypeTraits;
template <>
struct DTypeTraits<float> {
  static constexpr DType dtype = DType::f32;
  static constexpr float to_float(float x) { return x; }
  static constexpr float from_float(float x) { return x; }
};
template <>
struct DTypeTraits<half> {
  static constexpr DType dtype = DType::f16;
  static constexpr float to_float(half x) { return half_to_float(x); }
  static constexpr half from_float(float x) { return float_to_half(x); }
};
template <>
struct DTypeTraits<bfloat16> {
  static constexpr DType dtype = DType::bf16;
  static constexpr float to_float(bfloat16 x) { return bfloat16_to_float(x); }
  static constexpr bfloat16 from_float(float x) { return float_to_bfloat16(x); }
};

template <class T>
concept StorageType = requires { DTypeTraits<std::remove_const_t<T>>::dtype; };

template <StorageType T>
constexpr float to_float(T x) {
  return DTypeTraits<std::remove_const_t<T>>::to_float(x);
}
template <StorageType T>
constexpr T from_float(float x) {
  return DTypeTraits<T>::from_float(x);
}

}  // namespace kvsift
