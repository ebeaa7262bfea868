// kvsift_specontext_layers: does one selection serve every layer? SpeContext selects once per decode step, from
// a retrieval head, and every layer attends that selection. This measures the assumption on captures of all
// layers: the "proxy head" of source layer s is OracleTopK run on layer s's own q/k (softmax per query head, the
// maximum over each GQA group, the top K per kv head), and its selection is scored in every target layer t by
// t's attention-mass recall (eval/metrics.hpp attention_mass_recall_per_head: the exact fp64 softmax mass of t's
// query heads that the selected tokens carry, as the fidelity harness scores), divided by the recall of t's own
// OracleTopK at the same K. Source 0 is also the layer-0 head: layer 0's q/k are the model's layer-0
// Q/K projections of the normalised token embeddings, which exist before any layer runs.
//
//   kvsift_specontext_layers [--positions N] [--prefill F] [--budgets F,F,...] [--tokens N,N,...]
//                            [--window SINK,RECENT] [--csv FILE] CAPTURE...
//
// Positions and budgets follow the fidelity harness (eval/fidelity.hpp): tokens [0, P) are the prefill, P =
// round(prefill * tokens); N positions spread evenly over [P, tokens - 1]; a budget fraction F means
// K = max(1, round(F * (P + 1))) tokens per kv head; --tokens adds budgets given in tokens. No attention window
// by default (the harness's OracleTopK has none); --window adds one beside the K selected tokens, as SpeContext's
// option (4 + 64): every layer attends it, both selections leave it out, and the recall counts it. Per capture, each (source, target, budget) recall is the mean over
// (evaluated position, query head); the tables pool the captures by averaging those means, and the ratio of a
// (source, target) is the pooled proxy recall over the pooled own-oracle recall. Every capture must hold the same
// layers and shapes. Prints markdown; --csv writes the source x target ratio matrix of the first budget.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/selection_buffer.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/eval/metrics.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "../cli_list.hpp"

