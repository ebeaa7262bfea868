#pragma once
/// CUDA top-K shared by every selector, the twin of cpu/topk.hpp (same order and tie rule: higher score first,
/// on equal scores the smaller index, NaN below every number).
/// Device memory; caller-owned workspace (size from the matching *_workspace_bytes query); no allocation, no
/// host sync; stream-ordered; reentrant (concurrent calls need distinct workspaces).

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "kvsift/core/views.hpp"

namespace kvsift::cuda {

enum class TopKAlgorithm : std::uint8_t {
  /// Radix select: three histogram passes over 11/11/10 key bits, one counting and one writing pass; reads
  /// the scores five times and sorts nothing. Several CTAs per row, so a few rows still fill the GPU.
  radix_select,
  /// CUB radix sorts of every (row, score) key, then of the chosen (row, index) pairs.
  radix_sort,
};

/// Top-K per row: scores [rows, n] (row stride scores.row_stride) → indices [rows, k] (row stride k) of each
/// row's k best scores, ascending; ties go to the smaller index; NaN ranks below every number. Both
/// algorithms give identical results (they are tested against cpu::topk_indices); radix_select is the
/// faster one at every measured shape (docs/primitives.md) and is the default. Deterministic. The workspace
/// size depends on the algorithm and, for radix_select, on the current device's SM count.
std::size_t topk_workspace_bytes(std::int64_t rows, std::int32_t n, std::int32_t k,
                                 TopKAlgorithm algorithm = TopKAlgorithm::radix_select);
void topk(const MatrixView<const float>& scores, std::int32_t k, std::int32_t* d_indices, std::span<std::byte> workspace,
          cudaStream_t stream, TopKAlgorithm algorithm = TopKAlgorithm::radix_select);

}  // namespace kvsift::cuda
