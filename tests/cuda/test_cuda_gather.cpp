// CUDA KV gathers (cuda/gather.hpp) against their CPU twins (whose tests check them against std::map / std::set
// references), bit for bit: gather_kv from contiguous and paged sources into contiguous and paged destinations,
// gather_keys into a padded view, and
// gather_kv_difference over several steps of overlapping selections with the source in pinned host memory (read
// through its mapped pointers) and in device memory, in fp32, fp16 and bf16, outputs poisoned first. Also the
// device-value rules and the host-side refusals (which run without a GPU). A difference step captured in a CUDA
// graph and replayed is CudaWorkspaces.GatherKvDifferenceFromPinnedHost (tests/cuda/test_cuda_workspaces.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "gather_problem.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/gather.hpp"
#include "kvsift/cuda/gather.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::same_bytes;
using test::Random;

using test::PinnedBuffer;

class CudaGather : public test::GpuTest {};

/// The gathers' source: a random cache of 4 sequences (lengths 0, 77, 300, 129; 2 kv heads, 300 tokens), contiguous
/// or paged in pages of 16, as the CPU twin reads it (host) and as the GPU does (device memory).
template <class T>
struct SourceTwins {
  static constexpr std::int32_t batch = 4, kv_heads = 2, tokens = 300;
  const std::vector<std::int32_t> lens = {0, 77, 300, 129};
  test::HostKV src_f;
  test::HostPagedKV paged_f;
  bool paged;
  std::vector<T> k, v;
  DeviceBuffer<T> d_k, d_v;
  DeviceBuffer<std::int32_t> d_lens, d_indptr, d_indices, d_last;

  SourceTwins(Random& rng, std::int32_t head_dim, bool paged_src)
      : src_f(rng, batch, kv_heads, tokens, head_dim, lens),
        paged_f(src_f, 16, true, rng),
        paged(paged_src),
        k(test::to_storage<T>(paged ? paged_f.k_pages : src_f.k)),
        v(test::to_storage<T>(paged ? paged_f.v_pages : src_f.v)),
        d_k(k),
        d_v(v),
        d_lens(src_f.seq_lens),
        d_indptr(paged_f.indptr),
        d_indices(paged_f.indices),
        d_last(paged_f.last_len) {}

  KVCache<const T> view(bool device) const {
    if (paged) {
      const auto& f = paged_f.view;
      return PagedKVView<const T>{device ? d_k.data() : k.data(), device ? d_v.data() : v.data(),
                                  device ? d_indptr.data() : f.page_indptr, device ? d_indices.data() : f.page_indices,
                                  device ? d_last.data() : f.last_page_len, f.batch, f.kv_heads, f.head_dim,
                                  f.page_size, f.num_pages, f.page_stride, f.token_stride, f.head_stride};
    }
    return ContiguousKVView<const T>::packed(device ? d_k.data() : k.data(), device ? d_v.data() : v.data(), batch,
                                             kv_heads, tokens, src_f.head_dim,
                                             device ? d_lens.data() : src_f.seq_lens.data());
  }
};

/// A random selection of up to `capacity` tokens per row within `lengths`, on the host and in device memory.
struct SelectionTwins {
  test::HostSelection host;
  DeviceBuffer<std::int32_t> d_rows, d_counts;
  SelectionView device;

  SelectionTwins(Random& rng, std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity,
                 const std::vector<std::int32_t>& lengths)
      : host(batch, kv_heads, capacity, false),
        d_rows(filled(host, rng, lengths).indices),
        d_counts(host.counts),
        device(host.view) {
    device.indices = d_rows.data();
    device.counts = d_counts.data();
  }
  static const test::HostSelection& filled(test::HostSelection& s, Random& rng,
                                           const std::vector<std::int32_t>& lengths) {
    test::random_rows(rng, s, lengths);
    return s;
  }
};

