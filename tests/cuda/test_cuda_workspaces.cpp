// Every CUDA workspace API through tests/workspace_check.hpp (issue 19): its size query, a buffer one block
// short and a misaligned one (refused, nothing written), the exact size with 0xff and 0x00 contents, and the
// call captured in a CUDA graph and replayed twice (the same bytes each time); the result then against the CPU
// twin or an fp64 reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>
#include <string>

#include "gather_problem.hpp"
#include "gpu_test.hpp"
#include "inverted_lists_problem.hpp"
#include "kvsift/cpu/gather.hpp"
#include "kvsift/cpu/inverted_lists.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/topk.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/cuda/decode.hpp"
#include "kvsift/cuda/gather.hpp"
#include "kvsift/cuda/inverted_lists.hpp"
#include "kvsift/cuda/primitives.hpp"
#include "kvsift/cuda/topk.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/selectors/streaming_llm/streaming_llm.hpp"
#include "kvsift/step/decode_step.hpp"
#include "selector_check.hpp"
#include "workspace_check.hpp"

namespace kvsift::test {
namespace {

constexpr AttentionWindow kWindow{4, 16};

class CudaWorkspaces : public GpuTest {};

template <class... B>
auto poison_all(B&... buffers) {
  return [&buffers...] { (buffers.poison(), ...); };
}
template <class... B>
auto download_all(const B&... buffers) {
  return [&buffers...] { return bytes_of(buffers.download()...); };
}

TEST_F(CudaWorkspaces, TopKRows) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t batch = 3, kv_heads = 2, max_tokens = 700, k = 24;
  const AttentionWindow window{2, 5};
  for (const std::int32_t heads_per_row : {1, 2}) {
    SCOPED_TRACE(testing::Message() << "heads_per_row " << heads_per_row);
    const std::int64_t score_rows = std::int64_t(batch) * kv_heads * heads_per_row;
    const auto scores = rng.normal(std::size_t(score_rows) * max_tokens);
    std::vector<std::int32_t> lengths(batch);
    for (auto& l : lengths) l = rng.uniform_int(0, max_tokens);
    const std::int32_t capacity = heads_per_row * k;
    DeviceBuffer<float> d_scores(scores);
    DeviceBuffer<std::int32_t> d_lengths(lengths), indices(std::size_t(batch) * kv_heads * capacity),
        counts(std::size_t(batch) * kv_heads);
    DeviceBuffer<float> weights(indices.size());
    const TopKRowsOptions options{.window = window, .heads_per_row = heads_per_row};
    const SelectionView out{indices.data(), counts.data(), weights.data(), batch, kv_heads, capacity};
    check_device_workspace(
        cuda::topk_rows_workspace_bytes(score_rows, max_tokens, k, options),
        [&](std::span<std::byte> ws, cudaStream_t stream) {
          cuda::topk_rows(MatrixView<const float>::packed(d_scores.data(), score_rows, max_tokens), d_lengths.data(),
                          k, options, out, ws, stream);
        },
        download_all(indices, counts, weights), poison_all(indices, counts, weights));

    HostSelection want(batch, kv_heads, capacity, /*with_weights=*/true);
    cpu::Array<std::byte> cpu_ws(cpu::topk_rows_workspace_bytes(score_rows, max_tokens, k, options, nullptr));
    cpu::topk_rows(MatrixView<const float>::packed(scores.data(), score_rows, max_tokens), lengths.data(), k, options,
                   want.view, cpu_ws.bytes());
    const auto got_counts = counts.download();
    const auto got_indices = indices.download();
    const auto got_weights = weights.download();
    EXPECT_EQ(got_counts, want.counts);
    for (std::size_t s = 0; s < want.counts.size(); ++s) {
      for (std::int32_t i = 0; i < want.counts[s]; ++i) {
        EXPECT_EQ(got_indices[s * capacity + i], want.indices[s * capacity + i]) << "row " << s << " entry " << i;
        EXPECT_EQ(got_weights[s * capacity + i], 0.0f) << "row " << s << " entry " << i;
      }
    }
  }
}

/// A half problem (contiguous cache, ragged lengths) and its device copy.
template <class T>
struct DeviceProblem {
  HostDecodeProblem<T> p;
  DeviceBuffer<T> q, k, v;
  DeviceBuffer<std::int32_t> seq_lens, sel_indices, sel_counts, slots;
  DeviceBuffer<float> sel_weights;
  std::vector<std::int32_t> host_slots;

