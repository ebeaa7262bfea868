// cpu::kmeans_batched against an fp64 reference of one problem written here, planted blobs, weights, the
// empty-cluster rules, strided subspace views, batching, thread counts, dtypes, the workspace API and refusals;
// the mini-batch steps against an fp64 reference of their own, and batch_size >= n as the full batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include "kvsift/core/kmeans_seeding.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/kmeans.hpp"
#include "test_util.hpp"
#include "workspace_check.hpp"

namespace kvsift {
namespace {

class CpuBatchedKMeans : public test::SeededTest {};

struct Result {
  std::vector<float> centroids;
  std::vector<std::int32_t> assignment;
};

template <class T>
Result run(const BatchedMatrixView<const T>& points, const float* weights, const BatchedKMeansConfig& config,
           cpu::ThreadPool* pool = nullptr) {
  Result r{std::vector<float>(std::size_t(points.problems) * config.clusters * points.cols, test::kPoison),
           std::vector<std::int32_t>(std::size_t(points.problems) * points.rows, test::kPoisonIndex)};
  cpu::Array<std::byte> ws(cpu::batched_kmeans_workspace_bytes(points.problems, points.rows, points.cols, config));
  cpu::kmeans_batched(points, weights, config, r.centroids.data(), r.assignment.data(), ws.bytes(), pool);
  return r;
}

// ---- an fp64 reference of one problem: the same draws, its own sums and distances ----------------------------

double distance64(const double* x, const double* c, int d, bool cosine) {
  double s = 0.0;
  for (int j = 0; j < d; ++j) s += cosine ? x[j] * c[j] : (x[j] - c[j]) * (x[j] - c[j]);
  return cosine ? std::max(0.0, 1.0 - s) : s;
}

struct Reference {
  std::vector<std::int64_t> seeds;  // the seeding's chosen points
  std::vector<double> centroids;
  std::vector<std::int32_t> assignment;
  std::vector<double> margin;  // per point: second-best minus best distance at the final assignment
};

Reference reference_kmeans(const std::vector<float>& raw, const std::vector<float>& w, std::int64_t n, int d, int k,
                           int iterations, bool cosine, std::uint64_t seed) {
  std::vector<double> x(raw.begin(), raw.end());
  if (cosine) {
    for (std::int64_t i = 0; i < n; ++i) {
      double s = 0;
      for (int j = 0; j < d; ++j) s += x[i * d + j] * x[i * d + j];
      for (int j = 0; j < d; ++j) x[i * d + j] /= std::sqrt(s);
    }
  }
  Reference r;
  r.centroids.resize(std::size_t(k) * d);
  std::vector<double> nearest(n, std::numeric_limits<double>::infinity());
  std::int64_t chosen = detail::kmeans_first_point(seed, n);
  const int per_step = detail::kmeans_candidates_per_step(k);
  for (int c = 0;; ++c) {
    r.seeds.push_back(chosen);
    std::copy_n(&x[chosen * d], d, &r.centroids[std::size_t(c) * d]);
    if (c + 1 == k) break;
    for (std::int64_t i = 0; i < n; ++i) nearest[i] = std::min(nearest[i], distance64(&x[i * d], &x[chosen * d], d, cosine));
    std::vector<double> prefix(n);
    double total = 0;
    for (std::int64_t i = 0; i < n; ++i) prefix[i] = total += w[i] * nearest[i];
    if (total <= 0) {
      chosen = (chosen + 1) % n;
      continue;
    }
    double best_potential = std::numeric_limits<double>::infinity();
    for (int t = 0; t < per_step; ++t) {
      const double target = detail::kmeans_draw_target(seed, std::uint32_t(c + 1), std::uint32_t(t), total);
      const std::int64_t candidate =
          std::min<std::int64_t>(std::upper_bound(prefix.begin(), prefix.end(), target) - prefix.begin(), n - 1);
      double potential = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        potential += w[i] * std::min(nearest[i], distance64(&x[i * d], &x[candidate * d], d, cosine));
      }
      if (potential < best_potential) best_potential = potential, chosen = candidate;
    }
  }
  r.assignment.assign(n, 0);
  r.margin.assign(n, 0);
  const auto assign = [&] {
    for (std::int64_t i = 0; i < n; ++i) {
      double best = std::numeric_limits<double>::infinity(), second = best;
      for (int c = 0; c < k; ++c) {
        const double dist = distance64(&x[i * d], &r.centroids[std::size_t(c) * d], d, cosine);
        if (dist < best) {
          second = best, best = dist, r.assignment[i] = c;
        } else {
          second = std::min(second, dist);
        }
      }
      r.margin[i] = second - best;
    }
  };
  for (int it = 0; it < iterations; ++it) {
    assign();
    std::vector<double> sum(std::size_t(k) * d, 0.0), weight(k, 0.0);
    for (std::int64_t i = 0; i < n; ++i) {
      weight[r.assignment[i]] += w[i];
      for (int j = 0; j < d; ++j) sum[std::size_t(r.assignment[i]) * d + j] += w[i] * x[i * d + j];
    }
    for (int c = 0; c < k; ++c) {
      if (weight[c] == 0) continue;
      double norm = 0;
      for (int j = 0; j < d; ++j) norm += std::pow(sum[std::size_t(c) * d + j] / weight[c], 2);
      for (int j = 0; j < d; ++j) {
        r.centroids[std::size_t(c) * d + j] = sum[std::size_t(c) * d + j] / weight[c] / (cosine ? std::sqrt(norm) : 1.0);
      }
    }
  }
  assign();
  return r;
}

TEST_F(CpuBatchedKMeans, OneProblemMatchesTheFp64Reference) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const bool cosine : {false, true}) {
    for (const bool weighted : {false, true}) {
      const std::int64_t n = 1500 + rng.uniform_int(0, 700);  // segments of 2 and 3 points, some empty ones
      const int d = 16, k = 12, iterations = 6;
      const auto x = rng.normal(std::size_t(n) * d);
      std::vector<float> w(n, 1.0f);
      if (weighted) {
        for (float& v : w) v = rng.uniform(0.0f, 3.0f);
      }
      const std::uint64_t s = seed ^ (cosine ? 11 : 0) ^ (weighted ? 13 : 0);
      const BatchedKMeansConfig config{.clusters = k, .iterations = iterations,
                                       .metric = cosine ? KMeansMetric::cosine : KMeansMetric::l2, .seed = s};
      const auto got = run(BatchedMatrixView<const float>::packed(x.data(), 1, n, d), weighted ? w.data() : nullptr, config);
      const auto want = reference_kmeans(x, w, n, d, k, iterations, cosine, s);
      SCOPED_TRACE(testing::Message() << "cosine " << cosine << " weighted " << weighted);
      // The seeding picks the same points: check through the centroids with iterations = 0.
      const auto seeded = run(BatchedMatrixView<const float>::packed(x.data(), 1, n, d), weighted ? w.data() : nullptr,
                              BatchedKMeansConfig{.clusters = k, .iterations = 0, .metric = config.metric, .seed = s});
      const auto seeding = reference_kmeans(x, w, n, d, k, 0, cosine, s);
      for (int c = 0; c < k; ++c) {
        for (int j = 0; j < d; ++j) {
          ASSERT_NEAR(seeded.centroids[std::size_t(c) * d + j], seeding.centroids[std::size_t(c) * d + j], 1e-6)
              << "seeded centroid " << c << " (reference point " << seeding.seeds[c] << ")";
        }
      }
      // Lloyd: the same assignment except within rounding of a tie, centroids within fp32 sums' error.
      constexpr double kTieMargin = 1e-4;  // fp32 distances of O(10) values
      int near_ties = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        if (got.assignment[i] != want.assignment[i]) {
          EXPECT_LT(want.margin[i], kTieMargin) << "point " << i;
          ++near_ties;
        }
      }
      if (near_ties == 0) {
        for (std::size_t e = 0; e < got.centroids.size(); ++e) EXPECT_NEAR(got.centroids[e], want.centroids[e], 1e-5);
      }
    }
  }
}

