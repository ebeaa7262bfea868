// CSAttention on CUDA (selectors/csattention/csattention.hpp with cuda::Context) against its CPU twin, in lockstep through a
// DecodeStep each: after prepare the tables are equal (the k-means, the lists, bit for bit), and at every decode
// step, appends included, the selections and the overlays are equal; contiguous and paged caches, GQA and not,
// both reductions, both table modes, the search period. select + attend + append replay from a CUDA graph while
// the engine advances the length, and equal the CPU's eager steps. A base file saved on either backend is the
// same bytes, loads on the other, and the loaded selectors decode as the CPU twin does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <tuple>
#include <vector>

#include "ctkvr_problem.hpp"
#include "cuda/ctkvr_device_cache.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/csattention/csattention.hpp"
#include "kvsift/step/decode_step.hpp"
#include "score_table_contents.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::CtkvrDeviceCache;
using test::CtkvrProblem;
using test::DeviceBuffer;
using CpuSelector = Csattention<half, cpu::Context>;
using CudaSelector = Csattention<half, cuda::Context>;

template <class V>
std::vector<V> download(const V* d, std::size_t n) {
  std::vector<V> host(n);
  KVSIFT_CUDA_CHECK(cudaMemcpy(host.data(), d, n * sizeof(V), cudaMemcpyDeviceToHost));
  return host;
}

/// The tables of both selectors are equal: centroids, base lists, and each slot's overlay.
void expect_equal_tables(const ScoreTablesView<const std::int32_t>& cpu, const ScoreTablesView<const std::int32_t>& gpu,
                         const std::string& when) {
  const std::size_t lists = ScoreTablesView<std::int32_t>::list_count(cpu.slots, cpu.table_heads, cpu.subspaces,
                                                                       cpu.centroids_per_subspace);
  const auto same = [&](const auto* host, const auto* device, std::size_t n, const char* what) {
    const auto got = download(device, n);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::memcmp(&host[i], &got[i], sizeof(got[i])), 0) << when << ": " << what << " differ at " << i;
    }
  };
  same(cpu.centroids, gpu.centroids,
       ScoreTablesView<std::int32_t>::centroid_elements(cpu.bases, cpu.table_heads, cpu.subspaces,
                                                         cpu.centroids_per_subspace, cpu.width),
       "centroids");
  same(cpu.base_counts, gpu.base_counts, lists, "base counts");
  same(cpu.base_ids, gpu.base_ids, lists * std::size_t(cpu.length), "base ids");
  same(cpu.base_scores, gpu.base_scores, lists * std::size_t(cpu.length), "base scores");
  same(cpu.evicted, gpu.evicted, lists, "evictions");
  same(cpu.overlay_sizes, gpu.overlay_sizes, lists, "overlay sizes");
  same(cpu.overlay_ids, gpu.overlay_ids, lists * std::size_t(cpu.overlay_capacity), "overlay ids");
}

/// (group, paged, variant): variant 0 the defaults (dense, tables per kv head); 1 the sort reduction with tables
/// per query head; 2 the paper's sums (no weights, no floor) searching every 4 steps.
class CudaCsattention : public test::GpuTest,
                        public ::testing::WithParamInterface<std::tuple<std::int32_t, bool, int>> {};
INSTANTIATE_TEST_SUITE_P(Variants, CudaCsattention,
                         ::testing::Combine(::testing::Values(1, 4), ::testing::Values(false, true),
                                            ::testing::Values(0, 1, 2)));

CsattentionConfig variant_config(int variant) {
  CsattentionConfig c{.centroids = 6, .list_fraction = 0.25, .keep_fraction = 0.2, .overlay_capacity = 64,
                      .prepare_chunk = 20};
  if (variant == 1) {
    c.reduce = CsattentionReduce::sort;
    c.tables = CsattentionTables::per_query_head;
  }
  if (variant == 2) {
    c.weight_by_norm = c.from_floor = false;
    c.search_period = 4;
  }
  return c;
}

