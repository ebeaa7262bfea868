// CPU decode attention at every SIMD level this machine runs, against kvsift's fp64 reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "attention_check.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/context.hpp"
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


/// Runs the CPU kernels on a problem (poisoned outputs) and returns (O, LSE).
/// With `split_rows`, a workspace of cpu::decode_workspace_bytes (poisoned with NaN bytes) lets rows run on
/// several threads.
template <class T>
std::pair<std::vector<T>, std::vector<float>> run_cpu(HostDecodeProblem<T>& p, bool sparse, cpu::ThreadPool* pool = nullptr,
                                                      bool split_rows = false, cpu::DecodeOptions options = {},
                                                      const SelectionView* selection = nullptr) {
  if (sparse && selection == nullptr) options.attention.window = p.spec.window;
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
      cpu::sparse_decode(p.q_view(), kv, selection != nullptr ? *selection : p.selection(), out, options, pool, workspace);
    } else {
      cpu::dense_decode(p.q_view(), kv, out, options, pool, workspace);
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
  for (SimdLevel level : test::available_simd_levels()) {
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
  for (SimdLevel level : test::available_simd_levels()) {
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
  // An fp32 LSE's error is a few ulps of the merged states' LSEs (|lse| ~ 10 here), not of the result, which may lie
  // near 0: relative to 1 + |ref| (a run's merged -0.0012 missed a tolerance relative to |ref| alone by 7e-8).
  for (std::size_t i = 0; i < got.lse.size(); ++i) EXPECT_NEAR(got.lse[i], ref.lse[i], 1e-5 * (1 + std::abs(ref.lse[i])));
  test::HostState alone(batch, heads, d), with_empty(batch, heads, d);
  cpu::merge_states<float, float>(std::vector{parts[0]}, alone.view);
  cpu::merge_states<float, float>(std::vector{parts[2], parts[0], parts[2]}, with_empty.view);
  EXPECT_EQ(alone.o, os[0]);
  EXPECT_EQ(with_empty.o, os[0]);
  EXPECT_EQ(with_empty.lse, lses[0]);
}

TEST_F(CpuDecode, WindowIsTheSameAsSelectingItsTokensFirst) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(8);
  for (SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    // Windows wider than some sequences, sink only, recent only; rows split over threads or not.
    for (const AttentionWindow window : {AttentionWindow{4, 64}, AttentionWindow{300, 400}, AttentionWindow{16, 0},
                                         AttentionWindow{0, 37}}) {
      for (bool split : {false, true}) {
        // Rows of at least 700 selected entries: on 8 threads they split (chunks of >= 256 entries), and
        // chunks cross the window's boundary.
        const CaseSpec spec{2, 8, 2, 64, rng.uniform_int(1500, 2500), 700, std::vector{0, 16}[rng.uniform_int(0, 1)],
                            true, false, window};
        SCOPED_TRACE(fmt::format("{} {}{}", cpu::simd_level_name(level), test::describe(spec), split ? ", split" : ""));
        HostDecodeProblem<bfloat16> p(rng, spec);
        const auto [o, lse] = run_cpu(p, true, split ? &pool : nullptr, split);
        test::expect_close(o, lse, p.reference(true), "window");
        const test::UnionSelection explicit_window = test::window_as_selection(p);
        const auto [o_union, lse_union] = run_cpu(p, true, split ? &pool : nullptr, split, {}, &explicit_window.view);
        EXPECT_EQ(0, std::memcmp(o.data(), o_union.data(), o.size() * sizeof(bfloat16)));
        EXPECT_EQ(lse, lse_union);
      }
    }
  }
}

/// A page-level selection (AttentionOptions::selection_page_size) attends each page's middle tokens: against the fp64
/// reference, whose page mode equals its token mode over the pages' tokens exactly, at every SIMD level, split over
/// threads or not, windows over page edges and wider than sequences, page sizes of 16 and 5, both cache layouts.
TEST_F(CpuDecode, PageSelectionsAttendThePagesMiddleTokens) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(8);
  for (SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    for (const AttentionWindow window : {AttentionWindow{4, 64}, AttentionWindow{}, AttentionWindow{300, 400},
                                         AttentionWindow{0, 37}}) {
      for (std::int32_t page_size : {16, 5}) {
        const bool split = rng.uniform_int(0, 1) == 1;
        const CaseSpec spec{2, 8, 2, 64, rng.uniform_int(1500, 2500), 0, std::vector{0, 16}[rng.uniform_int(0, 1)],
                            rng.uniform_int(0, 1) == 1, true, window};
        SCOPED_TRACE(fmt::format("{} {} selection pages of {}{}", cpu::simd_level_name(level), test::describe(spec),
                                 page_size, split ? ", split" : ""));
        HostDecodeProblem<bfloat16> p(rng, spec);
        const test::PagesAndTokens s = test::random_page_selection(rng, p, page_size, 90);
        const AttentionOptions pages{.window = window, .selection_page_size = page_size};
        test::HostState ref(spec.batch, spec.q_heads, spec.head_dim), ref_tokens(spec.batch, spec.q_heads, spec.head_dim);
        reference::sparse_decode(p.q_view(), p.contiguous(), s.pages.view, ref.view, pages);
        reference::sparse_decode(p.q_view(), p.contiguous(), s.tokens.view, ref_tokens.view, {.window = window});
        EXPECT_EQ(ref.o, ref_tokens.o);
        EXPECT_EQ(ref.lse, ref_tokens.lse);
        const auto [o, lse] = run_cpu(p, true, split ? &pool : nullptr, split,
                                      {.attention = pages, .validate_indices = rng.uniform_int(0, 1) == 1}, &s.pages.view);
        test::expect_close(o, lse, ref, "pages");
      }
    }
  }
}

/// Validation refuses a page outside the sequence's pages and a page listed twice, by position, and writes nothing;
/// a page size below 1, and pages in dense decode, are refused.
TEST_F(CpuDecode, PageSelectionsRefuseBadPages) {
  HostDecodeProblem<half> p(rng, CaseSpec{2, 4, 2, 64, 500, 0, 0, false, false, {4, 64}});
  test::PagesAndTokens s = test::random_page_selection(rng, p, 16, 8);
  const AttentionOptions pages{.window = {4, 64}, .selection_page_size = 16};
  const auto refused = [&](const std::string& message, const AttentionOptions& attention) {
    std::vector<half> o(p.q.size(), from_float<half>(7.0f));
    std::vector<float> lse(std::size_t(2) * 4, 7.0f);
    test::expect_error(
        [&] {
          cpu::sparse_decode(p.q_view(), p.contiguous(), s.pages.view, StateView<half>::packed(o.data(), lse.data(), 2, 4, 64),
                             {.attention = attention, .validate_indices = true});
        },
        message);
    EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](half x) { return to_float(x) == 7.0f; })) << "O was written";
    EXPECT_TRUE(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 7.0f; })) << "LSE was written";
  };
  const std::int32_t len = p.kv_values.seq_lens[1], sequence_pages = (len + 15) / 16;
  const std::size_t row = 1 * 2 + 1;
  s.pages.counts[row] = 3;
  s.pages.indices[row * 8 + 0] = 0;
  s.pages.indices[row * 8 + 1] = sequence_pages - 1;
  s.pages.indices[row * 8 + 2] = sequence_pages;  // one past the last page
  refused(fmt::format("selection.indices[2] (= {}) at batch 1, kv_head 1 is outside the sequence's pages [0, {}) "
                      "(page_size 16, seq_len {})",
                      sequence_pages, sequence_pages, len),
          pages);
  s.pages.indices[row * 8 + 2] = -1;
  refused(fmt::format("selection.indices[2] (= -1) at batch 1, kv_head 1 is outside the sequence's pages [0, {})",
                      sequence_pages),
          pages);
  s.pages.indices[row * 8 + 2] = sequence_pages - 1;
  refused("selection.indices[2] (= " + std::to_string(sequence_pages - 1) +
              ") at batch 1, kv_head 1 repeats selection.indices[1]: a row lists each page at most once",
          pages);
  refused("cpu::sparse_decode: options.attention.selection_page_size (= 0) must be >= 1", {.selection_page_size = 0});
  s.pages.indices[row * 8 + 2] = 1;
  test::expect_error([&] { run_cpu(p, false, nullptr, false, {.attention = {.selection_page_size = 16}}); },
                     "cpu::dense_decode: options selection_page_size (= 16) applies to sparse decode");
  // The pages' window tokens are attended once (from the window), not refused.
  const auto [o, lse] = run_cpu(p, true, nullptr, false, {.attention = pages, .validate_indices = true}, &s.pages.view);
  test::HostState ref(2, 4, 64);
  reference::sparse_decode(p.q_view(), p.contiguous(), s.pages.view, ref.view, pages);
  test::expect_close(o, lse, ref, "pages 0 and the last");
}

