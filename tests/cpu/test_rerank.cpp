// Query centroids and rerank on the CPU (selectors/ctkvr/cpu/query_centroids.hpp, cpu/rerank.hpp) against the fp64 references of
// tests/rerank_problem.hpp, outputs poisoned: centroid scores (partial slots, GQA), stored centroids (unit, at
// their columns), candidate scores (contiguous and paged caches, softmax + max and raw + sum, empty and full
// rows), the remap back to token ids (in place), thread independence, and every refused input.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kvsift/selectors/ctkvr/cpu/query_centroids.hpp"
#include "kvsift/cpu/rerank.hpp"
#include "kvsift/cpu/simd.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "rerank_problem.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::Random;

/// Overwrites a HostSelection array in place (its view keeps pointing at it).
void fill_in(std::vector<std::int32_t>& a, std::initializer_list<std::int32_t> values) {
  ASSERT_EQ(a.size(), values.size());
  std::copy(values.begin(), values.end(), a.begin());
}

template <class T>
class CpuQueryCentroids : public ::testing::Test {};
using StorageTypes = ::testing::Types<float, half, bfloat16>;
TYPED_TEST_SUITE(CpuQueryCentroids, StorageTypes);

TYPED_TEST(CpuQueryCentroids, ScoresAreTheGroupsBestCosine) {
  using T = TypeParam;
  const auto seed = test::test_seed();
  SCOPED_TRACE(seed);
  Random rng(seed);
  const test::CentroidProblem<T> p(rng, 3, 8, 2, 5, 37, 64);
  const auto expected = p.reference();
  cpu::ThreadPool pool(3);
  for (cpu::ThreadPool* used : {static_cast<cpu::ThreadPool*>(nullptr), &pool}) {
    std::vector<float> scores(expected.size() + 5, test::kPoison);  // one spare column: never written
    const auto view = MatrixView<float>{scores.data(), 6, p.capacity, p.capacity};
    cpu::centroid_scores(p.query(), p.view(), p.row_slots.data(), p.kv_heads, view, used);
    for (std::size_t i = 0; i < expected.size(); ++i) {
      if (std::isinf(expected[i])) {
        EXPECT_EQ(scores[i], -INFINITY) << i;
      } else {
        EXPECT_NEAR(scores[i], expected[i], 2e-6) << i;
      }
    }
  }
}

TYPED_TEST(CpuQueryCentroids, StoreWritesUnitQueriesAtTheirColumns) {
  using T = TypeParam;
  const auto seed = test::test_seed();
  SCOPED_TRACE(seed);
  Random rng(seed);
  const std::int32_t batch = 2, q_heads = 6, kv_heads = 3, slots = 4, capacity = 9, d = 32, n = 3;
  const std::vector<T> queries = test::to_storage<T>(rng.normal(std::size_t(batch) * q_heads * n * d, 4.0f));
  std::vector<T> store(QueryCentroidsView<T>::elements(slots, q_heads, capacity, d), from_float<T>(test::kPoison));
  std::vector<std::int32_t> counts(slots, 0), row_slots = {3, 1}, first = {0, 6, 2, 1, 5, 4};
  const QueryCentroidsView<T> view{store.data(), counts.data(), slots, q_heads, capacity, d};
  const auto seq = SequenceView<const T>::packed(queries.data(), batch, q_heads, n, d);
  cpu::store_centroids(seq, row_slots.data(), first.data(), kv_heads, view);
  for (std::int32_t b = 0; b < batch; ++b) {
    for (std::int32_t h = 0; h < q_heads; ++h) {
      for (std::int32_t i = 0; i < n; ++i) {
        const T* x = seq.row(b, h, i);
        double norm = 0;
        for (std::int32_t j = 0; j < d; ++j) norm += double(to_float(x[j])) * to_float(x[j]);
        const T* c = view.row(row_slots[b], h, first[b * kv_heads + h / 2] + i);
        for (std::int32_t j = 0; j < d; ++j) {
          const double tolerance = std::is_same_v<T, float> ? 1e-6 : 1e-2;
          EXPECT_NEAR(to_float(c[j]), to_float(x[j]) / std::sqrt(norm), tolerance);
        }
      }
    }
  }
  EXPECT_EQ(counts, (std::vector<std::int32_t>{0, 8, 0, 9}));  // grown to the rows' last columns + 1
  EXPECT_TRUE(std::isnan(to_float(view.row(0, 0, 0)[0])));  // slots 0 and 2 untouched
  EXPECT_TRUE(std::isnan(to_float(view.row(3, 0, 3)[0])));  // past row 0's columns [0, 3)
}

TEST(CpuRerank, CandidateScoresMatchFp64AtEverySimdLevelAndThreadCount) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(seed);
  Random rng(seed);
  const std::int32_t q_heads = 8, kv_heads = 2, d = 64;
  for (const std::int32_t capacity : {50, 5000}) {  // one chunk of 2048 candidates, and three
    const std::vector<std::int32_t> lengths = {capacity + 700, 40, 2100};
    const test::HostKV kv(rng, 3, kv_heads, std::max(capacity + 720, 2100), d, lengths);
    const test::HostPagedKV paged(kv, 16, true, rng);
    const std::vector<float> q = rng.normal(std::size_t(3) * q_heads * d);
    const auto qv = QueryView<const float>::packed(q.data(), 3, q_heads, d);
    const test::HostSelection candidates = test::random_candidates(rng, lengths, kv_heads, capacity);
    for (const cpu::SimdLevel level : test::available_simd_levels()) {
      cpu::ScopedSimdLevel force(level);
      for (const bool softmax : {true, false}) {
        const GroupScoreOptions options{.sm_scale = 0.3f, .reduce = softmax ? GroupReduce::max : GroupReduce::sum,
                                        .softmax = softmax};
        const auto expected = test::candidate_reference(q, q_heads, kv.view(), candidates, 0.3, softmax, !softmax);
        std::vector<float> first;
        for (const bool use_paged : {false, true}) {
          for (const std::int32_t threads : {1, 3}) {
            cpu::ThreadPool pool(threads);
            std::vector<float> scores(expected.size(), test::kPoison);
            std::vector<std::byte> ws(cpu::candidate_scores_workspace_bytes(6, 4, capacity) + 256);
            auto span = std::span<std::byte>(ws).subspan((256 - reinterpret_cast<std::uintptr_t>(ws.data()) % 256) % 256);
            std::fill(span.begin(), span.end(), std::byte{0xff});
            const auto sv = MatrixView<float>::packed(scores.data(), 6, capacity);
            if (use_paged) {
              cpu::candidate_scores(qv, paged.view, candidates.view, options, sv, span, &pool);
            } else {
              cpu::candidate_scores(qv, kv.view(), candidates.view, options, sv, span, &pool);
            }
            const std::string what = fmt::format("level {} capacity {} softmax {} paged {} threads {}",
                                                 cpu::simd_level_name(level), capacity, softmax, use_paged, threads);
            for (std::size_t i = 0; i < expected.size(); ++i) {
              if (std::isnan(expected[i])) {
                ASSERT_TRUE(std::isnan(scores[i])) << what << ": written past the count at " << i;
              } else {
                ASSERT_NEAR(scores[i], expected[i], 2e-5 * std::max(1.0, std::abs(expected[i]))) << what << " at " << i;
              }
            }
            // Every layout and thread count gives the same bits.
            if (first.empty()) first = scores;
            EXPECT_TRUE(test::same_bytes(scores, first)) << what;
          }
        }
      }
    }
  }
}

TEST(CpuRerank, RemapMapsPositionsToIdsInPlace) {
  test::HostSelection ids(2, 2, 6, false), positions(2, 2, 3, true);
  fill_in(ids.indices, {10, 20, 30, 40, 50, 60, 1, 2, 3, 0, 0, 0, 7, 8, 9, 11, 0, 0, 5, 0, 0, 0, 0, 0});
  fill_in(ids.counts, {6, 3, 4, 1});
  fill_in(positions.indices, {0, 2, 5, 1, 2, -1, 0, 3, -1, 0, -1, -1});
  fill_in(positions.counts, {3, 2, 2, 1});
  cpu::remap_selection(positions.view, ids.view, positions.view);
  EXPECT_EQ(positions.counts, (std::vector<std::int32_t>{3, 2, 2, 1}));
  const std::vector<std::int32_t> expected = {10, 30, 60, 2, 3, 7, 11, 5};
  const std::vector<std::int32_t> got = {positions.indices[0], positions.indices[1], positions.indices[2],
                                         positions.indices[3], positions.indices[4], positions.indices[6],
                                         positions.indices[7], positions.indices[9]};
  EXPECT_EQ(got, expected);
  EXPECT_EQ(positions.log_weights[0], 0.0f);
  EXPECT_TRUE(std::isnan(positions.log_weights[5]));  // past the count: not written
}

