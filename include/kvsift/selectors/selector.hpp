#pragma once
/// The KVSelector concept every retrieval method implements, on the CPU and on CUDA, and AnySelector, its
/// type-erased wrapper for engines that pick the method at run time (docs/selector_framework.md).
///
/// A selector is a class over a storage type T (half, bfloat16; float for references and tests) bound to one
/// execution context (S::context_type: cpu::Context, a thread pool, or cuda::Context, a stream). Its memory
/// (index, per-slot state, the views it is given and writes) is that context's: host for the CPU, device for
/// CUDA. Life cycle, per layer:
///   - construction: the limits (slots, tokens, heads) and the method's parameters; may allocate.
///   - prepare(prefill, ctx): builds the index of the joining sequences (their slots) from the engine's cache
///     and, for methods that cluster queries, the last W prefill queries. May allocate.
///   - per decode step, after the engine (or DecodeStep) appended the step's K/V to the cache:
///     append(inputs, workspace, ctx) updates the index with the new token, then
///     select(inputs, out, workspace, ctx) writes the selection for the step's queries.
///     Neither allocates nor synchronizes the host; per-step state lives in the context's memory, so a CUDA
///     selector's append and select are stream-ordered and CUDA-graph capturable. Scratch comes from the caller's
///     workspace, at least append_workspace_bytes(shape) / select_workspace_bytes(shape) bytes (256-byte aligned,
///     contents irrelevant), queries that need only shapes and the context (a CPU pool's thread count sizes
///     per-thread scratch; a run on a larger pool than the query's is refused).
///   - release(slots): sequences leave; their slots may be prepared again for new ones.
///
/// The selection (core/views.hpp SelectionView): per (batch row, kv head) up to capacity() absolute token
/// positions, distinct, ascending, none inside the attention window (inputs.attention.window, which the
/// attention kernel attends itself: a selector chooses among the middle only); counts in the context's memory;
/// log-weights (SelectionView::log_weights) when the selector declares that it writes them (below).
///
/// Optional, detected (the concept does not require them; selector_writes_log_weights and
/// selector_second_source_capacity read them, 0 / false when absent):
///   - `static constexpr bool writes_log_weights()`: true when select writes a natural-log weight for every
///     entry it lists. The decode step then carves a [max_batch, kv_heads, capacity] fp32 array from its
///     workspace and passes it as out.log_weights; a selector without it gets log_weights == nullptr (the
///     kernels read no weight) and its steps pay nothing. A member function rather than a SelectorLimits field:
///     weighting is a property of the method, not a limit the engine sets, and AnySelector forwards a function.
///   - a second source (CentroidKV's merged rows): `std::int32_t second_source_capacity() const` (> 0; entries
///     per row of the second selection) and `SecondSource<T> second_source(const SelectInputs<T>& in) const`,
///     the views of the second source that the last select wrote for in's rows. The step attends it whole,
///     with no window, as a second fp32 partial and merges it with the primary one by LSE.
///   - a host stage (HasHostStage, CTKVR's recall + rerank): select as a recall on the selector's context, which reads
///     its index and no K/V row, and a stage that finishes the selection on the CPU over a host cache. A GPU
///     selector with one runs only the recall on the GPU in a split placement (step/split_step.hpp), so the device
///     cache need hold only the window. `std::int32_t candidate_capacity(std::int32_t max_seq_len) const`,
///     `recall_workspace_bytes(shape, ctx)`, `recall(in, candidates, workspace, ctx)`, `host_stage()` (an object
///     with `workspace_bytes(batch, candidate_capacity, cpu_ctx)` and `run(q, cache, lengths, attention,
///     candidates, out, update_entries, workspace, cpu_ctx)`, all host memory), `std::int32_t update_capacity()
///     const` (entries per row of an index update the host stage writes, 0: none) and `update(q, slots, entries,
///     replaced, ctx)`, which applies them on the selector's context.
///   - page-level selections (Quest): `std::int32_t selection_page_size() const` (P > 1): select writes, when
///     in.attention.selection_page_size is P, up to capacity() / P page ids per row (pages of P tokens, distinct,
///     within the sequence's pages; sparse decode attends their middle tokens: attention/options.hpp), instead of
///     the pages' tokens; with 1 it writes tokens as above. The local decode step asks for pages
///     (DecodeStepConfig::page_selections), which spares the expansion into tokens. Every selector refuses a
///     selection_page_size it does not write (selector_selection_page_size reads it: 1 when absent).
///   - `bool prepared(std::int32_t slot) const`: whether `slot` holds a prepared sequence (not released since).
///     kvsift's selectors keep this life cycle on the host (selectors/detail/slot_states.hpp): append and select
///     refuse host slots without a sequence, release refuses a slot without one; a decode step with
///     validate_indices checks a CUDA step's device slots through it. selector_slot_prepared reads it (true when
///     absent).
///   - `bool select_reads_append(const AttentionWindow& window) const`: false when select never reads what append
///     wrote in the same step under `window` (A²ATS with a recent window: the step's token is in the window, which
///     select never ranks). The local CUDA decode step then runs the append on a second stream beside the select
///     (DecodeStepConfig::append_beside_select). selector_select_reads_append reads it (true when absent).
///
/// Thread safety: a selector is not synchronized: prepare, append, select and release must not run
/// concurrently on one object; const calls (capacity, *_workspace_bytes, index_bytes, name) may run
/// concurrently with each other. Distinct objects are independent.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

/// Shapes that size a selector's workspaces (host values).
///
/// max_seq_len sizes the scratch that grows with the sequence (OracleTopK's token scores, Quest's page scores):
/// min(max_seq_len, limits.max_tokens) columns, limits.max_tokens where it is 0; so a step planned for 32K tokens
/// on a selector built for 128K takes the 32K workspace. select learns the bound from SelectInputs::max_seq_len,
/// which must be the value the workspace was sized with. A sequence longer than the bound (a device value the
/// host cannot see) is never cut to it: on CUDA its selection rows get count -1 (which the decode step's
/// validation refuses); on the CPU, where lengths are host values, select throws naming the length.
struct SelectShape {
  std::int32_t batch = 0;        ///< batch rows of a step (<= the selector's max_slots)
  std::int32_t q_heads = 0;
  std::int32_t kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t max_seq_len = 0;  ///< bound on every sequence's length, the step's token included (0: max_tokens)
};

/// Bytes a selector keeps, host and device separately.
struct IndexBytes {
  std::size_t host = 0;
  std::size_t device = 0;
};

/// The limits a selector is built for: its per-slot buffers are sized once, at construction or prepare.
struct SelectorLimits {
  std::int32_t max_slots = 1;    ///< sequences that may be live at once (continuous batching)
  std::int32_t max_tokens = 0;   ///< bound on any sequence's length
  std::int32_t q_heads = 0;
  std::int32_t kv_heads = 0;
  std::int32_t head_dim = 0;

  friend bool operator==(const SelectorLimits&, const SelectorLimits&) = default;
};

/// Prefill of the joining sequences (batch row b is sequence slots[b]).
template <class T>
struct PrefillInputs {
  KVCache<const T> cache{};          ///< the engine's cache holding the prompts (post-RoPE keys)
  const std::int32_t* slots = nullptr;  ///< [cache.batch()], context memory
  SequenceView<const T> queries{};   ///< optional: the last W prefill queries [batch, q_heads, W, head_dim] (W may be 0)
  /// optional: the prompts' keys before RoPE [batch, kv_heads, n, head_dim], n >= every prompt's length (token t
  /// of row b is the cache's key t unrotated), for methods that index pre-RoPE keys (A²ATS); without it they
  /// undo RoPE on the cache's keys (inverse rotation; divides out YaRN's attention factor).
  SequenceView<const T> k_pre_rope{};
  RopeConfig rope{};                 ///< the model's RoPE, for methods that need pre-RoPE keys
  std::int32_t layer = 0;
  /// sm_scale and the window the selections will leave out (an index built at prefill excludes the window's
  /// tokens, as CTKVR's lists do). The decode steps set it from their configuration.
  AttentionOptions attention{};
};

/// One decode step's token, already in the cache at position lengths[b] - 1 of each batch row.
template <class T>
struct AppendInputs {
  KVCache<const T> cache{};
  const std::int32_t* slots = nullptr;    ///< [batch], context memory
  const std::int32_t* lengths = nullptr;  ///< [batch] cache.seq_len(b), the new token included; context memory
  HeadsView<const T> k_pre_rope{};        ///< optional: the new token's key before RoPE [batch, kv_heads, head_dim]
  std::int32_t layer = 0;
};

