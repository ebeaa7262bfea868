// CUDA score tables (selectors/csattention/cuda/score_tables.hpp) against their CPU twins, bit for bit, on random tables
// (score_tables_problem.hpp): GQA group 4, tables per query head and per kv head, both subspace splits, contiguous
// and paged caches, fp16 and bf16, outputs poisoned first (0xff bytes on both sides, so whole arrays compare).
// Also: the step's primitives captured in a CUDA graph and replayed equal the eager run, the device-value rules,
// and the host-side refusals (which run without a GPU).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "score_tables_problem.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::Random;
using test::same_bytes;
using test::TablesProblem;
using test::TablesShape;

template <class V>
void poison(std::vector<V>& x) {
  std::memset(static_cast<void*>(x.data()), 0xff, x.size() * sizeof(V));
}

/// A problem's arrays on the device, with its member names (the problem builds views over either).
template <class T>
struct DeviceTables {
  DeviceBuffer<float> centroids;
  DeviceBuffer<std::int32_t> base_ids, base_counts, slot_base, evicted, overlay_ids, overlay_sizes, slots, lengths;
  DeviceBuffer<half> base_scores, overlay_scores;
  DeviceBuffer<T> k, v, k_pages, v_pages, q;
  DeviceBuffer<std::int32_t> seq_lens, page_indptr, page_indices, last_page_len, chosen_indices, chosen_counts, weights;
  /// The base lists' token order (cuda::order_table_lists), which the dense reduction reads: rebuilt by every
  /// upload.
  std::int32_t token_ranges;
  DeviceBuffer<std::uint32_t> token_entries;
  DeviceBuffer<std::int32_t> token_offsets, token_prompt;
  explicit DeviceTables(const TablesProblem<T>& p)
      : centroids(p.centroids), base_ids(p.base_ids), base_counts(p.base_counts), slot_base(p.slot_base),
        evicted(p.evicted), overlay_ids(p.overlay_ids), overlay_sizes(p.overlay_sizes), slots(p.slots),
        lengths(p.lengths), base_scores(p.base_scores), overlay_scores(p.overlay_scores), k(p.k), v(p.v),
        k_pages(p.k_pages), v_pages(p.v_pages), q(p.q), seq_lens(p.seq_lens), page_indptr(p.page_indptr),
        page_indices(p.page_indices), last_page_len(p.last_page_len), chosen_indices(p.chosen_indices),
        chosen_counts(p.chosen_counts), weights(p.weights), token_ranges(table_token_ranges(p.capacity)),
        token_entries(p.base_ids.size()), token_offsets(p.base_counts.size() * std::size_t(token_ranges + 1)),
        token_prompt(std::size_t(p.bases)) {
    order(p);
  }
  TokenOrderView<const std::uint32_t> token_order() const {
    return {token_entries.data(), token_offsets.data(), token_prompt.data(), token_ranges};
  }
  /// The token order of every base, from the device lists, over the problem's prompts.
  void order(const TablesProblem<T>& p) {
    token_entries.poison();
    token_offsets.poison();
    token_prompt.poison();
    const std::size_t lists = std::size_t(p.table_heads) * p.lists();
    for (std::int32_t b = 0; b < p.bases; ++b) {
      BaseTablesView base = p.base(*this, b);
      base.token_order = {token_entries.data() + b * lists * p.length,
                          token_offsets.data() + b * lists * std::size_t(token_ranges + 1), token_prompt.data() + b,
                          token_ranges};
      cuda::order_table_lists(base, p.prompt[std::size_t(b)], cuda::Context{});
    }
  }
  /// The arrays the primitives write and the tests change, from the host.
  void upload(const TablesProblem<T>& p) {
    for (auto [d, h] : {std::pair{&base_ids, &p.base_ids}, {&base_counts, &p.base_counts}, {&evicted, &p.evicted},
                        {&overlay_ids, &p.overlay_ids}, {&overlay_sizes, &p.overlay_sizes}, {&slots, &p.slots},
                        {&lengths, &p.lengths}, {&chosen_indices, &p.chosen_indices},
                        {&chosen_counts, &p.chosen_counts}, {&weights, &p.weights}, {&slot_base, &p.slot_base}}) {
      d->upload(*h);
    }
    base_scores.upload(p.base_scores);
    overlay_scores.upload(p.overlay_scores);
    order(p);
  }
  /// The device arrays equal the host's, bit for bit.
  void expect_equal(const TablesProblem<T>& p, const char* what) const {
    EXPECT_EQ(base_ids.download(), p.base_ids) << what;
    EXPECT_EQ(base_counts.download(), p.base_counts) << what;
    EXPECT_TRUE(same_bytes(base_scores.download(), p.base_scores)) << what;
    EXPECT_EQ(evicted.download(), p.evicted) << what;
    EXPECT_EQ(overlay_sizes.download(), p.overlay_sizes) << what;
    EXPECT_EQ(overlay_ids.download(), p.overlay_ids) << what;
    EXPECT_TRUE(same_bytes(overlay_scores.download(), p.overlay_scores)) << what;
    EXPECT_EQ(chosen_counts.download(), p.chosen_counts) << what;
    EXPECT_EQ(chosen_indices.download(), p.chosen_indices) << what;
    EXPECT_EQ(weights.download(), p.weights) << what;
  }
};