TEST_F(CpuDecode, AttendAllRowsAttendEveryTokenOnce) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(8);
  for (SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    for (const AttentionWindow window : {AttentionWindow{}, AttentionWindow{4, 64}}) {
      for (std::int32_t page_size : {0, 16}) {
        // Rows of up to 1500 tokens against a capacity of 200: an attend_all row is far longer than the split
        // plan's other rows; with 8 threads it is cut into chunks, some past the window.
        const CaseSpec spec{3, 8, 2, 64, rng.uniform_int(600, 1500), 200, page_size, true, true, window};
        HostDecodeProblem<bfloat16> p(rng, spec);
        p.mark_attend_all(rng);  // their counts and indices are poisoned: reading them would fail
        const auto ref = p.reference(true);
        for (bool split : {false, true}) {
          for (bool validate : {false, true}) {
            SCOPED_TRACE(fmt::format("{} {} split {} validate {}", cpu::simd_level_name(level), test::describe(spec),
                                     split, validate));
            const auto [o, lse] = run_cpu(p, true, split ? &pool : nullptr, split, {.validate_indices = validate});
            test::expect_close(o, lse, ref, "attend_all");
          }
        }
      }
    }
  }
}

TEST_F(CpuDecode, Fp32PartialsMergeWithoutRoundingTwice) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(4);
  for (SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    const CaseSpec spec{2, 8, 2, 128, 1500, 400, 16, true, true, AttentionWindow{4, 64}};
    HostDecodeProblem<bfloat16> p(rng, spec);
    const auto ref = p.reference(true);
    // Two partials, as the hybrid step makes them: the window alone (an empty selection) and the selection
    // alone (no window), each in fp32, then merged.
    std::vector<std::int32_t> no_counts(p.sel_counts.size(), 0);
    const SelectionView selection = p.selection();
    SelectionView window_only = selection;
    window_only.counts = no_counts.data();
    test::HostState window_part(spec.batch, spec.q_heads, spec.head_dim), selected_part(spec.batch, spec.q_heads, spec.head_dim);
    std::vector<std::byte> ws(cpu::decode_workspace_bytes(spec.batch, spec.q_heads, spec.kv_heads, spec.head_dim, &pool) + 256);
    std::span<std::byte> workspace(ws.data() + (256 - reinterpret_cast<std::uintptr_t>(ws.data()) % 256) % 256, ws.size() - 256);
    cpu::sparse_decode(p.q_view(), p.paged(), window_only, window_part.view, {.attention = {.window = spec.window}}, &pool, workspace);
    cpu::sparse_decode(p.q_view(), p.paged(), selection, selected_part.view, {}, &pool, workspace);
    test::HostState merged(spec.batch, spec.q_heads, spec.head_dim);
    cpu::merge_states<float, float>(std::vector{window_part.view.as_const(), selected_part.view.as_const()}, merged.view);
    // fp32 throughout: within fp32 rounding of the fp64 reference, far inside bf16's 2^-8.
    double num = 0, den = 0;
    for (std::size_t i = 0; i < ref.o.size(); ++i) {
      num += (merged.o[i] - ref.o[i]) * (merged.o[i] - ref.o[i]);
      den += double(ref.o[i]) * ref.o[i];
    }
    EXPECT_LT(std::sqrt(num / den), 2e-6) << simd_level_name(level);
    for (std::size_t i = 0; i < ref.lse.size(); ++i) EXPECT_NEAR(merged.lse[i], ref.lse[i], 2e-5 * std::abs(ref.lse[i]) + 1e-6);
  }
}

