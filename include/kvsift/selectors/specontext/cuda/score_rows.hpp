#pragma once
/// Reductions of score rows on the GPU, the twin of selectors/specontext/cpu/score_rows.hpp (read its contract): equal bit for bit, but
/// for a NaN's payload (the device's max.NaN writes the canonical NaN).
/// Device memory; no allocation, no host sync; stream-ordered; CUDA-graph capturable. Lengths are read on the
/// device: a length past out.cols is clamped to it (top-K then marks that row).

#include <cstdint>

#include "kvsift/core/views.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

/// cpu::max_score_rows. One launch, a thread per (row, column), columns in 16-byte loads where aligned.
void max_score_rows(const MatrixView<const float>& scores, std::int32_t group, const std::int32_t* d_lengths,
                    const MatrixView<float>& out, const Context& ctx);

}  // namespace kvsift::cuda
