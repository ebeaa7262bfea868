#pragma once
// A²ATS problems (selectors/a2ats/a2ats.hpp) and the fp64 / scalar references of its rule, shared by the CPU and CUDA
// selector tests: every key of every sequence generated up front (pre-RoPE, in T) and the cache holding them rotated
// to their positions in fp64 (rounded to T); a codebook over them built here in fp64 (C^z = C L); queries rotated to
// their positions in fp64, and q~ = q R_b recomputed from the rounded post-RoPE query; scores q~ . C_code in fp64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kvsift/core/rope.hpp"
#include "kvsift/selectors/a2ats/a2ats.hpp"
#include "kvsift/step/decode_step.hpp"
#include "test_util.hpp"

namespace kvsift::test {

/// The window the authors always attend (sinks 4, recent 64 with the step's token): the step's window in the tests.
inline constexpr AttentionWindow kA2atsWindow{.sink = 4, .recent = 64};

enum class A2atsCodebookKind {
  exact,      ///< one codeword per key of every sequence (C = the keys): a key's code is its own codeword
  clustered,  ///< `codewords` random codewords, each key one of them plus small noise (many keys per code)
};

template <class T>
struct A2atsProblem {
  std::int32_t batch, q_heads, kv_heads, head_dim, capacity, codewords;
  RopeConfig rope;
  std::int32_t offset;
  bool windowed;
  std::vector<std::int32_t> lengths, slots;
  std::vector<T> k_pre, k, v;  ///< [batch, kv_heads, capacity, head_dim]; k = k_pre rotated to each position
  std::vector<float> transform, centroids, codebook;  ///< L [kv, d, d], C^z and C [kv, codewords, d] (fp32)
  std::vector<double> key_space;                      ///< C in fp64 (the fp32 values): the reference's codewords
  std::vector<std::int32_t> code_of;                  ///< [batch, kv_heads, capacity]: each key's code

