#pragma once
/// Run-time SIMD dispatch for the CPU backend. Kernel bodies are templates on SimdLevel written once
/// (cpu/detail/*-inl.hpp); only src/cpu/*_avx2.cpp and *_avx512.cpp are compiled with ISA flags, so no common
/// or inline code can leak illegal instructions onto older CPUs. Dispatch happens once per call, outside loops.
///
/// The level is the best one the CPU supports, lowered (never raised) by the environment variable
/// KVSIFT_SIMD=scalar|avx2|avx512 or by set_simd_level_override() (tests use ScopedSimdLevel).

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

#include "kvsift/core/enum_names.hpp"

namespace kvsift::cpu {

enum class SimdLevel : std::uint8_t { scalar, avx2, avx512 };

inline constexpr std::array<std::string_view, 3> kSimdLevelNames{"scalar", "avx2", "avx512"};
constexpr std::string_view simd_level_name(SimdLevel level) { return enum_name(kSimdLevelNames, level); }

/// The best level this CPU runs: avx512 needs AVX-512 F/BW/VL plus F16C and FMA (BF16 dot products are
/// used when AVX512_BF16 is also present); avx2 needs AVX2, FMA and F16C.
SimdLevel detected_simd_level();
/// Whether this CPU has AVX512_BF16 (vdpbf16ps).
bool cpu_has_avx512_bf16();
/// The level kernels use now: the detected one, lowered by KVSIFT_SIMD or the override.
SimdLevel active_simd_level();
/// Forces a level (std::nullopt clears). A level above the detected one is refused with kvsift::Error.
void set_simd_level_override(std::optional<SimdLevel> level);

/// Restores the previous override when it goes out of scope.
class ScopedSimdLevel {
 public:
  explicit ScopedSimdLevel(SimdLevel level);
  ~ScopedSimdLevel();
  ScopedSimdLevel(const ScopedSimdLevel&) = delete;
  ScopedSimdLevel& operator=(const ScopedSimdLevel&) = delete;

 private:
  std::optional<SimdLevel> previous_;
};

/// Calls fn.template operator()<L>() with L = active_simd_level().
template <class F>
decltype(auto) with_simd_level(F&& fn) {
  switch (active_simd_level()) {
    case SimdLevel::avx512: return fn.template operator()<SimdLevel::avx512>();
    case SimdLevel::avx2: return fn.template operator()<SimdLevel::avx2>();
    case SimdLevel::scalar: break;
  }
  return fn.template operator()<SimdLevel::scalar>();
}

}  // namespace kvsift::cpu