/// One decode step's queries (post-RoPE) [batch, q_heads, head_dim].
template <class T>
struct SelectInputs {
  QueryView<const T> q{};
  KVCache<const T> cache{};
  const std::int32_t* slots = nullptr;    ///< [batch], context memory
  const std::int32_t* lengths = nullptr;  ///< [batch] cache.seq_len(b); context memory
  AttentionOptions attention{};           ///< sm_scale (for softmax scores) and the window the selection leaves out
  std::int32_t layer = 0;
  std::int32_t max_seq_len = 0;           ///< the SelectShape::max_seq_len the workspace was sized with (0: max_tokens)
  /// true: work a selector runs beside its selection on a stream of its own, for its next select (CTKVR's index
  /// update), may still run when select returns; the caller calls the selector's join_beside(ctx) on the same
  /// stream before the selector is used again (DecodeStep: after the attention, which reads none of that work; in
  /// a captured graph, before the capture ends). false: select joins it. Only for a selector with join_beside
  /// (SelectorJoinsBeside); a select that finds work still unjoined joins it first.
  bool defer_beside = false;
};

/// A selector-owned compressed cache attended whole besides the primary selection (CentroidKV: per slot and kv
/// head B merged K/V rows, each with weight log n_t). Views in the context's memory, valid until the selector's
/// next select. Batch row b of `cache` is the step's batch row b: a store kept per slot maps rows to slots through
/// a paged view whose page_indices are the step's slots (one page per slot, as the tests' selector does).
/// `selection` lists rows of `cache`, with their log-weights, capacity second_source_capacity(); it never has
/// attend_all. Its row for batch row b is row b, or with `selection_rows` ([batch], the context's memory; sparse
/// decode's AttentionOptions::selection_rows) row selection_rows[b] of its own batch: a selection kept per slot,
/// read in place (CentroidKV's store, whose rows are the slots). The attention window does not apply to it.
template <class T>
struct SecondSource {
  KVCache<const T> cache{};
  SelectionView selection{};
  const std::int32_t* selection_rows = nullptr;
};

template <class S>
concept KVSelector =
    requires(S& s, const S& cs, const typename S::context_type& ctx, const PrefillInputs<typename S::value_type>& p,
             const AppendInputs<typename S::value_type>& a, const SelectInputs<typename S::value_type>& in,
             const SelectionView& out, std::span<std::byte> workspace, const SelectShape& shape,
             std::span<const std::int32_t> slots) {
      typename S::value_type;
      typename S::context_type;
      { cs.capacity() } -> std::convertible_to<std::int32_t>;
      { cs.select_workspace_bytes(shape, ctx) } -> std::convertible_to<std::size_t>;
      { cs.append_workspace_bytes(shape, ctx) } -> std::convertible_to<std::size_t>;
      s.prepare(p, ctx);
      s.append(a, workspace, ctx);
      s.select(in, out, workspace, ctx);
      s.release(slots);
      { cs.index_bytes() } -> std::convertible_to<IndexBytes>;
      { cs.name() } -> std::convertible_to<std::string_view>;
    };

/// A selector whose select can leave the work it runs beside its selection unjoined (SelectInputs::defer_beside)
/// for join_beside(ctx) to join; nothing to join is nothing.
template <class S>
concept SelectorJoinsBeside = requires(S& s, const typename S::context_type& ctx) { s.join_beside(ctx); };

/// Whether S's select writes log-weights (its optional `writes_log_weights()`; false without it).
template <KVSelector S>
bool selector_writes_log_weights(const S& selector) {
  if constexpr (requires { { selector.writes_log_weights() } -> std::convertible_to<bool>; }) {
    return selector.writes_log_weights();
  } else {
    return false;
  }
}

/// Whether S's select reads what its append wrote in the same step under `window` (its optional
/// `select_reads_append(window)`; true without it: a step runs the append before the select).
template <class S>
bool selector_select_reads_append(const S& selector, const AttentionWindow& window) {
  if constexpr (requires { { selector.select_reads_append(window) } -> std::convertible_to<bool>; }) {
    return selector.select_reads_append(window);
  } else {
    return true;
  }
}

