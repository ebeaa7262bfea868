// Every selector's life cycle per slot and NaN in what it reads, through DecodeStep on the CPU: one test body per
// case, run by each selector through its line in selector_cases() (SpeContext, whose step takes the retrieval
// head's keys, has its cases in test_specontext.cpp).
//   - run before prepare, run after release, release of a slot without a sequence (never prepared, released,
//     outside the slots, listed twice) are refused naming the slot, and a refused release changes nothing;
//   - a NaN key in the prompt's middle makes the output of its kv head's query heads NaN, as dense attention's,
//     or is refused at prepare (stated per selector below); a NaN prefill query likewise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "a2ats_problem.hpp"
#include "ctkvr_problem.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/a2ats/a2ats.hpp"
#include "kvsift/selectors/centroid_kv/centroid_kv.hpp"
#include "kvsift/selectors/csattention/csattention.hpp"
#include "kvsift/selectors/ctkvr/ctkvr.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/selectors/streaming_llm/streaming_llm.hpp"
#include "kvsift/step/decode_step.hpp"
#include "test_util.hpp"

namespace kvsift::test {
namespace {

using Any = AnySelector<half, cpu::Context>;

/// How a selector meets NaN in the prompt: its row's output becomes NaN (the token is selected, or the row is
/// marked bad), it refuses it at prepare, or it never reads the middle's keys (StreamingLLM, which attends the
/// window alone).
enum class NanPolicy { propagates, refused_at_prepare, not_read };

struct SelectorCase {
  std::string name;
  std::function<Any(const SelectorLimits&)> make;
  AttentionWindow window;      ///< the step's window (CentroidKV's must be empty)
  NanPolicy nan_key, nan_query;  ///< a NaN key in the middle, a NaN prefill query
};

constexpr AttentionWindow kWindow{4, 16};
constexpr std::int32_t kHeadDim = 64;  // A²ATS takes 64 or 128

/// A²ATS's codebooks for kv_heads 2 and kHeadDim: clustered codewords of a problem of their own (the selector copies
/// them; the keys it codes are any cache's).
const A2atsLayerCodebooks& a2ats_codebooks() {
  static Random rng(test_seed());
  static const A2atsProblem<half> problem(rng, A2atsCodebookKind::clustered, 1, 8, 2, 64, {64}, {}, 2048, true, 24,
                                          kHeadDim);
  static const A2atsLayerCodebooks codebooks = problem.codebooks();
  return codebooks;
}

const std::vector<SelectorCase>& selector_cases() {
  static const std::vector<SelectorCase> cases = {
      {"OracleTopK", [](const SelectorLimits& l) { return Any(OracleTopK<half, cpu::Context>(l, {.budget = 32})); },
       kWindow, NanPolicy::propagates, NanPolicy::not_read},
      {"Quest", [](const SelectorLimits& l) { return Any(Quest<half, cpu::Context>(l, {.budget = 32, .page_size = 8})); },
       kWindow, NanPolicy::propagates, NanPolicy::not_read},
      {"StreamingLLM", [](const SelectorLimits& l) { return Any(StreamingLLM<half, cpu::Context>(l)); }, kWindow,
       NanPolicy::not_read, NanPolicy::not_read},
      {"Ctkvr",
       [](const SelectorLimits& l) {
         return Any(Ctkvr<half, cpu::Context>(l, {.budget = 32, .centroids = 8, .max_centroids = 16,
                                                  .recalled_centroids = 2}));
       },
       kWindow, NanPolicy::refused_at_prepare, NanPolicy::refused_at_prepare},
      {"Csattention",
       [](const SelectorLimits& l) {
         return Any(Csattention<half, cpu::Context>(
             l, {.subspaces = 8, .centroids = 6, .list_fraction = 0.25, .keep_fraction = 0.2, .prepare_chunk = 20}));
       },
       kWindow, NanPolicy::refused_at_prepare, NanPolicy::refused_at_prepare},
      {"A2ats",
       [](const SelectorLimits& l) {
         return Any(A2ats<half, cpu::Context>(l, {.budget_fraction = 0.1}, a2ats_codebooks(), cpu::Context{}));
       },
       kWindow, NanPolicy::refused_at_prepare, NanPolicy::not_read},
      {"CentroidKV",
       [](const SelectorLimits& l) {
         return Any(CentroidKV<half, cpu::Context>(l, {.budget_ratio = 0.5f, .sinks = 4, .recent = 16}, {}));
       },
       AttentionWindow{}, NanPolicy::propagates, NanPolicy::not_read},
  };
  return cases;
}

class LifeCycle : public testing::TestWithParam<std::size_t> {
 protected:
  const SelectorCase& sc() const { return selector_cases()[GetParam()]; }
  Random rng{test_seed()};
  CtkvrProblem p{rng, 8, 2, 200, 16, kHeadDim};

