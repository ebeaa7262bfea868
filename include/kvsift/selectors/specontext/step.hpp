#pragma once
/// SpeContextStep: a model's decode step with one SpeContext selection per step (selectors/specontext/specontext.hpp), the
/// framework's "decode step that takes a selection made outside it" (docs/selector_framework.md, placement (a)
/// with every layer's KV on the GPU; (d) elastic is selectors/specontext/elastic_kv.hpp's). One object per model, not per layer:
///   - select(head inputs) once per step, before layer 0: the lengths (from the given cache), the head's append
///     (its k_r rotated and stored) and select (its q_r rotated, top B per kv head), written once for every
///     placement (step/selector_part.hpp), into the step's workspace;
///   - attend(layer inputs) per layer: the step's token written into that layer's cache when given, then sparse
///     attention of that layer's cache over THE selection and the window, into `out` (T, or fp32). With
///     config.rerank (its budget K > 0), each layer first keeps the best K of the selection by its own exact scores
///     (the rerank stage of selectors/rerank.hpp over that layer's query and keys): the selection serves as c x K
///     candidates (build the selector with budget c x K), and every layer attends its own K of them. Cost per
///     layer: the candidates' keys, c x K per (sequence, kv head), besides the attention.
/// Every layer's sequences have the same lengths (the same tokens), so absolute positions serve every layer.
///
/// The window: config.attention.window (0 + 0 by default, the paper's; 4 + 64 as an option) with at least the
/// current token as its recent part (specontext_window): the step's own token is always attended, exactly once,
/// since the selection leaves the window out.
///
/// Placements (step/placement.hpp): placement::Local (this file), every layer's KV in the context's memory; and
/// placement::LayersOnHost (CUDA, selectors/specontext/offload.hpp), the last layers' KV in pinned host caches,
/// attended from GPU-resident rows that ElasticKV keeps current with the step's one selection. That placement is
/// built on this one's seams: attend_selection attends any cache with any selection and window (a resident buffer
/// of B + 1 rows per (sequence, kv head) with the selection mapped to slot space), and selection(workspace, batch)
/// is the one selection the loader diffs against its last one.
///
/// Memory and calls: views in the context's memory; the workspace of workspace_bytes() bytes (256-byte aligned,
/// contents irrelevant) holds the lengths, the selection, the selector's append and select scratch and the
/// decode's scratch, at offsets fixed at construction for every batch up to config.step.max_batch. select and attend
/// allocate nothing and never synchronize the host (except with config.validate_indices on CUDA); on CUDA, select
/// and the attention of every layer are stream-ordered and CUDA-graph capturable. attend reads the selection of
/// the last select over the same workspace, for the same batch rows. Trusted on the device (CUDA; checked on the
/// CPU), as by DecodeStep: slots, lengths (<= config.max_seq_len) and page tables. A length past the bound is
/// contained (that row's selection count is -1, the attention writes NaN, the head's cache write skips it); a bad
/// slot still reaches the owned head cache's write (selectors/specontext/specontext.hpp), so check slots while integrating.
/// Thread safety: one step serves one thread at a time; it owns its selector.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/rerank.hpp"
#include "kvsift/selectors/specontext/specontext.hpp"
#include "kvsift/step/decode_step.hpp"
#include "kvsift/step/placement.hpp"
#include "kvsift/step/selector_part.hpp"

