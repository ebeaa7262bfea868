// RoPE on CUDA (cuda/rope.hpp): the checks shared with the CPU (device contents unread), then the launchers
// of kernels/rope.cu.
#include "kvsift/cuda/rope.hpp"

#include "kvsift/core/detail/rope_checks.hpp"
#include "kvsift/core/detail/rope_instances.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/rope_launch.hpp"

namespace kvsift::cuda {
namespace {

constexpr std::int32_t kMaxTableRotaryDim = 2 * 48 * 1024 / 8;

double forward_scale(const RopeTableView& table, bool inverse) {
  return inverse ? 1.0 / double(table.attention_factor) : double(table.attention_factor);
}

/// x's vectors for the kernel: problem h, row b.
template <class T>
BatchedMatrixView<T> heads_rows(const HeadsView<T>& x) {
  return {x.data, x.heads, x.batch, x.head_dim, x.head_stride, x.batch_stride};
}

}  // namespace

void build_rope_table(const RopeConfig& config, const RopeTableView& table, const Context& ctx) {
  constexpr const char* where = "cuda::build_rope_table";
  kvsift::detail::check_rope_table_build(where, config, table);
  KVSIFT_CHECK(table.rotary_dim <= kMaxTableRotaryDim, where,
               "table.rotary_dim (= {}) exceeds {}: the kernel keeps the inverse frequencies in 48 KiB of shared memory",
               table.rotary_dim, kMaxTableRotaryDim);
  KVSIFT_CUDA_CHECK(detail::launch_build_rope_table(config, table, ctx.stream));
}

template <class T>
void apply_rope(const HeadsView<T>& x, const std::int32_t* d_positions, const RopeTableView& table, bool inverse,
                const Context& ctx) {
  apply_rope(x, d_positions, 0, table, inverse, ctx);
}

template <class T>
void apply_rope(const HeadsView<T>& x, const std::int32_t* d_positions, std::int32_t position_offset,
                const RopeTableView& table, bool inverse, const Context& ctx) {
  kvsift::detail::check_rope_rows("cuda::apply_rope", x, d_positions, table, "d_positions");
  const detail::RopeAmounts amounts{.values = d_positions, .offset = position_offset};
  KVSIFT_CUDA_CHECK(
      detail::launch_rope(heads_rows(x), amounts, table, inverse, forward_scale(table, inverse), ctx.stream));
}

template <class T>
void apply_rope(const MatrixView<T>& rows, const std::int32_t* d_positions, const RopeTableView& table, bool inverse,
                const Context& ctx) {
  kvsift::detail::check_rope_rows("cuda::apply_rope", rows, d_positions, table, "d_positions");
  const BatchedMatrixView<T> r{rows.data, 1, rows.rows, rows.cols, 0, rows.row_stride};
  KVSIFT_CUDA_CHECK(
      detail::launch_rope(r, {.values = d_positions}, table, inverse, forward_scale(table, inverse), ctx.stream));
}

template <class T>
void rotate_to_position(const HeadsView<T>& x, const std::int32_t* d_positions, std::int32_t position_offset,
                        std::int32_t target, const RopeTableView& table, const Context& ctx) {
  constexpr const char* where = "cuda::rotate_to_position";
  kvsift::detail::check_rope_rows(where, x, d_positions, table, "d_positions");
  kvsift::detail::check_rope_target(where, target);
  const detail::RopeAmounts amounts{.values = d_positions, .kind = detail::RopeAmountKind::to_target,
                                    .offset = position_offset, .target = target};
  KVSIFT_CUDA_CHECK(detail::launch_rope(heads_rows(x), amounts, table, /*inverse=*/false, 1.0, ctx.stream));
}

KVSIFT_STORAGE_TYPES(KVSIFT_ROPE_INSTANCES)

}  // namespace kvsift::cuda