  SelectorLimits limits() const {
    SelectorLimits l = p.limits();
    l.max_slots = 2;
    return l;
  }
  DecodeStep<Any> step() const {
    DecodeStepConfig config = p.config();
    config.attention.window = sc().window;
    return DecodeStep<Any>(sc().make(limits()), config, {});
  }
  /// One decode step of slot p.slot on a poisoned workspace into a poisoned output: O [q_heads, head_dim] and
  /// LSE [q_heads].
  struct Output {
    std::vector<float> o, lse;
  };
  Output run(DecodeStep<Any>& s) {
    const std::vector<half> q = to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim));
    // Poisoned with +inf, which neither the finite nor the NaN checks below accept.
    constexpr float poison = std::numeric_limits<float>::infinity();
    Output out{std::vector<float>(std::size_t(p.q_heads) * p.head_dim, poison),
               std::vector<float>(std::size_t(p.q_heads), poison)};
    cpu::Array<std::byte> workspace(s.workspace_bytes());
    std::memset(workspace.data(), 0xff, workspace.size());
    s.run(StepInputs<half>{.q = QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim), .cache = p.cache(),
                           .slots = &p.slot},
          StateView<float>::packed(out.o.data(), out.lse.data(), 1, p.q_heads, p.head_dim), workspace.bytes(), {});
    return out;
  }
  static bool head_is_nan(const Output& out, std::int32_t h, std::int32_t head_dim) {
    for (std::int32_t i = 0; i < head_dim; ++i) {
      if (!std::isnan(out.o[std::size_t(h) * head_dim + i])) return false;
    }
    return std::isnan(out.lse[std::size_t(h)]);
  }
  static bool all_finite(const Output& out) {
    for (const float x : out.o) {
      if (!std::isfinite(x)) return false;
    }
    for (const float x : out.lse) {
      if (!std::isfinite(x)) return false;
    }
    return true;
  }
};

TEST_P(LifeCycle, CallsOnASlotWithoutASequenceAreRefusedByName) {
  SCOPED_TRACE(sc().name);
  DecodeStep<Any> s = step();
  const std::string name = sc().name;
  expect_error([&] { run(s); }, {name + "::append: slots[0] (= 0) holds no sequence: it was never prepared"});
  expect_error([&] { s.release(std::vector<std::int32_t>{0}); },
               {name + "::release: slots[0] (= 0) holds no sequence: it was never prepared"});
  s.prepare(p.prefill(), {});
  EXPECT_TRUE(all_finite(run(s)));
  EXPECT_TRUE(s.selector().prepared(0));
  EXPECT_FALSE(s.selector().prepared(1));
  // Release: a slot never prepared, outside the slots or listed twice is refused, and nothing changes.
  expect_error([&] { s.release(std::vector<std::int32_t>{0, 1}); },
               {name + "::release: slots[1] (= 1) holds no sequence: it was never prepared"});
  expect_error([&] { s.release(std::vector<std::int32_t>{2}); },
               {name + "::release: slots[0] (= 2) is outside [0, limits.max_slots = 2)"});
  expect_error([&] { s.release(std::vector<std::int32_t>{0, 0}); }, {name + "::release: slots lists slot 0 twice"});
  EXPECT_TRUE(s.selector().prepared(0));
  EXPECT_TRUE(all_finite(run(s))) << "the refused releases left slot 0 prepared";
  s.release(std::vector<std::int32_t>{0});
  EXPECT_FALSE(s.selector().prepared(0));
  expect_error([&] { run(s); }, {name + "::append: slots[0] (= 0) holds no sequence: it was released"});
  expect_error([&] { s.release(std::vector<std::int32_t>{0}); }, {"slots[0] (= 0) holds no sequence: it was released"});
  // A released slot takes a joining sequence again.
  s.prepare(p.prefill(), {});
  EXPECT_TRUE(all_finite(run(s)));
}

TEST_P(LifeCycle, ANanKeyInThePromptIsSelectedOrRefused) {
  SCOPED_TRACE(sc().name);
  if (sc().nan_key == NanPolicy::not_read) GTEST_SKIP() << sc().name << " reads no middle key";
  DecodeStep<Any> s = step();
  // Token 101 of kv head 1, channel 7: in the middle (the window is 4 + 16 of 200 tokens).
  const std::int32_t g = 1, t = 101;
  p.k[(std::size_t(g) * p.capacity + t) * p.head_dim + 7] = from_float<half>(std::numeric_limits<float>::quiet_NaN());
  if (sc().nan_key == NanPolicy::refused_at_prepare) {
    expect_error([&] { s.prepare(p.prefill(), {}); },
                 {sc().name + "::prepare", "the prompt's keys hold a non-finite value at sequence 0, kv head 1, token 101"});
    EXPECT_FALSE(s.selector().prepared(0)) << "a refused prepare prepares nothing";
    return;
  }
  s.prepare(p.prefill(), {});
  const Output out = run(s);
  const std::int32_t group = p.q_heads / p.kv_heads;
  for (std::int32_t h = 0; h < p.q_heads; ++h) {
    if (h / group == g) {
      EXPECT_TRUE(head_is_nan(out, h, p.head_dim)) << "query head " << h << ": dense attention is NaN there";
    } else {
      EXPECT_TRUE(std::isfinite(out.lse[std::size_t(h)])) << "query head " << h << " of the other kv head";
    }
  }
}

TEST_P(LifeCycle, ANanPrefillQueryIsRefused) {
  SCOPED_TRACE(sc().name);
  if (sc().nan_query == NanPolicy::not_read) GTEST_SKIP() << sc().name << " reads no prefill query";
  DecodeStep<Any> s = step();
  p.prefill_q[std::size_t(3) * p.queries * p.head_dim + 5] = from_float<half>(std::numeric_limits<float>::infinity());
  expect_error([&] { s.prepare(p.prefill(), {}); },
               {sc().name + "::prepare", "in.queries holds a non-finite value at sequence 0, head 3, query 0"});
  EXPECT_FALSE(s.selector().prepared(0));
}

INSTANTIATE_TEST_SUITE_P(EverySelector, LifeCycle, testing::Range<std::size_t>(0, selector_cases().size()),
                         [](const testing::TestParamInfo<std::size_t>& info) {
                           return selector_cases()[info.param].name;
                         });

}  // namespace
}  // namespace kvsift::test