namespace {

using kvsift::half;

constexpr const char* kTool = "kvsift_specontext_layers";

struct Options {
  std::int32_t positions = 64;
  double prefill = 0.5;
  std::vector<double> fractions{0.02, 0.05};
  std::vector<std::int32_t> tokens{256, 512};
  kvsift::AttentionWindow window{};
  std::string csv;
};

/// A budget column: its label and K.
struct Budget {
  std::string label;
  std::int32_t tokens = 0;
};

/// Mean mass recall per (budget, source, target) of one capture: [budget][source * layers + target].
using Recalls = std::vector<std::vector<double>>;

/// One capture's recalls. The oracle's selections are made per (position, source, budget) and scored in every
/// target; the exact attention of each target is computed once per position.
Recalls measure(const kvsift::Capture& capture, const std::vector<std::int32_t>& positions,
                const std::vector<Budget>& budgets, const kvsift::AttentionWindow& window) {
  using Oracle = kvsift::OracleTopK<half, kvsift::cpu::Context>;
  const kvsift::cpu::Context ctx{};  // single-threaded: the machine is shared
  const auto layers = static_cast<std::int32_t>(capture.layers.size());
  const std::int32_t qh = capture.q_heads, kvh = capture.kv_heads, d = capture.head_dim;
  const kvsift::SelectorLimits limits{.max_slots = 1, .max_tokens = capture.tokens, .q_heads = qh, .kv_heads = kvh,
                                      .head_dim = d};
  const kvsift::SelectShape shape{.batch = 1, .q_heads = qh, .kv_heads = kvh, .head_dim = d,
                                  .max_seq_len = capture.tokens};
  std::vector<Oracle> oracles;
  std::vector<kvsift::cpu::Array<std::byte>> workspaces;
  std::vector<kvsift::SelectionBuffer> selections, attended;  // the oracle's, and with the window's tokens
  for (const Budget& b : budgets) {
    oracles.emplace_back(limits, kvsift::OracleTopKConfig{.budget = b.tokens});
    workspaces.emplace_back(oracles.back().select_workspace_bytes(shape, ctx));
    selections.emplace_back(1, kvh, b.tokens, false);
    attended.emplace_back(1, kvh, window.size(capture.tokens) + b.tokens, false);
  }
  Recalls sums(budgets.size(), std::vector<double>(std::size_t(layers) * layers, 0.0));
  const std::int32_t slot = 0;
  std::int32_t length = capture.tokens;  // the oracles index nothing, but a slot holds a sequence before its steps
  for (auto& oracle : oracles) oracle.prepare({.cache = capture.kv(0, &length), .slots = &slot}, ctx);
  std::vector<kvsift::AttentionWeights> attention(static_cast<std::size_t>(layers));
  for (const std::int32_t pos : positions) {
    length = pos + 1;  // the query at pos attends [0, pos], its own token included
    const auto query = [&](std::int32_t l) {
      return kvsift::QueryView<const half>::packed(capture.layers[std::size_t(l)].q.data() + std::size_t(pos) * qh * d,
                                                   1, qh, d);
    };
    for (std::int32_t t = 0; t < layers; ++t) attention[std::size_t(t)] = kvsift::attention_weights(query(t), capture.kv(std::size_t(t), &length));
    for (std::int32_t s = 0; s < layers; ++s) {
      const kvsift::SelectInputs<half> in{.q = query(s), .cache = capture.kv(std::size_t(s), &length), .slots = &slot,
                                          .lengths = &length, .attention = {.window = window},
                                          .layer = capture.layers[std::size_t(s)].layer,
                                          .max_seq_len = capture.tokens};
      for (std::size_t b = 0; b < budgets.size(); ++b) {
        // Poisoned: a count the oracle failed to write is refused below, an index by the recall's range check.
        const kvsift::SelectionView& out = selections[b].view();
        std::fill_n(out.indices, std::size_t(kvh) * out.capacity, -1);
        std::fill_n(out.counts, kvh, -1);
        oracles[b].select(in, out, workspaces[b].bytes(), ctx);
        const kvsift::SelectionView& all = attended[b].view();
        for (std::int32_t g = 0; g < kvh; ++g) {  // the window's tokens, then the selection (as the harness)
          KVSIFT_CHECK(out.count(0, g) >= 0 && out.count(0, g) <= out.capacity, "kvsift_specontext_layers",
                       "layer {}, position {}, kv head {}: OracleTopK wrote count {}", s, pos, g, out.count(0, g));
          std::int32_t* row = all.row(0, g);
          std::int32_t n = 0;
          for (std::int32_t i = 0; i < window.size(length); ++i) row[n++] = window.token(i, length);
          for (std::int32_t i = 0; i < out.count(0, g); ++i) row[n++] = out.row(0, g)[i];
          all.counts[g] = n;
        }
        for (std::int32_t t = 0; t < layers; ++t) {
          double sum = 0.0;
          for (const double r : kvsift::attention_mass_recall_per_head(attention[std::size_t(t)], all)) sum += r;
          sums[b][std::size_t(s) * layers + t] += sum / qh;
        }
      }
    }
  }
  for (auto& budget : sums) {
    for (double& x : budget) x /= double(positions.size());
  }
  return sums;
}

int usage() {
  std::fprintf(stderr,
               "usage: kvsift_specontext_layers [--positions N] [--prefill F] [--budgets F,F,...] [--tokens N,N,...] "
               "[--window SINK,RECENT] [--csv FILE] CAPTURE...\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) try {
  Options options;
  std::vector<std::string> files;
  kvsift::bench::Arguments args(kTool, argc, argv);
  while (args.next()) {
    if (args.is("--positions")) {
      options.positions = args.integer<std::int32_t>(1);
    } else if (args.is("--prefill")) {
      options.prefill = args.real();
    } else if (args.is("--budgets")) {
      options.fractions = args.reals();
    } else if (args.is("--tokens")) {
      options.tokens = args.integers<std::int32_t>(1);
    } else if (args.is("--window")) {
      const std::string value = args.value();
      const auto w = kvsift::bench::parse_integers<std::int32_t>(kTool, "--window", value, 0);
      KVSIFT_CHECK(w.size() == 2, kTool, "--window must be SINK,RECENT (two token counts), got '{}'", value);
      options.window = {w[0], w[1]};
    } else if (args.is("--csv")) {
      options.csv = args.value();
    } else if (args.arg().starts_with("--")) {
      args.refuse();
    } else {
      files.push_back(args.arg());
    }
  }
  if (files.empty()) return usage();

  std::vector<Recalls> per_capture;
  std::vector<std::int32_t> layer_ids, positions;
  std::vector<Budget> budgets;
  std::string shape;
  for (const std::string& file : files) {
    const kvsift::Capture capture = kvsift::read_capture(file);
    std::vector<std::int32_t> ids;
    for (const auto& l : capture.layers) ids.push_back(l.layer);
    const std::string this_shape = fmt::format("{} tokens, {} q heads, {} kv heads, head_dim {}", capture.tokens,
                                               capture.q_heads, capture.kv_heads, capture.head_dim);
    if (per_capture.empty()) {
      layer_ids = ids;
      shape = this_shape;
      // The harness's protocol (eval/fidelity.hpp): P = round(prefill * tokens), N positions evenly spread over
      // [P, tokens - 1] (P + round(i (decoded - 1) / (N - 1))), K = max(1, round(F (P + 1))). A copy of the few
      // lines private to src/eval/fidelity.cpp, kept until the harness exports them: change both together.
      const bool share = options.prefill > 0.0 && options.prefill < 1.0;
      const auto first = share ? std::int32_t(std::lround(options.prefill * capture.tokens)) : 0;
      KVSIFT_CHECK(share && first >= 1 && first < capture.tokens, kTool,
                   "--prefill {} leaves no prefill or no decode position of {} tokens", options.prefill,
                   capture.tokens);
      const std::int32_t decoded = capture.tokens - first, n = options.positions;
      KVSIFT_CHECK(n >= 1 && n <= decoded, kTool, "--positions {} is outside [1, {}]", n, decoded);
      for (std::int32_t i = 0; i < n; ++i) {
        const std::int64_t step = n == 1 ? 0 : (std::int64_t(i) * (decoded - 1) + (n - 1) / 2) / (n - 1);
        positions.push_back(n == 1 ? capture.tokens - 1 : first + std::int32_t(step));
      }
      for (const double f : options.fractions) {
        KVSIFT_CHECK(f > 0.0 && f <= 1.0, kTool, "budget fraction {} is outside (0, 1]", f);
        budgets.push_back({fmt::format("{:g}%", 100 * f),
                           std::max<std::int32_t>(1, std::int32_t(std::lround(f * (first + 1))))});
      }
      for (const std::int32_t k : options.tokens) {
        KVSIFT_CHECK(k >= 1 && k <= first + 1, kTool, "budget of {} tokens is outside [1, P + 1 = {}]", k, first + 1);
        budgets.push_back({fmt::format("{} tok", k), k});
      }
    }
    KVSIFT_CHECK(ids == layer_ids && this_shape == shape, kTool,
                 "{} holds layers {} ({}), the first capture layers {} ({})", file, fmt::join(ids, ","), this_shape,
                 fmt::join(layer_ids, ","), shape);
    std::fprintf(stderr, "%s: %s, %zu layers\n", file.c_str(), this_shape.c_str(), ids.size());
    per_capture.push_back(measure(capture, positions, budgets, options.window));
  }

  const std::size_t layers = layer_ids.size(), captures = per_capture.size();
  // pooled[b][s * layers + t]: the mean over captures; ratio = pooled proxy / pooled own oracle (the diagonal).
  Recalls pooled(budgets.size(), std::vector<double>(layers * layers, 0.0)), ratio = pooled;
  for (std::size_t b = 0; b < budgets.size(); ++b) {
    for (const Recalls& r : per_capture) {
      for (std::size_t i = 0; i < layers * layers; ++i) pooled[b][i] += r[b][i] / double(captures);
    }
    for (std::size_t s = 0; s < layers; ++s) {
      for (std::size_t t = 0; t < layers; ++t) ratio[b][s * layers + t] = pooled[b][s * layers + t] / pooled[b][t * layers + t];
    }
  }
  // Per (budget, source): the mean and minimum ratio over targets, the worst target, and the minimum over
  // (capture, target) of the per-capture ratio.
  struct Summary {
    double mean = 0.0, min = 0.0, capture_min = 0.0;
    std::size_t worst = 0;
  };
  const auto summarize = [&](std::size_t b, std::size_t s) {
    Summary out{.min = INFINITY, .capture_min = INFINITY};
    for (std::size_t t = 0; t < layers; ++t) {
      const double r = ratio[b][s * layers + t];
      out.mean += r / double(layers);
      if (r < out.min) {
        out.min = r;
        out.worst = t;
      }
      for (const Recalls& c : per_capture) {
        out.capture_min = std::min(out.capture_min, c[b][s * layers + t] / c[b][t * layers + t]);
      }
    }
    return out;
  };

  std::string md;
  auto out = std::back_inserter(md);
  fmt::format_to(out, "Captures: {} ({}; layers {}). Prefill [0, {}), {} positions evaluated in {}..{}; window: "
                      "sink {}, recent {}.\n\n",
                 captures, shape, fmt::join(layer_ids, ","), positions.front(), positions.size(), positions.front(),
                 positions.back(), options.window.sink, options.window.recent);
  fmt::format_to(out, "Own OracleTopK mass recall per layer (mean over captures of the mean over positions and "
                      "query heads):\n\n| layer |");
  for (const Budget& b : budgets) fmt::format_to(out, " {} (K {}) |", b.label, b.tokens);
  md += "\n|---|";
  for (std::size_t b = 0; b < budgets.size(); ++b) md += "---|";
  md += "\n";
  for (std::size_t t = 0; t < layers; ++t) {
    fmt::format_to(out, "| {} |", layer_ids[t]);
    for (std::size_t b = 0; b < budgets.size(); ++b) fmt::format_to(out, " {:.3f} |", pooled[b][t * layers + t]);
    md += "\n";
  }
  md += "\nProxy from each source layer: mass recall in each target layer / the target's own oracle's, over the "
        "targets: mean, min (the worst target), and the min over (capture, target).\n\n| source |";
  for (const Budget& b : budgets) fmt::format_to(out, " {0} mean | {0} min (layer) | {0} capture min |", b.label);
  md += "\n|---|";
  for (std::size_t b = 0; b < budgets.size(); ++b) md += "---|---|---|";
  md += "\n";
  for (std::size_t s = 0; s < layers; ++s) {
    fmt::format_to(out, "| {} |", layer_ids[s]);
    for (std::size_t b = 0; b < budgets.size(); ++b) {
      const Summary x = summarize(b, s);
      fmt::format_to(out, " {:.3f} | {:.3f} ({}) | {:.3f} |", x.mean, x.min, layer_ids[x.worst], x.capture_min);
    }
    md += "\n";
  }
  md += "\nBest source per budget, by the mean and by the min over targets; targets below 0.9 with it:\n\n";
  for (std::size_t b = 0; b < budgets.size(); ++b) {
    std::size_t by_mean = 0, by_min = 0;
    for (std::size_t s = 1; s < layers; ++s) {
      if (summarize(b, s).mean > summarize(b, by_mean).mean) by_mean = s;
      if (summarize(b, s).min > summarize(b, by_min).min) by_min = s;
    }
    for (const std::size_t best : {by_mean, by_min}) {
      std::vector<std::string> failing;
      for (std::size_t t = 0; t < layers; ++t) {
        if (ratio[b][best * layers + t] < 0.9) {
          failing.push_back(fmt::format("{} ({:.3f})", layer_ids[t], ratio[b][best * layers + t]));
        }
      }
      fmt::format_to(out, "- {} (K {}), best by {}: source {} (mean {:.3f}, min {:.3f}); below 0.9: {}\n",
                     budgets[b].label, budgets[b].tokens, best == by_mean ? "mean" : "min", layer_ids[best],
                     summarize(b, best).mean, summarize(b, best).min,
                     failing.empty() ? std::string("none") : fmt::format("{}", fmt::join(failing, ", ")));
      if (by_mean == by_min) break;
    }
  }
  std::fwrite(md.data(), 1, md.size(), stdout);

  if (!options.csv.empty()) {
    std::ofstream csv(options.csv);
    KVSIFT_CHECK(bool(csv), kTool, "cannot write --csv {}", options.csv);
    csv << "source\\target";
    for (const std::int32_t t : layer_ids) csv << ',' << t;
    csv << '\n';
    for (std::size_t s = 0; s < layers; ++s) {
      csv << layer_ids[s];
      for (std::size_t t = 0; t < layers; ++t) csv << fmt::format(",{:.4f}", ratio[0][s * layers + t]);
      csv << '\n';
    }
  }
  return 0;
} catch (const kvsift::Error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
