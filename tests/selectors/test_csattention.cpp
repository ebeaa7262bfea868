// CSAttention on the CPU (selectors/csattention/csattention.hpp) through a DecodeStep, against references written here:
// - with alpha = 1 every list holds the whole prompt, and both reductions give every key fp64's sum over the
//   subspaces of c . k^(s) for the query's nearest centroids (fp16 rounding apart); the nearest centroids are
//   fp64's cosine argmax;
// - at every decode step, every list a sequence reads is the top L (by its fp16 score, then the older id) of all
//   the keys seen, the base never changes, and the selection is the top K of fp64 sums of the lists' stored scores
//   (max over the group, 0 where a head lacks the key); the dense and sort reductions select the same tokens;
// - both GQA table modes and both subspace splits; every refused configuration and prefill.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/csattention/csattention.hpp"
#include "kvsift/step/decode_step.hpp"
#include "ctkvr_problem.hpp"
#include "selector_check.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::CtkvrProblem;
using test::kCtkvrWindow;
using test::Random;
using Selector = Csattention<half, cpu::Context>;

/// Steps `steps` decode tokens (the step's workspace poisoned before each); check(step, query, selection).
template <class Check>
void decode(CtkvrProblem& p, DecodeStep<Selector>& step, Random& rng, std::int32_t steps, Check check) {
  cpu::Array<std::byte> workspace(step.workspace_bytes());
  std::vector<float> o(std::size_t(p.q_heads) * p.head_dim), lse(p.q_heads);
  for (std::int32_t s = 0; s < steps; ++s) {
    ++p.length;
    std::memset(workspace.data(), 0xff, workspace.size());
    const std::vector<half> q = test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim));
    const std::vector<half> nk = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
    const std::vector<half> nv = test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim));
    step.run({.q = QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim), .cache = p.cache(),
              .k = HeadsView<const half>::packed(nk.data(), 1, p.kv_heads, p.head_dim),
              .v = HeadsView<const half>::packed(nv.data(), 1, p.kv_heads, p.head_dim), .slots = &p.slot},
             StateView<float>::packed(o.data(), lse.data(), 1, p.q_heads, p.head_dim), workspace.bytes(), {});
    check(s, q, step.selection(workspace.bytes(), 1));
  }
}

/// The test's own fp32 partial score (FMAs in ascending element order, as both backends promise), in table form.
float partial_score(const float* centroid, const half* x, SubspaceSplit split, std::int32_t s, std::int32_t width,
                    std::int32_t head_dim) {
  float sum = 0.0f;
  for (std::int32_t j = 0; j < width; ++j) {
    sum = std::fma(centroid[j], to_float(x[subspace_channel(split, s, j, width, head_dim)]), sum);
  }
  return table_score(sum);
}

/// The (id, stored score) entries list l of table head t of slot 0 reads: its kept base part and its overlay.
std::map<std::int32_t, float> read_list(const ScoreTablesView<const std::int32_t>& t, std::int32_t h, std::int32_t l) {
  std::map<std::int32_t, float> entries;
  const std::int64_t list = t.list_index(0, h, l);
  const std::int32_t kept = t.base_counts[list] - t.evicted[list];
  for (std::int32_t p = 0; p < kept; ++p) {
    entries[t.base_ids[t.base_entry(0, h, l) + p]] = half_to_float(t.base_scores[t.base_entry(0, h, l) + p]);
  }
  for (std::int32_t p = 0; p < t.overlay_sizes[list]; ++p) {
    entries[t.overlay_ids[t.overlay_entry(0, h, l) + p]] = half_to_float(t.overlay_scores[t.overlay_entry(0, h, l) + p]);
  }
  return entries;
}

