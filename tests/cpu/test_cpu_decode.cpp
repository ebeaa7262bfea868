// CPU decode attention at every SIMD level this machine runs, against kvsift's fp64 reference.
#include <gtest/gtest.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "attention_check.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/decode.hpp"
#include "kvsift/cpu/detail/decode_kernels.hpp"
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
/// With `split_rows`, a workspace of cpu::decode_workspace_bytes (poisoned with NaN bytes) lets rows run on
/// several threads.
template <class T>
std::pair<std::vector<T>, std::vector<float>> run_cpu(HostDecodeProblem<T>& p, bool sparse, cpu::ThreadPool* pool = nullptr,
                                                      bool split_rows = false) {
  std::vector<T> o(p.q.size());
  std::memset(o.data(), 0xff, o.size() * sizeof(T));
  std::vector<float> lse(std::size_t(p.spec.batch) * p.spec.q_heads, test::kPoison);
  const auto out = StateView<T>::packed(o.data(), lse.data(), p.spec.batch, p.spec.q_heads, p.spec.head_dim);
  const std::size_t ws_bytes =
      split_rows ? cpu::decode_workspace_bytes(p.spec.batch, p.spec.q_heads, p.spec.kv_heads, p.spec.head_dim, pool) : 0;
  struct alignas(WorkspaceLayout::kAlignment) Block {
    std::byte bytes[WorkspaceLayout::kAlignment];
  };
  Block poisoned;
  std::memset(poisoned.bytes, 0xff, sizeof(poisoned.bytes));
  std::vector<Block> ws_storage((ws_bytes + sizeof(Block) - 1) / sizeof(Block), poisoned);
  const std::span<std::byte> workspace(reinterpret_cast<std::byte*>(ws_storage.data()), ws_bytes);
  const auto go = [&](auto kv) {
    if (sparse) {
      cpu::sparse_decode(p.q_view(), kv, p.selection(), out, {}, pool, workspace);
    } else {
      cpu::dense_decode(p.q_view(), kv, out, {}, pool, workspace);
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

TEST_F(CpuDecode, RowsSplitOverThreadsMatchTheReference) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (int threads : {2, 3, 16}) {
    cpu::ThreadPool pool(threads);
    for (int trial = 0; trial < 6; ++trial) {
      const std::int32_t kv_heads = rng.uniform_int(1, threads - 1 < 2 ? 1 : 2);  // fewer rows than threads
      const std::int32_t group = std::vector<std::int32_t>{1, 4, 8}[rng.uniform_int(0, 2)];
      const std::int32_t tokens = rng.uniform_int(600, 3000);
      const std::int32_t k = std::vector<std::int32_t>{0, 520, tokens}[rng.uniform_int(0, 2)];
      const CaseSpec spec{1, group * kv_heads, kv_heads, 128, tokens, k,
                          std::vector<std::int32_t>{0, 16}[rng.uniform_int(0, 1)], rng.uniform_int(0, 1) == 1, false};
      SCOPED_TRACE(fmt::format("{} threads, {}", threads, test::describe(spec)));
      // There are fewer rows than threads, so the workspace is what lets rows split.
      ASSERT_GT(cpu::decode_workspace_bytes(spec.batch, spec.q_heads, spec.kv_heads, spec.head_dim, &pool), 0u);
      HostDecodeProblem<bfloat16> p(rng, spec);
      const auto [o, lse] = run_cpu(p, k > 0, &pool, true);
      test::expect_close(o, lse, p.reference(k > 0), k > 0 ? "sparse" : "dense");
    }
  }
}

TEST(CpuDecodeSplits, KeepEveryThreadBusy) {
  using cpu::detail::decode_splits;
  EXPECT_EQ(decode_splits(8, 16), 2);
  EXPECT_EQ(decode_splits(8, 12), 3);  // 24 chunks, 2 per thread: 2/3 of a row each, against a whole row with 2
  EXPECT_EQ(decode_splits(1, 16), 16);
  EXPECT_EQ(decode_splits(4, 5), 5);
  EXPECT_EQ(decode_splits(16, 8), 1);
  EXPECT_EQ(decode_splits(8, 16, 300), 1);   // a chunk would be shorter than kMinTokensPerSplit
  EXPECT_EQ(decode_splits(1, 16, 1024), 4);  // chunks of 256 tokens
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

  // A row of 1024 tokens on 4 threads splits in 4 and needs the workspace that decode_workspace_bytes sizes.
  cpu::ThreadPool pool(4);
  std::vector<half> kk(1024 * 64, from_float<half>(0.5f)), vv(kk.size()), qq(64, from_float<half>(1.0f)), oo(64);
  const auto dense_with = [&](std::span<std::byte> workspace) {
    cpu::dense_decode(QueryView<const half>::packed(qq.data(), 1, 1, 64),
                      ContiguousKVView<const half>::packed(kk.data(), vv.data(), 1, 1, 1024, 64),
                      StateView<half>::packed(oo.data(), lse.data(), 1, 1, 64), {}, &pool, workspace);
  };
  const std::size_t needed = cpu::decode_workspace_bytes(1, 1, 1, 64, &pool);
  alignas(WorkspaceLayout::kAlignment) static std::byte buffer[8192];
  ASSERT_LE(needed, sizeof(buffer));
  test::expect_error([&] { dense_with({buffer, needed - 256}); }, "workspace too small: 'partial_lse' needs bytes");
  test::expect_error([&] { dense_with({buffer + 4, needed}); }, "is not 256-byte aligned");
  test::expect_error([] { cpu::decode_workspace_bytes(1, 0, 1, 64, nullptr); }, "q_heads (= 0)");
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
