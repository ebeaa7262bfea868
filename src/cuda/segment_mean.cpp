// Segment means on CUDA (cuda/segment_mean.hpp): the checks shared with the CPU, the workspace layout (also
// cuda::kmeans_batched's), then the launcher of kernels/segment_mean.cu.
#include "kvsift/cuda/segment_mean.hpp"

#include "kvsift/core/detail/segment_mean_checks.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/segment_mean_launch.hpp"

namespace kvsift::cuda {

detail::SegmentMeanBuffers detail::layout_segment_mean(WorkspaceLayout& layout, std::int64_t rows,
                                                       std::int32_t segments) {
  SegmentMeanBuffers b{};
  KVSIFT_CUDA_CHECK(segment_mean_cub_bytes(rows, segments, &b.cub_temp_bytes));
  const auto n = std::size_t(rows);
  b.keys = layout.allocate<std::int32_t>(n, "segment_mean keys");
  b.sorted_keys = layout.allocate<std::int32_t>(n, "segment_mean sorted keys");
  b.row_ids = layout.allocate<std::int32_t>(n, "segment_mean row ids");
  b.members = layout.allocate<std::int32_t>(n, "segment_mean members");
  b.bounds = layout.allocate<std::int32_t>(2 * std::size_t(segments), "segment_mean bounds");
  b.cub_temp = layout.allocate<std::byte>(b.cub_temp_bytes, "segment_mean cub temporary storage");
  return b;
}

std::size_t segment_mean_workspace_bytes(std::int64_t rows, std::int32_t segments, const Context&) {
  kvsift::detail::check_segment_mean_shape("cuda::segment_mean_workspace_bytes", rows, segments);
  WorkspaceLayout counting;
  detail::layout_segment_mean(counting, rows, segments);
  return counting.bytes();
}

template <class T>
void segment_mean(const MatrixView<const T>& rows, const std::int32_t* d_assignment, std::int32_t segments,
                  const float* d_weights, const MatrixView<float>& means, std::int32_t* d_counts,
                  std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cuda::segment_mean";
  kvsift::detail::check_segment_mean(where, rows, d_assignment, segments, means, d_counts);
  KVSIFT_CHECK(rows.cols <= 65535 * 128, where, "rows.cols (= {}) exceeds the launch limit of {} columns", rows.cols,
               65535 * 128);
  WorkspaceLayout layout(workspace, where);
  const detail::SegmentMeanBuffers buffers = detail::layout_segment_mean(layout, rows.rows, segments);
  KVSIFT_CUDA_CHECK(
      detail::launch_segment_mean(rows, d_assignment, segments, d_weights, means, d_counts, buffers, ctx.stream));
}

#define KVSIFT_INSTANTIATE(T)                                                                                 \
  template void segment_mean<T>(const MatrixView<const T>&, const std::int32_t*, std::int32_t, const float*, \
                                const MatrixView<float>&, std::int32_t*, std::span<std::byte>, const Context&);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda
