#pragma once
/// The workspace and launcher of cuda::segment_mean (kernels/segment_mean.cu), also run by cuda::kmeans_batched
/// for its centroid updates. The launcher returns the launch status and never throws.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/core/views.hpp"

namespace kvsift {
class WorkspaceLayout;  // core/workspace.hpp, which device code cannot include (fmt)
}  // namespace kvsift

namespace kvsift::cuda::detail {

struct SegmentMeanBuffers {
  std::int32_t* keys;           ///< [rows]: each row's segment, `segments` for rows in none
  std::int32_t* sorted_keys;    ///< [rows]
  std::int32_t* row_ids;        ///< [rows]: 0, 1, ..., rows - 1
  std::int32_t* members;        ///< [rows]: row ids sorted by segment (stable: ascending within one)
  std::int32_t* bounds;         ///< [2, segments]: begin and end of each segment in `members`
  void* cub_temp;
  std::size_t cub_temp_bytes;
};

/// Carves the buffers for `rows` rows and `segments` segments (counting mode: sizes only).
SegmentMeanBuffers layout_segment_mean(WorkspaceLayout& layout, std::int64_t rows, std::int32_t segments);

/// CUB's temporary storage of the sort.
cudaError_t segment_mean_cub_bytes(std::int64_t rows, std::int32_t segments, std::size_t* bytes);

template <class T>
cudaError_t launch_segment_mean(const MatrixView<const T>& rows, const std::int32_t* assignment, std::int32_t segments,
                                const float* weights, const MatrixView<float>& means, std::int32_t* counts,
                                const SegmentMeanBuffers& buffers, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
