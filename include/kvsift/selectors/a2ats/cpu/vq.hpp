#pragma once
/// Codebook quantization, lookup tables and code scan on the CPU (A²ATS's primitives; the math and the views
/// are in selectors/a2ats/vq.hpp). The twin of selectors/a2ats/cuda/vq.hpp, with the same arguments but the context. Host memory; no
/// allocation; results independent of the thread count.
///
/// A decode step of A²ATS: vq_topk_rows selects from the codes what topk_rows (cpu/topk.hpp) would select from the
/// approximate scores vq_lut_scan (or vq_lut, then vq_code_scan) writes per query head. Prefill and append:
/// vq_encode.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/ranking.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/selectors/a2ats/vq.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// norms[i] = |centroids.row(i)|^2, summed in fp32 in ascending column order: the codebook's norms
/// (VqEncodeCodebook::norms), computed once when the codebooks load; centroids [kv_heads * codewords, head_dim].
void vq_codeword_norms(const MatrixView<const float>& centroids, float* norms, const Context& ctx = {});

/// Bytes of host workspace (256-byte aligned) vq_encode needs: one kv head's codebook packed for blocked scoring
/// (4 * codewords rounded up to 32 * head_dim, plus the offsets) and, per thread of ctx.pool, a block of 64
/// transformed keys (4 * 64 * (head_dim + 1)). A run on a larger pool is refused.
std::size_t vq_encode_workspace_bytes(std::int32_t codewords, std::int32_t head_dim, const Context& ctx);

/// Codes of keys [rows, kv_heads, head_dim] (half, bfloat16 or float; any strides): for every row r and kv head
/// h, z = k L (fp32, once per row) and the code argmin_c |C^z_c|^2 - 2 z . C^z_c (ties: the smaller c), written
/// to codes.row(slot_r, h)[position_r] as `destination` says (selectors/a2ats/vq.hpp; rows it places outside `codes` are
/// skipped). fp32 math: codes equal the exact argmin except where two codewords are within fp32 rounding of a
/// tie. Refused: head_dim other than 64 or 128, codewords outside [1, 65536], shapes that disagree, a workspace
/// smaller than vq_encode_workspace_bytes(codewords, head_dim, ctx). Threads: rows on ctx.pool.
template <class T>
void vq_encode(const HeadsView<const T>& keys, const VqEncodeCodebook& codebook, const VqCodesView<std::uint16_t>& codes,
               const VqCodeDestination& destination, std::span<std::byte> workspace, const Context& ctx = {});

/// Lookup tables: lut.row(b * q_heads + h)[c] = q[b, h] . C[h / group, c] in fp32 (the SIMD GEMV of group_scores),
/// group = q.heads / codebook.kv_heads. q [batch, q_heads, head_dim]; lut [batch * q_heads, codewords].
template <class T>
void vq_lut(const QueryView<const T>& q, const VqCodebook<T>& codebook, const MatrixView<float>& lut,
            const Context& ctx = {});

/// The scan: with q_heads = lut.rows / batch and group = q_heads / codes.kv_heads, for every batch row b, query
/// head h and token t < n_b = min(lengths[b], scores.cols, codes.max_tokens) (0 if negative):
///   scores.row(b * q_heads + h)[t] = lut.row(b * q_heads + h)[codes.row(slots[b], h / group)[t]],
/// NaN where the code is >= lut.cols or slots[b] is outside [0, codes.slots). Nothing is written at t >= n_b.
/// With options.group_max (selectors/a2ats/vq.hpp) scores has batch * kv_heads rows instead: row b * kv_heads + g holds
/// max over u < group of lut.row(b * q_heads + g * group + u)[code] (selectors/a2ats/vq.hpp vq_group_max, in head order).
/// Each code is read once per group. slots and lengths [batch]. AVX-512 gathers where the CPU has them, for the
/// per-head scan (a copy: every level writes the same bits); the group maximum reads the tables with scalar loads.
void vq_code_scan(const MatrixView<const float>& lut, std::int32_t batch, const VqCodesView<const std::uint16_t>& codes,
                  const std::int32_t* slots, const std::int32_t* lengths, const MatrixView<float>& scores,
                  const VqScanOptions& options, const Context& ctx = {});

/// Bytes of host workspace vq_lut_scan needs: per thread of ctx.pool (at most batch * kv_heads of them) the
/// lookup tables of one group, 4 * (q_heads / kv_heads) * codewords bytes. head_dim is checked, not used (the
/// CUDA twin's query takes the same arguments).
std::size_t vq_lut_scan_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                        std::int32_t codewords, std::int32_t head_dim, const Context& ctx);

/// vq_lut then vq_code_scan, one (sequence, kv head) at a time with the group's tables in the workspace: the same
/// scores, bit for bit, without the [batch * q_heads, codewords] table in memory. scores [q.batch * q.heads,
/// cols] ([q.batch * kv_heads, cols] with options.group_max); codes.kv_heads == codebook.kv_heads; slots and
/// lengths [q.batch]. The workspace does not depend on the options.
template <class T>
void vq_lut_scan(const QueryView<const T>& q, const VqCodebook<T>& codebook, const VqCodesView<const std::uint16_t>& codes,
                 const std::int32_t* slots, const std::int32_t* lengths, const MatrixView<float>& scores,
                 const VqScanOptions& options, std::span<std::byte> workspace, const Context& ctx = {});

/// Bytes of host workspace (256-byte aligned) vq_topk_rows needs: per thread of ctx.pool (at most batch * kv_heads
/// of them) the group's tables and words (8 * group * codewords bytes), the tokens per code (4 * codewords), a
/// radix pass's histogram (1 KB) and 12 * group bytes of thresholds. Checked as the run checks the shapes.
std::size_t vq_topk_rows_workspace_bytes(const VqTopKShape& shape, const Context& ctx);

/// A²ATS's selection from the codes: what topk_rows(scores, lengths, shape.k, options, out) (cpu/topk.hpp) selects
/// from vq_lut_scan's scores (shape.scan.group_max: one score row per kv head, else one per query head and their
/// union), without the scores: a row's scores are entries of its table, so per selection row the middle's tokens
/// are counted per code, each score row's threshold and quota of tied tokens found by radix passes over its
/// codewords' words weighted by their counts, and the middle walked once in index order (a token at or past min(codes.max_tokens,
/// shape.max_tokens) ranks as NaN, where the composed form would read a score it never wrote). The same checks and
/// refusals as topk_rows (a length past shape.max_tokens, a row_k past shape.k), and options.heads_per_row must be 1
/// with scan.group_max, else q.heads / codebook.kv_heads; shape's batch, heads, codewords and head_dim must be the
/// arguments'. Threads: selection rows on ctx.pool. The CUDA twin selects the same tokens from its own tables.
template <class T>
void vq_topk_rows(const QueryView<const T>& q, const VqCodebook<T>& codebook, const VqCodesView<const std::uint16_t>& codes,
                  const std::int32_t* slots, const std::int32_t* lengths, const VqTopKShape& shape,
                  const TopKRowsOptions& options, const SelectionView& out, std::span<std::byte> workspace,
                  const Context& ctx = {});

}  // namespace kvsift::cpu
