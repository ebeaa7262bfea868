#pragma once
/// DecodeStep<S, Placement>: one layer's decode step, select -> sparse attention (with the window) in one object,
/// planned once, for selector S in a placement (step/placement.hpp). Include cpu/backend.hpp or cuda/backend.hpp (or
/// both) before using it with that backend's selectors. This header defines the shared part (DecodeStepConfig,
/// StepInputs, detail::StepBase) and the local placement; step/split_step.hpp the placements that split the step
/// over the GPU and the CPU.
///
/// placement::Local (the default) follows the selector's context: with a cuda::Context everything runs on one
/// stream (select, attend), CUDA-graph capturable end to end; with a cpu::Context everything runs on the thread
/// pool.
///
/// run() per step, in this order (docs/selector_framework.md):
///   1. the step's token: if in.k and in.v are given, they are written into the cache at position
///      seq_len(b) - 1 (the engine has grown the cache's lengths or page table to count it); otherwise the
///      engine wrote them. A decode query attends to its own token, as in every engine.
///   2. lengths[b] = cache.seq_len(b), once, into the workspace (context memory), for the selector;
///   3. selector.append (the index learns the new token), then selector.select (the middle tokens, with their
///      log-weights when the selector writes them: selectors/selector.hpp; the pages of a selector with page-level
///      selections, config.page_selections); steps 2-3 are step/selector_part.hpp, shared with the hybrid
///      placement;
///   4. sparse attention over the window (config.attention.window, attended by the kernel in the same launch)
///      and the selection, into `out` (storage type, or fp32 for a partial to merge later). A selector with a
///      second source (selector.hpp SecondSource, CentroidKV's merged rows): the selection with the window and
///      the second source without it are attended into two fp32 partials in the workspace and merged by LSE
///      into `out` (three launches on CUDA where there is one without it). A selector whose primary selection is
///      always empty (capacity() == 0, CentroidKV) under an empty window has nothing but the second source to
///      attend: one launch into `out`, no partials.
///   5. CUDA, config.append_beside_select where the selector's select reads no append of its step (A²ATS with a
///      recent window): step 3's append ran on a second stream the step owns, forked after step 2, beside the
///      select and the attention; the step's stream waits for it here (the next select sees the token). In a
///      captured graph the append is a parallel branch. Likewise a selector with join_beside (selector.hpp
///      SelectorJoinsBeside; CTKVR's index update for the next step) leaves the work it forks beside its selection
///      running through the attention (SelectInputs::defer_beside), joined after it.
/// A selection row whose count is outside [0, capacity] (a primitive's -1) gets NaN in O and LSE of its query
/// heads (core/views.hpp SelectionView::counts).
/// The selection stays in the workspace until the next run: selection(workspace, batch) reads it (the fidelity
/// harness scores it); selection_page_size() says whether it lists tokens (1) or pages.
///
/// Memory: the views in StepInputs and `out` are in the context's memory; the workspace, of workspace_bytes()
/// bytes (256-byte aligned, contents irrelevant), holds lengths, the selection (and its log-weights), the
/// selector's and the decode's scratch (and the two partials of a second source), at offsets fixed at construction for every batch up to config.max_batch. run() allocates
/// nothing, queries nothing and never synchronizes the host (except with config.validate_indices on CUDA,
/// which checks the selection and throws on the host).
///
/// The selector's life cycle (selectors/detail/slot_states.hpp): every slot of a run holds a prepared sequence, not
/// released since; the CPU checks it on every run, CUDA with config.validate_indices (the slots are device values).
/// Trusted on the device (CUDA; checked on the CPU): the slots (in [0, the selector's max_slots)), every
/// sequence's length (<= config.max_seq_len and the selector's max_tokens) and the cache's page tables. A
/// primitive that meets a bad device value marks that selection row with count -1 (cuda/topk.hpp,
/// selectors/quest/cuda/page_bounds.hpp); config.validate_indices refuses it by name, without it that row's output is NaN
/// (memory stays in bounds). Run with validate_indices while integrating.
/// Thread safety: one step serves one thread at a time; it owns its selector (and, appending beside the select, a
/// stream and two events of the device current at construction).

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/context_fork.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/selector.hpp"
#include "kvsift/step/placement.hpp"
#include "kvsift/step/selector_part.hpp"

