// cuda::group_scores against its CPU twin, cpu::group_scores, on fresh random inputs: every storage type, head_dim
// and cache layout, GQA groups of 1 to 32 (two head tiles), raw and softmax scores reduced by max and sum, ragged
// lengths (empty sequences, rows over several 1024-token chunks); the NaN contract; graph replay; the workspace;
// and every refused input (those tests run without a GPU: they fail before any device call).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "group_scores_problem.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cuda/primitives.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::describe;
using test::kSoftmaxRel;
using test::kUlp;
using test::Random;
using test::type_name;

/// The host problem (group_scores_problem.hpp) and its device copy, contiguous (device seq_lens, or none:
/// every sequence at capacity) and paged. V is never read: the device views pass K for it.
template <class T>
struct GroupProblem : test::GroupScoresProblem<T> {
  using Host = test::GroupScoresProblem<T>;
  bool null_lengths;
  DeviceBuffer<T> d_q, d_k, d_k_pages;
  DeviceBuffer<std::int32_t> d_lengths, d_indptr, d_indices, d_last;

  GroupProblem(Random& rng, std::int32_t batch_, std::int32_t q_heads_, std::int32_t kv_heads_, std::int32_t head_dim_,
               const std::vector<std::int32_t>& lengths, std::int32_t page_size, bool null_lengths_ = false)
      : Host(rng, batch_, q_heads_, kv_heads_, head_dim_, lengths, page_size), null_lengths(null_lengths_) {}
  /// Copies the host problem (after any set_q / set_k) to the device.
  void upload() {
    d_q = DeviceBuffer<T>(this->q);
    d_k = DeviceBuffer<T>(this->k);
    d_lengths = DeviceBuffer<std::int32_t>(this->values.seq_lens);
    if (this->paged_values) {
      d_k_pages = DeviceBuffer<T>(this->k_pages);
      d_indptr = DeviceBuffer<std::int32_t>(this->paged_values->indptr);
      d_indices = DeviceBuffer<std::int32_t>(this->paged_values->indices.empty() ? std::vector<std::int32_t>{0}
                                                                                 : this->paged_values->indices);
      d_last = DeviceBuffer<std::int32_t>(this->paged_values->last_len);
    }
  }
  std::int32_t length(std::int32_t b) const { return null_lengths ? this->values.capacity : this->values.seq_lens[b]; }

  QueryView<const T> host_q() const { return this->q_view(); }
  ContiguousKVView<const T> host_contiguous() const {
    return this->contiguous(null_lengths ? nullptr : this->values.seq_lens.data());
  }
  PagedKVView<const T> host_paged() const { return this->paged(); }
  QueryView<const T> device_q() const {
    return QueryView<const T>::packed(d_q.data(), this->batch, this->q_heads, this->head_dim);
  }
  ContiguousKVView<const T> device_contiguous() const {
    return ContiguousKVView<const T>::packed(d_k.data(), d_k.data(), this->batch, this->kv_heads, this->values.capacity,
                                             this->head_dim, null_lengths ? nullptr : d_lengths.data());
  }
  PagedKVView<const T> device_paged() const {
    return this->paged_view(d_k_pages.data(), d_k_pages.data(), d_indptr.data(), d_indices.data(), d_last.data());
  }
};

/// Scores [rows, cols] with a row stride past the width: wider than the longest sequence, so that the entries
/// a run must not write (past each sequence, past the columns) can be checked to keep their poison (NaN).
struct ScoreShape {
  std::int64_t rows;
  std::int32_t cols;
  std::int64_t stride() const { return cols + 5; }
  std::size_t size() const { return std::size_t(rows * stride()); }
};

std::vector<float> run_cpu(const auto& p, bool paged, const ScoreShape& shape, const GroupScoreOptions& options) {
  std::vector<float> scores(shape.size(), test::kPoison);
  const std::size_t bytes = cpu::group_scores_workspace_bytes(p.batch, p.q_heads, p.kv_heads, shape.cols, options);
  std::vector<std::byte> buffer(bytes + WorkspaceLayout::kAlignment);
  const std::size_t misalignment = reinterpret_cast<std::uintptr_t>(buffer.data()) % WorkspaceLayout::kAlignment;
  const std::span<std::byte> workspace{buffer.data() + (misalignment ? WorkspaceLayout::kAlignment - misalignment : 0), bytes};
  const MatrixView<float> view{scores.data(), shape.rows, shape.cols, shape.stride()};
  if (paged) {
    cpu::group_scores(p.host_q(), p.host_paged(), view, options, workspace);
  } else {
    cpu::group_scores(p.host_q(), p.host_contiguous(), view, options, workspace);
  }
  return scores;
}

/// One device call into poisoned scores, with a poisoned workspace of exactly the queried size.
template <class T>
std::vector<float> run_cuda(const GroupProblem<T>& p, bool paged, const ScoreShape& shape,
                            const GroupScoreOptions& options, cudaStream_t stream = nullptr) {
  DeviceBuffer<float> scores(shape.size());
  scores.poison();
  const std::size_t bytes = cuda::group_scores_workspace_bytes(p.batch, p.q_heads, p.kv_heads, shape.cols, options);
  DeviceBuffer<std::byte> workspace(bytes);
  workspace.poison();
  const MatrixView<float> view{scores.data(), shape.rows, shape.cols, shape.stride()};
  if (paged) {
    cuda::group_scores(p.device_q(), p.device_paged(), view, options, {workspace.data(), bytes}, stream);
  } else {
    cuda::group_scores(p.device_q(), p.device_contiguous(), view, options, {workspace.data(), bytes}, stream);
  }
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  return scores.download();
}

/// How far the two backends' scores may differ, per entry, from an fp64 recomputation of the logits.
/// A dot product of d fp32-exact products accumulated in fp32 errs by at most d * 2^-24 * sum |q_c k_c| when
/// every add rounds to nearest (the CPU); tensor cores may truncate their fp32 adds, twice that (the GPU's
/// bound, which also covers its fp32-key FMA path). Each backend rounds the scale multiply once more. A softmax
/// weight exp(s - LSE) errs relatively by the errors of s and of LSE (at most its largest logit's, plus the
/// fp32 sum of the exponentials and the exp2 approximations: kSoftmaxRel per backend, the CPU twin's test's
/// bound, which it justifies). Sums over the group add a rounding per head on each side.

template <class T>
std::vector<double> tolerances(const GroupProblem<T>& p, const ScoreShape& shape, const GroupScoreOptions& options) {
  const std::int32_t group = p.q_heads / p.kv_heads, d = p.head_dim;
  const bool sum = options.reduce == GroupReduce::sum;
  std::vector<double> tol(shape.size(), 0.0);
  for (std::int32_t b = 0; b < p.batch; ++b) {
    const std::int32_t n = p.length(b);
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      const test::GroupLogits l = test::group_logits(p, b, g, n, test::score_scale(options, d));
      const std::vector<double>& logit = l.logit;
      std::vector<double> bound(std::size_t(group) * n), largest(group, 0.0);
      for (std::size_t i = 0; i < bound.size(); ++i) {
        bound[i] = 3 * (d + 2) * kUlp * l.magnitude[i] + 2 * kUlp * std::abs(logit[i]);
        largest[i / std::size_t(n)] = std::max(largest[i / std::size_t(n)], bound[i]);
      }
      for (std::int32_t t = 0; t < n; ++t) {
        double total = 0.0, magnitude = 0.0;
        for (std::int32_t h = 0; h < group; ++h) {
          const std::size_t i = std::size_t(h) * n + t;
          double x = std::abs(logit[i]), x_tol = bound[i];
          if (options.softmax) {
            x = std::exp(logit[i] - l.lse[h]);
            x_tol = x * (bound[i] + largest[h] + 2 * kSoftmaxRel) + 1e-30;
          }
          total = sum ? total + x_tol : std::max(total, x_tol);
          magnitude += x;
        }
        tol[std::size_t((std::int64_t(b) * p.kv_heads + g) * shape.stride() + t)] =
            total + (sum ? 4 * group * kUlp * magnitude : 0.0);
      }
    }
  }
  return tol;
}

/// Every scored entry within tolerance of the CPU's (NaN where the CPU has NaN), every other entry untouched.
template <class T>
void expect_match(const GroupProblem<T>& p, const ScoreShape& shape, const std::vector<float>& cpu_scores,
                  const std::vector<float>& gpu_scores, const std::vector<double>& tol) {
  for (std::int64_t row = 0; row < shape.rows; ++row) {
    const std::int32_t n = p.length(std::int32_t(row / p.kv_heads));
    for (std::int64_t t = 0; t < shape.stride(); ++t) {
      const std::size_t i = std::size_t(row * shape.stride() + t);
      if (t >= n) {
        ASSERT_TRUE(std::isnan(gpu_scores[i])) << "written past the sequence: row " << row << " token " << t;
      } else if (std::isnan(cpu_scores[i])) {
        ASSERT_TRUE(std::isnan(gpu_scores[i])) << "row " << row << " token " << t;
      } else if (std::isinf(cpu_scores[i])) {
        ASSERT_EQ(gpu_scores[i], cpu_scores[i]) << "row " << row << " token " << t;
      } else {
        ASSERT_NEAR(gpu_scores[i], cpu_scores[i], tol[i]) << "row " << row << " token " << t;
      }
    }
  }
}

template <class T>
void check_problem(GroupProblem<T>& p, bool paged, const GroupScoreOptions& options, std::int32_t extra_cols = 3) {
  SCOPED_TRACE(fmt::format("{} layout, {}", paged ? "paged" : "contiguous", describe(options)));
  p.upload();
  const ScoreShape shape{p.rows(), p.longest() + extra_cols};
  expect_match(p, shape, run_cpu(p, paged, shape, options), run_cuda(p, paged, shape, options),
               tolerances(p, shape, options));
}

constexpr GroupScoreOptions kForms[] = {{.reduce = GroupReduce::max},
                                             {.reduce = GroupReduce::sum},
                                             {.reduce = GroupReduce::max, .softmax = true},
                                             {.reduce = GroupReduce::sum, .softmax = true}};

using CudaGroupScores = test::GpuTest;

TEST_F(CudaGroupScores, MatchTheCpuForEveryTypeHeadDimGroupAndLayout) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  int form = 0;
  const auto check = [&]<class T>(T, std::int32_t head_dim, std::int32_t group) {
    const std::int32_t kv_heads = rng.uniform_int(1, 2), batch = rng.uniform_int(1, 3);
    // Ragged: an empty sequence now and then, short ones, and one over several 1024-token chunks.
    std::vector<std::int32_t> lengths(batch);
    for (auto& n : lengths) n = rng.uniform_int(0, 3) == 0 ? 0 : rng.uniform_int(1, 400);
    lengths[rng.uniform_int(0, batch - 1)] = rng.uniform_int(1025, 2600);
    const std::int32_t page_size = std::vector<std::int32_t>{16, 7, 64}[rng.uniform_int(0, 2)];
    auto options = kForms[form++ % 4];
    options.sm_scale = std::vector<float>{0.0f, 0.0f, 0.3f, -0.2f}[rng.uniform_int(0, 3)];
    SCOPED_TRACE(fmt::format("{} head_dim {} group {} kv_heads {} page_size {} lengths [{}]", type_name<T>(), head_dim,
                             group, kv_heads, page_size, fmt::join(lengths, ", ")));
    GroupProblem<T> p(rng, batch, group * kv_heads, kv_heads, head_dim, lengths, page_size);
    check_problem(p, false, options);
    check_problem(p, true, options);
  };
  for (const std::int32_t head_dim : {64, 128, 256}) {
    for (const std::int32_t group : {1, 4, 8, 16, 32}) {
      check(float{}, head_dim, group);
      check(half{}, head_dim, group);
      check(bfloat16{}, head_dim, group);
    }
  }
}

TEST_F(CudaGroupScores, EveryFormOnOneProblem) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  // The four forms side by side on ragged rows (an empty one, one of 5 chunks), a group of 12 (a part-filled tile).
  GroupProblem<bfloat16> p(rng, 3, 24, 2, 128, {4500, 0, 700}, 16);
  for (const auto& options : kForms) {
    check_problem(p, false, options);
    check_problem(p, true, options);
  }
  // Contiguous seq_lens null: every sequence at capacity; scores exactly as wide as the rows.
  GroupProblem<half> full(rng, 2, 8, 2, 64, {1500, 1500}, 0, /*null_lengths=*/true);
  for (const auto& options : kForms) check_problem(full, false, options, 0);
}

TEST_F(CudaGroupScores, NaNNeverVanishes) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const auto check = [&]<class T>(T) {
    SCOPED_TRACE(type_name<T>());
    // Two kv heads of a group of 4, 1500 tokens (two chunks); each case corrupts kv head 0 only (row 0).
    const auto fresh = [&] { return GroupProblem<T>(rng, 1, 8, 2, 64, {1500}, 0); };
    const ScoreShape shape{2, 1500};
    const auto run = [&](GroupProblem<T>& p, bool softmax, GroupReduce reduce, float sm_scale = 0.0f) {
      p.upload();
      const GroupScoreOptions options{.sm_scale = sm_scale, .reduce = reduce, .softmax = softmax};
      const auto gpu = run_cuda(p, false, shape, options);
      // The CPU twin states the contract; the device must give NaN exactly where it does.
      const auto cpu = run_cpu(p, false, shape, options);
      for (std::size_t i = 0; i < gpu.size(); ++i) EXPECT_EQ(std::isnan(gpu[i]), std::isnan(cpu[i])) << i;
      return gpu;
    };
    const auto at = [&](const std::vector<float>& s, std::int64_t row, std::int64_t t) {
      return s[std::size_t(row * shape.stride() + t)];
    };
    const auto all = [&](const std::vector<float>& s, std::int64_t row, auto pred) {
      for (std::int32_t t = 0; t < shape.cols; ++t) {
        if (!pred(at(s, row, t))) return false;
      }
      return true;
    };
    const auto is_nan = [](float x) { return std::isnan(x); };
    const auto is_finite = [](float x) { return std::isfinite(x); };
    for (const auto reduce : {GroupReduce::max, GroupReduce::sum}) {
      SCOPED_TRACE(reduce == GroupReduce::sum ? "sum" : "max");
      // A NaN in one key (in the second chunk): that token's raw score; the whole row's softmax scores.
      auto p = fresh();
      p.set_k(0, 0, 1200, 3, NAN);
      const auto raw = run(p, false, reduce);
      EXPECT_TRUE(std::isnan(at(raw, 0, 1200)));
      EXPECT_TRUE(std::isfinite(at(raw, 0, 1199)) && std::isfinite(at(raw, 0, 1201)));
      EXPECT_TRUE(all(raw, 1, is_finite));
      const auto soft = run(p, true, reduce);
      EXPECT_TRUE(all(soft, 0, is_nan));
      EXPECT_TRUE(all(soft, 1, is_finite));
      // A NaN in one query head: every score of its group, in both forms.
      p = fresh();
      p.set_q(0, 2, 0, NAN);
      EXPECT_TRUE(all(run(p, false, reduce), 0, is_nan));
      const auto soft_q = run(p, true, reduce);
      EXPECT_TRUE(all(soft_q, 0, is_nan));
      EXPECT_TRUE(all(soft_q, 1, is_finite));
      // A NaN sm_scale: everything.
      p = fresh();
      EXPECT_TRUE(all(run(p, true, reduce, NAN), 1, is_nan));
      EXPECT_TRUE(all(run(p, false, reduce, NAN), 1, is_nan));
      // A +inf logit (a key of +inf against positive queries): the raw score is +inf, the softmax has none.
      for (std::int32_t h = 0; h < 4; ++h) {
        for (std::int32_t c = 0; c < 64; ++c) p.set_q(0, h, c, 0.5f);
      }
      for (std::int32_t c = 0; c < 64; ++c) p.set_k(0, 0, 7, c, INFINITY);
      EXPECT_EQ(at(run(p, false, reduce), 0, 7), INFINITY);
      EXPECT_TRUE(all(run(p, true, reduce), 0, is_nan));
    }
    // A head whose every logit is -inf (group 1: q -0.5 against keys of +inf) has no softmax: its row is NaN.
    GroupProblem<T> p(rng, 1, 2, 2, 64, {1100}, 0);
    for (std::int32_t c = 0; c < 64; ++c) p.set_q(0, 0, c, -0.5f);
    for (std::int32_t t = 0; t < 1100; ++t) {
      for (std::int32_t c = 0; c < 64; ++c) p.set_k(0, 0, t, c, INFINITY);
    }
    p.upload();
    const ScoreShape one{2, 1100};
    const auto soft = run_cuda(p, false, one, {.softmax = true});
    const auto raw = run_cuda(p, false, one, {});
    for (std::int32_t t = 0; t < 1100; ++t) {
      EXPECT_TRUE(std::isnan(soft[std::size_t(t)])) << t;
      EXPECT_EQ(raw[std::size_t(t)], -INFINITY) << t;
      EXPECT_TRUE(std::isfinite(soft[std::size_t(one.stride() + t)])) << t;
    }
  };
  check(float{});
  check(half{});
  check(bfloat16{});
}

// heads_per_row: the sets of each group's heads, each reduced into its own score row, as on the CPU.
TEST_F(CudaGroupScores, HeadsPerRowMatchesTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const std::int32_t per : {2, 4}) {
    for (const bool paged : {false, true}) {
      GroupProblem<bfloat16> p(rng, 2, 8, 2, 128, {rng.uniform_int(1, 3000), 2100}, paged ? 16 : 0);
      p.upload();
      const GroupScoreOptions options{.reduce = GroupReduce::max, .softmax = true, .heads_per_row = per};
      const std::int32_t sets = 4 / per;
      const ScoreShape shape{p.rows() * sets, p.longest() + 3};
      const std::vector<float> cpu_scores = run_cpu(p, paged, shape, options), gpu = run_cuda(p, paged, shape, options);
      for (std::int64_t row = 0; row < shape.rows; ++row) {
        const std::int32_t n = p.length(std::int32_t(row / sets / p.kv_heads));
        for (std::int64_t t = 0; t < shape.stride(); ++t) {
          const std::size_t i = std::size_t(row * shape.stride() + t);
          if (t >= n) {
            ASSERT_TRUE(std::isnan(gpu[i])) << "written past the sequence: row " << row << " token " << t;
          } else {  // softmax weights: relative error of the logits' fp32 rounding (d = 128)
            ASSERT_NEAR(gpu[i], cpu_scores[i], 2e-3 * std::abs(cpu_scores[i]) + 1e-30)
                << "per " << per << " row " << row << " token " << t;
          }
        }
      }
    }
  }
}

TEST_F(CudaGroupScores, GraphReplayEqualsEagerBitForBit) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  GroupProblem<bfloat16> p(rng, 2, 32, 8, 128, {3000, 1100}, 16);
  p.upload();
  const ScoreShape shape{p.rows(), 3000};
  for (const auto& options : kForms) {
    SCOPED_TRACE(describe(options));
    const auto eager = run_cuda(p, true, shape, options);
    ASSERT_EQ(0, std::memcmp(eager.data(), run_cuda(p, true, shape, options).data(), eager.size() * sizeof(float)))
        << "two eager calls differ";
    DeviceBuffer<float> scores(shape.size());
    const std::size_t bytes = cuda::group_scores_workspace_bytes(p.batch, p.q_heads, p.kv_heads, shape.cols, options);
    DeviceBuffer<std::byte> workspace(bytes);
    const test::Stream stream;
    const test::CapturedGraph graph(stream, [&] {
      cuda::group_scores(p.device_q(), p.device_paged(), {scores.data(), shape.rows, shape.cols, shape.stride()}, options,
                         {workspace.data(), bytes}, stream);
    });
    for (int replay = 0; replay < 2; ++replay) {
      scores.poison();
      workspace.poison();
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets ran on the legacy stream, which `stream` does not wait for
      graph.launch();
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto replayed = scores.download();
      EXPECT_EQ(0, std::memcmp(replayed.data(), eager.data(), eager.size() * sizeof(float))) << "replay " << replay;
    }
  }
}

// ---- refusals: none reaches the device, so they run on any machine -------------------------------------------

TEST(CudaGroupScoresBadInput, WorkspaceQuery) {
  const GroupScoreOptions raw{}, softmax{.softmax = true};
  EXPECT_EQ(cuda::group_scores_workspace_bytes(2, 6, 2, 40, raw), 0u);
  const std::size_t needed = cuda::group_scores_workspace_bytes(2, 6, 2, 40, softmax);
  EXPECT_GE(needed, std::size_t(4) * 2 * 6 * 40);  // the per-head logits
  EXPECT_LE(needed, std::size_t(4) * 2 * 6 * 40 + 3 * WorkspaceLayout::kAlignment);  // and two floats per (row, head)
  EXPECT_EQ(needed % WorkspaceLayout::kAlignment, 0u);
  // 4 chunks of 1024 tokens: [rows * group, 4] maxima and sums besides the logits (3001 columns padded to 3004).
  EXPECT_GE(cuda::group_scores_workspace_bytes(1, 8, 2, 3001, softmax), std::size_t(4) * 8 * 3004 + 2 * 4 * 8 * 4);
  test::expect_error([] { cuda::group_scores_workspace_bytes(1, 6, 4, 10, {}); },
                     "kvsift::cuda::group_scores_workspace_bytes: q_heads (= 6) is not a multiple of kv_heads (= 4)");
  test::expect_error([] { cuda::group_scores_workspace_bytes(1, 4, 4, 0, {}); }, "max_tokens (= 0) must be positive");
  test::expect_error([] { cuda::group_scores_workspace_bytes(1, 4, 4, 10, {.reduce = GroupReduce(3)}); },
                     "options.reduce (= 3) is neither GroupReduce::max nor GroupReduce::sum");
}

TEST(CudaGroupScoresBadInput, RefusedBeforeAnyDeviceCall) {
  // Host buffers standing in for device memory: nothing here is dereferenced, every call is refused first.
  struct alignas(256) Block {
    std::byte bytes[256];
  };
  std::vector<Block> memory(64);
  auto* base = reinterpret_cast<bfloat16*>(memory.data());
  const auto q = QueryView<const bfloat16>::packed(base, 2, 8, 128);
  const auto kv = ContiguousKVView<const bfloat16>::packed(base, base, 2, 2, 40, 128);
  const MatrixView<float> scores{reinterpret_cast<float*>(base), 4, 40, 48};
  const GroupScoreOptions softmax{.softmax = true};
  const std::size_t needed = cuda::group_scores_workspace_bytes(2, 8, 2, 40, softmax);
  const auto go = [&](auto qv, auto kvv, MatrixView<float> s, GroupScoreOptions options, std::span<std::byte> ws) {
    cuda::group_scores(qv, kvv, s, options, ws, nullptr);
  };
  const std::string where = "kvsift::cuda::group_scores: ";
  // The workspace.
  auto* ws = reinterpret_cast<std::byte*>(memory.data());
  test::expect_error([&] { go(q, kv, scores, softmax, {ws, needed - 256}); },
                     where + "workspace too small: 'chunk_sum' needs bytes");
  test::expect_error([&] { go(q, kv, scores, softmax, {}); }, where + "workspace too small: 'logits'");
  test::expect_error([&] { go(q, kv, scores, softmax, {ws + 4, needed}); }, "is not 256-byte aligned");
  // Shapes, as on the CPU.
  auto bad_q = q;
  bad_q.heads = 5;
  bad_q.batch_stride = 5 * 128;
  test::expect_error([&] { go(bad_q, kv, scores, {}, {}); }, where + "q.heads (= 5) is not a multiple of kv.kv_heads (= 2)");
  bad_q = q;
  bad_q.batch = 1;
  test::expect_error([&] { go(bad_q, kv, scores, {}, {}); }, where + "kv.batch (= 2) != q.batch (= 1)");
  auto bad_kv = kv;
  bad_kv.head_dim = 64;
  test::expect_error([&] { go(q, bad_kv, scores, {}, {}); }, where + "kv.head_dim (= 64) != q.head_dim (= 128)");
  bad_kv = kv;
  bad_kv.k = nullptr;
  test::expect_error([&] { go(q, bad_kv, scores, {}, {}); }, where + "kv.k is a null pointer");
  test::expect_error([&] { go(q, kv, MatrixView<float>{scores.data, 3, 40, 48}, {}, {}); },
                     where + "scores.rows (= 3) != kv.batch * kv.kv_heads (= 2 * 2)");
  test::expect_error([&] { go(q, kv, MatrixView<float>{nullptr, 4, 40, 48}, {}, {}); }, where + "scores.data is a null pointer");
  test::expect_error([&] { go(q, kv, scores, {.reduce = GroupReduce(7)}, {}); },
                     where + "options.reduce (= 7) is neither GroupReduce::max nor GroupReduce::sum");
  // The device's own rules: head_dim, alignment, group size.
  const auto q96 = QueryView<const bfloat16>::packed(base, 2, 8, 96);
  const auto kv96 = ContiguousKVView<const bfloat16>::packed(base, base, 2, 2, 40, 96);
  test::expect_error([&] { go(q96, kv96, scores, {}, {}); },
                     where + "head_dim (= 96) is not supported by the CUDA group-score kernels (supported: 64, 128, 256)");
  test::expect_error([&] { go(QueryView<const bfloat16>::packed(base + 1, 2, 8, 128), kv, scores, {}, {}); },
                     {where + "q.data", "is not 16-byte aligned"});
  bad_kv = kv;
  bad_kv.token_stride = 132;  // 264 bytes
  bad_kv.head_stride = 132 * 40;
  bad_kv.batch_stride = 2 * 132 * 40;
  test::expect_error([&] { go(q, bad_kv, scores, {}, {}); }, where + "kv.k: stride 132 (264 bytes) is not a multiple of 16 bytes");
  const auto wide_group = QueryView<const bfloat16>::packed(base, 1, 12290, 64);
  const auto one_head = ContiguousKVView<const bfloat16>::packed(base, base, 1, 1, 40, 64);
  test::expect_error([&] { go(wide_group, one_head, MatrixView<float>{scores.data, 1, 40, 48}, {}, {}); },
                     where + "q_heads / kv_heads (= 12290) exceeds the CUDA kernels' limit of 12288");
  // More (row, chunk) CTAs than a grid holds: 2^26 rows of 2^20 columns (1024 chunks each).
  const auto many_q = QueryView<const bfloat16>::packed(base, 1 << 16, 1 << 10, 64);
  const auto many_kv = ContiguousKVView<const bfloat16>::packed(base, base, 1 << 16, 1 << 10, 40, 64);
  test::expect_error([&] { go(many_q, many_kv, MatrixView<float>::packed(scores.data, 1 << 26, 1 << 20), {}, {}); },
                     where + "batch * kv_heads * ceil(max_tokens / 1024) (= 68719476736) exceeds the CUDA grid limit");
  // A paged cache: the page table is device memory, never read on the host.
  const std::int32_t* table = reinterpret_cast<const std::int32_t*>(memory.data());
  const PagedKVView<const bfloat16> paged{base, base, table, table, table, 2, 2, 128, 16, 4, 16 * 2 * 128, 2 * 128, 128};
  test::expect_error([&] { go(q, paged, scores, softmax, {}); }, where + "workspace too small: 'logits'");
}

}  // namespace
}  // namespace kvsift
