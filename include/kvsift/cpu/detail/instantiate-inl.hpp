// Instantiates every per-ISA CPU kernel (decode attention, primitives) at KVSIFT_CPU_LEVEL. Included once by
// each src/cpu/kernels_<level>.cpp, which defines KVSIFT_CPU_LEVEL and is compiled with that level's flags.
// No include guard: it is meant to be included once per translation unit, by those files only.

#ifndef KVSIFT_CPU_LEVEL
#error "define KVSIFT_CPU_LEVEL (a kvsift::cpu::SimdLevel) before including instantiate-inl.hpp"
#endif

#include "kvsift/cpu/detail/decode-inl.hpp"
#include "kvsift/cpu/detail/primitives-inl.hpp"

namespace kvsift::cpu::detail {

#define KVSIFT_INSTANTIATE_DECODE(T, KV) \
  template void decode_items<KVSIFT_CPU_LEVEL, T, KV>(const DecodeJob<T, KV>&, std::int64_t, std::int64_t, bool);
KVSIFT_INSTANTIATE_DECODE(half, ContiguousKVView<const half>)
KVSIFT_INSTANTIATE_DECODE(half, PagedKVView<const half>)
KVSIFT_INSTANTIATE_DECODE(bfloat16, ContiguousKVView<const bfloat16>)
KVSIFT_INSTANTIATE_DECODE(bfloat16, PagedKVView<const bfloat16>)
#undef KVSIFT_INSTANTIATE_DECODE

#define KVSIFT_INSTANTIATE_GEMV(T) \
  template void gemv_rows<KVSIFT_CPU_LEVEL, T>(const float*, const MatrixView<const T>&, float, float*, std::int64_t, std::int64_t);
KVSIFT_INSTANTIATE_GEMV(float)
KVSIFT_INSTANTIATE_GEMV(half)
KVSIFT_INSTANTIATE_GEMV(bfloat16)
#undef KVSIFT_INSTANTIATE_GEMV

template void score_rows<KVSIFT_CPU_LEVEL>(const MatrixView<const float>&, const ScorePanel&, float*, std::int64_t,
                                           std::int64_t, std::int64_t);
template void assign_rows<KVSIFT_CPU_LEVEL>(const MatrixView<const float>&, const ScorePanel&, std::int32_t*, std::int64_t,
                                            std::int64_t);

}  // namespace kvsift::cpu::detail
