// HybridDecoder: the window attended on the GPU, a selection of the middle on the CPU from pinned host
// memory, absolute positions on both sides, merged by LSE; against kvsift's fp64 reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <string>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/step/hybrid_decoder.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::expect_error;
using test::Random;

using test::PinnedBuffer;

/// One cache in both layouts, split as the hybrid contract has it: the device copies hold only each
/// sequence's window rows, the pinned host copies only its middle rows; every other row is NaN, so a read
/// of a row the contract says is not read shows in the result.
struct HybridCase {
  static constexpr std::int32_t kBatch = 3, kQHeads = 8, kKvHeads = 2, kDim = 128, kPageSize = 16;
  static constexpr AttentionWindow kWindow{4, 64};
  std::int32_t capacity;
  test::HostKV full;
  test::HostPagedKV paged;
  std::vector<bfloat16> q, k, v, k_pages, v_pages;
  DeviceBuffer<bfloat16> d_q, d_o;
  DeviceBuffer<float> d_lse;
  DeviceBuffer<bfloat16> d_k, d_v, d_k_pages, d_v_pages;
  DeviceBuffer<std::int32_t> d_lens, d_indptr, d_page_indices, d_last;
  std::unique_ptr<PinnedBuffer<bfloat16>> h_k, h_v, h_k_pages, h_v_pages;

  /// Sequence 0 is no longer than the window (an empty middle), sequence 1 a little longer, 2 full.
  HybridCase(Random& rng, std::int32_t cap)
      : capacity(cap),
        full(rng, kBatch, kKvHeads, cap, kDim,
             {rng.uniform_int(1, kWindow.sink + kWindow.recent), rng.uniform_int(69, 200), cap}),
        paged(full, kPageSize, /*hnd=*/rng.uniform_int(0, 1) == 1, rng),
        q(test::to_storage<bfloat16>(rng.normal(std::size_t(kBatch) * kQHeads * kDim))),
        k(test::to_storage<bfloat16>(full.k)),
        v(test::to_storage<bfloat16>(full.v)),
        k_pages(test::to_storage<bfloat16>(paged.k_pages)),
        v_pages(test::to_storage<bfloat16>(paged.v_pages)),
        d_q(q),
        d_o(q.size()),
        d_lse(std::size_t(kBatch) * kQHeads),
        d_lens(full.seq_lens),
        d_indptr(paged.indptr),
        d_page_indices(paged.indices),
        d_last(paged.last_len) {
    const auto in_window = [&](std::int32_t b, std::int32_t t) {
      const std::int32_t n = full.seq_lens[b];
      return t < kWindow.sink_end(n) || t >= kWindow.recent_begin(n);
    };
    const auto in_middle = [&](std::int32_t b, std::int32_t t) { return !in_window(b, t); };
    const auto contiguous_device = only_rows(k, v, contiguous(k.data(), v.data()), in_window);
    const auto paged_device = only_rows(k_pages, v_pages, paged_view(k_pages.data(), v_pages.data()), in_window);
    const auto contiguous_host = only_rows(k, v, contiguous(k.data(), v.data()), in_middle);
    const auto paged_host = only_rows(k_pages, v_pages, paged_view(k_pages.data(), v_pages.data()), in_middle);
    d_k = DeviceBuffer<bfloat16>(contiguous_device[0]);
    d_v = DeviceBuffer<bfloat16>(contiguous_device[1]);
    d_k_pages = DeviceBuffer<bfloat16>(paged_device[0]);
    d_v_pages = DeviceBuffer<bfloat16>(paged_device[1]);
    h_k = std::make_unique<PinnedBuffer<bfloat16>>(contiguous_host[0]);
    h_v = std::make_unique<PinnedBuffer<bfloat16>>(contiguous_host[1]);
    h_k_pages = std::make_unique<PinnedBuffer<bfloat16>>(paged_host[0]);
    h_v_pages = std::make_unique<PinnedBuffer<bfloat16>>(paged_host[1]);
  }

  /// Copies of (k, v) in which only the rows keep(b, t) of the sequences' tokens hold their values.
  template <class View, class Keep>
  std::array<std::vector<bfloat16>, 2> only_rows(const std::vector<bfloat16>& k_src, const std::vector<bfloat16>& v_src,
                                                 const View& view, Keep keep) const {
    const bfloat16 nan = from_float<bfloat16>(std::numeric_limits<float>::quiet_NaN());
    std::array<std::vector<bfloat16>, 2> out{std::vector<bfloat16>(k_src.size(), nan),
                                             std::vector<bfloat16>(v_src.size(), nan)};
    for (std::int32_t b = 0; b < kBatch; ++b) {
      for (std::int32_t h = 0; h < kKvHeads; ++h) {
        for (std::int32_t t = 0; t < full.seq_lens[b]; ++t) {
          if (!keep(b, t)) continue;
          const std::int64_t off = view.offset(b, h, t);
          std::copy_n(k_src.begin() + off, kDim, out[0].begin() + off);
          std::copy_n(v_src.begin() + off, kDim, out[1].begin() + off);
        }
      }
    }
    return out;
  }

  ContiguousKVView<const bfloat16> contiguous(const bfloat16* k_data, const bfloat16* v_data,
                                              const std::int32_t* lens = nullptr) const {
    return ContiguousKVView<const bfloat16>::packed(k_data, v_data, kBatch, kKvHeads, capacity, kDim,
                                                    lens != nullptr ? lens : full.seq_lens.data());
  }
  PagedKVView<const bfloat16> paged_view(const bfloat16* k_data, const bfloat16* v_data,
                                         const std::int32_t* indptr = nullptr, const std::int32_t* pages = nullptr,
                                         const std::int32_t* last = nullptr) const {
    auto view = paged.view;
    return {k_data,
            v_data,
            indptr != nullptr ? indptr : paged.indptr.data(),
            pages != nullptr ? pages : paged.indices.data(),
            last != nullptr ? last : paged.last_len.data(),
            view.batch,
            view.kv_heads,
            view.head_dim,
            view.page_size,
            view.num_pages,
            view.page_stride,
            view.token_stride,
            view.head_stride};
  }
  ContiguousKVView<const bfloat16> device_contiguous() const { return contiguous(d_k.data(), d_v.data(), d_lens.data()); }
  PagedKVView<const bfloat16> device_paged() const {
    return paged_view(d_k_pages.data(), d_v_pages.data(), d_indptr.data(), d_page_indices.data(), d_last.data());
  }
  ContiguousKVView<const bfloat16> host_contiguous() const { return contiguous(h_k->data(), h_v->data()); }
  PagedKVView<const bfloat16> host_paged() const { return paged_view(h_k_pages->data(), h_v_pages->data()); }
  /// Every value, for the reference.
  ContiguousKVView<const bfloat16> reference_cache() const { return contiguous(k.data(), v.data()); }

  QueryView<const bfloat16> q_host() const { return QueryView<const bfloat16>::packed(q.data(), kBatch, kQHeads, kDim); }
  QueryView<const bfloat16> q_device() const { return QueryView<const bfloat16>::packed(d_q.data(), kBatch, kQHeads, kDim); }
  StateView<bfloat16> out() const { return StateView<bfloat16>::packed(d_o.data(), d_lse.data(), kBatch, kQHeads, kDim); }
  cuda::HybridDecoderConfig config() const {
    return {.batch = kBatch, .q_heads = kQHeads, .kv_heads = kKvHeads, .head_dim = kDim, .attention = {.window = kWindow}};
  }
};

/// Up to `k` (all, when k = 0) distinct middle positions per row, in random order.
test::HostSelection middle_selection(Random& rng, const HybridCase& c, std::int32_t k) {
  const std::int32_t capacity = k > 0 ? k : c.capacity;
  test::HostSelection sel(c.kBatch, c.kKvHeads, capacity, /*with_weights=*/false);
  for (std::int32_t b = 0; b < c.kBatch; ++b) {
    const std::int32_t n = c.full.seq_lens[b], lo = c.kWindow.sink_end(n), hi = c.kWindow.recent_begin(n);
    for (std::int32_t h = 0; h < c.kKvHeads; ++h) {
      std::vector<std::int32_t> middle(hi - lo);
      std::iota(middle.begin(), middle.end(), lo);
      std::shuffle(middle.begin(), middle.end(), rng.engine);
      const std::int32_t count = std::min<std::int32_t>(capacity, hi - lo);
      std::copy_n(middle.begin(), count, sel.view.row(b, h));
      sel.view.counts[sel.view.row_index(b, h)] = count;
    }
  }
  return sel;
}

using HybridDecode = test::GpuTest;

TEST_F(HybridDecode, MatchesTheReferenceOverWindowAndSelectionForEveryLayout) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  HybridCase c(rng, 3000);
  cpu::ThreadPool pool(2);
  for (bool whole_middle : {true, false}) {
    const test::HostSelection sel = middle_selection(rng, c, whole_middle ? 0 : 150);
    test::HostState ref(c.kBatch, c.kQHeads, c.kDim);
    if (whole_middle) {  // window and middle are the whole sequence
      reference::dense_decode(c.q_host(), c.reference_cache(), ref.view);
    } else {
      reference::sparse_decode(c.q_host(), c.reference_cache(), sel.view, ref.view, {.window = c.kWindow});
    }
    ASSERT_TRUE(std::isfinite(ref.lse[0]));  // sequence 0, window only, is not empty
    const auto check = [&](const auto& device_kv, const auto& host_kv, const std::string& layouts) {
      for (bool validate : {false, true}) {
        auto config = c.config();
        config.validate_indices = validate;
        cuda::HybridDecoder<bfloat16> decoder(config, validate ? &pool : nullptr);
        const test::SplitBuffers workspace(decoder.workspace_bytes());  // poisoned: the decoder writes what it reads
        for (int step = 0; step < 2; ++step) {  // the second step reuses the workspace
          c.d_o.poison();
          c.d_lse.poison();
          decoder.decode(c.q_device(), c.q_host(), device_kv, host_kv, sel.view, c.out(), workspace.view(), nullptr);
          KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
          test::expect_close(c.d_o.download(), c.d_lse.download(), ref,
                             fmt::format("{}, {} middle, validate {}, step {}", layouts,
                                         whole_middle ? "whole" : "partial", validate, step));
        }
      }
    };
    check(c.device_contiguous(), c.host_contiguous(), "contiguous device, contiguous host");
    check(c.device_contiguous(), c.host_paged(), "contiguous device, paged host");
    check(c.device_paged(), c.host_contiguous(), "paged device, contiguous host");
    check(c.device_paged(), c.host_paged(), "paged device, paged host");
  }
}

TEST_F(HybridDecode, BadArgumentsAreRefused) {
  HybridCase c(rng, 500);
  test::HostSelection sel = middle_selection(rng, c, 8);
  expect_error(
      [&] {
        auto config = c.config();
        config.attention.window = {};
        cuda::HybridDecoder<bfloat16> decoder(config);
      },
      "cuda::HybridDecoder: config.attention.window is empty");
  expect_error(
      [&] {
        auto config = c.config();
        config.attention.selection_page_size = 16;
        cuda::HybridDecoder<bfloat16> decoder(config);
      },
      "cuda::HybridDecoder: config.attention.selection_page_size (= 16) must be 1");
  expect_error(
      [&] {
        auto config = c.config();
        const std::int32_t row_map[1] = {0};
        config.attention.selection_rows = row_map;
        cuda::HybridDecoder<bfloat16> decoder(config);
      },
      "cuda::HybridDecoder: config.attention.selection_rows is set");
  auto config = c.config();
  config.validate_indices = true;
  cuda::HybridDecoder<bfloat16> decoder(config);
  const test::SplitBuffers workspace(decoder.workspace_bytes());
  const auto decode = [&](const auto& host_kv, const SelectionView& s) {
    decoder.decode(c.q_device(), c.q_host(), c.device_contiguous(), host_kv, s, c.out(), workspace.view(), nullptr);
  };
  const std::vector<bfloat16> pageable_k(c.k), pageable_v(c.v);
  expect_error([&] { decode(c.contiguous(pageable_k.data(), pageable_v.data()), sel.view); },
               {"cuda::HybridDecoder::decode: host_kv's k (", ") is not pinned host memory"});
  std::vector<std::byte> pageable_block(decoder.workspace_bytes().host + WorkspaceLayout::kAlignment);
  const std::size_t skip = (WorkspaceLayout::kAlignment - reinterpret_cast<std::uintptr_t>(pageable_block.data()) %
                                                           WorkspaceLayout::kAlignment) % WorkspaceLayout::kAlignment;
  expect_error(
      [&] {
        decoder.decode(c.q_device(), c.q_host(), c.device_contiguous(), c.host_contiguous(), sel.view, c.out(),
                       {.device = workspace.view().device,
                        .host = std::span<std::byte>(pageable_block).subspan(skip, decoder.workspace_bytes().host)},
                       nullptr);
      },
      {"cuda::HybridDecoder::decode: workspace.host's data (", ") is not pinned host memory"});
  expect_error(
      [&] {
        decoder.decode(c.q_device(), c.q_host(), c.device_contiguous(), c.host_contiguous(), sel.view, c.out(),
                       {.device = workspace.view().device.first(256), .host = workspace.view().host}, nullptr);
      },
      "cuda::HybridDecoder::decode: workspace too small");
  std::vector<std::uint8_t> attend_all(std::size_t(c.kBatch) * c.kKvHeads, 1);
  SelectionView all = sel.view;
  all.attend_all = attend_all.data();
  expect_error([&] { decode(c.host_contiguous(), all); }, "selection.attend_all is set");
  const std::int32_t n = c.full.seq_lens[2];
  sel.view.row(2, 1)[0] = n - 1;  // a recent token: the GPU attends it already
  expect_error([&] { decode(c.host_contiguous(), sel.view); },
               fmt::format("selection.indices[0] (= {}) at batch 2, kv_head 1 is in the attention window", n - 1));
  expect_error(
      [&] {
        decoder.decode(QueryView<const bfloat16>::packed(c.d_q.data(), c.kBatch, 4, c.kDim), c.q_host(),
                       c.device_contiguous(), c.host_contiguous(), sel.view, c.out(), workspace.view(), nullptr);
      },
      "q_device shape [3, 4, 128] != configured [batch = 3, q_heads = 8, head_dim = 128]");
}

}  // namespace
}  // namespace kvsift
