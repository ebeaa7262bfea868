// The CPU kernels (decode attention, primitives) at SIMD level avx2. The kernels_<level>.cpp files are the
// only ones compiled with ISA flags (see CMakeLists.txt); they hold nothing but these instantiations.
#define KVSIFT_CPU_LEVEL ::kvsift::cpu::SimdLevel::avx2
#include "kvsift/cpu/detail/instantiate-inl.hpp"
