#pragma once
/// The values the non-finite scans are tested with, shared by the CPU and CUDA tests of first_nonfinite_key: every
/// non-finite encoding of a storage type (quiet, negative and signalling NaN, +inf, -inf) and the finite values next
/// to them (the largest magnitudes, the smallest subnormals), and a key's position.

#include <array>
#include <bit>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "test_util.hpp"

namespace kvsift::test {

using KeyPosition = std::array<std::int32_t, 4>;  ///< {b, h, t, i}
inline constexpr KeyPosition kNoKey{-1, -1, -1, -1};

/// T from its bits (the low 16 for half and bfloat16).
template <class T>
T from_bits(std::uint32_t bits) {
  if constexpr (std::is_same_v<T, float>) {
    return std::bit_cast<float>(bits);
  } else {
    return T{std::uint16_t(bits)};
  }
}

/// NaN (quiet, negative, signalling), +inf and -inf in T.
template <class T>
std::vector<T> nonfinite_values() {
  constexpr float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::uint32_t signalling = std::is_same_v<T, half> ? 0x7c01u : std::is_same_v<T, bfloat16> ? 0xff81u : 0x7f800001u;
  return {from_float<T>(nan), from_float<T>(-nan), from_float<T>(inf), from_float<T>(-inf), from_bits<T>(signalling)};
}

/// Finite values next to the non-finite encodings: the largest magnitudes and the smallest subnormals.
template <class T>
std::vector<T> finite_extremes() {
  if constexpr (std::is_same_v<T, half>) {
    return {from_bits<T>(0x7bffu), from_bits<T>(0xfbffu), from_bits<T>(0x0001u), from_bits<T>(0x83ffu)};
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    return {from_bits<T>(0x7f7fu), from_bits<T>(0xff7fu), from_bits<T>(0x0001u), from_bits<T>(0x807fu)};
  } else {
    return {std::numeric_limits<float>::max(), std::numeric_limits<float>::lowest(),
            std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()};
  }
}

/// A random key position among the scanned ones (tokens below lengths[b] of a random row b), none when that row is
/// empty.
inline std::optional<KeyPosition> random_key_position(Random& rng, const std::vector<std::int32_t>& lengths,
                                                      std::int32_t kv_heads, std::int32_t head_dim) {
  const std::int32_t b = rng.uniform_int(0, std::int32_t(lengths.size()) - 1);
  if (lengths[std::size_t(b)] == 0) return std::nullopt;
  return KeyPosition{b, rng.uniform_int(0, kv_heads - 1), rng.uniform_int(0, lengths[std::size_t(b)] - 1),
                     rng.uniform_int(0, head_dim - 1)};
}

}  // namespace kvsift::test
