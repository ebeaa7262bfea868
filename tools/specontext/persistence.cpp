// kvsift_specontext_persistence: how much of a per-step selection persists between adjacent decode steps, the
// statistic SpeContext's elastic loading rests on (the paper, §5.3: over 80%), and the rows elastic loading moves.
//
//   kvsift_specontext_persistence --captures A.kvscap[,B.kvscap...] [--layers all | L,L,...] [--steps 256]
//                                 [--budgets 2048,2%] [--threads N]
//
// For each capture and layer, the decode steps at positions p = tokens - steps .. tokens - 1 (the query of position
// p over keys [0, p], its own included) select with OracleTopK (softmax per query head, max over the GQA group, top
// B per kv head; no window: SpeContext's default), the exact selection a perfect retrieval head would make. Between
// steps p - 1 and p, per kv head: persistence |S_p ∩ S_{p-1}| / |S_{p-1}|, rows moved |S_p \ S_{p-1}| (what
// ElasticKV copies per offloaded layer). A budget "N%" is N% of the capture's length. Prints a markdown table, a row
// per layer: persistence pooled over steps and kv heads, its lowest step (pooled over kv heads), and rows moved per
// step (summed over kv heads), per budget; the last row pools every layer.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "../cli_list.hpp"

namespace {

using kvsift::half;

constexpr const char* kTool = "kvsift_specontext_persistence";

int usage() {
  std::fprintf(stderr,
               "usage: kvsift_specontext_persistence --captures A.kvscap[,B.kvscap...] [--layers all | L,L,...] "
               "[--steps N] [--budgets 2048,2%%] [--threads N]\n");
  return 2;
}

/// Sums over steps and kv heads of one (layer, budget).
struct Tally {
  double kept = 0, previous = 0, moved = 0, lowest = 1;
  std::int64_t steps = 0;
  void add(const Tally& o) {
    kept += o.kept;
    previous += o.previous;
    moved += o.moved;
    lowest = std::min(lowest, o.lowest);
    steps += o.steps;
  }
  double persistence() const { return previous > 0 ? kept / previous : 1.0; }
  double moved_per_step() const { return steps > 0 ? moved / double(steps) : 0.0; }
};

/// One layer of one capture at one budget: OracleTopK at each step, compared with the step before.
Tally measure(const kvsift::Capture& cap, std::size_t layer, std::int32_t budget, std::int32_t steps,
              const kvsift::cpu::Context& ctx) {
  using Selector = kvsift::OracleTopK<half, kvsift::cpu::Context>;
  const kvsift::SelectorLimits limits{.max_slots = 1,
                                      .max_tokens = cap.tokens,
                                      .q_heads = cap.q_heads,
                                      .kv_heads = cap.kv_heads,
                                      .head_dim = cap.head_dim};
  Selector selector(limits, {.budget = budget});
  const kvsift::SelectShape shape{.batch = 1,
                                  .q_heads = cap.q_heads,
                                  .kv_heads = cap.kv_heads,
                                  .head_dim = cap.head_dim,
                                  .max_seq_len = cap.tokens};
  kvsift::cpu::Array<std::byte> workspace(selector.select_workspace_bytes(shape, ctx));
  const std::size_t row = std::size_t(budget);
  std::vector<std::int32_t> indices[2] = {std::vector<std::int32_t>(cap.kv_heads * row),
                                          std::vector<std::int32_t>(cap.kv_heads * row)};
  std::vector<std::int32_t> counts[2] = {std::vector<std::int32_t>(cap.kv_heads),
                                         std::vector<std::int32_t>(cap.kv_heads)};
  const std::int32_t slot = 0;
  std::int32_t prompt = cap.tokens;  // the oracle indexes nothing, but a slot holds a sequence before its steps
  selector.prepare({.cache = kvsift::KVCache<const half>(cap.kv(layer, &prompt)), .slots = &slot}, ctx);
  const auto queries = cap.queries(layer);
  Tally tally;
  const std::int32_t first = std::max(1, cap.tokens - steps) - 1;  // one step before the first compared
  for (std::int32_t p = first; p < cap.tokens; ++p) {
    const int cur = (p - first) % 2, prev = 1 - cur;
    std::int32_t length = p + 1;
    const kvsift::QueryView<const half> q{queries.row(0, 0, p), 1, cap.q_heads, cap.head_dim, queries.batch_stride,
                                          queries.head_stride};
    const kvsift::SelectionView out{indices[cur].data(), counts[cur].data(), nullptr, 1, cap.kv_heads, budget};
    selector.select({.q = q,
                     .cache = kvsift::KVCache<const half>(cap.kv(layer, &length)),
                     .slots = &slot,
                     .lengths = &length,
                     .max_seq_len = cap.tokens},
                    out, workspace.bytes(), ctx);
    if (p == first) continue;
    double step_kept = 0, step_previous = 0;
    for (std::int32_t h = 0; h < cap.kv_heads; ++h) {
      const auto* a = indices[prev].data() + h * row;
      const auto* b = indices[cur].data() + h * row;
      std::vector<std::int32_t> sa(a, a + counts[prev][h]), sb(b, b + counts[cur][h]), both;
      std::sort(sa.begin(), sa.end());
      std::sort(sb.begin(), sb.end());
      std::set_intersection(sa.begin(), sa.end(), sb.begin(), sb.end(), std::back_inserter(both));
      step_kept += double(both.size());
      step_previous += double(sa.size());
      tally.moved += double(sb.size() - both.size());
    }
    tally.kept += step_kept;
    tally.previous += step_previous;
    tally.lowest = std::min(tally.lowest, step_previous > 0 ? step_kept / step_previous : 1.0);
    ++tally.steps;
  }
  return tally;
}

/// A --budgets item: `value` tokens, or `value` percent of the capture's length.
struct BudgetArg {
  std::string text;
  double value = 0;
  bool percent = false;
};

/// "2048,2%" -> {2048 tokens, 2 percent}: token counts are positive integers, percentages positive numbers.
std::vector<BudgetArg> parse_budgets(const std::string& list) {
  std::vector<BudgetArg> out;
  kvsift::bench::for_each_list_item("--budgets", list, [&](const std::string& label, const std::string& item) {
    BudgetArg b{.text = item, .percent = item.ends_with('%')};
    if (b.percent) {
      b.value = kvsift::bench::parse_real(kTool, label, std::string_view(item).substr(0, item.size() - 1));
      KVSIFT_CHECK(b.value > 0, kTool, "{} must be a positive percentage, got '{}'", label, item);
    } else {
      const auto tokens = kvsift::parse_number<std::int32_t>(item);
      KVSIFT_CHECK(tokens && *tokens >= 1, kTool, "{} must be a token count (a positive integer) or a percentage "
                   "(such as 2%), got '{}'", label, item);
      b.value = *tokens;
    }
    out.push_back(b);
  });
  return out;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string captures;
  std::vector<std::int32_t> layer_ids;  // empty: every layer the first capture holds (--layers all)
  std::vector<BudgetArg> budget_args = parse_budgets("2048,2%");
  std::int32_t steps = 256;
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  kvsift::bench::Arguments args(kTool, argc, argv);
  while (args.next()) {
    if (args.is("--captures")) {
      captures = args.value();
    } else if (args.is("--layers")) {
      layer_ids = kvsift::bench::parse_layers(kTool, "--layers", args.value());
    } else if (args.is("--steps")) {
      steps = args.integer<std::int32_t>(1);
    } else if (args.is("--budgets")) {
      budget_args = parse_budgets(args.value());
    } else if (args.is("--threads")) {
      threads = args.integer<int>(1);
    } else {
      args.refuse();
    }
  }
  if (captures.empty()) return usage();
  kvsift::cpu::ThreadPool pool(threads);
  const kvsift::cpu::Context ctx{&pool};

  std::vector<std::vector<Tally>> tallies;  // [layer][budget], pooled over captures
  std::vector<std::int32_t> budgets;
  std::int32_t tokens = 0;
  for (const std::string& path : kvsift::bench::split_list(captures)) {
    const kvsift::Capture cap = kvsift::read_capture(path);
    if (budgets.empty()) {
      tokens = cap.tokens;
      for (const BudgetArg& b : budget_args) {
        budgets.push_back(b.percent ? std::int32_t(std::lround(b.value / 100.0 * cap.tokens)) : std::int32_t(b.value));
        KVSIFT_CHECK(budgets.back() > 0, kTool, "budget {} rounds to 0 of the capture's {} tokens", b.text, cap.tokens);
      }
      if (layer_ids.empty()) {
        for (std::size_t i = 0; i < cap.layers.size(); ++i) layer_ids.push_back(cap.layers[i].layer);
      }
      tallies.assign(layer_ids.size(), std::vector<Tally>(budgets.size()));
    }
    KVSIFT_CHECK(cap.tokens == tokens, kTool, "{} holds {} tokens, the first capture {}", path, cap.tokens, tokens);
    for (std::size_t li = 0; li < layer_ids.size(); ++li) {
      std::size_t index = cap.layers.size();
      for (std::size_t i = 0; i < cap.layers.size(); ++i) {
        if (cap.layers[i].layer == layer_ids[li]) index = i;
      }
      KVSIFT_CHECK(index < cap.layers.size(), kTool, "{} has no layer {}", path, layer_ids[li]);
      for (std::size_t bi = 0; bi < budgets.size(); ++bi) {
        tallies[li][bi].add(measure(cap, index, budgets[bi], std::min(steps, cap.tokens - 1), ctx));
      }
      std::fprintf(stderr, "%s: layer %d done\n", path.c_str(), layer_ids[li]);
    }
  }

  fmt::print("## SpeContext: persistence of the selection between adjacent decode steps\n\n");
  fmt::print("captures: {}; {} tokens; the last {} decode steps; OracleTopK (softmax, group max), no window\n\n",
             captures, tokens, steps);
  std::string header = "| layer |", rule = "|---|";
  for (std::size_t bi = 0; bi < budgets.size(); ++bi) {
    header += fmt::format(" B = {} ({}): persist | lowest step | rows moved / step |", budgets[bi],
                          budget_args[bi].text);
    rule += "---|---|---|";
  }
  fmt::print("{}\n{}\n", header, rule);
  std::vector<Tally> all(budgets.size());
  for (std::size_t li = 0; li < layer_ids.size(); ++li) {
    std::string line = fmt::format("| {} |", layer_ids[li]);
    for (std::size_t bi = 0; bi < budgets.size(); ++bi) {
      const Tally& t = tallies[li][bi];
      line += fmt::format(" {:.3f} | {:.3f} | {:.1f} |", t.persistence(), t.lowest, t.moved_per_step());
      all[bi].add(t);
    }
    fmt::print("{}\n", line);
  }
  std::string line = "| all |";
  for (const Tally& t : all)
    line += fmt::format(" {:.3f} | {:.3f} | {:.1f} |", t.persistence(), t.lowest, t.moved_per_step());
  fmt::print("{}\n", line);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvsift_specontext_persistence: %s\n", e.what());
  return 1;
}
