// CPU codebook quantization, lookup tables and code scan (selectors/a2ats/cpu/vq.hpp) against fp64 references written from the
// paper's definitions (tests/vq_problem.hpp): codes are the argmin of (k - C_c) H (k - C_c)^T except within a
// stated epsilon of a tie, tables are q . C_c within fp32 rounding, scans copy table entries exactly. Random
// lower-triangular L (upper triangle NaN: never read), codewords 16 / 256 / 4096, head_dim 64 / 128, fp32 / fp16 /
// bf16, strided keys, prefill and append destinations, slots out of order, ragged and clamped lengths, invalid
// codes and slots (NaN); outputs poisoned; every SIMD level; thread counts; workspaces through workspace_check.hpp;
// every refusal with its message.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/topk.hpp"
#include "kvsift/selectors/a2ats/cpu/vq.hpp"
#include "test_util.hpp"
#include "vq_problem.hpp"
#include "workspace_check.hpp"

namespace kvsift {
namespace {

using test::Random;
using test::VqProblem;

constexpr std::uint16_t kCodePoison = 0xffff;  // above every codebook here: an unwritten code shows
using test::kScoreSentinel;
using test::ScanProblem;

std::vector<float> norms_of(const VqProblem& p, cpu::ThreadPool* pool) {
  std::vector<float> norms(std::size_t(p.kv_heads) * p.codewords, test::kPoison);
  cpu::vq_codeword_norms(MatrixView<const float>::packed(p.centroids.data(), std::int64_t(p.kv_heads) * p.codewords, p.d),
                         norms.data(), pool);
  for (std::size_t i = 0; i < norms.size(); ++i) {
    double want = 0;
    for (std::int32_t j = 0; j < p.d; ++j) want += double(p.centroids[i * p.d + j]) * p.centroids[i * p.d + j];
    EXPECT_NEAR(norms[i], want, 1e-5 * want) << "norm " << i;
  }
  return norms;
}

/// Keys [rows, kv_heads, d] with a padded head stride, in T; their fp64 values (after rounding to T).
template <class T>
struct Keys {
  std::int32_t rows, kv_heads, d, pitch;
  std::vector<T> data;
  Keys(Random& rng, std::int32_t rows_, std::int32_t kv_heads_, std::int32_t d_)
      : rows(rows_), kv_heads(kv_heads_), d(d_), pitch(d_ + 3),
        data(test::to_storage<T>(rng.normal(std::size_t(rows_) * kv_heads_ * (d_ + 3)))) {}
  HeadsView<const T> view() const { return {data.data(), rows, kv_heads, d, std::int64_t(kv_heads) * pitch, pitch}; }
  std::vector<double> row(std::int32_t r, std::int32_t h) const {
    std::vector<double> k(d);
    for (std::int32_t j = 0; j < d; ++j) k[j] = to_float(data[(std::size_t(r) * kv_heads + h) * pitch + j]);
    return k;
  }
};

template <class T>
void check_encode(Random& rng, std::int32_t kv_heads, std::int32_t codewords, std::int32_t d, std::int32_t rows,
                  cpu::ThreadPool* pool) {
  SCOPED_TRACE(testing::Message() << "codewords " << codewords << " d " << d << " rows " << rows << " threads "
                                  << (pool ? pool->size() : 1));
  const VqProblem p = test::make_vq_problem(rng, kv_heads, codewords, d);
  const std::vector<float> norms = norms_of(p, pool);
  const Keys<T> keys(rng, rows, kv_heads, d);
  const VqEncodeCodebook codebook{p.transform.data(), p.centroids.data(), norms.data(), kv_heads, codewords, d};
  const std::int32_t slots = 3, max_tokens = rows + 10, first = 7;
  std::vector<std::uint16_t> codes(std::size_t(slots) * kv_heads * max_tokens, kCodePoison);
  const auto codes_view = VqCodesView<std::uint16_t>::packed(codes.data(), slots, kv_heads, max_tokens);

  // Prefill: rows into slot 1 from position 7.
  test::check_workspace(
      cpu::vq_encode_workspace_bytes(codewords, d, pool),
      [&](std::span<std::byte> ws) {
        cpu::vq_encode(keys.view(), codebook, codes_view, {.slot = 1, .position_offset = first}, ws, pool);
      },
      [&] { return test::bytes_of(codes); }, [&] { std::fill(codes.begin(), codes.end(), kCodePoison); });
  std::int32_t near_ties = 0;
  for (std::int32_t s = 0; s < slots; ++s) {
    for (std::int32_t h = 0; h < kv_heads; ++h) {
      for (std::int32_t t = 0; t < max_tokens; ++t) {
        const std::uint16_t code = codes[(std::size_t(s) * kv_heads + h) * max_tokens + t];
        if (s != 1 || t < first || t >= first + rows) {
          ASSERT_EQ(code, kCodePoison) << "written outside the destination at slot " << s << " token " << t;
          continue;
        }
        const auto k = keys.row(t - first, h);
        near_ties += test::expect_vq_code(test::vq_forms(p, h, k), p, h, code) ? 1 : 0;
      }
    }
  }
  EXPECT_LE(near_ties, rows * kv_heads / 20 + 1) << "too many rows excused as near ties: the rule would hide errors";

  // Append: one key per sequence at its own slot and position (lengths - 1); a slot past the codes and an empty
  // sequence (position -1) write nothing.
  const std::vector<std::int32_t> row_slots = {2, 0, 1, 3, 0};
  const std::vector<std::int32_t> lengths = {5, 1, max_tokens, 4, 0};
  const auto appended = std::min<std::int32_t>(rows, 5);
  const HeadsView<const T> some{keys.data.data(), appended, kv_heads, d, std::int64_t(kv_heads) * keys.pitch, keys.pitch};
  std::vector<std::uint16_t> step(codes.size(), kCodePoison);
  cpu::Array<std::byte> workspace(cpu::vq_encode_workspace_bytes(codewords, d, pool));
  cpu::vq_encode(some, codebook, VqCodesView<std::uint16_t>::packed(step.data(), slots, kv_heads, max_tokens),
                 {.slots = row_slots.data(), .positions = lengths.data(), .position_offset = -1}, workspace.bytes(), pool);
  std::size_t written = 0, valid = 0;
  for (std::int32_t r = 0; r < appended; ++r) {
    const std::int32_t slot = row_slots[r], position = lengths[r] - 1;
    if (slot >= slots || position < 0) continue;
    for (std::int32_t h = 0; h < kv_heads; ++h, ++valid) {
      EXPECT_EQ(step[(std::size_t(slot) * kv_heads + h) * max_tokens + position],
                codes[(std::size_t(1) * kv_heads + h) * max_tokens + first + r])
          << "row " << r << " head " << h << ": the appended key's code differs from its prefill code";
    }
  }
  for (const std::uint16_t c : step) written += c != kCodePoison ? 1 : 0;
  EXPECT_EQ(written, valid) << "codes written outside the rows' destinations";
}

TEST(VqEncode, CodesAreTheArgminOfTheQueryAwareForm) {
  const std::uint64_t seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  Random rng(seed);
  cpu::ThreadPool pool(3);
  for (const cpu::SimdLevel level : test::available_simd_levels()) {
    SCOPED_TRACE(testing::Message() << "level " << cpu::simd_level_name(level));
    cpu::ScopedSimdLevel scoped(level);
    check_encode<float>(rng, 2, 16, 64, 70, nullptr);
    check_encode<bfloat16>(rng, 2, 256, 128, 45, &pool);
    check_encode<half>(rng, 1, 4096, 64, 33, &pool);
  }
  check_encode<bfloat16>(rng, 1, 4096, 128, 20, &pool);
  check_encode<half>(rng, 3, 256, 64, 130, nullptr);
}

TEST(VqEncode, ResultsDoNotDependOnTheThreadCount) {
  Random rng(test::test_seed());
  const VqProblem p = test::make_vq_problem(rng, 2, 300, 64);
  const std::vector<float> norms = norms_of(p, nullptr);
  const Keys<half> keys(rng, 500, 2, 64);
  const VqEncodeCodebook codebook{p.transform.data(), p.centroids.data(), norms.data(), 2, 300, 64};
  std::vector<std::vector<std::uint16_t>> results;
  for (const int threads : {1, 2, 5}) {
    cpu::ThreadPool pool(threads);
    std::vector<std::uint16_t> codes(2 * 500, kCodePoison);
    cpu::Array<std::byte> workspace(cpu::vq_encode_workspace_bytes(300, 64, &pool));
    cpu::vq_encode(keys.view(), codebook, VqCodesView<std::uint16_t>::packed(codes.data(), 1, 2, 500), {}, workspace.bytes(),
                   &pool);
    results.push_back(codes);
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
}

/// The key-space codebook rounded to T, [kv_heads, codewords, d].
template <class T>
std::vector<T> key_codebook(const VqProblem& p) {
  std::vector<float> c(p.key_space.size());
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = float(p.key_space[i]);
  return test::to_storage<T>(c);
}

template <class T>
void check_lut(Random& rng, std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads, std::int32_t codewords,
               std::int32_t d, cpu::ThreadPool* pool) {
  SCOPED_TRACE(testing::Message() << "batch " << batch << " heads " << q_heads << "/" << kv_heads << " codewords "
                                  << codewords << " d " << d);
  const VqProblem p = test::make_vq_problem(rng, kv_heads, codewords, d);
  const std::vector<T> cb = key_codebook<T>(p);
  const std::vector<T> q = test::to_storage<T>(rng.normal(std::size_t(batch) * q_heads * d));
  const std::int64_t stride = codewords + 5;
  std::vector<float> lut(std::size_t(batch) * q_heads * stride, test::kPoison);
  cpu::vq_lut(QueryView<const T>::packed(q.data(), batch, q_heads, d), VqCodebook<T>{cb.data(), kv_heads, codewords, d},
              MatrixView<float>{lut.data(), std::int64_t(batch) * q_heads, codewords, stride}, pool);
  const std::int32_t group = q_heads / kv_heads;
  std::vector<double> qd(d), cd(d);
  for (std::int64_t row = 0; row < std::int64_t(batch) * q_heads; ++row) {
    for (std::int32_t j = 0; j < d; ++j) qd[j] = to_float(q[row * d + j]);
    const std::int32_t g = std::int32_t(row % q_heads) / group;
    for (std::int32_t c = 0; c < codewords; ++c) {
      double want = 0;
      for (std::int32_t j = 0; j < d; ++j) {
        cd[j] = to_float(cb[(std::size_t(g) * codewords + c) * d + j]);
        want += qd[j] * cd[j];
      }
      ASSERT_NEAR(lut[row * stride + c], want, test::vq_lut_bound(qd.data(), cd.data(), d)) << "row " << row << " c " << c;
    }
    for (std::int64_t c = codewords; c < stride; ++c) ASSERT_TRUE(std::isnan(lut[row * stride + c])) << "padding written";
  }
}

TEST(VqLut, TablesAreQueryDotCodeword) {
  Random rng(test::test_seed());
  cpu::ThreadPool pool(3);
  for (const cpu::SimdLevel level : test::available_simd_levels()) {
    SCOPED_TRACE(testing::Message() << "level " << cpu::simd_level_name(level));
    cpu::ScopedSimdLevel scoped(level);
    check_lut<float>(rng, 2, 8, 2, 16, 64, nullptr);
    check_lut<bfloat16>(rng, 3, 12, 4, 256, 128, &pool);
    check_lut<half>(rng, 1, 32, 8, 4096, 64, &pool);
  }
}

/// VqScanOptions::group_max: each kv head's row is the maximum of its group's per-head rows (`per_head`, [batch *
/// q_heads, cols]), NaN where any of them is NaN, the sentinel where they hold it (past the length).
void expect_group_max(const std::vector<float>& per_head, const std::vector<float>& maxima, std::int32_t batch,
                      std::int32_t q_heads, std::int32_t kv_heads, std::int32_t cols) {
  const std::int32_t group = q_heads / kv_heads;
  for (std::int64_t row = 0; row < std::int64_t(batch) * kv_heads; ++row) {
    for (std::int32_t t = 0; t < cols; ++t) {
      bool nan = false;
      float best = -INFINITY;
      for (std::int32_t u = 0; u < group; ++u) {
        const float x = per_head[std::size_t((row * group + u) * cols + t)];
        nan = nan || std::isnan(x);
        best = std::max(best, x);
      }
      const float got = maxima[std::size_t(row * cols + t)];
      if (nan) {
        ASSERT_TRUE(std::isnan(got)) << "row " << row << " token " << t;
      } else {
        ASSERT_EQ(got, best) << "row " << row << " token " << t;
      }
    }
  }
}

TEST(VqCodeScan, ScoresAreTableEntriesOfTheCodes) {
  Random rng(test::test_seed());
  cpu::ThreadPool pool(3);
  for (const cpu::SimdLevel level : test::available_simd_levels()) {
    SCOPED_TRACE(testing::Message() << "level " << cpu::simd_level_name(level));
    cpu::ScopedSimdLevel scoped(level);
    for (const auto& [batch, q_heads, kv_heads, codewords, cols] :
         {std::tuple{5, 8, 2, 16, 333}, std::tuple{4, 4, 4, 256, 1000}, std::tuple{2, 32, 8, 4096, 2051},
          std::tuple{1, 6, 2, 65536, 100}}) {
      SCOPED_TRACE(testing::Message() << "batch " << batch << " codewords " << codewords << " cols " << cols);
      const ScanProblem sp(rng, batch, q_heads, kv_heads, codewords, cols, true);
      std::vector<float> scores(std::size_t(batch) * q_heads * cols, kScoreSentinel);
      cpu::vq_code_scan(sp.lut_view(), batch, sp.codes_view(), sp.slot_of.data(), sp.lengths.data(),
                        MatrixView<float>::packed(scores.data(), std::int64_t(batch) * q_heads, cols), {}, &pool);
      EXPECT_TRUE(test::same_bytes(scores, sp.expected(sp.lut)));
      std::vector<float> maxima(std::size_t(batch) * kv_heads * cols, kScoreSentinel);
      cpu::vq_code_scan(sp.lut_view(), batch, sp.codes_view(), sp.slot_of.data(), sp.lengths.data(),
                        MatrixView<float>::packed(maxima.data(), std::int64_t(batch) * kv_heads, cols),
                        {.group_max = true}, &pool);
      expect_group_max(scores, maxima, batch, q_heads, kv_heads, cols);
    }
  }
}

/// A codebook and queries in T, and a scan's codes, slots and lengths (invalid codes and slots among them).
template <class T>
struct ScanCase {
  VqProblem p;
  std::vector<T> cb, q;
  ScanProblem sp;
  VqCodebook<T> codebook;
  QueryView<const T> qv;
  ScanCase(Random& rng, std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads, std::int32_t codewords,
           std::int32_t d, std::int32_t cols)
      : p(test::make_vq_problem(rng, kv_heads, codewords, d)), cb(key_codebook<T>(p)),
        q(test::to_storage<T>(rng.normal(std::size_t(batch) * q_heads * d))),
        sp(rng, batch, q_heads, kv_heads, codewords, cols, true), codebook{cb.data(), kv_heads, codewords, d},
        qv(QueryView<const T>::packed(q.data(), batch, q_heads, d)) {}
};

template <class T>
void check_lut_scan(Random& rng, std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads, std::int32_t codewords,
                    std::int32_t d, std::int32_t cols, cpu::ThreadPool* pool) {
  SCOPED_TRACE(testing::Message() << "batch " << batch << " heads " << q_heads << "/" << kv_heads << " codewords "
                                  << codewords << " d " << d << " cols " << cols);
  const ScanCase<T> c(rng, batch, q_heads, kv_heads, codewords, d, cols);
  const VqCodebook<T>& codebook = c.codebook;
  const QueryView<const T>& qv = c.qv;
  const ScanProblem& sp = c.sp;
  std::vector<float> lut(std::size_t(batch) * q_heads * codewords, test::kPoison);
  cpu::vq_lut(qv, codebook, MatrixView<float>::packed(lut.data(), std::int64_t(batch) * q_heads, codewords), pool);
  const std::vector<float> want = sp.expected(lut);
  std::vector<float> scores(want.size(), kScoreSentinel);
  const auto scores_view = MatrixView<float>::packed(scores.data(), std::int64_t(batch) * q_heads, cols);
  test::check_workspace(
      cpu::vq_lut_scan_workspace_bytes(batch, q_heads, kv_heads, codewords, d, pool),
      [&](std::span<std::byte> ws) {
        cpu::vq_lut_scan(qv, codebook, sp.codes_view(), sp.slot_of.data(), sp.lengths.data(), scores_view, {}, ws, pool);
      },
      [&] { return test::bytes_of(scores); }, [&] { std::fill(scores.begin(), scores.end(), kScoreSentinel); });
  EXPECT_TRUE(test::same_bytes(scores, want)) << "the fused scan differs from vq_lut then vq_code_scan";
  // The group maximum: the same workspace; each code read once, the group's entries reduced.
  std::vector<float> maxima(std::size_t(batch) * kv_heads * cols, kScoreSentinel);
  cpu::Array<std::byte> ws(cpu::vq_lut_scan_workspace_bytes(batch, q_heads, kv_heads, codewords, d, pool));
  std::memset(ws.data(), 0xff, ws.size());
  cpu::vq_lut_scan(qv, codebook, sp.codes_view(), sp.slot_of.data(), sp.lengths.data(),
                   MatrixView<float>::packed(maxima.data(), std::int64_t(batch) * kv_heads, cols), {.group_max = true},
                   ws.bytes(), pool);
  expect_group_max(scores, maxima, batch, q_heads, kv_heads, cols);
}

TEST(VqLutScan, EqualsTheTablesThenTheScan) {
  Random rng(test::test_seed());
  cpu::ThreadPool pool(3);
  for (const cpu::SimdLevel level : test::available_simd_levels()) {
    SCOPED_TRACE(testing::Message() << "level " << cpu::simd_level_name(level));
    cpu::ScopedSimdLevel scoped(level);
    check_lut_scan<float>(rng, 3, 8, 2, 16, 64, 300, nullptr);
    check_lut_scan<half>(rng, 2, 6, 3, 256, 64, 77, &pool);
  }
  check_lut_scan<bfloat16>(rng, 5, 32, 8, 4096, 128, 1500, &pool);
}

/// vq_topk_rows (a count per code, thresholds from the codewords' sorted words, one walk) against topk_rows of the
/// scan's scores (vq_lut_scan, then cpu::topk_rows: a selection by rank keys): per-head rows and their union, or the
/// group maximum; invalid codes and slots, ragged lengths, an attention window, budgets per row, few codewords (ties
/// of hundreds of tokens); nan_marks_row on single-head rows; outputs and workspace poisoned.
template <class T>
void check_topk_rows(Random& rng, std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                     std::int32_t codewords, std::int32_t d, std::int32_t cols, std::int32_t k, bool group_max,
                     cpu::ThreadPool* pool) {
  SCOPED_TRACE(testing::Message() << "batch " << batch << " heads " << q_heads << "/" << kv_heads << " codewords "
                                  << codewords << " cols " << cols << " k " << k << " group_max " << group_max);
  const ScanCase<T> c(rng, batch, q_heads, kv_heads, codewords, d, cols);
  const VqCodebook<T>& codebook = c.codebook;
  const QueryView<const T>& qv = c.qv;
  const ScanProblem& sp = c.sp;
  std::vector<std::int32_t> lengths = sp.lengths;  // topk_rows refuses a length past cols
  for (auto& len : lengths) len = std::min(len, cols);
  const std::int32_t heads = group_max ? 1 : q_heads / kv_heads, capacity = heads * k;
  const std::int64_t score_rows = std::int64_t(batch) * kv_heads * heads, rows = std::int64_t(batch) * kv_heads;
  std::vector<std::int32_t> row_k(static_cast<std::size_t>(rows));
  for (auto& r : row_k) r = rng.uniform_int(0, k);
  const VqTopKShape shape{.batch = batch, .q_heads = q_heads, .kv_heads = kv_heads, .codewords = codewords,
                          .head_dim = d, .max_tokens = cols, .k = k, .scan = {.group_max = group_max}};
  for (const bool nan_marks_row : {false, true}) {
    if (nan_marks_row && heads > 1) continue;  // topk_rows' option of single-head rows
    for (const bool per_row_budgets : {false, true}) {
      SCOPED_TRACE(testing::Message() << "nan_marks_row " << nan_marks_row << " per-row budgets " << per_row_budgets);
      const TopKRowsOptions options{.window = {.sink = 3, .recent = 5},
                                    .row_k = per_row_budgets ? row_k.data() : nullptr,
                                    .heads_per_row = heads,
                                    .nan_marks_row = nan_marks_row};
      std::vector<float> scores(std::size_t(score_rows) * cols, kScoreSentinel);
      cpu::Array<std::byte> scan_ws(cpu::vq_lut_scan_workspace_bytes(batch, q_heads, kv_heads, codewords, d, pool));
      cpu::vq_lut_scan(qv, codebook, sp.codes_view(), sp.slot_of.data(), lengths.data(),
                       MatrixView<float>::packed(scores.data(), score_rows, cols), shape.scan, scan_ws.bytes(), pool);
      std::vector<std::int32_t> want(std::size_t(rows) * capacity, -7), want_counts(std::size_t(rows), -7);
      cpu::Array<std::byte> topk_ws(cpu::topk_rows_workspace_bytes(score_rows, cols, k, options, pool));
      cpu::topk_rows(MatrixView<const float>::packed(scores.data(), score_rows, cols), lengths.data(), k, options,
                     SelectionView{want.data(), want_counts.data(), nullptr, batch, kv_heads, capacity}, topk_ws.bytes(),
                     pool);

      std::vector<std::int32_t> got(want.size()), counts(want_counts.size());
      std::vector<float> weights(want.size());
      test::check_workspace(
          cpu::vq_topk_rows_workspace_bytes(shape, pool),
          [&](std::span<std::byte> ws) {
            cpu::vq_topk_rows(qv, codebook, sp.codes_view(), sp.slot_of.data(), lengths.data(), shape, options,
                              SelectionView{got.data(), counts.data(), weights.data(), batch, kv_heads, capacity}, ws,
                              pool);
          },
          [&] { return test::bytes_of(got, counts); },
          [&] {
            std::fill(got.begin(), got.end(), -9);
            std::fill(counts.begin(), counts.end(), -9);
            std::fill(weights.begin(), weights.end(), 1.0f);
          });
      std::int32_t chosen = 0, marked = 0;
      for (std::size_t r = 0; r < counts.size(); ++r) {
        ASSERT_EQ(counts[r], want_counts[r]) << "row " << r;
        marked += counts[r] == -1 ? 1 : 0;
        for (std::int32_t i = 0; i < counts[r]; ++i) {
          ASSERT_EQ(got[r * capacity + i], want[r * capacity + i]) << "row " << r << " entry " << i;
          ASSERT_EQ(weights[r * capacity + i], 0.0f) << "row " << r << " entry " << i;
        }
        chosen += std::max(counts[r], 0);
      }
      if (nan_marks_row) {
        EXPECT_GT(marked, 0) << "no row held a NaN: nan_marks_row untested";
      } else {
        EXPECT_GT(chosen, 0) << "no row chose a token: the comparison tested nothing";
      }
    }
  }
}

TEST(VqTopKRows, EqualTheTopKOfTheScan) {
  Random rng(test::test_seed());
  cpu::ThreadPool pool(3);
  for (const bool group_max : {false, true}) {
    check_topk_rows<half>(rng, 5, 8, 2, 256, 64, 3001, 100, group_max, nullptr);
    check_topk_rows<bfloat16>(rng, 4, 32, 8, 4096, 128, 2000, 60, group_max, &pool);
    check_topk_rows<float>(rng, 6, 8, 2, 16, 64, 5000, 400, group_max, &pool);  // 16 codewords: ties of hundreds
    check_topk_rows<half>(rng, 3, 20, 1, 100, 64, 700, 30, group_max, nullptr);  // a group of 20
  }
}

TEST(VqTopKRows, RefusesWhatTopKRowsRefuses) {
  std::vector<half> q(2 * 8 * 64), cbook(2 * 16 * 64);
  std::vector<std::uint16_t> codes(2 * 2 * 10);
  const auto qv = QueryView<const half>::packed(q.data(), 2, 8, 64);
  const VqCodebook<half> book{cbook.data(), 2, 16, 64};
  const auto cv = VqCodesView<const std::uint16_t>::packed(codes.data(), 2, 2, 10);
  const VqTopKShape shape{.batch = 2, .q_heads = 8, .kv_heads = 2, .codewords = 16, .head_dim = 64, .max_tokens = 10, .k = 3};
  std::vector<std::int32_t> picked(2 * 2 * 12), counts(2 * 2);
  const SelectionView out{picked.data(), counts.data(), nullptr, 2, 2, 12};
  cpu::Array<std::byte> ws(cpu::vq_topk_rows_workspace_bytes(shape, {}));
  const std::int32_t slots[2] = {0, 1}, too_long[2] = {3, 11}, lengths[2] = {3, 4}, row_k[4] = {1, 4, 0, 2};
  test::expect_error([&] { cpu::vq_topk_rows(qv, book, cv, slots, too_long, shape, {.heads_per_row = 4}, out, ws.bytes()); },
                     "cpu::vq_topk_rows: lengths[1] (= 11) is outside [0, shape.max_tokens = 10]");
  test::expect_error(
      [&] { cpu::vq_topk_rows(qv, book, cv, slots, lengths, shape, {.row_k = row_k, .heads_per_row = 4}, out, ws.bytes()); },
      "options.row_k[1] (= 4) is outside [0, k = 3]");
  test::expect_error(
      [&] {
        cpu::vq_topk_rows(qv, book, cv, slots, lengths, shape, {.heads_per_row = 4},
                          SelectionView{picked.data(), counts.data(), nullptr, 2, 2, 11}, ws.bytes());
      },
      "out.capacity (= 11) < options.heads_per_row * k (= 4 * 3)");
  test::expect_error([&] { cpu::vq_topk_rows(qv, book, cv, nullptr, lengths, shape, {.heads_per_row = 4}, out, ws.bytes()); },
                     "slots must be non-null");
  test::expect_error(
      [&] { cpu::vq_topk_rows(qv, book, cv, slots, lengths, shape, {.heads_per_row = 4, .nan_marks_row = true}, out, ws.bytes()); },
      "options.nan_marks_row needs options.heads_per_row == 1 (it is 4)");
}

/// Both row scans at the benchmark's shape (128K tokens, 32 query heads over 8 kv heads, 4096 codewords): the
/// same bits, and the time of each (printed; selectors/a2ats/cpu/vq.hpp's choice of gathers rests on it).
TEST(VqCodeScan, Avx512GathersAndScalarLoadsAgreeAndAreTimed) {
  if (cpu::detected_simd_level() != cpu::SimdLevel::avx512) GTEST_SKIP() << "no AVX-512 on this CPU";
  Random rng(test::test_seed());
  const std::int32_t cols = 131072;
  const ScanProblem sp(rng, 1, 32, 8, 4096, cols, false);
  std::vector<float> first;
  for (const cpu::SimdLevel level : {cpu::SimdLevel::scalar, cpu::SimdLevel::avx512}) {
    cpu::ScopedSimdLevel scoped(level);
    std::vector<float> scores(std::size_t(32) * cols, kScoreSentinel);
    const auto view = MatrixView<float>::packed(scores.data(), 32, cols);
    std::vector<int> lengths_full(1, cols);
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      cpu::vq_code_scan(sp.lut_view(), 1, sp.codes_view(), sp.slot_of.data(), lengths_full.data(), view, {});
      best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    }
    std::printf("[ timing ] vq_code_scan %s, one thread, 128K tokens x 32 heads: %.0f us (%.2f GB/s written)\n",
                std::string(cpu::simd_level_name(level)).c_str(), best, 32.0 * cols * 4 / best / 1e3);
    if (first.empty()) {
      first = scores;
    } else {
      EXPECT_TRUE(test::same_bytes(first, scores));
    }
  }
}

TEST(VqBadInput, RefusedWithTheirMessages) {
  std::vector<float> f(64 * 64 * 4, 1.0f);
  std::vector<half> keys(64 * 2 * 64);
  std::vector<std::uint16_t> codes(2 * 2 * 10);
  const auto key_view = HeadsView<const half>::packed(keys.data(), 64, 2, 64);
  const auto codes_view = VqCodesView<std::uint16_t>::packed(codes.data(), 2, 2, 10);
  const VqEncodeCodebook good{f.data(), f.data(), f.data(), 2, 16, 64};
  cpu::Array<std::byte> ws(cpu::vq_encode_workspace_bytes(16, 64, nullptr));
  const auto encode = [&](VqEncodeCodebook cb, HeadsView<const half> k, VqCodesView<std::uint16_t> c) {
    return [=, &ws] { cpu::vq_encode(k, cb, c, {}, ws.bytes()); };
  };
  auto cb = good;
  cb.codewords = 0;
  test::expect_error(encode(cb, key_view, codes_view), "cpu::vq_encode: codebook.codewords (= 0) is outside [1, 65536]");
  cb.codewords = 65537;
  test::expect_error(encode(cb, key_view, codes_view), "codebook.codewords (= 65537) is outside [1, 65536]");
  test::expect_error([] { (void)cpu::vq_encode_workspace_bytes(65537, 64, nullptr); }, "codewords (= 65537)");
  test::expect_error([] { (void)cpu::vq_encode_workspace_bytes(16, 96, nullptr); },
                     "head_dim (= 96) is not supported (supported: 64, 128)");
  test::expect_error(encode(good, HeadsView<const half>::packed(keys.data(), 64, 2, 32), codes_view),
                     "keys.head_dim (= 32) is not supported");
  cb = good;
  cb.kv_heads = 1;
  test::expect_error(encode(cb, key_view, codes_view), "codebook is [kv_heads = 1, head_dim = 64]; keys has 2 heads");
  test::expect_error(encode(good, key_view, VqCodesView<std::uint16_t>::packed(codes.data(), 2, 1, 20)),
                     "codes.kv_heads (= 1) != keys.heads (= 2)");
  cb = good;
  cb.norms = nullptr;
  test::expect_error(encode(cb, key_view, codes_view), "codebook.norms must be non-null");
  test::expect_error([&] { cpu::vq_encode(key_view, good, codes_view, {}, ws.bytes().first(ws.size() - 256)); },
                     "workspace too small");

  std::vector<half> q(2 * 8 * 64), cbook(2 * 16 * 64);
  std::vector<float> lut(2 * 8 * 16), scores(2 * 8 * 10);
  const auto qv = QueryView<const half>::packed(q.data(), 2, 8, 64);
  const VqCodebook<half> book{cbook.data(), 2, 16, 64};
  const auto lut_view = MatrixView<float>::packed(lut.data(), 16, 16);
  test::expect_error([&] { cpu::vq_lut(QueryView<const half>::packed(q.data(), 2, 7, 64), book, lut_view); },
                     "q.heads (= 7) is not a multiple of codebook.kv_heads (= 2)");
  test::expect_error([&] { cpu::vq_lut(qv, book, MatrixView<float>::packed(lut.data(), 15, 16)); },
                     "lut is [15, 16]; expected [batch * q_heads = 2 * 8, codewords = 16]");
  test::expect_error([&] { cpu::vq_lut(qv, VqCodebook<half>{cbook.data(), 2, 0, 64}, lut_view); },
                     "codebook.codewords (= 0) is outside [1, 65536]");
  test::expect_error([&] { cpu::vq_lut(QueryView<const half>::packed(q.data(), 2, 8, 128), book, lut_view); },
                     "q.head_dim (= 128) != codebook.head_dim (= 64)");
  const std::int32_t slots[2] = {0, 1}, lengths[2] = {3, 4};
  const auto table = MatrixView<const float>::packed(lut.data(), 16, 16);
  const auto cv = VqCodesView<const std::uint16_t>::packed(codes.data(), 2, 2, 10);
  test::expect_error(
      [&] { cpu::vq_code_scan(table, 2, cv, slots, lengths, MatrixView<float>::packed(scores.data(), 15, 10), {}); },
      "scores.rows (= 15) != batch * q_heads (= 2 * 8)");
  test::expect_error(
      [&] {
        cpu::vq_code_scan(table, 2, cv, slots, lengths, MatrixView<float>::packed(scores.data(), 16, 10),
                          {.group_max = true});
      },
      "scores.rows (= 16) != batch * kv_heads (options.group_max) (= 2 * 2)");
  test::expect_error(
      [&] { cpu::vq_code_scan(table, 3, cv, slots, lengths, MatrixView<float>::packed(scores.data(), 16, 10), {}); },
      "lut.rows (= 16) is not a positive multiple of batch (= 3)");
  test::expect_error(
      [&] { cpu::vq_code_scan(table, 2, cv, nullptr, lengths, MatrixView<float>::packed(scores.data(), 16, 10), {}); },
      "slots and lengths must be non-null");
  test::expect_error(
      [&] {
        cpu::vq_lut_scan(qv, book, VqCodesView<const std::uint16_t>::packed(codes.data(), 1, 4, 10), slots, lengths,
                         MatrixView<float>::packed(scores.data(), 16, 10), {}, {});
      },
      "codes.kv_heads (= 4) != codebook.kv_heads (= 2)");
  test::expect_error(
      [&] {
        cpu::vq_lut_scan(qv, book, cv, slots, lengths, MatrixView<float>::packed(scores.data(), 16, 10),
                         {.group_max = true}, {});
      },
      "scores.rows (= 16) != batch * kv_heads (options.group_max) (= 2 * 2)");
  test::expect_error([] { (void)cpu::vq_lut_scan_workspace_bytes(1, 6, 4, 16, 64, nullptr); },
                     "q_heads a multiple of kv_heads");
  test::expect_error([&] { cpu::vq_lut_scan(qv, book, cv, slots, lengths, MatrixView<float>::packed(scores.data(), 16, 10), {}, {}); },
                     "workspace too small");

  // vq_topk_rows: its shape must be the arguments', its options the shape's top-k; its workspace is checked.
  const VqTopKShape shape{.batch = 2, .q_heads = 8, .kv_heads = 2, .codewords = 16, .head_dim = 64, .max_tokens = 10, .k = 3};
  std::vector<std::int32_t> picked(2 * 2 * 12), counts(2 * 2);
  const SelectionView out{picked.data(), counts.data(), nullptr, 2, 2, 12};
  cpu::Array<std::byte> topk_ws(cpu::vq_topk_rows_workspace_bytes(shape, {}));
  const auto topk = [&](VqTopKShape s, TopKRowsOptions o, std::span<std::byte> w) {
    return [=, &qv, &book, &cv, &slots, &lengths, &out] { cpu::vq_topk_rows(qv, book, cv, slots, lengths, s, o, out, w); };
  };
  test::expect_error(topk(shape, {.heads_per_row = 1}, topk_ws.bytes()),
                     "cpu::vq_topk_rows: options.heads_per_row (= 1) must be 4 (the group without it: q_heads 8, kv_heads 2)");
  auto group_max = shape;
  group_max.scan.group_max = true;
  test::expect_error(topk(group_max, {.heads_per_row = 4}, topk_ws.bytes()),
                     "options.heads_per_row (= 4) must be 1 (1 with scan.group_max");
  auto wrong = shape;
  wrong.codewords = 32;
  test::expect_error(topk(wrong, {.heads_per_row = 4}, topk_ws.bytes()),
                     "shape (batch 2, q_heads 8, kv_heads 2, codewords 32, head_dim 64) is not the arguments' (q: batch 2, "
                     "heads 8, head_dim 64; codebook: kv_heads 2, codewords 16)");
  wrong = shape;
  wrong.max_tokens = 0;
  test::expect_error([&] { (void)cpu::vq_topk_rows_workspace_bytes(wrong, {}); },
                     "cpu::vq_topk_rows_workspace_bytes: max_tokens (= 0) must be positive");
  test::expect_error(topk(shape, {.heads_per_row = 4}, topk_ws.bytes().first(topk_ws.size() - 256)),
                     "workspace too small");
}

}  // namespace
}  // namespace kvsift
