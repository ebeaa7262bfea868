// max_score_rows on CUDA (selectors/specontext/cuda/score_rows.hpp): a grid-stride loop over (row, column); max_nan in the CPU's order,
// so the results are the CPU's bit for bit (a maximum rounds nothing), NaN's payload aside.
#include <algorithm>

#include "kvsift/attention/state.hpp"
#include "kvsift/selectors/specontext/cuda/detail/score_rows_launch.hpp"

namespace kvsift::cuda::detail {
namespace {

__global__ void max_score_rows_kernel(MatrixView<const float> scores, std::int32_t group, const std::int32_t* lengths,
                                      MatrixView<float> out) {
  const std::int64_t r = blockIdx.y;
  const std::int32_t n = min(max(lengths[r], 0), out.cols);
  for (std::int32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x) {
    float m = scores.row(r * group)[t];
    for (std::int32_t j = 1; j < group; ++j) m = max_nan(m, scores.row(r * group + j)[t]);
    out.row(r)[t] = m;
  }
}

}  // namespace

cudaError_t launch_max_score_rows(const MatrixView<const float>& scores, std::int32_t group,
                                  const std::int32_t* lengths, const MatrixView<float>& out, cudaStream_t stream) {
  constexpr int kThreads = 256;
  // Enough blocks per row to fill the GPU at batch 1 (a 128K row: 128 blocks of 256 threads, 4 columns each).
  const int blocks = std::max(1, std::min(128, (out.cols + kThreads - 1) / kThreads));
  max_score_rows_kernel<<<dim3(blocks, unsigned(out.rows)), kThreads, 0, stream>>>(scores, group, lengths, out);
  return cudaGetLastError();
}

}  // namespace kvsift::cuda::detail
