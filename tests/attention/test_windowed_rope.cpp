// Windowed-RoPE decode attention on the CPU (selectors/a2ats/windowed_rope.hpp, A²ATS's eq. 11) against an fp64 reference of
// the equation written here: pre-RoPE keys and queries drawn at random, rotated to their absolute positions by the
// fp64 apply_rope of core/rope.hpp; the last w tokens by q.k over post-RoPE rows, the sinks and the selection by
// (q rotated by b - p).k_pre. Dense (every middle token listed) and sparse selections in any order, GQA groups 1 and
// 4, fp16 and bf16 caches, outputs in the storage type and in fp32, contiguous and paged caches, with and without a
// pool. Then the two cases where the equation is ordinary attention, and every refusal.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

#include "attention_check.hpp"
#include "kvsift/selectors/a2ats/windowed_rope.hpp"
#include "kvsift/cpu/backend.hpp"
#include "test_util.hpp"
#include "windowed_rope_problem.hpp"

namespace kvsift::test {
namespace {

/// Runs windowed_rope_decode into a poisoned output of type TO and returns it as (O, LSE).
template <class T, class TO>
std::pair<std::vector<TO>, std::vector<float>> run_wrope(WropeProblem<T>& p, const WindowedRopeParams& params,
                                                         cpu::ThreadPool* pool) {
  const WropeSpec& s = p.spec;
  const cpu::Context ctx{pool};
  cpu::Array<std::byte> workspace(windowed_rope_workspace_bytes<T>(
      {s.batch, s.q_heads, s.kv_heads, s.head_dim, p.capacity()}, params, ctx));
  std::vector<TO> o(std::size_t(s.batch) * s.q_heads * s.head_dim, from_float<TO>(kPoison));
  std::vector<float> lse(std::size_t(s.batch) * s.q_heads, kPoison);
  windowed_rope_decode(p.q_view(), p.post_cache(), p.pre_cache(), p.selection(),
                       StateView<TO>::packed(o.data(), lse.data(), s.batch, s.q_heads, s.head_dim), params,
                       workspace.bytes(), ctx);
  return {o, lse};
}

template <class T>
void expect_equals_eq11(Random& rng, const WropeSpec& spec, cpu::ThreadPool* pool) {
  SCOPED_TRACE(fmt::format("{} {} pool {}", dtype_label<T>(), describe(spec), pool != nullptr));
  WropeProblem<T> p(rng, spec);
  const HostState ref = p.reference(1.0 / std::sqrt(double(spec.head_dim)));
  const auto [o, lse] = run_wrope<T, T>(p, p.params(), pool);
  expect_close<T>(o, lse, ref, "windowed RoPE, O in T");
  const auto [o32, lse32] = run_wrope<T, float>(p, p.params(), pool);
  expect_close<float>(o32, lse32, ref, "windowed RoPE, O in fp32");
}

class WindowedRope : public SeededTest {};

TEST_F(WindowedRope, SparseEqualsEquation11) {
  cpu::ThreadPool pool(3);
  for (const std::int32_t page_size : {0, 16}) {
    for (const std::int32_t group : {1, 4}) {
      SCOPED_TRACE(fmt::format("seed {}", seed));
      const WropeSpec spec{.q_heads = 2 * group, .kv_heads = 2, .page_size = page_size};
      expect_equals_eq11<half>(rng, spec, nullptr);
      expect_equals_eq11<bfloat16>(rng, spec, &pool);
    }
  }
}

TEST_F(WindowedRope, DenseEqualsEquation11) {
  cpu::ThreadPool pool(2);
  for (const std::int32_t page_size : {0, 32}) {
    for (const std::int32_t group : {1, 4}) {
      SCOPED_TRACE(fmt::format("seed {}", seed));
      // Odd sizes: a head_dim of 64, a window and sinks that are not powers of two, b inside the sequence.
      const WropeSpec spec{.batch = 3, .q_heads = 3 * group, .kv_heads = 3, .head_dim = 64, .tokens = 517,
                           .window = 37, .offset = 300, .sink = 3, .k = 0, .page_size = page_size};
      expect_equals_eq11<half>(rng, spec, &pool);
      expect_equals_eq11<bfloat16>(rng, spec, nullptr);
    }
  }
}

// Every token local (w = length, no sink, nothing selected): equation 11 is ordinary RoPE attention over the whole
// sequence, dense decode.
TEST_F(WindowedRope, AllLocalIsDenseAttention) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = bfloat16;
  WropeProblem<T> p(rng, {.batch = 2, .q_heads = 8, .kv_heads = 2, .tokens = 300, .window = 300, .sink = 0, .k = 8,
                          .equal_lengths = true});
  HostState ref(2, 8, 128);
  reference::dense_decode(p.q_view(), p.post_cache().contiguous, ref.view);
  const auto [o, lse] = run_wrope<T, T>(p, p.params(), nullptr);
  expect_close<T>(o, lse, ref, "all local");
}

// When every non-local token sits exactly at distance b (here the one sink: length b + 1, w = b), R_b is R_{p - j}
// and equation 11 is ordinary sparse attention over the window {sink 1, recent b}.
TEST_F(WindowedRope, DistanceBIsOrdinaryAttention) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = half;
  constexpr std::int32_t kOffset = 200;
  for (const std::int32_t group : {1, 4}) {
    WropeProblem<T> p(rng, {.batch = 2, .q_heads = 2 * group, .kv_heads = 2, .tokens = kOffset + 1,
                            .window = kOffset, .offset = kOffset, .sink = 1, .k = 4, .equal_lengths = true});
    HostState ref(2, 2 * group, 128);
    reference::sparse_decode(p.q_view(), p.post_cache().contiguous, p.selection(), ref.view,
                             {.window = {.sink = 1, .recent = kOffset}});
    const auto [o, lse] = run_wrope<T, T>(p, p.params(), nullptr);
    expect_close<T>(o, lse, ref, "non-local at distance b");
  }
}

