#pragma once
/// A budget of K tokens per (sequence, kv head) that holds the attention window too, split into the window and the
/// selection: the rule kvsift_fidelity's entries use (eval/fidelity.hpp), stated once so that every comparison at
/// "K tokens" spends them alike.

#include <algorithm>
#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"

namespace kvsift {

struct BudgetSplit {
  AttentionWindow window;   ///< the step's window
  std::int32_t selection;   ///< the tokens left to the selector: K - window.sink - window.recent
};

/// The preferred window, shrunk to at most K / 8 sink and K / 4 recent tokens, and the rest of K for the selection:
/// at least 5/8 of K at any K, so a small budget never leaves a selector without room to choose, and at a large K
/// the window is the preferred one (e.g. {4, 64} from K = 256 on). Refused: K < 1, a negative preferred size.
inline BudgetSplit split_budget(std::int32_t k, const AttentionWindow& preferred) {
  constexpr const char* where = "split_budget";
  KVSIFT_CHECK(k >= 1, where, "k (= {}) must be >= 1", k);
  validate(preferred, where, "preferred");
  const AttentionWindow window{std::min(preferred.sink, k / 8), std::min(preferred.recent, k / 4)};
  return {window, k - window.sink - window.recent};
}

}  // namespace kvsift