/// The shapes every test runs: GQA group 4 with tables per kv head and per query head, both splits, more than 32
/// centroids (nearest_centroids' rounds) and probes past a warp, small and full overlays.
std::vector<TablesShape> shapes() {
  return {{.table_heads = 2},
          {.table_heads = 8, .head_dim = 64, .subspaces = 8, .split = SubspaceSplit::rope_pairs},
          {.batch = 2, .table_heads = 2, .centroids_per_subspace = 70, .length = 40, .overlay_capacity = 3,
           .probes = 40},
          {.batch = 4, .q_heads = 4, .kv_heads = 1, .table_heads = 4, .head_dim = 48, .subspaces = 3,
           .centroids_per_subspace = 33, .overlay_capacity = 9, .bases = 3, .probes = 5,
           .split = SubspaceSplit::rope_pairs}};
}

/// Runs check(rng, shape, paged) on every shape, cache layout and 16-bit type.
template <template <class> class Check>
void for_every_problem(Random& rng) {
  for (const TablesShape& shape : shapes()) {
    for (const bool paged : {false, true}) {
      SCOPED_TRACE(fmt::format("table_heads {}, head_dim {}, subspaces {}, centroids {}, probes {}, {}, {}",
                               shape.table_heads, shape.head_dim, shape.subspaces, shape.centroids_per_subspace,
                               shape.probes, shape.split == SubspaceSplit::contiguous ? "contiguous" : "rope_pairs",
                               paged ? "paged" : "contiguous cache"));
      Check<half>::run(rng, shape, paged);
      Check<bfloat16>::run(rng, shape, paged);
    }
  }
}

class CudaScoreTables : public test::GpuTest {};

template <class T>
struct CheckBuild {
  static void run(Random& rng, const TablesShape& shape, bool paged) {
    TablesProblem<T> p(rng, shape);
    DeviceTables<T> d(p);
    const std::int32_t head = rng.uniform_int(0, p.table_heads - 1), row = rng.uniform_int(0, p.batch - 1);
    const std::int32_t list_begin = rng.uniform_int(0, p.lists() - 1);
    const std::int32_t list_count = rng.uniform_int(1, p.lists() - list_begin);
    const std::int32_t begin = rng.uniform_int(0, p.seq_lens[row] - 1);
    const std::int32_t tokens = rng.uniform_int(1, p.seq_lens[row] - begin), cols = tokens + 3;
    std::vector<float> cpu_out(std::size_t(list_count) * cols);
    poison(cpu_out);
    DeviceBuffer<float> gpu_out(cpu_out);
    cpu::subspace_scores(p.base(p, 0), head, list_begin, list_count, p.cache(p, paged), row, begin,
                         tokens, MatrixView<float>::packed(cpu_out.data(), list_count, cols), cpu::Context{});
    cuda::subspace_scores(p.base(d, 0), head, list_begin, list_count, p.cache(d, paged), row, begin,
                          tokens, MatrixView<float>::packed(gpu_out.data(), list_count, cols), cuda::Context{});
    ASSERT_TRUE(same_bytes(gpu_out.download(), cpu_out)) << "subspace_scores";

    // The lists of those scores (table scores, many equal), and of raw values the rule must rank as stored.
    for (const bool raw : {false, true}) {
      std::vector<float> s = cpu_out;
      if (raw) {
        for (float& x : s) {
          const int kind = rng.uniform_int(0, 9);
          x = kind == 0 ? NAN : kind == 1 ? -0.0f : kind == 2 ? 0.0f : kind == 3 ? INFINITY : rng.uniform(-7e4f, 7e4f);
        }
      }
      DeviceBuffer<float> d_s(s);
      const std::int32_t keep = rng.uniform_int(1, p.length), used = rng.uniform_int(0, tokens);
      poison(p.base_ids);
      poison(p.base_scores);
      poison(p.base_counts);
      d.upload(p);
      const auto scores = [&](const float* x) { return MatrixView<const float>::packed(x, list_count, cols); };
      cpu::Array<std::byte> cpu_ws(cpu::store_table_lists_workspace_bytes(list_count, used));
      DeviceBuffer<std::byte> ws(cuda::store_table_lists_workspace_bytes(list_count, used));
      ws.poison();
      cpu::store_table_lists(scores(s.data()), used, keep, p.base(p, 1), head, list_begin, cpu_ws.bytes());
      cuda::store_table_lists(scores(d_s.data()), used, keep, p.base(d, 1), head, list_begin, {ws.data(), ws.size()},
                              nullptr);
      d.expect_equal(p, raw ? "store_table_lists of raw values" : "store_table_lists");
    }
  }
};