/// Every list is the top L of all the keys [0, length) by (table score, then the smaller id).
void expect_lists_are_top_l(const CtkvrProblem& p, const ScoreTablesView<const std::int32_t>& t, std::int32_t length,
                            const std::string& what) {
  for (std::int32_t h = 0; h < t.table_heads; ++h) {
    const std::int32_t g = h * p.kv_heads / t.table_heads;
    for (std::int32_t l = 0; l < t.lists(); ++l) {
      const std::int32_t s = l / t.centroids_per_subspace, c = l % t.centroids_per_subspace;
      std::vector<std::pair<float, std::int32_t>> all;
      for (std::int32_t id = 0; id < length; ++id) {
        const half* key = p.k.data() + (std::size_t(g) * p.capacity + id) * p.head_dim;
        all.emplace_back(-partial_score(t.centroid(0, h, s, c), key, t.split, s, t.width, p.head_dim), id);
      }
      std::sort(all.begin(), all.end());
      const std::int32_t size = t.base_counts[t.list_index(0, h, l)];
      std::map<std::int32_t, float> want;
      for (std::int32_t i = 0; i < size; ++i) want[all[std::size_t(i)].second] = -all[std::size_t(i)].first;
      ASSERT_EQ(read_list(t, h, l), want) << what << ": table head " << h << " list " << l;
    }
  }
}

/// fp64: the per-subspace nearest centroid (cosine) of query head h's sub-vectors, in table head th.
std::vector<std::int32_t> nearest(const ScoreTablesView<const std::int32_t>& t, const half* q, std::int32_t th) {
  std::vector<std::int32_t> out;
  for (std::int32_t s = 0; s < t.subspaces; ++s) {
    double best = -2;
    std::int32_t arg = 0;
    for (std::int32_t c = 0; c < t.centroids_per_subspace; ++c) {
      double dot = 0, qq = 0;
      for (std::int32_t j = 0; j < t.width; ++j) {
        const double x = to_float(q[subspace_channel(t.split, s, j, t.width, t.head_dim())]);
        dot += x * t.centroid(0, th, s, c)[j];
        qq += x * x;
      }
      const double cosine = dot / std::sqrt(qq);
      if (cosine > best) best = cosine, arg = c;
    }
    out.push_back(s * t.centroids_per_subspace + arg);
  }
  return out;
}

/// The weight of query sub-vector s by the formula the backends promise (selectors/csattention/score_tables.hpp table_weight).
double sub_vector_weight(const ScoreTablesView<const std::int32_t>& t, const half* q, std::int32_t s) {
  float square_sum = 0.0f;
  for (std::int32_t j = 0; j < t.width; ++j) {
    const float x = to_float(q[subspace_channel(t.split, s, j, t.width, t.head_dim())]);
    square_sum = std::fma(x, x, square_sum);
  }
  return table_weight(std::sqrt(square_sum)) / double(kTableWeightOne);
}

/// fp64 scores of kv head g's candidates: per head the sum over its nearest lists of weight * (stored score -
/// floor), max over heads (0 where a head lacks the key); middle tokens only. Weights: the sub-vector norms
/// (weighted) or 1; floor: the list's lowest score (from_floor) or 0.
std::map<std::int32_t, double> candidate_scores(const CtkvrProblem& p, const ScoreTablesView<const std::int32_t>& t,
                                                const std::vector<half>& q, std::int32_t g, bool weighted = false,
                                                bool from_floor = false) {
  const std::int32_t group = p.q_heads / p.kv_heads;
  std::vector<std::map<std::int32_t, double>> per_head(static_cast<std::size_t>(group));
  for (std::int32_t j = 0; j < group; ++j) {
    const std::int32_t h = g * group + j, th = h * t.table_heads / p.q_heads;
    for (const std::int32_t l : nearest(t, q.data() + std::size_t(h) * p.head_dim, th)) {
      const std::map<std::int32_t, float> list = read_list(t, th, l);
      double floor = 0;
      if (from_floor && !list.empty()) {
        floor = 1e300;
        for (const auto& entry : list) floor = std::min(floor, double(entry.second));
      }
      const double weight =
          weighted ? sub_vector_weight(t, q.data() + std::size_t(h) * p.head_dim, l / t.centroids_per_subspace) : 1.0;
      for (const auto& [id, score] : list) {
        if (id >= kCtkvrWindow.sink_end(p.length) && id < kCtkvrWindow.recent_begin(p.length)) {
          per_head[std::size_t(j)][id] += weight * (score - floor);
        }
      }
    }
  }
  std::map<std::int32_t, double> best;
  for (std::int32_t j = 0; j < group; ++j) {
    for (const auto& [id, sum] : per_head[std::size_t(j)]) {
      double value = sum;
      for (std::int32_t o = 0; o < group; ++o) {
        const auto it = per_head[std::size_t(o)].find(id);
        value = std::max(value, it == per_head[std::size_t(o)].end() ? 0.0 : it->second);
      }
      best[id] = value;
    }
  }
  return best;
}

