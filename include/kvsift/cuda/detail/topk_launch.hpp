#pragma once
/// Params, launch shapes and launchers of the CUDA top-K (cuda/topk.hpp), for the host code in
/// src/cuda/topk.cpp. Kernels: kernels/topk_rows.cu (device code in detail/topk_kernels.cuh, detail/topk_held_kernels.cuh
/// and detail/topk_mass_kernels.cuh). Launchers return
/// the launch status and never throw.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

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

/// The held kernel's CTA shapes (detail/topk_held_kernels.cuh): threads x rank words each holds in registers,
/// smallest first. TopKRowsLaunch::held = i + 1 names kTopKHeldShapes[i].
struct TopKHeldShape {
  int threads, items;
};
inline constexpr std::array<TopKHeldShape, 3> kTopKHeldShapes{{{512, 4}, {1024, 8}, {1024, 16}}};

/// Rank-word units below a seed's word (TopKRowsOptions::seed) that a seeded row of the held kernel still counts as
/// candidates: 2^-5 of a number's magnitude, ~3%.
inline constexpr std::uint32_t kSeedSlack = 1u << 18;

/// The one-CTA kernel's shapes (detail/topk_cta_kernels.cuh), smallest first: TopKRowsLaunch::cta = i + 1 names
/// kTopKCtaShapes[i].
inline constexpr std::array<TopKHeldShape, 2> kTopKCtaShapes{{{1024, 8}, {1024, 16}}};

struct TopKRowsLaunch {
  std::int32_t cluster = 1;           ///< CTAs per score row, a power of two <= 16
  std::int32_t cta = 0;               ///< i > 0: the one-CTA kernel of kTopKCtaShapes[i - 1] (cluster 1, held 0)
  std::int32_t held = 0;              ///< 0: the slice kernel; i > 0: the held kernel of kTopKHeldShapes[i - 1]
  std::int32_t smem_words = 0;        ///< slice kernel: leading rank words of a CTA's slice in shared memory
  std::int32_t smem_limit_words = 0;  ///< the GPU's limit (the slice kernel's attribute, never lowered)
};

/// Whether the GPU places clusters of 2^log2 CTAs for `score_rows` rows (see TopKClusterCapacity: portable sizes
/// where it holds any, 16 where it holds them all at once).
inline bool topk_clusters_placed(int log2, std::int64_t score_rows, const TopKClusterCapacity& capacity) {
  if (log2 == 0) return true;
  const int held = capacity[std::size_t(log2)];
  return (std::int32_t(1) << log2) <= kTopKMaxPortableCluster ? held > 0 : score_rows <= held;
}

/// Rows longer than this may take the held kernel in up to twice the SMs' CTAs (plan_topk_rows). H200, 2026-11-29:
/// 32 rows of 131072 in clusters of 8 took 74.0 us against the slice kernel's 92.5; 32 rows of 32768 in clusters of
/// 4 made A²ATS's step 7 us slower, and 64 rows of 131072 gained nothing (80.2 against 80.3; 86.7 in four waves).
inline constexpr std::int32_t kTopKHeldLongRow = 65536;

/// The launch shape: score rows on `sms` SMs. The one-CTA kernel where a row fits one CTA's registers and the rows
/// are at most the SMs (the smallest shape of kTopKCtaShapes that holds max_tokens words). Else the held kernel where
/// a row fits a cluster's registers: the smallest CTA shape of kTopKHeldShapes whose cluster (a power of two of at
/// most 16 the GPU places) holds max_tokens words, with at most half the SMs busy, or twice the SMs for rows longer
/// than kTopKHeldLongRow (measured faster than the slice kernel at 1 and 8 rows of 131072 and 8 rows of 8192). Else
/// the slice kernel: the cluster grows (powers of two) while the grid's CTAs are at most the SMs, the GPU places
/// clusters of that size, and each slice keeps kTopKMinSliceWords scores; up to smem_limit_words
/// (topk_rows_smem_limit_words) of each slice go to shared memory.
inline TopKRowsLaunch plan_topk_rows(std::int64_t score_rows, std::int32_t max_tokens, int sms,
                                     const TopKClusterCapacity& capacity, std::int32_t smem_limit_words) {
  TopKRowsLaunch launch;
  launch.smem_limit_words = smem_limit_words;
  for (std::size_t i = 0; i < kTopKCtaShapes.size() && score_rows <= sms; ++i) {
    if (std::int64_t(kTopKCtaShapes[i].threads) * kTopKCtaShapes[i].items >= max_tokens) {
      launch.cta = std::int32_t(i) + 1;
      return launch;
    }
  }
  const std::int64_t held_ctas = max_tokens > kTopKHeldLongRow ? 2 * std::int64_t(sms) : sms / 2;
  for (std::size_t i = 0; i < kTopKHeldShapes.size(); ++i) {
    const std::int64_t tile = std::int64_t(kTopKHeldShapes[i].threads) * kTopKHeldShapes[i].items;
    int log2 = 0;
    while (log2 < 4 && (tile << log2) < max_tokens) ++log2;
    if ((tile << log2) < max_tokens || !topk_clusters_placed(log2, score_rows, capacity) ||
        score_rows * (std::int64_t(1) << log2) > held_ctas) {
      continue;
    }
    launch.cluster = std::int32_t(1) << log2;
    launch.held = std::int32_t(i) + 1;
    return launch;
  }
  for (int log2 = 1; log2 < int(capacity.size()); ++log2) {
    const std::int32_t next = std::int32_t(1) << log2;
    const bool fits = topk_clusters_placed(log2, score_rows, capacity) && score_rows * next <= sms &&
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
  const float* seed;                   ///< TopKRowsOptions::seed: [selection rows] or nullptr (the held kernel's)
  SelectionView out;
  const std::int32_t* ids;             ///< TopKRowsOptions::ids: [selection rows, ids_stride] or nullptr
  std::int64_t ids_stride;
  std::int32_t* picks;                 ///< heads_per_row > 1: [score rows, k], each score row's picks
  std::uint32_t* union_bits;           ///< [selection rows, union_words] where the bitmap exceeds shared memory
  std::int32_t union_words;
  TopKRowsLaunch launch;
};

/// The current GPU's TopKClusterCapacity for the select kernel (cudaOccupancyMaxActiveClusters).
cudaError_t topk_rows_cluster_capacity(TopKClusterCapacity* capacity);

cudaError_t launch_topk_rows(const TopKRowsParams& params, cudaStream_t stream);

/// The second launch of heads_per_row > 1 (the union of a selection row's picks); nothing for heads_per_row = 1.
cudaError_t launch_topk_rows_union(const TopKRowsParams& params, cudaStream_t stream);

/// Whether p's plan takes the one-CTA or the held kernel: those a word source can feed (topk_words_launch.cuh).
inline bool topk_rows_takes_words(const TopKRowsParams& p) { return p.launch.cta > 0 || p.launch.held > 0; }

/// A topk_rows call's params, checked (throws kvsift::Error as topk_rows does), its workspace carved and its launch
/// planned for the current device (src/cuda/topk.cpp): topk_rows launches them; a selector whose kernels compute
/// the scores into a word source (topk_words_launch.cuh) launches them itself where the plan takes words.
TopKRowsParams topk_rows_params(const char* where, const MatrixView<const float>& scores, const std::int32_t* d_lengths,
                                std::int32_t k, const TopKRowsOptions& options, const SelectionView& out,
                                std::span<std::byte> workspace);

cudaError_t launch_length_budgets(const std::int32_t* lengths, std::int32_t batch, std::int32_t heads,
                                  const LengthBudget& budget, std::int32_t* row_k, cudaStream_t stream);

// ---- mass_budgets: one CTA per row -------------------------------------------------------------------------

/// Threads of the mass_budgets kernel: 4 of MassBudget's 2048 radix bins per thread in its scan.
inline constexpr int kMassBudgetsThreads = 512;

/// Everything one mass_budgets launch reads and writes (device pointers).
struct MassBudgetsParams {
  MatrixView<const float> scores;  ///< [rows, capacity]
  const std::int32_t* counts;      ///< [rows]
  MassBudget budget;               ///< budget.limits: [rows] or nullptr
  std::int32_t* row_k;             ///< [rows]
};

cudaError_t launch_mass_budgets(const MassBudgetsParams& params, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
