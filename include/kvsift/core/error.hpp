#pragma once
/// kvsift's one error model: public entry points validate their arguments and throw kvsift::Error with a
/// message that names the function, the argument, its value and the rule it broke. Internal invariants use
/// KVSIFT_DASSERT, which is compiled out of release builds. Hot paths never throw after validation.

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace kvsift {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
[[noreturn]] inline void throw_error(const char* where, const std::string& what) {
  throw Error(fmt::format("kvsift::{}: {}", where, what));
}
}  // namespace detail

/// Multiplies sizes, refusing overflow instead of wrapping (`what` names the computation in the error).
inline std::size_t checked_mul(std::size_t a, std::size_t b, const char* what) {
  if (a != 0 && b > std::numeric_limits<std::size_t>::max() / a) {
    detail::throw_error(what, fmt::format("size {} * {} overflows std::size_t", a, b));
  }
  return a * b;
}

}  // namespace kvsift

/// Refuses bad input at a public boundary: `where` is the public function name, the rest an fmt message.
#define KVSIFT_CHECK(cond, where, ...)                                                     \
  do {                                                                                     \
    if (!(cond)) [[unlikely]] ::kvsift::detail::throw_error(where, fmt::format(__VA_ARGS__)); \
  } while (0)

#ifndef NDEBUG
#define KVSIFT_DASSERT(cond)                                                                  \
  do {                                                                                        \
    if (!(cond)) [[unlikely]]                                                                 \
      ::kvsift::detail::throw_error("internal", fmt::format("assertion failed: {} ({}:{})", \
                                                            #cond, __FILE__, __LINE__));      \
  } while (0)
#else
#define KVSIFT_DASSERT(cond) ((void)0)
#endif