TEST_F(CpuBatchedKMeans, RecoversWellSeparatedBlobsInStridedSubspaces) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  // A query matrix [n, heads * 32]: per head two subspaces of 16 columns; problem (h, s) = h * 2 + s.
  const int heads = 3, subspaces = 2, width = 16, k = 5, per = 30, n = k * per;
  std::vector<float> q(std::size_t(n) * heads * subspaces * width);
  std::vector<std::vector<std::int32_t>> truth(heads * subspaces);
  for (int p = 0; p < heads * subspaces; ++p) {
    const auto [points, labels] = test::planted_clusters(rng, k, per, width);
    std::vector<std::int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng.engine);
    for (int i = 0; i < n; ++i) {
      std::copy_n(&points[std::size_t(order[i]) * width], width, &q[std::size_t(i) * heads * subspaces * width + p * width]);
      truth[p].push_back(labels[order[i]]);
    }
  }
  const BatchedMatrixView<const float> view{q.data(), heads * subspaces, n, width, width, heads * subspaces * width};
  for (const auto metric : {KMeansMetric::l2, KMeansMetric::cosine}) {
    const BatchedKMeansConfig config{.clusters = k, .iterations = 10, .metric = metric, .seed = seed};
    cpu::ThreadPool pool(3);
    const auto got = run(view, nullptr, config, &pool);
    const auto single = run(view, nullptr, config);
    EXPECT_TRUE(test::same_bytes(got.centroids, single.centroids)) << "thread count changed the centroids";
    EXPECT_TRUE(test::same_bytes(got.assignment, single.assignment));
    for (int p = 0; p < heads * subspaces; ++p) {
      std::map<std::int32_t, std::set<std::int32_t>> found;
      std::set<std::int32_t> used;
      for (int i = 0; i < n; ++i) found[truth[p][i]].insert(got.assignment[std::size_t(p) * n + i]), used.insert(got.assignment[std::size_t(p) * n + i]);
      for (const auto& [t, f] : found) EXPECT_EQ(f.size(), 1u) << "problem " << p << " planted cluster " << t;
      EXPECT_EQ(used.size(), std::size_t(k)) << "problem " << p;
    }
    // The strided view gives what packed copies of each problem give.
    std::vector<float> packed(std::size_t(heads * subspaces) * n * width);
    for (int p = 0; p < heads * subspaces; ++p) {
      for (int i = 0; i < n; ++i) std::copy_n(view.row(p, i), width, &packed[(std::size_t(p) * n + i) * width]);
    }
    const auto from_packed = run(BatchedMatrixView<const float>::packed(packed.data(), heads * subspaces, n, width), nullptr, config);
    EXPECT_TRUE(test::same_bytes(got.centroids, from_packed.centroids));
    EXPECT_TRUE(test::same_bytes(got.assignment, from_packed.assignment));
  }
}