using Mode = std::tuple<std::int32_t, CsattentionTables, SubspaceSplit>;
class CpuCsattention : public test::SeededTest, public ::testing::WithParamInterface<Mode> {};
INSTANTIATE_TEST_SUITE_P(Modes, CpuCsattention,
                         ::testing::Combine(::testing::Values(1, 4),
                                            ::testing::Values(CsattentionTables::per_query_head,
                                                              CsattentionTables::per_kv_head),
                                            ::testing::Values(SubspaceSplit::contiguous, SubspaceSplit::rope_pairs)));

CsattentionConfig small_config(const Mode& mode, double alpha, bool kvsift_options = false) {
  return {.subspaces = 8, .split = std::get<2>(mode), .tables = std::get<1>(mode), .centroids = 6,
          .list_fraction = alpha, .keep_fraction = 0.2, .weight_by_norm = kvsift_options,
          .from_floor = kvsift_options, .overlay_capacity = 64, .prepare_chunk = 20};
}

TEST_P(CpuCsattention, WholeListsSumToTheQuerysPartialScores) {
  SCOPED_TRACE(seed);
  const std::int32_t group = std::get<0>(GetParam());
  CtkvrProblem p(rng, 2 * group, 2, 120, 16);
  Selector selector(p.limits(), small_config(GetParam(), 1.0));
  selector.prepare(p.prefill(), {});
  const auto t = selector.index_tables();
  ASSERT_EQ(t.base_counts[0], p.prompt);
  const std::vector<half> q = test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim));
  const std::int32_t chosen_cap = group * 8;
  std::vector<std::int32_t> chosen(std::size_t(p.kv_heads * chosen_cap), -7), chosen_counts(std::size_t(p.kv_heads), -7);
  const SelectionView chosen_view{chosen.data(), chosen_counts.data(), nullptr, 1, p.kv_heads, chosen_cap};
  cpu::nearest_centroids(QueryView<const half>::packed(q.data(), 1, p.q_heads, p.head_dim), t, &p.slot, 1, chosen_view,
                         nullptr);
  for (std::int32_t g = 0; g < p.kv_heads; ++g) {
    ASSERT_EQ(chosen_counts[std::size_t(g)], chosen_cap);
    for (std::int32_t j = 0; j < group; ++j) {
      const std::int32_t h = g * group + j, th = h * t.table_heads / p.q_heads;
      const std::vector<std::int32_t> want = nearest(t, q.data() + std::size_t(h) * p.head_dim, th);
      for (std::int32_t s = 0; s < 8; ++s) {
        EXPECT_EQ(chosen[std::size_t(g * chosen_cap + j * 8 + s)], th * t.lists() + want[std::size_t(s)]) << h << " " << s;
      }
    }
  }
  // Both reductions against fp64 sums of c . k^(s) (each partial rounded to fp16 by the table: 2^-11 relative).
  const LengthBudget budget{.fraction = 1, .maximum = p.prompt};
  std::vector<float> dense(std::size_t(p.kv_heads * p.prompt), -7.0f);
  std::vector<std::int32_t> row_k(std::size_t(p.kv_heads), -7);
  cpu::Array<std::byte> ws(cpu::table_scores_dense_workspace_bytes(p.kv_heads, group, p.prompt));
  std::vector<std::int32_t> lengths{p.prompt};
  cpu::table_scores_dense(t, chosen_view, {}, group, &p.slot, lengths.data(), kCtkvrWindow, budget,
                          MatrixView<float>::packed(dense.data(), p.kv_heads, p.prompt), row_k.data(), p.prompt, ws.bytes());
  const std::int32_t cap = std::int32_t(cpu::table_scores_sparse_capacity(chosen_cap, t.length));
  std::vector<std::int32_t> ids(std::size_t(p.kv_heads * cap), -7), counts(std::size_t(p.kv_heads), -7);
  std::vector<float> sums(std::size_t(p.kv_heads * cap), -7.0f);
  std::vector<std::int32_t> sparse_k(std::size_t(p.kv_heads), -7);
  cpu::Array<std::byte> sparse_ws(cpu::table_scores_sparse_workspace_bytes(p.kv_heads, chosen_cap, t.length));
  cpu::table_scores_sparse(t, chosen_view, {}, group, &p.slot, lengths.data(), kCtkvrWindow, budget,
                           {ids.data(), counts.data(), nullptr, 1, p.kv_heads, cap},
                           MatrixView<float>::packed(sums.data(), p.kv_heads, cap), sparse_k.data(), sparse_ws.bytes());
  const std::int32_t lo = kCtkvrWindow.sink_end(p.prompt), hi = kCtkvrWindow.recent_begin(p.prompt);
  for (std::int32_t g = 0; g < p.kv_heads; ++g) {
    ASSERT_EQ(counts[std::size_t(g)], hi - lo);
    EXPECT_EQ(row_k[std::size_t(g)], std::min(p.prompt - 8, hi - lo));
    EXPECT_EQ(sparse_k[std::size_t(g)], row_k[std::size_t(g)]);
    for (std::int32_t id = 0; id < p.prompt; ++id) {
      const float got = dense[std::size_t(g * p.prompt + id)];
      if (id < lo || id >= hi) {
        EXPECT_EQ(got, -INFINITY) << id;
        continue;
      }
      EXPECT_EQ(ids[std::size_t(g * cap + id - lo)], id);
      EXPECT_EQ(sums[std::size_t(g * cap + id - lo)], got) << "the reductions differ at " << id;
      double best = -1e300, tolerance = 1e-6;
      for (std::int32_t j = 0; j < group; ++j) {
        const std::int32_t h = g * group + j, th = h * t.table_heads / p.q_heads;
        double sum = 0, magnitude = 0;
        for (const std::int32_t l : nearest(t, q.data() + std::size_t(h) * p.head_dim, th)) {
          const std::int32_t s = l / t.centroids_per_subspace;
          double dot = 0;
          for (std::int32_t e = 0; e < t.width; ++e) {
            dot += double(t.centroid(0, th, s, l % t.centroids_per_subspace)[e]) *
                   to_float(p.k[(std::size_t(g) * p.capacity + id) * p.head_dim +
                                subspace_channel(t.split, s, e, t.width, p.head_dim)]);
          }
          sum += dot;
          magnitude += std::abs(dot);
        }
        EXPECT_GE(got, sum - (magnitude * 0x1p-10 + 1e-6)) << "the max over heads is below head " << h;
        best = std::max(best, sum);
        tolerance = std::max(tolerance, magnitude * 0x1p-10 + 1e-6);
      }
      EXPECT_NEAR(got, best, tolerance) << "kv head " << g << " token " << id;
    }
  }
}

