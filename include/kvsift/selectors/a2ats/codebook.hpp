#pragma once
/// A²ATS's offline artefact (He et al., 2025, §4.2, eqs. 13-19): per (layer, kv head) a query-aware codebook.
/// Calibration, the versioned file and its refusals; the selector that uses one layer's codebooks is
/// selectors/a2ats/a2ats.hpp; the command-line builder is bench/a2ats_codebook.cpp (kvsift_a2ats_codebook).
///
/// Calibration of one (layer, kv head), from pre-RoPE queries and keys of calibration texts (tools/capture):
///   q~ = q R_b for every query of every query head of the group (b = offset, the fixed relative position of
///        windowed RoPE: the same rotation for every query, not the query's own position; core/rope.hpp
///        apply_rope, fp64, rounded once to fp32);
///   H  = sum q~^T q~ (fp64), divided by its RMS entry, plus ridge I; a Cholesky that fails (a pivot that is not
///        finite or not above 1e-12 of the largest diagonal entry) retries with the ridge times 10, refused after
///        `ridge_attempts`;
///   L  = cholesky(H) (H = L L^T, lower-triangular, fp64, then rounded to fp32: every later step uses the stored
///        fp32 L, as the selector's encoder does), z = k L for every key (fp64 sums, fp32 result);
///   C^z = k-means of the z with cpu::kmeans_batched (all kv heads of the layer in one call): k-means++ seeding,
///        a fixed number of Lloyd steps (`kmeans_iterations`: the primitive has no tolerance stop; the report
///        gives the movement one more step would make), empty clusters reseeded, seed + kv head;
///   C  = C^z L^-1 (a triangular solve per codeword in fp64, rounded once to fp32).
/// Ablations (the paper's table 2), from the same captures: query_aware = false takes L = I (plain k-means on
/// the keys); windowed_rope = false codes post-RoPE keys (each key rotated to its own position) and weights H by
/// post-RoPE queries at their own positions (the baseline and "QAVQ" rows). A codebook records both flags; the
/// selector scores with the query rotated to `offset` when windowed_rope, else with the post-RoPE query as is.
/// Positions restart at 0 with each text of the calibration inputs.
///
/// All arrays fp32, row-major, host memory. Deterministic: the same inputs, config and seed give the same bits
/// whatever the pool. Thread safety: calibration runs on the given pool and writes only its layer's arrays; a
/// loaded A2atsCodebooks is immutable and may be shared by any number of selectors.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift {

/// What a set of codebooks was built for and how; the file's header.
struct A2atsCodebookParams {
  std::string model_id;         ///< free text naming the model (compared on load when the caller gives one)
  std::int32_t layers = 0;      ///< the model's layer count
  /// The model layers the set holds, ascending, each in [0, layers); empty: every layer. A codebook set for a
  /// few layers (an ablation on captured layers 3 and 15) is addressed by the same layer numbers as a full one.
  std::vector<std::int32_t> calibrated_layers;
  std::int32_t kv_heads = 0;
  std::int32_t q_heads = 0;     ///< the calibration's query heads (a multiple of kv_heads)
  std::int32_t head_dim = 0;    ///< 64 or 128 (the vq primitives')
  std::int32_t codewords = 4096;
  RopeConfig rope{};
  std::int32_t offset = 2048;   ///< b: the fixed relative position non-local keys are scored at
  std::int32_t window = 64;     ///< w: windowed RoPE's local window (recorded; the attention window is the step's)
  bool query_aware = true;      ///< false: L = I (plain k-means)
  bool windowed_rope = true;    ///< false: codes of post-RoPE keys, queries scored at their own positions
};

