#pragma once
/// The launchers of kernels/rerank.cu (cuda/rerank.hpp). They return the launch
/// status and never throw; the host entry points (src/cuda/rerank.cpp) check the arguments first.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

/// The GQA group and head_dim that the group-dot kernels (these and CTKVR's query centroids) keep in shared memory,
/// and their check, naming the caller (host code: src/cuda/rerank.cpp; the .cu files never include the error layer).
inline constexpr std::int32_t kGroupDotMaxGroup = 16, kGroupDotMaxHeadDim = 256;
void check_group_dot_limits(const char* where, std::int32_t group, std::int32_t head_dim);

/// Candidates per block of the logits and finish passes, and so per softmax partial.
inline constexpr std::int32_t kCandidatesPerBlock = 256;
inline std::int32_t candidate_chunks(std::int32_t capacity) {
  return (capacity + kCandidatesPerBlock - 1) / kCandidatesPerBlock;
}

/// logits: [rows, group, candidates.capacity] fp32 scratch; stats: [rows, candidate_chunks(capacity), group, 2]
/// (each chunk's softmax maximum and sum of exponentials per head, combined by the finish pass).
template <class T, class KV>
cudaError_t launch_candidate_scores(const QueryView<const T>& q, const KV& kv, const SelectionView& candidates,
                                    const GroupScoreOptions& options, const MatrixView<float>& scores, float* logits,
                                    float* stats, cudaStream_t stream);

cudaError_t launch_remap_selection(const SelectionView& positions, const SelectionView& ids, const SelectionView& out,
                                   cudaStream_t stream);

cudaError_t launch_append_range(const SelectionView& rows, const std::int32_t* slots, const std::int32_t* first,
                                const std::int32_t* lengths, AttentionWindow window, std::int32_t* counts_before,
                                cudaStream_t stream);

}  // namespace kvsift::cuda::detail