  A2atsProblem(Random& rng, A2atsCodebookKind kind, std::int32_t batch_, std::int32_t q_heads_, std::int32_t kv_heads_,
               std::int32_t capacity_, std::vector<std::int32_t> prompts, RopeConfig rope_ = {}, std::int32_t offset_ = 2048,
               bool windowed_ = true, std::int32_t clustered_codewords = 24, std::int32_t head_dim_ = 64)
      : batch(batch_), q_heads(q_heads_), kv_heads(kv_heads_), head_dim(head_dim_), capacity(capacity_),
        codewords(kind == A2atsCodebookKind::exact ? batch_ * capacity_ : clustered_codewords), rope(rope_),
        offset(offset_), windowed(windowed_), lengths(std::move(prompts)), slots(std::size_t(batch_)) {
    const std::int32_t d = head_dim;
    const std::size_t elements = std::size_t(batch) * kv_heads * capacity * d;
    std::iota(slots.rbegin(), slots.rend(), 0);  // row b reads slot batch - 1 - b: slots are not rows
    code_of.resize(elements / std::size_t(d));
    std::vector<double> words(std::size_t(kv_heads) * codewords * d);  // C per kv head
    if (kind == A2atsCodebookKind::clustered) {
      const auto w = rng.normal(words.size());
      for (std::size_t i = 0; i < words.size(); ++i) words[i] = double(w[i]) * 1.5;
    }
    // Keys: exact, random (C is then the keys as the codebook sees them); clustered, a codeword plus noise.
    std::vector<float> pre = rng.normal(elements);
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t h = 0; h < kv_heads; ++h) {
        for (std::int32_t t = 0; t < capacity; ++t) {
          const std::size_t row = (std::size_t(b) * kv_heads + h) * capacity + t;
          const std::int32_t code = kind == A2atsCodebookKind::exact ? b * capacity + t : rng.uniform_int(0, codewords - 1);
          code_of[row] = code;
          if (kind == A2atsCodebookKind::clustered) {
            for (std::int32_t j = 0; j < d; ++j) {
              pre[row * d + j] = float(words[(std::size_t(h) * codewords + code) * d + j] + 0.03 * pre[row * d + j]);
            }
          }
        }
      }
    }
    k_pre = to_storage<T>(pre);
    v = to_storage<T>(rng.normal(elements));
    k.resize(elements);
    std::vector<float> x(d);
    for (std::size_t row = 0; row < code_of.size(); ++row) {
      for (std::int32_t j = 0; j < d; ++j) x[j] = to_float(k_pre[row * d + j]);
      apply_rope(x.data(), d, std::int64_t(row % std::size_t(capacity)), rope);
      for (std::int32_t j = 0; j < d; ++j) k[row * d + j] = from_float<T>(x[j]);
    }
    if (kind == A2atsCodebookKind::exact) {  // the codewords are the keys the codes are made of: pre- or post-RoPE
      const std::vector<T>& coded = windowed ? k_pre : k;
      for (std::size_t row = 0; row < code_of.size(); ++row) {
        const std::size_t h = row / std::size_t(capacity) % std::size_t(kv_heads);
        for (std::int32_t j = 0; j < d; ++j) {
          words[(h * codewords + code_of[row]) * d + j] = to_float(coded[row * d + j]);
        }
      }
    }
    build_codebook(rng, words);
  }

  /// A well-conditioned lower-triangular L per kv head, C^z = C L in fp64 (rounded once), C in fp32.
  void build_codebook(Random& rng, const std::vector<double>& words) {
    const std::int32_t d = head_dim;
    transform.assign(std::size_t(kv_heads) * d * d, 0.0f);
    centroids.resize(words.size());
    codebook.resize(words.size());
    key_space.resize(words.size());
    for (std::int32_t h = 0; h < kv_heads; ++h) {
      float* l = transform.data() + std::size_t(h) * d * d;
      const auto off = rng.normal(std::size_t(d) * d, 0.3f / std::sqrt(float(d)));
      for (std::int32_t i = 0; i < d; ++i) {
        for (std::int32_t j = 0; j < i; ++j) l[i * d + j] = off[std::size_t(i) * d + j];
        l[i * d + i] = rng.uniform(0.5f, 1.5f);
      }
      for (std::int32_t c = 0; c < codewords; ++c) {
        const std::size_t at = (std::size_t(h) * codewords + c) * d;
        for (std::int32_t j = 0; j < d; ++j) {
          codebook[at + j] = float(words[at + j]);
          key_space[at + j] = codebook[at + j];
        }
        for (std::int32_t j = 0; j < d; ++j) {  // z_j = sum_{i >= j} C_i L[i][j]
          double s = 0;
          for (std::int32_t i = j; i < d; ++i) s += key_space[at + i] * l[i * d + j];
          centroids[at + j] = float(s);
        }
      }
    }
  }

  /// A new sequence in row b (clustered codebooks: its keys drawn again around the codewords), `length` tokens long.
  void redraw_row(Random& rng, std::int32_t b, std::int32_t length) {
    const std::int32_t d = head_dim;
    const auto noise = rng.normal(std::size_t(kv_heads) * capacity * d);
    std::vector<float> x(d);
    for (std::int32_t h = 0; h < kv_heads; ++h) {
      for (std::int32_t t = 0; t < capacity; ++t) {
        const std::size_t row = (std::size_t(b) * kv_heads + h) * capacity + t;
        const std::int32_t code = rng.uniform_int(0, codewords - 1);
        code_of[row] = code;
        const std::size_t n = (std::size_t(h) * capacity + t) * d;
        for (std::int32_t j = 0; j < d; ++j) {
          k_pre[row * d + j] = from_float<T>(float(key_space[(std::size_t(h) * codewords + code) * d + j] + 0.03 * noise[n + j]));
          x[j] = to_float(k_pre[row * d + j]);
        }
        apply_rope(x.data(), d, t, rope);
        for (std::int32_t j = 0; j < d; ++j) k[row * d + j] = from_float<T>(x[j]);
      }
    }
    lengths[std::size_t(b)] = length;
  }

  A2atsLayerCodebooks codebooks() const {
    return {transform.data(), centroids.data(), codebook.data(), kv_heads, codewords, head_dim, rope, offset, windowed};
  }
  SelectorLimits limits() const {
    return {.max_slots = batch, .max_tokens = capacity, .q_heads = q_heads, .kv_heads = kv_heads, .head_dim = head_dim};
  }
  DecodeStepConfig step_config() const {
    return {.attention = {.window = kA2atsWindow}, .max_batch = batch, .q_heads = q_heads, .kv_heads = kv_heads,
            .head_dim = head_dim, .max_seq_len = capacity};
  }
  /// The cache over arrays holding k and v (host here, device copies in the GPU tests) and `seq_lens`.
  ContiguousKVView<T> contiguous(T* k_data, T* v_data, const std::int32_t* seq_lens) const {
    return ContiguousKVView<T>::packed(k_data, v_data, batch, kv_heads, capacity, head_dim, seq_lens);
  }
  ContiguousKVView<T> contiguous() { return contiguous(k.data(), v.data(), lengths.data()); }
  /// Every key before RoPE, [batch, kv_heads, capacity, head_dim] (PrefillInputs::k_pre_rope).
  SequenceView<const T> k_pre_rope(const T* data) const {
    return SequenceView<const T>::packed(data, batch, kv_heads, capacity, head_dim);
  }
  /// The pre-RoPE keys of each row's newest token (lengths[b] - 1), packed [batch, kv_heads, head_dim].
  std::vector<T> step_k_pre() const {
    std::vector<T> out(std::size_t(batch) * kv_heads * head_dim);
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t h = 0; h < kv_heads; ++h) {
        const T* row = k_pre.data() + ((std::size_t(b) * kv_heads + h) * capacity + lengths[b] - 1) * head_dim;
        std::copy_n(row, head_dim, out.begin() + (std::size_t(b) * kv_heads + h) * head_dim);
      }
    }
    return out;
  }

  /// The codes the selector must hold for row b's tokens [0, lengths[b]) at slot slots[b] (codes [slots, kv, cap]).
  void expect_codes(const std::vector<std::uint16_t>& codes, const std::string& what) const {
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t h = 0; h < kv_heads; ++h) {
        for (std::int32_t t = 0; t < lengths[b]; ++t) {
          ASSERT_EQ(codes[(std::size_t(slots[b]) * kv_heads + h) * capacity + t],
                    code_of[(std::size_t(b) * kv_heads + h) * capacity + t])
              << what << ": row " << b << " kv head " << h << " token " << t;
        }
      }
    }
  }

  /// A step's queries: random before RoPE, rotated to lengths[b] - 1 in fp64 and rounded to T (what the selector
  /// gets); q~ recomputed from those rounded values: rotated back and on to the offset (windowed), or as they are.
  struct Queries {
    std::vector<T> q;              ///< [batch, q_heads, d]
    std::vector<double> rotated;   ///< q~ [batch, q_heads, d]
  };
  Queries queries(Random& rng) const {
    const std::int32_t d = head_dim;
    Queries out{to_storage<T>(rng.normal(std::size_t(batch) * q_heads * d)), {}};
    out.rotated.resize(out.q.size());
    std::vector<float> x(d);
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t h = 0; h < q_heads; ++h) {
        T* row = out.q.data() + (std::size_t(b) * q_heads + h) * d;
        for (std::int32_t j = 0; j < d; ++j) x[j] = to_float(row[j]);
        apply_rope(x.data(), d, lengths[b] - 1, rope);
        for (std::int32_t j = 0; j < d; ++j) row[j] = from_float<T>(x[j]);
        for (std::int32_t j = 0; j < d; ++j) x[j] = to_float(row[j]);
        if (windowed) {
          apply_rope(x.data(), d, lengths[b] - 1, rope, /*inverse=*/true);
          apply_rope(x.data(), d, offset, rope);
        }
        for (std::int32_t j = 0; j < d; ++j) out.rotated[(std::size_t(b) * q_heads + h) * d + j] = x[j];
      }
    }
    return out;
  }

  /// Query head h of row b against codeword `code` of its kv head, fp64, and the magnitude sum |q~_j C_j|.
  double score(const Queries& qs, std::int32_t b, std::int32_t h, std::int32_t code, double* magnitude) const {
    const double* q = qs.rotated.data() + (std::size_t(b) * q_heads + h) * head_dim;
    const double* c = key_space.data() + (std::size_t(h / (q_heads / kv_heads)) * codewords + code) * head_dim;
    double s = 0, m = 0;
    for (std::int32_t j = 0; j < head_dim; ++j) s += q[j] * c[j], m += std::abs(q[j] * c[j]);
    *magnitude = m;
    return s;
  }
};

