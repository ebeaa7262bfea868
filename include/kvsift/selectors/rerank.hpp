#pragma once
/// The rerank stage any selector can end with (docs/selector_framework.md, "Rerank"): a selector proposes
/// candidates, the stage reads their keys from the engine's cache, scores them exactly and keeps the best.
///   - RerankStage<T, Context>: candidates (token ids per (sequence, kv head), any order within a row) -> the best
///     `budget` of them by the exact score, as ascending token ids; optionally also the best `entries` (an index
///     update's rows, CTKVR's new list). The exact score of a candidate is the GQA group's softmax weight, max over
///     the group, the softmax taken over the row's candidates (candidate_scores with rerank_score_options): the
///     ranking inside a head is the attention's own; across the group's heads each head's weights sum to one over
///     the candidates. Ties go to the smaller candidate ordinal (topk_rows' rule), so both backends agree exactly.
///     With config.mass = p > 0 a row keeps fewer: the fewest of its best candidates whose scores sum to p of its
///     total (top-p; mass_budgets, exact in fixed point on both backends), at least config.floor.
///   - Reranked<S>: a selector whose proposer S selects S.capacity() candidates (c x K: build S with the larger
///     budget) that the stage reduces to the best K = config.budget. The window stays the proposer's concern: it
///     never proposes window tokens, so none is kept. Cost: c x K keys read per (sequence, kv head) besides the
///     proposer's select.
/// Written once for both backends from the shared primitives (candidate_scores, length_budgets, mass_budgets,
/// topk_rows with the candidates as its ids); include cpu/backend.hpp or cuda/backend.hpp before instantiating either.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "kvsift/core/error.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

struct RerankConfig {
  /// K: candidates kept per (sequence, kv head), the best by their exact scores (the selection's capacity).
  std::int32_t budget = 0;
  /// > 0: each row keeps floor(budget_fraction * its current length) (the step's token included), at most
  /// `budget` (CTKVR's dynamic budget). 0: every row keeps `budget`.
  double budget_fraction = 0;
  /// > 0: also the best `entries` of each row's candidates, for an index update (CTKVR's new list). 0: none.
  std::int32_t entries = 0;
  /// p in (0, 1]: each row keeps the fewest of its best candidates whose exact scores sum to at least p of the
  /// row's total (top-p, as Twilight prunes; mass_budgets, core/ranking.hpp MassBudget, in fixed point: the same
  /// rows on both backends), at least `floor` and at most `budget` (with budget_fraction, at most the length's
  /// budget too: the smaller of the two). 0: off. The selection's counts then vary per row.
  double mass = 0;
  /// With mass > 0, the fewest candidates a row keeps (a row with fewer candidates keeps them all); in [1,
  /// budget]. Default 1: the adaptive budget alone decides (a peaked row may keep a single token).
  std::int32_t floor = 1;
};

namespace detail {

/// The rerank's exact score: the group's softmax weight over the candidates, max over the group.
inline GroupScoreOptions rerank_score_options(const AttentionOptions& attention) {
  return {.sm_scale = attention.sm_scale, .reduce = GroupReduce::max, .softmax = true};
}

inline const RerankConfig& checked_rerank_config(const char* where, const RerankConfig& c) {
  KVSIFT_CHECK(c.budget > 0, where, "config.budget (= {}) must be positive", c.budget);
  KVSIFT_CHECK(std::isfinite(c.budget_fraction) && c.budget_fraction >= 0 && c.budget_fraction <= 1, where,
               "config.budget_fraction (= {}) is outside [0, 1]", c.budget_fraction);
  KVSIFT_CHECK(c.entries >= 0, where, "config.entries (= {}) must be >= 0", c.entries);
  KVSIFT_CHECK(std::isfinite(c.mass) && c.mass >= 0 && c.mass <= 1, where,
               "config.mass (= {}) is outside [0, 1] (0: off)", c.mass);
  KVSIFT_CHECK(c.floor >= 1 && c.floor <= c.budget, where, "config.floor (= {}) is outside [1, config.budget = {}]",
               c.floor, c.budget);
  return c;
}

}  // namespace detail

template <class T, class Context>
class RerankStage {
  static_assert(BackendIncluded<Context>, "RerankStage<T, Context>: include kvsift/cpu/backend.hpp or "
                                          "kvsift/cuda/backend.hpp first");