namespace kvsift {

struct DecodeStepConfig {
  AttentionOptions attention{};   ///< sm_scale and the sink + recent window the kernel attends
  std::int32_t max_batch = 1;     ///< batch rows per step (<= the selector's slots)
  std::int32_t q_heads = 0;
  std::int32_t kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t max_seq_len = 0;   ///< bound on every sequence's length, the step's token included
  /// Check each selection (counts, range, duplicates, window) before attending and throw naming the first bad
  /// entry; on CUDA this synchronizes the stream and cannot be captured in a graph.
  bool validate_indices = false;
  /// CUDA: launch the attention as a programmatic dependent of the selector's last kernel (PDL, sm_90;
  /// cuda::DecodeOptions::programmatic_launch). Ignored on the CPU.
  bool programmatic_launch = true;
  /// The local placement, a selector with page-level selections (selectors/selector.hpp selection_page_size,
  /// Quest): true, the selector writes its chosen pages and the kernel attends their middle tokens (no expansion
  /// into tokens: a launch less on CUDA), and the step's selection(workspace, batch) lists pages
  /// (selection_page_size()); false, tokens, which selection() readers such as the fidelity harness expect.
  /// config.attention.selection_page_size stays 1: the step sets it from the selector.
  bool page_selections = false;
  /// CUDA: where the selector's select reads nothing its append writes in the same step (selectors/selector.hpp
  /// select_reads_append: A²ATS with a recent window), run the append on a second stream the step owns
  /// (cuda::StreamFork), beside the select and the attention, joined back before run() returns: the same results,
  /// eager and in a captured graph, with the append off the step's critical path. Ignored on the CPU.
  bool append_beside_select = true;
};

/// One step's inputs, for every placement. The selector's views (q, cache, slots, k_pre_rope) are in the memory of
/// the selector's context; the split placements (step/split_step.hpp) take the other side's views too.
template <class T>
struct StepInputs {
  QueryView<const T> q{};               ///< [batch, q_heads, head_dim], post-RoPE
  KVCache<T> cache{};                   ///< the cache the selector reads; seq_len(b) counts the step's token
  HeadsView<const T> k{};               ///< local placement, optional: the step's new K [batch, kv_heads, head_dim] to write first
  HeadsView<const T> v{};               ///< with k
  HeadsView<const T> k_pre_rope{};      ///< optional, for selectors that index pre-RoPE keys
  const std::int32_t* slots = nullptr;  ///< [batch] each row's selector slot
  std::int32_t layer = 0;
  /// A CPU selector in a split placement: the same queries in device memory, and the engine's device cache (at
  /// least the window's rows at their positions), from which the GPU attends the window.
  QueryView<const T> q_device{};
  KVCache<const T> device_cache{};
  /// A GPU selector in placement::MiddleOnCpu: the pinned host cache holding the middle's rows at their positions
  /// (its lengths or page table in host memory), from which the CPU attends the selection.
  KVCache<const T> host_cache{};
};

namespace detail {

/// What every placement of DecodeStep shares: the selector it owns, the checked configuration, the selector's
/// part of the step (step/selector_part.hpp), planned for every batch up to config.max_batch on the selector's
/// context, and the life cycle calls.
template <KVSelector S>
class StepBase {
 public:
  using value_type = typename S::value_type;
  using selector_context = typename S::context_type;

  S& selector() { return selector_; }
  const S& selector() const { return selector_; }
  const DecodeStepConfig& config() const { return config_; }

  /// What the step's selection entries name (AttentionOptions::selection_page_size): 1 tokens, else pages.
  std::int32_t selection_page_size() const { return attention_.selection_page_size; }

  /// Prefill of joining sequences on the selector's context: the selector's prepare (may allocate), with the
  /// step's attention options.
  void prepare(PrefillInputs<value_type> in, const selector_context& ctx) {
    in.attention = config_.attention;
    selector_.prepare(in, ctx);
  }
  /// Sequences leave: the selector's release.
  void release(std::span<const std::int32_t> slots) { selector_.release(slots); }

 protected:
  /// `attends_pages`: this placement attends a selector's page-level selections (config.page_selections).
  StepBase(S selector, const DecodeStepConfig& config, const selector_context& ctx, const char* where,
           bool attends_pages = false)
      : selector_(std::move(selector)), config_(checked(config, where)),
        attention_(with_pages(config, attends_pages && config.page_selections ? page_size_of(selector_) : 1)),
        part_(selector_, {config.max_batch, config.q_heads, config.kv_heads, config.head_dim, config.max_seq_len}, ctx,
              attention_.selection_page_size),
        planned_threads_(workspace_threads(ctx)) {}

  /// The run's batch within the plan, on a pool no larger than the planned one.
  void check_run(const char* where, std::int32_t batch, const selector_context& ctx) const {
    check_planned_run(where, "in.q.batch", batch, config_.max_batch, workspace_threads(ctx), planned_threads_);
  }
  /// The selection of the last run over `selector` (the selector's part of a carved workspace) for `batch` rows.
  SelectionView planned_selection(const char* where, const typename SelectorPart<S>::Buffers& selector,
                                  std::int32_t batch) const {
    KVSIFT_CHECK(batch > 0 && batch <= config_.max_batch, where, "batch (= {}) is outside [1, config.max_batch = {}]",
                 batch, config_.max_batch);
    return part_.selection(selector, batch);
  }
  SelectorStepInputs<value_type> selector_inputs(const StepInputs<value_type>& in) const {
    return {.q = in.q, .cache = in.cache, .slots = in.slots, .k_pre_rope = in.k_pre_rope,
            .attention = attention_, .layer = in.layer};
  }

  S selector_;
  DecodeStepConfig config_;
  AttentionOptions attention_;  ///< config.attention, with the selection's page size
  SelectorPart<S> part_;
  std::int32_t planned_threads_;

 private:
  static const DecodeStepConfig& checked(const DecodeStepConfig& config, const char* where) {
    KVSIFT_CHECK(config.max_batch > 0, where, "config.max_batch (= {}) must be positive", config.max_batch);
    KVSIFT_CHECK(config.max_seq_len > 0, where, "config.max_seq_len (= {}) must be positive", config.max_seq_len);
    validate(config.attention.window, where, "config.attention.window");
    KVSIFT_CHECK(config.attention.selection_page_size == 1, where,
                 "config.attention.selection_page_size (= {}) must be 1: the step attends a selector's pages by "
                 "itself (config.page_selections)",
                 config.attention.selection_page_size);
    KVSIFT_CHECK(config.attention.selection_rows == nullptr, where,
                 "config.attention.selection_rows is set: the step's selections are by batch row (a second source "
                 "brings its own row map)");
    return config;
  }
  /// The selector's page size, where its pages are attended alone (a second source attends tokens beside them).
  static std::int32_t page_size_of(const S& selector) {
    if (selector_second_source_capacity(selector) != 0) return 1;
    const std::int32_t page_size = selector_selection_page_size(selector);
    KVSIFT_CHECK(page_size >= 1, "DecodeStep", "the selector's selection_page_size() (= {}) must be >= 1", page_size);
    return page_size;
  }
  static AttentionOptions with_pages(const DecodeStepConfig& config, std::int32_t page_size) {
    AttentionOptions attention = config.attention;
    attention.selection_page_size = page_size;
    return attention;
  }
};

}  // namespace detail

/// The local placement (the primary template); the split placements are specializations in step/split_step.hpp.
template <KVSelector S, class Placement = placement::Local>
  requires placement::Fits<Placement, typename S::context_type>
class DecodeStep : public detail::StepBase<S> {
  static_assert(std::same_as<Placement, placement::Local>,
                "DecodeStep's split placements are defined in kvsift/step/split_step.hpp: include it");
  using Base = detail::StepBase<S>;
  using Base::attention_;
  using Base::config_;
  using Base::part_;
  using Base::selector_;

 public:
  using value_type = typename S::value_type;
  using context_type = typename S::context_type;
  using T = value_type;
  using Context = context_type;

  /// Plans the step for every batch of 1 .. config.max_batch rows on `ctx` (a CPU pool's thread count sizes
  /// per-thread scratch: run() refuses a larger pool). May allocate (the selector's own state).
  DecodeStep(S selector, const DecodeStepConfig& config, const Context& ctx)
      : Base(std::move(selector), config, ctx, "DecodeStep", /*attends_pages=*/true),
        second_capacity_(selector_second_source_capacity(selector_)),
        second_source_only_(second_capacity_ > 0 && selector_.capacity() == 0 && config.attention.window.empty()) {
    KVSIFT_CHECK(second_capacity_ >= 0, "DecodeStep", "the selector's second_source_capacity() (= {}) is negative",
                 second_capacity_);
    // Fewer rows may split more (a CPU pool's threads, a GPU's SMs): the largest need of any batch size. The
    // second source's decode runs after the primary's on the same context and reuses its scratch.
    for (std::int32_t batch = 1; batch <= config.max_batch; ++batch) {
      decode_bytes_ = std::max(decode_bytes_, sparse_decode_workspace_bytes(
                                                  batch, config.q_heads, config.kv_heads, config.head_dim,
                                                  part_.capacity(), config.max_seq_len, attention_,
                                                  config.validate_indices, ctx));
      if (second_capacity_ > 0) {
        decode_bytes_ = std::max(decode_bytes_, sparse_decode_workspace_bytes(
                                                    batch, config.q_heads, config.kv_heads, config.head_dim,
                                                    second_capacity_, config.max_seq_len, second_attention(),
                                                    config.validate_indices, ctx));
      }
    }
    WorkspaceLayout counting;
    layout(counting);
    workspace_bytes_ = counting.bytes();
    if constexpr (detail::ForksWork<Context>) {
      if (config.append_beside_select && !selector_select_reads_append(selector_, config.attention.window)) {
        append_fork_.emplace();
      }
    }
  }

  std::size_t workspace_bytes() const { return workspace_bytes_; }

  template <class TO>
  void run(const StepInputs<T>& in, const StateView<TO>& out, std::span<std::byte> workspace, const Context& ctx) {
    constexpr const char* where = "DecodeStep::run";
    this->check_run(where, in.q.batch, ctx);
    KVSIFT_CHECK(in.cache.batch() == in.q.batch, where, "in.cache batch (= {}) != in.q.batch (= {})",
                 in.cache.batch(), in.q.batch);
    KVSIFT_CHECK(in.q_device.data == nullptr && in.device_cache.batch() == 0 && in.host_cache.batch() == 0, where,
                 "in.q_device, in.device_cache or in.host_cache is set: they are the split placements' "
                 "(step/split_step.hpp); the local placement attends in.cache");
    WorkspaceLayout carving(workspace, where);
    const Buffers b = layout(carving);
    if (config_.validate_indices) detail::check_device_slots(where, selector_, in.slots, in.q.batch, ctx);
    if (in.k.data != nullptr || in.v.data != nullptr) {
      KVSIFT_CHECK(in.k.data != nullptr && in.v.data != nullptr, where, "in.k and in.v must be given together");
      write_step_kv(in.cache, in.k, in.v, ctx);
    }
    const detail::SelectorStepInputs<T> selector_inputs = this->selector_inputs(in);
    if constexpr (detail::ForksWork<Context>) {
      if (append_fork_.has_value()) {
        // The append beside the select and the attention (which read nothing it writes), joined at the end: the
        // attention still follows the select's last kernel (a programmatic launch), and the next select, on this
        // stream, sees the append.
        part_.write_lengths(selector_inputs, b.selector, ctx);
        detail::run_beside(
            *append_fork_, ctx,
            [&](const Context& beside) { part_.append_index(selector_, selector_inputs, b.selector, beside); },
            [&] { select_and_attend(selector_inputs, in, out, b, ctx); });
        return;
      }
    }
    part_.append(selector_, selector_inputs, b.selector, ctx);
    select_and_attend(selector_inputs, in, out, b, ctx);
  }

  /// Whether run() puts the append on a stream of its own (config.append_beside_select, on CUDA, where the
  /// selector's select reads no append of its step).
  bool appends_beside_select() const { return append_fork_.has_value(); }

  /// The selection of the last run() over this workspace, for that run's `batch` rows (context memory), its
  /// log-weights included when the selector writes them (a second source is the selector's:
  /// selector().second_source).
  SelectionView selection(std::span<std::byte> workspace, std::int32_t batch) const {
    constexpr const char* where = "DecodeStep::selection";
    WorkspaceLayout carving(workspace, where);
    return this->planned_selection(where, layout(carving).selector, batch);
  }

 private:
  struct Buffers {
    typename detail::SelectorPart<S>::Buffers selector;
    float* partial_o[2] = {};  ///< only with a second source and a primary that may list entries: their fp32 states
    float* partial_lse[2] = {};
    std::span<std::byte> decode;
  };

  /// The select, then the attention; a selector that can leave the work beside its selection running
  /// (SelectorJoinsBeside: CTKVR's index update) does, and it is joined after the attention, which reads none of it:
  /// that work then runs beside the attention, not before it. An exception from the attention still joins.
  template <class TO>
  void select_and_attend(const detail::SelectorStepInputs<T>& selector_inputs, const StepInputs<T>& in,
                         const StateView<TO>& out, const Buffers& b, const Context& ctx) {
    if constexpr (SelectorJoinsBeside<S>) {
      part_.select(selector_, selector_inputs, b.selector, ctx, /*defer_beside=*/true);
      detail::joined_on_failure([&] { attend(in, out, b, ctx); }, [&] { selector_.join_beside(ctx); });
      selector_.join_beside(ctx);
    } else {
      part_.select(selector_, selector_inputs, b.selector, ctx);
      attend(in, out, b, ctx);
    }
  }

  /// The attention of the step's selection (with the window), and of a second source.
  template <class TO>
  void attend(const StepInputs<T>& in, const StateView<TO>& out, const Buffers& b, const Context& ctx) {
    const SelectionView selection = part_.selection(b.selector, in.q.batch);
    if constexpr (HasSecondSource<S>) {
      if (second_capacity_ > 0) return attend_two_sources(in, selection, out, b, ctx);
    }
    sparse_decode(in.q, KVCache<const T>(in.cache), selection, out, attention_, config_.validate_indices,
                  config_.programmatic_launch, b.decode, ctx);
  }

