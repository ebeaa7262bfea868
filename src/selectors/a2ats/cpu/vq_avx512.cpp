// The AVX-512 row scan of cpu::vq_code_scan (src/selectors/a2ats/cpu/vq.cpp): 16 codes widened to int32, one masked gather from
// the table per 16 tokens (codes >= codewords keep the NaN fill), one store. As instantiate-inl.hpp does, the
// level's instructions are enabled for this body alone, after every header, and its helpers stay in this
// file: no inline function shared with baseline code is compiled with them.
#include <immintrin.h>

#include <cstdint>
#include <limits>

#if defined(__clang__)
#error "kvsift's per-ISA CPU kernels are built with GCC's target pragma: compile them with g++ (README: g++ >= 12)"
#endif

namespace kvsift::cpu::detail::isa_avx512 {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on the intrinsics' own undefined-vector arguments

void vq_scan_row_avx512(const float* lut, std::int32_t codewords, const std::uint16_t* codes, std::int32_t n, float* out) {
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  const __m512i limit = _mm512_set1_epi32(codewords);
  std::int32_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512i index = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + t)));
    const __mmask16 inside = _mm512_cmplt_epi32_mask(index, limit);
    _mm512_storeu_ps(out + t, _mm512_mask_i32gather_ps(nan, inside, index, lut, 4));
  }
  if (t < n) {
    const __mmask16 tail = __mmask16((1u << (n - t)) - 1u);
    const __m512i index = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail, codes + t));
    const __mmask16 inside = _mm512_mask_cmplt_epi32_mask(tail, index, limit);
    _mm512_mask_storeu_ps(out + t, tail, _mm512_mask_i32gather_ps(nan, inside, index, lut, 4));
  }
}

#pragma GCC diagnostic pop
#pragma GCC pop_options

}  // namespace kvsift::cpu::detail::isa_avx512