TEST_P(CudaCsattention, TablesSelectionsAndInsertsEqualTheCpus) {
  SCOPED_TRACE(seed);
  const auto [group, paged, variant] = GetParam();
  CtkvrProblem p(rng, 2 * group, 2, 208, 16, 64);  // capacity 224: 14 pages; head_dim 64 (CUDA decode)
  CtkvrDeviceCache cache(p, paged, rng.engine);
  const cuda::Context ctx{};
  const CsattentionConfig config = variant_config(variant);
  DecodeStep gpu(CudaSelector(p.limits(), config), p.config(), ctx);
  DecodeStep cpu(CpuSelector(p.limits(), config), p.config(), {});
  gpu.prepare(cache.prefill(p), ctx);
  cpu.prepare(p.prefill(), {});
  expect_equal_tables(cpu.selector().index_tables(), gpu.selector().index_tables(), "after prepare");

  DeviceBuffer<std::byte> workspace(gpu.workspace_bytes());
  cpu::Array<std::byte> host_workspace(cpu.workspace_bytes());
  DeviceBuffer<float> o(std::size_t(p.q_heads) * p.head_dim), lse(std::size_t(p.q_heads));
  std::vector<float> host_o(std::size_t(p.q_heads) * p.head_dim), host_lse(std::size_t(p.q_heads));
  for (std::int32_t s = 0; s < 10; ++s) {
    const std::vector<half> q = test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim));
    const std::vector<half> nk = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
    const std::vector<half> nv = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
    ++p.length;
    cache.grow(p.length);
    DeviceBuffer<half> dq(q), dk(nk), dv(nv);
    workspace.poison();
    gpu.run({.q = QueryView<const half>::packed(dq.data(), 1, p.q_heads, p.head_dim), .cache = cache.view(p),
             .k = HeadsView<const half>::packed(dk.data(), 1, p.kv_heads, p.head_dim),
             .v = HeadsView<const half>::packed(dv.data(), 1, p.kv_heads, p.head_dim), .slots = cache.slot.data()},
            StateView<float>::packed(o.data(), lse.data(), 1, p.q_heads, p.head_dim),
            {workspace.data(), workspace.size()}, ctx);
    std::memset(host_workspace.data(), 0xff, host_workspace.size());
    cpu.run({.q = QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim), .cache = p.cache(),
             .k = HeadsView<const half>::packed(nk.data(), 1, p.kv_heads, p.head_dim),
             .v = HeadsView<const half>::packed(nv.data(), 1, p.kv_heads, p.head_dim), .slots = &p.slot},
            StateView<float>::packed(host_o.data(), host_lse.data(), 1, p.q_heads, p.head_dim), host_workspace.bytes(),
            {});
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    const SelectionView want = cpu.selection(host_workspace.bytes(), 1);
    const SelectionView got = gpu.selection({workspace.data(), workspace.size()}, 1);
    const auto ids = download(got.indices, std::size_t(p.kv_heads) * got.capacity);
    const auto counts = download(got.counts, std::size_t(p.kv_heads));
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      ASSERT_EQ(counts[std::size_t(g)], want.count(0, g)) << "step " << s << " kv head " << g;
      EXPECT_TRUE(std::equal(want.row(0, g), want.row(0, g) + want.count(0, g), ids.begin() + std::size_t(g) * got.capacity))
          << "step " << s << " kv head " << g;
    }
    expect_equal_tables(cpu.selector().index_tables(), gpu.selector().index_tables(), fmt::format("step {}", s));
  }
}

