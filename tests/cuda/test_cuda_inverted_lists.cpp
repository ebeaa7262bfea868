// CUDA inverted lists (cuda/inverted_lists.hpp) against their CPU twins (whose tests check them against std::set
// references and a plain FIFO), bit for bit: the union on both of its paths (one launch per row set, the segmented
// sort), recall_lists on both of its (the top-k in the union's launch, topk_rows then the union), and the FIFO
// replacement over several steps, fp32 and fp16 scores, outputs poisoned first. Also: the union
// captured in a CUDA graph and replayed equals the eager run, the device-value rules, and the host-side refusals
// (which run without a GPU).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "inverted_lists_problem.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/inverted_lists.hpp"
#include "kvsift/cuda/inverted_lists.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::same_bytes;
using test::ListsProblem;
using test::Random;

/// A ListsProblem's arrays on the device.
template <class T>
struct DeviceLists {
  DeviceBuffer<std::int32_t> ids, counts, cursors, slots, lengths, chosen_indices, chosen_counts, fifo_begin;
  DeviceBuffer<T> scores;
  explicit DeviceLists(const ListsProblem<T>& p)
      : ids(p.ids), counts(p.counts), cursors(p.cursors), slots(p.slots), lengths(p.lengths),
        chosen_indices(p.chosen.indices), chosen_counts(p.chosen.counts), fifo_begin(p.fifo_begin),
        scores(p.scores.empty() ? DeviceBuffer<T>() : DeviceBuffer<T>(p.scores)) {}
  void upload(const ListsProblem<T>& p) {
    ids.upload(p.ids);
    counts.upload(p.counts);
    cursors.upload(p.cursors);
    if (!p.scores.empty()) scores.upload(p.scores);
  }
  InvertedListsView<T> view(const ListsProblem<T>& p) const {
    return {ids.data(), p.scores.empty() ? nullptr : scores.data(), counts.data(), cursors.data(),
            p.slot_count, p.kv_heads, p.lists, p.list_capacity, p.fifo_begin.empty() ? nullptr : fifo_begin.data()};
  }
  SelectionView chosen(const ListsProblem<T>& p) const {
    auto v = p.chosen.view;
    v.indices = chosen_indices.data();
    v.counts = chosen_counts.data();
    return v;
  }
};

/// Device selection buffers, poisoned (indices and counts -1, weights NaN).
struct DeviceOut {
  DeviceBuffer<std::int32_t> indices, counts;
  DeviceBuffer<float> weights;
  SelectionView view;
  DeviceOut(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity)
      : indices(std::size_t(batch) * kv_heads * capacity), counts(std::size_t(batch) * kv_heads),
        weights(indices.size()) {
    view = {indices.data(), counts.data(), weights.data(), batch, kv_heads, capacity};
    poison();
  }
  void poison() {
    indices.poison();
    counts.poison();
    weights.poison();
  }
};

/// The device results equal the host ones on every written entry; entries past a count are not written.
void expect_out_equal(const test::HostSelection& cpu, const DeviceOut& gpu) {
  const auto counts = gpu.counts.download(), indices = gpu.indices.download();
  const auto weights = gpu.weights.download();
  const std::int32_t capacity = cpu.view.capacity;
  ASSERT_EQ(counts, cpu.counts);
  for (std::size_t r = 0; r < counts.size(); ++r) {
    for (std::int32_t i = 0; i < capacity; ++i) {
      const std::size_t at = r * capacity + i;
      if (i < counts[r]) {
        EXPECT_EQ(indices[at], cpu.indices[at]) << "row " << r << " entry " << i;
        EXPECT_EQ(weights[at], 0.0f);
      } else {
        EXPECT_EQ(indices[at], -1) << "written past the count";
      }
    }
  }
}