TEST_F(CpuBatchedKMeans, ProblemsAreIndependentAndDrawFromSeedPlusTheirIndex) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const int problems : {1, 3, 64}) {
    const int n = 90 + rng.uniform_int(0, 40), d = 16, k = 7;
    const auto x = rng.normal(std::size_t(problems) * n * d);
    std::vector<float> w(std::size_t(problems) * n);
    for (float& v : w) v = rng.uniform(0.5f, 2.0f);
    const BatchedKMeansConfig config{.clusters = k, .iterations = 5, .metric = KMeansMetric::cosine, .seed = seed,
                                     .empty = EmptyCluster::reseed};
    cpu::ThreadPool pool(2);
    const auto all = run(BatchedMatrixView<const float>::packed(x.data(), problems, n, d), w.data(), config, &pool);
    for (int p = 0; p < problems; p += std::max(1, problems / 5)) {
      auto one_config = config;
      one_config.seed = seed + std::uint64_t(p);
      const auto one = run(BatchedMatrixView<const float>::packed(&x[std::size_t(p) * n * d], 1, n, d), &w[std::size_t(p) * n], one_config);
      EXPECT_TRUE(std::equal(one.centroids.begin(), one.centroids.end(), all.centroids.begin() + std::size_t(p) * k * d))
          << "problems " << problems << " problem " << p;
      EXPECT_TRUE(std::equal(one.assignment.begin(), one.assignment.end(), all.assignment.begin() + std::size_t(p) * n))
          << "problems " << problems << " problem " << p;
    }
  }
}

TEST_F(CpuBatchedKMeans, AWeightOfTwoEqualsADuplicatedPoint) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int k = 4, per = 25, d = 16;
  const auto [points, truth] = test::planted_clusters(rng, k, per, d);
  const int n = k * per;
  std::vector<float> weights(n, 1.0f), duplicated = points;
  for (int i = 0; i < n; i += 3) {
    weights[i] = 2.0f;
    duplicated.insert(duplicated.end(), points.begin() + std::size_t(i) * d, points.begin() + std::size_t(i + 1) * d);
  }
  const int m = int(duplicated.size() / d);
  for (const auto metric : {KMeansMetric::l2, KMeansMetric::cosine}) {
    const BatchedKMeansConfig config{.clusters = k, .iterations = 8, .metric = metric, .seed = seed};
    const auto a = run(BatchedMatrixView<const float>::packed(points.data(), 1, n, d), weights.data(), config);
    const auto b = run(BatchedMatrixView<const float>::packed(duplicated.data(), 1, m, d), nullptr, config);
    // Both find the planted blobs (different draws); each blob's weighted mean equals its mean with duplicates.
    const auto sorted_rows = [&](const std::vector<float>& c) {
      std::vector<std::vector<float>> rows;
      for (int r = 0; r < k; ++r) rows.emplace_back(c.begin() + r * d, c.begin() + (r + 1) * d);
      std::sort(rows.begin(), rows.end());
      return rows;
    };
    const auto ra = sorted_rows(a.centroids), rb = sorted_rows(b.centroids);
    for (int r = 0; r < k; ++r) {
      for (int j = 0; j < d; ++j) EXPECT_NEAR(ra[r][j], rb[r][j], 1e-5) << "metric " << int(metric) << " row " << r;
    }
  }
}

