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
/// Bases and slots (selectors/csattention/score_tables.hpp): a base is the index of one prompt (centroids and lists); a slot (a live
/// sequence) reads one base and owns an overlay, where the keys its decoding inserts go, so a base is never written
/// while a slot reads it. Bases live in a pool of max_slots storages apart from the slots, with reference counts
/// on the host:
///   - prepare: each joining slot drops its base and gets one built from its prompt in a storage no slot reads
///     (there is one: the other slots read at most max_slots - 1).
///   - share(source_slot, slots): the listed slots read source_slot's base, overlays emptied (evictions 0), with
///     no k-means nor list building: sequences whose caches hold the prompt that base was built from (tokens
///     [0, N), N = the source's prompt length) share its index, as the paper reuses tables across requests with a
///     common prefill. A sharer's tokens after N are inserted by append, one call per token in order
///     (AppendInputs::lengths = position + 1), before its first select; decoding then inserts as usual.
///   - release(slots): the slots drop their bases; a base no slot reads is free for the next prepare.
///   - save_base(slot, file) / load_base(file, slots): the base a slot reads, in a versioned binary file (below);
///     a load makes the listed slots read it as share does (their caches must hold the prompt it was built from).
/// A slot that has no base (never prepared, shared nor loaded, or released) is refused by share, release and
/// save_base; it must not be passed to append or select.
///
/// Base files (core/index_file.hpp's framing: magic "KVCSBASE", version 1, zlib's CRC-32 of everything before it
/// last), values little-endian, no padding:
///   int32 kv_heads, q_heads, head_dim, config.subspaces (m); uint32 config.split, config.tables (the enums'
///   values); int32 config.centroids (C), table_heads, width (head_dim / m); fp64 config.list_fraction; int32
///   config.max_list_length; uint64 config.seed; int32 config.kmeans_iterations, config.max_points_per_centroid,
///   config.kmeans_batch (the fields a loading selector
///   must have, each compared)
///   int32 N (the prompt's length), L (list_length(N), the entries per list)
///   fp32 centroids [table_heads, m, C, width]
///   int32 ids [table_heads, m * C, L]: each list highest first (the list order); entries at and after its count 0
///   fp16 scores [table_heads, m * C, L]: likewise
///   int32 counts [table_heads, m * C]
/// load_base refuses, naming what differs: another magic, another version, a file that ends early (at any byte),
/// a checksum that differs (corrupted), a field above that differs (its name, the file's value, this selector's),
/// L above this selector's L_max (the entries it stores per list), N above limits.max_tokens, counts or ids out of
/// range. A refused load leaves the selector as it was: it stages the file on the host and commits only then.
///
/// Memory (index_bytes): max_slots base storages (centroids [table_heads, m, C, w] fp32, lists [table_heads, m *
/// C, L_max] int32 + fp16 with counts) and per slot an overlay ([table_heads, m * C, overlay_capacity] int32 + fp16,
/// evicted counts and sizes), in the context's memory; on the host, the pool's bookkeeping (O(max_slots)). On CUDA
/// with the dense reduction, each base storage also keeps its lists in token order (TokenOrderView: 4 bytes per
/// stored entry and 4 * (ceil(max_tokens / 1024) + 1) per list, built by prepare and load_base; at 128K tokens and
/// alpha 0.1, 434 MB per layer beside the 695 of the tables), which the dense reduction reads so that each CTA
/// reads only its own tokens' entries; CsattentionReduce::sort keeps none.
/// Synchronization: prepare allocates scratch and reads the lengths (and page lists) on the host; share and
/// load_base (which allocates its staging) write the slots' state: on CUDA each synchronizes the stream; save_base
/// copies the base to the host (and synchronizes); release touches only the host bookkeeping. append and select
/// neither allocate nor synchronize.
///
/// Thread safety, as every selector's (selectors/selector.hpp): prepare, share, load_base, release, append and
/// select must not run concurrently on one object; save_base, a const call, may run with the other const calls.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/index_file.hpp"
#include "kvsift/core/kmeans_batched.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/selectors/csattention/score_tables.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/detail/selector_core.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

/// Whose tables a query head reads (the paper describes one head; kvsift's choice, docs/csattention.md).
enum class CsattentionTables : std::uint8_t {
  per_query_head,  ///< every query head has its own centroids and lists (the paper's per-head index; G times the bytes)
  per_kv_head,     ///< a GQA group shares them, clustered on the group's pooled queries; each head picks its own centroids
};