namespace kvsift {

struct SpeContextStepConfig {
  /// Every layer's decode step (step/decode_step.hpp): sm_scale and window (its recent part raised to at least 1:
  /// specontext_window), batch rows per step (<= the selector's slots), the model's heads and head_dim (the
  /// head's must be the same), the bound on every sequence's length, validation (of the selection before each
  /// layer's attention; on CUDA it synchronizes and cannot be captured) and PDL.
  DecodeStepConfig step{};
  std::int32_t layers = 0;  ///< the model's layers; attend takes a layer in [0, layers)
  /// budget K > 0: each layer keeps the best K of the step's selection by its own exact scores (see above); mass and
  /// floor as the rerank stage has them (top-p per row). Refused: K above the selector's budget, entries > 0,
  /// budget_fraction > 0, and with placement::LayersOnHost (an offloaded layer's keys are on the host). 0: every
  /// layer attends the whole selection.
  RerankConfig rerank{};
};

/// The retrieval head's step: its vectors before RoPE, and the cache the lengths come from.
template <class T>
struct SpeContextHeadInputs {
  QueryView<const T> q{};   ///< q_r [batch, q_heads, head_dim]
  HeadsView<const T> k{};   ///< k_r of the step's token [batch, kv_heads, head_dim]
  /// Owned head cache: any of the model's layer caches (read for the lengths, which count the step's token).
  /// Engine-kept head cache: the head's cache, grown to count the step's token.
  KVCache<const T> cache{};
  const std::int32_t* slots = nullptr;  ///< [batch] each row's selector slot
  /// placement::LayersOnHost only (refused by the local step): the offloaded layers' pinned host caches, one per
  /// layer in order, their lengths counting the step's token.
  std::span<const KVCache<const T>> host_caches{};
};

/// One layer's attention.
template <class T>
struct SpeContextLayerInputs {
  QueryView<const T> q{};  ///< the layer's post-RoPE query [batch, q_heads, head_dim]
  KVCache<T> cache{};      ///< the layer's cache; seq_len(b) counts the step's token
  HeadsView<const T> k{};  ///< optional: the step's K [batch, kv_heads, head_dim] to write first
  HeadsView<const T> v{};  ///< with k
  std::int32_t layer = 0;
};

/// The model-level step over detail::StepBase (step/decode_step.hpp): the selector, the layers' DecodeStepConfig, the
/// selector's part of the step and the planned-run check are the decode step's own. This primary template is the
/// local placement; placement::LayersOnHost is its specialization in selectors/specontext/offload.hpp.
template <class T, class Context, class Placement = placement::Local>
class SpeContextStep : public detail::StepBase<SpeContext<T, Context>> {
  static_assert(std::same_as<Placement, placement::Local>,
                "SpeContextStep<T, Context, Placement>: Placement is placement::Local, or placement::LayersOnHost with "
                "cuda::Context (include kvsift/selectors/specontext/offload.hpp)");
  using Base = detail::StepBase<SpeContext<T, Context>>;
  using Base::config_;
  using Base::part_;
  using Base::planned_threads_;
  using Base::selector_;

 public:
  using value_type = T;
  using context_type = Context;
  using Selector = SpeContext<T, Context>;

  /// Plans the step for every batch of 1 .. config.step.max_batch rows on `ctx`. Refused: the head's (the selector's)
  /// q_heads, kv_heads or head_dim other than the model's (config.step), layers <= 0, max_batch outside [1, the
  /// selector's max_slots], max_seq_len outside [1, its max_tokens], a bad window.
  SpeContextStep(Selector selector, const SpeContextStepConfig& config, const Context& ctx)
      : SpeContextStep(checked(config, selector.limits()), std::move(selector), ctx) {}

  std::int32_t layers() const { return layers_; }
  std::size_t workspace_bytes() const { return workspace_bytes_; }
  /// The selection's capacity: entries per (sequence, kv head), the selector's budget (at least 1).
  std::int32_t capacity() const { return part_.capacity(); }
  /// The rerank per layer (config.rerank), or nullptr when every layer attends the whole selection.
  const RerankConfig* rerank() const { return rerank_ ? &rerank_->config() : nullptr; }
  /// The layers' attention: config().attention with the window's recent part at least 1.
  AttentionOptions attention() const {
    return {.sm_scale = config_.attention.sm_scale, .window = specontext_window(config_.attention.window)};
  }

  /// Prefill of joining sequences: the head's prompt keys (in.k_pre_rope) into its cache (may allocate), with the
  /// layers' attention. The batch changes: attend refuses to run until the next select.
  void prepare(PrefillInputs<T> in, const Context& ctx) {
    in.attention = attention();
    selector_.prepare(in, ctx);
    selected_batch_ = 0;
  }
  /// Sequences leave (the selector refuses a slot without one); attend refuses to run until the next select.
  void release(std::span<const std::int32_t> slots) {
    selector_.release(slots);
    selected_batch_ = 0;
  }

