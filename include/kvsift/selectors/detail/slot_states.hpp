#pragma once
/// A selector's life cycle per slot, kept on the host: which slots hold a prepared sequence. Every selector owns
/// one, so that a call on a slot without a sequence is refused by name instead of reading another sequence's (or
/// no) index.
///
/// prepare marks its slots once it has succeeded (a refused prepare changes nothing); append and select require
/// their slots to be prepared; release requires it too and then clears them (a released slot may be prepared
/// again). The host checks the slots it can see: on the CPU every call's; on CUDA, where a step's slots are device
/// values that the host reads only by synchronizing, prepare (which synchronizes anyway) and release (host slots)
/// are checked, and append and select trust the device's slots, as they trust its lengths. The decode steps check
/// a CUDA step's slots against the selector's states with their validate_indices option (which synchronizes
/// already), through selector_slot_prepared (selectors/selector.hpp).

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"

namespace kvsift::detail {

class SlotStates {
 public:
  explicit SlotStates(std::int32_t max_slots) : states_(std::size_t(max_slots > 0 ? max_slots : 0), State::never) {}

  bool prepared(std::int32_t slot) const { return in_range(slot) && states_[std::size_t(slot)] == State::prepared; }

  /// Marks `batch` slots (the context's memory; read on the host, which synchronizes a CUDA stream) prepared.
  /// Call it last in prepare, once nothing can be refused any more; the slots were range-checked by then.
  template <class Context>
  void mark_prepared(const std::int32_t* slots, std::int32_t batch, const Context& ctx) {
    if constexpr (Context::memory == MemorySpace::host) {
      mark_prepared(std::span<const std::int32_t>(slots, std::size_t(batch)));
    } else {
      std::vector<std::int32_t> host(static_cast<std::size_t>(batch));
      copy_to_host(slots, host.size(), host.data(), ctx);
      mark_prepared(std::span<const std::int32_t>(host));
    }
  }
  void mark_prepared(std::span<const std::int32_t> host_slots) {
    for (const std::int32_t slot : host_slots) {
      if (in_range(slot)) states_[std::size_t(slot)] = State::prepared;
    }
  }

  /// Refuses slots[b] (b < batch) that holds no prepared sequence, when the slots are in host memory (`memory`);
  /// device slots are trusted (see above).
  void require(const char* where, const std::int32_t* slots, std::int32_t batch, MemorySpace memory) const {
    if (memory != MemorySpace::host) return;
    require(where, std::span<const std::int32_t>(slots, std::size_t(batch)));
  }
  void require(const char* where, std::span<const std::int32_t> host_slots) const {
    for (std::size_t b = 0; b < host_slots.size(); ++b) check_prepared(where, "slots", b, host_slots[b]);
  }

  /// Sequences leave: every slot must hold a prepared sequence, once in the list; all are checked before any is
  /// cleared, so a refused release changes nothing.
  void release(const char* where, std::span<const std::int32_t> slots) {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      check_prepared(where, "slots", i, slots[i]);
      for (std::size_t j = 0; j < i; ++j) {
        KVSIFT_CHECK(slots[j] != slots[i], where, "slots lists slot {} twice", slots[i]);
      }
    }
    for (const std::int32_t slot : slots) states_[std::size_t(slot)] = State::released;
  }

 private:
  enum class State : std::uint8_t { never, prepared, released };

  bool in_range(std::int32_t slot) const { return slot >= 0 && std::size_t(slot) < states_.size(); }

  void check_prepared(const char* where, const char* name, std::size_t i, std::int32_t slot) const {
    KVSIFT_CHECK(in_range(slot), where, "{}[{}] (= {}) is outside [0, limits.max_slots = {})", name, i, slot,
                 states_.size());
    const State state = states_[std::size_t(slot)];
    KVSIFT_CHECK(state == State::prepared, where, "{}[{}] (= {}) holds no sequence: {}", name, i, slot,
                 state == State::never ? "it was never prepared (call prepare for the joining sequence first)"
                                       : "it was released (prepare a joining sequence into it first)");
  }

  std::vector<State> states_;
};

}  // namespace kvsift::detail