template <class T>
void check_gather_kv(Random& rng, std::int32_t head_dim, bool paged_src, bool paged_dst) {
  SCOPED_TRACE(testing::Message() << "head_dim " << head_dim << (paged_src ? " paged src" : " contiguous src")
                                  << (paged_dst ? " paged dst" : " contiguous dst"));
  const SourceTwins<T> src(rng, head_dim, paged_src);
  const std::int32_t batch = src.batch, kv_heads = src.kv_heads, capacity = 64;
  test::HostKV dst_f(rng, batch, kv_heads, capacity, head_dim);
  test::HostPagedKV dst_paged_f(dst_f, 8, false, rng);
  auto dk = test::to_storage<T>(paged_dst ? dst_paged_f.k_pages : dst_f.k);
  auto dv = test::to_storage<T>(paged_dst ? dst_paged_f.v_pages : dst_f.v);
  DeviceBuffer<T> d_dk(dk.size()), d_dv(dv.size());
  d_dk.poison();
  d_dv.poison();
  std::memset(dk.data(), 0xff, dk.size() * sizeof(T));  // the host twin poisoned as DeviceBuffer::poison does
  std::memset(dv.data(), 0xff, dv.size() * sizeof(T));
  DeviceBuffer<std::int32_t> dd_indptr(dst_paged_f.indptr), dd_indices(dst_paged_f.indices),
      dd_last(dst_paged_f.last_len);
  const auto make_dst = [&](bool device) -> KVCache<T> {
    if (paged_dst) {
      const auto& f = dst_paged_f.view;
      return PagedKVView<T>{device ? d_dk.data() : dk.data(), device ? d_dv.data() : dv.data(),
                            device ? dd_indptr.data() : f.page_indptr, device ? dd_indices.data() : f.page_indices,
                            device ? dd_last.data() : f.last_page_len, f.batch, f.kv_heads, f.head_dim, f.page_size,
                            f.num_pages, f.page_stride, f.token_stride, f.head_stride};
    }
    return ContiguousKVView<T>::packed(device ? d_dk.data() : dk.data(), device ? d_dv.data() : dv.data(), batch,
                                       kv_heads, capacity, head_dim);
  };
  const SelectionTwins rows(rng, batch, kv_heads, capacity, src.lens);
  cpu::gather_kv(src.view(false), rows.host.view, make_dst(false));
  cuda::gather_kv(src.view(true), rows.device, make_dst(true), nullptr);
  EXPECT_TRUE(same_bytes(d_dk.download(), dk)) << "K";
  EXPECT_TRUE(same_bytes(d_dv.download(), dv)) << "V";
}

TEST_F(CudaGather, GatherKvEqualsTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (bool ps : {false, true}) {
    for (bool pd : {false, true}) {
      check_gather_kv<float>(rng, 64, ps, pd);
      check_gather_kv<half>(rng, 128, ps, pd);
      check_gather_kv<bfloat16>(rng, 128, ps, pd);
      check_gather_kv<half>(rng, 20, ps, pd);  // rows of 40 bytes: the element-wise copy
    }
  }
}

/// gather_keys into a padded [batch, kv_heads, tokens, head_dim] view (unaligned rows where head_dim says so), from
/// a contiguous or paged source in device memory, against the CPU twin, both destinations poisoned alike.
template <class T>
void check_gather_keys(Random& rng, std::int32_t head_dim, bool paged_src) {
  SCOPED_TRACE(testing::Message() << "head_dim " << head_dim << (paged_src ? " paged src" : " contiguous src"));
  const SourceTwins<T> src(rng, head_dim, paged_src);
  const std::int32_t batch = src.batch, kv_heads = src.kv_heads, capacity = 64, tokens = 70, row = head_dim + 8;
  DeviceBuffer<T> d_keys(std::size_t(batch) * kv_heads * tokens * row);
  d_keys.poison();
  std::vector<T> keys(d_keys.size());
  std::memset(keys.data(), 0xff, keys.size() * sizeof(T));  // the host twin poisoned as DeviceBuffer::poison does
  const auto make_dst = [&](T* data) {
    return SequenceView<T>{data, batch, kv_heads, tokens, head_dim, std::int64_t(kv_heads) * tokens * row,
                           std::int64_t(tokens) * row, row};
  };
  const SelectionTwins rows(rng, batch, kv_heads, capacity, src.lens);
  cpu::gather_keys(src.view(false), rows.host.view, make_dst(keys.data()));
  cuda::gather_keys(src.view(true), rows.device, make_dst(d_keys.data()), nullptr);
  EXPECT_TRUE(same_bytes(d_keys.download(), keys));
}

TEST_F(CudaGather, GatherKeysEqualsTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (bool ps : {false, true}) {
    check_gather_keys<float>(rng, 64, ps);
    check_gather_keys<half>(rng, 128, ps);
    check_gather_keys<bfloat16>(rng, 128, ps);
    check_gather_keys<half>(rng, 20, ps);  // rows of 40 bytes: the element-wise copy
  }
}

/// Both twins of a difference problem: the source (pinned host or device for CUDA), selections, slot maps.
template <class T>
struct DifferenceProblem {
  static constexpr std::int32_t batch = 3, kv_heads = 2, cap = 96;
  std::int32_t head_dim, resident_cap;
  std::vector<std::int32_t> lens = {700, 40, 1000};
  test::HostKV src_f;
  std::vector<T> k, v;
  PinnedBuffer<T> pinned_k, pinned_v;
  DeviceBuffer<T> dev_k, dev_v;
  PinnedBuffer<std::int32_t> pinned_lens;
  std::vector<T> res_k, res_v;
  DeviceBuffer<T> d_res_k, d_res_v;
  test::HostSelection prev, cur;
  std::vector<std::int32_t> prev_slots, cur_slots;
  DeviceBuffer<std::int32_t> d_prev_idx, d_prev_cnt, d_cur_idx, d_cur_cnt, d_prev_slots, d_cur_slots, d_copied;
  cpu::Array<std::byte> cpu_ws;
  DeviceBuffer<std::byte> ws;

