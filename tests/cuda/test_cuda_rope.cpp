// CUDA RoPE (cuda/rope.hpp) against its CPU twin (whose tests check it against fp64 references from the HF
// formulas): the table within one fp32 ulp of the CPU's (the device's fp64 pow/log/cos/sin may round otherwise),
// every rotation bit for bit from the same table (fp32, fp16, bf16; heads with strides, key rows; both layouts,
// partial rotary dims, every scaling; inverse; lengths as positions with an offset; rotation to a
// fixed position); positions outside the table give NaN rotary channels;
// table + rotations captured in a CUDA graph replay the eager results; refused inputs are refused before any
// device call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/rope.hpp"
#include "kvsift/cuda/rope.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::same_bytes;
using test::Random;

std::vector<RopeConfig> scalings(std::int32_t rotary, RopeLayout layout) {
  return {
      {.theta = 10000.0, .rotary_dim = rotary, .layout = layout},
      {.theta = 10000.0, .rotary_dim = rotary, .layout = layout, .scaling = {.kind = RopeScaling::linear, .factor = 4.0}},
      {.theta = 500000.0, .rotary_dim = rotary, .layout = layout,
       .scaling = {.kind = RopeScaling::llama3, .factor = 8.0, .original_max_position_embeddings = 8192}},
      {.theta = 1000000.0, .rotary_dim = rotary, .layout = layout,
       .scaling = {.kind = RopeScaling::yarn, .factor = 4.0, .original_max_position_embeddings = 32768}},
  };
}

/// A table built on the CPU and its device copy (the rotations compare bit for bit from one table).
struct Tables {
  std::vector<float> cos, sin;
  DeviceBuffer<float> d_cos, d_sin;
  RopeTableView host, device;
  Tables(const RopeConfig& c, std::int32_t head_dim, std::int32_t positions)
      : cos(RopeTableView::elements(c, head_dim, positions)), sin(cos.size()) {
    host = RopeTableView::make(c, head_dim, positions, cos.data(), sin.data());
    cpu::build_rope_table(c, host);
    d_cos = DeviceBuffer<float>(cos);
    d_sin = DeviceBuffer<float>(sin);
    device = RopeTableView::make(c, head_dim, positions, d_cos.data(), d_sin.data());
  }
};

class CudaRope : public test::GpuTest {};

TEST_F(CudaRope, TableIsWithinAnUlpOfTheCpus) {
  const std::int32_t positions = 131072;
  for (const RopeConfig& c : scalings(96, RopeLayout::neox)) {
    SCOPED_TRACE(testing::Message() << "scaling " << int(c.scaling.kind));
    Tables t(c, 128, positions);
    DeviceBuffer<float> d_cos(t.cos.size()), d_sin(t.cos.size());
    d_cos.poison();
    d_sin.poison();
    cuda::build_rope_table(c, RopeTableView::make(c, 128, positions, d_cos.data(), d_sin.data()), nullptr);
    const auto cos = d_cos.download(), sin = d_sin.download();
    std::size_t differing = 0;
    for (std::size_t e = 0; e < cos.size(); ++e) {
      ASSERT_NEAR(cos[e], t.cos[e], 6e-8f) << e;  // also fails on an unwritten (NaN) entry
      ASSERT_NEAR(sin[e], t.sin[e], 6e-8f) << e;
      differing += cos[e] != t.cos[e] || sin[e] != t.sin[e];
    }
    EXPECT_LT(differing, cos.size() / 100) << "more than rare last-bit differences";
  }
}