TEST(CpuRerank, AppendRangeAddsTheUnindexedMiddle) {
  // Rows of slots 2 and 0; slot 2's index was built at 50 tokens less its recent window of 8 (first = 42).
  test::HostSelection rows(2, 2, 12, true);
  fill_in(rows.indices, {3, 10, 41, 43, 44, -1, -1, -1, -1, -1, -1, -1, 5, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                         1, 2, 9, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1});
  fill_in(rows.counts, {5, 1, 3, 0});
  const std::vector<std::int32_t> slots = {2, 0}, first = {2, 0, 42}, lengths = {55, 12};
  const AttentionWindow window{.sink = 4, .recent = 8};
  std::vector<std::int32_t> counts_before(4, -7);
  cpu::append_range(rows.view, slots.data(), first.data(), lengths.data(), window, counts_before.data());
  EXPECT_EQ(counts_before, (std::vector<std::int32_t>{5, 1, 3, 0})) << "each row's count as it came in";
  // Row (0, 0): 43, 44 are dropped (>= 42) and [42, 47) appended; (0, 1) gets [42, 47) after 5.
  EXPECT_EQ(rows.counts, (std::vector<std::int32_t>{8, 6, 2, 0}));
  EXPECT_EQ(std::vector<std::int32_t>(rows.indices.begin(), rows.indices.begin() + 8),
            (std::vector<std::int32_t>{3, 10, 41, 42, 43, 44, 45, 46}));
  EXPECT_EQ(std::vector<std::int32_t>(rows.indices.begin() + 12, rows.indices.begin() + 18),
            (std::vector<std::int32_t>{5, 42, 43, 44, 45, 46}));
  // Slot 0 (first 2, 12 tokens): the middle [4, 4) is empty, rows keep their entries below 4.
  EXPECT_EQ(std::vector<std::int32_t>(rows.indices.begin() + 24, rows.indices.begin() + 26),
            (std::vector<std::int32_t>{1, 2}));
  EXPECT_EQ(rows.log_weights[3], 0.0f);
  test::HostSelection small(1, 1, 3, false);
  fill_in(small.counts, {0});
  const std::vector<std::int32_t> one = {0}, far = {0}, long_len = {100};
  test::expect_error([&] { cpu::append_range(small.view, one.data(), far.data(), long_len.data(), window, nullptr); },
                     "row 0 holds 0 entries below 4 and the range adds 88: more than its capacity (3)");
}

TEST(CpuRerank, BadInputsAreRefused) {
  Random rng(1);
  const test::CentroidProblem<float> p(rng, 2, 4, 2, 3, 5, 16);
  std::vector<float> scores(4 * 5);
  const auto sv = MatrixView<float>::packed(scores.data(), 4, 5);
  std::vector<std::int32_t> bad_slots = {0, 3};
  test::expect_error([&] { cpu::centroid_scores(p.query(), p.view(), bad_slots.data(), 2, sv); },
                     "slots[1] (= 3) is outside [0, centroids.slots = 3)");
  test::expect_error([&] { cpu::centroid_scores(p.query(), p.view(), p.row_slots.data(), 3, sv); },
                     "kv_heads (= 3) must divide");
  test::expect_error(
      [&] { cpu::centroid_scores(p.query(), p.view(), p.row_slots.data(), 2, MatrixView<float>::packed(scores.data(), 4, 4)); },
      "expected [batch * kv_heads = 4, >= centroids.capacity = 5]");
  std::vector<std::int32_t> bad_counts = {6, 1, 1};
  auto view = p.view();
  view.counts = bad_counts.data();
  test::expect_error([&] { cpu::centroid_scores(p.query(), view, std::vector<std::int32_t>{0, 1}.data(), 2, sv); },
                     "centroids.counts[0] (= 6) is outside [0, capacity = 5]");

  std::vector<float> store(QueryCentroidsView<float>::elements(3, 4, 5, 16));
  std::vector<std::int32_t> counts(3);
  const QueryCentroidsView<float> out{store.data(), counts.data(), 3, 4, 5, 16};
  const auto one = SequenceView<const float>::packed(p.q.data(), 2, 4, 1, 16);
  std::vector<std::int32_t> same = {1, 1}, first = {0, 5, 0, 0};
  test::expect_error([&] { cpu::store_centroids(one, same.data(), nullptr, 2, out); }, "repeats an earlier row's slot");
  test::expect_error([&] { cpu::store_centroids(one, std::vector<std::int32_t>{0, 1}.data(), first.data(), 2, out); },
                     "first[1] (= 5) + 1 queries passes centroids.capacity (= 5)");

  const test::HostKV kv(rng, 1, 2, 10, 16);
  test::HostSelection candidates(1, 2, 4, false);
  fill_in(candidates.counts, {5, 0});
  std::vector<float> cs(8);
  const auto q = QueryView<const float>::packed(p.q.data(), 1, 4, 16);
  test::expect_error([&] { cpu::candidate_scores(q, kv.view(), candidates.view, {}, MatrixView<float>::packed(cs.data(), 2, 4), {}); },
                     "candidates.counts[0] (= 5) is outside [0, capacity = 4]");
  fill_in(candidates.counts, {1, 0});
  candidates.indices[0] = 10;
  test::expect_error([&] { cpu::candidate_scores(q, kv.view(), candidates.view, {}, MatrixView<float>::packed(cs.data(), 2, 4), {}); },
                     "candidate 0 of row 0 (= 10) is outside [0, seq_len = 10)");

  test::HostSelection ids(1, 2, 4, false), positions(1, 2, 4, false);
  fill_in(ids.counts, {2, 0});
  fill_in(positions.counts, {1, 0});
  positions.indices[0] = 2;
  test::expect_error([&] { cpu::remap_selection(positions.view, ids.view, positions.view); },
                     "position 0 of row 0 (= 2) is outside [0, ids.count = 2)");
  test::HostSelection wide(1, 3, 4, false);
  test::expect_error([&] { cpu::remap_selection(positions.view, wide.view, positions.view); }, "positions has 2 rows, ids 3");
}

}  // namespace
}  // namespace kvsift