/// A candidate of a reference row: its fp64 score, its code (equal codes score equally on both sides) and the bound
/// of the tested side's error on its score.
struct Candidate {
  double score = 0;
  std::int32_t code = 0;
  double eps = 0;
};

/// What a reference top-K of one score row pins down: `exact` when no token of the top K and token outside it of
/// different codes score within their error bounds of each other (then the picks are those of the tie rule: equal
/// codes score equally on both sides, the smaller token first), else the tokens that must be in (`sure`) and those
/// that may be (`possible`).
struct RowPicks {
  bool exact = true;
  std::set<std::int32_t> sure, possible;
};

inline RowPicks reference_picks(const std::map<std::int32_t, Candidate>& candidates, std::int32_t k) {
  std::vector<std::pair<double, std::int32_t>> order;
  double eps = 0;
  for (const auto& [t, c] : candidates) order.emplace_back(-c.score, t), eps = std::max(eps, c.eps);
  std::sort(order.begin(), order.end());
  k = std::min<std::int32_t>(k, std::int32_t(order.size()));
  RowPicks picks;
  if (k == 0) return picks;
  const double kth = -order[std::size_t(k) - 1].first;
  for (std::size_t o = std::size_t(k); o < order.size() && -order[o].first >= kth - 2 * eps; ++o) {
    const Candidate& out = candidates.at(order[o].second);
    for (std::size_t i = 0; i < std::size_t(k); ++i) {
      const Candidate& in = candidates.at(order[i].second);
      if (in.code != out.code && in.score - out.score <= in.eps + out.eps) picks.exact = false;
    }
  }
  for (std::int32_t i = 0; i < std::int32_t(order.size()); ++i) {
    const double s = -order[std::size_t(i)].first;
    const std::int32_t t = order[std::size_t(i)].second;
    if (picks.exact) {
      if (i < k) picks.sure.insert(t), picks.possible.insert(t);
    } else {
      if (s > kth + 2 * eps) picks.sure.insert(t);
      if (s >= kth - 2 * eps) picks.possible.insert(t);
    }
  }
  return picks;
}