/// After a union with an append: the counts, and the entries below them (past them, the union's own launch leaves
/// its ids past the range where append_range's launch wrote fewer; rows past the capacity are -1 with their
/// entries as the union left them).
void expect_appended_equal(const test::HostSelection& cpu, const DeviceOut& gpu) {
  const auto counts = gpu.counts.download(), indices = gpu.indices.download();
  const auto capacity = std::size_t(cpu.view.capacity);
  ASSERT_EQ(counts, cpu.counts);
  for (std::size_t r = 0; r < counts.size(); ++r) {
    for (std::int32_t i = 0; i < counts[r]; ++i) {
      ASSERT_EQ(indices[r * capacity + std::size_t(i)], cpu.indices[r * capacity + std::size_t(i)])
          << "row " << r << " entry " << i;
    }
  }
}

class CudaInvertedLists : public test::GpuTest {};

/// append_range's contract written out on the host over a union's rows (the reference of UnionAppend): each row's
/// ids below its range kept, the range's tokens after them, count -1 past the capacity or for a row already -1;
/// counts_before the union's counts.
void append_reference(test::HostSelection& rows, const std::vector<std::int32_t>& slots,
                      const std::vector<std::int32_t>& first, const std::vector<std::int32_t>& lengths,
                      const AttentionWindow& window, std::vector<std::int32_t>& counts_before) {
  const std::int32_t kv_heads = rows.view.kv_heads, capacity = rows.view.capacity;
  counts_before = rows.counts;
  for (std::size_t r = 0; r < rows.counts.size(); ++r) {
    if (rows.counts[r] < 0) continue;
    const std::size_t b = r / std::size_t(kv_heads);
    const auto range = kvsift::detail::unindexed_range(first[std::size_t(slots[b])], lengths[b], window);
    std::int32_t* ids = rows.indices.data() + r * std::size_t(capacity);
    std::int32_t below = 0;
    while (below < rows.counts[r] && ids[below] < range.begin) ++below;
    const std::int32_t added = std::max(0, range.end - range.begin);
    if (std::int64_t(below) + added > capacity) {
      rows.counts[r] = -1;
      continue;
    }
    for (std::int32_t i = 0; i < added; ++i) {
      ids[below + i] = range.begin + i;
      rows.log_weights[r * std::size_t(capacity) + std::size_t(below + i)] = 0.0f;
    }
    rows.counts[r] = below + added;
  }
}

/// The union on both backends; with `append_rng`, then each slot's middle tokens from a random first on
/// (UnionAppend: in the cluster's launch on sm_90, else append_range's launch), against append_reference over the
/// CPU's union. `room`: the output's capacity past the chosen lists' entries (0 with an append: some rows pass the
/// capacity and get -1).
template <class T>
void check_union(ListsProblem<T> p, Random* append_rng = nullptr, std::int32_t room = 0) {
  DeviceLists<T> d(p);
  const std::int32_t list_capacity = p.list_capacity, rows = p.batch * p.kv_heads, capacity = 4 * list_capacity + room;
  test::HostSelection cpu_out(p.batch, p.kv_heads, capacity, true);
  cpu::Array<std::byte> cpu_ws(cpu::list_reduction_workspace_bytes(rows, 4, list_capacity));
  DeviceOut gpu(p.batch, p.kv_heads, capacity);
  DeviceBuffer<std::byte> ws(cuda::list_reduction_workspace_bytes(rows, 4, list_capacity));
  ws.poison();
  cpu::union_lists(p.view().as_const(), p.chosen.view, p.slots.data(), p.lengths.data(), p.window, cpu_out.view,
                   cpu_ws.bytes());
  if (append_rng == nullptr) {
    cuda::union_lists(d.view(p).as_const(), d.chosen(p), d.slots.data(), d.lengths.data(), p.window, gpu.view,
                      {ws.data(), ws.size()}, nullptr);
    expect_out_equal(cpu_out, gpu);
    return;
  }
  const std::int32_t longest = *std::max_element(p.lengths.begin(), p.lengths.end());
  std::vector<std::int32_t> first(std::size_t(p.slot_count));
  for (auto& f : first) f = append_rng->uniform_int(0, 3) == 0 ? 0 : append_rng->uniform_int(0, longest + 2);
  SCOPED_TRACE(fmt::format("append from [{}], room {}", fmt::join(first, ", "), room));
  std::vector<std::int32_t> want_before;
  append_reference(cpu_out, p.slots, first, p.lengths, p.window, want_before);
  DeviceBuffer<std::int32_t> d_first(first), counts_before(static_cast<std::size_t>(rows));
  counts_before.poison();
  cuda::union_lists(d.view(p).as_const(), d.chosen(p), d.slots.data(), d.lengths.data(), p.window,
                    UnionAppend{.first = d_first.data(), .counts_before = counts_before.data()}, gpu.view,
                    {ws.data(), ws.size()}, nullptr);
  EXPECT_EQ(counts_before.download(), want_before);
  expect_appended_equal(cpu_out, gpu);
}

