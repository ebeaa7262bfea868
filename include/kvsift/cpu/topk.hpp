#pragma once
/// CPU top-K selection shared by every selector.
///
/// Order and ties: the K largest scores win; on equal scores the smaller index wins; NaN ranks below every
/// number. Output indices are written in ascending index order, so CPU and CUDA results compare exactly.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <climits>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "kvsift/core/error.hpp"

namespace kvsift::cpu {

/// Packs a score and its index into one integer whose ascending order is kvsift's ranking: higher score
/// first, NaN last, and on equal scores the smaller index first.
inline std::uint64_t rank_key(float score, std::int32_t index) {
  std::uint32_t bits;
  std::memcpy(&bits, &score, sizeof(bits));
  if (score == 0.0f) bits = 0;  // -0 and +0 are equal scores
  const std::uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  const std::uint32_t descending = std::isnan(score) ? 0xffffffffu : ~ascending;
  return (std::uint64_t(descending) << 32) | std::uint32_t(index);
}

/// Writes into out[0, k) the indices of the k best of `scores`, ascending. `scratch` is reused between
/// calls to avoid allocation (it grows to scores.size()).
inline void topk_indices(std::span<const float> scores, std::int32_t k, std::span<std::int32_t> out,
                         std::vector<std::uint64_t>& scratch) {
  constexpr const char* where = "cpu::topk_indices";
  KVSIFT_CHECK(k >= 0 && static_cast<std::size_t>(k) <= scores.size(), where,
               "k (= {}) is outside [0, number of scores = {}]", k, scores.size());
  KVSIFT_CHECK(out.size() >= static_cast<std::size_t>(k), where, "out.size() (= {}) < k (= {})", out.size(), k);
  KVSIFT_CHECK(scores.size() <= std::size_t(INT32_MAX), where, "number of scores (= {}) exceeds 2^31 - 1",
               scores.size());
  scratch.resize(scores.size());
  for (std::size_t i = 0; i < scores.size(); ++i) scratch[i] = rank_key(scores[i], std::int32_t(i));
  std::nth_element(scratch.begin(), scratch.begin() + k, scratch.end());
  for (std::int32_t i = 0; i < k; ++i) out[i] = std::int32_t(scratch[i] & 0xffffffffu);
  std::sort(out.begin(), out.begin() + k);
}

}  // namespace kvsift::cpu
