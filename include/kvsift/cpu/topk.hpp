#pragma once
/// CPU top-K selection shared by every selector.
///
/// Order and ties: the K largest scores win; on equal scores the smaller index wins; NaN ranks below every
/// number. Output indices are written in ascending index order, so CPU and CUDA results compare exactly.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "kvsift/core/error.hpp"

namespace kvsift::cpu {

/// True when score a at index ia ranks before score b at index ib under kvsift's one tie rule.
inline bool ranks_before(float a, std::int32_t ia, float b, std::int32_t ib) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

/// Writes into out[0, k) the indices of the k best of `scores`, ascending. `scratch` is reused between
/// calls to avoid allocation (it grows to scores.size()).
inline void topk_indices(std::span<const float> scores, std::int32_t k, std::span<std::int32_t> out,
                         std::vector<std::int32_t>& scratch) {
  constexpr const char* where = "cpu::topk_indices";
  KVSIFT_CHECK(k >= 0 && static_cast<std::size_t>(k) <= scores.size(), where,
               "k (= {}) is outside [0, number of scores = {}]", k, scores.size());
  KVSIFT_CHECK(out.size() >= static_cast<std::size_t>(k), where, "out.size() (= {}) < k (= {})", out.size(), k);
  scratch.resize(scores.size());
  std::iota(scratch.begin(), scratch.end(), 0);
  const auto better = [&](std::int32_t a, std::int32_t b) { return ranks_before(scores[a], a, scores[b], b); };
  std::nth_element(scratch.begin(), scratch.begin() + k, scratch.end(), better);
  std::sort(scratch.begin(), scratch.begin() + k);
  std::copy_n(scratch.begin(), k, out.begin());
}

}  // namespace kvsift::cpu
