#pragma once
/// CSAttention (centroid-scoring attention): subspace query centroids with precomputed score tables. head_dim
/// splits into m subspaces; per table head and subspace, cosine k-means of the prefill queries' sub-vectors gives
/// C unit centroids, and each centroid keeps the L keys with the largest partial scores c . k^(s) (ids and fp16
/// scores). A decode query takes, per subspace, its nearest centroid(s), sums the chosen lists' scores per key,
/// combines the query heads of a GQA group by maximum, and selects the best rho * length tokens (the attention
/// window counted inside). A new key is inserted into every list whose lowest entry it beats.
///
/// Written once for both backends from the shared primitives: kmeans_batched, subspace_scores,
/// store_table_lists, append_tables, nearest_centroids, table_scores_dense / table_scores_sparse, length
/// budgets, topk_rows (docs/csattention.md). Include cpu/backend.hpp or cuda/backend.hpp before instantiating it.
///
/// Memory (index_bytes): per slot its base (centroids [table_heads, m, C, w] fp32, lists [table_heads, m * C,
/// L_max] int32 + fp16 with counts) and its overlay ([table_heads, m * C, overlay_capacity] int32 + fp16, evicted
/// counts and sizes). prepare allocates scratch and reads the lengths (and page lists) on the host: on CUDA it
/// synchronizes the stream. append and select neither allocate nor synchronize.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/kmeans_batched.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/score_tables.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

/// Whose tables a query head reads (the paper describes one head; kvsift's choice, docs/csattention.md).
enum class CsattentionTables : std::uint8_t {
  per_query_head,  ///< every query head has its own centroids and lists (the paper's per-head index; G times the bytes)
  per_kv_head,     ///< a GQA group shares them, clustered on the group's pooled queries; each head picks its own centroids
};

/// How the chosen lists' scores are summed per key (both give the same selection).
enum class CsattentionReduce : std::uint8_t {
  dense,  ///< an accumulator over every token of the row
  sort,   ///< the paper's sort by key id and segmented sum over the chosen entries
};

struct CsattentionConfig {
  std::int32_t subspaces = 8;                        ///< m: divides head_dim
  SubspaceSplit split = SubspaceSplit::contiguous;   ///< rope_pairs keeps NeoX rotation pairs in one subspace
  CsattentionTables tables = CsattentionTables::per_kv_head;  ///< kvsift's choice, measured in docs/csattention.md
  std::int32_t centroids = 128;                      ///< C per subspace (the paper: 64, 128, 200)
  std::int32_t kmeans_iterations = 10;               ///< Lloyd steps of the full-batch cosine k-means
  std::uint64_t seed = 0;                            ///< k-means seeding; problem (table head t, subspace s) draws from seed + t * m + s
  double list_fraction = 0.2;                        ///< alpha: L = floor(alpha * N) keys per list, N the prompt's length
  std::int32_t max_list_length = 32768;              ///< the absolute cap on L (kvsift's choice)
  double keep_fraction = 0.05;                       ///< rho: K = floor(rho * length) tokens, the window's included
  /// When > 0, a fixed K = budget tokens per row, the window's included, in place of rho * length (equal budgets
  /// beside other selectors, as the fidelity harness compares them).
  std::int32_t budget = 0;
  /// P: a search every P selects; the P - 1 between reuse its selection and add the tokens that left the recent
  /// window since (new tokens are in the window until then). The batch must keep its rows between searches;
  /// prepare forces the next select to search. searches_next() says which kind the next select is (on CUDA, a
  /// graph captures one kind: capture one of each and replay them in that order).
  std::int32_t search_period = 1;
  std::int32_t probes = 1;                           ///< centroids per subspace a query reads (the paper: 1)
  /// Weigh each chosen list by the norm of the query's sub-vector (the paper: w_b = 1; kvsift's option, its
  /// section 2.3's observation: docs/csattention.md measures it).
  bool weight_by_norm = true;
  /// Count a key absent from a chosen list as that list's lowest score rather than 0 (kvsift's option,
  /// TableScoreOptions::from_floor; the paper: 0).
  bool from_floor = true;
  CsattentionReduce reduce = CsattentionReduce::dense;
  /// Evictions per list a sequence's inserts may make (kvsift's choice: the overlay's bound, docs/csattention.md).
  std::int32_t overlay_capacity = 1024;
  std::int32_t prepare_chunk = 128;                  ///< lists scored per pass in prepare ([chunk, N] fp32 scratch)
};

