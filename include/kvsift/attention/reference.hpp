#pragma once
/// Scalar reference attention: the oracle every other backend is tested against. Inputs of any storage type
/// are widened to fp64; logits, softmax and the weighted sum of V are computed in fp64 in two passes
/// (maximum, then exponentials), and results are rounded once into the output type. Host memory only.
///
/// GQA: query head h reads kv head h / (q_heads / kv_heads). Outputs: O [batch, q_heads, head_dim] and
/// LSE [batch, q_heads] = natural log of sum_t exp(logit_t), logit_t = sm_scale * q.k_t (+ log-weight_t).
/// A sequence or selection with no tokens, or whose every logit is -inf (log-weights of -inf mask tokens),
/// yields the empty state O = 0 and LSE = -inf. A NaN or +inf logit gives NaN in O and LSE (state.hpp).
/// Duplicate indices in a selection row are attended once per occurrence.

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/attention/state.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::reference {

namespace detail {

/// Attends query row `q` to `count` tokens of (b, kv_head): token i is index_of(i) with log-weight
/// log_weight_of(i). Writes the normalized output and LSE.
template <class TQ, KVCacheView KV, class TO, class IndexOf, class LogWeightOf>
void attend(const TQ* q, const KV& kv, std::int64_t b, std::int64_t kv_head, std::int32_t count, IndexOf index_of,
            LogWeightOf log_weight_of, double scale, TO* o, float& lse, std::vector<double>& logits) {
  const std::int32_t d = kv.head_dim;
  logits.resize(static_cast<std::size_t>(count));
  double max_logit = negative_infinity<double>();
  for (std::int32_t i = 0; i < count; ++i) {
    const auto* k = kv.k_row(b, kv_head, index_of(i));
    double dot = 0.0;
    for (std::int32_t c = 0; c < d; ++c) dot += double(to_float(q[c])) * double(to_float(k[c]));
    logits[i] = scale * dot + double(log_weight_of(i));
    max_logit = max_nan(max_logit, logits[i]);
  }
  const bool empty = max_logit == negative_infinity<double>();
  std::vector<double> acc(static_cast<std::size_t>(d), 0.0);
  double denom = 0.0;
  for (std::int32_t i = 0; i < count && !empty; ++i) {
    const double p = std::exp(logits[i] - max_logit);
    denom += p;
    const auto* v = kv.v_row(b, kv_head, index_of(i));
    for (std::int32_t c = 0; c < d; ++c) acc[c] += p * double(to_float(v[c]));
  }
  for (std::int32_t c = 0; c < d; ++c) o[c] = from_float<TO>(empty ? 0.0f : float(acc[c] / denom));
  lse = empty ? negative_infinity<float>() : float(max_logit + std::log(denom));
}

}  // namespace detail

/// Dense decode attention of each sequence's query over all its seq_len tokens.
template <class TQ, KVCacheView KV, class TO>
void dense_decode(const QueryView<TQ>& q, const KV& kv, const StateView<TO>& out, const AttentionOptions& opts = {}) {
  constexpr const char* where = "reference::dense_decode";
  validate(q, where, "q");
  validate(kv, where, "kv", MemorySpace::host);
  validate(out, where, "out");
  check_decode_shapes(where, q, kv, out);
  check_no_window(where, opts);
  const std::int32_t group = q.heads / kv.kv_heads;
  const double scale = opts.resolved_scale(q.head_dim);
  std::vector<double> logits;
  for (std::int32_t b = 0; b < q.batch; ++b) {
    for (std::int32_t h = 0; h < q.heads; ++h) {
      detail::attend(
          q.row(b, h), kv, b, h / group, kv.seq_len(b), [](std::int32_t i) { return i; },
          [](std::int32_t) { return 0.0f; }, scale, out.o_row(b, h), out.lse_at(b, h), logits);
    }
  }
}

/// Sparse decode attention: query head h of sequence b attends to the attention window (opts.window: its
/// sink tokens, then its recent ones) and to the tokens selection.row(b, kv_head) lists, each selected
/// token's logit plus its log-weight when the selection carries them. Selected tokens inside the window are
/// refused (they would be attended twice); duplicates within a row are attended once per occurrence. With
/// opts.selection_page_size P > 1 the row lists pages: each page's tokens of the middle (neither window nor at
/// or past seq_len), in order, with the page's log-weight. A row whose selection.attend_all entry is nonzero
/// attends every token [0, seq_len) once instead (its count, indices and log-weights are not read). With
/// opts.selection_rows (host memory) batch row b attends selection row opts.selection_rows[b].
template <class TQ, KVCacheView KV, class TO>
void sparse_decode(const QueryView<TQ>& q, const KV& kv, const SelectionView& selection, const StateView<TO>& out,
                   const AttentionOptions& opts = {}) {
  constexpr const char* where = "reference::sparse_decode";
  validate(q, where, "q");
  validate(kv, where, "kv", MemorySpace::host);
  validate(out, where, "out");
  check_decode_shapes(where, q, kv, out);
  validate(selection, kv, where, "selection", opts.selection_rows);
  validate(opts.window, where, "opts.window");
  check_selection_page_size(where, "opts.selection_page_size", opts.selection_page_size);
  check_selection_contents(selection, kv, where, "selection", /*refuse_duplicates=*/false, opts.window,
                           opts.selection_page_size, opts.selection_rows);
  const std::int32_t group = q.heads / kv.kv_heads, page_size = opts.selection_page_size;
  const double scale = opts.resolved_scale(q.head_dim);
  std::vector<double> logits;
  std::vector<std::int32_t> tokens;  // a row's entries as tokens: the window's, then the selected ones
  std::vector<float> weights;
  for (std::int32_t b = 0; b < q.batch; ++b) {
    const std::int32_t length = kv.seq_len(b), window = opts.window.size(length);
    const std::int32_t lo = opts.window.sink_end(length), hi = opts.window.recent_begin(length);
    const std::int64_t r = attended_selection_row(opts.selection_rows, b, selection.batch);  // checked above
    for (std::int32_t h = 0; h < q.heads; ++h) {
      const std::int32_t kv_head = h / group;
      const bool all = selection.attend_all != nullptr && selection.attend_all[selection.row_index(r, kv_head)] != 0;
      if (all) {
        detail::attend(
            q.row(b, h), kv, b, kv_head, length, [](std::int32_t i) { return i; },
            [](std::int32_t) { return 0.0f; }, scale, out.o_row(b, h), out.lse_at(b, h), logits);
        continue;
      }
      const std::int32_t* idx = selection.row(r, kv_head);
      const float* lw = selection.weights_row(r, kv_head);
      tokens.clear();
      weights.clear();
      for (std::int32_t i = 0; i < window; ++i) {
        tokens.push_back(opts.window.token(i, length));
        weights.push_back(0.0f);
      }
      for (std::int32_t i = 0; i < selection.count(r, kv_head); ++i) {
        const std::int64_t first = std::int64_t(idx[i]) * page_size;
        for (std::int64_t t = first; t < first + page_size; ++t) {
          if (page_size > 1 && (t < lo || t >= hi)) continue;
          tokens.push_back(std::int32_t(t));
          weights.push_back(lw == nullptr ? 0.0f : lw[i]);
        }
      }
      detail::attend(
          q.row(b, h), kv, b, kv_head, std::int32_t(tokens.size()), [&](std::int32_t i) { return tokens[i]; },
          [&](std::int32_t i) { return weights[i]; }, scale, out.o_row(b, h), out.lse_at(b, h), logits);
    }
  }
}

/// Merges N partial states of one shape into `out`: LSE = log sum_i exp(LSE_i) and
/// O = sum_i exp(LSE_i - LSE) O_i. Empty partials (LSE = -inf) are skipped; if all are empty, O = 0 and
/// LSE = -inf. A partial with LSE = NaN makes the merged O and LSE NaN. `out` may alias no partial.
template <class TI, class TO>
void merge_states(std::span<const StateView<const TI>> partials, const StateView<TO>& out) {
  constexpr const char* where = "reference::merge_states";
  validate_merge_inputs(where, partials, out);
  std::vector<double> acc(static_cast<std::size_t>(out.head_dim));
  for (std::int32_t b = 0; b < out.batch; ++b) {
    for (std::int32_t h = 0; h < out.heads; ++h) {
      double lse_max = negative_infinity<double>();
      for (const auto& p : partials) lse_max = max_nan(lse_max, double(p.lse_at(b, h)));
      std::fill(acc.begin(), acc.end(), 0.0);
      double weight_sum = 0.0;
      for (const auto& p : partials) {
        if (p.lse_at(b, h) == negative_infinity<float>()) continue;  // only empty partials are skipped
        const double w = state_weight(double(p.lse_at(b, h)), lse_max);
        weight_sum += w;
        const TI* o = p.o_row(b, h);
        for (std::int32_t c = 0; c < out.head_dim; ++c) acc[c] += w * double(to_float(o[c]));
      }
      TO* o = out.o_row(b, h);
      for (std::int32_t c = 0; c < out.head_dim; ++c) {
        o[c] = from_float<TO>(weight_sum == 0.0 ? 0.0f : float(acc[c] / weight_sum));
      }
      out.lse_at(b, h) = float(merged_lse(lse_max, weight_sum));
    }
  }
}

}  // namespace kvsift::reference
