// CTKVR in the paper's hybrid placement, DecodeStep<Ctkvr<T, cuda::Context>, placement::MiddleOnCpu> with its host
// stage (step/split_step.hpp): index and recall on the GPU, rerank and the selection's attention on the CPU over a
// pinned host cache, the window on the GPU, merged on the GPU. The device cache's middle rows are NaN after prepare
// (only the window may be read there); the workspace is poisoned once, the output before each step. Against
// fp64 references written from the contract (tests/ctkvr_problem.hpp): with C' = C and whole lists, every step's
// host selection is the top of the softmax over the middle, max over the group, also after decoded tokens left the
// window and the dynamic update (computed on the CPU, applied to the GPU's index) replaced lists; the output is
// the reference attention over window and selection; the pinned prefill centroids' lists survive on the GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_check.hpp"
#include "ctkvr_problem.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/ctkvr/ctkvr.hpp"
#include "kvsift/step/split_step.hpp"
#include "selector_check.hpp"

namespace kvsift {
namespace {

using test::CtkvrProblem;
using test::DeviceBuffer;
using test::kCtkvrWindow;
using test::PinnedBuffer;

using CtkvrOnGpu = Ctkvr<half, cuda::Context>;
using CtkvrSplitStep = DecodeStep<CtkvrOnGpu, placement::MiddleOnCpu>;
static_assert(HasHostStage<CtkvrOnGpu>, "CTKVR declares its rerank as a host stage");

class CtkvrHybrid : public test::GpuTest, public ::testing::WithParamInterface<std::int32_t> {};
INSTANTIATE_TEST_SUITE_P(Groups, CtkvrHybrid, ::testing::Values(1, 4));

TEST_P(CtkvrHybrid, SelectionsAndOutputsFollowTheReferenceAtEveryStep) {
  SCOPED_TRACE(seed);
  const std::int32_t group = GetParam();
  CtkvrProblem p(rng, 2 * group, 2, 208, 16, 64);
  cpu::ThreadPool pool(2);
  const std::int32_t budget = 24, columns = 8;
  // Six whole prefill lists pinned in eight columns: with C' = 6, at least four whole lists are recalled.
  const SplitContext split{.cpu = {&pool}};
  CtkvrSplitStep step(CtkvrOnGpu(p.limits(), {.budget = budget, .list_size = p.middle(), .centroids = 6,
                                              .max_centroids = columns, .recalled_centroids = 6,
                                              .pin_prefill_centroids = true}),
                      p.config(), split);
  DeviceBuffer<half> d_k(p.k), d_v(p.v), d_queries(p.prefill_q);
  DeviceBuffer<std::int32_t> d_length(std::vector<std::int32_t>{p.length}), d_slot(std::vector<std::int32_t>{0});
  const auto device_cache = [&] {
    return ContiguousKVView<half>::packed(d_k.data(), d_v.data(), 1, p.kv_heads, p.capacity, p.head_dim,
                                          d_length.data());
  };
  step.prepare({.cache = device_cache(), .slots = d_slot.data(),
                .queries = SequenceView<const half>::packed(d_queries.data(), 1, p.q_heads, p.queries, p.head_dim)},
               {});
  const test::SplitBuffers workspace(step.workspace_bytes());
  PinnedBuffer<half> h_k(p.k), h_v(p.v);
  const std::vector<std::int32_t> lists_before(
      [&] {
        std::vector<std::int32_t> ids(std::size_t(p.kv_heads) * columns * p.middle());
        KVSIFT_CUDA_CHECK(
            cudaMemcpy(ids.data(), step.selector().index_lists().ids, ids.size() * 4, cudaMemcpyDeviceToHost));
        return ids;
      }());
  // From here on the device cache holds the window alone: the middle's rows are NaN, and each step's token is
  // written to both caches.
  std::vector<half> device_k = p.k, device_v = p.v;
  const half nan = from_float<half>(std::numeric_limits<float>::quiet_NaN());
  for (std::int32_t h = 0; h < p.kv_heads; ++h) {
    for (std::int32_t t = kCtkvrWindow.sink_end(p.length); t < kCtkvrWindow.recent_begin(p.length); ++t) {
      std::fill_n(device_k.begin() + (std::size_t(h) * p.capacity + t) * p.head_dim, p.head_dim, nan);
      std::fill_n(device_v.begin() + (std::size_t(h) * p.capacity + t) * p.head_dim, p.head_dim, nan);
    }
  }

  DeviceBuffer<half> d_o(std::size_t(p.q_heads) * p.head_dim);
  DeviceBuffer<float> d_lse(std::size_t(p.q_heads));
  for (std::int32_t s = 0; s < 10; ++s) {
    ++p.length;
    const std::vector<half> q = test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim));
    for (std::int32_t h = 0; h < p.kv_heads; ++h) {  // the engine writes the token to both caches
      const std::size_t row = (std::size_t(h) * p.capacity + p.length - 1) * p.head_dim;
      const std::vector<half> nk = test::to_storage<half>(rng.normal(std::size_t(p.head_dim)));
      const std::vector<half> nv = test::to_storage<half>(rng.normal(std::size_t(p.head_dim)));
      std::copy(nk.begin(), nk.end(), p.k.begin() + row);
      std::copy(nv.begin(), nv.end(), p.v.begin() + row);
      std::copy(nk.begin(), nk.end(), h_k.data() + row);
      std::copy(nv.begin(), nv.end(), h_v.data() + row);
      std::copy(nk.begin(), nk.end(), device_k.begin() + row);
      std::copy(nv.begin(), nv.end(), device_v.begin() + row);
    }
    d_k.upload(device_k);
    d_v.upload(device_v);
    d_length.upload({p.length});
    DeviceBuffer<half> d_q(q);
    d_o.poison();
    d_lse.poison();
    step.run({.q = QueryView<const half>::packed(d_q.data(), 1, p.q_heads, p.head_dim),
              .cache = device_cache(),
              .slots = d_slot.data(),
              .host_cache = ContiguousKVView<const half>::packed(h_k.data(), h_v.data(), 1, p.kv_heads, p.capacity,
                                                                 p.head_dim, &p.length)},
             StateView<half>::packed(d_o.data(), d_lse.data(), 1, p.q_heads, p.head_dim), workspace.view(), split);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const SelectionView sel = step.selection(workspace.view());
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      const std::vector<std::int32_t> chosen(sel.row(0, g), sel.row(0, g) + sel.count(0, g));
      test::expect_top_k(chosen, test::middle_softmax(p, q, g), budget, 1e-5, fmt::format("step {} kv head {}", s, g));
    }
    test::HostState ref(1, p.q_heads, p.head_dim);
    reference::sparse_decode(QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim),
                             ContiguousKVView<const half>::packed(p.k.data(), p.v.data(), 1, p.kv_heads, p.capacity,
                                                                  p.head_dim, &p.length),
                             sel, ref.view, p.config().attention);
    test::expect_close<half>(d_o.download(), d_lse.download(), ref, fmt::format("step {} output", s));
    const StepStats& stats = step.last_step_stats();
    EXPECT_GT(stats.select_seconds, 0.0);
    EXPECT_GT(stats.cpu_attention_seconds, 0.0);
    // To the device: the CPU's state, and the update's new list of rho entries per kv head with its count.
    EXPECT_EQ(stats.to_device_bytes, std::size_t(p.q_heads) * (p.head_dim + 1) * sizeof(float) +
                                         std::size_t(p.kv_heads) * (std::size_t(p.middle()) + 1) * sizeof(std::int32_t));
  }
  // Ten updates cycled over columns 6 and 7 of the GPU's index: the prefill lists are as prepare left them.
  std::vector<std::int32_t> lists_after(lists_before.size()), cursors(std::size_t(p.kv_heads));
  const auto lists = step.selector().index_lists();
  KVSIFT_CUDA_CHECK(cudaMemcpy(lists_after.data(), lists.ids, lists_after.size() * 4, cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(cursors.data(), lists.cursors, cursors.size() * 4, cudaMemcpyDeviceToHost));
  for (const std::int32_t cursor : cursors) EXPECT_EQ(cursor, 6);
  for (std::int32_t g = 0; g < p.kv_heads; ++g) {
    const std::size_t first = std::size_t(g) * columns * std::size_t(p.middle());
    EXPECT_TRUE(std::equal(lists_before.begin() + first, lists_before.begin() + first + 6 * std::size_t(p.middle()),
                           lists_after.begin() + first));
    // The updates wrote lists of the query's top rho into the two spare columns.
    std::int32_t count = 0;
    KVSIFT_CUDA_CHECK(cudaMemcpy(&count, lists.counts + std::size_t(g) * columns + 7, 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(count, p.middle());
  }
}

// A step planned for more rows than the selector's slots, or for other heads, is refused by name (the GPU selector
// allocates its index when it is built: this runs on a GPU).
using CtkvrHybridRefusals = test::GpuTest;
TEST_F(CtkvrHybridRefusals, MismatchedShapesAreRefused) {
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 512, .q_heads = 8, .kv_heads = 2, .head_dim = 64};
  const DecodeStepConfig config{.attention = {.window = kCtkvrWindow}, .max_batch = 3, .q_heads = 8, .kv_heads = 2,
                                .head_dim = 64, .max_seq_len = 512};
  test::expect_error([&] { CtkvrSplitStep(CtkvrOnGpu(limits, {.budget = 16}), config, SplitContext{}); },
                     "shape.batch (= 3) is outside [1, limits.max_slots = 2]");
  DecodeStepConfig heads = config;
  heads.max_batch = 1;
  heads.q_heads = 16;
  test::expect_error([&] { CtkvrSplitStep(CtkvrOnGpu(limits, {.budget = 16}), heads, SplitContext{}); },
                     "shape heads/head_dim (16, 2, 64) != limits (8, 2, 64)");
}

}  // namespace
}  // namespace kvsift
