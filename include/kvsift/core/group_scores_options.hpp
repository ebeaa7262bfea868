#pragma once
/// Options of group_scores (cpu/primitives.hpp, cuda/primitives.hpp): backend-neutral, like TopKRowsOptions
/// (core/ranking.hpp), so that a CUDA call's argument-dependent lookup never reaches into kvsift::cpu.

#include <cstdint>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

/// How group_scores reduces a token's scores over the query heads of a GQA group.
enum class GroupReduce : std::uint8_t { max, sum };

struct GroupScoreOptions {
  /// Logit scale applied to q.k; 0 selects the default 1/sqrt(head_dim) (as AttentionOptions::sm_scale).
  float sm_scale = 0.0f;
  GroupReduce reduce = GroupReduce::max;
  /// Reduce each head's softmax weight exp(s - LSE_h) (LSE_h over that head's whole row) instead of the raw
  /// logit s. softmax + max is OracleTopK's score: the largest softmax weight any head of the group gives.
  bool softmax = false;
  /// 0: each (sequence, kv head) row's whole group reduces into one score row. Else (softmax only) its
  /// group / heads_per_row consecutive sets of heads_per_row query heads reduce into one score row each, row
  /// (b * kv_heads + g) * sets + s: CTKVR's prepare scores many centroids' query heads against one key read.
  std::int32_t heads_per_row = 0;

  /// Score rows per (sequence, kv head) row for a group of `group` query heads.
  constexpr std::int32_t score_rows_per_row(std::int32_t group) const {
    return heads_per_row > 0 ? group / heads_per_row : 1;
  }
};

}  // namespace kvsift