// A row whose count is -1 (a primitive's bad device value) gets NaN in O and LSE of its query heads; the others
// stay the equation's.
TEST_F(WindowedRope, BadCountRowIsNan) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = bfloat16;
  WropeProblem<T> p(rng, {.q_heads = 8, .kv_heads = 2});
  const std::int32_t bad = rng.uniform_int(0, 3);
  p.sel_counts[std::size_t(bad)] = 0;
  HostState ref = p.reference(1.0 / std::sqrt(128.0));
  p.sel_counts[std::size_t(bad)] = -1;
  auto [o, lse] = run_wrope<T, float>(p, p.params(), nullptr);
  const std::int32_t group = 4, d = 128;
  for (std::int32_t h = 0; h < group; ++h) {
    const std::size_t head = std::size_t(bad) * group + h;
    EXPECT_TRUE(std::isnan(lse[head])) << "head " << head;
    for (std::int32_t c = 0; c < d; ++c) ASSERT_TRUE(std::isnan(o[head * d + c])) << "head " << head;
    std::fill_n(o.begin() + head * d, d, 0.0f);
    std::fill_n(ref.o.begin() + head * d, d, 0.0f);
    lse[head] = ref.lse[head] = 0.0f;
  }
  expect_close<float>(o, lse, ref, "the other rows");
}

class WindowedRopeBadInput : public SeededTest {
 protected:
  using T = half;
  WropeProblem<T> p{rng, {.batch = 2, .q_heads = 4, .kv_heads = 2, .tokens = 200, .k = 16}};
  std::vector<T> o = std::vector<T>(std::size_t(2) * 4 * 128);
  std::vector<float> lse = std::vector<float>(8);
  cpu::Array<std::byte> workspace{
      windowed_rope_workspace_bytes<T>({2, 4, 2, 128, 16}, p.params(), cpu::Context{})};

  void run(const WindowedRopeParams& params, QueryView<const T> q, KVCache<const T> cache, KVCache<const T> pre,
           SelectionView selection, std::span<std::byte> ws) {
    windowed_rope_decode(q, cache, pre, selection, StateView<T>::packed(o.data(), lse.data(), 2, 4, 128), params, ws,
                         cpu::Context{});
  }
  void run(const WindowedRopeParams& params) {
    run(params, p.q_view(), p.post_cache(), p.pre_cache(), p.selection(), workspace.bytes());
  }
  void run(SelectionView selection, bool validate) {
    WindowedRopeParams params = p.params();
    params.validate_indices = validate;
    run(params, p.q_view(), p.post_cache(), p.pre_cache(), selection, workspace.bytes());
  }
};

