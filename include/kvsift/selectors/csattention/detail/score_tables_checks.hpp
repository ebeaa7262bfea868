#pragma once
/// Argument checks of the score-table functions, shared by selectors/csattention/cpu/score_tables.hpp and selectors/csattention/cuda/score_tables.hpp so both
/// backends refuse the same inputs in the same words. Shape checks read only the views' fields; content checks
/// (slots, bases, lengths, chosen list ids, list counts) read the arrays and run only where they are host memory
/// (MemorySpace::host). The CUDA backend defines instead what a bad device value does (selectors/csattention/cuda/score_tables.hpp).

#include <climits>
#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/selectors/csattention/score_tables.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::detail {

inline void check_table_shape(const char* where, const char* name, std::int32_t table_heads, std::int32_t subspaces,
                              std::int32_t centroids, std::int32_t width, std::int32_t length, SubspaceSplit split) {
  check_positive(where, name, "table_heads", table_heads);
  check_positive(where, name, "subspaces", subspaces);
  check_positive(where, name, "centroids_per_subspace", centroids);
  check_positive(where, name, "width", width);
  check_positive(where, name, "length", length);
  KVSIFT_CHECK(split == SubspaceSplit::contiguous || split == SubspaceSplit::rope_pairs, where,
               "{}.split (= {}) is not a SubspaceSplit", name, int(split));
  KVSIFT_CHECK(split != SubspaceSplit::rope_pairs || width % 2 == 0, where,
               "{}.width (= {}) must be even with SubspaceSplit::rope_pairs", name, width);
  KVSIFT_CHECK(double(table_heads) * subspaces * centroids * length <= 0x1p31, where,
               "{} has more than 2^31 entries per base ({} table heads * {} subspaces * {} centroids * {})", name,
               table_heads, subspaces, centroids, length);
}

inline void check_base_tables(const char* where, const BaseTablesView& base) {
  check_pointer(where, "base", "centroids", base.centroids);
  check_pointer(where, "base", "ids", base.ids);
  check_pointer(where, "base", "scores", base.scores);
  check_pointer(where, "base", "counts", base.counts);
  check_table_shape(where, "base", base.table_heads, base.subspaces, base.centroids_per_subspace, base.width,
                    base.length, base.split);
}

template <class C>
void check_score_tables(const char* where, const ScoreTablesView<C>& t) {
  check_pointer(where, "tables", "centroids", t.centroids);
  check_pointer(where, "tables", "base_ids", t.base_ids);
  check_pointer(where, "tables", "base_scores", t.base_scores);
  check_pointer(where, "tables", "base_counts", t.base_counts);
  check_pointer(where, "tables", "slot_base", t.slot_base);
  check_pointer(where, "tables", "evicted", t.evicted);
  check_pointer(where, "tables", "overlay_ids", t.overlay_ids);
  check_pointer(where, "tables", "overlay_scores", t.overlay_scores);
  check_pointer(where, "tables", "overlay_sizes", t.overlay_sizes);
  check_positive(where, "tables", "bases", t.bases);
  check_positive(where, "tables", "slots", t.slots);
  check_positive(where, "tables", "overlay_capacity", t.overlay_capacity);
  check_table_shape(where, "tables", t.table_heads, t.subspaces, t.centroids_per_subspace, t.width, t.length, t.split);
}

/// The table heads against the heads of the cache or queries: table_heads a multiple of kv_heads and a divisor of
/// q_heads (q_heads 0: not checked), head_dim = subspaces * width.
inline void check_table_heads(const char* where, std::int32_t table_heads, std::int32_t head_dim_of_tables,
                              std::int32_t q_heads, std::int32_t kv_heads, std::int32_t head_dim) {
  KVSIFT_CHECK(head_dim == head_dim_of_tables, where, "head_dim (= {}) != tables' subspaces * width (= {})", head_dim,
               head_dim_of_tables);
  KVSIFT_CHECK(kv_heads > 0 && table_heads % kv_heads == 0, where,
               "tables.table_heads (= {}) is not a multiple of kv_heads (= {})", table_heads, kv_heads);
  KVSIFT_CHECK(q_heads == 0 || q_heads % table_heads == 0, where,
               "q_heads (= {}) is not a multiple of tables.table_heads (= {})", q_heads, table_heads);
}

