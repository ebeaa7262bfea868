#pragma once
/// Fidelity metrics for a selection against exact attention (host memory, fp64 accumulation).

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

/// Attention-mass recall: the exact softmax mass (over all seq_len tokens, no log-weights) that the
/// selected tokens carry, averaged over every (sequence, query head). 1 means nothing attended was dropped.
template <class TQ, KVCacheView KV>
double attention_mass_recall(const QueryView<TQ>& q, const KV& kv, const SelectionView& selection,
                             const AttentionOptions& opts = {}) {
  constexpr const char* where = "attention_mass_recall";
  validate(q, where, "q");
  validate(kv, where, "kv", MemorySpace::host);
  validate(selection, kv, where, "selection", MemorySpace::host);
  KVSIFT_CHECK(q.heads % kv.kv_heads == 0, where, "q.heads (= {}) is not a multiple of kv.kv_heads (= {})", q.heads,
               kv.kv_heads);
  const std::int32_t group = q.heads / kv.kv_heads;
  const double scale = opts.resolved_scale(q.head_dim);
  std::vector<double> logits;
  double total = 0.0;
  for (std::int32_t b = 0; b < q.batch; ++b) {
    const std::int32_t n = kv.seq_len(b);
    logits.resize(static_cast<std::size_t>(n));
    for (std::int32_t h = 0; h < q.heads; ++h) {
      const std::int32_t g = h / group;
      double max_logit = -INFINITY;
      for (std::int32_t t = 0; t < n; ++t) {
        const auto* k = kv.k_row(b, g, t);
        double dot = 0.0;
        for (std::int32_t c = 0; c < q.head_dim; ++c) dot += double(to_float(q.row(b, h)[c])) * double(to_float(k[c]));
        logits[t] = scale * dot;
        max_logit = std::max(max_logit, logits[t]);
      }
      double denom = 0.0;
      for (std::int32_t t = 0; t < n; ++t) denom += std::exp(logits[t] - max_logit);
      double kept = 0.0;
      const std::int32_t* idx = selection.row(b, g);
      for (std::int32_t i = 0; i < selection.count(b, g); ++i) kept += std::exp(logits[idx[i]] - max_logit);
      total += kept / denom;
    }
  }
  return total / (double(q.batch) * q.heads);
}

/// ||a - ref||_2 / ||ref||_2 in fp64.
inline double relative_l2_error(std::span<const float> a, std::span<const float> ref) {
  KVSIFT_CHECK(a.size() == ref.size(), "relative_l2_error", "sizes differ ({} vs {})", a.size(), ref.size());
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(num) / std::sqrt(den);
}

}  // namespace kvsift