template <class T>
void check_union(Random& rng, std::int32_t list_capacity = 33, std::int32_t max_len = 300) {
  SCOPED_TRACE(fmt::format("lists of {}, lengths up to {}", list_capacity, max_len));
  check_union(ListsProblem<T>(rng, 5, 2, 9, list_capacity, 4, max_len));
  // The union then the tokens past each slot's index: with room for every row, and with none.
  check_union(ListsProblem<T>(rng, 5, 2, 9, list_capacity, 4, max_len), &rng, max_len);
  check_union(ListsProblem<T>(rng, 5, 2, 9, list_capacity, 4, max_len), &rng, 0);
}

// The union of up to 10,240 entries per row runs as one launch: on sm_90 a cluster of 8 CTAs per row over windows
// of 262,144 ids, before it one CTA per row (a bitmap of ids below 262,144, else a block radix sort); CTKVR's C' =
// 4 lists of 2560 fill it exactly, and 4 x 3000 takes the segmented sort. Ids up to 200,003 and 262,143 (the
// bitmap's last word, one window), and up to 600,000 (three windows; 20 bits to sort).
TEST_F(CudaInvertedLists, UnionsAtTheBlockSortsBoundEqualTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const std::int32_t list_capacity : {2560, 3000}) {
    check_union<half>(rng, list_capacity, 200000);
    check_union<float>(rng, list_capacity, 5000);  // many equal ids
    check_union<half>(rng, list_capacity, 262144);
    check_union<float>(rng, list_capacity, 600000);
  }
}

// Ids on the edges of the bitmap's words and windows (31, 32, 262,143, 262,144, 524,287, 524,288) at the head of
// every list, every sequence 600,000 tokens long but the first (empty); batch row 1's ids all past the first window
// (an empty window before its ids). Also with an appended range from a random first token on.
TEST_F(CudaInvertedLists, UnionsAcrossWindowEdgesEqualTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  constexpr std::int32_t kLength = 600000;
  ListsProblem<half> p(rng, 5, 2, 9, 2560, 4, kLength);
  for (std::int32_t b = 1; b < p.batch; ++b) p.lengths[std::size_t(b)] = kLength;
  const std::vector<std::int32_t> edges = {31, 32, 262143, 262144, 524287, 524288};
  const std::size_t per_slot = std::size_t(p.kv_heads) * p.lists * p.list_capacity;
  for (std::int32_t slot = 0; slot < p.slot_count; ++slot) {
    std::int32_t* slot_ids = p.ids.data() + std::size_t(slot) * per_slot;
    if (slot == p.slots[1]) {
      for (std::size_t i = 0; i < per_slot; ++i) slot_ids[i] = 262144 + std::abs(slot_ids[i]) % (kLength - 262144);
    }
    for (std::size_t list = 0; list < per_slot / std::size_t(p.list_capacity); ++list) {
      for (std::size_t e = 0; e < edges.size(); ++e) slot_ids[list * std::size_t(p.list_capacity) + e] = edges[e];
    }
  }
  check_union(p, &rng, kLength);  // the appended range across the windows too
  check_union(std::move(p));
}

