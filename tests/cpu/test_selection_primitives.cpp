// The selection primitives every selector calls: cpu::group_scores (the decode query's GQA groups scored
// against the KV cache) and cpu::topk_rows (each row's best tokens outside the attention window, into a
// selection), against independent fp64 loops written here, at every SIMD level this machine runs.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "attention_check.hpp"
#include "group_scores_problem.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/simd.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "kvsift/cpu/topk.hpp"
#include "mass_budgets_problem.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using cpu::SimdLevel;
using test::describe;
using test::kSoftmaxRel;
using test::kUlp;
using test::Random;
using test::type_name;

/// A 256-byte aligned host workspace of exactly `bytes` bytes, every byte 0xff (NaN as floats), so that a run
/// cannot pass by reading what it did not write.
class PoisonedWorkspace {
 public:
  explicit PoisonedWorkspace(std::size_t bytes) : blocks_(bytes / sizeof(Block) + 1), bytes_(bytes) {
    std::memset(blocks_.data(), 0xff, blocks_.size() * sizeof(Block));
  }
  std::byte* data() { return reinterpret_cast<std::byte*>(blocks_.data()); }
  std::span<std::byte> span() { return {data(), bytes_}; }

 private:
  struct alignas(WorkspaceLayout::kAlignment) Block {
    std::byte bytes[WorkspaceLayout::kAlignment];
  };
  std::vector<Block> blocks_;
  std::size_t bytes_;
};

// ---- group_scores ------------------------------------------------------------------------------------------

/// A decode query and a KV cache in storage type T, contiguous and paged (group_scores_problem.hpp).
template <class T>
using ScoreProblem = test::GroupScoresProblem<T>;

/// Scores in a matrix wider than the longest sequence and with a row stride past its width, poisoned (NaN):
/// entries a run must not write stay NaN.
struct ScoreMatrix {
  std::int64_t rows;
  std::int32_t cols;
  std::int64_t stride;
  std::vector<float> data;
  ScoreMatrix(std::int64_t rows_, std::int32_t cols_)
      : rows(rows_), cols(cols_), stride(cols_ + 5), data(std::size_t(rows_ * stride), test::kPoison) {}
  MatrixView<float> view() { return {data.data(), rows, cols, stride}; }
  float at(std::int64_t r, std::int64_t t) const { return data[std::size_t(r * stride + t)]; }
};

/// The fp64 scores of a problem, with a bound on the error of the fp32 computation per entry.
struct ExpectedScores {
  std::vector<double> value, tolerance;  ///< [rows, longest]
};

/// Error bounds, relative to the magnitudes they scale (group_scores_problem.hpp's kUlp, kSoftmaxRel). A fp32
/// dot product of d terms accumulated in fp32 (any order, FMA or not) errs by at most d * 2^-24 * sum |q_c k_c|;
/// scaling adds one rounding. A softmax weight exp(s - LSE) errs relatively by the errors of s and of LSE (which
/// is at most its largest logit's error, plus kSoftmaxRel).
template <class T>
ExpectedScores expected_scores(const ScoreProblem<T>& p, const GroupScoreOptions& options) {
  const std::int32_t group = p.q_heads / p.kv_heads, d = p.head_dim, longest = p.longest();
  const double scale = test::score_scale(options, d);
  const bool sum = options.reduce == GroupReduce::sum;
  ExpectedScores e{std::vector<double>(std::size_t(p.batch) * p.kv_heads * longest),
                   std::vector<double>(std::size_t(p.batch) * p.kv_heads * longest)};
  for (std::int32_t b = 0; b < p.batch; ++b) {
    const std::int32_t n = p.values.seq_lens[b];
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      const test::GroupLogits l = test::group_logits(p, b, g, n, scale);
      std::vector<double> bound(std::size_t(group) * n), largest_bound(group, 0.0);
      for (std::size_t i = 0; i < bound.size(); ++i) {
        bound[i] = (d + 2) * kUlp * l.magnitude[i];
        largest_bound[i / std::size_t(n)] = std::max(largest_bound[i / std::size_t(n)], bound[i]);
      }
      for (std::int32_t t = 0; t < n; ++t) {
        double value = 0.0, tolerance = 0.0;
        for (std::int32_t h = 0; h < group; ++h) {
          const double s = l.logit[std::size_t(h) * n + t], err = bound[std::size_t(h) * n + t];
          double x = s, x_tolerance = err + kUlp * std::abs(s);
          if (options.softmax) {
            x = std::exp(s - l.lse[h]);
            x_tolerance = x * (err + largest_bound[h] + kSoftmaxRel) + 1e-30;
          }
          value = h == 0 ? x : sum ? value + x : std::max(value, x);
          tolerance = sum ? tolerance + x_tolerance : std::max(tolerance, x_tolerance);
        }
        const std::size_t i = (std::size_t(b) * p.kv_heads + g) * longest + t;
        e.value[i] = value;
        e.tolerance[i] = tolerance + (sum ? 2 * group * kUlp * std::abs(value) : 0.0);
      }
    }
  }
  return e;
}

/// Runs group_scores on the problem (contiguous or paged) into poisoned scores with an exactly sized,
/// poisoned workspace.
template <class T>
ScoreMatrix run_group_scores(const ScoreProblem<T>& p, bool paged, const GroupScoreOptions& options,
                             cpu::ThreadPool* pool = nullptr, std::int32_t extra_cols = 3) {
  ScoreMatrix scores(std::int64_t(p.batch) * p.kv_heads, p.longest() + extra_cols);
  PoisonedWorkspace workspace(
      cpu::group_scores_workspace_bytes(p.batch, p.q_heads, p.kv_heads, scores.cols, options));
  if (paged) {
    cpu::group_scores(p.q_view(), p.paged(), scores.view(), options, workspace.span(), pool);
  } else {
    cpu::group_scores(p.q_view(), p.contiguous(), scores.view(), options, workspace.span(), pool);
  }
  return scores;
}

template <class T>
void expect_scores_match(const ScoreProblem<T>& p, const ScoreMatrix& scores, const ExpectedScores& e) {
  for (std::int32_t b = 0; b < p.batch; ++b) {
    const std::int32_t n = p.values.seq_lens[b];
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      const std::int64_t row = std::int64_t(b) * p.kv_heads + g;
      for (std::int32_t t = 0; t < n; ++t) {
        const std::size_t i = std::size_t(row) * p.longest() + t;
        ASSERT_NEAR(scores.at(row, t), e.value[i], e.tolerance[i]) << "sequence " << b << " kv head " << g << " token " << t;
      }
      for (std::int32_t t = n; t < scores.stride; ++t) {  // past the sequence, and past the columns: untouched
        ASSERT_TRUE(std::isnan(scores.at(row, t))) << "sequence " << b << " kv head " << g << " token " << t;
      }
    }
  }
}

GroupScoreOptions random_options(Random& rng) {
  return {.sm_scale = std::vector<float>{0.0f, 0.0f, 0.3f, -0.2f}[rng.uniform_int(0, 3)],
          .reduce = rng.uniform_int(0, 1) == 1 ? GroupReduce::sum : GroupReduce::max,
          .softmax = rng.uniform_int(0, 1) == 1};
}


using GroupScores = test::SeededTest;

