#pragma once
/// CPU decode attention over host-resident KV: sparse (a selection, optional log-weights), dense, and the
/// LSE merge of partial states. Same conventions as the reference and CUDA paths: O [batch, q_heads,
/// head_dim] in the storage type, LSE [batch, q_heads] fp32 natural log; an empty row (no tokens, or every
/// logit -inf) gives O = 0 and LSE = -inf. NaN never vanishes (attention/state.hpp): a NaN or +inf logit
/// (from Q, K, a log-weight or sm_scale) gives NaN in O and LSE of that (sequence, head), a NaN in V a NaN
/// in O, at every SIMD level.
///
/// Sparse decode attends options.attention.window (sink and recent tokens, attention/options.hpp) besides the
/// selection, in the same pass; dense decode refuses a window. A selection row whose attend_all entry is
/// nonzero attends every token [0, seq_len) once instead (window included; its count, indices and
/// log-weights are not read, nor checked).
///
/// Selections: a row whose count is outside [0, capacity] (a primitive's -1, SelectionView::counts) attends
/// nothing and gets NaN in O and LSE of its every query head, as on CUDA; validation refuses it instead.
/// Indices are trusted unless options.validate_indices is set (checking every index costs a pass over the selection): an index outside
/// [0, seq_len), or inside the window, is then refused, and so is a duplicate in a row, naming the sequence, kv head, position and
/// value; nothing is written. Without validation an index out of range is undefined behaviour and a
/// duplicate is attended once per occurrence (k copies of a token weigh as one token with log-weight + log k). Storage kvsift::half (F16C) or kvsift::bfloat16 (AVX512_BF16 vdpbf16ps for QK where the CPU
/// has it), fp32 accumulation; any head_dim up to 256; any GQA group; contiguous or paged KV; no alignment
/// requirement. SIMD level chosen at run time (cpu/simd.hpp).
///
/// Threads: work is split over (sequence, kv head) rows on `pool` (nullptr: the calling thread); see
/// cpu/thread_pool.hpp for the contract when several engine threads call in. When there are fewer rows than
/// threads (batch 1 has kv_heads rows) and a workspace is given, each row is also cut into chunks of at least
/// 256 tokens that run on different threads, and their partial states are merged by LSE on the calling
/// thread (the CPU's split-K); without a workspace a row runs on one thread. Results are deterministic for a
/// given pool size; the chunking, and so the rounding, may change with it. Reentrant; besides the arguments
/// and the workspace, the only memory used is a fixed ~18 KB of stack per thread.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cpu {

/// Options of the CPU decode entry points (the CPU twin of cuda::DecodeOptions).
struct DecodeOptions {
  AttentionOptions attention{};
  /// Check every selection index (range and duplicates) before attending, and throw naming the first
  /// offending (sequence, kv head, position, value). Allocates a bitmap of the longest sequence's length.
  bool validate_indices = false;
};

/// Bytes of host workspace (256-byte aligned) that let sparse_decode and dense_decode split rows over all of
/// `pool`'s threads for this shape; 0 when there are enough rows or no pool.
std::size_t decode_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                   std::int32_t head_dim, const ThreadPool* pool);

/// `out` holds O in the storage type (TO = T) or in fp32 (TO = float): a partial state for a later
/// merge_states (GPU window ⊕ CPU offload, context shards), which then rounds once instead of twice.
template <class T, class KV, class TO>
void sparse_decode(const QueryView<const T>& q, const KV& kv, const SelectionView& selection, const StateView<TO>& out,
                   const DecodeOptions& options = {}, ThreadPool* pool = nullptr,
                   std::span<std::byte> workspace = {});

template <class T, class KV, class TO>
void dense_decode(const QueryView<const T>& q, const KV& kv, const StateView<TO>& out,
                  const DecodeOptions& options = {}, ThreadPool* pool = nullptr, std::span<std::byte> workspace = {});

/// Merges partial states (e.g. the GPU window's and the CPU offload's) into `out`, which must not alias a
/// partial. Empty partials (LSE = -inf) are skipped, so they change nothing bit for bit; a partial with
/// LSE = NaN makes that (sequence, head) of `out` NaN in O and LSE.
template <class TI, class TO>
void merge_states(std::span<const StateView<const TI>> partials, const StateView<TO>& out);

}  // namespace kvsift::cpu