  /// The step's selection, once, before layer 0.
  void select(const SpeContextHeadInputs<T>& in, std::span<std::byte> workspace, const Context& ctx) {
    constexpr const char* where = "SpeContextStep::select";
    check_batch(where, in.q.batch, ctx);
    KVSIFT_CHECK(in.cache.batch() == in.q.batch, where, "in.cache batch (= {}) != in.q.batch (= {})", in.cache.batch(),
                 in.q.batch);
    KVSIFT_CHECK(in.host_caches.empty(), where,
                 "in.host_caches (size {}) is for placement::LayersOnHost: this step's layers are all local",
                 in.host_caches.size());
    WorkspaceLayout carving(workspace, where);
    const Buffers b = layout(carving);
    selected_batch_ = 0;  // a refused select leaves no selection to attend
    if (config_.validate_indices) detail::check_device_slots(where, selector_, in.slots, in.q.batch, ctx);
    part_.run(selector_,
              {.q = in.q, .cache = in.cache, .slots = in.slots, .k_pre_rope = in.k, .attention = attention(), .layer = 0},
              b.selector, ctx);
    selected_batch_ = in.q.batch;
  }

  /// Layer in.layer's attention over the selection of the last select and the window. Refused before any select,
  /// after a prepare or release (until the next select), and for more rows than the last select's.
  template <class TO>
  void attend(const SpeContextLayerInputs<T>& in, const StateView<TO>& out, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = "SpeContextStep::attend";
    check_layer_inputs(where, in, ctx);
    KVSIFT_CHECK(selected_batch_ > 0, where,
                 "no selection to attend: call select for the step first (after construction, prepare and release, "
                 "attend waits for a select)");
    KVSIFT_CHECK(in.q.batch <= selected_batch_, where, "in.q.batch (= {}) exceeds the rows of the last select (= {})",
                 in.q.batch, selected_batch_);
    attend_candidates(in, selection(workspace, in.q.batch), out, workspace, ctx);
  }

  /// Layer in.layer's attention over `candidates` as over the step's own selection (its batch and kv heads the
  /// layer's, capacity at most capacity()): with config.rerank over the layer's best rerank.budget of them, else
  /// over all; the step's window. For selections kept from earlier selects (a block of positions selected first,
  /// then attended layer by layer). With `validate_indices` (or config.validate_indices) the candidates are checked
  /// first (counts, range, duplicates, window); with config.rerank that check is a validated attention of the
  /// candidates into `out`, which the kept selection's attention then overwrites.
  template <class TO>
  void attend_candidates(const SpeContextLayerInputs<T>& in, const SelectionView& candidates,
                         const StateView<TO>& out, std::span<std::byte> workspace, const Context& ctx,
                         bool validate_indices = false) {
    constexpr const char* where = "SpeContextStep::attend";
    if (!rerank_) {
      attend_selection(in, candidates, attention().window, out, workspace, ctx, validate_indices);
      return;
    }
    check_layer_inputs(where, in, ctx);
    KVSIFT_CHECK(candidates.batch == in.q.batch && candidates.kv_heads == config_.kv_heads, where,
                 "candidates [batch = {}, kv_heads = {}] != [{}, {}]", candidates.batch, candidates.kv_heads,
                 in.q.batch, config_.kv_heads);
    KVSIFT_CHECK(candidates.capacity <= part_.capacity(), where,
                 "candidates.capacity (= {}) exceeds the planned capacity (= {})", candidates.capacity,
                 part_.capacity());
    if (validate_indices || config_.validate_indices) {
      SpeContextLayerInputs<T> read_only = in;  // the step's token is written once, below
      read_only.k = {};
      read_only.v = {};
      attend_selection(read_only, candidates, attention().window, out, workspace, ctx, true);
    }
    // The candidates are middle tokens (the window holds the step's own), so the layer's cache already has their
    // keys whether or not in.k is written first.
    WorkspaceLayout carving(workspace, where);
    const Buffers b = layout(carving);
    const SelectionView kept = kept_view(b, in.q.batch);
    rerank_->run(in.q, KVCache<const T>(in.cache), b.selector.lengths, attention(), candidates, kept, SelectionView{},
                 b.rerank, ctx);
    attend_selection(in, kept, attention().window, out, workspace, ctx);
  }

  /// With config.rerank: the selection the last attend over this workspace attended, its `batch` rows (the best
  /// rerank.budget of the step's selection by that layer's scores; context memory). Refused without config.rerank.
  SelectionView reranked_selection(std::span<std::byte> workspace, std::int32_t batch) const {
    constexpr const char* where = "SpeContextStep::reranked_selection";
    KVSIFT_CHECK(rerank_.has_value(), where, "config.rerank.budget is 0: the layers attend the step's selection");
    KVSIFT_CHECK(batch > 0 && batch <= config_.max_batch, where, "batch (= {}) is outside [1, config.max_batch = {}]",
                 batch, config_.max_batch);
    WorkspaceLayout carving(workspace, where);
    return kept_view(layout(carving), batch);
  }

