#pragma once
/// OracleTopK: the exact top-K selector, the upper bound every retrieval method is measured against.
///
/// Score of token t for kv head g: the largest softmax weight any query head of g's GQA group gives t,
/// computed exactly over all tokens (as CTKVR and SpeContext reduce a group, by max). The first `sink`
/// tokens and the last `recent` tokens are always kept and count against the budget; the rest of the
/// budget goes to the best-scoring other tokens (ties: smaller index). Indices are written ascending;
/// log-weights, if the selection has them, are set to 0.
///
/// The index is a copy of every key in fp32: index_bytes() = 4 * head_dim * tokens * kv_heads * batch.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/selector.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/cpu/topk.hpp"

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
    constexpr const char* where = "OracleTopK::prepare";
    validate(in.kv, where, "kv", MemorySpace::host);
    batch_ = in.kv.batch;
    kv_heads_ = in.kv.kv_heads;
    head_dim_ = in.kv.head_dim;
    lengths_.assign(batch_, 0);
    keys_.assign(static_cast<std::size_t>(batch_) * kv_heads_, {});
    for (std::int32_t b = 0; b < batch_; ++b) {
      lengths_[b] = in.kv.seq_len(b);
      for (std::int32_t h = 0; h < kv_heads_; ++h) {
        auto& dst = keys_[b * kv_heads_ + h];
        dst.resize(static_cast<std::size_t>(lengths_[b]) * head_dim_);
        for (std::int32_t t = 0; t < lengths_[b]; ++t) {
          std::copy_n(in.kv.k_row(b, h, t), head_dim_, dst.data() + static_cast<std::size_t>(t) * head_dim_);
        }
      }
    }
  }

  void append(const AppendInputs<float>& step) {
    constexpr const char* where = "OracleTopK::append";
    require_prepared(where);
    validate(step.k, where, "k");
    KVSIFT_CHECK(step.k.batch == batch_ && step.k.heads == kv_heads_ && step.k.head_dim == head_dim_, where,
                 "k shape [{}, {}, {}] != prepared [batch = {}, kv_heads = {}, head_dim = {}]", step.k.batch,
                 step.k.heads, step.k.head_dim, batch_, kv_heads_, head_dim_);
    for (std::int32_t b = 0; b < batch_; ++b) {
      for (std::int32_t h = 0; h < kv_heads_; ++h) {
        const float* k = step.k.row(b, h);
        keys_[b * kv_heads_ + h].insert(keys_[b * kv_heads_ + h].end(), k, k + head_dim_);
      }
      ++lengths_[b];
    }
  }

  void select(const QueryView<const float>& q, const SelectionView& out) {
    constexpr const char* where = "OracleTopK::select";
    require_prepared(where);
    validate(q, where, "q");
    KVSIFT_CHECK(q.batch == batch_ && q.head_dim == head_dim_, where,
                 "q batch (= {}) / head_dim (= {}) != prepared batch (= {}) / head_dim (= {})", q.batch, q.head_dim,
                 batch_, head_dim_);
    KVSIFT_CHECK(q.heads % kv_heads_ == 0, where, "q.heads (= {}) is not a multiple of kv_heads (= {})", q.heads,
                 kv_heads_);
    KVSIFT_CHECK(out.indices && out.counts, where, "out.indices and out.counts must be non-null");
    KVSIFT_CHECK(out.batch == batch_ && out.kv_heads == kv_heads_, where,
                 "out [batch = {}, kv_heads = {}] != prepared [batch = {}, kv_heads = {}]", out.batch, out.kv_heads,
                 batch_, kv_heads_);
    KVSIFT_CHECK(out.capacity >= config_.budget, where, "out.capacity (= {}) is smaller than budget (= {})",
                 out.capacity, config_.budget);
    const std::int32_t group = q.heads / kv_heads_;
    const double scale = config_.attention.resolved_scale(head_dim_);
    for (std::int32_t b = 0; b < batch_; ++b) {
      const std::int32_t n = lengths_[b];
      KVSIFT_CHECK(config_.budget <= n, where, "budget (= {}) exceeds the tokens available (= {}) at batch {}",
                   config_.budget, n, b);
      for (std::int32_t g = 0; g < kv_heads_; ++g) {
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
  void require_prepared(const char* where) const {
    KVSIFT_CHECK(batch_ > 0, where, "prepare() has not been called");
  }

  void group_scores(const QueryView<const float>& q, std::int32_t b, std::int32_t g, std::int32_t group, double scale,
                    std::int32_t n) {
    scores_.assign(static_cast<std::size_t>(n), 0.0f);
    logits_.resize(static_cast<std::size_t>(n));
    const float* keys = keys_[b * kv_heads_ + g].data();
    for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
      const float* qh = q.row(b, h);
      double max_logit = -std::numeric_limits<double>::infinity();
      for (std::int32_t t = 0; t < n; ++t) {
        const float* k = keys + static_cast<std::size_t>(t) * head_dim_;
        double dot = 0.0;
        for (std::int32_t c = 0; c < head_dim_; ++c) dot += double(qh[c]) * double(k[c]);
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
  std::int32_t batch_ = 0;
  std::int32_t kv_heads_ = 0;
  std::int32_t head_dim_ = 0;
  std::vector<std::int32_t> lengths_;
  std::vector<std::vector<float>> keys_;  ///< per (b, kv head): [tokens, head_dim]
  std::vector<float> scores_;
  std::vector<double> logits_;
  std::vector<std::uint64_t> topk_scratch_;
};

static_assert(KVSelector<OracleTopK>);

}  // namespace kvsift
