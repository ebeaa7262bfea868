#include "kvsift/selectors/a2ats/codebook.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <istream>
#include <ostream>
#include <span>
#include <type_traits>

#include "kvsift/core/detail/rope_checks.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/index_file.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/selectors/a2ats/vq.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/kmeans.hpp"
#include "kvsift/cpu/primitives.hpp"

namespace kvsift {
namespace {

inline constexpr IndexFileFormat kA2atsCodebookFile{
    .name = "A2ATS codebook", .magic = {'K', 'V', 'A', '2', 'A', 'T', 'C', 'B'}, .version = kA2atsCodebookFileVersion};

/// The longest model id a file holds: a bound checked before a read allocates for it.
constexpr std::size_t kMaxModelIdBytes = 4096;
/// A Cholesky pivot at or below this fraction of the largest diagonal entry counts as a failure: L^-1 would then
/// amplify the fp32 rounding of C^z by more than 1e6 in C = C^z L^-1, leaving C noise in that direction.
constexpr double kPivotFloor = 1e-12;

/// Bytes from the read position to the end of `in` (0 if the stream cannot tell); the position is kept.
std::size_t bytes_left(std::istream& in) {
  const std::streampos here = in.tellg();
  in.seekg(0, std::ios::end);
  const std::streampos end = in.tellg();
  in.seekg(here);
  return here >= 0 && end >= here ? std::size_t(end - here) : 0;
}

/// What no A2atsCodebooks accepts in `p`, in words ("" when it is fine): the constructor and a file's load
/// refuse with it.
std::string params_problem(const A2atsCodebookParams& p) {
  if (p.model_id.size() > kMaxModelIdBytes) {
    return fmt::format("model_id holds {} bytes, more than the {} a file holds", p.model_id.size(), kMaxModelIdBytes);
  }
  if (p.layers <= 0) return fmt::format("layers (= {}) must be positive", p.layers);
  if (p.kv_heads <= 0) return fmt::format("kv_heads (= {}) must be positive", p.kv_heads);
  if (p.q_heads <= 0 || p.q_heads % p.kv_heads != 0) {
    return fmt::format("q_heads (= {}) must be a positive multiple of kv_heads (= {})", p.q_heads, p.kv_heads);
  }
  if (!is_supported(kVqHeadDims, p.head_dim)) {
    return fmt::format("head_dim (= {}) must be one of {}", p.head_dim, supported_text(kVqHeadDims));
  }
  if (p.codewords < 1 || p.codewords > kVqMaxCodewords) {
    return fmt::format("codewords (= {}) is outside [1, {}] (uint16 codes)", p.codewords, kVqMaxCodewords);
  }
  if (p.offset < 0) return fmt::format("offset (= {}) must be >= 0", p.offset);
  if (p.window < 0) return fmt::format("window (= {}) must be >= 0", p.window);
  for (std::size_t i = 0; i < p.calibrated_layers.size(); ++i) {
    const std::int32_t l = p.calibrated_layers[i];
    if (l < 0 || l >= p.layers || (i > 0 && l <= p.calibrated_layers[i - 1])) {
      return fmt::format("calibrated_layers ({}) must be ascending and distinct, each in [0, layers = {})",
                         fmt::join(p.calibrated_layers, ", "), p.layers);
    }
  }
  try {
    validate(p.rope, p.head_dim, "rope");
    detail::check_rope_scaling(p.rope, "rope");
  } catch (const Error& e) {
    // The rule without the thrower's "kvsift::rope: ": the caller names itself.
    const std::string what = e.what(), prefix = "kvsift::rope: ";
    return what.starts_with(prefix) ? what.substr(prefix.size()) : what;
  }
  return {};
}

/// Refuses a layer outside [0, layers) or one the set does not hold.
void check_layer(const A2atsCodebookParams& p, std::int32_t layer, const char* where) {
  KVSIFT_CHECK(p.layers > 0, where, "the codebooks are empty (default-constructed)");
  KVSIFT_CHECK(layer >= 0 && layer < p.layers, where, "layer (= {}) is outside [0, layers = {})", layer, p.layers);
  const auto& held = p.calibrated_layers;
  KVSIFT_CHECK(held.empty() || std::binary_search(held.begin(), held.end(), layer), where,
               "layer {} has no codebooks in this set (it holds layers {})", layer, fmt::join(held, ", "));
}

std::size_t held_layer_count(const A2atsCodebookParams& p) {
  return p.calibrated_layers.empty() ? std::size_t(p.layers) : p.calibrated_layers.size();
}
/// The held model layers, ascending.
std::vector<std::int32_t> held_layers(const A2atsCodebookParams& p) {
  if (!p.calibrated_layers.empty()) return p.calibrated_layers;
  std::vector<std::int32_t> all(std::size_t(p.layers));
  for (std::int32_t l = 0; l < p.layers; ++l) all[std::size_t(l)] = l;
  return all;
}
std::size_t transform_floats(const A2atsCodebookParams& p) {
  return checked_mul(std::size_t(p.kv_heads), std::size_t(p.head_dim) * std::size_t(p.head_dim), "A2atsCodebooks L");
}
std::size_t codebook_floats(const A2atsCodebookParams& p) {
  return checked_mul(std::size_t(p.kv_heads), std::size_t(p.codewords) * std::size_t(p.head_dim), "A2atsCodebooks C");
}

// ---- calibration ----------------------------------------------------------------------------------------

/// The position of every input row within its text (inputs checked).
std::vector<std::int32_t> text_positions(const A2atsCalibrationInputs& inputs) {
  std::vector<std::int32_t> positions(std::size_t(inputs.keys.tokens));
  std::size_t text = 0;
  for (std::int32_t t = 0; t < inputs.keys.tokens; ++t) {
    while (text + 1 < inputs.text_starts.size() && inputs.text_starts[text + 1] <= t) ++text;
    positions[std::size_t(t)] = t - (inputs.text_starts.empty() ? 0 : inputs.text_starts[text]);
  }
  return positions;
}

/// The shape and text checks of calibrate_a2ats_layer and a2ats_score_error, and every value finite.
void check_inputs(const char* where, const A2atsCodebooks& codebooks, std::int32_t layer,
                  const A2atsCalibrationInputs& inputs) {
  const A2atsCodebookParams& p = codebooks.params();
  check_layer(p, layer, where);
  const auto check_view = [&](const SequenceView<const float>& v, const char* name, const char* heads_name,
                              std::int32_t heads) {
    validate(v, where, name);
    KVSIFT_CHECK(v.batch == 1, where, "{}.batch (= {}) must be 1", name, v.batch);
    KVSIFT_CHECK(v.heads == heads, where, "{}.heads (= {}) differs from the codebooks' {} (= {})", name, v.heads,
                 heads_name, heads);
    KVSIFT_CHECK(v.head_dim == p.head_dim, where, "{}.head_dim (= {}) differs from the codebooks' head_dim (= {})",
                 name, v.head_dim, p.head_dim);
    for (std::int32_t h = 0; h < v.heads; ++h) {
      for (std::int32_t t = 0; t < v.tokens; ++t) {
        const float* row = v.row(0, h, t);
        for (std::int32_t j = 0; j < v.head_dim; ++j) {
          KVSIFT_CHECK(std::isfinite(row[j]), where, "{} holds a non-finite value ({}) at token {}, head {}, channel {}",
                       name, row[j], t, h, j);
        }
      }
    }
  };
  check_view(inputs.queries, "inputs.queries", "q_heads", p.q_heads);
  check_view(inputs.keys, "inputs.keys", "kv_heads", p.kv_heads);
  KVSIFT_CHECK(inputs.queries.tokens == inputs.keys.tokens, where,
               "inputs.queries.tokens (= {}) != inputs.keys.tokens (= {})", inputs.queries.tokens, inputs.keys.tokens);
  const auto& starts = inputs.text_starts;
  for (std::size_t i = 0; i < starts.size(); ++i) {
    KVSIFT_CHECK((i == 0 ? starts[i] == 0 : starts[i] > starts[i - 1]) && starts[i] < inputs.keys.tokens, where,
                 "inputs.text_starts ({}) must start at 0 and ascend strictly below tokens (= {})", fmt::join(starts, ", "),
                 inputs.keys.tokens);
  }
}

/// Row t of head h of x as the codebook's scoring sees it, into out [d]: rotated to `position` (apply_rope in
/// fp64, one fp32 rounding), or as is for position < 0.
void scoring_row(const SequenceView<const float>& x, std::int32_t h, std::int32_t t, std::int64_t position,
                 const RopeConfig& rope, float* out) {
  std::copy_n(x.row(0, h, t), x.head_dim, out);
  if (position >= 0) apply_rope(out, x.head_dim, position, rope);
}

/// The positions rows are scored at: queries at b (windowed RoPE) or their own; keys pre-RoPE (-1: as is) or at
/// their own.
std::int64_t query_position(const A2atsCodebookParams& p, std::int32_t own) { return p.windowed_rope ? p.offset : own; }
std::int64_t key_position(const A2atsCodebookParams& p, std::int32_t own) { return p.windowed_rope ? -1 : own; }

/// H = sum q~^T q~ over the queries of kv head h's group [d, d] (fp64, both triangles), in token, then head order.
std::vector<double> query_moment(const A2atsCodebookParams& p, const A2atsCalibrationInputs& inputs,
                                 const std::vector<std::int32_t>& positions, std::int32_t kv_head) {
  const std::int32_t d = p.head_dim, group = p.q_heads / p.kv_heads;
  std::vector<double> h(std::size_t(d) * d, 0.0);
  float q[128];
  for (std::int32_t t = 0; t < inputs.queries.tokens; ++t) {
    for (std::int32_t u = 0; u < group; ++u) {
      scoring_row(inputs.queries, kv_head * group + u, t, query_position(p, positions[std::size_t(t)]), p.rope, q);
      for (std::int32_t i = 0; i < d; ++i) {
        const double qi = q[i];
        double* row = h.data() + std::size_t(i) * d;
        for (std::int32_t j = 0; j <= i; ++j) row[j] += qi * double(q[j]);
      }
    }
  }
  for (std::int32_t i = 0; i < d; ++i) {
    for (std::int32_t j = i + 1; j < d; ++j) h[std::size_t(i) * d + j] = h[std::size_t(j) * d + i];
  }
  return h;
}

/// Lower-triangular l [d, d] with l l^T = a (fp64); false where a pivot is not finite or not above kPivotFloor
/// times a's largest diagonal entry.
bool cholesky(const std::vector<double>& a, std::int32_t d, std::vector<double>& l) {
  double largest = 0.0;
  for (std::int32_t i = 0; i < d; ++i) largest = std::max(largest, a[std::size_t(i) * d + i]);
  std::fill(l.begin(), l.end(), 0.0);
  for (std::int32_t j = 0; j < d; ++j) {
    double pivot = a[std::size_t(j) * d + j];
    for (std::int32_t k = 0; k < j; ++k) pivot -= l[std::size_t(j) * d + k] * l[std::size_t(j) * d + k];
    if (!std::isfinite(pivot) || !(pivot > kPivotFloor * largest)) return false;
    const double diagonal = std::sqrt(pivot);
    l[std::size_t(j) * d + j] = diagonal;
    for (std::int32_t i = j + 1; i < d; ++i) {
      double sum = a[std::size_t(i) * d + j];
      for (std::int32_t k = 0; k < j; ++k) sum -= l[std::size_t(i) * d + k] * l[std::size_t(j) * d + k];
      l[std::size_t(i) * d + j] = sum / diagonal;
    }
  }
  return true;
}

/// z = k L, L lower-triangular [d, d] fp32: z_j = sum_{i >= j} k_i L[i][j], fp64 sums, one fp32 rounding.
void transform_row(const float* k, const float* l, std::int32_t d, float* z) {
  double sum[128] = {};
  for (std::int32_t i = 0; i < d; ++i) {
    const double ki = k[i];
    const float* row = l + std::size_t(i) * d;
    for (std::int32_t j = 0; j <= i; ++j) sum[j] += ki * double(row[j]);
  }
  for (std::int32_t j = 0; j < d; ++j) z[j] = float(sum[j]);
}

/// x with x L = c (L lower-triangular fp32 [d, d]): back substitution from the last channel, fp64.
void solve_row(const float* c, const float* l, std::int32_t d, float* x) {
  double solved[128];
  for (std::int32_t j = d - 1; j >= 0; --j) {
    double sum = c[j];
    for (std::int32_t i = j + 1; i < d; ++i) sum -= solved[i] * double(l[std::size_t(i) * d + j]);
    solved[j] = sum / double(l[std::size_t(j) * d + j]);
  }
  for (std::int32_t j = 0; j < d; ++j) x[j] = float(solved[j]);
}

/// The transformed keys of kv head h, z = k~ L, into z [tokens, d].
void transformed_keys(const A2atsCodebookParams& p, const A2atsCalibrationInputs& inputs,
                      const std::vector<std::int32_t>& positions, std::int32_t kv_head, const float* l, float* z) {
  const std::int32_t d = p.head_dim;
  float k[128];
  for (std::int32_t t = 0; t < inputs.keys.tokens; ++t) {
    scoring_row(inputs.keys, kv_head, t, key_position(p, positions[std::size_t(t)]), p.rope, k);
    transform_row(k, l, d, z + std::size_t(t) * d);
  }
}

/// The largest distance a centroid moves to the mean of its points, relative to the RMS norm of the points.
double centroid_movement(const float* z, const std::int32_t* assignment, std::int64_t n, const float* centroids,
                         std::int32_t k, std::int32_t d) {
  std::vector<double> sums(std::size_t(k) * d, 0.0), counts(std::size_t(k), 0.0);
  double square_norms = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float* x = z + std::size_t(i) * d;
    double* sum = sums.data() + std::size_t(assignment[i]) * d;
    for (std::int32_t j = 0; j < d; ++j) sum[j] += x[j], square_norms += double(x[j]) * x[j];
    counts[std::size_t(assignment[i])] += 1.0;
  }
  double largest = 0.0;
  for (std::int32_t c = 0; c < k; ++c) {
    if (counts[std::size_t(c)] == 0.0) continue;
    double square = 0.0;
    for (std::int32_t j = 0; j < d; ++j) {
      const double diff = sums[std::size_t(c) * d + j] / counts[std::size_t(c)] - centroids[std::size_t(c) * d + j];
      square += diff * diff;
    }
    largest = std::max(largest, std::sqrt(square));
  }
  const double rms = std::sqrt(square_norms / double(n));
  return rms > 0.0 ? largest / rms : 0.0;
}

// ---- files ----------------------------------------------------------------------------------------------

/// The header's fixed-size fields after the layer list, in file order, as the file stores them.
struct FileFields {
  std::int32_t kv_heads, q_heads, head_dim, codewords;
  double theta;
  std::int32_t rotary_dim;
  std::uint32_t layout, kind;
  double factor;
  std::int32_t original_max_position_embeddings;
  double low_freq_factor, high_freq_factor, beta_fast, beta_slow;
  std::uint32_t truncate;
  double attention_factor, mscale, mscale_all_dim;
  std::int32_t offset, window;
  std::uint32_t dtype, query_aware, windowed_rope;
};
constexpr std::uint32_t kDtypeF32 = 0;

FileFields file_fields(const A2atsCodebookParams& p) {
  const RopeScalingConfig& s = p.rope.scaling;
  return {p.kv_heads, p.q_heads, p.head_dim, p.codewords, p.rope.theta, p.rope.resolved_rotary_dim(p.head_dim),
          std::uint32_t(p.rope.layout), std::uint32_t(s.kind), s.factor, s.original_max_position_embeddings,
          s.low_freq_factor, s.high_freq_factor, s.beta_fast, s.beta_slow, s.truncate ? 1u : 0u,
          s.attention_factor, s.mscale, s.mscale_all_dim, p.offset, p.window, kDtypeF32, p.query_aware ? 1u : 0u,
          p.windowed_rope ? 1u : 0u};
}

/// f(name, field) over the fields in file order (the names the refusals quote).
template <class Fields, class F>
void for_each_field(Fields& x, F&& f) {
  f("kv_heads", x.kv_heads);
  f("q_heads", x.q_heads);
  f("head_dim", x.head_dim);
  f("codewords", x.codewords);
  f("rope.theta", x.theta);
  f("rope.rotary_dim", x.rotary_dim);
  f("rope.layout (0 neox, 1 interleaved)", x.layout);
  f("rope.scaling.kind (0 none, 1 linear, 2 llama3, 3 yarn)", x.kind);
  f("rope.scaling.factor", x.factor);
  f("rope.scaling.original_max_position_embeddings", x.original_max_position_embeddings);
  f("rope.scaling.low_freq_factor", x.low_freq_factor);
  f("rope.scaling.high_freq_factor", x.high_freq_factor);
  f("rope.scaling.beta_fast", x.beta_fast);
  f("rope.scaling.beta_slow", x.beta_slow);
  f("rope.scaling.truncate", x.truncate);
  f("rope.scaling.attention_factor", x.attention_factor);
  f("rope.scaling.mscale", x.mscale);
  f("rope.scaling.mscale_all_dim", x.mscale_all_dim);
  f("offset", x.offset);
  f("window", x.window);
  f("dtype (0 fp32)", x.dtype);
  f("query_aware", x.query_aware);
  f("windowed_rope", x.windowed_rope);
}

/// Refuses each field of the file's that `expected` sets and that differs (the RoPE config: the fields its
/// scaling kind reads).
void check_expected(const IndexFileReader& r, const std::string& model_id, std::int32_t layers, const FileFields& f,
                    const A2atsCodebookExpectation& e) {
  if (!e.model_id.empty()) r.expect("model_id", model_id, e.model_id);
  const auto shape = [&](std::string_view name, std::int32_t found, std::int32_t expected) {
    if (expected != 0) r.expect(name, found, expected);
  };
  shape("layers", layers, e.layers);
  shape("kv_heads", f.kv_heads, e.kv_heads);
  shape("q_heads", f.q_heads, e.q_heads);
  shape("head_dim", f.head_dim, e.head_dim);
  shape("codewords", f.codewords, e.codewords);
  if (!e.rope) return;
  A2atsCodebookParams wanted;
  wanted.head_dim = e.head_dim != 0 ? e.head_dim : f.head_dim;
  wanted.rope = *e.rope;
  const FileFields w = file_fields(wanted);
  r.expect("rope.theta", f.theta, w.theta);
  r.expect("rope.rotary_dim", f.rotary_dim, w.rotary_dim);
  r.expect("rope.layout (0 neox, 1 interleaved)", f.layout, w.layout);
  r.expect("rope.scaling.kind (0 none, 1 linear, 2 llama3, 3 yarn)", f.kind, w.kind);
  const auto kind = RopeScaling(w.kind);
  if (kind == RopeScaling::none) return;
  r.expect("rope.scaling.factor", f.factor, w.factor);
  if (kind == RopeScaling::linear) return;
  r.expect("rope.scaling.original_max_position_embeddings", f.original_max_position_embeddings,
           w.original_max_position_embeddings);
  if (kind == RopeScaling::llama3) {
    r.expect("rope.scaling.low_freq_factor", f.low_freq_factor, w.low_freq_factor);
    r.expect("rope.scaling.high_freq_factor", f.high_freq_factor, w.high_freq_factor);
    return;
  }
  r.expect("rope.scaling.beta_fast", f.beta_fast, w.beta_fast);
  r.expect("rope.scaling.beta_slow", f.beta_slow, w.beta_slow);
  r.expect("rope.scaling.truncate", f.truncate, w.truncate);
  r.expect("rope.scaling.attention_factor", f.attention_factor, w.attention_factor);
  r.expect("rope.scaling.mscale", f.mscale, w.mscale);
  r.expect("rope.scaling.mscale_all_dim", f.mscale_all_dim, w.mscale_all_dim);
}

A2atsCodebooks read_codebooks(std::istream& in, const std::string& source, const A2atsCodebookExpectation& expected,
                              const char* where) {
  IndexFileReader r(in, kA2atsCodebookFile, source, where);
  A2atsCodebookParams p;
  const auto id_bytes = r.read<std::uint32_t>("the model id's length");
  KVSIFT_CHECK(id_bytes <= kMaxModelIdBytes, where, "{}: the model id's length ({}) is above {}", source, id_bytes,
               kMaxModelIdBytes);
  p.model_id.resize(id_bytes);
  r.read_array(std::span<char>(p.model_id.data(), id_bytes), "the model id");
  p.layers = r.read<std::int32_t>("layers");
  const auto held = r.read<std::int32_t>("the count of calibrated layers");
  KVSIFT_CHECK(held >= 1 && held <= p.layers, where, "{}: the count of calibrated layers ({}) is outside [1, layers = {}]",
               source, held, p.layers);
  // The layer list is bounded by the file's size before it is allocated (the header's counts are not checked by
  // the checksum until the end).
  KVSIFT_CHECK(std::size_t(held) * sizeof(std::int32_t) <= bytes_left(in), where,
               "{}: truncated: the header lists {} calibrated layers, more than the file's remaining {} bytes hold",
               source, held, bytes_left(in));
  p.calibrated_layers.resize(std::size_t(held));
  r.read_array(std::span<std::int32_t>(p.calibrated_layers), "the calibrated layers");
  FileFields f{};
  for_each_field(f, [&](std::string_view name, auto& value) { value = r.read<std::decay_t<decltype(value)>>(name); });
  check_expected(r, p.model_id, p.layers, f, expected);
  r.expect("dtype (0 fp32)", f.dtype, kDtypeF32);
  p.kv_heads = f.kv_heads, p.q_heads = f.q_heads, p.head_dim = f.head_dim, p.codewords = f.codewords;
  p.rope = {.theta = f.theta,
            .rotary_dim = f.rotary_dim,
            .layout = RopeLayout(f.layout),
            .scaling = {.kind = RopeScaling(f.kind),
                        .factor = f.factor,
                        .original_max_position_embeddings = f.original_max_position_embeddings,
                        .low_freq_factor = f.low_freq_factor,
                        .high_freq_factor = f.high_freq_factor,
                        .beta_fast = f.beta_fast,
                        .beta_slow = f.beta_slow,
                        .truncate = f.truncate != 0,
                        .attention_factor = f.attention_factor,
                        .mscale = f.mscale,
                        .mscale_all_dim = f.mscale_all_dim}};
  p.offset = f.offset, p.window = f.window, p.query_aware = f.query_aware != 0, p.windowed_rope = f.windowed_rope != 0;
  KVSIFT_CHECK(f.layout <= 1 && f.kind <= 3 && f.truncate <= 1 && f.query_aware <= 1 && f.windowed_rope <= 1, where,
               "{}: an enum or flag of the header is out of range (layout {}, scaling kind {}, truncate {}, "
               "query_aware {}, windowed_rope {})",
               source, f.layout, f.kind, f.truncate, f.query_aware, f.windowed_rope);
  const std::string problem = params_problem(p);
  KVSIFT_CHECK(problem.empty(), where, "{}: the header describes codebooks no A2atsCodebooks holds: {}", source,
               problem);
  // The arrays' bytes against what the file holds, before allocating them (a damaged header could ask for
  // anything: the checksum is checked only at the end).
  const std::size_t layer_floats = transform_floats(p) + 2 * codebook_floats(p);
  const std::size_t needed = checked_mul(std::size_t(held), checked_mul(layer_floats, 4, where), where) + 4;
  const std::size_t left = bytes_left(in);
  KVSIFT_CHECK(left >= needed, where,
               "{}: truncated: the header asks for {} bytes of codebooks and checksum after byte {}, the file holds {}",
               source, needed, std::int64_t(in.tellg()), left);
  A2atsCodebooks codebooks(p);
  for (const std::int32_t layer : p.calibrated_layers) {
    r.read_array(std::span<float>(codebooks.transform(layer), transform_floats(p)), fmt::format("layer {} L", layer));
    r.read_array(std::span<float>(codebooks.centroids(layer), codebook_floats(p)), fmt::format("layer {} C^z", layer));
    r.read_array(std::span<float>(codebooks.codebook(layer), codebook_floats(p)), fmt::format("layer {} C", layer));
  }
  r.finish();
  return codebooks;
}

}  // namespace

