// Instantiates every per-ISA CPU kernel (decode attention, primitives) at KVSIFT_CPU_LEVEL. Included once by
// each src/cpu/kernels_<level>.cpp, which defines KVSIFT_CPU_LEVEL, KVSIFT_CPU_ISA (the namespace of the
// level's helpers), KVSIFT_CPU_HAS_AVX2 and KVSIFT_CPU_HAS_AVX512 (which code the bodies compile: g++ lexes
// a C++ unit before it applies a target pragma, so __AVX2__ and the like cannot tell) and, above scalar,
// KVSIFT_CPU_TARGET (the instructions the bodies may use). No include guard: it is meant to be included
// once per translation unit, by those files only.
//
// ISA isolation, as Highway's per-target namespaces and target pragmas do it. An inline or template function
// is emitted in every unit that uses it and the linker keeps one copy: compiled with AVX-512 flags, a view
// accessor or std::exp2 wrapper could be the copy an AVX2-only machine runs. So (1) every header the bodies
// use is included first, with the baseline flags; (2) only the kernel bodies are compiled with the level's
// target; (3) the bodies' helpers live in namespace KVSIFT_CPU_ISA, and the entry points are templates on
// SimdLevel, so every symbol compiled with the level's instructions is the level's own.
// tests/cpu/check_isa_symbols.py checks this on the built objects.

#if !defined(KVSIFT_CPU_LEVEL) || !defined(KVSIFT_CPU_ISA) || !defined(KVSIFT_CPU_HAS_AVX2) || !defined(KVSIFT_CPU_HAS_AVX512)
#error "define KVSIFT_CPU_LEVEL, KVSIFT_CPU_ISA, KVSIFT_CPU_HAS_AVX2 and KVSIFT_CPU_HAS_AVX512 before including instantiate-inl.hpp"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "kvsift/attention/state.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/detail/decode_kernels.hpp"
#include "kvsift/cpu/detail/primitives_kernels.hpp"
#include "kvsift/cpu/simd.hpp"

#if defined(KVSIFT_CPU_TARGET)
#if defined(__clang__)
#error "kvsift's per-ISA CPU kernels are built with GCC's target pragma: compile them with g++ (README: g++ >= 12)"
#endif
#define KVSIFT_CPU_PRAGMA(text) _Pragma(#text)
#define KVSIFT_CPU_TARGET_PRAGMA(isa) KVSIFT_CPU_PRAGMA(GCC target(isa))  // expands the macro naming the ISA
#pragma GCC push_options
KVSIFT_CPU_TARGET_PRAGMA(KVSIFT_CPU_TARGET)
#endif

#include "kvsift/cpu/detail/decode-inl.hpp"
#include "kvsift/cpu/detail/primitives-inl.hpp"

namespace kvsift::cpu::detail {

// O in the storage type, or fp32 for a later merge.
#define KVSIFT_INSTANTIATE_DECODE(T, KV)                                                                          \
  template void decode_items<KVSIFT_CPU_LEVEL, T, KV, T>(const DecodeJob<T, KV, T>&, std::int64_t, std::int64_t, bool); \
  template void decode_items<KVSIFT_CPU_LEVEL, T, KV, float>(const DecodeJob<T, KV, float>&, std::int64_t, std::int64_t, bool);
KVSIFT_DECODE_TYPES(KVSIFT_INSTANTIATE_DECODE)
#undef KVSIFT_INSTANTIATE_DECODE

#define KVSIFT_INSTANTIATE_GEMV(T) \
  template void gemv_rows<KVSIFT_CPU_LEVEL, T>(const float*, const MatrixView<const T>&, float, float*, std::int64_t, std::int64_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE_GEMV)
#undef KVSIFT_INSTANTIATE_GEMV

#define KVSIFT_INSTANTIATE_GROUP_SCORES(T, KV)                                                                       \
  template void group_logits_items<KVSIFT_CPU_LEVEL, T, KV>(const GroupScoreJob<T, KV>&, std::int64_t, std::int64_t, bool); \
  template void group_softmax_items<KVSIFT_CPU_LEVEL, T, KV>(const GroupScoreJob<T, KV>&, std::int64_t, std::int64_t);
KVSIFT_GROUP_SCORE_TYPES(KVSIFT_INSTANTIATE_GROUP_SCORES)
#undef KVSIFT_INSTANTIATE_GROUP_SCORES

template void score_rows<KVSIFT_CPU_LEVEL>(const MatrixView<const float>&, const ScorePanel&, float*, std::int64_t,
                                           std::int64_t, std::int64_t);
template void assign_rows<KVSIFT_CPU_LEVEL>(const MatrixView<const float>&, const ScorePanel&, std::int32_t*, std::int64_t,
                                            std::int64_t);

}  // namespace kvsift::cpu::detail

#if defined(KVSIFT_CPU_TARGET)
#pragma GCC pop_options
#endif
