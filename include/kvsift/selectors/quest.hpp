#pragma once
/// Quest-style page selection (Tang et al., 2024), a reference for the retrieval selectors: keys are grouped
/// in pages of `page_size` consecutive tokens, and each page keeps the channel-wise minimum and maximum of
/// its keys. A page's score for query q is sum_c max(q_c * min_c, q_c * max_c), an upper bound on q . k of
/// every key in the page; a kv head scores a page by the largest bound over its GQA group's query heads. The
/// best floor(budget / page_size) pages are selected whole, so a selection never exceeds the budget.
///
/// index_bytes() = 2 * 4 * head_dim * pages * kv_heads * batch.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string_view>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/selector.hpp"
#include "kvsift/cpu/topk.hpp"
#include "kvsift/selectors/detail/selector_shape.hpp"

namespace kvsift {

struct QuestConfig {
  std::int32_t budget = 0;      ///< tokens selected per (sequence, kv head), at least one page
  std::int32_t page_size = 16;
};

class Quest {
 public:
  using element_type = float;

  explicit Quest(const QuestConfig& config) : config_(config) {
    KVSIFT_CHECK(config.page_size > 0, "Quest", "config.page_size (= {}) must be positive", config.page_size);
    KVSIFT_CHECK(config.budget >= config.page_size, "Quest",
                 "config.budget (= {}) is smaller than one page (page_size = {})", config.budget, config.page_size);
  }

  std::string_view name() const { return "Quest"; }

  void prepare(const PrefillInputs<float>& in) {
    shape_.prepare("Quest::prepare", in.kv);
    bounds_.assign(static_cast<std::size_t>(shape_.batch()) * shape_.kv_heads(), {});
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      for (std::int32_t h = 0; h < shape_.kv_heads(); ++h) {
        for (std::int32_t t = 0; t < shape_.length(b); ++t) add_key(shape_.row(b, h), t, in.kv.k_row(b, h, t));
      }
    }
  }

  void append(const AppendInputs<float>& step) {
    shape_.append("Quest::append", step);
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      for (std::int32_t h = 0; h < shape_.kv_heads(); ++h) add_key(shape_.row(b, h), shape_.length(b) - 1, step.k.row(b, h));
    }
  }

  void select(const QueryView<const float>& q, const SelectionView& out) {
    const std::int32_t group = shape_.check_select("Quest::select", q, out, config_.budget);
    const std::int32_t d = shape_.head_dim();
    for (std::int32_t b = 0; b < shape_.batch(); ++b) {
      const std::int32_t n = shape_.length(b);
      const std::int32_t pages = (n + config_.page_size - 1) / config_.page_size;
      const std::int32_t chosen = std::min(pages, config_.budget / config_.page_size);
      for (std::int32_t g = 0; g < shape_.kv_heads(); ++g) {
        const std::vector<float>& bounds = bounds_[shape_.row(b, g)];
        page_scores_.assign(static_cast<std::size_t>(pages), -std::numeric_limits<float>::infinity());
        for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qh = q.row(b, h);
          for (std::int32_t p = 0; p < pages; ++p) {
            const float* lo = bounds.data() + static_cast<std::size_t>(2 * p) * d;
            const float* hi = lo + d;
            float bound = 0.0f;
            for (std::int32_t c = 0; c < d; ++c) bound += std::max(qh[c] * lo[c], qh[c] * hi[c]);
            page_scores_[p] = std::max(page_scores_[p], bound);
          }
        }
        chosen_pages_.resize(static_cast<std::size_t>(chosen));
        cpu::topk_indices(page_scores_, chosen, chosen_pages_, topk_scratch_);
        std::int32_t* dst = out.row(b, g);
        std::int32_t count = 0;
        for (const std::int32_t p : chosen_pages_) {  // ascending pages give ascending tokens
          const std::int32_t first = p * config_.page_size, last = std::min(n, first + config_.page_size);
          std::iota(dst + count, dst + count + (last - first), first);
          count += last - first;
        }
        out.counts[out.row_index(b, g)] = count;
        if (float* lw = out.weights_row(b, g)) std::fill_n(lw, count, 0.0f);
      }
    }
  }

  std::size_t index_bytes() const {
    std::size_t bytes = 0;
    for (const auto& b : bounds_) bytes += b.size() * sizeof(float);
    return bytes;
  }

 private:
  /// Widens the bounds of token t's page by key k (a new page starts at k).
  void add_key(std::size_t r, std::int32_t t, const float* k) {
    const std::int32_t d = shape_.head_dim();
    std::vector<float>& bounds = bounds_[r];
    const std::size_t page = static_cast<std::size_t>(t / config_.page_size);
    if (t % config_.page_size == 0) {
      bounds.resize((page + 1) * 2 * d);
      std::copy_n(k, d, bounds.data() + page * 2 * d);
      std::copy_n(k, d, bounds.data() + page * 2 * d + d);
      return;
    }
    float* lo = bounds.data() + page * 2 * d;
    float* hi = lo + d;
    for (std::int32_t c = 0; c < d; ++c) {
      lo[c] = std::min(lo[c], k[c]);
      hi[c] = std::max(hi[c], k[c]);
    }
  }

  QuestConfig config_;
  detail::SelectorShape shape_;
  std::vector<std::vector<float>> bounds_;  ///< per (b, kv head): [pages][min | max][head_dim]
  std::vector<float> page_scores_;
  std::vector<std::int32_t> chosen_pages_;
  std::vector<std::uint64_t> topk_scratch_;
};

static_assert(KVSelector<Quest>);

}  // namespace kvsift