// ---- A2atsCodebooks -------------------------------------------------------------------------------------

A2atsCodebooks::A2atsCodebooks(const A2atsCodebookParams& params) : params_(params) {
  const std::string problem = params_problem(params);
  KVSIFT_CHECK(problem.empty(), "A2atsCodebooks", "params: {}", problem);
  const std::size_t layers = held_layer_count(params);
  transform_.resize(checked_mul(layers, transform_floats(params), "A2atsCodebooks L"));
  centroids_.resize(checked_mul(layers, codebook_floats(params), "A2atsCodebooks C^z"));
  codebook_.resize(centroids_.size());
}

bool A2atsCodebooks::holds(std::int32_t layer) const {
  if (layer < 0 || layer >= params_.layers) return false;
  const auto& held = params_.calibrated_layers;
  return held.empty() || std::binary_search(held.begin(), held.end(), layer);
}

std::size_t A2atsCodebooks::slot(std::int32_t layer, const char* where) const {
  check_layer(params_, layer, where);
  const auto& held = params_.calibrated_layers;
  return held.empty() ? std::size_t(layer) : std::size_t(std::lower_bound(held.begin(), held.end(), layer) - held.begin());
}

A2atsLayerCodebooks A2atsCodebooks::layer(std::int32_t layer) const {
  const std::size_t s = slot(layer, "A2atsCodebooks::layer");
  return {.transform = transform_.data() + s * transform_floats(params_),
          .centroids = centroids_.data() + s * codebook_floats(params_),
          .codebook = codebook_.data() + s * codebook_floats(params_),
          .kv_heads = params_.kv_heads,
          .codewords = params_.codewords,
          .head_dim = params_.head_dim,
          .rope = params_.rope,
          .offset = params_.offset,
          .windowed_rope = params_.windowed_rope};
}