TEST_F(GroupScores, MatchFp64AtEverySimdLevelTypeAndLayout) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    const auto check = [&]<class T>(T, int trial) {
      const std::int32_t kv_heads = rng.uniform_int(1, 3), batch = rng.uniform_int(1, 3);
      const std::int32_t group = std::vector<std::int32_t>{1, 3, 4, 8, 12}[rng.uniform_int(0, 4)];
      const std::int32_t head_dim = std::vector<std::int32_t>{16, 33, 64, 100, 128}[rng.uniform_int(0, 4)];
      // Ragged lengths: an empty sequence now and then, short ones, and (trial 0) one past two 2048-token chunks.
      std::vector<std::int32_t> lengths(batch);
      for (auto& n : lengths) n = rng.uniform_int(0, 4) == 0 ? 0 : rng.uniform_int(1, 300);
      if (trial == 0) lengths[0] = rng.uniform_int(4097, 4600);
      if (lengths.back() == 0) lengths.back() = 1;  // a paged cache of only empty sequences has no page array at all
      const std::int32_t page_size = std::vector<std::int32_t>{0, 16, 7}[rng.uniform_int(0, 2)];
      const auto options = random_options(rng);
      SCOPED_TRACE(fmt::format("{} {} batch {} kv_heads {} group {} head_dim {} page_size {} lengths [{}] {}",
                               cpu::simd_level_name(level), type_name<T>(), batch, kv_heads, group, head_dim, page_size,
                               fmt::join(lengths, ", "), describe(options)));
      const ScoreProblem<T> p(rng, batch, group * kv_heads, kv_heads, head_dim, lengths, page_size);
      expect_scores_match(p, run_group_scores(p, page_size > 0, options), expected_scores(p, options));
    };
    for (int trial = 0; trial < 6; ++trial) {
      check(float{}, trial);
      check(half{}, trial);
      check(bfloat16{}, trial);
    }
  }
}

TEST_F(GroupScores, EveryReductionOnOneProblem) {
  // The four (reduce, softmax) forms side by side, contiguous and paged, at the widest level.
  const ScoreProblem<bfloat16> p(rng, 2, 8, 2, 128, {700, 33}, 16);
  for (const bool softmax : {false, true}) {
    for (const auto reduce : {GroupReduce::max, GroupReduce::sum}) {
      const GroupScoreOptions options{.reduce = reduce, .softmax = softmax};
      SCOPED_TRACE(describe(options));
      const auto e = expected_scores(p, options);
      expect_scores_match(p, run_group_scores(p, false, options), e);
      expect_scores_match(p, run_group_scores(p, true, options), e);
    }
  }
}

TEST_F(GroupScores, NaNNeverVanishes) {
  for (SimdLevel level : test::available_simd_levels()) {
    cpu::ScopedSimdLevel force(level);
    const auto check = [&]<class T>(T) {
      SCOPED_TRACE(fmt::format("{} {}", cpu::simd_level_name(level), type_name<T>()));
      // Two kv heads of a group of 4, 300 tokens; each case corrupts kv head 0 only (row 0), so row 1 stays finite.
      const auto fresh = [&] { return ScoreProblem<T>(rng, 1, 8, 2, 64, {300}, 0); };
      const auto run = [&](const ScoreProblem<T>& p, bool softmax, GroupReduce reduce, float sm_scale = 0.0f) {
        return run_group_scores(p, false, {.sm_scale = sm_scale, .reduce = reduce, .softmax = softmax}, nullptr, 0);
      };
      const auto finite_row = [](const ScoreMatrix& s, std::int64_t row) {
        for (std::int32_t t = 0; t < s.cols; ++t) {
          if (!std::isfinite(s.at(row, t))) return false;
        }
        return true;
      };
      const auto nan_row = [](const ScoreMatrix& s, std::int64_t row) {
        for (std::int32_t t = 0; t < s.cols; ++t) {
          if (!std::isnan(s.at(row, t))) return false;
        }
        return true;
      };
      for (const auto reduce : {GroupReduce::max, GroupReduce::sum}) {
        // A NaN in one key: that token's raw score; the whole row's softmax scores.
        auto p = fresh();
        p.set_k(0, 0, 5, 3, NAN);
        const auto raw = run(p, false, reduce);
        EXPECT_TRUE(std::isnan(raw.at(0, 5)));
        EXPECT_TRUE(std::isfinite(raw.at(0, 4)) && std::isfinite(raw.at(0, 6)));
        EXPECT_TRUE(finite_row(raw, 1));
        const auto soft = run(p, true, reduce);
        EXPECT_TRUE(nan_row(soft, 0));
        EXPECT_TRUE(finite_row(soft, 1));
        // A NaN in one query head: every score of its group, in both forms.
        p = fresh();
        p.set_q(0, 2, 0, NAN);
        EXPECT_TRUE(nan_row(run(p, false, reduce), 0));
        EXPECT_TRUE(nan_row(run(p, true, reduce), 0));
        EXPECT_TRUE(finite_row(run(p, true, reduce), 1));
        // A NaN sm_scale: everything.
        p = fresh();
        EXPECT_TRUE(nan_row(run(p, true, reduce, NAN), 1));
        EXPECT_TRUE(nan_row(run(p, false, reduce, NAN), 1));
        // A +inf logit (a key of +inf against positive queries): the raw score is +inf, the softmax has none.
        for (std::int32_t h = 0; h < 4; ++h) {
          for (std::int32_t c = 0; c < 64; ++c) p.set_q(0, h, c, 0.5f);
        }
        for (std::int32_t c = 0; c < 64; ++c) p.set_k(0, 0, 7, c, INFINITY);
        EXPECT_EQ(run(p, false, reduce).at(0, 7), INFINITY);
        EXPECT_TRUE(nan_row(run(p, true, reduce), 0));
      }
    };
    check(float{});
    check(half{});
    check(bfloat16{});
  }
}

TEST_F(GroupScores, IdenticalForEveryThreadCount) {
  // Ragged rows of up to three 2048-token chunks, fewer rows than threads for the larger pools.
  const ScoreProblem<bfloat16> p(rng, 3, 8, 2, 64, {5000, 0, 2100}, 0);
  for (const auto& options : {GroupScoreOptions{.softmax = true},
                              GroupScoreOptions{.reduce = GroupReduce::sum, .softmax = true},
                              GroupScoreOptions{.reduce = GroupReduce::sum}}) {
    SCOPED_TRACE(describe(options));
    const auto alone = run_group_scores(p, false, options);
    for (int threads : {1, 2, 3, 7}) {
      cpu::ThreadPool pool(threads);
      const auto pooled = run_group_scores(p, false, options, &pool);
      EXPECT_EQ(0, std::memcmp(alone.data.data(), pooled.data.data(), alone.data.size() * sizeof(float))) << threads;
    }
  }
}

