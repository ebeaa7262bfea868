// CUDA top-K (cuda/topk.hpp): validation, launch shape and workspace layout (host compiler); kernels in
// kernels/topk_rows.cu.
#include "kvsift/cuda/topk.hpp"

#include <algorithm>
#include <array>
#include <tuple>

#include "kvsift/core/detail/topk_rows_checks.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/per_device.hpp"
#include "kvsift/cuda/detail/topk_launch.hpp"

namespace kvsift::cuda {
namespace {

/// Grid x holds score rows * cluster CTAs (cluster <= 16).
constexpr std::int64_t kMaxScoreRows = (std::int64_t(1) << 31) / 16;

/// The shared checks, and the grid's limit on score rows.
void check_topk_rows_shape(const char* where, std::int64_t score_rows, std::int32_t max_tokens, std::int32_t k,
                           const TopKRowsOptions& options) {
  kvsift::detail::check_topk_rows_shape(where, score_rows, max_tokens, k, options);
  KVSIFT_CHECK(score_rows < kMaxScoreRows, where, "score_rows (= {}) must be below {}", score_rows, kMaxScoreRows);
}

struct TopKRowsBuffers {
  std::int32_t* picks = nullptr;
  std::uint32_t* union_bits = nullptr;
};

/// The single layout behind topk_rows_workspace_bytes (counting) and topk_rows (carving).
TopKRowsBuffers layout_topk_rows(WorkspaceLayout& layout, std::int64_t score_rows, std::int32_t max_tokens,
                                 std::int32_t k, std::int32_t heads_per_row) {
  TopKRowsBuffers b;
  if (heads_per_row == 1) return b;
  constexpr const char* what = "cuda topk_rows workspace";
  b.picks = layout.allocate<std::int32_t>(checked_mul(std::size_t(score_rows), std::size_t(k), what), "topk picks");
  const std::int32_t words = detail::topk_union_words(max_tokens);
  if (words > detail::kTopKUnionSmemWords) {
    b.union_bits = layout.allocate<std::uint32_t>(
        checked_mul(std::size_t(score_rows / heads_per_row), std::size_t(words), what), "topk union bitmaps");
  }
  return b;
}

/// The current device's cluster capacity, queried once per device (as multiprocessor_count is); counts clamped to
/// PerDeviceCounts' range, which only lowers the cluster size chosen.
detail::TopKClusterCapacity cluster_capacity() {
  static detail::PerDeviceCounts<std::tuple_size_v<detail::TopKClusterCapacity>> cache;
  detail::TopKClusterCapacity capacity{};
  KVSIFT_CUDA_CHECK(cache.get(&capacity, [](detail::TopKClusterCapacity* c) { return detail::topk_rows_cluster_capacity(c); }));
  return capacity;
}

detail::TopKRowsLaunch plan_launch(std::int64_t score_rows, std::int32_t max_tokens) {
  return detail::plan_topk_rows(score_rows, max_tokens, multiprocessor_count(), cluster_capacity(),
                                detail::topk_rows_smem_limit_words(max_shared_memory_per_block()));
}

}  // namespace

namespace detail {

TopKRowsParams topk_rows_params(const char* where, const MatrixView<const float>& scores, const std::int32_t* d_lengths,
                                std::int32_t k, const TopKRowsOptions& options, const SelectionView& out,
                                std::span<std::byte> workspace) {
  kvsift::detail::check_topk_rows_call(where, scores, d_lengths, "d_lengths", k, options, out);
  KVSIFT_CHECK(scores.rows < kMaxScoreRows, where, "score_rows (= {}) must be below {}", scores.rows, kMaxScoreRows);
  const std::int32_t heads = options.heads_per_row;
  WorkspaceLayout layout(workspace, where);
  const TopKRowsBuffers buffers = layout_topk_rows(layout, scores.rows, scores.cols, k, heads);
  return {.scores = scores,
          .lengths = d_lengths,
          .row_k = options.row_k,
          .k = k,
          .window = options.window,
          .heads_per_row = heads,
          .nan_marks_row = options.nan_marks_row,
          .seed = options.seed,
          .out = out,
          .ids = options.ids,
          .ids_stride = options.ids_stride,
          .picks = buffers.picks,
          .union_bits = buffers.union_bits,
          .union_words = topk_union_words(scores.cols),
          .launch = plan_launch(scores.rows, scores.cols)};
}

}  // namespace detail

std::size_t topk_rows_workspace_bytes(std::int64_t score_rows, std::int32_t max_tokens, std::int32_t k,
                                      const TopKRowsOptions& options) {
  check_topk_rows_shape("cuda::topk_rows_workspace_bytes", score_rows, max_tokens, k, options);
  WorkspaceLayout counting;
  layout_topk_rows(counting, score_rows, max_tokens, k, options.heads_per_row);
  return counting.bytes();
}

void topk_rows(const MatrixView<const float>& scores, const std::int32_t* d_lengths, std::int32_t k,
               const TopKRowsOptions& options, const SelectionView& out, std::span<std::byte> workspace,
               cudaStream_t stream) {
  KVSIFT_CUDA_CHECK(detail::launch_topk_rows(
      detail::topk_rows_params("cuda::topk_rows", scores, d_lengths, k, options, out, workspace), stream));
}

void length_budgets(const std::int32_t* d_lengths, std::int32_t batch, std::int32_t heads, const LengthBudget& budget,
                    std::int32_t* d_row_k, cudaStream_t stream) {
  kvsift::detail::check_length_budgets("cuda::length_budgets", d_lengths, batch, heads, budget, d_row_k);
  KVSIFT_CUDA_CHECK(detail::launch_length_budgets(d_lengths, batch, heads, budget, d_row_k, stream));
}

void mass_budgets(const MatrixView<const float>& scores, const std::int32_t* d_counts, const MassBudget& budget,
                  std::int32_t* d_row_k, cudaStream_t stream) {
  constexpr const char* where = "cuda::mass_budgets";
  kvsift::detail::check_mass_budgets(where, scores, d_counts, budget, d_row_k);
  KVSIFT_CHECK(scores.rows <= std::int64_t(0x7fffffff), where, "scores.rows (= {}) must be below 2^31 (one CTA a row)",
               scores.rows);
  KVSIFT_CUDA_CHECK(detail::launch_mass_budgets(
      {.scores = scores, .counts = d_counts, .budget = budget, .row_k = d_row_k}, stream));
}

}  // namespace kvsift::cuda