  DeviceProblem(Random& rng, const CaseSpec& spec) : p(rng, spec), host_slots(std::size_t(spec.batch)) {
    q = DeviceBuffer<T>(p.q);
    k = DeviceBuffer<T>(p.k);
    v = DeviceBuffer<T>(p.v);
    seq_lens = DeviceBuffer<std::int32_t>(p.kv_values.seq_lens);
    if (spec.k > 0) {
      sel_indices = DeviceBuffer<std::int32_t>(p.sel_indices);
      sel_counts = DeviceBuffer<std::int32_t>(p.sel_counts);
      if (spec.log_weights) sel_weights = DeviceBuffer<float>(p.sel_weights);
    }
    std::iota(host_slots.begin(), host_slots.end(), 0);
    std::shuffle(host_slots.begin(), host_slots.end(), rng.engine);
    slots = DeviceBuffer<std::int32_t>(host_slots);
  }
  const CaseSpec& spec() const { return p.spec; }
  QueryView<const T> q_view() const { return QueryView<const T>::packed(q.data(), spec().batch, spec().q_heads, spec().head_dim); }
  ContiguousKVView<T> cache() const {
    return ContiguousKVView<T>::packed(k.data(), v.data(), spec().batch, spec().kv_heads, spec().tokens,
                                       spec().head_dim, seq_lens.data());
  }
  ContiguousKVView<const T> kv() const {
    return ContiguousKVView<const T>::packed(k.data(), v.data(), spec().batch, spec().kv_heads, spec().tokens,
                                             spec().head_dim, seq_lens.data());
  }
  SelectionView selection() const {
    return {sel_indices.data(), sel_counts.data(), spec().log_weights ? sel_weights.data() : nullptr, spec().batch,
            spec().kv_heads, spec().k};
  }
  SelectorLimits limits() const {
    return {.max_slots = spec().batch, .max_tokens = spec().tokens, .q_heads = spec().q_heads,
            .kv_heads = spec().kv_heads, .head_dim = spec().head_dim};
  }
};

TEST_F(CudaWorkspaces, GroupScores) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  DeviceProblem<half> d(rng, CaseSpec{.batch = 2, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .tokens = 1500,
                                      .k = 0, .page_size = 0, .log_weights = false});
  const auto& c = d.spec();
  const std::int64_t rows = std::int64_t(c.batch) * c.kv_heads;
  const std::int32_t cols = c.tokens;
  DeviceBuffer<float> scores(std::size_t(rows) * cols);
  for (const bool softmax : {false, true}) {
    SCOPED_TRACE(testing::Message() << "softmax " << softmax);
    const GroupScoreOptions options{.reduce = GroupReduce::max, .softmax = softmax};
    check_device_workspace(
        cuda::group_scores_workspace_bytes(c.batch, c.q_heads, c.kv_heads, cols, options),
        [&](std::span<std::byte> ws, cudaStream_t stream) {
          cuda::group_scores(d.q_view(), d.kv(), MatrixView<float>::packed(scores.data(), rows, cols), options, ws,
                             stream);
        },
        download_all(scores), poison_all(scores));
    std::vector<float> want(scores.size(), kPoison);
    cpu::Array<std::byte> cpu_ws(cpu::group_scores_workspace_bytes(c.batch, c.q_heads, c.kv_heads, cols, options));
    cpu::group_scores(d.p.q_view(), d.p.contiguous(), MatrixView<float>::packed(want.data(), rows, cols), options,
                      cpu_ws.bytes());
    const auto got = scores.download();
    for (std::int32_t b = 0; b < c.batch; ++b) {
      for (std::int32_t g = 0; g < c.kv_heads; ++g) {
        const std::size_t row = std::size_t(b) * c.kv_heads + g;
        for (std::int32_t t = 0; t < d.p.kv_values.seq_lens[b]; ++t) {
          // the twins sum fp32 dot products of 64 terms in different orders: a few ulps of the scores' scale
          EXPECT_NEAR(got[row * cols + t], want[row * cols + t], 1e-4 * (1 + std::abs(want[row * cols + t])))
              << "row " << row << " token " << t;
        }
      }
    }
  }
}

