// Rerank on CUDA (cuda/rerank.hpp): the checks shared with the CPU, the kernels' own limits, the workspace, then the
// launchers of kernels/rerank.cu.
#include "kvsift/cuda/rerank.hpp"

#include "kvsift/core/detail/rerank_checks.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/rerank_launch.hpp"

namespace kvsift::cuda {
namespace detail {

void check_group_dot_limits(const char* where, std::int32_t group, std::int32_t head_dim) {
  KVSIFT_CHECK(group <= kGroupDotMaxGroup, where, "the GQA group (= {} query heads per kv head) exceeds {}", group,
               kGroupDotMaxGroup);
  KVSIFT_CHECK(head_dim <= kGroupDotMaxHeadDim, where, "head_dim (= {}) exceeds {}", head_dim, kGroupDotMaxHeadDim);
}

}  // namespace detail
namespace {

struct CandidateBuffers {
  float *logits, *stats;
};
CandidateBuffers layout_candidates(WorkspaceLayout& layout, std::int64_t rows, std::int32_t group, std::int32_t capacity) {
  const std::size_t heads = std::size_t(rows) * std::size_t(group);
  return {layout.allocate<float>(heads * std::size_t(capacity), "candidate_scores logits"),
          layout.allocate<float>(heads * std::size_t(detail::candidate_chunks(capacity)) * 2,
                                 "candidate_scores softmax partials")};
}

}  // namespace

std::size_t candidate_scores_workspace_bytes(std::int64_t rows, std::int32_t group, std::int32_t capacity) {
  kvsift::detail::check_candidate_scores_shape("cuda::candidate_scores_workspace_bytes", rows, group, capacity);
  WorkspaceLayout counting;
  layout_candidates(counting, rows, group, capacity);
  return counting.bytes();
}

template <class T, class KV>
void candidate_scores(const QueryView<const T>& q, const KV& kv, const SelectionView& candidates,
                      const GroupScoreOptions& options, const MatrixView<float>& scores, std::span<std::byte> workspace,
                      cudaStream_t stream) {
  constexpr const char* where = "cuda::candidate_scores";
  kvsift::detail::check_candidate_scores(where, q, kv, candidates, options, scores, MemorySpace::device);
  const std::int32_t group = q.heads / kv.kv_heads;
  detail::check_group_dot_limits(where, group, q.head_dim);
  WorkspaceLayout layout(workspace, where);
  const CandidateBuffers buffers = layout_candidates(layout, scores.rows, group, candidates.capacity);
  KVSIFT_CUDA_CHECK(
      detail::launch_candidate_scores(q, kv, candidates, options, scores, buffers.logits, buffers.stats, stream));
}

void remap_selection(const SelectionView& positions, const SelectionView& ids, const SelectionView& out,
                     cudaStream_t stream) {
  kvsift::detail::check_remap_selection("cuda::remap_selection", positions, ids, out);
  KVSIFT_CUDA_CHECK(detail::launch_remap_selection(positions, ids, out, stream));
}

void append_range(const SelectionView& rows, const std::int32_t* d_slots, const std::int32_t* d_first,
                  const std::int32_t* d_lengths, const AttentionWindow& window, std::int32_t* d_counts_before,
                  cudaStream_t stream) {
  kvsift::detail::check_append_range("cuda::append_range", rows, d_slots, d_first, d_lengths, window);
  KVSIFT_CUDA_CHECK(detail::launch_append_range(rows, d_slots, d_first, d_lengths, window, d_counts_before, stream));
}

#define KVSIFT_INSTANTIATE(T)                                                                                         \
  template void candidate_scores<T, ContiguousKVView<const T>>(const QueryView<const T>&,                            \
                                                               const ContiguousKVView<const T>&, const SelectionView&, \
                                                               const GroupScoreOptions&, const MatrixView<float>&,    \
                                                               std::span<std::byte>, cudaStream_t);                   \
  template void candidate_scores<T, PagedKVView<const T>>(const QueryView<const T>&, const PagedKVView<const T>&,    \
                                                          const SelectionView&, const GroupScoreOptions&,             \
                                                          const MatrixView<float>&, std::span<std::byte>, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda
