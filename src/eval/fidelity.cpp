#include "kvsift/eval/fidelity.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <numeric>
#include <optional>

#include "kvsift/eval/metrics.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/selection_buffer.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/eval/detail/fidelity_backend.hpp"

namespace kvsift {
namespace {

/// One capture layer in fp32, [token][head][channel], for the exact references (the backends hold the fp16
/// cache themselves).
struct Layer {
  std::int32_t tokens, q_heads, kv_heads, head_dim;
  std::vector<float> q32, k32, v32;

  Layer(const Capture& c, const CaptureLayer& layer)
      : tokens(c.tokens), q_heads(c.q_heads), kv_heads(c.kv_heads), head_dim(c.head_dim), q32(widen(layer.q)),
        k32(widen(layer.k)), v32(widen(layer.v)) {}
  static std::vector<float> widen(const std::vector<half>& src) {
    std::vector<float> dst(src.size());
    std::transform(src.begin(), src.end(), dst.begin(), [](half x) { return to_float(x); });
    return dst;
  }
  /// The cache holding tokens [0, *length).
  ContiguousKVView<const float> reference_kv(const std::int32_t* length) const {
    const std::int64_t token_stride = std::int64_t(kv_heads) * head_dim;
    return {k32.data(), v32.data(), length, 1, kv_heads, tokens, head_dim, tokens * token_stride, head_dim,
            token_stride};
  }
  QueryView<const float> query(std::int32_t pos) const {
    return QueryView<const float>::packed(q32.data() + std::size_t(pos) * q_heads * head_dim, 1, q_heads, head_dim);
  }
};

/// Host memory is the CPU context's: plain copies, nothing to wait for.
struct HostCopy {
  static void copy(void* dst, const void* src, std::size_t bytes, const cpu::Context&) {
    if (bytes > 0) std::memcpy(dst, src, bytes);
  }
  static void wait(const cpu::Context&) {}
};

}  // namespace

template std::vector<BasicSelectorEntry<cpu::Context>> reference_selectors<cpu::Context>();
template std::vector<BasicSelectorEntry<cpu::Context>> method_selectors<cpu::Context>();
template std::vector<BasicSelectorEntry<cpu::Context>> rerank_selectors<cpu::Context>(std::int32_t);
template std::vector<BasicSelectorEntry<cpu::Context>> csattention_variants<cpu::Context>();
template std::vector<BasicSelectorEntry<cpu::Context>> centroid_kv_selectors<cpu::Context>(double);
template std::vector<BasicSelectorEntry<cpu::Context>> a2ats_selectors<cpu::Context>(
    const std::string&, std::shared_ptr<const A2atsCodebooks>, bool, std::int32_t);

std::unique_ptr<FidelityBackend> fidelity_backend(std::vector<SelectorEntry> selectors, const cpu::Context& ctx) {
  return std::make_unique<detail::SelectorBackend<cpu::Context, HostCopy>>("cpu", std::move(selectors), ctx);
}

double BackendDifference::max_mass() const {
  double most = 0.0;
  for (const auto& m : mismatches) most = std::max(most, m.mass);
  return most;
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

/// One selector at one budget on one layer on one backend: its decode step (absent when refused) and its samples.
struct Run {
  std::size_t budget_index = 0;
  std::unique_ptr<FidelityStep> step;
  std::string refused;
  std::vector<double> mass, error, lse_error;  ///< per (evaluated position, query head)
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

/// Tokens in `a` and not in `b`, both ascending.
std::vector<std::int32_t> minus(const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b) {
  std::vector<std::int32_t> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

std::string row_label(std::int32_t layer, std::string_view selector, double budget) {
  return fmt::format("layer {}, {}, {:g}%", layer, selector, 100 * budget);
}

}  // namespace

FidelityComparison evaluate_fidelity(const Capture& capture, std::span<FidelityBackend* const> backends,
                                     const FidelityOptions& options) {
  constexpr const char* where = "evaluate_fidelity";
  KVSIFT_CHECK(!backends.empty(), where, "no backend given");
  for (std::size_t i = 0; i < backends.size(); ++i) {
    KVSIFT_CHECK(backends[i] != nullptr, where, "backends[{}] is null", i);
  }
  const FidelityBackend& first = *backends[0];
  const std::size_t entries = first.selectors();
  for (std::size_t i = 1; i < backends.size(); ++i) {
    const FidelityBackend& other = *backends[i];
    KVSIFT_CHECK(other.selectors() == entries, where, "backend {} holds {} selectors, backend {} holds {}",
                 other.name(), other.selectors(), first.name(), entries);
    for (std::size_t e = 0; e < entries; ++e) {
      KVSIFT_CHECK(other.selector(e) == first.selector(e), where, "selector {} is {} on backend {} but {} on backend {}",
                   e, other.selector(e), other.name(), first.selector(e), first.name());
    }
  }
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

  std::vector<std::int32_t> positions;
  for (std::int32_t i = 0; i < n_eval; ++i) {  // P + round(i (decoded - 1) / (N - 1)), halves rounded up
    const std::int64_t step = n_eval == 1 ? 0 : (std::int64_t(i) * (decoded - 1) + (n_eval - 1) / 2) / (n_eval - 1);
    positions.push_back(n_eval == 1 ? capture.tokens - 1 : first_position + std::int32_t(step));
  }
  std::vector<std::int32_t> budget_tokens;
  for (const double budget : options.budgets) {
    budget_tokens.push_back(std::max<std::int32_t>(1, std::int32_t(std::lround(budget * (first_position + 1)))));
  }

  FidelityComparison out;
  for (std::size_t k = 0; k < backends.size(); ++k) {
    out.results.push_back({.backend = std::string(backends[k]->name()), .first_position = first_position,
                           .positions = positions, .rows = {}});
    if (k > 0) {
      BackendDifference& difference = out.differences.emplace_back();
      difference.backend = backends[k]->name();
      difference.first = first.name();
    }
  }

  const std::int32_t qh = capture.q_heads, kvh = capture.kv_heads, d = capture.head_dim;
  const std::size_t state_size = std::size_t(qh) * d;
  std::vector<float> o(state_size), o_dense(state_size), lse(qh), lse_dense(qh);
  std::vector<std::int32_t> rank, order;
  std::vector<float> score;
  // Per kv head, the first backend's attended set of the run being compared (ascending), and this backend's.
  std::vector<std::vector<std::int32_t>> first_attended(static_cast<std::size_t>(kvh)),
      attended_set(static_cast<std::size_t>(kvh));
  std::int32_t length = first_position;  // the reference cache's length, read through the view below
  for (const auto& capture_layer : capture.layers) {
    const Layer layer(capture, capture_layer);
    for (FidelityBackend* backend : backends) backend->load(capture, capture_layer);
    // Per backend, every (budget, selector) in its own decode step, prepared on the prefill.
    std::vector<std::vector<Run>> runs(backends.size());
    for (std::size_t k = 0; k < backends.size(); ++k) {
      for (std::size_t b = 0; b < budget_tokens.size(); ++b) {
        for (std::size_t e = 0; e < entries; ++e) {
          Run& run = runs[k].emplace_back();
          run.budget_index = b;
          try {
            run.step = backends[k]->step(e, budget_tokens[b]);
          } catch (const Error& error) {
            run.refused = error.what();
            continue;
          }
          run.step->prepare(first_position);
        }
      }
    }
    auto next_eval = positions.begin();
    for (std::int32_t pos = first_position; pos < capture.tokens; ++pos) {
      length = pos + 1;  // the query at pos attends [0, pos], its own token included
      const auto q32 = layer.query(pos);
      const auto kv = layer.reference_kv(&length);
      const bool evaluated = next_eval != positions.end() && *next_eval == pos;
      std::optional<AttentionWeights> attention;
      if (evaluated) {
        ++next_eval;
        attention = attention_weights(q32, kv);
        reference::dense_decode(q32, kv, StateView<float>::packed(o_dense.data(), lse_dense.data(), 1, qh, d));
        rank_tokens(*attention, kvh, rank, score, order);
      }
      for (std::size_t r = 0; r < runs[0].size(); ++r) {
        for (std::size_t k = 0; k < backends.size(); ++k) {
          Run& run = runs[k][r];
          if (!run.step) continue;
          run.step->run(pos);
          if (!evaluated) continue;
          // The attended set: the window's tokens, then the selection.
          const SelectionView selection = run.step->read(o, lse);
          const AttentionWindow window = run.step->window();
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
          for (std::int32_t h = 0; h < qh; ++h) {
            run.lse_error.push_back(std::abs(double(lse[std::size_t(h)]) - double(lse_dense[std::size_t(h)])));
          }
          const std::int32_t top = std::min(budget_tokens[run.budget_index], length);  // the oracle's top-K
          for (std::int32_t g = 0; g < kvh; ++g) {
            std::int32_t hits = 0;
            for (std::int32_t i = 0; i < all.count(0, g); ++i) hits += rank[std::size_t(g) * length + all.row(0, g)[i]] < top ? 1 : 0;
            run.id_recall += double(hits) / top;
            run.selected += all.count(0, g);
          }
          // Against the first backend's attended set of the same run, token by token.
          if (k > 0 && !runs[0][r].step) continue;
          for (std::int32_t g = 0; g < kvh; ++g) {
            auto& set = k == 0 ? first_attended[std::size_t(g)] : attended_set[std::size_t(g)];
            set.assign(all.row(0, g), all.row(0, g) + all.count(0, g));
            std::sort(set.begin(), set.end());
          }
          if (k == 0) continue;
          BackendDifference& difference = out.differences[k - 1];
          difference.selections += kvh;
          for (std::int32_t g = 0; g < kvh; ++g) {
            SelectionMismatch m{.layer = capture_layer.layer, .selector = std::string(first.selector(r % entries)),
                                .budget = options.budgets[run.budget_index], .position = pos, .kv_head = g,
                                .only_first = minus(first_attended[std::size_t(g)], attended_set[std::size_t(g)]),
                                .only_this = minus(attended_set[std::size_t(g)], first_attended[std::size_t(g)])};
            if (m.only_first.empty() && m.only_this.empty()) continue;
            for (std::int32_t h = g * attention->group; h < (g + 1) * attention->group; ++h) {
              const double* w = attention->row(0, h);
              double moved = 0.0;
              for (const std::int32_t t : m.only_this) moved += w[t];
              for (const std::int32_t t : m.only_first) moved -= w[t];
              m.mass = std::max(m.mass, std::abs(moved) / attention->denominators[std::size_t(h)]);
            }
            difference.mismatches.push_back(std::move(m));
          }
        }
      }
    }
    for (std::size_t k = 0; k < backends.size(); ++k) {
      for (std::size_t r = 0; r < runs[k].size(); ++r) {
        Run& run = runs[k][r];
        FidelityRow row;
        row.layer = capture_layer.layer;
        row.selector = std::string(first.selector(r % entries));
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
          row.lse_error = mean(run.lse_error);
          row.lse_error_p90 = quantile(run.lse_error, 0.9);
        }
        if (k > 0 && run.refused.empty() != runs[0][r].refused.empty()) {
          const bool first_refused = !runs[0][r].refused.empty();
          out.differences[k - 1].refusals.push_back(
              fmt::format("{}: refused on {} only ({})", row_label(row.layer, row.selector, row.budget),
                          first_refused ? first.name() : backends[k]->name(),
                          first_refused ? runs[0][r].refused : run.refused));
        }
        out.results[k].rows.push_back(std::move(row));
      }
    }
  }
  return out;
}

FidelityResult evaluate_fidelity(const Capture& capture, std::span<const SelectorEntry> selectors,
                                 const FidelityOptions& options) {
  const auto cpu = fidelity_backend(std::vector<SelectorEntry>(selectors.begin(), selectors.end()));
  FidelityBackend* const backends[] = {cpu.get()};
  return std::move(evaluate_fidelity(capture, backends, options).results.front());
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

std::string fidelity_error_markdown(std::span<const FidelityRow> rows) {
  std::string out =
      "| layer | selector | budget | K | output error | error p90 | LSE error | LSE error p90 |\n"
      "|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows) {
    if (!r.refused.empty()) {
      fmt::format_to(std::back_inserter(out), "| {} | {} | {:g}% | {} | refused: {} | | | |\n", r.layer, r.selector,
                     100 * r.budget, r.budget_tokens, r.refused);
      continue;
    }
    fmt::format_to(std::back_inserter(out), "| {} | {} | {:g}% | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} |\n", r.layer,
                   r.selector, 100 * r.budget, r.budget_tokens, r.output_error, r.output_error_p90, r.lse_error,
                   r.lse_error_p90);
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

std::string fidelity_markdown(const BackendDifference& difference) {
  std::string out = fmt::format("{} against {}: ", difference.backend, difference.first);
  const auto& mismatches = difference.mismatches;
  if (mismatches.empty()) {
    fmt::format_to(std::back_inserter(out), "all {} selections (layer, budget, selector, evaluated position, kv head) "
                   "attended the same tokens", difference.selections);
  } else {
    std::size_t swapped = 0;
    for (const auto& m : mismatches) swapped += m.only_first.size() + m.only_this.size();
    fmt::format_to(std::back_inserter(out),
                   "{} of {} selections (layer, budget, selector, evaluated position, kv head) attended other tokens "
                   "({} tokens in one set only), moving a (position, query head)'s mass recall by at most {:.3g}; per "
                   "row, differing selections (most mass moved):",
                   mismatches.size(), difference.selections, swapped, difference.max_mass());
    struct Group {
      std::string row;
      std::size_t count = 0;
      double mass = 0.0;
    };
    std::vector<Group> groups;  // rows in the order of their first mismatch
    for (const auto& m : mismatches) {
      std::string row = row_label(m.layer, m.selector, m.budget);
      auto group = std::find_if(groups.begin(), groups.end(), [&](const Group& x) { return x.row == row; });
      if (group == groups.end()) group = groups.insert(groups.end(), {std::move(row)});
      ++group->count;
      group->mass = std::max(group->mass, m.mass);
    }
    for (std::size_t i = 0; i < groups.size(); ++i) {
      fmt::format_to(std::back_inserter(out), "{} {}: {} ({:.3g})", i == 0 ? "" : ";", groups[i].row,
                     groups[i].count, groups[i].mass);
    }
  }
  if (!difference.refusals.empty()) {
    out += "; refused by one backend only:";
    for (std::size_t i = 0; i < difference.refusals.size(); ++i) {
      fmt::format_to(std::back_inserter(out), "{} {}", i == 0 ? "" : ";", difference.refusals[i]);
    }
  }
  out += ".\n";
  return out;
}

}  // namespace kvsift
