// The CPU kernels (decode attention, primitives) at SIMD level avx512. This file and its siblings are the only ones compiled with ISA
// flags (see CMakeLists.txt); they hold nothing but instantiations of templates on SimdLevel::avx512.
#include "kvsift/cpu/detail/decode-inl.hpp"
#include "kvsift/cpu/detail/primitives-inl.hpp"

namespace kvsift::cpu::detail {

#define KVSIFT_INSTANTIATE(T)                                                                                  \
  template void decode_rows<SimdLevel::avx512, T, ContiguousKVView<const T>>(                                 \
      const DecodeJob<T, ContiguousKVView<const T>>&, std::int64_t, std::int64_t, bool);                       \
  template void decode_rows<SimdLevel::avx512, T, PagedKVView<const T>>(const DecodeJob<T, PagedKVView<const T>>&, \
                                                                        std::int64_t, std::int64_t, bool);
KVSIFT_INSTANTIATE(half)
KVSIFT_INSTANTIATE(bfloat16)
#undef KVSIFT_INSTANTIATE

template void gemv_rows<SimdLevel::avx512, float>(const float*, const MatrixView<const float>&, float, float*, std::int64_t,
                                               std::int64_t);
template void gemv_rows<SimdLevel::avx512, half>(const float*, const MatrixView<const half>&, float, float*, std::int64_t,
                                              std::int64_t);
template void gemv_rows<SimdLevel::avx512, bfloat16>(const float*, const MatrixView<const bfloat16>&, float, float*,
                                                  std::int64_t, std::int64_t);
template void assign_rows<SimdLevel::avx512>(const MatrixView<const float>&, const MatrixView<const float>&, const float*,
                                          bool, std::int32_t*, std::int64_t, std::int64_t);

}  // namespace kvsift::cpu::detail
