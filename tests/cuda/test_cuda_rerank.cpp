// Query centroids and rerank on CUDA (selectors/ctkvr/cuda/query_centroids.hpp, cuda/rerank.hpp) against their CPU twins (whose
// tests check them against fp64) on the same inputs, outputs poisoned: centroid scores (GQA, partial slots),
// stored centroids, candidate scores (contiguous and paged, softmax + max and raw + sum), the remap in place;
// the device-value rules (bad slot or count: NaN row; bad position: count -1); the host-side refusals (run
// without a GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "kvsift/selectors/ctkvr/cpu/query_centroids.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/rerank.hpp"
#include "kvsift/selectors/ctkvr/cuda/query_centroids.hpp"
#include "kvsift/cuda/rerank.hpp"
#include "rerank_problem.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::Random;

class CudaRerank : public test::GpuTest {};

/// Within fp32 rounding of the CPU's value (the sums run in another order); NaN and -inf where the CPU has them.
void expect_close(const std::vector<float>& gpu, const std::vector<float>& cpu, double tolerance) {
  ASSERT_EQ(gpu.size(), cpu.size());
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    if (std::isnan(cpu[i]) || std::isinf(cpu[i])) {
      EXPECT_TRUE(std::isnan(cpu[i]) ? std::isnan(gpu[i]) : gpu[i] == cpu[i]) << i << ": " << gpu[i] << " vs " << cpu[i];
    } else {
      EXPECT_NEAR(gpu[i], cpu[i], tolerance * std::max(1.0f, std::abs(cpu[i]))) << i;
    }
  }
}

TEST_F(CudaRerank, CentroidScoresAndStoreAgreeWithTheCpu) {
  SCOPED_TRACE(seed);
  const test::CentroidProblem<half> p(rng, 3, 32, 8, 4, 70, 128);
  std::vector<float> cpu_scores(std::size_t(24) * p.capacity, test::kPoison);
  cpu::centroid_scores(p.query(), p.view(), p.row_slots.data(), p.kv_heads,
                       MatrixView<float>::packed(cpu_scores.data(), 24, p.capacity));
  DeviceBuffer<half> centroids(p.centroids), q(p.q);
  DeviceBuffer<std::int32_t> counts(p.counts), slots(p.row_slots);
  DeviceBuffer<float> scores(std::vector<float>(cpu_scores.size(), test::kPoison));
  const QueryCentroidsView<const half> view{centroids.data(), counts.data(), p.slots, p.q_heads, p.capacity, p.head_dim};
  cuda::centroid_scores(QueryView<const half>::packed(q.data(), p.batch, p.q_heads, p.head_dim), view, slots.data(),
                        p.kv_heads, MatrixView<float>::packed(scores.data(), 24, p.capacity), nullptr);
  expect_close(scores.download(), cpu_scores, 2e-6);

  // Store the decode queries at per-row columns, as CTKVR's dynamic update does.
  std::vector<std::int32_t> first(24);
  for (auto& f : first) f = rng.uniform_int(0, p.capacity - 1);
  std::vector<half> cpu_store = p.centroids;
  std::vector<std::int32_t> host_counts = p.counts;
  const QueryCentroidsView<half> cpu_view{cpu_store.data(), host_counts.data(), p.slots, p.q_heads, p.capacity, p.head_dim};
  const auto seq_host = SequenceView<const half>::packed(p.q.data(), p.batch, p.q_heads, 1, p.head_dim);
  cpu::store_centroids(seq_host, p.row_slots.data(), first.data(), p.kv_heads, cpu_view);
  DeviceBuffer<std::int32_t> d_first(first);
  const QueryCentroidsView<half> gpu_view{centroids.data(), counts.data(), p.slots, p.q_heads, p.capacity, p.head_dim};
  cuda::store_centroids(SequenceView<const half>::packed(q.data(), p.batch, p.q_heads, 1, p.head_dim), slots.data(),
                        d_first.data(), p.kv_heads, gpu_view, nullptr);
  EXPECT_EQ(counts.download(), host_counts);  // grown alike
  const std::vector<half> gpu_store = centroids.download();
  std::size_t differ = 0;
  for (std::size_t i = 0; i < cpu_store.size(); ++i) {
    const float a = to_float(gpu_store[i]), b = to_float(cpu_store[i]);
    EXPECT_NEAR(a, b, 1e-3) << i;
    differ += a != b;
  }
  EXPECT_LE(differ, cpu_store.size() / 100) << "more than 1% of the stored values differ in the last bit";
}

TEST_F(CudaRerank, CandidateScoresAgreeWithTheCpuOnBothLayouts) {
  SCOPED_TRACE(seed);
  const std::int32_t q_heads = 16, kv_heads = 4, d = 128, capacity = 700;
  const std::vector<std::int32_t> lengths = {3000, 500, 1200};
  const test::HostKV kv(rng, 3, kv_heads, 3000, d, lengths);
  const test::HostPagedKV paged(kv, 16, false, rng);
  const std::vector<float> q = rng.normal(std::size_t(3) * q_heads * d);
  const test::HostSelection candidates = test::random_candidates(rng, lengths, kv_heads, capacity);
  const std::int64_t rows = 12;
  DeviceBuffer<float> dq(q), dk(kv.k), dv(kv.v), dk_pages(paged.k_pages), dv_pages(paged.v_pages);
  DeviceBuffer<std::int32_t> dlens(kv.seq_lens), dindptr(paged.indptr), dindices(paged.indices), dlast(paged.last_len);
  DeviceBuffer<std::int32_t> cand_ids(candidates.indices), cand_counts(candidates.counts);
  const SelectionView d_candidates{cand_ids.data(), cand_counts.data(), nullptr, 3, kv_heads, capacity};
  auto d_contiguous = kv.view();
  d_contiguous.k = dk.data(), d_contiguous.v = dv.data(), d_contiguous.seq_lens = dlens.data();
  auto d_paged = paged.view;
  d_paged.k_pages = dk_pages.data(), d_paged.v_pages = dv_pages.data(), d_paged.page_indptr = dindptr.data();
  d_paged.page_indices = dindices.data(), d_paged.last_page_len = dlast.data();
  DeviceBuffer<std::byte> ws(cuda::candidate_scores_workspace_bytes(rows, 4, capacity));
  cpu::Array<std::byte> host_ws(cpu::candidate_scores_workspace_bytes(rows, 4, capacity));  // 256-byte aligned
  const std::span<std::byte> host_span = host_ws.bytes();
  const auto qv = QueryView<const float>::packed(q.data(), 3, q_heads, d);
  const auto d_qv = QueryView<const float>::packed(dq.data(), 3, q_heads, d);
  for (const bool softmax : {true, false}) {
    const GroupScoreOptions options{.reduce = softmax ? GroupReduce::max : GroupReduce::sum, .softmax = softmax};
    std::vector<float> cpu_scores(std::size_t(rows) * capacity, test::kPoison);
    cpu::candidate_scores(qv, kv.view(), candidates.view, options,
                          MatrixView<float>::packed(cpu_scores.data(), rows, capacity), host_span);
    for (const bool use_paged : {false, true}) {
      DeviceBuffer<float> scores(std::vector<float>(cpu_scores.size(), test::kPoison));
      const auto sv = MatrixView<float>::packed(scores.data(), rows, capacity);
      if (use_paged) {
        cuda::candidate_scores(d_qv, PagedKVView<const float>(d_paged), d_candidates, options, sv,
                               {ws.data(), ws.size()}, nullptr);
      } else {
        cuda::candidate_scores(d_qv, ContiguousKVView<const float>(d_contiguous), d_candidates, options, sv,
                               {ws.data(), ws.size()}, nullptr);
      }
      SCOPED_TRACE(use_paged ? "paged" : "contiguous");
      expect_close(scores.download(), cpu_scores, 2e-5);
    }
  }
}

