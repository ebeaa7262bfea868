#pragma once
/// SpeContext test problems, shared by the CPU and CUDA tests: a synthetic retrieval head (seeded random W_q, W_k
/// applied to seeded random hidden states), the model's layer caches, and independent fp64 references: the head's
/// RoPE with YaRN written here from HF's formulas (not core/rope.hpp's), the group-max softmax scores per kv head
/// and per sequence (batch-level mode), and the sparse attention of a layer over window and selection.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/selectors/selector.hpp"
#include "selector_check.hpp"
#include "test_util.hpp"

namespace kvsift::test {

struct SpeContextSpec {
  std::int32_t batch = 2;
  std::int32_t q_heads = 4;
  std::int32_t kv_heads = 2;
  std::int32_t head_dim = 64;
  std::int32_t max_tokens = 256;  ///< the selector's limit and every cache's capacity
  std::int32_t min_length = 40;   ///< each sequence's length (the step's token included) is drawn in [min, max]
  std::int32_t max_length = 200;
  std::int32_t layers = 3;
  std::int32_t hidden = 48;        ///< the synthetic head's hidden size
  std::int32_t head_page_size = 0;  ///< > 0: the engine keeps the head's cache, paged (NHD) with this page size
  bool head_contiguous = false;     ///< the engine keeps the head's cache, contiguous [batch, kv_heads, max_tokens, d]
};

/// The head's RoPE in the tests: YaRN that bites at these lengths (original context 64, factor 4).
inline RopeConfig test_head_rope() {
  RopeConfig rope{.theta = 10000.0};
  rope.scaling = {.kind = RopeScaling::yarn, .factor = 4.0, .original_max_position_embeddings = 64};
  return rope;
}

/// HF's YaRN (transformers' _compute_yarn_parameters and get_mscale), written apart from core/rope.hpp: the
/// inverse frequency of pair i and the attention factor.
struct YarnReference {
  double theta, factor;
  std::int32_t original, rotary;
  double inv_freq(std::int32_t i) const {
    const double pi = std::acos(-1.0);
    const double pos_freq = std::pow(theta, double(2 * i) / double(rotary));
    const auto corr = [&](double rot) { return rotary * std::log(original / (rot * 2 * pi)) / (2 * std::log(theta)); };
    const double low = std::max(std::floor(corr(32.0)), 0.0);
    double high = std::min(std::ceil(corr(1.0)), double(rotary - 1));
    if (low == high) high += 0.001;
    const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
    const double extrapolation_factor = 1.0 - ramp;  // HF: inv_freq_extrapolation_factor
    return (1.0 / (factor * pos_freq)) * (1 - extrapolation_factor) + (1.0 / pos_freq) * extrapolation_factor;
  }
  double attention_factor() const { return 0.1 * std::log(factor) + 1.0; }
  /// x (pre-RoPE, head_dim values) at position p, NeoX pairs (i, i + rotary / 2), in fp64.
  std::vector<double> rotate(const std::vector<double>& x, std::int64_t p) const {
    std::vector<double> y = x;
    const std::int32_t half = rotary / 2;
    for (std::int32_t i = 0; i < half; ++i) {
      const double a = double(p) * inv_freq(i);
      y[i] = (x[i] * std::cos(a) - x[i + half] * std::sin(a)) * attention_factor();
      y[i + half] = (x[i] * std::sin(a) + x[i + half] * std::cos(a)) * attention_factor();
    }
    return y;
  }
};

template <class T>
struct SpeContextProblem {
  SpeContextSpec spec;
  std::vector<std::int32_t> lengths;         ///< [batch], the step's token included
  std::vector<std::int32_t> prompt_lengths;  ///< lengths - 1
  std::vector<std::int32_t> slots;           ///< [batch] distinct in [0, max_slots)
  std::int32_t max_slots;
  std::vector<T> k_r;     ///< the head's pre-RoPE keys [batch, kv_heads, max_tokens, head_dim] (0 past the length)
  std::vector<T> k_step;  ///< the step token's k_r [batch, kv_heads, head_dim]
  std::vector<T> q_r;     ///< the step's q_r [batch, q_heads, head_dim]
  std::vector<std::vector<T>> layer_k, layer_v;  ///< per layer [batch, kv_heads, max_tokens, head_dim]
  std::vector<T> step_k, step_v;                 ///< per layer [layers, batch, kv_heads, head_dim]
  std::vector<T> layer_q;                        ///< per layer [layers, batch, q_heads, head_dim]
  YarnReference yarn;

