#pragma once
/// CUDA twins of the CPU primitives (cpu/primitives.hpp, cpu/topk.hpp), with the same results: top-K with
/// kvsift's one tie rule, GEMV scores, row gather, batched RoPE. Device memory; caller-owned workspace where
/// one is needed (size from the matching *_workspace_bytes query); no allocation, no host sync; stream-ordered.

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda {

/// Top-K per row: scores [rows, n] (row stride scores.row_stride) → indices [rows, k] (row stride k) of each
/// row's k best scores, ascending; ties go to the smaller index; NaN ranks below every number. Built on CUB
/// radix sorts of (row, score) keys: O(rows * n) work, deterministic.
std::size_t topk_workspace_bytes(std::int64_t rows, std::int32_t n, std::int32_t k);
void topk(const MatrixView<const float>& scores, std::int32_t k, std::int32_t* d_indices, std::span<std::byte> workspace,
          cudaStream_t stream);

/// scores[i] = scale * dot(q, rows.row(i)); q: [rows.cols] fp32, scores: [rows.rows] fp32.
template <class T>
void gemv_scores(const float* d_q, const MatrixView<const T>& rows, float scale, float* d_scores, cudaStream_t stream);

/// dst.row(i) = src.row(indices[i]) for i < count; indices must be in [0, src.rows) (not checked on the device).
template <class T>
void gather_rows(const MatrixView<const T>& src, const std::int32_t* d_indices, std::int64_t count,
                 const MatrixView<T>& dst, cudaStream_t stream);

/// Rotates row i of `rows` for position positions[i] (fp64 angles, as the CPU path), or undoes the rotation.
void apply_rope_rows(const MatrixView<float>& rows, const std::int64_t* d_positions, const RopeConfig& rope,
                     bool inverse, cudaStream_t stream);

}  // namespace kvsift::cuda
