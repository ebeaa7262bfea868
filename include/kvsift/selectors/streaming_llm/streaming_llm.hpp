#pragma once
/// StreamingLLM (Xiao et al., 2023): the first `sink` and the last `recent` tokens, whatever the query: the
/// query-blind reference every retrieval method must beat. The window is the attention kernel's
/// (AttentionOptions::window, set to {sink, recent} in the decode step's config), so as a selector it selects
/// nothing: every row's count is 0 (one memset on CUDA). No index.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/detail/selector_core.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

template <class T, class Context>
class StreamingLLM : public SelectorTypes<T, Context>, public detail::SelectorCore<"StreamingLLM"> {
 public:
  explicit StreamingLLM(const SelectorLimits& limits) : SelectorCore(limits) {}

  std::string_view name() const { return "StreamingLLM"; }
  std::int32_t capacity() const { return 0; }
  IndexBytes index_bytes() const { return {}; }
  std::size_t select_workspace_bytes(const SelectShape& shape, const Context&) const {
    return detail::no_workspace_bytes(entry_point<"select_workspace_bytes">(), limits_, shape);
  }
  /// No index, but the life cycle of every selector: a slot is prepared before its steps (slot_states.hpp).
  /// Refused: a prompt longer than limits.max_tokens (the bound every selector keeps), before any slot changes.
  void prepare(const PrefillInputs<T>& in, const Context& ctx) {
    constexpr const char* where = entry_point<"prepare">();
    const std::int32_t batch = detail::check_cache(where, limits_, in.cache, in.slots, Context::memory);
    ContextArray<Context, std::int32_t> context_lengths(static_cast<std::size_t>(batch));
    const auto rows = detail::read_prefill_rows(where, limits_, in.cache, in.slots, context_lengths.data(), ctx);
    slot_states_.mark_prepared(rows.slots);
  }
  /// Nothing to append: the step's inputs are checked all the same.
  void append(const AppendInputs<T>& in, std::span<std::byte>, const Context&) {
    checked_append<Context>(entry_point<"append">(), in);
  }
  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte>, const Context& ctx) {
    detail::check_select(entry_point<"select">(), limits_, slot_states_, in, out, capacity(), Context::memory);
    clear_counts(out, ctx);
  }
};

}  // namespace kvsift