// heads_per_row: each set of the group's heads reduces into its own score row, exactly as a group_scores call
// whose group is that set alone (one kv head, so the set is a plain sub-view of the queries): the same bits.
TEST_F(GroupScores, HeadsPerRowReducesEachSetLikeAGroupOfItsOwn) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const auto check = [&]<class T>(T, std::int32_t page_size) {
    const ScoreProblem<T> p(rng, 2, 12, 1, 64, {rng.uniform_int(1, 3000), 2500}, page_size);
    for (const std::int32_t per : {1, 3, 4, 12}) {
      for (const GroupReduce reduce : {GroupReduce::max, GroupReduce::sum}) {
        const GroupScoreOptions options{.reduce = reduce, .softmax = true, .heads_per_row = per};
        const std::int32_t sets = 12 / per, cols = p.longest() + 3;
        ScoreMatrix all(std::int64_t(p.batch) * sets, cols);
        PoisonedWorkspace ws(cpu::group_scores_workspace_bytes(p.batch, 12, 1, cols, options));
        const auto run = [&](const QueryView<const T>& q, const MatrixView<float>& out, std::span<std::byte> w,
                             const GroupScoreOptions& o) {
          if (page_size > 0) {
            cpu::group_scores(q, p.paged(), out, o, w);
          } else {
            cpu::group_scores(q, p.contiguous(), out, o, w);
          }
        };
        run(p.q_view(), all.view(), ws.span(), options);
        for (std::int32_t set = 0; set < sets; ++set) {
          QueryView<const T> q = p.q_view();
          q.data += std::int64_t(set) * per * q.head_stride;
          q.heads = per;
          const GroupScoreOptions whole{.reduce = reduce, .softmax = true};
          ScoreMatrix alone(p.batch, cols);
          PoisonedWorkspace alone_ws(cpu::group_scores_workspace_bytes(p.batch, per, 1, cols, whole));
          run(q, alone.view(), alone_ws.span(), whole);
          for (std::int32_t b = 0; b < p.batch; ++b) {
            for (std::int32_t t = 0; t < cols + 5; ++t) {
              const float got = all.at(std::int64_t(b) * sets + set, t), want = alone.at(b, t);
              ASSERT_TRUE(std::memcmp(&got, &want, sizeof(float)) == 0 || (std::isnan(got) && std::isnan(want)))
                  << type_name<T>() << " per " << per << " set " << set << " sequence " << b << " token " << t;
            }
          }
        }
      }
    }
  };
  for (const std::int32_t page_size : {0, 16}) {
    check(float{}, page_size);
    check(bfloat16{}, page_size);
  }
  // Refused: a set size that does not divide the group, raw scores in sets, scores without a row per set.
  const ScoreProblem<float> p(rng, 1, 12, 1, 64, {100}, 0);
  std::vector<float> scores(3 * 100);
  const auto go = [&](const GroupScoreOptions& o, std::int64_t rows) {
    cpu::group_scores(p.q_view(), p.contiguous(), MatrixView<float>::packed(scores.data(), rows, 100), o, {});
  };
  test::expect_error([&] { go({.softmax = true, .heads_per_row = 5}, 3); },
                     "options.heads_per_row (= 5) must divide the group (q_heads / kv_heads = 12)");
  test::expect_error([&] { go({.heads_per_row = 4}, 3); }, "options.heads_per_row (= 4) needs options.softmax");
  test::expect_error([&] { go({.softmax = true, .heads_per_row = 4}, 2); },
                     "scores.rows (= 2) != kv.batch * kv.kv_heads * score rows per kv head (= 1 * 1 * 3)");
}

TEST_F(GroupScores, WorkspaceQueryAndRefusals) {
  const ScoreProblem<half> p(rng, 2, 6, 2, 32, {40, 12}, 0);
  const GroupScoreOptions softmax{.softmax = true}, raw{};
  EXPECT_EQ(cpu::group_scores_workspace_bytes(2, 6, 2, 40, raw), 0u);
  const std::size_t needed = cpu::group_scores_workspace_bytes(2, 6, 2, 40, softmax);
  EXPECT_GE(needed, std::size_t(4) * 2 * 6 * 40);  // the per-head logits
  EXPECT_LE(needed, std::size_t(4) * 2 * 6 * 40 + 3 * WorkspaceLayout::kAlignment);  // and two floats per (row, head)
  EXPECT_EQ(needed % WorkspaceLayout::kAlignment, 0u);

  ScoreMatrix scores(4, 40);
  PoisonedWorkspace buffer(needed);
  const auto go = [&](auto q, auto kv, MatrixView<float> s, GroupScoreOptions options, std::span<std::byte> ws) {
    cpu::group_scores(q, kv, s, options, ws);
  };
  go(p.q_view(), p.contiguous(), scores.view(), raw, {});  // no workspace needed
  go(p.q_view(), p.contiguous(), scores.view(), softmax, buffer.span());
  test::expect_error([&] { go(p.q_view(), p.contiguous(), scores.view(), softmax, {buffer.data(), needed - 256}); },
                     "kvsift::cpu::group_scores: workspace too small: 'chunk_sum' needs bytes");
  test::expect_error([&] { go(p.q_view(), p.contiguous(), scores.view(), softmax, {buffer.data() + 4, needed}); },
                     "is not 256-byte aligned");
  test::expect_error([&] { go(p.q_view(), p.contiguous(), scores.view(), softmax, {}); }, "workspace too small: 'logits'");

  // Shapes.
  auto bad_q = p.q_view();
  bad_q.heads = 5;
  bad_q.batch_stride = 5 * 32;
  test::expect_error([&] { go(bad_q, p.contiguous(), scores.view(), raw, {}); },
                     "q.heads (= 5) is not a multiple of kv.kv_heads (= 2)");
  bad_q = p.q_view();
  bad_q.batch = 1;
  test::expect_error([&] { go(bad_q, p.contiguous(), scores.view(), raw, {}); }, "kv.batch (= 2) != q.batch (= 1)");
  auto bad_kv = p.contiguous();
  bad_kv.head_dim = 16;
  test::expect_error([&] { go(p.q_view(), bad_kv, scores.view(), raw, {}); }, "kv.head_dim (= 16) != q.head_dim (= 32)");
  bad_kv = p.contiguous();
  bad_kv.capacity = 30;  // below seq_lens[0] = 40
  test::expect_error([&] { go(p.q_view(), bad_kv, scores.view(), raw, {}); },
                     "kv.seq_lens[0] (= 40) is outside [0, capacity = 30]");
  test::expect_error([&] { go(p.q_view(), p.contiguous(), MatrixView<float>{scores.data.data(), 3, 40, 45}, raw, {}); },
                     "scores.rows (= 3) != kv.batch * kv.kv_heads (= 2 * 2)");
  test::expect_error([&] { go(p.q_view(), p.contiguous(), MatrixView<float>{scores.data.data(), 4, 39, 45}, raw, {}); },
                     "scores.cols (= 39) < kv.seq_len(0) (= 40)");
  test::expect_error([&] { go(p.q_view(), p.contiguous(), MatrixView<float>{nullptr, 4, 40, 45}, raw, {}); },
                     "scores.data is a null pointer");
  test::expect_error(
      [&] { go(p.q_view(), p.contiguous(), scores.view(), {.reduce = GroupReduce(7)}, {}); },
      "options.reduce (= 7) is neither GroupReduce::max nor GroupReduce::sum");
  const ScoreProblem<half> wide(rng, 1, 1, 1, 300, {4}, 0);
  test::expect_error(
      [&] { go(wide.q_view(), wide.contiguous(), MatrixView<float>::packed(scores.data.data(), 1, 4), raw, {}); },
      "head_dim (= 300) exceeds the CPU kernels' limit of 256");
  // The size query.
  test::expect_error([] { cpu::group_scores_workspace_bytes(1, 6, 4, 10, {}); },
                     "kvsift::cpu::group_scores_workspace_bytes: q_heads (= 6) is not a multiple of kv_heads (= 4)");
  test::expect_error([] { cpu::group_scores_workspace_bytes(1, 4, 4, 0, {}); }, "max_tokens (= 0) must be positive");
}

