// kvsift_fidelity: scores every selector (and the OracleTopK, StreamingLLM and Quest references) on real
// attention captures; see include/kvsift/selectors/fidelity.hpp for what is measured.
//
//   kvsift_fidelity [--positions N] [--budgets 0.01,0.02,0.05] [--plot-data FILE] CAPTURE...
//
// Prints one markdown table per capture. --plot-data writes mass recall per budget (rows) and selector
// (columns), averaged over the captures, for bench/fidelity_plot.gp.
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "kvsift/core/capture.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/selectors/fidelity.hpp"

namespace {

std::vector<double> parse_budgets(const std::string& list) {
  std::vector<double> out;
  for (std::size_t start = 0; start <= list.size();) {
    const std::size_t end = std::min(list.find(',', start), list.size());
    out.push_back(std::stod(list.substr(start, end - start)));
    start = end + 1;
  }
  return out;
}

int usage() {
  std::fprintf(stderr, "usage: kvsift_fidelity [--positions N] [--budgets F,F,...] [--plot-data FILE] CAPTURE...\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  kvsift::FidelityOptions options;
  std::string plot_data;
  std::vector<std::string> captures;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--positions" && has_value) {
      options.decode_positions = std::atoi(argv[++i]);
    } else if (arg == "--budgets" && has_value) {
      options.budgets = parse_budgets(argv[++i]);
    } else if (arg == "--plot-data" && has_value) {
      plot_data = argv[++i];
    } else if (arg.starts_with("--")) {
      return usage();
    } else {
      captures.push_back(arg);
    }
  }
  if (captures.empty()) return usage();

  try {
    const auto selectors = kvsift::reference_selectors();
    std::map<std::pair<double, std::string>, std::vector<double>> mass;  // (budget, selector) -> per capture
    for (const auto& path : captures) {
      const kvsift::Capture capture = kvsift::read_capture(path);
      fmt::print("\n### {}: {}, {} tokens, layers", capture.text_id, capture.model, capture.tokens);
      for (const auto& layer : capture.layers) fmt::print(" {}", layer.layer);
      fmt::print("; the last {} positions decoded\n\n", options.decode_positions);
      const auto rows = kvsift::evaluate_fidelity(capture, selectors, options);
      fmt::print("{}", kvsift::fidelity_markdown(rows));
      for (const auto& r : rows) {
        if (r.refused.empty()) mass[{r.budget, r.selector}].push_back(r.mass_recall);
      }
    }
    if (!plot_data.empty()) {
      std::FILE* f = std::fopen(plot_data.c_str(), "w");
      KVSIFT_CHECK(f != nullptr, "kvsift_fidelity", "cannot write {}", plot_data);
      fmt::print(f, "budget_percent");
      for (const auto& s : selectors) fmt::print(f, " {}", s.name);
      fmt::print(f, "\n");
      for (const double budget : options.budgets) {
        fmt::print(f, "{:g}", 100 * budget);
        for (const auto& s : selectors) {
          const auto it = mass.find({budget, s.name});
          if (it == mass.end()) {  // refused at this budget: gnuplot leaves a gap
            fmt::print(f, " NaN");
            continue;
          }
          double mean = 0.0;
          for (double m : it->second) mean += m / double(it->second.size());
          fmt::print(f, " {:.4f}", mean);
        }
        fmt::print(f, "\n");
      }
      std::fclose(f);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvsift_fidelity: %s\n", e.what());
    return 1;
  }
  return 0;
}
