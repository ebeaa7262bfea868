// kvsift_fidelity: scores every selector (and the OracleTopK, StreamingLLM and Quest references) on real
// attention captures; see include/kvsift/eval/fidelity.hpp for what is measured.
//
//   kvsift_fidelity [--backend cpu|cuda|both] [--positions N] [--prefill F] [--budgets 0.01,0.02,0.05]
//                   [--plot-data FILE] [--csattention-variants] [--centroidkv] [--rerank C] [--only NAME,...]
//                   [--a2ats NAME=CODEBOOKS]... CAPTURE...
//
// Prints per capture a line on the decoded range and the budget, then one markdown table with a row per
// (layer, budget, selector). --backend picks where the selectors' decode steps run (eval/fidelity.hpp,
// eval/cuda_fidelity.hpp): cpu (the default), cuda (refused in a build without CUDA or on a machine without a
// GPU), or both, in lockstep: a table per backend, then a paragraph on how many of CUDA's selections differed
// from the CPU's and by how much mass. --plot-data writes, per (capture, layer), a gnuplot data block (blocks
// separated by two blank lines, each preceded by a "# panel NAME" line) of the first backend's rows: budget in
// percent, then mass recall mean, p10 and p90 per selector (NaN where it refused), for bench/fidelity_plot.gp.
// --csattention-variants adds CSAttention's variants (eval/fidelity.hpp csattention_variants). Each --a2ats adds
// A²ATS over a codebook file (kvsift_a2ats_codebook) labelled NAME (eval/fidelity.hpp a2ats_selectors; the first
// one also with the group-maximum rule); the file must match each capture's shapes and RoPE. --centroidkv adds
// CentroidKV at equal entries (eval/fidelity.hpp centroid_kv_selectors; the CPU backend only for now) and, after
// each table, the output and LSE error columns alone (fidelity_error_markdown). --rerank C adds the rerank stage
// after Quest (also with an adaptive budget, "Quest + rerank (p 0.9)": compare it by its tokens selected) and
// CSAttention, each proposing C times its budget (eval/fidelity.hpp rerank_selectors), and after the
// first --a2ats's group-maximum rule (a2ats_selectors). --only keeps the selectors of those names (e.g. the
// references beside CentroidKV at budgets where CTKVR refuses the prefill);
// a name no selector has is refused, listing theirs. Numbers are read whole (tools/cli_list.hpp): "abc", "12x" or
// an unknown option end the run with a message naming the option and the text.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvsift/eval/capture.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/eval/fidelity.hpp"
#if defined(KVSIFT_WITH_CUDA)
#include "kvsift/eval/cuda_fidelity.hpp"
#endif
#include "cli_list.hpp"