  /// Layer in.layer's attention over any `selection` (its batch and kv heads the layer's) and `window`: the seam
  /// for offloaded layers, attended from a resident buffer (in.cache) with a slot-space selection. The selection
  /// is checked (counts, range, duplicates, window) with config.validate_indices or `validate_indices`: a
  /// selection made outside the step (Python's attend(selection=) checks by default).
  template <class TO>
  void attend_selection(const SpeContextLayerInputs<T>& in, const SelectionView& selection,
                        const AttentionWindow& window, const StateView<TO>& out, std::span<std::byte> workspace,
                        const Context& ctx, bool validate_indices = false) {
    constexpr const char* where = "SpeContextStep::attend";
    check_layer_inputs(where, in, ctx);
    KVSIFT_CHECK(selection.capacity <= part_.capacity(), where,
                 "selection.capacity (= {}) exceeds the planned capacity (= {})", selection.capacity, part_.capacity());
    WorkspaceLayout carving(workspace, where);
    const Buffers b = layout(carving);
    if (in.k.data != nullptr || in.v.data != nullptr) {
      KVSIFT_CHECK(in.k.data != nullptr && in.v.data != nullptr, where, "in.k and in.v must be given together");
      write_step_kv(in.cache, in.k, in.v, ctx);
    }
    sparse_decode(in.q, KVCache<const T>(in.cache), selection, out,
                  AttentionOptions{.sm_scale = config_.attention.sm_scale, .window = window},
                  config_.validate_indices || validate_indices, config_.programmatic_launch, b.decode, ctx);
  }

  /// The selection of the last select over this workspace, for its `batch` rows (context memory).
  SelectionView selection(std::span<std::byte> workspace, std::int32_t batch) const {
    constexpr const char* where = "SpeContextStep::selection";
    WorkspaceLayout carving(workspace, where);
    return Base::planned_selection(where, layout(carving).selector, batch);
  }

 private:
  struct Buffers {
    typename detail::SelectorPart<Selector>::Buffers selector;
    std::span<std::byte> decode;
    std::int32_t *kept_indices = nullptr, *kept_counts = nullptr;  ///< config.rerank: a layer's kept selection
    std::span<std::byte> rerank;                                     ///< config.rerank: the stage's workspace
  };

  /// The constructor's body, once the configuration is checked (the selector is moved only here).
  SpeContextStep(const SpeContextStepConfig& config, Selector&& selector, const Context& ctx)
      : Base(std::move(selector), config.step, ctx, "SpeContextStep"), layers_(config.layers) {
    if (config.rerank.budget > 0) rerank_.emplace(selector_.limits(), checked_rerank(config.rerank, part_.capacity()));
    // Fewer rows may split more; planned with validation, which attend_selection may ask for per call.
    for (std::int32_t batch = 1; batch <= config_.max_batch; ++batch) {
      decode_bytes_ = std::max(decode_bytes_, sparse_decode_workspace_bytes(
                                                  batch, config_.q_heads, config_.kv_heads, config_.head_dim,
                                                  part_.capacity(), config_.max_seq_len, attention(),
                                                  /*validate_indices=*/true, ctx));
    }
    // The stage's scratch grows with the rows (one plan per batch, as for the decode above).
    for (std::int32_t batch = 1; rerank_ && batch <= config_.max_batch; ++batch) {
      rerank_bytes_ = std::max(rerank_bytes_, rerank_->workspace_bytes(batch, part_.capacity(), ctx));
    }
    WorkspaceLayout counting;
    layout(counting);
    workspace_bytes_ = counting.bytes();
  }

  void check_batch(const char* where, std::int32_t batch, const Context& ctx) const {
    detail::check_planned_run(where, "batch", batch, config_.max_batch, workspace_threads(ctx), planned_threads_);
  }

