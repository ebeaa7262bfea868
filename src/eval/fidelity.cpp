#include "kvsift/eval/fidelity.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numeric>
#include <optional>

#include "kvsift/eval/metrics.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/selection_buffer.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/selectors/oracle_topk.hpp"
#include "kvsift/selectors/quest.hpp"
#include "kvsift/selectors/streaming_llm.hpp"

namespace kvsift {
namespace {

/// One capture layer in fp32, in the capture's [token][head][channel] layout, viewed as prefixes.
struct FloatLayer {
  std::int32_t tokens, q_heads, kv_heads, head_dim;
  std::vector<float> q, k, v;

  FloatLayer(const Capture& c, const CaptureLayer& layer)
      : tokens(c.tokens), q_heads(c.q_heads), kv_heads(c.kv_heads), head_dim(c.head_dim) {
    const auto widen = [](const std::vector<half>& src) {
      std::vector<float> dst(src.size());
      std::transform(src.begin(), src.end(), dst.begin(), [](half x) { return to_float(x); });
      return dst;
    };
    q = widen(layer.q);
    k = widen(layer.k);
    v = widen(layer.v);
  }
  std::int64_t kv_token_stride() const { return std::int64_t(kv_heads) * head_dim; }
  /// The cache holding tokens [0, *length).
  ContiguousKVView<const float> kv(const std::int32_t* length) const {
    return {k.data(), v.data(), length, 1, kv_heads, tokens, head_dim, tokens * kv_token_stride(), head_dim,
            kv_token_stride()};
  }
  QueryView<const float> query(std::int32_t pos) const {
    return QueryView<const float>::packed(q.data() + std::size_t(pos) * q_heads * head_dim, 1, q_heads, head_dim);
  }
  PrefillInputs<float> prefill(const std::int32_t* length) const {
    const std::int64_t q_token_stride = std::int64_t(q_heads) * head_dim;
    return {{q.data(), 1, q_heads, *length, head_dim, tokens * q_token_stride, head_dim, q_token_stride}, kv(length)};
  }
  AppendInputs<float> token(std::int32_t pos) const {
    const std::size_t offset = std::size_t(pos) * kv_heads * head_dim;
    return {HeadsView<const float>::packed(k.data() + offset, 1, kv_heads, head_dim),
            HeadsView<const float>::packed(v.data() + offset, 1, kv_heads, head_dim), query(pos)};
  }
};

}  // namespace

std::vector<SelectorEntry> reference_selectors() {
  return {
      {"OracleTopK", [](std::int32_t k) { return AnySelector<float>(OracleTopK({.budget = k})); }},
      {"StreamingLLM", [](std::int32_t k) { return AnySelector<float>(StreamingLLM({.budget = k, .sink = std::min(4, k)})); }},
      {"Quest", [](std::int32_t k) { return AnySelector<float>(Quest({.budget = k, .page_size = 16})); }},
  };
}

namespace {

/// The q-quantile of `values` by linear interpolation between order statistics (numpy's default); sorts them.
double quantile(std::vector<double>& values, double q) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const double h = q * double(values.size() - 1);
  const auto lo = std::size_t(std::floor(h));
  const std::size_t hi = std::min(lo + 1, values.size() - 1);
  return values[lo] + (h - double(lo)) * (values[hi] - values[lo]);
}

double mean(const std::vector<double>& values) {
  double sum = 0.0;
  for (const double x : values) sum += x;
  return values.empty() ? 0.0 : sum / double(values.size());
}

/// One selector at one budget on one layer: the selector (absent when refused) and its samples.
struct Run {
  std::size_t budget_index = 0;
  std::optional<AnySelector<float>> selector;
  std::string refused;
  std::vector<double> mass, error;  ///< per (evaluated position, query head)
  double id_recall = 0.0, selected = 0.0;  ///< sums over (evaluated position, kv head)
};

/// The oracle's ranking of one position: per kv head, each token's rank when the tokens are ordered by the
/// largest fp32 softmax weight of the group's query heads, descending, ties to the smaller index.
void rank_tokens(const AttentionWeights& attention, std::int32_t kv_heads, std::vector<std::int32_t>& rank,
                 std::vector<float>& score, std::vector<std::int32_t>& order) {
  const std::int32_t n = attention.seq_lens[0];
  rank.resize(std::size_t(kv_heads) * n);
  score.resize(std::size_t(n));
  order.resize(std::size_t(n));
  for (std::int32_t g = 0; g < kv_heads; ++g) {
    std::fill(score.begin(), score.end(), 0.0f);
    for (std::int32_t h = g * attention.group; h < (g + 1) * attention.group; ++h) {
      const double* w = attention.row(0, h);
      const double denom = attention.denominators[std::size_t(h)];
      for (std::int32_t t = 0; t < n; ++t) score[t] = std::max(score[t], static_cast<float>(w[t] / denom));
    }
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](std::int32_t a, std::int32_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
    for (std::int32_t r = 0; r < n; ++r) rank[std::size_t(g) * n + order[r]] = r;
  }
}

}  // namespace

FidelityResult evaluate_fidelity(const Capture& capture, std::span<const SelectorEntry> selectors,
                                 const FidelityOptions& options) {
  constexpr const char* where = "evaluate_fidelity";
  KVSIFT_CHECK(!capture.layers.empty(), where, "the capture holds no layers");
  KVSIFT_CHECK(capture.tokens > 1 && capture.q_heads > 0 && capture.kv_heads > 0 && capture.head_dim > 0 &&
                   capture.q_heads % capture.kv_heads == 0,
               where, "capture shape (tokens {}, q_heads {}, kv_heads {}, head_dim {}) is not a decodable one",
               capture.tokens, capture.q_heads, capture.kv_heads, capture.head_dim);
  const std::size_t q_size = std::size_t(capture.tokens) * capture.q_heads * capture.head_dim;
  const std::size_t kv_size = std::size_t(capture.tokens) * capture.kv_heads * capture.head_dim;
  for (const auto& l : capture.layers) {
    KVSIFT_CHECK(l.q.size() == q_size && l.k.size() == kv_size && l.v.size() == kv_size, where,
                 "layer {}: q, k, v hold {}, {}, {} values; the shape needs {}, {}, {}", l.layer, l.q.size(),
                 l.k.size(), l.v.size(), q_size, kv_size, kv_size);
  }
  for (const double budget : options.budgets) {
    KVSIFT_CHECK(budget > 0.0 && budget <= 1.0, where, "budget fraction {} is outside (0, 1]", budget);
  }
  const bool share = options.prefill > 0.0 && options.prefill < 1.0;  // false for NaN too
  const auto first_position = share ? std::int32_t(std::lround(options.prefill * capture.tokens)) : 0;
  KVSIFT_CHECK(share && first_position >= 1 && first_position < capture.tokens,
               where,
               "options.prefill (= {}) leaves no prefill or no decode position (first decode position {} of {} tokens)",
               options.prefill, first_position, capture.tokens);
  const std::int32_t decoded = capture.tokens - first_position;
  const std::int32_t n_eval = options.decode_positions;
  KVSIFT_CHECK(n_eval >= 1 && n_eval <= decoded, where,
               "options.decode_positions (= {}) is outside [1, decoded positions = {}]", n_eval, decoded);

  FidelityResult result;
  result.first_position = first_position;
  for (std::int32_t i = 0; i < n_eval; ++i) {  // P + round(i (decoded - 1) / (N - 1)), halves rounded up
    const std::int64_t step = n_eval == 1 ? 0 : (std::int64_t(i) * (decoded - 1) + (n_eval - 1) / 2) / (n_eval - 1);
    result.positions.push_back(n_eval == 1 ? capture.tokens - 1 : first_position + std::int32_t(step));
  }
  std::vector<std::int32_t> budget_tokens;
  for (const double budget : options.budgets) {
    budget_tokens.push_back(std::max<std::int32_t>(1, std::int32_t(std::lround(budget * (first_position + 1)))));
  }

  const std::int32_t qh = capture.q_heads, kvh = capture.kv_heads, d = capture.head_dim;
  const std::size_t state_size = std::size_t(qh) * d;
  std::vector<float> o(state_size), lse(qh), o_dense(state_size), lse_dense(qh);
  std::vector<std::int32_t> rank, order;
  std::vector<float> score;
  for (const auto& capture_layer : capture.layers) {
    const FloatLayer layer(capture, capture_layer);
    // Every (budget, selector), prepared on the prefill.
    std::vector<Run> runs;
    std::vector<SelectionBuffer> buffers;  // one per budget, reused by its selectors
    const std::int32_t prefill_length = first_position;
    for (std::size_t b = 0; b < budget_tokens.size(); ++b) {
      buffers.emplace_back(1, kvh, budget_tokens[b], true);
      for (const auto& entry : selectors) {
        Run& run = runs.emplace_back();
        run.budget_index = b;
        try {
          run.selector.emplace(entry.make(budget_tokens[b]));
        } catch (const Error& e) {
          run.refused = e.what();
          continue;
        }
        run.selector->prepare(layer.prefill(&prefill_length));
      }
    }
    auto next_eval = result.positions.begin();
    for (std::int32_t pos = first_position; pos < capture.tokens; ++pos) {
      const std::int32_t length = pos + 1;  // the query at pos attends [0, pos], its own token included
      const auto q = layer.query(pos);
      const auto kv = layer.kv(&length);
      for (Run& run : runs) {
        if (run.selector) run.selector->append(layer.token(pos));
      }
      const bool evaluated = next_eval != result.positions.end() && *next_eval == pos;
      std::optional<AttentionWeights> attention;
      if (evaluated) {
        ++next_eval;
        attention = attention_weights(q, kv);
        reference::dense_decode(q, kv, StateView<float>::packed(o_dense.data(), lse_dense.data(), 1, qh, d));
        rank_tokens(*attention, kvh, rank, score, order);
      }
      for (Run& run : runs) {
        if (!run.selector) continue;
        SelectionBuffer& buffer = buffers[run.budget_index];
        const SelectionView& selection = buffer.view();
        std::fill(buffer.log_weights().begin(), buffer.log_weights().end(), 0.0f);
        run.selector->select(q, selection);
        if (!evaluated) continue;
        check_selection_contents(selection, kv, where, "selection", /*refuse_duplicates=*/true);
        const auto mass = attention_mass_recall_per_head(*attention, selection);
        run.mass.insert(run.mass.end(), mass.begin(), mass.end());
        reference::sparse_decode(q, kv, selection, StateView<float>::packed(o.data(), lse.data(), 1, qh, d));
        const auto error = relative_l2_error_per_row(o, o_dense, std::size_t(d));
        run.error.insert(run.error.end(), error.begin(), error.end());
        const std::int32_t k = std::min(budget_tokens[run.budget_index], length);  // the oracle's top-K
        for (std::int32_t g = 0; g < kvh; ++g) {
          std::int32_t hits = 0;
          for (std::int32_t i = 0; i < selection.count(0, g); ++i) {
            hits += rank[std::size_t(g) * length + selection.row(0, g)[i]] < k ? 1 : 0;
          }
          run.id_recall += double(hits) / k;
          run.selected += selection.count(0, g);
        }
      }
    }
    for (std::size_t r = 0; r < runs.size(); ++r) {
      Run& run = runs[r];
      FidelityRow row;
      row.layer = capture_layer.layer;
      row.selector = selectors[r % selectors.size()].name;
      row.budget = options.budgets[run.budget_index];
      row.budget_tokens = budget_tokens[run.budget_index];
      row.refused = run.refused;
      if (run.selector) {
        const double samples = double(n_eval) * kvh;
        row.id_recall = run.id_recall / samples;
        row.mean_selected = run.selected / samples;
        row.mass_recall = mean(run.mass);
        row.mass_recall_p10 = quantile(run.mass, 0.1);
        row.mass_recall_p90 = quantile(run.mass, 0.9);
        row.output_error = mean(run.error);
        row.output_error_p90 = quantile(run.error, 0.9);
      }
      result.rows.push_back(std::move(row));
    }
  }
  return result;
}

