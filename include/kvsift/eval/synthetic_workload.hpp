#pragma once
/// A generator of long-context decode workloads shaped like real attention rather than iid noise, for the
/// demo, tests and benchmarks. Per (sequence, kv head), in pre-RoPE space:
///   - keys share a bias with a few dominant low-frequency channels (the outlier channels of real keys);
///   - tokens come in runs of one "topic" (a cluster centre), so keys and values are clustered;
///   - queries drift slowly (a normalized random walk) and favour a few topics, so neighbouring queries are
///     similar and attention is concentrated but not trivial;
///   - the first sink_tokens keys align with every query on the dominant channels (attention sinks);
///   - `needles` keys at random middle positions are planted post-RoPE along the decode query of their kv
///     group, so they are the strongest non-sink tokens that the decode query must find.
/// RoPE (configurable) is then applied; pre-RoPE keys and queries are kept for methods that need them.
/// Deterministic for a given config (seed included) on one standard library.

#include <cstdint>
#include <vector>

#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

struct SyntheticWorkloadConfig {
  std::int32_t tokens = 8192;
  std::int32_t batch = 1;
  std::int32_t q_heads = 8;
  std::int32_t kv_heads = 2;
  std::int32_t head_dim = 128;
  std::uint64_t seed = 1;
  RopeConfig rope{.theta = 500000.0};
  std::int32_t sink_tokens = 4;
  std::int32_t needles = 4;
  std::int32_t topics = 256;
  float topic_persistence = 0.98f;  ///< probability that the next token keeps the current topic
  std::int32_t focus_topics = 3;    ///< topics the decode query favours
  bool prefill_queries = false;     ///< also generate the query of every prefill position
};

struct SyntheticWorkload {
  SyntheticWorkloadConfig config;
  std::vector<float> k;                    ///< post-RoPE keys [batch, kv_heads, tokens, head_dim]
  std::vector<float> k_pre_rope;           ///< same shape, before RoPE
  std::vector<float> v;                    ///< [batch, kv_heads, tokens, head_dim]
  std::vector<float> q;                    ///< decode query at position `tokens`, post-RoPE [batch, q_heads, head_dim]
  std::vector<float> q_pre_rope;           ///< same, before RoPE
  std::vector<float> prefill_q;            ///< post-RoPE [batch, q_heads, tokens, head_dim] if requested, else empty
  std::vector<std::int32_t> needle_positions;  ///< [batch, kv_heads, needles]

  ContiguousKVView<const float> kv() const {
    return ContiguousKVView<const float>::packed(k.data(), v.data(), config.batch, config.kv_heads, config.tokens,
                                                 config.head_dim);
  }
  QueryView<const float> query() const {
    return QueryView<const float>::packed(q.data(), config.batch, config.q_heads, config.head_dim);
  }
  SequenceView<const float> prefill_query() const {
    return SequenceView<const float>::packed(prefill_q.data(), config.batch, config.q_heads, config.tokens,
                                             config.head_dim);
  }
};

SyntheticWorkload make_synthetic_workload(const SyntheticWorkloadConfig& config);

}  // namespace kvsift
