#pragma once
/// Lists of the values a family of kernels is compiled for, as constexpr arrays, and the three things every list
/// drives: the kernels' dispatch (dispatch_value: one instantiation per entry), the host checks
/// (is_supported, detail::check_supported in core/validate.hpp) and their error text (supported_text). A value
/// added to a list is added to all three at once. No fmt, no CUDA: .cu files include it.
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>

namespace kvsift {

/// head_dim of the CUDA attention family: dense and sparse decode, group scores, Quest's page scores.
inline constexpr std::array<int, 3> kCudaAttentionHeadDims{64, 128, 256};

constexpr bool is_supported(std::span<const int> values, std::int64_t value) {
  for (const int v : values) {
    if (v == value) return true;
  }
  return false;
}

/// "64, 128, 256": the list as error messages and docs write it.
inline std::string supported_text(std::span<const int> values) {
  std::string text;
  for (const int v : values) text += (text.empty() ? "" : ", ") + std::to_string(v);
  return text;
}

/// Calls f.template operator()<Values[i]>() for the entry equal to `value`; false when none is (the caller has
/// refused it already, with check_supported). Values: a constexpr std::array of int with static storage.
template <const auto& Values, class F>
constexpr bool dispatch_value(std::int64_t value, F&& f) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return ((value == Values[I] ? (f.template operator()<Values[I]>(), true) : false) || ...);
  }(std::make_index_sequence<Values.size()>{});
}

}  // namespace kvsift
