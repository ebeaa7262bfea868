// CUDA primitives: validation and workspace layout (host compiler); kernels in kernels/primitives.cu.
#include "kvsift/cuda/primitives.hpp"

#include <algorithm>
#include <climits>

#include "kvsift/core/kmeans_seeding.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/primitives_kernels.cuh"

namespace kvsift::cuda {
namespace {

void check_sort_unique_shape(const char* where, std::int64_t rows, std::int32_t capacity) {
  KVSIFT_CHECK(rows > 0 && capacity > 0, where, "rows (= {}) and capacity (= {}) must be positive", rows, capacity);
  KVSIFT_CHECK(rows * capacity <= INT32_MAX, where, "rows * capacity (= {}) exceeds 2^31 - 1", rows * capacity);
}

detail::SortUniqueBuffers layout_sort_unique(WorkspaceLayout& layout, std::int64_t rows, std::int32_t capacity) {
  detail::SortUniqueBuffers b{};
  KVSIFT_CUDA_CHECK(detail::sort_unique_cub_bytes(rows, capacity, &b.cub_temp_bytes));
  b.sorted = layout.allocate<std::int32_t>(std::size_t(rows) * std::size_t(capacity), "sort_unique sorted");
  b.segment_begin = layout.allocate<std::int32_t>(std::size_t(rows), "sort_unique segment begins");
  b.segment_end = layout.allocate<std::int32_t>(std::size_t(rows), "sort_unique segment ends");
  b.cub_temp = layout.allocate<std::byte>(b.cub_temp_bytes, "sort_unique cub temporary storage");
  return b;
}

/// Shared memory of the seeding's distance kernel: the candidates' rows.
constexpr std::size_t kKMeansCandidateRowsBytes = 48 * 1024;

void check_kmeans(const char* where, std::int64_t n, std::int32_t dim, const cpu::KMeansConfig& config) {
  KVSIFT_CHECK(n > 0 && dim > 0, where, "points (= {}) and dim (= {}) must be positive", n, dim);
  KVSIFT_CHECK(n <= INT32_MAX, where, "points (= {}) exceeds 2^31 - 1", n);
  cpu::detail::check_kmeans_config(where, n, config);
  KVSIFT_CHECK(config.metric == cpu::KMeansMetric::l2 || config.metric == cpu::KMeansMetric::cosine, where,
               "unknown KMeansMetric ({})", int(config.metric));
  const std::size_t candidate_bytes =
      std::size_t(kvsift::detail::kmeans_candidates_per_step(config.clusters)) * std::size_t(dim) * sizeof(float);
  KVSIFT_CHECK(candidate_bytes <= kKMeansCandidateRowsBytes, where,
               "dim (= {}) is too large: the {} seeding candidates' rows need {} bytes of shared memory, more than {}",
               dim, kvsift::detail::kmeans_candidates_per_step(config.clusters), candidate_bytes, kKMeansCandidateRowsBytes);
}

detail::KMeansBuffers layout_kmeans(WorkspaceLayout& layout, std::int64_t n, std::int32_t dim, std::int32_t clusters) {
  detail::KMeansBuffers b{};
  b.candidates_per_step = kvsift::detail::kmeans_candidates_per_step(clusters);
  b.distance_blocks = detail::kmeans_distance_blocks(n);
  const auto points = std::size_t(n);
  KVSIFT_CUDA_CHECK(detail::kmeans_cub_bytes(n, &b.cub_temp_bytes));
  b.points = layout.allocate<float>(checked_mul(points, std::size_t(dim), "kmeans points"), "kmeans points");
  b.norms = layout.allocate<float>(points, "kmeans norms");
  b.nearest = layout.allocate<double>(points, "kmeans nearest distances");
  b.prefix = layout.allocate<double>(points, "kmeans prefix sums");
  b.distances = layout.allocate<double>(points * std::size_t(b.candidates_per_step), "kmeans candidate distances");
  b.potentials = layout.allocate<double>(std::size_t(b.distance_blocks) * std::size_t(b.candidates_per_step),
                                         "kmeans candidate potentials");
  b.candidates = layout.allocate<std::int32_t>(std::size_t(b.candidates_per_step), "kmeans candidates");
  b.step = layout.allocate<std::int32_t>(3, "kmeans step state");
  b.counts = layout.allocate<std::int32_t>(std::size_t(clusters), "kmeans cluster counts");
  b.segment_mean = detail::layout_segment_mean(layout, n, clusters);
  b.cub_temp = layout.allocate<std::byte>(b.cub_temp_bytes, "kmeans cub temporary storage");
  return b;
}

}  // namespace

std::size_t sort_unique_workspace_bytes(std::int64_t rows, std::int32_t capacity) {
  check_sort_unique_shape("cuda::sort_unique_workspace_bytes", rows, capacity);
  WorkspaceLayout counting;
  layout_sort_unique(counting, rows, capacity);
  return counting.bytes();
}

void sort_unique(std::int32_t* d_indices, std::int64_t rows, std::int32_t capacity, const std::int32_t* d_counts,
                 std::int32_t* d_unique_counts, std::span<std::byte> workspace, cudaStream_t stream) {
  constexpr const char* where = "cuda::sort_unique";
  check_sort_unique_shape(where, rows, capacity);
  KVSIFT_CHECK(d_indices != nullptr && d_counts != nullptr && d_unique_counts != nullptr, where,
               "d_indices, d_counts and d_unique_counts must be non-null");
  WorkspaceLayout layout(workspace, where);
  const detail::SortUniqueBuffers buffers = layout_sort_unique(layout, rows, capacity);
  KVSIFT_CUDA_CHECK(detail::launch_sort_unique(d_indices, rows, capacity, d_counts, d_unique_counts, buffers, stream));
}

void assign_nearest(const MatrixView<const float>& points, const MatrixView<const float>& centroids,
                    cpu::KMeansMetric metric, std::int32_t* d_assignment, cudaStream_t stream) {
  constexpr const char* where = "cuda::assign_nearest";
  validate(points, where, "points");
  validate(centroids, where, "centroids");
  KVSIFT_CHECK(points.cols == centroids.cols, where, "points.cols (= {}) != centroids.cols (= {})", points.cols,
               centroids.cols);
  KVSIFT_CHECK(centroids.rows >= 1 && centroids.rows <= INT32_MAX, where, "centroids.rows (= {}) is outside [1, 2^31)",
               centroids.rows);
  KVSIFT_CHECK(points.rows < std::int64_t(INT32_MAX) * 64, where, "points.rows (= {}) exceeds the grid limit", points.rows);
  KVSIFT_CHECK(metric == cpu::KMeansMetric::l2 || metric == cpu::KMeansMetric::cosine, where,
               "unknown KMeansMetric ({})", int(metric));
  KVSIFT_CHECK(d_assignment != nullptr || points.rows == 0, where, "d_assignment is a null pointer");
  if (points.rows == 0) return;
  KVSIFT_CUDA_CHECK(detail::launch_assign_nearest(points, centroids, metric == cpu::KMeansMetric::cosine, d_assignment,
                                                  stream));
}

std::size_t kmeans_workspace_bytes(std::int64_t points, std::int32_t dim, const cpu::KMeansConfig& config) {
  check_kmeans("cuda::kmeans_workspace_bytes", points, dim, config);
  WorkspaceLayout counting;
  layout_kmeans(counting, points, dim, config.clusters);
  return counting.bytes();
}

template <class T>
void kmeans(const MatrixView<const T>& points, const cpu::KMeansConfig& config, const MatrixView<float>& centroids,
            std::int32_t* d_assignment, std::span<std::byte> workspace, cudaStream_t stream) {
  constexpr const char* where = "cuda::kmeans";
  validate(points, where, "points");
  check_kmeans(where, points.rows, points.cols, config);
  validate(centroids, where, "centroids");
  KVSIFT_CHECK(centroids.rows == config.clusters && centroids.cols == points.cols, where,
               "centroids are [{}, {}]; expected [clusters = {}, dim = {}]", centroids.rows, centroids.cols,
               config.clusters, points.cols);
  KVSIFT_CHECK(d_assignment != nullptr, where, "d_assignment is a null pointer");
  WorkspaceLayout layout(workspace, where);
  const detail::KMeansBuffers buffers = layout_kmeans(layout, points.rows, points.cols, config.clusters);
  KVSIFT_CUDA_CHECK(detail::launch_kmeans(points, config.clusters, config.iterations,
                                          config.metric == cpu::KMeansMetric::cosine, config.seed, centroids,
                                          d_assignment, buffers, stream));
}

template void kmeans<float>(const MatrixView<const float>&, const cpu::KMeansConfig&, const MatrixView<float>&,
                            std::int32_t*, std::span<std::byte>, cudaStream_t);
template void kmeans<half>(const MatrixView<const half>&, const cpu::KMeansConfig&, const MatrixView<float>&,
                           std::int32_t*, std::span<std::byte>, cudaStream_t);
template void kmeans<bfloat16>(const MatrixView<const bfloat16>&, const cpu::KMeansConfig&, const MatrixView<float>&,
                               std::int32_t*, std::span<std::byte>, cudaStream_t);

DeviceKMeansAssigner::~DeviceKMeansAssigner() {
  if (buffer_ != nullptr) cudaFree(buffer_);
}

void DeviceKMeansAssigner::operator()(const MatrixView<const float>& points, const MatrixView<const float>& centroids,
                                      cpu::KMeansMetric metric, std::span<std::int32_t> assignment) {
  constexpr const char* where = "cuda::DeviceKMeansAssigner";
  validate(points, where, "points");
  validate(centroids, where, "centroids");
  KVSIFT_CHECK(assignment.size() >= std::size_t(points.rows), where, "assignment.size() (= {}) < points.rows (= {})",
               assignment.size(), points.rows);
  const auto layout_buffers = [&](WorkspaceLayout& layout) {
    struct {
      float* points;
      float* centroids;
      std::int32_t* assignment;
    } b{layout.allocate<float>(checked_mul(std::size_t(points.rows), std::size_t(points.cols), where), "points"),
        layout.allocate<float>(checked_mul(std::size_t(centroids.rows), std::size_t(centroids.cols), where), "centroids"),
        layout.allocate<std::int32_t>(std::size_t(points.rows), "assignment")};
    return b;
  };
  WorkspaceLayout counting;
  layout_buffers(counting);
  if (counting.bytes() > capacity_) {
    if (buffer_ != nullptr) KVSIFT_CUDA_CHECK(cudaFree(buffer_));
    buffer_ = nullptr;
    capacity_ = 0;
    KVSIFT_CUDA_CHECK(cudaMalloc(&buffer_, counting.bytes()));
    capacity_ = counting.bytes();
  }
  WorkspaceLayout layout({static_cast<std::byte*>(buffer_), capacity_}, where);
  const auto b = layout_buffers(layout);
  const auto upload = [&](float* dst, const MatrixView<const float>& m) {
    KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(dst, std::size_t(m.cols) * sizeof(float), m.data,
                                        std::size_t(m.row_stride) * sizeof(float), std::size_t(m.cols) * sizeof(float),
                                        std::size_t(m.rows), cudaMemcpyHostToDevice, stream_));
    return MatrixView<const float>::packed(dst, m.rows, m.cols);
  };
  assign_nearest(upload(b.points, points), upload(b.centroids, centroids), metric, b.assignment, stream_);
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(assignment.data(), b.assignment, std::size_t(points.rows) * sizeof(std::int32_t),
                                    cudaMemcpyDeviceToHost, stream_));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

