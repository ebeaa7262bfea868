#pragma once
/// CPU decode attention over host-resident KV: sparse (a selection, optional log-weights), dense, and the
/// LSE merge of partial states. Same conventions as the reference and CUDA paths: O [batch, q_heads,
/// head_dim] in the storage type, LSE [batch, q_heads] fp32 natural log; an empty row gives O = 0 and
/// LSE = -inf. Storage kvsift::half (F16C) or kvsift::bfloat16 (AVX512_BF16 vdpbf16ps for QK where the CPU
/// has it), fp32 accumulation; any head_dim up to 256; any GQA group; contiguous or paged KV; no alignment
/// requirement. SIMD level chosen at run time (cpu/simd.hpp).
///
/// Threads: work is split over (sequence, kv head) rows on `pool` (nullptr: the calling thread); see
/// cpu/thread_pool.hpp for the contract when several engine threads call in. Reentrant; the only memory
/// used besides the arguments is a fixed ~18 KB of stack per thread.

#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cpu {

template <class T, class KV>
void sparse_decode(const QueryView<const T>& q, const KV& kv, const SelectionView& selection, const StateView<T>& out,
                   const AttentionOptions& options = {}, ThreadPool* pool = nullptr);

template <class T, class KV>
void dense_decode(const QueryView<const T>& q, const KV& kv, const StateView<T>& out,
                  const AttentionOptions& options = {}, ThreadPool* pool = nullptr);

/// Merges partial states (e.g. the GPU window's and the CPU offload's) into `out`, which must not alias a
/// partial. Empty partials (LSE = -inf) are skipped, so they change nothing bit for bit.
template <class TI, class TO>
void merge_states(std::span<const StateView<const TI>> partials, const StateView<TO>& out);

}  // namespace kvsift::cpu