TEST_F(CpuDecode, NonFiniteInputsGiveNaNWhereTheReferenceDoes) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(8);  // 4 rows of 600 entries on 8 threads: rows split in two, partials merged
  for (SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    for (test::Corruption c : test::kCorruptions) {
      for (bool sparse : {true, false}) {
        if (!sparse && test::needs_log_weights(c)) continue;
        for (bool split : {false, true}) {
          const auto check = [&]<class T>(T) {
            SCOPED_TRACE(fmt::format("{} {}: {}, {}{}", cpu::simd_level_name(level), test::dtype_label<T>(),
                                     test::corruption_name(c), sparse ? "sparse" : "dense", split ? ", split" : ""));
            HostDecodeProblem<T> p(rng, CaseSpec{2, 8, 2, 64, 1200, 600, 0, true, false});
            const float scale = test::corrupt(p, c);
            const auto ref = p.reference(sparse, {.sm_scale = scale});
            // The case is not vacuous: the reference has the NaN (or the empty row) the contract describes.
            if (c == test::Corruption::row_masked) {
              ASSERT_EQ(ref.lse[4], -INFINITY);
            } else if (sparse || c != test::Corruption::k_inf) {
              ASSERT_TRUE(std::any_of(ref.o.begin(), ref.o.end(), [](float x) { return std::isnan(x); }));
            }
            const auto [o, lse] = run_cpu(p, sparse, split ? &pool : nullptr, split, {.attention = {.sm_scale = scale}});
            test::expect_close_with_nan(o, lse, ref, "non-finite");
          };
          check(half{});
          check(bfloat16{});
        }
      }
    }
  }
}