/// Whether `slot` holds a prepared sequence of `selector` (its optional `prepared(slot)`; true without it: a
/// selector that keeps no life cycle accepts every slot).
template <KVSelector S>
bool selector_slot_prepared(const S& selector, std::int32_t slot) {
  if constexpr (requires { { selector.prepared(slot) } -> std::convertible_to<bool>; }) {
    return selector.prepared(slot);
  } else {
    return true;
  }
}

/// A selector type that may have a second source (AnySelector does; its second_source_capacity() says whether
/// the wrapped one has).
template <class S>
concept HasSecondSource = requires(const S& s, const SelectInputs<typename S::value_type>& in) {
  { s.second_source_capacity() } -> std::convertible_to<std::int32_t>;
  { s.second_source(in) } -> std::same_as<SecondSource<typename S::value_type>>;
};

/// A selector that declares a host stage (above): its select splits into a recall on its context and a finish on
/// the CPU.
template <class S>
concept HasHostStage = requires(const S& s, std::int32_t max_seq_len) {
  { s.candidate_capacity(max_seq_len) } -> std::same_as<std::int32_t>;
  { s.update_capacity() } -> std::same_as<std::int32_t>;
  s.host_stage();
};

/// Entries per row of S's second source (its optional `second_source_capacity()`); 0: S has none.
template <KVSelector S>
std::int32_t selector_second_source_capacity(const S& selector) {
  if constexpr (HasSecondSource<S>) {
    return selector.second_source_capacity();
  } else {
    return 0;
  }
}

/// Tokens per page of S's page-level selections (its optional `selection_page_size()`); 1: S selects tokens only.
template <class S>
std::int32_t selector_selection_page_size(const S& selector) {
  if constexpr (requires { { selector.selection_page_size() } -> std::convertible_to<std::int32_t>; }) {
    return selector.selection_page_size();
  } else {
    return 1;
  }
}

/// Owns any KVSelector of storage type T and context Context behind one runtime interface, the optional
/// log-weights, second source, page-level selections and select_reads_append included (as runtime answers:
/// writes_log_weights(), second_source_capacity() 0, selection_page_size() 1 and select_reads_append() true when the
/// wrapped selector has none). Move-only; never empty after construction.
template <class T, class Context>
class AnySelector {
 public:
  using value_type = T;
  using context_type = Context;

  template <KVSelector S>
    requires(std::same_as<typename S::value_type, T> && std::same_as<typename S::context_type, Context> &&
             !std::same_as<std::remove_cvref_t<S>, AnySelector>)
  explicit AnySelector(S selector) : impl_(std::make_unique<Model<S>>(std::move(selector))) {}