  DifferenceProblem(Random& rng, std::int32_t head_dim_)
      : head_dim(head_dim_), resident_cap(cap + rng.uniform_int(0, 40)),
        src_f(rng, batch, kv_heads, 1000, head_dim_, lens), k(test::to_storage<T>(src_f.k)), v(test::to_storage<T>(src_f.v)),
        pinned_k(k), pinned_v(v), dev_k(k), dev_v(v), pinned_lens(lens),
        res_k(std::size_t(batch) * kv_heads * resident_cap * head_dim_), res_v(res_k.size()),
        d_res_k(res_k.size()), d_res_v(res_k.size()), prev(batch, kv_heads, cap, false),
        cur(batch, kv_heads, cap, false), prev_slots(prev.indices.size(), -1), cur_slots(prev_slots),
        d_prev_idx(prev.indices.size()), d_prev_cnt(prev.counts.size()), d_cur_idx(prev.indices.size()),
        d_cur_cnt(prev.counts.size()), d_prev_slots(prev_slots), d_cur_slots(prev_slots.size()),
        d_copied(prev.counts.size()),
        cpu_ws(cpu::gather_kv_difference_workspace_bytes(batch, kv_heads, cap, resident_cap)),
        ws(cuda::gather_kv_difference_workspace_bytes(batch, kv_heads, cap, resident_cap)) {
    std::memset(res_k.data(), 0xff, res_k.size() * sizeof(T));
    std::memset(res_v.data(), 0xff, res_v.size() * sizeof(T));
    d_res_k.poison();
    d_res_v.poison();
    std::fill(prev.counts.begin(), prev.counts.end(), 0);
    d_prev_cnt.upload(prev.counts);
    d_prev_idx.upload(prev.indices);
  }
  KVCache<const T> source(bool device, bool pinned) const {
    if (!device) return ContiguousKVView<const T>::packed(k.data(), v.data(), batch, kv_heads, 1000, head_dim, lens.data());
    return ContiguousKVView<const T>::packed(pinned ? pinned_k.data() : dev_k.data(), pinned ? pinned_v.data() : dev_v.data(),
                                             batch, kv_heads, 1000, head_dim, pinned_lens.data());
  }
  ContiguousKVView<T> resident(bool device) {
    return ContiguousKVView<T>::packed(device ? d_res_k.data() : res_k.data(), device ? d_res_v.data() : res_v.data(),
                                       batch, kv_heads, resident_cap, head_dim);
  }
  SelectionView device_view(const test::HostSelection& s, const DeviceBuffer<std::int32_t>& idx,
                            const DeviceBuffer<std::int32_t>& cnt) const {
    auto view = s.view;
    view.indices = idx.data();
    view.counts = cnt.data();
    return view;
  }
  /// The next selection (gather_problem.hpp): part of the current one kept, random tokens added; uploaded.
  void next_selection(Random& rng) {
    test::next_selection(rng, prev, cur, lens);
    d_cur_idx.upload(cur.indices);
    d_cur_cnt.upload(cur.counts);
  }
  void run_cuda(bool pinned, cudaStream_t stream) {
    cuda::gather_kv_difference(source(true, pinned), device_view(prev, d_prev_idx, d_prev_cnt), d_prev_slots.data(),
                               device_view(cur, d_cur_idx, d_cur_cnt), d_cur_slots.data(), resident(true),
                               d_copied.data(), {ws.data(), ws.size()}, stream);
  }
  std::vector<std::int32_t> run_cpu() {
    std::vector<std::int32_t> copied(prev.counts.size());
    cpu::gather_kv_difference(source(false, false), prev.view, prev_slots.data(), cur.view, cur_slots.data(),
                              resident(false), copied.data(), cpu_ws.bytes());
    return copied;
  }
  /// This step's selection and slots become the previous ones (both twins).
  void advance() {
    prev.indices = cur.indices;
    prev.counts = cur.counts;
    prev_slots = cur_slots;
    d_prev_idx.upload(prev.indices);
    d_prev_cnt.upload(prev.counts);
    d_prev_slots.upload(prev_slots);
  }
};

template <class T>
void check_difference(Random& rng, std::int32_t head_dim, bool pinned) {
  SCOPED_TRACE(testing::Message() << "head_dim " << head_dim << (pinned ? " pinned host source" : " device source"));
  DifferenceProblem<T> p(rng, head_dim);
  for (int step = 0; step < 6; ++step) {
    p.next_selection(rng);
    std::fill(p.cur_slots.begin(), p.cur_slots.end(), -1);
    p.d_cur_slots.poison();
    p.d_copied.poison();
    const auto copied = p.run_cpu();
    p.run_cuda(pinned, nullptr);
    ASSERT_EQ(p.d_copied.download(), copied) << "step " << step;
    ASSERT_EQ(p.d_cur_slots.download(), p.cur_slots) << "step " << step;
    ASSERT_TRUE(same_bytes(p.d_res_k.download(), p.res_k)) << "resident K, step " << step;
    ASSERT_TRUE(same_bytes(p.d_res_v.download(), p.res_v)) << "resident V, step " << step;
    p.advance();
  }
}

TEST_F(CudaGather, DifferenceEqualsTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (bool pinned : {true, false}) {
    check_difference<half>(rng, 128, pinned);
    check_difference<bfloat16>(rng, 64, pinned);
    check_difference<float>(rng, 36, pinned);  // 144-byte rows: the element-wise copy
  }
}

/// A count outside its range gives copied = -1 and writes no slot; the other rows are as the CPU's.
TEST_F(CudaGather, OutOfRangeCountsHaveTheDefinedResult) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  DifferenceProblem<half> p(rng, 64);
  p.next_selection(rng);
  p.d_cur_slots.poison();
  auto counts = p.cur.counts;
  counts[1] = DifferenceProblem<half>::cap + 1;
  counts[4] = -2;
  p.d_cur_cnt.upload(counts);
  p.run_cuda(false, nullptr);
  const auto copied = p.d_copied.download(), slots = p.d_cur_slots.download();
  EXPECT_EQ(copied[1], -1);
  EXPECT_EQ(copied[4], -1);
  for (std::int32_t i = 0; i < DifferenceProblem<half>::cap; ++i) {
    EXPECT_EQ(slots[1 * DifferenceProblem<half>::cap + i], -1);
    EXPECT_EQ(slots[4 * DifferenceProblem<half>::cap + i], -1);
  }
  p.cur.counts[1] = p.cur.counts[4] = 0;
  const auto cpu_copied = p.run_cpu();
  EXPECT_EQ(copied[0], cpu_copied[0]);
  EXPECT_EQ(copied[5], cpu_copied[5]);
}

/// Host-side refusals: shapes only, before any device call (no GPU needed).
TEST(CudaGatherBadInput, RefusedBeforeAnyDeviceCall) {
  Random rng(2);
  test::HostKV src(rng, 2, 2, 20, 8, {20, 10});
  test::HostKV dst(rng, 2, 2, 4, 8);
  const auto dv = ContiguousKVView<float>::packed(dst.k.data(), dst.v.data(), 2, 2, 4, 8);
  test::HostSelection rows(2, 1, 4, false);
  test::expect_error([&] { cuda::gather_kv(KVCache<const float>(src.view()), rows.view, KVCache<float>(dv), nullptr); },
                     {"cuda::gather_kv", "rows is [batch = 2, kv_heads = 1], the cache [batch = 2, kv_heads = 2]"});
  std::vector<float> keys(2 * 2 * 4 * 8);
  const KVCache<const float> s(src.view());
  const auto keys_view = SequenceView<float>::packed(keys.data(), 2, 2, 4, 8);
  const auto wide_keys = SequenceView<float>::packed(keys.data(), 2, 2, 2, 16);
  test::expect_error([&] { cuda::gather_keys(s, rows.view, keys_view, nullptr); },
                     {"cuda::gather_keys", "rows is [batch = 2, kv_heads = 1], the cache [batch = 2, kv_heads = 2]"});
  test::expect_error([&] { cuda::gather_keys(s, rows.view, wide_keys, nullptr); },
                     "src is [batch = 2, kv_heads = 2, head_dim = 8], dst [batch = 2, heads = 2, head_dim = 16]");
  test::HostSelection prev(2, 2, 4, false), cur(2, 2, 8, false);
  std::vector<std::int32_t> slots(16), copied(4);
  std::vector<std::byte> ws(1024);
  test::expect_error([&] {
    cuda::gather_kv_difference(KVCache<const float>(src.view()), prev.view, slots.data(), cur.view, copied.data(), dv,
                               copied.data(), {ws.data(), ws.size()}, nullptr);
  }, {"cuda::gather_kv_difference", "resident.capacity (= 4) < current.capacity (= 8)"});
  test::expect_error([&] { cuda::gather_kv_difference_workspace_bytes(0, 2, 4, 4); }, "batch (= 0)");
}

}  // namespace
}  // namespace kvsift