TEST_F(CpuBatchedKMeans, EmptyClustersKeepOrReseed) {
  // Three locations, four copies each, and k = 4: after three centroids every potential is 0, so the fourth is
  // the next point in order, a copy of a location that a smaller id already holds; its cluster stays empty.
  const int d = 2, n = 12, k = 4;
  std::vector<float> x;
  for (int i = 0; i < n; ++i) {
    x.push_back(float(i % 3) * 10.0f);
    x.push_back(float(i % 3 == 2) * 7.0f);
  }
  const auto view = BatchedMatrixView<const float>::packed(x.data(), 1, n, d);
  const auto keep = run(view, nullptr, {.clusters = k, .iterations = 3, .seed = seed});
  const auto reseed = run(view, nullptr, {.clusters = k, .iterations = 3, .seed = seed, .empty = EmptyCluster::reseed});
  EXPECT_EQ(std::count(keep.assignment.begin(), keep.assignment.end(), 3), 0);
  EXPECT_TRUE(test::same_bytes(keep.assignment, reseed.assignment));
  // Every point sits on its centroid: all reseed keys are 0, so the first point in the order (index 0) is taken.
  EXPECT_EQ(reseed.centroids[3 * d], x[0]);
  EXPECT_EQ(reseed.centroids[3 * d + 1], x[1]);
  bool keep_is_a_location = false;
  for (int i = 0; i < n; ++i) keep_is_a_location |= keep.centroids[3 * d] == x[i * d] && keep.centroids[3 * d + 1] == x[i * d + 1];
  EXPECT_TRUE(keep_is_a_location);
}

TEST_F(CpuBatchedKMeans, ReseedTakesTheFarthestPointFirst) {
  // Cosine: 4 copies of e1, 4 of e2, then a zero row z, which is at distance 1 from every centroid, itself
  // included. With k = 4 the seeding takes e1 and e2, then z twice (only z has potential left); z ties every
  // centroid and goes to cluster 0, so clusters 2 and 3 are empty. Reseeding gives cluster 2 the point of largest
  // key, z (1; every other point is on its centroid: 0), and cluster 3 the next in order, point 0 (key 0, the
  // smallest index); keeping leaves both at z.
  const int d = 2, n = 9, k = 4;
  std::vector<float> x;
  for (int i = 0; i < 8; ++i) x.push_back(i < 4 ? 1.0f : 0.0f), x.push_back(i < 4 ? 0.0f : 1.0f);
  x.push_back(0.0f), x.push_back(0.0f);
  const auto view = BatchedMatrixView<const float>::packed(x.data(), 1, n, d);
  int tried = 0;
  for (std::uint64_t s = seed;; ++s) {
    ASSERT_LT(++tried, 50) << "no seed draws e1 and e2 first";
    const BatchedKMeansConfig keep{.clusters = k, .iterations = 2, .metric = KMeansMetric::cosine, .seed = s};
    const auto kept = run(view, nullptr, keep);
    const bool seeded_as_planned = kept.centroids[0] + kept.centroids[2] == 1.0f && kept.centroids[1] + kept.centroids[3] == 1.0f &&
                                   std::all_of(kept.centroids.begin() + 2 * d, kept.centroids.end(), [](float v) { return v == 0.0f; });
    if (!seeded_as_planned) continue;  // e.g. z drawn first
    auto reseed = keep;
    reseed.empty = EmptyCluster::reseed;
    const auto got = run(view, nullptr, reseed);
    EXPECT_EQ(got.centroids[2 * d], 0.0f);
    EXPECT_EQ(got.centroids[2 * d + 1], 0.0f);
    EXPECT_EQ(got.centroids[3 * d], x[0]);
    EXPECT_EQ(got.centroids[3 * d + 1], x[1]);
    EXPECT_TRUE(std::equal(got.centroids.begin(), got.centroids.begin() + 2 * d, kept.centroids.begin()));
    break;
  }
}

TEST_F(CpuBatchedKMeans, StorageTypesReadAsTheirFp32Values) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int problems = 3, n = 200, d = 24, k = 9;
  const auto x = rng.normal(std::size_t(problems) * n * d);
  const BatchedKMeansConfig config{.clusters = k, .iterations = 4, .seed = seed, .empty = EmptyCluster::reseed};
  const auto check = [&]<class T>(T) {
    const auto stored = test::to_storage<T>(x);
    std::vector<float> widened(stored.size());
    for (std::size_t i = 0; i < stored.size(); ++i) widened[i] = to_float(stored[i]);
    const auto a = run(BatchedMatrixView<const T>::packed(stored.data(), problems, n, d), nullptr, config);
    const auto b = run(BatchedMatrixView<const float>::packed(widened.data(), problems, n, d), nullptr, config);
    EXPECT_TRUE(test::same_bytes(a.centroids, b.centroids));
    EXPECT_TRUE(test::same_bytes(a.assignment, b.assignment));
  };
  check(half{});
  check(bfloat16{});
}

TEST_F(CpuBatchedKMeans, WorkspaceQueryRunAndContents) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int problems = 4, n = 150, d = 16, k = 6;
  const auto x = rng.normal(std::size_t(problems) * n * d);
  const BatchedKMeansConfig config{.clusters = k, .iterations = 3, .metric = KMeansMetric::cosine, .seed = seed,
                                   .empty = EmptyCluster::reseed};
  std::vector<float> centroids(std::size_t(problems) * k * d);
  std::vector<std::int32_t> assignment(std::size_t(problems) * n);
  const auto view = BatchedMatrixView<const float>::packed(x.data(), problems, n, d);
  test::check_workspace(
      cpu::batched_kmeans_workspace_bytes(problems, n, d, config),
      [&](std::span<std::byte> ws) { cpu::kmeans_batched(view, nullptr, config, centroids.data(), assignment.data(), ws); },
      [&] { return test::bytes_of(centroids, assignment); },
      [&] {
        std::fill(centroids.begin(), centroids.end(), test::kPoison);
        std::fill(assignment.begin(), assignment.end(), test::kPoisonIndex);
      });
  for (const std::int32_t a : assignment) EXPECT_TRUE(a >= 0 && a < k);
}