TEST_F(CudaScoreTables, BuildEqualsTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for_every_problem<CheckBuild>(rng);
}

/// store_table_lists of `rows` rows of `tokens` values from few (so many ties) into base 0, table head 1, from list 0.
void check_store(Random& rng, TablesProblem<half>& p, std::int32_t rows, std::int32_t tokens, int values) {
  DeviceTables<half> d(p);
  std::vector<float> s(std::size_t(rows) * tokens);
  for (float& x : s) x = float(rng.uniform_int(-values, values)) * 0.5f;
  DeviceBuffer<float> d_s(s);
  const auto scores = [&](const float* x) { return MatrixView<const float>::packed(x, rows, tokens); };
  cpu::Array<std::byte> cpu_ws(cpu::store_table_lists_workspace_bytes(rows, tokens));
  DeviceBuffer<std::byte> ws(cuda::store_table_lists_workspace_bytes(rows, tokens));
  cpu::store_table_lists(scores(s.data()), tokens, p.length, p.base(p, 0), 1, 0, cpu_ws.bytes());
  cuda::store_table_lists(scores(d_s.data()), tokens, p.length, p.base(d, 0), 1, 0, {ws.data(), ws.size()}, nullptr);
  d.expect_equal(p, "store_table_lists");
}

// Long rows (4 of 100,000 tokens, L = 20,000), and more rows than one sort takes (70,000 of 5 tokens, L = 3).
TEST_F(CudaScoreTables, LongAndManyListsEqualTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  TablesProblem<half> p(rng, {.batch = 1, .length = 20000, .bases = 1, .capacity = 32768});
  check_store(rng, p, 4, 100000, 15);
  TablesProblem<half> wide(rng, {.batch = 1, .head_dim = 2, .subspaces = 1, .centroids_per_subspace = 70000,
                                 .length = 3, .bases = 1, .probes = 1, .capacity = 8});
  check_store(rng, wide, 70000, 5, 3);
}

template <class T>
struct CheckAppend {
  static void run(Random& rng, const TablesShape& shape, bool paged) {
    TablesProblem<T> p(rng, shape);
    DeviceTables<T> d(p);
    for (std::int32_t step = 0; step < p.overlay_capacity + 3; ++step) {  // overlays fill, then replace their roots
      for (std::int32_t b = 0; b < p.batch; ++b) p.lengths[b] = std::min(p.lengths[b] + 1, p.seq_lens[b]);
      d.lengths.upload(p.lengths);
      cpu::append_tables(p.tables(p), p.cache(p, paged), p.slots.data(), p.lengths.data(), cpu::Context{});
      cuda::append_tables(p.tables(d), p.cache(d, paged), d.slots.data(), d.lengths.data(), cuda::Context{});
      d.expect_equal(p, "append_tables");
    }
  }
};

TEST_F(CudaScoreTables, AppendEqualsTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for_every_problem<CheckAppend>(rng);
}

