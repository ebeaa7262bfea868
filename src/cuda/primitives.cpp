// CUDA primitives: validation and workspace layout (host compiler); kernels in kernels/primitives.cu.
#include "kvsift/cuda/primitives.hpp"
#include "kvsift/cuda/topk.hpp"

#include <algorithm>
#include <climits>

#include "kvsift/core/kmeans_seeding.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/primitives_kernels.cuh"

namespace kvsift::cuda {
namespace {

void check_topk_shape(const char* where, std::int64_t rows, std::int32_t n, std::int32_t k) {
  KVSIFT_CHECK(rows > 0 && n > 0, where, "rows (= {}) and n (= {}) must be positive", rows, n);
  KVSIFT_CHECK(k >= 0 && k <= n, where, "k (= {}) is outside [0, n = {}]", k, n);
  KVSIFT_CHECK(rows < (std::int64_t(1) << 31), where, "rows (= {}) must be below 2^31", rows);
}

/// The single layouts behind topk_workspace_bytes (counting) and topk (carving).
detail::TopKSortBuffers layout_topk_sort(WorkspaceLayout& layout, std::int64_t rows, std::int32_t n, std::int32_t k) {
  std::size_t first = 0, second = 0;
  KVSIFT_CUDA_CHECK(detail::topk_sort_cub_bytes(rows, n, k, &first, &second));
  const std::size_t total = std::size_t(rows) * std::size_t(n), chosen = std::size_t(rows) * std::size_t(k);
  detail::TopKSortBuffers b{};
  b.keys_in = layout.allocate<unsigned long long>(total, "topk keys_in");
  b.keys_out = layout.allocate<unsigned long long>(total, "topk keys_out");
  b.values_in = layout.allocate<std::int32_t>(total, "topk values_in");
  b.values_out = layout.allocate<std::int32_t>(total, "topk values_out");
  b.chosen_in = layout.allocate<unsigned long long>(chosen, "topk chosen_in");
  b.chosen_out = layout.allocate<unsigned long long>(chosen, "topk chosen_out");
  b.cub_temp_bytes = std::max(first, second);
  b.cub_temp = layout.allocate<std::byte>(b.cub_temp_bytes, "topk cub temporary storage");
  return b;
}

/// Radix select runs about two CTAs per SM in all, each over at least kMinSelectChunk scores: few rows are
/// split into many chunks, many rows get one CTA each.
constexpr std::int64_t kMinSelectChunk = 2048;

detail::TopKSelectBuffers layout_topk_select(WorkspaceLayout& layout, std::int64_t rows, std::int32_t n) {
  const std::int64_t target_ctas = 2 * std::int64_t(multiprocessor_count());
  const std::int64_t max_chunks = (n + kMinSelectChunk - 1) / kMinSelectChunk;
  const std::int64_t wanted = std::clamp<std::int64_t>((target_ctas + rows - 1) / rows, 1, max_chunks);
  detail::TopKSelectBuffers b{};
  b.chunk_size = std::int32_t((n + wanted - 1) / wanted);
  b.chunks = std::int32_t((n + b.chunk_size - 1) / b.chunk_size);
  const auto per_row = [&](std::size_t count) { return checked_mul(std::size_t(rows), count, "topk workspace"); };
  b.state = layout.allocate<detail::SelectRowState>(per_row(1), "topk row states");
  b.histograms = layout.allocate<std::uint32_t>(per_row(detail::kSelectBins), "topk histograms");
  b.tickets = layout.allocate<std::uint32_t>(per_row(1), "topk tickets");
  b.chunk_counts = layout.allocate<std::uint32_t>(per_row(2 * std::size_t(b.chunks)), "topk chunk counts");
  return b;
}

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
  b.point_ids = layout.allocate<std::int32_t>(points, "kmeans point ids");
  b.sorted_clusters = layout.allocate<std::int32_t>(points, "kmeans sorted assignment");
  b.members = layout.allocate<std::int32_t>(points, "kmeans cluster members");
  b.cluster_bounds = layout.allocate<std::int32_t>(2 * std::size_t(clusters), "kmeans cluster bounds");
  b.cub_temp = layout.allocate<std::byte>(b.cub_temp_bytes, "kmeans cub temporary storage");
  return b;
}

}  // namespace

std::size_t topk_workspace_bytes(std::int64_t rows, std::int32_t n, std::int32_t k, TopKAlgorithm algorithm) {
  check_topk_shape("cuda::topk_workspace_bytes", rows, n, k);
  WorkspaceLayout counting;
  if (algorithm == TopKAlgorithm::radix_sort) {
    layout_topk_sort(counting, rows, n, k);
  } else {
    layout_topk_select(counting, rows, n);
  }
  return counting.bytes();
}

void topk(const MatrixView<const float>& scores, std::int32_t k, std::int32_t* d_indices, std::span<std::byte> workspace,
          cudaStream_t stream, TopKAlgorithm algorithm) {
  constexpr const char* where = "cuda::topk";
  validate(scores, where, "scores");
  check_topk_shape(where, scores.rows, scores.cols, k);
  KVSIFT_CHECK(d_indices != nullptr || k == 0, where, "d_indices is a null pointer");
  KVSIFT_CHECK(algorithm == TopKAlgorithm::radix_select || algorithm == TopKAlgorithm::radix_sort, where,
               "unknown TopKAlgorithm ({})", int(algorithm));
  WorkspaceLayout layout(workspace, where);
  if (algorithm == TopKAlgorithm::radix_sort) {
    KVSIFT_CUDA_CHECK(detail::launch_topk_sort(scores, k, d_indices, layout_topk_sort(layout, scores.rows, scores.cols, k),
                                               stream));
  } else {
    KVSIFT_CUDA_CHECK(
        detail::launch_topk_select(scores, k, d_indices, layout_topk_select(layout, scores.rows, scores.cols), stream));
  }
}

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

void apply_rope_rows(const MatrixView<float>& rows, const std::int64_t* d_positions, const RopeConfig& rope, bool inverse,
                     cudaStream_t stream) {
  constexpr const char* where = "cuda::apply_rope_rows";
  validate(rows, where, "rows");
  validate(rope, rows.cols, where);
  KVSIFT_CHECK(d_positions != nullptr, where, "d_positions is a null pointer");
  KVSIFT_CUDA_CHECK(detail::launch_apply_rope_rows(rows, d_positions, rope, inverse, stream));
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
