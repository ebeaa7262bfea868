#pragma once
// A one-sequence CTKVR problem (an fp16 cache with room for decode steps, prefill queries) and the fp64 reference
// of its rerank, shared by the CPU and CUDA CTKVR tests.
#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

#include "kvsift/selectors/selector.hpp"
#include "kvsift/step/decode_step.hpp"
#include "test_util.hpp"

namespace kvsift::test {

inline constexpr AttentionWindow kCtkvrWindow{.sink = 4, .recent = 4};

/// One sequence in a contiguous fp16 cache with `capacity` tokens, `prompt` of them filled, and W prefill queries.
struct CtkvrProblem {
  std::int32_t q_heads, kv_heads, head_dim, capacity, prompt, queries;
  std::vector<half> k, v, prefill_q;
  std::int32_t length;
  std::int32_t slot = 0;

  CtkvrProblem(Random& rng, std::int32_t q_heads_, std::int32_t kv_heads_, std::int32_t prompt_, std::int32_t queries_,
               std::int32_t head_dim_ = 32)
      : q_heads(q_heads_), kv_heads(kv_heads_), head_dim(head_dim_), capacity(prompt_ + 16), prompt(prompt_),
        queries(queries_), length(prompt_) {
    k = test::to_storage<half>(rng.normal(std::size_t(kv_heads) * capacity * head_dim));
    v = test::to_storage<half>(rng.normal(std::size_t(kv_heads) * capacity * head_dim));
    prefill_q = test::to_storage<half>(rng.normal(std::size_t(q_heads) * queries * head_dim));
  }
  KVCache<half> cache() {
    return ContiguousKVView<half>::packed(k.data(), v.data(), 1, kv_heads, capacity, head_dim, &length);
  }
  SelectorLimits limits() const { return {.max_slots = 1, .max_tokens = capacity, .q_heads = q_heads, .kv_heads = kv_heads, .head_dim = head_dim}; }
  DecodeStepConfig config() const {
    return {.attention = {.window = kCtkvrWindow}, .max_batch = 1, .q_heads = q_heads, .kv_heads = kv_heads,
            .head_dim = head_dim, .max_seq_len = capacity};
  }
  PrefillInputs<half> prefill() {
    return {.cache = cache(), .slots = &slot,
            .queries = SequenceView<const half>::packed(prefill_q.data(), 1, q_heads, queries, head_dim)};
  }
  std::int32_t middle() const { return kCtkvrWindow.recent_begin(prompt) - kCtkvrWindow.sink_end(prompt); }
};

/// fp64: per middle token of kv head g, the largest softmax weight over the middle that a head of g gives it.
inline std::map<std::int32_t, double> middle_softmax(const CtkvrProblem& p, const std::vector<half>& q, std::int32_t g) {
  const std::int32_t group = p.q_heads / p.kv_heads, lo = kCtkvrWindow.sink_end(p.length), hi = kCtkvrWindow.recent_begin(p.length);
  std::map<std::int32_t, double> best;
  for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
    std::vector<double> logits;
    for (std::int32_t t = lo; t < hi; ++t) {
      double dot = 0;
      for (std::int32_t i = 0; i < p.head_dim; ++i) {
        dot += double(to_float(q[std::size_t(h) * p.head_dim + i])) *
               to_float(p.k[(std::size_t(g) * p.capacity + t) * p.head_dim + i]);
      }
      logits.push_back(dot / std::sqrt(double(p.head_dim)));
    }
    const double top = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double l : logits) sum += std::exp(l - top);
    for (std::int32_t t = lo; t < hi; ++t) best[t] = std::max(best[t], std::exp(logits[t - lo] - top) / sum);
  }
  return best;
}

}  // namespace kvsift::test
