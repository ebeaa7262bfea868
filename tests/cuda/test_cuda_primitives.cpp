// CUDA primitives against their CPU twins: top-K (exact, same tie rule), GEMV scores, gather, RoPE rows.
#include <gtest/gtest.h>

#include <string>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/topk.hpp"
#include "kvsift/cuda/primitives.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::Random;

using CudaPrimitives = test::GpuTest;

void check_topk(Random& rng, std::int64_t rows, std::int32_t n, std::int32_t k) {
  SCOPED_TRACE(testing::Message() << "rows " << rows << " n " << n << " k " << k);
  std::vector<float> scores(std::size_t(rows) * n);
  for (auto& s : scores) s = float(rng.uniform_int(-50, 50)) * 0.25f;  // many ties
  for (int i = 0; i < 5 && n > 10; ++i) {
    scores[rng.uniform_int(0, int(scores.size()) - 1)] = NAN;
    scores[rng.uniform_int(0, int(scores.size()) - 1)] = -INFINITY;
    scores[rng.uniform_int(0, int(scores.size()) - 1)] = INFINITY;
    scores[rng.uniform_int(0, int(scores.size()) - 1)] = -0.0f;
  }
  DeviceBuffer<float> d_scores(scores);
  DeviceBuffer<std::int32_t> d_out(std::max<std::size_t>(1, std::size_t(rows) * k));
  d_out.poison();
  const std::size_t bytes = cuda::topk_workspace_bytes(rows, n, k);
  DeviceBuffer<std::byte> ws(bytes);
  cuda::topk(MatrixView<const float>::packed(d_scores.data(), rows, n), k, d_out.data(), {ws.data(), bytes}, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const auto got = d_out.download();
  std::vector<std::int32_t> expected(k);
  std::vector<std::uint64_t> scratch;
  for (std::int64_t r = 0; r < rows; ++r) {
    cpu::topk_indices({scores.data() + r * n, std::size_t(n)}, k, expected, scratch);
    ASSERT_EQ(std::vector<std::int32_t>(got.begin() + r * k, got.begin() + (r + 1) * k), expected) << "row " << r;
  }
}

TEST_F(CudaPrimitives, TopKEqualsTheCpuTopKExactly) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (int trial = 0; trial < 12; ++trial) {
    const std::int32_t n = rng.uniform_int(1, 20000);
    const std::int32_t k = std::vector<std::int32_t>{0, 1, 17, n / 2, n}[rng.uniform_int(0, 4)];
    check_topk(rng, rng.uniform_int(1, 9), n, k);
  }
  check_topk(rng, 8, 131072, 2048);
  check_topk(rng, 1, 1 << 20, 8192);
}

TEST_F(CudaPrimitives, GemvGatherAndRopeAgreeWithTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t n = 3001, d = 128;
  const auto rows_f = rng.normal(std::size_t(n) * d);
  const auto rows = test::to_storage<bfloat16>(rows_f);
  const auto q = rng.normal(d);
  std::vector<float> cpu_scores(n);
  cpu::gemv_scores<bfloat16>(q, MatrixView<const bfloat16>::packed(rows.data(), n, d), 0.3f, cpu_scores);
  DeviceBuffer<bfloat16> d_rows(rows);
  DeviceBuffer<float> d_q(q), d_scores(n);
  d_scores.poison();
  cuda::gemv_scores<bfloat16>(d_q.data(), MatrixView<const bfloat16>::packed(d_rows.data(), n, d), 0.3f, d_scores.data(), nullptr);
  const auto gpu_scores = d_scores.download();
  for (std::int32_t i = 0; i < n; ++i) ASSERT_NEAR(gpu_scores[i], cpu_scores[i], 1e-4 * (1 + std::abs(cpu_scores[i])));

  std::vector<std::int32_t> idx(500);
  for (auto& i : idx) i = rng.uniform_int(0, n - 1);
  DeviceBuffer<std::int32_t> d_idx(idx);
  DeviceBuffer<bfloat16> d_dst(idx.size() * d);
  d_dst.poison();
  cuda::gather_rows<bfloat16>(MatrixView<const bfloat16>::packed(d_rows.data(), n, d), d_idx.data(), 500,
                              MatrixView<bfloat16>::packed(d_dst.data(), 500, d), nullptr);
  const auto gathered = d_dst.download();
  for (std::size_t r = 0; r < idx.size(); ++r) {
    for (std::int32_t c = 0; c < d; ++c) ASSERT_EQ(gathered[r * d + c].bits, rows[std::size_t(idx[r]) * d + c].bits);
  }

  for (RopeLayout layout : {RopeLayout::neox, RopeLayout::interleaved}) {
    auto x = rng.normal(std::size_t(n) * d);
    std::vector<std::int64_t> pos(n);
    for (auto& p : pos) p = rng.uniform_int(0, 131071);
    const RopeConfig cfg{.theta = 500000.0, .rotary_dim = 96, .layout = layout};
    DeviceBuffer<float> d_x(x);
    DeviceBuffer<std::int64_t> d_pos(pos);
    cuda::apply_rope_rows(MatrixView<float>::packed(d_x.data(), n, d), d_pos.data(), cfg, false, nullptr);
    cpu::apply_rope_rows(MatrixView<float>::packed(x.data(), n, d), pos, cfg);
    const auto gpu = d_x.download();
    for (std::size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(gpu[i], x[i], 1e-5f * (1 + std::abs(x[i])));
  }
}

TEST(CudaPrimitivesBadInput, RefusedBeforeAnyDeviceCall) {
  test::expect_error([] { cuda::topk_workspace_bytes(4, 100, 101); }, "k (= 101) is outside [0, n = 100]");
}

}  // namespace
}  // namespace kvsift
