// CPU decode attention at every SIMD level this machine runs, against kvsift's fp64 reference.
#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "attention_check.hpp"
#include "kvsift/cpu/decode.hpp"
#include "kvsift/cpu/simd.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using cpu::SimdLevel;
using test::CaseSpec;
using test::HostDecodeProblem;
using test::Random;

std::vector<SimdLevel> available_levels() {
  std::vector<SimdLevel> levels;
  for (SimdLevel l : {SimdLevel::scalar, SimdLevel::avx2, SimdLevel::avx512}) {
    if (l <= cpu::detected_simd_level()) levels.push_back(l);
  }
  return levels;
}

/// Runs the CPU kernels on a problem (poisoned outputs) and returns (O, LSE).
template <class T>
std::pair<std::vector<T>, std::vector<float>> run_cpu(HostDecodeProblem<T>& p, bool sparse, cpu::ThreadPool* pool = nullptr) {
  std::vector<T> o(p.q.size());
  std::memset(o.data(), 0xff, o.size() * sizeof(T));
  std::vector<float> lse(std::size_t(p.spec.batch) * p.spec.q_heads, test::kPoison);
  const auto out = StateView<T>::packed(o.data(), lse.data(), p.spec.batch, p.spec.q_heads, p.spec.head_dim);
  const auto go = [&](auto kv) {
    if (sparse) {
      cpu::sparse_decode(p.q_view(), kv, p.selection(), out, {}, pool);
    } else {
      cpu::dense_decode(p.q_view(), kv, out, {}, pool);
    }
  };
  if (p.spec.page_size == 0) {
    go(p.contiguous());
  } else {
    go(p.paged());
  }
  return {o, lse};
}

using CpuDecode = test::SeededTest;

TEST_F(CpuDecode, EverySimdLevelMatchesTheReference) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (SimdLevel level : available_levels()) {
    cpu::ScopedSimdLevel force(level);
    for (int trial = 0; trial < 16; ++trial) {
      const std::int32_t kv_heads = rng.uniform_int(1, 3);
      const std::int32_t group = std::vector<std::int32_t>{1, 2, 4, 5, 8, 12}[rng.uniform_int(0, 5)];
      const std::int32_t head_dim = std::vector<std::int32_t>{16, 33, 64, 100, 128, 256}[rng.uniform_int(0, 5)];
      const std::int32_t tokens = rng.uniform_int(1, 700);
      const std::int32_t k = std::vector<std::int32_t>{0, 1, 17, 300, tokens}[rng.uniform_int(0, 4)];
      const CaseSpec spec{rng.uniform_int(1, 4), group * kv_heads, kv_heads, head_dim, tokens, k,
                          std::vector<std::int32_t>{0, 16, 64}[rng.uniform_int(0, 2)], rng.uniform_int(0, 1) == 1};
      const auto check = [&]<class T>(T) {
        SCOPED_TRACE(fmt::format("{} {} {}", cpu::simd_level_name(level), test::dtype_label<T>(), test::describe(spec)));
        HostDecodeProblem<T> p(rng, spec);
        const auto [o, lse] = run_cpu(p, k > 0);
        test::expect_close(o, lse, p.reference(k > 0), k > 0 ? "sparse" : "dense");
      };
      check(half{});
      check(bfloat16{});
    }
  }
}

TEST_F(CpuDecode, FullSelectionInOrderEqualsDenseBitForBit) {
  for (SimdLevel level : available_levels()) {
    cpu::ScopedSimdLevel force(level);
    HostDecodeProblem<bfloat16> p(rng, CaseSpec{2, 8, 2, 128, 333, 333, 16, false, false});
    for (std::size_t row = 0; row < p.sel_counts.size(); ++row) {
      std::iota(p.sel_indices.begin() + row * 333, p.sel_indices.begin() + (row + 1) * 333, 0);
    }
    const auto sparse = run_cpu(p, true), dense = run_cpu(p, false);
    EXPECT_EQ(0, std::memcmp(sparse.first.data(), dense.first.data(), sparse.first.size() * 2)) << simd_level_name(level);
    EXPECT_EQ(sparse.second, dense.second);
  }
}

