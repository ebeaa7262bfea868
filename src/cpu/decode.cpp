// CPU decode attention: validation and dispatch (baseline ISA flags); kernels in kernels_<level>.cpp.
#include "kvsift/cpu/decode.hpp"

#include <cmath>
#include <vector>

#include "kvsift/attention/state.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/cpu/detail/decode_kernels.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu {
namespace {

template <class T, class KV>
void run(const char* where, const QueryView<const T>& q, const KV& kv, const SelectionView* selection,
         const StateView<T>& out, const AttentionOptions& options, ThreadPool* pool) {
  validate(q, where, "q");
  validate(kv, where, "kv", MemorySpace::host);
  validate(out, where, "out");
  check_decode_shapes(where, q, kv, out);
  KVSIFT_CHECK(q.head_dim <= detail::kMaxHeadDim, where,
               "head_dim (= {}) exceeds the CPU decode kernels' limit of {}", q.head_dim, detail::kMaxHeadDim);
  detail::DecodeJob<T, KV> job{q, kv, {}, out, q.heads / kv.kv_heads,
                               options.resolved_scale(q.head_dim) * kLog2e};
  if (selection != nullptr) {
    validate(*selection, kv, where, "selection", MemorySpace::host);
    job.selection = *selection;
  }
  const std::int64_t rows = std::int64_t(q.batch) * kv.kv_heads;
  with_simd_level([&]<SimdLevel L>() {
    const bool bf16_dot = L == SimdLevel::avx512 && std::is_same_v<T, bfloat16> && cpu_has_avx512_bf16();
    parallel_for(pool, rows, [&](std::int64_t begin, std::int64_t end) {
      detail::decode_rows<L, T, KV>(job, begin, end, bf16_dot);
    });
  });
}

}  // namespace

template <class T, class KV>
void sparse_decode(const QueryView<const T>& q, const KV& kv, const SelectionView& selection, const StateView<T>& out,
                   const AttentionOptions& options, ThreadPool* pool) {
  run("cpu::sparse_decode", q, kv, &selection, out, options, pool);
}

template <class T, class KV>
void dense_decode(const QueryView<const T>& q, const KV& kv, const StateView<T>& out, const AttentionOptions& options,
                  ThreadPool* pool) {
  run("cpu::dense_decode", q, kv, nullptr, out, options, pool);
}

template <class TI, class TO>
void merge_states(std::span<const StateView<const TI>> partials, const StateView<TO>& out) {
  constexpr const char* where = "cpu::merge_states";
  validate_merge_inputs(where, partials, out);
  for (std::int32_t b = 0; b < out.batch; ++b) {
    for (std::int32_t h = 0; h < out.heads; ++h) {
      float lse_max = negative_infinity<float>();
      for (const auto& p : partials) lse_max = std::max(lse_max, p.lse_at(b, h));
      float weight_sum = 0.0f;
      for (const auto& p : partials) weight_sum += state_weight(p.lse_at(b, h), lse_max);
      TO* o = out.o_row(b, h);
      for (std::int32_t c = 0; c < out.head_dim; ++c) {
        float acc = 0.0f;
        for (const auto& p : partials) {
          const float w = state_weight(p.lse_at(b, h), lse_max);
          if (w != 0.0f) acc += w * to_float(p.o_row(b, h)[c]);
        }
        o[c] = from_float<TO>(weight_sum == 0.0f ? 0.0f : acc / weight_sum);
      }
      out.lse_at(b, h) = merged_lse(lse_max, weight_sum);
    }
  }
}

#define KVSIFT_INSTANTIATE(T)                                                                                       \
  template void sparse_decode<T, ContiguousKVView<const T>>(const QueryView<const T>&, const ContiguousKVView<const T>&, \
                                                            const SelectionView&, const StateView<T>&,              \
                                                            const AttentionOptions&, ThreadPool*);                  \
  template void sparse_decode<T, PagedKVView<const T>>(const QueryView<const T>&, const PagedKVView<const T>&,      \
                                                       const SelectionView&, const StateView<T>&,                   \
                                                       const AttentionOptions&, ThreadPool*);                       \
  template void dense_decode<T, ContiguousKVView<const T>>(const QueryView<const T>&, const ContiguousKVView<const T>&, \
                                                           const StateView<T>&, const AttentionOptions&, ThreadPool*); \
  template void dense_decode<T, PagedKVView<const T>>(const QueryView<const T>&, const PagedKVView<const T>&,       \
                                                      const StateView<T>&, const AttentionOptions&, ThreadPool*);
KVSIFT_INSTANTIATE(half)
KVSIFT_INSTANTIATE(bfloat16)
#undef KVSIFT_INSTANTIATE
template void merge_states<float, float>(std::span<const StateView<const float>>, const StateView<float>&);
template void merge_states<half, half>(std::span<const StateView<const half>>, const StateView<half>&);
template void merge_states<bfloat16, bfloat16>(std::span<const StateView<const bfloat16>>, const StateView<bfloat16>&);
template void merge_states<float, half>(std::span<const StateView<const float>>, const StateView<half>&);
template void merge_states<float, bfloat16>(std::span<const StateView<const float>>, const StateView<bfloat16>&);

}  // namespace kvsift::cpu
