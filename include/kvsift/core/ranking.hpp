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

/// A budget that follows the scores (top-p, as Twilight prunes): a row keeps the fewest of its best candidates
/// whose scores sum to at least `mass` of the row's total, at least `floor` and at most `maximum` (and the row's
/// candidate count). mass_budgets (cpu/topk.hpp, cuda/topk.hpp) writes it as topk_rows' row_k. The scores are the
/// rerank's (group-max softmax weights, in [0, 1]); the sums are taken in fixed point (mass_units below) so that
/// both backends find the same k bit for bit, whatever order they add in. The rule, per row of n = count
/// candidates (docs/selector_framework.md, "Rerank"):
///   u_i = mass_units(s_i), U = sum u_i, target = mass_target(mass, U),
///   k = the fewest of the largest u_i (the scores' order: ties do not change the sum) whose sum is >= target,
///   row_k = min(max(k, floor), maximum, n[, limits[row]]).
/// A row with a score outside [0, 1] (NaN, an infinity, a negative or a larger number) cannot be measured and
/// keeps min(maximum, n[, limits[row]]), as a fixed budget would. U = 0 (every score 0) gives k = 0, so floor.
struct MassBudget {
  double mass = 0;           ///< p, in (0, 1]
  std::int32_t floor = 1;    ///< in [1, maximum]
  std::int32_t maximum = 0;  ///< the selection's capacity, topk_rows' k
  /// Optional [rows]: each row's k is at most limits[row], in [0, maximum] (length_budgets' row_k: the smaller
  /// of the two budgets). In the backend's memory (device on CUDA). nullptr: no limit but maximum.
  const std::int32_t* limits = nullptr;
};

/// The fixed point of MassBudget: a score s in [0, 1] counts u = round(s * 2^40) (half up) units, exactly (s *
/// 2^40 is exact in double and below 2^41, so adding 1/2 is exact too). A row's sum is at most n * 2^40; n <=
/// kMassMaxCandidates = 2^23 keeps it below 2^63, so uint64 sums never wrap (the rerank's rows hold c x K, e.g.
/// 4 x 2048 = 8192 = 2^13 candidates, with sums below 2^53).
inline constexpr int kMassFractionBits = 40;
inline constexpr std::int32_t kMassMaxCandidates = std::int32_t(1) << 23;

/// Whether s can be measured: in [0, 1] (false for NaN).
KVSIFT_HOST_DEVICE inline bool mass_measurable(float s) { return s >= 0.0f && s <= 1.0f; }

/// The units of a measurable score s (mass_measurable): round(s * 2^40), half up.
KVSIFT_HOST_DEVICE inline std::uint64_t mass_units(float s) {
  return static_cast<std::uint64_t>(static_cast<double>(s) * 1099511627776.0 + 0.5);  // 2^40
}

/// The smallest integer >= mass * total, at most total: the product rounded once in double (IEEE, the same on
/// both backends: one multiplication, nothing to contract), then its ceiling by integer comparison.
KVSIFT_HOST_DEVICE inline std::uint64_t mass_target(double mass, std::uint64_t total) {
  const double product = mass * static_cast<double>(total);
  if (!(product < static_cast<double>(total))) return total;
  const std::uint64_t whole = static_cast<std::uint64_t>(product);  // product in [0, 2^63): truncation = floor
  return static_cast<double>(whole) < product ? whole + 1 : whole;
}

/// A row's budget from its k (the fewest best candidates that reach the target) and its upper bound
/// min(maximum, count[, limit]): max(k, floor), at most the bound.
KVSIFT_HOST_DEVICE inline std::int32_t mass_row_k(std::int32_t k, std::int32_t floor, std::int32_t upper) {
  const std::int32_t kept = k < floor ? floor : k;
  return kept < upper ? kept : upper;
}

/// The float bits of a measurable score (mass_measurable) with -0 as +0: ascending as the scores are, so the
/// radix selects of mass_budgets rank by them (the rank_word order, restricted to [0, 1]).
KVSIFT_HOST_DEVICE inline std::uint32_t mass_bits(float s) {
  std::uint32_t bits;
  std::memcpy(&bits, &s, sizeof(bits));
  return bits == 0x80000000u ? 0u : bits;
}

/// The digits of mass_budgets' radix select over mass_bits, most significant first: 11, 11 and 10 bits (a
/// measurable score's bits are below 2^30, so the first digit's top bit is always 0).
inline constexpr int kMassRadixPasses = 3;
KVSIFT_HOST_DEVICE inline int mass_digit_shift(int pass) { return pass == 0 ? 21 : pass == 1 ? 10 : 0; }
KVSIFT_HOST_DEVICE inline std::uint32_t mass_digit_mask(int pass) { return pass == 2 ? 0x3ffu : 0x7ffu; }
inline constexpr int kMassRadixBins = 2048;

/// The last step of the select: the threshold bin holds `count` candidates of one score, so of one unit value
/// mass / count each; `remaining` (in (0, mass]) more units take ceil(remaining / unit) of them.
KVSIFT_HOST_DEVICE inline std::int32_t mass_equal_picks(std::uint64_t remaining, std::uint64_t mass,
                                                        std::int32_t count) {
  const std::uint64_t unit = mass / static_cast<std::uint64_t>(count);
  return static_cast<std::int32_t>((remaining + unit - 1) / unit);
}

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
  /// Optional [out.batch * out.kv_heads]: a guess at each selection row's k-th best score (each of its score
  /// rows'), e.g. the previous decode step's (selections persist between steps, and so roughly does the score
  /// at their edge). Any value, NaN and infinities included, gives the same selection; a close guess makes rows
  /// of up to 16 x 16,384 scores cheaper on CUDA (the candidates are then the scores at or above it: no
  /// cluster-wide histogram pass; docs/primitives.md#seeded-top-k). The CPU does not read it. In the backend's
  /// memory.
  const float* seed = nullptr;
  /// Optional [selection rows, ids_stride]: each selection row's table of ids (a rerank's candidate token ids): its
  /// picks are written as ids[row * ids_stride + position] in place of their positions, in the positions'
  /// ascending order: topk_rows then remap_selection in one call (on CUDA no remap launch). Every position is
  /// below the row's length, so ids_stride >= max_tokens covers it. Refused: a table that overlaps out.indices,
  /// heads_per_row > 1. In the backend's memory.
  const std::int32_t* ids = nullptr;
  std::int64_t ids_stride = 0;
};

}  // namespace kvsift
