#pragma once
/// The CPU decode job and the per-ISA kernels' declarations; the kernels are defined in decode-inl.hpp and
/// instantiated only in src/cpu/kernels_<level>.cpp (so that baseline code never instantiates ISA code).

#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/attention/state.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu::detail {

inline constexpr int kMaxHeadDim = 256;
inline constexpr int kHeadTile = 8;
inline constexpr int kTokenBlock = 64;

/// Everything one decode call needs. Rows are (sequence, kv head) pairs, row = b * kv_heads + h; each row's
/// entries (its tokens; or its window's tokens, then its selection's) are cut into `splits` equal chunks, and
/// a work item is one chunk of one row, item = row * splits + chunk.
template <class T, class KV, class TO = T>
struct DecodeJob {
  QueryView<const T> q;
  KV kv;
  SelectionView selection;  ///< indices == nullptr: dense decode over every token
  StateView<TO> out;        ///< written directly when splits == 1; TO = T, or float for a later merge
  std::int32_t group = 1;
  float scale_log2 = 0.0f;  ///< sm_scale * log2(e)
  AttentionWindow window{};  ///< sparse decode: attended before each row's selected entries
  std::int32_t page_size = 1;  ///< sparse decode: tokens per selection entry (AttentionOptions::selection_page_size)
  const std::int32_t* selection_rows = nullptr;  ///< sparse decode: AttentionOptions::selection_rows, or nullptr
  std::int32_t splits = 1;
  float* partial_o = nullptr;    ///< splits > 1: [splits, batch, q_heads, head_dim], merged into out afterwards
  float* partial_lse = nullptr;  ///< splits > 1: [splits, batch, q_heads], natural log
};

inline constexpr std::int32_t kMaxDecodeSplits = 64;
/// A row is cut only into chunks of at least this many tokens: each chunk restarts the prefetch pipeline
/// and adds a partial state to merge.
inline constexpr std::int32_t kMinTokensPerSplit = 256;

/// Chunks per (sequence, kv head) row so that `rows` rows keep `threads` threads busy (src/cpu/decode.cpp):
/// 1 when there are at least as many rows as threads; otherwise the count that minimizes the busiest
/// thread's share of a row (parallel_for hands each thread a contiguous run of items), the smallest such
/// count on ties, capped so that a chunk of the longest row (in tokens) is at least kMinTokensPerSplit long.
std::int32_t decode_splits(std::int64_t rows, int threads,
                           std::int32_t longest_row = kMaxDecodeSplits * kMinTokensPerSplit);

/// Runs work items [item_begin, item_end) of the job at SIMD level L. use_bf16_dot selects vdpbf16ps
/// (avx512 only).
template <SimdLevel L, class T, class KV, class TO>
void decode_items(const DecodeJob<T, KV, TO>& job, std::int64_t item_begin, std::int64_t item_end, bool use_bf16_dot);

}  // namespace kvsift::cpu::detail