/// The step (KV write, append, select, attend) captured once and replayed while the engine advances the length:
/// every replay's selection equals the CPU twin's eager step on the same token.
class CudaCsattentionGraph : public test::GpuTest {};
TEST_F(CudaCsattentionGraph, ReplaysWithAdvancingLengthsEqualTheCpusSteps) {
  SCOPED_TRACE(seed);
  CtkvrProblem p(rng, 8, 2, 208, 16, 64);
  CtkvrDeviceCache cache(p, false, rng.engine);
  const test::Stream stream;
  const cuda::Context ctx{stream};
  const CsattentionConfig config = variant_config(0);
  DecodeStep gpu(CudaSelector(p.limits(), config), p.config(), ctx);
  DecodeStep cpu(CpuSelector(p.limits(), config), p.config(), {});
  gpu.prepare(cache.prefill(p), ctx);
  cpu.prepare(p.prefill(), {});
  DeviceBuffer<std::byte> workspace(gpu.workspace_bytes());
  cpu::Array<std::byte> host_workspace(cpu.workspace_bytes());
  DeviceBuffer<half> dq(std::size_t(p.q_heads) * p.head_dim), dk(std::size_t(p.kv_heads) * p.head_dim),
      dv(std::size_t(p.kv_heads) * p.head_dim);
  DeviceBuffer<float> o(std::size_t(p.q_heads) * p.head_dim), lse(std::size_t(p.q_heads));
  std::vector<float> host_o(o.size()), host_lse(lse.size());
  const auto run = [&] {
    gpu.run({.q = QueryView<const half>::packed(dq.data(), 1, p.q_heads, p.head_dim), .cache = cache.view(p),
             .k = HeadsView<const half>::packed(dk.data(), 1, p.kv_heads, p.head_dim),
             .v = HeadsView<const half>::packed(dv.data(), 1, p.kv_heads, p.head_dim), .slots = cache.slot.data()},
            StateView<float>::packed(o.data(), lse.data(), 1, p.q_heads, p.head_dim),
            {workspace.data(), workspace.size()}, ctx);
  };
  const test::CapturedGraph graph(stream, run, cudaStreamCaptureModeGlobal);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (std::int32_t s = 0; s < 6; ++s) {
    const std::vector<half> q = test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim));
    const std::vector<half> nk = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
    const std::vector<half> nv = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
    ++p.length;
    cache.grow(p.length);
    dq.upload(q);
    dk.upload(nk);
    dv.upload(nv);
    workspace.poison();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    graph.launch();
    cpu.run({.q = QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim), .cache = p.cache(),
             .k = HeadsView<const half>::packed(nk.data(), 1, p.kv_heads, p.head_dim),
             .v = HeadsView<const half>::packed(nv.data(), 1, p.kv_heads, p.head_dim), .slots = &p.slot},
            StateView<float>::packed(host_o.data(), host_lse.data(), 1, p.q_heads, p.head_dim), host_workspace.bytes(),
            {});
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const SelectionView want = cpu.selection(host_workspace.bytes(), 1);
    const SelectionView got = gpu.selection({workspace.data(), workspace.size()}, 1);
    const auto ids = download(got.indices, std::size_t(p.kv_heads) * got.capacity);
    const auto counts = download(got.counts, std::size_t(p.kv_heads));
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      ASSERT_EQ(counts[std::size_t(g)], want.count(0, g)) << "replay " << s << " kv head " << g;
      EXPECT_TRUE(std::equal(want.row(0, g), want.row(0, g) + want.count(0, g), ids.begin() + std::size_t(g) * got.capacity))
          << "replay " << s << " kv head " << g;
    }
  }
}

/// A CUDA selector's tables copied to the host, with a host view over them.
struct HostTables {
  std::vector<float> centroids;
  std::vector<std::int32_t> base_ids, base_counts, slot_base, evicted, overlay_ids, overlay_sizes;
  std::vector<half> base_scores, overlay_scores;
  ScoreTablesView<const std::int32_t> view;

