#pragma once
/// CPU top-K selection shared by every selector.
///
/// Order and ties: kvsift's ranking rule (core/ranking.hpp): the K largest scores win; on equal scores the
/// smaller index wins; NaN ranks above every number. Output indices are written in ascending index order, so
/// CPU and CUDA results (cuda/topk.hpp) compare exactly.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cpu {

/// Bytes of host workspace (256-byte aligned) topk_rows needs for `score_rows` score rows of max_tokens =
/// scores.cols scores on `pool` (nullptr: one thread): for each of min(selection rows, threads) threads,
/// selection rows = score_rows / options.heads_per_row, 8 * max_tokens bytes of rank keys and, when
/// heads_per_row > 1, 4 * heads_per_row * k bytes for the score rows' picks before their union. A run on a
/// larger pool than the query's needs more and is refused. k and the options are checked as the run checks
/// them.
std::size_t topk_rows_workspace_bytes(std::int64_t score_rows, std::int32_t max_tokens, std::int32_t k,
                                      const TopKRowsOptions& options, const ThreadPool* pool);

/// Top-K per selection row (sequence b, kv head g), among the tokens that the attention window leaves.
/// Shapes: scores [out.batch * out.kv_heads * heads_per_row, max_tokens] fp32 (group_scores' layout when
/// heads_per_row = 1; a GQA group's query heads, consecutive, otherwise); score row r belongs to selection row
/// s = r / heads_per_row = b * out.kv_heads + g and holds the scores of tokens [0, lengths[b]). Candidates are
/// the middle [window.sink_end(len), window.recent_begin(len)) (sparse decode attends the window anyway,
/// attention/options.hpp). Each score row picks its min(k_s, middle size) best candidates, k_s = row_k[s] if
/// options.row_k is given, else k: higher score first, NaN above every number, on equal scores the smaller
/// index (core/ranking.hpp). Into out.row(b, g) goes the union of the picks of s's score rows, distinct and
/// ascending, and its size into out.counts[s]; a middle of at most k_s tokens is taken whole, an empty
/// sequence (or k_s = 0) gets count 0. Log-weights, if out has them, are set to 0 for the written entries;
/// entries past the count are not written.
///
/// Checked: k > 0, options.heads_per_row >= 1, scores.rows == out.batch * out.kv_heads * heads_per_row,
/// out.capacity >= heads_per_row * k, window sizes >= 0, every lengths[b] in [0, scores.cols], every
/// row_k[s] in [0, k]. Memory: scores, lengths [out.batch], row_k, out and workspace in host memory.
/// workspace: topk_rows_workspace_bytes(scores.rows, scores.cols, k, options, pool) bytes, 256-byte
/// aligned, contents need not be initialized; a smaller buffer is refused. Selection rows run in parallel on
/// `pool` (nullptr: the calling thread); each row's result depends on that row alone, so it is identical for
/// every thread count. No allocation. Reentrant with distinct workspaces and outputs.
void topk_rows(const MatrixView<const float>& scores, const std::int32_t* lengths, std::int32_t k,
               const TopKRowsOptions& options, const SelectionView& out, std::span<std::byte> workspace,
               ThreadPool* pool = nullptr);

/// topk_rows' per-row budgets from the sequences' lengths: row_k[b * heads + h] = budget(lengths[b]) for every
/// h < heads (core/ranking.hpp LengthBudget). Checked: non-null pointers, batch and heads positive,
/// budget.fraction in (0, 1], budget.minimum in [0, budget.maximum]. Host memory; lengths [batch], row_k
/// [batch * heads].
void length_budgets(const std::int32_t* lengths, std::int32_t batch, std::int32_t heads, const LengthBudget& budget,
                    std::int32_t* row_k);

/// topk_rows' per-row budgets from the scores themselves (core/ranking.hpp MassBudget, top-p): for each row r of
/// `scores` [rows, capacity] (the rerank's candidate scores, group-max softmax weights) whose first counts[r]
/// entries are its candidates, row_k[r] = the fewest of its best candidates whose scores hold budget.mass of
/// the row's total, in MassBudget's fixed point, clamped to [budget.floor, min(budget.maximum, counts[r],
/// budget.limits[r])]. A row with a score outside [0, 1] (NaN, an infinity, a negative) keeps that upper bound;
/// a row with counts[r] = -1 (a row an earlier stage marked bad) gets row_k[r] = -1, which topk_rows passes on
/// as count -1 on CUDA (and refuses with the row's length on the CPU). Checked: non-null pointers, scores.cols in
/// [1, kMassMaxCandidates], budget.mass in (0, 1], budget.floor >= 1, budget.maximum >= budget.floor, every
/// counts[r] in [-1, scores.cols], every budget.limits[r] in [0, budget.maximum]. The result is cuda::mass_budgets'
/// bit for bit (integer sums: no order dependence). Per row a radix select over the scores' bits that counts
/// items and units per digit (3 passes of 11, 11 and 10 bits over the row, histograms on the stack); rows in
/// parallel on `pool` (nullptr: the calling thread). Host memory; no allocation, no workspace.
void mass_budgets(const MatrixView<const float>& scores, const std::int32_t* counts, const MassBudget& budget,
                  std::int32_t* row_k, ThreadPool* pool = nullptr);

}  // namespace kvsift::cpu
