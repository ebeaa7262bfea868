// CUDA segment means (cuda/segment_mean.hpp) against the CPU twin (whose tests check it against an fp64
// reference): means and counts bit for bit (the same fp64 sums in the same order) for fp32, fp16 and bf16 rows,
// strided views, weights or none, rows in no segment, empty and zero-weight segments (means left as they were),
// with poisoned counts and workspace; a captured CUDA graph replays the eager results; refused inputs are
// refused before any device call. cuda::kmeans_batched's centroid updates run on it (test_cuda_batched_kmeans.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/segment_mean.hpp"
#include "kvsift/cuda/segment_mean.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::Random;

struct Problem {
  std::int64_t n;
  std::int32_t dim, segments, stride;
  std::vector<float> values;
  std::vector<std::int32_t> assignment;
  std::vector<float> weights;
  std::vector<float> previous;  ///< means before the call [segments, dim]
};

Problem make_problem(Random& rng, std::int64_t n, std::int32_t dim, std::int32_t segments, bool weighted) {
  Problem p{n, dim, segments, dim + 5, rng.normal(std::size_t(n) * (dim + 5), 3.0f), std::vector<std::int32_t>(n), {},
            rng.normal(std::size_t(segments) * dim)};
  for (auto& a : p.assignment) {
    do a = rng.uniform_int(-2, segments + 1);
    while (segments > 2 && a == 1);  // segment 1 stays empty
  }
  if (weighted) {
    p.weights.resize(std::size_t(n));
    for (auto& w : p.weights) w = rng.uniform(0.0f, 4.0f);
    for (std::int64_t i = 0; i < n; ++i) {
      if (p.assignment[i] == 0) p.weights[i] = 0.0f;  // segment 0 weighs nothing: unchanged
    }
  }
  return p;
}

template <class T>
std::tuple<std::vector<float>, std::vector<std::int32_t>> on_cpu(const Problem& p, const std::vector<T>& rows) {
  std::vector<float> means = p.previous;
  std::vector<std::int32_t> counts(p.segments);
  cpu::Array<std::byte> workspace(cpu::segment_mean_workspace_bytes(p.n, p.segments));
  cpu::segment_mean(MatrixView<const T>{rows.data(), p.n, p.dim, p.stride}, p.assignment.data(), p.segments,
                    p.weights.empty() ? nullptr : p.weights.data(),
                    MatrixView<float>::packed(means.data(), p.segments, p.dim), counts.data(), workspace.bytes());
  return {means, counts};
}

/// Device copies of a problem, run with poisoned counts and workspace on `stream`.
template <class T>
struct DeviceProblem {
  DeviceBuffer<T> rows;
  DeviceBuffer<std::int32_t> assignment, counts;
  DeviceBuffer<float> weights, means;
  DeviceBuffer<std::byte> workspace;
  const Problem& p;
  DeviceProblem(const Problem& problem, const std::vector<T>& host_rows)
      : rows(host_rows), assignment(problem.assignment), counts(std::size_t(problem.segments)), weights(problem.weights),
        means(problem.previous), workspace(cuda::segment_mean_workspace_bytes(problem.n, problem.segments)), p(problem) {}
  void reset() {
    means.upload(p.previous);
    counts.poison();
    workspace.poison();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  }
  void run(cudaStream_t stream) {
    cuda::segment_mean(MatrixView<const T>{rows.data(), p.n, p.dim, p.stride}, assignment.data(), p.segments,
                       p.weights.empty() ? nullptr : weights.data(),
                       MatrixView<float>::packed(means.data(), p.segments, p.dim), counts.data(),
                       std::span<std::byte>(workspace.data(), workspace.size()), stream);
  }
};

template <class T>
void check_equal_to_the_cpu(Random& rng) {
  for (const auto& [n, dim, segments] : {std::tuple{5000L, 128, 64}, std::tuple{1L, 64, 1}, std::tuple{777L, 200, 9},
                                         std::tuple{20000L, 96, 4096}}) {
    for (const bool weighted : {false, true}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " dim " << dim << " segments " << segments << " weighted " << weighted);
      const Problem p = make_problem(rng, n, dim, segments, weighted);
      std::vector<T> rows(p.values.size());
      std::transform(p.values.begin(), p.values.end(), rows.begin(), [](float f) { return from_float<T>(f); });
      const auto [means, counts] = on_cpu(p, rows);
      DeviceProblem<T> d(p, rows);
      d.reset();
      d.run(nullptr);
      EXPECT_EQ(d.counts.download(), counts);
      const auto got = d.means.download();
      ASSERT_EQ(std::memcmp(got.data(), means.data(), means.size() * sizeof(float)), 0);
    }
  }
}

class CudaSegmentMean : public test::GpuTest {};

TEST_F(CudaSegmentMean, EqualsTheCpuF32) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_equal_to_the_cpu<float>(rng);
}
TEST_F(CudaSegmentMean, EqualsTheCpuF16) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_equal_to_the_cpu<half>(rng);
}
TEST_F(CudaSegmentMean, EqualsTheCpuBf16) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_equal_to_the_cpu<bfloat16>(rng);
}

TEST_F(CudaSegmentMean, GraphReplayEqualsTheEagerRun) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const Problem p = make_problem(rng, 3000, 128, 100, true);
  std::vector<bfloat16> rows(p.values.size());
  std::transform(p.values.begin(), p.values.end(), rows.begin(), [](float f) { return from_float<bfloat16>(f); });
  DeviceProblem<bfloat16> d(p, rows);
  const test::Stream stream;
  const auto outputs = [&] {
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return std::pair(d.means.download(), d.counts.download());
  };
  d.reset();
  d.run(stream);
  const auto eager = outputs();
  EXPECT_EQ(eager.second, std::get<1>(on_cpu(p, rows)));
  const test::CapturedGraph graph(stream, [&] {
    d.run(stream);
  });
  for (int replay = 0; replay < 3; ++replay) {
    d.reset();
    graph.launch();
    const auto got = outputs();
    EXPECT_EQ(std::memcmp(got.first.data(), eager.first.data(), got.first.size() * sizeof(float)), 0) << replay;
    EXPECT_EQ(got.second, eager.second) << replay;
  }
}

TEST_F(CudaSegmentMean, UndersizedWorkspaceIsRefused) {
  const Problem p = make_problem(rng, 100, 16, 4, false);
  DeviceProblem<float> d(p, p.values);
  test::expect_error(
      [&] {
        cuda::segment_mean(MatrixView<const float>{d.rows.data(), p.n, p.dim, p.stride}, d.assignment.data(), p.segments,
                           nullptr, MatrixView<float>::packed(d.means.data(), p.segments, p.dim), d.counts.data(),
                           std::span<std::byte>(d.workspace.data(), d.workspace.size() - 256), nullptr);
      },
      {"cuda::segment_mean", "workspace too small", "needs bytes"});
}

TEST(CudaSegmentMeanBadInput, RefusedBeforeAnyDeviceCall) {
  // Host arrays stand in for device ones: every call here is refused before it reaches the device.
  std::vector<float> rows(10 * 8), means(3 * 8);
  std::vector<std::int32_t> assignment(10), counts(3);
  alignas(256) static std::byte workspace[256];
  const auto x = MatrixView<const float>::packed(rows.data(), 10, 8);
  const auto m = MatrixView<float>::packed(means.data(), 3, 8);
  const std::span<std::byte> ws(workspace, sizeof(workspace));
  test::expect_error([&] { cuda::segment_mean(x, nullptr, 3, nullptr, m, counts.data(), ws, nullptr); },
                     {"cuda::segment_mean", "assignment and counts must be non-null"});
  test::expect_error([&] { cuda::segment_mean(x, assignment.data(), 4, nullptr, m, counts.data(), ws, nullptr); },
                     "means is [3, 8]; expected [segments = 4, rows.cols = 8]");
  std::vector<float> wide(8'388'608 + 1), wide_means(8'388'608 + 1);
  test::expect_error(
      [&] {
        cuda::segment_mean(MatrixView<const float>::packed(wide.data(), 1, 8'388'608 + 1), assignment.data(), 1, nullptr,
                           MatrixView<float>::packed(wide_means.data(), 1, 8'388'608 + 1), counts.data(), ws, nullptr);
      },
      "rows.cols (= 8388609) exceeds the launch limit of 8388480 columns");
  test::expect_error([] { cuda::segment_mean_workspace_bytes(0, 3); }, {"cuda::segment_mean_workspace_bytes", "rows (= 0)"});
  test::expect_error([] { cuda::segment_mean_workspace_bytes(5, 0); }, "segments (= 0) must be positive");
}

}  // namespace
}  // namespace kvsift