// ---- mini-batch steps: an fp64 reference of one problem from the library's seeding -------------------------

struct MiniBatchReference {
  std::vector<double> centroids;
  std::vector<std::int32_t> assignment;
  /// The closest call of any choice: a drawn point's second-best minus best distance, or the gap between the
  /// reseed keys of a point taken and the next in the order (two points of a two-point cluster tie exactly).
  double choice_margin = std::numeric_limits<double>::infinity();
  std::vector<double> margin;                                     // per point, at the final assignment
};

/// The mini-batch contract (cpu/kmeans.hpp) in fp64 from `seeded` centroids: the draws of
/// detail::minibatch_point, nearest centroids by distance64, each centroid's running weighted mean, reseeding of
/// the clusters no drawn point has reached, in the reseed order over the drawn points.
MiniBatchReference reference_minibatch(const std::vector<float>& raw, const std::vector<float>& w, std::int64_t n, int d,
                                       int k, int iterations, int batch, bool cosine, bool reseed, std::uint64_t seed,
                                       const std::vector<float>& seeded) {
  std::vector<double> x(raw.begin(), raw.end());
  for (std::int64_t i = 0; i < n && cosine; ++i) {
    double s = 0;
    for (int j = 0; j < d; ++j) s += x[i * d + j] * x[i * d + j];
    for (int j = 0; j < d; ++j) x[i * d + j] /= std::sqrt(s);
  }
  MiniBatchReference r;
  r.centroids.assign(seeded.begin(), seeded.end());
  const auto nearest = [&](std::int64_t i, double* margin) {
    double best = std::numeric_limits<double>::infinity(), second = best;
    std::int32_t id = 0;
    for (int c = 0; c < k; ++c) {
      const double dist = distance64(&x[i * d], &r.centroids[std::size_t(c) * d], d, cosine);
      if (dist < best) {
        second = best, best = dist, id = c;
      } else {
        second = std::min(second, dist);
      }
    }
    *margin = second - best;
    return id;
  };
  std::vector<double> absorbed(k, 0.0);
  std::vector<bool> reached(k, false);
  for (int it = 0; it < iterations; ++it) {
    std::vector<std::int64_t> drawn(batch);
    std::vector<std::int32_t> a(batch);
    std::vector<double> sum(std::size_t(k) * d, 0.0), weight(k, 0.0);
    for (int b = 0; b < batch; ++b) {
      drawn[b] = detail::minibatch_point(seed, it, b, n);
      double margin = 0;
      a[b] = nearest(drawn[b], &margin);
      r.choice_margin = std::min(r.choice_margin, margin);
      reached[a[b]] = true;
      weight[a[b]] += w[drawn[b]];
      for (int j = 0; j < d; ++j) sum[std::size_t(a[b]) * d + j] += w[drawn[b]] * x[drawn[b] * d + j];
    }
    for (int c = 0; c < k; ++c) {
      if (weight[c] == 0) continue;
      double* row = &r.centroids[std::size_t(c) * d];
      double norm = 0;
      for (int j = 0; j < d; ++j) row[j] = (absorbed[c] * row[j] + sum[std::size_t(c) * d + j]) / (absorbed[c] + weight[c]);
      for (int j = 0; j < d; ++j) norm += row[j] * row[j];
      for (int j = 0; j < d && cosine; ++j) row[j] /= std::sqrt(norm);
      absorbed[c] += weight[c];
    }
    // Reseeding: the drawn points, distinct, by descending key, then ascending index.
    std::vector<std::pair<double, std::int64_t>> order;
    for (int b = 0; b < batch && reseed; ++b) {
      order.emplace_back(-w[drawn[b]] * distance64(&x[drawn[b] * d], &r.centroids[std::size_t(a[b]) * d], d, cosine), drawn[b]);
    }
    std::sort(order.begin(), order.end());
    order.erase(std::unique(order.begin(), order.end()), order.end());
    std::size_t next = 0;
    for (int c = 0; c < k && reseed; ++c) {
      if (reached[c] || next == order.size()) continue;
      if (next + 1 < order.size()) r.choice_margin = std::min(r.choice_margin, order[next + 1].first - order[next].first);
      std::copy_n(&x[order[next++].second * d], d, &r.centroids[std::size_t(c) * d]);
    }
  }
  r.assignment.resize(n);
  r.margin.resize(n);
  for (std::int64_t i = 0; i < n; ++i) r.assignment[i] = nearest(i, &r.margin[i]);
  return r;
}

