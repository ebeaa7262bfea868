// The CPU kernels (decode attention, primitives) at SIMD level avx512: nothing but their instantiations.
// The level's instructions are enabled for the kernel bodies alone (see instantiate-inl.hpp), never for
// the translation unit, so that no inline function shared with other units is compiled with them.
#define KVSIFT_CPU_LEVEL ::kvsift::cpu::SimdLevel::avx512
#define KVSIFT_CPU_ISA isa_avx512
#define KVSIFT_CPU_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"
#define KVSIFT_CPU_HAS_AVX2 1  // the Vec<> and vdpbf16ps code this level compiles
#define KVSIFT_CPU_HAS_AVX512 1
#include "kvsift/cpu/detail/instantiate-inl.hpp"