TEST_F(CudaInvertedLists, SmallUnionsEqualTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (int repeat = 0; repeat < 5; ++repeat) {
    check_union<float>(rng);
    check_union<half>(rng);
  }
}

/// recall_lists on both backends, bit for bit: chosen (poisoned first), the union with an append, counts_before.
/// With `bad_rows`, batch rows 1 and 3 get device columns outside [0, cols] (-1, cols + 1) and the CPU twin 0 columns:
/// those rows must come out -1 in chosen, the union and counts_before (topk_rows' invalid row), the others as the
/// CPU's.
template <class T>
void check_recall(Random& rng, std::int32_t lists, std::int32_t list_capacity, std::int32_t k, std::int32_t cols,
                  bool bad_rows) {
  SCOPED_TRACE(fmt::format("{} lists of {}, k {}, {} columns{}", lists, list_capacity, k, cols, bad_rows ? ", bad rows" : ""));
  ListsProblem<T> p(rng, 5, 2, lists, list_capacity, k, 300);
  test::RecallScores scores(rng, p.batch, p.kv_heads, cols);
  const std::int32_t rows = p.batch * p.kv_heads, capacity = k * list_capacity + 300;
  std::vector<std::int32_t> first(std::size_t(p.slot_count)), device_columns = scores.columns;
  for (auto& f : first) f = rng.uniform_int(0, 3) == 0 ? 0 : rng.uniform_int(0, 302);
  if (bad_rows) {
    device_columns[1] = -1;
    device_columns[3] = cols + 1;
    scores.columns[1] = scores.columns[3] = 0;
  }
  test::HostSelection cpu_chosen(p.batch, p.kv_heads, k, true), cpu_out(p.batch, p.kv_heads, capacity, true);
  std::vector<std::int32_t> cpu_before(static_cast<std::size_t>(rows));
  cpu::Array<std::byte> cpu_ws(cpu::recall_lists_workspace_bytes(rows, cols, k, list_capacity));
  cpu::recall_lists(scores.view(), scores.columns.data(), p.view().as_const(), cpu_chosen.view, p.slots.data(),
                    p.lengths.data(), p.window, UnionAppend{.first = first.data(), .counts_before = cpu_before.data()},
                    cpu_out.view, cpu_ws.bytes());
  for (const std::int32_t b : {1, 3}) {
    for (std::int32_t h = 0; bad_rows && h < p.kv_heads; ++h) {
      const std::size_t r = std::size_t(b) * p.kv_heads + std::size_t(h);
      cpu_chosen.counts[r] = cpu_out.counts[r] = cpu_before[r] = -1;
    }
  }
  DeviceLists<T> d(p);
  DeviceBuffer<float> d_scores(scores.scores);
  DeviceBuffer<std::int32_t> d_columns(device_columns), d_first(first), before(static_cast<std::size_t>(rows));
  DeviceOut chosen(p.batch, p.kv_heads, k), out(p.batch, p.kv_heads, capacity);
  before.poison();
  DeviceBuffer<std::byte> ws(cuda::recall_lists_workspace_bytes(rows, cols, k, list_capacity));
  ws.poison();
  cuda::recall_lists(MatrixView<const float>::packed(d_scores.data(), rows, cols), d_columns.data(),
                     d.view(p).as_const(), chosen.view, d.slots.data(), d.lengths.data(), p.window,
                     UnionAppend{.first = d_first.data(), .counts_before = before.data()}, out.view,
                     {ws.data(), ws.size()}, nullptr);
  EXPECT_EQ(before.download(), cpu_before);
  expect_out_equal(cpu_chosen, chosen);
  expect_appended_equal(cpu_out, out);
}