/// The paper's schedules (its table 3): keep ratio rho and search period P.
enum class CsattentionSchedule : std::uint8_t { keep5_every1, keep5_every2, keep15_every4, keep20_every8 };
inline CsattentionConfig csattention_schedule(CsattentionSchedule schedule, CsattentionConfig config = {}) {
  static constexpr struct {
    double rho;
    std::int32_t period;
  } kSchedules[] = {{0.05, 1}, {0.05, 2}, {0.15, 4}, {0.20, 8}};
  const auto& chosen = kSchedules[std::size_t(schedule)];
  config.keep_fraction = chosen.rho;
  config.search_period = chosen.period;
  return config;
}

template <class T, class Context>
class Csattention {
  static_assert(BackendIncluded<Context>, "Csattention<T, Context>: include kvsift/cpu/backend.hpp (cpu::Context) or "
                                          "kvsift/cuda/backend.hpp (cuda::Context) before instantiating it");
  template <class V>
  using Array = typename Context::template array<V>;

 public:
  using value_type = T;
  using context_type = Context;

  Csattention(const SelectorLimits& limits, const CsattentionConfig& config)
      : limits_(limits), config_(checked(limits, config)) {
    const std::int32_t slots = limits.max_slots, heads = table_heads(), m = config_.subspaces, c = config_.centroids;
    const std::size_t lists = ScoreTablesView<std::int32_t>::list_count(slots, heads, m, c);
    centroids_.resize(ScoreTablesView<std::int32_t>::centroid_elements(slots, heads, m, c, width()));
    base_ids_.resize(lists * std::size_t(max_length_));
    base_scores_.resize(lists * std::size_t(max_length_));
    base_counts_.resize(lists);
    slot_base_.resize(std::size_t(slots));
    evicted_.resize(lists);
    overlay_ids_.resize(lists * std::size_t(config_.overlay_capacity));
    overlay_scores_.resize(lists * std::size_t(config_.overlay_capacity));
    overlay_sizes_.resize(lists);
    if (config_.search_period > 1) {
      kept_.resize(std::size_t(slots) * std::size_t(limits.kv_heads) * std::size_t(capacity_));
      kept_counts_.resize(std::size_t(slots) * std::size_t(limits.kv_heads));
      first_.resize(std::size_t(slots));
      rows_.resize(std::size_t(slots));
    }
  }

  std::string_view name() const { return "CSAttention"; }
  const CsattentionConfig& config() const { return config_; }
  /// The most tokens a row selects: K (budget, or floor(rho * max_tokens); a step selects floor(rho * length) less
  /// its window), plus P - 1 for the tokens a reused selection adds.
  std::int32_t capacity() const { return capacity_; }
  /// Whether the next select searches (P = 1: always).
  bool searches_next() const { return calls_until_search_ == 0; }
  /// The tables, in the context's memory: for tests and inspection.
  ScoreTablesView<const std::int32_t> index_tables() const { return const_cast<Csattention*>(this)->tables().as_const(); }
  IndexBytes index_bytes() const {
    const std::size_t bytes = centroids_.size() * sizeof(float) +
                              (base_ids_.size() + overlay_ids_.size()) * sizeof(std::int32_t) +
                              (base_scores_.size() + overlay_scores_.size()) * sizeof(half) +
                              (base_counts_.size() + slot_base_.size() + evicted_.size() + overlay_sizes_.size()) *
                                  sizeof(std::int32_t);
    return Context::memory == MemorySpace::host ? IndexBytes{bytes, 0} : IndexBytes{0, bytes};
  }
  /// L for a prompt of n tokens.
  std::int32_t list_length(std::int32_t n) const {
    return std::clamp(std::int32_t(config_.list_fraction * double(n)), 1, max_length_);
  }

