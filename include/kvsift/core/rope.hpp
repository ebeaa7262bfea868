#pragma once
/// Rotary position embedding (RoPE): the model's configuration (theta, layout, partial rotary dim, and the
/// context-extension scalings models ship: linear, llama3, YaRN), its inverse frequencies, the cos/sin table
/// view the primitives read (cpu/rope.hpp, cuda/rope.hpp), and the math shared by host and device.
///
/// Pairs rotate by angle pos * inv_freq(i), i in [0, rotary_dim / 2); channels at or past rotary_dim are left
/// alone. neox (GPT-NeoX, Llama in HF) pairs channel i with i + rotary_dim / 2; interleaved (GPT-J, Meta's
/// original Llama) pairs 2i with 2i + 1. The rotation is orthogonal, so `inverse` recovers pre-RoPE vectors.
///
/// YaRN's attention factor: HF multiplies cos and sin by it, so post-RoPE q and k both carry it (and q.k
/// carries its square). kvsift does the same: a forward rotation multiplies by the table's attention_factor, an
/// inverse one divides by it (so inverse recovers the pre-RoPE vector; A²ATS undoing RoPE on cached keys gets
/// it divided out), and a rotation by a position delta, which moves an already rotated vector, leaves it alone.
/// A caller that wants the bare rotation sets scaling.attention_factor = 1.

#include <cmath>
#include <cstdint>

#include "kvsift/core/config.hpp"

namespace kvsift {

enum class RopeLayout : std::uint8_t { neox, interleaved };

/// The `rope_scaling.rope_type` of an HF config.json ("default" is none).
enum class RopeScaling : std::uint8_t { none, linear, llama3, yarn };

/// `rope_scaling`'s parameters, under their HF names; each kind reads only its own.
struct RopeScalingConfig {
  RopeScaling kind = RopeScaling::none;
  double factor = 1.0;                                ///< linear, llama3, yarn
  std::int32_t original_max_position_embeddings = 0;  ///< llama3, yarn (HF falls back to max_position_embeddings)
  double low_freq_factor = 1.0;                       ///< llama3
  double high_freq_factor = 4.0;                      ///< llama3
  double beta_fast = 32.0;                            ///< yarn
  double beta_slow = 1.0;                             ///< yarn
  bool truncate = true;                               ///< yarn: floor/ceil of the correction range (HF's default)
  /// yarn: q and k scale by this; 0 derives it as HF does, from mscale and mscale_all_dim when both are set
  /// (DeepSeek), else 0.1 ln(factor) + 1.
  double attention_factor = 0.0;
  double mscale = 0.0;          ///< yarn, optional
  double mscale_all_dim = 0.0;  ///< yarn, optional
};

struct RopeConfig {
  double theta = 10000.0;
  std::int32_t rotary_dim = 0;  ///< 0 means head_dim
  RopeLayout layout = RopeLayout::neox;
  RopeScalingConfig scaling{};

  KVSIFT_HOST_DEVICE std::int32_t resolved_rotary_dim(std::int32_t head_dim) const {
    return rotary_dim == 0 ? head_dim : rotary_dim;
  }

  /// The inverse frequency of pair i < rotary / 2, in fp64, as transformers' modeling_rope_utils.py
  /// (_compute_*_parameters) defines it; HF evaluates it in fp32 torch ops, so its values differ from these in
  /// the last fp32 bits. With base = theta and f_i = base^(-2i / rotary) (_compute_default_rope_parameters):
  ///   none:   f_i.
  ///   linear: f_i / factor.
  ///   llama3: wavelen = 2 pi / f_i; L = original_max_position_embeddings;
  ///           wavelen < L / high_freq_factor: f_i; wavelen > L / low_freq_factor: f_i / factor;
  ///           else with s = (L / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor):
  ///           (1 - s) f_i / factor + s f_i.
  ///   yarn:   corr(r) = rotary ln(L / (2 pi r)) / (2 ln base); low = max(floor(corr(beta_fast)), 0),
  ///           high = min(ceil(corr(beta_slow)), rotary - 1) (no floor/ceil without truncate); high += 0.001 if
  ///           low == high; ramp_i = clamp((i - low) / (high - low), 0, 1);
  ///           f_i / factor * ramp_i + f_i * (1 - ramp_i).
  KVSIFT_HOST_DEVICE double inv_freq(std::int32_t i, std::int32_t rotary) const {
    const double f = ::pow(theta, -2.0 * double(i) / double(rotary));
    const RopeScalingConfig& s = scaling;
    switch (s.kind) {
      case RopeScaling::none:
        return f;
      case RopeScaling::linear:
        return f / s.factor;
      case RopeScaling::llama3: {
        const double pi = 3.14159265358979323846;
        const double old_len = double(s.original_max_position_embeddings);
        const double wavelen = 2.0 * pi / f;
        if (wavelen < old_len / s.high_freq_factor) return f;
        if (wavelen > old_len / s.low_freq_factor) return f / s.factor;
        const double smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        return (1.0 - smooth) * f / s.factor + smooth * f;
      }
      case RopeScaling::yarn: {
        const double pi = 3.14159265358979323846;
        const auto correction_dim = [&](double rotations) {
          return double(rotary) * ::log(double(s.original_max_position_embeddings) / (rotations * 2.0 * pi)) /
                 (2.0 * ::log(theta));
        };
        double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
        if (s.truncate) low = ::floor(low), high = ::ceil(high);
        low = ::fmax(low, 0.0);
        high = ::fmin(high, double(rotary - 1));
        if (low == high) high += 0.001;
        const double ramp = ::fmin(::fmax((double(i) - low) / (high - low), 0.0), 1.0);
        return f / s.factor * ramp + f * (1.0 - ramp);
      }
    }
    return f;
  }