TEST_P(CpuCsattention, ListsStayTheTopLAndTheSelectionTheTopKAtEveryStep) {
  SCOPED_TRACE(seed);
  const std::int32_t group = std::get<0>(GetParam());
  CtkvrProblem p(rng, 2 * group, 2, 120, 16);
  for (const bool options : {false, true}) {  // the paper's sums; weighted by the norms, from the lists' floors
  SCOPED_TRACE(options ? "weight_by_norm and from_floor" : "the paper's sums");
  std::vector<std::vector<std::int32_t>> selections[2];
  for (const CsattentionReduce reduce : {CsattentionReduce::dense, CsattentionReduce::sort}) {
    CtkvrProblem run = p;
    Random steps_rng(seed + 1);
    CsattentionConfig config = small_config(GetParam(), 0.25, options);
    config.reduce = reduce;
    DecodeStep step(Selector(run.limits(), config), run.config(), {});
    step.prepare(run.prefill(), {});
    const auto t = step.selector().index_tables();
    const std::vector<std::int32_t> base_ids(t.base_ids, t.base_ids + std::size_t(t.table_heads) * t.lists() * t.length);
    expect_lists_are_top_l(run, t, run.prompt, "after prefill");
    decode(run, step, steps_rng, 12, [&](std::int32_t s, const std::vector<half>& q, const SelectionView& sel) {
      expect_lists_are_top_l(run, t, run.length, fmt::format("step {}", s));
      const std::int32_t k = std::int32_t(std::floor(0.2 * run.length)) - 8;
      for (std::int32_t g = 0; g < p.kv_heads; ++g) {
        const std::vector<std::int32_t> chosen(sel.row(0, g), sel.row(0, g) + sel.count(0, g));
        test::expect_top_k(chosen, candidate_scores(run, t, q, g, options, options), k, 1e-5,
                           fmt::format("step {} kv head {}", s, g));
        selections[int(reduce)].push_back(chosen);
      }
    });
    EXPECT_TRUE(std::equal(base_ids.begin(), base_ids.end(), t.base_ids)) << "an insert changed the base";
  }
  EXPECT_EQ(selections[0], selections[1]) << "the dense and sort reductions selected differently";
  }
}

TEST_P(CpuCsattention, SearchPeriodReusesTheSelectionAndAddsWhatLeftTheWindow) {
  SCOPED_TRACE(seed);
  const std::int32_t group = std::get<0>(GetParam());
  CtkvrProblem p(rng, 2 * group, 2, 120, 16);
  const CsattentionConfig config =
      csattention_schedule(CsattentionSchedule::keep15_every4, small_config(GetParam(), 0.25, true));
  ASSERT_EQ(config.search_period, 4);
  DecodeStep step(Selector(p.limits(), config), p.config(), {});
  step.prepare(p.prefill(), {});
  EXPECT_EQ(step.selector().capacity(), std::int32_t(0.15 * p.capacity) + 3);
  const auto t = step.selector().index_tables();
  std::vector<std::vector<std::int32_t>> searched(std::size_t(p.kv_heads));
  std::int32_t searched_length = 0;
  decode(p, step, rng, 10, [&](std::int32_t s, const std::vector<half>& q, const SelectionView& sel) {
    EXPECT_EQ(step.selector().searches_next(), (s + 1) % 4 == 0) << "after step " << s;
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      const std::vector<std::int32_t> chosen(sel.row(0, g), sel.row(0, g) + sel.count(0, g));
      if (s % 4 == 0) {  // a search
        const std::int32_t k = std::int32_t(std::floor(0.15 * p.length)) - 8;
        test::expect_top_k(chosen, candidate_scores(p, t, q, g, true, true), k, 1e-5,
                           fmt::format("step {} kv head {}", s, g));
        searched[std::size_t(g)] = chosen;
        searched_length = p.length;
        continue;
      }
      // The search's tokens, then every middle token from where the window began at the search.
      std::vector<std::int32_t> want = searched[std::size_t(g)];
      for (std::int32_t id = kCtkvrWindow.recent_begin(searched_length); id < kCtkvrWindow.recent_begin(p.length); ++id) {
        want.push_back(id);
      }
      EXPECT_EQ(chosen, want) << "step " << s << " kv head " << g;
      // With the window, every token generated since the search is attended.
      for (std::int32_t id = searched_length - 1; id < p.length; ++id) {
        EXPECT_TRUE(id >= kCtkvrWindow.recent_begin(p.length) || std::binary_search(chosen.begin(), chosen.end(), id))
            << id;
      }
    }
  });
}