/// Both reductions of the problem's chosen lists on both backends, every output poisoned first.
template <class T>
void check_reductions(TablesProblem<T>& p, DeviceTables<T>& d, const TableScoreOptions& options, const char* what) {
  SCOPED_TRACE(fmt::format("{}, weights {}, from_floor {}", what, options.weights != nullptr, options.from_floor));
  const std::int32_t rows = p.batch * p.kv_heads, group = p.group(), max_tokens = p.capacity;
  const TableScoreOptions d_options{options.weights != nullptr ? d.weights.data() : nullptr, options.from_floor};
  const auto t = p.tables(p).as_const();
  const auto dt = p.tables(d).as_const();
  std::vector<float> dense(std::size_t(rows) * max_tokens);
  std::vector<std::int32_t> row_k(rows);
  poison(dense);
  poison(row_k);
  DeviceBuffer<float> d_dense(dense);
  DeviceBuffer<std::int32_t> d_row_k(row_k);
  cpu::Array<std::byte> cpu_ws(cpu::table_scores_dense_workspace_bytes(rows, group, max_tokens));
  DeviceBuffer<std::byte> ws(cuda::table_scores_dense_workspace_bytes(rows, group, max_tokens));
  ws.poison();
  cpu::table_scores_dense(t, p.chosen_view(p), options, group, p.slots.data(), p.lengths.data(), p.window,
                          {.fraction = 0.3, .maximum = 40, .reserved = 3},
                          MatrixView<float>::packed(dense.data(), rows, max_tokens), row_k.data(), max_tokens,
                          cpu_ws.bytes());
  cuda::table_scores_dense(dt, p.chosen_view(d), d_options, group, d.slots.data(), d.lengths.data(), p.window,
                           {.fraction = 0.3, .maximum = 40, .reserved = 3},
                           MatrixView<float>::packed(d_dense.data(), rows, max_tokens), d_row_k.data(), max_tokens,
                           {ws.data(), ws.size()}, nullptr);
  EXPECT_TRUE(same_bytes(d_dense.download(), dense)) << "table_scores_dense";
  EXPECT_EQ(d_row_k.download(), row_k) << "table_scores_dense";

  const auto cap = std::int32_t(cuda::table_scores_sparse_capacity(p.chosen_capacity(), p.length));
  test::HostSelection out(p.batch, p.kv_heads, cap, true);
  std::vector<float> sums(out.indices.size());
  for (auto* x : {&out.indices, &out.counts, &row_k}) poison(*x);
  poison(out.log_weights);
  poison(sums);
  DeviceBuffer<std::int32_t> d_indices(out.indices), d_counts(out.counts);
  DeviceBuffer<float> d_weights(out.log_weights), d_sums(sums);
  d_row_k.upload(row_k);
  cpu::Array<std::byte> cpu_sws(cpu::table_scores_sparse_workspace_bytes(rows, p.chosen_capacity(), p.length));
  DeviceBuffer<std::byte> sws(cuda::table_scores_sparse_workspace_bytes(rows, p.chosen_capacity(), p.length));
  sws.poison();
  cpu::table_scores_sparse(t, p.chosen_view(p), options, group, p.slots.data(), p.lengths.data(), p.window, {1.0, 0, 5},
                           out.view, MatrixView<float>::packed(sums.data(), rows, cap), row_k.data(), cpu_sws.bytes());
  cuda::table_scores_sparse(dt, p.chosen_view(d), d_options, group, d.slots.data(), d.lengths.data(), p.window,
                            {1.0, 0, 5},
                            {d_indices.data(), d_counts.data(), d_weights.data(), p.batch, p.kv_heads, cap},
                            MatrixView<float>::packed(d_sums.data(), rows, cap), d_row_k.data(),
                            {sws.data(), sws.size()}, nullptr);
  EXPECT_EQ(d_counts.download(), out.counts) << "table_scores_sparse";
  EXPECT_EQ(d_indices.download(), out.indices) << "table_scores_sparse";
  EXPECT_TRUE(same_bytes(d_weights.download(), out.log_weights)) << "table_scores_sparse";
  EXPECT_TRUE(same_bytes(d_sums.download(), sums)) << "table_scores_sparse";
  EXPECT_EQ(d_row_k.download(), row_k) << "table_scores_sparse";
}