TEST_F(CpuDecode, MergeCarriesNaNAndOnlyMinusInfinityIsEmpty) {
  const std::int32_t batch = 2, heads = 3, d = 20;
  std::vector<std::vector<float>> os(3), lses(3);
  std::vector<StateView<const float>> parts;
  for (int i = 0; i < 3; ++i) {
    os[i] = rng.normal(std::size_t(batch) * heads * d);
    lses[i] = rng.normal(std::size_t(batch) * heads, 5.0f);
    parts.push_back(StateView<const float>::packed(os[i].data(), lses[i].data(), batch, heads, d));
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  lses[1][1 * heads + 2] = nan;           // (b 1, h 2): a corrupted partial state
  os[2][(0 * heads + 1) * d + 7] = nan;   // (b 0, h 1): a NaN in one partial's O
  lses[0][0] = lses[2][0] = -INFINITY;    // (b 0, h 0): two empty partials and ...
  lses[1][0] = nan;                       // ... a corrupted one: NaN, not empty
  test::HostState ref(batch, heads, d), got(batch, heads, d);
  reference::merge_states<float, float>(parts, ref.view);
  cpu::merge_states<float, float>(parts, got.view);
  EXPECT_TRUE(std::isnan(ref.lse[0]) && std::isnan(ref.lse[5]) && std::isnan(ref.o[1 * d + 7]));
  test::expect_close_with_nan(got.o, got.lse, ref, "merge");
  EXPECT_TRUE(std::isnan(got.lse[0]));
  for (int c = 0; c < d; ++c) EXPECT_TRUE(std::isnan(got.o[c]) && std::isnan(got.o[5 * d + c]));
  EXPECT_FALSE(std::isnan(got.lse[1]));  // a NaN in O leaves the LSE as the weights give it
}

TEST_F(CpuDecode, ANaNWhoseWeightUnderflowsStillShows) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Merging: a partial 150 below the other has weight exp(-150) = 0 in fp32, yet its NaN shows.
  std::vector<float> o1(4, 1.0f), lse1{0.0f}, o2{0.5f, nan, 0.5f, 0.5f}, lse2{-150.0f};
  const std::vector parts{StateView<const float>::packed(o1.data(), lse1.data(), 1, 1, 4),
                          StateView<const float>::packed(o2.data(), lse2.data(), 1, 1, 4)};
  test::HostState ref(1, 1, 4), got(1, 1, 4);
  reference::merge_states<float, float>(parts, ref.view);
  cpu::merge_states<float, float>(parts, got.view);
  EXPECT_TRUE(std::isnan(ref.o[1]) && std::isnan(got.o[1]));
  EXPECT_EQ(got.o[0], 1.0f);
  EXPECT_FLOAT_EQ(got.lse[0], 0.0f);
  // Decoding: entries 512.. weigh e^-150 and one of them has a NaN in V; split over threads or not, O shows it.
  cpu::ThreadPool pool(8);
  for (SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    HostDecodeProblem<bfloat16> p(rng, CaseSpec{1, 1, 1, 64, 1024, 1024, 0, true, false});
    for (int i = 512; i < 1024; ++i) p.sel_weights[i] = -150.0f;
    p.v[std::size_t(p.sel_indices[900]) * 64 + 3] = from_float<bfloat16>(nan);
    const auto reference_state = p.reference(true);
    ASSERT_TRUE(std::isnan(reference_state.o[3]));
    for (bool split : {false, true}) {
      const auto [o, lse] = run_cpu(p, true, split ? &pool : nullptr, split);
      test::expect_close_with_nan(o, lse, reference_state, fmt::format("{} split {}", simd_level_name(level), split));
    }
  }
}

TEST_F(CpuDecode, ARowWhoseEveryLogitIsMinusInfinityIsEmptyWhateverItsValues) {
  for (SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    HostDecodeProblem<half> p(rng, CaseSpec{1, 2, 1, 64, 100, 4, 0, true, false});
    std::fill(p.sel_weights.begin(), p.sel_weights.end(), -INFINITY);
    p.v[std::size_t(p.sel_indices[2]) * 64 + 5] = from_float<half>(std::numeric_limits<float>::quiet_NaN());
    const auto reference_state = p.reference(true);
    const auto [o, lse] = run_cpu(p, true);
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(reference_state.lse[h], -INFINITY);
      EXPECT_EQ(lse[h], -INFINITY) << simd_level_name(level);
    }
    for (std::size_t i = 0; i < o.size(); ++i) {
      ASSERT_EQ(reference_state.o[i], 0.0f);
      ASSERT_EQ(to_float(o[i]), 0.0f) << simd_level_name(level) << " element " << i;
    }
  }
}