/// A slot's base (host memory), returned.
template <class C>
std::int32_t check_slot_base(const char* where, const ScoreTablesView<C>& t, std::int32_t b, std::int32_t slot) {
  KVSIFT_CHECK(slot >= 0 && slot < t.slots, where, "slots[{}] (= {}) is outside [0, tables.slots = {})", b, slot,
               t.slots);
  const std::int32_t base = t.slot_base[slot];
  KVSIFT_CHECK(base >= 0 && base < t.bases, where, "tables.slot_base (= {}) of slot {} is outside [0, tables.bases = {})",
               base, slot, t.bases);
  return base;
}

/// A slot's list l of table head h (host memory): base count in [0, length], evicted in [0, base count], overlay
/// size in [0, overlay_capacity], kept + overlay <= base count.
template <class C>
void check_slot_list(const char* where, const ScoreTablesView<C>& t, std::int32_t slot, std::int32_t base,
                     std::int32_t h, std::int32_t l) {
  const std::int32_t count = t.base_counts[t.list_index(base, h, l)];
  const std::int32_t evicted = t.evicted[t.list_index(slot, h, l)];
  const std::int32_t size = t.overlay_sizes[t.list_index(slot, h, l)];
  KVSIFT_CHECK(count >= 0 && count <= t.length && evicted >= 0 && evicted <= count && size >= 0 &&
                   size <= t.overlay_capacity && count - evicted + size <= count,
               where,
               "list {} of table head {} of slot {} is inconsistent: base count {}, evicted {}, overlay size {} "
               "(length {}, overlay_capacity {})",
               l, h, slot, count, evicted, size, t.length, t.overlay_capacity);
}

/// subspace_scores: rows [list_begin, list_begin + list_count) of one table head; tokens [token_begin, +tokens) of
/// batch row `row` (the range against the length is the caller's, on CUDA).
template <class T>
void check_subspace_scores(const char* where, const BaseTablesView& base, std::int32_t table_head,
                           std::int32_t list_begin, std::int32_t list_count, const KVCache<const T>& cache,
                           std::int32_t row, std::int32_t token_begin, std::int32_t tokens,
                           const MatrixView<float>& out) {
  check_base_tables(where, base);
  check_table_heads(where, base.table_heads, base.subspaces * base.width, 0, cache.kv_heads(), cache.head_dim());
  KVSIFT_CHECK(table_head >= 0 && table_head < base.table_heads, where,
               "table_head (= {}) is outside [0, base.table_heads = {})", table_head, base.table_heads);
  KVSIFT_CHECK(list_begin >= 0 && list_count > 0 && list_begin + std::int64_t(list_count) <= base.lists(), where,
               "lists [{}, {} + {}) are outside [0, base lists = {})", list_begin, list_begin, list_count, base.lists());
  KVSIFT_CHECK(row >= 0 && row < cache.batch(), where, "row (= {}) is outside [0, cache batch = {})", row,
               cache.batch());
  KVSIFT_CHECK(token_begin >= 0 && tokens > 0, where, "tokens [{}, {} + {}) is not a range", token_begin, token_begin,
               tokens);
  validate(out, where, "out");
  KVSIFT_CHECK(out.rows == list_count && out.cols >= tokens, where, "out is [{}, {}], not [list_count = {}, >= {}]",
               out.rows, out.cols, list_count, tokens);
}

/// store_table_lists.
inline void check_store_table_lists(const char* where, const MatrixView<const float>& scores, std::int32_t tokens,
                                    std::int32_t keep, const BaseTablesView& base, std::int32_t table_head,
                                    std::int32_t list_begin) {
  check_base_tables(where, base);
  KVSIFT_CHECK(keep >= 1 && keep <= base.length, where, "keep (= {}) is outside [1, base.length = {}]", keep,
               base.length);
  validate(scores, where, "scores");
  KVSIFT_CHECK(tokens >= 0 && tokens <= scores.cols, where, "tokens (= {}) is outside [0, scores.cols = {}]", tokens,
               scores.cols);
  KVSIFT_CHECK(table_head >= 0 && table_head < base.table_heads, where,
               "table_head (= {}) is outside [0, base.table_heads = {})", table_head, base.table_heads);
  KVSIFT_CHECK(list_begin >= 0 && list_begin + scores.rows <= base.lists(), where,
               "lists [{}, {} + scores.rows = {}) are outside [0, base lists = {})", list_begin, list_begin,
               scores.rows, base.lists());
}

