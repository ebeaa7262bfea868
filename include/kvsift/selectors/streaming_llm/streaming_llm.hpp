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
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

template <class T, class Context>
class StreamingLLM : public SelectorTypes<T, Context> {
 public:
  explicit StreamingLLM(const SelectorLimits& limits) : limits_(limits), slot_states_(limits.max_slots) {
    detail::check_limits("StreamingLLM", limits);
  }

  std::string_view name() const { return "StreamingLLM"; }
  const SelectorLimits& limits() const { return limits_; }
  std::int32_t capacity() const { return 0; }
  IndexBytes index_bytes() const { return {}; }
  std::size_t select_workspace_bytes(const SelectShape& shape, const Context&) const {
    return detail::no_workspace_bytes("StreamingLLM::select_workspace_bytes", limits_, shape);
  }
  std::size_t append_workspace_bytes(const SelectShape& shape, const Context&) const {
    return detail::no_workspace_bytes("StreamingLLM::append_workspace_bytes", limits_, shape);
  }
  /// No index, but the life cycle of every selector: a slot is prepared before its steps (slot_states.hpp).
  /// Refused: a prompt longer than limits.max_tokens (the bound every selector keeps), before any slot changes.
  void prepare(const PrefillInputs<T>& in, const Context& ctx) {
    constexpr const char* where = "StreamingLLM::prepare";
    const std::int32_t batch = detail::check_cache(where, limits_, in.cache, in.slots, Context::memory);
    ContextArray<Context, std::int32_t> context_lengths(static_cast<std::size_t>(batch));
    const auto rows = detail::read_prefill_rows(where, limits_, in.cache, in.slots, context_lengths.data(), ctx);
    slot_states_.mark_prepared(rows.slots);
  }
  void append(const AppendInputs<T>& in, std::span<std::byte>, const Context&) {
    detail::check_step_cache("StreamingLLM::append", limits_, slot_states_, in.cache, in.slots, Context::memory);
  }
  void release(std::span<const std::int32_t> slots) { slot_states_.release("StreamingLLM::release", slots); }
  bool prepared(std::int32_t slot) const { return slot_states_.prepared(slot); }
  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte>, const Context& ctx) {
    detail::check_select("StreamingLLM::select", limits_, slot_states_, in, out, capacity(), Context::memory);
    clear_counts(out, ctx);
  }

 private:
  SelectorLimits limits_;
  detail::SlotStates slot_states_;
};

}  // namespace kvsift
