#pragma once
/// Params, buffers and launchers of the CUDA score tables (cuda/score_tables.hpp), for the host code in
/// src/cuda/score_tables.cpp; kernels in kernels/score_tables.cu. Launchers return the launch status and never
/// throw; every kernel reads the device values it depends on itself and follows cuda/score_tables.hpp's rules.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/score_tables.hpp"
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
/// (src/cuda/score_tables.cpp's one layout): CUB's double buffers.
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

/// table_scores_dense's scratch: sums [rows, heads_per_row, max_tokens] int64 (units of 2^-24), flags [rows,
/// max_tokens] (1: the token is a candidate).
struct DenseTableBuffers {
  std::int64_t* sums = nullptr;
  std::uint8_t* flags = nullptr;
};

cudaError_t launch_table_scores_dense(const TableScoresParams& params, const MatrixView<float>& scores,
                                      std::int32_t max_tokens, const DenseTableBuffers& buffers, cudaStream_t stream);

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
