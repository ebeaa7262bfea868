// CUDA decode attention, dense and sparse, and the LSE merge, against kvsift's fp64 reference.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>

#include "cuda/gpu_test.hpp"
#include "kvsift/cuda/decode.hpp"
#include "kvsift/cuda/detail/decode_params.hpp"
#include "kvsift/cuda/detail/decode_plan.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/cuda/check.hpp"
#include "attention_check.hpp"
#include "test_util.hpp"
#include "vllm_layout.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::Random;
using test::dtype_label;
using test::expect_close;
using test::expect_error;
using test::to_storage;
using test::CaseSpec;
using test::describe;


/// A HostDecodeProblem with device copies of everything the kernels read.
template <class T>
struct DecodeProblem {
  test::HostDecodeProblem<T> host;
  const CaseSpec& spec = host.spec;
  std::vector<std::int32_t>& sel_indices = host.sel_indices;
  std::vector<std::int32_t>& sel_counts = host.sel_counts;
  DeviceBuffer<T> d_q, d_k, d_v, d_o;
  DeviceBuffer<std::int32_t> d_lens, d_indptr, d_page_indices, d_last, d_sel_indices, d_sel_counts;
  DeviceBuffer<float> d_lse, d_sel_weights, d_o32;
  DeviceBuffer<std::uint8_t> d_sel_attend_all;

  DecodeProblem(Random& rng, const CaseSpec& c) : host(rng, c) {
    d_q = DeviceBuffer<T>(host.q);
    d_lens = DeviceBuffer<std::int32_t>(host.kv_values.seq_lens);
    if (c.page_size == 0) {
      d_k = DeviceBuffer<T>(host.k);
      d_v = DeviceBuffer<T>(host.v);
    } else {
      d_k = DeviceBuffer<T>(host.k_pages);
      d_v = DeviceBuffer<T>(host.v_pages);
      d_indptr = DeviceBuffer<std::int32_t>(host.paged_values->indptr);
      d_page_indices = DeviceBuffer<std::int32_t>(host.paged_values->indices);
      d_last = DeviceBuffer<std::int32_t>(host.paged_values->last_len);
    }
    if (c.k > 0) {
      d_sel_indices = DeviceBuffer<std::int32_t>(host.sel_indices);
      d_sel_counts = DeviceBuffer<std::int32_t>(host.sel_counts);
      if (c.log_weights) d_sel_weights = DeviceBuffer<float>(host.sel_weights);
    }
    d_o = DeviceBuffer<T>(host.q.size());
    d_o32 = DeviceBuffer<float>(host.q.size());
    d_lse = DeviceBuffer<float>(std::size_t(c.batch) * c.q_heads);
  }

  /// Copies the host selection (after changes to it) to the device, attend_all included.
  void upload_selection() {
    d_sel_indices.upload(host.sel_indices);
    d_sel_counts.upload(host.sel_counts);
    if (spec.log_weights) d_sel_weights.upload(host.sel_weights);
    if (!host.sel_attend_all.empty()) d_sel_attend_all = DeviceBuffer<std::uint8_t>(host.sel_attend_all);
  }

  QueryView<const T> device_q() const { return QueryView<const T>::packed(d_q.data(), spec.batch, spec.q_heads, spec.head_dim); }
  ContiguousKVView<const T> device_contiguous() const {
    return ContiguousKVView<const T>::packed(d_k.data(), d_v.data(), spec.batch, spec.kv_heads, spec.tokens,
                                             spec.head_dim, d_lens.data());
  }
  PagedKVView<const T> device_paged() const {
    return host.paged(d_k.data(), d_v.data(), d_indptr.data(), d_page_indices.data(), d_last.data());
  }
  SelectionView device_selection() const {
    return {d_sel_indices.data(), d_sel_counts.data(), spec.log_weights ? d_sel_weights.data() : nullptr, spec.batch,
            spec.kv_heads, spec.k, d_sel_attend_all.size() > 0 ? d_sel_attend_all.data() : nullptr};
  }
  /// The output in the storage type (TO = T) or in fp32 (TO = float).
  template <class TO = T>
  StateView<TO> device_out() const {
    if constexpr (std::is_same_v<TO, float>) {
      return StateView<float>::packed(d_o32.data(), d_lse.data(), spec.batch, spec.q_heads, spec.head_dim);
    } else {
      return StateView<T>::packed(d_o.data(), d_lse.data(), spec.batch, spec.q_heads, spec.head_dim);
    }
  }

  /// Runs sparse (k > 0) or dense decode on the device with poisoned outputs; returns (O, LSE), O in T or
  /// (TO = float) in fp32. `selection`: a device selection to attend instead of the problem's, without the
  /// problem's window.
  template <class TO = T>
  std::pair<std::vector<TO>, std::vector<float>> run(bool sparse, cuda::DecodeOptions options = {},
                                                     const SelectionView* selection = nullptr) {
    options.max_seq_len = spec.tokens;
    if (sparse && selection == nullptr) options.attention.window = spec.window;
    const SelectionView chosen = selection != nullptr ? *selection : device_selection();
    d_o.poison();
    d_o32.poison();
    d_lse.poison();
    const auto launch = [&](auto kv) {
      const std::size_t bytes = sparse ? cuda::sparse_decode_workspace_bytes(device_q(), kv, chosen, options)
                                       : cuda::dense_decode_workspace_bytes(device_q(), kv, options);
      DeviceBuffer<std::byte> workspace(bytes);
      workspace.poison();  // the workspace needs no initialization
      if (sparse) {
        cuda::sparse_decode(device_q(), kv, chosen, device_out<TO>(), {workspace.data(), bytes}, nullptr, options);
      } else {
        cuda::dense_decode(device_q(), kv, device_out<TO>(), {workspace.data(), bytes}, nullptr, options);
      }
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    };
    if (spec.page_size == 0) {
      launch(device_contiguous());
    } else {
      launch(device_paged());
    }
    if constexpr (std::is_same_v<TO, float>) {
      return {d_o32.download(), d_lse.download()};
    } else {
      return {d_o.download(), d_lse.download()};
    }
  }

  test::HostState reference(bool sparse, float sm_scale = 0.0f) { return host.reference(sparse, {.sm_scale = sm_scale}); }
};

/// Runs the case with both CTA shapes where this GPU holds them: eight warps (chosen on sm_90) and four
/// (chosen where a block gets less shared memory, e.g. sm_80/86/89, and at head_dim 256), against one
/// reference.
template <class T>
void check_case(Random& rng, const CaseSpec& spec) {
  SCOPED_TRACE(fmt::format("{} {}", dtype_label<T>(), describe(spec)));
  DecodeProblem<T> problem(rng, spec);
  const bool sparse = spec.k > 0;
  const auto reference = problem.reference(sparse);
  for (std::int32_t warps : {4, 8}) {
    if (cuda::decode_shared_bytes(spec.head_dim, warps) > std::size_t(cuda::max_shared_memory_per_block())) continue;
    const auto [o, lse] = problem.run(sparse, {.cta_warps = warps});
    expect_close(o, lse, reference, fmt::format("{}, {} warps per CTA", sparse ? "sparse" : "dense", warps));
  }
}

/// fp32 partial states merged by the fp64 reference and, from device copies, by cuda::merge_states (poisoned
/// output): the reference's state and the device's O and LSE.
struct MergedOnBoth {
  test::HostState ref;
  std::vector<float> o, lse;
};
MergedOnBoth merge_on_both(const std::vector<std::vector<float>>& os, const std::vector<std::vector<float>>& lses,
                           std::int32_t batch, std::int32_t heads, std::int32_t d) {
  std::vector<DeviceBuffer<float>> d_os, d_lses;
  std::vector<StateView<const float>> host_parts, device_parts;
  for (std::size_t i = 0; i < os.size(); ++i) {
    d_os.emplace_back(os[i]);
    d_lses.emplace_back(lses[i]);
    host_parts.push_back(StateView<const float>::packed(os[i].data(), lses[i].data(), batch, heads, d));
    device_parts.push_back(StateView<const float>::packed(d_os[i].data(), d_lses[i].data(), batch, heads, d));
  }
  MergedOnBoth merged{test::HostState(batch, heads, d), {}, {}};
  reference::merge_states<float, float>(host_parts, merged.ref.view);
  DeviceBuffer<float> o(merged.ref.o.size()), lse(merged.ref.lse.size());
  o.poison();
  lse.poison();
  cuda::merge_states<float>(device_parts, StateView<float>::packed(o.data(), lse.data(), batch, heads, d), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  merged.o = o.download();
  merged.lse = lse.download();
  return merged;
}

using CudaDecode = test::GpuTest;

TEST_F(CudaDecode, SparseMatchesReferenceAcrossTheShapeMatrix) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (std::int32_t group : {1, 4, 8}) {
    for (std::int32_t head_dim : {64, 128, 256}) {
      for (std::int32_t k_kind : {1, 17, 2048, -1}) {
        for (std::int32_t page_size : {0, 16, 64}) {
          const std::int32_t kv_heads = rng.uniform_int(1, 3);
          const std::int32_t tokens = rng.uniform_int(20, k_kind == 2048 ? 4000 : 1500);
          CaseSpec spec{rng.uniform_int(1, 8), group * kv_heads, kv_heads, head_dim, tokens,
                        k_kind == -1 ? tokens : k_kind, page_size, rng.uniform_int(0, 1) == 1};
          check_case<half>(rng, spec);
          check_case<bfloat16>(rng, spec);
        }
      }
    }
  }
}

