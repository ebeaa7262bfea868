#include "kvsift/selectors/fidelity.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <optional>
#include <set>

#include "kvsift/attention/metrics.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/selection_buffer.hpp"
#include "kvsift/selectors/oracle_topk.hpp"
#include "kvsift/selectors/quest.hpp"
#include "kvsift/selectors/streaming_llm.hpp"

namespace kvsift {
namespace {

/// One capture layer in fp32, in the capture's [token][head][channel] layout, viewed as prefixes.
struct FloatLayer {
  std::int32_t tokens, q_heads, kv_heads, head_dim;
  std::vector<float> q, k, v;

  FloatLayer(const Capture& c, const CaptureLayer& layer)
      : tokens(c.tokens), q_heads(c.q_heads), kv_heads(c.kv_heads), head_dim(c.head_dim) {
    const auto widen = [](const std::vector<half>& src) {
      std::vector<float> dst(src.size());
      std::transform(src.begin(), src.end(), dst.begin(), [](half x) { return to_float(x); });
      return dst;
    };
    q = widen(layer.q);
    k = widen(layer.k);
    v = widen(layer.v);
  }
  std::int64_t kv_token_stride() const { return std::int64_t(kv_heads) * head_dim; }
  /// The cache holding tokens [0, *length).
  ContiguousKVView<const float> kv(const std::int32_t* length) const {
    return {k.data(), v.data(), length, 1, kv_heads, tokens, head_dim, tokens * kv_token_stride(), head_dim,
            kv_token_stride()};
  }
  QueryView<const float> query(std::int32_t pos) const {
    return QueryView<const float>::packed(q.data() + std::size_t(pos) * q_heads * head_dim, 1, q_heads, head_dim);
  }
  PrefillInputs<float> prefill(const std::int32_t* length) const {
    const std::int64_t q_token_stride = std::int64_t(q_heads) * head_dim;
    return {{q.data(), 1, q_heads, *length, head_dim, tokens * q_token_stride, head_dim, q_token_stride}, kv(length)};
  }
  AppendInputs<float> token(std::int32_t pos) const {
    const std::size_t offset = std::size_t(pos) * kv_heads * head_dim;
    return {HeadsView<const float>::packed(k.data() + offset, 1, kv_heads, head_dim),
            HeadsView<const float>::packed(v.data() + offset, 1, kv_heads, head_dim), query(pos)};
  }
};

}  // namespace

std::vector<SelectorEntry> reference_selectors() {
  return {
      {"OracleTopK", [](std::int32_t k) { return AnySelector<float>(OracleTopK({.budget = k})); }},
      {"StreamingLLM", [](std::int32_t k) { return AnySelector<float>(StreamingLLM({.budget = k, .sink = std::min(4, k)})); }},
      {"Quest", [](std::int32_t k) { return AnySelector<float>(Quest({.budget = k, .page_size = 16})); }},
  };
}

std::vector<FidelityRow> evaluate_fidelity(const Capture& capture, std::span<const SelectorEntry> selectors,
                                           const FidelityOptions& options) {
  constexpr const char* where = "evaluate_fidelity";
  KVSIFT_CHECK(!capture.layers.empty(), where, "the capture holds no layers");
  KVSIFT_CHECK(options.decode_positions > 0 && options.decode_positions < capture.tokens, where,
               "options.decode_positions (= {}) is outside [1, tokens = {})", options.decode_positions, capture.tokens);
  for (const double budget : options.budgets) {
    KVSIFT_CHECK(budget > 0.0 && budget <= 1.0, where, "budget fraction {} is outside (0, 1]", budget);
  }
  const std::int32_t first_position = capture.tokens - options.decode_positions;
  const std::size_t state_size = std::size_t(capture.q_heads) * capture.head_dim;

  std::vector<FidelityRow> rows;
  for (const double budget : options.budgets) {
    const auto k = std::max<std::int32_t>(1, std::int32_t(std::lround(budget * first_position)));
    for (const auto& entry : selectors) {
      FidelityRow row;
      row.selector = entry.name;
      row.budget = budget;
      row.budget_tokens = k;
      rows.push_back(std::move(row));
    }
  }
  std::vector<std::int64_t> samples(rows.size(), 0);

  std::vector<float> o(state_size), lse(capture.q_heads), lse_dense(capture.q_heads);
  std::vector<float> o_dense(state_size * options.decode_positions);  // [position][head][channel]
  std::vector<AttentionWeights> attention(std::size_t(options.decode_positions));  // what every selection is scored against
  for (const auto& capture_layer : capture.layers) {
    const FloatLayer layer(capture, capture_layer);
    for (std::int32_t pos = first_position, length = first_position; pos < capture.tokens; ++pos, ++length) {
      reference::dense_decode(layer.query(pos), layer.kv(&length),
                              StateView<float>::packed(o_dense.data() + (pos - first_position) * state_size,
                                                       lse_dense.data(), 1, capture.q_heads, capture.head_dim));
      attention[std::size_t(pos - first_position)] = attention_weights(layer.query(pos), layer.kv(&length));
    }
    for (std::size_t b = 0; b < options.budgets.size(); ++b) {
      const std::int32_t k = rows[b * selectors.size()].budget_tokens;
      std::int32_t oracle_length = first_position;
      OracleTopK oracle({.budget = k});
      oracle.prepare(layer.prefill(&oracle_length));
      std::vector<SelectionBuffer> oracle_selections;
      oracle_selections.reserve(std::size_t(options.decode_positions));
      for (std::int32_t pos = first_position; pos < capture.tokens; ++pos) {
        oracle_selections.emplace_back(1, capture.kv_heads, k, true);
        oracle.select(layer.query(pos), oracle_selections.back().view());
        oracle.append(layer.token(pos));
      }
      for (std::size_t s = 0; s < selectors.size(); ++s) {
        FidelityRow& row = rows[b * selectors.size() + s];
        std::optional<AnySelector<float>> selector;
        try {
          selector.emplace(selectors[s].make(k));
        } catch (const Error& e) {
          row.refused = e.what();
          continue;
        }
        std::int32_t length = first_position;
        selector->prepare(layer.prefill(&length));
        SelectionBuffer buffer(1, capture.kv_heads, k, true);
        const SelectionView& selection = buffer.view();
        for (std::int32_t pos = first_position; pos < capture.tokens; ++pos, ++length) {
          const auto q = layer.query(pos);
          const auto kv = layer.kv(&length);
          std::fill(buffer.log_weights().begin(), buffer.log_weights().end(), 0.0f);
          selector->select(q, selection);
          reference::sparse_decode(q, kv, selection,
                                   StateView<float>::packed(o.data(), lse.data(), 1, capture.q_heads, capture.head_dim));
          row.mass_recall += attention_mass_recall(attention[std::size_t(pos - first_position)], selection);
          row.output_error +=
              relative_l2_error(o, std::span(o_dense).subspan((pos - first_position) * state_size, state_size));
          const SelectionView& oracle_view = oracle_selections[pos - first_position].view();
          for (std::int32_t g = 0; g < capture.kv_heads; ++g) {
            const std::set<std::int32_t> chosen(selection.row(0, g), selection.row(0, g) + selection.count(0, g));
            std::int32_t hits = 0;
            for (std::int32_t i = 0; i < oracle_view.count(0, g); ++i) hits += chosen.count(oracle_view.row(0, g)[i]) ? 1 : 0;
            row.id_recall += double(hits) / oracle_view.count(0, g) / capture.kv_heads;
            row.mean_selected += double(selection.count(0, g)) / capture.kv_heads;
          }
          ++samples[b * selectors.size() + s];
          selector->append(layer.token(pos));
        }
      }
    }
  }
  for (std::size_t r = 0; r < rows.size(); ++r) {
    if (samples[r] == 0) continue;
    rows[r].id_recall /= double(samples[r]);
    rows[r].mass_recall /= double(samples[r]);
    rows[r].output_error /= double(samples[r]);
    rows[r].mean_selected /= double(samples[r]);
  }
  return rows;
}

std::string fidelity_markdown(std::span<const FidelityRow> rows) {
  std::string out =
      "| selector | budget | K | id recall | mass recall | output error | tokens selected |\n"
      "|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows) {
    if (!r.refused.empty()) {
      fmt::format_to(std::back_inserter(out), "| {} | {:g}% | {} | refused: {} | | | |\n", r.selector, 100 * r.budget,
                     r.budget_tokens, r.refused);
      continue;
    }
    fmt::format_to(std::back_inserter(out), "| {} | {:g}% | {} | {:.3f} | {:.3f} | {:.3f} | {:.1f} |\n", r.selector,
                   100 * r.budget, r.budget_tokens, r.id_recall, r.mass_recall, r.output_error, r.mean_selected);
  }
  return out;
}

}  // namespace kvsift