TEST_F(CpuBatchedKMeans, MiniBatchMatchesTheFp64Reference) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const bool cosine : {false, true}) {
    for (const bool weighted : {false, true}) {
      for (const bool reseed : {false, true}) {
        // A choice within rounding of a tie may go the other way and move everything after it: such data is
        // drawn again.
        constexpr double kTieMargin = 1e-4;
        bool compared = false;
        for (int attempt = 0; attempt < 8 && !compared; ++attempt) {
          const std::int64_t n = 300 + rng.uniform_int(0, 200);
          const int d = 8 + rng.uniform_int(0, 12), k = 10, iterations = 7;
          const int batch = reseed ? 15 : 40 + rng.uniform_int(0, 60);  // 15: clusters go unreached
          const auto x = rng.normal(std::size_t(n) * d);
          std::vector<float> w(n, 1.0f);
          for (float& v : w) v = weighted ? rng.uniform(0.0f, 3.0f) : 1.0f;
          if (weighted) w[rng.uniform_int(0, int(n) - 1)] = 0.0f;
          const std::uint64_t s = seed + std::uint64_t(attempt);
          const BatchedKMeansConfig config{.clusters = k, .iterations = iterations,
                                           .metric = cosine ? KMeansMetric::cosine : KMeansMetric::l2, .seed = s,
                                           .empty = reseed ? EmptyCluster::reseed : EmptyCluster::keep,
                                           .batch_size = batch};
          SCOPED_TRACE(testing::Message() << "cosine " << cosine << " weighted " << weighted << " reseed " << reseed
                                          << " n " << n << " d " << d << " batch " << batch << " attempt " << attempt);
          const auto view = BatchedMatrixView<const float>::packed(x.data(), 1, n, d);
          const float* weights = weighted ? w.data() : nullptr;
          auto seeding = config;
          seeding.iterations = 0;
          const auto seeded = run(view, weights, seeding);
          const auto got = run(view, weights, config);
          const auto want = reference_minibatch(x, w, n, d, k, iterations, batch, cosine, reseed, s, seeded.centroids);
          if (want.choice_margin < kTieMargin) continue;
          compared = true;
          for (std::size_t e = 0; e < got.centroids.size(); ++e) ASSERT_NEAR(got.centroids[e], want.centroids[e], 2e-5) << e;
          for (std::int64_t i = 0; i < n; ++i) {
            if (got.assignment[i] != want.assignment[i]) {
              EXPECT_LT(want.margin[i], kTieMargin) << "point " << i;
            }
          }
          // Mini-batch steps move the centroids unlike full-batch ones.
          auto full = config;
          full.batch_size = 0;
          EXPECT_FALSE(test::same_bytes(run(view, weights, full).centroids, got.centroids));
        }
        EXPECT_TRUE(compared) << "every attempt had a choice near a tie";
      }
    }
  }
}

TEST_F(CpuBatchedKMeans, MiniBatchReseedsClustersNoDrawReaches) {
  // Cosine, e1 x 4, e2 x 4 and a zero row (ReseedTakesTheFarthestPointFirst's points), k = 4, a batch of 1 and
  // one step: the step reaches one cluster a, which moves onto the drawn point (its first weight replaces the
  // seed). With reseed the smallest unreached id takes the drawn point too, and the other unreached clusters
  // stay, as the batch has no next point.
  const int d = 2, n = 9, k = 4;
  std::vector<float> x;
  for (int i = 0; i < 8; ++i) x.push_back(i < 4 ? 1.0f : 0.0f), x.push_back(i < 4 ? 0.0f : 1.0f);
  x.push_back(0.0f), x.push_back(0.0f);
  const auto view = BatchedMatrixView<const float>::packed(x.data(), 1, n, d);
  for (std::uint64_t s = seed; s < seed + 20; ++s) {
    const BatchedKMeansConfig keep{.clusters = k, .iterations = 1, .metric = KMeansMetric::cosine, .seed = s, .batch_size = 1};
    auto reseed = keep;
    reseed.empty = EmptyCluster::reseed;
    auto seeding = keep;
    seeding.iterations = 0;
    const auto seeded = run(view, nullptr, seeding), kept = run(view, nullptr, keep), got = run(view, nullptr, reseed);
    const std::int64_t drawn = detail::minibatch_point(s, 0, 0, n);
    // The drawn point's cluster: the reference's nearest (distance64 ranks as nearest_centroid here: exact values).
    std::vector<double> xd(x.begin(), x.end()), cd(seeded.centroids.begin(), seeded.centroids.end());
    int a = 0;
    for (int c = 1; c < k; ++c) {
      if (distance64(&xd[drawn * d], &cd[c * d], d, true) < distance64(&xd[drawn * d], &cd[a * d], d, true)) a = c;
    }
    // keep: only cluster a moves (to the drawn point: its first weight replaces the seed, then normalized).
    for (int c = 0; c < k; ++c) {
      const bool same = std::equal(kept.centroids.begin() + c * d, kept.centroids.begin() + (c + 1) * d, seeded.centroids.begin() + c * d);
      if (c != a) {
        EXPECT_TRUE(same) << "seed " << s << " cluster " << c;
      }
    }
    // reseed: the first unreached cluster (smallest id != a) takes the drawn point, every other one stays.
    const int first = a == 0 ? 1 : 0;
    for (int c = 0; c < k; ++c) {
      if (c == a) continue;
      const float* want = c == first ? &x[drawn * d] : &seeded.centroids[c * d];
      EXPECT_TRUE(std::equal(got.centroids.begin() + c * d, got.centroids.begin() + (c + 1) * d, want)) << "seed " << s << " cluster " << c;
    }
  }
}