TEST_F(CudaDecode, DenseMatchesReferenceAcrossTheShapeMatrix) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (std::int32_t group : {1, 4, 8}) {
    for (std::int32_t head_dim : {64, 128, 256}) {
      for (std::int32_t page_size : {0, 16, 64}) {
        const std::int32_t kv_heads = rng.uniform_int(1, 3);
        CaseSpec spec{rng.uniform_int(1, 8), group * kv_heads, kv_heads, head_dim, rng.uniform_int(1, 3000), 0,
                      page_size, false};
        check_case<half>(rng, spec);
        check_case<bfloat16>(rng, spec);
      }
    }
  }
}

TEST_F(CudaDecode, LongContextsUpTo128K) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (std::int32_t k : {0, 2048, 131072}) {
    for (std::int32_t page_size : {0, 64}) {
      CaseSpec spec{2, 8, 2, 128, 131072, k, page_size, k == 2048};
      check_case<bfloat16>(rng, spec);
    }
  }
  check_case<half>(rng, CaseSpec{1, 32, 8, 128, 131072, 0, 0, false, false});
}

TEST_F(CudaDecode, GroupsThatAreNotPowersOfTwoOrAreLargerThanATile) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (std::int32_t group : {3, 5, 7, 12, 16, 20, 32}) {  // 20 and 32: two tiles of 16 heads
    check_case<bfloat16>(rng, CaseSpec{2, group * 2, 2, 128, 700, 300, 0, true});
    check_case<half>(rng, CaseSpec{2, group, 1, 64, 700, 0, 16, false});
  }
}

TEST_F(CudaDecode, FullSelectionEqualsDenseBitForBit) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (std::int32_t page_size : {0, 16}) {
    DecodeProblem<bfloat16> p(rng, CaseSpec{3, 8, 2, 128, 5000, 5000, page_size, false, false});
    // Indices in order 0..n-1, so that both paths visit the same tokens in the same order.
    for (std::size_t row = 0; row < p.sel_counts.size(); ++row) {
      std::iota(p.sel_indices.begin() + row * 5000, p.sel_indices.begin() + (row + 1) * 5000, 0);
    }
    p.d_sel_indices.upload(p.sel_indices);
    const auto sparse = p.run(true), dense = p.run(false);
    EXPECT_EQ(0, std::memcmp(sparse.first.data(), dense.first.data(), sparse.first.size() * sizeof(bfloat16)));
    EXPECT_EQ(sparse.second, dense.second);
  }
}

TEST_F(CudaDecode, EmptySelectionGivesMinusInfinityAndMergesAsANoOp) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  DecodeProblem<half> p(rng, CaseSpec{2, 4, 2, 64, 300, 64, 0, false});
  std::fill(p.sel_counts.begin(), p.sel_counts.end(), 0);
  p.sel_counts[1] = 64;  // one non-empty row: (b 0, kv head 1)
  p.d_sel_counts.upload(p.sel_counts);
  const auto [o, lse] = p.run(true);
  expect_close(o, lse, p.reference(true), "mostly empty");
  // Batch 0 heads 0, 1 read kv head 0 (empty); heads 2, 3 read kv head 1; batch 1 is all empty.
  for (std::int32_t h : {0, 1, 4, 5, 6, 7}) {
    EXPECT_EQ(lse[h], -INFINITY) << "head " << h;
    for (std::int32_t c = 0; c < 64; ++c) EXPECT_EQ(to_float(o[h * 64 + c]), 0.0f);
  }
  for (std::int32_t h : {2, 3}) EXPECT_TRUE(std::isfinite(lse[h]));

  // GPU merge: (state) + (empty) == (state), bit for bit.
  DeviceBuffer<half> merged_o(o.size());
  DeviceBuffer<float> merged_lse(lse.size()), empty_lse(std::vector<float>(lse.size(), -INFINITY));
  DeviceBuffer<half> empty_o(o.size());
  empty_o.poison();
  merged_o.poison();
  merged_lse.poison();
  const auto state = StateView<const half>::packed(p.d_o.data(), p.d_lse.data(), 2, 4, 64);
  const auto empty = StateView<const half>::packed(empty_o.data(), empty_lse.data(), 2, 4, 64);
  cuda::merge_states<half>(std::vector{empty, state, empty},
                           StateView<half>::packed(merged_o.data(), merged_lse.data(), 2, 4, 64), nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const auto mo = merged_o.download();
  EXPECT_EQ(0, std::memcmp(mo.data(), o.data(), o.size() * sizeof(half)));
  EXPECT_EQ(merged_lse.download(), lse);
}

TEST_F(CudaDecode, MergeStatesMatchesReferenceMerge) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t batch = 3, heads = 5, d = 96, parts = 7;  // any head_dim: the merge has no vector loads
  std::vector<std::vector<float>> os, lses;
  for (std::int32_t i = 0; i < parts; ++i) {
    os.push_back(rng.normal(std::size_t(batch) * heads * d));
    lses.push_back(rng.normal(std::size_t(batch) * heads, 20.0f));
    if (i == 3) std::fill(lses.back().begin(), lses.back().end(), -INFINITY);
  }
  const auto [ref, got_o, got_lse] = merge_on_both(os, lses, batch, heads, d);
  for (std::size_t i = 0; i < got_o.size(); ++i) ASSERT_NEAR(got_o[i], ref.o[i], 1e-5 * (1 + std::abs(ref.o[i])));
  for (std::size_t i = 0; i < got_lse.size(); ++i) ASSERT_NEAR(got_lse[i], ref.lse[i], 1e-5 * std::abs(ref.lse[i]));
}

TEST_F(CudaDecode, SplitCountDoesNotChangeTheResultBeyondRounding) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  DecodeProblem<bfloat16> p(rng, CaseSpec{2, 8, 2, 128, 20000, 4096, 0, true});
  const auto ref = p.reference(true);
  for (std::int32_t splits : {1, 2, 7, 16, 17, 33, 4096}) {
    const auto [o, lse] = p.run(true, {.num_splits = splits});
    expect_close(o, lse, ref, fmt::format("num_splits {}", splits));
  }
  // Two GQA tiles per kv head (group 20), head_dim 64, fp16, paged.
  DecodeProblem<half> tiled(rng, CaseSpec{1, 40, 2, 64, 3000, 1500, 16, false});
  const auto tiled_ref = tiled.reference(true);
  for (std::int32_t splits : {3, 16, 17}) {
    const auto [o, lse] = tiled.run(true, {.num_splits = splits});
    expect_close(o, lse, tiled_ref, fmt::format("group 20, num_splits {}", splits));
  }
  const auto first = p.run(true), second = p.run(true);  // deterministic run to run
  EXPECT_EQ(0, std::memcmp(first.first.data(), second.first.data(), first.first.size() * sizeof(bfloat16)));
  EXPECT_EQ(first.second, second.second);
  // A plain launch (no programmatic dependent launch) computes the same bits.
  const auto plain = p.run(true, {.programmatic_launch = false});
  EXPECT_EQ(0, std::memcmp(first.first.data(), plain.first.data(), first.first.size() * sizeof(bfloat16)));
  EXPECT_EQ(first.second, plain.second);
}