TEST_P(CpuCsattention, KMeansTrainsOnEverySthQueryAndTheMiniBatchOption) {
  // max_points_per_centroid caps a problem's points near C * max (C = 6): the centroids must be those of the same
  // selector without the cap over a prefill holding only every s-th query, s = floor(pooled / (C * max)).
  SCOPED_TRACE(seed);
  const std::int32_t group = std::get<0>(GetParam());
  CtkvrProblem p(rng, 2 * group, 2, 120, 40);
  const std::int32_t per_table = std::get<1>(GetParam()) == CsattentionTables::per_kv_head ? group : 1;
  const std::int32_t most = per_table == 1 ? 2 : 5;  // s = 3 (14 queries kept) or 5 (8 kept): at least C
  const std::int32_t stride = per_table * p.queries / (6 * most), kept = (p.queries + stride - 1) / stride;
  ASSERT_GT(stride, 1);
  CsattentionConfig capped = small_config(GetParam(), 0.5), whole = capped;
  capped.max_points_per_centroid = most;
  whole.max_points_per_centroid = 0;
  Selector a(p.limits(), capped), b(p.limits(), whole);
  a.prepare(p.prefill(), {});
  std::vector<half> sampled;
  for (std::int32_t h = 0; h < p.q_heads; ++h) {
    for (std::int32_t t = 0; t < p.queries; t += stride) {
      const half* row = p.prefill_q.data() + (std::size_t(h) * p.queries + t) * p.head_dim;
      sampled.insert(sampled.end(), row, row + p.head_dim);
    }
  }
  PrefillInputs<half> strided = p.prefill();
  strided.queries = SequenceView<const half>::packed(sampled.data(), 1, p.q_heads, kept, p.head_dim);
  b.prepare(strided, {});
  const auto ta = a.index_tables(), tb = b.index_tables();
  const std::size_t centroids = std::size_t(ta.table_heads) * 8 * 6 * ta.width;
  ASSERT_EQ(std::memcmp(ta.centroids, tb.centroids, centroids * sizeof(float)), 0);
  ASSERT_EQ(std::memcmp(ta.base_ids, tb.base_ids, std::size_t(ta.table_heads) * 8 * 6 * ta.length * 4), 0);
  // Mini-batch: a batch at least the problem's points is the full batch, bit for bit; a small one moves the
  // centroids elsewhere, still unit norm.
  const auto centroids_of = [&](std::int32_t batch) {
    CsattentionConfig config = whole;
    config.kmeans_batch = batch;
    Selector selector(p.limits(), config);
    selector.prepare(p.prefill(), {});
    const float* c = selector.index_tables().centroids;
    return std::vector<float>(c, c + centroids);
  };
  const std::vector<float> full = centroids_of(0), small = centroids_of(3);
  ASSERT_EQ(centroids_of(per_table * p.queries), full);
  ASSERT_NE(small, full);
  for (std::size_t c = 0; c < small.size(); c += std::size_t(ta.width)) {
    double norm = 0;
    for (std::int32_t j = 0; j < ta.width; ++j) norm += double(small[c + j]) * small[c + j];
    ASSERT_NEAR(norm, 1.0, 1e-5) << "centroid " << c / std::size_t(ta.width);
  }
}

