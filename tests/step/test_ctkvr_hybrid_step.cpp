// CTKVR in the paper's hybrid placement (selectors/ctkvr/hybrid_step.hpp): index and recall on the GPU, rerank and the
// selection's attention on the CPU over a pinned host cache, the window on the GPU, merged on the GPU. Against
// fp64 references written from the contract (tests/ctkvr_problem.hpp): with C' = C and whole lists, every step's
// host selection is the top of the softmax over the middle, max over the group, also after decoded tokens left the
// window and the dynamic update (computed on the CPU, applied to the GPU's index) replaced lists; the output is
// the reference attention over window and selection; the pinned prefill centroids' lists survive on the GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_check.hpp"
#include "ctkvr_problem.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/selectors/ctkvr/hybrid_step.hpp"
#include "selector_check.hpp"

namespace kvsift {
namespace {

using test::CtkvrProblem;
using test::DeviceBuffer;
using test::kCtkvrWindow;
using test::PinnedBuffer;

class CtkvrHybrid : public test::GpuTest, public ::testing::WithParamInterface<std::int32_t> {};
INSTANTIATE_TEST_SUITE_P(Groups, CtkvrHybrid, ::testing::Values(1, 4));

TEST_P(CtkvrHybrid, SelectionsAndOutputsFollowTheReferenceAtEveryStep) {
  SCOPED_TRACE(seed);
  const std::int32_t group = GetParam();
  CtkvrProblem p(rng, 2 * group, 2, 208, 16, 64);
  cpu::ThreadPool pool(2);
  const std::int32_t budget = 24, columns = 8;
  // Six whole prefill lists pinned in eight columns: with C' = 6, at least four whole lists are recalled.
  CtkvrHybridStep<half> step(p.limits(),
                             {.budget = budget, .list_size = p.middle(), .centroids = 6, .max_centroids = columns,
                              .recalled_centroids = 6, .pin_prefill_centroids = true},
                             p.config(), &pool);
  DeviceBuffer<half> d_k(p.k), d_v(p.v), d_queries(p.prefill_q);
  DeviceBuffer<std::int32_t> d_length(std::vector<std::int32_t>{p.length}), d_slot(std::vector<std::int32_t>{0});
  const auto device_cache = [&] {
    return ContiguousKVView<const half>::packed(d_k.data(), d_v.data(), 1, p.kv_heads, p.capacity, p.head_dim,
                                                d_length.data());
  };
  step.prepare({.cache = device_cache(), .slots = d_slot.data(),
                .queries = SequenceView<const half>::packed(d_queries.data(), 1, p.q_heads, p.queries, p.head_dim)},
               {});
  PinnedBuffer<half> h_k(p.k), h_v(p.v);
  const std::vector<std::int32_t> lists_before(
      [&] {
        std::vector<std::int32_t> ids(std::size_t(p.kv_heads) * columns * p.middle());
        KVSIFT_CUDA_CHECK(cudaMemcpy(ids.data(), step.index().index_lists().ids, ids.size() * 4, cudaMemcpyDeviceToHost));
        return ids;
      }());

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
    }
    d_k.upload(p.k);
    d_v.upload(p.v);
    d_length.upload({p.length});
    DeviceBuffer<half> d_q(q);
    d_o.poison();
    d_lse.poison();
    const std::int32_t slot = 0;
    step.run({.q_device = QueryView<const half>::packed(d_q.data(), 1, p.q_heads, p.head_dim),
              .q_host = QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim),
              .device_cache = device_cache(),
              .host_cache = ContiguousKVView<const half>::packed(h_k.data(), h_v.data(), 1, p.kv_heads, p.capacity,
                                                                 p.head_dim, &p.length),
              .slots = &slot},
             StateView<half>::packed(d_o.data(), d_lse.data(), 1, p.q_heads, p.head_dim), nullptr, {&pool});
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const SelectionView sel = step.selection();
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
    const auto& times = step.last_step_times();
    EXPECT_GT(times.recall, 0.0);
    EXPECT_GT(times.rerank, 0.0);
  }
  // Ten updates cycled over columns 6 and 7 of the GPU's index: the prefill lists are as prepare left them.
  std::vector<std::int32_t> lists_after(lists_before.size()), cursors(std::size_t(p.kv_heads));
  const auto lists = step.index().index_lists();
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

TEST(CtkvrHybridBadInput, MismatchedShapesAreRefused) {
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 512, .q_heads = 8, .kv_heads = 2, .head_dim = 64};
  const DecodeStepConfig config{.attention = {.window = kCtkvrWindow}, .max_batch = 3, .q_heads = 8, .kv_heads = 2,
                                .head_dim = 64, .max_seq_len = 512};
  test::expect_error([&] { CtkvrHybridStep<half>(limits, {.budget = 16}, config); },
                     "kvsift::CtkvrHybridStep: config.max_batch (= 3) is outside [1, limits.max_slots = 2]");
  DecodeStepConfig heads = config;
  heads.max_batch = 1;
  heads.q_heads = 16;
  test::expect_error([&] { CtkvrHybridStep<half>(limits, {.budget = 16}, heads); },
                     "config's heads and head_dim (16, 2, 64) differ from the selector limits' (8, 2, 64)");
}

}  // namespace
}  // namespace kvsift