namespace {

constexpr const char* kTool = "kvsift_fidelity";

struct NamedCodebooks {
  std::string name;
  std::shared_ptr<const kvsift::A2atsCodebooks> codebooks;
};

/// The codebooks of each --a2ats NAME=PATH, refused unless they fit the capture's shapes and RoPE.
std::vector<NamedCodebooks> load_codebooks(const std::vector<std::pair<std::string, std::string>>& files,
                                           const kvsift::Capture& capture) {
  kvsift::A2atsCodebookExpectation expected;
  expected.q_heads = capture.q_heads;
  expected.kv_heads = capture.kv_heads;
  expected.head_dim = capture.head_dim;
  expected.rope = capture.rope;
  std::vector<NamedCodebooks> out;
  for (const auto& [name, path] : files) {
    out.push_back({name, std::make_shared<const kvsift::A2atsCodebooks>(kvsift::load_a2ats_codebooks(path, expected))});
  }
  return out;
}

/// The references, then the retrieval selectors (eval/fidelity.hpp), then the variants asked for.
template <class Context>
std::vector<kvsift::BasicSelectorEntry<Context>> all_selectors(bool csattention_variants,
                                                               const std::vector<NamedCodebooks>& a2ats,
                                                               bool centroid_kv, double prefill,
                                                               std::int32_t rerank_factor) {
  auto entries = kvsift::reference_selectors<Context>();
  for (auto& method : kvsift::method_selectors<Context>()) entries.push_back(std::move(method));
  if (rerank_factor > 0) {
    for (auto& e : kvsift::rerank_selectors<Context>(rerank_factor)) entries.push_back(std::move(e));
  }
  if constexpr (std::is_same_v<Context, kvsift::cpu::Context>) {
    if (centroid_kv) {
      for (auto& e : kvsift::centroid_kv_selectors<Context>(prefill)) entries.push_back(std::move(e));
    }
  }
  for (std::size_t i = 0; i < a2ats.size(); ++i) {
    for (auto& e : kvsift::a2ats_selectors<Context>(a2ats[i].name, a2ats[i].codebooks, i == 0, rerank_factor)) {
      entries.push_back(std::move(e));
    }
  }
  if (!csattention_variants) return entries;
  for (auto& variant : kvsift::csattention_variants<Context>()) entries.push_back(std::move(variant));
  return entries;
}

/// The entries named in `only` (all of them when it is empty); refuses a name no entry has, listing theirs.
template <class Context>
std::vector<kvsift::BasicSelectorEntry<Context>> keep_only(std::vector<kvsift::BasicSelectorEntry<Context>> entries,
                                                           const std::vector<std::string>& only) {
  if (!only.empty()) {
    std::vector<std::string> names;
    for (const auto& e : entries) names.push_back(e.name);
    kvsift::bench::check_names(kTool, "--only", only, names);
    std::erase_if(entries, [&](const auto& e) { return std::find(only.begin(), only.end(), e.name) == only.end(); });
  }
  return entries;
}

int usage() {
  std::fprintf(stderr,
               "usage: kvsift_fidelity [--backend cpu|cuda|both] [--positions N] [--prefill F] [--budgets F,F,...] "
               "[--plot-data FILE] [--csattention-variants] [--centroidkv] [--rerank C] [--only NAME,...] "
               "[--a2ats NAME=CODEBOOKS]... CAPTURE...\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) try {
  kvsift::FidelityOptions options;
  std::string backend = "cpu", plot_data;
  bool variants = false, centroid_kv = false;
  std::int32_t rerank_factor = 0;  // 0: no rerank entries
  std::vector<std::string> only;  // empty: every selector
  std::vector<std::string> captures;
  std::vector<std::pair<std::string, std::string>> a2ats;  // (name, codebook file)
  kvsift::bench::Arguments args(kTool, argc, argv);
  while (args.next()) {
    if (args.is("--backend")) {
      backend = args.value();
      kvsift::bench::check_names(kTool, "--backend", {backend}, {"cpu", "cuda", "both"});
    } else if (args.is("--positions")) {
      options.decode_positions = args.integer<std::int32_t>(1);
    } else if (args.is("--prefill")) {
      options.prefill = args.real();
    } else if (args.is("--budgets")) {
      options.budgets = args.reals();
    } else if (args.is("--plot-data")) {
      plot_data = args.value();
    } else if (args.is("--csattention-variants")) {
      variants = true;
    } else if (args.is("--centroidkv")) {
      centroid_kv = true;
    } else if (args.is("--rerank")) {
      rerank_factor = args.integer<std::int32_t>(1);
    } else if (args.is("--only")) {
      only = kvsift::bench::split_list(args.value());
    } else if (args.is("--a2ats")) {
      const std::string value = args.value();
      const std::size_t eq = value.find('=');
      KVSIFT_CHECK(eq != std::string::npos && eq != 0 && eq + 1 != value.size(), kTool,
                   "--a2ats must be NAME=CODEBOOKS (a label and a kvsift_a2ats_codebook file), got '{}'", value);
      a2ats.emplace_back(value.substr(0, eq), value.substr(eq + 1));
    } else if (args.arg().starts_with("--")) {
      args.refuse();
    } else {
      captures.push_back(args.arg());
    }
  }
  if (captures.empty()) return usage();
  if (centroid_kv && backend != "cpu") {
    std::fprintf(stderr, "kvsift_fidelity: --centroidkv runs on the CPU backend only for now\n");
    return 2;
  }
  if (backend != "cpu") {
#if defined(KVSIFT_WITH_CUDA)
    const bool available = kvsift::cuda::device_available();
    const char* why = "this machine has no CUDA device";
#else
    const bool available = false;
    const char* why = "this build has no CUDA backend (configure with -DKVSIFT_CUDA=ON where nvcc is found)";
#endif
    if (!available) {
      std::fprintf(stderr, "kvsift_fidelity: --backend %s: %s\n", backend.c_str(), why);
      return 2;
    }
  }

  std::string plot;  // the gnuplot blocks, one per (capture, layer)
  for (const auto& path : captures) {
    const kvsift::Capture capture = kvsift::read_capture(path);
    const std::vector<NamedCodebooks> codebooks = load_codebooks(a2ats, capture);
    const auto selectors = keep_only(
        all_selectors<kvsift::cpu::Context>(variants, codebooks, centroid_kv, options.prefill, rerank_factor), only);
    std::vector<std::unique_ptr<kvsift::FidelityBackend>> owned;
    if (backend != "cuda") owned.push_back(kvsift::fidelity_backend(selectors));
#if defined(KVSIFT_WITH_CUDA)
    if (backend != "cpu") {
      owned.push_back(kvsift::cuda::fidelity_backend(
          keep_only(all_selectors<kvsift::cuda::Context>(variants, codebooks, false, options.prefill, rerank_factor),
                    only)));
    }
#endif
    std::vector<kvsift::FidelityBackend*> backends;
    for (const auto& b : owned) backends.push_back(b.get());
    fmt::print("\n### {}: {}, {} tokens, layers", capture.text_id, capture.model, capture.tokens);
    for (const auto& layer : capture.layers) fmt::print(" {}", layer.layer);
    fmt::print("\n\n");
    const auto comparison = kvsift::evaluate_fidelity(capture, backends, options);
    for (const auto& r : comparison.results) {
      if (backends.size() > 1) fmt::print("#### Backend: {}\n\n", r.backend);
      fmt::print("{}", kvsift::fidelity_markdown(r));
      if (centroid_kv) {
        fmt::print("\nOutput and LSE error (|LSE - LSE_dense|, natural log) against dense attention:\n\n{}",
                   kvsift::fidelity_error_markdown(std::span<const kvsift::FidelityRow>(r.rows)));
      }
      if (backends.size() > 1) fmt::print("\n");
    }
    for (const auto& d : comparison.differences) fmt::print("{}", kvsift::fidelity_markdown(d));
    const auto& result = comparison.results.front();
    const std::string stem = std::filesystem::path(path).stem().string();
    for (const auto& layer : capture.layers) {
      fmt::format_to(std::back_inserter(plot), "{}# panel {}:layer_{}\nbudget_percent", plot.empty() ? "" : "\n\n",
                     stem, layer.layer);
      for (const auto& s : selectors) {
        // gnuplot splits the header at blanks: "Quest + rerank" becomes one word, "Quest_+_rerank".
        std::string word = s.name;
        std::replace(word.begin(), word.end(), ' ', '_');
        fmt::format_to(std::back_inserter(plot), " {0} {0}_p10 {0}_p90", word);
      }
      plot += "\n";
      for (const double budget : options.budgets) {
        fmt::format_to(std::back_inserter(plot), "{:g}", 100 * budget);
        for (const auto& s : selectors) {
          for (const auto& r : result.rows) {
            if (r.layer != layer.layer || r.budget != budget || r.selector != s.name) continue;
            if (r.refused.empty()) {
              fmt::format_to(std::back_inserter(plot), " {:.4f} {:.4f} {:.4f}", r.mass_recall, r.mass_recall_p10,
                             r.mass_recall_p90);
            } else {  // refused at this budget: gnuplot leaves a gap
              plot += " NaN NaN NaN";
            }
          }
        }
        plot += "\n";
      }
    }
  }
  if (!plot_data.empty()) {
    std::FILE* f = std::fopen(plot_data.c_str(), "w");
    KVSIFT_CHECK(f != nullptr, "kvsift_fidelity", "cannot write {}", plot_data);
    fmt::print(f, "{}", plot);
    std::fclose(f);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvsift_fidelity: %s\n", e.what());
  return 1;
}