  SpeContextProblem(Random& rng, const SpeContextSpec& s)
      : spec(s), lengths(static_cast<std::size_t>(s.batch)), prompt_lengths(static_cast<std::size_t>(s.batch)),
        slots(static_cast<std::size_t>(s.batch)),
        max_slots(s.batch + 1), yarn{10000.0, 4.0, 64, s.head_dim} {
    const std::int32_t kv = s.kv_heads, d = s.head_dim, n = s.max_tokens;
    for (std::int32_t b = 0; b < s.batch; ++b) {
      lengths[std::size_t(b)] = rng.uniform_int(s.min_length, s.max_length);
      prompt_lengths[std::size_t(b)] = lengths[std::size_t(b)] - 1;
    }
    std::vector<std::int32_t> all(static_cast<std::size_t>(max_slots));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng.engine);
    std::copy_n(all.begin(), s.batch, slots.begin());
    draw_head(rng);
    if (s.head_page_size > 0) {  // the engine's page allocator: shuffled pages, full lengths
      for (std::int32_t b = 0; b < s.batch; ++b) {
        head_num_pages += (lengths[std::size_t(b)] + s.head_page_size - 1) / s.head_page_size;
      }
      std::vector<std::int32_t> ids(static_cast<std::size_t>(head_num_pages));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng.engine);
      std::size_t next = 0;
      for (std::int32_t b = 0; b < s.batch; ++b) {
        head_pages.emplace_back();
        for (std::int32_t i = 0; i * s.head_page_size < lengths[std::size_t(b)]; ++i) head_pages.back().push_back(ids[next++]);
      }
    }
    // The model's layers: random post-RoPE K, V and queries; the step's K/V rows apart (attend writes them).
    for (std::int32_t l = 0; l < s.layers; ++l) {
      layer_k.push_back(to_storage<T>(rng.normal(std::size_t(s.batch) * kv * n * d)));
      layer_v.push_back(to_storage<T>(rng.normal(std::size_t(s.batch) * kv * n * d)));
    }
    step_k = to_storage<T>(rng.normal(std::size_t(s.layers) * s.batch * kv * d));
    step_v = to_storage<T>(rng.normal(std::size_t(s.layers) * s.batch * kv * d));
    layer_q = to_storage<T>(rng.normal(std::size_t(s.layers) * s.batch * s.q_heads * d));
  }

  /// This problem with another synthetic head (fresh projections and hidden states: a second group's head over the
  /// same sequences and layers).
  SpeContextProblem with_new_head(Random& rng) const {
    SpeContextProblem other = *this;
    other.draw_head(rng);
    return other;
  }

 private:
  /// The synthetic head: q_r = W_q x_t, k_r = W_k x_t over random hidden states x_t.
  void draw_head(Random& rng) {
    const SpeContextSpec& s = spec;
    const std::int32_t kv = s.kv_heads, d = s.head_dim, n = s.max_tokens;
    const auto w_q = rng.normal(std::size_t(s.q_heads) * d * s.hidden, 1.0f / std::sqrt(float(s.hidden)));
    const auto w_k = rng.normal(std::size_t(kv) * d * s.hidden, 1.0f / std::sqrt(float(s.hidden)));
    const auto project = [&](const std::vector<float>& w, std::int32_t row, const std::vector<float>& x) {
      double acc = 0;
      for (std::int32_t j = 0; j < s.hidden; ++j) acc += double(w[std::size_t(row) * s.hidden + j]) * x[std::size_t(j)];
      return from_float<T>(float(acc));
    };
    k_r.assign(std::size_t(s.batch) * kv * n * d, from_float<T>(0.0f));
    k_step.resize(std::size_t(s.batch) * kv * d);
    q_r.resize(std::size_t(s.batch) * s.q_heads * d);
    for (std::int32_t b = 0; b < s.batch; ++b) {
      const std::int32_t len = lengths[std::size_t(b)];
      for (std::int32_t t = 0; t < len; ++t) {
        const auto x = rng.normal(static_cast<std::size_t>(s.hidden));
        for (std::int32_t g = 0; g < kv; ++g) {
          for (std::int32_t c = 0; c < d; ++c) {
            const T value = project(w_k, g * d + c, x);
            k_r[((std::size_t(b) * kv + g) * n + t) * d + c] = value;
            if (t == len - 1) k_step[(std::size_t(b) * kv + g) * d + c] = value;
          }
        }
        if (t != len - 1) continue;
        for (std::int32_t h = 0; h < s.q_heads; ++h) {
          for (std::int32_t c = 0; c < d; ++c) q_r[(std::size_t(b) * s.q_heads + h) * d + c] = project(w_q, h * d + c, x);
        }
      }
    }
  }

 public:
  SelectorLimits limits() const {
    return {.max_slots = max_slots, .max_tokens = spec.max_tokens, .q_heads = spec.q_heads, .kv_heads = spec.kv_heads,
            .head_dim = spec.head_dim};
  }
  /// The head's pages when the engine keeps its cache (spec.head_page_size > 0): every sequence's pages for its
  /// full length, in shuffled order, NHD; page_table(lengths) views their first ceil(length / page_size).
  std::vector<std::vector<std::int32_t>> head_pages;
  std::int32_t head_num_pages = 0;
  struct PageTable {
    std::vector<std::int32_t> indptr, indices, last_len;
  };
  PageTable page_table(const std::vector<std::int32_t>& lens) const {
    PageTable t{{0}, {}, {}};
    const std::int32_t ps = spec.head_page_size;
    for (std::int32_t b = 0; b < spec.batch; ++b) {
      const std::int32_t pages = (lens[std::size_t(b)] + ps - 1) / ps;
      for (std::int32_t i = 0; i < pages; ++i) t.indices.push_back(head_pages[std::size_t(b)][std::size_t(i)]);
      t.indptr.push_back(std::int32_t(t.indices.size()));
      t.last_len.push_back(lens[std::size_t(b)] - (pages - 1) * ps);
    }
    return t;
  }
  /// The head's page view (NHD) over `pages` with table t.
  template <class U>
  PagedKVView<U> head_view(U* pages, const PageTable& t) const {
    const std::int32_t kv = spec.kv_heads, d = spec.head_dim, ps = spec.head_page_size;
    return PagedKVView<U>{pages, pages, t.indptr.data(), t.indices.data(), t.last_len.data(), spec.batch, kv, d, ps,
                          head_num_pages, std::int64_t(ps) * kv * d, std::int64_t(kv) * d, d};
  }

  /// The reference's rotated head key t of (b, g) and query of (b, h), rounded once to T as kvsift stores them.
  std::vector<double> rotated_key(std::int32_t b, std::int32_t g, std::int32_t t) const {
    const std::int32_t d = spec.head_dim;
    std::vector<double> x(static_cast<std::size_t>(d));
    for (std::int32_t c = 0; c < d; ++c) {
      x[std::size_t(c)] = to_float(k_r[((std::size_t(b) * spec.kv_heads + g) * spec.max_tokens + t) * d + c]);
    }
    return round_to_storage(yarn.rotate(x, t));
  }
  std::vector<double> rotated_query(std::int32_t b, std::int32_t h) const {
    const std::int32_t d = spec.head_dim;
    std::vector<double> x(static_cast<std::size_t>(d));
    for (std::int32_t c = 0; c < d; ++c) x[std::size_t(c)] = to_float(q_r[(std::size_t(b) * spec.q_heads + h) * d + c]);
    return round_to_storage(yarn.rotate(x, lengths[std::size_t(b)] - 1));
  }
  static std::vector<double> round_to_storage(std::vector<double> x) {
    for (double& v : x) v = to_float(from_float<T>(float(v)));
    return x;
  }

  /// Softmax weights of query head h of row b over its kv head's rotated keys, fp64 (scale 1/sqrt(d)).
  std::vector<double> softmax_weights(std::int32_t b, std::int32_t h) const {
    const std::int32_t len = lengths[std::size_t(b)], g = h / (spec.q_heads / spec.kv_heads);
    const auto q = rotated_query(b, h);
    const double scale = 1.0 / std::sqrt(double(spec.head_dim));
    std::vector<double> logits(static_cast<std::size_t>(len));
    for (std::int32_t t = 0; t < len; ++t) {
      const auto k = rotated_key(b, g, t);
      double s = 0;
      for (std::int32_t c = 0; c < spec.head_dim; ++c) s += q[std::size_t(c)] * k[std::size_t(c)];
      logits[std::size_t(t)] = s * scale;
    }
    const double m = *std::max_element(logits.begin(), logits.end());
    double z = 0;
    for (const double l : logits) z += std::exp(l - m);
    for (double& l : logits) l = std::exp(l - m) / z;
    return logits;
  }
  /// SpeContext's score of every token of row (b, g): the max over g's group of the softmax weights; with
  /// batch_level, over every query head of the sequence.
  std::vector<double> scores(std::int32_t b, std::int32_t g, bool batch_level) const {
    const std::int32_t group = spec.q_heads / spec.kv_heads;
    const std::int32_t first = batch_level ? 0 : g * group, last = batch_level ? spec.q_heads : (g + 1) * group;
    std::vector<double> best(static_cast<std::size_t>(lengths[std::size_t(b)]), 0.0);
    for (std::int32_t h = first; h < last; ++h) {
      const auto w = softmax_weights(b, h);
      for (std::size_t t = 0; t < best.size(); ++t) best[t] = std::max(best[t], w[t]);
    }
    return best;
  }

  /// The rerank's exact scores (group_softmax_scores, selector_check.hpp) of row (b, g)'s `candidates` in layer l:
  /// layer l's query against its prompt keys (candidates are middle tokens, never the step's own), scale 1/sqrt(d).
  std::map<std::int32_t, double> layer_rerank_scores(std::int32_t l, std::int32_t b, std::int32_t g,
                                                     const std::vector<std::int32_t>& candidates) const {
    const std::int32_t kv = spec.kv_heads, d = spec.head_dim, group = spec.q_heads / kv;
    const T* q = layer_q.data() + (std::size_t(l) * spec.batch + b) * spec.q_heads * d;
    const T* k = layer_k[std::size_t(l)].data() + (std::size_t(b) * kv + g) * spec.max_tokens * d;
    return group_softmax_scores(
        g * group, (g + 1) * group, d, candidates, 1.0 / std::sqrt(double(d)),
        [&](std::int32_t h, std::int32_t c) { return to_float(q[std::size_t(h) * d + c]); },
        [&](std::int32_t t, std::int32_t c) { return to_float(k[std::size_t(t) * d + c]); });
  }

  /// fp64 attention of layer l's query over its cache (the step's K/V at len - 1) on the window's tokens and row
  /// (b, g)'s selected ones, for every query head: O [batch, q_heads, head_dim] and LSE.
  HostState attention(std::int32_t l, const std::vector<std::int32_t>& indices, const std::vector<std::int32_t>& counts,
                      std::int32_t capacity, const AttentionWindow& window) const {
    const std::int32_t kv = spec.kv_heads, d = spec.head_dim, n = spec.max_tokens, group = spec.q_heads / kv;
    HostState ref(spec.batch, spec.q_heads, d);
    std::vector<float> k_row(static_cast<std::size_t>(d)), v_row(static_cast<std::size_t>(d));
    for (std::int32_t b = 0; b < spec.batch; ++b) {
      const std::int32_t len = lengths[std::size_t(b)];
      for (std::int32_t g = 0; g < kv; ++g) {
        std::vector<std::int32_t> tokens;
        for (std::int32_t i = 0; i < window.size(len); ++i) tokens.push_back(window.token(i, len));
        const std::int32_t row = b * kv + g;
        for (std::int32_t i = 0; i < counts[std::size_t(row)]; ++i) tokens.push_back(indices[std::size_t(row) * capacity + i]);
        std::vector<std::vector<float>> ks, vs;
        for (const std::int32_t t : tokens) {
          std::vector<float> k(static_cast<std::size_t>(d)), v(static_cast<std::size_t>(d));
          for (std::int32_t c = 0; c < d; ++c) {
            const bool step = t == len - 1;
            const std::size_t at = step ? ((std::size_t(l) * spec.batch + b) * kv + g) * d + c
                                        : ((std::size_t(b) * kv + g) * n + t) * d + c;
            k[std::size_t(c)] = to_float(step ? step_k[at] : layer_k[std::size_t(l)][at]);
            v[std::size_t(c)] = to_float(step ? step_v[at] : layer_v[std::size_t(l)][at]);
          }
          ks.push_back(std::move(k));
          vs.push_back(std::move(v));
        }
        std::vector<const float*> kp, vp;
        for (std::size_t i = 0; i < ks.size(); ++i) kp.push_back(ks[i].data()), vp.push_back(vs[i].data());
        for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
          std::vector<float> q(static_cast<std::size_t>(d));
          const std::size_t row = (std::size_t(l) * spec.batch + b) * spec.q_heads + h;
          for (std::int32_t c = 0; c < d; ++c) q[std::size_t(c)] = to_float(layer_q[row * d + c]);
          std::vector<double> o;
          const double lse = naive_attention(q.data(), kp, vp, std::vector<double>(kp.size(), 0.0), d,
                                             1.0 / std::sqrt(double(d)), o);
          ref.lse[std::size_t(b) * spec.q_heads + h] = float(lse);
          for (std::int32_t c = 0; c < d; ++c) ref.o[(std::size_t(b) * spec.q_heads + h) * d + c] = float(o[std::size_t(c)]);
        }
      }
    }
    return ref;
  }
};

/// The tolerance of a SpeContext score against the fp64 reference, relative to the row's largest: fp32 sums, and
/// the rotations' roundings to T (one ulp of T apart from the reference's on some elements).
inline constexpr double kSpeContextScoreEps = 4e-3;

/// Checks a SpeContext selection [batch, kv_heads, capacity] against the reference scores: per row, the top
/// `budget` of the window's middle, within kSpeContextScoreEps of the k-th score; batch_level rows of a sequence
/// are equal.
template <class T>
void expect_head_selection(const SpeContextProblem<T>& p, const std::vector<std::int32_t>& indices,
                           const std::vector<std::int32_t>& counts, std::int32_t capacity, std::int32_t budget,
                           const AttentionWindow& window, bool batch_level, const std::string& what) {
  const std::int32_t kv = p.spec.kv_heads;
  for (std::int32_t b = 0; b < p.spec.batch; ++b) {
    const std::int32_t len = p.lengths[std::size_t(b)];
    for (std::int32_t g = 0; g < kv; ++g) {
      const auto scores = p.scores(b, g, batch_level);
      std::map<std::int32_t, double> middle;
      for (std::int32_t t = window.sink_end(len); t < window.recent_begin(len); ++t) middle[t] = scores[std::size_t(t)];
      const auto row = selection_row(indices, counts, b * kv + g, capacity);
      expect_top_k(row, middle, budget, kSpeContextScoreEps * *std::max_element(scores.begin(), scores.end()),
                   fmt::format("{}: row ({}, {}) of length {}", what, b, g, len));
      if (batch_level && g > 0) {
        EXPECT_EQ(row, selection_row(indices, counts, b * kv, capacity)) << what << ": kv heads differ in row " << b;
      }
    }
  }
}

}  // namespace kvsift::test