float* A2atsCodebooks::transform(std::int32_t layer) {
  return transform_.data() + slot(layer, "A2atsCodebooks::transform") * transform_floats(params_);
}
float* A2atsCodebooks::centroids(std::int32_t layer) {
  return centroids_.data() + slot(layer, "A2atsCodebooks::centroids") * codebook_floats(params_);
}
float* A2atsCodebooks::codebook(std::int32_t layer) {
  return codebook_.data() + slot(layer, "A2atsCodebooks::codebook") * codebook_floats(params_);
}

std::size_t A2atsCodebooks::bytes() const {
  return (transform_.size() + centroids_.size() + codebook_.size()) * sizeof(float);
}

// ---- calibration ----------------------------------------------------------------------------------------

A2atsCalibrationReport calibrate_a2ats_layer(A2atsCodebooks& codebooks, std::int32_t layer,
                                             const A2atsCalibrationInputs& inputs,
                                             const A2atsCalibrationConfig& config, cpu::ThreadPool* pool) {
  constexpr const char* where = "calibrate_a2ats_layer";
  check_inputs(where, codebooks, layer, inputs);
  const A2atsCodebookParams& p = codebooks.params();
  const std::int32_t d = p.head_dim, kv_heads = p.kv_heads, k = p.codewords;
  const std::int64_t n = inputs.keys.tokens;
  KVSIFT_CHECK(n >= k, where, "layer {}: {} keys per kv head are fewer than the {} codewords: calibrate on more text or "
               "with fewer codewords", layer, n, k);
  KVSIFT_CHECK(std::isfinite(config.ridge) && config.ridge > 0.0, where, "config.ridge (= {}) must be finite and > 0",
               config.ridge);
  KVSIFT_CHECK(config.ridge_attempts >= 1, where, "config.ridge_attempts (= {}) must be >= 1", config.ridge_attempts);
  KVSIFT_CHECK(config.kmeans_iterations >= 0, where, "config.kmeans_iterations (= {}) must be >= 0",
               config.kmeans_iterations);
  const std::vector<std::int32_t> positions = text_positions(inputs);
  float* transform = codebooks.transform(layer);
  float* centroids = codebooks.centroids(layer);
  float* codebook = codebooks.codebook(layer);
  A2atsCalibrationReport report{.keys = n,
                                .kmeans_iterations = config.kmeans_iterations,
                                .ridge = std::vector<double>(std::size_t(kv_heads), 0.0),
                                .movement = std::vector<double>(std::size_t(kv_heads), 0.0)};

  // L per kv head, then the transformed keys z [kv_heads, n, d] that k-means clusters.
  // L is stored once every head has one: a refused head leaves the layer's codebooks as they were.
  std::vector<float> z(std::size_t(kv_heads) * std::size_t(n) * d);
  std::vector<float> transforms(std::size_t(kv_heads) * d * d);
  cpu::parallel_for(pool, kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (auto h = std::int32_t(begin); h < end; ++h) {
      float* l = transforms.data() + std::size_t(h) * d * d;
      std::fill_n(l, std::size_t(d) * d, 0.0f);
      if (!p.query_aware) {
        for (std::int32_t i = 0; i < d; ++i) l[std::size_t(i) * d + i] = 1.0f;
      } else {
        std::vector<double> a = query_moment(p, inputs, positions, h);
        double square_sum = 0.0;
        for (const double x : a) square_sum += x * x;
        const double rms = std::sqrt(square_sum / double(a.size()));
        KVSIFT_CHECK(rms > 0.0, where, "layer {}, kv head {}: every query of the group is zero (H = 0)", layer, h);
        for (double& x : a) x /= rms;
        std::vector<double> shifted(a.size()), factor(a.size());
        double ridge = config.ridge;
        bool factored = false;
        for (std::int32_t attempt = 0; attempt < config.ridge_attempts && !factored; ++attempt) {
          if (attempt > 0) ridge *= 10.0;
          shifted = a;
          for (std::int32_t i = 0; i < d; ++i) shifted[std::size_t(i) * d + i] += ridge;
          factored = cholesky(shifted, d, factor);
        }
        KVSIFT_CHECK(factored, where,
                     "layer {}, kv head {}: the Cholesky of H / RMS(H) + ridge I failed {} times, last with ridge {} "
                     "(raise config.ridge or config.ridge_attempts)",
                     layer, h, config.ridge_attempts, ridge);
        report.ridge[std::size_t(h)] = ridge;
        for (std::size_t i = 0; i < factor.size(); ++i) l[i] = float(factor[i]);
      }
      transformed_keys(p, inputs, positions, h, l, z.data() + std::size_t(h) * std::size_t(n) * d);
    }
  });
  std::copy(transforms.begin(), transforms.end(), transform);

  // C^z: every kv head of the layer in one batched call, written in place.
  const BatchedKMeansConfig kmeans{.clusters = k,
                                   .iterations = config.kmeans_iterations,
                                   .metric = KMeansMetric::l2,
                                   .seed = config.seed,
                                   .empty = EmptyCluster::reseed};
  const auto points = BatchedMatrixView<const float>::packed(z.data(), kv_heads, n, d);
  cpu::Array<std::byte> workspace(cpu::batched_kmeans_workspace_bytes(kv_heads, n, d, kmeans));
  std::vector<std::int32_t> assignment(std::size_t(kv_heads) * std::size_t(n));
  cpu::kmeans_batched(points, nullptr, kmeans, centroids, assignment.data(), workspace.bytes(), pool);

  // C = C^z L^-1, and how far one more Lloyd step would move the centroids.
  cpu::parallel_for(pool, kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (auto h = std::int32_t(begin); h < end; ++h) {
      const float* l = transform + std::size_t(h) * d * d;
      const float* cz = centroids + std::size_t(h) * k * d;
      for (std::int32_t c = 0; c < k; ++c) {
        solve_row(cz + std::size_t(c) * d, l, d, codebook + (std::size_t(h) * k + c) * d);
      }
      report.movement[std::size_t(h)] = centroid_movement(z.data() + std::size_t(h) * std::size_t(n) * d,
                                                          assignment.data() + std::size_t(h) * std::size_t(n), n, cz,
                                                          k, d);
    }
  });
  return report;
}