 public:
  /// The stage for `limits`' heads. Refused: a config RerankConfig's comments rule out.
  RerankStage(const SelectorLimits& limits, const RerankConfig& config)
      : limits_(limits), config_(detail::checked_rerank_config("RerankStage", config)) {}

  const RerankConfig& config() const { return config_; }

  /// Workspace of run() for `batch` rows of `candidate_capacity` candidates.
  std::size_t workspace_bytes(std::int32_t batch, std::int32_t candidate_capacity, const Context& ctx) const {
    WorkspaceLayout counting;
    layout(counting, batch, candidate_capacity, ctx);
    return counting.bytes();
  }

  /// candidates [batch, kv_heads, capacity] (token ids; counts per row) -> out [batch, kv_heads, >= budget] token
  /// ids, ascending; and, when entries.indices is set (config.entries > 0), entries [batch, kv_heads, >= entries]
  /// the best config.entries. q, cache, lengths ([batch], the cache's; read with budget_fraction only) and every
  /// view in the context's memory. A candidate row with count -1 gives an output row with count -1.
  /// run() is score(), keep() and keep_entries() in turn over one workspace; a caller may run keep_entries() on a
  /// second stream beside keep() (they write apart; CTKVR's dynamic update does, selectors/ctkvr/ctkvr.hpp).
  void run(const QueryView<const T>& q, const KVCache<const T>& cache, const std::int32_t* lengths,
           const AttentionOptions& attention, const SelectionView& candidates, const SelectionView& out,
           const SelectionView& entries, std::span<std::byte> workspace, const Context& ctx) const {
    constexpr const char* where = "RerankStage::run";
    check_out(where, out);  // before any launch
    if (entries.indices != nullptr) check_entries(where, entries);
    score(q, cache, attention, candidates, workspace, ctx);
    keep(lengths, candidates, out, workspace, ctx);
    if (entries.indices != nullptr) keep_entries(candidates, entries, workspace, ctx);
  }

  /// The candidates' exact scores, into the workspace, for keep() and keep_entries() over the same workspace.
  void score(const QueryView<const T>& q, const KVCache<const T>& cache, const AttentionOptions& attention,
             const SelectionView& candidates, std::span<std::byte> workspace, const Context& ctx) const {
    const Buffers w = carve(workspace, candidates, "RerankStage::score", ctx);
    candidate_scores(q, cache, candidates, detail::rerank_score_options(attention),
                     MatrixView<float>::packed(w.scores, std::int64_t(candidates.batch) * limits_.kv_heads,
                                               candidates.capacity),
                     w.scores_scratch, ctx);
  }

  /// The best budget (by length and mass where configured) of the scored candidates into `out`.
  void keep(const std::int32_t* lengths, const SelectionView& candidates, const SelectionView& out,
            std::span<std::byte> workspace, const Context& ctx) const {
    constexpr const char* where = "RerankStage::keep";
    check_out(where, out);
    const Buffers w = carve(workspace, candidates, where, ctx);
    const std::int32_t batch = candidates.batch;
    const std::int64_t rows = std::int64_t(batch) * limits_.kv_heads;
    const auto ranked = MatrixView<const float>::packed(w.scores, rows, candidates.capacity);
    TopKRowsOptions budget_options{.ids = candidates.indices, .ids_stride = candidates.capacity};
    if (config_.budget_fraction > 0) {
      length_budgets(lengths, batch, limits_.kv_heads, {.fraction = config_.budget_fraction, .maximum = config_.budget},
                     w.length_k, ctx);
      budget_options.row_k = w.length_k;
    }
    if (config_.mass > 0) {
      mass_budgets(ranked, candidates.counts,
                   {.mass = config_.mass, .floor = config_.floor, .maximum = config_.budget, .limits = budget_options.row_k},
                   w.mass_k, ctx);
      budget_options.row_k = w.mass_k;
    }
    const SelectionView positions{out.indices, out.counts, out.log_weights, std::int32_t(rows), 1, out.capacity};
    topk_rows(ranked, candidates.counts, config_.budget, budget_options, positions, w.topk_scratch, ctx);
  }

  /// The best config.entries of the scored candidates into `entries` (config.entries > 0), with scratch of its own.
  void keep_entries(const SelectionView& candidates, const SelectionView& entries, std::span<std::byte> workspace,
                    const Context& ctx) const {
    constexpr const char* where = "RerankStage::keep_entries";
    check_entries(where, entries);
    const Buffers w = carve(workspace, candidates, where, ctx);
    const std::int64_t rows = std::int64_t(candidates.batch) * limits_.kv_heads;
    const SelectionView entry_rows{entries.indices, entries.counts, nullptr, std::int32_t(rows), 1, entries.capacity};
    topk_rows(MatrixView<const float>::packed(w.scores, rows, candidates.capacity), candidates.counts, config_.entries,
              {.ids = candidates.indices, .ids_stride = candidates.capacity}, entry_rows, w.entries_topk_scratch, ctx);
  }

