#pragma once
/// Independent fp64 references of the reference selectors (OracleTopK's and Quest's scores) and the check that
/// a selection is the top-k of such scores, shared by the CPU and CUDA selector tests.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "attention_check.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/selectors/rerank.hpp"
#include "kvsift/step/decode_step.hpp"

namespace kvsift::test {

/// A CaseSpec's selector limits (a slot per batch row, its tokens as max_tokens) and decode step configuration.
inline SelectorLimits case_limits(const CaseSpec& c) {
  return {.max_slots = c.batch, .max_tokens = c.tokens, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
          .head_dim = c.head_dim};
}
inline DecodeStepConfig case_step_config(const CaseSpec& c, const AttentionWindow& window) {
  return {.attention = {.window = window}, .max_batch = c.batch, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
          .head_dim = c.head_dim, .max_seq_len = c.tokens};
}

/// OracleTopK's score of every token [0, len) of row (b, g): the largest softmax weight over the group's heads,
/// in fp64 from the problem's (already rounded) values.
template <class T>
std::vector<double> oracle_scores(const HostDecodeProblem<T>& p, std::int32_t b, std::int32_t g, double scale) {
  const auto& c = p.spec;
  const std::int32_t len = p.kv_values.seq_lens[b], group = c.q_heads / c.kv_heads;
  const auto kv = p.kv_values.view();
  std::vector<double> best(len, 0.0), logits(len);
  for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
    double max_logit = -std::numeric_limits<double>::infinity();
    for (std::int32_t t = 0; t < len; ++t) {
      double dot = 0;
      for (std::int32_t i = 0; i < c.head_dim; ++i) {
        dot += double(to_float(p.q[(std::size_t(b) * c.q_heads + h) * c.head_dim + i])) * kv.k_row(b, g, t)[i];
      }
      logits[t] = scale * dot;
      max_logit = std::max(max_logit, logits[t]);
    }
    double sum = 0;
    for (std::int32_t t = 0; t < len; ++t) sum += std::exp(logits[t] - max_logit);
    for (std::int32_t t = 0; t < len; ++t) best[t] = std::max(best[t], std::exp(logits[t] - max_logit) / sum);
  }
  return best;
}

/// Quest's bound of every page of row (b, g) in fp64: max over the group's heads of
/// sum_c max(q_c * min_c, q_c * max_c) over the page's keys.
template <class T>
std::vector<double> quest_page_scores(const HostDecodeProblem<T>& p, std::int32_t b, std::int32_t g,
                                      std::int32_t page_size) {
  const auto& c = p.spec;
  const std::int32_t len = p.kv_values.seq_lens[b], group = c.q_heads / c.kv_heads;
  const std::int32_t pages = (len + page_size - 1) / page_size;
  const auto kv = p.kv_values.view();
  std::vector<double> scores(pages, -std::numeric_limits<double>::infinity());
  for (std::int32_t page = 0; page < pages; ++page) {
    const std::int32_t first = page * page_size, last = std::min(len, first + page_size);
    for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
      double bound = 0;
      for (std::int32_t i = 0; i < c.head_dim; ++i) {
        double lo = kv.k_row(b, g, first)[i], hi = lo;
        for (std::int32_t t = first + 1; t < last; ++t) {
          lo = std::min(lo, double(kv.k_row(b, g, t)[i]));
          hi = std::max(hi, double(kv.k_row(b, g, t)[i]));
        }
        const double qi = to_float(p.q[(std::size_t(b) * c.q_heads + h) * c.head_dim + i]);
        bound += std::max(qi * lo, qi * hi);
      }
      scores[page] = std::max(scores[page], bound);
    }
  }
  return scores;
}

/// Expects `chosen` (distinct, ascending) to be the k best of `candidates` (id -> score), k = min(k, number of
/// candidates), except that candidates whose scores lie within `eps` of the k-th best score may trade places
/// (the backends round their fp32 sums differently).
inline void expect_top_k(const std::vector<std::int32_t>& chosen, const std::map<std::int32_t, double>& candidates,
                         std::int32_t k, double eps, const std::string& what) {
  k = std::min<std::int32_t>(k, std::int32_t(candidates.size()));
  ASSERT_EQ(std::int32_t(chosen.size()), k) << what;
  ASSERT_TRUE(std::is_sorted(chosen.begin(), chosen.end()) &&
              std::adjacent_find(chosen.begin(), chosen.end()) == chosen.end())
      << what << ": not distinct and ascending";
  if (k == 0) return;
  std::vector<double> sorted;
  for (const auto& [id, score] : candidates) sorted.push_back(score);
  std::sort(sorted.begin(), sorted.end(), std::greater<>());
  const double kth = sorted[std::size_t(k) - 1];
  const std::set<std::int32_t> picked(chosen.begin(), chosen.end());
  for (const std::int32_t id : chosen) {
    ASSERT_TRUE(candidates.count(id)) << what << ": " << id << " is not a candidate";
    EXPECT_GE(candidates.at(id), kth - eps) << what << ": chose " << id << " below the k-th score " << kth;
  }
  for (const auto& [id, score] : candidates) {
    if (!picked.count(id)) {
      EXPECT_LE(score, kth + eps) << what << ": left out " << id << " above the k-th " << kth;
    }
  }
}

