// cuda::group_scores: validation, workspace layout and launch (host compiler); the kernels are in
// cuda/detail/group_scores_kernels.cuh, instantiated in kernels/group_scores.cu.
#include <cstdint>
#include <limits>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/detail/group_scores_checks.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/decode_params.hpp"
#include "kvsift/cuda/detail/group_scores_kernels.cuh"
#include "kvsift/cuda/primitives.hpp"

namespace kvsift::cuda {
namespace {

std::int32_t group_score_chunks(std::int32_t max_tokens) {
  return (max_tokens + detail::kGroupScoreChunk - 1) / detail::kGroupScoreChunk;
}

/// Logit rows padded to 4 floats, so that pass 1's pair stores stay 8-byte aligned.
std::int64_t logit_stride(std::int32_t max_tokens) { return (std::int64_t(max_tokens) + 3) / 4 * 4; }

struct GroupScoreWorkspace {
  float* logits = nullptr;
  float* chunk_max = nullptr;
  float* chunk_sum = nullptr;
};

/// The single layout behind group_scores_workspace_bytes (counting) and group_scores (carving).
GroupScoreWorkspace layout_group_scores(WorkspaceLayout& layout, std::int64_t rows, std::int32_t group,
                                        std::int32_t max_tokens, const GroupScoreOptions& options) {
  GroupScoreWorkspace ws;
  if (!options.softmax) return ws;
  constexpr const char* what = "cuda group_scores workspace";
  const std::size_t heads = checked_mul(std::size_t(rows), std::size_t(group), what);
  ws.logits = layout.allocate<float>(checked_mul(heads, std::size_t(logit_stride(max_tokens)), what), "logits");
  const std::size_t partials = checked_mul(heads, std::size_t(group_score_chunks(max_tokens)), what);
  ws.chunk_max = layout.allocate<float>(partials, "chunk_max");
  ws.chunk_sum = layout.allocate<float>(partials, "chunk_sum");
  return ws;
}

/// The CUDA-only rules: head_dims the kernels are built for, a grid of (row, chunk) CTAs, pass 2's LSEs in
/// shared memory.
void check_cuda_shape(const char* where, std::int32_t head_dim, std::int64_t rows, std::int32_t group,
                      std::int32_t max_tokens) {
  kvsift::detail::check_supported(where, "head_dim", head_dim, kCudaAttentionHeadDims, "the CUDA group-score kernels");
  KVSIFT_CHECK(group <= detail::kGroupScoreMaxGroup, where, "q_heads / kv_heads (= {}) exceeds the CUDA kernels' limit of {}",
               group, detail::kGroupScoreMaxGroup);
  const std::int64_t ctas = rows * group_score_chunks(max_tokens);
  KVSIFT_CHECK(ctas <= std::numeric_limits<std::int32_t>::max(), where,
               "batch * kv_heads * ceil(max_tokens / {}) (= {}) exceeds the CUDA grid limit 2^31 - 1",
               detail::kGroupScoreChunk, ctas);
}

/// 16-byte copies of q (tensor-core fragments, fp32 vector loads) and of every key row.
void check_aligned16(const char* where, const char* name, const void* p, std::size_t element_bytes,
                     std::initializer_list<std::int64_t> strides) {
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(p) % 16 == 0, where,
               "{} (= {}) is not 16-byte aligned, which the CUDA group-score kernels' vector loads need", name, p);
  for (const std::int64_t s : strides) {
    KVSIFT_CHECK(s * std::int64_t(element_bytes) % 16 == 0, where, "{}: stride {} ({} bytes) is not a multiple of 16 bytes",
                 name, s, s * std::int64_t(element_bytes));
  }
}
template <class T>
void check_keys_aligned(const char* where, const ContiguousKVView<const T>& kv) {
  check_aligned16(where, "kv.k", kv.k, sizeof(T), {kv.batch_stride, kv.head_stride, kv.token_stride});
}
template <class T>
void check_keys_aligned(const char* where, const PagedKVView<const T>& kv) {
  check_aligned16(where, "kv.k_pages", kv.k_pages, sizeof(T), {kv.page_stride, kv.head_stride, kv.token_stride});
}

}  // namespace

std::size_t group_scores_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                         std::int32_t max_tokens, const GroupScoreOptions& options) {
  return kvsift::detail::group_scores_bytes("cuda::group_scores_workspace_bytes", batch, q_heads, kv_heads, max_tokens,
                                            options, layout_group_scores);
}

template <class T, class KV>
void group_scores(const QueryView<const T>& q, const KV& kv, const MatrixView<float>& scores,
                  const GroupScoreOptions& options, std::span<std::byte> workspace, cudaStream_t stream) {
  constexpr const char* where = "cuda::group_scores";
  kvsift::detail::check_group_scores(where, q, kv, scores, options, MemorySpace::device);
  const std::int64_t rows = std::int64_t(kv.batch) * kv.kv_heads;
  const std::int32_t group = q.heads / kv.kv_heads;
  check_cuda_shape(where, q.head_dim, rows, group, scores.cols);
  check_aligned16(where, "q.data", q.data, sizeof(T), {q.batch_stride, q.head_stride});
  check_keys_aligned(where, kv);

  detail::GroupScoreParams<T, KV> p{.q = q,
                                    .kv = kv,
                                    .scores = scores,
                                    .group = group,
                                    .heads_per_row = options.heads_per_row > 0 ? options.heads_per_row : group,
                                    .head_tiles = (group + kHeadsPerTile - 1) / kHeadsPerTile,
                                    .chunks = group_score_chunks(scores.cols),
                                    .scale = AttentionOptions{.sm_scale = options.sm_scale}.resolved_scale(q.head_dim),
                                    .sum = options.reduce == GroupReduce::sum,
                                    .softmax = options.softmax,
                                    .logit_stride = logit_stride(scores.cols)};
  WorkspaceLayout layout(workspace, where);
  const GroupScoreWorkspace ws = layout_group_scores(layout, rows, group, scores.cols, options);
  p.logits = ws.logits;
  p.chunk_max = ws.chunk_max;
  p.chunk_sum = ws.chunk_sum;
  KVSIFT_CUDA_CHECK(detail::launch_group_scores(p, stream));
}

#define KVSIFT_INSTANTIATE(T, KV)                                                                        \
  template void group_scores<T, KV>(const QueryView<const T>&, const KV&, const MatrixView<float>&,      \
                                    const GroupScoreOptions&, std::span<std::byte>, cudaStream_t);
KVSIFT_GROUP_SCORE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda
