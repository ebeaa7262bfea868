#pragma once
/// Params, buffers and launchers of the CUDA score tables (selectors/csattention/cuda/score_tables.hpp), for the host code in
/// src/selectors/csattention/cuda/score_tables.cpp; kernels in kernels/score_tables.cu. Launchers return the launch status and never
/// throw; every kernel reads the device values it depends on itself and follows selectors/csattention/cuda/score_tables.hpp's rules.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/selectors/csattention/score_tables.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

/// subspace_scores: a CTA scores kSubspaceScoreThreads tokens against kSubspaceScoreLists consecutive centroids of
/// one subspace; the CTAs cover every subspace the list range touches.
inline constexpr int kSubspaceScoreThreads = 128;
inline constexpr int kSubspaceScoreLists = 8;
inline std::int64_t subspace_scores_blocks(std::int32_t centroids, std::int32_t list_begin, std::int32_t list_count,
                                           std::int32_t tokens) {
  const std::int64_t subspaces = (std::int64_t(list_begin) + list_count - 1) / centroids - list_begin / centroids + 1;
  return subspaces * ((centroids + kSubspaceScoreLists - 1) / kSubspaceScoreLists) *
         ((std::int64_t(tokens) + kSubspaceScoreThreads - 1) / kSubspaceScoreThreads);
}

template <class KV>
cudaError_t launch_subspace_scores(const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                                   std::int32_t list_count, const KV& kv, std::int32_t row, std::int32_t token_begin,
                                   std::int32_t tokens, const MatrixView<float>& out, cudaStream_t stream);

/// store_table_lists sorts at most this many list rows at once: a row's index fills the 16 bits of its sort keys
/// above the rank key. More rows take several sorts in turn, over one workspace.
inline constexpr std::int64_t kTableListSortRows = 65536;

/// store_table_lists' scratch for min(rows, kTableListSortRows) rows, carved from the caller's workspace
/// (src/selectors/csattention/cuda/score_tables.cpp's one layout): CUB's double buffers.
struct TableListBuffers {
  std::uint32_t* keys[2] = {};     ///< row << 16 | rank key (ascending: the row, then best first)
  std::int32_t* columns[2] = {};  ///< the columns, filled in ascending order (the tie rule, the sort being stable)
  void* cub_temp = nullptr;
  std::size_t cub_temp_bytes = 0;
};

/// CUB's radix-sort scratch for the (key, column) pairs of min(rows, kTableListSortRows) rows of `tokens`.
cudaError_t table_list_sort_bytes(std::int64_t rows, std::int32_t tokens, std::size_t* bytes);

cudaError_t launch_store_table_lists(const MatrixView<const float>& scores, std::int32_t tokens, std::int32_t keep,
                                     const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                                     const TableListBuffers& buffers, cudaStream_t stream);

template <class KV>
cudaError_t launch_append_tables(const ScoreTablesView<std::int32_t>& tables, const KV& kv,
                                 const std::int32_t* slots, const std::int32_t* lengths, cudaStream_t stream);

template <class T>
cudaError_t launch_nearest_centroids(const QueryView<const T>& q, const ScoreTablesView<const std::int32_t>& tables,
                                     const std::int32_t* slots, std::int32_t probes, const SelectionView& chosen,
                                     std::int32_t* weights, cudaStream_t stream);

/// What both reductions of the chosen lists read.
struct TableScoresParams {
  ScoreTablesView<const std::int32_t> tables;
  SelectionView chosen;
  TableScoreOptions options;
  std::int32_t heads_per_row;
  const std::int32_t* slots;
  const std::int32_t* lengths;
  AttentionWindow window;
  LengthBudget budget;
  std::int32_t* row_k;
  std::int64_t rows;  ///< chosen.batch * chosen.kv_heads
};

/// order_table_lists: a CTA per list of one base's table heads.
inline constexpr int kOrderThreads = 256;
cudaError_t launch_order_table_lists(const BaseTablesView& base, std::int32_t tokens, cudaStream_t stream);

/// table_scores_dense: a CTA per (row, part), a part a power-of-two range of the row's tokens (at least
/// kTableTokenRange, at most 2^16, so that an id's low 16 bits name it within the part): the CTA reads, list after
/// chosen list, the entries of its own ranges from the base's token order and the overlays where its tokens reach
/// past the prompt, and adds each kept entry into its own shared int64 sum (exact in any order): nothing remote.
inline constexpr int kDenseThreads = 512;
inline constexpr int kDenseAhead = 8;  ///< lists whose entries a thread loads at once
inline constexpr int kDenseSlots = 2;  ///< entries a thread loads at once per list (more are read one by one)
inline constexpr int kDenseLists = 64;  ///< chosen lists whose device values a CTA holds at once
inline constexpr int kDenseMaxShift = 16;
inline constexpr std::int32_t kDenseKeyBytes = 8 + 4 + 1;  ///< sum, maximum, listed flag

/// A row's parts: rows * parts CTAs of 1 << key_shift tokens.
struct DenseTablePlan {
  std::int32_t parts = 0;
  std::int32_t key_shift = 0;
  std::size_t smem_bytes = 0;
};
/// The plan for `rows` rows of max_tokens: parts of kTableTokenRange tokens, doubled while the grid holds more than
/// kDenseCtasPerSm CTAs per multiprocessor (one wave: a CTA's time is a chain of dependent loads, so waves add up)
/// and a CTA's shared memory fits `smem_limit`.
inline constexpr int kDenseCtasPerSm = 2;
DenseTablePlan plan_dense_tables(std::int64_t rows, std::int32_t max_tokens, int multiprocessors,
                                 std::size_t smem_limit);
/// Parts of a plan at most: the counts' columns the workspace holds per row.
inline std::int64_t dense_parts_bound(std::int32_t max_tokens) { return table_token_ranges(max_tokens); }

/// table_scores_dense's scratch: each CTA's candidate count, [rows, dense_parts_bound(max_tokens)].
struct DenseTableBuffers {
  std::int32_t* counts = nullptr;
  std::int64_t parts = 0;  ///< the row stride of counts
};

cudaError_t launch_table_scores_dense(const TableScoresParams& params, const MatrixView<float>& scores,
                                      std::int32_t max_tokens, const DenseTablePlan& plan,
                                      const DenseTableBuffers& buffers, cudaStream_t stream);

/// table_scores_sparse's scratch: one segment of chosen.capacity * tables.length entries per row; entry k of a row
/// is position k % length of its chosen list k / length. The sort's spare buffers serve the compaction after it.
struct SparseTableBuffers {
  std::uint64_t* keys[2] = {};     ///< row << 31 | id, dropped entries' id kAbsentListEntry; [items]
  std::int32_t* ordinals[2] = {};  ///< k; [items + 1]
  std::int64_t* values = nullptr;  ///< by row and k: weight * (fixed score - floor)
  void* cub_temp = nullptr;        ///< the sort's, then the scan's
  std::size_t cub_temp_bytes = 0;
};

/// CUB's scratch for the sort and the scan of rows * segment entries (the larger of the two).
cudaError_t table_scores_sparse_cub_bytes(std::int64_t rows, std::int32_t segment, std::size_t* bytes);

cudaError_t launch_table_scores_sparse(const TableScoresParams& params, const SelectionView& out,
                                       const MatrixView<float>& sums, std::int32_t segment,
                                       const SparseTableBuffers& buffers, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