/// union_lists over inverted lists in device memory, against its CPU twin (whose tests check it against std::set
/// references): 4 lists of 33 take the one-CTA-per-row path, 4 of 2600 (over 10,240 entries) the segmented sort,
/// the path that uses the workspace.
TEST_F(CudaWorkspaces, UnionLists) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const std::int32_t list_capacity : {33, 2600}) {
    SCOPED_TRACE(testing::Message() << "lists of " << list_capacity);
    ListsProblem<half> p(rng, 5, 2, 9, list_capacity, 4, 10 * list_capacity, /*with_scores=*/false);
    const std::int32_t rows = p.batch * p.kv_heads, capacity = p.chosen.view.capacity * p.list_capacity;
    DeviceBuffer<std::int32_t> ids(p.ids), counts(p.counts), cursors(p.cursors), slots(p.slots), lengths(p.lengths),
        chosen_indices(p.chosen.indices), chosen_counts(p.chosen.counts);
    const InvertedListsView<const half> lists{ids.data(), nullptr, counts.data(), cursors.data(), p.slot_count,
                                              p.kv_heads, p.lists, p.list_capacity};
    SelectionView chosen = p.chosen.view;
    chosen.indices = chosen_indices.data();
    chosen.counts = chosen_counts.data();
    DeviceBuffer<std::int32_t> out_indices(std::size_t(rows) * capacity), out_counts(static_cast<std::size_t>(rows));
    DeviceBuffer<float> out_weights(out_indices.size());
    const SelectionView out{out_indices.data(), out_counts.data(), out_weights.data(), p.batch, p.kv_heads, capacity};
    check_device_workspace(
        cuda::list_reduction_workspace_bytes(rows, p.chosen.view.capacity, p.list_capacity),
        [&](std::span<std::byte> ws, cudaStream_t stream) {
          cuda::union_lists(lists, chosen, slots.data(), lengths.data(), p.window, out, ws, stream);
        },
        download_all(out_indices, out_counts, out_weights), poison_all(out_indices, out_counts, out_weights));

    HostSelection want(p.batch, p.kv_heads, capacity, /*with_weights=*/true);
    cpu::Array<std::byte> cpu_ws(cpu::list_reduction_workspace_bytes(rows, p.chosen.view.capacity, p.list_capacity));
    cpu::union_lists(p.view().as_const(), p.chosen.view, p.slots.data(), p.lengths.data(), p.window, want.view,
                     cpu_ws.bytes());
    const auto got_counts = out_counts.download(), got_indices = out_indices.download();
    const auto got_weights = out_weights.download();
    ASSERT_EQ(got_counts, want.counts);
    for (std::int32_t r = 0; r < rows; ++r) {
      const auto first = std::ptrdiff_t(r) * capacity, last = first + want.counts[r];
      EXPECT_TRUE(std::equal(got_indices.begin() + first, got_indices.begin() + last, want.indices.begin() + first))
          << "row " << r;
      EXPECT_EQ(std::memcmp(got_weights.data() + first, want.log_weights.data() + first,
                            std::size_t(last - first) * sizeof(float)),
                0)
          << "row " << r;
      // entries past the count are not written: still the poison (all bits set: -1)
      EXPECT_TRUE(std::all_of(got_indices.begin() + last, got_indices.begin() + first + capacity,
                              [](std::int32_t i) { return i == -1; }))
          << "row " << r << ": written past the count";
    }
  }
}

