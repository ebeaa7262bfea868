#pragma once
/// Codebook quantization, lookup tables and code scan on CUDA: selectors/a2ats/cpu/vq.hpp's twin, with the same arguments but the
/// context (the math and views: selectors/a2ats/vq.hpp). Device memory for every pointer (views, slots, lengths, positions,
/// workspace); no allocation, no host sync; stream-ordered and CUDA-graph capturable; deterministic (no atomics).
///
/// Results against the CPU: scans are copies of table entries, so equal tables give equal scores bit for bit;
/// tables and codes are fp32 math summed in another order (FMAs), so tables agree within fp32 rounding and codes
/// agree except where two codewords are within fp32 rounding of a tie.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/ranking.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/selectors/a2ats/vq.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

/// cpu::vq_codeword_norms's contract in device memory (one warp per codeword; fp32, another summation order).
void vq_codeword_norms(const MatrixView<const float>& centroids, float* d_norms, const Context& ctx);

/// 0: vq_encode keeps its scratch in shared memory. Checks the arguments as the CPU's query does; the context, for
/// the CPU's call shape, does not change the answer (nor vq_lut_scan_workspace_bytes').
std::size_t vq_encode_workspace_bytes(std::int32_t codewords, std::int32_t head_dim, const Context& = {});

/// cpu::vq_encode's contract (kernels/selectors/a2ats/vq_encode.cu), two kernels by the row count:
/// - up to 256 rows (an append): blocks of 8 rows of one kv head, each scoring a slice of the codewords in fp32
///   (the exact argmin), the slices of one (row group, kv head) a cluster of up to 8 blocks on sm_90 whose winners
///   merge through distributed shared memory in rank order (one block per (row group, kv head) elsewhere);
/// - more rows (a prefill): on tensor cores, one block per 256 rows and kv head: z = k L in fp32 into shared
///   memory, then bf16 mma.sync of z against 32-codeword tiles of C^z, each row's best bf16 scores kept in
///   registers; where another codeword's bf16 score is within the bf16 error bound of the leader's, the best four
///   are re-scored in fp32 and the best fp32 score wins (ties: smaller code).
/// codebook.centroids must be 16-byte aligned (refused otherwise). workspace may be empty; one launch.
template <class T>
void vq_encode(const HeadsView<const T>& keys, const VqEncodeCodebook& codebook, const VqCodesView<std::uint16_t>& codes,
               const VqCodeDestination& destination, std::span<std::byte> workspace, const Context& ctx);

/// cpu::vq_lut's contract: one thread per codeword of each (sequence, kv head), the group's queries in shared
/// memory. codebook.data must be 16-byte aligned; at most 64 query heads per kv head (both refused otherwise,
/// here and in vq_lut_scan).
template <class T>
void vq_lut(const QueryView<const T>& q, const VqCodebook<T>& codebook, const MatrixView<float>& lut, const Context& ctx);

/// cpu::vq_code_scan's contract, the tables read from global memory (L1/L2); the group maximum equals the CPU's
/// bit for bit from equal tables (one reduction, selectors/a2ats/vq.hpp vq_group_max, in head order).
void vq_code_scan(const MatrixView<const float>& lut, std::int32_t batch, const VqCodesView<const std::uint16_t>& codes,
                  const std::int32_t* d_slots, const std::int32_t* d_lengths, const MatrixView<float>& scores,
                  const VqScanOptions& options, const Context& ctx);

/// Bytes of device workspace vq_lut_scan needs: 0 when the group's tables and queries fit one block's shared
/// memory on this device (4 * group * (codewords + head_dim) bytes: 65 KB at group 4, 4096 codewords), else the
/// tables of every query head, 4 * batch * q_heads * codewords (the two-launch form).
std::size_t vq_lut_scan_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                        std::int32_t codewords, std::int32_t head_dim, const Context& = {});

/// cpu::vq_lut_scan's contract, the scores bit for bit those of vq_lut then vq_code_scan on this device. One
/// launch where the group's tables fit shared memory: on sm_90 a cluster of 8 blocks builds the tables of one
/// (sequence, kv head), an eighth each, and every block copies the others' through distributed shared memory; then
/// the blocks of the (sequence, kv head) split its tokens, each code read once for the group's heads. Elsewhere
/// (sm_80) each block builds the whole tables. Otherwise vq_lut into the workspace, then vq_code_scan.
template <class T>
void vq_lut_scan(const QueryView<const T>& q, const VqCodebook<T>& codebook, const VqCodesView<const std::uint16_t>& codes,
                 const std::int32_t* d_slots, const std::int32_t* d_lengths, const MatrixView<float>& scores,
                 const VqScanOptions& options, std::span<std::byte> workspace, const Context& ctx);

/// Bytes of device workspace vq_topk_rows needs: cpu::vq_topk_rows_workspace_bytes' layout on this device (the
/// score matrix, vq_lut_scan's and topk_rows' scratch), then the query heads' lookup tables (4 * batch * q_heads *
/// codewords bytes) of the fused form.
std::size_t vq_topk_rows_workspace_bytes(const VqTopKShape& shape, const Context& ctx = {});

/// cpu::vq_topk_rows' contract, in one of three forms, each selecting the same tokens (equal tables: one device
/// function computes them) but for the note below:
/// - the count select, where there are at least 64 selection rows (batch * kv_heads: it takes one CTA per row) and a
///   selection row has at most 8 score rows (the group, or 1 with scan.group_max), its
///   counts and classes (codewords * (4 + score rows) bytes) fit a block's shared memory and options has no
///   nan_marks_row or seed: vq_lut into the workspace's tables, then one CTA per selection row counts the middle's
///   tokens per code, finds each score row's threshold by a radix select over the codewords weighted by their counts
///   (a row's scores are table entries: at most `codewords` distinct values), and writes the union of the rows'
///   picks in one pass over the codes (2 launches, no score matrix, no union launch);
/// - else, where topk_rows plans its one-CTA or held kernel and the codebook has at most 16384 codewords: vq_lut,
///   then that kernel computes each score row's words from the codes and the row's table in shared memory (the
///   union kernel follows with heads_per_row > 1);
/// - else vq_lut_scan into the workspace's scores, then topk_rows.
/// The first two rank a token at or past min(codes.max_tokens, shape.max_tokens) as NaN where the composed form
/// would read a score it never wrote.
template <class T>
void vq_topk_rows(const QueryView<const T>& q, const VqCodebook<T>& codebook, const VqCodesView<const std::uint16_t>& codes,
                  const std::int32_t* d_slots, const std::int32_t* d_lengths, const VqTopKShape& shape,
                  const TopKRowsOptions& options, const SelectionView& out, std::span<std::byte> workspace,
                  const Context& ctx);

}  // namespace kvsift::cuda