TEST_F(WindowedRopeBadInput, Params) {
  run(p.params());  // as given, fine
  WindowedRopeParams params = p.params();
  params.window = 0;
  expect_error([&] { run(params); }, "windowed_rope_decode: params.window (= 0) must be >= 1");
  params = p.params();
  params.sink = -1;
  expect_error([&] { run(params); }, "windowed_rope_decode: params.sink (= -1) must be >= 0");
  params = p.params();
  params.offset = p.table.positions;
  expect_error([&] { run(params); }, fmt::format("params.offset (= {0}) is outside [0, params.rope.positions = {0})",
                                                 p.table.positions));
  params.offset = -1;
  expect_error([&] { run(params); }, "params.offset (= -1) is outside");
  params = p.params();
  params.rope.sin = nullptr;
  expect_error([&] { run(params); }, "windowed_rope_decode: params.rope has a null cos or sin table");
  params = p.params();
  params.rope.rotary_dim = 130;
  expect_error([&] { run(params); }, "params.rope.rotary_dim (= 130) must be even and in [2, head_dim = 128]");
  // A table too short for a distance |b - p|: the rotation refuses it.
  params = p.params();
  params.offset = 0;
  params.rope.positions = 50;  // every sequence is at least 100 long
  expect_error([&] { run(params); }, "rotate_to_position");
}

TEST_F(WindowedRopeBadInput, Lengths) {
  WindowedRopeParams params = p.params();
  params.window = p.post.seq_lens[0] - 3;
  expect_error([&] { run(params); },
               fmt::format("windowed_rope_decode: sequence 0 has {} tokens, fewer than params.sink + params.window "
                           "(= 4 + {}): its sinks would be attended twice",
                           p.post.seq_lens[0], params.window));
  std::vector<std::int32_t> shorter = p.post.seq_lens;
  shorter[0] -= 1;
  KVCache<const T> pre = p.pre_cache();
  pre.contiguous.seq_lens = shorter.data();
  expect_error([&] { run(p.params(), p.q_view(), p.post_cache(), pre, p.selection(), workspace.bytes()); },
               fmt::format("sequence 0 has {} tokens in pre_rope_cache and {} in cache: they must agree", shorter[0],
                           p.post.seq_lens[0]));
}

TEST_F(WindowedRopeBadInput, Shapes) {
  QueryView<const T> strided = p.q_view();
  strided.batch_stride += 8;
  expect_error([&] { run(p.params(), strided, p.post_cache(), p.pre_cache(), p.selection(), workspace.bytes()); },
               "windowed_rope_decode: q.batch_stride (= 520) must be q.heads * q.head_stride (= 512)");
  KVCache<const T> pre = p.pre_cache();
  pre.contiguous.kv_heads = 1;
  expect_error([&] { run(p.params(), p.q_view(), p.post_cache(), pre, p.selection(), workspace.bytes()); },
               "windowed_rope_decode: pre_rope_cache.kv_heads (= 1) != cache.kv_heads (= 2)");
  SelectionView all = p.selection();
  std::vector<std::uint8_t> attend_all(4, 1);
  all.attend_all = attend_all.data();
  expect_error([&] { run(all, false); }, "windowed_rope_decode: selection.attend_all is set");
  SelectionView one_row = p.selection();
  one_row.batch = 1;
  expect_error([&] { run(one_row, false); }, "windowed_rope_decode: selection.batch (= 1) != kv.batch (= 2)");
  expect_error(
      [&] { run(p.params(), p.q_view(), p.post_cache(), p.pre_cache(), p.selection(), workspace.bytes().first(512)); },
      {"windowed_rope_decode: workspace too small", "'windowed RoPE rotated query'"});
}

// With validate_indices every entry is checked against the middle [sink, length - w) and refused by name.
TEST_F(WindowedRopeBadInput, SelectionEntries) {
  run(p.selection(), true);  // the problem's selection is valid
  const std::int32_t length = p.post.seq_lens[0];
  p.sel_indices[1] = length - 5;  // a recent token
  expect_error([&] { run(p.selection(), true); },
               fmt::format("selection.indices[1] (= {}) at batch 0, kv_head 0 is in the attention window (sink [0, "
                           "4), recent [{}, {}))",
                           length - 5, length - 64, length));
  p.sel_indices[1] = 2;  // a sink
  expect_error([&] { run(p.selection(), true); }, "selection.indices[1] (= 2) at batch 0, kv_head 0 is in the attention window");
  p.sel_indices[1] = p.sel_indices[0];
  expect_error([&] { run(p.selection(), true); }, "at batch 0, kv_head 0 repeats selection.indices[0]");
  p.make_selection(rng);
  p.sel_counts[3] = 17;
  expect_error([&] { run(p.selection(), true); },
               "selection.counts (= 17) at batch 1, kv_head 1 is outside [0, capacity = 16]");
}

}  // namespace
}  // namespace kvsift::test
