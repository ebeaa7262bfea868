#pragma once
/// Launch planning of CUDA decode attention (host only): how many CTAs split each (sequence, kv head) row and
/// how many warps a CTA has, from the shape, the options and the GPU's limits. Kept apart from the launch so
/// that the rules can be tested against any GPU's limits, on machines without one.

#include <array>
#include <cstddef>
#include <cstdint>

#include "kvsift/cuda/decode.hpp"

namespace kvsift::cuda::detail {

/// [s]: how many clusters of s decode CTAs (the largest: eight warps at head_dim 128, one per SM) the GPU holds at
/// once, s = 2 .. kClusterMergeMaxSplits; all 0 where the decode kernels' sm_90 code does not run (no clusters).
using DecodeClusterCapacity = std::array<int, kClusterMergeMaxSplits + 1>;

/// What planning needs to know of a GPU.
struct DeviceLimits {
  int multiprocessors = 0;
  std::size_t shared_memory_per_block = 0;  ///< the most dynamic shared memory a block may opt in to
  DecodeClusterCapacity clusters{};         ///< SplitMerge::cluster's placements
};
/// The current device's limits (each queried once per device, then cached).
DeviceLimits current_device_limits();

struct DecodePlan {
  std::int32_t num_splits = 1;  ///< CTAs along the tokens of each row
  std::int32_t cta_warps = 4;   ///< warps per CTA
  bool cluster_merge = false;   ///< num_splits > 1 and the row's CTAs merge in their cluster (SplitMerge::cluster)
};

/// Throws kvsift::Error for options no GPU accepts (negative num_splits, a warp count other than 0, 4, 8, an unknown
/// split_merge, split_merge cluster with more than kClusterMergeMaxSplits splits).
void check_decode_options(const char* where, const DecodeOptions& options);

/// rows: CTAs along batch x kv heads x GQA tiles; max_tokens: the most tokens (or selection entries) a row
/// may have. Throws kvsift::Error when the options cannot run on a GPU with these limits.
DecodePlan plan_decode(const char* where, std::int64_t rows, std::int32_t max_tokens, int head_dim,
                       const DecodeOptions& options, const DeviceLimits& limits);

}  // namespace kvsift::cuda::detail