// recall_lists: in the union's cluster launch on sm_90 (up to 2048 columns, 16 chosen lists, 10,240 entries a
// row: CTKVR's C' = 4 lists of 2560 among them), else topk_rows' launch then the union's (2049 and 9000 columns,
// 17 chosen lists, 4 lists of 3000). Scores with ties, infinities, signed zeros and NaN; ragged columns; bad device columns.
TEST_F(CudaInvertedLists, RecallsEqualTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const bool bad_rows : {false, true}) {
    check_recall<half>(rng, 2048, 40, 4, 2048, bad_rows);
    check_recall<float>(rng, 2048, 8, 16, 2048, bad_rows);
    check_recall<half>(rng, 2049, 8, 4, 2049, bad_rows);
    check_recall<half>(rng, 64, 2560, 4, 64, bad_rows);
    check_recall<float>(rng, 37, 5, 1, 30, bad_rows);
    check_recall<float>(rng, 9000, 8, 4, 9000, bad_rows);
    check_recall<half>(rng, 40, 33, 17, 40, bad_rows);
    check_recall<float>(rng, 16, 3000, 4, 16, bad_rows);
  }
}

template <class T>
void check_updates(Random& rng, bool pinned) {
  ListsProblem<T> p(rng, 3, 2, 40, 70, 1, 500);  // lists longer than a warp
  if (pinned) {  // every FIFO wraps within the steps, back to its slot's first list
    p.pin(rng);
    for (std::int32_t slot = 0; slot < p.slot_count; ++slot) {
      for (std::int32_t h = 0; h < p.kv_heads; ++h) {
        p.cursors[std::size_t(slot) * p.kv_heads + h] = std::max(p.fifo_begin[std::size_t(slot)], p.lists - 2);
      }
    }
  }
  DeviceLists<T> d(p);
  const std::int32_t rows = p.batch * p.kv_heads;
  for (std::int32_t step = 0; step < 6; ++step) {
    const std::int32_t cap = rng.uniform_int(1, p.list_capacity);
    test::HostSelection entries(p.batch, p.kv_heads, cap, false);
    for (std::size_t r = 0; r < entries.counts.size(); ++r) {
      entries.counts[r] = rng.uniform_int(0, cap);
      for (std::int32_t i = 0; i < cap; ++i) entries.indices[r * cap + i] = rng.uniform_int(0, 1000);
    }
    std::vector<float> es(entries.indices.size());
    for (auto& x : es) x = rng.uniform(-4.0f, 4.0f);
    DeviceBuffer<std::int32_t> e_idx(entries.indices), e_cnt(entries.counts), d_replaced(entries.counts.size());
    DeviceBuffer<float> d_es(es);
    d_replaced.poison();
    auto e_view = entries.view;
    e_view.indices = e_idx.data();
    e_view.counts = e_cnt.data();
    std::vector<std::int32_t> replaced(entries.counts.size());
    cpu::replace_list(p.view(), p.slots.data(), entries.view, MatrixView<const float>::packed(es.data(), rows, cap),
                      replaced.data());
    cuda::replace_list(d.view(p), d.slots.data(), e_view, MatrixView<const float>::packed(d_es.data(), rows, cap),
                       d_replaced.data(), nullptr);
    ASSERT_EQ(d_replaced.download(), replaced) << "replace step " << step;
    ASSERT_EQ(d.cursors.download(), p.cursors);
    ASSERT_EQ(d.counts.download(), p.counts);
    ASSERT_EQ(d.ids.download(), p.ids);
    ASSERT_TRUE(same_bytes(d.scores.download(), p.scores));
  }
}

TEST_F(CudaInvertedLists, UpdatesEqualTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (int repeat = 0; repeat < 3; ++repeat) {
    for (const bool pinned : {false, true}) {
      check_updates<float>(rng, pinned);
      check_updates<half>(rng, pinned);
    }
  }
}