/// append_tables: batch rows of the cache, one slot each (distinct), the new key at lengths[b] - 1.
template <class T>
void check_append_tables(const char* where, const ScoreTablesView<std::int32_t>& t, const KVCache<const T>& cache,
                         const std::int32_t* slots, const std::int32_t* lengths, MemorySpace contents) {
  check_score_tables(where, t);
  check_table_heads(where, t.table_heads, t.head_dim(), 0, cache.kv_heads(), cache.head_dim());
  KVSIFT_CHECK(slots != nullptr, where, "slots is a null pointer");
  KVSIFT_CHECK(lengths != nullptr, where, "lengths is a null pointer");
  if (contents != MemorySpace::host) return;
  for (std::int32_t b = 0; b < cache.batch(); ++b) {
    for (std::int32_t other = 0; other < b; ++other) {
      KVSIFT_CHECK(slots[other] != slots[b], where, "slots[{}] (= {}) repeats slots[{}]: each batch row owns its slot",
                   b, slots[b], other);
    }
    KVSIFT_CHECK(lengths[b] >= 1 && lengths[b] <= cache.seq_len(b), where,
                 "lengths[{}] (= {}) is outside [1, the cache's length = {}]", b, lengths[b], cache.seq_len(b));
    const std::int32_t base = check_slot_base(where, t, b, slots[b]);
    for (std::int32_t h = 0; h < t.table_heads; ++h) {
      for (std::int32_t l = 0; l < t.lists(); ++l) check_slot_list(where, t, slots[b], base, h, l);
    }
  }
}

/// nearest_centroids.
template <class T>
void check_nearest_centroids(const char* where, const QueryView<const T>& q, const ScoreTablesView<const std::int32_t>& t,
                             const std::int32_t* slots, std::int32_t probes, const SelectionView& chosen,
                             MemorySpace contents) {
  check_score_tables(where, t);
  validate(q, where, "q");
  check_pointer(where, "chosen", "indices", chosen.indices);
  check_pointer(where, "chosen", "counts", chosen.counts);
  KVSIFT_CHECK(slots != nullptr, where, "slots is a null pointer");
  KVSIFT_CHECK(chosen.batch == q.batch, where, "chosen.batch (= {}) != q.batch (= {})", chosen.batch, q.batch);
  check_table_heads(where, t.table_heads, t.head_dim(), q.heads, chosen.kv_heads, q.head_dim);
  KVSIFT_CHECK(probes >= 1 && probes <= t.centroids_per_subspace && probes <= kMaxTableProbes, where,
               "probes (= {}) is outside [1, min(centroids_per_subspace = {}, {})]", probes, t.centroids_per_subspace,
               kMaxTableProbes);
  KVSIFT_CHECK(std::int64_t(t.subspaces) * probes <= kMaxTableBlock, where,
               "tables.subspaces * probes (= {} * {}) exceeds {} lists per query head", t.subspaces, probes,
               kMaxTableBlock);
  const std::int64_t needed = std::int64_t(q.heads / chosen.kv_heads) * t.subspaces * probes;
  KVSIFT_CHECK(chosen.capacity >= needed, where, "chosen.capacity (= {}) < heads per row * subspaces * probes (= {})",
               chosen.capacity, needed);
  if (contents != MemorySpace::host) return;
  for (std::int32_t b = 0; b < q.batch; ++b) check_slot_base(where, t, b, slots[b]);
}