  explicit HostTables(const ScoreTablesView<const std::int32_t>& d) : view(d) {
    const auto lists = [&](std::int32_t owners) {
      return ScoreTablesView<std::int32_t>::list_count(owners, d.table_heads, d.subspaces, d.centroids_per_subspace);
    };
    centroids = download(d.centroids, lists(d.bases) * std::size_t(d.width));
    base_ids = download(d.base_ids, lists(d.bases) * std::size_t(d.length));
    base_scores = download(d.base_scores, lists(d.bases) * std::size_t(d.length));
    base_counts = download(d.base_counts, lists(d.bases));
    slot_base = download(d.slot_base, std::size_t(d.slots));
    evicted = download(d.evicted, lists(d.slots));
    overlay_ids = download(d.overlay_ids, lists(d.slots) * std::size_t(d.overlay_capacity));
    overlay_scores = download(d.overlay_scores, lists(d.slots) * std::size_t(d.overlay_capacity));
    overlay_sizes = download(d.overlay_sizes, lists(d.slots));
    view.centroids = centroids.data();
    view.base_ids = base_ids.data();
    view.base_scores = base_scores.data();
    view.base_counts = base_counts.data();
    view.slot_base = slot_base.data();
    view.evicted = evicted.data();
    view.overlay_ids = overlay_ids.data();
    view.overlay_scores = overlay_scores.data();
    view.overlay_sizes = overlay_sizes.data();
  }
};

std::string saved(const auto& selector, const auto& ctx) {
  std::ostringstream out(std::ios::binary);
  selector.save_base(0, out, ctx);
  return out.str();
}

