#pragma once
/// Subspace score tables on the CPU (selectors/csattention/score_tables.hpp): CSAttention's build, streaming insert, nearest
/// centroids and the two reductions of the chosen lists (dense accumulator; sort and reduce by key). The twin of
/// selectors/csattention/cuda/score_tables.hpp, with the same arguments but the context and the same results, bit for bit. Host memory;
/// no allocation; deterministic and independent of the thread count; reentrant with distinct outputs and
/// workspaces. Every argument is checked, array contents included (slots, lengths, chosen ids, counts).
/// T: the cache's and queries' storage type (float, half, bfloat16).
///
/// Dot products (subspace_scores, append_tables, nearest_centroids) are fp32 fused multiply-adds in ascending
/// element order of the subspace (element j is channel subspace_channel(split, s, j, ...)), starting from 0.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/selectors/csattention/score_tables.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// The scores that fill a base's lists: row r < list_count is list list_begin + r of table head `table_head`
/// (subspace s = l / centroids, centroid c = l % centroids), column t < tokens is token token_begin + t of batch
/// row `row` of `cache`, kv head table_head * cache.kv_heads() / base.table_heads; the value is
/// table_score(centroid . k^(s)). out [list_count, >= tokens]. Checked: shapes (head_dim == base.subspaces *
/// base.width, table_heads a multiple of the cache's kv heads), the range inside the sequence, the list range
/// inside [0, lists). Threads: lists.
template <class T>
void subspace_scores(const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                     std::int32_t list_count, const KVCache<const T>& cache, std::int32_t row,
                     std::int32_t token_begin, std::int32_t tokens, const MatrixView<float>& out,
                     const Context& ctx = {});

/// Host workspace of store_table_lists: 8 * tokens bytes per thread (min(list rows, threads)).
std::size_t store_table_lists_workspace_bytes(std::int32_t list_rows, std::int32_t tokens, const Context& ctx = {});

/// Fills lists [list_begin, list_begin + scores.rows) of table head `table_head` of `base`: list r takes the
/// min(keep, tokens) best columns t < tokens of scores row r (keep in [1, base.length]: the prompt's L; ranked by
/// kvsift's rule on the stored values: higher score, then the smaller column), ids = the columns (token positions
/// from 0), scores as fp16, highest first; its count. Values are ranked as table_score rounds them (subspace_scores' output is already
/// rounded; other values, NaN and infinities included, are rounded first). Checked: the range, tokens in [0,
/// scores.cols], keep.
void store_table_lists(const MatrixView<const float>& scores, std::int32_t tokens, std::int32_t keep,
                       const BaseTablesView& base,
                       std::int32_t table_head, std::int32_t list_begin, std::span<std::byte> workspace,
                       const Context& ctx = {});

/// The streaming insert (CSAttention's append): batch row b's key at position lengths[b] - 1 (kv head t *
/// cache.kv_heads() / table_heads for table head t) tries into every list l of every table head t of slot
/// slots[b], with value table_score(centroid(base of the slot, t, s, c) . k^(s)), by the rule of
/// selectors/csattention/score_tables.hpp detail::insert_table_key. Checked: slots in [0, tables.slots), distinct, their base in
/// [0, tables.bases); lengths in [1, the cache's length]; every touched list's counts consistent (base count in
/// [0, length], evicted in [0, base count], overlay size in [0, min(overlay_capacity, evicted)]: core/detail/
/// score_tables_checks.hpp check_slot_list). Threads: (row, table head).
template <class T>
void append_tables(const ScoreTablesView<std::int32_t>& tables, const KVCache<const T>& cache,
                   const std::int32_t* slots, const std::int32_t* lengths, const Context& ctx = {});

