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
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/oracle_topk.hpp"
#include "kvsift/selectors/quest.hpp"
#include "kvsift/selectors/streaming_llm.hpp"
#include "kvsift/step/decode_step.hpp"

namespace kvsift {
namespace {

/// One capture layer: its fp16 q, k, v in the capture's [token][head][channel] layout, the cache an engine
/// would hold, and fp32 copies for the references.
struct Layer {
  std::int32_t tokens, q_heads, kv_heads, head_dim;
  std::vector<half> q, k, v;
  std::vector<float> q32, k32, v32;

  Layer(const Capture& c, const CaptureLayer& layer)
      : tokens(c.tokens), q_heads(c.q_heads), kv_heads(c.kv_heads), head_dim(c.head_dim), q(layer.q), k(layer.k),
        v(layer.v), q32(widen(q)), k32(widen(k)), v32(widen(v)) {}
  static std::vector<float> widen(const std::vector<half>& src) {
    std::vector<float> dst(src.size());
    std::transform(src.begin(), src.end(), dst.begin(), [](half x) { return to_float(x); });
    return dst;
  }
  std::int64_t kv_token_stride() const { return std::int64_t(kv_heads) * head_dim; }
  /// The cache holding tokens [0, *length).
  template <class T>
  ContiguousKVView<T> kv(T* keys, T* values, const std::int32_t* length) const {
    return {keys, values, length, 1, kv_heads, tokens, head_dim, tokens * kv_token_stride(), head_dim,
            kv_token_stride()};
  }
  KVCache<half> cache(const std::int32_t* length) { return kv(k.data(), v.data(), length); }
  ContiguousKVView<const float> reference_kv(const std::int32_t* length) const {
    return kv<const float>(k32.data(), v32.data(), length);
  }
  template <class T>
  static QueryView<const T> query(const std::vector<T>& q, std::int32_t pos, std::int32_t heads, std::int32_t d) {
    return QueryView<const T>::packed(q.data() + std::size_t(pos) * heads * d, 1, heads, d);
  }
};

}  // namespace

std::vector<SelectorEntry> reference_selectors() {
  return {
      {"OracleTopK",
       [](std::int32_t k, const SelectorLimits& limits) {
         return SelectorSetup{AnySelector<half, cpu::Context>(OracleTopK<half, cpu::Context>(limits, {.budget = k}))};
       }},
      {"StreamingLLM",
       [](std::int32_t k, const SelectorLimits& limits) {
         const std::int32_t sink = std::min(4, k);
         return SelectorSetup{AnySelector<half, cpu::Context>(StreamingLLM<half, cpu::Context>(limits)), {sink, k - sink}};
       }},
      {"Quest",
       [](std::int32_t k, const SelectorLimits& limits) {
         return SelectorSetup{
             AnySelector<half, cpu::Context>(Quest<half, cpu::Context>(limits, {.budget = k, .page_size = 16}))};
       }},
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

using Step = DecodeStep<AnySelector<half, cpu::Context>>;

/// One selector at one budget on one layer: its decode step (absent when refused) and its samples.
struct Run {
  std::size_t budget_index = 0;
  std::optional<Step> step;
  std::optional<cpu::Array<std::byte>> workspace;
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
  const SelectorLimits limits{.max_slots = 1, .max_tokens = capture.tokens, .q_heads = qh, .kv_heads = kvh,
                              .head_dim = d};
  const cpu::Context ctx{};
  const std::int32_t slot = 0;
  std::int32_t length = first_position;  // the cache's length, read through the views below
  for (const auto& capture_layer : capture.layers) {
    Layer layer(capture, capture_layer);
    length = first_position;
    // Every (budget, selector) in its own decode step, prepared on the prefill.
    std::vector<Run> runs;
    for (std::size_t b = 0; b < budget_tokens.size(); ++b) {
      for (const auto& entry : selectors) {
        Run& run = runs.emplace_back();
        run.budget_index = b;
        try {
          SelectorSetup setup = entry.make(budget_tokens[b], limits);
          run.step.emplace(std::move(setup.selector),
                           DecodeStepConfig{.attention = {.window = setup.window}, .max_batch = 1, .q_heads = qh,
                                            .kv_heads = kvh, .head_dim = d, .max_seq_len = capture.tokens},
                           ctx);
        } catch (const Error& e) {
          run.refused = e.what();
          continue;
        }
        run.workspace.emplace(run.step->workspace_bytes());
        run.step->prepare({.cache = layer.cache(&length), .slots = &slot}, ctx);
      }
    }
    auto next_eval = result.positions.begin();
    for (std::int32_t pos = first_position; pos < capture.tokens; ++pos) {
      length = pos + 1;  // the query at pos attends [0, pos], its own token included
      const auto q = Layer::query(layer.q, pos, qh, d);
      const auto q32 = Layer::query(layer.q32, pos, qh, d);
      const auto kv = layer.reference_kv(&length);
      const bool evaluated = next_eval != result.positions.end() && *next_eval == pos;
      std::optional<AttentionWeights> attention;
      if (evaluated) {
        ++next_eval;
        attention = attention_weights(q32, kv);
        reference::dense_decode(q32, kv, StateView<float>::packed(o_dense.data(), lse_dense.data(), 1, qh, d));
        rank_tokens(*attention, kvh, rank, score, order);
      }
      for (Run& run : runs) {
        if (!run.step) continue;
        run.step->run(StepInputs<half>{.q = q, .cache = layer.cache(&length), .slots = &slot},
                      StateView<float>::packed(o.data(), lse.data(), 1, qh, d), run.workspace->bytes(), ctx);
        if (!evaluated) continue;
        // The attended set: the window's tokens, then the selection.
        const SelectionView selection = run.step->selection(run.workspace->bytes(), 1);
        const AttentionWindow& window = run.step->config().attention.window;
        check_selection_contents(selection, kv, where, "selection", /*refuse_duplicates=*/true, window);
        SelectionBuffer attended(1, kvh, window.size(length) + std::max(1, selection.capacity), false);
        for (std::int32_t g = 0; g < kvh; ++g) {
          std::int32_t* row = attended.view().row(0, g);
          std::int32_t n = 0;
          for (std::int32_t t = 0; t < window.sink_end(length); ++t) row[n++] = t;
          for (std::int32_t t = window.recent_begin(length); t < length; ++t) row[n++] = t;
          for (std::int32_t i = 0; i < selection.count(0, g); ++i) row[n++] = selection.row(0, g)[i];
          attended.view().counts[g] = n;
        }
        const SelectionView& all = attended.view();
        const auto mass = attention_mass_recall_per_head(*attention, all);
        run.mass.insert(run.mass.end(), mass.begin(), mass.end());
        const auto error = relative_l2_error_per_row(o, o_dense, std::size_t(d));
        run.error.insert(run.error.end(), error.begin(), error.end());
        const std::int32_t k = std::min(budget_tokens[run.budget_index], length);  // the oracle's top-K
        for (std::int32_t g = 0; g < kvh; ++g) {
          std::int32_t hits = 0;
          for (std::int32_t i = 0; i < all.count(0, g); ++i) hits += rank[std::size_t(g) * length + all.row(0, g)[i]] < k ? 1 : 0;
          run.id_recall += double(hits) / k;
          run.selected += all.count(0, g);
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
      if (run.step) {
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
