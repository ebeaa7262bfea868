#pragma once
/// CUDA top-K shared by every selector, the twin of cpu/topk.hpp: the same ranking rule (core/ranking.hpp:
/// higher score first, on equal scores the smaller index, NaN above every number) and identical results.
/// Device memory; caller-owned workspace (size from the matching *_workspace_bytes query); no allocation, no
/// host sync; stream-ordered; CUDA-graph capturable; reentrant (concurrent calls need distinct workspaces). topk_rows'
/// kernels are launched as programmatic dependents (PDL, sm_90: cuda/detail/launch.cuh programmatic_start): each
/// waits for the stream's previous kernel before touching memory, and lets the next one be scheduled early.
/// Deterministic: the chosen set is a function of the scores alone, and so is the output order (ascending).

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "kvsift/core/ranking.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda {

/// Bytes of device workspace (256-byte aligned) topk_rows needs for `score_rows` score rows of max_tokens =
/// scores.cols scores: none for heads_per_row = 1; for heads_per_row > 1 each score row's picks (4 * k bytes)
/// and, past 360,416 tokens, a bitmap of each selection row's middle (max_tokens / 8 bytes). Shapes
/// only (no device query); k and the options are checked as the run checks them.
std::size_t topk_rows_workspace_bytes(std::int64_t score_rows, std::int32_t max_tokens, std::int32_t k,
                                      const TopKRowsOptions& options);

/// cpu::topk_rows' twin, with identical results (index sets, order and counts): per selection row s = (b, g)
/// of `out`, the union of its heads_per_row score rows' min(k_s, middle) best tokens of the middle
/// [window.sink_end(len), window.recent_begin(len)), len = d_lengths[b], distinct and ascending, into
/// out.row(b, g) and its size into out.counts[s]; log-weights, if out has them, 0 for the written entries;
/// entries past the count are not written. See cpu/topk.hpp for the shapes.
///
/// Memory: scores, d_lengths [out.batch], options.row_k [out.batch * out.kv_heads], out and workspace on the
/// device. Checked before the launch as on the CPU (k > 0, heads_per_row >= 1, scores.rows == out.batch *
/// out.kv_heads * heads_per_row, out.capacity >= heads_per_row * k, window sizes >= 0, the workspace size).
/// Lengths and row_k live on the device, so they cannot be checked before the launch: a selection row whose
/// length lies outside [0, scores.cols] or whose row_k lies outside [0, k] gets count -1 and no indices
/// (the decode's validation mode refuses a count of -1, cuda/decode.hpp).
///
/// Launches: one for heads_per_row = 1 (a thread-block cluster of up to 16 CTAs per score row on sm_90, its
/// size chosen from the row count, max_tokens and the SM count, read once per device), two otherwise (the
/// union). docs/primitives.md has the algorithm and its timings.
void topk_rows(const MatrixView<const float>& scores, const std::int32_t* d_lengths, std::int32_t k,
               const TopKRowsOptions& options, const SelectionView& out, std::span<std::byte> workspace,
               cudaStream_t stream);

/// cpu::length_budgets' twin: row_k[b * heads + h] = budget(d_lengths[b]) (core/ranking.hpp LengthBudget), the
/// same checks before the launch. Device memory; one launch, no allocation, graph capturable.
void length_budgets(const std::int32_t* d_lengths, std::int32_t batch, std::int32_t heads, const LengthBudget& budget,
                    std::int32_t* d_row_k, cudaStream_t stream);

/// cpu::mass_budgets' twin, bit for bit (core/ranking.hpp MassBudget): row_k[r] from the first counts[r] scores
/// of row r. The same checks before the launch; counts and budget.limits live on the device, so a row whose
/// count lies outside [0, scores.cols] or whose limit lies outside [0, budget.maximum] gets row_k[r] = -1
/// (which topk_rows turns into count -1). One launch, one CTA per row (a radix select over the scores' bits
/// whose histograms count items and fixed-point units per digit; uint64 shared atomics, so the sums are exact
/// and order-independent), a programmatic dependent (PDL) like topk_rows'. Device memory; no allocation, no
/// host sync, graph capturable.
void mass_budgets(const MatrixView<const float>& scores, const std::int32_t* d_counts, const MassBudget& budget,
                  std::int32_t* d_row_k, cudaStream_t stream);

}  // namespace kvsift::cuda