/// How the chosen lists' scores are summed per key (both give the same selection).
enum class CsattentionReduce : std::uint8_t {
  dense,  ///< an accumulator over every token of the row (on CUDA over the lists' token order: more memory, above)
  sort,   ///< the paper's sort by key id and segmented sum over the chosen entries
};

struct CsattentionConfig {
  std::int32_t subspaces = 8;                        ///< m: divides head_dim
  SubspaceSplit split = SubspaceSplit::contiguous;   ///< rope_pairs keeps NeoX rotation pairs in one subspace
  CsattentionTables tables = CsattentionTables::per_kv_head;  ///< kvsift's choice, measured in docs/csattention.md
  std::int32_t centroids = 128;                      ///< C per subspace (the paper: 64, 128, 200)
  std::int32_t kmeans_iterations = 10;               ///< Lloyd steps of the cosine k-means
  /// k-means trains on at most about this many points per centroid and problem (FAISS's max_points_per_centroid;
  /// kvsift's choice): with more pooled prefill queries Q than C times it, every s-th query of each head is used,
  /// s = floor(Q / (C * max_points_per_centroid)), so a problem keeps about C * max to 2 * C * max points.
  /// 0: every query.
  std::int32_t max_points_per_centroid = 256;
  /// Points drawn per Lloyd step and problem by mini-batch k-means (the paper's; BatchedKMeansConfig::batch_size);
  /// 0: full batch (the default). Deterministic either way.
  std::int32_t kmeans_batch = 0;
  std::uint64_t seed = 0;                            ///< k-means seeding; problem (table head t, subspace s) draws from seed + t * m + s
  /// alpha: L = floor(alpha * N) keys per list, N the prompt's length (the paper: "typically 0.2-0.4"; kvsift's
  /// default from the sweep in docs/csattention.md: recall flat from 0.05 to 0.4, bytes and time linear in alpha)
  double list_fraction = 0.1;
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

/// CSAttention's base files (format above, in Csattention's comment).
inline constexpr IndexFileFormat kCsattentionBaseFile{
    .name = "CSAttention base", .magic = {'K', 'V', 'C', 'S', 'B', 'A', 'S', 'E'}, .version = 1};

template <class T, class Context>
class Csattention : public SelectorTypes<T, Context>, public detail::SelectorCore<"Csattention"> {
 public:
  Csattention(const SelectorLimits& limits, const CsattentionConfig& config)
      : SelectorCore(limits), config_(checked(limits, config)) {
    KVSIFT_CHECK(!keeps_token_order() || token_ranges() <= kMaxTableTokenRanges, "Csattention",
                 "limits.max_tokens (= {}) is above the dense reduction's {} tokens on CUDA (CsattentionReduce::sort "
                 "has no such bound)",
                 limits.max_tokens, std::int64_t(kMaxTableTokenRanges) * kTableTokenRange);
    const std::int32_t slots = limits.max_slots, heads = table_heads(), m = config_.subspaces, c = config_.centroids;
    const std::size_t lists = ScoreTablesView<std::int32_t>::list_count(slots, heads, m, c);
    centroids_.resize(ScoreTablesView<std::int32_t>::centroid_elements(slots, heads, m, c, width()));
    base_ids_.resize(lists * std::size_t(max_length_));
    base_scores_.resize(lists * std::size_t(max_length_));
    base_counts_.resize(lists);
    slot_base_.resize(std::size_t(slots));
    base_info_.resize(std::size_t(slots));
    host_slot_base_.assign(std::size_t(slots), -1);
    evicted_.resize(lists);
    overlay_ids_.resize(lists * std::size_t(config_.overlay_capacity));
    overlay_scores_.resize(lists * std::size_t(config_.overlay_capacity));
    overlay_sizes_.resize(lists);
    if (keeps_token_order()) {
      token_entries_.resize(lists * std::size_t(max_length_));
      token_offsets_.resize(lists * std::size_t(token_ranges() + 1));
      token_prompt_.resize(std::size_t(slots));
    }
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
                              (base_counts_.size() + slot_base_.size() + evicted_.size() + overlay_sizes_.size() +
                               token_entries_.size() + token_offsets_.size() + token_prompt_.size()) *
                                  sizeof(std::int32_t);
    const std::size_t bookkeeping =
        base_info_.size() * sizeof(BaseInfo) + host_slot_base_.size() * sizeof(std::int32_t);
    return detail::context_index_bytes<Context>(bytes, bookkeeping);
  }
  /// L for a prompt of n tokens.
  std::int32_t list_length(std::int32_t n) const {
    return std::clamp(std::int32_t(config_.list_fraction * double(n)), 1, max_length_);
  }

  std::size_t select_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return planned_select_bytes(
        shape, [&](WorkspaceLayout& counting, std::int32_t tokens) { layout(counting, shape.batch, tokens, ctx); });
  }

  /// Builds each joining sequence's base from its prompt (in.cache) and its last W prefill queries (in.queries,
  /// W >= C) in a free storage (the slot's old base, if any, dropped first: one shared with other slots stays
  /// theirs), and empties its overlay. in.slots distinct. Allocates scratch; on CUDA synchronizes the stream.
  /// Refused before anything changes: a non-finite prefill query or prompt key (detail::check_finite_prompt).
  void prepare(const PrefillInputs<T>& in, const Context& ctx) {
    constexpr const char* where = entry_point<"prepare">();
    const std::int32_t batch = detail::check_cache(where, limits_, in.cache, in.slots, Context::memory);
    detail::check_prefill_queries(where, limits_, in.queries, batch);
    validate(in.attention.window, where, "in.attention.window");
    KVSIFT_CHECK(in.queries.tokens >= config_.centroids, where,
                 "in.queries holds {} prefill queries per head, fewer than config.centroids (C = {})",
                 in.queries.tokens, config_.centroids);
    const auto rows = static_cast<std::size_t>(batch);
    ContextArray<Context, std::int32_t> context_lengths(rows);
    const auto [lengths, slots] =
        detail::read_prefill_rows(where, limits_, in.cache, in.slots, context_lengths.data(), ctx);
    check_slots(where, "in.slots", slots);
    for (std::int32_t b = 0; b < batch; ++b) {  // every refusal before the first row changes anything
      KVSIFT_CHECK(in.attention.window.recent < lengths[b], where,
                   "the recent window (R = {}) covers sequence {}'s whole prompt ({} tokens): nothing is left to index",
                   in.attention.window.recent, b, lengths[b]);
    }
    detail::check_finite_prompt(where, in.cache, context_lengths.data(), in.queries, ctx);
    for (std::int32_t b = 0; b < batch; ++b) {
      const std::int32_t slot = slots[std::size_t(b)], length = lengths[std::size_t(b)];
      detach(slot);
      const std::int32_t base = free_base();
      build_base(in, b, base, length, ctx);
      order_base(base, length, ctx);
      base_info_[std::size_t(base)] = {.references = 0, .prompt = length, .list_length = list_length(length)};
      attach(base, {&slot, 1}, ctx);
    }
    joined(ctx);
  }

  /// The listed slots (distinct; source_slot may be one: its overlay is emptied) read source_slot's base with empty
  /// overlays, each dropping its own base first (see the class comment: their caches must hold the base's prompt,
  /// their later tokens go through append). Refuses a source_slot without a base. On CUDA synchronizes the stream.
  void share(std::int32_t source_slot, std::span<const std::int32_t> slots, const Context& ctx) {
    constexpr const char* where = entry_point<"share">();
    const std::int32_t base = base_of(where, "source_slot", source_slot);
    check_slots(where, "slots", slots);
    attach(base, slots, ctx);
    joined(ctx);
  }

  /// Sequences leave: the listed slots (distinct, each holding a sequence: prepared, shared or loaded, and not
  /// released since) drop their bases; a base no slot reads is free. Host bookkeeping only (no context:
  /// selectors/selector.hpp's release).
  void release(std::span<const std::int32_t> slots) {
    SelectorCore::release(slots);
    for (const std::int32_t slot : slots) detach(slot);
  }

  /// Writes the base `slot` reads (not its overlay) as a base file (the class comment's format). Refuses a slot
  /// without a base and a stream that fails. On CUDA copies the base to the host and synchronizes the stream.
  void save_base(std::int32_t slot, std::ostream& out, const Context& ctx) const {
    constexpr const char* where = entry_point<"save_base">();
    write_base(download(base_of(where, "slot", slot), ctx), out, where);
  }
  /// save_base to `path` (written to path.partial, renamed over `path` once complete).
  void save_base(std::int32_t slot, const std::string& path, const Context& ctx) const {
    constexpr const char* where = entry_point<"save_base">();
    const HostBase staged = download(base_of(where, "slot", slot), ctx);
    write_index_file(path, where, [&](std::ostream& out) { write_base(staged, out, where); });
  }

