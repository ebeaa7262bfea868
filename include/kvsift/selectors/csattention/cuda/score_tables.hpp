#pragma once
/// Subspace score tables on the GPU, the twin of selectors/csattention/cpu/score_tables.hpp (read its contracts; the differences are
/// here). Device memory for every pointer and view; stream-ordered; no allocation, no host sync; CUDA-graph
/// capturable; deterministic; reentrant with distinct outputs and workspaces. Results equal the CPU's bit for bit:
/// the dot products and sums of squares are the same fused multiply-adds in the same order, the ranking is
/// core/ranking.hpp's, the inserts run selectors/csattention/score_tables.hpp's rule, and the sums are exact integers, so the order
/// of the atomics and of the sort is immaterial. The cache is a KVCache of const T, dispatched here to the kernels'
/// contiguous or paged instantiation; T is float, half or bfloat16. options.weights is device memory.
/// Beyond the CPU's checks: table_scores_sparse takes at most 2^31 - 1 entries (rows * chosen.capacity * length)
/// a call, table_scores_dense at most 2^31 - 1 CTAs (its rows times their parts).
///
/// Shapes are checked on the host before the launch as on the CPU; the arrays' contents (slots, slot_base,
/// lengths, the cache's lengths, chosen counts and list ids, the lists' counts) live on the device and are not,
/// so each function defines what a bad value does, and none reads or writes out of bounds:
/// - subspace_scores: a column whose token is at or past the sequence's length (the cache's own, read on the
///   device) is NaN, its key not read.
/// - append_tables: a batch row whose slot is outside [0, tables.slots), whose slot's base is outside [0,
///   tables.bases) or whose length is outside [1, the cache's length] is left alone, and so is a list whose
///   counts are inconsistent (base count outside [0, length], evicted outside [0, base count], overlay size
///   outside [0, min(evicted, overlay_capacity)]); two rows naming one slot race (the CPU refuses it).
/// - nearest_centroids: a selection row whose batch row's slot or its base is out of range gets count -1 and no
///   entries.
/// - table_scores_dense / table_scores_sparse: a row whose slot or its base is out of range, whose length is
///   negative (dense: or above max_tokens), or whose chosen count is outside [0, chosen.capacity] or not a
///   multiple of heads_per_row gets row_k -1 (sparse: and out count -1) and no scores or entries; a chosen list id
///   outside [0, table_heads * lists), a chosen list whose counts are inconsistent, or whose weight
///   (options.weights) is outside [0, kMaxTableWeight], contributes nothing.
///   row_k -1 makes topk_rows give the row count -1, the selection's mark of a bad row.
/// - store_table_lists reads no device value but the scores.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/selectors/csattention/score_tables.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

/// cpu::subspace_scores. One launch: a thread per token scores 8 lists of one subspace, reading its key's
/// sub-vector once for the 8 centroids.
template <class T>
void subspace_scores(const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                     std::int32_t list_count, const KVCache<const T>& cache, std::int32_t row,
                     std::int32_t token_begin, std::int32_t tokens, const MatrixView<float>& out, const Context& ctx);

/// Device workspace of store_table_lists (shapes only): for min(list_rows, 65536) rows of `tokens` a 32-bit sort
/// key and a column, twice, and CUB's radix-sort scratch (16 * rows * tokens bytes and a little). The context of
/// this file's workspace and capacity queries is the CPU's call shape: it does not change the answer.
std::size_t store_table_lists_workspace_bytes(std::int32_t list_rows, std::int32_t tokens, const Context& = {});

/// cpu::store_table_lists. Three launches per 65,536 rows: a CTA per row finds the row's best min(keep, tokens)
/// by a radix select of their 16-bit rank keys (a table score is an fp16 value, so its rank word has 16
/// significant bits; ties at the threshold to the smaller column, the ranking's rule) and writes them in column
/// order, each key above its row; CUB's stable radix sort of those keys with the columns over the bits in use;
/// then each row's entries into its list. workspace: store_table_lists_workspace_bytes(scores.rows, tokens).
void store_table_lists(const MatrixView<const float>& scores, std::int32_t tokens, std::int32_t keep,
                       const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                       std::span<std::byte> workspace, const Context& ctx);

