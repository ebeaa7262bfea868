#pragma once
#include <cmath>
#include <cstdint>

namespace kvsift {

/// Options shared by every decode-attention entry point (reference, CPU, CUDA).
struct AttentionOptions {
  /// Logit scale applied to q.k; 0 selects the default 1/sqrt(head_dim).
  float sm_scale = 0.0f;

  float resolved_scale(std::int32_t head_dim) const {
    return sm_scale != 0.0f ? sm_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));
  }
};

}  // namespace kvsift