/// One gather_kv_difference step after a first one (tokens kept, dropped and added), the source K/V and lengths
/// in pinned host memory read through their mapped pointers, against the CPU twin bit for bit.
TEST_F(CudaWorkspaces, GatherKvDifferenceFromPinnedHost) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::vector<std::int32_t> lens = {700, 40, 1000};
  const std::int32_t batch = 3, kv_heads = 2, head_dim = 128, tokens = 1000, cap = 96, resident_cap = 110;
  const std::int32_t rows = batch * kv_heads;
  const HostKV src_f(rng, batch, kv_heads, tokens, head_dim, lens);
  const auto k = to_storage<half>(src_f.k), v = to_storage<half>(src_f.v);
  const PinnedBuffer<half> pinned_k(k), pinned_v(v);
  const PinnedBuffer<std::int32_t> pinned_lens(lens);
  const auto host_source = ContiguousKVView<const half>::packed(k.data(), v.data(), batch, kv_heads, tokens, head_dim,
                                                                lens.data());
  const auto pinned_source = ContiguousKVView<const half>::packed(pinned_k.data(), pinned_v.data(), batch, kv_heads,
                                                                  tokens, head_dim, pinned_lens.data());
  // The host twin's state after a first step from an empty previous selection; the device starts from it.
  std::vector<half> res_k(std::size_t(rows) * resident_cap * head_dim), res_v(res_k.size());
  const auto host_resident = [&] {
    return ContiguousKVView<half>::packed(res_k.data(), res_v.data(), batch, kv_heads, resident_cap, head_dim);
  };
  HostSelection prev(batch, kv_heads, cap, false), cur(batch, kv_heads, cap, false);
  std::fill(prev.counts.begin(), prev.counts.end(), 0);
  std::vector<std::int32_t> prev_slots(prev.indices.size(), kPoisonIndex), cur_slots(prev_slots), copied(rows);
  cpu::Array<std::byte> cpu_ws(cpu::gather_kv_difference_workspace_bytes(batch, kv_heads, cap, resident_cap));
  const auto cpu_step = [&] {
    std::fill(cur_slots.begin(), cur_slots.end(), -1);  // the device poison, for entries past the counts
    cpu::gather_kv_difference(KVCache<const half>(host_source), prev.view, prev_slots.data(), cur.view,
                              cur_slots.data(), host_resident(), copied.data(), cpu_ws.bytes());
  };
  next_selection(rng, prev, cur, lens);
  cpu_step();
  prev.indices = cur.indices;
  prev.counts = cur.counts;
  prev_slots = cur_slots;
  next_selection(rng, prev, cur, lens);

  DeviceBuffer<std::int32_t> d_prev_idx(prev.indices), d_prev_cnt(prev.counts), d_prev_slots(prev_slots),
      d_cur_idx(cur.indices), d_cur_cnt(cur.counts), d_cur_slots(cur_slots.size()), d_copied(copied.size());
  DeviceBuffer<half> d_res_k(res_k), d_res_v(res_v);
  SelectionView d_prev = prev.view, d_cur = cur.view;
  d_prev.indices = d_prev_idx.data();
  d_prev.counts = d_prev_cnt.data();
  d_cur.indices = d_cur_idx.data();
  d_cur.counts = d_cur_cnt.data();
  const auto d_resident = ContiguousKVView<half>::packed(d_res_k.data(), d_res_v.data(), batch, kv_heads,
                                                         resident_cap, head_dim);
  const auto resident_k = res_k, resident_v = res_v;
  check_device_workspace(
      cuda::gather_kv_difference_workspace_bytes(batch, kv_heads, cap, resident_cap),
      [&](std::span<std::byte> ws, cudaStream_t stream) {
        cuda::gather_kv_difference(KVCache<const half>(pinned_source), d_prev, d_prev_slots.data(), d_cur,
                                   d_cur_slots.data(), d_resident, d_copied.data(), ws, stream);
      },
      download_all(d_cur_slots, d_copied, d_res_k, d_res_v),
      [&] {  // the resident buffer is updated in place: restored, as the first step left it
        d_cur_slots.poison();
        d_copied.poison();
        d_res_k.upload(resident_k);
        d_res_v.upload(resident_v);
      });
  cpu_step();
  EXPECT_EQ(d_copied.download(), copied);
  EXPECT_EQ(d_cur_slots.download(), cur_slots);  // entries past the counts: -1 (poison) on both
  EXPECT_TRUE(same_bytes(d_res_k.download(), res_k)) << "resident K";
  EXPECT_TRUE(same_bytes(d_res_v.download(), res_v)) << "resident V";
}

/// One sequence per row whose selection plus window holds 2520 tokens: the planner splits it (or num_splits
/// forces 4 splits), so the decode workspace holds partial states with the merge kernel (SplitMerge::kernel; a
/// cluster merge, automatic on a GPU that places the clusters, needs none).
DeviceProblem<bfloat16> long_rows(Random& rng) {
  return DeviceProblem<bfloat16>(rng, CaseSpec{.batch = 1, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
                                               .tokens = 3000, .k = 2500, .page_size = 0, .log_weights = true,
                                               .random_lengths = false, .window = kWindow});
}