/// centroid_scores on every path against the CPU twin: 16-bit centroids of 64, 128 or 256 channels on tensor cores
/// (groups of 1, 4 and 16: head j's scores are row j of C, rows past 8 in the fragments' upper half), fp32 and
/// 96 channels on CUDA cores; 70 centroids a slot (a last n-tile of 6), a slot of 1 centroid (-inf past it): a
/// batch row per slot, so that every slot is scored.
template <class T>
void check_centroid_scores(Random& rng, std::int32_t q_heads, std::int32_t kv_heads, std::int32_t d) {
  SCOPED_TRACE(std::to_string(q_heads / kv_heads) + " heads a group, " + std::to_string(d) + " channels");
  const test::CentroidProblem<T> p(rng, 4, q_heads, kv_heads, 4, 70, d);
  const std::int64_t rows = std::int64_t(p.batch) * kv_heads;
  std::vector<float> cpu_scores(std::size_t(rows) * p.capacity, test::kPoison);
  cpu::centroid_scores(p.query(), p.view(), p.row_slots.data(), kv_heads,
                       MatrixView<float>::packed(cpu_scores.data(), rows, p.capacity));
  DeviceBuffer<T> centroids(p.centroids), q(p.q);
  DeviceBuffer<std::int32_t> counts(p.counts), slots(p.row_slots);
  DeviceBuffer<float> scores(std::vector<float>(cpu_scores.size(), test::kPoison));
  const QueryCentroidsView<const T> view{centroids.data(), counts.data(), p.slots, p.q_heads, p.capacity, d};
  cuda::centroid_scores(QueryView<const T>::packed(q.data(), p.batch, p.q_heads, d), view, slots.data(), kv_heads,
                        MatrixView<float>::packed(scores.data(), rows, p.capacity), nullptr);
  expect_close(scores.download(), cpu_scores, 2e-6);
}

TEST_F(CudaRerank, CentroidScoresAgreeWithTheCpuOnEveryPath) {
  SCOPED_TRACE(seed);
  for (const std::int32_t d : {64, 128, 256}) {
    check_centroid_scores<bfloat16>(rng, 32, 8, d);
    check_centroid_scores<half>(rng, 32, 8, d);
  }
  check_centroid_scores<bfloat16>(rng, 16, 16, 128);  // groups of 1
  check_centroid_scores<bfloat16>(rng, 32, 2, 128);   // groups of 16
  check_centroid_scores<half>(rng, 32, 2, 64);
  check_centroid_scores<bfloat16>(rng, 32, 8, 96);
  check_centroid_scores<float>(rng, 32, 8, 128);
}