template <class T>
struct CheckSelect {
  static void run(Random& rng, const TablesShape& shape, bool) {
    TablesProblem<T> p(rng, shape);
    DeviceTables<T> d(p);
    for (const bool random_chosen : {true, false}) {
      if (!random_chosen) {  // nearest_centroids' lists and weights, as the selector chains them
        for (auto* x : {&p.chosen_indices, &p.chosen_counts, &p.weights}) poison(*x);
        d.upload(p);
        cpu::nearest_centroids(p.query(p), p.tables(p).as_const(), p.slots.data(), p.probes, p.chosen_view(p),
                               p.weights.data(), cpu::Context{});
        cuda::nearest_centroids(p.query(d), p.tables(d).as_const(), d.slots.data(), p.probes, p.chosen_view(d),
                                d.weights.data(), nullptr);
        d.expect_equal(p, "nearest_centroids");
      }
      for (const bool weighted : {false, true}) {
        for (const bool from_floor : {false, true}) {
          check_reductions(p, d, {weighted ? p.weights.data() : nullptr, from_floor},
                           random_chosen ? "random chosen lists" : "nearest centroids' lists");
        }
      }
    }
    // Without weights nearest_centroids writes the same lists.
    const auto chosen = p.chosen_indices;
    poison(p.chosen_indices);
    d.upload(p);
    cuda::nearest_centroids(p.query(d), p.tables(d).as_const(), d.slots.data(), p.probes, p.chosen_view(d), nullptr,
                            nullptr);
    EXPECT_EQ(d.chosen_indices.download(), chosen);
  }
};

TEST_F(CudaScoreTables, SelectEqualsTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for_every_problem<CheckSelect>(rng);
}

/// Rows of up to 140,000 tokens: the dense reduction's rows span many parts, and prompts reach past 65,536 tokens
/// (a token-order entry keeps its id's low 16 bits).
TEST_F(CudaScoreTables, LongRowsReduceEqualTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  TablesProblem<half> p(rng, {.batch = 2, .length = 6000, .probes = 3, .capacity = 140000});
  DeviceTables<half> d(p);
  check_reductions(p, d, {p.weights.data(), true}, "long rows");
  check_reductions(p, d, {nullptr, false}, "long rows");
}

/// append, nearest_centroids and both reductions captured once and replayed (state restored, outputs poisoned)
/// equal the eager run.
TEST_F(CudaScoreTables, GraphReplayEqualsEager) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  TablesProblem<bfloat16> p(rng, {.table_heads = 8});
  for (std::int32_t b = 0; b < p.batch; ++b) p.lengths[b] = p.seq_lens[b];
  DeviceTables<bfloat16> d(p);
  const std::int32_t rows = p.batch * p.kv_heads, group = p.group(), max_tokens = p.capacity;
  const auto cap = std::int32_t(cuda::table_scores_sparse_capacity(p.chosen_capacity(), p.length));
  DeviceBuffer<float> dense(std::size_t(rows) * max_tokens), sums(std::size_t(rows) * cap);
  DeviceBuffer<std::int32_t> row_k(rows), indices(std::size_t(rows) * cap), counts(rows);
  DeviceBuffer<std::byte> ws(cuda::table_scores_dense_workspace_bytes(rows, group, max_tokens));
  DeviceBuffer<std::byte> sws(cuda::table_scores_sparse_workspace_bytes(rows, p.chosen_capacity(), p.length));
  const test::Stream stream;
  const cuda::Context ctx{stream};
  const TableScoreOptions options{d.weights.data(), true};
  const auto step = [&] {
    cuda::append_tables(p.tables(d), p.cache(d, true), d.slots.data(), d.lengths.data(), ctx);
    const auto t = p.tables(d).as_const();
    cuda::nearest_centroids(p.query(d), t, d.slots.data(), p.probes, p.chosen_view(d), d.weights.data(), ctx);
    cuda::table_scores_dense(t, p.chosen_view(d), options, group, d.slots.data(), d.lengths.data(), p.window,
                             {.fraction = 0.2, .maximum = 30},
                             MatrixView<float>::packed(dense.data(), rows, max_tokens), row_k.data(), max_tokens,
                             {ws.data(), ws.size()}, ctx);
    cuda::table_scores_sparse(t, p.chosen_view(d), options, group, d.slots.data(), d.lengths.data(), p.window,
                              {.fraction = 0.2, .maximum = 30}, {indices.data(), counts.data(), nullptr, p.batch,
                                                                 p.kv_heads, cap},
                              MatrixView<float>::packed(sums.data(), rows, cap), row_k.data(),
                              {sws.data(), sws.size()}, ctx);
  };
  const auto outputs = [&] {  // every output's bytes
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<std::vector<std::byte>> all;
    const auto add = [&](const auto& buffer) {
      const auto x = buffer.download();
      all.emplace_back(reinterpret_cast<const std::byte*>(x.data()),
                       reinterpret_cast<const std::byte*>(x.data() + x.size()));
    };
    for (const auto* x : {&d.overlay_ids, &d.evicted, &d.overlay_sizes, &d.chosen_indices, &d.weights, &row_k,
                          &indices, &counts}) {
      add(*x);
    }
    add(d.overlay_scores);
    add(dense);
    add(sums);
    return all;
  };
  const auto reset = [&] {
    d.upload(p);
    for (auto* x : {&row_k, &indices, &counts}) x->poison();
    dense.poison();
    sums.poison();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the legacy-stream uploads and memsets before the non-blocking stream
  };
  reset();
  step();
  const auto eager = outputs();
  const test::CapturedGraph graph(stream, [&] { step(); });
  for (int replay = 0; replay < 2; ++replay) {
    reset();
    graph.launch();
    EXPECT_EQ(outputs(), eager) << "replay " << replay;
  }
}

/// Device values the host cannot check get selectors/csattention/cuda/score_tables.hpp's results.
TEST_F(CudaScoreTables, OutOfRangeDeviceValuesHaveTheDefinedResult) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  TablesProblem<half> p(rng, {.batch = 4, .q_heads = 4, .kv_heads = 1, .table_heads = 4});
  // Good rows agree with the CPU on the good problem; rows 0-2 are spoiled below, row 3 chooses only bad ids.
  TablesProblem<half> good = p;
  for (std::int32_t i = 0; i < 4; ++i) p.chosen_indices[3 * p.chosen_capacity() + i] = i % 2 == 0 ? -1 : 1 << 20;
  p.chosen_counts[3] = 4;
  p.slots[0] = p.slot_count;
  p.slot_base[p.slots[1]] = p.bases;
  p.lengths[2] = -1;
  DeviceTables<half> d(p);
  const std::int32_t rows = 4, max_tokens = p.capacity;
  DeviceBuffer<float> dense(std::size_t(rows) * max_tokens);
  DeviceBuffer<std::int32_t> row_k(rows);
  dense.poison();
  DeviceBuffer<std::byte> ws(cuda::table_scores_dense_workspace_bytes(rows, 4, max_tokens));
  cuda::table_scores_dense(p.tables(d).as_const(), p.chosen_view(d), {}, 4, d.slots.data(), d.lengths.data(),
                           p.window, {.fraction = 1.0, .maximum = 50}, MatrixView<float>::packed(dense.data(), rows,
                                                                                                 max_tokens),
                           row_k.data(), max_tokens, {ws.data(), ws.size()}, nullptr);
  EXPECT_EQ(row_k.download(), (std::vector<std::int32_t>{-1, -1, -1, 0}));
  const auto scores = dense.download();
  for (std::int32_t t = 0; t < max_tokens; ++t) {
    EXPECT_TRUE(std::isnan(scores[t]) && std::isnan(scores[max_tokens + t]) && std::isnan(scores[2 * max_tokens + t]))
        << "a bad row was written at " << t;
    if (t < p.lengths[3]) {
      EXPECT_EQ(scores[3 * max_tokens + t], -INFINITY) << "no list gives a candidate";
    }
  }
  std::vector<std::int32_t> chosen(std::size_t(rows) * p.chosen_capacity()), weights(chosen.size()), counts(rows);
  poison(chosen);
  poison(counts);
  p.chosen_indices = chosen;
  p.weights = weights;
  p.chosen_counts = counts;
  d.upload(p);
  cuda::nearest_centroids(p.query(d), p.tables(d).as_const(), d.slots.data(), p.probes, p.chosen_view(d), nullptr,
                          nullptr);
  cpu::nearest_centroids(good.query(good), good.tables(good).as_const(), good.slots.data(), p.probes,
                         good.chosen_view(good), nullptr, cpu::Context{});
  const auto got = d.chosen_counts.download(), got_ids = d.chosen_indices.download();
  EXPECT_EQ(got, (std::vector<std::int32_t>{-1, -1, good.chosen_counts[2], good.chosen_counts[3]}));
  for (std::int32_t i = 0; i < 2 * p.chosen_capacity(); ++i) EXPECT_EQ(got_ids[i], -1) << "a bad row was written";
  for (std::int32_t i = 0; i < p.chosen_capacity(); ++i) {
    EXPECT_EQ(got_ids[3 * p.chosen_capacity() + i], good.chosen_indices[3 * p.chosen_capacity() + i]);
  }

  // append: rows whose slot, base or length is bad change nothing; subspace_scores: tokens past the length are NaN.
  p.lengths = {1, 1, 0, p.seq_lens[3] + 1};
  d.upload(p);
  cuda::append_tables(p.tables(d), p.cache(d, false), d.slots.data(), d.lengths.data(), cuda::Context{});
  d.expect_equal(p, "append_tables of bad rows");
  DeviceBuffer<float> out(std::size_t(3) * 8);
  cuda::subspace_scores(p.base(d, 0), 0, 0, 3, p.cache(d, true), 3, p.seq_lens[3] - 5, 8,
                        MatrixView<float>::packed(out.data(), 3, 8), cuda::Context{});
  std::vector<float> cpu_out(3 * 8, NAN);
  cpu::subspace_scores(p.base(p, 0), 0, 0, 3, p.cache(p, true), 3, p.seq_lens[3] - 5, 5,
                       MatrixView<float>::packed(cpu_out.data(), 3, 8), cpu::Context{});
  const auto got_scores = out.download();
  for (std::int32_t i = 0; i < 24; ++i) {
    if (i % 8 < 5) {
      EXPECT_EQ(got_scores[i], cpu_out[i]) << i;
    } else {
      EXPECT_TRUE(std::isnan(got_scores[i])) << "a token past the length at " << i;
    }
  }
}

