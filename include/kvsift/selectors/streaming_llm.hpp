#pragma once
/// StreamingLLM (Xiao et al., 2023) as a selector: the first `sink` tokens and the most recent
/// budget - sink tokens, whatever the query. The query-blind reference every retrieval method must beat.
/// No index: index_bytes() = 0.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string_view>

#include "kvsift/core/error.hpp"
#include "kvsift/core/selector.hpp"
#include "kvsift/selectors/detail/selector_shape.hpp"

namespace kvsift {

struct StreamingLLMConfig {
  std::int32_t budget = 0;  ///< tokens selected per (sequence, kv head), sink included
  std::int32_t sink = 4;    ///< leading tokens always kept
};

class StreamingLLM {
 public:
  using element_type = float;

  explicit StreamingLLM(const StreamingLLMConfig& config) : config_(config) {
    KVSIFT_CHECK(config.budget > 0, "StreamingLLM", "config.budget (= {}) must be positive", config.budget);
    KVSIFT_CHECK(config.sink >= 0 && config.sink <= config.budget, "StreamingLLM",
                 "config.sink (= {}) is outside [0, budget = {}]", config.sink, config.budget);
  }

  std::string_view name() const { return "StreamingLLM"; }
  void prepare(const PrefillInputs<float>& in) { shape_.prepare("StreamingLLM::prepare", in.kv); }
  void append(const AppendInputs<float>& step) { shape_.append("StreamingLLM::append", step); }
  std::size_t index_bytes() const { return 0; }

  /// Rows shorter than the budget select every token.
  void select(const QueryView<const float>& q, const SelectionView& out) {
    shape_.check_select("StreamingLLM::select", q, out, config_.budget);
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      const std::int32_t n = shape_.length(b);
      const std::int32_t sink = std::min(config_.sink, n);
      const std::int32_t recent_begin = std::max(sink, n - (config_.budget - config_.sink));
      for (std::int32_t g = 0; g < shape_.kv_heads(); ++g) {
        std::int32_t* row = out.row(b, g);
        std::iota(row, row + sink, 0);
        std::iota(row + sink, row + sink + (n - recent_begin), recent_begin);
        const std::int32_t count = sink + (n - recent_begin);
        out.counts[out.row_index(b, g)] = count;
        if (float* lw = out.weights_row(b, g)) std::fill_n(lw, count, 0.0f);
      }
    }
  }

 private:
  StreamingLLMConfig config_;
  detail::SelectorShape shape_;
};

static_assert(KVSelector<StreamingLLM>);

}  // namespace kvsift