/// The rows of a selection in host memory as vectors.
inline std::vector<std::int32_t> selection_row(const std::vector<std::int32_t>& indices,
                                               const std::vector<std::int32_t>& counts, std::int32_t row,
                                               std::int32_t capacity) {
  const std::int32_t count = counts[std::size_t(row)];
  EXPECT_GE(count, 0);
  EXPECT_LE(count, capacity);
  const auto begin = indices.begin() + std::ptrdiff_t(row) * capacity;
  return {begin, begin + std::max(0, std::min(count, capacity))};
}

/// Checks OracleTopK's selection of every row of problem p against oracle_scores.
template <class T>
void expect_oracle_selection(const HostDecodeProblem<T>& p, const std::vector<std::int32_t>& indices,
                             const std::vector<std::int32_t>& counts, std::int32_t capacity, std::int32_t budget,
                             const AttentionWindow& window, double scale) {
  const auto& c = p.spec;
  for (std::int32_t b = 0; b < c.batch; ++b) {
    const std::int32_t len = p.kv_values.seq_lens[b];
    for (std::int32_t g = 0; g < c.kv_heads; ++g) {
      const auto scores = oracle_scores(p, b, g, scale);
      std::map<std::int32_t, double> middle;
      for (std::int32_t t = window.sink_end(len); t < window.recent_begin(len); ++t) middle[t] = scores[t];
      expect_top_k(selection_row(indices, counts, b * c.kv_heads + g, capacity), middle, budget,
                   1e-4 * *std::max_element(scores.begin(), scores.end()),
                   fmt::format("OracleTopK row ({}, {}) of length {}", b, g, len));
    }
  }
}

/// Checks Quest's selection: whole pages less their window tokens, the pages the top of quest_page_scores.
template <class T>
void expect_quest_selection(const HostDecodeProblem<T>& p, const std::vector<std::int32_t>& indices,
                            const std::vector<std::int32_t>& counts, std::int32_t capacity, std::int32_t pages_per_row,
                            std::int32_t page_size, const AttentionWindow& window) {
  const auto& c = p.spec;
  for (std::int32_t b = 0; b < c.batch; ++b) {
    const std::int32_t len = p.kv_values.seq_lens[b];
    const std::int32_t lo = window.sink_end(len), hi = window.recent_begin(len);
    for (std::int32_t g = 0; g < c.kv_heads; ++g) {
      const std::string what = fmt::format("Quest row ({}, {}) of length {}", b, g, len);
      const auto scores = quest_page_scores(p, b, g, page_size);
      const auto row = selection_row(indices, counts, b * c.kv_heads + g, capacity);
      std::set<std::int32_t> pages;
      for (const std::int32_t t : row) {
        ASSERT_TRUE(t >= lo && t < hi) << what << ": token " << t << " is outside the middle [" << lo << ", " << hi << ")";
        pages.insert(t / page_size);
      }
      std::vector<std::int32_t> whole;  // every middle token of the chosen pages, so pages are taken whole
      for (const std::int32_t page : pages) {
        for (std::int32_t t = std::max(lo, page * page_size); t < std::min(hi, (page + 1) * page_size); ++t) {
          whole.push_back(t);
        }
      }
      EXPECT_EQ(row, whole) << what << ": pages are not taken whole";
      std::map<std::int32_t, double> candidates;  // pages holding a middle token
      double max_abs = 0;
      for (std::int32_t page = lo / page_size; page * page_size < hi; ++page) {
        candidates[page] = scores[page];
        max_abs = std::max(max_abs, std::abs(scores[page]));
      }
      expect_top_k({pages.begin(), pages.end()}, candidates, pages_per_row, 1e-4 * (1 + max_abs), what);
    }
  }
}

/// The rerank's exact score of each candidate, in fp64: the group's softmax weight over the candidates alone, max
/// over the group's heads [heads_begin, heads_end). query(h, d) and key(t, d): element d of head h's query and of
/// token t's key.
template <class Query, class Key>
std::map<std::int32_t, double> group_softmax_scores(std::int32_t heads_begin, std::int32_t heads_end,
                                                    std::int32_t head_dim, const std::vector<std::int32_t>& candidates,
                                                    double scale, Query query, Key key) {
  std::map<std::int32_t, double> best;
  std::vector<double> logits(candidates.size());
  for (std::int32_t h = heads_begin; h < heads_end; ++h) {
    double max_logit = -std::numeric_limits<double>::infinity();
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      double dot = 0;
      for (std::int32_t d = 0; d < head_dim; ++d) dot += double(query(h, d)) * double(key(candidates[i], d));
      logits[i] = scale * dot;
      max_logit = std::max(max_logit, logits[i]);
    }
    double sum = 0;
    for (const double l : logits) sum += std::exp(l - max_logit);
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      best[candidates[i]] = std::max(best[candidates[i]], std::exp(logits[i] - max_logit) / sum);
    }
  }
  return best;
}