// ---- topk_rows ---------------------------------------------------------------------------------------------

/// kvsift's ranking rule, stated independently of the implementation: NaN first, then higher score, on equal
/// scores the smaller index first.
bool ranks_before(float a, std::int32_t ia, float b, std::int32_t ib) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

/// One top-K problem: scores with many ties (or continuous ones, spread over many of topk_rows' radix bins),
/// NaN, infinities and signed zeros; ragged lengths (0, inside the window, below k, up to cols); optionally a
/// k per selection row and several score rows per selection row; with one score row per selection row, half of
/// the problems write their picks through a random id table (TopKRowsOptions::ids).
struct TopKProblem {
  std::int32_t batch, kv_heads, heads_per_row, cols, k, capacity;
  AttentionWindow window;
  bool weights;
  std::vector<float> scores;  ///< [batch * kv_heads * heads_per_row, cols + 2] (row stride past the width)
  std::vector<std::int32_t> lengths;
  std::vector<std::int32_t> row_k;  ///< [batch * kv_heads] or empty
  std::vector<std::int32_t> ids;    ///< [batch * kv_heads, ids_stride()] or empty

  std::int64_t rows() const { return std::int64_t(batch) * kv_heads * heads_per_row; }
  std::int64_t stride() const { return cols + 2; }
  std::int64_t ids_stride() const { return cols + 3; }
  MatrixView<const float> view() const { return {scores.data(), rows(), cols, stride()}; }
  TopKRowsOptions options() const {
    return {.window = window, .row_k = row_k.empty() ? nullptr : row_k.data(), .heads_per_row = heads_per_row,
            .ids = ids.empty() ? nullptr : ids.data(), .ids_stride = ids.empty() ? 0 : ids_stride()};
  }

  TopKProblem(Random& rng, std::int32_t batch_, std::int32_t kv_heads_, std::int32_t heads_per_row_, std::int32_t cols_,
              std::int32_t k_, AttentionWindow window_, bool weights_, bool per_row_k)
      : batch(batch_), kv_heads(kv_heads_), heads_per_row(heads_per_row_), cols(cols_), k(k_),
        capacity(heads_per_row_ * k_ + 3), window(window_), weights(weights_) {
    scores.resize(std::size_t(rows()) * stride());
    const int spread = std::vector<int>{0, 3, 40}[rng.uniform_int(0, 2)];  // 0: continuous; 3: nearly all ties
    const float scale = rng.uniform(0.001f, 1000.0f);
    for (auto& s : scores) {
      const int kind = rng.uniform_int(0, 60);
      s = kind == 0   ? NAN
          : kind == 1 ? -INFINITY
          : kind == 2 ? INFINITY
          : kind == 3 ? -0.0f
          : spread > 0 ? float(rng.uniform_int(-spread, spread))
                       : scale * rng.normal(1)[0];
    }
    for (std::int32_t b = 0; b < batch; ++b) {
      const int kind = rng.uniform_int(0, 6);
      const std::int32_t window_tokens = window.sink + window.recent;
      lengths.push_back(kind == 0   ? 0
                        : kind == 1 ? std::min(cols, rng.uniform_int(1, window_tokens + 1))
                        : kind == 2 ? std::min(cols, window_tokens + rng.uniform_int(1, k))  // a middle of at most k
                                    : rng.uniform_int(0, cols));
    }
    if (per_row_k) {
      for (std::int32_t s = 0; s < batch * kv_heads; ++s) {
        const int kind = rng.uniform_int(0, 3);
        row_k.push_back(kind == 0 ? 0 : kind == 1 ? k : rng.uniform_int(0, k));
      }
    }
    if (heads_per_row == 1 && rng.uniform_int(0, 1) == 1) {
      ids.resize(std::size_t(batch) * kv_heads * ids_stride());
      for (auto& id : ids) id = rng.uniform_int(0, 1 << 30);
    }
  }

  /// The expected selection row: the union of each score row's min(k_s, middle) best middle tokens under
  /// ranks_before, ascending.
  std::vector<std::int32_t> expected(std::int32_t b, std::int32_t g) const {
    const std::int32_t n = lengths[b], lo = window.sink_end(n), hi = window.recent_begin(n);
    const std::int64_t s = std::int64_t(b) * kv_heads + g;
    const std::int32_t k_s = row_k.empty() ? k : row_k[s];
    std::vector<bool> chosen(std::size_t(cols), false);
    for (std::int32_t h = 0; h < heads_per_row; ++h) {
      const float* row = scores.data() + (s * heads_per_row + h) * stride();
      std::vector<std::int32_t> middle(hi - lo);
      std::iota(middle.begin(), middle.end(), lo);
      std::sort(middle.begin(), middle.end(),
                [&](std::int32_t x, std::int32_t y) { return ranks_before(row[x], x, row[y], y); });
      for (std::int32_t i = 0; i < std::min(k_s, hi - lo); ++i) chosen[std::size_t(middle[i])] = true;
    }
    std::vector<std::int32_t> want;
    for (std::int32_t t = 0; t < cols; ++t) {
      if (chosen[std::size_t(t)]) want.push_back(ids.empty() ? t : ids[std::size_t(s * ids_stride() + t)]);
    }
    return want;
  }
};

/// Runs topk_rows into a poisoned selection with an exactly sized, poisoned workspace.
test::HostSelection run_topk_rows(const TopKProblem& p, cpu::ThreadPool* pool) {
  test::HostSelection sel(p.batch, p.kv_heads, p.capacity, p.weights);
  PoisonedWorkspace workspace(cpu::topk_rows_workspace_bytes(p.rows(), p.cols, p.k, p.options(), pool));
  cpu::topk_rows(p.view(), p.lengths.data(), p.k, p.options(), sel.view, workspace.span(), pool);
  return sel;
}

/// Checks a selection against the problem's expected rows: counts, indices, weights, and that nothing past
/// each count was written.
void expect_topk_rows(const TopKProblem& p, const test::HostSelection& sel) {
  for (std::int32_t b = 0; b < p.batch; ++b) {
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      const auto want = p.expected(b, g);
      ASSERT_EQ(sel.view.count(b, g), std::int32_t(want.size())) << b << ", " << g;
      const std::int32_t* row = sel.view.row(b, g);
      EXPECT_EQ(std::vector<std::int32_t>(row, row + want.size()), want) << b << ", " << g;
      for (std::int32_t i = std::int32_t(want.size()); i < p.capacity; ++i) ASSERT_EQ(row[i], test::kPoisonIndex);
      if (p.weights) {
        const float* w = sel.view.weights_row(b, g);
        for (std::size_t i = 0; i < want.size(); ++i) ASSERT_EQ(w[i], 0.0f);
        for (std::int32_t i = std::int32_t(want.size()); i < p.capacity; ++i) ASSERT_TRUE(std::isnan(w[i]));
      }
    }
  }
}

using TopKRows = test::SeededTest;