/// candidate_scores on `T` keys of head_dim d (softmax + max, and raw logits + sum) against the CPU twin: the logits
/// kernel takes 16-bit keys of 64, 128 or 256 channels on tensor cores (the group's heads as up to 16 rows of A:
/// `q_heads` / 2 of them; the softmax partials from its registers), holds fp32 keys of 32, 64 or 128 channels in
/// registers and reads other rows element by element, and rows not 16-byte aligned (`shifted`: the cache starts
/// one element past an aligned address) one element at a time. On the device, a candidate past its sequence's end
/// or negative scores NaN and, under the softmax, makes its whole row NaN (the CPU refuses such candidates on the
/// host). A NaN in one key makes its score NaN on both, and under the softmax its whole row.
template <class T>
void check_candidate_scores(Random& rng, std::int32_t d, bool shifted, std::int32_t q_heads = 8, float q_scale = 1.0f) {
  SCOPED_TRACE(std::to_string(d) + " channels, " + std::to_string(q_heads / 2) + " heads a group, q x " +
               std::to_string(q_scale) + (shifted ? ", rows not 16-byte aligned" : ""));
  const std::int32_t kv_heads = 2, batch = 2, max_len = 2500, capacity = 600;
  const std::vector<std::int32_t> lengths = {2500, 900};
  const std::int64_t rows = std::int64_t(batch) * kv_heads, shift = shifted ? 1 : 0;
  const std::size_t elements = std::size_t(batch) * kv_heads * max_len * d + 1;
  std::vector<T> k = test::to_storage<T>(rng.normal(elements));
  const std::vector<T> v = test::to_storage<T>(rng.normal(elements));
  std::vector<float> q_values = rng.normal(std::size_t(batch) * q_heads * d);
  for (float& x : q_values) x *= q_scale;
  const std::vector<T> q = test::to_storage<T>(q_values);
  // Row 3 (b 1, h 1): one channel of the keys of its sixth and of a later candidate (the second chunk's where the
  // row has one) is NaN; it holds at least 6 candidates (an unconstrained draw had fewer 1% of the time).
  const test::HostSelection candidates = test::random_candidates(rng, lengths, kv_heads, capacity, 6);
  constexpr std::int32_t kNanRow = 3;
  const std::int32_t nan_count = candidates.counts[kNanRow];
  ASSERT_GT(nan_count, 5);
  const std::vector<std::int32_t> nan_entries = {5, std::min(nan_count - 1, 300)};
  for (const std::int32_t entry : nan_entries) {
    const std::int32_t token = candidates.indices[std::size_t(kNanRow) * capacity + entry];
    k[std::size_t(shift + ContiguousKVView<const T>::packed(nullptr, nullptr, batch, kv_heads, max_len, d)
                              .offset(1, 1, token) + d / 2 + 1)] = test::to_storage<T>(std::vector<float>{NAN})[0];
  }
  // The device's row 2 (b 1, h 0) starts with two candidates outside its sequence.
  constexpr std::int32_t kBadRow = 2;
  std::vector<std::int32_t> device_ids = candidates.indices, device_counts = candidates.counts;
  device_ids[std::size_t(kBadRow) * capacity] = -3;
  device_ids[std::size_t(kBadRow) * capacity + 1] = lengths[1];
  device_counts[kBadRow] = std::max(device_counts[kBadRow], 2);
  DeviceBuffer<T> dk(k), dv(v), dq(q);
  DeviceBuffer<std::int32_t> dlens(lengths), cand_ids(device_ids), cand_counts(device_counts);
  const SelectionView d_candidates{cand_ids.data(), cand_counts.data(), nullptr, batch, kv_heads, capacity};
  const auto kv = ContiguousKVView<const T>::packed(k.data() + shift, v.data() + shift, batch, kv_heads, max_len, d,
                                                    lengths.data());
  const auto d_kv = ContiguousKVView<const T>::packed(dk.data() + shift, dv.data() + shift, batch, kv_heads, max_len,
                                                      d, dlens.data());
  const std::int32_t group = q_heads / kv_heads;
  cpu::Array<std::byte> host_ws(cpu::candidate_scores_workspace_bytes(rows, group, capacity));  // 256-byte aligned
  const std::span<std::byte> host_span = host_ws.bytes();
  DeviceBuffer<std::byte> ws(cuda::candidate_scores_workspace_bytes(rows, group, capacity));
  for (const bool softmax : {true, false}) {
    SCOPED_TRACE(softmax ? "softmax, max over the group" : "logits, sum over the group");
    const GroupScoreOptions options{.reduce = softmax ? GroupReduce::max : GroupReduce::sum, .softmax = softmax};
    std::vector<float> cpu_scores(std::size_t(rows) * capacity, test::kPoison);
    cpu::candidate_scores(QueryView<const T>::packed(q.data(), batch, q_heads, d), kv, candidates.view, options,
                          MatrixView<float>::packed(cpu_scores.data(), rows, capacity), host_span);
    ws.poison();
    DeviceBuffer<float> scores(std::vector<float>(cpu_scores.size(), test::kPoison));
    cuda::candidate_scores(QueryView<const T>::packed(dq.data(), batch, q_heads, d), d_kv, d_candidates, options,
                           MatrixView<float>::packed(scores.data(), rows, capacity), {ws.data(), ws.size()}, nullptr);
    std::vector<float> got = scores.download();
    for (std::int32_t i = 0; i < capacity; ++i) {
      float& x = got[std::size_t(kBadRow) * capacity + i];
      if (softmax ? i < device_counts[kBadRow] : i < 2) {
        EXPECT_TRUE(std::isnan(x)) << "row " << kBadRow << " entry " << i << ": " << x;
        x = cpu_scores[std::size_t(kBadRow) * capacity + i];  // the rest is compared below
      }
    }
    for (std::int32_t i = 0; i < candidates.counts[kNanRow]; ++i) {
      if (softmax || std::ranges::find(nan_entries, i) != nan_entries.end()) {
        EXPECT_TRUE(std::isnan(cpu_scores[std::size_t(kNanRow) * capacity + i])) << "the CPU keeps the NaN, " << i;
      }
    }
    // A raw logit's rounding follows its products' size (q_scale), not the size of their sum.
    expect_close(got, cpu_scores, softmax ? 2e-5 : 2e-5 * q_scale);
  }
}

TEST_F(CudaRerank, CandidateScoresAgreeWithTheCpuForEveryKeyRowSize) {
  SCOPED_TRACE(seed);
  for (const bool shifted : {false, true}) {
    for (const std::int32_t d : {64, 128, 256}) check_candidate_scores<bfloat16>(rng, d, shifted);
    for (const std::int32_t q_heads : {10, 32}) check_candidate_scores<bfloat16>(rng, 128, shifted, q_heads);
    check_candidate_scores<half>(rng, 128, shifted);
    check_candidate_scores<half>(rng, 64, shifted, 32);
    // Logits spread over ~120: a maximum far from the chunk's overflows or underflows the softmax's sums.
    check_candidate_scores<bfloat16>(rng, 128, shifted, 8, 20.0f);
    check_candidate_scores<half>(rng, 256, shifted, 32, 20.0f);
    for (const std::int32_t d : {32, 96, 128}) check_candidate_scores<float>(rng, d, shifted);
  }
}

TEST_F(CudaRerank, RemapAndDeviceValueRules) {
  SCOPED_TRACE(seed);
  test::HostSelection ids(2, 2, 6, false), positions(2, 2, 3, true);
  const std::vector<std::int32_t> id_values = {10, 20, 30, 40, 50, 60, 1, 2, 3, 0, 0, 0, 7, 8, 9, 11, 0, 0, 5, 0, 0, 0, 0, 0};
  const std::vector<std::int32_t> position_values = {0, 2, 5, 1, 2, -1, 0, 4, -1, 0, -1, -1};  // row 2: position 4 >= 4
  DeviceBuffer<std::int32_t> d_ids(id_values), d_id_counts(std::vector<std::int32_t>{6, 3, 4, 1});
  DeviceBuffer<std::int32_t> d_pos(position_values), d_pos_counts(std::vector<std::int32_t>{3, 2, 2, 1});
  DeviceBuffer<float> d_weights(std::vector<float>(12, test::kPoison));
  const SelectionView pos{d_pos.data(), d_pos_counts.data(), d_weights.data(), 2, 2, 3};
  cuda::remap_selection(pos, SelectionView{d_ids.data(), d_id_counts.data(), nullptr, 2, 2, 6}, pos, nullptr);
  EXPECT_EQ(d_pos_counts.download(), (std::vector<std::int32_t>{3, 2, -1, 1}));
  const std::vector<std::int32_t> out = d_pos.download();
  EXPECT_EQ((std::vector<std::int32_t>{out[0], out[1], out[2], out[3], out[4], out[9]}),
            (std::vector<std::int32_t>{10, 30, 60, 2, 3, 5}));
  EXPECT_EQ(d_weights.download()[0], 0.0f);

  // A bad count: the candidate row is NaN; a bad slot: the centroid row is NaN.
  const test::HostKV kv(rng, 1, 1, 8, 32);
  DeviceBuffer<float> dk(kv.k), dv(kv.v), dq(rng.normal(32));
  DeviceBuffer<std::int32_t> dlens(kv.seq_lens), cand(std::vector<std::int32_t>(4, 0)), bad_count(std::vector<std::int32_t>{5});
  auto view = kv.view();
  view.k = dk.data(), view.v = dv.data(), view.seq_lens = dlens.data();
  DeviceBuffer<float> scores(std::vector<float>(4, 0.0f));
  DeviceBuffer<std::byte> ws(cuda::candidate_scores_workspace_bytes(1, 1, 4));
  cuda::candidate_scores(QueryView<const float>::packed(dq.data(), 1, 1, 32), ContiguousKVView<const float>(view),
                         SelectionView{cand.data(), bad_count.data(), nullptr, 1, 1, 4}, {},
                         MatrixView<float>::packed(scores.data(), 1, 4), {ws.data(), ws.size()}, nullptr);
  for (float s : scores.download()) EXPECT_TRUE(std::isnan(s));
  DeviceBuffer<float> centroids(std::vector<float>(2 * 32, 1.0f));
  DeviceBuffer<std::int32_t> ccounts(std::vector<std::int32_t>{2}), bad_slot(std::vector<std::int32_t>{1});
  DeviceBuffer<float> cscores(std::vector<float>(2, 0.0f));
  cuda::centroid_scores(QueryView<const float>::packed(dq.data(), 1, 1, 32),
                        QueryCentroidsView<const float>{centroids.data(), ccounts.data(), 1, 1, 2, 32}, bad_slot.data(), 1,
                        MatrixView<float>::packed(cscores.data(), 1, 2), nullptr);
  for (float s : cscores.download()) EXPECT_TRUE(std::isnan(s));
}

