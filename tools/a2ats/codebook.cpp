// kvsift_a2ats_codebook: builds A²ATS codebooks (selectors/a2ats/codebook.hpp) from tools/capture captures and
// writes the versioned codebook file.
//
//   kvsift_a2ats_codebook --captures A.kvscap[,B.kvscap...] --out FILE [--layers 3,15 | all] [--codewords N]
//                         [--offset 2048] [--window 64] [--plain] [--no-wrope] [--model-id TEXT]
//                         [--model-layers N] [--iterations 50] [--seed 0] [--threads N] [--compare-plain]
//
// Several captures are several texts of one model (positions restart with each); every one must hold the layers
// asked for (all: every layer the first capture holds). --plain calibrates without query awareness (L = I),
// --no-wrope on post-RoPE keys and queries at their own positions (the paper's ablations). --model-layers is the
// model's layer count the file records (default: the highest layer the first capture holds + 1, which is the
// model's when it captured every layer); --model-id defaults to the
// captures' model. Prints a markdown table, a row per layer: keys per kv head, codewords, the ridge each kv
// head's Cholesky took, the Lloyd steps and how far one more would move the centroids (relative to the RMS norm
// of the transformed keys), the attention-score error J' of the codebook on its own calibration data (relative,
// mean over kv heads; a2ats_score_error) and the build time; --compare-plain adds J' of plain k-means codebooks
// built from the same keys (a second k-means per layer).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/selectors/a2ats/codebook.hpp"
#include "../cli_list.hpp"

