#pragma once
/// DecodeStep: one layer's decode step, select -> sparse attention (with the window) in one object, planned
/// once. Include cpu/backend.hpp or cuda/backend.hpp (or both) before using it with that backend's selectors.
///
/// The placement follows the selector's context: with a cuda::Context everything runs on one stream (select,
/// attend), CUDA-graph capturable end to end; with a cpu::Context everything runs on the thread pool. (The
/// hybrid placement, the window on the GPU and the selected middle on the CPU, is step/hybrid_decoder.hpp.)
///
/// run() per step, in this order (docs/selector_framework.md):
///   1. the step's token: if in.k and in.v are given, they are written into the cache at position
///      seq_len(b) - 1 (the engine has grown the cache's lengths or page table to count it); otherwise the
///      engine wrote them. A decode query attends to its own token, as in every engine.
///   2. lengths[b] = cache.seq_len(b), once, into the workspace (context memory), for the selector;
///   3. selector.append (the index learns the new token), then selector.select (the middle tokens);
///   4. sparse attention over the window (config.attention.window, attended by the kernel in the same launch)
///      and the selection, into `out` (storage type, or fp32 for a partial to merge later).
/// The selection stays in the workspace until the next run: selection(workspace, batch) reads it (the fidelity
/// harness scores it).
///
/// Memory: the views in StepInputs and `out` are in the context's memory; the workspace, of workspace_bytes()
/// bytes (256-byte aligned, contents irrelevant), holds lengths, the selection and the selector's and the
/// decode's scratch, at offsets fixed at construction for every batch up to config.max_batch. run() allocates
/// nothing, queries nothing and never synchronizes the host (except with config.validate_indices on CUDA,
/// which checks the selection and throws on the host).
///
/// Trusted on the device (CUDA; checked on the CPU): the slots (in [0, the selector's max_slots)), every
/// sequence's length (<= config.max_seq_len and the selector's max_tokens) and the cache's page tables. A
/// primitive that meets a bad device value marks that selection row with count -1 (cuda/topk.hpp,
/// cuda/page_bounds.hpp); config.validate_indices refuses it by name, without it that row's output is wrong
/// (memory stays in bounds). Run with validate_indices while integrating.
/// Thread safety: one step serves one thread at a time; it owns its selector.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/selector.hpp"

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
};

template <class T>
struct StepInputs {
  QueryView<const T> q{};               ///< [batch, q_heads, head_dim], post-RoPE
  KVCache<T> cache{};                   ///< the engine's cache; seq_len(b) counts the step's token
  HeadsView<const T> k{};               ///< optional: the step's new K [batch, kv_heads, head_dim] to write first
  HeadsView<const T> v{};               ///< with k
  HeadsView<const T> k_pre_rope{};      ///< optional, for selectors that index pre-RoPE keys
  const std::int32_t* slots = nullptr;  ///< [batch] each row's selector slot, context memory
  std::int32_t layer = 0;
};

template <KVSelector S>
class DecodeStep {
 public:
  using value_type = typename S::value_type;
  using context_type = typename S::context_type;
  using T = value_type;
  using Context = context_type;

  /// Plans the step for every batch of 1 .. config.max_batch rows on `ctx` (a CPU pool's thread count sizes
  /// per-thread scratch: run() refuses a larger pool). May allocate (the selector's own state).
  DecodeStep(S selector, const DecodeStepConfig& config, const Context& ctx)
      : selector_(std::move(selector)), config_(config), capacity_(std::max(1, selector_.capacity())),
        planned_threads_(workspace_threads(ctx)) {
    constexpr const char* where = "DecodeStep";
    KVSIFT_CHECK(config.max_batch > 0, where, "config.max_batch (= {}) must be positive", config.max_batch);
    KVSIFT_CHECK(config.max_seq_len > 0, where, "config.max_seq_len (= {}) must be positive", config.max_seq_len);
    validate(config.attention.window, where, "config.attention.window");
    // Fewer rows may split more (a CPU pool's threads, a GPU's SMs): the largest need of any batch size.
    for (std::int32_t batch = 1; batch <= config.max_batch; ++batch) {
      const SelectShape shape{batch, config.q_heads, config.kv_heads, config.head_dim, config.max_seq_len};
      scratch_.append = std::max(scratch_.append, selector_.append_workspace_bytes(shape, ctx));
      scratch_.select = std::max(scratch_.select, selector_.select_workspace_bytes(shape, ctx));
      scratch_.decode = std::max(scratch_.decode, sparse_decode_workspace_bytes(
                                                      batch, config.q_heads, config.kv_heads, config.head_dim,
                                                      capacity_, config.max_seq_len, config.attention,
                                                      config.validate_indices, ctx));
    }
    WorkspaceLayout counting;
    layout(counting);
    workspace_bytes_ = counting.bytes();
  }

