#pragma once
/// Fidelity metrics for a selection against exact attention (host memory, fp64 accumulation).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

/// Exact attention of every (sequence, query head) over its seq_len tokens, no log-weights: the unnormalized
/// weights exp(logit - max logit) and their sums, in fp64. Computed once, it scores any number of selections
/// of the same query (attention_mass_recall below); the fidelity harness scores every selector and budget
/// against one per decode position.
struct AttentionWeights {
  std::int32_t batch = 0;
  std::int32_t heads = 0;
  std::int32_t group = 1;                ///< query heads per kv head
  std::vector<std::int32_t> seq_lens;    ///< [batch]
  std::vector<std::size_t> row_offsets;  ///< [batch * heads]: where a (sequence, head)'s weights start
  std::vector<double> weights;           ///< per (sequence, head): seq_len values
  std::vector<double> denominators;      ///< [batch * heads]

  const double* row(std::int32_t b, std::int32_t h) const { return weights.data() + row_offsets[std::size_t(b) * heads + h]; }
};

template <class TQ, KVCacheView KV>
AttentionWeights attention_weights(const QueryView<TQ>& q, const KV& kv, const AttentionOptions& opts = {}) {
  constexpr const char* where = "attention_weights";
  validate(q, where, "q");
  validate(kv, where, "kv", MemorySpace::host);
  KVSIFT_CHECK(q.heads % kv.kv_heads == 0, where, "q.heads (= {}) is not a multiple of kv.kv_heads (= {})", q.heads,
               kv.kv_heads);
  AttentionWeights out;
  out.batch = q.batch;
  out.heads = q.heads;
  out.group = q.heads / kv.kv_heads;
  const double scale = opts.resolved_scale(q.head_dim);
  for (std::int32_t b = 0; b < q.batch; ++b) {
    const std::int32_t n = kv.seq_len(b);
    out.seq_lens.push_back(n);
    for (std::int32_t h = 0; h < q.heads; ++h) {
      const std::int32_t g = h / out.group;
      out.row_offsets.push_back(out.weights.size());
      double max_logit = -INFINITY;
      for (std::int32_t t = 0; t < n; ++t) {
        const auto* k = kv.k_row(b, g, t);
        double dot = 0.0;
        for (std::int32_t c = 0; c < q.head_dim; ++c) dot += double(to_float(q.row(b, h)[c])) * double(to_float(k[c]));
        out.weights.push_back(scale * dot);
        max_logit = std::max(max_logit, out.weights.back());
      }
      double denom = 0.0;
      double* logits = out.weights.data() + out.row_offsets.back();
      for (std::int32_t t = 0; t < n; ++t) denom += logits[t] = std::exp(logits[t] - max_logit);
      out.denominators.push_back(denom);
    }
  }
  return out;
}

/// Attention-mass recall of every (sequence, query head) separately, [batch * heads] in that order: the exact
/// softmax mass (over all seq_len tokens, no log-weights) that the selected tokens carry. 1 means nothing
/// attended was dropped; a sequence with no tokens has nothing to drop and counts as 1.
inline std::vector<double> attention_mass_recall_per_head(const AttentionWeights& attention,
                                                          const SelectionView& selection) {
  constexpr const char* where = "attention_mass_recall";
  KVSIFT_CHECK(selection.batch == attention.batch && selection.kv_heads * attention.group == attention.heads, where,
               "selection shape (batch {}, kv_heads {}) does not match the attention (batch {}, q_heads {}, group {})",
               selection.batch, selection.kv_heads, attention.batch, attention.heads, attention.group);
  std::vector<double> out;
  out.reserve(std::size_t(attention.batch) * attention.heads);
  for (std::int32_t b = 0; b < attention.batch; ++b) {
    for (std::int32_t h = 0; h < attention.heads; ++h) {
      const std::int32_t g = h / attention.group;
      const double* weights = attention.row(b, h);
      const std::int32_t* idx = selection.row(b, g);
      double kept = 0.0;
      for (std::int32_t i = 0; i < selection.count(b, g); ++i) {
        KVSIFT_CHECK(idx[i] >= 0 && idx[i] < attention.seq_lens[b], where,
                     "selection index {} at batch {}, kv_head {} is outside [0, seq_len = {})", idx[i], b, g,
                     attention.seq_lens[b]);
        kept += weights[idx[i]];
      }
      const double denominator = attention.denominators[std::size_t(b) * attention.heads + h];
      out.push_back(attention.seq_lens[b] == 0 ? 1.0 : kept / denominator);
    }
  }
  return out;
}

/// The mean of attention_mass_recall_per_head over every (sequence, query head).
inline double attention_mass_recall(const AttentionWeights& attention, const SelectionView& selection) {
  const std::vector<double> per_head = attention_mass_recall_per_head(attention, selection);
  double total = 0.0;
  for (double r : per_head) total += r;
  return total / double(per_head.size());
}

template <class TQ, KVCacheView KV>
double attention_mass_recall(const QueryView<TQ>& q, const KV& kv, const SelectionView& selection,
                             const AttentionOptions& opts = {}) {
  validate(selection, kv, "attention_mass_recall", "selection");
  check_selection_contents(selection, kv, "attention_mass_recall", "selection", /*refuse_duplicates=*/true);
  return attention_mass_recall(attention_weights(q, kv, opts), selection);
}

/// ||a - ref||_2 / ||ref||_2 in fp64. Against a zero (or empty) reference: 0 when a is zero too, else +inf.
inline double relative_l2_error(std::span<const float> a, std::span<const float> ref) {
  KVSIFT_CHECK(a.size() == ref.size(), "relative_l2_error", "sizes differ ({} vs {})", a.size(), ref.size());
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(ref[i]);
    num += d * d;
    den += double(ref[i]) * double(ref[i]);
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num) / std::sqrt(den);
}

/// relative_l2_error of each row of `row_size` consecutive values, e.g. per (sequence, query head) of an
/// attention output [batch, q_heads, head_dim] with row_size = head_dim: a.size() / row_size values, in row
/// order. a and ref must have the same size, a multiple of row_size (> 0).
inline std::vector<double> relative_l2_error_per_row(std::span<const float> a, std::span<const float> ref,
                                                     std::size_t row_size) {
  constexpr const char* where = "relative_l2_error_per_row";
  KVSIFT_CHECK(a.size() == ref.size(), where, "sizes differ ({} vs {})", a.size(), ref.size());
  KVSIFT_CHECK(row_size > 0 && a.size() % row_size == 0, where, "size {} is not a multiple of row_size (= {})",
               a.size(), row_size);
  std::vector<double> out;
  out.reserve(a.size() / row_size);
  for (std::size_t r = 0; r < a.size(); r += row_size) {
    out.push_back(relative_l2_error(a.subspan(r, row_size), ref.subspan(r, row_size)));
  }
  return out;
}

}  // namespace kvsift
