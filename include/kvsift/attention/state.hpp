#pragma once
/// The attention-state math every backend shares (reference, CPU, CUDA): merging partial states
/// (O_i, LSE_i), LSE in natural log. An empty state (LSE = -inf) contributes weight exactly 0 and its O is
/// never used, so merging it changes nothing, bit for bit, even if its O holds garbage.

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