/// The union captured once and replayed (outputs poisoned before each replay) equals the eager run, on both of its
/// paths: 3 lists of 40 (one CTA per row) and of 3500 (over 10,240 entries: the segmented sort).
TEST_F(CudaInvertedLists, GraphReplayEqualsEager) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  ListsProblem<half> small(rng, 4, 2, 8, 40, 3, 200), large(rng, 4, 2, 8, 3500, 3, 20000);
  const DeviceLists<half> d_small(small), d_large(large);
  const std::int32_t rows = small.batch * small.kv_heads;
  DeviceOut out_small(small.batch, small.kv_heads, 3 * 40), out_large(large.batch, large.kv_heads, 3 * 3500);
  DeviceBuffer<std::byte> ws_small(cuda::list_reduction_workspace_bytes(rows, 3, 40));
  DeviceBuffer<std::byte> ws_large(cuda::list_reduction_workspace_bytes(rows, 3, 3500));
  const test::Stream stream;
  const cuda::Context ctx{stream};
  const auto step = [&] {
    cuda::union_lists(d_small.view(small).as_const(), d_small.chosen(small), d_small.slots.data(),
                      d_small.lengths.data(), small.window, out_small.view, {ws_small.data(), ws_small.size()},
                      ctx);
    cuda::union_lists(d_large.view(large).as_const(), d_large.chosen(large), d_large.slots.data(),
                      d_large.lengths.data(), large.window, out_large.view, {ws_large.data(), ws_large.size()},
                      ctx);
  };
  const auto outputs = [&] {
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return std::make_tuple(out_small.indices.download(), out_small.counts.download(), out_large.indices.download(),
                           out_large.counts.download());
  };
  const auto reset = [&] {
    out_small.poison();
    out_large.poison();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the legacy-stream memsets before the non-blocking stream
  };
  reset();
  step();
  const auto eager = outputs();
  const test::CapturedGraph graph(stream, [&] {
    step();
  });
  for (int replay = 0; replay < 3; ++replay) {
    reset();
    graph.launch();
    EXPECT_EQ(outputs(), eager) << replay;
  }
}

/// A bad slot, a negative length or a chosen count past the capacity give the row count -1 and no entries; a
/// chosen list id outside the lists contributes nothing (as if not chosen). Lists of `list_capacity`: 10 takes the
/// one-CTA-per-row path, 5200 (2 x 5200 > 10,240 entries) the segmented sort.
void check_bad_union_rows(Random& rng, std::int32_t list_capacity) {
  SCOPED_TRACE(testing::Message() << "lists of " << list_capacity);
  ListsProblem<float> p(rng, 4, 1, 6, list_capacity, 2, 60);
  p.chosen.counts = {2, 2, 2, 2};
  for (auto& l : p.chosen.indices) l = rng.uniform_int(0, p.lists - 1);
  ListsProblem<float> bad = p;
  bad.slots[0] = p.slot_count;
  bad.lengths[1] = -1;
  bad.chosen.counts[2] = 3;
  bad.chosen.indices[3 * 2 + 1] = p.lists;  // row 3's second list
  p.chosen.counts[3] = 1;                   // the CPU reference for row 3: its first list alone
  const DeviceLists<float> d(bad);
  const std::int32_t capacity = 2 * list_capacity;
  DeviceOut gpu(4, 1, capacity);
  DeviceBuffer<std::byte> ws(cuda::list_reduction_workspace_bytes(4, 2, list_capacity));
  cuda::union_lists(d.view(bad).as_const(), d.chosen(bad), d.slots.data(), d.lengths.data(), p.window, gpu.view,
                    {ws.data(), ws.size()}, nullptr);
  test::HostSelection cpu_out(4, 1, capacity, true);
  cpu::Array<std::byte> cpu_ws(cpu::list_reduction_workspace_bytes(4, 2, list_capacity));
  cpu::union_lists(p.view().as_const(), p.chosen.view, p.slots.data(), p.lengths.data(), p.window, cpu_out.view,
                   cpu_ws.bytes());
  const auto counts = gpu.counts.download(), indices = gpu.indices.download();
  EXPECT_EQ(counts[0], -1);
  EXPECT_EQ(counts[1], -1);
  EXPECT_EQ(counts[2], -1);
  ASSERT_EQ(counts[3], cpu_out.counts[3]);
  const std::size_t row3 = 3 * std::size_t(capacity);
  for (std::int32_t i = 0; i < counts[3]; ++i) EXPECT_EQ(indices[row3 + i], cpu_out.indices[row3 + i]);
  for (std::size_t i = 0; i < row3; ++i) EXPECT_EQ(indices[i], -1) << "a refused row was written";
}