  std::int32_t capacity() const { return impl_->capacity(); }
  std::size_t select_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return impl_->select_workspace_bytes(shape, ctx);
  }
  std::size_t append_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return impl_->append_workspace_bytes(shape, ctx);
  }
  void prepare(const PrefillInputs<T>& p, const Context& ctx) { impl_->prepare(p, ctx); }
  void append(const AppendInputs<T>& a, std::span<std::byte> ws, const Context& ctx) { impl_->append(a, ws, ctx); }
  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> ws, const Context& ctx) {
    impl_->select(in, out, ws, ctx);
  }
  void release(std::span<const std::int32_t> slots) { impl_->release(slots); }
  IndexBytes index_bytes() const { return impl_->index_bytes(); }
  std::string_view name() const { return impl_->name(); }
  bool writes_log_weights() const { return impl_->writes_log_weights(); }
  bool prepared(std::int32_t slot) const { return impl_->prepared(slot); }
  bool select_reads_append(const AttentionWindow& window) const { return impl_->select_reads_append(window); }
  std::int32_t second_source_capacity() const { return impl_->second_source_capacity(); }
  std::int32_t selection_page_size() const { return impl_->selection_page_size(); }
  /// Only for a wrapped selector with a second source (second_source_capacity() > 0); refused otherwise.
  SecondSource<T> second_source(const SelectInputs<T>& in) const { return impl_->second_source(in); }

 private:
  struct Interface {
    virtual ~Interface() = default;
    virtual std::int32_t capacity() const = 0;
    virtual std::size_t select_workspace_bytes(const SelectShape&, const Context&) const = 0;
    virtual std::size_t append_workspace_bytes(const SelectShape&, const Context&) const = 0;
    virtual void prepare(const PrefillInputs<T>&, const Context&) = 0;
    virtual void append(const AppendInputs<T>&, std::span<std::byte>, const Context&) = 0;
    virtual void select(const SelectInputs<T>&, const SelectionView&, std::span<std::byte>, const Context&) = 0;
    virtual void release(std::span<const std::int32_t>) = 0;
    virtual IndexBytes index_bytes() const = 0;
    virtual std::string_view name() const = 0;
    virtual bool writes_log_weights() const = 0;
    virtual bool prepared(std::int32_t slot) const = 0;
    virtual bool select_reads_append(const AttentionWindow&) const = 0;
    virtual std::int32_t second_source_capacity() const = 0;
    virtual std::int32_t selection_page_size() const = 0;
    virtual SecondSource<T> second_source(const SelectInputs<T>&) const = 0;
  };
  template <class S>
  struct Model final : Interface {
    explicit Model(S s) : selector(std::move(s)) {}
    std::int32_t capacity() const override { return selector.capacity(); }
    std::size_t select_workspace_bytes(const SelectShape& s, const Context& ctx) const override {
      return selector.select_workspace_bytes(s, ctx);
    }
    std::size_t append_workspace_bytes(const SelectShape& s, const Context& ctx) const override {
      return selector.append_workspace_bytes(s, ctx);
    }
    void prepare(const PrefillInputs<T>& p, const Context& ctx) override { selector.prepare(p, ctx); }
    void append(const AppendInputs<T>& a, std::span<std::byte> ws, const Context& ctx) override {
      selector.append(a, ws, ctx);
    }
    void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> ws,
                const Context& ctx) override {
      selector.select(in, out, ws, ctx);
    }
    void release(std::span<const std::int32_t> slots) override { selector.release(slots); }
    IndexBytes index_bytes() const override { return selector.index_bytes(); }
    std::string_view name() const override { return selector.name(); }
    bool writes_log_weights() const override { return selector_writes_log_weights(selector); }
    bool prepared(std::int32_t slot) const override { return selector_slot_prepared(selector, slot); }
    bool select_reads_append(const AttentionWindow& window) const override {
      return selector_select_reads_append(selector, window);
    }
    std::int32_t second_source_capacity() const override { return selector_second_source_capacity(selector); }
    std::int32_t selection_page_size() const override { return selector_selection_page_size(selector); }
    SecondSource<T> second_source(const SelectInputs<T>& in) const override {
      if constexpr (requires { selector.second_source(in); }) {
        return selector.second_source(in);
      } else {
        KVSIFT_CHECK(false, "AnySelector::second_source", "the wrapped selector ({}) has no second source",
                     selector.name());
        return {};
      }
    }
    S selector;
  };
  std::unique_ptr<Interface> impl_;
};

/// Whether the primitives a selector calls with a Context are declared: cpu/backend.hpp and cuda/backend.hpp each
/// declare backend_included(const Context*) for their context, found by argument-dependent lookup. Selectors
/// check it where they are instantiated, so that a missing include reads as one message rather than as an
/// overload failure deep inside select. Checked once per translation unit, at the first instantiation: include
/// the backend header before it.
template <class Context>
concept BackendIncluded = requires(const Context* ctx) {
  { backend_included(ctx) } -> std::same_as<bool>;
};

/// Context's array of V: a selector's memory (host for cpu::Context, device for cuda::Context).
template <class Context, class V>
using ContextArray = typename Context::template array<V>;

/// The base every selector class over (T, Context) derives from: KVSelector's types, and the BackendIncluded
/// check at the selector's instantiation (the compiler's note names the selector that was instantiated).
template <class T, class Context>
struct SelectorTypes {
  static_assert(BackendIncluded<Context>, "a kvsift selector<T, Context>: include kvsift/cpu/backend.hpp "
                                          "(cpu::Context) or kvsift/cuda/backend.hpp (cuda::Context) before "
                                          "instantiating it");

  using value_type = T;
  using context_type = Context;
};

}  // namespace kvsift