/// One layer's codebooks, host fp32 views into an A2atsCodebooks: for kv head h,
/// transform + h * head_dim^2 is L (lower-triangular, row-major), centroids + h * codewords * head_dim is C^z and
/// codebook + h * codewords * head_dim is C = C^z L^-1.
struct A2atsLayerCodebooks {
  const float* transform = nullptr;  ///< [kv_heads, head_dim, head_dim]
  const float* centroids = nullptr;  ///< [kv_heads, codewords, head_dim]
  const float* codebook = nullptr;   ///< [kv_heads, codewords, head_dim]
  std::int32_t kv_heads = 0;
  std::int32_t codewords = 0;
  std::int32_t head_dim = 0;
  RopeConfig rope{};
  std::int32_t offset = 0;
  bool windowed_rope = true;
};

/// Every held layer's codebooks (owning, host memory).
class A2atsCodebooks {
 public:
  A2atsCodebooks() = default;
  /// Zero-filled arrays for `params` (checked: positive shapes, head_dim 64 or 128, codewords in [1, 65536],
  /// q_heads a multiple of kv_heads, calibrated_layers ascending in [0, layers), a valid RoPE config, offset >= 0,
  /// window >= 0).
  explicit A2atsCodebooks(const A2atsCodebookParams& params);

  const A2atsCodebookParams& params() const { return params_; }
  /// Whether the set holds model layer `layer`.
  bool holds(std::int32_t layer) const;
  /// Model layer `layer`'s views (refused outside [0, layers) or for a layer the set does not hold).
  A2atsLayerCodebooks layer(std::int32_t layer) const;

  /// Mutable arrays of one held layer, for calibration and loading: [kv_heads, d, d], [kv_heads, codewords, d]
  /// twice.
  float* transform(std::int32_t layer);
  float* centroids(std::int32_t layer);
  float* codebook(std::int32_t layer);

  /// Bytes of the arrays (all held layers).
  std::size_t bytes() const;

 private:
  /// The index of model layer `layer` among the held ones (refused as layer() says).
  std::size_t slot(std::int32_t layer, const char* where) const;

  A2atsCodebookParams params_{};
  std::vector<float> transform_, centroids_, codebook_;
};

/// Calibration's knobs (the math above).
struct A2atsCalibrationConfig {
  double ridge = 1e-6;               ///< added to H / RMS(H) before the first Cholesky; > 0
  std::int32_t ridge_attempts = 4;   ///< Cholesky attempts, the ridge times 10 after each failure; >= 1
  std::int32_t kmeans_iterations = 50;  ///< Lloyd steps, a fixed count (cpu::kmeans_batched has no early stop)
  std::uint64_t seed = 0;            ///< kv head h's k-means draws from seed + h
};

/// Calibration inputs of one layer: pre-RoPE queries [tokens, q_heads, head_dim] and keys [tokens, kv_heads,
/// head_dim] of one or more texts, fp32 host memory; row r of a text is at position r - (its text's first row)
/// (text_starts: the first row of each text, ascending, starting at 0; empty: one text).
struct A2atsCalibrationInputs {
  SequenceView<const float> queries{};  ///< batch 1: [1, q_heads, tokens, head_dim]
  SequenceView<const float> keys{};     ///< batch 1: [1, kv_heads, tokens, head_dim]
  std::vector<std::int32_t> text_starts{};
};

/// What one layer's calibration did, per kv head.
struct A2atsCalibrationReport {
  std::int64_t keys = 0;             ///< keys per kv head (every row of every text)
  std::int32_t kmeans_iterations = 0;
  std::vector<double> ridge;         ///< [kv_heads] the ridge the Cholesky succeeded with (0 without query_aware)
  /// [kv_heads] the largest distance a centroid would move in one more Lloyd step (the mean of its points),
  /// relative to the RMS norm of the z: the stopping rule is < 1e-4.
  std::vector<double> movement;
};

