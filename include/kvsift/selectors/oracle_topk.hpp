#pragma once
/// OracleTopK: the exact top-K selector, the upper bound every retrieval method is measured against.
///
/// Score of token t for kv head g: the largest softmax weight any query head of g's GQA group gives t,
/// computed over all tokens (as CTKVR and SpeContext reduce a group, by max) by cpu::group_scores (softmax,
/// max; fp32 with fp32 accumulation). The first `sink` tokens and the last `recent` tokens (the attention
/// window, attention/options.hpp) are always kept and count against the budget; the rest of the budget,
/// budget - sink - recent, goes to the best-scoring tokens of the middle, chosen by cpu::topk_rows (ties:
/// smaller index). A sequence of at most `budget` tokens (ragged batches, the empty one included) gets every
/// token. Indices are written ascending (sink tokens, chosen middle tokens, recent tokens); log-weights, if
/// the selection has them, are set to 0. Runs on the calling thread; uses kvsift::cpu (link kvsift::cpu).
///
/// The index is a copy of every key in fp32, token-major ([token, batch, kv_heads, head_dim], so that append()
/// only adds rows), shorter sequences padded to the longest: index_bytes() = 4 * head_dim * kv_heads * batch *
/// (the longest sequence's tokens).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string_view>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/selector.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/primitives.hpp"
#include "kvsift/cpu/topk.hpp"
#include "kvsift/selectors/detail/selector_shape.hpp"

namespace kvsift {

struct OracleTopKConfig {
  std::int32_t budget = 0;  ///< tokens selected per (sequence, kv head), sink and recent included
  std::int32_t sink = 0;    ///< leading tokens always kept
  std::int32_t recent = 0;  ///< trailing tokens always kept
  AttentionOptions attention{};  ///< its sm_scale ranks the tokens; the kept tokens are sink and recent above
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
    KVSIFT_CHECK(config.attention.window.empty(), where,
                 "config.attention.window (sink = {}, recent = {}) is not used: set config.sink and config.recent",
                 config.attention.window.sink, config.attention.window.recent);
  }

  std::string_view name() const { return "OracleTopK"; }

  void prepare(const PrefillInputs<float>& in) {
    shape_.prepare("OracleTopK::prepare", in.kv);
    tokens_ = 1;  // at least one (padding) row, so that the keys always form a valid cache view
    for (std::int32_t b = 0; b < shape_.batch(); ++b) tokens_ = std::max(tokens_, shape_.length(b));
    keys_.assign(std::size_t(tokens_) * token_elements(), 0.0f);
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      for (std::int32_t h = 0; h < shape_.kv_heads(); ++h) {
        for (std::int32_t t = 0; t < shape_.length(b); ++t) {
          std::copy_n(in.kv.k_row(b, h, t), shape_.head_dim(), key(b, h, t));
        }
      }
    }
  }

  void append(const AppendInputs<float>& step) {
    shape_.append("OracleTopK::append", step);
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      if (shape_.length(b) > tokens_) {  // one more row for every sequence (amortized by the vector's growth)
        tokens_ = shape_.length(b);
        keys_.resize(std::size_t(tokens_) * token_elements(), 0.0f);
      }
    }
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      for (std::int32_t h = 0; h < shape_.kv_heads(); ++h) {
        std::copy_n(step.k.row(b, h), shape_.head_dim(), key(b, h, shape_.length(b) - 1));
      }
    }
  }

  void select(const QueryView<const float>& q, const SelectionView& out) {
    constexpr const char* where = "OracleTopK::select";
    shape_.check_select(where, q, out, config_.budget);
    const AttentionWindow window{config_.sink, config_.recent};
    const std::int32_t middle_budget = config_.budget - config_.sink - config_.recent;
    const std::int64_t rows = std::int64_t(shape_.batch()) * shape_.kv_heads();
    lengths_.resize(std::size_t(shape_.batch()));
    for (std::int32_t b = 0; b < shape_.batch(); ++b) lengths_[std::size_t(b)] = shape_.length(b);
    middle_counts_.assign(std::size_t(rows), 0);
    if (middle_budget > 0) {
      const cpu::GroupScoreOptions options{.sm_scale = config_.attention.sm_scale, .reduce = cpu::GroupReduce::max,
                                           .softmax = true};
      const std::size_t bytes = std::max(
          cpu::group_scores_workspace_bytes(shape_.batch(), q.heads, shape_.kv_heads(), tokens_, options),
          cpu::topk_rows_workspace_bytes(rows, tokens_, middle_budget, {.window = window}, nullptr));
      workspace_.resize(bytes / sizeof(WorkspaceBlock) + 1);
      const std::span<std::byte> workspace(reinterpret_cast<std::byte*>(workspace_.data()), bytes);
      scores_.resize(std::size_t(rows) * std::size_t(tokens_));
      const auto scores = MatrixView<float>::packed(scores_.data(), rows, tokens_);
      cpu::group_scores(q, keys_view(), scores, options, workspace);
      // topk_rows writes each row's picks after its sink tokens: the same rows, shifted by `sink` entries
      // (sink + middle_budget + recent <= capacity keeps every row's writes inside it).
      const SelectionView middle{out.indices + config_.sink, middle_counts_.data(),
                                 out.log_weights != nullptr ? out.log_weights + config_.sink : nullptr, out.batch,
                                 out.kv_heads, out.capacity};
      cpu::topk_rows(MatrixView<const float>::packed(scores_.data(), rows, tokens_), lengths_.data(), middle_budget,
                     {.window = window}, middle, workspace);
    }
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      const std::int32_t n = shape_.length(b), sinks = window.sink_end(n), recent_begin = window.recent_begin(n);
      for (std::int32_t g = 0; g < shape_.kv_heads(); ++g) {
        const std::int32_t picks = middle_counts_[std::size_t(out.row_index(b, g))];
        std::int32_t* row = out.row(b, g);
        std::iota(row, row + sinks, 0);
        std::iota(row + sinks + picks, row + sinks + picks + (n - recent_begin), recent_begin);
        const std::int32_t count = sinks + picks + (n - recent_begin);
        out.counts[out.row_index(b, g)] = count;
        if (float* lw = out.weights_row(b, g)) std::fill_n(lw, count, 0.0f);
      }
    }
  }

  std::size_t index_bytes() const { return keys_.size() * sizeof(float); }

 private:
  struct alignas(WorkspaceLayout::kAlignment) WorkspaceBlock {
    std::byte bytes[WorkspaceLayout::kAlignment];
  };

  std::size_t token_elements() const {
    return std::size_t(shape_.batch()) * std::size_t(shape_.kv_heads()) * std::size_t(shape_.head_dim());
  }
  float* key(std::int32_t b, std::int32_t h, std::int32_t t) {
    return keys_.data() + std::size_t(t) * token_elements() +
           (std::size_t(b) * std::size_t(shape_.kv_heads()) + std::size_t(h)) * std::size_t(shape_.head_dim());
  }
  /// The keys as a cache [batch, kv_heads, tokens_, head_dim] (token-major strides); V is never read.
  ContiguousKVView<const float> keys_view() const {
    const std::int64_t d = shape_.head_dim();
    return {.k = keys_.data(),
            .v = keys_.data(),
            .seq_lens = lengths_.data(),
            .batch = shape_.batch(),
            .kv_heads = shape_.kv_heads(),
            .capacity = tokens_,
            .head_dim = shape_.head_dim(),
            .batch_stride = shape_.kv_heads() * d,
            .head_stride = d,
            .token_stride = std::int64_t(token_elements())};
  }

  OracleTopKConfig config_;
  detail::SelectorShape shape_;
  std::int32_t tokens_ = 0;                  ///< rows of keys_: the longest sequence (at least 1)
  std::vector<float> keys_;                  ///< [tokens_, batch, kv_heads, head_dim]
  std::vector<std::int32_t> lengths_;        ///< [batch], the sequences' lengths for the cache view
  std::vector<std::int32_t> middle_counts_;  ///< [batch * kv_heads], tokens topk_rows chose per row
  std::vector<float> scores_;                ///< [batch * kv_heads, tokens_]
  std::vector<WorkspaceBlock> workspace_;    ///< group_scores', then topk_rows' workspace
};

static_assert(KVSelector<OracleTopK>);

}  // namespace kvsift
