// CUDA primitives: validation and workspace layout (host compiler); kernels in kernels/primitives.cu.
#include "kvsift/cuda/primitives.hpp"

#include <algorithm>

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

/// The single layout behind topk_workspace_bytes (counting) and topk (carving).
detail::TopKBuffers layout_topk(WorkspaceLayout& layout, std::int64_t rows, std::int32_t n, std::int32_t k) {
  std::size_t first = 0, second = 0;
  KVSIFT_CUDA_CHECK(detail::topk_cub_bytes(rows, n, k, &first, &second));
  const std::size_t total = std::size_t(rows) * std::size_t(n), chosen = std::size_t(rows) * std::size_t(k);
  detail::TopKBuffers b{};
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

}  // namespace

std::size_t topk_workspace_bytes(std::int64_t rows, std::int32_t n, std::int32_t k) {
  check_topk_shape("cuda::topk_workspace_bytes", rows, n, k);
  WorkspaceLayout counting;
  layout_topk(counting, rows, n, k);
  return counting.bytes();
}

void topk(const MatrixView<const float>& scores, std::int32_t k, std::int32_t* d_indices, std::span<std::byte> workspace,
          cudaStream_t stream) {
  constexpr const char* where = "cuda::topk";
  validate(scores, where, "scores");
  check_topk_shape(where, scores.rows, scores.cols, k);
  KVSIFT_CHECK(d_indices != nullptr || k == 0, where, "d_indices is a null pointer");
  WorkspaceLayout layout(workspace, where);
  const detail::TopKBuffers buffers = layout_topk(layout, scores.rows, scores.cols, k);
  KVSIFT_CUDA_CHECK(detail::launch_topk(scores, k, d_indices, buffers, stream));
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