  /// The factor post-RoPE q and k carry: YaRN's attention factor (HF's get_mscale), 1 for the other kinds.
  KVSIFT_HOST_DEVICE double attention_factor() const {
    const RopeScalingConfig& s = scaling;
    if (s.kind != RopeScaling::yarn) return 1.0;
    if (s.attention_factor != 0.0) return s.attention_factor;
    const auto get_mscale = [&](double m) { return s.factor <= 1.0 ? 1.0 : 0.1 * m * ::log(s.factor) + 1.0; };
    if (s.mscale != 0.0 && s.mscale_all_dim != 0.0) return get_mscale(s.mscale) / get_mscale(s.mscale_all_dim);
    return get_mscale(1.0);
  }
};

/// The pair (a, b) that inverse frequency i rotates, in a rotary span of `half` pairs.
KVSIFT_HOST_DEVICE inline void rope_pair(RopeLayout layout, std::int32_t i, std::int32_t half, std::int32_t& a,
                                         std::int32_t& b) {
  a = layout == RopeLayout::neox ? i : 2 * i;
  b = layout == RopeLayout::neox ? i + half : 2 * i + 1;
}

/// A cos/sin table of a RopeConfig: row p < positions holds cos(p * inv_freq(i)) and sin(...) for the pairs
/// i < rotary_dim / 2, fp64 angles rounded once to fp32 (cos[p * rotary_dim / 2 + i]). It records the layout and
/// the attention factor, so a rotation needs the table alone. Filled by build_rope_table on either backend, in
/// that backend's memory; make() sizes it for a config and head_dim.
struct RopeTableView {
  float* cos = nullptr;  ///< [positions, rotary_dim / 2]
  float* sin = nullptr;  ///< [positions, rotary_dim / 2]
  std::int32_t positions = 0;
  std::int32_t rotary_dim = 0;
  RopeLayout layout = RopeLayout::neox;
  float attention_factor = 1.0f;

  KVSIFT_HOST_DEVICE std::int32_t pairs() const { return rotary_dim / 2; }

  /// Elements of each of cos and sin for `positions` positions of `config` at `head_dim`.
  static std::int64_t elements(const RopeConfig& config, std::int32_t head_dim, std::int32_t positions) {
    return std::int64_t(positions) * (config.resolved_rotary_dim(head_dim) / 2);
  }
  static RopeTableView make(const RopeConfig& config, std::int32_t head_dim, std::int32_t positions, float* cos,
                            float* sin) {
    return {cos, sin, positions, config.resolved_rotary_dim(head_dim), config.layout,
            float(config.attention_factor())};
  }
};

/// One table entry: cos and sin of position p for a pair of inverse frequency inv_freq (RopeConfig::inv_freq),
/// the angle p * inv_freq in fp64, rounded once.
KVSIFT_HOST_DEVICE inline void rope_table_entry(double inv_freq, std::int32_t p, float& c, float& s) {
  const double angle = double(p) * inv_freq;
  c = float(::cos(angle));
  s = float(::sin(angle));
}

/// The rotation of one pair (xa, xb) by cos c and sin s (negated sin: the inverse), times `scale`: the fp32
/// products are exact in fp64 and their difference rounds once there, so the result is the same on every
/// backend whether or not the compiler fuses multiply-adds; one rounding to fp32 follows.
KVSIFT_HOST_DEVICE inline void rope_rotate_pair(float& xa, float& xb, float c, float s, double scale) {
  const double a = xa, b = xb;
  const double ya = a * double(c) - b * double(s);
  const double yb = a * double(s) + b * double(c);
  xa = float(ya * scale);
  xb = float(yb * scale);
}

/// The table entry of a rotation by `delta` (negative: the other way) or, with inverse, by -delta: cos and sin
/// of |delta|'s row with sin negated as needed. Returns false when |delta| is not a row of the table.
KVSIFT_HOST_DEVICE inline bool rope_lookup(const RopeTableView& table, std::int64_t delta, bool inverse,
                                           std::int32_t i, float& c, float& s) {
  const std::int64_t p = delta < 0 ? -delta : delta;
  if (p >= table.positions) return false;
  const std::int64_t e = p * table.pairs() + i;
  c = table.cos[e];
  s = ((delta < 0) != inverse) ? -table.sin[e] : table.sin[e];
  return true;
}

/// Rotates x[0 .. head_dim) in place for token position `pos`, or undoes that rotation, entirely in fp64 (no
/// table): the reference that synthetic workloads and tests use. The attention factor applies as in the table
/// primitives (multiplied forward, divided on inverse).
inline void apply_rope(float* x, std::int32_t head_dim, std::int64_t pos, const RopeConfig& cfg, bool inverse = false) {
  const std::int32_t rotary = cfg.resolved_rotary_dim(head_dim);
  const std::int32_t half = rotary / 2;
  const double scale = inverse ? 1.0 / cfg.attention_factor() : cfg.attention_factor();
  for (std::int32_t i = 0; i < half; ++i) {
    const double angle = (inverse ? -1.0 : 1.0) * static_cast<double>(pos) * cfg.inv_freq(i, rotary);
    const double c = std::cos(angle), s = std::sin(angle);
    std::int32_t a = 0, b = 0;
    rope_pair(cfg.layout, i, half, a, b);
    const double xa = x[a], xb = x[b];
    x[a] = static_cast<float>((xa * c - xb * s) * scale);
    x[b] = static_cast<float>((xa * s + xb * c) * scale);
  }
}

}  // namespace kvsift
