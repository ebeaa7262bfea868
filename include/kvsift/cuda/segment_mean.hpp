#pragma once
/// Segment means on CUDA: cpu/segment_mean.hpp's twin, with the same arguments but the context and
/// bit-identical results (the same fp64 sums in the same ascending row order). Device memory; no allocation, no
/// host sync; stream-ordered and CUDA-graph capturable. Four launches and a memset: a stable radix sort of the
/// rows by segment (CUB), the segments' bounds, then one thread per (segment, column) summing its rows in order.
/// No float atomics.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/views.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

/// Bytes of device workspace: the sort's keys and row ids (in and out, 16 * rows bytes), the segments' bounds
/// (8 * segments) and CUB's temporary storage, whatever the context.
std::size_t segment_mean_workspace_bytes(std::int64_t rows, std::int32_t segments, const Context& = {});

/// cpu::segment_mean's contract, in device memory (assignment, weights, means, counts, workspace).
template <class T>
void segment_mean(const MatrixView<const T>& rows, const std::int32_t* d_assignment, std::int32_t segments,
                  const float* d_weights, const MatrixView<float>& means, std::int32_t* d_counts,
                  std::span<std::byte> workspace, const Context& ctx);

}  // namespace kvsift::cuda