namespace {

constexpr const char* kTool = "kvsift_a2ats_codebook";

int usage() {
  std::fprintf(stderr,
               "usage: kvsift_a2ats_codebook --captures A.kvscap[,B.kvscap...] --out FILE [--layers L,L,... | all] "
               "[--codewords N] [--offset B] [--window W] [--plain] [--no-wrope] [--model-id TEXT] "
               "[--model-layers N] [--iterations N] [--seed N] [--threads N] [--compare-plain]\n");
  return 2;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// One layer's calibration inputs from every capture, texts one after another, in fp32.
struct LayerInputs {
  std::vector<float> queries, keys;  // [tokens, q_heads, d], [tokens, kv_heads, d]
  std::vector<std::int32_t> starts;
  std::int32_t tokens = 0;

  LayerInputs(const std::vector<kvsift::Capture>& captures, std::int32_t layer) {
    for (const auto& c : captures) {
      const auto it = std::find_if(c.layers.begin(), c.layers.end(), [&](const auto& l) { return l.layer == layer; });
      starts.push_back(tokens);
      tokens += c.tokens;
      for (const kvsift::half x : it->q_pre) queries.push_back(kvsift::to_float(x));
      for (const kvsift::half x : it->k_pre) keys.push_back(kvsift::to_float(x));
    }
  }
  kvsift::A2atsCalibrationInputs view(const kvsift::Capture& c) const {
    const std::int32_t d = c.head_dim;
    return {.queries = {queries.data(), 1, c.q_heads, tokens, d, std::int64_t(queries.size()), d,
                        std::int64_t(c.q_heads) * d},
            .keys = {keys.data(), 1, c.kv_heads, tokens, d, std::int64_t(keys.size()), d, std::int64_t(c.kv_heads) * d},
            .text_starts = starts};
  }
};

double mean(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / double(v.size()); }

}  // namespace

int main(int argc, char** argv) try {
  std::vector<std::string> capture_paths;
  std::string out, model_id;
  std::vector<std::int32_t> layers;  // empty: every layer the first capture holds (--layers all)
  kvsift::A2atsCodebookParams params;
  params.codewords = 4096;
  kvsift::A2atsCalibrationConfig config;
  std::int32_t model_layers = 0;  // 0: the highest layer the first capture holds + 1
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
  bool compare_plain = false;
  kvsift::bench::Arguments args(kTool, argc, argv);
  while (args.next()) {
    if (args.is("--captures")) {
      capture_paths = kvsift::bench::split_list(args.value());
    } else if (args.is("--out")) {
      out = args.value();
    } else if (args.is("--layers")) {
      layers = kvsift::bench::parse_layers(kTool, "--layers", args.value());
    } else if (args.is("--codewords")) {
      params.codewords = args.integer<std::int32_t>(1);
    } else if (args.is("--offset")) {
      params.offset = args.integer<std::int32_t>(0);
    } else if (args.is("--window")) {
      params.window = args.integer<std::int32_t>(0);
    } else if (args.is("--plain")) {
      params.query_aware = false;
    } else if (args.is("--no-wrope")) {
      params.windowed_rope = false;
    } else if (args.is("--model-id")) {
      model_id = args.value();
    } else if (args.is("--model-layers")) {
      model_layers = args.integer<std::int32_t>(1);
    } else if (args.is("--iterations")) {
      config.kmeans_iterations = args.integer<std::int32_t>(0);
    } else if (args.is("--seed")) {
      config.seed = args.integer<std::uint64_t>(0);
    } else if (args.is("--threads")) {
      threads = args.integer<int>(1);
    } else if (args.is("--compare-plain")) {
      compare_plain = true;
    } else {
      args.refuse();
    }
  }
  if (capture_paths.empty() || out.empty()) return usage();

  std::vector<kvsift::Capture> captures;
  for (const auto& path : capture_paths) captures.push_back(kvsift::read_capture(path));
  const kvsift::Capture& first = captures.front();
  if (layers.empty()) {
    for (const auto& l : first.layers) layers.push_back(l.layer);
  }
  std::sort(layers.begin(), layers.end());
  layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
  std::int32_t keys = 0;
  for (std::size_t i = 0; i < captures.size(); ++i) {
    const kvsift::Capture& c = captures[i];
    const auto& p = capture_paths[i];
    const kvsift::RopeScalingConfig &x = c.rope.scaling, &y = first.rope.scaling;
    const bool same_scaling = x.kind == y.kind && x.factor == y.factor &&
                              x.original_max_position_embeddings == y.original_max_position_embeddings &&
                              x.low_freq_factor == y.low_freq_factor && x.high_freq_factor == y.high_freq_factor &&
                              x.beta_fast == y.beta_fast && x.beta_slow == y.beta_slow && x.truncate == y.truncate &&
                              x.attention_factor == y.attention_factor && x.mscale == y.mscale &&
                              x.mscale_all_dim == y.mscale_all_dim;
    KVSIFT_CHECK(c.model == first.model && c.q_heads == first.q_heads && c.kv_heads == first.kv_heads &&
                     c.head_dim == first.head_dim && c.rope.theta == first.rope.theta &&
                     c.rope.resolved_rotary_dim(c.head_dim) == first.rope.resolved_rotary_dim(first.head_dim) &&
                     c.rope.layout == first.rope.layout && same_scaling,
                 "kvsift_a2ats_codebook", "{} is of another model or shape than {} (model, heads, head_dim, RoPE)", p,
                 capture_paths.front());
    for (const std::int32_t layer : layers) {
      KVSIFT_CHECK(std::any_of(c.layers.begin(), c.layers.end(), [&](const auto& l) { return l.layer == layer; }),
                   "kvsift_a2ats_codebook", "{} holds no layer {}", p, layer);
    }
    keys += c.tokens;
  }
  KVSIFT_CHECK(params.codewords <= keys, "kvsift_a2ats_codebook",
               "--codewords {} is more than the {} keys per kv head the captures hold: use --codewords {} or fewer "
               "(or calibrate on more text)",
               params.codewords, keys, keys);
  params.model_id = model_id.empty() ? first.model : model_id;
  std::int32_t captured = 0;
  for (const auto& l : first.layers) captured = std::max(captured, l.layer + 1);
  params.layers = model_layers > 0 ? model_layers : captured;
  params.calibrated_layers = layers;
  params.kv_heads = first.kv_heads;
  params.q_heads = first.q_heads;
  params.head_dim = first.head_dim;
  params.rope = first.rope;
  kvsift::A2atsCodebooks codebooks(params);
  kvsift::cpu::ThreadPool pool(threads);

  fmt::print("## A2ATS codebooks: {}\n\n", params.model_id);
  fmt::print("captures: {} ({} keys per kv head); {} kv heads, {} query heads, head_dim {}; codewords {}, b = {}, "
             "w = {}, query_aware {}, windowed_rope {}; {} Lloyd steps, seed {}, {} threads\n\n",
             fmt::join(capture_paths, ", "), keys, params.kv_heads, params.q_heads, params.head_dim,
             params.codewords, params.offset, params.window, params.query_aware, params.windowed_rope,
             config.kmeans_iterations, config.seed, threads);
  fmt::print("| layer | keys/head | codewords | ridge per kv head | Lloyd steps | max movement | J' | {}build s |\n",
             compare_plain ? "J' plain | " : "");
  fmt::print("|---|---|---|---|---|---|---|{}---|\n", compare_plain ? "---|" : "");
  double total = 0.0;
  for (const std::int32_t layer : layers) {
    const LayerInputs data(captures, layer);
    const auto inputs = data.view(first);
    const auto start = std::chrono::steady_clock::now();
    const kvsift::A2atsCalibrationReport report = kvsift::calibrate_a2ats_layer(codebooks, layer, inputs, config, &pool);
    const double build = seconds_since(start);
    total += build;
    const double error = mean(kvsift::a2ats_score_error(codebooks, layer, inputs, &pool));
    std::string plain;
    if (compare_plain) {
      kvsift::A2atsCodebookParams plain_params = params;
      plain_params.query_aware = false;
      plain_params.calibrated_layers = {layer};
      kvsift::A2atsCodebooks reference(plain_params);
      kvsift::calibrate_a2ats_layer(reference, layer, inputs, config, &pool);
      plain = fmt::format("{:.4f} | ", mean(kvsift::a2ats_score_error(reference, layer, inputs, &pool)));
    }
    const double movement = *std::max_element(report.movement.begin(), report.movement.end());
    fmt::print("| {} | {} | {} | {:g} | {} | {:.2e} | {:.4f} | {}{:.2f} |\n", layer, report.keys, params.codewords,
               fmt::join(report.ridge, ", "), report.kmeans_iterations, movement, error, plain, build);
    if (movement >= 1e-4) {  // the convergence rule: Lloyd until the centroids move less than 1e-4
      std::fprintf(stderr, "kvsift_a2ats_codebook: warning: layer %d has not converged (one more Lloyd step would "
                           "move a centroid by %.2e of the keys' RMS norm): raise --iterations\n", layer, movement);
    }
    std::fflush(stdout);
  }
  kvsift::save_a2ats_codebooks(out, codebooks);
  fmt::print("\nwrote {}: {} layers, {} bytes of codebooks; build {:.1f} s in all ({:.2f} s per layer)\n", out,
             layers.size(), codebooks.bytes(), total, total / double(layers.size()));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvsift_a2ats_codebook: %s\n", e.what());
  return 1;
}
