// kvsift demo: how much of exact attention a sparse selection keeps, on synthetic long-context workloads
// shaped like real attention (see include/kvsift/core/synthetic_workload.hpp), and what the reference
// attention costs dense vs sparse on this machine. Each selector joins this table as it lands.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "kvsift/attention/metrics.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/core/capture.hpp"
#include "kvsift/core/selection_buffer.hpp"
#include "kvsift/selectors/fidelity.hpp"
#include "kvsift/core/synthetic_workload.hpp"
#include "kvsift/selectors/oracle_topk.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

double needle_recall(const kvsift::SyntheticWorkload& w, const kvsift::SelectionView& sel) {
  std::int32_t found = 0, total = 0;
  for (std::int32_t g = 0; g < w.config.kv_heads; ++g) {
    const std::set<std::int32_t> chosen(sel.row(0, g), sel.row(0, g) + sel.count(0, g));
    for (std::int32_t i = 0; i < w.config.needles; ++i, ++total) {
      found += chosen.count(w.needle_positions[g * w.config.needles + i]) ? 1 : 0;
    }
  }
  return double(found) / total;
}

/// The real-data table: the fidelity harness (OracleTopK, StreamingLLM, Quest) on the committed capture.
/// Its 512 tokens make 1% of the context 5 tokens, less than one Quest page: budgets here are 5/10/20%.
void real_data_table(const std::string& path) {
  const kvsift::Capture c = kvsift::read_capture(path);
  const kvsift::FidelityOptions options{.budgets = {0.05, 0.10, 0.20}, .decode_positions = 32};
  fmt::print("\nReal attention: {} ({} tokens of {}), layers", c.model, c.tokens, c.text_id);
  for (const auto& l : c.layers) fmt::print(" {}", l.layer);
  fmt::print("; q_heads {}, kv_heads {}, head_dim {}; means over the last {} decode positions, heads and layers\n\n",
             c.q_heads, c.kv_heads, c.head_dim, options.decode_positions);
  fmt::print("{}", kvsift::fidelity_markdown(kvsift::evaluate_fidelity(c, kvsift::reference_selectors(), options)));
}

}  // namespace

int main(int argc, char** argv) {
  // `kvsift_demo --quick` runs only the smallest context, for smoke tests.
  const bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  const std::vector<std::int32_t> contexts = quick ? std::vector<std::int32_t>{8192} : std::vector<std::int32_t>{8192, 32768, 131072};
  const std::vector<double> budgets = {0.01, 0.02, 0.05};

  fmt::print("kvsift demo: synthetic long-context decode, q_heads 8, kv_heads 2, head_dim 128, RoPE theta 5e5\n");
  fmt::print("mass recall = exact softmax mass of the selected tokens; error = ||O_sparse - O_dense|| / ||O_dense||\n");
  fmt::print("times: scalar fp64 reference attention on this CPU (one decode step, all heads)\n\n");
  fmt::print("{:>8} {:>7} {:>6} {:<11} {:>11} {:>10} {:>8} {:>10} {:>10}\n", "context", "budget", "K", "selector",
             "mass recall", "error", "needles", "dense ms", "sparse ms");
  for (std::int32_t tokens : contexts) {
    const auto w = kvsift::make_synthetic_workload({.tokens = tokens, .seed = 2026});
    const auto& c = w.config;
    std::vector<float> o_dense(std::size_t(c.q_heads) * c.head_dim), lse_dense(c.q_heads);
    auto start = Clock::now();
    kvsift::reference::dense_decode(w.query(), w.kv(),
                                    kvsift::StateView<float>::packed(o_dense.data(), lse_dense.data(), 1, c.q_heads, c.head_dim));
    const double dense_ms = ms_since(start);
    for (double budget : budgets) {
      const auto k = static_cast<std::int32_t>(budget * tokens);
      kvsift::OracleTopK oracle({.budget = k, .sink = c.sink_tokens, .recent = 32});
      oracle.prepare({{}, w.kv()});
      const kvsift::SelectionBuffer buffer(1, c.kv_heads, k, false);
      const kvsift::SelectionView& sel = buffer.view();
      oracle.select(w.query(), sel);
      std::vector<float> o(o_dense.size()), lse(lse_dense.size());
      start = Clock::now();
      kvsift::reference::sparse_decode(w.query(), w.kv(), sel,
                                       kvsift::StateView<float>::packed(o.data(), lse.data(), 1, c.q_heads, c.head_dim));
      const double sparse_ms = ms_since(start);
      fmt::print("{:>8} {:>6.0f}% {:>6} {:<11} {:>11.4f} {:>10.2e} {:>7.0f}% {:>10.1f} {:>10.2f}\n", tokens,
                 budget * 100, k, oracle.name(), kvsift::attention_mass_recall(w.query(), w.kv(), sel),
                 kvsift::relative_l2_error(o, o_dense), 100 * needle_recall(w, sel), dense_ms, sparse_ms);
    }
  }
  real_data_table(KVSIFT_DEMO_CAPTURE);
  return 0;
}