template <class Call>
void check_decode(const DeviceProblem<bfloat16>& d, std::size_t bytes, Call decode, const HostState& ref) {
  const auto& c = d.spec();
  DeviceBuffer<bfloat16> o(std::size_t(c.batch) * c.q_heads * c.head_dim);
  DeviceBuffer<float> lse(std::size_t(c.batch) * c.q_heads);
  const auto out = StateView<bfloat16>::packed(o.data(), lse.data(), c.batch, c.q_heads, c.head_dim);
  check_device_workspace(
      bytes, [&](std::span<std::byte> ws, cudaStream_t stream) { decode(out, ws, stream); }, download_all(o, lse),
      poison_all(o, lse));
  expect_close<bfloat16>(o.download(), lse.download(), ref, "decode output");
}

TEST_F(CudaWorkspaces, SparseDecode) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  auto d = long_rows(rng);
  const auto& c = d.spec();
  const HostState ref = d.p.reference(/*sparse=*/true);
  for (const auto& [num_splits, merge] : {std::pair{0, cuda::SplitMerge::automatic}, std::pair{4, cuda::SplitMerge::automatic},
                                         std::pair{0, cuda::SplitMerge::kernel}, std::pair{4, cuda::SplitMerge::kernel}}) {
    SCOPED_TRACE(testing::Message() << "num_splits " << num_splits << ", split_merge " << cuda::split_merge_name(merge));
    const cuda::DecodeOptions options{.attention = {.window = c.window}, .num_splits = num_splits, .split_merge = merge};
    const std::size_t bytes = cuda::sparse_decode_workspace_bytes(d.q_view(), d.kv(), d.selection(), options);
    // The shape-only query (a decode step's plan) must give the same bytes for these shapes.
    EXPECT_EQ(cuda::sparse_decode_workspace_bytes(
                  cuda::SparseDecodeShape{c.batch, c.q_heads, c.kv_heads, c.head_dim, c.k}, options),
              bytes);
    check_decode(d, bytes,
                 [&](const StateView<bfloat16>& out, std::span<std::byte> ws, cudaStream_t stream) {
                   cuda::sparse_decode(d.q_view(), d.kv(), d.selection(), out, ws, stream, options);
                 },
                 ref);
  }
}

TEST_F(CudaWorkspaces, DenseDecode) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  auto d = long_rows(rng);
  const HostState ref = d.p.reference(/*sparse=*/false);
  for (const auto& [num_splits, merge] : {std::pair{0, cuda::SplitMerge::automatic}, std::pair{4, cuda::SplitMerge::automatic},
                                         std::pair{0, cuda::SplitMerge::kernel}, std::pair{4, cuda::SplitMerge::kernel}}) {
    SCOPED_TRACE(testing::Message() << "num_splits " << num_splits << ", split_merge " << cuda::split_merge_name(merge));
    const cuda::DecodeOptions options{.num_splits = num_splits, .split_merge = merge};
    check_decode(d, cuda::dense_decode_workspace_bytes(d.q_view(), d.kv(), options),
                 [&](const StateView<bfloat16>& out, std::span<std::byte> ws, cudaStream_t stream) {
                   cuda::dense_decode(d.q_view(), d.kv(), out, ws, stream, options);
                 },
                 ref);
  }
}

struct DeviceSelection {
  std::vector<std::int32_t> indices, counts;
};

/// A selector's append and select through the driver on problem d (prepared first), the select planned for
/// sequences of up to max_seq_len tokens; returns the selection.
template <class S>
DeviceSelection check_selector(S& selector, DeviceProblem<bfloat16>& d, std::int32_t max_seq_len) {
  const auto& c = d.spec();
  const SelectShape shape{c.batch, c.q_heads, c.kv_heads, c.head_dim, max_seq_len};
  const KVCache<const bfloat16> cache = d.kv();
  selector.prepare({.cache = cache, .slots = d.slots.data()}, cuda::Context{});
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  check_device_workspace(
      selector.append_workspace_bytes(shape, cuda::Context{}),
      [&](std::span<std::byte> ws, cudaStream_t stream) {
        selector.append({.cache = cache, .slots = d.slots.data(), .lengths = d.seq_lens.data()}, ws,
                        cuda::Context{stream});
      },
      [] { return std::vector<std::byte>{}; }, [] {});
  const std::int32_t capacity = std::max(1, selector.capacity());  // as DecodeStep sizes it
  DeviceBuffer<std::int32_t> indices(std::size_t(c.batch) * c.kv_heads * capacity),
      counts(std::size_t(c.batch) * c.kv_heads);
  const SelectionView out{indices.data(), counts.data(), nullptr, c.batch, c.kv_heads, capacity};
  check_device_workspace(
      selector.select_workspace_bytes(shape, cuda::Context{}),
      [&](std::span<std::byte> ws, cudaStream_t stream) {
        selector.select({.q = d.q_view(), .cache = cache, .slots = d.slots.data(), .lengths = d.seq_lens.data(),
                         .attention = {.window = kWindow}, .max_seq_len = max_seq_len},
                        out, ws, cuda::Context{stream});
      },
      download_all(indices, counts), poison_all(indices, counts));
  return {indices.download(), counts.download()};
}

DeviceProblem<bfloat16> selector_problem(Random& rng) {
  return DeviceProblem<bfloat16>(rng, CaseSpec{.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
                                               .tokens = 1500, .k = 0, .page_size = 0, .log_weights = false});
}

TEST_F(CudaWorkspaces, OracleTopKSelectAndAppend) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  auto d = selector_problem(rng);
  OracleTopK<bfloat16, cuda::Context> selector(d.limits(), {.budget = 64});
  const auto sel = check_selector(selector, d, d.spec().tokens);
  expect_oracle_selection(d.p, sel.indices, sel.counts, 64, 64, kWindow, 1.0 / std::sqrt(128.0));
}

TEST_F(CudaWorkspaces, QuestSelectAndAppend) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  auto d = selector_problem(rng);
  Quest<bfloat16, cuda::Context> selector(d.limits(), {.budget = 128, .page_size = 16});
  const auto sel = check_selector(selector, d, d.spec().tokens);
  expect_quest_selection(d.p, sel.indices, sel.counts, 128, 8, 16, kWindow);
}

TEST_F(CudaWorkspaces, StreamingLLMSelectAndAppend) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  auto d = selector_problem(rng);
  StreamingLLM<bfloat16, cuda::Context> selector(d.limits());
  const auto sel = check_selector(selector, d, d.spec().tokens);
  EXPECT_EQ(sel.counts, std::vector<std::int32_t>(sel.counts.size(), 0));
}

/// A select planned for fewer tokens than the longest sequence (SelectShape::max_seq_len) takes a selector built
/// for that bound's workspace and marks each row past the bound with count -1 (a device length the host cannot
/// see): never a cut row. OracleTopK's other rows against the fp64 reference; Quest's (bounds per page) equal to
/// the run planned for every token; a sequence within Quest's last planned page is selected in full.
TEST_F(CudaWorkspaces, SelectPlannedForFewerTokens) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  auto d = selector_problem(rng);
  const auto& c = d.spec();
  const auto& lens = d.p.kv_values.seq_lens;
  const std::int32_t longest = *std::max_element(lens.begin(), lens.end());
  SelectorLimits tight = d.limits();
  {
    const std::int32_t bound = longest - 1;
    tight.max_tokens = bound;
    OracleTopK<bfloat16, cuda::Context> selector(d.limits(), {.budget = 64});
    const SelectShape shape{c.batch, c.q_heads, c.kv_heads, c.head_dim, bound};
    EXPECT_EQ(selector.select_workspace_bytes(shape, {}),
              (OracleTopK<bfloat16, cuda::Context>(tight, {.budget = 64}).select_workspace_bytes(shape, {})));
    const auto sel = check_selector(selector, d, bound);
    for (std::int32_t b = 0; b < c.batch; ++b) {
      for (std::int32_t g = 0; g < c.kv_heads; ++g) {
        const std::int32_t row = b * c.kv_heads + g;
        if (lens[b] > bound) {
          EXPECT_EQ(sel.counts[row], -1) << "OracleTopK row " << row << " of length " << lens[b] << " > " << bound;
          continue;
        }
        const auto scores = oracle_scores(d.p, b, g, 1.0 / std::sqrt(128.0));
        std::map<std::int32_t, double> middle;
        for (std::int32_t t = kWindow.sink_end(lens[b]); t < kWindow.recent_begin(lens[b]); ++t) middle[t] = scores[t];
        expect_top_k(selection_row(sel.indices, sel.counts, row, 64), middle, 64,
                     1e-4 * *std::max_element(scores.begin(), scores.end()), "OracleTopK row " + std::to_string(row));
      }
    }
  }
  {
    // One page short of the longest sequence's pages; a bound inside a page plans the whole page.
    const std::int32_t page_size = 16, bound = (longest - 1) / page_size * page_size - 3;
    const QuestConfig config{.budget = 128, .page_size = page_size};
    tight.max_tokens = bound;
    Quest<bfloat16, cuda::Context> selector(d.limits(), config);
    const SelectShape shape{c.batch, c.q_heads, c.kv_heads, c.head_dim, bound};
    EXPECT_EQ(selector.select_workspace_bytes(shape, {}),
              (Quest<bfloat16, cuda::Context>(tight, config).select_workspace_bytes(shape, {})));
    const auto whole = check_selector(selector, d, 0);
    const auto sel = check_selector(selector, d, bound);
    const std::int32_t planned_pages = (bound + page_size - 1) / page_size;
    for (std::int32_t b = 0; b < c.batch; ++b) {
      for (std::int32_t g = 0; g < c.kv_heads; ++g) {
        const std::int32_t row = b * c.kv_heads + g;
        if ((lens[b] + page_size - 1) / page_size > planned_pages) {
          EXPECT_EQ(sel.counts[row], -1) << "Quest row " << row << " of length " << lens[b] << " > " << bound;
          continue;
        }
        EXPECT_EQ(selection_row(sel.indices, sel.counts, row, 128),
                  selection_row(whole.indices, whole.counts, row, 128))
            << "Quest row " << row << " of length " << lens[b];
      }
    }
  }
}