/// The token order of a built base (TokenOrderView), which table_scores_dense reads: base.token_order's offsets
/// and entries from base's lists (ids and scores, whatever their counts evict later), and its prompt = `tokens`
/// (the tokens the lists were built over, at most base.token_order.ranges * kTableTokenRange). One launch, a CTA
/// per list. Run it after every build or upload of the base's lists. Refused: an empty token order or its ranges
/// outside [1, 12288].
void order_table_lists(const BaseTablesView& base, std::int32_t tokens, const Context& ctx);

/// cpu::append_tables. One launch, a thread per (batch row, table head, list).
template <class T>
void append_tables(const ScoreTablesView<std::int32_t>& tables, const KVCache<const T>& cache,
                   const std::int32_t* d_slots, const std::int32_t* d_lengths, const Context& ctx);

/// cpu::nearest_centroids. One launch, a warp per (batch row, query head, subspace): each lane scores every 32nd
/// centroid, and the warp merges each round of 32 into its sorted best `probes` (shared memory). d_weights may be
/// nullptr.
template <class T>
void nearest_centroids(const QueryView<const T>& q, const ScoreTablesView<const std::int32_t>& tables,
                       const std::int32_t* d_slots, std::int32_t probes, const SelectionView& chosen,
                       std::int32_t* d_weights, const Context& ctx);

/// Device workspace of table_scores_dense: a count per CTA, 4 * ceil(max_tokens / 1024) bytes per row.
std::size_t table_scores_dense_workspace_bytes(std::int64_t rows, std::int32_t heads_per_row, std::int32_t max_tokens,
                                               const Context& = {});
/// cpu::table_scores_dense. Two launches. A CTA per (row, part of its tokens; a power of two from 1024 to 65536
/// tokens), holding the part's sums in shared memory: per query-head block, it reads from the base's token order
/// (tables.token_order, order_table_lists) the chosen lists' entries of its own tokens alone, and the lists'
/// overlays where its tokens reach past the base's prompt, and adds each kept entry's value (weight * (fixed score
/// - floor)) to its token's int64 sum (list after list, a barrier apart: exact integers, the same in any order); it
/// folds each block's sums
/// into a running maximum as fp32 (rounding is monotonic: the maximum of the rounded sums is the rounded maximum)
/// and writes the scores and its candidate count. Then a thread per row writes row_k. Overlays are read by the
/// parts that reach past the base's prompt (token_order.prompt), where append_tables puts a decode step's keys: an
/// overlay entry inside the prompt (only an append at a position inside it inserts one, which a decode step never
/// does) is counted only if its part reaches past the prompt, and differs from the CPU's otherwise. Refused besides
/// the CPU's: an empty token order.
void table_scores_dense(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                        const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* d_slots,
                        const std::int32_t* d_lengths, const AttentionWindow& window, const LengthBudget& budget,
                        const MatrixView<float>& scores, std::int32_t* d_row_k, std::int32_t max_tokens,
                        std::span<std::byte> workspace, const Context& ctx);

/// Entries a row of table_scores_sparse may hold: chosen.capacity * tables.length (as on the CPU).
std::int64_t table_scores_sparse_capacity(std::int32_t chosen_capacity, std::int32_t length, const Context& = {});
/// Device workspace of table_scores_sparse (shapes only): for rows * chosen_capacity * length entries a 64-bit sort
/// key and an ordinal, twice, and an int64 value (32 bytes an entry), and CUB's scratch.
std::size_t table_scores_sparse_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity, std::int32_t length,
                                                const Context& = {});
/// cpu::table_scores_sparse. Five launches: the chosen lists' entries into one fixed segment per row (key row << 31
/// | id, dropped entries keyed past the row's ids; values by ordinal), CUB's radix sort of (key, ordinal) over the
/// bits in use (stable, so each id's entries stay in chosen order, its query-head blocks ascending), the runs of
/// equal keys flagged and scanned into their ranks, then each run's first entry writes the candidate and its score.
void table_scores_sparse(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                         const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* d_slots,
                         const std::int32_t* d_lengths, const AttentionWindow& window, const LengthBudget& budget,
                         const SelectionView& out, const MatrixView<float>& sums, std::int32_t* d_row_k,
                         std::span<std::byte> workspace, const Context& ctx);

}  // namespace kvsift::cuda
