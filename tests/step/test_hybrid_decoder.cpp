// HybridDecoder: GPU window + CPU offloaded selection, merged by LSE, against kvsift's fp64 reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/step/hybrid_decoder.hpp"
#include "kvsift/attention/reference.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::Random;

/// Pinned host memory for the offloaded cache.
template <class T>
struct PinnedBuffer {
  T* data = nullptr;
  explicit PinnedBuffer(std::size_t n) { KVSIFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&data), std::max<std::size_t>(n, 1) * sizeof(T))); }
  ~PinnedBuffer() { cudaFreeHost(data); }
  PinnedBuffer(const PinnedBuffer&) = delete;
};

/// A full cache split into the GPU window (sink, then recent tokens) and the pinned offloaded middle.
struct HybridCase {
  static constexpr std::int32_t kBatch = 2, kQHeads = 8, kKvHeads = 2, kDim = 128, kSink = 4, kRecent = 64;
  static constexpr std::int32_t kWindow = kSink + kRecent;
  std::int32_t capacity;
  test::HostKV full;
  std::vector<bfloat16> q, k, v;
  std::int32_t mid_capacity;
  std::vector<std::int32_t> mid_lens;
  PinnedBuffer<bfloat16> mid_k, mid_v;
  DeviceBuffer<bfloat16> d_window_k, d_window_v, d_q, d_o;
  DeviceBuffer<float> d_lse;

  /// Sequence 0 has a random length that leaves at least `min_offloaded` tokens off the GPU; sequence 1 is full.
  HybridCase(Random& rng, std::int32_t cap, std::int32_t min_offloaded = 1)
      : capacity(cap),
        full(rng, kBatch, kKvHeads, cap, kDim, {rng.uniform_int(kWindow + min_offloaded, cap), cap}),
        q(test::to_storage<bfloat16>(rng.normal(std::size_t(kBatch) * kQHeads * kDim))),
        k(test::to_storage<bfloat16>(full.k)),
        v(test::to_storage<bfloat16>(full.v)),
        mid_capacity(cap - kWindow),
        mid_lens{full.seq_lens[0] - kWindow, full.seq_lens[1] - kWindow},
        mid_k(std::size_t(kBatch) * kKvHeads * mid_capacity * kDim),
        mid_v(std::size_t(kBatch) * kKvHeads * mid_capacity * kDim),
        d_q(q),
        d_o(q.size()),
        d_lse(std::size_t(kBatch) * kQHeads) {
    std::vector<bfloat16> wk(std::size_t(kBatch) * kKvHeads * kWindow * kDim), wv(wk.size());
    const auto src = full_view();
    for (std::int32_t b = 0; b < kBatch; ++b) {
      const std::int32_t n = full.seq_lens[b];
      for (std::int32_t h = 0; h < kKvHeads; ++h) {
        for (std::int32_t t = 0; t < n; ++t) {
          bfloat16* dk;
          bfloat16* dv;
          if (t < kSink || t >= n - kRecent) {
            const std::int32_t w = t < kSink ? t : kSink + (t - (n - kRecent));
            const std::size_t off = ((std::size_t(b) * kKvHeads + h) * kWindow + w) * kDim;
            dk = wk.data() + off;
            dv = wv.data() + off;
          } else {
            const std::size_t off = ((std::size_t(b) * kKvHeads + h) * mid_capacity + (t - kSink)) * kDim;
            dk = mid_k.data + off;
            dv = mid_v.data + off;
          }
          std::copy_n(src.k_row(b, h, t), kDim, dk);
          std::copy_n(src.v_row(b, h, t), kDim, dv);
        }
      }
    }
    d_window_k = DeviceBuffer<bfloat16>(wk);
    d_window_v = DeviceBuffer<bfloat16>(wv);
  }

  ContiguousKVView<const bfloat16> full_view() const {
    return ContiguousKVView<const bfloat16>::packed(k.data(), v.data(), kBatch, kKvHeads, capacity, kDim, full.seq_lens.data());
  }
  ContiguousKVView<const bfloat16> window() const {
    return ContiguousKVView<const bfloat16>::packed(d_window_k.data(), d_window_v.data(), kBatch, kKvHeads, kWindow, kDim);
  }
  ContiguousKVView<const bfloat16> offloaded() const {
    return ContiguousKVView<const bfloat16>::packed(mid_k.data, mid_v.data, kBatch, kKvHeads, mid_capacity, kDim,
                                                    mid_lens.data());
  }
  QueryView<const bfloat16> q_host() const { return QueryView<const bfloat16>::packed(q.data(), kBatch, kQHeads, kDim); }
  QueryView<const bfloat16> q_device() const { return QueryView<const bfloat16>::packed(d_q.data(), kBatch, kQHeads, kDim); }
  StateView<bfloat16> out() const { return StateView<bfloat16>::packed(d_o.data(), d_lse.data(), kBatch, kQHeads, kDim); }
};

using HybridDecode = test::GpuTest;

TEST_F(HybridDecode, FullOffloadSelectionEqualsDenseOverEverything) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  HybridCase c(rng, 3000);
  // Selection: every offloaded token, in random order.
  std::vector<std::int32_t> idx(std::size_t(c.kBatch) * c.kKvHeads * c.mid_capacity), counts(c.kBatch * c.kKvHeads);
  for (std::int32_t b = 0; b < c.kBatch; ++b) {
    for (std::int32_t h = 0; h < c.kKvHeads; ++h) {
      auto* row = idx.data() + (std::size_t(b) * c.kKvHeads + h) * c.mid_capacity;
      std::iota(row, row + c.mid_lens[b], 0);
      std::shuffle(row, row + c.mid_lens[b], rng.engine);
      counts[b * c.kKvHeads + h] = c.mid_lens[b];
    }
  }
  cpu::ThreadPool pool(2);
  cuda::HybridDecoder<bfloat16> decoder({.batch = c.kBatch, .q_heads = c.kQHeads, .kv_heads = c.kKvHeads,
                                         .head_dim = c.kDim, .sink = c.kSink, .recent = c.kRecent},
                                        &pool);
  test::HostState ref(c.kBatch, c.kQHeads, c.kDim);
  reference::dense_decode(c.q_host(), c.full_view(), ref.view);
  for (int step = 0; step < 2; ++step) {  // the second step reuses the decoder's buffers
    c.d_o.poison();
    c.d_lse.poison();
    decoder.decode(c.q_device(), c.q_host(), c.full.seq_lens, c.window(), c.offloaded(),
                   {idx.data(), counts.data(), nullptr, c.kBatch, c.kKvHeads, c.mid_capacity}, c.out(), nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    test::expect_close(c.d_o.download(), c.d_lse.download(), ref, "hybrid step " + std::to_string(step));
  }
}

TEST_F(HybridDecode, PartialSelectionEqualsSparseOverWindowAndSelection) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t k = 150;
  HybridCase c(rng, 2000, k);
  std::vector<std::int32_t> idx(std::size_t(c.kBatch) * c.kKvHeads * k), counts(c.kBatch * c.kKvHeads, k);
  // The same tokens in absolute positions, plus the window, for the reference.
  const std::int32_t ref_cap = c.kWindow + k;
  std::vector<std::int32_t> ref_idx(std::size_t(c.kBatch) * c.kKvHeads * ref_cap), ref_counts(c.kBatch * c.kKvHeads, ref_cap);
  for (std::int32_t b = 0; b < c.kBatch; ++b) {
    const std::int32_t n = c.full.seq_lens[b];
    for (std::int32_t h = 0; h < c.kKvHeads; ++h) {
      std::vector<std::int32_t> mid(c.mid_lens[b]);
      std::iota(mid.begin(), mid.end(), 0);
      std::shuffle(mid.begin(), mid.end(), rng.engine);
      const std::size_t row = std::size_t(b) * c.kKvHeads + h;
      std::int32_t* ref_row = ref_idx.data() + row * ref_cap;
      for (std::int32_t i = 0; i < k; ++i) {
        idx[row * k + i] = mid[i];
        *ref_row++ = mid[i] + c.kSink;
      }
      for (std::int32_t t = 0; t < c.kSink; ++t) *ref_row++ = t;
      for (std::int32_t t = n - c.kRecent; t < n; ++t) *ref_row++ = t;
    }
  }
  cuda::HybridDecoder<bfloat16> decoder({.batch = c.kBatch, .q_heads = c.kQHeads, .kv_heads = c.kKvHeads,
                                         .head_dim = c.kDim, .sink = c.kSink, .recent = c.kRecent});
  c.d_o.poison();
  c.d_lse.poison();
  decoder.decode(c.q_device(), c.q_host(), c.full.seq_lens, c.window(), c.offloaded(),
                 {idx.data(), counts.data(), nullptr, c.kBatch, c.kKvHeads, k}, c.out(), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  test::HostState ref(c.kBatch, c.kQHeads, c.kDim);
  reference::sparse_decode(c.q_host(), c.full_view(),
                           SelectionView{ref_idx.data(), ref_counts.data(), nullptr, c.kBatch, c.kKvHeads, ref_cap}, ref.view);
  test::expect_close(c.d_o.download(), c.d_lse.download(), ref, "hybrid partial");
}

TEST_F(HybridDecode, BadConfigurationsAreRefused) {
  HybridCase c(rng, 500);
  std::vector<std::int32_t> idx(std::size_t(c.kBatch) * c.kKvHeads * 8, 0), counts(c.kBatch * c.kKvHeads, 1);
  const SelectionView sel{idx.data(), counts.data(), nullptr, c.kBatch, c.kKvHeads, 8};
  using test::expect_error;
  cuda::HybridDecoder<bfloat16> decoder({.batch = c.kBatch, .q_heads = c.kQHeads, .kv_heads = c.kKvHeads,
                                         .head_dim = c.kDim, .sink = c.kSink, .recent = c.kRecent});
  std::vector<std::int32_t> short_lens = {50, c.full.seq_lens[1]};
  expect_error([&] { decoder.decode(c.q_device(), c.q_host(), short_lens, c.window(), c.offloaded(), sel, c.out(), nullptr); },
               "the GPU window (sink 4 + recent 64 = 68 tokens) is larger than sequence 0 (= 50 tokens)");
  std::vector<bfloat16> pageable_k(std::size_t(c.kBatch) * c.kKvHeads * c.mid_capacity * c.kDim), pageable_v(pageable_k.size());
  const auto pageable = ContiguousKVView<const bfloat16>::packed(pageable_k.data(), pageable_v.data(), c.kBatch, c.kKvHeads,
                                                                 c.mid_capacity, c.kDim, c.mid_lens.data());
  expect_error([&] { decoder.decode(c.q_device(), c.q_host(), c.full.seq_lens, c.window(), pageable, sel, c.out(), nullptr); },
               "offloaded.k and offloaded.v must be pinned host memory");
}

}  // namespace
}  // namespace kvsift
