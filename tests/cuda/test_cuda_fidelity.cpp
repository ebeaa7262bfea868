// The CUDA selectors on real attention: on the committed SmolLM2 capture, OracleTopK, Quest and StreamingLLM run
// in a CUDA decode step over the capture's fp16 cache in its own [token][head][channel] layout, as the fidelity
// harness runs their CPU twins. The step's output agrees with the fp64 reference over the window and the
// step's selection, and both backends' selections are the top of the fp64 scores but for candidates within
// fp32 rounding of the k-th (tests/selector_check.hpp's expect_top_k). Then the harness itself on both backends
// in lockstep (eval/cuda_fidelity.hpp), on a random capture and on the committed one: its CUDA rows equal its
// CPU rows up to selections that differ only in candidates within that epsilon of the k-th fp64 score.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <string>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/eval/cuda_fidelity.hpp"
#include "kvsift/eval/fidelity.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/selectors/streaming_llm/streaming_llm.hpp"
#include "kvsift/step/decode_step.hpp"
#include "selector_check.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;

class CudaFidelity : public test::GpuTest {};

/// The step's selection rows (host copies) and its output, for one position of one layer.
struct Outcome {
  std::vector<std::int32_t> indices, counts;
  std::vector<half> o;
  std::vector<float> lse;
  std::int32_t capacity = 0;
};

/// OracleTopK's score of every token [0, pos] of kv head g at position pos, in fp64 from the capture's fp16
/// values: the largest softmax weight over the group's query heads.
std::vector<double> oracle_fp64(const CaptureLayer& l, const Capture& c, std::int32_t pos, std::int32_t g) {
  const std::int32_t len = pos + 1, group = c.q_heads / c.kv_heads;
  const double scale = 1.0 / std::sqrt(double(c.head_dim));
  std::vector<double> best(std::size_t(len), 0.0), logits(std::size_t(len), 0.0);
  for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
    double top = -1e300;
    for (std::int32_t t = 0; t < len; ++t) {
      double dot = 0;
      for (std::int32_t i = 0; i < c.head_dim; ++i) {
        dot += double(to_float(l.q[(std::size_t(pos) * c.q_heads + h) * c.head_dim + i])) *
               to_float(l.k[(std::size_t(t) * c.kv_heads + g) * c.head_dim + i]);
      }
      logits[std::size_t(t)] = scale * dot;
      top = std::max(top, logits[std::size_t(t)]);
    }
    double sum = 0;
    for (const double x : logits) sum += std::exp(x - top);
    for (std::int32_t t = 0; t < len; ++t) best[std::size_t(t)] = std::max(best[std::size_t(t)], std::exp(logits[std::size_t(t)] - top) / sum);
  }
  return best;
}

/// Quest's bound of every page of kv head g at position pos, in fp64 from the capture's fp16 keys.
std::vector<double> page_bounds_fp64(const CaptureLayer& l, const Capture& c, std::int32_t pos, std::int32_t g,
                                     std::int32_t page_size) {
  const std::int32_t len = pos + 1, group = c.q_heads / c.kv_heads, pages = (len + page_size - 1) / page_size;
  std::vector<double> scores(std::size_t(pages), -1e300);
  for (std::int32_t p = 0; p < pages; ++p) {
    for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
      double bound = 0;
      for (std::int32_t i = 0; i < c.head_dim; ++i) {
        double lo = 1e300, hi = -1e300;
        for (std::int32_t t = p * page_size; t < std::min(len, (p + 1) * page_size); ++t) {
          const double x = to_float(l.k[(std::size_t(t) * c.kv_heads + g) * c.head_dim + i]);
          lo = std::min(lo, x);
          hi = std::max(hi, x);
        }
        const double qi = to_float(l.q[(std::size_t(pos) * c.q_heads + h) * c.head_dim + i]);
        bound += std::max(qi * lo, qi * hi);
      }
      scores[std::size_t(p)] = std::max(scores[std::size_t(p)], bound);
    }
  }
  return scores;
}

template <class Selector, class Context>
Outcome run_one_step(Selector selector, const DecodeStepConfig& config, const KVCache<half>& cache,
                     const QueryView<const half>& q, const std::int32_t* slot, const Context& ctx) {
  DecodeStep step(std::move(selector), config, ctx);
  step.prepare({.cache = cache, .slots = slot}, ctx);
  const std::size_t o_size = std::size_t(config.q_heads) * config.head_dim;
  Outcome r;
  r.o.resize(o_size);
  r.lse.resize(std::size_t(config.q_heads));
  if constexpr (std::is_same_v<Context, cpu::Context>) {
    cpu::Array<std::byte> workspace(step.workspace_bytes());
    step.run(StepInputs<half>{.q = q, .cache = cache, .slots = slot},
             StateView<half>::packed(r.o.data(), r.lse.data(), 1, config.q_heads, config.head_dim), workspace.bytes(), ctx);
    const SelectionView sel = step.selection(workspace.bytes(), 1);
    r.capacity = sel.capacity;
    r.indices.assign(sel.indices, sel.indices + std::size_t(config.kv_heads) * sel.capacity);
    r.counts.assign(sel.counts, sel.counts + config.kv_heads);
  } else {
    DeviceBuffer<std::byte> workspace(step.workspace_bytes());
    workspace.poison();
    DeviceBuffer<half> d_o(o_size);
    DeviceBuffer<float> d_lse(std::size_t(config.q_heads));
    d_o.poison();
    step.run(StepInputs<half>{.q = q, .cache = cache, .slots = slot},
             StateView<half>::packed(d_o.data(), d_lse.data(), 1, config.q_heads, config.head_dim),
             {workspace.data(), workspace.size()}, ctx);
    const SelectionView sel = step.selection({workspace.data(), workspace.size()}, 1);
    r.capacity = sel.capacity;
    r.indices.resize(std::size_t(config.kv_heads) * sel.capacity);
    r.counts.resize(std::size_t(config.kv_heads));
    KVSIFT_CUDA_CHECK(cudaMemcpy(r.indices.data(), sel.indices, r.indices.size() * 4, cudaMemcpyDeviceToHost));
    KVSIFT_CUDA_CHECK(cudaMemcpy(r.counts.data(), sel.counts, r.counts.size() * 4, cudaMemcpyDeviceToHost));
    r.o = d_o.download();
    r.lse = d_lse.download();
  }
  return r;
}

