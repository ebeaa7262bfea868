#pragma once
/// Fidelity of selectors on real attention: replays the decode positions of a capture through any set of
/// selectors at budgets given as fractions of the context, and scores each selection against exact attention.
///
/// Decoding, per layer, as an engine decodes: the capture's fp16 cache is the engine's cache, and every
/// selector (made per budget, with its attention window) runs in a CPU DecodeStep (step/decode_step.hpp):
/// prepare() on the prefill, then at each decode position p = P, ..., tokens - 1 one step over the cache
/// holding [0, p] (the query at p attends its own token): the selector's append and select, then sparse
/// attention over the window and the selection, with fp32 output. Tokens [0, P) are the prefill,
/// P = round(prefill * tokens) the first decode position.
///
/// Evaluated positions: `decode_positions` of them, spread evenly over the decoded range [P, tokens - 1], both
/// ends included (position i of N is P + round(i * (tokens - 1 - P) / (N - 1)); N = 1 is the last position).
/// Selectors select at every decode position; the scores are taken at the evaluated ones. At an evaluated
/// position the exact attention (fp64 softmax weights of every query head over [0, p]) and the dense output are
/// computed once, and every selector and budget is scored against them; memory is O(context) per position.
///
/// Budget: K = max(1, round(budget * (P + 1))) tokens per (position, kv head), the fraction of the context at
/// the first decode position (P + 1 tokens), the same K at every position (so at most that fraction later).
/// K counts the window's tokens too: a selector entry splits K between its window and its selection.
///
/// The attended set of a row is the window's tokens and the selection. Scores per (position, query head), and
/// per row (layer, budget, selector) their mean and tails over the
/// evaluated positions and heads (p10 / p90: quantiles by linear interpolation between order statistics, as
/// numpy's default: x_sorted[h] interpolated at h = q * (n - 1)):
///   - mass recall: the exact softmax mass of the selected tokens (attention_mass_recall_per_head, fp64);
///   - output error: ||O_step - O_dense|| / ||O_dense|| of the head's output (head_dim values): O_step is the
///     decode step's own output (CPU kernel, fp32 accumulation and output), O_dense the fp64 reference's
///     (relative_l2_error_per_row);
/// and per (position, kv head), means only:
///   - id recall: the share of the oracle's top-K ids that the selection holds. The oracle ranks the tokens of
///     a kv head once per position by the largest softmax weight any query head of its GQA group gives them
///     (rounded to fp32; ties: the smaller index), exactly as OracleTopK does; its top-K is every token when
///     the context holds at most K;
///   - tokens selected, since a method may select fewer than K (Quest takes whole pages).

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kvsift/cpu/context.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

/// A selector made for a budget: the selector and the attention window it runs with.
struct SelectorSetup {
  AnySelector<half, cpu::Context> selector;
  AttentionWindow window{};
};

/// A selector by name, and how to make one for a budget in tokens (window included) and the capture's
/// limits. make() throws kvsift::Error when the method cannot run at that budget (e.g. Quest below one page);
/// the harness reports that instead.
struct SelectorEntry {
  std::string name;
  std::function<SelectorSetup(std::int32_t budget_tokens, const SelectorLimits& limits)> make;
};

/// OracleTopK (the upper bound; no window), StreamingLLM (the window alone: sink min(4, K), recent K - sink)
/// and Quest (pages of 16, no window): the references every retrieval selector is compared with.
std::vector<SelectorEntry> reference_selectors();

struct FidelityOptions {
  std::vector<double> budgets{0.01, 0.02, 0.05};  ///< fractions of the context at the first decode position
  std::int32_t decode_positions = 64;             ///< positions evaluated, spread over the decoded range
  double prefill = 0.5;                           ///< share of the capture's tokens before the first decode position
};

/// Scores of one (layer, budget, selector).
struct FidelityRow {
  std::int32_t layer = 0;           ///< the model's layer number (CaptureLayer::layer)
  std::string selector;
  double budget = 0.0;              ///< fraction of the context at the first decode position
  std::int32_t budget_tokens = 0;   ///< K
  std::string refused;              ///< why the selector could not run at this budget; empty when it ran
  double mass_recall = 0.0;         ///< over (evaluated position, query head): mean, 10th and 90th percentile
  double mass_recall_p10 = 0.0;
  double mass_recall_p90 = 0.0;
  double output_error = 0.0;        ///< over (evaluated position, query head): mean and 90th percentile
  double output_error_p90 = 0.0;
  double id_recall = 0.0;           ///< mean over (evaluated position, kv head)
  double mean_selected = 0.0;       ///< tokens selected per (evaluated position, kv head)
};

struct FidelityResult {
  std::int32_t first_position = 0;      ///< P: tokens [0, P) are the prefill
  std::vector<std::int32_t> positions;  ///< the evaluated decode positions, ascending
  std::vector<FidelityRow> rows;        ///< per capture layer (capture order), budget (options order), selector
};

/// Scores `selectors` on every layer of `capture` (definitions above). Throws kvsift::Error for an empty
/// capture, arrays that disagree with its shape, a budget outside (0, 1], a prefill share that leaves no
/// prefill or no decode position, or decode_positions outside [1, decoded positions].
FidelityResult evaluate_fidelity(const Capture& capture, std::span<const SelectorEntry> selectors,
                                 const FidelityOptions& options = {});

/// The rows as a markdown table: layer, selector, budget, K, mass recall (mean, p10, p90), output error
/// (mean, p90), id recall, tokens selected.
std::string fidelity_markdown(std::span<const FidelityRow> rows);

/// A line stating the decoded range, the evaluated positions and K's definition, then the table.
std::string fidelity_markdown(const FidelityResult& result);

}  // namespace kvsift
