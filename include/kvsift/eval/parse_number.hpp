#pragma once
/// Strict text-to-number conversion, shared by the capture reader (eval/capture.hpp: its text header) and the
/// command-line tools (bench/cli_list.hpp). std::atoi, std::stod and istream >> accept "12x" as 12, "" or "abc"
/// as 0, and wrap or saturate on overflow; here the whole text must be one number of T, in T's range, or nothing
/// is returned. Base 10 only; no leading whitespace or '+'. A floating-point T also reads "nan" and "inf": the
/// callers decide whether those are allowed.

#include <charconv>
#include <concepts>
#include <optional>
#include <string_view>
#include <system_error>

namespace kvsift {

template <class T>
  requires std::integral<T> || std::floating_point<T>
std::optional<T> parse_number(std::string_view text) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (error != std::errc{} || stop != end) return std::nullopt;
  return value;
}

}  // namespace kvsift
