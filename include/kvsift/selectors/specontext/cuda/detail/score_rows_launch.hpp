#pragma once
/// Launcher of max_score_rows' kernel (kernels/selectors/specontext/score_rows.cu), called by src/selectors/specontext/cuda/score_rows.cpp after its checks.

#include <cstdint>

#include <cuda_runtime_api.h>

#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

cudaError_t launch_max_score_rows(const MatrixView<const float>& scores, std::int32_t group,
                                  const std::int32_t* lengths, const MatrixView<float>& out, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
