#include "kvsift/selectors/specontext/cuda/score_rows.hpp"

#include "kvsift/selectors/specontext/detail/score_rows_checks.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/selectors/specontext/cuda/detail/score_rows_launch.hpp"

namespace kvsift::cuda {

void max_score_rows(const MatrixView<const float>& scores, std::int32_t group, const std::int32_t* d_lengths,
                    const MatrixView<float>& out, const Context& ctx) {
  kvsift::detail::check_max_score_rows("cuda::max_score_rows", scores, group, d_lengths, out);
  KVSIFT_CUDA_CHECK(detail::launch_max_score_rows(scores, group, d_lengths, out, ctx.stream));
}

}  // namespace kvsift::cuda