/// The lists each query head reads: for selection row (b, g), query heads h = g * G + j (j < G, G = q.heads /
/// chosen.kv_heads) in order, subspaces s in order, the `probes` centroids c of table head t = h * table_heads /
/// q.heads (in slot slots[b]'s base) with the largest q^(s) . c (kvsift's ranking rule: higher, then the smaller
/// c; the cosine order, the query's norm being a positive factor), best first, as list ids t * lists + s *
/// centroids + c: chosen.row(b, g)[(j * subspaces + s) * probes + p], count G * subspaces * probes. weights
/// (optional, [batch * kv_heads, chosen.capacity], same positions): table_weight(|q^(s)|) for each entry. Checked:
/// q.heads a multiple of table_heads, table_heads a multiple of chosen.kv_heads, head_dim, probes in [1,
/// min(centroids, kMaxTableProbes)], subspaces * probes <= kMaxTableBlock, chosen.capacity >= G * subspaces *
/// probes, slots and their bases in range. Threads: rows.
template <class T>
void nearest_centroids(const QueryView<const T>& q, const ScoreTablesView<const std::int32_t>& tables,
                       const std::int32_t* slots, std::int32_t probes, const SelectionView& chosen,
                       std::int32_t* weights, const Context& ctx = {});

/// The candidates and scores of the chosen lists, the value both reductions compute. For selection row (b, g)
/// with G = heads_per_row, the chosen ids split into G equal blocks, one per query head (nearest_centroids'
/// order); each chosen list is the slot's list (base part and overlay, selectors/csattention/score_tables.hpp), and its entries
/// count when list_entry_kept(id, lengths[b], window). A token is a candidate when some block has it; block j's
/// sum S_j(token) adds weight * (fixed score - floor) of its entries with that id (selectors/csattention/score_tables.hpp
/// TableScoreOptions; exactly, int64), 0 without one; the token's score is fixed_to_float(max_j S_j). row_k[s] =
/// min(budget(lengths[b]), candidates of the row). Checked: chosen counts in [0, capacity] and divisible by G,
/// at most kMaxTableBlock per block, list ids in [0, table_heads * lists), weights in [0, kMaxTableWeight],
/// slots, bases, lengths >= 0, the lists' counts.

/// Host workspace of table_scores_dense: 8 * heads_per_row * max_tokens + max_tokens bytes per thread
/// (min(rows, threads)).
std::size_t table_scores_dense_workspace_bytes(std::int64_t rows, std::int32_t heads_per_row, std::int32_t max_tokens,
                                               const Context& ctx = {});
/// The dense accumulator: scores.row(b * kv_heads + g)[t] for t < lengths[b] is the candidate's score, -inf for
/// a token that is no candidate (columns past the length are not written). scores [batch * kv_heads, >=
/// max_tokens], lengths[b] <= max_tokens (refused otherwise). Threads: rows.
void table_scores_dense(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                        const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* slots, const std::int32_t* lengths,
                        const AttentionWindow& window, const LengthBudget& budget, const MatrixView<float>& scores,
                        std::int32_t* row_k, std::int32_t max_tokens, std::span<std::byte> workspace,
                        const Context& ctx = {});

/// Entries a row of table_scores_sparse may hold: chosen.capacity * tables.length, whatever the context.
std::int64_t table_scores_sparse_capacity(std::int32_t chosen_capacity, std::int32_t length, const Context& = {});
/// Host workspace of table_scores_sparse: 16 * chosen_capacity * length bytes per thread (min(rows, threads)).
std::size_t table_scores_sparse_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity, std::int32_t length,
                                                const Context& ctx = {});
/// The paper's sort and reduce by key: out.row(b, g) receives the row's candidates ascending and out.counts their
/// number, sums.row(b * kv_heads + g)[i] the score of candidate i. out [batch, kv_heads, >= chosen.capacity *
/// length]; log-weights, if out has them, 0. Threads: rows.
void table_scores_sparse(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                         const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* slots, const std::int32_t* lengths,
                         const AttentionWindow& window, const LengthBudget& budget, const SelectionView& out,
                         const MatrixView<float>& sums, std::int32_t* row_k, std::span<std::byte> workspace,
                         const Context& ctx = {});

}  // namespace kvsift::cpu