  std::size_t select_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    constexpr const char* where = "Csattention::select_workspace_bytes";
    detail::check_shape(where, limits_, shape);
    const std::int32_t tokens = detail::planned_tokens(where, "shape.max_seq_len", limits_, shape.max_seq_len);
    WorkspaceLayout counting;
    layout(counting, shape.batch, tokens, ctx);
    return counting.bytes();
  }
  std::size_t append_workspace_bytes(const SelectShape& shape, const Context&) const {
    detail::check_shape("Csattention::append_workspace_bytes", limits_, shape);
    return 0;
  }

  /// Builds each joining sequence's tables from its prompt (in.cache) and its last W prefill queries
  /// (in.queries, W >= C), and empties its overlay. Allocates scratch; on CUDA synchronizes the stream.
  void prepare(const PrefillInputs<T>& in, const Context& ctx) {
    constexpr const char* where = "Csattention::prepare";
    const std::int32_t batch = detail::check_cache(where, limits_, in.cache, in.slots, Context::memory);
    validate(in.queries, where, "in.queries");
    KVSIFT_CHECK(in.queries.batch == batch && in.queries.heads == limits_.q_heads &&
                     in.queries.head_dim == limits_.head_dim,
                 where, "in.queries [{}, {}, W, {}] != [batch = {}, q_heads = {}, W, head_dim = {}]", in.queries.batch,
                 in.queries.heads, in.queries.head_dim, batch, limits_.q_heads, limits_.head_dim);
    validate(in.attention.window, where, "in.attention.window");
    KVSIFT_CHECK(in.queries.tokens >= config_.centroids, where,
                 "in.queries holds {} prefill queries per head, fewer than config.centroids (C = {})",
                 in.queries.tokens, config_.centroids);
    const auto rows = static_cast<std::size_t>(batch);
    std::vector<std::int32_t> lengths(rows), slots(rows);
    Array<std::int32_t> context_lengths(rows);
    sequence_lengths(in.cache, context_lengths.data(), ctx);
    copy_to_host(context_lengths.data(), lengths.size(), lengths.data(), ctx);
    copy_to_host(in.slots, slots.size(), slots.data(), ctx);
    for (std::int32_t b = 0; b < batch; ++b) prepare_sequence(in, b, slots[b], lengths[b], ctx);
    if (config_.search_period > 1) {
      std::vector<std::int32_t> identity(std::size_t(limits_.max_slots));
      for (std::int32_t r = 0; r < limits_.max_slots; ++r) identity[std::size_t(r)] = r;
      copy_from_host(identity.data(), identity.size(), rows_.data(), ctx);
    }
    calls_until_search_ = 0;
  }

  /// Inserts each row's new key (position lengths[b] - 1) into its slot's lists.
  void append(const AppendInputs<T>& in, std::span<std::byte>, const Context& ctx) {
    detail::check_cache("Csattention::append", limits_, in.cache, in.slots, Context::memory);
    append_tables(tables(), in.cache, in.slots, in.lengths, ctx);
  }
  void release(std::span<const std::int32_t>) {}  // a joining sequence's prepare rebuilds its slot

  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = "Csattention::select";
    detail::check_select(where, limits_, in, out, capacity(), Context::memory);
    const std::int32_t batch = in.q.batch;
    const std::int64_t rows = std::int64_t(batch) * limits_.kv_heads;
    if (calls_until_search_ > 0) {
      KVSIFT_CHECK(batch == searched_batch_, where,
                   "a reused selection needs the batch of its search: {} rows now, {} at the search", batch,
                   searched_batch_);
      --calls_until_search_;
      reuse(in, out, ctx);
      return;
    }
    calls_until_search_ = config_.search_period - 1;
    searched_batch_ = batch;
    search(in, out, workspace, ctx);
    if (config_.search_period == 1) return;
    copy_rows_within(out.indices, out.capacity, kept_.data(), capacity_, capacity_, rows, ctx);
    copy_within(out.counts, std::size_t(rows), kept_counts_.data(), ctx);
    const AttentionWindow& window = in.attention.window;  // first[b] = length - R: where the window began
    length_budgets(in.lengths, batch, 1, {.fraction = 1, .maximum = limits_.max_tokens, .reserved = window.recent},
                   first_.data(), ctx);
  }

 private:
  struct Buffers {
    std::int32_t *chosen, *chosen_counts, *weights, *row_k, *candidates, *candidate_counts;
    float* scores;
    std::span<std::byte> reduce, topk;
  };

  /// The last search's selection and the middle tokens that left the recent window since.
  void reuse(const SelectInputs<T>& in, const SelectionView& out, const Context& ctx) {
    const std::int64_t rows = std::int64_t(in.q.batch) * limits_.kv_heads;
    copy_rows_within(kept_.data(), capacity_, out.indices, out.capacity, capacity_, rows, ctx);
    copy_within(kept_counts_.data(), std::size_t(rows), out.counts, ctx);
    const SelectionView rows_view{out.indices, out.counts, nullptr, in.q.batch, limits_.kv_heads, out.capacity};
    append_range(rows_view, rows_.data(), first_.data(), in.lengths, in.attention.window, ctx);
  }

  void search(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> workspace, const Context& ctx) {
    constexpr const char* where = "Csattention::select";
    const std::int32_t batch = in.q.batch, kv = limits_.kv_heads, group = limits_.q_heads / kv;
    const std::int32_t tokens = detail::planned_tokens(where, "in.max_seq_len", limits_, in.max_seq_len);
    const std::int64_t rows = std::int64_t(batch) * kv;
    WorkspaceLayout carving(workspace, where);
    const Buffers w = layout(carving, batch, tokens, ctx);
    const auto t = tables().as_const();
    const SelectionView chosen{w.chosen, w.chosen_counts, nullptr, batch, kv, chosen_capacity()};
    nearest_centroids(in.q, t, in.slots, config_.probes, chosen, w.weights, ctx);
    const TableScoreOptions options{.weights = w.weights, .from_floor = config_.from_floor};
    const LengthBudget budget = this->budget(in.attention.window);
    if (config_.reduce == CsattentionReduce::dense) {
      const auto scores = MatrixView<float>::packed(w.scores, rows, tokens);
      table_scores_dense(t, chosen, options, group, in.slots, in.lengths, in.attention.window, budget, scores, w.row_k, tokens,
                         w.reduce, ctx);
      topk_rows(MatrixView<const float>{scores.data, scores.rows, scores.cols, scores.row_stride}, in.lengths, capacity(), {.window = in.attention.window, .row_k = w.row_k}, out,
                w.topk, ctx);
      return;
    }
    const std::int32_t cap = sparse_capacity(ctx);
    const SelectionView candidates{w.candidates, w.candidate_counts, nullptr, batch, kv, cap};
    const auto sums = MatrixView<float>::packed(w.scores, rows, cap);
    table_scores_sparse(t, chosen, options, group, in.slots, in.lengths, in.attention.window, budget, candidates, sums, w.row_k,
                        w.reduce, ctx);
    const SelectionView positions{out.indices, out.counts, out.log_weights, std::int32_t(rows), 1, out.capacity};
    topk_rows(MatrixView<const float>{sums.data, sums.rows, sums.cols, sums.row_stride}, w.candidate_counts, capacity(), {.row_k = w.row_k}, positions, w.topk, ctx);
    remap_selection(positions, candidates, positions, ctx);
  }

  static CsattentionConfig checked(const SelectorLimits& limits, const CsattentionConfig& c) {
    constexpr const char* where = "Csattention";
    detail::check_limits(where, limits);
    KVSIFT_CHECK(c.subspaces > 0 && limits.head_dim % c.subspaces == 0, where,
                 "config.subspaces (m = {}) does not divide head_dim (= {})", c.subspaces, limits.head_dim);
    KVSIFT_CHECK(c.split == SubspaceSplit::contiguous || (limits.head_dim / c.subspaces) % 2 == 0, where,
                 "SubspaceSplit::rope_pairs needs an even subspace width; head_dim / subspaces = {} / {}",
                 limits.head_dim, c.subspaces);
    KVSIFT_CHECK(c.centroids > 0, where, "config.centroids (C = {}) must be positive", c.centroids);
    KVSIFT_CHECK(c.kmeans_iterations >= 0, where, "config.kmeans_iterations (= {}) must be >= 0", c.kmeans_iterations);
    KVSIFT_CHECK(c.list_fraction > 0 && c.list_fraction <= 1, where,
                 "config.list_fraction (alpha = {}) is outside (0, 1]", c.list_fraction);
    KVSIFT_CHECK(c.max_list_length > 0, where, "config.max_list_length (= {}) must be positive", c.max_list_length);
    KVSIFT_CHECK(c.keep_fraction > 0 && c.keep_fraction <= 1, where,
                 "config.keep_fraction (rho = {}) is outside (0, 1]", c.keep_fraction);
    KVSIFT_CHECK(c.probes >= 1 && c.probes <= std::min(c.centroids, kMaxTableProbes), where,
                 "config.probes (= {}) is outside [1, min(centroids = {}, {})]", c.probes, c.centroids, kMaxTableProbes);
    KVSIFT_CHECK(std::int64_t(c.subspaces) * c.probes <= kMaxTableBlock, where,
                 "config.subspaces * probes (= {} * {}) exceeds {} lists per query head", c.subspaces, c.probes,
                 kMaxTableBlock);
    KVSIFT_CHECK(c.overlay_capacity > 0, where, "config.overlay_capacity (= {}) must be positive", c.overlay_capacity);
    KVSIFT_CHECK(c.prepare_chunk > 0, where, "config.prepare_chunk (= {}) must be positive", c.prepare_chunk);
    KVSIFT_CHECK(c.budget >= 0 && c.budget <= limits.max_tokens, where,
                 "config.budget (= {}) is outside [0, limits.max_tokens = {}]", c.budget, limits.max_tokens);
    KVSIFT_CHECK(c.search_period >= 1, where, "config.search_period (P = {}) must be >= 1", c.search_period);
    KVSIFT_CHECK(c.reduce == CsattentionReduce::dense || c.reduce == CsattentionReduce::sort, where,
                 "config.reduce (= {}) is not a CsattentionReduce", int(c.reduce));
    KVSIFT_CHECK(c.tables == CsattentionTables::per_query_head || c.tables == CsattentionTables::per_kv_head, where,
                 "config.tables (= {}) is not a CsattentionTables", int(c.tables));
    return c;
  }

  std::int32_t table_heads() const {
    return config_.tables == CsattentionTables::per_query_head ? limits_.q_heads : limits_.kv_heads;
  }
  std::int32_t width() const { return limits_.head_dim / config_.subspaces; }
  std::int32_t chosen_capacity() const {
    return limits_.q_heads / limits_.kv_heads * config_.subspaces * config_.probes;
  }
  /// K less the window, at most the searched capacity.
  LengthBudget budget(const AttentionWindow& window) const {
    const std::int32_t reserved = window.sink + window.recent;
    if (config_.budget > 0) return {.fraction = 1, .maximum = std::max(0, config_.budget - reserved), .reserved = reserved};
    return {.fraction = config_.keep_fraction, .maximum = searched_capacity(), .reserved = reserved};
  }
  std::int32_t searched_capacity() const { return capacity_ - (config_.search_period - 1); }
  std::int32_t sparse_capacity(const Context& ctx) const {
    return std::int32_t(table_scores_sparse_capacity(chosen_capacity(), max_length_, ctx));
  }

  Buffers layout(WorkspaceLayout& layout, std::int32_t batch, std::int32_t tokens, const Context& ctx) const {
    const std::int64_t rows = std::int64_t(batch) * limits_.kv_heads;
    const auto r = std::size_t(rows);
    const std::int32_t group = limits_.q_heads / limits_.kv_heads;
    Buffers b{};
    b.chosen = layout.allocate<std::int32_t>(r * std::size_t(chosen_capacity()), "CSAttention chosen lists");
    b.chosen_counts = layout.allocate<std::int32_t>(r, "CSAttention chosen counts");
    b.weights = config_.weight_by_norm
                    ? layout.allocate<std::int32_t>(r * std::size_t(chosen_capacity()), "CSAttention list weights")
                    : nullptr;
    b.row_k = layout.allocate<std::int32_t>(r, "CSAttention budgets");
    if (config_.reduce == CsattentionReduce::dense) {
      b.scores = layout.allocate<float>(r * std::size_t(tokens), "CSAttention token scores");
      b.reduce = layout.span(table_scores_dense_workspace_bytes(rows, group, tokens, ctx), "CSAttention accumulator");
      b.topk = layout.span(topk_rows_workspace_bytes(rows, tokens, capacity(), {}, ctx), "CSAttention top-k");
      return b;
    }
    const std::int32_t cap = sparse_capacity(ctx);
    b.candidates = layout.allocate<std::int32_t>(r * std::size_t(cap), "CSAttention candidates");
    b.candidate_counts = layout.allocate<std::int32_t>(r, "CSAttention candidate counts");
    b.scores = layout.allocate<float>(r * std::size_t(cap), "CSAttention candidate sums");
    b.reduce = layout.span(table_scores_sparse_workspace_bytes(rows, chosen_capacity(), max_length_, ctx),
                           "CSAttention sort");
    b.topk = layout.span(topk_rows_workspace_bytes(rows, cap, capacity(), {}, ctx), "CSAttention top-k");
    return b;
  }

  ScoreTablesView<std::int32_t> tables() {
    return {centroids_.data(),
            base_ids_.data(),
            base_scores_.data(),
            base_counts_.data(),
            slot_base_.data(),
            evicted_.data(),
            overlay_ids_.data(),
            overlay_scores_.data(),
            overlay_sizes_.data(),
            limits_.max_slots,
            limits_.max_slots,
            table_heads(),
            config_.subspaces,
            config_.centroids,
            width(),
            max_length_,
            config_.overlay_capacity,
            config_.split};
  }
  BaseTablesView base_tables(std::int32_t base) {
    const std::size_t lists = std::size_t(table_heads()) * std::size_t(config_.subspaces * config_.centroids);
    return {centroids_.data() + std::size_t(base) * lists * std::size_t(width()),
            base_ids_.data() + std::size_t(base) * lists * std::size_t(max_length_),
            base_scores_.data() + std::size_t(base) * lists * std::size_t(max_length_),
            base_counts_.data() + std::size_t(base) * lists,
            table_heads(),
            config_.subspaces,
            config_.centroids,
            width(),
            max_length_,
            config_.split};
  }

  /// Batch row b's base in slot `slot`: per table head, the k-means of its queries' sub-vectors (the queries of
  /// the heads that read it, packed per subspace), then per chunk of lists the partial scores over the prompt and
  /// their top L; the slot's overlay emptied.
  void prepare_sequence(const PrefillInputs<T>& in, std::int32_t b, std::int32_t slot, std::int32_t length,
                        const Context& ctx) {
    constexpr const char* where = "Csattention::prepare";
    KVSIFT_CHECK(in.attention.window.recent < length, where,
                 "the recent window (R = {}) covers sequence {}'s whole prompt ({} tokens): nothing is left to index",
                 in.attention.window.recent, b, length);
    const std::int32_t heads = table_heads(), m = config_.subspaces, w = width(), d = limits_.head_dim;
    const std::int32_t heads_per_table = limits_.q_heads / heads, queries = in.queries.tokens;
    const std::int64_t points = std::int64_t(heads_per_table) * queries;
    const BaseTablesView base = base_tables(slot);
    const BatchedKMeansConfig kmeans{.clusters = config_.centroids,
                                     .iterations = config_.kmeans_iterations,
                                     .metric = KMeansMetric::cosine,
                                     .seed = 0,
                                     .empty = EmptyCluster::reseed};
    Array<T> packed(std::size_t(m) * std::size_t(points) * std::size_t(w));
    Array<std::int32_t> assignment(std::size_t(m) * std::size_t(points));
    Array<std::byte> kmeans_ws(batched_kmeans_workspace_bytes(m, points, w, kmeans, ctx));
    for (std::int32_t t = 0; t < heads; ++t) {
      for (std::int32_t j = 0; j < heads_per_table; ++j) {
        const T* first = in.queries.row(b, t * heads_per_table + j, 0);
        for (std::int32_t s = 0; s < m; ++s) {
          T* dst = packed.data() + (std::int64_t(s) * points + std::int64_t(j) * queries) * w;
          // A subspace is one channel run (contiguous) or two of w / 2 (rope_pairs); copy_rows_within per run.
          const bool pairs = config_.split == SubspaceSplit::rope_pairs;
          const std::int32_t run = pairs ? w / 2 : w;
          for (std::int32_t part = 0; part < (pairs ? 2 : 1); ++part) {
            const std::int32_t channel = subspace_channel(config_.split, s, part * run, w, d);
            copy_rows_within(first + channel, in.queries.token_stride, dst + part * run, w, run, queries, ctx);
          }
        }
      }
      BatchedKMeansConfig head_kmeans = kmeans;
      head_kmeans.seed = config_.seed + std::uint64_t(t) * std::uint64_t(m);
      kmeans_batched(BatchedMatrixView<const T>::packed(packed.data(), m, points, w), nullptr, head_kmeans,
                     base.centroids + std::int64_t(t) * m * config_.centroids * w, assignment.data(),
                     std::span<std::byte>(kmeans_ws.data(), kmeans_ws.size()), ctx);
    }
    const std::int32_t lists = m * config_.centroids, chunk = std::min(config_.prepare_chunk, lists);
    const std::int32_t keep = list_length(length);
    Array<float> scores(std::size_t(chunk) * std::size_t(length));
    Array<std::byte> store_ws(store_table_lists_workspace_bytes(chunk, length, ctx));
    for (std::int32_t t = 0; t < heads; ++t) {
      for (std::int32_t l0 = 0; l0 < lists; l0 += chunk) {
        const std::int32_t n = std::min(chunk, lists - l0);
        const auto out = MatrixView<float>::packed(scores.data(), n, length);
        subspace_scores(base, t, l0, n, in.cache, b, 0, length, out, ctx);
        store_table_lists(MatrixView<const float>{out.data, out.rows, out.cols, out.row_stride}, length, keep, base, t, l0,
                          std::span<std::byte>(store_ws.data(), store_ws.size()), ctx);
      }
    }
    const std::size_t slot_lists = std::size_t(heads) * std::size_t(lists);
    const std::vector<std::int32_t> zeros(slot_lists, 0);
    copy_from_host(zeros.data(), slot_lists, evicted_.data() + std::size_t(slot) * slot_lists, ctx);
    copy_from_host(zeros.data(), slot_lists, overlay_sizes_.data() + std::size_t(slot) * slot_lists, ctx);
    copy_from_host(&slot, 1, slot_base_.data() + slot, ctx);
  }

  SelectorLimits limits_;
  CsattentionConfig config_;
  std::int32_t max_length_ = std::clamp(std::int32_t(config_.list_fraction * double(limits_.max_tokens)), 1,
                                        config_.max_list_length);
  std::int32_t capacity_ =
      (config_.budget > 0 ? config_.budget : std::max(1, std::int32_t(config_.keep_fraction * double(limits_.max_tokens)))) +
      config_.search_period - 1;
  std::int32_t calls_until_search_ = 0, searched_batch_ = 0;
  Array<float> centroids_;
  Array<std::int32_t> base_ids_;
  Array<half> base_scores_;
  Array<std::int32_t> base_counts_, slot_base_, evicted_, overlay_ids_;
  Array<half> overlay_scores_;
  Array<std::int32_t> overlay_sizes_;
  // Search period > 1: the searched selection per batch row, where each row's window began at the search, and
  // the identity map of batch rows (append_range indexes `first` by slot).
  Array<std::int32_t> kept_, kept_counts_, first_, rows_;
};

}  // namespace kvsift