/// Checks a selection row against the union (or the single row, group max) of reference picks; returns whether it
/// was checked exactly (every pick unambiguous).
inline bool expect_selection_row(const std::vector<std::int32_t>& chosen, const std::vector<RowPicks>& heads,
                                 const std::string& what) {
  EXPECT_TRUE(std::is_sorted(chosen.begin(), chosen.end()) && std::adjacent_find(chosen.begin(), chosen.end()) == chosen.end())
      << what << ": not distinct and ascending";
  std::set<std::int32_t> sure, possible;
  bool exact = true;
  for (const RowPicks& p : heads) {
    sure.insert(p.sure.begin(), p.sure.end());
    possible.insert(p.possible.begin(), p.possible.end());
    exact = exact && p.exact;
  }
  const std::set<std::int32_t> got(chosen.begin(), chosen.end());
  if (exact) {
    EXPECT_EQ(got, sure) << what;
    return true;
  }
  for (const std::int32_t t : sure) EXPECT_TRUE(got.count(t)) << what << ": left out " << t;
  for (const std::int32_t t : got) EXPECT_TRUE(possible.count(t)) << what << ": chose " << t;
  return false;
}

/// Checks every row of a selection (host copies of indices [batch, kv, capacity] and counts) against the rule:
/// per query head (union) or per kv head on the group's maximum (group_max), the top K = min(floor(f len), max_budget)
/// of the middle by the fp64 score of each token's code. Returns the rows checked exactly. A score's error: T's
/// rounding of q~ and of C (one unit each, relative to sum |q~_j C_j|) and the fp32 sums and rotation.
template <class T>
std::int32_t expect_a2ats_selection(const A2atsProblem<T>& p, const typename A2atsProblem<T>::Queries& qs,
                                    const std::vector<std::int32_t>& indices, const std::vector<std::int32_t>& counts,
                                    std::int32_t capacity, const A2atsConfig& config, std::int32_t max_budget,
                                    const std::string& what) {
  const double tol = std::is_same_v<T, float> ? 1e-5 : std::is_same_v<T, half> ? 1.2e-3 : 8.5e-3;
  const std::int32_t group = p.q_heads / p.kv_heads;
  std::int32_t exact_rows = 0;
  for (std::int32_t b = 0; b < p.batch; ++b) {
    const std::int32_t len = p.lengths[b];
    const std::int32_t k = LengthBudget{.fraction = config.budget_fraction, .maximum = max_budget}(len);
    for (std::int32_t g = 0; g < p.kv_heads; ++g) {
      const std::size_t row = std::size_t(b) * p.kv_heads + g;
      std::vector<std::map<std::int32_t, Candidate>> per_head(static_cast<std::size_t>(group));
      for (std::int32_t t = kA2atsWindow.sink_end(len); t < kA2atsWindow.recent_begin(len); ++t) {
        const std::int32_t code = p.code_of[row * p.capacity + t];
        for (std::int32_t u = 0; u < group; ++u) {
          double magnitude = 0;
          const double s = p.score(qs, b, g * group + u, code, &magnitude);
          per_head[std::size_t(u)][t] = {s, code, tol * magnitude + 1e-6};
        }
      }
      std::vector<RowPicks> picks;
      if (config.group_rule == A2atsGroupRule::union_of_heads) {
        for (const auto& candidates : per_head) picks.push_back(reference_picks(candidates, k));
      } else {
        std::map<std::int32_t, Candidate> maxima = per_head[0];
        for (const auto& candidates : per_head) {
          for (const auto& [t, c] : candidates) {
            Candidate& m = maxima[t];
            m.eps = std::max(m.eps, c.eps);  // the maximum of scores each off by at most its eps
            m.score = std::max(m.score, c.score);
          }
        }
        picks.push_back(reference_picks(maxima, k));
      }
      const std::int32_t count = counts[row];
      EXPECT_TRUE(count >= 0 && count <= capacity) << what << ": count " << count;
      const std::vector<std::int32_t> chosen(indices.begin() + std::ptrdiff_t(row) * capacity,
                                             indices.begin() + std::ptrdiff_t(row) * capacity + std::clamp(count, 0, capacity));
      exact_rows += expect_selection_row(chosen, picks, fmt::format("{}: row ({}, {}) of length {}, K {}", what, b, g, len, k));
    }
  }
  return exact_rows;
}

}  // namespace kvsift::test
