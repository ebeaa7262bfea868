#pragma once
/// The launchers of selectors/a2ats/cuda/vq.hpp (kernels/selectors/a2ats/vq.cu). They return the launch status and never throw; src/selectors/a2ats/cuda/vq.cpp
/// checks the arguments first.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

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

template <class T>
cudaError_t launch_vq_lut(const QueryView<const T>& q, const VqCodebook<T>& codebook, const MatrixView<float>& lut,
                          cudaStream_t stream);

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

/// The count select (vq_topk_rows where it applies): threads of its one CTA per selection row, and the most score
/// heads per selection row it takes (the group, or 1 with group_max).
inline constexpr int kVqCountSelectThreads = 1024;
inline constexpr std::int32_t kVqCountSelectMaxHeads = 8;
/// Selection rows (batch * kv_heads) from which the count select is taken: its one CTA per row walks the row's
/// codes alone (about 20 instructions a token), so a few rows leave the GPU idle. H200, A²ATS steps at 128K
/// (2026-11-30 09:1x): 8 rows (batch 1) 185 µs (union) and 135 (group max) against 159 and 87 with the held top-k
/// fed by the codes; 64 rows (batch 8) 341 and 199 against 833 and 330.
inline constexpr std::int64_t kVqCountSelectMinRows = 64;

/// The count select's static shared memory (its histograms and scan buffers, 10.3 KB), with margin.
inline constexpr std::size_t kVqCountSelectStaticSmem = 12 * 1024;

/// Dynamic shared memory of the count select: a count per codeword and a rank word per (head, codeword).
constexpr std::size_t vq_count_select_smem_bytes(std::int32_t codewords, std::int32_t heads) {
  return std::size_t(codewords) * sizeof(std::uint32_t) * (1 + std::size_t(heads));
}

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
};

/// One CTA per selection row; the caller has checked heads <= kVqCountSelectMaxHeads and the shared memory.
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
