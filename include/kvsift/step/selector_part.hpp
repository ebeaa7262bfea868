#pragma once
/// The selector's part of a decode step, written once for every placement of DecodeStep (step/placement.hpp): its
/// workspace (lengths, the selection with its log-weights when the selector writes them, the selector's append and
/// select scratch), planned once for every batch up to max_batch, and the sequence lengths -> append -> select, so
/// that a selector is driven identically wherever the attention runs.
/// Include the context's backend header (cpu/backend.hpp, cuda/backend.hpp) before using it.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift::detail {

/// One step's inputs to the selector (memory of the selector's context).
template <class T>
struct SelectorStepInputs {
  QueryView<const T> q{};
  KVCache<const T> cache{};  ///< counts the step's token
  const std::int32_t* slots = nullptr;
  HeadsView<const T> k_pre_rope{};
  AttentionOptions attention{};
  std::int32_t layer = 0;
};

template <KVSelector S>
class SelectorPart {
 public:
  using T = typename S::value_type;
  using Context = typename S::context_type;

  struct Buffers {
    std::int32_t* lengths = nullptr;
    std::int32_t* indices = nullptr;
    std::int32_t* counts = nullptr;
    float* log_weights = nullptr;  ///< only for a selector that writes log-weights
    std::span<std::byte> append, select;
  };

  /// Fewer rows may split more (a CPU pool's threads): the largest need of any batch of 1 .. max_batch rows.
  /// page_size > 1: the selector writes page-level selections of that page size (selector.hpp
  /// selection_page_size), capacity() / page_size pages per row.
  SelectorPart(const S& selector, const SelectShape& max_shape, const Context& ctx, std::int32_t page_size = 1)
      : max_batch_(max_shape.batch), kv_heads_(max_shape.kv_heads), max_seq_len_(max_shape.max_seq_len),
        capacity_(std::max(1, (selector.capacity() + page_size - 1) / page_size)),
        log_weights_(selector_writes_log_weights(selector)) {
    for (std::int32_t batch = 1; batch <= max_shape.batch; ++batch) {
      SelectShape shape = max_shape;
      shape.batch = batch;
      append_bytes_ = std::max(append_bytes_, selector.append_workspace_bytes(shape, ctx));
      select_bytes_ = std::max(select_bytes_, selector.select_workspace_bytes(shape, ctx));
    }
  }

  /// Entries per selection row: tokens, or pages of a page-level selection.
  std::int32_t capacity() const { return capacity_; }

  /// The part's share of a workspace layout (the one layout behind the byte count and the carving).
  Buffers layout(WorkspaceLayout& layout) const {
    const std::size_t rows = std::size_t(max_batch_) * std::size_t(kv_heads_);
    Buffers b;
    b.lengths = layout.allocate<std::int32_t>(std::size_t(max_batch_), "step lengths");
    b.indices = layout.allocate<std::int32_t>(rows * std::size_t(capacity_), "step selection indices");
    b.counts = layout.allocate<std::int32_t>(rows, "step selection counts");
    if (log_weights_) b.log_weights = layout.allocate<float>(rows * std::size_t(capacity_), "step selection log-weights");
    b.append = layout.span(append_bytes_, "step selector append scratch");
    b.select = layout.span(select_bytes_, "step selector select scratch");
    return b;
  }

  /// A workspace holding this part alone (the placements that own their selector's memory): its bytes, and its
  /// buffers carved from `memory` of at least that many bytes.
  std::size_t workspace_bytes() const {
    WorkspaceLayout counting;
    layout(counting);
    return counting.bytes();
  }
  Buffers carve(std::span<std::byte> memory, const char* where) const {
    WorkspaceLayout carving(memory, where);
    return layout(carving);
  }

  SelectionView selection(const Buffers& b, std::int32_t batch) const {
    return {b.indices, b.counts, b.log_weights, batch, kv_heads_, capacity_};
  }

  /// The lengths (lengths()), once, for the selector; then its append (the index learns the step's token)
  /// and its select (the middle tokens, into the buffers' selection of in.q.batch rows).
  void run(S& selector, const SelectorStepInputs<T>& in, const Buffers& b, const Context& ctx) const {
    append(selector, in, b, ctx);
    select(selector, in, b, ctx);
  }
  /// The lengths and the append alone: a placement that runs the select in stages (a host stage) goes on from here.
  void append(S& selector, const SelectorStepInputs<T>& in, const Buffers& b, const Context& ctx) const {
    write_lengths(in, b, ctx);
    append_index(selector, in, b, ctx);
  }
  /// run() in parts, for a step that runs the append beside the select (DecodeStepConfig::append_beside_select):
  /// the lengths first, then the append and the select, each on its context.
  void write_lengths(const SelectorStepInputs<T>& in, const Buffers& b, const Context& ctx) const {
    if (lengths(in.cache, b) == b.lengths) sequence_lengths(in.cache, b.lengths, ctx);
  }
  void append_index(S& selector, const SelectorStepInputs<T>& in, const Buffers& b, const Context& ctx) const {
    selector.append({.cache = in.cache, .slots = in.slots, .lengths = lengths(in.cache, b), .k_pre_rope = in.k_pre_rope,
                     .layer = in.layer},
                    b.append, ctx);
  }
  /// defer_beside: SelectInputs::defer_beside (the caller joins the selector's work beside its selection).
  void select(S& selector, const SelectorStepInputs<T>& in, const Buffers& b, const Context& ctx,
              bool defer_beside = false) const {
    SelectInputs<T> inputs = select_inputs(in, b);
    inputs.defer_beside = defer_beside;
    selector.select(inputs, selection(b, in.q.batch), b.select, ctx);
  }
  /// The select's inputs over the part's lengths; max_seq_len is the bound the scratch was sized with
  /// (SelectShape::max_seq_len).
  SelectInputs<T> select_inputs(const SelectorStepInputs<T>& in, const Buffers& b) const {
    return {.q = in.q, .cache = in.cache, .slots = in.slots, .lengths = lengths(in.cache, b), .attention = in.attention,
            .layer = in.layer, .max_seq_len = max_seq_len_};
  }
  /// The step's lengths, cache.seq_len(b): the cache's own seq_lens array where seq_len reads one (a contiguous
  /// cache with lengths, a paged one with seq_lens: vLLM's block tables always), read in place (a launch or a copy
  /// less per step), else b.lengths, which append fills first (a FlashInfer page table, from its last_page_len).
  static const std::int32_t* lengths(const KVCache<const T>& cache, const Buffers& b) {
    const std::int32_t* own = cache.is_paged() ? cache.paged.seq_lens : cache.contiguous.seq_lens;
    return own != nullptr ? own : b.lengths;
  }

 private:
  std::int32_t max_batch_, kv_heads_, max_seq_len_, capacity_;
  bool log_weights_;
  std::size_t append_bytes_ = 0, select_bytes_ = 0;
};

/// A step's run of `batch` rows (named `batch_name`) against its plan: within [1, max_batch], on a context of no more
/// threads than the one planned (a CPU pool's thread count sizes per-thread scratch).
inline void check_planned_run(const char* where, const char* batch_name, std::int32_t batch, std::int32_t max_batch,
                              std::int32_t threads, std::int32_t planned_threads) {
  KVSIFT_CHECK(batch > 0 && batch <= max_batch, where, "{} (= {}) is outside [1, config.max_batch = {}]", batch_name,
               batch, max_batch);
  KVSIFT_CHECK(threads <= planned_threads, where,
               "the context has {} threads, the step was planned for {}: plan the step with the pool it runs on",
               threads, planned_threads);
}

/// A step's slots, in host memory, against the selector's life cycle (selector_slot_prepared).
template <KVSelector S>
void check_slots_prepared(const char* where, const S& selector, std::span<const std::int32_t> host_slots) {
  for (std::size_t b = 0; b < host_slots.size(); ++b) {
    KVSIFT_CHECK(selector_slot_prepared(selector, host_slots[b]), where,
                 "in.slots[{}] (= {}) holds no prepared sequence of the selector ({}): prepare it first (a released "
                 "slot, or one outside [0, max_slots), holds none)",
                 b, host_slots[b], selector.name());
  }
}

/// A step's device slots against the selector's life cycle, for the steps' validate_indices: read on the host,
/// which synchronizes the stream, as that validation does anyway. Host slots need no such call: the selector's
/// append and select check them on every call.
template <KVSelector S>
void check_device_slots(const char* where, const S& selector, const std::int32_t* slots, std::int32_t batch,
                        const typename S::context_type& ctx) {
  if constexpr (S::context_type::memory == MemorySpace::device) {
    KVSIFT_CHECK(slots != nullptr, where, "in.slots must be non-null");
    std::vector<std::int32_t> host(std::size_t(batch > 0 ? batch : 0));
    copy_to_host(slots, host.size(), host.data(), ctx);
    check_slots_prepared(where, selector, host);
  }
}

/// Refuses, in the constructor of placement `where`, a selector with a second source (selectors/selector.hpp),
/// which only DecodeStep attends; `instead` names where to run it.
template <KVSelector S>
void refuse_second_source(const char* where, const S& selector, const char* instead) {
  KVSIFT_CHECK(selector_second_source_capacity(selector) == 0, where,
               "the selector ({}) has a second source (second_source_capacity() = {}), which this placement does not "
               "attend: run it with DecodeStep {}",
               selector.name(), selector_second_source_capacity(selector), instead);
}

}  // namespace kvsift::detail