/// table_scores_dense and table_scores_sparse (sums / dense scores: `scores`, [rows, >= columns]).
inline void check_table_scores(const char* where, const ScoreTablesView<const std::int32_t>& t,
                               const SelectionView& chosen, const TableScoreOptions& options,
                               std::int32_t heads_per_row, const std::int32_t* slots,
                               const std::int32_t* lengths, const AttentionWindow& window, const LengthBudget& budget,
                               const MatrixView<float>& scores, std::int64_t columns, const std::int32_t* row_k,
                               MemorySpace contents) {
  check_score_tables(where, t);
  check_pointer(where, "chosen", "indices", chosen.indices);
  check_pointer(where, "chosen", "counts", chosen.counts);
  check_positive(where, "chosen", "batch", chosen.batch);
  check_positive(where, "chosen", "kv_heads", chosen.kv_heads);
  check_positive(where, "chosen", "capacity", chosen.capacity);
  KVSIFT_CHECK(heads_per_row >= 1 && chosen.capacity % heads_per_row == 0, where,
               "chosen.capacity (= {}) is not a multiple of heads_per_row (= {})", chosen.capacity, heads_per_row);
  KVSIFT_CHECK(chosen.capacity / heads_per_row <= kMaxTableBlock, where,
               "chosen.capacity / heads_per_row (= {} / {}) exceeds {} lists per query head", chosen.capacity,
               heads_per_row, kMaxTableBlock);
  KVSIFT_CHECK(slots != nullptr && lengths != nullptr && row_k != nullptr, where,
               "slots, lengths and row_k must be non-null");
  validate(window, where, "window");
  KVSIFT_CHECK(budget.fraction > 0 && budget.fraction <= 1 && budget.minimum >= 0 &&
                   budget.minimum <= budget.maximum && budget.reserved >= 0,
               where, "budget (fraction {}, minimum {}, maximum {}, reserved {}) is not a LengthBudget", budget.fraction,
               budget.minimum, budget.maximum, budget.reserved);
  validate(scores, where, "scores");
  const std::int64_t rows = std::int64_t(chosen.batch) * chosen.kv_heads;
  KVSIFT_CHECK(scores.rows == rows && scores.cols >= columns, where, "scores is [{}, {}], not [batch * kv_heads = {}, >= {}]",
               scores.rows, scores.cols, rows, columns);
  if (contents != MemorySpace::host) return;
  const std::int32_t table_lists = t.table_heads * t.lists();
  for (std::int32_t b = 0; b < chosen.batch; ++b) {
    KVSIFT_CHECK(lengths[b] >= 0, where, "lengths[{}] (= {}) is negative", b, lengths[b]);
    const std::int32_t base = check_slot_base(where, t, b, slots[b]);
    for (std::int32_t g = 0; g < chosen.kv_heads; ++g) {
      const std::int32_t count = chosen.count(b, g);
      check_selection_count(where, "chosen", b, g, count, chosen.capacity);
      KVSIFT_CHECK(count % heads_per_row == 0, where,
                   "chosen count (= {}) at batch {}, kv_head {} is not a multiple of heads_per_row (= {})", count, b, g,
                   heads_per_row);
      for (std::int32_t i = 0; i < count; ++i) {
        const std::int32_t id = chosen.row(b, g)[i];
        KVSIFT_CHECK(id >= 0 && id < table_lists, where,
                     "chosen.indices[{}] (= {}) at batch {}, kv_head {} is outside [0, table_heads * lists = {})", i,
                     id, b, g, table_lists);
        check_slot_list(where, t, slots[b], base, id / t.lists(), id % t.lists());
        if (options.weights == nullptr) continue;
        const std::int32_t weight = options.weights[chosen.row_index(b, g) * chosen.capacity + i];
        KVSIFT_CHECK(weight >= 0 && weight <= kMaxTableWeight, where,
                     "options.weights[{}] (= {}) at batch {}, kv_head {} is outside [0, {}]", i, weight, b, g,
                     kMaxTableWeight);
      }
    }
  }
}

/// table_scores_sparse's output: [chosen.batch, chosen.kv_heads, >= capacity]; the sort keys hold an entry's
/// ordinal in 24 bits and its query-head block in 8.
inline void check_sparse_out(const char* where, const SelectionView& out, const SelectionView& chosen,
                             std::int32_t heads_per_row, std::int64_t capacity) {
  check_pointer(where, "out", "indices", out.indices);
  check_pointer(where, "out", "counts", out.counts);
  KVSIFT_CHECK(out.batch == chosen.batch && out.kv_heads == chosen.kv_heads, where,
               "out is [batch = {}, kv_heads = {}], chosen [batch = {}, kv_heads = {}]", out.batch, out.kv_heads,
               chosen.batch, chosen.kv_heads);
  KVSIFT_CHECK(out.capacity >= capacity, where, "out.capacity (= {}) < chosen.capacity * tables.length (= {})",
               out.capacity, capacity);
  KVSIFT_CHECK(capacity < (std::int64_t(1) << 24) && heads_per_row < 256, where,
               "chosen.capacity * tables.length (= {}) must be below 2^24 and heads_per_row (= {}) below 256", capacity,
               heads_per_row);
}

}  // namespace kvsift::detail
