// Segment means on the CPU (cpu/segment_mean.hpp): a stable counting sort of the rows by segment, then each
// segment's fp64 sums in ascending row order, a column block at a time.
#include "kvsift/cpu/segment_mean.hpp"

#include <algorithm>

#include "kvsift/core/detail/segment_mean_checks.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"

namespace kvsift::cpu {
namespace {

struct SegmentMeanWorkspace {
  std::int32_t* offsets;  ///< [segments + 1]: where each segment's rows start in `members`
  std::int32_t* members;  ///< [rows]: row ids by segment, ascending within a segment
};

SegmentMeanWorkspace layout_segment_mean(WorkspaceLayout& layout, std::int64_t rows, std::int32_t segments) {
  return {layout.allocate<std::int32_t>(std::size_t(segments) + 1, "segment_mean offsets"),
          layout.allocate<std::int32_t>(std::size_t(rows), "segment_mean members")};
}

/// Columns summed together per pass over a segment's rows (their fp64 sums stay in registers or L1).
constexpr std::int32_t kColumnBlock = 32;

}  // namespace

std::size_t segment_mean_workspace_bytes(std::int64_t rows, std::int32_t segments, const Context&) {
  kvsift::detail::check_segment_mean_shape("cpu::segment_mean_workspace_bytes", rows, segments);
  WorkspaceLayout counting;
  layout_segment_mean(counting, rows, segments);
  return counting.bytes();
}

template <class T>
void segment_mean(const MatrixView<const T>& rows, const std::int32_t* assignment, std::int32_t segments,
                  const float* weights, const MatrixView<float>& means, std::int32_t* counts,
                  std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cpu::segment_mean";
  kvsift::detail::check_segment_mean(where, rows, assignment, segments, means, counts);
  WorkspaceLayout layout(workspace, where);
  const SegmentMeanWorkspace ws = layout_segment_mean(layout, rows.rows, segments);
  const auto inside = [&](std::int32_t s) { return s >= 0 && s < segments; };

  std::fill_n(counts, segments, 0);
  for (std::int64_t i = 0; i < rows.rows; ++i) {
    if (inside(assignment[i])) ++counts[assignment[i]];
  }
  // offsets[s + 1] starts at segment s's first place and is its cursor; after the scatter it is s's end, which
  // is where s + 1 starts.
  ws.offsets[0] = ws.offsets[1] = 0;
  for (std::int32_t s = 0; s + 1 < segments; ++s) ws.offsets[s + 2] = ws.offsets[s + 1] + counts[s];
  for (std::int64_t i = 0; i < rows.rows; ++i) {
    if (inside(assignment[i])) ws.members[ws.offsets[assignment[i] + 1]++] = std::int32_t(i);
  }

  parallel_for(ctx.pool, segments, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t s = begin; s < end; ++s) {
      const std::int32_t* first = ws.members + ws.offsets[s];
      const std::int32_t* last = ws.members + ws.offsets[s + 1];
      if (first == last) continue;
      double total = 0.0;
      for (const std::int32_t* m = first; m != last; ++m) total += weights == nullptr ? 1.0 : double(weights[*m]);
      if (total == 0.0) continue;
      for (std::int32_t c0 = 0; c0 < rows.cols; c0 += kColumnBlock) {
        const std::int32_t width = std::min(kColumnBlock, rows.cols - c0);
        double sum[kColumnBlock] = {};
        for (const std::int32_t* m = first; m != last; ++m) {
          const T* x = rows.row(*m) + c0;
          const double w = weights == nullptr ? 1.0 : double(weights[*m]);
          for (std::int32_t c = 0; c < width; ++c) sum[c] += w * double(to_float(x[c]));
        }
        float* out = means.row(s) + c0;
        for (std::int32_t c = 0; c < width; ++c) out[c] = float(sum[c] / total);
      }
    }
  });
}

#define KVSIFT_INSTANTIATE(T)                                                                                 \
  template void segment_mean<T>(const MatrixView<const T>&, const std::int32_t*, std::int32_t, const float*, \
                                const MatrixView<float>&, std::int32_t*, std::span<std::byte>, const Context&);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cpu
