#pragma once
/// What every selector holds and does the same way, written once: its limits, its slots' life cycle
/// (slot_states.hpp) with `prepared` and `release`, the workspace query of an append that takes none, and the
/// checks that open append and select, each refusal prefixed by the selector's class and entry point
/// ("Quest::select"). A selector derives from SelectorCore<"Name"> (a base that depends on neither T nor the
/// context, so its members need no `this->`) and hides what it does otherwise (an append with scratch, a release
/// that frees more).

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/error.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/detail/slot_states.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift::detail {

/// A string literal as a template argument (C++20): a selector's class name.
template <std::size_t N>
struct SelectorName {
  char text[N] = {};
  constexpr SelectorName(const char (&s)[N]) {  // NOLINT(google-explicit-constructor): built from a literal
    for (std::size_t i = 0; i < N; ++i) text[i] = s[i];
  }
  static constexpr std::size_t length = N - 1;
};

/// "Class::member", NUL-terminated, made at compile time.
template <SelectorName Class, SelectorName Member>
inline constexpr auto kQualifiedName = [] {
  std::array<char, Class.length + 2 + Member.length + 1> out{};
  std::size_t i = 0;
  for (std::size_t j = 0; j < Class.length; ++j) out[i++] = Class.text[j];
  out[i++] = ':';
  out[i++] = ':';
  for (std::size_t j = 0; j < Member.length; ++j) out[i++] = Member.text[j];
  return out;
}();

template <SelectorName Name>
class SelectorCore {
 public:
  const SelectorLimits& limits() const { return limits_; }
  /// Whether `slot` holds a prepared sequence (slot_states.hpp).
  bool prepared(std::int32_t slot) const { return slot_states_.prepared(slot); }
  /// The slots' sequences leave; a joining sequence's prepare rebuilds a released slot.
  void release(std::span<const std::int32_t> slots) { slot_states_.release(entry_point<"release">(), slots); }
  /// An append that takes no workspace: `shape` checked all the same, 0 bytes.
  template <class Context>
  std::size_t append_workspace_bytes(const SelectShape& shape, const Context&) const {
    return no_workspace_bytes(entry_point<"append_workspace_bytes">(), limits_, shape);
  }

 protected:
  /// Refuses limits out of range (check_limits) before anything is sized from them.
  explicit SelectorCore(const SelectorLimits& limits)
      : limits_((check_limits(Name.text, limits), limits)), slot_states_(limits.max_slots) {}

  /// The error prefix of entry point `Member`: "Name::Member".
  template <SelectorName Member>
  static constexpr const char* entry_point() {
    return kQualifiedName<Name, Member>.data();
  }
  /// The workspace query of entry point `Member`: `shape` checked against the limits, then the bytes
  /// layout(counting) carves (workspace_bytes).
  template <SelectorName Member, class Layout>
  std::size_t layout_bytes(const SelectShape& shape, Layout&& layout) const {
    return workspace_bytes(entry_point<Member>(), limits_, shape, layout);
  }
  /// select's workspace query: the bytes layout(counting, tokens) carves at the planned token bound
  /// (planned_workspace_bytes).
  template <class Layout>
  std::size_t planned_select_bytes(const SelectShape& shape, Layout&& layout) const {
    return planned_workspace_bytes(entry_point<"select_workspace_bytes">(), limits_, shape, layout);
  }
  /// An append's cache and slots (check_step_cache); returns its batch.
  template <class Context, class T>
  std::int32_t checked_append(const char* where, const AppendInputs<T>& in) const {
    return check_step_cache(where, limits_, slot_states_, in.cache, in.slots, Context::memory);
  }
  /// checked_append of an append at the step's position, lengths[b] - 1: in.lengths is required.
  template <class Context, class T>
  std::int32_t checked_positioned_append(const char* where, const AppendInputs<T>& in) const {
    const std::int32_t batch = checked_append<Context>(where, in);
    KVSIFT_CHECK(in.lengths != nullptr, where, "in.lengths must be non-null");
    return batch;
  }
  /// A select's inputs and output, for a selector of `capacity` (check_select).
  template <class Context, class T>
  void checked_select(const char* where, const SelectInputs<T>& in, const SelectionView& out, std::int32_t capacity,
                      std::int32_t page_size = 1) const {
    detail::check_select(where, limits_, slot_states_, in, out, capacity, Context::memory, page_size);
  }
  /// checked_select of a select whose workspace is planned for in.max_seq_len: returns its planned token bound
  /// (planned_tokens, which refuses a bound outside [0, limits.max_tokens]).
  template <class Context, class T>
  std::int32_t checked_planned_select(const char* where, const SelectInputs<T>& in, const SelectionView& out,
                                      std::int32_t capacity) const {
    checked_select<Context>(where, in, out, capacity);
    return planned_tokens(where, "in.max_seq_len", limits_, in.max_seq_len);
  }

  SelectorLimits limits_;
  SlotStates slot_states_;
};

}  // namespace kvsift::detail