// A count outside [0, capacity] (a primitive's -1 for a bad device value) makes every query head of its row NaN
// in O and LSE, window included, on one thread and with rows split over threads; the other rows are untouched
// by it. Outputs start finite (0), so a row left unwritten fails.
TEST_F(CpuDecode, BadCountRowsAreNaN) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(8);
  for (const bool split_rows : {false, true}) {
    for (const std::int32_t page_size : {0, 16}) {
      HostDecodeProblem<bfloat16> p(rng, CaseSpec{2, 8, 2, 64, 900, 48, page_size, true, true, {4, 32}});
      SCOPED_TRACE(describe(p.spec));
      const std::int32_t bad_count = rng.uniform_int(0, 1) == 0 ? -1 : rng.uniform_int(49, 60);
      const std::int32_t bad_row = rng.uniform_int(0, 3);
      // The reference over the other rows: the bad row emptied, its heads then compared with NaN instead.
      const test::HostState ref = [&] {
        std::vector<std::int32_t> counts = p.sel_counts;
        p.sel_counts[bad_row] = 0;
        test::HostState r = p.reference(true);
        p.sel_counts = counts;
        return r;
      }();
      p.sel_counts[bad_row] = bad_count;
      std::vector<bfloat16> o(p.q.size(), from_float<bfloat16>(0.0f));
      std::vector<float> lse(std::size_t(2) * 8, 0.0f);
      const std::size_t ws_bytes = split_rows ? cpu::decode_workspace_bytes(2, 8, 2, 64, &pool) : 0;
      cpu::Array<std::byte> workspace(ws_bytes);
      const auto out = StateView<bfloat16>::packed(o.data(), lse.data(), 2, 8, 64);
      const cpu::DecodeOptions options{.attention = {.window = p.spec.window}};
      if (page_size == 0) {
        cpu::sparse_decode(p.q_view(), p.contiguous(), p.selection(), out, options, &pool, workspace.bytes());
      } else {
        cpu::sparse_decode(p.q_view(), p.paged(), p.selection(), out, options, &pool, workspace.bytes());
      }
      const std::int32_t group = 4;
      for (std::int32_t head = 0; head < 2 * 8; ++head) {
        const bool in_bad_row = head / group == bad_row;
        for (std::int32_t c = 0; c < 64; ++c) {
          const float got = to_float(o[std::size_t(head) * 64 + c]);
          if (in_bad_row) {
            ASSERT_TRUE(std::isnan(got)) << "head " << head << " channel " << c << " count " << bad_count;
          } else {
            ASSERT_NEAR(got, ref.o[std::size_t(head) * 64 + c], 2e-2) << "head " << head << " channel " << c;
          }
        }
        if (in_bad_row) {
          EXPECT_TRUE(std::isnan(lse[head])) << "head " << head;
        } else {
          EXPECT_NEAR(lse[head], ref.lse[head], 1e-3 * std::max(1.0f, std::abs(ref.lse[head]))) << "head " << head;
        }
      }
    }
  }
}

