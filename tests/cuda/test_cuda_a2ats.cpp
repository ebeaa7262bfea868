// A²ATS on CUDA (selectors/a2ats/a2ats.hpp with cuda::Context) against its CPU twin, in lockstep: clustered codebooks with
// keys far from any tie (so the backends' fp32 codes agree) and codewords whose table entries are far apart (so their
// fp32 tables rank alike): after prepare (pre-RoPE keys given, or recovered from the cache in chunks) the codes are
// equal, and at every step, appends included, the codes and the selections are equal and follow the rule's
// reference (tests/a2ats_problem.hpp); both group rules. select + attend + append of a DecodeStep replay from a CUDA
// graph while the engine advances the lengths, and equal the CPU step's selections, the output the fp64 sparse
// attention over them. Workspaces (poisoned; too small refused) and refusals made before any device call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "a2ats_problem.hpp"
#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/a2ats/a2ats.hpp"
#include "kvsift/selectors/rerank.hpp"
#include "kvsift/step/decode_step.hpp"

namespace kvsift {
namespace {

using test::A2atsCodebookKind;
using test::A2atsProblem;
using test::DeviceBuffer;
using test::kA2atsWindow;
using CpuSelector = A2ats<half, cpu::Context>;
using CudaSelector = A2ats<half, cuda::Context>;

/// The problem's arrays on the device (the cache's keys and values, the pre-RoPE keys, lengths and slots).
struct DeviceProblem {
  DeviceBuffer<half> k, v, k_pre;
  DeviceBuffer<std::int32_t> lengths, slots;
  explicit DeviceProblem(const A2atsProblem<half>& p)
      : k(p.k), v(p.v), k_pre(p.k_pre), lengths(p.lengths), slots(p.slots) {}
  KVCache<half> cache(const A2atsProblem<half>& p) const { return p.contiguous(k.data(), v.data(), lengths.data()); }
};

std::vector<std::uint16_t> host_codes(const VqCodesView<const std::uint16_t>& c, bool device) {
  std::vector<std::uint16_t> out(std::size_t(c.slots) * c.kv_heads * c.max_tokens);
  if (device) {
    KVSIFT_CUDA_CHECK(cudaMemcpy(out.data(), c.data, out.size() * 2, cudaMemcpyDeviceToHost));
  } else {
    std::copy_n(c.data, out.size(), out.begin());
  }
  return out;
}

using Mode = std::tuple<A2atsGroupRule, bool>;
class CudaA2ats : public test::GpuTest, public ::testing::WithParamInterface<Mode> {};
INSTANTIATE_TEST_SUITE_P(Modes, CudaA2ats,
                         ::testing::Combine(::testing::Values(A2atsGroupRule::union_of_heads, A2atsGroupRule::group_max),
                                            ::testing::Bool()));

TEST_P(CudaA2ats, CodesAndSelectionsEqualTheCpus) {
  SCOPED_TRACE(seed);
  const auto [rule, pre_rope] = GetParam();
  SCOPED_TRACE(pre_rope ? "pre-RoPE keys given" : "keys recovered from the cache");
  const RopeConfig rope{.theta = 500000.0, .scaling = {.kind = RopeScaling::llama3, .factor = 8.0,
                                                       .original_max_position_embeddings = 256}};
  A2atsProblem<half> p(rng, A2atsCodebookKind::clustered, 3, 16, 4, 1200, {1000, 777, 1100}, rope, 2048, true, 64,
                       128);
  const A2atsConfig config{.group_rule = rule, .prepare_chunk = 300};
  DeviceProblem dp(p);
  CpuSelector cpu_sel(p.limits(), config, p.codebooks(), {});
  CudaSelector gpu_sel(p.limits(), config, p.codebooks(), {nullptr});
  const SelectShape shape{p.batch, p.q_heads, p.kv_heads, p.head_dim, p.capacity};
  cpu::Array<std::byte> cpu_append(cpu_sel.append_workspace_bytes(shape, {})), cpu_select(cpu_sel.select_workspace_bytes(shape, {}));
  DeviceBuffer<std::byte> gpu_append(gpu_sel.append_workspace_bytes(shape, {nullptr}));
  DeviceBuffer<std::byte> gpu_select(gpu_sel.select_workspace_bytes(shape, {nullptr}));
  const auto prefill = [&](bool device) {
    PrefillInputs<half> in{.cache = device ? KVCache<const half>(dp.cache(p)) : KVCache<const half>(p.contiguous()),
                           .slots = device ? dp.slots.data() : p.slots.data()};
    if (pre_rope) in.k_pre_rope = p.k_pre_rope(device ? dp.k_pre.data() : p.k_pre.data());
    return in;
  };
  cpu_sel.prepare(prefill(false), {});
  gpu_sel.prepare(prefill(true), {nullptr});
  p.expect_codes(host_codes(cpu_sel.codes(), false), "CPU prepare");
  ASSERT_EQ(host_codes(gpu_sel.codes(), true), host_codes(cpu_sel.codes(), false)) << "prepare";
  const std::int32_t capacity = cpu_sel.capacity();
  const std::size_t entries = std::size_t(p.batch) * p.kv_heads * capacity, rows = std::size_t(p.batch) * p.kv_heads;
  DeviceBuffer<std::int32_t> indices(entries), counts(rows);
  DeviceBuffer<half> q(std::size_t(p.batch) * p.q_heads * p.head_dim), step_k(std::size_t(p.batch) * p.kv_heads * p.head_dim);
  for (std::int32_t step = 0; step < 6; ++step) {
    if (step > 0) {
      for (auto& l : p.lengths) ++l;
      dp.lengths.upload(p.lengths);
      const std::vector<half> k_pre = p.step_k_pre();
      step_k.upload(k_pre);
      const auto view = [&](const half* data) {
        return pre_rope ? HeadsView<const half>::packed(data, p.batch, p.kv_heads, p.head_dim) : HeadsView<const half>{};
      };
      std::memset(cpu_append.data(), 0xff, cpu_append.size());
      gpu_append.poison();
      cpu_sel.append({.cache = p.contiguous(), .slots = p.slots.data(), .lengths = p.lengths.data(),
                      .k_pre_rope = view(k_pre.data())},
                     cpu_append.bytes(), {});
      gpu_sel.append({.cache = dp.cache(p), .slots = dp.slots.data(), .lengths = dp.lengths.data(),
                      .k_pre_rope = view(step_k.data())},
                     {gpu_append.data(), gpu_append.size()}, {nullptr});
      ASSERT_EQ(host_codes(gpu_sel.codes(), true), host_codes(cpu_sel.codes(), false)) << "append " << step;
    }
    const auto qs = p.queries(rng);
    q.upload(qs.q);
    std::vector<std::int32_t> want_indices(entries, test::kPoisonIndex), want_counts(rows, -7);
    std::memset(cpu_select.data(), 0xff, cpu_select.size());
    cpu_sel.select({.q = QueryView<const half>::packed(qs.q.data(), p.batch, p.q_heads, p.head_dim),
                    .cache = p.contiguous(), .slots = p.slots.data(), .lengths = p.lengths.data(),
                    .attention = {.window = kA2atsWindow}},
                   {want_indices.data(), want_counts.data(), nullptr, p.batch, p.kv_heads, capacity}, cpu_select.bytes(),
                   {});
    test::expect_a2ats_selection(p, qs, want_indices, want_counts, capacity, config, cpu_sel.max_budget(),
                                 fmt::format("CPU step {}", step));
    indices.poison();
    counts.poison();
    gpu_select.poison();
    gpu_sel.select({.q = QueryView<const half>::packed(q.data(), p.batch, p.q_heads, p.head_dim), .cache = dp.cache(p),
                    .slots = dp.slots.data(), .lengths = dp.lengths.data(), .attention = {.window = kA2atsWindow}},
                   {indices.data(), counts.data(), nullptr, p.batch, p.kv_heads, capacity},
                   {gpu_select.data(), gpu_select.size()}, {nullptr});
    const std::vector<std::int32_t> got_counts = counts.download(), got_indices = indices.download();
    ASSERT_EQ(got_counts, want_counts) << "step " << step;
    for (std::size_t r = 0; r < rows; ++r) {
      for (std::int32_t i = 0; i < want_counts[r]; ++i) {
        ASSERT_EQ(got_indices[r * capacity + i], want_indices[r * capacity + i]) << "step " << step << " row " << r << " entry " << i;
      }
    }
  }
  // An undersized workspace is refused before any launch.
  test::expect_error(
      [&] {
        gpu_sel.append({.cache = dp.cache(p), .slots = dp.slots.data(), .lengths = dp.lengths.data()},
                       {gpu_append.data(), gpu_append.size() - 256}, {nullptr});
      },
      "workspace too small");
}

class CudaA2atsGraph : public test::GpuTest {};
TEST_F(CudaA2atsGraph, ReplaysWithAdvancingLengthsEqualTheCpusSteps) {
  SCOPED_TRACE(seed);
  A2atsProblem<half> p(rng, A2atsCodebookKind::clustered, 2, 32, 8, 900, {700, 811}, {}, 2048, true, 48, 128);
  DeviceProblem dp(p);
  const test::Stream stream;
  const cuda::Context ctx{stream};
  DecodeStep gpu(CudaSelector(p.limits(), {}, p.codebooks(), ctx), p.step_config(), ctx);
  DecodeStep cpu(CpuSelector(p.limits(), {}, p.codebooks(), {}), p.step_config(), {});
  gpu.prepare({.cache = dp.cache(p), .slots = dp.slots.data()}, ctx);
  cpu.prepare({.cache = p.contiguous(), .slots = p.slots.data()}, {});
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  DeviceBuffer<std::byte> workspace(gpu.workspace_bytes());
  cpu::Array<std::byte> host_workspace(cpu.workspace_bytes());
  DeviceBuffer<half> dq(std::size_t(p.batch) * p.q_heads * p.head_dim), o(dq.size());
  DeviceBuffer<float> lse(std::size_t(p.batch) * p.q_heads);
  std::vector<half> host_o(dq.size());
  std::vector<float> host_lse(lse.size());
  const test::CapturedGraph graph(
      stream,
      [&] {
        gpu.run({.q = QueryView<const half>::packed(dq.data(), p.batch, p.q_heads, p.head_dim), .cache = dp.cache(p),
                 .slots = dp.slots.data()},
                StateView<half>::packed(o.data(), lse.data(), p.batch, p.q_heads, p.head_dim),
                {workspace.data(), workspace.size()}, ctx);
      },
      cudaStreamCaptureModeGlobal);
  for (std::int32_t s = 0; s < 5; ++s) {
    for (auto& l : p.lengths) ++l;  // the engine's step: the token is in the cache, the lengths grow
    dp.lengths.upload(p.lengths);
    const auto qs = p.queries(rng);
    dq.upload(qs.q);
    workspace.poison();
    o.poison();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    graph.launch();
    const auto qv = QueryView<const half>::packed(qs.q.data(), p.batch, p.q_heads, p.head_dim);
    cpu.run({.q = qv, .cache = p.contiguous(), .slots = p.slots.data()},
            StateView<half>::packed(host_o.data(), host_lse.data(), p.batch, p.q_heads, p.head_dim),
            host_workspace.bytes(), {});
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const SelectionView want = cpu.selection(host_workspace.bytes(), p.batch);
    const SelectionView got = gpu.selection({workspace.data(), workspace.size()}, p.batch);
    std::vector<std::int32_t> ids(std::size_t(p.batch) * p.kv_heads * got.capacity), counts(std::size_t(p.batch) * p.kv_heads);
    KVSIFT_CUDA_CHECK(cudaMemcpy(ids.data(), got.indices, ids.size() * 4, cudaMemcpyDeviceToHost));
    KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), got.counts, counts.size() * 4, cudaMemcpyDeviceToHost));
    for (std::int32_t r = 0; r < p.batch * p.kv_heads; ++r) {
      ASSERT_EQ(counts[std::size_t(r)], want.counts[r]) << "replay " << s << " row " << r;
      EXPECT_TRUE(std::equal(want.indices + std::size_t(r) * want.capacity,
                             want.indices + std::size_t(r) * want.capacity + want.counts[r],
                             ids.begin() + std::ptrdiff_t(r) * got.capacity))
          << "replay " << s << " row " << r;
    }
    test::HostState ref(p.batch, p.q_heads, p.head_dim);
    reference::sparse_decode(qv,
                             ContiguousKVView<const half>::packed(p.k.data(), p.v.data(), p.batch, p.kv_heads, p.capacity,
                                                                  p.head_dim, p.lengths.data()),
                             want, ref.view, AttentionOptions{.window = kA2atsWindow});
    test::expect_close(o.download(), lse.download(), ref, fmt::format("replay {}", s));
  }
}