/// group_softmax_scores of row (b, g)'s candidates in a HostDecodeProblem.
template <class T>
std::map<std::int32_t, double> rerank_scores(const HostDecodeProblem<T>& p, std::int32_t b, std::int32_t g,
                                             const std::vector<std::int32_t>& candidates, double scale) {
  const auto& c = p.spec;
  const std::int32_t group = c.q_heads / c.kv_heads;
  const auto kv = p.kv_values.view();
  return group_softmax_scores(
      g * group, (g + 1) * group, c.head_dim, candidates, scale,
      [&](std::int32_t h, std::int32_t d) { return to_float(p.q[(std::size_t(b) * c.q_heads + h) * c.head_dim + d]); },
      [&](std::int32_t t, std::int32_t d) { return kv.k_row(b, g, t)[d]; });
}

/// The rows of a reranked step with RerankConfig::mass (selectors/rerank.hpp), against fp64: row r keeps k of its
/// proposed candidates (`candidates`, the proposer's step alone on the same inputs, capacity `proposed`), k within
/// [min(floor, upper), upper], upper = min(budget, candidates, the length's budget with budget_fraction), k the
/// fewest best whose fp64 scores hold config.mass of the row's (within 1e-5 of the row's mass: fp32 scores near
/// the target may tip k by one) unless the floor or upper bound decided; and the kept set is the top k of the
/// exact scores (expect_top_k, near-ties within 1e-4 of the top score free to trade places).
template <class T, class Selection>
void expect_reranked_mass_rows(const HostDecodeProblem<T>& p, const Selection& candidates, std::int32_t proposed,
                               const Selection& sel, const RerankConfig& config, double scale) {
  const auto& c = p.spec;
  for (std::int32_t b = 0; b < c.batch; ++b) {
    for (std::int32_t g = 0; g < c.kv_heads; ++g) {
      const std::int32_t row = b * c.kv_heads + g;
      const std::string what = fmt::format("row ({}, {})", b, g);
      const auto ids = selection_row(candidates.indices, candidates.counts, row, proposed);
      const auto scores = rerank_scores(p, b, g, ids, scale);
      const auto kept = selection_row(sel.indices, sel.counts, row, config.budget);
      std::vector<double> sorted;
      for (const auto& [id, score] : scores) sorted.push_back(score);
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      std::int32_t upper = std::min<std::int32_t>(config.budget, std::int32_t(sorted.size()));
      if (config.budget_fraction > 0) {
        upper = std::min(upper, LengthBudget{.fraction = config.budget_fraction, .maximum = config.budget}(
                                    p.kv_values.seq_lens[std::size_t(b)]));
      }
      const std::int32_t k = std::int32_t(kept.size());
      EXPECT_GE(k, std::min(config.floor, upper)) << what;
      EXPECT_LE(k, upper) << what;
      double total = 0, held = 0;
      for (const double s : sorted) total += s;
      for (std::int32_t i = 0; i < k; ++i) held += sorted[std::size_t(i)];
      const double target = config.mass * total, tolerance = 1e-5 * total;
      if (k < upper) {
        EXPECT_GE(held, target - tolerance) << what << ": " << k << " candidates hold too little";
      }
      if (k > config.floor) {
        EXPECT_LT(held - sorted[std::size_t(k) - 1], target + tolerance) << what << ": " << k - 1 << " would do";
      }
      const double top = sorted.empty() ? 0.0 : sorted.front();
      expect_top_k(kept, scores, k, 1e-4 * top, what);
    }
  }
}

/// A step's page-level selection (`pages`: pages_per_row page ids of page_size tokens a row) expands, row by row,
/// to the token step's selection of the same inputs (`tokens`: capacity entries a row): each page's middle tokens,
/// in its order (config.page_selections against the expansion into tokens).
template <class T, class Selection>
void expect_pages_expand_to_tokens(const HostDecodeProblem<T>& p, const Selection& pages, std::int32_t pages_per_row,
                                   std::int32_t page_size, const Selection& tokens, std::int32_t capacity,
                                   const AttentionWindow& window) {
  for (std::int32_t b = 0; b < p.spec.batch; ++b) {
    for (std::int32_t h = 0; h < p.spec.kv_heads; ++h) {
      const std::size_t row = std::size_t(b) * p.spec.kv_heads + h;
      const std::vector<std::int32_t> expanded = page_middle_tokens(
          pages.indices.data() + row * pages_per_row, pages.counts[row], page_size, p.kv_values.seq_lens[b], window);
      const auto first = tokens.indices.begin() + std::ptrdiff_t(row * capacity);
      EXPECT_EQ(expanded, std::vector<std::int32_t>(first, first + tokens.counts[row])) << "row " << row;
    }
  }
}

}  // namespace kvsift::test
