#pragma once
/// OracleTopK: the exact top-K selector, the upper bound every retrieval method is measured against.
///
/// Score of token t for kv head g: the largest softmax weight any query head of g's GQA group gives t,
/// computed exactly over all tokens (as CTKVR and SpeContext reduce a group, by max). The first `sink`
/// tokens and the last `recent` tokens are always kept and count against the budget; the rest of the
/// budget goes to the best-scoring other tokens (ties: smaller index). A sequence of at most `budget`
/// tokens (ragged batches, the empty one included) gets every token. Indices are written ascending;
/// log-weights, if the selection has them, are set to 0.
///
/// The index is a copy of every key in fp32: index_bytes() = 4 * head_dim * tokens * kv_heads * batch.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string_view>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/selector.hpp"
#include "kvsift/cpu/topk.hpp"
#include "kvsift/selectors/detail/selector_shape.hpp"

namespace kvsift {

struct OracleTopKConfig {
  std::int32_t budget = 0;  ///< tokens selected per (sequence, kv head), sink and recent included
  std::int32_t sink = 0;    ///< leading tokens always kept
  std::int32_t recent = 0;  ///< trailing tokens always kept
  AttentionOptions attention{};
};

class OracleTopK {
 public:
  using element_type = float;

  explicit OracleTopK(const OracleTopKConfig& config) : config_(config) {
    constexpr const char* where = "OracleTopK";
    KVSIFT_CHECK(config.budget > 0, where, "config.budget (= {}) must be positive", config.budget);
    KVSIFT_CHECK(config.sink >= 0 && config.recent >= 0, where, "config.sink (= {}) and config.recent (= {}) must be >= 0",
                 config.sink, config.recent);
    KVSIFT_CHECK(config.sink + config.recent <= config.budget, where,
                 "config.sink + config.recent (= {}) exceeds config.budget (= {})", config.sink + config.recent,
                 config.budget);
  }

  std::string_view name() const { return "OracleTopK"; }

  void prepare(const PrefillInputs<float>& in) {
    shape_.prepare("OracleTopK::prepare", in.kv);
    keys_.assign(static_cast<std::size_t>(shape_.batch()) * shape_.kv_heads(), {});
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      for (std::int32_t h = 0; h < shape_.kv_heads(); ++h) {
        auto& dst = keys_[shape_.row(b, h)];
        dst.resize(static_cast<std::size_t>(shape_.length(b)) * shape_.head_dim());
        for (std::int32_t t = 0; t < shape_.length(b); ++t) {
          std::copy_n(in.kv.k_row(b, h, t), shape_.head_dim(), dst.data() + static_cast<std::size_t>(t) * shape_.head_dim());
        }
      }
    }
  }

  void append(const AppendInputs<float>& step) {
    shape_.append("OracleTopK::append", step);
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      for (std::int32_t h = 0; h < shape_.kv_heads(); ++h) {
        const float* k = step.k.row(b, h);
        keys_[shape_.row(b, h)].insert(keys_[shape_.row(b, h)].end(), k, k + shape_.head_dim());
      }
    }
  }

  void select(const QueryView<const float>& q, const SelectionView& out) {
    constexpr const char* where = "OracleTopK::select";
    const std::int32_t group = shape_.check_select(where, q, out, config_.budget);
    const double scale = config_.attention.resolved_scale(shape_.head_dim());
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      const std::int32_t n = shape_.length(b);
      for (std::int32_t g = 0; g < shape_.kv_heads(); ++g) {
        if (n <= config_.budget) {  // every token, as StreamingLLM and Quest do
          std::iota(out.row(b, g), out.row(b, g) + n, 0);
          out.counts[out.row_index(b, g)] = n;
          if (float* lw = out.weights_row(b, g)) std::fill_n(lw, n, 0.0f);
          continue;
        }
        group_scores(q, b, g, group, scale, n);
        const float keep = std::numeric_limits<float>::infinity();
        std::fill_n(scores_.begin(), std::min(config_.sink, n), keep);
        std::fill(scores_.begin() + std::max(0, n - config_.recent), scores_.begin() + n, keep);
        cpu::topk_indices({scores_.data(), static_cast<std::size_t>(n)}, config_.budget,
                          {out.row(b, g), static_cast<std::size_t>(config_.budget)}, topk_scratch_);
        out.counts[out.row_index(b, g)] = config_.budget;
        if (float* lw = out.weights_row(b, g)) std::fill_n(lw, config_.budget, 0.0f);
      }
    }
  }

  std::size_t index_bytes() const {
    std::size_t bytes = 0;
    for (const auto& k : keys_) bytes += k.size() * sizeof(float);
    return bytes;
  }

 private:
  void group_scores(const QueryView<const float>& q, std::int32_t b, std::int32_t g, std::int32_t group, double scale,
                    std::int32_t n) {
    scores_.assign(static_cast<std::size_t>(n), 0.0f);
    logits_.resize(static_cast<std::size_t>(n));
    const float* keys = keys_[shape_.row(b, g)].data();
    for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
      const float* qh = q.row(b, h);
      double max_logit = -std::numeric_limits<double>::infinity();
      for (std::int32_t t = 0; t < n; ++t) {
        const float* k = keys + static_cast<std::size_t>(t) * shape_.head_dim();
        double dot = 0.0;
        for (std::int32_t c = 0; c < shape_.head_dim(); ++c) dot += double(qh[c]) * double(k[c]);
        logits_[t] = scale * dot;
        max_logit = std::max(max_logit, logits_[t]);
      }
      double denom = 0.0;
      for (std::int32_t t = 0; t < n; ++t) denom += std::exp(logits_[t] - max_logit);
      for (std::int32_t t = 0; t < n; ++t) {
        scores_[t] = std::max(scores_[t], static_cast<float>(std::exp(logits_[t] - max_logit) / denom));
      }
    }
  }

  OracleTopKConfig config_;
  detail::SelectorShape shape_;
  std::vector<std::vector<float>> keys_;  ///< per (b, kv head): [tokens, head_dim]
  std::vector<float> scores_;
  std::vector<double> logits_;
  std::vector<std::uint64_t> topk_scratch_;
};

static_assert(KVSelector<OracleTopK>);

}  // namespace kvsift