TEST_F(CpuBatchedKMeans, MiniBatchOfAtLeastNIsTheFullBatch) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int problems = 3, n = 120, d = 16, k = 7;
  const auto x = rng.normal(std::size_t(problems) * n * d);
  std::vector<float> w(std::size_t(problems) * n);
  for (float& v : w) v = rng.uniform(0.5f, 2.0f);
  const auto view = BatchedMatrixView<const float>::packed(x.data(), problems, n, d);
  for (const auto metric : {KMeansMetric::l2, KMeansMetric::cosine}) {
    const BatchedKMeansConfig full{.clusters = k, .iterations = 5, .metric = metric, .seed = seed, .empty = EmptyCluster::reseed};
    const auto want = run(view, w.data(), full);
    for (const int batch : {n, n + 1, 1 << 30}) {
      auto config = full;
      config.batch_size = batch;
      EXPECT_EQ(cpu::batched_kmeans_workspace_bytes(problems, n, d, config), cpu::batched_kmeans_workspace_bytes(problems, n, d, full));
      const auto got = run(view, w.data(), config);
      EXPECT_TRUE(test::same_bytes(got.centroids, want.centroids)) << "batch " << batch;
      EXPECT_TRUE(test::same_bytes(got.assignment, want.assignment)) << "batch " << batch;
    }
    auto below = full;
    below.batch_size = n - 1;
    EXPECT_FALSE(test::same_bytes(run(view, w.data(), below).centroids, want.centroids));
  }
}

TEST_F(CpuBatchedKMeans, MiniBatchProblemsAreIndependentOfEachOtherAndOfThreads) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const int problems : {1, 5}) {
    const int n = 200 + rng.uniform_int(0, 100), d = 12, k = 9;
    const auto x = rng.normal(std::size_t(problems) * n * d);
    std::vector<float> w(std::size_t(problems) * n);
    for (float& v : w) v = rng.uniform(0.5f, 2.0f);
    const BatchedKMeansConfig config{.clusters = k, .iterations = 6, .metric = KMeansMetric::cosine, .seed = seed,
                                     .empty = EmptyCluster::reseed, .batch_size = 33};
    cpu::ThreadPool pool(3);
    const auto all = run(BatchedMatrixView<const float>::packed(x.data(), problems, n, d), w.data(), config, &pool);
    const auto serial = run(BatchedMatrixView<const float>::packed(x.data(), problems, n, d), w.data(), config);
    EXPECT_TRUE(test::same_bytes(all.centroids, serial.centroids));
    EXPECT_TRUE(test::same_bytes(all.assignment, serial.assignment));
    for (int p = 0; p < problems; ++p) {
      auto one_config = config;
      one_config.seed = seed + std::uint64_t(p);
      const auto one = run(BatchedMatrixView<const float>::packed(&x[std::size_t(p) * n * d], 1, n, d), &w[std::size_t(p) * n], one_config);
      EXPECT_TRUE(std::equal(one.centroids.begin(), one.centroids.end(), all.centroids.begin() + std::size_t(p) * k * d)) << p;
      EXPECT_TRUE(std::equal(one.assignment.begin(), one.assignment.end(), all.assignment.begin() + std::size_t(p) * n)) << p;
    }
  }
}

TEST_F(CpuBatchedKMeans, MiniBatchRecoversWellSeparatedBlobs) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int k = 5, per = 200, d = 16, n = k * per;
  const auto [points, truth] = test::planted_clusters(rng, k, per, d);
  for (const auto metric : {KMeansMetric::l2, KMeansMetric::cosine}) {
    const BatchedKMeansConfig config{.clusters = k, .iterations = 10, .metric = metric, .seed = seed, .batch_size = 64};
    const auto got = run(BatchedMatrixView<const float>::packed(points.data(), 1, n, d), nullptr, config);
    std::map<std::int32_t, std::set<std::int32_t>> found;
    for (int i = 0; i < n; ++i) found[truth[i]].insert(got.assignment[i]);
    for (const auto& [t, f] : found) EXPECT_EQ(f.size(), 1u) << "metric " << int(metric) << " planted cluster " << t;
  }
}

