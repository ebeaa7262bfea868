#pragma once
/// The attention-state math every backend shares (reference, CPU, CUDA): merging partial states
/// (O_i, LSE_i), LSE in natural log. An empty state (LSE = -inf) contributes weight exactly 0 and its O is
/// never used, so merging it changes nothing, bit for bit, even if its O holds garbage.
///
/// NaN never vanishes. Only LSE = -inf means empty: a state whose LSE is NaN is corrupted, and merging it
/// with anything gives NaN in O and LSE; a partial whose weight underflows to 0 still multiplies its O
/// (0 * NaN = NaN). Attention produces a NaN state when a logit is NaN or +inf (from a NaN in Q, K, a
/// log-weight or sm_scale, or an infinity that makes a logit +inf or NaN), as the fp64 reference does
/// (exp(inf - inf) is NaN); a NaN in the V of an attended token makes O NaN (even where its weight
/// underflows to 0) and leaves LSE as the logits give it. A token whose logit is -inf (a log-weight of
/// -inf masks it) is not attended and its V is unspecified input: a NaN there shows in O in one pass over
/// its row, but not when a split of the row holds only masked tokens (an empty partial, skipped by the
/// merge). A row whose every logit is -inf is empty: O = 0, LSE = -inf, whatever its V.

#include <cmath>
#include <limits>

#include "kvsift/core/config.hpp"

namespace kvsift {

/// Kernels keep logits in base 2 (exp2 is the fast instruction); these convert at the boundaries, where
/// LSE is always reported in natural log.
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

template <class Acc>
KVSIFT_HOST_DEVICE constexpr Acc negative_infinity() {
  return -std::numeric_limits<Acc>::infinity();
}

/// max(a, b) that returns NaN when either is NaN (std::max and fmaxf drop a NaN, which would let a
/// corrupted logit or state vanish from a softmax maximum). On the device this is one max.NaN instruction.
KVSIFT_HOST_DEVICE inline float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a ? a : (b != b || b > a) ? b : a;
#endif
}
KVSIFT_HOST_DEVICE inline double max_nan(double a, double b) { return a != a ? a : (b != b || b > a) ? b : a; }

/// Weight of a partial state with log-sum-exp `lse` relative to the running maximum `lse_max`
/// (unnormalized): exp(lse - lse_max), and exactly 0 for an empty state.
template <class Acc>
KVSIFT_HOST_DEVICE inline Acc state_weight(Acc lse, Acc lse_max) {
  using std::exp;
  return lse == negative_infinity<Acc>() ? Acc(0) : exp(lse - lse_max);
}

/// Log-sum-exp of a merged state from the maximum and the sum of unnormalized weights; -inf when empty.
template <class Acc>
KVSIFT_HOST_DEVICE inline Acc merged_lse(Acc lse_max, Acc weight_sum) {
  using std::log;
  return weight_sum == Acc(0) ? negative_infinity<Acc>() : lse_max + log(weight_sum);
}

}  // namespace kvsift
