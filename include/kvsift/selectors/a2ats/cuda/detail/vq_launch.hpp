#pragma once
/// The launchers of selectors/a2ats/cuda/vq.hpp (kernels/selectors/a2ats/vq.cu). They return the launch status and never throw; src/selectors/a2ats/cuda/vq.cpp
/// checks the arguments first.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/views.hpp"
#include "kvsift/cuda/detail/topk_launch.hpp"
#include "kvsift/selectors/a2ats/vq.hpp"

namespace kvsift::cuda::detail {

/// Query heads per kv head that the lookup-table kernels take (their queries sit in shared memory).
inline constexpr std::int32_t kVqMaxGroup = 64;

/// Shared memory of the fused lut + scan block: the group's tables and queries, fp32.
constexpr std::size_t vq_fused_smem_bytes(std::int32_t group, std::int32_t codewords, std::int32_t head_dim) {
  return sizeof(float) * std::size_t(group) * (std::size_t(codewords) + std::size_t(head_dim));
}

/// Blocks per (sequence, kv head) of a scan, split over its tokens (a multiple of `cluster`), and the cluster size
/// of the fused form (8 on sm_90, else 1), chosen on the host (src/selectors/a2ats/cuda/vq.cpp) from the device's limits.
struct VqScanGrid {
  std::int32_t parts = 1;
  std::int32_t cluster = 1;
};

cudaError_t launch_vq_codeword_norms(const MatrixView<const float>& centroids, float* norms, cudaStream_t stream);

/// The group tables of every (sequence, kv head), one programmatic launch; it also zeroes `zeroed` (32-bit words:
/// the count select's scratch, which the next launch of vq_topk_rows reads, so that it needs no memset node of its
/// own between the two kernels).
template <class T>
cudaError_t launch_vq_lut(const QueryView<const T>& q, const VqCodebook<T>& codebook, const MatrixView<float>& lut,
                          std::span<std::uint32_t> zeroed, cudaStream_t stream);

cudaError_t launch_vq_code_scan(const MatrixView<const float>& lut, std::int32_t batch,
                                const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots,
                                const std::int32_t* lengths, const MatrixView<float>& scores,
                                const VqScanOptions& options, const VqScanGrid& grid, cudaStream_t stream);

/// The one-launch form; the caller has checked that vq_fused_smem_bytes fits the device's block.
template <class T>
cudaError_t launch_vq_lut_scan(const QueryView<const T>& q, const VqCodebook<T>& codebook,
                               const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots,
                               const std::int32_t* lengths, const MatrixView<float>& scores,
                               const VqScanOptions& options, const VqScanGrid& grid, cudaStream_t stream);

/// Codewords at most of the fused top-k's table (4 bytes each, in the top-k kernel's shared memory beside its own).
inline constexpr std::int32_t kVqTopKMaxCodewords = 16384;

/// What the fused top-k of vq_topk_rows reads in place of scores: vq_lut's tables [batch * q_heads, codewords] and
/// the scan's codes, slots and lengths (device pointers).
struct VqTopKWords {
  const float* tables;
  VqCodesView<const std::uint16_t> codes;
  const std::int32_t* slots;
  const std::int32_t* lengths;
  std::int32_t codewords, group;
  bool group_max;
};

/// The planned one-CTA or held top-k kernel (p.launch; topk_rows_takes_words) with words from `words`, then the
/// union kernel of p.heads_per_row > 1.
cudaError_t launch_vq_topk_rows(const TopKRowsParams& p, const VqTopKWords& words, cudaStream_t stream);

/// The count select (vq_topk_rows where it applies; kernels/selectors/a2ats/vq.cu) in one of two forms: a CTA per
/// selection row (kVqCountRowThreads threads), or each row's middle in slices of about kVqCountSliceTokens tokens (at
/// most kVqCountMaxSlices), a CTA per (row, slice) of kVqCountSliceThreads threads counting and emitting, a CTA per
/// (row, head) of kVqCountRowThreads finding thresholds. Both take up to kVqCountSelectMaxHeads score rows per
/// selection row (the group, or 1 with group_max).
inline constexpr std::int32_t kVqCountSliceTokens = 8192;
inline constexpr std::int32_t kVqCountMaxSlices = 256;
inline constexpr std::int32_t kVqCountSelectMaxHeads = 8;
inline constexpr int kVqCountRowThreads = 1024;
inline constexpr int kVqCountSliceThreads = 512;
/// Consecutive tokens a thread decides per pass of a walk (two 16-byte code loads): a pass's picks are a 16-bit mask
/// per thread.
inline constexpr int kVqCountPassTokens = 16;

/// Where each form takes the call (cuda/vq.cpp). A CTA per row walks the row alone (about 20 instructions a token), so
/// it needs rows enough to fill the GPU; the split form spreads a row over its slices but pays a memset, three
/// launches and two look-backs, so it needs CTAs enough. H200, A²ATS steps (2026-11-30 11:5x-12:0x, union / group
/// max; docs/experiments.md#a2ats-count-select-split):
/// - 64 rows (batch 8), 128K: a CTA per row 339 / 202 µs, the split 376 / 223; 32K 175 / 130 against 187 / 139;
/// - 8 rows (batch 1) x 16 slices (128K): the split 111 / 88 µs against 159 / 89 with topk_rows' kernels fed by the
///   codes; 512K 210 / 132 against 699 / 226; 1M 338 / 184 against 1475 / 387; 16 rows x 8 slices (batch 2, 64K)
///   116 / 97 against 198 / 89; 32 rows x 8 slices (batch 4, 64K) 162 / 119 against 283 / 202;
/// - 8 rows x 4 slices (batch 1, 32K): the split 96 / 80 µs against 84 / 71; 8K 87 / 76 against 66 / 62.
inline constexpr std::int64_t kVqCountSelectMinRows = 64;
inline constexpr std::int64_t kVqCountSplitMinCtas = 128;

/// Slices per selection row of rows of max_tokens tokens.
constexpr std::int32_t vq_count_slices(std::int32_t max_tokens) {
  const std::int32_t slices = (max_tokens + kVqCountSliceTokens - 1) / kVqCountSliceTokens;
  return slices < 1 ? 1 : slices > kVqCountMaxSlices ? kVqCountMaxSlices : slices;
}

/// The count select's kernels' static shared memory (the CTA per row's: a histogram per head, 8 KB, and scan
/// buffers, 2 KB), with margin.
inline constexpr std::size_t kVqCountSelectStaticSmem = 12 * 1024;

/// Dynamic shared memory of the CTA per row: a count per code (the codewords, then NaN) and each head's rank word
/// per code.
constexpr std::size_t vq_count_row_smem_bytes(std::int32_t codewords, std::int32_t heads) {
  return sizeof(std::uint32_t) * (std::size_t(codewords) + 1) * (1 + std::size_t(heads));
}

/// Dynamic shared memory of the split form's thresholds kernel: a count and its head's rank word per code.
constexpr std::size_t vq_count_thresholds_smem_bytes(std::int32_t codewords) {
  return vq_count_row_smem_bytes(codewords, 1);
}

/// Dynamic shared memory of the split form's picks kernel: each code's classes, and the picks of each of its
/// slice's passes (a 16-bit mask per thread and pass), kept from the walk that counts them to the one that writes
/// them. A slice holds at most ceil(max_tokens / slices) tokens rounded up to 8.
constexpr std::size_t vq_count_picks_smem_bytes(std::int32_t codewords, std::int32_t max_tokens, std::int32_t slices) {
  const std::size_t slice_tokens = ((std::size_t(max_tokens) + slices - 1) / slices + 7) / 8 * 8;
  const std::size_t pass_tokens = std::size_t(kVqCountSliceThreads) * kVqCountPassTokens;
  const std::size_t passes = (slice_tokens + pass_tokens - 1) / pass_tokens;
  return sizeof(std::uint32_t) * (std::size_t(codewords) + 1) + sizeof(std::uint16_t) * kVqCountSliceThreads * passes;
}

/// The split form's device scratch (in vq_topk_rows' workspace; rows = batch * kv_heads, S = slices). The first
/// zeroed_words from `counts` (counts, classes, the published values, the row states) are zeroed in every call by the
/// launch of the tables before it (launch_vq_lut's `zeroed`).
struct VqCountSelectScratch {
  std::uint32_t* counts;          ///< [rows, codewords + 1]: the row's tokens per code, NaN tokens last
  std::uint32_t* classes;         ///< [rows, codewords + 1]: each code's class per head (2 bits a head), NaN's last
  std::uint32_t* published_tied;  ///< [rows, S, kVqCountSelectMaxHeads]: 1 + the slice's tied tokens of each head
  std::uint32_t* published;       ///< [rows, S]: 1 + the slice's picks once known, 0 before
  std::uint32_t* row_state;       ///< [rows, 2]: the row finished by the thresholds kernel (1) or not; the slice ticket
  std::size_t zeroed_words;
  std::uint32_t* quota;           ///< [rows, kVqCountSelectMaxHeads]: each head's tied tokens to take
};

/// Everything the count select reads and writes (device pointers): the words' source, topk_rows' budget, window
/// and output, max_tokens (the score rows' length: a longer sequence gets count -1, as from topk_rows).
struct VqCountSelectParams {
  VqTopKWords words;
  const std::int32_t* row_k;  ///< [rows] or nullptr
  std::int32_t k;
  AttentionWindow window;
  std::int32_t max_tokens;
  SelectionView out;
  std::int64_t rows;  ///< selection rows: batch * kv_heads
  bool nan_marks_row;  ///< TopKRowsOptions::nan_marks_row (one score row per selection row)
  std::int32_t slices;  ///< 0: a CTA per row; else the split form's slices per row (vq_count_slices(max_tokens))
  VqCountSelectScratch scratch;  ///< the split form's
};

/// A CTA per row (p.slices 0), or a memset and three launches: the slices' counts, each (row, head)'s threshold, the
/// slices' picks. The caller has checked heads <= kVqCountSelectMaxHeads and the form's shared memory.
cudaError_t launch_vq_count_select(const VqCountSelectParams& p, cudaStream_t stream);

/// fn.template operator()<D>() for D = head_dim, one of kVqHeadDims (the host refuses any other first); an
/// unsupported head_dim returns cudaErrorInvalidValue. The one head_dim dispatch of the VQ launchers.
template <class F>
cudaError_t with_vq_head_dim(std::int32_t head_dim, F&& fn) {
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_value<kVqHeadDims>(head_dim, [&]<int D>() { status = fn.template operator()<D>(); });
  return status;
}

}  // namespace kvsift::cuda::detail