// AttentionOptions::selection_rows: a selection kept by slot (5 rows, its other rows poisoned) read in place
// through a row map gives what the same rows copied into batch order give: the reference's numbers, and bit for
// bit the CPU's own on the copy, at every SIMD level, split or not. A map value outside the selection makes its
// batch row NaN, or is refused by name when validating; dense decode refuses a map.
TEST_F(CpuDecode, ASelectionRowMapReadsRowsInPlace) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(8);
  constexpr std::int32_t kSlots = 5, kBatch = 3, kKvHeads = 2;
  for (const std::int32_t page_size : {0, 16}) {
    HostDecodeProblem<bfloat16> p(
        rng, CaseSpec{kBatch, 8, kKvHeads, 64, rng.uniform_int(300, 900), 48, page_size, true, true, {4, 32}});
    SCOPED_TRACE(describe(p.spec));
    const std::vector<std::int32_t> slots = test::distinct_slots(rng, kSlots, kBatch);  // batch row b's in slots[b]
    test::HostSelection store(kSlots, kKvHeads, p.spec.k, true);  // the other slots' rows poisoned
    test::copy_rows_by_slot(p.selection(), slots, store.view);
    const test::HostState ref = p.reference(true);
    // The reference itself reads the slots' rows through the map.
    test::HostState mapped_ref(kBatch, 8, 64);
    reference::sparse_decode(p.q_view(), p.contiguous(), store.view, mapped_ref.view,
                             {.window = p.spec.window, .selection_rows = slots.data()});
    EXPECT_TRUE(std::memcmp(ref.o.data(), mapped_ref.o.data(), ref.o.size() * sizeof(float)) == 0);
    EXPECT_TRUE(std::memcmp(ref.lse.data(), mapped_ref.lse.data(), ref.lse.size() * sizeof(float)) == 0);
    for (SimdLevel level : test::available_simd_levels()) {
      cpu::ScopedSimdLevel force(level);
      for (const bool split : {false, true}) {
        for (const bool validate : {false, true}) {
          SCOPED_TRACE(fmt::format("{} split {} validate {}", cpu::simd_level_name(level), split, validate));
          cpu::DecodeOptions options{.validate_indices = validate};
          options.attention = {.window = p.spec.window, .selection_rows = slots.data()};
          const auto [o, lse] = run_cpu(p, true, split ? &pool : nullptr, split, options, &store.view);
          test::expect_close(o, lse, ref, "row map");
          const auto [o_copy, lse_copy] = run_cpu(p, true, split ? &pool : nullptr, split, {.validate_indices = validate});
          EXPECT_TRUE(std::memcmp(o.data(), o_copy.data(), o.size() * sizeof(bfloat16)) == 0);
          EXPECT_TRUE(std::memcmp(lse.data(), lse_copy.data(), lse.size() * sizeof(float)) == 0);
        }
      }
    }
    // A map value outside [0, kSlots): that batch row's heads NaN, the others as before; refused when validating.
    for (const std::int32_t bad : {-1, kSlots, 1 << 30}) {
      std::vector<std::int32_t> bad_slots = slots;
      bad_slots[1] = bad;
      cpu::DecodeOptions options;
      options.attention = {.window = p.spec.window, .selection_rows = bad_slots.data()};
      const auto [o, lse] = run_cpu(p, true, &pool, true, options, &store.view);
      const std::int32_t group = 4;
      for (std::int32_t head = 0; head < kBatch * 8; ++head) {
        const bool in_bad_row = head / 8 == 1;
        const float got = to_float(o[std::size_t(head) * 64]);
        if (in_bad_row) {
          EXPECT_TRUE(std::isnan(got) && std::isnan(lse[head])) << "head " << head << " map value " << bad;
        } else {
          EXPECT_NEAR(got, ref.o[std::size_t(head) * 64], 2e-2) << "head " << head << " (group " << group << ")";
        }
      }
      options.validate_indices = true;
      test::expect_error([&] { run_cpu(p, true, &pool, true, options, &store.view); },
                         fmt::format("cpu::sparse_decode: options selection_rows[1] (= {}) is outside [0, "
                                     "selection.batch = {})",
                                     bad, kSlots));
    }
  }
  // Dense decode has no selection: a map is a mistake.
  HostDecodeProblem<half> dense(rng, CaseSpec{2, 4, 2, 64, 100, 0, 0, false, false});
  const std::int32_t map[2] = {0, 1};
  cpu::DecodeOptions options;
  options.attention.selection_rows = map;
  test::expect_error([&] { run_cpu(dense, false, nullptr, false, options); },
                     "options selection_rows (a row map) applies to sparse decode");
}