TEST_F(TopKRows, BestOfTheMiddleUnderTheTieRuleForEveryThreadCount) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool2(2), pool3(3), pool7(7);
  for (int trial = 0; trial < 80; ++trial) {
    const std::int32_t cols = rng.uniform_int(1, 1500);
    const AttentionWindow window =
        std::vector<AttentionWindow>{{0, 0}, {4, 0}, {0, 16}, {4, 16}, {64, 64}}[rng.uniform_int(0, 4)];
    const std::int32_t k = std::vector<std::int32_t>{1, 5, 100, cols}[rng.uniform_int(0, 3)];
    const std::int32_t heads_per_row = std::vector<std::int32_t>{1, 1, 2, 4, 7}[rng.uniform_int(0, 4)];
    const TopKProblem p(rng, rng.uniform_int(1, 4), rng.uniform_int(1, 3), heads_per_row, cols, k, window,
                        rng.uniform_int(0, 1) == 1, rng.uniform_int(0, 1) == 1);
    SCOPED_TRACE(fmt::format("batch {} kv_heads {} heads_per_row {} cols {} k {} window {}+{} lengths [{}] row_k [{}]{}",
                             p.batch, p.kv_heads, heads_per_row, cols, k, window.sink, window.recent,
                             fmt::join(p.lengths, ", "), fmt::join(p.row_k, ", "), p.ids.empty() ? "" : " ids"));
    const auto sel = run_topk_rows(p, nullptr);
    expect_topk_rows(p, sel);
    for (cpu::ThreadPool* pool : {&pool2, &pool3, &pool7}) {
      const auto pooled = run_topk_rows(p, pool);
      EXPECT_EQ(pooled.indices, sel.indices) << pool->size() << " threads";
      EXPECT_EQ(pooled.counts, sel.counts) << pool->size() << " threads";
    }
  }
}

TEST_F(TopKRows, TiesGoToTheSmallerIndexAndNaNRanksFirst) {
  // One row of 12 tokens, window 2 + 2: the middle is [2, 10).
  std::vector<float> scores = {9, 9, 1, NAN, 5, 5, -INFINITY, 5, NAN, 0.0f, 9, 9};
  scores[9] = -0.0f;
  const std::int32_t length = 12;
  const TopKRowsOptions options{.window = {2, 2}};
  const auto top = [&](std::int32_t k) {
    test::HostSelection sel(1, 1, k, false);
    PoisonedWorkspace workspace(cpu::topk_rows_workspace_bytes(1, 12, k, options, nullptr));
    cpu::topk_rows(MatrixView<const float>::packed(scores.data(), 1, 12), &length, k, options, sel.view, workspace.span());
    return std::vector<std::int32_t>(sel.indices.begin(), sel.indices.begin() + sel.counts[0]);
  };
  EXPECT_EQ(top(1), (std::vector<std::int32_t>{3}));           // NaN at 3 and 8 first: the smaller index
  EXPECT_EQ(top(2), (std::vector<std::int32_t>{3, 8}));
  EXPECT_EQ(top(3), (std::vector<std::int32_t>{3, 4, 8}));     // then 5 at 4, 5 and 7: the smallest index
  EXPECT_EQ(top(5), (std::vector<std::int32_t>{3, 4, 5, 7, 8}));
  EXPECT_EQ(top(6), (std::vector<std::int32_t>{2, 3, 4, 5, 7, 8}));  // then 1 at 2
  EXPECT_EQ(top(7), (std::vector<std::int32_t>{2, 3, 4, 5, 7, 8, 9}));  // then -0, before -inf
  EXPECT_EQ(top(20), (std::vector<std::int32_t>{2, 3, 4, 5, 6, 7, 8, 9}));  // the whole middle
}

// nan_marks_row: a row with a NaN among its candidates (the middle) gets count -1, whether it takes k of them or
// the whole middle; NaN in the window (not a candidate) or in a row with k_s = 0 (nothing read) changes nothing;
// without the option the same rows select as the ranking rule says.
TEST_F(TopKRows, NanMarksRowGivesCountMinusOneForANanCandidate) {
  constexpr std::int32_t kCols = 12;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Window 2 + 2: the middle of a 12-token row is [2, 10).
  std::vector<float> scores = {
      nan, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, nan,  // row 0: NaN in the window only
      0, 1, 2, 3, 4, nan, 6, 7, 8, 9, 1, 2,    // row 1: NaN at 5, in the middle
      0, 1, 2, nan, 4, 5, 6, 7, 8, 9, 1, 2,    // row 2: NaN at 3, a row that takes its whole (short) middle
      0, 1, 2, 3, nan, 5, 6, 7, 8, 9, 1, 2,    // row 3: NaN at 4, k_s = 0
  };
  const std::vector<std::int32_t> lengths = {12, 12, 7, 12};  // row 2: middle [2, 5) of 3 tokens <= k
  const std::vector<std::int32_t> row_k = {4, 4, 4, 0};
  const auto run = [&](bool nan_marks_row) {
    const TopKRowsOptions options{.window = {2, 2}, .row_k = row_k.data(), .nan_marks_row = nan_marks_row};
    test::HostSelection sel(4, 1, 4, false);
    std::fill(sel.counts.begin(), sel.counts.end(), 99);
    PoisonedWorkspace workspace(cpu::topk_rows_workspace_bytes(4, kCols, 4, options, nullptr));
    cpu::topk_rows(MatrixView<const float>::packed(scores.data(), 4, kCols), lengths.data(), 4, options, sel.view,
                   workspace.span());
    return sel;
  };
  const auto marked = run(true);
  EXPECT_EQ(marked.counts, (std::vector<std::int32_t>{4, -1, -1, 0}));
  EXPECT_EQ(std::vector<std::int32_t>(marked.indices.begin(), marked.indices.begin() + 4),
            (std::vector<std::int32_t>{6, 7, 8, 9}));
  const auto plain = run(false);
  EXPECT_EQ(plain.counts, (std::vector<std::int32_t>{4, 4, 3, 0}));
  EXPECT_EQ(std::vector<std::int32_t>(plain.indices.begin() + 4, plain.indices.begin() + 8),
            (std::vector<std::int32_t>{5, 7, 8, 9}));  // NaN first, then the best three
  test::expect_error(
      [&] {
        (void)cpu::topk_rows_workspace_bytes(4, kCols, 4, {.heads_per_row = 2, .nan_marks_row = true}, nullptr);
      },
      "options.nan_marks_row needs options.heads_per_row == 1 (it is 2)");
}

TEST_F(TopKRows, PerRowKAndTheUnionOfAGroup) {
  // Two selection rows (batch 1, kv_heads 2) of two score rows each, 10 tokens, no window.
  const std::vector<float> scores = {
      9, 8, 7, 0, 0, 0, 0, 0, 0, 0,  // row 0, head 0: best 0, 1, 2
      0, 8, 9, 7, 0, 0, 0, 0, 0, 0,  // row 0, head 1: best 2, 1, 3
      0, 0, 0, 0, 0, 0, 0, 0, 1, 2,  // row 1, head 0: best 9, 8, then ties from 0
      3, 0, 0, 0, 0, 0, 0, 0, 0, 0,  // row 1, head 1: best 0, then ties from 1
  };
  const std::int32_t length = 10;
  const auto run = [&](std::int32_t k, const std::int32_t* row_k) {
    const TopKRowsOptions options{.row_k = row_k, .heads_per_row = 2};
    test::HostSelection sel(1, 2, 2 * k, false);
    PoisonedWorkspace workspace(cpu::topk_rows_workspace_bytes(4, 10, k, options, nullptr));
    cpu::topk_rows(MatrixView<const float>::packed(scores.data(), 4, 10), &length, k, options, sel.view, workspace.span());
    std::vector<std::vector<std::int32_t>> rows;
    for (std::int32_t g = 0; g < 2; ++g) rows.emplace_back(sel.view.row(0, g), sel.view.row(0, g) + sel.view.count(0, g));
    return rows;
  };
  using Rows = std::vector<std::vector<std::int32_t>>;
  EXPECT_EQ(run(3, nullptr), (Rows{{0, 1, 2, 3}, {0, 1, 2, 8, 9}}));  // shared picks once
  const std::int32_t row_k[2] = {1, 2};
  EXPECT_EQ(run(3, row_k), (Rows{{0, 2}, {0, 1, 8, 9}}));
  const std::int32_t none_and_all[2] = {0, 3};
  EXPECT_EQ(run(3, none_and_all), (Rows{{}, {0, 1, 2, 8, 9}}));
}

