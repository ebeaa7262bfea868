// CTKVR on CUDA (selectors/ctkvr/ctkvr.hpp with cuda::Context) through a DecodeStep on a contiguous and a paged cache
// (pages scattered, the page table grown by the engine each step), against the fp64 reference of the CPU test
// (tests/ctkvr_problem.hpp): with C' = C and whole lists, every step's selection is the top of the softmax over the
// middle, max over the group, also after decoded tokens left the window and the dynamic update replaced lists;
// the index after prepare holds no window token; select + attend (with and without the update) replays from a
// CUDA graph; a non-finite prompt key is refused at prepare, as on the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

#include "ctkvr_problem.hpp"
#include "cuda/ctkvr_device_cache.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/ctkvr/ctkvr.hpp"
#include "kvsift/step/decode_step.hpp"
#include "selector_check.hpp"

namespace kvsift {
namespace {

using test::CtkvrDeviceCache;
using test::CtkvrProblem;
using test::DeviceBuffer;
using test::kCtkvrWindow;
using Selector = Ctkvr<half, cuda::Context>;

class CudaCtkvrGraph : public test::GpuTest {};

/// An index's lists on the host (ids, counts, cursors) for a selector of `kv_heads` heads, 8 columns, lists of 40:
/// what two runs that must build the same index are compared by.
std::tuple<std::vector<std::int32_t>, std::vector<std::int32_t>, std::vector<std::int32_t>> host_lists(
    const InvertedListsView<const float>& view, std::int32_t kv_heads) {
  const std::size_t n = std::size_t(kv_heads) * 8;
  std::vector<std::int32_t> ids(n * 40), counts(n), cursors(static_cast<std::size_t>(kv_heads));
  KVSIFT_CUDA_CHECK(cudaMemcpy(ids.data(), view.ids, ids.size() * 4, cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), view.counts, counts.size() * 4, cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(cursors.data(), view.cursors, cursors.size() * 4, cudaMemcpyDeviceToHost));
  return {ids, counts, cursors};
}
/// (group, paged, variant): variant 1 selects 5% of the current length (budget_fraction), pins the six prefill
/// centroids in eight columns, so the updates cycle over columns 6 and 7, and bounds the unindexed tokens at nine
/// (max_unindexed): the tenth step holds ten, and is served all the same, its candidates (the middle, once, plus ten)
/// fitting C' lists plus nine (the device's lengths are not checked on the host).
class CudaCtkvr : public test::GpuTest,
                  public ::testing::WithParamInterface<std::tuple<std::int32_t, bool, bool>> {};
INSTANTIATE_TEST_SUITE_P(GroupsAndLayouts, CudaCtkvr,
                         ::testing::Combine(::testing::Values(1, 4), ::testing::Values(false, true),
                                            ::testing::Values(false, true)));

TEST_P(CudaCtkvr, WholeListsGiveTheTopOfTheMiddleAtEveryStep) {
  SCOPED_TRACE(seed);
  const auto [group, paged, variant] = GetParam();
  CtkvrProblem p(rng, 2 * group, 2, 208, 16, 64);  // capacity 224: 14 pages; head_dim 64 (CUDA decode)
  CtkvrDeviceCache cache(p, paged, rng.engine);
  const cuda::Context ctx{};
  const std::int32_t budget = 24;
  // With C' = 6 of at most 8 columns, at least four whole prefill lists are recalled: the union is the middle.
  const double fraction = variant ? 0.05 : 0.0;
  const std::int32_t columns = variant ? 8 : 6;
  DecodeStep step(Selector(p.limits(), {.budget = budget, .list_size = p.middle(), .centroids = 6,
                                        .max_centroids = columns, .recalled_centroids = 6,
                                        .budget_fraction = fraction, .pin_prefill_centroids = variant,
                                        .max_unindexed = variant ? 9 : 0}),
                  p.config(), ctx);
  step.prepare(cache.prefill(p), ctx);
  const auto lists = step.selector().index_lists();
  const auto download = [](const std::int32_t* d, std::size_t n) {
    std::vector<std::int32_t> host(n);
    KVSIFT_CUDA_CHECK(cudaMemcpy(host.data(), d, n * 4, cudaMemcpyDeviceToHost));
    return host;
  };
  std::vector<std::int32_t> ids = download(lists.ids, std::size_t(p.kv_heads) * columns * p.middle());
  const std::vector<std::int32_t> counts = download(lists.counts, std::size_t(p.kv_heads) * columns);
  for (std::int32_t g = 0; g < p.kv_heads; ++g) {
    for (std::int32_t c = 0; c < 6; ++c) {
      const std::size_t l = std::size_t(g) * columns + std::size_t(c);
      EXPECT_EQ(counts[l], p.middle());
      for (std::int32_t i = 0; i < counts[l]; ++i) {
        const std::int32_t id = ids[l * std::size_t(p.middle()) + std::size_t(i)];
        EXPECT_TRUE(id >= kCtkvrWindow.sink && id < p.prompt - kCtkvrWindow.recent) << id;
      }
    }
  }

  DeviceBuffer<std::byte> workspace(step.workspace_bytes());
  DeviceBuffer<float> o(std::size_t(p.q_heads) * p.head_dim), lse(std::size_t(p.q_heads));
  DeviceBuffer<std::int32_t> selected(std::size_t(p.kv_heads) * budget), selected_counts(std::size_t(p.kv_heads));
  for (std::int32_t s = 0; s < 10; ++s) {
    ++p.length;
    cache.grow(p.length);
    const std::vector<half> q = test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim));
    const std::vector<half> nk = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
    const std::vector<half> nv = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
    for (std::int32_t h = 0; h < p.kv_heads; ++h) {  // the host mirror the reference reads
      std::copy_n(nk.begin() + std::size_t(h) * p.head_dim, p.head_dim,
                  p.k.begin() + (std::size_t(h) * p.capacity + p.length - 1) * p.head_dim);
    }
    DeviceBuffer<half> dq(q), dk(nk), dv(nv);
    step.run({.q = QueryView<const half>::packed(dq.data(), 1, p.q_heads, p.head_dim), .cache = cache.view(p),
              .k = HeadsView<const half>::packed(dk.data(), 1, p.kv_heads, p.head_dim),
              .v = HeadsView<const half>::packed(dv.data(), 1, p.kv_heads, p.head_dim), .slots = cache.slot.data()},
             StateView<float>::packed(o.data(), lse.data(), 1, p.q_heads, p.head_dim),
             {workspace.data(), workspace.size()}, ctx);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const SelectionView sel = step.selection({workspace.data(), workspace.size()}, 1);
    std::vector<std::int32_t> host_ids(std::size_t(p.kv_heads) * sel.capacity), host_counts(std::size_t(p.kv_heads));
    KVSIFT_CUDA_CHECK(cudaMemcpy(host_ids.data(), sel.indices, host_ids.size() * 4, cudaMemcpyDeviceToHost));
    KVSIFT_CUDA_CHECK(cudaMemcpy(host_counts.data(), sel.counts, host_counts.size() * 4, cudaMemcpyDeviceToHost));
    const std::int32_t k = variant ? std::min(budget, std::int32_t(fraction * p.length)) : budget;
    const std::vector<std::int32_t> unions = download(step.selector().last_union_sizes(), std::size_t(p.kv_heads));
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      ASSERT_GE(host_counts[g], 0) << "step " << s;
      const std::vector<std::int32_t> chosen(host_ids.begin() + std::size_t(g) * sel.capacity,
                                             host_ids.begin() + std::size_t(g) * sel.capacity + host_counts[g]);
      test::expect_top_k(chosen, test::middle_softmax(p, q, g), k, 1e-5, fmt::format("step {} kv head {}", s, g));
      if (s == 0) {
        EXPECT_EQ(unions[std::size_t(g)], p.middle()) << "the prefill lists' union, kv head " << g;
      }
    }
  }
  if (variant) {  // ten updates over columns 6 and 7: the cursors are back at 6, the prefill lists untouched
    for (const std::int32_t cursor : download(lists.cursors, std::size_t(p.kv_heads))) EXPECT_EQ(cursor, 6);
    const std::vector<std::int32_t> after = download(lists.ids, ids.size());
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      const std::size_t first = std::size_t(g) * columns * std::size_t(p.middle());
      EXPECT_TRUE(std::equal(ids.begin() + first, ids.begin() + first + 6 * std::size_t(p.middle()), after.begin() + first));
    }
  }
}

/// select + attend captured in a CUDA graph: replays give the eager step's selection. With the dynamic update (on
/// CUDA a parallel branch of the graph: select runs it on the selector's second stream) the index changes each step:
/// a second step, run eagerly from the same prompt, is the reference of each replay.
TEST_F(CudaCtkvrGraph, CaptureAndReplayEqualTheEagerStep) {
  SCOPED_TRACE(seed);
  for (const bool update : {false, true}) {
    SCOPED_TRACE(update ? "dynamic update" : "no update");
    CtkvrProblem p(rng, 8, 2, 208, 16, 64);
    CtkvrDeviceCache cache(p, false, rng.engine);
    DeviceBuffer<half> q(test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim)));
    const test::Stream stream;
    const cuda::Context ctx{stream};
    const auto make_step = [&] {
      DecodeStep step(Selector(p.limits(), {.budget = 16, .list_size = 40, .centroids = 6, .max_centroids = 8,
                                            .recalled_centroids = 3, .dynamic_update = update}),
                      p.config(), ctx);
      step.prepare(cache.prefill(p), ctx);
      return step;
    };
    auto step = make_step(), reference = make_step();
    DeviceBuffer<std::byte> workspace(step.workspace_bytes()), reference_workspace(reference.workspace_bytes());
    DeviceBuffer<float> o(std::size_t(p.q_heads) * p.head_dim), lse(std::size_t(p.q_heads));
    DeviceBuffer<float> reference_o(o.size()), reference_lse(lse.size());
    const auto run = [&](auto& s, DeviceBuffer<std::byte>& ws, DeviceBuffer<float>& out, DeviceBuffer<float>& out_lse) {
      s.run({.q = QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim), .cache = cache.view(p),
             .slots = cache.slot.data()},
            StateView<float>::packed(out.data(), out_lse.data(), 1, p.q_heads, p.head_dim), {ws.data(), ws.size()}, ctx);
    };
    const auto selection = [&](auto& s, DeviceBuffer<std::byte>& ws) {
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const SelectionView sel = s.selection({ws.data(), ws.size()}, 1);
      std::vector<std::int32_t> ids(std::size_t(p.kv_heads) * sel.capacity), counts(std::size_t(p.kv_heads));
      KVSIFT_CUDA_CHECK(cudaMemcpy(ids.data(), sel.indices, ids.size() * 4, cudaMemcpyDeviceToHost));
      KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), sel.counts, counts.size() * 4, cudaMemcpyDeviceToHost));
      std::vector<std::vector<std::int32_t>> rows;
      for (std::int32_t g = 0; g < p.kv_heads; ++g) {
        EXPECT_GT(counts[g], 0);
        rows.emplace_back(ids.begin() + std::size_t(g) * sel.capacity, ids.begin() + std::size_t(g) * sel.capacity + std::max(counts[g], 0));
      }
      return rows;
    };
    run(step, workspace, o, lse);
    run(reference, reference_workspace, reference_o, reference_lse);
    ASSERT_EQ(selection(step, workspace), selection(reference, reference_workspace));
    const test::CapturedGraph graph(stream, [&] { run(step, workspace, o, lse); }, cudaStreamCaptureModeGlobal);
    for (int replay = 0; replay < 4; ++replay) {
      workspace.poison();
      reference_workspace.poison();
      o.poison();
      reference_o.poison();
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      graph.launch();
      run(reference, reference_workspace, reference_o, reference_lse);
      EXPECT_EQ(selection(step, workspace), selection(reference, reference_workspace)) << "replay " << replay;
      EXPECT_EQ(o.download(), reference_o.download()) << "replay " << replay;
    }
    if (update) {  // the index both steps built: four updates beside their selections
      EXPECT_EQ(host_lists(step.selector().index_lists(), p.kv_heads),
                host_lists(reference.selector().index_lists(), p.kv_heads));
    }
  }
}

/// SelectInputs::defer_beside: a select that leaves its index update running (joined by the next select, or by
/// join_beside) selects what a select that joins it does, step after step, and builds the same index; its update
/// writes nothing the selection of its own step reads.
TEST_F(CudaCtkvrGraph, DeferredUpdatesEqualJoinedOnes) {
  SCOPED_TRACE(seed);
  CtkvrProblem p(rng, 8, 2, 208, 16, 64);
  CtkvrDeviceCache cache(p, false, rng.engine);
  const test::Stream stream;
  const cuda::Context ctx{stream};
  const auto make = [&] {
    Selector s(p.limits(), {.budget = 16, .list_size = 40, .centroids = 6, .max_centroids = 8, .recalled_centroids = 3});
    s.prepare(cache.prefill(p), ctx);
    return s;
  };
  Selector deferring = make(), joining = make();
  const SelectShape shape{.batch = 1, .q_heads = p.q_heads, .kv_heads = p.kv_heads, .head_dim = p.head_dim};
  DeviceBuffer<std::byte> ws_a(deferring.select_workspace_bytes(shape, ctx)), ws_b(joining.select_workspace_bytes(shape, ctx));
  DeviceBuffer<std::int32_t> out_a(std::size_t(p.kv_heads) * 16), counts_a(std::size_t(p.kv_heads));
  DeviceBuffer<std::int32_t> out_b(out_a.size()), counts_b(counts_a.size());
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE(testing::Message() << "step " << step);
    ++p.length;
    cache.grow(p.length);
    DeviceBuffer<half> q(test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim)));
    SelectInputs<half> in{.q = QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim), .cache = cache.view(p),
                          .slots = cache.slot.data(), .lengths = cache.length.data(), .attention = {.window = kCtkvrWindow}};
    for (auto* buffer : {&out_a, &counts_a, &out_b, &counts_b}) buffer->poison();
    ws_a.poison();
    ws_b.poison();
    in.defer_beside = true;
    deferring.select(in, {out_a.data(), counts_a.data(), nullptr, 1, p.kv_heads, 16}, {ws_a.data(), ws_a.size()}, ctx);
    in.defer_beside = false;
    joining.select(in, {out_b.data(), counts_b.data(), nullptr, 1, p.kv_heads, 16}, {ws_b.data(), ws_b.size()}, ctx);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(counts_a.download(), counts_b.download());
    EXPECT_EQ(out_a.download(), out_b.download());
  }
  deferring.join_beside(ctx);
  deferring.join_beside(ctx);  // nothing pending: nothing
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(host_lists(deferring.index_lists(), p.kv_heads), host_lists(joining.index_lists(), p.kv_heads));
}

/// A NaN prompt key (kv head 1, token 101, channel 7: in the middle) is refused at prepare by its position and
/// value, with a later inf of the same head and a NaN past the prompt (not a key) beside it, contiguous and paged;
/// the slot stays unprepared. The same prompt made finite prepares.
class CudaCtkvrPrompt : public test::GpuTest {};
TEST_F(CudaCtkvrPrompt, ANonFinitePromptKeyIsRefusedAtPrepare) {
  SCOPED_TRACE(seed);
  for (const bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "contiguous");
    CtkvrProblem p(rng, 4, 2, 208, 16, 64);
    const auto key = [&](std::int32_t h, std::int32_t t, std::int32_t i) -> half& {
      return p.k[(std::size_t(h) * p.capacity + std::size_t(t)) * p.head_dim + std::size_t(i)];
    };
    const std::vector<half> finite = p.k;
    key(1, 101, 7) = from_float<half>(std::numeric_limits<float>::quiet_NaN());
    key(1, 150, 0) = from_float<half>(std::numeric_limits<float>::infinity());
    key(0, 210, 3) = from_float<half>(std::numeric_limits<float>::quiet_NaN());  // past the prompt's 208 tokens
    const cuda::Context ctx{};
    DecodeStep step(Selector(p.limits(), {.budget = 16, .list_size = 40, .centroids = 6, .max_centroids = 8,
                                          .recalled_centroids = 3}),
                    p.config(), ctx);
    const auto prepare = [&](const CtkvrDeviceCache& cache) {
      step.prepare(cache.prefill(p), ctx);
    };
    {
      CtkvrDeviceCache cache(p, paged, rng.engine);
      test::expect_error([&] { prepare(cache); },
                         {"Ctkvr::prepare: the prompt's keys hold a non-finite value at sequence 0, kv head 1, token "
                          "101, channel 7 (= nan): NaN and inf are refused rather than indexed"});
      EXPECT_FALSE(step.selector().prepared(0)) << "a refused prepare prepares nothing";
    }
    p.k = finite;
    key(0, 210, 3) = from_float<half>(std::numeric_limits<float>::quiet_NaN());
    CtkvrDeviceCache cache(p, paged, rng.engine);
    prepare(cache);
    EXPECT_TRUE(step.selector().prepared(0));
  }
}

}  // namespace
}  // namespace kvsift