TEST_F(CpuBatchedKMeans, MiniBatchWorkspaceQueryRunAndContents) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int problems = 4, n = 150, d = 16, k = 6;
  const auto x = rng.normal(std::size_t(problems) * n * d);
  const BatchedKMeansConfig config{.clusters = k, .iterations = 3, .metric = KMeansMetric::cosine, .seed = seed,
                                   .empty = EmptyCluster::reseed, .batch_size = 20};
  std::vector<float> centroids(std::size_t(problems) * k * d);
  std::vector<std::int32_t> assignment(std::size_t(problems) * n);
  const auto view = BatchedMatrixView<const float>::packed(x.data(), problems, n, d);
  test::check_workspace(
      cpu::batched_kmeans_workspace_bytes(problems, n, d, config),
      [&](std::span<std::byte> ws) { cpu::kmeans_batched(view, nullptr, config, centroids.data(), assignment.data(), ws); },
      [&] { return test::bytes_of(centroids, assignment); },
      [&] {
        std::fill(centroids.begin(), centroids.end(), test::kPoison);
        std::fill(assignment.begin(), assignment.end(), test::kPoisonIndex);
      });
  for (const std::int32_t a : assignment) EXPECT_TRUE(a >= 0 && a < k);
}

TEST_F(CpuBatchedKMeans, BadInputIsRefused) {
  const int n = 20, d = 4;
  std::vector<float> x(std::size_t(2) * n * d, 1.0f), c(64 * d), w(2 * n, 1.0f);
  std::vector<std::int32_t> a(2 * n);
  const auto view = BatchedMatrixView<const float>::packed(x.data(), 2, n, d);
  cpu::Array<std::byte> ws(1 << 20);
  const auto call = [&](const BatchedMatrixView<const float>& v, const float* weights, BatchedKMeansConfig config,
                        float* centroids = nullptr, std::int32_t* assignment = nullptr) {
    cpu::kmeans_batched(v, weights, config, centroids ? centroids : c.data(), assignment ? assignment : a.data(), ws.bytes());
  };
  const BatchedKMeansConfig ok{.clusters = 3};
  test::expect_error([&] { call(view, nullptr, {.clusters = 0}); }, "config.clusters (= 0) is outside [1, n = 20]");
  test::expect_error([&] { call(view, nullptr, {.clusters = 21}); }, "config.clusters (= 21) is outside [1, n = 20]");
  test::expect_error([&] { call(view, nullptr, {.clusters = 3, .iterations = -1}); }, "config.iterations (= -1)");
  test::expect_error([&] { call(view, nullptr, {.clusters = 3, .metric = KMeansMetric(7)}); }, "config.metric (= 7)");
  test::expect_error([&] { call(view, nullptr, {.clusters = 3, .empty = EmptyCluster(9)}); }, "config.empty (= 9)");
  test::expect_error([&] { call(view, nullptr, {.clusters = 3, .batch_size = -1}); },
                     {"cpu::kmeans_batched", "config.batch_size (= -1) must be >= 0"});
  test::expect_error([&] { cpu::batched_kmeans_workspace_bytes(2, n, d, {.clusters = 3, .batch_size = -5}); },
                     {"cpu::batched_kmeans_workspace_bytes", "config.batch_size (= -5) must be >= 0"});
  auto bad = view;
  bad.problems = 0;
  test::expect_error([&] { call(bad, nullptr, ok); }, "problems (= 0) must be >= 1");
  bad = view, bad.cols = 257;
  test::expect_error([&] { call(bad, nullptr, ok); }, "dim (= 257) is outside [1, 256]");
  bad = view, bad.problem_stride = -1;
  test::expect_error([&] { call(bad, nullptr, ok); }, "points.problem_stride (= -1) must be >= 0");
  bad = view, bad.row_stride = d - 1;
  test::expect_error([&] { call(bad, nullptr, ok); }, "points");
  bad = view, bad.data = nullptr;
  test::expect_error([&] { call(bad, nullptr, ok); }, "points");
  test::expect_error([&] { call(view, reinterpret_cast<const float*>(reinterpret_cast<const char*>(w.data()) + 1), ok); },
                     "is not 4-byte aligned");
  w[n + 3] = -1.0f;
  test::expect_error([&] { call(view, w.data(), ok); }, "weights[23] (= -1) is not a finite value >= 0 (problem 1, point 3)");
  w[n + 3] = std::numeric_limits<float>::quiet_NaN();
  test::expect_error([&] { call(view, w.data(), ok); }, "weights[23] (= nan)");
  test::expect_error([&] { cpu::kmeans_batched(view, nullptr, ok, nullptr, a.data(), ws.bytes()); },
                     "centroids is a null pointer");
  test::expect_error([&] { cpu::kmeans_batched(view, nullptr, ok, c.data(), nullptr, ws.bytes()); },
                     "assignment is a null pointer");
  test::expect_error([&] { cpu::kmeans_batched(view, nullptr, ok, c.data(), a.data(), ws.bytes().first(256)); },
                     "workspace too small");
  test::expect_error([&] { cpu::batched_kmeans_workspace_bytes(1 << 16, 1 << 16, d, ok); }, "problems * n");
}

}  // namespace
}  // namespace kvsift
