#pragma once
/// Quest (Tang et al., 2024): query-aware page selection. Keys are grouped in pages of `page_size` consecutive
/// tokens (16 by default; independent of the engine's cache pages); each page keeps the channel-wise minimum
/// and maximum of its keys (page bounds, in the storage type: exact). A page's score for query q is
/// sum_c max(q_c * min_c, q_c * max_c), an upper bound on q . k of every key in the page; a kv head scores a
/// page by the largest bound over its GQA group's query heads. Pages whose every token is in the attention
/// window score -inf (the kernel attends the window itself); the best budget / page_size pages are selected
/// whole, less their window tokens, so a row selects at most `budget` tokens.
///
/// Per step: select_pages (page scores, top pages, their tokens: three primitives; the top pages themselves, two,
/// when the caller attends pages: in.attention.selection_page_size == page_size, as the local decode step asks,
/// selector.hpp); append folds the step's key into its page (one launch). Written once for both backends; the index is bounds per slot, in the
/// context's memory: index_bytes() = 2 * sizeof(T) * head_dim * max_pages * kv_heads * max_slots.
/// Workspace of select: select_pages' over ceil(N / page_size) pages per row, N the planned bound
/// min(shape.max_seq_len, limits.max_tokens) (selector.hpp SelectShape). A sequence with more pages gets count
/// -1 on CUDA and is refused on the CPU; one past N within its last page is selected in full.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "kvsift/core/error.hpp"
#include "kvsift/selectors/quest/backend.hpp"
#include "kvsift/selectors/quest/page_bounds_view.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/detail/selector_core.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

struct QuestConfig {
  std::int32_t budget = 0;      ///< middle tokens selected per (sequence, kv head) at most: budget / page_size pages
  std::int32_t page_size = 16;
};

/// Pages a Quest selection should have to choose from, at least: the paper's smallest setting (256 tokens in pages of
/// 16). With fewer, a small budget is spent on a few coarse pages (SmolLM2 captures at 2%: 21 tokens as one page of
/// 16 kept 0.09-0.17 of the mass, StreamingLLM 0.22-0.67).
inline constexpr std::int32_t kQuestMinPages = 16;
/// The page size for a Quest selection of `budget` tokens: `preferred` (the paper's 16), halved while the budget
/// holds fewer than kQuestMinPages pages of it, down to 1 (a token per page: Quest's bound is then the exact score).
/// A small budget thus gets finer pages rather than fewer: budget 14 -> pages of 1, 35 -> 2, 128 -> 8, 256 and
/// above -> 16.
/// The index grows as the pages shrink (index_bytes(): 2 * sizeof(T) * head_dim per page). Refused: budget < 1,
/// preferred < 1.
inline std::int32_t quest_page_size(std::int32_t budget, std::int32_t preferred = 16) {
  KVSIFT_CHECK(budget >= 1, "quest_page_size", "budget (= {}) must be >= 1", budget);
  KVSIFT_CHECK(preferred >= 1, "quest_page_size", "preferred (= {}) must be >= 1", preferred);
  std::int32_t page_size = preferred;
  while (page_size > 1 && std::int64_t(budget) < std::int64_t(kQuestMinPages) * page_size) page_size /= 2;
  return page_size;
}

template <class T, class Context>
class Quest : public SelectorTypes<T, Context>, public detail::SelectorCore<"Quest"> {
 public:
  Quest(const SelectorLimits& limits, const QuestConfig& config)
      : SelectorCore(limits), config_(config), max_pages_(checked_pages(limits, config)) {
    bounds_.resize(PageBoundsView<T>::bytes(limits.max_slots, limits.kv_heads, max_pages_, limits.head_dim) /
                   sizeof(T));
  }

  std::string_view name() const { return "Quest"; }
  /// Whole pages: the budget rounded down to pages.
  std::int32_t capacity() const { return pages_per_row() * config_.page_size; }
  /// Page-level selections (selector.hpp): up to capacity() / page_size pages per row.
  std::int32_t selection_page_size() const { return config_.page_size; }
  IndexBytes index_bytes() const {
    const std::size_t bytes = bounds_.size() * sizeof(T);
    return detail::context_index_bytes<Context>(bytes);
  }

  std::size_t select_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    constexpr const char* where = entry_point<"select_workspace_bytes">();
    detail::check_shape(where, limits_, shape);
    return select_pages_workspace_bytes(shape.batch, limits_.kv_heads,
                                        planned_pages(where, "shape.max_seq_len", shape.max_seq_len), pages_per_row(),
                                        ctx);
  }

  void prepare(const PrefillInputs<T>& in, const Context& ctx) {
    detail::check_cache(entry_point<"prepare">(), limits_, in.cache, in.slots, Context::memory);
    build_page_bounds(in.cache, in.slots, bounds(), ctx);
    slot_states_.mark_prepared(in.slots, in.cache.batch(), ctx);
  }
  void append(const AppendInputs<T>& in, std::span<std::byte>, const Context& ctx) {
    checked_append<Context>(entry_point<"append">(), in);
    append_page_bounds(in.cache, in.slots, bounds(), ctx);
  }
  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = entry_point<"select">();
    const bool pages = config_.page_size > 1 && in.attention.selection_page_size == config_.page_size;
    checked_select<Context>(where, in, out, pages ? pages_per_row() : capacity(), config_.page_size);
    select_pages(in.q, bounds().as_const(), in.slots, in.lengths, in.attention.window,
                 planned_pages(where, "in.max_seq_len", in.max_seq_len), pages_per_row(),
                 pages ? PagesOut::pages : PagesOut::tokens, out, workspace, ctx);
  }

 private:
  static std::int32_t checked_pages(const SelectorLimits& limits, const QuestConfig& config) {
    KVSIFT_CHECK(config.page_size > 0, "Quest", "config.page_size (= {}) must be positive", config.page_size);
    KVSIFT_CHECK(config.budget >= config.page_size, "Quest",
                 "config.budget (= {}) is smaller than one page (page_size = {})", config.budget, config.page_size);
    return (limits.max_tokens + config.page_size - 1) / config.page_size;
  }
  std::int32_t pages_per_row() const { return config_.budget / config_.page_size; }
  /// The page-score columns of a workspace planned for sequences of up to max_seq_len tokens.
  std::int32_t planned_pages(const char* where, const char* name, std::int32_t max_seq_len) const {
    return (detail::planned_tokens(where, name, limits_, max_seq_len) + config_.page_size - 1) / config_.page_size;
  }
  PageBoundsView<T> bounds() {
    return {bounds_.data(), limits_.max_slots, limits_.kv_heads, max_pages_, limits_.head_dim, config_.page_size};
  }
  QuestConfig config_;
  std::int32_t max_pages_;
  ContextArray<Context, T> bounds_;
};

}  // namespace kvsift
