// cuda::kmeans_batched: validation and workspace layout (host compiler); kernels in kernels/kmeans_batched.cu.
#include "kvsift/cuda/kmeans.hpp"

#include "kvsift/core/detail/kmeans_checks.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/kmeans_batched_launch.hpp"

namespace kvsift::cuda {
namespace {

/// The problems are a launch's grid.y in the assignment.
constexpr std::int32_t kMaxProblems = 65535;

void check_problems(const char* where, std::int32_t problems) {
  KVSIFT_CHECK(problems <= kMaxProblems, where, "problems (= {}) exceeds {}", problems, kMaxProblems);
}

detail::BatchedKMeansBuffers layout_kmeans_batched(WorkspaceLayout& layout, std::int32_t problems, std::int64_t n,
                                                   std::int32_t dim, const BatchedKMeansConfig& config) {
  constexpr const char* what = "batched k-means workspace";
  const std::size_t rows = checked_mul(std::size_t(problems), std::size_t(n), what);
  const std::size_t segments = checked_mul(std::size_t(problems), std::size_t(config.clusters), what);
  detail::BatchedKMeansBuffers b{};
  b.points = layout.allocate<float>(checked_mul(rows, std::size_t(dim), what), "kmeans_batched points");
  b.nearest = layout.allocate<float>(rows, "kmeans_batched nearest distances");
  b.counts = layout.allocate<std::int32_t>(segments, "kmeans_batched cluster counts");
  if (kvsift::detail::is_minibatch(config.batch_size, n)) {
    const std::size_t drawn = checked_mul(std::size_t(problems), std::size_t(config.batch_size), what);
    b.drawn = layout.allocate<std::int32_t>(drawn, "kmeans_batched drawn points");
    b.drawn_nearest = layout.allocate<std::int32_t>(drawn, "kmeans_batched drawn points' centroids");
    b.absorbed = layout.allocate<double>(segments, "kmeans_batched absorbed weights");
    return b;
  }
  b.keys = layout.allocate<std::int32_t>(rows, "kmeans_batched update keys");
  b.segment_mean = detail::layout_segment_mean(layout, std::int64_t(rows), std::int32_t(segments));
  return b;
}

}  // namespace

std::size_t batched_kmeans_workspace_bytes(std::int32_t problems, std::int64_t n, std::int32_t dim,
                                           const BatchedKMeansConfig& config, const Context&) {
  constexpr const char* where = "cuda::batched_kmeans_workspace_bytes";
  kvsift::detail::check_batched_kmeans_shape(where, problems, n, dim, config);
  check_problems(where, problems);
  WorkspaceLayout counting;
  layout_kmeans_batched(counting, problems, n, dim, config);
  return counting.bytes();
}

template <class T>
void kmeans_batched(const BatchedMatrixView<const T>& points, const float* d_weights, const BatchedKMeansConfig& config,
                    float* d_centroids, std::int32_t* d_assignment, std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cuda::kmeans_batched";
  kvsift::detail::check_batched_kmeans(where, points, d_weights, config, d_centroids, d_assignment);
  check_problems(where, points.problems);
  WorkspaceLayout layout(workspace, where);
  const detail::BatchedKMeansBuffers buffers = layout_kmeans_batched(layout, points.problems, points.rows, points.cols, config);
  KVSIFT_CUDA_CHECK(detail::launch_kmeans_batched(points, d_weights, config, d_centroids, d_assignment, buffers, ctx.stream));
}

#define KVSIFT_INSTANTIATE(T)                                                                                       \
  template void kmeans_batched<T>(const BatchedMatrixView<const T>&, const float*, const BatchedKMeansConfig&, \
                                  float*, std::int32_t*, std::span<std::byte>, const Context&);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda
