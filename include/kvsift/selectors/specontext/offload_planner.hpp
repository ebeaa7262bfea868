#pragma once
/// SpeContext's memory planner (paper §6, equations 6-8, algorithms 1 and 2): which layers' KV cache must leave
/// the GPU for host memory as a sequence grows. Pure functions of a params struct; the engine calls
/// sequence_thresholds once (algorithm 1, "in compilation") and plan_offload at every length (algorithm 2).
///
/// The model of GPU memory, in bytes (Table 1's symbols):
///   runtime = ceil((100 + runtime_percent) / 100 * (M_O + M_D))   weights plus runtime buffers: the paper's
///                                                    factor 1.3 is runtime_percent = 30 (exact integer arithmetic)
///   c       = 2 * bytes_per_element * R * H * D      one token's K and V in one layer for all R requests: the
///                                                    paper's coefficient "4" is 2 (K, V) x 2 bytes (FP16)
///   K       = L + head_layers + alpha                the layers holding S tokens: the model's L, the retrieval
///                                                    head's own cache (the "+1") and the GQA repeat_kv buffer,
///                                                    alpha layers' worth (S x alpha*H x D)
///   eq. 6:  M_all(S)     = runtime + c * K * S
///   eq. 7:  M_part(S, n) = runtime + c * [(K - n) * S + n * B]
///                          n = L_CPU layers offloaded, each keeping a GPU buffer of B selected tokens
///   eq. 8:  maximise L_GPU = L - n subject to M_part(S, n) <= Mem_GPU.
///
/// Algorithm 1: S_n^T = floor((Mem_GPU - runtime - n * b) / (c * (K - n))), n = 0..L, with b the GPU buffer of an
/// offloaded layer: b = c * B, exactly eq. 7 (the default). As printed, line 3 subtracts (n * B) * R * H * D, without
/// the "4" it applies in the denominator and in eq. 7, i.e. b = B * R * H * D: those thresholds overstate what fits
/// by (c / (R H D) - 1) * n * B * R * H * D bytes (3 n B R H D at 2 bytes per element), so a plan made with them can
/// exceed Mem_GPU (literal_algorithm1).
/// Algorithm 2: with n layers offloaded, S fits while S < S_n^T; the plan offloads the fewest layers n with
/// S < S_n^T, the last layers first (layers L - n .. L - 1 live in host memory). Since S < S_n^T <=
/// the real quotient, M_part(S, n) < Mem_GPU strictly (eq. 6's "<"); the floor makes the plan offload one layer
/// early by at most one token relative to eq. 8's "<=". A stateful engine that only ever offloads gets the same
/// n from the stateless plan, because the thresholds are nondecreasing and S only grows.
///
/// The planner's buffer and ElasticKV's (selectors/specontext/elastic_kv.hpp) differ: the planner counts an offloaded layer's GPU
/// buffer as R requests x B tokens (c * B), ElasticKV allocates B + 1 slots (the selection and the step's token)
/// for each of max_slots sequences, plus, once for all offloaded layers, its resident state (two int32 per slot and
/// kv head: 8 / (2 * bytes_per_element * D) of one layer's buffer, 1.6% at D 128 and 2 bytes). To plan for
/// ElasticKV, pass requests = max_slots and budget = B + 1: every term then counts max_slots sequences (the S-token
/// layers too: exact when every slot is live, an over-count otherwise); the state is not counted.
///
/// Monotone thresholds: S_n^T (before the floor) is nondecreasing in n iff Mem_GPU - runtime >= b * K, i.e. (by
/// default) iff the memory left for KV holds at least B tokens in all K layers. Otherwise offloading a layer costs
/// more (its B-token buffer) than it frees (its S < B tokens), and sequence_thresholds refuses the budget.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvsift/core/error.hpp"