TEST_F(CudaFidelity, SelectorsOnARealCaptureAgreeWithTheirCpuTwinsAndTheReference) {
  const Capture c = read_capture(std::string(KVSIFT_TEST_DATA_DIR) + "/gpl3_512_l3_l15.kvscap");
  constexpr std::int32_t kBudget = 48, kPositions = 4;
  const AttentionWindow window{4, 16};
  const std::int32_t qd = c.q_heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  const SelectorLimits limits{.max_slots = 1, .max_tokens = c.tokens, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
                              .head_dim = c.head_dim};
  const DecodeStepConfig config{.attention = {.window = window}, .max_batch = 1, .q_heads = c.q_heads,
                                .kv_heads = c.kv_heads, .head_dim = c.head_dim, .max_seq_len = c.tokens};
  const std::int32_t slot = 0;
  const DeviceBuffer<std::int32_t> d_slot(std::vector<std::int32_t>{slot});
  for (const CaptureLayer& l : c.layers) {
    std::vector<half> k = l.k, v = l.v;
    DeviceBuffer<half> d_k(l.k), d_v(l.v), d_q(l.q);
    for (std::int32_t pos = c.tokens - kPositions; pos < c.tokens; ++pos) {
      const std::int32_t length = pos + 1;  // the query at pos attends its own token
      const DeviceBuffer<std::int32_t> d_length(std::vector<std::int32_t>{length});
      const auto cache_of = [&](half* kp, half* vp, const std::int32_t* len) {
        return KVCache<half>(ContiguousKVView<half>{kp, vp, len, 1, c.kv_heads, c.tokens, c.head_dim,
                                                    std::int64_t(c.tokens) * kvd, c.head_dim, kvd});
      };
      const auto q_host = QueryView<const half>::packed(l.q.data() + std::size_t(pos) * qd, 1, c.q_heads, c.head_dim);
      const auto q_dev = QueryView<const half>::packed(d_q.data() + std::size_t(pos) * qd, 1, c.q_heads, c.head_dim);
      const auto compare = [&](const std::string& name, auto cpu_selector, auto cuda_selector) {
        SCOPED_TRACE(testing::Message() << name << ", layer " << l.layer << ", position " << pos);
        const Outcome want = run_one_step(std::move(cpu_selector), config, cache_of(k.data(), v.data(), &length), q_host,
                                          &slot, cpu::Context{});
        const Outcome got = run_one_step(std::move(cuda_selector), config, cache_of(d_k.data(), d_v.data(), d_length.data()),
                                         q_dev, d_slot.data(), cuda::Context{});
        // CPU and CUDA both pick the top of the fp64 scores, up to candidates within fp32 rounding of the k-th.
        for (std::int32_t g = 0; g < c.kv_heads; ++g) {
          const std::string what = fmt::format("kv head {}", g);
          const auto row = [&](const Outcome& r) {
            return std::vector<std::int32_t>(r.indices.begin() + std::ptrdiff_t(g) * r.capacity,
                                             r.indices.begin() + std::ptrdiff_t(g) * r.capacity + r.counts[g]);
          };
          if (name == "StreamingLLM") {
            EXPECT_EQ(got.counts[g], 0) << what;
            EXPECT_EQ(want.counts[g], 0) << what;
            continue;
          }
          const bool quest = name == "Quest";
          const auto scores = quest ? page_bounds_fp64(l, c, pos, g, 16) : oracle_fp64(l, c, pos, g);
          std::map<std::int32_t, double> candidates;
          const std::int32_t lo = window.sink_end(length), hi = window.recent_begin(length);
          for (std::int32_t t = lo; t < hi; ++t) candidates[quest ? t / 16 : t] = scores[std::size_t(quest ? t / 16 : t)];
          const auto as_candidates = [&](const std::vector<std::int32_t>& tokens) {
            std::set<std::int32_t> ids;
            for (const std::int32_t t : tokens) ids.insert(quest ? t / 16 : t);
            return std::vector<std::int32_t>(ids.begin(), ids.end());
          };
          double kth_scale = 0;
          for (const auto& [id, score] : candidates) kth_scale = std::max(kth_scale, std::abs(score));
          const double eps = quest ? 1e-4 * (1 + kth_scale) : 1e-4 * kth_scale;
          const std::int32_t k = quest ? kBudget / 16 : kBudget;
          test::expect_top_k(as_candidates(row(got)), candidates, k, eps, "CUDA " + what);
          test::expect_top_k(as_candidates(row(want)), candidates, k, eps, "CPU " + what);
        }
        // The CUDA output is exact attention over the window and the CUDA selection.
        const SelectionView sel{const_cast<std::int32_t*>(got.indices.data()), const_cast<std::int32_t*>(got.counts.data()),
                                nullptr, 1, c.kv_heads, got.capacity};
        test::HostState ref(1, c.q_heads, c.head_dim);
        reference::sparse_decode(q_host, cache_of(k.data(), v.data(), &length).contiguous, sel, ref.view,
                                 config.attention);
        test::expect_close(got.o, got.lse, ref, name);
      };
      compare("OracleTopK", OracleTopK<half, cpu::Context>(limits, {.budget = kBudget}),
              OracleTopK<half, cuda::Context>(limits, {.budget = kBudget}));
      compare("Quest", Quest<half, cpu::Context>(limits, {.budget = kBudget, .page_size = 16}),
              Quest<half, cuda::Context>(limits, {.budget = kBudget, .page_size = 16}));
      compare("StreamingLLM", StreamingLLM<half, cpu::Context>(limits), StreamingLLM<half, cuda::Context>(limits));
    }
  }
}

// ---- the harness on both backends -------------------------------------------------------------------------

/// Both backends' selections at `m` differ only in candidates whose fp64 scores lie within epsilon of the k-th best
/// (the epsilons of the test above). OracleTopK has no window: every token is a candidate and k is the budget.
/// Quest runs as reference_selectors makes it: split_budget(K, {4, 64}) into a window and a selection of pages of
/// quest_page_size(selection); its candidates are the pages holding a middle token. StreamingLLM selects nothing,
/// so its attended sets (the window) never differ.
void expect_near_tie(const Capture& c, const SelectionMismatch& m, std::int32_t budget_tokens) {
  SCOPED_TRACE(testing::Message() << m.selector << ", layer " << m.layer << ", budget " << m.budget << ", position "
                                  << m.position << ", kv head " << m.kv_head);
  ASSERT_TRUE(m.selector == "OracleTopK" || m.selector == "Quest") << "attended sets differ";
  const auto layer = std::find_if(c.layers.begin(), c.layers.end(), [&](const CaptureLayer& l) { return l.layer == m.layer; });
  ASSERT_NE(layer, c.layers.end());
  const bool quest = m.selector == "Quest";
  const BudgetSplit split = split_budget(budget_tokens, {4, 64});
  const std::int32_t page_size = quest ? quest_page_size(split.selection) : 1;
  const auto all = quest ? page_bounds_fp64(*layer, c, m.position, m.kv_head, page_size)
                         : oracle_fp64(*layer, c, m.position, m.kv_head);
  std::vector<double> sorted;
  if (quest) {
    const std::int32_t length = m.position + 1;
    const std::int32_t lo = split.window.sink_end(length), hi = split.window.recent_begin(length);
    for (std::int32_t p = lo / page_size; lo < hi && p <= (hi - 1) / page_size; ++p) sorted.push_back(all[std::size_t(p)]);
  } else {
    sorted = all;
  }
  std::sort(sorted.begin(), sorted.end(), std::greater<>());
  const std::int32_t k =
      std::min<std::int32_t>(quest ? split.selection / page_size : budget_tokens, std::int32_t(sorted.size()));
  ASSERT_GT(k, 0);
  const double kth = sorted[std::size_t(k) - 1], scale = std::max(std::abs(sorted.front()), std::abs(sorted.back()));
  const double eps = quest ? 1e-4 * (1 + scale) : 1e-4 * scale;
  for (const auto* tokens : {&m.only_first, &m.only_this}) {
    for (const std::int32_t t : *tokens) {
      const std::int32_t id = t / page_size;
      ASSERT_LT(std::size_t(id), all.size());
      EXPECT_LE(std::abs(all[std::size_t(id)] - kth), eps) << "token " << t << ": score " << all[std::size_t(id)]
                                                           << ", k-th " << kth;
    }
  }
}

/// The CUDA rows equal the CPU rows: exactly where no selection of the row differed (fp64 metrics over the same
/// attended sets), else within what the differing selections can move; output errors within kOutputErrorRelative
/// of each other: the CUDA kernel rounds the softmax weights to the storage type for its tensor-core P.V product
/// (2^-11 relative for fp16, a few 1e-4 of the output once summed; 1.6e-4 of 1.85 measured on the H100). Every differing selection is a
/// near-tie, and `selections` (layer, budget, selector, position, kv head) were compared.
void expect_backends_agree(const Capture& c, const FidelityComparison& got, std::int64_t selections) {
  constexpr double kOutputErrorRelative = 1e-3;
  ASSERT_EQ(got.results.size(), 2u);
  ASSERT_EQ(got.differences.size(), 1u);
  const FidelityResult &cpu = got.results[0], &gpu = got.results[1];
  const BackendDifference& diff = got.differences[0];
  EXPECT_EQ(cpu.backend, "cpu");
  EXPECT_EQ(gpu.backend, "cuda");
  EXPECT_EQ(diff.backend, "cuda");
  EXPECT_EQ(diff.first, "cpu");
  EXPECT_EQ(cpu.positions, gpu.positions);
  EXPECT_EQ(diff.selections, selections);
  EXPECT_TRUE(diff.refusals.empty()) << fidelity_markdown(diff);
  const auto samples = double(cpu.positions.size()) * c.kv_heads;
  ASSERT_EQ(cpu.rows.size(), gpu.rows.size());
  for (std::size_t i = 0; i < cpu.rows.size(); ++i) {
    const FidelityRow &a = cpu.rows[i], &b = gpu.rows[i];
    SCOPED_TRACE(testing::Message() << a.selector << ", layer " << a.layer << ", budget " << a.budget);
    ASSERT_EQ(a.layer, b.layer);
    ASSERT_EQ(a.selector, b.selector);
    ASSERT_EQ(a.budget, b.budget);
    EXPECT_EQ(a.budget_tokens, b.budget_tokens);
    EXPECT_EQ(a.refused, b.refused);
    if (!a.refused.empty()) continue;
    double mass = 0.0, ids = 0.0, selected = 0.0;
    bool differed = false;
    for (const auto& m : diff.mismatches) {
      if (m.layer != a.layer || m.selector != a.selector || m.budget != a.budget) continue;
      expect_near_tie(c, m, a.budget_tokens);
      differed = true;
      mass = std::max(mass, m.mass);
      ids += double(std::max(m.only_first.size(), m.only_this.size())) / a.budget_tokens / samples;
      selected += std::abs(double(m.only_this.size()) - double(m.only_first.size())) / samples;
    }
    constexpr double kSame = 1e-12;  // fp64 sums over the same sets in the same order
    EXPECT_NEAR(a.mass_recall, b.mass_recall, mass + kSame);
    EXPECT_NEAR(a.mass_recall_p10, b.mass_recall_p10, mass + kSame);  // quantiles move no more than every sample
    EXPECT_NEAR(a.mass_recall_p90, b.mass_recall_p90, mass + kSame);
    EXPECT_NEAR(a.id_recall, b.id_recall, ids + kSame);
    EXPECT_NEAR(a.mean_selected, b.mean_selected, selected + kSame);
    if (differed) continue;  // the swapped tokens' values move the outputs by an amount the rule does not bound
    EXPECT_NEAR(a.output_error, b.output_error, kOutputErrorRelative * a.output_error);
    EXPECT_NEAR(a.output_error_p90, b.output_error_p90, kOutputErrorRelative * a.output_error_p90);
  }
}

FidelityComparison evaluate_on_both(const Capture& c, const FidelityOptions& options) {
  const auto cpu = fidelity_backend(reference_selectors());
  const auto gpu = cuda::fidelity_backend(reference_selectors<cuda::Context>());
  FidelityBackend* const backends[] = {cpu.get(), gpu.get()};
  return evaluate_fidelity(c, backends, options);
}

class CudaFidelityHarness : public test::GpuTest {};

TEST_F(CudaFidelityHarness, BothBackendsGiveTheSameRowsOnARandomCapture) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  // 192 tokens, 8 query heads on 2 kv heads of dim 64 (a CUDA decode shape), two layers; queries of scale 2 give
  // logits of standard deviation 2, so attention is neither flat nor one-hot.
  constexpr std::int32_t kTokens = 192, kQHeads = 8, kKVHeads = 2, kDim = 64;
  Capture c;
  c.model = "random";
  c.text_id = "test";
  c.tokens = kTokens;
  c.q_heads = kQHeads;
  c.kv_heads = kKVHeads;
  c.head_dim = kDim;
  const auto fp16 = [&](std::size_t n, float stddev) {
    const auto x = rng.normal(n, stddev);
    std::vector<half> out(n);
    std::transform(x.begin(), x.end(), out.begin(), float_to_half);
    return out;
  };
  const std::size_t q_size = std::size_t(kTokens) * kQHeads * kDim, kv_size = std::size_t(kTokens) * kKVHeads * kDim;
  for (const std::int32_t id : {0, 7}) {
    c.layers.push_back({.layer = id, .q_pre = {}, .q = fp16(q_size, 2.0f), .k_pre = {}, .k = fp16(kv_size, 1.0f),
                        .v = fp16(kv_size, 1.0f)});
  }
  // Prefill [0, 96): K = 5, 19, 34 (Quest: windows of 0 + 1, 2 + 4, 4 + 8 tokens; 4, 13, 22 pages of one token).
  const FidelityOptions options{.budgets = {0.05, 0.2, 0.35}, .decode_positions = 24, .prefill = 0.5};
  const auto got = evaluate_on_both(c, options);
  ASSERT_FALSE(HasFatalFailure());
  // 2 layers x 3 budgets x 3 selectors x 24 positions x 2 kv heads: none refused (Quest's pages shrink with K).
  expect_backends_agree(c, got, 2 * 9 * 24 * 2);
  for (const FidelityRow& row : got.results[1].rows) EXPECT_EQ(row.refused, "") << row.selector << " " << row.budget;
  // Near-ties are rare on random data: nearly every selection is the same token for token.
  EXPECT_LE(got.differences[0].mismatches.size(), std::size_t(got.differences[0].selections / 100))
      << fidelity_markdown(got.differences[0]);
}

TEST_F(CudaFidelityHarness, BothBackendsGiveTheSameRowsOnTheCommittedCapture) {
  const Capture c = read_capture(std::string(KVSIFT_TEST_DATA_DIR) + "/gpl3_512_l3_l15.kvscap");
  // Prefill [0, 384): K = 19 and 39; 16 positions over 384..511.
  const auto got = evaluate_on_both(c, {.budgets = {0.05, 0.1}, .decode_positions = 16, .prefill = 0.75});
  // 2 layers x 2 budgets x 3 selectors x 16 positions x 3 kv heads.
  expect_backends_agree(c, got, 2 * 2 * 3 * 16 * 3);
  const std::string line = fidelity_markdown(got.differences[0]);
  EXPECT_EQ(line.rfind("cuda against cpu: ", 0), 0u) << line;
}

TEST(CudaFidelityBadInput, TheCudaBackendNeedsADevice) {
  if (cuda::device_available()) GTEST_SKIP() << "this machine has a CUDA device";
  test::expect_error([] { cuda::fidelity_backend(reference_selectors<cuda::Context>()); },
                     "no CUDA device on this machine");
}

}  // namespace
}  // namespace kvsift