TEST_F(CpuDecode, ThreadCountDoesNotChangeTheResult) {
  HostDecodeProblem<half> p(rng, CaseSpec{4, 16, 4, 64, 900, 250, 0, true});
  const auto alone = run_cpu(p, true);
  for (int threads : {1, 2, 3, 7}) {
    cpu::ThreadPool pool(threads);
    const auto pooled = run_cpu(p, true, &pool);
    EXPECT_EQ(0, std::memcmp(alone.first.data(), pooled.first.data(), alone.first.size() * 2)) << threads;
    EXPECT_EQ(alone.second, pooled.second);
  }
}

TEST_F(CpuDecode, EmptyRowsGiveMinusInfinity) {
  HostDecodeProblem<half> p(rng, CaseSpec{2, 4, 2, 64, 100, 10, 0, false});
  std::fill(p.sel_counts.begin(), p.sel_counts.end(), 0);
  const auto [o, lse] = run_cpu(p, true);
  for (float x : lse) EXPECT_EQ(x, -INFINITY);
  for (half x : o) EXPECT_EQ(to_float(x), 0.0f);
}

TEST_F(CpuDecode, MergeMatchesTheReferenceAndIgnoresEmptyStates) {
  const std::int32_t batch = 2, heads = 3, d = 40;
  std::vector<std::vector<float>> os, lses;
  std::vector<StateView<const float>> parts;
  for (int i = 0; i < 4; ++i) {
    os.push_back(rng.normal(std::size_t(batch) * heads * d));
    lses.push_back(rng.normal(std::size_t(batch) * heads, 10.0f));
    if (i == 2) std::fill(lses.back().begin(), lses.back().end(), -INFINITY);
    parts.push_back(StateView<const float>::packed(os[i].data(), lses[i].data(), batch, heads, d));
  }
  test::HostState ref(batch, heads, d), got(batch, heads, d);
  reference::merge_states<float, float>(parts, ref.view);
  cpu::merge_states<float, float>(parts, got.view);
  for (std::size_t i = 0; i < got.o.size(); ++i) EXPECT_NEAR(got.o[i], ref.o[i], 1e-5 * (1 + std::abs(ref.o[i])));
  for (std::size_t i = 0; i < got.lse.size(); ++i) EXPECT_NEAR(got.lse[i], ref.lse[i], 1e-5 * std::abs(ref.lse[i]));
  test::HostState alone(batch, heads, d), with_empty(batch, heads, d);
  cpu::merge_states<float, float>(std::vector{parts[0]}, alone.view);
  cpu::merge_states<float, float>(std::vector{parts[2], parts[0], parts[2]}, with_empty.view);
  EXPECT_EQ(alone.o, os[0]);
  EXPECT_EQ(with_empty.o, os[0]);
  EXPECT_EQ(with_empty.lse, lses[0]);
}

TEST(CpuDecodeBadInput, RefusedWithClearErrors) {
  std::vector<half> q(2 * 4 * 300), k(2 * 2 * 8 * 300), v(k.size()), o(q.size());
  std::vector<float> lse(8);
  test::expect_error(
      [&] {
        cpu::dense_decode(QueryView<const half>::packed(q.data(), 2, 4, 300),
                          ContiguousKVView<const half>::packed(k.data(), v.data(), 2, 2, 8, 300),
                          StateView<half>::packed(o.data(), lse.data(), 2, 4, 300));
      },
      "head_dim (= 300) exceeds the CPU decode kernels' limit of 256");
  test::expect_error([] { cpu::ThreadPool bad(0); }, "threads (= 0) must be >= 1");
}

TEST(CpuThreadPool, CoversTheRangeOnceAndRethrows) {
  cpu::ThreadPool pool(4);
  std::vector<int> hits(1001, 0);
  pool.parallel_for(1001, [&](std::int64_t b, std::int64_t e) {
    for (auto i = b; i < e; ++i) ++hits[i];
  });
  for (int h : hits) ASSERT_EQ(h, 1);
  EXPECT_THROW(pool.parallel_for(8, [](std::int64_t b, std::int64_t) {
    if (b > 0) throw std::runtime_error("chunk failed");
  }), std::runtime_error);
}

}  // namespace
}  // namespace kvsift
