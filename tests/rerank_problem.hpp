#pragma once
// Problems and fp64 references of the query-centroid and rerank primitives (selectors/ctkvr/cpu/query_centroids.hpp,
// cpu/rerank.hpp and their CUDA twins), shared by the CPU and CUDA tests.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kvsift/selectors/ctkvr/query_centroids.hpp"
#include "test_util.hpp"

namespace kvsift::test {

/// Centroids of `slots` slots, each with a random count in [1, capacity] (slot 0 full, slot 1 with 1 centroid
/// when there are two), unit vectors in T, and a decode query per batch row.
template <class T>
struct CentroidProblem {
  std::int32_t batch, q_heads, kv_heads, slots, capacity, head_dim;
  std::vector<T> centroids, q;
  std::vector<std::int32_t> counts, row_slots;

  CentroidProblem(Random& rng, std::int32_t batch_, std::int32_t q_heads_, std::int32_t kv_heads_, std::int32_t slots_,
                  std::int32_t capacity_, std::int32_t head_dim_)
      : batch(batch_), q_heads(q_heads_), kv_heads(kv_heads_), slots(slots_), capacity(capacity_), head_dim(head_dim_) {
    std::vector<float> c = rng.normal(QueryCentroidsView<T>::elements(slots, q_heads, capacity, head_dim));
    for (std::size_t r = 0; r < c.size(); r += head_dim) {
      double n = 0;
      for (std::int32_t i = 0; i < head_dim; ++i) n += double(c[r + i]) * c[r + i];
      for (std::int32_t i = 0; i < head_dim; ++i) c[r + i] = float(c[r + i] / std::sqrt(n));
    }
    centroids = to_storage<T>(c);
    q = to_storage<T>(rng.normal(std::size_t(batch) * q_heads * head_dim));
    for (std::int32_t s = 0; s < slots; ++s) counts.push_back(s == 0 ? capacity : s == 1 ? 1 : rng.uniform_int(1, capacity));
    std::vector<std::int32_t> order(slots);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng.engine);
    row_slots.assign(order.begin(), order.begin() + batch);
  }
  QueryCentroidsView<const T> view() const {
    return {centroids.data(), counts.data(), slots, q_heads, capacity, head_dim};
  }
  QueryView<const T> query() const { return QueryView<const T>::packed(q.data(), batch, q_heads, head_dim); }

  /// fp64 cosine scores [batch * kv_heads, capacity]: max over the group; -inf past a slot's count.
  std::vector<double> reference() const {
    const std::int32_t group = q_heads / kv_heads;
    std::vector<double> out(std::size_t(batch) * kv_heads * capacity, -INFINITY);
    for (std::int32_t b = 0; b < batch; ++b) {
      const std::int32_t s = row_slots[b];
      for (std::int32_t g = 0; g < kv_heads; ++g) {
        for (std::int32_t c = 0; c < counts[s]; ++c) {
          double best = -INFINITY;
          for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
            double dot = 0, n = 0;
            for (std::int32_t i = 0; i < head_dim; ++i) {
              const double x = to_float(q[(std::size_t(b) * q_heads + h) * head_dim + i]);
              dot += x * to_float(centroids[((std::size_t(s) * q_heads + h) * capacity + c) * head_dim + i]);
              n += x * x;
            }
            best = std::max(best, dot / std::sqrt(n));
          }
          out[(std::size_t(b) * kv_heads + g) * capacity + c] = best;
        }
      }
    }
    return out;
  }
};

/// Candidate rows over a cache of `lengths`: distinct random tokens per (b, h), ascending; row 0 full, row 1 empty,
/// the others' counts drawn from [min_count, capacity] (and at most their length); indices past the count poisoned.
inline HostSelection random_candidates(Random& rng, const std::vector<std::int32_t>& lengths, std::int32_t kv_heads,
                                       std::int32_t capacity, std::int32_t min_count = 0) {
  const auto batch = std::int32_t(lengths.size());
  HostSelection s(batch, kv_heads, capacity, false);
  for (std::int32_t b = 0; b < batch; ++b) {
    for (std::int32_t h = 0; h < kv_heads; ++h) {
      const std::int32_t row = b * kv_heads + h;
      const std::int32_t drawn = row == 0 ? capacity : row == 1 ? 0 : rng.uniform_int(min_count, capacity);
      const std::int32_t n = std::min(lengths[b], drawn);
      std::vector<std::int32_t> all(lengths[b]);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng.engine);
      std::sort(all.begin(), all.begin() + n);
      std::copy_n(all.begin(), n, s.indices.begin() + std::size_t(row) * capacity);
      s.counts[row] = n;
    }
  }
  return s;
}

/// fp64 candidate scores [rows, capacity] (NaN past the count, where nothing is written): per head the scaled
/// logits over the candidates, softmax over them if asked, then max or sum over the group.
template <class T, class KV>
std::vector<double> candidate_reference(const std::vector<T>& q, std::int32_t q_heads, const KV& kv,
                                        const HostSelection& candidates, double scale, bool softmax, bool sum) {
  const std::int32_t kv_heads = kv.kv_heads, group = q_heads / kv_heads, d = kv.head_dim, cap = candidates.view.capacity;
  std::vector<double> out(candidates.counts.size() * cap, NAN);
  for (std::int32_t b = 0; b < kv.batch; ++b) {
    for (std::int32_t g = 0; g < kv_heads; ++g) {
      const std::int32_t row = b * kv_heads + g, n = candidates.counts[row];
      for (std::int32_t j = 0; j < group; ++j) {
        const std::int32_t h = g * group + j;
        std::vector<double> s(n);
        for (std::int32_t i = 0; i < n; ++i) {
          const auto* k = kv.k_row(b, g, candidates.indices[std::size_t(row) * cap + i]);
          double dot = 0;
          for (std::int32_t c = 0; c < d; ++c) dot += double(to_float(q[(std::size_t(b) * q_heads + h) * d + c])) * to_float(k[c]);
          s[i] = scale * dot;
        }
        if (softmax && n > 0) {
          const double m = *std::max_element(s.begin(), s.end());
          double z = 0;
          for (double x : s) z += std::exp(x - m);
          for (double& x : s) x = std::exp(x - m) / z;
        }
        for (std::int32_t i = 0; i < n; ++i) {
          double& o = out[std::size_t(row) * cap + i];
          o = j == 0 ? s[i] : sum ? o + s[i] : std::max(o, s[i]);
        }
      }
    }
  }
  return out;
}

}  // namespace kvsift::test