/// Each variant: the CUDA selector and its CPU twin prepared from one prompt save the same bytes; the GPU's file
/// loads into a CPU selector and the CPU's into a CUDA one (slot 0), and at every decode step the three CPU-visible
/// indexes (the twin's, the CPU-loaded one's, the GPU-loaded one's) and their selections are equal.
class CudaCsattentionFiles : public test::GpuTest {};
TEST_F(CudaCsattentionFiles, ABaseSavedOnOneBackendLoadsOnTheOtherAndDecodesTheSame) {
  SCOPED_TRACE(seed);
  for (const int variant : {0, 1, 2}) {
    SCOPED_TRACE(variant);
    CtkvrProblem p(rng, 8, 2, 208, 16, 64);
    CtkvrDeviceCache cache(p, false, rng.engine);
    const cuda::Context ctx{};
    const CsattentionConfig config = variant_config(variant);
    DecodeStep gpu(CudaSelector(p.limits(), config), p.config(), ctx);
    DecodeStep twin(CpuSelector(p.limits(), config), p.config(), {});
    gpu.prepare(cache.prefill(p), ctx);
    twin.prepare(p.prefill(), {});
    const std::string gpu_file = saved(gpu.selector(), ctx), cpu_file = saved(twin.selector(), cpu::Context{});
    ASSERT_EQ(gpu_file, cpu_file) << "the backends' base files differ";

    const std::vector<std::int32_t> slot0{0};
    DecodeStep on_cpu(CpuSelector(p.limits(), config), p.config(), {});
    DecodeStep on_gpu(CudaSelector(p.limits(), config), p.config(), ctx);
    std::istringstream from_gpu(gpu_file, std::ios::binary), from_cpu(cpu_file, std::ios::binary);
    on_cpu.selector().load_base(from_gpu, slot0, {});
    on_gpu.selector().load_base(from_cpu, slot0, ctx);
    test::expect_same_slot(on_cpu.selector().index_tables(), 0, twin.selector().index_tables(), 0, "CPU after load");
    test::expect_same_slot(HostTables(on_gpu.selector().index_tables()).view, 0, twin.selector().index_tables(), 0,
                           "GPU after load");
    EXPECT_EQ(saved(on_gpu.selector(), ctx), cpu_file) << "the GPU-loaded base saves to other bytes";

    CtkvrProblem q = p;  // the CPU-loaded selector's cache
    DeviceBuffer<std::byte> workspace(on_gpu.workspace_bytes());
    cpu::Array<std::byte> twin_workspace(twin.workspace_bytes()), cpu_workspace(on_cpu.workspace_bytes());
    DeviceBuffer<float> o(std::size_t(p.q_heads) * p.head_dim), lse(std::size_t(p.q_heads));
    std::vector<float> host_o(std::size_t(p.q_heads) * p.head_dim), host_lse(std::size_t(p.q_heads));
    const auto cpu_run = [&](auto& step, CtkvrProblem& problem, cpu::Array<std::byte>& ws, const std::vector<half>& qv,
                             const std::vector<half>& kv, const std::vector<half>& vv) {
      std::memset(ws.data(), 0xff, ws.size());
      step.run({.q = QueryView<const half>::packed(qv.data(), 1, p.q_heads, p.head_dim), .cache = problem.cache(),
                .k = HeadsView<const half>::packed(kv.data(), 1, p.kv_heads, p.head_dim),
                .v = HeadsView<const half>::packed(vv.data(), 1, p.kv_heads, p.head_dim), .slots = &problem.slot},
               StateView<float>::packed(host_o.data(), host_lse.data(), 1, p.q_heads, p.head_dim), ws.bytes(), {});
      return step.selection(ws.bytes(), 1);
    };
    for (std::int32_t s = 0; s < 8; ++s) {
      const std::vector<half> qv = test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim));
      const std::vector<half> kv = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
      const std::vector<half> vv = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
      ++p.length;
      ++q.length;
      cache.grow(p.length);
      DeviceBuffer<half> dq(qv), dk(kv), dv(vv);
      workspace.poison();
      on_gpu.run({.q = QueryView<const half>::packed(dq.data(), 1, p.q_heads, p.head_dim), .cache = cache.view(p),
                  .k = HeadsView<const half>::packed(dk.data(), 1, p.kv_heads, p.head_dim),
                  .v = HeadsView<const half>::packed(dv.data(), 1, p.kv_heads, p.head_dim), .slots = cache.slot.data()},
                 StateView<float>::packed(o.data(), lse.data(), 1, p.q_heads, p.head_dim),
                 {workspace.data(), workspace.size()}, ctx);
      const SelectionView want = cpu_run(twin, p, twin_workspace, qv, kv, vv);
      const SelectionView loaded = cpu_run(on_cpu, q, cpu_workspace, qv, kv, vv);
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
      const SelectionView got = on_gpu.selection({workspace.data(), workspace.size()}, 1);
      const auto ids = download(got.indices, std::size_t(p.kv_heads) * got.capacity);
      const auto counts = download(got.counts, std::size_t(p.kv_heads));
      for (std::int32_t g = 0; g < p.kv_heads; ++g) {
        const std::vector<std::int32_t> row(want.row(0, g), want.row(0, g) + want.count(0, g));
        EXPECT_EQ(std::vector<std::int32_t>(loaded.row(0, g), loaded.row(0, g) + loaded.count(0, g)), row)
            << "CPU-loaded, step " << s << " kv head " << g;
        ASSERT_EQ(counts[std::size_t(g)], want.count(0, g)) << "GPU-loaded, step " << s << " kv head " << g;
        EXPECT_TRUE(std::equal(row.begin(), row.end(), ids.begin() + std::size_t(g) * got.capacity))
            << "GPU-loaded, step " << s << " kv head " << g;
      }
      test::expect_same_slot(on_cpu.selector().index_tables(), 0, twin.selector().index_tables(), 0,
                             fmt::format("CPU-loaded, step {}", s));
      test::expect_same_slot(HostTables(on_gpu.selector().index_tables()).view, 0, twin.selector().index_tables(), 0,
                             fmt::format("GPU-loaded, step {}", s));
    }
  }
}

/// The dense reduction's token order bounds a CUDA selector's max_tokens (its ranges counted in a CTA's shared
/// memory): refused at construction, before any allocation (no GPU needed); the sort reduction keeps no token order.
TEST(CudaCsattentionLimits, DenseRefusesMaxTokensPastTheTokenOrder) {
  const SelectorLimits limits{.max_slots = 1, .max_tokens = kMaxTableTokenRanges * kTableTokenRange + 1, .q_heads = 8,
                              .kv_heads = 2, .head_dim = 64};
  test::expect_error([&] { Csattention<half, cuda::Context> selector(limits, CsattentionConfig{}); },
                     {"Csattention", "limits.max_tokens (= 12582913) is above the dense reduction's 12582912 tokens"});
}

}  // namespace
}  // namespace kvsift
