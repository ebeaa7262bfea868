// CSAttention on CUDA (selectors/csattention.hpp with cuda::Context) against its CPU twin, in lockstep through a
// DecodeStep each: after prepare the tables are equal (the k-means, the lists, bit for bit), and at every decode
// step, appends included, the selections and the overlays are equal; contiguous and paged caches, GQA and not,
// both reductions, both table modes, the search period. select + attend + append replay from a CUDA graph while
// the engine advances the length, and equal the CPU's eager steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "ctkvr_problem.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/csattention.hpp"
#include "kvsift/step/decode_step.hpp"

namespace kvsift {
namespace {

using test::CtkvrProblem;
using test::DeviceBuffer;
using CpuSelector = Csattention<half, cpu::Context>;
using CudaSelector = Csattention<half, cuda::Context>;

constexpr std::int32_t kPage = 16;

template <class V>
std::vector<V> download(const V* d, std::size_t n) {
  std::vector<V> host(n);
  KVSIFT_CUDA_CHECK(cudaMemcpy(host.data(), d, n * sizeof(V), cudaMemcpyDeviceToHost));
  return host;
}

/// The problem's cache on the device, contiguous or in shuffled NHD pages; write() mirrors a new token.
struct DeviceCache {
  bool paged;
  std::int32_t pages;
  DeviceBuffer<half> k, v;
  DeviceBuffer<std::int32_t> length, indptr, indices, last;
  std::vector<std::int32_t> order;

  DeviceCache(const CtkvrProblem& p, bool paged_, std::mt19937_64& engine)
      : paged(paged_), pages(p.capacity / kPage), k(p.k.size()), v(p.v.size()), length(1), indptr(2),
        indices(std::size_t(p.capacity / kPage)), last(1), order(std::size_t(p.capacity / kPage)) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), engine);
    indices.upload(order);
    upload(p);
  }
  void upload(const CtkvrProblem& p) {
    std::vector<half> k_host(p.k.size()), v_host(p.v.size());
    for (std::int32_t h = 0; h < p.kv_heads; ++h) {
      for (std::int32_t t = 0; t < p.capacity; ++t) {
        const std::size_t from = (std::size_t(h) * p.capacity + t) * p.head_dim;
        const std::size_t to =
            paged ? ((std::size_t(order[t / kPage]) * kPage + t % kPage) * p.kv_heads + h) * p.head_dim : from;
        std::copy_n(p.k.begin() + from, p.head_dim, k_host.begin() + to);
        std::copy_n(p.v.begin() + from, p.head_dim, v_host.begin() + to);
      }
    }
    k.upload(k_host);
    v.upload(v_host);
  }
  void grow(std::int32_t len) {
    length.upload({len});
    const std::int32_t used = (len + kPage - 1) / kPage;
    indptr.upload({0, used});
    last.upload({len - (used - 1) * kPage});
  }
  KVCache<half> view(const CtkvrProblem& p) const {
    if (!paged) {
      return ContiguousKVView<half>::packed(k.data(), v.data(), 1, p.kv_heads, p.capacity, p.head_dim, length.data());
    }
    return PagedKVView<half>{.k_pages = k.data(), .v_pages = v.data(), .page_indptr = indptr.data(),
                             .page_indices = indices.data(), .last_page_len = last.data(), .batch = 1,
                             .kv_heads = p.kv_heads, .head_dim = p.head_dim, .page_size = kPage, .num_pages = pages,
                             .page_stride = std::int64_t(kPage) * p.kv_heads * p.head_dim,
                             .token_stride = std::int64_t(p.kv_heads) * p.head_dim, .head_stride = p.head_dim};
  }
};

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
  DeviceCache cache(p, paged, rng.engine);
  cache.grow(p.length);
  DeviceBuffer<half> queries(p.prefill_q);
  DeviceBuffer<std::int32_t> slot(std::vector<std::int32_t>{0});
  const cuda::Context ctx{};
  const CsattentionConfig config = variant_config(variant);
  DecodeStep gpu(CudaSelector(p.limits(), config), p.config(), ctx);
  DecodeStep cpu(CpuSelector(p.limits(), config), p.config(), {});
  gpu.prepare({.cache = cache.view(p), .slots = slot.data(),
               .queries = SequenceView<const half>::packed(queries.data(), 1, p.q_heads, p.queries, p.head_dim)},
              ctx);
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
             .v = HeadsView<const half>::packed(dv.data(), 1, p.kv_heads, p.head_dim), .slots = slot.data()},
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
  DeviceCache cache(p, false, rng.engine);
  cache.grow(p.length);
  DeviceBuffer<half> queries(p.prefill_q);
  DeviceBuffer<std::int32_t> slot(std::vector<std::int32_t>{0});
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cuda::Context ctx{stream};
  const CsattentionConfig config = variant_config(0);
  DecodeStep gpu(CudaSelector(p.limits(), config), p.config(), ctx);
  DecodeStep cpu(CpuSelector(p.limits(), config), p.config(), {});
  gpu.prepare({.cache = cache.view(p), .slots = slot.data(),
               .queries = SequenceView<const half>::packed(queries.data(), 1, p.q_heads, p.queries, p.head_dim)},
              ctx);
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
             .v = HeadsView<const half>::packed(dv.data(), 1, p.kv_heads, p.head_dim), .slots = slot.data()},
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
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace kvsift
