#pragma once
/// Rotary position embedding (RoPE) on one head vector, in the two layouts models use. Pairs rotate by
/// angle pos * theta^(-2i / rotary_dim), i in [0, rotary_dim / 2); channels at or past rotary_dim are left
/// alone. neox (GPT-NeoX, Llama in HF) pairs channel i with i + rotary_dim / 2; interleaved (GPT-J, Meta's
/// original Llama) pairs 2i with 2i + 1. The rotation is orthogonal, so `inverse` recovers pre-RoPE vectors.

#include <cmath>
#include <cstdint>

#include "kvsift/core/config.hpp"

namespace kvsift {

enum class RopeLayout : std::uint8_t { neox, interleaved };

struct RopeConfig {
  double theta = 10000.0;
  std::int32_t rotary_dim = 0;  ///< 0 means head_dim
  RopeLayout layout = RopeLayout::neox;

  KVSIFT_HOST_DEVICE std::int32_t resolved_rotary_dim(std::int32_t head_dim) const {
    return rotary_dim == 0 ? head_dim : rotary_dim;
  }
};

/// Rotates x[0 .. head_dim) in place for token position `pos`; with inverse = true undoes that rotation.
inline void apply_rope(float* x, std::int32_t head_dim, std::int64_t pos, const RopeConfig& cfg, bool inverse = false) {
  const std::int32_t rotary = cfg.resolved_rotary_dim(head_dim);
  const std::int32_t half = rotary / 2;
  for (std::int32_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(cfg.theta, -2.0 * i / rotary);
    const double angle = (inverse ? -1.0 : 1.0) * static_cast<double>(pos) * inv_freq;
    const double c = std::cos(angle), s = std::sin(angle);
    const std::int32_t a = cfg.layout == RopeLayout::neox ? i : 2 * i;
    const std::int32_t b = cfg.layout == RopeLayout::neox ? i + half : 2 * i + 1;
    const double xa = x[a], xb = x[b];
    x[a] = static_cast<float>(xa * c - xb * s);
    x[b] = static_cast<float>(xa * s + xb * c);
  }
}

}  // namespace kvsift
