#pragma once
/// kvsift's one ranking rule, shared by every top-K (CPU and CUDA, host and device code): higher score first;
/// on equal scores the smaller index first; NaN ranks above every number (+inf included); -0 and +0 are one
/// score. NaN first so that it never vanishes: a token whose score is NaN (a NaN key, or a NaN query's) is
/// selected, and the attention over it is NaN, as dense attention would be; ranked last it would be dropped and
/// the step's output would look finite. And the options of the per-row top-K into a selection (cpu::topk_rows, cuda::topk_rows).

#include <cstdint>
#include <cstring>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/config.hpp"

namespace kvsift {

/// The score half of rank_key: ascending order of the word is NaN first, then higher score first. Integer
/// operations only (no branch on the sign, which random scores would mispredict half the time).
KVSIFT_HOST_DEVICE inline std::uint32_t rank_word(float score) {
  std::uint32_t bits;
  std::memcpy(&bits, &score, sizeof(bits));
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  bits = magnitude == 0 ? 0u : bits;  // -0 and +0 are equal scores
  // Ascending float order as unsigned integers: negative numbers flip every bit, the others the sign bit.
  const std::uint32_t ascending = bits ^ (std::uint32_t(std::int32_t(bits) >> 31) | 0x80000000u);
  return magnitude > 0x7f800000u ? 0u : ~ascending;  // NaN first (no number's word is 0: +inf's is 0x007fffff)
}

/// A score and its index packed into one integer whose ascending order is the ranking rule.
KVSIFT_HOST_DEVICE inline std::uint64_t rank_key(float score, std::int32_t index) {
  return (std::uint64_t(rank_word(score)) << 32) | std::uint32_t(index);
}

/// A budget that follows the context: a sequence of `length` tokens (the step's own included) gets
/// clamp(floor(fraction * length) - reserved, minimum, maximum) tokens. CTKVR's "dynamic 4%" and A²ATS's 0.03 * len;
/// length_budgets (cpu/topk.hpp, cuda/topk.hpp) writes it as topk_rows' row_k. One formula for host and device
/// code, in double, so both backends round alike.
struct LengthBudget {
  double fraction = 0;       ///< in (0, 1]
  std::int32_t minimum = 0;  ///< in [0, maximum]
  std::int32_t maximum = 0;  ///< the selection's capacity, topk_rows' k
  /// Tokens of the budget spent elsewhere (CSAttention counts its attention window inside K = rho * length).
  std::int32_t reserved = 0;

  KVSIFT_HOST_DEVICE std::int32_t operator()(std::int32_t length) const {
    const double k =
        static_cast<double>(static_cast<std::int64_t>(fraction * static_cast<double>(length)) - reserved);
    return k < minimum ? minimum : k > maximum ? maximum : static_cast<std::int32_t>(k);
  }
};

/// Options of topk_rows (cpu/topk.hpp, cuda/topk.hpp); the defaults give one score row per selection row,
/// every row the same k and no window.
struct TopKRowsOptions {
  /// Its tokens are not candidates: sparse decode attends them anyway (attention/options.hpp).
  AttentionWindow window{};
  /// Optional [out.batch * out.kv_heads]: selection row s's own k, in [0, k] (a per-row budget computed on
  /// the device, A²ATS's 0.03 * len); nullptr: every row takes k. In the backend's memory (device on CUDA).
  const std::int32_t* row_k = nullptr;
  /// Score rows per selection row (a GQA group of query heads): each score row takes its own top-k, and
  /// the selection row gets their union (distinct, ascending), so out.capacity >= heads_per_row * k.
  std::int32_t heads_per_row = 1;
  /// A selection row any of whose candidates scores NaN gets count -1, which sparse decode turns into NaN O and
  /// LSE for its query heads (core/views.hpp SelectionView::counts), as dense attention over a NaN score would
  /// give. For scores that are softmax weights (OracleTopK, SpeContext): one NaN logit makes its head's every
  /// weight NaN, so ranking NaN first (above) can no longer single the bad token out, and a NaN query would
  /// otherwise select the row's first tokens and attend them as if nothing had happened. A row with k_s = 0
  /// reads nothing and keeps count 0. Requires heads_per_row == 1.
  bool nan_marks_row = false;
};

}  // namespace kvsift