 private:
  void check_out(const char* where, const SelectionView& out) const {
    KVSIFT_CHECK(out.capacity >= config_.budget, where, "out.capacity (= {}) < config.budget (= {})", out.capacity,
                 config_.budget);
  }
  void check_entries(const char* where, const SelectionView& entries) const {
    KVSIFT_CHECK(entries.indices != nullptr && config_.entries > 0 && entries.capacity >= config_.entries, where,
                 "entries (capacity {}) given with config.entries = {}: entries needs config.entries > 0 and at least "
                 "that capacity",
                 entries.capacity, config_.entries);
  }
  struct Buffers {
    float* scores;
    std::int32_t *length_k, *mass_k;  ///< the rows' budgets by length (budget_fraction) and by mass
    std::span<std::byte> scores_scratch, topk_scratch, entries_topk_scratch;
  };
  Buffers carve(std::span<std::byte> workspace, const SelectionView& candidates, const char* where,
                const Context& ctx) const {
    WorkspaceLayout carving(workspace, where);
    return layout(carving, candidates.batch, candidates.capacity, ctx);
  }
  Buffers layout(WorkspaceLayout& layout, std::int32_t batch, std::int32_t capacity, const Context& ctx) const {
    const std::int64_t rows = std::int64_t(batch) * limits_.kv_heads;
    Buffers b{};
    b.scores = layout.allocate<float>(std::size_t(rows) * std::size_t(capacity), "rerank candidate scores");
    b.length_k = config_.budget_fraction > 0
                     ? layout.allocate<std::int32_t>(std::size_t(rows), "rerank budgets per row by length")
                     : nullptr;
    b.mass_k = config_.mass > 0 ? layout.allocate<std::int32_t>(std::size_t(rows), "rerank budgets per row by mass")
                                : nullptr;
    b.scores_scratch = layout.span(
        candidate_scores_workspace_bytes(rows, limits_.q_heads / limits_.kv_heads, capacity, ctx),
        "rerank candidate scores scratch");
    b.topk_scratch =
        layout.span(topk_rows_workspace_bytes(rows, capacity, config_.budget, {}, ctx), "rerank top-k scratch");
    if (config_.entries > 0) {
      b.entries_topk_scratch = layout.span(topk_rows_workspace_bytes(rows, capacity, config_.entries, {}, ctx),
                                           "rerank entries top-k scratch");
    }
    return b;
  }

  SelectorLimits limits_;
  RerankConfig config_;
};

/// S (the proposer, a KVSelector with limits()) followed by the rerank stage: see above. Refused at construction:
/// config.budget above S's capacity (at S's capacity the stage keeps all of S's selection, so the proposer should
/// be built with c x K, c > 1), config.entries (no index to update here), an S that writes log-weights (its entries
/// carry weights the rerank would drop). An S with a second source does not compile (its rows are not the
/// cache's tokens).
template <KVSelector S>
class Reranked : public SelectorTypes<typename S::value_type, typename S::context_type> {
  using T = typename S::value_type;
  using Context = typename S::context_type;
  static_assert(!HasSecondSource<S>, "Reranked<S>: S has a second source; its rows are not the cache's tokens");

 public:
  Reranked(S proposer, const RerankConfig& config)
      : proposer_(std::move(proposer)),
        stage_(proposer_.limits(), checked(proposer_, config)),
        name_(std::string(proposer_.name()) + " + rerank") {}

  std::string_view name() const { return name_; }
  const SelectorLimits& limits() const { return proposer_.limits(); }
  std::int32_t capacity() const { return stage_.config().budget; }
  const RerankConfig& config() const { return stage_.config(); }
  S& proposer() { return proposer_; }
  const S& proposer() const { return proposer_; }

  std::size_t select_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return detail::workspace_bytes("Reranked::select_workspace_bytes", limits(), shape,
                                   [&](WorkspaceLayout& counting) { layout(counting, shape, ctx); });
  }
  std::size_t append_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return proposer_.append_workspace_bytes(shape, ctx);
  }
  IndexBytes index_bytes() const { return proposer_.index_bytes(); }
  bool prepared(std::int32_t slot) const { return selector_slot_prepared(proposer_, slot); }
  /// The proposer's answer (selectors/selector.hpp): the stage reads the candidates' keys from the cache, which the
  /// step writes before the append, and nothing the append writes.
  bool select_reads_append(const AttentionWindow& window) const {
    return selector_select_reads_append(proposer_, window);
  }

  void prepare(const PrefillInputs<T>& in, const Context& ctx) { proposer_.prepare(in, ctx); }
  void append(const AppendInputs<T>& in, std::span<std::byte> workspace, const Context& ctx) {
    proposer_.append(in, workspace, ctx);
  }
  void release(std::span<const std::int32_t> slots) { proposer_.release(slots); }

  /// The proposer's selection into the workspace, then the stage's best capacity() of it into `out`. The inputs
  /// are the proposer's to check (its refusals name it, as its append's do); `out` is checked here.
  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = "Reranked::select";
    const SelectorLimits& l = limits();
    KVSIFT_CHECK(in.q.batch > 0 && in.q.batch <= l.max_slots, where, "in.q.batch (= {}) is outside [1, {}]",
                 in.q.batch, l.max_slots);
    KVSIFT_CHECK(out.indices != nullptr && out.counts != nullptr, where, "out.indices and out.counts must be non-null");
    KVSIFT_CHECK(out.batch == in.q.batch && out.kv_heads == l.kv_heads, where,
                 "out [batch = {}, kv_heads = {}] != [{}, {}]", out.batch, out.kv_heads, in.q.batch, l.kv_heads);
    KVSIFT_CHECK(out.capacity >= capacity(), where,
                 "out.capacity (= {}) is smaller than the selector's capacity (= {})", out.capacity, capacity());
    KVSIFT_CHECK(in.attention.selection_page_size == 1, where,
                 "in.attention.selection_page_size (= {}) must be 1: the rerank selects tokens",
                 in.attention.selection_page_size);
    const SelectShape shape{.batch = in.q.batch, .q_heads = l.q_heads, .kv_heads = l.kv_heads,
                            .head_dim = l.head_dim, .max_seq_len = in.max_seq_len};
    WorkspaceLayout carving(workspace, where);
    const Buffers b = layout(carving, shape, ctx);
    const SelectionView candidates{b.indices, b.counts, nullptr, in.q.batch, l.kv_heads, proposer_.capacity()};
    proposer_.select(in, candidates, b.proposer, ctx);
    stage_.run(in.q, in.cache, in.lengths, in.attention, candidates, out, SelectionView{}, b.stage, ctx);
  }

 private:
  struct Buffers {
    std::int32_t *indices, *counts;
    std::span<std::byte> proposer, stage;
  };

  static RerankConfig checked(const S& proposer, const RerankConfig& config) {
    constexpr const char* where = "Reranked";
    detail::checked_rerank_config(where, config);
    KVSIFT_CHECK(config.budget <= proposer.capacity(), where,
                 "config.budget (= {}) exceeds the proposer's capacity (= {}): build {} with c x K candidates",
                 config.budget, proposer.capacity(), proposer.name());
    KVSIFT_CHECK(config.entries == 0, where, "config.entries (= {}) must be 0: Reranked has no index to update",
                 config.entries);
    KVSIFT_CHECK(!selector_writes_log_weights(proposer), where,
                 "{} writes log-weights, which the rerank would drop: it cannot be a proposer", proposer.name());
    return config;
  }

  /// The one layout behind select_workspace_bytes (counting) and select (carving): the candidates, the
  /// proposer's select workspace, the stage's.
  Buffers layout(WorkspaceLayout& layout, const SelectShape& shape, const Context& ctx) const {
    const std::size_t entries = std::size_t(shape.batch) * std::size_t(shape.kv_heads);
    Buffers b{};
    b.indices = layout.allocate<std::int32_t>(entries * std::size_t(proposer_.capacity()), "rerank candidates");
    b.counts = layout.allocate<std::int32_t>(entries, "rerank candidate counts");
    b.proposer = layout.span(proposer_.select_workspace_bytes(shape, ctx), "the proposer's select workspace");
    b.stage = layout.span(stage_.workspace_bytes(shape.batch, proposer_.capacity(), ctx), "the rerank's workspace");
    return b;
  }

  S proposer_;
  RerankStage<T, Context> stage_;
  std::string name_;
};

}  // namespace kvsift
