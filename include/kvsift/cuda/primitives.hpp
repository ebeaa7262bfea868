#pragma once
/// CUDA twins of the CPU primitives (cpu/primitives.hpp), with the same results: group scores, GEMV scores,
/// row gather, k-means and its assignment step, index deduplication. Top-K lives in cuda/topk.hpp.
/// Device memory; caller-owned workspace where one is needed (size from the matching *_workspace_bytes
/// query); no allocation, no host sync; stream-ordered; reentrant (concurrent calls need distinct
/// workspaces). DeviceKMeansAssigner is the one exception: an owning adapter for cpu::kmeans (see there).

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/primitives.hpp"

namespace kvsift::cuda {

/// scores[i] = scale * dot(q, rows.row(i)); q: [rows.cols] fp32, scores: [rows.rows] fp32.
template <class T>
void gemv_scores(const float* d_q, const MatrixView<const T>& rows, float scale, float* d_scores, cudaStream_t stream);

/// dst.row(i) = src.row(indices[i]) for i < count; indices must be in [0, src.rows) (not checked on the device).
template <class T>
void gather_rows(const MatrixView<const T>& src, const std::int32_t* d_indices, std::int64_t count,
                 const MatrixView<T>& dst, cudaStream_t stream);

/// Per row r < rows: sorts indices [r * capacity, r * capacity + counts[r]) ascending and removes repeats in
/// place (the distinct values lead the row; entries past them are unspecified) and sets unique_counts[r] to
/// their number. A row whose count is outside [0, capacity] is left unchanged and gets unique_counts[r] = -1
/// (counts live on the device, so they cannot be checked before the launch). cpu::sort_unique's twin.
std::size_t sort_unique_workspace_bytes(std::int64_t rows, std::int32_t capacity);
void sort_unique(std::int32_t* d_indices, std::int64_t rows, std::int32_t capacity, const std::int32_t* d_counts,
                 std::int32_t* d_unique_counts, std::span<std::byte> workspace, cudaStream_t stream);

/// cpu::assign_nearest's twin: d_assignment[i] = the centroid nearest point i (ties: smaller id), ranked by
/// x.c - |c|^2 / 2 (L2) or x.c (cosine; points and centroids normalized by the caller). Points [n, dim] and
/// centroids [k, dim] in device memory. Sums run in another order than on the CPU, so points almost exactly
/// between two centroids may resolve differently.
void assign_nearest(const MatrixView<const float>& points, const MatrixView<const float>& centroids,
                    cpu::KMeansMetric metric, std::int32_t* d_assignment, cudaStream_t stream);

/// cpu::kmeans's twin, entirely on the device: greedy k-means++ seeding with the same draws as the CPU
/// (core/kmeans_seeding.hpp), `config.iterations` Lloyd steps (assignment, then each centroid the mean of its
/// points, summed in ascending point order in double as on the CPU; an empty cluster keeps its centroid), and
/// the final assignment. Points [n, dim] (fp32, fp16 or bf16; normalized internally for cosine) → centroids
/// [clusters, dim] fp32 and d_assignment [n]. Deterministic for a given seed and input; it equals cpu::kmeans
/// unless a seeding candidate or an assignment sits on the edge of a tie, which the two backends' different
/// summation orders may break differently. Six to eight launches per centroid seeded and per iteration, no host
/// sync: for clustering at prefill, not per decode step.
std::size_t kmeans_workspace_bytes(std::int64_t points, std::int32_t dim, const cpu::KMeansConfig& config);
template <class T>
void kmeans(const MatrixView<const T>& points, const cpu::KMeansConfig& config, const MatrixView<float>& centroids,
            std::int32_t* d_assignment, std::span<std::byte> workspace, cudaStream_t stream);

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

/// A cpu::KMeansAssigner that runs the assignment step of cpu::kmeans on the GPU: each call uploads the
/// points and centroids, runs assign_nearest and downloads the assignment, synchronizing `stream`. Device
/// buffers are owned here and grow on demand (an allocation when a call needs more than any before): for
/// prefill-time clustering, not for the decode hot path. std::function copies its target, so pass it as
/// std::ref(assigner). One object serves one thread at a time.
class DeviceKMeansAssigner {
 public:
  explicit DeviceKMeansAssigner(cudaStream_t stream = nullptr) : stream_(stream) {}
  DeviceKMeansAssigner(const DeviceKMeansAssigner&) = delete;
  DeviceKMeansAssigner& operator=(const DeviceKMeansAssigner&) = delete;
  ~DeviceKMeansAssigner();

  void operator()(const MatrixView<const float>& points, const MatrixView<const float>& centroids,
                  cpu::KMeansMetric metric, std::span<std::int32_t> assignment);

 private:
  cudaStream_t stream_;
  void* buffer_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace kvsift::cuda