TEST_F(CpuCsattention, IndexBytesCountBaseAndOverlay) {
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 1000, .q_heads = 8, .kv_heads = 2, .head_dim = 64};
  for (const auto tables : {CsattentionTables::per_query_head, CsattentionTables::per_kv_head}) {
    const Selector s(limits, {.tables = tables, .centroids = 16, .list_fraction = 0.1, .overlay_capacity = 32});
    const std::size_t heads = tables == CsattentionTables::per_query_head ? 8 : 2, lists = 2 * heads * 8 * 16;
    // Two base storages and two slots' overlays; on the host, per storage its references, N and L, per slot its base.
    EXPECT_EQ(s.index_bytes().host,
              lists * 8 * 4 + lists * 100 * 6 + lists * 32 * 6 + lists * 4 * 3 + 2 * 4 + 2 * 3 * 4 + 2 * 4);
    EXPECT_EQ(s.capacity(), 50);
  }
}

TEST_F(CpuCsattention, BadConfigurationsAndPrefillsAreRefused) {
  CtkvrProblem p(rng, 4, 2, 100, 8);
  test::expect_error([&] { Selector(p.limits(), {.subspaces = 5}); },
                     "Csattention: config.subspaces (m = 5) does not divide head_dim (= 32)");
  test::expect_error([&] { Selector(p.limits(), {.subspaces = 32, .split = SubspaceSplit::rope_pairs}); },
                     "SubspaceSplit::rope_pairs needs an even subspace width; head_dim / subspaces = 32 / 32");
  test::expect_error([&] { Selector(p.limits(), {.list_fraction = 0}); }, "config.list_fraction (alpha = 0) is outside (0, 1]");
  test::expect_error([&] { Selector(p.limits(), {.list_fraction = 1.5}); },
                     "config.list_fraction (alpha = 1.5) is outside (0, 1]");
  test::expect_error([&] { Selector(p.limits(), {.keep_fraction = 0}); }, "config.keep_fraction (rho = 0) is outside (0, 1]");
  test::expect_error([&] { Selector(p.limits(), {.centroids = 4, .probes = 5}); },
                     "config.probes (= 5) is outside [1, min(centroids = 4, 64)]");
  test::expect_error([&] { Selector(p.limits(), {.centroids = 0}); }, "config.centroids (C = 0) must be positive");
  test::expect_error([&] { Selector(p.limits(), {.overlay_capacity = 0}); }, "config.overlay_capacity (= 0) must be positive");
  test::expect_error([&] { Selector(p.limits(), {.max_points_per_centroid = -1}); },
                     "config.max_points_per_centroid (= -1) must be >= 0 (0: every query)");
  test::expect_error([&] { Selector(p.limits(), {.kmeans_batch = -2}); },
                     "config.kmeans_batch (= -2) must be >= 0 (0: full batch)");
  test::expect_error([&] { Selector(p.limits(), {.search_period = 0}); }, "config.search_period (P = 0) must be >= 1");
  test::expect_error([&] { Selector(p.limits(), {.budget = 200}); }, "config.budget (= 200) is outside [0, limits.max_tokens = 116]");
  // C above the prefill queries (8 here).
  Selector many(p.limits(), {.centroids = 9});
  test::expect_error([&] { many.prepare(p.prefill(), {}); },
                     "Csattention::prepare: in.queries holds 8 prefill queries per head, fewer than config.centroids (C = 9)");
  // A recent window as long as the prompt.
  Selector fine(p.limits(), {.centroids = 4});
  PrefillInputs<half> in = p.prefill();
  in.attention.window = {.sink = 0, .recent = 100};
  test::expect_error([&] { fine.prepare(in, {}); },
                     "the recent window (R = 100) covers sequence 0's whole prompt (100 tokens): nothing is left to index");
  // A prompt longer than the selector's limits (its base could not be saved and loaded back).
  SelectorLimits short_limits = p.limits();
  short_limits.max_tokens = 99;
  Selector small(short_limits, {.centroids = 4});
  test::expect_error([&] { small.prepare(p.prefill(), {}); },
                     "Csattention::prepare: sequence 0's prompt (100 tokens) exceeds limits.max_tokens (= 99)");
}

}  // namespace
}  // namespace kvsift