/// Device values the host cannot check get the defined results: the union's bad rows (check_bad_union_rows) on
/// both paths; a bad cursor replaces nothing (replaced -1).
TEST_F(CudaInvertedLists, OutOfRangeDeviceValuesHaveTheDefinedResult) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_bad_union_rows(rng, 10);
  check_bad_union_rows(rng, 5200);

  ListsProblem<float> bad(rng, 4, 1, 6, 10, 2, 60);
  bad.slots[0] = bad.slot_count;
  bad.cursors[std::size_t(bad.slots[1])] = bad.lists;
  DeviceLists<float> d(bad);
  test::HostSelection entries(4, 1, 3, false);
  std::fill(entries.counts.begin(), entries.counts.end(), 1);
  DeviceBuffer<std::int32_t> e_idx(entries.indices), e_cnt(entries.counts), replaced(4);
  auto e_view = entries.view;
  e_view.indices = e_idx.data();
  e_view.counts = e_cnt.data();
  std::vector<float> es(12, 1.0f);
  DeviceBuffer<float> d_es(es);
  cuda::replace_list(d.view(bad), d.slots.data(), e_view, MatrixView<const float>::packed(d_es.data(), 4, 3),
                     replaced.data(), nullptr);
  const auto got = replaced.download();
  EXPECT_EQ(got[0], -1);  // slot outside
  EXPECT_EQ(got[1], -1);  // cursor outside
  EXPECT_EQ(got[2], bad.cursors[std::size_t(bad.slots[2])]);
}

/// Host-side refusals: shapes only, before any device call (no GPU needed).
TEST(CudaInvertedListsBadInput, RefusedBeforeAnyDeviceCall) {
  Random rng(1);
  ListsProblem<float> p(rng, 2, 2, 4, 5, 3, 30);
  test::HostSelection out(2, 2, 14, false);
  std::vector<std::byte> ws(1 << 16);
  test::expect_error([&] {
    cuda::union_lists(p.view().as_const(), p.chosen.view, p.slots.data(), p.lengths.data(), p.window, out.view,
                      {ws.data(), ws.size()}, nullptr);
  }, {"cuda::union_lists", "out.capacity (= 14) < chosen.capacity * lists.list_capacity (= 3 * 5)"});
  std::vector<float> s(24);
  test::HostSelection wide(2, 2, 6, false);
  test::expect_error([&] {
    cuda::replace_list(p.view(), p.slots.data(), wide.view, MatrixView<const float>::packed(s.data(), 4, 6), nullptr,
                       nullptr);
  }, {"cuda::replace_list", "entries.capacity (= 6) exceeds lists.list_capacity (= 5)"});
  test::expect_error([&] { cuda::list_reduction_workspace_bytes(1 << 20, 1 << 10, 1 << 10); },
                     "exceeds 2^31 - 1 entries");
  const test::RecallScores scores(rng, 2, 2, 4);
  auto fewer_rows = scores.view();
  fewer_rows.rows = 3;
  test::expect_error([&] {
    cuda::recall_lists(fewer_rows, scores.columns.data(), p.view().as_const(), p.chosen.view, p.slots.data(),
                       p.lengths.data(), p.window, UnionAppend{}, wide.view, {ws.data(), ws.size()}, nullptr);
  }, {"cuda::recall_lists", "scores.rows (= 3) must equal chosen.batch * chosen.kv_heads (= 2 * 2)"});
}

}  // namespace
}  // namespace kvsift