// The append on the step's second stream (DecodeStepConfig::append_beside_select, the default) changes nothing: a
// step replayed from a graph with it and an eager step without it, over more steps than the recent window holds (so
// that the appended codes reach the middle), select the same tokens, write the same output bit for bit and the
// same codes; both group rules, and the union under a rerank stage (Reranked forwards its proposer's answer).
TEST_F(CudaA2atsGraph, AppendBesideSelectEqualsTheAppendInOrder) {
  SCOPED_TRACE(seed);
  const auto check = [&](const char* what, const auto& make) {
    SCOPED_TRACE(what);
    A2atsProblem<half> p(rng, A2atsCodebookKind::clustered, 2, 32, 8, 900, {700, 811}, {}, 2048, true, 48, 128);
    DeviceProblem beside_problem(p), in_order_problem(p);
    const test::Stream stream;
    const cuda::Context ctx{stream};
    DecodeStepConfig in_order_config = p.step_config();
    in_order_config.append_beside_select = false;
    DecodeStep beside(make(p, ctx), p.step_config(), ctx);
    DecodeStep in_order(make(p, ctx), in_order_config, ctx);
    ASSERT_TRUE(beside.appends_beside_select());
    ASSERT_FALSE(in_order.appends_beside_select());
    beside.prepare({.cache = beside_problem.cache(p), .slots = beside_problem.slots.data()}, ctx);
    in_order.prepare({.cache = in_order_problem.cache(p), .slots = in_order_problem.slots.data()}, ctx);
    DeviceBuffer<std::byte> beside_workspace(beside.workspace_bytes()), in_order_workspace(in_order.workspace_bytes());
    DeviceBuffer<half> dq(std::size_t(p.batch) * p.q_heads * p.head_dim), beside_o(dq.size()), in_order_o(dq.size());
    DeviceBuffer<float> beside_lse(std::size_t(p.batch) * p.q_heads), in_order_lse(beside_lse.size());
    const auto q = QueryView<const half>::packed(dq.data(), p.batch, p.q_heads, p.head_dim);
    const auto run = [&](auto& step, const DeviceProblem& dp, DeviceBuffer<std::byte>& workspace, DeviceBuffer<half>& o,
                         DeviceBuffer<float>& lse) {
      step.run({.q = q, .cache = dp.cache(p), .slots = dp.slots.data()},
               StateView<half>::packed(o.data(), lse.data(), p.batch, p.q_heads, p.head_dim),
               {workspace.data(), workspace.size()}, ctx);
    };
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const test::CapturedGraph graph(
        stream, [&] { run(beside, beside_problem, beside_workspace, beside_o, beside_lse); },
        cudaStreamCaptureModeGlobal);
    const std::int32_t steps = kA2atsWindow.recent + 6;
    for (std::int32_t s = 0; s < steps; ++s) {
      for (auto& l : p.lengths) ++l;  // the engine's step
      beside_problem.lengths.upload(p.lengths);
      in_order_problem.lengths.upload(p.lengths);
      dq.upload(p.queries(rng).q);
      beside_workspace.poison();
      in_order_workspace.poison();
      beside_o.poison();
      in_order_o.poison();
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
      graph.launch();
      run(in_order, in_order_problem, in_order_workspace, in_order_o, in_order_lse);
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto selection = [&](auto& step, DeviceBuffer<std::byte>& workspace) {
        const SelectionView v = step.selection({workspace.data(), workspace.size()}, p.batch);
        std::vector<std::int32_t> ids(std::size_t(p.batch) * p.kv_heads * v.capacity), counts(std::size_t(p.batch) * p.kv_heads);
        KVSIFT_CUDA_CHECK(cudaMemcpy(ids.data(), v.indices, ids.size() * 4, cudaMemcpyDeviceToHost));
        KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), v.counts, counts.size() * 4, cudaMemcpyDeviceToHost));
        for (std::size_t r = 0; r < counts.size(); ++r) {
          std::fill(ids.begin() + std::ptrdiff_t(r * v.capacity + std::size_t(std::max(counts[r], 0))),
                    ids.begin() + std::ptrdiff_t((r + 1) * v.capacity), 0);  // past a row's count: not written
        }
        return std::pair{counts, ids};
      };
      const auto [want_counts, want_ids] = selection(in_order, in_order_workspace);
      const auto [got_counts, got_ids] = selection(beside, beside_workspace);
      ASSERT_GT(*std::max_element(want_counts.begin(), want_counts.end()), 0) << "step " << s;
      ASSERT_EQ(got_counts, want_counts) << "step " << s;
      ASSERT_EQ(got_ids, want_ids) << "step " << s;
      const std::vector<half> want_o = in_order_o.download(), got_o = beside_o.download();
      ASSERT_EQ(0, std::memcmp(got_o.data(), want_o.data(), want_o.size() * sizeof(half))) << "step " << s;
      ASSERT_EQ(beside_lse.download(), in_order_lse.download()) << "step " << s;
    }
    const auto codes = [](const auto& selector) {
      if constexpr (requires { selector.proposer(); }) {
        return host_codes(selector.proposer().codes(), true);
      } else {
        return host_codes(selector.codes(), true);
      }
    };
    EXPECT_EQ(codes(beside.selector()), codes(in_order.selector()));
  };
  const auto a2ats = [](A2atsGroupRule rule) {
    return [rule](const A2atsProblem<half>& p, const cuda::Context& ctx) {
      return CudaSelector(p.limits(), {.group_rule = rule}, p.codebooks(), ctx);
    };
  };
  check("union", a2ats(A2atsGroupRule::union_of_heads));
  check("group max", a2ats(A2atsGroupRule::group_max));
  check("union, reranked", [&](const A2atsProblem<half>& p, const cuda::Context& ctx) {
    CudaSelector proposer = a2ats(A2atsGroupRule::union_of_heads)(p, ctx);
    const std::int32_t kept = std::max(1, proposer.capacity() / 4);
    return Reranked<CudaSelector>(std::move(proposer), {.budget = kept});
  });
}


