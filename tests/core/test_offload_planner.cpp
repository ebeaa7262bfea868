// SpeContext's memory planner (selectors/specontext/offload_planner.hpp): algorithm 1's thresholds and algorithm 2's plans on
// examples worked by hand, the literal line 3 exceeding the memory, monotone thresholds and tight plans on random
// inputs against an fp64 evaluation of equation 7, and every refusal.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvsift/selectors/specontext/offload_planner.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::expect_error;
using test::Random;

// The hand example: Mem_GPU 1,000,000; M_O 100,000, M_D 0, +30% -> runtime 130,000, free 870,000.
// L 4, H 1, D 8, alpha 2, R 1, bf16, +1 head layer, B 10:
//   c = 2 (K,V) * 2 bytes * R 1 * H 1 * D 8 = 32 bytes;  K = 4 + 1 + 2 = 7;  buffer c * B = 320 bytes.
OffloadPlannerParams small_params() {
  return {.gpu_bytes = 1'000'000, .model_bytes = 100'000, .head_bytes = 0, .runtime_percent = 30, .layers = 4,
          .kv_heads = 1, .head_dim = 8, .group = 2, .requests = 1, .budget = 10, .bytes_per_element = 2,
          .head_layers = 1};
}

TEST(OffloadPlanner, ModelTermsByHand) {
  const OffloadPlannerParams p = small_params();
  EXPECT_EQ(planner_runtime_bytes(p), 130'000);
  EXPECT_EQ(planner_token_bytes(p), 32);
  EXPECT_EQ(planner_sequence_layers(p), 7);
  // eq. 6 at S 100: 130,000 + 32 * 7 * 100 = 152,400.
  EXPECT_EQ(planner_memory_bytes(p, 100, 0), 152'400);
  // eq. 7 at S 100, 2 offloaded: 130,000 + 32 * (5 * 100 + 2 * 10) = 130,000 + 16,640 = 146,640.
  EXPECT_EQ(planner_memory_bytes(p, 100, 2), 146'640);
  // The runtime rounds up: 100,001 * 1.3 = 130,001.3 -> 130,002.
  OffloadPlannerParams odd = p;
  odd.model_bytes = 100'001;
  EXPECT_EQ(planner_runtime_bytes(odd), 130'002);
  // fp32 instead of bf16 doubles c: 2 * 4 * 8 = 64.
  odd.bytes_per_element = 4;
  EXPECT_EQ(planner_token_bytes(odd), 64);
}

TEST(OffloadPlanner, ThresholdsByHand) {
  // S_n = floor((870,000 - n * 320) / (32 * (7 - n))):
  //   n 0: 870,000 / 224 = 3883.9 -> 3883     n 1: 869,680 / 192 = 4529.6 -> 4529
  //   n 2: 869,360 / 160 = 5433.5 -> 5433     n 3: 869,040 / 128 = 6789.4 -> 6789
  //   n 4: 868,720 /  96 = 9049.2 -> 9049
  EXPECT_EQ(sequence_thresholds(small_params()), (std::vector<std::int64_t>{3883, 4529, 5433, 6789, 9049}));
}

TEST(OffloadPlanner, LiteralLineThreeExceedsMemory) {
  // As printed, line 3 subtracts n * B * R * H * D = n * 80 (no factor 4):
  //   n 1: 869,920 / 192 = 4530.8 -> 4530     n 2: 869,840 / 160 = 5436.5 -> 5436
  //   n 3: 869,760 / 128 = 6795.0 -> 6795     n 4: 869,680 /  96 = 9059.2 -> 9059
  OffloadPlannerParams p = small_params();
  p.literal_algorithm1 = true;
  const std::vector<std::int64_t> literal = sequence_thresholds(p);
  EXPECT_EQ(literal, (std::vector<std::int64_t>{3883, 4530, 5436, 6795, 9059}));
  // At S 9058 the literal plan keeps all 4 layers offloaded, and eq. 7 needs
  // 130,000 + 32 * (3 * 9058 + 4 * 10) = 130,000 + 32 * 27,214 = 1,000,848 bytes > 1,000,000.
  EXPECT_EQ(plan_offload(literal, 9058).offloaded, 4);
  EXPECT_EQ(planner_memory_bytes(p, 9058, 4), 1'000'848);
  // At S 6794 it offloads 3: 130,000 + 32 * (4 * 6794 + 3 * 10) = 1,000,592 bytes > 1,000,000.
  EXPECT_EQ(plan_offload(literal, 6794).offloaded, 3);
  EXPECT_EQ(planner_memory_bytes(p, 6794, 3), 1'000'592);
  // The consistent plan refuses S 9058 (>= S_4 = 9049); its last fitting length, S 9048, needs
  // 130,000 + 32 * (3 * 9048 + 40) = 999,888 bytes.
  const std::vector<std::int64_t> consistent = sequence_thresholds(small_params());
  expect_error([&] { plan_offload(consistent, 9058); }, {"plan_offload", "seq_len = 9058 reaches S_L^T = 9049"});
  EXPECT_EQ(plan_offload(consistent, 9048).offloaded, 4);
  EXPECT_EQ(planner_memory_bytes(small_params(), 9048, 4), 999'888);
}

TEST(OffloadPlanner, PlansByHand) {
  const std::vector<std::int64_t> s = sequence_thresholds(small_params());  // {3883, 4529, 5433, 6789, 9049}
  const auto expect_plan = [&](std::int64_t seq_len, std::int32_t offloaded) {
    SCOPED_TRACE(seq_len);
    const OffloadPlan plan = plan_offload(s, seq_len);
    EXPECT_EQ(plan.offloaded, offloaded);
    EXPECT_EQ(plan.first_offloaded, 4 - offloaded);  // the last layers first
  };
  expect_plan(0, 0);
  expect_plan(3882, 0);
  // At S 3883 eq. 6 still fits (130,000 + 224 * 3883 = 999,792 bytes), but algorithm 2 offloads at S >= S_0:
  // the floor makes it one token early.
  EXPECT_LT(planner_memory_bytes(small_params(), 3883, 0), 1'000'000);
  expect_plan(3883, 1);
  expect_plan(4528, 1);
  expect_plan(4529, 2);
  expect_plan(5433, 3);
  expect_plan(6789, 4);
  expect_plan(9048, 4);
}

TEST(OffloadPlanner, IssueModelShape) {
  // The issue's shape, docs/specontext.md's table: L 32, H 8, D 128, alpha 4, bf16, B 2048, 80e9 bytes of
  // GPU, M_O 16,060,000,000 (8.03B parameters in bf16), M_D 1,092,616,192 (128256 x 4096 embedding + 4096 x 4096
  // Wq + 4096 x 1024 Wk, bf16). weights 17,152,616,192; +30%: 5,145,784,857.6 -> 5,145,784,858;
  // runtime 22,298,401,050; free 57,701,598,950. R 1: c = 4 * 8 * 128 = 4096, K = 37:
  //   S_0  = floor(57,701,598,950 / (4096 * 37 = 151,552)) = 380,737
  //          (151,552 * 380,737 = 57,701,453,824 <= free < 151,552 * 380,738 = 57,701,605,376)
  //   S_32 = floor((57,701,598,950 - 32 * 4096 * 2048) / (4096 * 5)) = 57,433,163,494 / 20,480 = 2,804,353
  //          (20,480 * 2,804,353 = 57,433,149,440 <= 57,433,163,494 < + 20,480)
  const OffloadPlannerParams p{.gpu_bytes = 80'000'000'000, .model_bytes = 16'060'000'000,
                               .head_bytes = 1'092'616'192, .layers = 32, .kv_heads = 8, .head_dim = 128,
                               .group = 4, .requests = 1, .budget = 2048};
  EXPECT_EQ(planner_runtime_bytes(p), 22'298'401'050);
  const std::vector<std::int64_t> s = sequence_thresholds(p);
  ASSERT_EQ(s.size(), 33u);
  EXPECT_EQ(s.front(), 380'737);
  EXPECT_EQ(s.back(), 2'804'353);
  EXPECT_EQ(plan_offload(s, 131'072).offloaded, 0);  // 128K fits whole
}

/// Random params, kept below 2^53 bytes so that fp64 evaluates equation 7 exactly.
OffloadPlannerParams random_params(Random& rng) {
  OffloadPlannerParams p;
  p.gpu_bytes = std::int64_t(std::ldexp(1.0, rng.uniform_int(20, 40)) * rng.uniform(1.0f, 2.0f));
  p.model_bytes = std::max<std::int64_t>(1, std::int64_t(double(p.gpu_bytes) * rng.uniform(0.0f, 0.8f)));
  p.head_bytes = std::int64_t(double(p.model_bytes) * rng.uniform(0.0f, 0.2f));
  p.runtime_percent = rng.uniform_int(0, 40);
  p.layers = rng.uniform_int(1, 96);
  p.kv_heads = rng.uniform_int(1, 16);
  p.head_dim = 8 * rng.uniform_int(1, 32);
  p.group = rng.uniform_int(1, 8);
  p.requests = rng.uniform_int(1, 16);
  p.budget = rng.uniform_int(1, 4096);
  p.bytes_per_element = 1 << rng.uniform_int(0, 2);
  p.head_layers = rng.uniform_int(0, 2);
  p.literal_algorithm1 = rng.uniform_int(0, 1) == 1;
  return p;
}

/// Equation 7 in fp64, from the params alone.
double reference_memory(const OffloadPlannerParams& p, double seq_len, double offloaded) {
  const double weights = double(p.model_bytes) + double(p.head_bytes);
  const double runtime = weights + std::ceil(weights * p.runtime_percent / 100.0);
  const double c = 2.0 * p.bytes_per_element * p.requests * p.kv_heads * p.head_dim;
  const double k = double(p.layers) + p.head_layers + p.group;
  return runtime + c * ((k - offloaded) * seq_len + offloaded * p.budget);
}

TEST(OffloadPlanner, RandomThresholdsMonotoneAndPlansTight) {
  const std::uint64_t seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "KVSIFT_TEST_SEED=" << seed);
  Random rng(seed);
  int planned = 0, refused = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const OffloadPlannerParams p = random_params(rng);
    const double c = 2.0 * p.bytes_per_element * p.requests * p.kv_heads * p.head_dim;
    const double buffer = (p.literal_algorithm1 ? c / (2.0 * p.bytes_per_element) : c) * p.budget;
    const double free = double(p.gpu_bytes) - reference_memory(p, 0, 0);
    const double k = double(p.layers) + p.head_layers + p.group;
    if (free <= 0 || free < k * buffer) {  // no KV memory, or decreasing thresholds: both refused
      EXPECT_THROW(sequence_thresholds(p), Error);
      ++refused;
      continue;
    }
    const std::vector<std::int64_t> s = sequence_thresholds(p);
    ASSERT_EQ(s.size(), std::size_t(p.layers) + 1);
    for (std::int32_t n = 0; n <= p.layers; ++n) {
      if (n > 0) {
        ASSERT_GE(s[n], s[n - 1]) << "n " << n;
      }
      // S_n is the floor of the quotient: the buffer model (eq. 7 by default) holds S_n tokens, not S_n + 1.
      const double held = double(p.gpu_bytes) - reference_memory(p, 0, 0) - n * buffer;
      ASSERT_LE(double(s[n]) * c * (k - n), held);
      ASSERT_GT(double(s[n] + 1) * c * (k - n), held);
    }
    for (int probe = 0; probe < 8; ++probe) {
      const std::int64_t seq_len = std::int64_t(rng.uniform(0.0f, 1.0f) * double(s.back() - 1));
      const OffloadPlan plan = plan_offload(s, seq_len);
      ASSERT_EQ(plan.first_offloaded, p.layers - plan.offloaded);
      ASSERT_LT(seq_len, s[plan.offloaded]);
      if (plan.offloaded > 0) {
        ASSERT_GE(seq_len, s[plan.offloaded - 1]);
      }
      if (p.literal_algorithm1) continue;  // the literal thresholds promise nothing about eq. 7
      // Fits (eq. 6's strict "<"), and is tight: one more token with one layer fewer would not fit.
      ASSERT_LT(reference_memory(p, double(seq_len), plan.offloaded), double(p.gpu_bytes));
      ASSERT_EQ(double(planner_memory_bytes(p, seq_len, plan.offloaded)),
                reference_memory(p, double(seq_len), plan.offloaded));
      if (plan.offloaded > 0) {
        ASSERT_GT(reference_memory(p, double(seq_len + 1), plan.offloaded - 1), double(p.gpu_bytes));
      }
    }
    ++planned;
  }
  EXPECT_GT(planned, 200);
  EXPECT_GT(refused, 50);
}

TEST(OffloadPlanner, RefusesBadParams) {
  const auto refuse = [](auto edit, const std::string& message) {
    OffloadPlannerParams p = small_params();
    edit(p);
    expect_error([&] { sequence_thresholds(p); }, {"sequence_thresholds", message});
    expect_error([&] { planner_memory_bytes(p, 10, 0); }, {"planner_memory_bytes", message});
  };
  refuse([](auto& p) { p.gpu_bytes = 0; }, "params.gpu_bytes (= 0) must be positive");
  refuse([](auto& p) { p.gpu_bytes = -5; }, "params.gpu_bytes (= -5) must be positive");
  refuse([](auto& p) { p.model_bytes = 0; }, "params.model_bytes (= 0) must be positive");
  refuse([](auto& p) { p.head_bytes = -1; }, "params.head_bytes (= -1) must not be negative");
  refuse([](auto& p) { p.runtime_percent = -30; }, "params.runtime_percent (= -30) must not be negative");
  refuse([](auto& p) { p.layers = 0; }, "params.layers (= 0) must be positive");
  refuse([](auto& p) { p.kv_heads = -8; }, "params.kv_heads (= -8) must be positive");
  refuse([](auto& p) { p.head_dim = 0; }, "params.head_dim (= 0) must be positive");
  refuse([](auto& p) { p.group = 0; }, "params.group (= 0) must be positive");
  refuse([](auto& p) { p.requests = 0; }, "params.requests (= 0) must be positive");
  refuse([](auto& p) { p.budget = 0; }, "params.budget (= 0) must be positive");
  refuse([](auto& p) { p.bytes_per_element = 0; }, "params.bytes_per_element (= 0) must be positive");
  refuse([](auto& p) { p.head_layers = -1; }, "params.head_layers (= -1) must not be negative");
  refuse([](auto& p) { p.model_bytes = std::numeric_limits<std::int64_t>::max(); p.head_bytes = 1; },
         "overflows int64");
}

TEST(OffloadPlanner, RefusesMemoryThatCannotHoldAPlan) {
  OffloadPlannerParams p = small_params();
  p.gpu_bytes = 130'000;  // exactly the weights and runtime
  expect_error([&] { sequence_thresholds(p); },
               {"sequence_thresholds", "(130000 bytes: 100000 + 0 plus 30%) leave no memory for KV on a GPU of "
                                       "130000 bytes"});
  // B 4000: the 870,000 free bytes hold 870,000 / 224 = 3883 tokens of all 7 layers, fewer than B, so an
  // offloaded layer's buffer (128,000 bytes) costs more than its tokens free: the thresholds would decrease.
  p = small_params();
  p.budget = 4000;
  expect_error([&] { sequence_thresholds(p); },
               {"sequence_thresholds", "the 870000 bytes left for KV hold fewer than budget = 4000 tokens in all 7 "
                                       "layers"});
  // The literal line's buffer is a quarter of that (32,000 bytes; 7 of them fit): not refused.
  p.literal_algorithm1 = true;
  EXPECT_EQ(sequence_thresholds(p).size(), 5u);
  // The boundary: free / K = 124,285 bytes; B 3883 (buffer 124,256) passes, B 3884 (124,288) does not.
  p = small_params();
  p.budget = 3883;
  EXPECT_NO_THROW(sequence_thresholds(p));
  p.budget = 3884;
  EXPECT_THROW(sequence_thresholds(p), Error);
}

TEST(OffloadPlanner, RefusesBadPlanInputs) {
  const std::vector<std::int64_t> s = sequence_thresholds(small_params());
  expect_error([&] { plan_offload(s, -1); }, {"plan_offload", "seq_len (= -1) must not be negative"});
  expect_error([&] { plan_offload(s, 9049); },
               {"plan_offload", "seq_len = 9049 reaches S_L^T = 9049: the KV does not fit even with all 4 layers "
                                "offloaded"});
  const std::vector<std::int64_t> one{100};
  expect_error([&] { plan_offload(one, 10); }, {"plan_offload", "thresholds hold 1 values"});
  const std::vector<std::int64_t> decreasing{100, 90, 200};
  expect_error([&] { plan_offload(decreasing, 10); }, {"plan_offload", "thresholds[1] (= 90) < thresholds[0] (= 100)"});
  expect_error([&] { planner_memory_bytes(small_params(), -3, 0); },
               {"planner_memory_bytes", "seq_len (= -3) must not be negative"});
  expect_error([&] { planner_memory_bytes(small_params(), 10, 5); },
               {"planner_memory_bytes", "offloaded (= 5) is outside [0, layers = 4]"});
  expect_error([&] { planner_memory_bytes(small_params(), 10, -1); },
               {"planner_memory_bytes", "offloaded (= -1) is outside [0, layers = 4]"});
  expect_error([&] { planner_memory_bytes(small_params(), std::numeric_limits<std::int64_t>::max() / 2, 0); },
               {"planner_memory_bytes", "overflows int64"});
}

}  // namespace
}  // namespace kvsift