TEST_F(TopKRows, WorkspaceQueryAndRefusals) {
  // 32 scores per row: one thread's rank keys fill one 256-byte block exactly.
  const std::int32_t lengths[2] = {32, 7};
  std::vector<float> scores(4 * 32, 1.0f);
  const auto view = MatrixView<const float>::packed(scores.data(), 4, 32);
  test::HostSelection sel(2, 2, 5, false);
  cpu::ThreadPool pool(3);
  const std::size_t one = cpu::topk_rows_workspace_bytes(4, 32, 5, {}, nullptr);
  const std::size_t three = cpu::topk_rows_workspace_bytes(4, 32, 5, {}, &pool);
  EXPECT_EQ(one, std::size_t(32) * 8);  // a rank key per score, for one thread
  EXPECT_EQ(three, 3 * one);            // and for each of 3
  EXPECT_EQ(cpu::topk_rows_workspace_bytes(2, 32, 5, {}, &pool), 2 * one);  // 2 rows: at most 2 threads busy
  // Two score rows per selection row: 2 selection rows, 2 threads, each with rank keys and 2 * 5 picks (80
  // bytes for both threads: one block).
  EXPECT_EQ(cpu::topk_rows_workspace_bytes(4, 32, 5, {.heads_per_row = 2}, &pool), 2 * one + 256);
  PoisonedWorkspace buffer(three);
  const auto go = [&](MatrixView<const float> s, const std::int32_t* lens, std::int32_t k, TopKRowsOptions o,
                      SelectionView out, std::span<std::byte> ws, cpu::ThreadPool* p = nullptr) {
    cpu::topk_rows(s, lens, k, o, out, ws, p);
  };
  go(view, lengths, 5, {}, sel.view, {buffer.data(), one});
  go(view, lengths, 5, {}, sel.view, buffer.span(), &pool);
  test::expect_error([&] { go(view, lengths, 5, {}, sel.view, {buffer.data(), one}, &pool); },
                     "kvsift::cpu::topk_rows: workspace too small: 'rank_keys' needs bytes");
  test::expect_error([&] { go(view, lengths, 5, {}, sel.view, {}); }, "workspace too small: 'rank_keys'");
  test::expect_error([&] { go(view, lengths, 0, {}, sel.view, buffer.span()); }, "k (= 0) must be positive");
  test::expect_error([&] { go(view, lengths, 6, {}, sel.view, buffer.span()); },
                     "out.capacity (= 5) < options.heads_per_row * k (= 1 * 6)");
  test::expect_error([&] { go(view, lengths, 5, {.heads_per_row = 0}, sel.view, buffer.span()); },
                     "options.heads_per_row (= 0) must be >= 1");
  test::expect_error([&] { go(MatrixView<const float>::packed(scores.data(), 3, 32), lengths, 5, {}, sel.view, buffer.span()); },
                     "scores.rows (= 3) != out.batch * out.kv_heads * options.heads_per_row (= 2 * 2 * 1)");
  test::expect_error([&] { go(view, lengths, 2, {.heads_per_row = 2}, sel.view, buffer.span()); },
                     "scores.rows (= 4) != out.batch * out.kv_heads * options.heads_per_row (= 2 * 2 * 2)");
  test::HostSelection one_row(1, 2, 5, false);
  test::expect_error([&] { go(view, lengths, 3, {.heads_per_row = 2}, one_row.view, buffer.span()); },
                     "out.capacity (= 5) < options.heads_per_row * k (= 2 * 3)");
  test::expect_error([&] { go(view, nullptr, 5, {}, sel.view, buffer.span()); }, "lengths is a null pointer");
  const std::int32_t long_lengths[2] = {32, 33}, negative_lengths[2] = {-1, 3};
  test::expect_error([&] { go(view, long_lengths, 5, {}, sel.view, buffer.span()); },
                     "lengths[1] (= 33) is outside [0, scores.cols = 32]");
  test::expect_error([&] { go(view, negative_lengths, 5, {}, sel.view, buffer.span()); },
                     "lengths[0] (= -1) is outside [0, scores.cols = 32]");
  test::expect_error([&] { go(view, lengths, 5, {.window = {-1, 0}}, sel.view, buffer.span()); },
                     "options.window.sink (= -1) and options.window.recent (= 0) must be >= 0");
  test::expect_error([&] { go(view, lengths, 5, {.window = {0, -2}}, sel.view, buffer.span()); },
                     "options.window.sink (= 0) and options.window.recent (= -2) must be >= 0");
  const std::int32_t big_row_k[4] = {5, 0, 6, 1}, negative_row_k[4] = {1, -1, 0, 0};
  test::expect_error([&] { go(view, lengths, 5, {.row_k = big_row_k}, sel.view, buffer.span()); },
                     "options.row_k[2] (= 6) is outside [0, k = 5]");
  test::expect_error([&] { go(view, lengths, 5, {.row_k = negative_row_k}, sel.view, buffer.span()); },
                     "options.row_k[1] (= -1) is outside [0, k = 5]");
  SelectionView no_indices = sel.view;
  no_indices.indices = nullptr;
  test::expect_error([&] { go(view, lengths, 5, {}, no_indices, buffer.span()); },
                     "out.indices and out.counts must be non-null");
  test::expect_error([&] { go(MatrixView<const float>{scores.data(), 4, 32, 5}, lengths, 5, {}, sel.view, buffer.span()); },
                     "scores: strides inconsistent with shape");
  const std::int32_t ids[2 * 32] = {};
  test::expect_error([&] { go(view, lengths, 2, {.heads_per_row = 2, .ids = ids, .ids_stride = 32}, one_row.view, buffer.span()); },
                     "options.ids needs options.heads_per_row == 1 (it is 2)");
  test::expect_error([&] { go(view, lengths, 5, {.ids = ids, .ids_stride = 31}, sel.view, buffer.span()); },
                     "options.ids_stride (= 31) < max_tokens (= 32): a row's ids must cover every position");
  std::vector<std::int32_t> shared(std::size_t(4) * 32);  // out's rows of 5 inside a table of rows of 32
  const SelectionView into_table{shared.data() + 7, sel.view.counts, nullptr, 2, 2, 5};
  test::expect_error([&] { go(view, lengths, 5, {.ids = shared.data(), .ids_stride = 32}, into_table, buffer.span()); },
                     "options.ids [4 rows of 32] overlaps out.indices [4 rows of 5]: the table must not be the output");
  // The size query checks what the run checks of its arguments.
  test::expect_error([] { cpu::topk_rows_workspace_bytes(0, 10, 1, {}, nullptr); },
                     "kvsift::cpu::topk_rows_workspace_bytes: score_rows (= 0) and max_tokens (= 10) must be positive");
  test::expect_error([] { cpu::topk_rows_workspace_bytes(4, 10, 0, {}, nullptr); },
                     "kvsift::cpu::topk_rows_workspace_bytes: k (= 0) must be positive");
  test::expect_error([] { cpu::topk_rows_workspace_bytes(4, 10, 1, {.heads_per_row = -1}, nullptr); },
                     "kvsift::cpu::topk_rows_workspace_bytes: options.heads_per_row (= -1) must be >= 1");
  test::expect_error([] { cpu::topk_rows_workspace_bytes(4, 10, 1, {.window = {0, -1}}, nullptr); },
                     "options.window.sink (= 0) and options.window.recent (= -1) must be >= 0");
}