template <class T>
void gemv_scores(const float* d_q, const MatrixView<const T>& rows, float scale, float* d_scores, cudaStream_t stream) {
  constexpr const char* where = "cuda::gemv_scores";
  validate(rows, where, "rows");
  KVSIFT_CHECK(d_q != nullptr && d_scores != nullptr, where, "d_q and d_scores must be non-null");
  KVSIFT_CUDA_CHECK(detail::launch_gemv_scores(d_q, rows, scale, d_scores, stream));
}

template <class T>
void gather_rows(const MatrixView<const T>& src, const std::int32_t* d_indices, std::int64_t count,
                 const MatrixView<T>& dst, cudaStream_t stream) {
  constexpr const char* where = "cuda::gather_rows";
  validate(src, where, "src");
  validate(dst, where, "dst");
  KVSIFT_CHECK(dst.cols == src.cols, where, "dst.cols (= {}) != src.cols (= {})", dst.cols, src.cols);
  KVSIFT_CHECK(count >= 0 && count <= dst.rows, where, "count (= {}) is outside [0, dst.rows = {}]", count, dst.rows);
  KVSIFT_CHECK(d_indices != nullptr || count == 0, where, "d_indices is a null pointer");
  if (count > 0) KVSIFT_CUDA_CHECK(detail::launch_gather_rows(src, d_indices, count, dst, stream));
}

#define KVSIFT_INSTANTIATE(T)                                                                                     \
  template void gemv_scores<T>(const float*, const MatrixView<const T>&, float, float*, cudaStream_t);            \
  template void gather_rows<T>(const MatrixView<const T>&, const std::int32_t*, std::int64_t, const MatrixView<T>&, \
                               cudaStream_t);
KVSIFT_INSTANTIATE(float)
KVSIFT_INSTANTIATE(half)
KVSIFT_INSTANTIATE(bfloat16)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda
