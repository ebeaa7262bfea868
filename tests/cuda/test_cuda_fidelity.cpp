// The CUDA selectors on real attention: on the committed SmolLM2 capture, OracleTopK, Quest and StreamingLLM run
// in a CUDA decode step over the capture's fp16 cache in its own [token][head][channel] layout, as the fidelity
// harness runs their CPU twins. The step's output agrees with the fp64 reference over the window and the
// step's selection, and both backends' selections are the top of the fp64 scores but for candidates within
// fp32 rounding of the k-th (tests/selector_check.hpp's expect_top_k).
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/selectors/oracle_topk.hpp"
#include "kvsift/selectors/quest.hpp"
#include "kvsift/selectors/streaming_llm.hpp"
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

}  // namespace
}  // namespace kvsift