TEST_F(CudaWorkspaces, DecodeStep) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  auto d = selector_problem(rng);
  const auto& c = d.spec();
  const DecodeStepConfig config{.attention = {.window = kWindow}, .max_batch = c.batch, .q_heads = c.q_heads,
                                .kv_heads = c.kv_heads, .head_dim = c.head_dim, .max_seq_len = c.tokens};
  DecodeStep step(OracleTopK<bfloat16, cuda::Context>(d.limits(), {.budget = 64}), config, cuda::Context{});
  step.prepare({.cache = d.kv(), .slots = d.slots.data()}, cuda::Context{});
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  const StepInputs<bfloat16> in{.q = d.q_view(), .cache = d.cache(), .slots = d.slots.data()};
  DeviceBuffer<bfloat16> o(std::size_t(c.batch) * c.q_heads * c.head_dim);
  DeviceBuffer<float> lse(std::size_t(c.batch) * c.q_heads);
  const auto out = StateView<bfloat16>::packed(o.data(), lse.data(), c.batch, c.q_heads, c.head_dim);
  const auto result = check_device_workspace(
      step.workspace_bytes(),
      [&](std::span<std::byte> ws, cudaStream_t stream) { step.run(in, out, ws, cuda::Context{stream}); },
      download_all(o, lse), poison_all(o, lse));

  // The selection lives in the workspace: one more run over a workspace kept here shows it, for the references.
  DeviceBuffer<std::byte> workspace(step.workspace_bytes());
  workspace.poison();
  o.poison();
  lse.poison();
  const std::span<std::byte> ws{workspace.data(), workspace.size()};
  step.run(in, out, ws, cuda::Context{});
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  expect_same_bytes(bytes_of(o.download(), lse.download()), result, "a run over the test's own workspace vs the driver's");
  const SelectionView d_sel = step.selection(ws, c.batch);
  std::vector<std::int32_t> indices(std::size_t(c.batch) * c.kv_heads * d_sel.capacity), counts(std::size_t(c.batch) * c.kv_heads);
  KVSIFT_CUDA_CHECK(cudaMemcpy(indices.data(), d_sel.indices, indices.size() * 4, cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), d_sel.counts, counts.size() * 4, cudaMemcpyDeviceToHost));
  expect_oracle_selection(d.p, indices, counts, d_sel.capacity, 64, kWindow, 1.0 / std::sqrt(128.0));
  const SelectionView h_sel{indices.data(), counts.data(), nullptr, c.batch, c.kv_heads, d_sel.capacity};
  HostState ref(c.batch, c.q_heads, c.head_dim);
  reference::sparse_decode(d.p.q_view(), d.p.kv_values.view(), h_sel, ref.view, config.attention);
  expect_close<bfloat16>(o.download(), lse.download(), ref, "step output");
}

}  // namespace
}  // namespace kvsift::test
