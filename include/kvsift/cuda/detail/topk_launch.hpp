#pragma once
/// Params, launch shapes and launchers of the CUDA top-K (cuda/topk.hpp), for the host code in
/// src/cuda/topk.cpp. Kernels: kernels/topk_rows.cu (device code in detail/topk_kernels.cuh) and
/// kernels/topk.cu (the CUB sort). Launchers return the launch status and never throw.

#include <cuda_runtime_api.h>

#include <algorithm>
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
/// Slices up to this many scores are loaded once into shared memory as rank words (128 KiB; less where the
/// GPU's opt-in shared memory per block is smaller, topk_rows_smem_limit_words); longer ones are re-read from
/// global memory (L2) on each pass.
inline constexpr std::int32_t kTopKMaxSmemWords = 32768;
/// Shared memory the select kernel keeps for its static TempStorage (6.2 KiB on sm_90), with margin.
inline constexpr std::int32_t kTopKStaticSmemBytes = 8192;
/// The union of heads_per_row > 1 rows: one CTA per selection row, a bitmap of the row's middle in shared
/// memory up to this many 32-bit words (44 KiB, under the 48 KiB without opt-in with the kernel's 2.2 KiB of
/// static storage: up to 360,416 tokens), in the workspace beyond.
inline constexpr int kTopKUnionThreads = 512;
inline constexpr std::int32_t kTopKUnionSmemWords = 11264;

/// The largest slice in shared memory on a GPU with `max_smem_per_block` bytes of opt-in shared memory.
inline std::int32_t topk_rows_smem_limit_words(std::int64_t max_smem_per_block) {
  return std::int32_t(std::clamp<std::int64_t>((max_smem_per_block - kTopKStaticSmemBytes) / 4, 0, kTopKMaxSmemWords));
}

/// Largest cluster: 8 is portable; 16 needs the non-portable attribute and a GPU that can place such a
/// cluster (topk_rows_cluster_limits).
inline constexpr std::int32_t kTopKMaxPortableCluster = 8;

struct TopKRowsLaunch {
  std::int32_t cluster = 1;           ///< CTAs per score row, a power of two <= 16
  std::int32_t smem_words = 0;        ///< rank words of a CTA's slice in shared memory; 0: the slices are re-read
  std::int32_t smem_limit_words = 0;  ///< the GPU's limit (the kernel's attribute, never lowered)
};

/// The launch shape: score rows (each a cluster of `cluster` CTAs) on `sms` SMs. The cluster grows (powers
/// of two) while the grid still fits the GPU in one wave, each slice keeps kTopKMinSliceWords scores, and
/// the GPU can hold the clusters at once: up to 8, and 16 where `clusters16` (how many 16-CTA clusters the
/// GPU holds at once, 0 where it holds none or the GPU has no clusters) is at least the row count.
/// `max_cluster` is 1 on GPUs without thread-block clusters (before sm_90). A slice goes to shared memory
/// where it fits in smem_limit_words (topk_rows_smem_limit_words).
inline TopKRowsLaunch plan_topk_rows(std::int64_t score_rows, std::int32_t max_tokens, int sms, int max_cluster,
                                     int clusters16, std::int32_t smem_limit_words) {
  TopKRowsLaunch launch;
  launch.smem_limit_words = smem_limit_words;
  while (true) {
    const std::int32_t next = launch.cluster * 2;
    const bool fits = next <= max_cluster && (next <= kTopKMaxPortableCluster || score_rows <= clusters16) &&
                      score_rows * next <= sms && (max_tokens + next - 1) / next >= kTopKMinSliceWords;
    if (!fits) break;
    launch.cluster = next;
  }
  const std::int32_t slice = (max_tokens + launch.cluster - 1) / launch.cluster;
  launch.smem_words = slice <= smem_limit_words ? slice : 0;
  return launch;
}

/// Bitmap words of one selection row's middle in the union kernel: the middle [lo, hi) spans at most
/// ceil(max_tokens / 32) + 1 words.
inline std::int32_t topk_union_words(std::int32_t max_tokens) { return (max_tokens + 31) / 32 + 1; }

/// Everything one topk_rows launch reads and writes (device pointers).
struct TopKRowsParams {
  MatrixView<const float> scores;      ///< [selection rows * heads_per_row, max_tokens]
  const std::int32_t* lengths;         ///< [out.batch]; nullptr: every row is scores.cols long
  const std::int32_t* row_k;           ///< [selection rows] or nullptr
  std::int32_t k;                      ///< k >= 0
  AttentionWindow window;
  std::int32_t heads_per_row;
  SelectionView out;                   ///< counts may be null (cuda::topk: every row has k)
  std::int32_t* picks;                 ///< heads_per_row > 1: [score rows, k], each score row's picks
  std::int32_t* pick_counts;           ///< heads_per_row > 1: [score rows]
  std::uint32_t* union_bits;           ///< [selection rows, union_words] where the bitmap exceeds shared memory
  std::int32_t union_words;
  TopKRowsLaunch launch;
};

/// The current GPU's cluster limits for the select kernel: max_cluster is 1 without thread-block clusters
/// (before sm_90), else 16 where the non-portable size is allowed, else 8; clusters16 is how many 16-CTA
/// clusters it holds at once with the largest shared-memory slice (0 where max_cluster < 16).
cudaError_t topk_rows_cluster_limits(int* max_cluster, int* clusters16);

cudaError_t launch_topk_rows(const TopKRowsParams& params, cudaStream_t stream);

cudaError_t launch_length_budgets(const std::int32_t* lengths, std::int32_t batch, std::int32_t heads,
                                  const LengthBudget& budget, std::int32_t* row_k, cudaStream_t stream);

// ---- top-K by two CUB radix sorts of (row, score) keys -------------------------------------------------

/// Sizes of the two CUB radix sorts (temporary storage only).
cudaError_t topk_sort_cub_bytes(std::int64_t rows, std::int32_t n, std::int32_t k, std::size_t* first_sort,
                                std::size_t* second_sort);

struct TopKSortBuffers {
  unsigned long long* keys_in;
  unsigned long long* keys_out;
  std::int32_t* values_in;
  std::int32_t* values_out;
  unsigned long long* chosen_in;
  unsigned long long* chosen_out;
  void* cub_temp;
  std::size_t cub_temp_bytes;
};

cudaError_t launch_topk_sort(const MatrixView<const float>& scores, std::int32_t k, std::int32_t* indices,
                             const TopKSortBuffers& buffers, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
