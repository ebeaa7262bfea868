// The CPU kernels (decode attention, primitives) at SIMD level avx2: nothing but their instantiations.
// The level's instructions are enabled for the kernel bodies alone (see instantiate-inl.hpp), never for
// the translation unit, so that no inline function shared with other units is compiled with them.
#define KVSIFT_CPU_LEVEL ::kvsift::cpu::SimdLevel::avx2
#define KVSIFT_CPU_ISA isa_avx2
#define KVSIFT_CPU_TARGET "avx2,fma,f16c"
#define KVSIFT_CPU_HAS_AVX2 1  // the Vec<> and vdpbf16ps code this level compiles
#define KVSIFT_CPU_HAS_AVX512 0
#include "kvsift/cpu/detail/instantiate-inl.hpp"