TEST_F(CudaRerank, AppendRangeAgreesWithTheCpu) {
  SCOPED_TRACE(seed);
  const std::int32_t batch = 3, kv_heads = 4, capacity = 500;
  const std::vector<std::int32_t> lengths = {900, 130, 40}, slots = {1, 3, 0}, first = {20, 700, 0, 100};
  const AttentionWindow window{.sink = 4, .recent = 16};
  // Indexed candidates (up to 250 per row) in rows with room for the range.
  const test::HostSelection indexed = test::random_candidates(rng, {700, 130, 40}, kv_heads, 250);
  test::HostSelection rows(batch, kv_heads, capacity, false);
  for (std::int32_t row = 0; row < batch * kv_heads; ++row) {
    std::copy_n(indexed.indices.begin() + row * 250, 250, rows.indices.begin() + row * capacity);
    rows.counts[row] = indexed.counts[row];
  }
  rows.counts[5] = -1;  // a bad row: count -1 on the device (the CPU refuses it)
  DeviceBuffer<std::int32_t> ids(rows.indices), counts(rows.counts), d_slots(slots), d_first(first), d_lengths(lengths);
  DeviceBuffer<std::int32_t> counts_before(rows.counts.size());
  counts_before.poison();
  cuda::append_range(SelectionView{ids.data(), counts.data(), nullptr, batch, kv_heads, capacity}, d_slots.data(),
                     d_first.data(), d_lengths.data(), window, counts_before.data(), nullptr);
  EXPECT_EQ(counts_before.download(), rows.counts) << "each row's count as it came in, the bad row's too";
  rows.counts[5] = 0;
  std::vector<std::int32_t> gpu_counts = counts.download();
  EXPECT_EQ(gpu_counts[5], -1);
  gpu_counts[5] = 0;
  test::HostSelection expected = rows;
  expected.view = {expected.indices.data(), expected.counts.data(), nullptr, batch, kv_heads, capacity};
  cpu::append_range(expected.view, slots.data(), first.data(), lengths.data(), window, nullptr);
  expected.counts[5] = 0;
  EXPECT_EQ(gpu_counts, expected.counts);
  const std::vector<std::int32_t> gpu_ids = ids.download();
  for (std::int32_t row = 0; row < batch * kv_heads; ++row) {
    for (std::int32_t i = 0; i < expected.counts[row]; ++i) {
      EXPECT_EQ(gpu_ids[row * capacity + i], expected.indices[row * capacity + i]) << row << " " << i;
    }
  }
}

TEST(CudaRerankBadInput, RefusedOnTheHost) {
  float dummy[64] = {};
  std::int32_t counts[2] = {1, 1};
  const QueryCentroidsView<const float> centroids{dummy, counts, 2, 17, 1, 2};
  std::vector<float> scores(8);
  test::expect_error(
      [&] {
        cuda::centroid_scores(QueryView<const float>::packed(dummy, 1, 17, 2), centroids, counts, 1,
                              MatrixView<float>::packed(scores.data(), 1, 1), nullptr);
      },
      "the GQA group (= 17 query heads per kv head) exceeds 16");
  test::expect_error([&] { (void)cuda::candidate_scores_workspace_bytes(0, 1, 1); }, "rows (= 0)");
  test::HostSelection a(1, 2, 4, false), b(1, 3, 4, false);
  test::expect_error([&] { cuda::remap_selection(a.view, b.view, a.view, nullptr); }, "positions has 2 rows, ids 3");
}

}  // namespace
}  // namespace kvsift