std::string fidelity_markdown(std::span<const FidelityRow> rows) {
  std::string out =
      "| layer | selector | budget | K | mass recall | mass p10 | mass p90 | output error | error p90 | id recall | "
      "tokens selected |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows) {
    if (!r.refused.empty()) {
      fmt::format_to(std::back_inserter(out), "| {} | {} | {:g}% | {} | refused: {} | | | | | | |\n", r.layer,
                     r.selector, 100 * r.budget, r.budget_tokens, r.refused);
      continue;
    }
    fmt::format_to(std::back_inserter(out),
                   "| {} | {} | {:g}% | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.1f} |\n", r.layer, r.selector, 100 * r.budget, r.budget_tokens, r.mass_recall, r.mass_recall_p10,
                   r.mass_recall_p90, r.output_error, r.output_error_p90, r.id_recall, r.mean_selected);
  }
  return out;
}

std::string fidelity_markdown(const FidelityResult& result) {
  std::string out;
  const std::int32_t last = result.positions.empty() ? result.first_position : result.positions.back();
  fmt::format_to(std::back_inserter(out),
                 "Prefill: tokens [0, {0}); {1} positions evaluated, evenly spread over the decoded positions {0}..{2} "
                 "(each query attends its own token too). K = budget x {3}, the context at the first decode "
                 "position. Mass recall and output error over (position, query head), output error per head.\n\n",
                 result.first_position, result.positions.size(), last, result.first_position + 1);
  out += fidelity_markdown(std::span<const FidelityRow>(result.rows));
  return out;
}

}  // namespace kvsift
