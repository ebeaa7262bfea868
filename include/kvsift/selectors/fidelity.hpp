#pragma once
/// Fidelity of selectors on real attention: replays the last decode positions of a capture (each position's
/// query attends to every token before it) through any set of selectors at budgets given as fractions of
/// the context, and scores each selection against exact attention:
///   - id recall: the share of OracleTopK's top-K token ids (K = the budget) that the selection holds,
///   - mass recall: the exact softmax mass the selected tokens carry (attention_mass_recall),
///   - output error: ||O_selected - O_dense|| / ||O_dense|| over all query heads, log-weights applied.
/// Every selector goes through its own life cycle: prepare() on the tokens before the first decode
/// position (with their queries), then select() and append() per position.

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kvsift/core/capture.hpp"
#include "kvsift/core/selector.hpp"

namespace kvsift {

/// A selector by name, and how to make one for a budget in tokens. make() throws kvsift::Error when the
/// method cannot run at that budget (e.g. Quest below one page); the harness reports that instead.
struct SelectorEntry {
  std::string name;
  std::function<AnySelector<float>(std::int32_t budget_tokens)> make;
};

/// OracleTopK (the upper bound), StreamingLLM (sink 4 + recent) and Quest (pages of 16): the references
/// every retrieval selector is compared with.
std::vector<SelectorEntry> reference_selectors();

struct FidelityOptions {
  std::vector<double> budgets{0.01, 0.02, 0.05};  ///< fractions of the context at the first decode position
  std::int32_t decode_positions = 64;             ///< the capture's last tokens, decoded one at a time
};

struct FidelityRow {
  std::string selector;
  double budget = 0.0;              ///< fraction of the context
  std::int32_t budget_tokens = 0;   ///< K
  std::string refused;              ///< why the selector could not run at this budget; empty when it ran
  double id_recall = 0.0;           ///< means over layers, decode positions and heads
  double mass_recall = 0.0;
  double output_error = 0.0;
  double mean_selected = 0.0;       ///< tokens selected per (position, kv head)
};

/// One row per (selector, budget), in the order of `selectors` within each budget.
std::vector<FidelityRow> evaluate_fidelity(const Capture& capture, std::span<const SelectorEntry> selectors,
                                           const FidelityOptions& options = {});

/// The rows as a markdown table (selector, budget, K, id recall, mass recall, output error, selected).
std::string fidelity_markdown(std::span<const FidelityRow> rows);

}  // namespace kvsift