  /// The primary selection (with the window) and the second source (whole, no window) into two fp32 partials,
  /// merged by LSE into `out`, rounded once. A NaN partial (a bad row) makes the output NaN.
  template <class TO>
    requires HasSecondSource<S>
  void attend_two_sources(const StepInputs<T>& in, const SelectionView& selection, const StateView<TO>& out,
                          const Buffers& b, const Context& ctx) {
    const KVCache<const T> cache = in.cache;
    const SecondSource<T> second = selector_.second_source({.q = in.q, .cache = cache, .slots = in.slots,
                                                            .lengths = part_.lengths(cache, b.selector),
                                                            .attention = config_.attention, .layer = in.layer});
    check_second_source("DecodeStep::run", second, in.q.batch);
    if (second_source_only_) {
      sparse_decode(in.q, second.cache, second.selection, out, second_attention(second.selection_rows),
                    config_.validate_indices, config_.programmatic_launch, b.decode, ctx);
      return;
    }
    const std::int32_t batch = in.q.batch;
    const StateView<float> partials[] = {
        StateView<float>::packed(b.partial_o[0], b.partial_lse[0], batch, config_.q_heads, config_.head_dim),
        StateView<float>::packed(b.partial_o[1], b.partial_lse[1], batch, config_.q_heads, config_.head_dim)};
    sparse_decode(in.q, cache, selection, partials[0], config_.attention, config_.validate_indices,
                  config_.programmatic_launch, b.decode, ctx);
    sparse_decode(in.q, second.cache, second.selection, partials[1], second_attention(second.selection_rows),
                  config_.validate_indices, config_.programmatic_launch, b.decode, ctx);
    const StateView<const float> merged[] = {partials[0].as_const(), partials[1].as_const()};
    merge_states(std::span<const StateView<const float>>(merged), out, ctx);
  }

  /// The second source is attended whole: the step's scale, no window; its selection's rows through its row map
  /// (SecondSource::selection_rows; none sizes the same workspace).
  AttentionOptions second_attention(const std::int32_t* selection_rows = nullptr) const {
    return {.sm_scale = config_.attention.sm_scale, .selection_rows = selection_rows};
  }

  /// The views the selector returns must have the step's rows and shapes (their contents are the selector's).
  void check_second_source(const char* where, const SecondSource<T>& second, std::int32_t batch) const {
    const SelectionView& s = second.selection;
    KVSIFT_CHECK(second.cache.batch() == batch && (second.selection_rows != nullptr || s.batch == batch), where,
                 "the second source's cache batch (= {}) and selection batch (= {}, with no row map) must be the "
                 "step's batch (= {})",
                 second.cache.batch(), s.batch, batch);
    KVSIFT_CHECK(second.cache.kv_heads() == config_.kv_heads && second.cache.head_dim() == config_.head_dim, where,
                 "the second source's cache has kv_heads {} and head_dim {}; the step has {} and {}",
                 second.cache.kv_heads(), second.cache.head_dim(), config_.kv_heads, config_.head_dim);
    KVSIFT_CHECK(s.capacity <= second_capacity_ && s.attend_all == nullptr, where,
                 "the second source's selection has capacity {} (planned: second_source_capacity() = {}) and {} "
                 "attend_all; it must not exceed the plan nor attend all",
                 s.capacity, second_capacity_, s.attend_all == nullptr ? "no" : "an");
  }

  /// The one layout behind workspace_bytes() (counting) and run() (carving), sized at construction.
  Buffers layout(WorkspaceLayout& layout) const {
    Buffers b;
    b.selector = part_.layout(layout);
    if (second_capacity_ > 0 && !second_source_only_) {
      const std::size_t states = std::size_t(config_.max_batch) * std::size_t(config_.q_heads);
      for (int i = 0; i < 2; ++i) {
        b.partial_o[i] = layout.allocate<float>(states * std::size_t(config_.head_dim), "DecodeStep partial O");
        b.partial_lse[i] = layout.allocate<float>(states, "DecodeStep partial LSE");
      }
    }
    b.decode = layout.span(decode_bytes_, "DecodeStep decode scratch");
    return b;
  }

  std::int32_t second_capacity_;
  bool second_source_only_;  ///< no primary entries and no window: the second source alone, into `out`
  std::size_t decode_bytes_ = 0;
  std::size_t workspace_bytes_ = 0;
  /// The append's own stream and events (appends_beside_select()); empty otherwise.
  std::optional<typename detail::ContextFork<Context>::type> append_fork_;
};

}  // namespace kvsift