// The cluster merge (SplitMerge::cluster) and the merge kernel merge the same fp32 states with the same code, so
// their outputs agree bit for bit; the merge kernel's are checked against the fp64 reference here and everywhere
// else. Shapes: sparse and dense, contiguous and paged, windows, page-level selections, log-weights, two GQA tiles
// (group 20), head_dim 64 / 128 / 256, both CTA shapes, fp32 outputs, a NaN input and a bad count row.
TEST_F(CudaDecode, ClusterMergeIsTheMergeKernelBitForBit) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  if (cuda::detail::current_device_limits().clusters[2] == 0) GTEST_SKIP() << "this GPU runs no clusters";
  const auto check = [&]<class T, class TO = T>(T, const CaseSpec& spec, cuda::DecodeOptions options, auto corrupt) {
    SCOPED_TRACE(fmt::format("{} {} {} splits {} warps {} page selections {}", dtype_label<T>(),
                             std::is_same_v<TO, float> ? "fp32 out" : "storage out", describe(spec), options.num_splits,
                             options.cta_warps, options.attention.selection_page_size));
    // A GPU that places fewer clusters than the case has rows refuses the cluster merge (the plan's test covers that).
    const std::int64_t rows = std::int64_t(spec.batch) * spec.kv_heads * ((spec.q_heads / spec.kv_heads + 15) / 16);
    if (rows > cuda::detail::current_device_limits().clusters[std::size_t(options.num_splits)]) return;
    DecodeProblem<T> p(rng, spec);
    const bool has_reference = corrupt(p);  // false where the fp64 reference does not model the input
    const bool sparse = spec.k > 0;
    options.split_merge = cuda::SplitMerge::kernel;
    const auto [o, lse] = p.template run<TO>(sparse, options);
    options.split_merge = cuda::SplitMerge::cluster;
    const auto [cluster_o, cluster_lse] = p.template run<TO>(sparse, options);
    ASSERT_EQ(o.size(), cluster_o.size());
    EXPECT_EQ(0, std::memcmp(o.data(), cluster_o.data(), o.size() * sizeof(TO)));
    EXPECT_EQ(0, std::memcmp(lse.data(), cluster_lse.data(), lse.size() * sizeof(float)));
    if constexpr (std::is_same_v<TO, T>) {
      if (has_reference && options.attention.selection_page_size == 1) {
        test::expect_close_with_nan(cluster_o, cluster_lse, p.reference(sparse), "cluster merge");
      }
    }
  };
  const auto nothing = [](auto&) { return true; };
  const auto bad_count_row = [](auto& p) {  // NaN in every head of the row (BadCountRowsAreNaN)
    p.sel_counts[1] = -1;
    p.upload_selection();
    return false;
  };
  const auto nan_key = [](auto& p) {
    test::corrupt(p.host, test::Corruption::k_nan);
    p.d_q.upload(p.host.q);
    p.d_k.upload(p.host.k);
    return true;
  };
  for (const std::int32_t splits : {2, 3, 5, 8}) {
    for (const std::int32_t warps : {4, 8}) {
      const cuda::DecodeOptions options{.num_splits = splits, .cta_warps = warps};
      check(bfloat16{}, CaseSpec{2, 8, 2, 128, 1500, 600, 0, true}, options, nothing);
      check(half{}, CaseSpec{3, 8, 2, 128, 1500, 300, 16, true, true, AttentionWindow{4, 64}}, options, nothing);
      check(bfloat16{}, CaseSpec{2, 8, 2, 128, 2000, 0, 0, false}, options, nothing);
      check(half{}, CaseSpec{1, 40, 2, 64, 3000, 1500, 16, false}, options, nothing);
      check.template operator()<bfloat16, float>(bfloat16{}, CaseSpec{2, 12, 3, 64, 900, 200, 0, true}, options,
                                                 nothing);
      check(half{}, CaseSpec{2, 8, 2, 128, 900, 48, 16, true, true, AttentionWindow{4, 32}}, options, bad_count_row);
      check(bfloat16{}, CaseSpec{2, 8, 2, 128, 1200, 600, 0, true, false}, options, nan_key);
    }
    check(bfloat16{}, CaseSpec{1, 4, 1, 256, 700, 200, 0, false}, {.num_splits = splits, .cta_warps = 4}, nothing);
    cuda::DecodeOptions pages{.attention = {.window = {4, 64}, .selection_page_size = 16}, .num_splits = splits};
    check(bfloat16{}, CaseSpec{2, 8, 2, 128, 4000, 40, 0, false, true, AttentionWindow{4, 64}}, pages,
          [](auto& p) {  // page ids: entry j of a row lists page j * 3 + 1 of the sequence's pages
            for (std::size_t r = 0; r < p.sel_counts.size(); ++r) {
              const std::int32_t len = p.host.kv_values.seq_lens[r / std::size_t(p.spec.kv_heads)];
              const std::int32_t pages = (len + 15) / 16;
              std::int32_t n = 0;
              for (std::int32_t j = 0; j < p.spec.k && j * 3 + 1 < pages; ++j) p.sel_indices[r * p.spec.k + j] = j * 3 + 1, ++n;
              p.sel_counts[r] = n;
            }
            p.upload_selection();
            return false;  // page ids (PageSelectionsAttendThePagesMiddleTokens checks them against the reference)
          });
  }
}

TEST_F(CudaDecode, ValidationModeRefusesBadIndicesAndDuplicatesAndWritesNothing) {
  for (std::int32_t page_size : {0, 16}) {
    DecodeProblem<half> p(rng, CaseSpec{3, 4, 2, 64, 500, 32, page_size, false, false});
    const auto refused = [&](const std::string& message) {
      p.d_sel_indices.upload(p.sel_indices);
      p.d_sel_counts.upload(p.sel_counts);
      expect_error([&] { p.run(true, {.validate_indices = true}); }, message);
      // run() poisons O and LSE before the call: a refused call leaves them so.
      for (half x : p.d_o.download()) ASSERT_TRUE(std::isnan(to_float(x))) << "O was written";
      for (float x : p.d_lse.download()) ASSERT_TRUE(std::isnan(x)) << "LSE was written";
    };
    const auto at = [&](std::int32_t b, std::int32_t h, std::int32_t i) -> std::int32_t& {
      return p.sel_indices[(std::size_t(b) * 2 + h) * 32 + i];
    };
    const std::int32_t saved = at(1, 1, 5);
    at(1, 1, 5) = 500;  // one past the end; a later row's error is not the one reported
    at(2, 0, 7) = -3;
    refused("selection.indices[5] (= 500) at batch 1, kv_head 1 is outside [0, seq_len = 500)");
    at(1, 1, 5) = saved;
    refused("selection.indices[7] (= -3) at batch 2, kv_head 0 is outside [0, seq_len = 500)");
    p.host.make_selection(rng);
    at(2, 1, 30) = at(2, 1, 3);
    refused(fmt::format("selection.indices[30] (= {}) at batch 2, kv_head 1 repeats selection.indices[3]", at(2, 1, 3)));
    p.host.make_selection(rng);
    p.sel_counts[0] = 33;
    refused("selection.counts (= 33) at batch 0, kv_head 0 is outside [0, capacity = 32]");
    p.sel_counts[0] = 32;
    p.d_sel_indices.upload(p.sel_indices);
    p.d_sel_counts.upload(p.sel_counts);
    const auto [o, lse] = p.run(true, {.validate_indices = true});  // clean input passes validation
    expect_close(o, lse, p.reference(true), "validated");
  }
}

TEST_F(CudaDecode, VllmBlockTablesGiveTheCsrViewsBitsAndTheirLengths) {
  // vLLM's caches as they are (tests/vllm_layout.hpp: NHD and HND, K and V separate or interleaved, shuffled blocks,
  // garbage past each row's blocks) read through PagedKVView's block-table form on the device: dense and sparse
  // decode give the bits of the CSR view of the same blocks and the reference's values; validation mode reads each
  // row's length from seq_lens.
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const test::VllmLayout layout : test::kVllmLayouts) {
    SCOPED_TRACE(test::vllm_layout_name(layout));
    DecodeProblem<half> p(rng, CaseSpec{3, 8, 2, 128, 700, 96, 0, true, true, {4, 16}});
    test::VllmCache<half> c(p.host.contiguous(), 16, layout, rng);
    const auto csr = c.csr();
    DeviceBuffer<half> d_k(c.key_cache);
    DeviceBuffer<half> d_v = c.value_cache.empty() ? DeviceBuffer<half>() : DeviceBuffer<half>(c.value_cache);
    DeviceBuffer<std::int32_t> d_tables(c.block_tables), d_lens(c.seq_lens), d_indptr(csr.indptr),
        d_indices(csr.indices), d_last(csr.last);
    const PagedKVView<const half> blocks =
        c.view_over<const half>(d_k.data(), d_v.size() > 0 ? d_v.data() : nullptr, d_tables.data(), d_lens.data());
    PagedKVView<const half> as_csr = blocks;
    as_csr.page_indptr = d_indptr.data();
    as_csr.page_indices = d_indices.data();
    as_csr.last_page_len = d_last.data();
    as_csr.block_table_stride = 0;
    as_csr.seq_lens = nullptr;
    const auto run = [&](const PagedKVView<const half>& kv, bool sparse, cuda::DecodeOptions options) {
      options.max_seq_len = p.spec.tokens;
      if (sparse) options.attention.window = p.spec.window;
      const SelectionView selection = p.device_selection();
      const std::size_t bytes = sparse ? cuda::sparse_decode_workspace_bytes(p.device_q(), kv, selection, options)
                                       : cuda::dense_decode_workspace_bytes(p.device_q(), kv, options);
      DeviceBuffer<std::byte> workspace(bytes);
      workspace.poison();
      p.d_o.poison();
      p.d_lse.poison();
      if (sparse) {
        cuda::sparse_decode(p.device_q(), kv, selection, p.device_out(), {workspace.data(), bytes}, nullptr, options);
      } else {
        cuda::dense_decode(p.device_q(), kv, p.device_out(), {workspace.data(), bytes}, nullptr, options);
      }
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
      return std::pair{p.d_o.download(), p.d_lse.download()};
    };
    for (const bool sparse : {false, true}) {
      SCOPED_TRACE(sparse ? "sparse" : "dense");
      const auto [o, lse] = run(blocks, sparse, {.validate_indices = sparse});
      const auto [csr_o, csr_lse] = run(as_csr, sparse, {});
      EXPECT_EQ(0, std::memcmp(o.data(), csr_o.data(), o.size() * sizeof(half)));
      EXPECT_EQ(0, std::memcmp(lse.data(), csr_lse.data(), lse.size() * sizeof(float)));
      expect_close(o, lse, p.reference(sparse), "block tables");
    }
    // Row (1, 0)'s first index one past its sequence's end: refused naming the length seq_lens holds.
    const std::int32_t saved = p.sel_indices[2 * 96];
    p.sel_indices[2 * 96] = c.seq_lens[1];
    p.d_sel_indices.upload(p.sel_indices);
    expect_error([&] { run(blocks, true, {.validate_indices = true}); },
                 fmt::format("selection.indices[0] (= {}) at batch 1, kv_head 0 is outside [0, seq_len = {})",
                             c.seq_lens[1], c.seq_lens[1]));
    p.sel_indices[2 * 96] = saved;
    p.d_sel_indices.upload(p.sel_indices);
  }
}

