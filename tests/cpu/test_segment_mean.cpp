// Segment means on the CPU (cpu/segment_mean.hpp) against an fp64 reference written here (each segment's
// weighted sum and weight in ascending row order, divided, rounded once: the contract's arithmetic, so the
// comparison is exact): fp32, fp16 and bf16 rows, strided views, weights or none, rows in no segment, empty
// segments and zero-weight segments (left unchanged), thread independence, and every refused input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/segment_mean.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::Random;

struct Problem {
  std::int64_t n;
  std::int32_t dim, segments, stride;
  std::vector<float> values;  ///< [n, stride], the rows' values (already representable in T)
  std::vector<std::int32_t> assignment;
  std::vector<float> weights;  ///< empty: unweighted
};

template <class T>
Problem make_problem(Random& rng, std::int64_t n, std::int32_t dim, std::int32_t segments, bool weighted) {
  Problem p{n, dim, segments, dim + 3, rng.normal(std::size_t(n) * (dim + 3), 3.0f), std::vector<std::int32_t>(n), {}};
  for (float& v : p.values) v = to_float(from_float<T>(v));
  // Segments 1 and the last get no rows; some rows belong to none (-1, or a segment id past the end).
  for (auto& a : p.assignment) {
    do a = rng.uniform_int(-1, segments);
    while (segments > 2 && (a == 1 || a == segments - 1));
  }
  if (weighted) {
    p.weights.resize(std::size_t(n));
    for (auto& w : p.weights) w = rng.uniform(0.0f, 4.0f);
    // Segment 0's weights sum to zero: it stays unchanged, but its rows are counted.
    for (std::int64_t i = 0; i < n; ++i) {
      if (p.assignment[i] == 0) p.weights[i] = 0.0f;
    }
  }
  return p;
}

struct Expected {
  std::vector<float> means;  ///< [segments, dim]: the previous value where a segment is left unchanged
  std::vector<std::int32_t> counts;
};

Expected reference(const Problem& p, const std::vector<float>& previous) {
  Expected e{previous, std::vector<std::int32_t>(p.segments, 0)};
  for (std::int32_t s = 0; s < p.segments; ++s) {
    double total = 0.0;
    std::vector<double> sum(p.dim, 0.0);
    for (std::int64_t i = 0; i < p.n; ++i) {
      if (p.assignment[i] != s) continue;
      ++e.counts[s];
      const double w = p.weights.empty() ? 1.0 : p.weights[i];
      total += w;
      for (std::int32_t c = 0; c < p.dim; ++c) sum[c] += w * double(p.values[i * p.stride + c]);
    }
    if (total == 0.0) continue;
    for (std::int32_t c = 0; c < p.dim; ++c) e.means[std::size_t(s) * p.dim + c] = float(sum[c] / total);
  }
  return e;
}

template <class T>
void check_against_reference(Random& rng) {
  cpu::ThreadPool pool(3);
  for (const auto& [n, dim, segments] : {std::tuple{1000L, 128, 37}, std::tuple{1L, 64, 1}, std::tuple{333L, 33, 5},
                                         std::tuple{4096L, 96, 300}}) {
    for (const bool weighted : {false, true}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " dim " << dim << " segments " << segments << " weighted " << weighted);
      const Problem p = make_problem<T>(rng, n, dim, segments, weighted);
      std::vector<T> rows(p.values.size());
      std::transform(p.values.begin(), p.values.end(), rows.begin(), [](float f) { return from_float<T>(f); });
      const auto previous = rng.normal(std::size_t(segments) * dim);
      const Expected expected = reference(p, previous);
      for (cpu::ThreadPool* threads : {static_cast<cpu::ThreadPool*>(nullptr), &pool}) {
        std::vector<float> means = previous;
        std::vector<std::int32_t> counts(segments, test::kPoisonIndex);
        cpu::Array<std::byte> workspace(cpu::segment_mean_workspace_bytes(n, segments));
        std::memset(workspace.data(), 0xff, workspace.size());
        cpu::segment_mean(MatrixView<const T>{rows.data(), n, dim, p.stride}, p.assignment.data(), segments,
                          weighted ? p.weights.data() : nullptr, MatrixView<float>::packed(means.data(), segments, dim),
                          counts.data(), workspace.bytes(), threads);
        ASSERT_EQ(counts, expected.counts);
        for (std::size_t e = 0; e < means.size(); ++e) {
          ASSERT_EQ(std::memcmp(&means[e], &expected.means[e], sizeof(float)), 0)
              << "segment " << e / dim << " column " << e % dim << ": " << means[e] << " vs " << expected.means[e];
        }
      }
    }
  }
}

class CpuSegmentMean : public test::SeededTest {};

TEST_F(CpuSegmentMean, EqualsTheFp64ReferenceF32) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_against_reference<float>(rng);
}
TEST_F(CpuSegmentMean, EqualsTheFp64ReferenceF16) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_against_reference<half>(rng);
}
TEST_F(CpuSegmentMean, EqualsTheFp64ReferenceBf16) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_against_reference<bfloat16>(rng);
}

TEST_F(CpuSegmentMean, MeanOfOneRowIsThatRowAndEqualRowsKeepTheirValue) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t dim = 16;
  auto rows = rng.normal(3 * dim);
  std::copy_n(rows.begin(), dim, rows.begin() + dim);  // rows 0 and 1 equal
  const std::vector<std::int32_t> assignment{0, 0, 1};
  const std::vector<float> weights{0.25f, 3.0f, 7.0f};
  std::vector<float> means(2 * dim, test::kPoison);
  std::vector<std::int32_t> counts(2);
  cpu::Array<std::byte> workspace(cpu::segment_mean_workspace_bytes(3, 2));
  cpu::segment_mean(MatrixView<const float>::packed(rows.data(), 3, dim), assignment.data(), 2, weights.data(),
                    MatrixView<float>::packed(means.data(), 2, dim), counts.data(), workspace.bytes());
  EXPECT_EQ(counts, (std::vector<std::int32_t>{2, 1}));
  for (int c = 0; c < dim; ++c) {
    EXPECT_EQ(means[c], rows[c]);
    EXPECT_EQ(means[dim + c], rows[2 * dim + c]);
  }
}

TEST(CpuSegmentMeanBadInput, RefusedWithTheirMessages) {
  std::vector<float> rows(10 * 8), means(3 * 8);
  std::vector<std::int32_t> assignment(10, 0), counts(3);
  cpu::Array<std::byte> workspace(cpu::segment_mean_workspace_bytes(10, 3));
  const auto x = MatrixView<const float>::packed(rows.data(), 10, 8);
  const auto m = MatrixView<float>::packed(means.data(), 3, 8);
  const auto run = [&](const MatrixView<const float>& r, const std::int32_t* a, std::int32_t segments,
                       const MatrixView<float>& out, std::int32_t* c, std::span<std::byte> ws) {
    cpu::segment_mean(r, a, segments, nullptr, out, c, ws);
  };
  test::expect_error([&] { run(x, nullptr, 3, m, counts.data(), workspace.bytes()); },
                     {"cpu::segment_mean", "assignment and counts must be non-null"});
  test::expect_error([&] { run(x, assignment.data(), 3, m, nullptr, workspace.bytes()); }, "assignment and counts");
  test::expect_error([&] { run(x, assignment.data(), 0, m, counts.data(), workspace.bytes()); },
                     "segments (= 0) must be positive");
  test::expect_error([&] { run(x, assignment.data(), 2, m, counts.data(), workspace.bytes()); },
                     "means is [3, 8]; expected [segments = 2, rows.cols = 8]");
  test::expect_error([&] { run(x, assignment.data(), 3, MatrixView<float>::packed(means.data(), 3, 7), counts.data(), workspace.bytes()); },
                     "means is [3, 7]; expected [segments = 3, rows.cols = 8]");
  test::expect_error([&] { run(MatrixView<const float>::packed(nullptr, 10, 8), assignment.data(), 3, m, counts.data(), workspace.bytes()); },
                     "cpu::segment_mean");
  test::expect_error([&] { run(x, assignment.data(), 3, m, counts.data(), workspace.bytes().first(workspace.size() - 256)); },
                     {"cpu::segment_mean", "workspace too small"});
  test::expect_error([] { cpu::segment_mean_workspace_bytes(0, 3); }, {"cpu::segment_mean_workspace_bytes", "rows (= 0)"});
  test::expect_error([] { cpu::segment_mean_workspace_bytes(std::int64_t(1) << 31, 3); }, "rows (= 2147483648)");
  test::expect_error([] { cpu::segment_mean_workspace_bytes(5, -1); }, "segments (= -1) must be positive");
}

}  // namespace
}  // namespace kvsift
