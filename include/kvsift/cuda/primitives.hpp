#pragma once
/// CUDA twins of the CPU primitives (cpu/primitives.hpp), with the same results: group scores. Top-K lives in
/// cuda/topk.hpp, batched k-means in cuda/kmeans.hpp. Device memory; caller-owned workspace (size from the
/// matching *_workspace_bytes query); no allocation, no host sync; stream-ordered; reentrant (concurrent calls
/// need distinct workspaces).

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda {

/// cpu::group_scores's twin: every cached token scored for every GQA group of the decode query, row
/// b * kv_heads + g of `scores` holding, for t < seq_len(b), the group's scaled logits s_h,t = sm_scale * q_h . k_t
/// reduced over its query heads by max or sum, raw or as softmax weights exp(s_h,t - LSE_h) (the contract, NaN
/// rules included, is cpu::group_scores's). Results equal the CPU's within fp32 rounding: fp16/bf16 dot
/// products run on tensor cores (exact products, fp32 accumulation), fp32 ones in fp32 FMAs, and sums are
/// taken in other orders. Deterministic: fixed chunks of 1024 tokens, fixed reduction orders, no atomics.
/// Each key row is read once per tile of 16 query heads (once for groups up to 16); V is never read.
///
/// head_dim 64, 128 or 256; q, K and scores in device memory; q and the key rows 16-byte aligned (pointers and
/// strides). Sequence lengths (seq_lens, or the page tables) are read on the device: contiguous seq_lens may be
/// null (every sequence holds `capacity` tokens); a length past scores.cols, which the host cannot see, is cut
/// to scores.cols. Entries past seq_len(b) are not written; an empty sequence writes nothing.
///
/// workspace: group_scores_workspace_bytes(batch, q_heads, kv_heads, scores.cols, options) bytes of device
/// memory, 256-byte aligned, contents need not be initialized: 0 without options.softmax, else the logits
/// (4 * batch * q_heads * scores.cols bytes, columns rounded up to 4) and two floats per (row, head, chunk of
/// 1024 tokens). A smaller buffer is refused. One launch (two with softmax), no allocation, no host sync;
/// stream-ordered and CUDA-graph capturable.
std::size_t group_scores_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                         std::int32_t max_tokens, const GroupScoreOptions& options);
template <class T, class KV>
void group_scores(const QueryView<const T>& q, const KV& kv, const MatrixView<float>& scores,
                  const GroupScoreOptions& options, std::span<std::byte> workspace, cudaStream_t stream);

}  // namespace kvsift::cuda