std::vector<double> a2ats_score_error(const A2atsCodebooks& codebooks, std::int32_t layer,
                                      const A2atsCalibrationInputs& inputs, cpu::ThreadPool* pool) {
  constexpr const char* where = "a2ats_score_error";
  check_inputs(where, codebooks, layer, inputs);
  const A2atsCodebookParams& p = codebooks.params();
  const A2atsLayerCodebooks view = codebooks.layer(layer);
  const std::int32_t d = p.head_dim, k = p.codewords;
  const std::int64_t n = inputs.keys.tokens;
  const std::vector<std::int32_t> positions = text_positions(inputs);
  std::vector<double> errors(std::size_t(p.kv_heads));
  std::vector<float> z(std::size_t(n) * d);
  std::vector<std::int32_t> codes(z.size() / std::size_t(d));
  for (std::int32_t h = 0; h < p.kv_heads; ++h) {
    const float* l = view.transform + std::size_t(h) * d * d;
    const float* c = view.codebook + std::size_t(h) * k * d;
    transformed_keys(p, inputs, positions, h, l, z.data());
    cpu::assign_nearest(MatrixView<const float>::packed(z.data(), n, d),
                        MatrixView<const float>::packed(view.centroids + std::size_t(h) * k * d, k, d), KMeansMetric::l2,
                        codes, pool);
    // sum_q (q~ x)^2 = x H x^T: the error of every (query, key) pair through H.
    const std::vector<double> moment = query_moment(p, inputs, positions, h);
    const auto quadratic = [&](const double* x) {
      double sum = 0.0;
      for (std::int32_t i = 0; i < d; ++i) {
        double row = 0.0;
        for (std::int32_t j = 0; j < d; ++j) row += moment[std::size_t(i) * d + j] * x[j];
        sum += x[i] * row;
      }
      return sum;
    };
    double error = 0.0, total = 0.0;
    float key[128];
    double x[128], residual[128];
    for (std::int64_t t = 0; t < n; ++t) {
      scoring_row(inputs.keys, h, std::int32_t(t), key_position(p, positions[std::size_t(t)]), p.rope, key);
      const float* word = c + std::size_t(codes[std::size_t(t)]) * d;
      for (std::int32_t j = 0; j < d; ++j) x[j] = key[j], residual[j] = double(key[j]) - double(word[j]);
      error += quadratic(residual);
      total += quadratic(x);
    }
    errors[std::size_t(h)] = total > 0.0 ? error / total : 0.0;
  }
  return errors;
}