template <class T>
void check_rotations_equal_the_cpu(Random& rng) {
  const std::int32_t batch = 7, heads = 5, d = 128, positions = 20000;
  const std::int64_t head_stride = d + 8, batch_stride = heads * head_stride + 3;
  for (const auto& [rotary, layout] : {std::pair{128, RopeLayout::neox}, std::pair{96, RopeLayout::neox},
                                       std::pair{64, RopeLayout::interleaved}}) {
    for (const RopeConfig& c : scalings(rotary, layout)) {
      SCOPED_TRACE(testing::Message() << "rotary " << rotary << " layout " << int(layout) << " scaling "
                                      << int(c.scaling.kind));
      Tables t(c, d, positions);
      const auto x = test::to_storage<T>(rng.normal(std::size_t(batch_stride) * batch, 2.0f));
      std::vector<std::int32_t> pos(batch);
      for (int b = 0; b < batch; ++b) pos[b] = rng.uniform_int(0, positions - 1);
      DeviceBuffer<std::int32_t> d_pos(pos);
      const auto heads_view = [&](T* data) { return HeadsView<T>{data, batch, heads, d, batch_stride, head_stride}; };
      // Lengths as positions (offset -1) and A²ATS's fixed target: |2048 - (lengths - 1)| within the table.
      std::vector<std::int32_t> lengths(batch);
      for (auto& l : lengths) l = rng.uniform_int(1, positions);
      DeviceBuffer<std::int32_t> d_lengths(lengths);
      for (int mode = 0; mode < 4; ++mode) {  // forward, inverse, inverse from the lengths, to a target
        std::vector<T> expected = x;
        DeviceBuffer<T> d_x(x);
        if (mode == 3) {
          cpu::rotate_to_position(heads_view(expected.data()), lengths.data(), -1, 2048, t.host);
          cuda::rotate_to_position(heads_view(d_x.data()), d_lengths.data(), -1, 2048, t.device, nullptr);
        } else if (mode == 2) {
          cpu::apply_rope(heads_view(expected.data()), lengths.data(), -1, t.host, true);
          cuda::apply_rope(heads_view(d_x.data()), d_lengths.data(), -1, t.device, true, nullptr);
        } else {
          cpu::apply_rope(heads_view(expected.data()), pos.data(), t.host, mode == 1);
          cuda::apply_rope(heads_view(d_x.data()), d_pos.data(), t.device, mode == 1, nullptr);
        }
        ASSERT_TRUE(same_bytes(d_x.download(), expected)) << "mode " << mode;
      }
      // Key rows: one position per row, a row stride past the head_dim.
      const std::int64_t rows = 301, stride = d + 4;
      const auto k = test::to_storage<T>(rng.normal(std::size_t(rows * stride)));
      std::vector<std::int32_t> row_pos(rows);
      for (auto& p : row_pos) p = rng.uniform_int(0, positions - 1);
      DeviceBuffer<std::int32_t> d_row_pos(row_pos);
      for (const bool inverse : {false, true}) {
        std::vector<T> expected = k;
        DeviceBuffer<T> d_k(k);
        cpu::apply_rope(MatrixView<T>{expected.data(), rows, d, stride}, row_pos.data(), t.host, inverse);
        cuda::apply_rope(MatrixView<T>{d_k.data(), rows, d, stride}, d_row_pos.data(), t.device, inverse, nullptr);
        ASSERT_TRUE(same_bytes(d_k.download(), expected)) << "rows, inverse " << inverse;
      }
    }
  }
}

TEST_F(CudaRope, RotationsEqualTheCpuF32) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_rotations_equal_the_cpu<float>(rng);
}
TEST_F(CudaRope, RotationsEqualTheCpuF16) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_rotations_equal_the_cpu<half>(rng);
}
TEST_F(CudaRope, RotationsEqualTheCpuBf16) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_rotations_equal_the_cpu<bfloat16>(rng);
}

TEST_F(CudaRope, PositionsOutsideTheTableGiveNanRotaryChannels) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t batch = 4, heads = 2, d = 64;
  const RopeConfig c{.rotary_dim = 32};
  Tables t(c, d, 100);
  const auto x = rng.normal(std::size_t(batch) * heads * d);
  // Positions (plain, and as lengths with offset -1), and positions rotated to target 50.
  const std::vector<std::int32_t> pos{5, -1, 100, 99}, lengths{6, 0, 101, 100};
  const std::vector<std::int32_t> from{5, 150, 149, -1};  // to 50: by 45, -100 (outside), -99, a negative position
  DeviceBuffer<std::int32_t> d_pos(pos), d_lengths(lengths), d_from(from);
  for (int mode = 0; mode < 3; ++mode) {
    DeviceBuffer<float> d_x(x);
    const auto view = HeadsView<float>::packed(d_x.data(), batch, heads, d);
    std::vector<bool> inside(batch);
    for (int b = 0; b < batch; ++b) {
      inside[b] = mode == 2 ? from[b] >= 0 && std::abs(50 - from[b]) < 100 : pos[b] >= 0 && pos[b] < 100;
    }
    if (mode == 0) cuda::apply_rope(view, d_pos.data(), t.device, false, nullptr);
    if (mode == 1) cuda::apply_rope(view, d_lengths.data(), -1, t.device, true, nullptr);
    if (mode == 2) cuda::rotate_to_position(view, d_from.data(), 0, 50, t.device, nullptr);
    const auto got = d_x.download();
    for (int b = 0; b < batch; ++b) {
      for (int h = 0; h < heads; ++h) {
        for (int ch = 0; ch < d; ++ch) {
          const std::size_t e = (std::size_t(b) * heads + h) * d + ch;
          if (ch >= 32) {
            ASSERT_EQ(got[e], x[e]) << "channel past rotary_dim changed";
          } else {
            ASSERT_EQ(std::isnan(got[e]), !inside[b]) << "mode " << mode << " b " << b << " ch " << ch;
          }
        }
      }
    }
  }
}

