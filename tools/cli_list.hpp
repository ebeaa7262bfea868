#pragma once
/// The command lines of the tools in bench/ (kvsift_fidelity, kvsift_a2ats_codebook, kvsift_specontext_layers,
/// kvsift_specontext_persistence, kvsift_demo): one strict reading of numbers, comma-separated lists and names, so
/// that no tool takes "12x" for 12, "abc" for 0 or an unknown name for nothing. Every refusal is kvsift::Error
/// naming the tool (`where`), the option and the text the user gave.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/eval/parse_number.hpp"

namespace kvsift::bench {

/// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}.
inline std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  for (std::size_t start = 0; start <= list.size();) {
    const std::size_t end = std::min(list.find(',', start), list.size());
    out.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

/// `text`, the value of `option`, as an integer T in [min, max]; refuses anything else ("x", "", "3x", "1.5",
/// a number outside T's range or [min, max]).
template <std::integral T>
T parse_integer(const char* where, std::string_view option, std::string_view text, T min,
                T max = std::numeric_limits<T>::max()) {
  const auto value = parse_number<T>(text);
  KVSIFT_CHECK(value && *value >= min && *value <= max, where, "{} must be an integer in [{}, {}], got '{}'", option,
               min, max, text);
  return *value;
}

/// `text`, the value of `option`, as a finite number; refuses junk, "nan", "inf" and overflow.
inline double parse_real(const char* where, std::string_view option, std::string_view text) {
  const auto value = parse_number<double>(text);
  KVSIFT_CHECK(value && std::isfinite(*value), where, "{} must be a finite number, got '{}'", option, text);
  return *value;
}

/// f(label, item) for each item of the comma-separated `list` given to `option`, where label names the item for
/// refusals: "--layers item 2 of '3,x'".
template <class F>
void for_each_list_item(std::string_view option, const std::string& list, F&& f) {
  const std::vector<std::string> items = split_list(list);
  for (std::size_t i = 0; i < items.size(); ++i) f(fmt::format("{} item {} of '{}'", option, i + 1, list), items[i]);
}

/// Each item of `list` as parse_integer.
template <std::integral T>
std::vector<T> parse_integers(const char* where, std::string_view option, const std::string& list, T min,
                              T max = std::numeric_limits<T>::max()) {
  std::vector<T> out;
  for_each_list_item(option, list, [&](const std::string& label, const std::string& item) {
    out.push_back(parse_integer<T>(where, label, item, min, max));
  });
  return out;
}

/// Each item of `list` as parse_real.
inline std::vector<double> parse_reals(const char* where, std::string_view option, const std::string& list) {
  std::vector<double> out;
  for_each_list_item(option, list, [&](const std::string& label, const std::string& item) {
    out.push_back(parse_real(where, label, item));
  });
  return out;
}

/// A --layers value: "all" gives an empty list (the tool takes every layer its first capture holds), anything else
/// a list of layer numbers (parse_integers, each >= 0).
inline std::vector<std::int32_t> parse_layers(const char* where, std::string_view option,
                                              const std::string& text) {
  return text == "all" ? std::vector<std::int32_t>{} : parse_integers<std::int32_t>(where, option, text, 0);
}

/// Refuses a name in `given` that is not one of `known`, listing the known ones.
inline void check_names(const char* where, std::string_view option, const std::vector<std::string>& given,
                        const std::vector<std::string>& known) {
  for (const std::string& name : given) {
    KVSIFT_CHECK(std::find(known.begin(), known.end(), name) != known.end(), where, "{}: '{}' is not one of: {}",
                 option, name, fmt::join(known, ", "));
  }
}

/// A tool's arguments, read front to back:
///   Arguments args(where, argc, argv);
///   while (args.next()) {
///     if (args.is("--positions")) positions = args.integer<std::int32_t>(1);
///     else if (args.is("--plain")) plain = true;
///     else args.refuse();
///   }
/// An option's value is the argument after it; one that ends the command line is refused, naming the option.
class Arguments {
 public:
  Arguments(const char* where, int argc, char** argv) : where_(where), argv_(argv + 1, argv + argc) {}

  /// Moves to the next argument; false past the last.
  bool next() { return ++at_ < argv_.size(); }
  /// The current argument.
  const std::string& arg() const { return argv_[at_]; }
  bool is(std::string_view option) const { return arg() == option; }

  /// The current option's value (the argument after it, which the next next() skips).
  const std::string& value() {
    KVSIFT_CHECK(at_ + 1 < argv_.size(), where_, "{} needs a value", arg());
    return argv_[++at_];
  }
  template <std::integral T>
  T integer(T min, T max = std::numeric_limits<T>::max()) {
    const std::string option = arg();
    return parse_integer<T>(where_, option, value(), min, max);
  }
  double real() {
    const std::string option = arg();
    return parse_real(where_, option, value());
  }
  template <std::integral T>
  std::vector<T> integers(T min, T max = std::numeric_limits<T>::max()) {
    const std::string option = arg();
    return parse_integers<T>(where_, option, value(), min, max);
  }
  std::vector<double> reals() {
    const std::string option = arg();
    return parse_reals(where_, option, value());
  }

  /// Refuses the current argument: an option the tool does not have.
  [[noreturn]] void refuse() const { kvsift::detail::throw_error(where_, fmt::format("unknown option '{}'", arg())); }

 private:
  const char* where_;
  std::vector<std::string> argv_;
  std::size_t at_ = std::size_t(-1);  // next() moves to 0
};

}  // namespace kvsift::bench