namespace kvsift {

/// Every input of the model above; sizes in bytes, counts as in Table 1.
struct OffloadPlannerParams {
  std::int64_t gpu_bytes = 0;          ///< Mem_GPU
  std::int64_t model_bytes = 0;        ///< M_O: the LLM's weights
  std::int64_t head_bytes = 0;         ///< M_D: the retrieval head's weights (0 for a head made of the LLM's own)
  std::int32_t runtime_percent = 30;   ///< runtime buffers as a share of the weights: factor 1.3 = 1 + 30%
  std::int32_t layers = 0;             ///< L
  std::int32_t kv_heads = 0;           ///< H
  std::int32_t head_dim = 0;           ///< D
  std::int32_t group = 0;              ///< alpha = q_heads / kv_heads (the repeat_kv buffer's layers)
  std::int32_t requests = 1;           ///< R
  std::int32_t budget = 2048;          ///< B: tokens per offloaded layer's GPU buffer
  std::int32_t bytes_per_element = 2;  ///< of K and V (2: FP16/BF16)
  std::int32_t head_layers = 1;        ///< the retrieval head's KV layers (the "+1")
  bool literal_algorithm1 = false;     ///< algorithm 1's line 3 as printed (b = B*R*H*D); see above
};

/// Layers [first_offloaded, layers) hold their KV in host memory, the last layers first.
struct OffloadPlan {
  std::int32_t offloaded = 0;        ///< L_CPU
  std::int32_t first_offloaded = 0;  ///< L - L_CPU (= layers when none is offloaded)
};

namespace detail {

inline std::int64_t planner_mul(std::int64_t a, std::int64_t b, const char* where) {
  std::int64_t out = 0;
  KVSIFT_CHECK(!__builtin_mul_overflow(a, b, &out), where, "byte count {} * {} overflows int64", a, b);
  return out;
}
inline std::int64_t planner_add(std::int64_t a, std::int64_t b, const char* where) {
  std::int64_t out = 0;
  KVSIFT_CHECK(!__builtin_add_overflow(a, b, &out), where, "byte count {} + {} overflows int64", a, b);
  return out;
}

inline void check_planner_params(const OffloadPlannerParams& p, const char* where) {
  KVSIFT_CHECK(p.gpu_bytes > 0, where, "params.gpu_bytes (= {}) must be positive", p.gpu_bytes);
  KVSIFT_CHECK(p.model_bytes > 0, where, "params.model_bytes (= {}) must be positive", p.model_bytes);
  KVSIFT_CHECK(p.head_bytes >= 0, where, "params.head_bytes (= {}) must not be negative", p.head_bytes);
  KVSIFT_CHECK(p.runtime_percent >= 0, where, "params.runtime_percent (= {}) must not be negative",
               p.runtime_percent);
  KVSIFT_CHECK(p.layers > 0, where, "params.layers (= {}) must be positive", p.layers);
  KVSIFT_CHECK(p.kv_heads > 0, where, "params.kv_heads (= {}) must be positive", p.kv_heads);
  KVSIFT_CHECK(p.head_dim > 0, where, "params.head_dim (= {}) must be positive", p.head_dim);
  KVSIFT_CHECK(p.group > 0, where, "params.group (= {}) must be positive", p.group);
  KVSIFT_CHECK(p.requests > 0, where, "params.requests (= {}) must be positive", p.requests);
  KVSIFT_CHECK(p.budget > 0, where, "params.budget (= {}) must be positive", p.budget);
  KVSIFT_CHECK(p.bytes_per_element > 0, where, "params.bytes_per_element (= {}) must be positive",
               p.bytes_per_element);
  KVSIFT_CHECK(p.head_layers >= 0, where, "params.head_layers (= {}) must not be negative", p.head_layers);
  planner_add(p.model_bytes, p.head_bytes, where);
}

}  // namespace detail

/// The weights plus runtime buffers, ceil((100 + runtime_percent) * (M_O + M_D) / 100) bytes (rounded up: never
/// understated).
inline std::int64_t planner_runtime_bytes(const OffloadPlannerParams& p) {
  constexpr const char* where = "planner_runtime_bytes";
  detail::check_planner_params(p, where);
  const std::int64_t weights = p.model_bytes + p.head_bytes;
  // weights * percent / 100 rounded up, without forming weights * percent: weights = 100 q + r.
  const std::int64_t extra = detail::planner_add(detail::planner_mul(weights / 100, p.runtime_percent, where),
                                                 (weights % 100 * p.runtime_percent + 99) / 100, where);
  return detail::planner_add(weights, extra, where);
}

/// c = 2 * bytes_per_element * R * H * D: one token's K and V in one layer for all requests (the paper's "4RHD").
inline std::int64_t planner_token_bytes(const OffloadPlannerParams& p) {
  constexpr const char* where = "planner_token_bytes";
  detail::check_planner_params(p, where);
  std::int64_t c = 2 * std::int64_t(p.bytes_per_element);
  for (const std::int64_t f : {std::int64_t(p.requests), std::int64_t(p.kv_heads), std::int64_t(p.head_dim)}) {
    c = detail::planner_mul(c, f, where);
  }
  return c;
}

/// K = L + head_layers + alpha: the layers whose KV grows with S when nothing is offloaded.
inline std::int64_t planner_sequence_layers(const OffloadPlannerParams& p) {
  detail::check_planner_params(p, "planner_sequence_layers");
  return std::int64_t(p.layers) + p.head_layers + p.group;
}

/// Equation 7 (equation 6 at offloaded = 0): GPU bytes at `seq_len` tokens with the last `offloaded` layers in
/// host memory, each keeping a GPU buffer of B tokens. Always the equation, whatever literal_algorithm1 says.
inline std::int64_t planner_memory_bytes(const OffloadPlannerParams& p, std::int64_t seq_len, std::int32_t offloaded) {
  constexpr const char* where = "planner_memory_bytes";
  detail::check_planner_params(p, where);
  KVSIFT_CHECK(seq_len >= 0, where, "seq_len (= {}) must not be negative", seq_len);
  KVSIFT_CHECK(offloaded >= 0 && offloaded <= p.layers, where, "offloaded (= {}) is outside [0, layers = {}]",
               offloaded, p.layers);
  const std::int64_t c = planner_token_bytes(p);
  const std::int64_t tokens = detail::planner_add(detail::planner_mul(planner_sequence_layers(p) - offloaded, seq_len, where),
                                                  detail::planner_mul(offloaded, p.budget, where), where);
  return detail::planner_add(planner_runtime_bytes(p), detail::planner_mul(c, tokens, where), where);
}

/// Algorithm 1: S^T = [S_0^T, ..., S_L^T]; with n layers offloaded a sequence fits while S < S_n^T. Nondecreasing.
/// Throws kvsift::Error for bad params, when the weights and runtime leave no memory for KV, and when the memory
/// left would hold fewer than B tokens in all K layers (the thresholds would decrease: offloading cannot help).
inline std::vector<std::int64_t> sequence_thresholds(const OffloadPlannerParams& p) {
  constexpr const char* where = "sequence_thresholds";
  detail::check_planner_params(p, where);
  const std::int64_t runtime = planner_runtime_bytes(p);
  KVSIFT_CHECK(runtime < p.gpu_bytes, where,
               "weights and runtime ({} bytes: {} + {} plus {}%) leave no memory for KV on a GPU of {} bytes",
               runtime, p.model_bytes, p.head_bytes, p.runtime_percent, p.gpu_bytes);
  const std::int64_t free = p.gpu_bytes - runtime;
  const std::int64_t c = planner_token_bytes(p);
  const std::int64_t k = planner_sequence_layers(p);
  // The GPU buffer of one offloaded layer: eq. 7's c * B, or the printed line 3's B * R * H * D.
  const std::int64_t per_head_token = detail::planner_mul(std::int64_t(p.requests) * p.kv_heads, p.head_dim, where);
  const std::int64_t buffer = detail::planner_mul(p.literal_algorithm1 ? per_head_token : c, p.budget, where);
  KVSIFT_CHECK(free / k >= buffer, where,
               "the {} bytes left for KV hold fewer than budget = {} tokens in all {} layers (L {} + head {} + "
               "group {}; {} bytes per token and layer): offloading a layer would cost more than it frees, so the "
               "thresholds would decrease; lower the budget or the requests",
               free, p.budget, k, p.layers, p.head_layers, p.group, c);
  std::vector<std::int64_t> out;
  out.reserve(std::size_t(p.layers) + 1);
  for (std::int32_t n = 0; n <= p.layers; ++n) {
    out.push_back((free - n * buffer) / detail::planner_mul(c, k - n, where));  // free >= k * buffer: no overflow
  }
  return out;
}

/// Algorithm 2 at one length: the fewest offloaded layers n with seq_len < thresholds[n] (the last layers go
/// first). `thresholds` is sequence_thresholds' output (L + 1 values, nondecreasing). Throws kvsift::Error for a
/// negative length, thresholds that are too short or decrease, and when seq_len reaches S_L^T: even with every
/// layer offloaded the KV does not fit.
inline OffloadPlan plan_offload(std::span<const std::int64_t> thresholds, std::int64_t seq_len) {
  constexpr const char* where = "plan_offload";
  KVSIFT_CHECK(thresholds.size() >= 2, where, "thresholds hold {} values; algorithm 1 gives layers + 1 >= 2",
               thresholds.size());
  KVSIFT_CHECK(thresholds.size() - 1 <= std::size_t(std::numeric_limits<std::int32_t>::max()), where,
               "thresholds hold {} values, more layers than int32", thresholds.size());
  for (std::size_t n = 1; n < thresholds.size(); ++n) {
    KVSIFT_CHECK(thresholds[n] >= thresholds[n - 1], where, "thresholds[{}] (= {}) < thresholds[{}] (= {})", n,
                 thresholds[n], n - 1, thresholds[n - 1]);
  }
  KVSIFT_CHECK(seq_len >= 0, where, "seq_len (= {}) must not be negative", seq_len);
  const auto layers = std::int32_t(thresholds.size() - 1);
  KVSIFT_CHECK(seq_len < thresholds.back(), where,
               "seq_len = {} reaches S_L^T = {}: the KV does not fit even with all {} layers offloaded", seq_len,
               thresholds.back(), layers);
  std::int32_t n = 0;
  while (seq_len >= thresholds[std::size_t(n)]) ++n;
  return {.offloaded = n, .first_offloaded = layers - n};
}

}  // namespace kvsift
