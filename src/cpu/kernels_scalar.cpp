// The CPU kernels (decode attention, primitives) at SIMD level scalar: nothing but their instantiations.
// The level's instructions are enabled for the kernel bodies alone (see instantiate-inl.hpp), never for
// the translation unit, so that no inline function shared with other units is compiled with them.
#define KVSIFT_CPU_LEVEL ::kvsift::cpu::SimdLevel::scalar
#define KVSIFT_CPU_ISA isa_scalar
#define KVSIFT_CPU_HAS_AVX2 0  // the Vec<> and vdpbf16ps code this level compiles
#define KVSIFT_CPU_HAS_AVX512 0
#include "kvsift/cpu/detail/instantiate-inl.hpp"