  /// Reads one base file from `in` (left after its checksum) and makes the listed slots (distinct, at least one)
  /// read it with empty overlays, each dropping its own base first, as share does. Refuses a file of another
  /// format, version, shape or configuration, a truncated or corrupted one (the class comment), one whose
  /// centroids or scores hold a NaN or an infinity (core/index_file.hpp: the array, list and element), and leaves
  /// the selector unchanged then. Allocates the staging; on CUDA synchronizes the stream.
  void load_base(std::istream& in, std::span<const std::int32_t> slots, const Context& ctx) {
    constexpr const char* where = entry_point<"load_base">();
    check_load_slots(where, slots);
    commit(read_base(in, "stream", where), slots, ctx);
  }
  /// load_base from `path`, also refusing bytes after the file's checksum.
  void load_base(const std::string& path, std::span<const std::int32_t> slots, const Context& ctx) {
    constexpr const char* where = entry_point<"load_base">();
    check_load_slots(where, slots);
    HostBase staged;
    read_index_file(path, where, [&](std::istream& in) { staged = read_base(in, path, where); });
    commit(staged, slots, ctx);
  }

  /// Inserts each row's new key (position lengths[b] - 1) into its slot's lists.
  void append(const AppendInputs<T>& in, std::span<std::byte>, const Context& ctx) {
    checked_append<Context>(entry_point<"append">(), in);
    append_tables(tables(), in.cache, in.slots, in.lengths, ctx);
  }

  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = entry_point<"select">();
    checked_select<Context>(where, in, out, capacity());
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
    append_range(rows_view, rows_.data(), first_.data(), in.lengths, in.attention.window, nullptr, ctx);
  }

  void search(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> workspace, const Context& ctx) {
    constexpr const char* where = entry_point<"select">();
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
    topk_rows(MatrixView<const float>{sums.data, sums.rows, sums.cols, sums.row_stride}, w.candidate_counts, capacity(),
              {.row_k = w.row_k, .ids = candidates.indices, .ids_stride = cap}, positions, w.topk, ctx);
  }

  static CsattentionConfig checked(const SelectorLimits& limits, const CsattentionConfig& c) {
    constexpr const char* where = "Csattention";
    KVSIFT_CHECK(c.subspaces > 0 && limits.head_dim % c.subspaces == 0, where,
                 "config.subspaces (m = {}) does not divide head_dim (= {})", c.subspaces, limits.head_dim);
    KVSIFT_CHECK(c.split == SubspaceSplit::contiguous || (limits.head_dim / c.subspaces) % 2 == 0, where,
                 "SubspaceSplit::rope_pairs needs an even subspace width; head_dim / subspaces = {} / {}",
                 limits.head_dim, c.subspaces);
    KVSIFT_CHECK(c.centroids > 0, where, "config.centroids (C = {}) must be positive", c.centroids);
    KVSIFT_CHECK(c.kmeans_iterations >= 0, where, "config.kmeans_iterations (= {}) must be >= 0", c.kmeans_iterations);
    KVSIFT_CHECK(c.max_points_per_centroid >= 0, where, "config.max_points_per_centroid (= {}) must be >= 0 (0: every query)",
                 c.max_points_per_centroid);
    KVSIFT_CHECK(c.kmeans_batch >= 0, where, "config.kmeans_batch (= {}) must be >= 0 (0: full batch)", c.kmeans_batch);
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

  /// What the host knows of a base storage.
  struct BaseInfo {
    std::int32_t references = 0;   ///< slots that read it; 0: free
    std::int32_t prompt = 0;       ///< N, its prompt's length
    std::int32_t list_length = 0;  ///< L = list_length(N)
  };
  /// One base on the host in the storage's layout (lists L_max entries apart): what save_base writes from and
  /// load_base stages into.
  struct HostBase {
    BaseInfo info;
    std::vector<float> centroids;
    std::vector<std::int32_t> ids;
    std::vector<half> scores;
    std::vector<std::int32_t> counts;
  };

  /// Slots listed by a call: each in range, none twice.
  void check_slots(const char* where, const char* name, std::span<const std::int32_t> slots) const {
    std::vector<bool> seen(std::size_t(limits_.max_slots), false);
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const std::int32_t slot = slots[i];
      KVSIFT_CHECK(slot >= 0 && slot < limits_.max_slots, where, "{}[{}] (= {}) is outside [0, limits.max_slots = {})",
                   name, i, slot, limits_.max_slots);
      KVSIFT_CHECK(!seen[std::size_t(slot)], where, "{} lists slot {} twice", name, slot);
      seen[std::size_t(slot)] = true;
    }
  }
  void check_load_slots(const char* where, std::span<const std::int32_t> slots) const {
    KVSIFT_CHECK(!slots.empty(), where, "slots is empty: a loaded base needs a slot to read it");
    check_slots(where, "slots", slots);
  }
  /// The base `slot` reads, refusing a slot out of range or without one; name: the argument, for the message.
  std::int32_t base_of(const char* where, std::string_view name, std::int32_t slot) const {
    KVSIFT_CHECK(slot >= 0 && slot < limits_.max_slots, where, "{} (= {}) is outside [0, limits.max_slots = {})", name,
                 slot, limits_.max_slots);
    const std::int32_t base = host_slot_base_[std::size_t(slot)];
    KVSIFT_CHECK(base >= 0, where,
                 "{} (= {}) has no base: it was not prepared, shared or loaded since the selector's construction or "
                 "its release",
                 name, slot);
    return base;
  }

  /// `slot` stops reading its base (if any).
  void detach(std::int32_t slot) {
    std::int32_t& base = host_slot_base_[std::size_t(slot)];
    if (base >= 0) --base_info_[std::size_t(base)].references;
    base = -1;
  }
  /// A storage no slot reads. One exists whenever some slot reads none (the joining slot, detached first): the
  /// other slots read at most max_slots - 1 storages.
  std::int32_t free_base() const {
    const auto free = std::find_if(base_info_.begin(), base_info_.end(),
                                   [](const BaseInfo& info) { return info.references == 0; });
    KVSIFT_DASSERT(free != base_info_.end());
    return std::int32_t(free - base_info_.begin());
  }
  /// `slots` read `base` with empty overlays, each dropping its own base first.
  void attach(std::int32_t base, std::span<const std::int32_t> slots, const Context& ctx) {
    const std::size_t slot_lists = base_lists();
    const std::vector<std::int32_t> zeros(slot_lists, 0);
    for (const std::int32_t slot : slots) {
      ++base_info_[std::size_t(base)].references;  // first: a slot that already reads `base` keeps it referenced
      detach(slot);
      host_slot_base_[std::size_t(slot)] = base;
      copy_from_host(zeros.data(), slot_lists, evicted_.data() + std::size_t(slot) * slot_lists, ctx);
      copy_from_host(zeros.data(), slot_lists, overlay_sizes_.data() + std::size_t(slot) * slot_lists, ctx);
    }
    // A slot without a base reads -1: the primitives refuse it rather than read a storage rebuilt for another.
    copy_from_host(host_slot_base_.data(), host_slot_base_.size(), slot_base_.data(), ctx);
    slot_states_.mark_prepared(slots);
  }
  /// Sequences joined (prepare, share, load_base): the next select searches, over the identity row map.
  void joined(const Context& ctx) {
    if (config_.search_period > 1) {
      std::vector<std::int32_t> identity(std::size_t(limits_.max_slots));
      for (std::int32_t r = 0; r < limits_.max_slots; ++r) identity[std::size_t(r)] = r;
      copy_from_host(identity.data(), identity.size(), rows_.data(), ctx);
    }
    calls_until_search_ = 0;
  }

  /// Lists per base (and per slot), and the element offsets of storage `base` in the base arrays.
  std::size_t base_lists() const {
    return std::size_t(table_heads()) * std::size_t(config_.subspaces) * std::size_t(config_.centroids);
  }
  std::size_t centroid_offset(std::int32_t base) const { return count_offset(base) * std::size_t(width()); }
  std::size_t entry_offset(std::int32_t base) const { return count_offset(base) * std::size_t(max_length_); }
  std::size_t count_offset(std::int32_t base) const { return std::size_t(base) * base_lists(); }

  HostBase download(std::int32_t base, const Context& ctx) const {
    const std::size_t lists = base_lists();
    HostBase h{.info = base_info_[std::size_t(base)],
               .centroids = std::vector<float>(lists * std::size_t(width())),
               .ids = std::vector<std::int32_t>(lists * std::size_t(max_length_)),
               .scores = std::vector<half>(lists * std::size_t(max_length_)),
               .counts = std::vector<std::int32_t>(lists)};
    copy_to_host(centroids_.data() + centroid_offset(base), h.centroids.size(), h.centroids.data(), ctx);
    copy_to_host(base_ids_.data() + entry_offset(base), h.ids.size(), h.ids.data(), ctx);
    copy_to_host(base_scores_.data() + entry_offset(base), h.scores.size(), h.scores.data(), ctx);
    copy_to_host(base_counts_.data() + count_offset(base), h.counts.size(), h.counts.data(), ctx);
    return h;
  }
  /// Makes `slots` read a staged (checked) base: their old bases dropped, it is copied into a free storage.
  void commit(const HostBase& h, std::span<const std::int32_t> slots, const Context& ctx) {
    for (const std::int32_t slot : slots) detach(slot);
    const std::int32_t base = free_base();
    copy_from_host(h.centroids.data(), h.centroids.size(), centroids_.data() + centroid_offset(base), ctx);
    copy_from_host(h.ids.data(), h.ids.size(), base_ids_.data() + entry_offset(base), ctx);
    copy_from_host(h.scores.data(), h.scores.size(), base_scores_.data() + entry_offset(base), ctx);
    copy_from_host(h.counts.data(), h.counts.size(), base_counts_.data() + count_offset(base), ctx);
    order_base(base, h.info.prompt, ctx);
    base_info_[std::size_t(base)] = {.references = 0, .prompt = h.info.prompt, .list_length = h.info.list_length};
    attach(base, slots, ctx);
    joined(ctx);
  }

  /// The fields of a base file before N and L, in their order: f(name, value) with this selector's values. An
  /// enum's name lists its values (the file stores the number).
  template <class F>
  void file_fields(F&& f) const {
    f("kv_heads", limits_.kv_heads);
    f("q_heads", limits_.q_heads);
    f("head_dim", limits_.head_dim);
    f("config.subspaces", config_.subspaces);
    f("config.split (0 contiguous, 1 rope_pairs)", std::uint32_t(config_.split));
    f("config.tables (0 per_query_head, 1 per_kv_head)", std::uint32_t(config_.tables));
    f("config.centroids", config_.centroids);
    f("table_heads", table_heads());
    f("width", width());
    f("config.list_fraction", config_.list_fraction);
    f("config.max_list_length", config_.max_list_length);
    f("config.seed", config_.seed);
    f("config.kmeans_iterations", config_.kmeans_iterations);
    f("config.max_points_per_centroid", config_.max_points_per_centroid);
    f("config.kmeans_batch", config_.kmeans_batch);
  }

  void write_base(const HostBase& h, std::ostream& out, const char* where) const {
    IndexFileWriter w(out, kCsattentionBaseFile, where);
    file_fields([&](std::string_view, const auto& value) { w.write(value); });
    w.write(h.info.prompt);
    w.write(h.info.list_length);
    w.write_array(std::span<const float>(h.centroids));
    const std::size_t lists = base_lists(), l = std::size_t(h.info.list_length);
    // Each list's first L entries, those at and after its count zeroed: a file depends on the base alone.
    const auto write_lists = [&]<class V>(const std::vector<V>& entries, V zero) {
      std::vector<V> row(l);
      for (std::size_t list = 0; list < lists; ++list) {
        const V* first = entries.data() + list * std::size_t(max_length_);
        std::fill(std::copy(first, first + h.counts[list], row.begin()), row.end(), zero);
        w.write_array(std::span<const V>(row));
      }
    };
    write_lists(h.ids, std::int32_t(0));
    write_lists(h.scores, half{0});
    w.write_array(std::span<const std::int32_t>(h.counts));
    w.finish();
  }

  /// Reads and checks one base file into host staging; the selector is not touched.
  HostBase read_base(std::istream& in, const std::string& source, const char* where) const {
    IndexFileReader r(in, kCsattentionBaseFile, source, where);
    file_fields([&](std::string_view name, const auto& value) { r.read_expected(name, value); });
    const auto prompt = r.read<std::int32_t>("the prompt length N");
    const auto length = r.read<std::int32_t>("the list length L");
    KVSIFT_CHECK(length >= 1 && length <= max_length_, where,
                 "{}: the list length (L = {}) is outside [1, this selector's L_max = {}] (the entries it stores per "
                 "list: config.list_fraction * limits.max_tokens, at most config.max_list_length)",
                 source, length, max_length_);
    KVSIFT_CHECK(prompt >= 1 && prompt <= limits_.max_tokens, where,
                 "{}: the prompt length (N = {}) is outside [1, limits.max_tokens = {}]", source, prompt,
                 limits_.max_tokens);
    r.expect("the list length L of the prompt length N", length, list_length(prompt));
    const std::size_t lists = base_lists(), l = std::size_t(length);
    HostBase h{.info = {.references = 0, .prompt = prompt, .list_length = length},
               .centroids = std::vector<float>(lists * std::size_t(width())),
               .ids = std::vector<std::int32_t>(lists * std::size_t(max_length_)),
               .scores = std::vector<half>(lists * std::size_t(max_length_)),
               .counts = std::vector<std::int32_t>(lists)};
    r.read_array(std::span<float>(h.centroids), "the centroids");
    for (std::size_t list = 0; list < lists; ++list) {
      r.read_array(std::span<std::int32_t>(h.ids.data() + list * std::size_t(max_length_), l), "the ids");
    }
    for (std::size_t list = 0; list < lists; ++list) {
      r.read_array(std::span<half>(h.scores.data() + list * std::size_t(max_length_), l),
                   fmt::format("the scores of list {}", list));
    }
    r.read_array(std::span<std::int32_t>(h.counts), "the counts");
    r.finish();
    // A file with a valid checksum that was written wrong: what the primitives would index with.
    for (std::size_t list = 0; list < lists; ++list) {
      const std::int32_t count = h.counts[list];
      KVSIFT_CHECK(count >= 0 && count <= length, where, "{}: list {} has count {}, outside [0, L = {}]", source, list,
                   count, length);
      const std::int32_t* ids = h.ids.data() + list * std::size_t(max_length_);
      for (std::int32_t p = 0; p < count; ++p) {
        KVSIFT_CHECK(ids[p] >= 0 && ids[p] < prompt, where, "{}: list {} entry {} has id {}, outside [0, N = {})",
                     source, list, p, ids[p], prompt);
      }
    }
    return h;
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
            config_.split,
            TokenOrderView<std::uint32_t>{token_entries_.data(), token_offsets_.data(), token_prompt_.data(),
                                          token_ranges()}
                .as_const()};
  }
  BaseTablesView base_tables(std::int32_t base) {
    return {centroids_.data() + centroid_offset(base),
            base_ids_.data() + entry_offset(base),
            base_scores_.data() + entry_offset(base),
            base_counts_.data() + count_offset(base),
            table_heads(),
            config_.subspaces,
            config_.centroids,
            width(),
            max_length_,
            config_.split,
            base_token_order(base)};
  }
  TokenOrderView<std::uint32_t> base_token_order(std::int32_t base) {
    if (!keeps_token_order()) return {};
    return {token_entries_.data() + entry_offset(base),
            token_offsets_.data() + count_offset(base) * std::size_t(token_ranges() + 1), token_prompt_.data() + base,
            token_ranges()};
  }
  /// Whether the tables keep the token order of their base lists: the dense reduction on CUDA reads it
  /// (cuda::table_scores_dense); the CPU's reads the lists as they are.
  bool keeps_token_order() const {
    return Context::memory == MemorySpace::device && config_.reduce == CsattentionReduce::dense;
  }
  std::int32_t token_ranges() const { return keeps_token_order() ? table_token_ranges(limits_.max_tokens) : 0; }
  /// The token order of storage `base`'s lists, built over a prompt of `tokens` (where the tables keep one).
  void order_base(std::int32_t base, std::int32_t tokens, const Context& ctx) {
    if constexpr (Context::memory == MemorySpace::device) {
      if (keeps_token_order()) order_table_lists(base_tables(base), tokens, ctx);
    }
  }

  /// Batch row b's base in storage `base`: one batched k-means over every (table head, subspace) problem, whose
  /// points are the sub-vectors of the queries of the heads that read the table (every s-th query, see
  /// max_points_per_centroid), then per table head and chunk of lists the partial scores over the prompt and their
  /// top L.
  void build_base(const PrefillInputs<T>& in, std::int32_t b, std::int32_t base_index, std::int32_t length,
                  const Context& ctx) {
    const std::int32_t heads = table_heads(), m = config_.subspaces, w = width(), d = limits_.head_dim;
    const std::int32_t heads_per_table = limits_.q_heads / heads;
    const std::int64_t pooled = std::int64_t(heads_per_table) * in.queries.tokens;
    const std::int64_t most = std::int64_t(config_.centroids) * config_.max_points_per_centroid;
    const std::int32_t stride = most > 0 ? std::int32_t(std::max<std::int64_t>(1, pooled / most)) : 1;
    const std::int32_t queries = (in.queries.tokens + stride - 1) / stride;  // per head, rows 0, s, 2s, ...
    const std::int64_t points = std::int64_t(heads_per_table) * queries;
    const std::int32_t problems = heads * m;
    const BaseTablesView base = base_tables(base_index);
    // Problem t * m + s draws from seed + t * m + s (BatchedKMeansConfig::seed).
    const BatchedKMeansConfig kmeans{.clusters = config_.centroids,
                                     .iterations = config_.kmeans_iterations,
                                     .metric = KMeansMetric::cosine,
                                     .seed = config_.seed,
                                     .empty = EmptyCluster::reseed,
                                     .batch_size = config_.kmeans_batch};
    ContextArray<Context, T> packed(std::size_t(problems) * std::size_t(points) * std::size_t(w));
    ContextArray<Context, std::int32_t> assignment(std::size_t(problems) * std::size_t(points));
    ContextArray<Context, std::byte> kmeans_ws(batched_kmeans_workspace_bytes(problems, points, w, kmeans, ctx));
    const bool pairs = config_.split == SubspaceSplit::rope_pairs;
    const std::int32_t run = pairs ? w / 2 : w;  // a subspace is one channel run (contiguous) or two (rope_pairs)
    for (std::int32_t t = 0; t < heads; ++t) {
      for (std::int32_t j = 0; j < heads_per_table; ++j) {
        const T* first = in.queries.row(b, t * heads_per_table + j, 0);
        for (std::int32_t s = 0; s < m; ++s) {
          T* dst = packed.data() + (std::int64_t(t * m + s) * points + std::int64_t(j) * queries) * w;
          for (std::int32_t part = 0; part < (pairs ? 2 : 1); ++part) {
            const std::int32_t channel = subspace_channel(config_.split, s, part * run, w, d);
            copy_rows_within(first + channel, in.queries.token_stride * stride, dst + part * run, w, run, queries, ctx);
          }
        }
      }
    }
    kmeans_batched(BatchedMatrixView<const T>::packed(packed.data(), problems, points, w), nullptr, kmeans,
                   base.centroids, assignment.data(), std::span<std::byte>(kmeans_ws.data(), kmeans_ws.size()), ctx);
    const std::int32_t lists = m * config_.centroids, chunk = std::min(config_.prepare_chunk, lists);
    const std::int32_t keep = list_length(length);
    ContextArray<Context, float> scores(std::size_t(chunk) * std::size_t(length));
    ContextArray<Context, std::byte> store_ws(store_table_lists_workspace_bytes(chunk, length, ctx));
    for (std::int32_t t = 0; t < heads; ++t) {
      for (std::int32_t l0 = 0; l0 < lists; l0 += chunk) {
        const std::int32_t n = std::min(chunk, lists - l0);
        const auto out = MatrixView<float>::packed(scores.data(), n, length);
        subspace_scores(base, t, l0, n, in.cache, b, 0, length, out, ctx);
        store_table_lists(MatrixView<const float>{out.data, out.rows, out.cols, out.row_stride}, length, keep, base, t, l0,
                          std::span<std::byte>(store_ws.data(), store_ws.size()), ctx);
      }
    }
  }

  CsattentionConfig config_;
  std::int32_t max_length_ = std::clamp(std::int32_t(config_.list_fraction * double(limits_.max_tokens)), 1,
                                        config_.max_list_length);
  std::int32_t capacity_ =
      (config_.budget > 0 ? config_.budget : std::max(1, std::int32_t(config_.keep_fraction * double(limits_.max_tokens)))) +
      config_.search_period - 1;
  std::int32_t calls_until_search_ = 0, searched_batch_ = 0;
  ContextArray<Context, float> centroids_;
  ContextArray<Context, std::int32_t> base_ids_;
  ContextArray<Context, half> base_scores_;
  ContextArray<Context, std::int32_t> base_counts_, slot_base_, evicted_, overlay_ids_;
  ContextArray<Context, half> overlay_scores_;
  ContextArray<Context, std::int32_t> overlay_sizes_;
  // The base lists in token order (keeps_token_order: CUDA's dense reduction), entries as uint32.
  ContextArray<Context, std::uint32_t> token_entries_;
  ContextArray<Context, std::int32_t> token_offsets_, token_prompt_;
  // The pool's bookkeeping: per storage, per slot the storage it reads (-1: none), mirrored in slot_base_.
  std::vector<BaseInfo> base_info_;
  std::vector<std::int32_t> host_slot_base_;
  // Search period > 1: the searched selection per batch row, where each row's window began at the search, and
  // the identity map of batch rows (append_range indexes `first` by slot).
  ContextArray<Context, std::int32_t> kept_, kept_counts_, first_, rows_;
};

}  // namespace kvsift
