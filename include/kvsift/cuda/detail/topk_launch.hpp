#pragma once
/// Params, launch shapes and launchers of the CUDA top-K (cuda/topk.hpp), for the host code in
/// src/cuda/topk.cpp. Kernels: kernels/topk_rows.cu (device code in detail/topk_kernels.cuh). Launchers return
/// the launch status and never throw.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

// ---- topk_rows: one cluster of CTAs per score row ---------------------------------------------------------

inline constexpr int kTopKRowsThreads = 1024;
/// A CTA's slice of a row is at least this many scores: fewer would spend more on cluster barriers than on
/// the scores themselves.
inline constexpr std::int32_t kTopKMinSliceWords = 2048;
/// Up to this many scores of a slice are loaded once into shared memory as rank words (176 KiB; less where
/// the GPU's opt-in shared memory per block is smaller, topk_rows_smem_limit_words); the rest of a longer
/// slice is re-read from global memory (L2) on each pass.
inline constexpr std::int32_t kTopKMaxSmemWords = 45056;
/// Shared memory the select kernel keeps for its static storage (BlockRadixSelect's 6.2 KiB and
/// LaneHistogramSelect's 34 KiB on sm_90), with margin.
inline constexpr std::int32_t kTopKStaticSmemBytes = 48 * 1024;
/// The union of heads_per_row > 1 rows: one CTA per selection row, a bitmap of the row's middle in shared
/// memory up to this many 32-bit words (44 KiB, under the 48 KiB without opt-in with the kernel's 0.2 KiB of
/// static storage: up to 360,416 tokens), in the workspace beyond.
inline constexpr int kTopKUnionThreads = 1024;
inline constexpr std::int32_t kTopKUnionSmemWords = 11264;

/// The largest slice in shared memory on a GPU with `max_smem_per_block` bytes of opt-in shared memory.
inline std::int32_t topk_rows_smem_limit_words(std::int64_t max_smem_per_block) {
  return std::int32_t(std::clamp<std::int64_t>((max_smem_per_block - kTopKStaticSmemBytes) / 4, 0, kTopKMaxSmemWords));
}

/// Dynamic shared memory of the select kernel for `words` cached rank words.
inline std::size_t topk_rows_select_smem_bytes(std::int32_t words) { return std::size_t(words) * sizeof(std::uint32_t); }

/// Largest cluster: 8 is portable; 16 needs the non-portable attribute and a GPU that can place such a
/// cluster (topk_rows_cluster_capacity).
inline constexpr std::int32_t kTopKMaxPortableCluster = 8;

/// [i]: how many clusters of 2^i select CTAs (largest shared-memory slice) the GPU holds at once, i = 1..4
/// (2 to 16 CTAs; [0] unused); 0 where it holds none of that size (no clusters before sm_90, no non-portable
/// size). Clusters live inside one GPC, so on the H100 (132 SMs) 32 clusters of 4 (32 score rows of 128K)
/// do not all fit at once: ncu shows a second wave (91 µs, the SMs active half the time). Still, 2 CTAs per
/// row in one wave, each reading a third of its 65,536 scores from L2 on every pass, measured slower (106
/// against 94 µs, H100, 2026-11-27), so plan_topk_rows requires all clusters at once only for 16.
using TopKClusterCapacity = std::array<int, 5>;

struct TopKRowsLaunch {
  std::int32_t cluster = 1;           ///< CTAs per score row, a power of two <= 16
  std::int32_t smem_words = 0;        ///< leading rank words of a CTA's slice in shared memory (the rest: L2)
  std::int32_t smem_limit_words = 0;  ///< the GPU's limit (the kernel's attribute, never lowered)
};

/// The launch shape: score rows (each a cluster of `cluster` CTAs) on `sms` SMs. The cluster grows (powers
/// of two) while the grid's CTAs are at most the SMs, the GPU has clusters of that size (16: holds all of
/// them at once; see TopKClusterCapacity), and each slice keeps kTopKMinSliceWords scores. Up to
/// smem_limit_words (topk_rows_smem_limit_words) of each slice go to shared memory.
inline TopKRowsLaunch plan_topk_rows(std::int64_t score_rows, std::int32_t max_tokens, int sms,
                                     const TopKClusterCapacity& capacity, std::int32_t smem_limit_words) {
  TopKRowsLaunch launch;
  launch.smem_limit_words = smem_limit_words;
  for (int log2 = 1; log2 < int(capacity.size()); ++log2) {
    const std::int32_t next = std::int32_t(1) << log2;
    const int held = capacity[std::size_t(log2)];
    const bool fits = (next <= kTopKMaxPortableCluster ? held > 0 : score_rows <= held) && score_rows * next <= sms &&
                      (max_tokens + next - 1) / next >= kTopKMinSliceWords;
    if (!fits) break;
    launch.cluster = next;
  }
  const std::int32_t slice = (max_tokens + launch.cluster - 1) / launch.cluster;
  launch.smem_words = std::min(slice, smem_limit_words);
  return launch;
}

/// Bitmap words of one selection row's middle in the union kernel: the middle [lo, hi) spans at most
/// ceil(max_tokens / 32) + 1 words.
inline std::int32_t topk_union_words(std::int32_t max_tokens) { return (max_tokens + 31) / 32 + 1; }

/// Everything one topk_rows launch reads and writes (device pointers).
struct TopKRowsParams {
  MatrixView<const float> scores;      ///< [selection rows * heads_per_row, max_tokens]
  const std::int32_t* lengths;         ///< [out.batch]
  const std::int32_t* row_k;           ///< [selection rows] or nullptr
  std::int32_t k;                      ///< k > 0
  AttentionWindow window;
  std::int32_t heads_per_row;
  bool nan_marks_row;                  ///< TopKRowsOptions::nan_marks_row (heads_per_row == 1)
  SelectionView out;
  std::int32_t* picks;                 ///< heads_per_row > 1: [score rows, k], each score row's picks
  std::uint32_t* union_bits;           ///< [selection rows, union_words] where the bitmap exceeds shared memory
  std::int32_t union_words;
  TopKRowsLaunch launch;
};

/// The current GPU's TopKClusterCapacity for the select kernel (cudaOccupancyMaxActiveClusters).
cudaError_t topk_rows_cluster_capacity(TopKClusterCapacity* capacity);

cudaError_t launch_topk_rows(const TopKRowsParams& params, cudaStream_t stream);

cudaError_t launch_length_budgets(const std::int32_t* lengths, std::int32_t batch, std::int32_t heads,
                                  const LengthBudget& budget, std::int32_t* row_k, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