  void check_layer_inputs(const char* where, const SpeContextLayerInputs<T>& in, const Context& ctx) const {
    check_batch(where, in.q.batch, ctx);
    KVSIFT_CHECK(in.layer >= 0 && in.layer < layers_, where, "in.layer (= {}) is outside [0, config.layers = {})",
                 in.layer, layers_);
    KVSIFT_CHECK(in.cache.batch() == in.q.batch, where, "in.cache batch (= {}) != in.q.batch (= {})", in.cache.batch(),
                 in.q.batch);
  }

  static const RerankConfig& checked_rerank(const RerankConfig& rerank, std::int32_t capacity) {
    constexpr const char* where = "SpeContextStep";
    KVSIFT_CHECK(rerank.budget <= capacity, where,
                 "config.rerank.budget (= {}) exceeds the selector's budget (= {}): build SpeContext with c x K "
                 "candidates",
                 rerank.budget, capacity);
    KVSIFT_CHECK(rerank.entries == 0, where, "config.rerank.entries (= {}) must be 0: the step has no index to update",
                 rerank.entries);
    KVSIFT_CHECK(rerank.budget_fraction == 0, where,
                 "config.rerank.budget_fraction (= {}) must be 0: every layer keeps config.rerank.budget (or its mass's "
                 "share)",
                 rerank.budget_fraction);
    return rerank;
  }

  static const SpeContextStepConfig& checked(const SpeContextStepConfig& config, const SelectorLimits& head) {
    constexpr const char* where = "SpeContextStep";
    const DecodeStepConfig& c = config.step;
    KVSIFT_CHECK(head.q_heads == c.q_heads && head.kv_heads == c.kv_heads && head.head_dim == c.head_dim, where,
                 "the retrieval head has q_heads {}, kv_heads {}, head_dim {}; the model (config.step) has {}, {}, {}: "
                 "they must be equal",
                 head.q_heads, head.kv_heads, head.head_dim, c.q_heads, c.kv_heads, c.head_dim);
    KVSIFT_CHECK(config.layers > 0, where, "config.layers (= {}) must be positive", config.layers);
    const RerankConfig& r = config.rerank;
    KVSIFT_CHECK(r.budget >= 0, where, "config.rerank.budget (= {}) must be >= 0 (0: no rerank)", r.budget);
    KVSIFT_CHECK(r.budget > 0 || (r.budget_fraction == 0 && r.entries == 0 && r.mass == 0 && r.floor == 1), where,
                 "config.rerank (budget_fraction {}, entries {}, mass {}, floor {}) is set with config.rerank.budget "
                 "= 0, which turns the rerank off",
                 r.budget_fraction, r.entries, r.mass, r.floor);
    KVSIFT_CHECK(c.max_batch > 0 && c.max_batch <= head.max_slots, where,
                 "config.step.max_batch (= {}) is outside [1, the selector's max_slots = {}]", c.max_batch,
                 head.max_slots);
    KVSIFT_CHECK(c.max_seq_len > 0 && c.max_seq_len <= head.max_tokens, where,
                 "config.step.max_seq_len (= {}) is outside [1, the selector's max_tokens = {}]", c.max_seq_len,
                 head.max_tokens);
    return config;
  }

  /// The one layout behind workspace_bytes() (counting) and the calls (carving), sized at construction.
  Buffers layout(WorkspaceLayout& layout) const {
    Buffers b;
    b.selector = part_.layout(layout);
    b.decode = layout.span(decode_bytes_, "SpeContextStep decode scratch");
    if (rerank_) {
      const std::size_t rows = std::size_t(config_.max_batch) * std::size_t(config_.kv_heads);
      b.kept_indices = layout.allocate<std::int32_t>(rows * std::size_t(rerank_->config().budget), "a layer's kept rows");
      b.kept_counts = layout.allocate<std::int32_t>(rows, "a layer's kept counts");
      b.rerank = layout.span(rerank_bytes_, "SpeContextStep rerank scratch");
    }
    return b;
  }
  SelectionView kept_view(const Buffers& b, std::int32_t batch) const {
    return {b.kept_indices, b.kept_counts, nullptr, batch, config_.kv_heads, rerank_->config().budget};
  }

  std::int32_t layers_;
  std::int32_t selected_batch_ = 0;  ///< rows of the last select (0: none to attend)
  std::size_t decode_bytes_ = 0;
  std::optional<RerankStage<T, Context>> rerank_;
  std::size_t rerank_bytes_ = 0;
  std::size_t workspace_bytes_ = 0;
};

}  // namespace kvsift
