#pragma once
/// Reranking candidates on CUDA: cpu/rerank.hpp's twins, with the same arguments but the stream. Device memory;
/// no allocation, no host sync; stream-ordered and CUDA-graph capturable. Scores agree with the CPU's within
/// fp32 rounding; the remap is exact.
/// Trusted on the device (checked on the CPU): counts, candidate ids, positions. candidate_scores writes NaN over
/// a row whose count is outside [0, capacity] and a NaN logit for a candidate outside [0, seq_len) (its key is not
/// read); remap_selection gives a row with a bad count or position count -1 (the selection's mark of a bad row).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda {

/// Bytes of device workspace: the group's logits of every row, 4 * rows * group * capacity bytes, and each head's
/// softmax statistics.
std::size_t candidate_scores_workspace_bytes(std::int64_t rows, std::int32_t group, std::int32_t capacity);

/// cpu::candidate_scores' contract, in device memory. Two launches over (row, chunk of 256 candidates): the logits
/// (on tensor cores for 16-bit keys of 64, 128 or 256 channels, on CUDA cores otherwise) with, under the softmax,
/// each chunk's per-head maximum and sum; then the reduced scores (each head's LSE from its chunks' partials first).
/// The logits' fp32 sums run in another order than the CPU's: scores agree within fp32 rounding, not bit for bit.
template <class T, class KV>
void candidate_scores(const QueryView<const T>& q, const KV& kv, const SelectionView& candidates,
                      const GroupScoreOptions& options, const MatrixView<float>& scores, std::span<std::byte> workspace,
                      cudaStream_t stream);

/// cpu::remap_selection's contract, in device memory (out may be positions). A block per row.
void remap_selection(const SelectionView& positions, const SelectionView& ids, const SelectionView& out,
                     cudaStream_t stream);

/// cpu::append_range's contract, in device memory; a row with a bad count, or that would pass its capacity, gets
/// count -1 (its counts_before entry: the count as it came in). A block per row.
void append_range(const SelectionView& rows, const std::int32_t* d_slots, const std::int32_t* d_first,
                  const std::int32_t* d_lengths, const AttentionWindow& window, std::int32_t* d_counts_before,
                  cudaStream_t stream);

}  // namespace kvsift::cuda
