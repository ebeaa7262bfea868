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

/// table_scores_dense: thread-block clusters of kDenseClusterMax CTAs (sm_90; one CTA elsewhere), each CTA owning
/// a power-of-two range of a row's tokens in shared memory (an int64 sum, the running maximum as fp32) and a bit per
/// token of the window (a cluster's tokens).
/// A cluster covers one window of cluster * keys tokens of one row; its CTAs share the scan of the row's chosen
/// lists and add each kept entry into the owning CTA's sum through distributed shared memory.
inline constexpr int kDenseThreads = 512;
inline constexpr int kDenseClusterMax = 8;
inline constexpr std::int32_t kDenseMinKeys = 1024;  ///< a CTA's range at least (the plan's bound on windows)
inline constexpr int kDenseLists = 64;               ///< chosen lists whose device values a CTA holds at once
inline constexpr int kDenseKeyBytes = 8 + 4 + kDenseClusterMax / 8;  ///< sum, maximum, the window's bits

/// A row's windows and its CTAs' ranges; rows * windows * cluster CTAs.
struct DenseTablePlan {
  std::int32_t cluster = 1;
  std::int32_t windows = 0;
  std::int32_t key_shift = 0;  ///< a CTA owns 1 << key_shift tokens
  std::size_t smem_bytes = 0;
};
/// The plan for `rows` rows of max_tokens: the fewest windows whose ranges fit `smem_limit` bytes a CTA (half
/// of the largest block, so that two CTAs share a multiprocessor), then more, down to kDenseMinKeys tokens a
/// CTA, while the grid fits twice the multiprocessors.
DenseTablePlan plan_dense_tables(std::int64_t rows, std::int32_t max_tokens, std::int32_t cluster,
                                 int multiprocessors, std::size_t smem_limit);
/// Windows * cluster of a plan at most: the counts' columns the workspace holds per row.
inline std::int64_t dense_parts_bound(std::int32_t max_tokens) {
  return (std::int64_t(max_tokens) + kDenseMinKeys - 1) / kDenseMinKeys + kDenseClusterMax;
}

/// table_scores_dense's scratch: each CTA's candidate count, [rows, dense_parts_bound(max_tokens)].
struct DenseTableBuffers {
  std::int32_t* counts = nullptr;
  std::int64_t parts = 0;  ///< the row stride of counts
};

/// The cluster size the dense kernel can run with on the current device: kDenseClusterMax where its binary has
/// clusters (sm_90 or later), else 1.
cudaError_t dense_tables_cluster(std::int32_t* cluster);

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
