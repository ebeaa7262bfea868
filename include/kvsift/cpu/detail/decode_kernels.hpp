#pragma once
/// The CPU decode job and the per-ISA kernels' declarations; the kernels are defined in decode-inl.hpp and
/// instantiated only in src/cpu/kernels_<level>.cpp (so that baseline code never instantiates ISA code).

#include <cstdint>

#include "kvsift/attention/state.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu::detail {

inline constexpr int kMaxHeadDim = 256;
inline constexpr int kHeadTile = 8;
inline constexpr int kTokenBlock = 64;

/// Everything one decode call needs; rows are (sequence, kv head) pairs, row = b * kv_heads + h.
template <class T, class KV>
struct DecodeJob {
  QueryView<const T> q;
  KV kv;
  SelectionView selection;  ///< indices == nullptr: dense decode over every token
  StateView<T> out;
  std::int32_t group = 1;
  float scale_log2 = 0.0f;  ///< sm_scale * log2(e)
};


/// Runs rows [row_begin, row_end) of the job at SIMD level L. use_bf16_dot selects vdpbf16ps (avx512 only).
template <SimdLevel L, class T, class KV>
void decode_rows(const DecodeJob<T, KV>& job, std::int64_t row_begin, std::int64_t row_end, bool use_bf16_dot);

}  // namespace kvsift::cpu::detail
