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
#include "kvsift/core/synthetic_workload.hpp"
#include "kvsift/selectors/oracle_topk.hpp"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

struct SelectionBuffers {
  std::vector<std::int32_t> indices, counts;
  kvsift::SelectionView view;
  SelectionBuffers(std::int32_t kv_heads, std::int32_t capacity)
      : indices(std::size_t(kv_heads) * capacity), counts(kv_heads) {
    view = {indices.data(), counts.data(), nullptr, 1, kv_heads, capacity};
  }
};

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

/// Layer i of a capture with fp32 keys/values [kv_heads, tokens, head_dim] for the reference and the oracle.
struct FloatLayer {
  std::vector<float> k, v;
  FloatLayer(const kvsift::Capture& c, std::size_t i) : k(std::size_t(c.kv_heads) * c.tokens * c.head_dim), v(k.size()) {
    const auto& layer = c.layers[i];
    for (std::int32_t t = 0; t < c.tokens; ++t) {
      for (std::int32_t g = 0; g < c.kv_heads; ++g) {
        for (std::int32_t j = 0; j < c.head_dim; ++j) {
          const std::size_t src = (std::size_t(t) * c.kv_heads + g) * c.head_dim + j;
          const std::size_t dst = (std::size_t(g) * c.tokens + t) * c.head_dim + j;
          k[dst] = kvsift::to_float(layer.k[src]);
          v[dst] = kvsift::to_float(layer.v[src]);
        }
      }
    }
  }
};

/// The real-data table: each of the last `positions` tokens decodes against all tokens before it.
void real_data_table(const std::string& path) {
  const kvsift::Capture c = kvsift::read_capture(path);
  constexpr int kPositions = 16;
  fmt::print("\nReal attention: {} ({} tokens of {}), layers", c.model, c.tokens, c.text_id);
  for (const auto& l : c.layers) fmt::print(" {}", l.layer);
  fmt::print("; q_heads {}, kv_heads {}, head_dim {}; mean over the last {} decode positions and the layers\n\n",
             c.q_heads, c.kv_heads, c.head_dim, kPositions);
  fmt::print("{:>7} {:<11} {:>11} {:>10}\n", "budget", "selector", "mass recall", "error");
  for (double budget : {0.01, 0.02, 0.05}) {
    double recall = 0.0, error = 0.0;
    int runs = 0;
    for (std::size_t i = 0; i < c.layers.size(); ++i) {
      const FloatLayer layer(c, i);
      for (std::int32_t pos = c.tokens - kPositions; pos < c.tokens; ++pos) {
        const std::int32_t length = pos + 1;  // the query at pos attends to tokens 0..pos
        const auto kv = kvsift::ContiguousKVView<const float>::packed(layer.k.data(), layer.v.data(), 1, c.kv_heads,
                                                                      c.tokens, c.head_dim, &length);
        std::vector<float> q(std::size_t(c.q_heads) * c.head_dim);
        for (std::size_t j = 0; j < q.size(); ++j) q[j] = kvsift::to_float(c.layers[i].q[std::size_t(pos) * q.size() + j]);
        const auto qv = kvsift::QueryView<const float>::packed(q.data(), 1, c.q_heads, c.head_dim);
        const auto k = std::max<std::int32_t>(1, static_cast<std::int32_t>(budget * length));
        kvsift::OracleTopK oracle({.budget = k});
        oracle.prepare({{}, kv});
        SelectionBuffers sel(c.kv_heads, k);
        oracle.select(qv, sel.view);
        std::vector<float> o_dense(q.size()), lse_dense(c.q_heads), o(q.size()), lse(c.q_heads);
        kvsift::reference::dense_decode(qv, kv, kvsift::StateView<float>::packed(o_dense.data(), lse_dense.data(), 1, c.q_heads, c.head_dim));
        kvsift::reference::sparse_decode(qv, kv, sel.view, kvsift::StateView<float>::packed(o.data(), lse.data(), 1, c.q_heads, c.head_dim));
        recall += kvsift::attention_mass_recall(qv, kv, sel.view);
        error += kvsift::relative_l2_error(o, o_dense);
        ++runs;
      }
    }
    fmt::print("{:>6.0f}% {:<11} {:>11.4f} {:>10.2e}\n", budget * 100, "OracleTopK", recall / runs, error / runs);
  }
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
      SelectionBuffers sel(c.kv_heads, k);
      oracle.select(w.query(), sel.view);
      std::vector<float> o(o_dense.size()), lse(lse_dense.size());
      start = Clock::now();
      kvsift::reference::sparse_decode(w.query(), w.kv(), sel.view,
                                       kvsift::StateView<float>::packed(o.data(), lse.data(), 1, c.q_heads, c.head_dim));
      const double sparse_ms = ms_since(start);
      fmt::print("{:>8} {:>6.0f}% {:>6} {:<11} {:>11.4f} {:>10.2e} {:>7.0f}% {:>10.1f} {:>10.2f}\n", tokens,
                 budget * 100, k, oracle.name(), kvsift::attention_mass_recall(w.query(), w.kv(), sel.view),
                 kvsift::relative_l2_error(o, o_dense), 100 * needle_recall(w, sel.view), dense_ms, sparse_ms);
    }
  }
  real_data_table(KVSIFT_DEMO_CAPTURE);
  return 0;
}
