#pragma once
/// Params, buffers and launchers of the CUDA inverted lists (cuda/inverted_lists.hpp), for the host code in
/// src/cuda/inverted_lists.cpp; kernels in kernels/inverted_lists.cu. Launchers return the launch status and never
/// throw; every kernel reads the device values it depends on itself and follows cuda/inverted_lists.hpp's rules.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/inverted_lists.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

/// The union's scratch, carved from the caller's workspace (src/cuda/inverted_lists.cpp's one layout); the
/// one-launch path of small rows uses none of it.
struct ListReductionBuffers {
  std::int32_t* keys_in = nullptr;   ///< [rows * segment]: the entries' ids, dropped ones kAbsentListEntry
  std::int32_t* keys_out = nullptr;  ///< [rows * segment]: sorted per row
  std::int32_t* segment_begin = nullptr;  ///< [rows]
  std::int32_t* segment_end = nullptr;    ///< [rows]
  void* cub_temp = nullptr;
  std::size_t cub_temp_bytes = 0;
};

/// A union of at most this many entries per row (chosen.capacity * list_capacity) is one launch: a CTA per row
/// sorts them in registers (kernels/inverted_lists.cu). Larger ones take the segmented sort.
inline constexpr std::int32_t kBlockUnionItems = 10240;

/// recall_lists' top-k in the union's launch (the cluster path, sm_90): score rows of at most this many columns
/// (8 words a thread: the cluster kernel keeps 48 registers, 5 CTAs an SM; with 32 words, 111 registers and 2 CTAs
/// an SM, CTKVR's batch-8 union took two waves, +21 us a step on the H200), at most this many chosen lists (a pass
/// over the row's registers and a barrier per pick).
inline constexpr std::int32_t kRecallFusedColumns = 2048;
inline constexpr std::int32_t kRecallFusedChosen = 16;

/// recall_lists' choice made in the union's launch: each row's chosen.capacity best columns of its score row, as
/// topk_rows(scores, columns, chosen.capacity, {}) picks them, written to chosen. scores.data nullptr: the chosen
/// lists are given (union_lists).
struct ListRecall {
  MatrixView<const float> scores;
  const std::int32_t* columns = nullptr;  ///< [chosen.batch]: each batch row's scored columns (topk_rows' lengths)
};

template <class T>
struct ListReductionParams {
  InvertedListsView<const T> lists;
  SelectionView chosen;
  const std::int32_t* slots;
  const std::int32_t* lengths;
  AttentionWindow window;
  SelectionView out;
  UnionAppend append;    ///< the range appended after the union (append.first nullptr: none)
  ListRecall recall;     ///< the chosen lists' choice in the launch (recall.scores.data nullptr: none)
  std::int64_t rows;     ///< chosen.batch * chosen.kv_heads
  std::int32_t segment;  ///< chosen.capacity * lists.list_capacity
};

/// CUB's segmented-sort scratch for rows * segment keys.
cudaError_t list_reduction_cub_bytes(std::int64_t rows, std::int32_t segment, std::size_t* bytes);

/// Whether recall_lists runs in one launch (the union's cluster path, its top-k inside) for these shapes.
template <class T>
cudaError_t recall_fuses(std::int32_t columns, std::int32_t chosen_capacity, std::int32_t segment, bool* fused);

/// With params.recall set, only where recall_fuses holds (else cudaErrorInvalidValue).
template <class T>
cudaError_t launch_list_reduction(const ListReductionParams<T>& params, const ListReductionBuffers& buffers,
                                  cudaStream_t stream);
template <class T>
cudaError_t launch_replace_list(const InvertedListsView<T>& lists, const std::int32_t* slots,
                                const SelectionView& entries, const MatrixView<const float>& scores,
                                std::int32_t* replaced, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