TEST_F(CudaDecode, WindowIsTheSameAsSelectingItsTokensFirst) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const AttentionWindow window : {AttentionWindow{4, 64}, AttentionWindow{300, 400}, AttentionWindow{16, 0},
                                       AttentionWindow{0, 37}}) {
    for (std::int32_t page_size : {0, 16}) {
      const CaseSpec spec{3, 8, 2, 128, rng.uniform_int(500, 3000), 300, page_size, true, true, window};
      SCOPED_TRACE(describe(spec));
      DecodeProblem<bfloat16> p(rng, spec);
      const auto ref = p.reference(true);
      const test::UnionSelection explicit_window = test::window_as_selection(p.host);
      DeviceBuffer<std::int32_t> u_indices(explicit_window.indices), u_counts(explicit_window.counts);
      DeviceBuffer<float> u_weights(explicit_window.log_weights);
      const SelectionView u{u_indices.data(), u_counts.data(), u_weights.data(), spec.batch, spec.kv_heads,
                            explicit_window.view.capacity};
      for (std::int32_t splits : {0, 5}) {
        for (std::int32_t warps : {4, 8}) {
          const auto [o, lse] = p.run(true, {.num_splits = splits, .cta_warps = warps});
          expect_close(o, lse, ref, fmt::format("{} splits, {} warps", splits, warps));
          const auto [o_union, lse_union] = p.run(true, {.num_splits = splits, .cta_warps = warps}, &u);
          EXPECT_EQ(0, std::memcmp(o.data(), o_union.data(), o.size() * sizeof(bfloat16)));
          EXPECT_EQ(lse, lse_union);
        }
      }
    }
  }
  DecodeProblem<half> w(rng, CaseSpec{1, 4, 2, 64, 500, 32, 0, false, false, {4, 64}});
  w.sel_indices[32 + 6] = 440;
  w.d_sel_indices.upload(w.sel_indices);
  expect_error([&] { w.run(true, {.validate_indices = true}); },
               "selection.indices[6] (= 440) at batch 0, kv_head 1 is in the attention window (sink [0, 4), recent "
               "[436, 500))");
  expect_error([&] { w.run(false, {.attention = {.window = {4, 64}}}); },
               "options window (sink = 4, recent = 64) applies to sparse decode");
}

/// A page-level selection (AttentionOptions::selection_page_size): each page's middle tokens against the fp64
/// reference over windows across page edges, page sizes 16 and 5, both cache layouts, splits and CTA shapes;
/// validation refuses a page past the sequence's last and a page listed twice, by position, writing nothing.
TEST_F(CudaDecode, PageSelectionsAttendThePagesMiddleTokens) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const AttentionWindow window : {AttentionWindow{4, 64}, AttentionWindow{}, AttentionWindow{300, 400},
                                       AttentionWindow{0, 37}}) {
    for (std::int32_t page_size : {16, 5}) {
      const CaseSpec spec{3, 8, 2, 128, rng.uniform_int(500, 3000), 0, std::vector{0, 16}[rng.uniform_int(0, 1)],
                          rng.uniform_int(0, 1) == 1, true, window};
      SCOPED_TRACE(fmt::format("{} selection pages of {}", describe(spec), page_size));
      DecodeProblem<bfloat16> p(rng, spec);
      const test::PagesAndTokens s = test::random_page_selection(rng, p.host, page_size, 130);
      const AttentionOptions pages{.window = window, .selection_page_size = page_size};
      test::HostState ref(spec.batch, spec.q_heads, spec.head_dim);
      reference::sparse_decode(p.host.q_view(), p.host.contiguous(), s.pages.view, ref.view, pages);
      DeviceBuffer<std::int32_t> indices(s.pages.indices), counts(s.pages.counts);
      DeviceBuffer<float> weights = spec.log_weights ? DeviceBuffer<float>(s.pages.log_weights) : DeviceBuffer<float>(1);
      const SelectionView d{indices.data(), counts.data(), spec.log_weights ? weights.data() : nullptr, spec.batch,
                            spec.kv_heads, s.pages.view.capacity};
      for (std::int32_t splits : {0, 5}) {
        for (std::int32_t warps : {4, 8}) {
          const auto [o, lse] = p.run(true, {.attention = pages, .num_splits = splits, .cta_warps = warps,
                                             .validate_indices = splits == 5}, &d);
          expect_close(o, lse, ref, fmt::format("{} splits, {} warps", splits, warps));
        }
      }
    }
  }
  DecodeProblem<half> w(rng, CaseSpec{2, 4, 2, 64, 500, 0, 0, false, false, {4, 64}});
  test::PagesAndTokens s = test::random_page_selection(rng, w.host, 16, 8);
  const std::int32_t len = w.host.kv_values.seq_lens[1], sequence_pages = (len + 15) / 16;
  const std::size_t row = 1 * 2 + 1;
  s.pages.counts[row] = 3;
  s.pages.indices[row * 8 + 0] = 0;
  s.pages.indices[row * 8 + 1] = sequence_pages - 1;
  s.pages.indices[row * 8 + 2] = sequence_pages;
  const AttentionOptions pages{.window = {4, 64}, .selection_page_size = 16};
  const auto refused = [&](const std::string& message) {
    DeviceBuffer<std::int32_t> indices(s.pages.indices), counts(s.pages.counts);
    const SelectionView d{indices.data(), counts.data(), nullptr, 2, 2, 8};
    expect_error([&] { w.run(true, {.attention = pages, .validate_indices = true}, &d); }, message);
    for (half x : w.d_o.download()) ASSERT_TRUE(std::isnan(to_float(x))) << "O was written";
    for (float x : w.d_lse.download()) ASSERT_TRUE(std::isnan(x)) << "LSE was written";
  };
  refused(fmt::format("selection.indices[2] (= {}) at batch 1, kv_head 1 is outside the sequence's pages [0, {}) "
                      "(page_size 16, seq_len {})",
                      sequence_pages, sequence_pages, len));
  s.pages.indices[row * 8 + 2] = sequence_pages - 1;
  refused(fmt::format("selection.indices[2] (= {}) at batch 1, kv_head 1 repeats selection.indices[1]",
                      sequence_pages - 1));
  expect_error([&] { w.run(false, {.attention = {.selection_page_size = 16}}); },
               "options selection_page_size (= 16) applies to sparse decode");
}

TEST_F(CudaDecode, DuplicateIndicesAcrossTheBitmapPassesAreFound) {
  // 300000 tokens: the check's shared-memory bitmap covers 262144 per pass, so the duplicate sits in the
  // second pass.
  DecodeProblem<bfloat16> p(rng, CaseSpec{1, 2, 1, 64, 300000, 64, 0, false, false});
  for (int i = 0; i < 64; ++i) p.sel_indices[i] = 4000 * i + 7;  // distinct, and none is 290000
  p.sel_indices[10] = 290000;
  p.sel_indices[50] = 290000;
  p.d_sel_indices.upload(p.sel_indices);
  expect_error([&] { p.run(true, {.validate_indices = true}); },
               "selection.indices[50] (= 290000) at batch 0, kv_head 0 repeats selection.indices[10]");
}

TEST_F(CudaDecode, DuplicatesWithoutValidationCountOncePerOccurrence) {
  DecodeProblem<bfloat16> p(rng, CaseSpec{1, 4, 1, 128, 100, 8, 0, false, false});
  std::fill(p.sel_indices.begin(), p.sel_indices.end(), 0);  // eight copies of token 0
  p.d_sel_indices.upload(p.sel_indices);
  const auto [o8, lse8] = p.run(true);
  expect_close(o8, lse8, p.reference(true), "eight copies, as the reference counts them");
  p.sel_counts[0] = 1;
  p.d_sel_counts.upload(p.sel_counts);
  const auto [o1, lse1] = p.run(true);
  for (int h = 0; h < 4; ++h) EXPECT_NEAR(lse8[h], lse1[h] + std::log(8.0f), 1e-4f);
}

TEST_F(CudaDecode, NonFiniteInputsGiveNaNWhereTheReferenceDoes) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (test::Corruption c : test::kCorruptions) {
    for (bool sparse : {true, false}) {
      if (!sparse && test::needs_log_weights(c)) continue;
      for (std::int32_t splits : {1, 5}) {  // one CTA per row, and a split merge
        const auto check = [&]<class T>(T) {
          SCOPED_TRACE(fmt::format("{}: {}, {}, {} splits", dtype_label<T>(), test::corruption_name(c),
                                   sparse ? "sparse" : "dense", splits));
          DecodeProblem<T> p(rng, CaseSpec{2, 8, 2, 128, 1200, 600, 0, true, false});
          const float scale = test::corrupt(p.host, c);
          p.d_q.upload(p.host.q);
          p.d_k.upload(p.host.k);
          p.d_v.upload(p.host.v);
          p.d_sel_weights.upload(p.host.sel_weights);
          const auto ref = p.reference(sparse, scale);
          if (c == test::Corruption::row_masked) {
            ASSERT_EQ(ref.lse[4], -INFINITY);
          } else if (sparse || c != test::Corruption::k_inf) {
            ASSERT_TRUE(std::any_of(ref.o.begin(), ref.o.end(), [](float x) { return std::isnan(x); }));
          }
          for (std::int32_t warps : {4, 8}) {
            const auto [o, lse] = p.run(sparse, {.attention = {.sm_scale = scale}, .num_splits = splits, .cta_warps = warps});
            test::expect_close_with_nan(o, lse, ref, fmt::format("{} warps", warps));
          }
        };
        check(half{});
        check(bfloat16{});
      }
    }
  }
}

TEST_F(CudaDecode, MergeCarriesNaNAndOnlyMinusInfinityIsEmpty) {
  const std::int32_t batch = 2, heads = 3, d = 20;
  std::vector<std::vector<float>> os(3), lses(3);
  for (int i = 0; i < 3; ++i) {
    os[i] = rng.normal(std::size_t(batch) * heads * d);
    lses[i] = rng.normal(std::size_t(batch) * heads, 5.0f);
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  lses[1][1 * heads + 2] = nan;
  os[2][(0 * heads + 1) * d + 7] = nan;
  lses[0][0] = lses[2][0] = -INFINITY;
  lses[1][0] = nan;  // with two empty partials: NaN, not empty
  const auto [ref, o, lse] = merge_on_both(os, lses, batch, heads, d);
  EXPECT_TRUE(std::isnan(ref.lse[0]) && std::isnan(ref.lse[5]) && std::isnan(ref.o[1 * d + 7]));
  test::expect_close_with_nan(o, lse, ref, "merge");
}

TEST_F(CudaDecode, Fp32OutputIsTheStorageOutputBeforeItsRounding) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const auto check = [&]<class T>(T, const CaseSpec& spec) {
    DecodeProblem<T> p(rng, spec);
    if (spec.k > 0) {  // one empty row: O = 0 and LSE = -inf in both outputs
      p.sel_counts[1] = 0;
      p.upload_selection();
    }
    const bool sparse = spec.k > 0;
    const auto ref = p.reference(sparse);
    for (std::int32_t splits : {1, 5}) {  // the kernel writes the fp32 output itself, or the split merge does
      SCOPED_TRACE(fmt::format("{} {}, {} splits", dtype_label<T>(), describe(spec), splits));
      const auto [o, lse] = p.run(sparse, {.num_splits = splits});
      const auto [o32, lse32] = p.template run<float>(sparse, {.num_splits = splits});
      std::vector<T> rounded(o32.size());
      for (std::size_t i = 0; i < o32.size(); ++i) rounded[i] = from_float<T>(o32[i]);
      EXPECT_EQ(0, std::memcmp(rounded.data(), o.data(), o.size() * sizeof(T)));
      EXPECT_EQ(lse32, lse);
      expect_close(rounded, lse32, ref, "fp32 output");
    }
  };
  for (std::int32_t page_size : {0, 16}) {
    check(half{}, CaseSpec{3, 8, 2, 128, 1500, 300, page_size, true, true, AttentionWindow{4, 64}});
    check(bfloat16{}, CaseSpec{2, 12, 3, 64, 900, 0, page_size, false});
    check(bfloat16{}, CaseSpec{1, 4, 1, 256, 700, 200, page_size, false});
  }
}

TEST_F(CudaDecode, MergeOfFp32PartialsRoundsOnceIntoTheStorageType) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t batch = 2, heads = 6, d = 128;
  for (std::int32_t parts : {1, 2, 17, 64}) {  // past the earlier limit of 16
    std::vector<std::vector<float>> os, lses;
    std::vector<DeviceBuffer<float>> d_os, d_lses;
    std::vector<StateView<const float>> host_parts, device_parts;
    for (std::int32_t i = 0; i < parts; ++i) {
      os.push_back(rng.normal(std::size_t(batch) * heads * d));
      lses.push_back(rng.normal(std::size_t(batch) * heads, 10.0f));
      if (i == 1) lses.back()[3] = -INFINITY;  // an empty partial of one row
      d_os.emplace_back(os.back());
      d_lses.emplace_back(lses.back());
      host_parts.push_back(StateView<const float>::packed(os.back().data(), lses.back().data(), batch, heads, d));
      device_parts.push_back(StateView<const float>::packed(d_os.back().data(), d_lses.back().data(), batch, heads, d));
    }
    const auto check = [&]<class T>(T) {
      SCOPED_TRACE(fmt::format("{} partials into {}", parts, dtype_label<T>()));
      test::HostState ref(batch, heads, d);
      reference::merge_states<float, float>(host_parts, ref.view);
      DeviceBuffer<T> o(ref.o.size());
      DeviceBuffer<float> lse(ref.lse.size());
      o.poison();
      lse.poison();
      cuda::merge_states<float, T>(device_parts, StateView<T>::packed(o.data(), lse.data(), batch, heads, d), nullptr);
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = o.download();
      const auto got_lse = lse.download();
      // Rounded once from fp32: within one unit in the last place of T of the fp64 merge.
      const double ulp = std::is_same_v<T, half> ? 0x1p-10 : 0x1p-7;
      for (std::size_t i = 0; i < got.size(); ++i) {
        ASSERT_LE(std::abs(to_float(got[i]) - ref.o[i]), ulp * std::abs(ref.o[i]) + 1e-6) << "element " << i;
      }
      for (std::size_t i = 0; i < got_lse.size(); ++i) ASSERT_NEAR(got_lse[i], ref.lse[i], 1e-5 * std::abs(ref.lse[i]) + 1e-6);
    };
    check(half{});
    check(bfloat16{});
  }
}

TEST_F(CudaDecode, ANaNWhoseWeightUnderflowsStillShows) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // merge_states: a partial 150 below the other has weight exp(-150) = 0 in fp32, yet its NaN shows.
  const std::int32_t d = 4;
  const auto [ref, o, lse] = merge_on_both({{1.0f, 1.0f, 1.0f, 1.0f}, {0.5f, nan, 0.5f, 0.5f}}, {{0.0f}, {-150.0f}}, 1, 1, d);
  ASSERT_TRUE(std::isnan(ref.o[1]));
  test::expect_close_with_nan(o, lse, ref, "merge_states");
  // The split merge: entries 512.. weigh e^-150 and one of them has a NaN in V; in two splits, the second
  // split's state weighs 0 in the merge, yet O shows the NaN.
  DecodeProblem<bfloat16> p(rng, CaseSpec{1, 1, 1, 64, 1024, 1024, 0, true, false});
  for (int i = 512; i < 1024; ++i) p.host.sel_weights[i] = -150.0f;
  p.host.v[std::size_t(p.sel_indices[900]) * 64 + 3] = from_float<bfloat16>(nan);
  p.d_v.upload(p.host.v);
  p.upload_selection();
  const auto reference_state = p.reference(true);
  ASSERT_TRUE(std::isnan(reference_state.o[3]));
  for (std::int32_t splits : {1, 2}) {
    const auto [so, slse] = p.run(true, {.num_splits = splits});
    test::expect_close_with_nan(so, slse, reference_state, fmt::format("{} splits", splits));
  }
}

TEST_F(CudaDecode, InfiniteScaleMasksTheRowsPastTheEnd) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  // Every q.k < 0, so with sm_scale = +inf every logit is -inf and the reference gives the empty state.
  // Lengths that are not multiples of a warp's 16 rows leave zero-filled rows whose 0 * inf is NaN unless
  // they are masked.
  DecodeProblem<half> p(rng, CaseSpec{2, 8, 2, 64, 37, 20, 0, false, true});
  for (auto& x : p.host.q) x = from_float<half>(std::abs(to_float(x)) + 0.01f);
  for (auto& x : p.host.k) x = from_float<half>(-std::abs(to_float(x)) - 0.01f);
  p.d_q.upload(p.host.q);
  p.d_k.upload(p.host.k);
  const float inf = std::numeric_limits<float>::infinity();
  for (bool sparse : {false, true}) {
    const auto ref = p.reference(sparse, inf);
    for (float x : ref.lse) ASSERT_EQ(x, -INFINITY);
    for (std::int32_t splits : {1, 3}) {
      SCOPED_TRACE(fmt::format("{}, {} splits", sparse ? "sparse" : "dense", splits));
      const auto [o, lse] = p.run(sparse, {.attention = {.sm_scale = inf}, .num_splits = splits});
      test::expect_close_with_nan(o, lse, ref, "half output");
      const auto [o32, lse32] = p.template run<float>(sparse, {.attention = {.sm_scale = inf}, .num_splits = splits});
      for (float x : o32) ASSERT_EQ(x, 0.0f);
      EXPECT_EQ(lse32, ref.lse);
    }
  }
  // A page-level selection whose pages hold window tokens and tokens past the end (masked entries): those are
  // masked outright too, so the state stays empty.
  const AttentionOptions pages{.sm_scale = inf, .window = {2, 5}, .selection_page_size = 16};
  std::vector<std::int32_t> page_ids(std::size_t(2) * 2 * 3), counts(std::size_t(2) * 2);
  for (std::size_t row = 0; row < counts.size(); ++row) {
    const std::int32_t len = p.host.kv_values.seq_lens[row / 2];
    counts[row] = (len + 15) / 16;  // every page of the sequence, the partial last one included
    for (std::int32_t i = 0; i < counts[row]; ++i) page_ids[row * 3 + i] = counts[row] - 1 - i;
  }
  DeviceBuffer<std::int32_t> d_pages(page_ids), d_counts(counts);
  const SelectionView d{d_pages.data(), d_counts.data(), nullptr, 2, 2, 3};
  for (std::int32_t splits : {1, 3}) {
    const auto [o32, lse32] = p.template run<float>(true, {.attention = pages, .num_splits = splits}, &d);
    for (float x : o32) ASSERT_EQ(x, 0.0f) << splits << " splits";
    for (float x : lse32) ASSERT_EQ(x, -INFINITY) << splits << " splits";
  }
}

TEST_F(CudaDecode, ValidationPassesEndOverASequenceNearTwoToThe31) {
  // The selection check covers 2^18 tokens per pass; a sequence of INT_MAX tokens takes 8192 passes, and the
  // last pass's base plus 2^18 overflowed an int (the check never returned). Only the check runs: row 1's
  // count is refused, so no K/V row is read and a tiny cache stands in for the long one.
  DeviceBuffer<half> k(64), v(64);
  DeviceBuffer<half> q(2 * 64), o(2 * 64);
  DeviceBuffer<float> lse(2);
  DeviceBuffer<std::int32_t> lens(std::vector<std::int32_t>{INT_MAX});
  const std::int32_t capacity = 4;
  DeviceBuffer<std::int32_t> indices(std::vector<std::int32_t>{5, INT_MAX - 1, INT_MAX - 2, 1 << 30, 0, 0, 0, 0});
  DeviceBuffer<std::int32_t> counts(std::vector<std::int32_t>{4, capacity + 1});
  const auto kv = ContiguousKVView<const half>::packed(k.data(), v.data(), 1, 2, INT_MAX, 64, lens.data());
  const SelectionView sel{indices.data(), counts.data(), nullptr, 1, 2, capacity};
  const auto qv = QueryView<const half>::packed(q.data(), 1, 2, 64);
  const cuda::DecodeOptions options{.validate_indices = true};
  DeviceBuffer<std::byte> workspace(cuda::sparse_decode_workspace_bytes(qv, kv, sel, options));
  expect_error(
      [&] {
        cuda::sparse_decode(qv, kv, sel, StateView<half>::packed(o.data(), lse.data(), 1, 2, 64),
                            {workspace.data(), workspace.size()}, nullptr, options);
      },
      "selection.counts (= 5) at batch 0, kv_head 1 is outside [0, capacity = 4]");
}

TEST_F(CudaDecode, AttendAllRowsAttendEveryTokenOnce) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const AttentionWindow window : {AttentionWindow{}, AttentionWindow{4, 64}}) {
    for (std::int32_t page_size : {0, 16}) {
      const auto check = [&]<class T>(T, std::int32_t head_dim) {
        // Capacity 100 against sequences of up to 3000 tokens: the split plan is sized for the selection, and
        // an attend_all row takes longer chunks.
        const CaseSpec spec{3, 8, 2, head_dim, rng.uniform_int(1000, 3000), 100, page_size, true, true, window};
        DecodeProblem<T> p(rng, spec);
        p.host.mark_attend_all(rng);  // their counts and indices are poisoned: reading them would fail
        p.upload_selection();
        const auto ref = p.reference(true);
        for (std::int32_t splits : {0, 1, 7}) {
          for (bool validate : {false, true}) {
            SCOPED_TRACE(fmt::format("{} {}, {} splits, validate {}", dtype_label<T>(), describe(spec), splits, validate));
            const auto [o, lse] = p.run(true, {.num_splits = splits, .validate_indices = validate});
            expect_close(o, lse, ref, "attend_all");
          }
        }
      };
      check(bfloat16{}, 128);
      check(half{}, 64);
    }
  }
}

TEST_F(CudaDecode, WorkspaceQueryIsExactAndGraphCaptureReplays) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  DecodeProblem<bfloat16> p(rng, CaseSpec{2, 8, 2, 128, 9000, 2048, 16, true});
  const auto expected = p.run(true, {.num_splits = 8, .split_merge = cuda::SplitMerge::kernel});
  // The merge kernel's partials live in the workspace; a cluster merge needs none (where the GPU runs clusters).
  for (const cuda::SplitMerge merge : {cuda::SplitMerge::kernel, cuda::SplitMerge::cluster}) {
    SCOPED_TRACE(fmt::format("split_merge {}", cuda::split_merge_name(merge)));
    if (merge == cuda::SplitMerge::cluster && cuda::detail::current_device_limits().clusters[8] < 4) continue;
    const cuda::DecodeOptions options{.num_splits = 8, .max_seq_len = 9000, .split_merge = merge};
    const std::size_t bytes =
        cuda::sparse_decode_workspace_bytes(p.device_q(), p.device_paged(), p.device_selection(), options);
    DeviceBuffer<std::byte> workspace(std::max<std::size_t>(bytes, 256));
    if (merge == cuda::SplitMerge::kernel) {
      ASSERT_GT(bytes, 0u);
      expect_error(
          [&] {
            cuda::sparse_decode(p.device_q(), p.device_paged(), p.device_selection(), p.device_out(),
                                {workspace.data(), bytes - 256}, nullptr, options);
          },
          "workspace too small");
    } else {
      EXPECT_EQ(bytes, 0u);
    }
    const test::Stream stream;
    const test::CapturedGraph graph(stream, [&] {
      cuda::sparse_decode(p.device_q(), p.device_paged(), p.device_selection(), p.device_out(),
                          {workspace.data(), bytes}, stream, options);
    });
    for (int replay = 0; replay < 3; ++replay) {
      p.d_o.poison();
      p.d_lse.poison();
      // Between replays another call may have used the workspace; its split counters must not confuse this one.
      if (replay == 2) workspace.poison();
      graph.launch();
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const auto o = p.d_o.download();
      EXPECT_EQ(0, std::memcmp(o.data(), expected.first.data(), o.size() * sizeof(bfloat16))) << "replay " << replay;
      EXPECT_EQ(p.d_lse.download(), expected.second);
    }
  }
}

// Launch planning takes the GPU's limits as an argument, so its rules run here against several GPUs' limits,
// with or without a GPU: sm_90 (132 SMs, 227 KB per block), sm_80 (108 SMs, 163 KB), sm_86 (84 SMs, 99 KB).
TEST(CudaDecodePlan, SplitsAndWarpsFollowTheShapeAndTheGpusLimits) {
  using cuda::detail::DeviceLimits;
  const DeviceLimits h100{132, 232448}, a100{108, 166912}, rtx{84, 101376};
  const auto plan = [](const DeviceLimits& gpu, std::int64_t rows, std::int32_t tokens, int head_dim,
                       cuda::DecodeOptions options = {}) {
    const auto p = cuda::detail::plan_decode("test", rows, tokens, head_dim, options, gpu);
    return std::pair{p.num_splits, p.cta_warps};
  };
  struct Case {
    const char* why;
    DeviceLimits gpu;
    std::int64_t rows;
    std::int32_t tokens, head_dim;
    cuda::DecodeOptions options;
    std::pair<std::int32_t, std::int32_t> splits_and_warps;
  };
  const Case cases[] = {
      {"eight warps where a block gets their 198 KB", h100, 8, 2048, 128, {}, {16, 8}},
      {"four warps on sm_80 at head_dim 128", a100, 8, 2048, 128, {}, {13, 4}},
      {"eight warps on sm_80 at head_dim 64 (100 KB)", a100, 8, 2048, 64, {}, {13, 8}},
      {"eight warps on sm_86 at head_dim 64", rtx, 8, 2048, 64, {}, {10, 8}},
      {"four warps on sm_86 at head_dim 128", rtx, 8, 2048, 128, {}, {10, 4}},
      {"one CTA per SM", h100, 8, 131072, 128, {}, {16, 8}},
      {"at least 64 tokens per split", h100, 8, 256, 128, {}, {4, 8}},
      {"a single token", h100, 8, 1, 128, {}, {1, 8}},
      {"more rows than SMs", h100, 200, 131072, 128, {}, {1, 8}},
      {"rows filling a third of the SMs: short rows stay whole", h100, 64, 2048, 128, {}, {1, 8}},
      {"... up to 8191 tokens", h100, 64, 8191, 128, {}, {1, 8}},
      {"... long rows split in two", h100, 64, 8192, 128, {}, {2, 8}},
      {"four-warp CTAs split short rows too", h100, 64, 2048, 128, {.cta_warps = 4}, {2, 4}},
      {"three splits are kept", h100, 40, 2048, 128, {}, {3, 8}},
      {"the caller's choices win", h100, 64, 2048, 128, {.num_splits = 7, .cta_warps = 4}, {7, 4}},
      {"four warps at head_dim 256 (eight would need 395 KB)", h100, 8, 2048, 256, {}, {16, 4}},
  };
  for (const Case& c : cases) EXPECT_EQ(plan(c.gpu, c.rows, c.tokens, c.head_dim, c.options), c.splits_and_warps) << c.why;
  expect_error([&] { plan(a100, 8, 2048, 128, {.cta_warps = 8}); },
               "8 warps per CTA need 198144 bytes of shared memory per block at head_dim 128; this GPU allows 166912");
  expect_error([&] { plan(a100, 8, 2048, 256); },
               "4 warps per CTA need 197376 bytes of shared memory per block at head_dim 256; this GPU allows 166912");
  expect_error([&] { plan({132, 65536}, 8, 2048, 128); },
               "4 warps per CTA need 99072 bytes of shared memory per block at head_dim 128; this GPU allows 65536");
  expect_error([&] { plan(h100, 8, 2048, 128, {.cta_warps = 5}); }, "options.cta_warps (= 5) must be 0 (chosen per GPU), 4 or 8");
}

// Where split CTAs merge: in a cluster for short rows on a GPU that places every row's cluster at once (the splits
// capped at 8), else in the merge kernel; the caller's SplitMerge wins where the GPU can run it.
TEST(CudaDecodePlan, ShortRowsMergeInAClusterWhereEveryClusterFits) {
  using cuda::SplitMerge;
  using cuda::detail::DeviceLimits;
  // 132 SMs in GPCs of 16 to 18: one CTA per SM, so 16 clusters of 8, 66 of 2.
  const DeviceLimits h200{132, 232448, {0, 0, 66, 44, 32, 24, 20, 16, 16}}, no_clusters{132, 232448};
  const auto plan = [](const DeviceLimits& gpu, std::int64_t rows, std::int32_t tokens, cuda::DecodeOptions options = {}) {
    const auto p = cuda::detail::plan_decode("test", rows, tokens, 128, options, gpu);
    return std::pair{p.num_splits, p.cluster_merge};
  };
  struct Case {
    const char* why;
    DeviceLimits gpu;
    std::int64_t rows;
    std::int32_t tokens;
    cuda::DecodeOptions options;
    std::pair<std::int32_t, bool> splits_and_cluster;
  };
  const Case cases[] = {
      {"a sparse step at batch 1: 8 splits in a cluster, not 16 and a merge kernel", h200, 8, 2116, {}, {8, true}},
      {"up to kClusterMergeMaxTokens", h200, 8, 4096, {}, {8, true}},
      {"longer rows keep every SM streaming", h200, 8, 4097, {}, {16, false}},
      {"dense 128K", h200, 8, 131072, {}, {16, false}},
      {"no clusters on this GPU", no_clusters, 8, 2116, {}, {16, false}},
      {"fewer splits are not capped", h200, 20, 2116, {}, {6, true}},
      {"rows beyond the clusters of 7 the GPU holds at once: the merge kernel", h200, 17, 2116, {}, {7, false}},
      {"... and of 4", h200, 33, 2116, {}, {4, false}},
      {"one split needs no merge", h200, 64, 2116, {}, {1, false}},
      {"the caller's split count", h200, 8, 2116, {.num_splits = 3}, {3, true}},
      {"... above 8: the merge kernel", h200, 8, 2116, {.num_splits = 16}, {16, false}},
      {"the caller's merge kernel", h200, 8, 2116, {.split_merge = SplitMerge::kernel}, {16, false}},
      {"the caller's cluster merge on long rows: capped at 8", h200, 8, 131072, {.split_merge = SplitMerge::cluster}, {8, true}},
  };
  for (const Case& c : cases) EXPECT_EQ(plan(c.gpu, c.rows, c.tokens, c.options), c.splits_and_cluster) << c.why;
  expect_error([&] { plan(h200, 8, 2116, {.num_splits = 9, .split_merge = SplitMerge::cluster}); },
               "options.num_splits (= 9) exceeds 8, the most CTAs options.split_merge (= cluster) merges in a cluster");
  expect_error([&] { plan(no_clusters, 8, 2116, {.split_merge = SplitMerge::cluster}); },
               "options.split_merge (= cluster): this GPU holds 0 clusters of 8 decode CTAs at once, fewer than the 8 rows");
  expect_error([&] { plan(h200, 40, 2116, {.num_splits = 8, .split_merge = SplitMerge::cluster}); },
               "this GPU holds 16 clusters of 8 decode CTAs at once, fewer than the 40 rows");
  expect_error([&] { plan(h200, 8, 2116, {.split_merge = SplitMerge(7)}); },
               "options.split_merge (= 7) is not a SplitMerge (automatic, cluster or kernel)");
}

// Bad input is refused on the host before any device call, so these tests run without a GPU as well.
TEST(CudaDecodeBadInput, RefusedBeforeAnyDeviceCall) {
  alignas(16) static half q[2 * 8 * 128], k[2 * 2 * 64 * 128], v[2 * 2 * 64 * 128], o[2 * 8 * 128];
  static float lse[16];
  static std::int32_t indices[2 * 2 * 8], counts[4];
  const auto qv = QueryView<const half>::packed(q, 2, 8, 128);
  const auto kv = ContiguousKVView<const half>::packed(k, v, 2, 2, 64, 128);
  const auto out = StateView<half>::packed(o, lse, 2, 8, 128);
  const SelectionView sel{indices, counts, nullptr, 2, 2, 8};
  std::byte* no_workspace = nullptr;
  const auto sparse = [&](auto q_, auto kv_, SelectionView s, cuda::DecodeOptions opt = {}) {
    cuda::sparse_decode(q_, kv_, s, out, {no_workspace, 0}, nullptr, opt);
  };
  expect_error([&] { sparse(QueryView<const half>::packed(q, 2, 8, 96), ContiguousKVView<const half>::packed(k, v, 2, 2, 64, 96), sel); },
               "head_dim (= 96) is not supported by the CUDA decode kernels (supported: 64, 128, 256)");
  expect_error([&] { sparse(QueryView<const half>::packed(q + 1, 2, 8, 128), kv, sel); }, "q.data");
  expect_error([&] { sparse(QueryView<const half>::packed(q + 1, 2, 8, 128), kv, sel); }, "is not 16-byte aligned");
  auto odd_stride = kv;
  odd_stride.token_stride = 132;
  odd_stride.head_stride = 132 * 64;
  odd_stride.batch_stride = 2 * 132 * 64;
  expect_error([&] { sparse(qv, odd_stride, sel); }, "kv.k: stride 132 is not a multiple of 8 elements");
  expect_error([&] { sparse(QueryView<const half>::packed(q, 2, 5, 128), kv, sel); },
               "q.heads (= 5) is not a multiple of kv.kv_heads (= 2)");
  expect_error([&] { sparse(qv, kv, SelectionView{indices, counts, nullptr, 2, 1, 8}); },
               "selection.kv_heads (= 1) != kv.kv_heads (= 2)");
  expect_error([&] { sparse(qv, kv, SelectionView{nullptr, counts, nullptr, 2, 2, 8}); }, "selection.indices is a null pointer");
  expect_error([&] { sparse(qv, kv, SelectionView{indices, counts, nullptr, 2, 2, 0}); }, "selection.capacity (= 0) must be positive");
  expect_error([&] { sparse(qv, kv, sel, {.num_splits = -1}); }, "options.num_splits (= -1) must be >= 0");
  expect_error([&] { sparse(qv, kv, sel, {.split_merge = cuda::SplitMerge(5)}); },
               "options.split_merge (= 5) is not a SplitMerge (automatic, cluster or kernel)");
  expect_error([&] { sparse(qv, kv, sel, {.num_splits = 12, .split_merge = cuda::SplitMerge::cluster}); },
               "options.num_splits (= 12) exceeds 8, the most CTAs options.split_merge (= cluster) merges in a cluster");
  expect_error([&] { sparse(qv, kv, sel, {.attention = {.window = {2, -3}}}); },
               "cuda::sparse_decode: options.attention.window.sink (= 2) and options.attention.window.recent (= -3) must be >= 0");
  expect_error([&] { cuda::dense_decode(qv, kv, out, {no_workspace, 0}, nullptr, {.attention = {.window = {0, 8}}}); },
               "cuda::dense_decode: options window (sink = 0, recent = 8) applies to sparse decode");
  expect_error([&] { sparse(qv, kv, sel, {.cta_warps = 6}); }, "options.cta_warps (= 6) must be 0 (chosen per GPU), 4 or 8");
  static std::int32_t indptr[3] = {0, 1, 2}, pages[2] = {0, 1}, last[2] = {5, 5};
  const PagedKVView<const half> paged{k, v, indptr, pages, last, 2, 2, 128, 16, 8, 16 * 2 * 128, 2 * 128, 128};
  expect_error([&] { cuda::dense_decode(qv, paged, out, {no_workspace, 0}, nullptr); },
               "options.max_seq_len (= 0) must be positive for dense decode on a paged cache");
  expect_error([&] { cuda::merge_states<half>(std::span<const StateView<const half>>{}, out, nullptr); },
               "number of partials (= 0) is outside [1, 64]");
  const std::vector<StateView<const float>> too_many(65, StateView<const float>::packed(lse, lse, 2, 8, 1));
  expect_error([&] { cuda::merge_states<float>(too_many, StateView<float>::packed(lse, lse, 2, 8, 1), nullptr); },
               "cuda::merge_states: number of partials (= 65) is outside [1, 64]: one launch takes at most 64");
  static half big_o[1 * 1 * 520];
  static float big_lse[1];
  const auto wide = StateView<half>::packed(big_o, big_lse, 1, 1, 520);
  expect_error([&] { cuda::merge_states<half>(std::vector{wide.as_const()}, wide, nullptr); },
               "out.head_dim (= 520) exceeds the merge kernel's limit of 512");
}