// ---- length_budgets --------------------------------------------------------------------------------------

TEST(LengthBudgets, FloorOfTheFractionClampedAndBroadcastOverHeads) {
  // Hand-worked: 4% of 1000 is 40; 4% of 24 is 0, raised to the minimum 2; 4% of 100000 is 4000, cut to 1024.
  const std::vector<std::int32_t> lengths{1000, 24, 100000, 0, 51};
  std::vector<std::int32_t> row_k(lengths.size() * 3, -7);
  cpu::length_budgets(lengths.data(), 5, 3, {.fraction = 0.04, .minimum = 2, .maximum = 1024}, row_k.data());
  const std::vector<std::int32_t> want{40, 40, 40, 2, 2, 2, 1024, 1024, 1024, 2, 2, 2, 2, 2, 2};
  EXPECT_EQ(row_k, want);
  // A²ATS's 3% on lengths where the product lands on whole numbers.
  const std::vector<std::int32_t> exact{100, 300, 2048};
  std::vector<std::int32_t> k3(exact.size(), -7);
  cpu::length_budgets(exact.data(), 3, 1, {.fraction = 0.03, .minimum = 0, .maximum = 1 << 20}, k3.data());
  EXPECT_EQ(k3, (std::vector<std::int32_t>{3, 9, 61}));
  // CSAttention's 5% with its 64-token window counted inside: floor(0.05 * n) - 64, at least 0.
  const std::vector<std::int32_t> long_lengths{131072, 1300, 1000};
  std::vector<std::int32_t> k5(long_lengths.size(), -7);
  cpu::length_budgets(long_lengths.data(), 3, 1, {.fraction = 0.05, .minimum = 0, .maximum = 1 << 20, .reserved = 64},
                      k5.data());
  EXPECT_EQ(k5, (std::vector<std::int32_t>{6489, 1, 0}));
}

TEST(LengthBudgets, RandomLengthsAgainstTheFloorOfTheProduct) {
  test::Random rng(test::test_seed());
  for (int trial = 0; trial < 20; ++trial) {
    const std::int32_t batch = rng.uniform_int(1, 16), heads = rng.uniform_int(1, 8);
    const LengthBudget budget{.fraction = double(rng.uniform(0.001f, 1.0f)), .minimum = rng.uniform_int(0, 8),
                              .maximum = rng.uniform_int(8, 5000), .reserved = rng.uniform_int(0, 100)};
    std::vector<std::int32_t> lengths(std::size_t(batch), 0);
    for (auto& n : lengths) n = rng.uniform_int(0, 200000);
    std::vector<std::int32_t> row_k(std::size_t(batch) * heads, -7);
    cpu::length_budgets(lengths.data(), batch, heads, budget, row_k.data());
    for (std::int32_t b = 0; b < batch; ++b) {
      const double k = std::floor(budget.fraction * double(lengths[std::size_t(b)])) - budget.reserved;
      const auto want = std::int32_t(std::clamp(k, double(budget.minimum), double(budget.maximum)));
      for (std::int32_t h = 0; h < heads; ++h) EXPECT_EQ(row_k[std::size_t(b) * heads + h], want) << b << " " << h;
    }
  }
}

TEST(LengthBudgets, BadBudgetsAreRefused) {
  std::int32_t lengths[2] = {10, 20}, row_k[2] = {};
  const auto go = [&](LengthBudget budget, std::int32_t batch = 2) {
    cpu::length_budgets(lengths, batch, 1, budget, row_k);
  };
  test::expect_error([&] { go({.fraction = 0, .maximum = 4}); }, "kvsift::cpu::length_budgets: budget.fraction (= 0) is outside (0, 1]");
  test::expect_error([&] { go({.fraction = 1.5, .maximum = 4}); }, "budget.fraction (= 1.5) is outside (0, 1]");
  test::expect_error([&] { go({.fraction = 0.5, .minimum = 5, .maximum = 4}); },
                     "budget.minimum (= 5) is outside [0, budget.maximum = 4]");
  test::expect_error([&] { go({.fraction = 0.5, .maximum = 4}, 0); }, "batch (= 0) and heads (= 1) must be positive");
  test::expect_error([&] { go({.fraction = 0.5, .maximum = 4, .reserved = -1}); }, "budget.reserved (= -1) must be >= 0");
  test::expect_error([&] { cpu::length_budgets(nullptr, 2, 1, {.fraction = 0.5, .maximum = 4}, row_k); },
                     "lengths and row_k must be non-null");
  EXPECT_EQ(row_k[0], 0);  // nothing written by a refused call
}

// ---- mass_budgets -----------------------------------------------------------------------------------------

std::vector<std::int32_t> run_mass_budgets(const std::vector<float>& scores, std::int32_t cols,
                                           const std::vector<std::int32_t>& counts, MassBudget budget) {
  std::vector<std::int32_t> row_k(counts.size(), -77);
  cpu::mass_budgets(MatrixView<const float>::packed(scores.data(), std::int64_t(counts.size()), cols), counts.data(),
                    budget, row_k.data());
  return row_k;
}

TEST(MassBudgets, HandWorkedRows) {
  // 1/2, 1/4, 1/8, 1/8 (any order): p = 0.75 takes the two best, 0.76 three, 1 all four; 0.5 the best alone.
  const std::vector<float> row{0.125f, 0.5f, 0.125f, 0.25f};
  const auto one = [&](MassBudget b, std::int32_t n = 4) { return run_mass_budgets(row, 4, {n}, b)[0]; };
  EXPECT_EQ(one({.mass = 0.75, .maximum = 8}), 2);
  EXPECT_EQ(one({.mass = 0.76, .maximum = 8}), 3);
  EXPECT_EQ(one({.mass = 1.0, .maximum = 8}), 4);
  EXPECT_EQ(one({.mass = 0.5, .maximum = 8}), 1);
  EXPECT_EQ(one({.mass = 0.5, .floor = 3, .maximum = 8}), 3);   // raised to the floor
  EXPECT_EQ(one({.mass = 1.0, .maximum = 2}), 2);               // cut to the maximum
  EXPECT_EQ(one({.mass = 1.0, .floor = 3, .maximum = 8}, 2), 2);  // the row's two candidates: 1/8 and 1/2
  EXPECT_EQ(one({.mass = 1.0, .maximum = 8}, 0), 0);
  EXPECT_EQ(one({.mass = 1.0, .maximum = 8}, -1), -1);  // a row marked bad stays marked
  const std::int32_t limit = 1;
  EXPECT_EQ(one({.mass = 1.0, .maximum = 8, .limits = &limit}), 1);
  // Ties: four equal scores, half the mass is two of them; all zeros need none (the floor).
  EXPECT_EQ(run_mass_budgets({0.25f, 0.25f, 0.25f, 0.25f}, 4, {4}, {.mass = 0.5, .maximum = 4})[0], 2);
  EXPECT_EQ(run_mass_budgets({0.0f, -0.0f, 0.0f}, 3, {3}, {.mass = 0.9, .floor = 2, .maximum = 4})[0], 2);
  // One score holds all the mass: one candidate at any p; a NaN, an infinity, a negative or a score above 1
  // keeps the maximum (the row's count here).
  EXPECT_EQ(run_mass_budgets({0.0f, 1.0f, 0.0f}, 3, {3}, {.mass = 1.0, .maximum = 4})[0], 1);
  for (const float bad : {NAN, INFINITY, -INFINITY, -0.5f, 1.0000001f}) {
    EXPECT_EQ(run_mass_budgets({0.5f, bad, 0.25f}, 3, {3}, {.mass = 0.1, .maximum = 4})[0], 3) << bad;
    EXPECT_EQ(run_mass_budgets({0.5f, 0.25f, bad}, 3, {2}, {.mass = 0.1, .maximum = 4})[0], 1) << bad;  // past the count
  }
  // The fixed point: 2^-41 is half a unit (rounds up to 1), 2^-42 rounds to 0; p = 1 needs every unit.
  EXPECT_EQ(run_mass_budgets({0.5f, std::ldexp(1.0f, -41)}, 2, {2}, {.mass = 1.0, .maximum = 4})[0], 2);
  EXPECT_EQ(run_mass_budgets({0.5f, std::ldexp(1.0f, -42)}, 2, {2}, {.mass = 1.0, .maximum = 4})[0], 1);
}

TEST(MassBudgets, RandomRowsEqualTheScalarReferenceAtEveryThreadCount) {
  const std::uint64_t seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  test::Random rng(seed);
  cpu::ThreadPool pool(3);
  for (int trial = 0; trial < 60; ++trial) {
    const std::int32_t cols_choices[] = {1, 2, 7, 100, 2048, 8192, rng.uniform_int(1, 10000)};
    const test::MassBudgetsProblem p(rng, rng.uniform_int(1, 12), cols_choices[rng.uniform_int(0, 6)]);
    SCOPED_TRACE(p.label());
    const std::vector<std::int32_t> want = test::mass_budgets_reference(p);
    for (cpu::ThreadPool* threads : {static_cast<cpu::ThreadPool*>(nullptr), &pool}) {
      std::vector<std::int32_t> row_k(std::size_t(p.rows), -77);
      cpu::mass_budgets(p.view(p.scores.data()), p.counts.data(), p.options(p.limits.data()), row_k.data(), threads);
      ASSERT_EQ(row_k, want);
    }
    // The fp64 reading of the rule: the kept prefix holds p of the row's mass, one less would not (within the
    // fixed point's rounding, half a unit a score), unless the floor or the upper bound decided.
    for (std::int32_t r = 0; r < p.rows; ++r) {
      const std::int32_t n = p.counts[std::size_t(r)], k = want[std::size_t(r)];
      const float* const row = p.scores.data() + r * p.stride();
      if (n <= 0 || p.kinds[std::size_t(r)] == test::MassRow::unmeasurable) continue;
      std::vector<double> sorted(row, row + n);
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      const double total = std::accumulate(sorted.begin(), sorted.end(), 0.0), slack = n * std::ldexp(1.0, -40);
      const double kept = std::accumulate(sorted.begin(), sorted.begin() + k, 0.0);
      const std::int32_t upper =
          std::min({p.budget.maximum, n, p.limits.empty() ? p.budget.maximum : p.limits[std::size_t(r)]});
      if (k < upper) {
        EXPECT_GE(kept, p.budget.mass * total - slack) << "row " << r;
      }
      if (k > p.budget.floor) {
        EXPECT_LT(kept - sorted[std::size_t(k) - 1], p.budget.mass * total + slack) << "row " << r;
      }
    }
  }
}

TEST(MassBudgets, BadArgumentsAreRefused) {
  const std::vector<float> scores(8, 0.125f);
  std::vector<std::int32_t> counts{4, 4}, row_k{-77, -77};
  const auto go = [&](MassBudget b, std::int32_t cols = 4, const std::int32_t* c = nullptr) {
    cpu::mass_budgets(MatrixView<const float>::packed(scores.data(), 2, cols), c != nullptr ? c : counts.data(), b,
                      row_k.data());
  };
  test::expect_error([&] { go({.mass = 0, .maximum = 4}); }, "kvsift::cpu::mass_budgets: budget.mass (= 0) is outside (0, 1]");
  test::expect_error([&] { go({.mass = 1.5, .maximum = 4}); }, "budget.mass (= 1.5) is outside (0, 1]");
  test::expect_error([&] { go({.mass = std::nan(""), .maximum = 4}); }, "budget.mass (= nan) is outside (0, 1]");
  test::expect_error([&] { go({.mass = 0.5, .floor = 0, .maximum = 4}); }, "budget.floor (= 0) must be >= 1");
  test::expect_error([&] { go({.mass = 0.5, .floor = 5, .maximum = 4}); },
                     "budget.maximum (= 4) is below budget.floor (= 5)");
  const std::vector<std::int32_t> too_many{5, 0}, too_few{0, -2};
  test::expect_error([&] { go({.mass = 0.5, .maximum = 4}, 4, too_many.data()); },
                     "counts[0] (= 5) is outside [-1, scores.cols = 4]");
  test::expect_error([&] { go({.mass = 0.5, .maximum = 4}, 4, too_few.data()); },
                     "counts[1] (= -2) is outside [-1, scores.cols = 4]");
  const std::vector<std::int32_t> limits{3, 5};
  test::expect_error([&] { go({.mass = 0.5, .maximum = 4, .limits = limits.data()}); },
                     "budget.limits[1] (= 5) is outside [0, budget.maximum = 4]");
  test::expect_error([&] { cpu::mass_budgets(MatrixView<const float>::packed(scores.data(), 2, 4), nullptr,
                                             {.mass = 0.5, .maximum = 4}, row_k.data()); },
                     "counts and row_k must be non-null");
  test::expect_error([&] { cpu::mass_budgets(MatrixView<const float>::packed(scores.data(), 2, 4), counts.data(),
                                             {.mass = 0.5, .maximum = 4}, nullptr); },
                     "counts and row_k must be non-null");
  test::expect_error([&] { cpu::mass_budgets(MatrixView<const float>::packed(scores.data(), 1, kMassMaxCandidates + 1),
                                             counts.data(), {.mass = 0.5, .maximum = 4}, row_k.data()); },
                     "scores.cols (= 8388609) exceeds 8388608 candidates per row");
  test::expect_error([&] { go({.mass = 0.5, .maximum = 4}, 0); }, "scores");
  EXPECT_EQ(row_k, (std::vector<std::int32_t>{-77, -77}));  // nothing written by a refused call
}

}  // namespace
}  // namespace kvsift