TEST_F(CudaRope, GraphReplayEqualsTheEagerRun) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t batch = 3, heads = 8, d = 128, positions = 4096;
  const RopeConfig c = scalings(128, RopeLayout::neox)[3];
  DeviceBuffer<float> d_cos(RopeTableView::elements(c, d, positions)), d_sin(d_cos.size());
  const auto table = RopeTableView::make(c, d, positions, d_cos.data(), d_sin.data());
  const auto x = test::to_storage<bfloat16>(rng.normal(std::size_t(batch) * heads * d));
  DeviceBuffer<bfloat16> d_x(x.size());
  std::vector<std::int32_t> pos(batch), lengths(batch);
  for (int b = 0; b < batch; ++b) pos[b] = rng.uniform_int(0, positions - 1), lengths[b] = rng.uniform_int(1, positions);
  DeviceBuffer<std::int32_t> d_pos(pos), d_lengths(lengths);
  const test::Stream stream;
  const cuda::Context ctx{stream};
  const auto view = HeadsView<bfloat16>::packed(d_x.data(), batch, heads, d);
  const auto step = [&] {
    cuda::build_rope_table(c, table, ctx);
    cuda::apply_rope(view, d_pos.data(), table, false, ctx);
    cuda::rotate_to_position(view, d_pos.data(), 0, 2048, table, ctx);
    cuda::apply_rope(view, d_lengths.data(), -1, table, true, ctx);
    cuda::rotate_to_position(view, d_lengths.data(), -1, 2048, table, ctx);
  };
  // `stream` does not wait for the legacy default stream, where cudaMemset and cudaMemcpy run.
  const auto reset = [&] {
    d_cos.poison();
    d_sin.poison();
    d_x.upload(x);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  };
  const auto outputs = [&] {
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return std::tuple(d_cos.download(), d_sin.download(), d_x.download());
  };
  reset();
  step();
  const auto eager = outputs();
  EXPECT_FALSE(std::any_of(std::get<0>(eager).begin(), std::get<0>(eager).end(), [](float v) { return std::isnan(v); }));
  const test::CapturedGraph graph(stream, [&] {
    step();
  });
  for (int replay = 0; replay < 3; ++replay) {
    reset();
    graph.launch();
    const auto got = outputs();
    EXPECT_TRUE(same_bytes(std::get<0>(got), std::get<0>(eager))) << "cos, replay " << replay;
    EXPECT_TRUE(same_bytes(std::get<1>(got), std::get<1>(eager))) << "sin, replay " << replay;
    EXPECT_TRUE(same_bytes(std::get<2>(got), std::get<2>(eager))) << "x, replay " << replay;
  }
}

TEST(CudaRopeBadInput, RefusedBeforeAnyDeviceCall) {
  // Host arrays stand in for device ones: every call here is refused before it reaches the device.
  const RopeConfig c{};
  std::vector<float> cos(64 * 100), sin(64 * 100), x(4 * 128);
  const auto table = RopeTableView::make(c, 128, 100, cos.data(), sin.data());
  const auto heads = HeadsView<float>::packed(x.data(), 2, 2, 128);
  const auto rows = MatrixView<float>::packed(x.data(), 4, 128);
  std::int32_t pos[4] = {};
  test::expect_error([&] { cuda::apply_rope(heads, nullptr, table, false, nullptr); },
                     {"cuda::apply_rope", "d_positions is a null pointer"});
  test::expect_error([&] { cuda::apply_rope(heads, nullptr, -1, table, true, nullptr); },
                     {"cuda::apply_rope", "d_positions is a null pointer"});
  test::expect_error([&] { cuda::rotate_to_position(heads, nullptr, -1, 2048, table, nullptr); },
                     {"cuda::rotate_to_position", "d_positions is a null pointer"});
  test::expect_error([&] { cuda::rotate_to_position(heads, pos, -1, -1, table, nullptr); },
                     {"cuda::rotate_to_position", "target (= -1) must be >= 0"});
  auto t = table;
  t.rotary_dim = 130;
  test::expect_error([&] { cuda::apply_rope(rows, pos, t, false, nullptr); },
                     {"cuda::apply_rope", "table.rotary_dim (= 130)", "[2, head_dim = 128]"});
  t = table, t.sin = nullptr;
  test::expect_error([&] { cuda::rotate_to_position(heads, pos, 0, 0, t, nullptr); },
                     "table.cos and table.sin must be non-null");
  t = table, t.attention_factor = -1.0f;
  test::expect_error([&] { cuda::apply_rope(heads, pos, t, true, nullptr); }, "table.attention_factor (= -1)");
  test::expect_error([&] { cuda::build_rope_table(RopeConfig{.layout = RopeLayout::interleaved}, table, nullptr); },
                     {"cuda::build_rope_table", "table.layout (0) != config.layout (1)"});
  test::expect_error(
      [&] {
        cuda::build_rope_table(RopeConfig{.scaling = {.kind = RopeScaling::llama3, .factor = 8.0}}, table, nullptr);
      },
      {"cuda::build_rope_table", "original_max_position_embeddings (= 0) must be positive"});
  const std::int32_t wide = 12290;
  test::expect_error(
      [&] { cuda::build_rope_table(c, RopeTableView::make(c, wide, 1, cos.data(), sin.data()), nullptr); },
      {"cuda::build_rope_table", "table.rotary_dim (= 12290) exceeds 12288"});
}

}  // namespace
}  // namespace kvsift
