#pragma once
/// The printable names of kvsift's small enums, one table per enum in its values' order.

#include <array>
#include <cstddef>
#include <string_view>

namespace kvsift {

/// names[value], or "?" for a value outside the table (a cast from an unchecked integer).
template <class Enum, std::size_t N>
constexpr std::string_view enum_name(const std::array<std::string_view, N>& names, Enum value) {
  const auto i = static_cast<std::size_t>(value);
  return i < N ? names[i] : std::string_view("?");
}

}  // namespace kvsift