/// order_table_lists against the lists: per list, offsets[r] counts the entries of ranges below r and the
/// entries of range r are the list's (id, score) pairs with ids in it, every one of the list's count, over prompts
/// past 65,536 tokens (an entry keeps its id's low 16 bits); the prompt is written.
TEST_F(CudaScoreTables, TokenOrderHoldsEachListByRange) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  TablesProblem<half> p(rng, {.length = 3000, .capacity = 100000});
  DeviceTables<half> d(p);
  const auto entries = d.token_entries.download();
  const auto offsets = d.token_offsets.download();
  EXPECT_EQ(d.token_prompt.download(), p.prompt);
  const std::size_t ranges = std::size_t(d.token_ranges), lists = p.base_counts.size();
  ASSERT_EQ(ranges, 98u);
  for (std::size_t list = 0; list < lists; ++list) {
    const std::int32_t* off = offsets.data() + list * (ranges + 1);
    std::vector<std::vector<std::pair<std::int32_t, std::uint16_t>>> expected(ranges), got(ranges);
    for (std::int32_t e = 0; e < p.base_counts[list]; ++e) {
      const std::int32_t id = p.base_ids[list * p.length + e];
      expected[std::size_t(id) / kTableTokenRange].emplace_back(id, p.base_scores[list * p.length + e].bits);
    }
    ASSERT_EQ(off[0], 0) << "list " << list;
    for (std::size_t r = 0; r < ranges; ++r) {
      ASSERT_EQ(off[r + 1] - off[r], std::int32_t(expected[r].size())) << "list " << list << " range " << r;
      for (std::int32_t e = off[r]; e < off[r + 1]; ++e) {
        const std::uint32_t x = entries[list * p.length + std::size_t(e)];
        got[r].emplace_back(std::int32_t(r / 64 * 65536 + (x & 0xffffu)), std::uint16_t(x >> 16));
      }
      std::sort(expected[r].begin(), expected[r].end());
      std::sort(got[r].begin(), got[r].end());
      EXPECT_EQ(got[r], expected[r]) << "list " << list << " range " << r;
    }
  }
}