/// Calibrates layer `layer` of `codebooks` (every kv head) from `inputs`, as the header comment says.
/// Refused: a layer the set does not hold, shapes that disagree with codebooks.params(), bad text_starts, fewer
/// keys than codewords, a non-finite query or key, queries that are all zero, a Cholesky that fails
/// ridge_attempts times (naming the layer, kv head and last ridge). Threads: kv heads and k-means on `pool`.
A2atsCalibrationReport calibrate_a2ats_layer(A2atsCodebooks& codebooks, std::int32_t layer,
                                             const A2atsCalibrationInputs& inputs,
                                             const A2atsCalibrationConfig& config, cpu::ThreadPool* pool = nullptr);

/// The paper's attention-score error J' (eq. 10) of layer `layer`'s codebooks on `inputs`, relative, per kv
/// head: sum over the queries q~ and keys k~ of (q~ (k~ - C_code(k~)))^2 / sum of (q~ k~)^2, with q~ and k~ as
/// the codebook's windowed_rope flag makes them (queries of the group's heads rotated to offset and pre-RoPE
/// keys, or both post-RoPE at their own positions) and each key coded as the selector codes it (the C^z nearest
/// to z = k L). Sums in fp64 through H = sum q~^T q~. Refused as calibration refuses shapes and inputs.
std::vector<double> a2ats_score_error(const A2atsCodebooks& codebooks, std::int32_t layer,
                                      const A2atsCalibrationInputs& inputs, cpu::ThreadPool* pool = nullptr);

/// Codebook files (core/index_file.hpp's framing: magic "KVA2ATCB", version 1, zlib's CRC-32 of everything
/// before it last), values little-endian, no padding:
///   uint32 n, then n bytes: model_id (n <= 4096)
///   int32 layers, m, calibrated layers [m] (the held layers, explicit even when they are all)
///   int32 kv_heads, q_heads, head_dim, codewords
///   fp64 rope.theta; int32 rope.rotary_dim (resolved: 0 is written as head_dim); uint32 rope.layout,
///   rope.scaling.kind; fp64 factor; int32 original_max_position_embeddings; fp64 low_freq_factor,
///   high_freq_factor, beta_fast, beta_slow; uint32 truncate; fp64 attention_factor, mscale, mscale_all_dim
///   int32 offset, window; uint32 dtype (0: fp32, the only one), query_aware, windowed_rope
///   per held layer, ascending: fp32 L [kv_heads, d, d], C^z [kv_heads, codewords, d], C [kv_heads, codewords, d]
/// Written to path.partial and renamed over path once complete.
inline constexpr std::uint32_t kA2atsCodebookFileVersion = 1;
void save_a2ats_codebooks(const std::filesystem::path& path, const A2atsCodebooks& codebooks);

/// What the model that loads a codebook file needs: the fields that are set are compared with the file's.
struct A2atsCodebookExpectation {
  std::string model_id;          ///< compared when non-empty
  std::int32_t layers = 0;       ///< the shapes: each compared when non-zero
  std::int32_t kv_heads = 0;
  std::int32_t q_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t codewords = 0;
  /// Compared when set (an engine that knows its model's RoPE should set it; the selector rotates with the
  /// file's): theta, the resolved rotary dim, the layout, the scaling kind and the parameters that kind reads
  /// (core/rope.hpp inv_freq and attention_factor).
  std::optional<RopeConfig> rope{};
};

/// Reads a file written by save_a2ats_codebooks. Refused, naming the path and what is wrong: a missing file,
/// another magic, another version, a file that ends early (at any byte) or whose header describes more bytes
/// than it holds, a checksum that differs (corrupted), bytes after the checksum, header values that no
/// A2atsCodebooks accepts, each field `expected` sets that differs (its name, the file's value and the
/// expected one), a path that is a directory, and a NaN or an infinity in any value (core/index_file.hpp: the
/// layer's array, L, C^z or C, and the first such element). A refused load returns nothing.
A2atsCodebooks load_a2ats_codebooks(const std::filesystem::path& path, const A2atsCodebookExpectation& expected);

}  // namespace kvsift