// On a machine without a GPU (CI) a CUDA call says so in those words, naming no path of the build machine.
TEST(CudaNoDeviceBadInput, SaysNoCudaDevice) {
  if (cuda::device_available()) GTEST_SKIP() << "this machine has a CUDA device";
  alignas(16) static half q[8 * 128], k[2 * 64 * 128], v[2 * 64 * 128], o[8 * 128];
  static float lse[8];
  try {
    cuda::dense_decode(QueryView<const half>::packed(q, 1, 8, 128), ContiguousKVView<const half>::packed(k, v, 1, 2, 64, 128),
                       StateView<half>::packed(o, lse, 1, 8, 128), {}, nullptr);
    ADD_FAILURE() << "expected kvsift::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("kvsift::cuda: no CUDA device on this machine"), std::string::npos) << message;
    EXPECT_EQ(message.find("insufficient"), std::string::npos) << message;  // the runtime's driver wording
    EXPECT_EQ(message.find(".cpp"), std::string::npos) << message;           // no source path
  }
}

// A count outside [0, capacity] (a primitive's -1 for a bad device value) makes every query head of its row NaN in
// O and LSE (the window is not attended either): windowed and windowless kernels, one CTA or split rows (merged),
// O in T or fp32. Outputs start at 0, so a row left unwritten fails; the other rows match the reference.
// AttentionOptions::selection_rows (the CPU twin: test_cpu_decode.cpp, ASelectionRowMapReadsRowsInPlace): a
// selection kept by slot (5 rows, the others poisoned) read through a row map gives the reference's numbers, and bit
// for bit the kernel's own on the rows copied into batch order, unsplit and split, validating or not. A map value
// outside the selection makes its batch row NaN, or is refused by name when validating; dense decode refuses a map.
TEST_F(CudaDecode, ASelectionRowMapReadsRowsInPlace) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  constexpr std::int32_t kSlots = 5, kBatch = 3, kKvHeads = 2;
  for (const std::int32_t splits : {1, 4}) {
    const CaseSpec spec{kBatch, 8, kKvHeads, 128, rng.uniform_int(300, 900), 48, splits == 1 ? 0 : 16, true, true,
                        {4, 32}};
    SCOPED_TRACE(describe(spec) + fmt::format(" splits {}", splits));
    DecodeProblem<half> p(rng, spec);
    const std::vector<std::int32_t> slots = test::distinct_slots(rng, kSlots, kBatch);  // batch row b's in slots[b]
    test::HostSelection store(kSlots, kKvHeads, spec.k, true);  // the other slots' rows poisoned
    test::copy_rows_by_slot(p.host.selection(), slots, store.view);
    const DeviceBuffer<std::int32_t> d_indices(store.indices), d_counts(store.counts), d_slots(slots);
    const DeviceBuffer<float> d_weights(store.log_weights);
    const SelectionView device_store{d_indices.data(), d_counts.data(), d_weights.data(), kSlots, kKvHeads, spec.k};
    const test::HostState ref = p.host.reference(true);
    for (const bool validate : {false, true}) {
      SCOPED_TRACE(fmt::format("validate {}", validate));
      const cuda::DecodeOptions options{.attention = {.window = spec.window, .selection_rows = d_slots.data()},
                                        .num_splits = splits,
                                        .validate_indices = validate};
      const auto [o, lse] = p.run(true, options, &device_store);
      test::expect_close(o, lse, ref, "row map");
      const auto [o_copy, lse_copy] = p.run(true, {.num_splits = splits, .validate_indices = validate});
      EXPECT_TRUE(std::memcmp(o.data(), o_copy.data(), o.size() * sizeof(half)) == 0);
      EXPECT_TRUE(std::memcmp(lse.data(), lse_copy.data(), lse.size() * sizeof(float)) == 0);
    }
    for (const std::int32_t bad : {-1, kSlots, 1 << 30}) {
      std::vector<std::int32_t> bad_slots = slots;
      bad_slots[1] = bad;
      const DeviceBuffer<std::int32_t> d_bad(bad_slots);
      cuda::DecodeOptions options{.attention = {.window = spec.window, .selection_rows = d_bad.data()},
                                  .num_splits = splits};
      const auto [o, lse] = p.run(true, options, &device_store);
      for (std::int32_t head = 0; head < kBatch * 8; ++head) {
        const float got = to_float(o[std::size_t(head) * 128]);
        if (head / 8 == 1) {
          EXPECT_TRUE(std::isnan(got) && std::isnan(lse[head])) << "head " << head << " map value " << bad;
        } else {
          EXPECT_NEAR(got, ref.o[std::size_t(head) * 128], 1e-2) << "head " << head;
        }
      }
      options.validate_indices = true;
      test::expect_error([&] { p.run(true, options, &device_store); },
                         fmt::format("cuda::sparse_decode: options selection_rows[1] (= {}) is outside [0, "
                                     "selection.batch = {})",
                                     bad, kSlots));
    }
  }
  // Dense decode has no selection: a map is a mistake.
  DecodeProblem<half> dense(rng, CaseSpec{2, 4, 2, 64, 100, 0, 0, false, false});
  const DeviceBuffer<std::int32_t> map(std::vector<std::int32_t>{0, 1});
  cuda::DecodeOptions options;
  options.attention.selection_rows = map.data();
  test::expect_error([&] { dense.run(false, options); }, "options selection_rows (a row map) applies to sparse decode");
}

TEST_F(CudaDecode, BadCountRowsAreNaN) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const AttentionWindow window : {AttentionWindow{}, AttentionWindow{4, 32}}) {
    for (const std::int32_t splits : {1, 4}) {
      for (const bool f32 : {false, true}) {
        const CaseSpec spec{2, 8, 2, 128, 900, 48, splits == 1 ? 0 : 16, true, true, window};
        SCOPED_TRACE(describe(spec) + fmt::format(" splits {} fp32 out {}", splits, f32));
        DecodeProblem<half> p(rng, spec);
        const std::int32_t bad_row = rng.uniform_int(0, 3);
        const std::int32_t bad_count = rng.uniform_int(0, 1) == 0 ? -1 : rng.uniform_int(49, 60);
        const test::HostState ref = [&] {
          const std::vector<std::int32_t> counts = p.sel_counts;
          p.sel_counts[bad_row] = 0;  // the reference of the other rows
          test::HostState r = p.host.reference(true);
          p.sel_counts = counts;
          return r;
        }();
        p.sel_counts[bad_row] = bad_count;
        p.upload_selection();
        const cuda::DecodeOptions options{.attention = {.window = window}, .num_splits = splits};
        KVSIFT_CUDA_CHECK(cudaMemset(p.d_o.data(), 0, p.d_o.size() * sizeof(half)));
        KVSIFT_CUDA_CHECK(cudaMemset(p.d_o32.data(), 0, p.d_o32.size() * sizeof(float)));
        KVSIFT_CUDA_CHECK(cudaMemset(p.d_lse.data(), 0, p.d_lse.size() * sizeof(float)));
        const auto launch = [&](auto kv) {
          const std::size_t bytes = cuda::sparse_decode_workspace_bytes(p.device_q(), kv, p.device_selection(), options);
          DeviceBuffer<std::byte> workspace(bytes);
          workspace.poison();
          if (f32) {
            cuda::sparse_decode(p.device_q(), kv, p.device_selection(), p.template device_out<float>(),
                                {workspace.data(), bytes}, nullptr, options);
          } else {
            cuda::sparse_decode(p.device_q(), kv, p.device_selection(), p.device_out(), {workspace.data(), bytes},
                                nullptr, options);
          }
          KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
        };
        if (spec.page_size == 0) {
          launch(p.device_contiguous());
        } else {
          launch(p.device_paged());
        }
        std::vector<float> o;
        if (f32) {
          o = p.d_o32.download();
        } else {
          for (const half x : p.d_o.download()) o.push_back(to_float(x));
        }
        const std::vector<float> lse = p.d_lse.download();
        for (std::int32_t head = 0; head < 16; ++head) {
          const bool in_bad_row = head / 4 == bad_row;
          for (std::int32_t c = 0; c < 128; ++c) {
            const float got = o[std::size_t(head) * 128 + c];
            if (in_bad_row) {
              ASSERT_TRUE(std::isnan(got)) << "head " << head << " channel " << c << " count " << bad_count;
            } else {
              ASSERT_NEAR(got, ref.o[std::size_t(head) * 128 + c], 1e-2) << "head " << head << " channel " << c;
            }
          }
          if (in_bad_row) {
            EXPECT_TRUE(std::isnan(lse[head])) << "head " << head;
          } else {
            EXPECT_NEAR(lse[head], ref.lse[head], 1e-3 * std::max(1.0f, std::abs(ref.lse[head]))) << "head " << head;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvsift
