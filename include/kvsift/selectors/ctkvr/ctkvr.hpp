#pragma once
/// CTKVR (Lin et al., 2025): centroid-then-token KV retrieval. The last C prefill queries of a sequence are its
/// query centroids; each centroid's list holds, per kv head, the rho keys it attends most (the largest softmax
/// weight any query head of the group gives them, over all the prompt's keys). A decode query recalls the lists
/// of its C' most cosine-similar centroids (max over the group), reranks their union, plus the middle tokens no
/// list can hold (those that left the recent window after prefill), by the exact softmax over that set (max over
/// the group), and selects the best rho' (the budget). With the dynamic centroid update, the query then becomes a
/// centroid whose list is the top rho of its rerank.
///
/// Written once for both backends from the shared primitives: centroid_scores, recall_lists (the top C' and the
/// union of their lists, with the append of the unindexed tokens; one launch on sm_90), candidate_scores,
/// topk_rows, replace_list, store_centroids (docs/primitives.md).
/// Include cpu/backend.hpp or cuda/backend.hpp before instantiating it.
///
/// Memory per slot (index_bytes): centroids [q_heads, max_centroids, head_dim] in T, lists [kv_heads,
/// max_centroids, rho] int32 with their counts, FIFO cursors and first columns, the prefill boundary. prepare allocates scratch,
/// reads the lengths (and a paged cache's page lists) on the host: on CUDA it synchronizes the stream.
/// Workspace of select: the centroid scores [rows, max_centroids], the chosen lists, the candidates [rows,
/// C' * rho + U] and their scores, the primitives' scratch (rows = batch * kv_heads; U = config.max_unindexed, or the
/// planned bound N where that is 0 or larger).
/// On CUDA, with the dynamic update, select runs the update (the top rho, the new list, its centroid) on a second
/// stream the selector owns (cuda::StreamFork, made at construction) beside the selection's top rho', and joins it
/// before it returns, or with SelectInputs::defer_beside (the decode step) after the attention (join_beside):
/// stream-ordered and graph-capturable as before (in a captured graph, a parallel branch).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "kvsift/core/context_fork.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/inverted_lists.hpp"
#include "kvsift/selectors/ctkvr/query_centroids.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/detail/selector_core.hpp"
#include "kvsift/selectors/rerank.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

struct CtkvrConfig {
  /// rho': tokens selected per (sequence, kv head) besides the attention window (the paper: 512 or 1024).
  std::int32_t budget = 1024;
  /// rho: keys per centroid list; 0: 5 * budget / 2 (the paper's rho = 2.5 rho').
  std::int32_t list_size = 0;
  /// C: centroids of a sequence, its last C prefill queries; 0: clamp(N / 16, 1, max_centroids), N the prompt's
  /// length (the paper's min(2048, length / 16)). PrefillInputs::queries must hold at least C queries.
  std::int32_t centroids = 0;
  /// Centroid (and list) columns per slot. kvsift's choice: the dynamic update fills spare columns before it
  /// evicts the oldest centroid, so a short prompt's index grows with the conversation up to this bound.
  std::int32_t max_centroids = 2048;
  /// C': centroids recalled per (sequence, kv head).
  std::int32_t recalled_centroids = 4;
  /// The dynamic centroid update (the paper's DCU, on by default).
  bool dynamic_update = true;
  /// Centroids scored per pass in prepare (kvsift's choice: bounds its [chunk, N] fp32 score scratch, 64 MiB at
  /// 128K tokens; on the H100, 128 takes 40 ms at 32K where 32 takes 55, docs/ctkvr.md).
  std::int32_t prepare_chunk = 128;
  /// The paper's dynamic budget (its table 6, "dynamic 4%"): when > 0, each (sequence, kv head) selects
  /// floor(budget_fraction * current length) tokens (the step's own included), at most `budget`, which stays
  /// the selection's capacity and sizes the lists. 0: every row selects `budget`.
  double budget_fraction = 0;
  /// Keeps the prefill's centroids for the whole conversation: the dynamic update cycles over the spare columns
  /// [C, max_centroids) alone (kvsift's choice; the paper evicts the oldest centroid, whatever made it). prepare
  /// refuses a sequence whose C leaves no spare column.
  bool pin_prefill_centroids = false;
  /// The most middle tokens a sequence holds past its index (those that left the recent window after prefill; the
  /// rerank's appended candidates): the engine's longest generation bounds them. It sizes the candidates, C' lists
  /// plus this, so that the rerank's kernels plan for C' * rho + U candidates where they planned for max_seq_len
  /// (141,312 at 128K tokens; the rows hold ~10K). 0: the planned max_seq_len (always enough). A row past it is
  /// refused where the lengths are host values (the CPU). On CUDA (device lengths) such a row is served while its
  /// candidates fit the capacity (the union rarely fills its C' lists), and gets count -1 from the union's append
  /// (append_range's contract) past that, which sparse decode turns into NaN for its heads.
  std::int32_t max_unindexed = 0;
};

namespace detail {
/// CTKVR's rerank (selectors/rerank.hpp): the budget's best of the recalled candidates and, with the dynamic
/// update, the top rho as the query's new list.
inline RerankConfig ctkvr_rerank_config(const CtkvrConfig& config) {
  return {.budget = config.budget,
          .budget_fraction = config.budget_fraction,
          .entries = config.dynamic_update ? config.list_size : 0};
}
}  // namespace detail

template <class T, class Context>
class Ctkvr : public SelectorTypes<T, Context>, public detail::SelectorCore<"Ctkvr"> {
 public:
  Ctkvr(const SelectorLimits& limits, const CtkvrConfig& config)
      : SelectorCore(limits), config_(checked(limits, config)), rerank_(limits, detail::ctkvr_rerank_config(config_)) {
    const auto slots = std::size_t(limits.max_slots), kv = std::size_t(limits.kv_heads);
    const auto columns = std::size_t(config_.max_centroids);
    centroids_.resize(QueryCentroidsView<T>::elements(limits.max_slots, limits.q_heads, config_.max_centroids,
                                                      limits.head_dim));
    centroid_counts_.resize(slots);
    list_ids_.resize(slots * kv * columns * std::size_t(config_.list_size));
    list_counts_.resize(slots * kv * columns);
    cursors_.resize(slots * kv);
    fifo_begin_.resize(slots);
    boundaries_.resize(slots);
    union_sizes_.resize(slots * kv);
    full_columns_.resize(slots);
    if constexpr (detail::ForksWork<Context>) {
      if (config_.dynamic_update) update_fork_.emplace();
    }
  }

  std::string_view name() const { return "CTKVR"; }
  /// Views of the index, in the context's memory: for tests and inspection.
  QueryCentroidsView<const T> index_centroids() const {
    return {centroids_.data(), centroid_counts_.data(), limits_.max_slots, limits_.q_heads, config_.max_centroids,
            limits_.head_dim};
  }
  InvertedListsView<const float> index_lists() const {
    return {list_ids_.data(), nullptr, list_counts_.data(), cursors_.data(), limits_.max_slots, limits_.kv_heads,
            config_.max_centroids, config_.list_size, fifo_begin_.data()};
  }
  /// The last select's (or recall's) union sizes, [batch * kv_heads] in the context's memory: per (sequence, kv
  /// head) the distinct ids of the C' recalled lists left after the window, before the unindexed middle joins
  /// them. Over list_size * recalled_centroids it is the paper's deduplication coefficient (below 0.5 in its
  /// figure). Valid for the rows of the last call until the next one.
  const std::int32_t* last_union_sizes() const { return union_sizes_.data(); }
  std::int32_t capacity() const { return config_.budget; }
  const CtkvrConfig& config() const { return config_; }
  IndexBytes index_bytes() const {
    const std::size_t bytes = centroids_.size() * sizeof(T) +
                              (centroid_counts_.size() + list_ids_.size() + list_counts_.size() + cursors_.size() +
                               fifo_begin_.size() + boundaries_.size()) * sizeof(std::int32_t);
    return detail::context_index_bytes<Context>(bytes);
  }
  /// Candidates per row for sequences of up to `max_seq_len` tokens: C' lists and the unindexed middle (at most
  /// config.max_unindexed tokens where that is set).
  std::int32_t candidate_capacity(std::int32_t max_seq_len) const {
    const std::int32_t unindexed =
        config_.max_unindexed > 0 ? std::min(config_.max_unindexed, max_seq_len) : max_seq_len;
    return config_.recalled_centroids * config_.list_size + unindexed;
  }

  std::size_t select_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return planned_select_bytes(
        shape, [&](WorkspaceLayout& counting, std::int32_t tokens) { layout(counting, shape.batch, tokens, ctx); });
  }
  /// Workspace of recall() for `shape`.
  std::size_t recall_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return layout_bytes<"recall_workspace_bytes">(
        shape, [&](WorkspaceLayout& counting) { layout_recall(counting, shape.batch, ctx); });
  }

  /// Builds the index of the joining sequences: centroids from in.queries (the last C of each head), lists over
  /// the prompt's keys, less in.attention's window. Allocates scratch; on CUDA synchronizes the stream. Refused
  /// before anything changes: a non-finite prefill query or prompt key (detail::check_finite_prompt).
  void prepare(const PrefillInputs<T>& in, const Context& ctx) {
    constexpr const char* where = entry_point<"prepare">();
    const std::int32_t batch = detail::check_cache(where, limits_, in.cache, in.slots, Context::memory);
    detail::check_prefill_queries(where, limits_, in.queries, batch);
    validate(in.attention.window, where, "in.attention.window");
    join_beside(ctx);  // an update a caller left running writes the index too
    ContextArray<Context, std::int32_t> context_lengths(static_cast<std::size_t>(batch));
    const auto [lengths, slots] =
        detail::read_prefill_rows(where, limits_, in.cache, in.slots, context_lengths.data(), ctx);
    detail::check_finite_prompt(where, in.cache, context_lengths.data(), in.queries, ctx);
    const std::vector<std::int32_t> full(std::size_t(limits_.max_slots), config_.max_centroids);
    copy_from_host(full.data(), full.size(), full_columns_.data(), ctx);
    for (std::int32_t b = 0; b < batch; ++b) prepare_sequence(in, b, slots[b], lengths[b], ctx);
    slot_states_.mark_prepared(slots);
  }

  /// Nothing to append: the step's inputs are checked all the same.
  void append(const AppendInputs<T>& in, std::span<std::byte>, const Context&) {
    checked_append<Context>(entry_point<"append">(), in);
  }
  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = entry_point<"select">();
    const std::int32_t tokens = checked_planned_select<Context>(where, in, out, capacity());
    check_unindexed(where, in);
    join_beside(ctx);  // an update a caller left running: this select reads the index it writes
    const std::int32_t batch = in.q.batch;
    WorkspaceLayout carving(workspace, where);
    const Buffers w = layout(carving, batch, tokens, ctx);
    const SelectionView candidates{w.candidates, w.candidate_counts, nullptr, batch, limits_.kv_heads,
                                   candidate_capacity(tokens)};
    recall_into(in, candidates, w.recall, ctx);
    const SelectionView entries{w.entries, w.entry_counts, nullptr, batch, limits_.kv_heads, config_.list_size};
    rerank_.score(in.q, in.cache, in.attention, candidates, w.rerank, ctx);
    if (!config_.dynamic_update) return rerank_.keep(in.lengths, candidates, out, w.rerank, ctx);
    if constexpr (detail::ForksWork<Context>) {
      // The new list and its centroid (the next step's index) on a second stream beside the selection, which reads
      // neither. With in.defer_beside the caller joins it after the attention (join_beside: the update off the
      // step's path), else it is joined here (the longer of the two chains, not their sum, before the attention).
      detail::fork_beside(*update_fork_, ctx, [&](const Context& beside) {
        rerank_.keep_entries(candidates, entries, w.rerank, beside);
        update(in.q, in.slots, entries, w.replaced, beside);
      });
      update_pending_ = true;
      detail::joined_on_failure([&] { rerank_.keep(in.lengths, candidates, out, w.rerank, ctx); },
                                [&] { join_beside(ctx); });
      if (!in.defer_beside) join_beside(ctx);
    } else {
      rerank_.keep(in.lengths, candidates, out, w.rerank, ctx);
      rerank_.keep_entries(candidates, entries, w.rerank, ctx);
      update(in.q, in.slots, entries, w.replaced, ctx);
    }
  }

  /// Joins the dynamic update that a select with SelectInputs::defer_beside left running (CUDA), on ctx's stream;
  /// nothing pending (or a CPU context): nothing.
  void join_beside(const Context& ctx) {
    if constexpr (detail::ForksWork<Context>) {
      if (!update_pending_) return;
      update_pending_ = false;
      detail::join_beside(*update_fork_, ctx);
    }
  }

  /// Select's first stage, alone (the hybrid placement's GPU part): the C' best centroids per (sequence, kv
  /// head), the union of their lists and the unindexed middle, into `candidates` [batch, kv_heads,
  /// candidate_capacity(max_seq_len)] (token ids, ascending within each part). in.cache is read for nothing
  /// but its shape; in.lengths and in.slots as in select.
  void recall(const SelectInputs<T>& in, const SelectionView& candidates, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = entry_point<"recall">();
    detail::check_select(where, limits_, slot_states_, in, candidates, candidates.capacity, Context::memory);
    join_beside(ctx);  // an update a caller left running: recall reads the index it writes
    const std::int32_t tokens = detail::planned_tokens(where, "in.max_seq_len", limits_, in.max_seq_len);
    KVSIFT_CHECK(candidates.capacity >= candidate_capacity(tokens), where,
                 "candidates.capacity (= {}) < candidate_capacity(max_seq_len) (= {})", candidates.capacity,
                 candidate_capacity(tokens));
    check_unindexed(where, in);
    WorkspaceLayout carving(workspace, where);
    recall_into(in, candidates, layout_recall(carving, in.q.batch, ctx), ctx);
  }

  /// The host stage (selectors/selector.hpp HasHostStage): the rerank of recall's candidates over a host cache, on
  /// the CPU, with this selector's limits and configuration.
  RerankStage<T, cpu::Context> host_stage() const { return {limits_, detail::ctkvr_rerank_config(config_)}; }
  /// Entries per (sequence, kv head) of the dynamic update's new list; 0 without the update.
  std::int32_t update_capacity() const { return config_.dynamic_update ? config_.list_size : 0; }

  /// Select's last stage, alone: each row's query q becomes a centroid (FIFO over the columns) whose list is
  /// entries' row [batch, kv_heads, list_size] (the rerank's top rho). `replaced` [batch * kv_heads] is scratch in
  /// the context's memory. Nothing to do without the dynamic update.
  void update(const QueryView<const T>& q, const std::int32_t* slots, const SelectionView& entries,
              std::int32_t* replaced, const Context& ctx) {
    if (!config_.dynamic_update) return;
    replace_list(lists(), slots, entries, MatrixView<const float>{}, replaced, ctx);
    const SequenceView<const T> query{q.data, q.batch, q.heads, 1, q.head_dim, q.batch_stride, q.head_stride,
                                      q.head_dim};
    store_centroids(query, slots, replaced, limits_.kv_heads, centroids(), ctx);
  }

 private:
  struct RecallBuffers {
    float* centroid_scores;
    std::int32_t *chosen, *chosen_counts;
    std::span<std::byte> scratch;  // recall_lists'
  };
  struct Buffers {
    RecallBuffers recall;
    std::int32_t *candidates, *candidate_counts, *entries, *entry_counts, *replaced;
    std::span<std::byte> rerank;
  };

  /// Query heads per scoring row in prepare: the CUDA group-score kernels' tile (two of the CPU's).
  static constexpr std::int32_t kPrepareTileHeads = 16;

  /// Refuses a sequence with more unindexed middle tokens than config.max_unindexed, where the step's slots and
  /// lengths are host values (the index's boundaries live in the context's memory too); on CUDA the union's append
  /// marks such a row instead.
  void check_unindexed(const char* where, const SelectInputs<T>& in) const {
    if constexpr (Context::memory == MemorySpace::host) {
      if (config_.max_unindexed == 0) return;
      for (std::int32_t b = 0; b < in.q.batch; ++b) {
        const std::int32_t slot = in.slots[b], length = in.lengths[b];
        const kvsift::detail::TokenRange range =
            kvsift::detail::unindexed_range(boundaries_.data()[slot], length, in.attention.window);
        const std::int64_t unindexed = std::max<std::int64_t>(0, std::int64_t(range.end) - range.begin);
        KVSIFT_CHECK(unindexed <= config_.max_unindexed, where,
                     "sequence {} (slot {}, length {}) holds {} middle tokens past its index: more than "
                     "config.max_unindexed (= {})",
                     b, slot, length, unindexed, config_.max_unindexed);
      }
    }
  }

  static CtkvrConfig checked(const SelectorLimits& limits, CtkvrConfig c) {
    constexpr const char* where = "Ctkvr";
    KVSIFT_CHECK(c.budget > 0, where, "config.budget (= {}) must be positive", c.budget);
    if (c.list_size == 0) c.list_size = 5 * c.budget / 2;
    KVSIFT_CHECK(c.list_size > 0, where, "config.list_size (= {}) must be positive", c.list_size);
    KVSIFT_CHECK(c.max_centroids > 0, where, "config.max_centroids (= {}) must be positive", c.max_centroids);
    KVSIFT_CHECK(c.centroids >= 0 && c.centroids <= c.max_centroids, where,
                 "config.centroids (= {}) is outside [0, max_centroids = {}]", c.centroids, c.max_centroids);
    KVSIFT_CHECK(c.recalled_centroids > 0 && c.recalled_centroids <= c.max_centroids, where,
                 "config.recalled_centroids (C' = {}) is outside [1, max_centroids = {}]", c.recalled_centroids,
                 c.max_centroids);
    KVSIFT_CHECK(c.budget <= std::int64_t(c.list_size) * c.recalled_centroids, where,
                 "config.budget (rho' = {}) exceeds list_size * recalled_centroids (rho * C' = {} * {})", c.budget,
                 c.list_size, c.recalled_centroids);
    KVSIFT_CHECK(c.prepare_chunk > 0, where, "config.prepare_chunk (= {}) must be positive", c.prepare_chunk);
    KVSIFT_CHECK(c.budget_fraction >= 0 && c.budget_fraction <= 1, where,
                 "config.budget_fraction (= {}) is outside [0, 1] (0: a fixed budget)", c.budget_fraction);
    KVSIFT_CHECK(c.max_unindexed >= 0, where, "config.max_unindexed (= {}) must not be negative (0: max_seq_len)",
                 c.max_unindexed);
    return c;
  }
  RecallBuffers layout_recall(WorkspaceLayout& layout, std::int32_t batch, const Context& ctx) const {
    const std::int64_t rows = std::int64_t(batch) * limits_.kv_heads;
    const auto r = std::size_t(rows);
    const std::int32_t columns = config_.max_centroids;
    RecallBuffers b{};
    b.centroid_scores = layout.allocate<float>(r * std::size_t(columns), "CTKVR centroid scores");
    b.chosen = layout.allocate<std::int32_t>(r * std::size_t(config_.recalled_centroids), "CTKVR chosen lists");
    b.chosen_counts = layout.allocate<std::int32_t>(r, "CTKVR chosen counts");
    b.scratch = layout.span(
        recall_lists_workspace_bytes(rows, columns, config_.recalled_centroids, config_.list_size, ctx),
        "CTKVR recall scratch");
    return b;
  }
  Buffers layout(WorkspaceLayout& layout, std::int32_t batch, std::int32_t tokens, const Context& ctx) const {
    const auto r = std::size_t(std::int64_t(batch) * limits_.kv_heads);
    const std::int32_t cap = candidate_capacity(tokens);
    Buffers b{};
    b.recall = layout_recall(layout, batch, ctx);
    b.candidates = layout.allocate<std::int32_t>(r * std::size_t(cap), "CTKVR candidates");
    b.candidate_counts = layout.allocate<std::int32_t>(r, "CTKVR candidate counts");
    b.entries = layout.allocate<std::int32_t>(r * std::size_t(config_.list_size), "CTKVR new list");
    b.entry_counts = layout.allocate<std::int32_t>(r, "CTKVR new list counts");
    b.replaced = layout.allocate<std::int32_t>(r, "CTKVR replaced columns");
    b.rerank = layout.span(rerank_.workspace_bytes(batch, cap, ctx), "CTKVR rerank");
    return b;
  }

  void recall_into(const SelectInputs<T>& in, const SelectionView& candidates, const RecallBuffers& w,
                   const Context& ctx) {
    const std::int32_t batch = in.q.batch, kv = limits_.kv_heads, columns = config_.max_centroids;
    const std::int64_t rows = std::int64_t(batch) * kv;
    centroid_scores(in.q, centroids().as_const(), in.slots, kv, MatrixView<float>::packed(w.centroid_scores, rows, columns),
                    ctx);
    const SelectionView chosen{w.chosen, w.chosen_counts, nullptr, batch, kv, config_.recalled_centroids};
    recall_lists(MatrixView<const float>::packed(w.centroid_scores, rows, columns), full_columns_.data(),
                 lists().as_const(), chosen, in.slots, in.lengths, in.attention.window,
                 UnionAppend{.first = boundaries_.data(), .counts_before = union_sizes_.data()}, candidates, w.scratch,
                 ctx);
  }

  QueryCentroidsView<T> centroids() {
    return {centroids_.data(), centroid_counts_.data(), limits_.max_slots, limits_.q_heads, config_.max_centroids,
            limits_.head_dim};
  }
  InvertedListsView<float> lists() {  // ids only (no scores: the score type is unused)
    return {list_ids_.data(), nullptr, list_counts_.data(), cursors_.data(), limits_.max_slots, limits_.kv_heads,
            config_.max_centroids, config_.list_size, fifo_begin_.data()};
  }

  /// Batch row b's index: its centroids, then per kv head and chunk of centroids the lists (group_scores with
  /// softmax, each centroid's heads reduced by max into its own row, over the sequence broadcast to the chunk's
  /// rows of centroids; topk_rows straight into the list storage).
  void prepare_sequence(const PrefillInputs<T>& in, std::int32_t b, std::int32_t slot, std::int32_t length,
                        const Context& ctx) {
    constexpr const char* where = entry_point<"prepare">();
    const AttentionWindow window = in.attention.window;
    const std::int32_t c_count =
        config_.centroids > 0 ? config_.centroids : std::clamp(length / 16, 1, config_.max_centroids);
    KVSIFT_CHECK(in.queries.tokens >= c_count, where,
                 "in.queries holds {} queries per head; CTKVR needs the last C = {} (config.centroids, or "
                 "clamp(N / 16, 1, max_centroids) with N = {})",
                 in.queries.tokens, c_count, length);
    KVSIFT_CHECK(config_.recalled_centroids <= c_count, where,
                 "config.recalled_centroids (C' = {}) exceeds the sequence's centroids (C = {})",
                 config_.recalled_centroids, c_count);
    const bool pinned = config_.pin_prefill_centroids && config_.dynamic_update;
    KVSIFT_CHECK(!pinned || c_count < config_.max_centroids, where,
                 "config.pin_prefill_centroids leaves the dynamic update no column: sequence {} has C = {} centroids "
                 "and config.max_centroids is {}; raise max_centroids or lower centroids",
                 b, c_count, config_.max_centroids);
    const std::int32_t middle = std::max(0, window.recent_begin(length) - window.sink_end(length));
    KVSIFT_CHECK(config_.list_size <= middle, where,
                 "config.list_size (rho = {}) is larger than sequence {}'s middle ({} of its {} tokens, less the window)",
                 config_.list_size, b, middle, length);
    const std::int32_t first_query = in.queries.tokens - c_count;
    const std::int32_t* slot_pointer = in.slots + b;
    const SequenceView<const T> last{in.queries.row(b, 0, first_query), 1, in.queries.heads, c_count,
                                     in.queries.head_dim, in.queries.batch_stride, in.queries.head_stride,
                                     in.queries.token_stride};
    store_centroids(last, slot_pointer, nullptr, limits_.kv_heads, centroids(), ctx);

    // Rows of `per_row` centroids: a row's per_row * G query heads (packed) fill one 16-head tile of the scoring
    // kernels, so each read of K serves per_row centroids; each centroid's G heads reduce into its own score row
    // (heads_per_row). The sequence is broadcast to the chunk's rows. A chunk's last row may hold stale or zero
    // queries past its centroids: their score rows are not ranked.
    const std::int32_t group = limits_.q_heads / limits_.kv_heads, chunk = std::min(config_.prepare_chunk, c_count);
    const std::int32_t d = limits_.head_dim, per_row = std::max(1, kPrepareTileHeads / group);
    const std::int32_t max_rows = (chunk + per_row - 1) / per_row;
    GroupScoreOptions options = detail::rerank_score_options(in.attention);
    options.heads_per_row = group;
    const std::vector<T> zeros(std::size_t(max_rows) * per_row * group * d, T{});
    ContextArray<Context, T> packed(zeros.size());
    copy_from_host(zeros.data(), zeros.size(), packed.data(), ctx);
    ContextArray<Context, float> scores(std::size_t(max_rows) * per_row * std::size_t(length));
    ContextArray<Context, std::byte> group_ws(
        group_scores_workspace_bytes(max_rows, per_row * group, 1, length, options, ctx));
    ContextArray<Context, std::byte> topk_ws(
        topk_rows_workspace_bytes(chunk, length, config_.list_size, {.window = window}, ctx));
    const std::vector<std::int32_t> host_lengths(std::size_t(chunk), length);
    ContextArray<Context, std::int32_t> chunk_lengths(host_lengths.size());
    copy_from_host(host_lengths.data(), host_lengths.size(), chunk_lengths.data(), ctx);
    const BroadcastCache broadcast = broadcast_cache(in.cache, b, max_rows, chunk_lengths.data(), ctx);
    for (std::int32_t g = 0; g < limits_.kv_heads; ++g) {
      for (std::int32_t c0 = 0; c0 < c_count; c0 += chunk) {
        const std::int32_t n = std::min(chunk, c_count - c0), rows = (n + per_row - 1) / per_row;
        for (std::int32_t j = 0; j < group; ++j) {  // packed head c * G + j: centroid c's query head g * G + j
          copy_rows_within(in.queries.row(b, g * group + j, first_query + c0), in.queries.token_stride,
                           packed.data() + std::int64_t(j) * d, std::int64_t(group) * d, d, n, ctx);
        }
        const QueryView<const T> q{packed.data(), rows, per_row * group, d, std::int64_t(per_row) * group * d, d};
        const auto chunk_scores = MatrixView<float>::packed(scores.data(), std::int64_t(rows) * per_row, length);
        group_scores(q, broadcast.head(g, rows), chunk_scores, options,
                     std::span<std::byte>(group_ws.data(), group_ws.size()), ctx);
        const std::int64_t list = (std::int64_t(slot) * limits_.kv_heads + g) * config_.max_centroids + c0;
        const SelectionView into{list_ids_.data() + list * config_.list_size, list_counts_.data() + list, nullptr, n, 1,
                                 config_.list_size};
        topk_rows(MatrixView<const float>::packed(scores.data(), n, length), chunk_lengths.data(), config_.list_size,
                  TopKRowsOptions{.window = window}, into, std::span<std::byte>(topk_ws.data(), topk_ws.size()), ctx);
      }
      // Spare columns hold empty lists until the dynamic update fills them.
      const std::int64_t spare = (std::int64_t(slot) * limits_.kv_heads + g) * config_.max_centroids + c_count;
      if (c_count < config_.max_centroids) {
        clear_counts(SelectionView{list_ids_.data(), list_counts_.data() + spare, nullptr, config_.max_centroids - c_count,
                                   1, 1},
                     ctx);
      }
    }
    const std::int32_t count = c_count, boundary = window.recent_begin(length), fifo_begin = pinned ? c_count : 0;
    const std::vector<std::int32_t> cursors(std::size_t(limits_.kv_heads), c_count % config_.max_centroids);
    copy_from_host(&count, 1, centroid_counts_.data() + slot, ctx);
    copy_from_host(&boundary, 1, boundaries_.data() + slot, ctx);
    copy_from_host(&fifo_begin, 1, fifo_begin_.data() + slot, ctx);
    copy_from_host(cursors.data(), cursors.size(), cursors_.data() + std::size_t(slot) * limits_.kv_heads, ctx);
  }

  /// Sequence b of the cache as `rows` identical rows, one kv head at a time: contiguous by a zero batch
  /// stride, paged by repeating its page list (built on the host, a CSR table whichever form the cache's is).
  struct BroadcastCache {
    KVCache<const T> base;
    ContextArray<Context, std::int32_t> indptr, pages, last;
    const std::int32_t* lengths;
    std::int32_t sequence;

    KVCache<const T> head(std::int32_t g, std::int32_t rows) const {
      if (!base.is_paged()) {
        ContiguousKVView<const T> v = base.contiguous;
        v.k = v.k_row(sequence, g, 0);
        v.v = v.v_row(sequence, g, 0);
        v.seq_lens = lengths;
        v.batch = rows;
        v.kv_heads = 1;
        v.batch_stride = 0;
        return v;
      }
      PagedKVView<const T> v = base.paged;
      v.k_pages += std::int64_t(g) * v.head_stride;
      v.v_pages += std::int64_t(g) * v.head_stride;
      v.page_indptr = indptr.data();
      v.page_indices = pages.data();
      v.last_page_len = last.data();
      v.block_table_stride = 0;
      v.seq_lens = nullptr;
      v.batch = rows;
      v.kv_heads = 1;
      return v;
    }
  };
  BroadcastCache broadcast_cache(const KVCache<const T>& cache, std::int32_t b, std::int32_t rows,
                                 const std::int32_t* lengths, const Context& ctx) const {
    BroadcastCache out{cache, {}, {}, {}, lengths, b};
    if (!cache.is_paged()) return out;
    const PagedKVView<const T>& p = cache.paged;
    std::int32_t count = 0, last_len = 0;
    std::int64_t first = 0;
    if (p.seq_lens != nullptr) {  // the block-table form (or CSR with lengths): the pages the length needs
      std::int32_t length = 0;
      copy_to_host(p.seq_lens + b, 1, &length, ctx);
      count = length > 0 ? (length - 1) / p.page_size + 1 : 0;
      last_len = length - std::max(count - 1, 0) * p.page_size;
      if (p.is_block_table()) {
        first = std::int64_t(b) * p.block_table_stride;
      } else {
        std::int32_t entry = 0;
        copy_to_host(p.page_indptr + b, 1, &entry, ctx);
        first = entry;
      }
    } else {
      std::int32_t bounds[2];
      copy_to_host(p.page_indptr + b, 2, bounds, ctx);
      copy_to_host(p.last_page_len + b, 1, &last_len, ctx);
      count = bounds[1] - bounds[0];
      first = bounds[0];
    }
    std::vector<std::int32_t> own(std::size_t(std::max(count, 0))), indptr(std::size_t(rows) + 1), pages, last(std::size_t(rows), last_len);
    copy_to_host(p.page_indices + first, own.size(), own.data(), ctx);
    for (std::int32_t r = 0; r <= rows; ++r) indptr[std::size_t(r)] = r * count;
    for (std::int32_t r = 0; r < rows; ++r) pages.insert(pages.end(), own.begin(), own.end());
    out.indptr.resize(indptr.size());
    out.pages.resize(std::max<std::size_t>(pages.size(), 1));
    out.last.resize(last.size());
    copy_from_host(indptr.data(), indptr.size(), out.indptr.data(), ctx);
    copy_from_host(pages.data(), pages.size(), out.pages.data(), ctx);
    copy_from_host(last.data(), last.size(), out.last.data(), ctx);
    return out;
  }

  CtkvrConfig config_;
  RerankStage<T, Context> rerank_;
  ContextArray<Context, T> centroids_;
  ContextArray<Context, std::int32_t> centroid_counts_, list_ids_, list_counts_, cursors_, fifo_begin_, boundaries_,
      union_sizes_;
  ContextArray<Context, std::int32_t> full_columns_;
  /// The dynamic update's own stream and events (CUDA), made at construction; empty otherwise.
  std::optional<typename detail::ContextFork<Context>::type> update_fork_;
  /// A select forked the update and no join has followed (SelectInputs::defer_beside).
  bool update_pending_ = false;
};

}  // namespace kvsift
