#pragma once
/// Captures of real attention inputs written by tools/capture (format in tools/capture/capture.py): for
/// chosen layers of a real model, every position's pre- and post-RoPE Q and K, and V, in fp16.
/// read_capture validates everything it reads and refuses a truncated or inconsistent file with
/// kvsift::Error naming the problem: a path that is a directory, a header value that is not a number of its kind
/// (every count and index an integer in range, rope_theta a finite number > 0: "12x", "nan", "-5" are refused,
/// naming the field and the text), and an array holding a NaN or an infinity (naming the array, the layer and the
/// first such value's token, head and channel). Non-finite data is refused at load, not propagated by the
/// statistics: read_capture is the one way captures enter kvsift, and the fidelity harness's percentiles and the
/// selectors would otherwise let a NaN vanish (a NaN key is never selected; a sorted NaN leaves p10 and p90 finite).

#include <cstdint>
#include <string>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

struct CaptureLayer {
  std::int32_t layer = 0;
  std::vector<half> q_pre, q;        ///< [tokens, q_heads, head_dim]
  std::vector<half> k_pre, k, v;     ///< [tokens, kv_heads, head_dim]
};

struct Capture {
  std::string model, text_id;
  std::int32_t tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  RopeConfig rope;
  std::vector<CaptureLayer> layers;

  /// Layer i's post-RoPE (or pre-RoPE) queries of every position as [1, q_heads, tokens, head_dim].
  SequenceView<const half> queries(std::size_t i, bool pre_rope = false) const {
    const auto& data = pre_rope ? layers.at(i).q_pre : layers.at(i).q;
    return {data.data(), 1, q_heads, tokens, head_dim, std::int64_t(tokens) * q_heads * head_dim, head_dim,
            std::int64_t(q_heads) * head_dim};
  }
  /// Layer i's post-RoPE keys and values as a KV cache of one sequence holding `length` tokens.
  ContiguousKVView<const half> kv(std::size_t i, const std::int32_t* length = nullptr) const {
    const auto& l = layers.at(i);
    return {l.k.data(), l.v.data(), length, 1, kv_heads, tokens, head_dim,
            std::int64_t(tokens) * kv_heads * head_dim, head_dim, std::int64_t(kv_heads) * head_dim};
  }
};

Capture read_capture(const std::string& path);

}  // namespace kvsift
