#pragma once
/// Segment means on the CPU: the (weighted) mean of the rows of each segment, the update step of k-means and
/// CentroidKV's merge of matched rows. The twin of cuda/segment_mean.hpp, with the same arguments but the context
/// and bit-identical results. Host memory; no allocation; deterministic and independent of the thread count.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/views.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// Bytes of host workspace (256-byte aligned) segment_mean needs for `rows` rows in `segments` segments: the
/// rows' order by segment and the segments' offsets, 4 * (rows + segments + 1) bytes rounded up, whatever the
/// context's threads.
std::size_t segment_mean_workspace_bytes(std::int64_t rows, std::int32_t segments, const Context& = {});

/// For each segment s < segments, with R_s the rows i whose assignment[i] == s (rows assigned outside
/// [0, segments), e.g. -1, belong to none):
///   counts[s] = |R_s|,
///   means.row(s) = sum_{i in R_s} w_i rows.row(i) / sum_{i in R_s} w_i, w_i = weights[i] (1 without weights),
/// summed in fp64 in ascending i (fp32 products are exact there, so fused multiply-adds cannot change a bit)
/// and rounded once to fp32. A segment with no rows, or whose weights sum to 0, keeps its means row unchanged.
/// rows [n, dim] in half, bfloat16 or float, n < 2^31; assignment and weights [n]; means [segments, dim] fp32;
/// counts [segments]. workspace: segment_mean_workspace_bytes(n, segments) bytes, contents irrelevant; a
/// smaller buffer is refused. Threads: segments on ctx.pool.
template <class T>
void segment_mean(const MatrixView<const T>& rows, const std::int32_t* assignment, std::int32_t segments,
                  const float* weights, const MatrixView<float>& means, std::int32_t* counts,
                  std::span<std::byte> workspace, const Context& ctx = {});

}  // namespace kvsift::cpu