/// Host-side refusals: shapes only, before any device call (no GPU needed), with the CPU's messages.
TEST(CudaScoreTablesBadInput, RefusedBeforeAnyDeviceCall) {
  Random rng(1);
  TablesProblem<half> p(rng, {});
  std::vector<float> s(64);
  std::vector<std::byte> ws(1 << 16);
  test::expect_error([&] {
    cuda::store_table_lists(MatrixView<const float>::packed(s.data(), 2, 32), 32, 0, p.base(p, 0), 0, 0,
                            {ws.data(), ws.size()}, nullptr);
  }, {"cuda::store_table_lists", "keep (= 0) is outside [1, base.length = 24]"});
  test::expect_error([&] {
    cuda::subspace_scores(p.base(p, 0), 0, 40, 20, p.cache(p, false), 0, 0, 8,
                          MatrixView<float>::packed(s.data(), 20, 8), nullptr);
  }, {"cuda::subspace_scores", "lists [40, 40 + 20) are outside [0, base lists = 48)"});
  auto odd = p.tables(p);
  odd.table_heads = 3;
  test::expect_error([&] {
    cuda::append_tables(odd, p.cache(p, true), p.slots.data(), p.lengths.data(), nullptr);
  }, {"cuda::append_tables", "tables.table_heads (= 3) is not a multiple of kv_heads (= 2)"});
  test::expect_error([&] {
    cuda::nearest_centroids(p.query(p), p.tables(p).as_const(), p.slots.data(), 13, p.chosen_view(p), nullptr,
                            nullptr);
  }, {"cuda::nearest_centroids", "probes (= 13) is outside [1, min(centroids_per_subspace = 12, 64)]"});
  auto chosen = p.chosen_view(p);
  chosen.capacity = 30;
  std::vector<std::int32_t> row_k(6);
  test::expect_error([&] {
    cuda::table_scores_dense(p.tables(p).as_const(), chosen, {}, 4, p.slots.data(), p.lengths.data(), p.window,
                             {.fraction = 0.5, .maximum = 8}, MatrixView<float>::packed(s.data(), 6, 160), row_k.data(),
                             160, {ws.data(), ws.size()}, nullptr);
  }, {"cuda::table_scores_dense", "chosen.capacity (= 30) is not a multiple of heads_per_row (= 4)"});
  test::expect_error([&] {  // the host tables keep no token order
    cuda::table_scores_dense(p.tables(p).as_const(), p.chosen_view(p), {}, 4, p.slots.data(), p.lengths.data(),
                             p.window, {.fraction = 0.5, .maximum = 8}, MatrixView<float>::packed(s.data(), 6, 160),
                             row_k.data(), 160, {ws.data(), ws.size()}, nullptr);
  }, {"cuda::table_scores_dense", "tables.token_order is empty"});
  std::vector<std::uint32_t> entries(p.base_ids.size());
  std::vector<std::int32_t> offsets(p.base_counts.size() * 200), prompt(2);
  BaseTablesView base = p.base(p, 0);
  test::expect_error([&] { cuda::order_table_lists(base, 10, nullptr); },
                     {"cuda::order_table_lists", "base.token_order is empty"});
  for (const std::int32_t ranges : {0, kMaxTableTokenRanges + 1}) {
    base.token_order = {entries.data(), offsets.data(), prompt.data(), ranges};
    test::expect_error([&] { cuda::order_table_lists(base, 10, nullptr); },
                       {"cuda::order_table_lists", fmt::format("base.token_order.ranges (= {}) is outside [1, 12288]",
                                                               ranges)});
  }
  base.token_order.ranges = 2;
  test::expect_error([&] { cuda::order_table_lists(base, 2049, nullptr); },
                     {"cuda::order_table_lists", "tokens (= 2049) is outside [0, base.token_order.ranges * 1024 = 2048]"});
  test::HostSelection out(3, 2, 100, false);
  test::expect_error([&] {
    cuda::table_scores_sparse(p.tables(p).as_const(), p.chosen_view(p), {}, 4, p.slots.data(), p.lengths.data(),
                              p.window, {.fraction = 0.5, .maximum = 8}, out.view,
                              MatrixView<float>::packed(s.data(), 6, 100), row_k.data(), {ws.data(), ws.size()},
                              nullptr);
  }, {"cuda::table_scores_sparse", "out.capacity (= 100) < chosen.capacity * tables.length (= 768)"});
  test::expect_error([&] { cuda::table_scores_sparse_workspace_bytes(1 << 20, 512, 1 << 12); },
                     "exceeds 2^31 - 1 entries");
  test::expect_error([&] { cuda::store_table_lists_workspace_bytes(0, 10); }, "list_rows (= 0) must be positive");
}

}  // namespace
}  // namespace kvsift