TEST_F(CpuDecode, ValidationRefusesBadIndicesAndDuplicatesAndWritesNothing) {
  HostDecodeProblem<half> p(rng, CaseSpec{3, 4, 2, 64, 500, 32, 0, false, false});
  const auto refused = [&](const std::string& message, bool validate = true) {
    std::vector<half> o(p.q.size(), from_float<half>(7.0f));
    std::vector<float> lse(std::size_t(3) * 4, 7.0f);
    test::expect_error(
        [&] {
          cpu::sparse_decode(p.q_view(), p.contiguous(), p.selection(), StateView<half>::packed(o.data(), lse.data(), 3, 4, 64),
                             {.validate_indices = validate});
        },
        message);
    EXPECT_TRUE(std::all_of(o.begin(), o.end(), [](half x) { return to_float(x) == 7.0f; })) << "O was written";
    EXPECT_TRUE(std::all_of(lse.begin(), lse.end(), [](float x) { return x == 7.0f; })) << "LSE was written";
  };
  const auto at = [&](std::int32_t b, std::int32_t h, std::int32_t i) -> std::int32_t& {
    return p.sel_indices[(std::size_t(b) * 2 + h) * 32 + i];
  };
  const std::int32_t saved = at(1, 1, 5);
  at(1, 1, 5) = 500;  // one past the end
  refused("selection.indices[5] (= 500) at batch 1, kv_head 1 is outside [0, seq_len = 500)");
  at(1, 1, 5) = -3;
  refused("selection.indices[5] (= -3) at batch 1, kv_head 1 is outside [0, seq_len = 500)");
  at(1, 1, 5) = saved;
  at(2, 0, 9) = at(2, 0, 4);
  refused(fmt::format("selection.indices[9] (= {}) at batch 2, kv_head 0 repeats selection.indices[4]", at(2, 0, 4)));
  p.make_selection(rng);  // fresh distinct rows
  p.sel_counts[0] = 33;   // without validation such a row is NaN (BadCountRowsAreNaN)
  refused("selection.counts (= 33) at batch 0, kv_head 0 is outside [0, capacity = 32]");
  p.sel_counts[0] = -1;
  refused("selection.counts (= -1) at batch 0, kv_head 0 is outside [0, capacity = 32]");
  p.sel_counts[0] = 32;
  const auto [o, lse] = run_cpu(p, true, nullptr, false, {.validate_indices = true});  // clean input passes
  test::expect_close(o, lse, p.reference(true), "validated");

  // With a window, its tokens may not be selected too (they would be attended twice).
  HostDecodeProblem<half> w(rng, CaseSpec{1, 4, 2, 64, 500, 32, 0, false, false, {4, 64}});
  w.sel_indices[32 + 6] = 440;
  test::expect_error([&] { run_cpu(w, true, nullptr, false, {.validate_indices = true}); },
                     "selection.indices[6] (= 440) at batch 0, kv_head 1 is in the attention window (sink [0, 4), recent "
                     "[436, 500))");
  test::expect_error([&] { run_cpu(w, false, nullptr, false, {.attention = {.window = {4, 64}}}); },
                     "cpu::dense_decode: options window (sink = 4, recent = 64) applies to sparse decode");
  w.sel_indices[32 + 6] = 100;
  const SelectionView plain = w.selection();
  test::expect_error([&] { run_cpu(w, true, nullptr, false, {.attention = {.window = {-1, 64}}}, &plain); },
                     "cpu::sparse_decode: options.attention.window.sink (= -1) and options.attention.window.recent (= 64) must be >= 0");
}

TEST_F(CpuDecode, DuplicatesWithoutValidationCountOncePerOccurrence) {
  for (SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    HostDecodeProblem<bfloat16> p(rng, CaseSpec{1, 2, 1, 64, 100, 8, 0, false, false});
    std::fill(p.sel_indices.begin(), p.sel_indices.end(), 0);  // eight copies of token 0
    const auto [o8, lse8] = run_cpu(p, true);
    p.sel_counts[0] = 1;
    const auto [o1, lse1] = run_cpu(p, true);
    for (int h = 0; h < 2; ++h) EXPECT_NEAR(lse8[h], lse1[h] + std::log(8.0f), 1e-5f) << simd_level_name(level);
    EXPECT_EQ(0, std::memcmp(o8.data(), o1.data(), o1.size() * sizeof(bfloat16))) << simd_level_name(level);
    p.sel_counts[0] = 8;
    test::expect_close(o8, lse8, p.reference(true), "the reference counts duplicates alike");
  }
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
