#pragma once
/// The argument checks that cpu/rope.hpp and cuda/rope.hpp share (each adds its own memory rules).

#include <cmath>
#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/validate.hpp"

namespace kvsift::detail {

/// The scaling parameters' rules (validate(RopeConfig) checks theta and rotary_dim): factor >= 1 for linear,
/// llama3 and yarn; llama3: original_max_position_embeddings > 0 and 0 < low_freq_factor < high_freq_factor;
/// yarn: original_max_position_embeddings > 0, beta_fast > beta_slow > 0, attention_factor >= 0.
inline void check_rope_scaling(const RopeConfig& rope, const char* where) {
  const RopeScalingConfig& s = rope.scaling;
  KVSIFT_CHECK(s.kind == RopeScaling::none || s.kind == RopeScaling::linear || s.kind == RopeScaling::llama3 ||
                   s.kind == RopeScaling::yarn,
               where, "unknown RopeScaling ({})", int(s.kind));
  if (s.kind == RopeScaling::none) return;
  KVSIFT_CHECK(s.factor >= 1.0, where, "rope.scaling.factor (= {}) must be >= 1", s.factor);
  if (s.kind == RopeScaling::linear) return;
  KVSIFT_CHECK(s.original_max_position_embeddings > 0, where,
               "rope.scaling.original_max_position_embeddings (= {}) must be positive",
               s.original_max_position_embeddings);
  if (s.kind == RopeScaling::llama3) {
    KVSIFT_CHECK(s.low_freq_factor > 0.0 && s.low_freq_factor < s.high_freq_factor, where,
                 "rope.scaling low_freq_factor (= {}) and high_freq_factor (= {}) must satisfy 0 < low < high",
                 s.low_freq_factor, s.high_freq_factor);
    return;
  }
  KVSIFT_CHECK(s.beta_slow > 0.0 && s.beta_fast > s.beta_slow, where,
               "rope.scaling beta_fast (= {}) and beta_slow (= {}) must satisfy beta_fast > beta_slow > 0", s.beta_fast,
               s.beta_slow);
  KVSIFT_CHECK(s.attention_factor >= 0.0 && s.mscale >= 0.0 && s.mscale_all_dim >= 0.0, where,
               "rope.scaling attention_factor (= {}), mscale (= {}) and mscale_all_dim (= {}) must be >= 0",
               s.attention_factor, s.mscale, s.mscale_all_dim);
}

/// A table the rotations can read: arrays present, positions > 0, rotary_dim even in [2, head_dim], a known
/// layout, a finite positive attention factor.
inline void check_rope_table(const char* where, const RopeTableView& table, std::int32_t head_dim) {
  KVSIFT_CHECK(table.cos != nullptr && table.sin != nullptr, where, "table.cos and table.sin must be non-null");
  KVSIFT_CHECK(table.positions > 0, where, "table.positions (= {}) must be positive", table.positions);
  KVSIFT_CHECK(table.rotary_dim >= 2 && table.rotary_dim <= head_dim && table.rotary_dim % 2 == 0, where,
               "table.rotary_dim (= {}) must be even and in [2, head_dim = {}]", table.rotary_dim, head_dim);
  KVSIFT_CHECK(table.layout == RopeLayout::neox || table.layout == RopeLayout::interleaved, where,
               "unknown table.layout ({})", int(table.layout));
  KVSIFT_CHECK(std::isfinite(table.attention_factor) && table.attention_factor > 0.0f, where,
               "table.attention_factor (= {}) must be finite and positive", table.attention_factor);
}

/// build_rope_table's: a valid config whose rotary dim, layout and attention factor are the table's.
inline void check_rope_table_build(const char* where, const RopeConfig& config, const RopeTableView& table) {
  KVSIFT_CHECK(config.rotary_dim == 0 || config.rotary_dim == table.rotary_dim, where,
               "config.rotary_dim (= {}) != table.rotary_dim (= {})", config.rotary_dim, table.rotary_dim);
  validate(config, table.rotary_dim, where);
  check_rope_scaling(config, where);
  check_rope_table(where, table, table.rotary_dim);
  KVSIFT_CHECK(table.layout == config.layout, where, "table.layout ({}) != config.layout ({})", int(table.layout),
               int(config.layout));
  KVSIFT_CHECK(table.attention_factor == float(config.attention_factor()), where,
               "table.attention_factor (= {}) != the config's (= {}); make the table with RopeTableView::make",
               table.attention_factor, config.attention_factor());
}

/// rotate_to_position's target: a position.
inline void check_rope_target(const char* where, std::int32_t target) {
  KVSIFT_CHECK(target >= 0, where, "target (= {}) must be >= 0", target);
}

/// Rows of x, their positions (or deltas) and the table agree; rows * pairs fits the launch's index type.
template <class V>
void check_rope_rows(const char* where, const V& x, const std::int32_t* positions, const RopeTableView& table,
                     const char* positions_name) {
  validate(x, where, "x");
  KVSIFT_CHECK(positions != nullptr, where, "{} is a null pointer", positions_name);
  if constexpr (requires { x.head_dim; }) {
    check_rope_table(where, table, x.head_dim);
  } else {
    check_rope_table(where, table, x.cols);
  }
}

}  // namespace kvsift::detail
