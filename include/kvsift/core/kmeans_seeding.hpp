#pragma once
/// The random draws of k-means++ seeding, shared by cpu::kmeans_batched and cuda::kmeans_batched. Each draw is a pure function
/// of (seed, centroid, trial), computed alike on the host and the device, so both backends draw the same
/// candidates from the same seed: they then choose the same centroids unless two candidates' potentials, or a
/// draw and a running sum, tie within the rounding of their different summation orders.

#include <cmath>
#include <cstdint>

#include "kvsift/core/config.hpp"

namespace kvsift::detail {

/// SplitMix64's output function: a bijection of 64-bit words whose outputs pass BigCrush for counter inputs.
KVSIFT_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// Draw `trial` for centroid `centroid`: independent 64-bit words for distinct (seed, centroid, trial).
KVSIFT_HOST_DEVICE constexpr std::uint64_t kmeans_draw(std::uint64_t seed, std::uint32_t centroid, std::uint32_t trial) {
  return mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ ((std::uint64_t(centroid) << 32) | trial));
}

/// The first centroid: a point drawn uniformly (the modulo bias is below n / 2^64).
KVSIFT_HOST_DEVICE constexpr std::int64_t kmeans_first_point(std::uint64_t seed, std::int64_t points) {
  return std::int64_t(kmeans_draw(seed, 0, 0) % std::uint64_t(points));
}

/// A target uniform in [0, total): candidate `trial` for centroid `centroid` >= 1 is the first point whose
/// inclusive prefix sum of distances to the nearest centroid exceeds it.
KVSIFT_HOST_DEVICE constexpr double kmeans_draw_target(std::uint64_t seed, std::uint32_t centroid, std::uint32_t trial,
                                                       double total) {
  return double(kmeans_draw(seed, centroid, trial) >> 11) * 0x1.0p-53 * total;
}

/// Candidates per centroid of greedy k-means++ (as scikit-learn): 2 + ln k.
inline int kmeans_candidates_per_step(std::int32_t clusters) { return 2 + int(std::log(double(clusters))); }

}  // namespace kvsift::detail