TEST(CudaA2atsBadInput, RefusedBeforeAnyDeviceCall) {
  // The construction's checks come before the upload; select's before any launch (host arrays stand in).
  test::Random rng(test::test_seed());
  A2atsProblem<half> p(rng, A2atsCodebookKind::clustered, 2, 8, 2, 200, {150, 120});
  auto cb = p.codebooks();
  cb.kv_heads = 4;
  test::expect_error([&] { CudaSelector(p.limits(), {}, cb, {nullptr}); },
                     "A2ats: the codebook is [kv_heads = 4, head_dim = 64]; limits have kv_heads = 2, head_dim = 64");
  test::expect_error([&] { CudaSelector(p.limits(), {.budget_fraction = 2.0}, p.codebooks(), {nullptr}); },
                     "config.budget_fraction (= 2) is outside (0, 1]");
  if (!cuda::device_available()) return;
  CudaSelector s(p.limits(), {}, p.codebooks(), {nullptr});
  std::int32_t ints[8] = {};
  test::expect_error(
      [&] {
        s.select({.q = QueryView<const half>::packed(p.k.data(), 2, 8, 64), .cache = p.contiguous(), .slots = ints,
                  .lengths = ints},
                 {ints, ints, nullptr, 2, 2, 23}, {}, {nullptr});
      },
      "out.capacity (= 23) is smaller than the selector's capacity (= 24)");
  test::expect_error([&] { (void)s.select_workspace_bytes({2, 8, 2, 64, 300}, {nullptr}); },
                     "shape.max_seq_len (= 300) is outside [0, limits.max_tokens = 200]");
}

}  // namespace
}  // namespace kvsift