  S& selector() { return selector_; }
  const S& selector() const { return selector_; }
  const DecodeStepConfig& config() const { return config_; }
  std::size_t workspace_bytes() const { return workspace_bytes_; }

  /// Prefill of joining sequences: the selector's prepare (may allocate).
  void prepare(const PrefillInputs<T>& in, const Context& ctx) { selector_.prepare(in, ctx); }
  /// Sequences leave: the selector's release.
  void release(std::span<const std::int32_t> slots) { selector_.release(slots); }

  template <class TO>
  void run(const StepInputs<T>& in, const StateView<TO>& out, std::span<std::byte> workspace, const Context& ctx) {
    constexpr const char* where = "DecodeStep::run";
    KVSIFT_CHECK(in.q.batch > 0 && in.q.batch <= config_.max_batch, where,
                 "in.q.batch (= {}) is outside [1, config.max_batch = {}]", in.q.batch, config_.max_batch);
    KVSIFT_CHECK(in.cache.batch() == in.q.batch, where, "in.cache batch (= {}) != in.q.batch (= {})",
                 in.cache.batch(), in.q.batch);
    KVSIFT_CHECK(workspace_threads(ctx) <= planned_threads_, where,
                 "the context has {} threads, the step was planned for {}: plan the step with the pool it runs on",
                 workspace_threads(ctx), planned_threads_);
    WorkspaceLayout carving(workspace, where);
    const Buffers b = layout(carving);
    if (in.k.data != nullptr || in.v.data != nullptr) {
      KVSIFT_CHECK(in.k.data != nullptr && in.v.data != nullptr, where, "in.k and in.v must be given together");
      write_step_kv(in.cache, in.k, in.v, ctx);
    }
    const KVCache<const T> cache = in.cache;
    sequence_lengths(cache, b.lengths, ctx);
    const SelectionView selection = selection_view(b, in.q.batch);
    selector_.append({.cache = cache, .slots = in.slots, .lengths = b.lengths, .k_pre_rope = in.k_pre_rope,
                      .layer = in.layer},
                     b.append, ctx);
    selector_.select({.q = in.q, .cache = cache, .slots = in.slots, .lengths = b.lengths,
                      .attention = config_.attention, .layer = in.layer},
                     selection, b.select, ctx);
    sparse_decode(in.q, cache, selection, out, config_.attention, config_.validate_indices,
                  config_.programmatic_launch, b.decode, ctx);
  }

  /// The selection of the last run() over this workspace, for that run's `batch` rows (context memory).
  SelectionView selection(std::span<std::byte> workspace, std::int32_t batch) const {
    constexpr const char* where = "DecodeStep::selection";
    KVSIFT_CHECK(batch > 0 && batch <= config_.max_batch, where, "batch (= {}) is outside [1, config.max_batch = {}]",
                 batch, config_.max_batch);
    WorkspaceLayout carving(workspace, where);
    return selection_view(layout(carving), batch);
  }

 private:
  struct Scratch {
    std::size_t append = 0, select = 0, decode = 0;
  };
  struct Buffers {
    std::int32_t* lengths;
    std::int32_t* indices;
    std::int32_t* counts;
    std::span<std::byte> append, select, decode;
  };

  /// The one layout behind workspace_bytes() (counting) and run() (carving), sized at construction.
  Buffers layout(WorkspaceLayout& layout) const {
    const std::size_t rows = std::size_t(config_.max_batch) * std::size_t(config_.kv_heads);
    Buffers b{};
    b.lengths = layout.allocate<std::int32_t>(std::size_t(config_.max_batch), "DecodeStep lengths");
    b.indices = layout.allocate<std::int32_t>(rows * std::size_t(capacity_), "DecodeStep selection indices");
    b.counts = layout.allocate<std::int32_t>(rows, "DecodeStep selection counts");
    b.append = layout.span(scratch_.append, "DecodeStep selector append scratch");
    b.select = layout.span(scratch_.select, "DecodeStep selector select scratch");
    b.decode = layout.span(scratch_.decode, "DecodeStep decode scratch");
    return b;
  }
  SelectionView selection_view(const Buffers& b, std::int32_t batch) const {
    return {b.indices, b.counts, nullptr, batch, config_.kv_heads, capacity_};
  }

  S selector_;
  DecodeStepConfig config_;
  std::int32_t capacity_;
  std::int32_t planned_threads_;
  Scratch scratch_;
  std::size_t workspace_bytes_ = 0;
};

}  // namespace kvsift
