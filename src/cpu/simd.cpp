#include "kvsift/cpu/simd.hpp"

#include <atomic>
#include <cstdlib>
#include <string_view>

#include "kvsift/core/error.hpp"

namespace kvsift::cpu {
namespace {

// -1: no override; otherwise a SimdLevel value.
std::atomic<int> g_override{-1};

std::optional<SimdLevel> parse_level(std::string_view name) {
  if (name == "scalar") return SimdLevel::scalar;
  if (name == "avx2") return SimdLevel::avx2;
  if (name == "avx512") return SimdLevel::avx512;
  return std::nullopt;
}

SimdLevel environment_cap() {
  static const SimdLevel cap = [] {
    const char* value = std::getenv("KVSIFT_SIMD");
    if (value == nullptr) return SimdLevel::avx512;
    const auto level = parse_level(value);
    KVSIFT_CHECK(level.has_value(), "cpu::active_simd_level", "KVSIFT_SIMD (= '{}') must be scalar, avx2 or avx512",
                 value);
    return *level;
  }();
  return cap;
}

}  // namespace

SimdLevel detected_simd_level() {
  static const SimdLevel level = [] {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
    return avx512 ? SimdLevel::avx512 : avx2 ? SimdLevel::avx2 : SimdLevel::scalar;
  }();
  return level;
}

bool cpu_has_avx512_bf16() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
  }();
  return has;
}

SimdLevel active_simd_level() {
  SimdLevel level = std::min(detected_simd_level(), environment_cap());
  const int forced = g_override.load(std::memory_order_relaxed);
  if (forced >= 0) level = std::min(level, static_cast<SimdLevel>(forced));
  return level;
}

void set_simd_level_override(std::optional<SimdLevel> level) {
  if (level) {
    KVSIFT_CHECK(*level <= detected_simd_level(), "cpu::set_simd_level_override",
                 "level {} is above this CPU's {}", simd_level_name(*level), simd_level_name(detected_simd_level()));
  }
  g_override.store(level ? static_cast<int>(*level) : -1, std::memory_order_relaxed);
}

ScopedSimdLevel::ScopedSimdLevel(SimdLevel level) {
  const int current = g_override.load(std::memory_order_relaxed);
  if (current >= 0) previous_ = static_cast<SimdLevel>(current);
  set_simd_level_override(level);
}

ScopedSimdLevel::~ScopedSimdLevel() { set_simd_level_override(previous_); }

}  // namespace kvsift::cpu