// ---- files ----------------------------------------------------------------------------------------------

void save_a2ats_codebooks(const std::filesystem::path& path, const A2atsCodebooks& codebooks) {
  constexpr const char* where = "save_a2ats_codebooks";
  const A2atsCodebookParams& p = codebooks.params();
  KVSIFT_CHECK(p.layers > 0, where, "the codebooks are empty (default-constructed)");
  const std::vector<std::int32_t> held = held_layers(p);
  write_index_file(path.string(), where, [&](std::ostream& out) {
    IndexFileWriter w(out, kA2atsCodebookFile, where);
    w.write(std::uint32_t(p.model_id.size()));
    w.write_array(std::span<const char>(p.model_id.data(), p.model_id.size()));
    w.write(p.layers);
    w.write(std::int32_t(held.size()));
    w.write_array(std::span<const std::int32_t>(held));
    FileFields f = file_fields(p);
    for_each_field(f, [&](std::string_view, const auto& value) { w.write(value); });
    for (const std::int32_t layer : held) {
      const A2atsLayerCodebooks v = codebooks.layer(layer);
      w.write_array(std::span<const float>(v.transform, transform_floats(p)));
      w.write_array(std::span<const float>(v.centroids, codebook_floats(p)));
      w.write_array(std::span<const float>(v.codebook, codebook_floats(p)));
    }
    w.finish();
  });
}

A2atsCodebooks load_a2ats_codebooks(const std::filesystem::path& path, const A2atsCodebookExpectation& expected) {
  constexpr const char* where = "load_a2ats_codebooks";
  A2atsCodebooks staged;
  read_index_file(path.string(), where,
                  [&](std::istream& in) { staged = read_codebooks(in, path.string(), expected, where); });
  return staged;
}

}  // namespace kvsift
