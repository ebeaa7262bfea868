#pragma once
/// HybridDecodeStep: the decode step's hybrid placement (docs/selector_framework.md, placement (b)). The selector
/// runs on the CPU (its context is a cpu::Context) over a pinned host copy of the cache; the attention window is
/// attended on the GPU from the engine's device cache and the selected middle on the CPU, overlapped, then
/// merged on the GPU (cuda::HybridDecoder, step/hybrid_decoder.hpp: absolute positions everywhere, fp32
/// partials, one rounding). This is CTKVR's and A²ATS's arrangement, and CSAttention's CPU-search mode.
///
/// run() per step: lengths from the host cache (which counts the step's token: the engine has written it to
/// both caches), the selector's append and select on the calling thread and ctx.pool, then
/// HybridDecoder::decode (the window's attention enqueued on `stream`, the selection attended on the CPU, the
/// CPU's state copied and merged on `stream`). It returns once the merge is enqueued; the GPU is not waited for.
///
/// Memory: q_device, device_cache and `out` in device memory; q_host, host_cache (pinned), slots in host memory.
/// The step owns its host scratch (lengths, the selection, the selector's workspaces) and the decoder's
/// buffers, all allocated in the constructor; run() allocates nothing. Every step has config.max_batch rows (the
/// decoder's buffers are sized for them). Thread safety: one step serves one thread at a time.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "kvsift/core/error.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/selector.hpp"
#include "kvsift/step/decode_step.hpp"
#include "kvsift/step/hybrid_decoder.hpp"

namespace kvsift {

template <class T>
struct HybridStepInputs {
  QueryView<const T> q_device{};        ///< [batch, q_heads, head_dim], device memory
  QueryView<const T> q_host{};          ///< the same queries in host memory: the CPU selects and attends with them
  KVCache<const T> device_cache{};      ///< the engine's device cache: at least the window's rows at their positions
  KVCache<const T> host_cache{};        ///< pinned host cache: the middle's rows at their positions; lengths on the host
  const std::int32_t* slots = nullptr;  ///< [batch] each row's selector slot, host memory
  HeadsView<const T> k_pre_rope{};      ///< optional, host memory, for selectors that index pre-RoPE keys
  std::int32_t layer = 0;
};

template <KVSelector S>
  requires std::same_as<typename S::context_type, cpu::Context>
class HybridDecodeStep {
 public:
  using value_type = typename S::value_type;
  using T = value_type;

  HybridDecodeStep(S selector, const DecodeStepConfig& config, const cpu::Context& ctx)
      : selector_(std::move(selector)),
        config_(config),
        capacity_(std::max(1, selector_.capacity())),
        lengths_(std::size_t(checked_batch(config))),
        indices_(std::size_t(config.max_batch) * std::size_t(config.kv_heads) * std::size_t(capacity_)),
        counts_(std::size_t(config.max_batch) * std::size_t(config.kv_heads)),
        append_workspace_(selector_.append_workspace_bytes(shape(), ctx)),
        select_workspace_(selector_.select_workspace_bytes(shape(), ctx)),
        decoder_({.batch = config.max_batch, .q_heads = config.q_heads, .kv_heads = config.kv_heads,
                  .head_dim = config.head_dim, .attention = config.attention,
                  .validate_indices = config.validate_indices},
                 ctx.pool) {}

  S& selector() { return selector_; }
  const DecodeStepConfig& config() const { return config_; }
  /// The last run's selection (host memory), valid until the next run.
  SelectionView selection() { return {indices_.data(), counts_.data(), nullptr, config_.max_batch, config_.kv_heads, capacity_}; }
  /// The decoder's host timings of the last run (CPU part and whole call), for overlap measurements.
  const cuda::HybridStepTimes& last_step_times() const { return decoder_.last_step_times(); }

  /// Prefill of joining sequences over the host cache: the selector's prepare (may allocate).
  void prepare(const PrefillInputs<T>& in, const cpu::Context& ctx) { selector_.prepare(in, ctx); }

  void run(const HybridStepInputs<T>& in, const StateView<T>& out, cudaStream_t stream, const cpu::Context& ctx) {
    constexpr const char* where = "HybridDecodeStep::run";
    KVSIFT_CHECK(in.q_host.batch == config_.max_batch && in.host_cache.batch() == config_.max_batch, where,
                 "in.q_host.batch (= {}) and the host cache's batch (= {}) must be config.max_batch (= {})",
                 in.q_host.batch, in.host_cache.batch(), config_.max_batch);
    cpu::sequence_lengths(in.host_cache, lengths_.data());
    const SelectionView sel = selection();
    selector_.append({.cache = in.host_cache, .slots = in.slots, .lengths = lengths_.data(),
                      .k_pre_rope = in.k_pre_rope, .layer = in.layer},
                     append_workspace_.bytes(), ctx);
    selector_.select({.q = in.q_host, .cache = in.host_cache, .slots = in.slots, .lengths = lengths_.data(),
                      .attention = config_.attention, .layer = in.layer},
                     sel, select_workspace_.bytes(), ctx);
    in.device_cache.visit([&](const auto& device_kv) {
      in.host_cache.visit([&](const auto& host_kv) {
        decoder_.decode(in.q_device, in.q_host, device_kv, host_kv, sel, out, stream);
      });
    });
  }

 private:
  static std::int32_t checked_batch(const DecodeStepConfig& config) {
    KVSIFT_CHECK(config.max_batch > 0, "HybridDecodeStep", "config.max_batch (= {}) must be positive", config.max_batch);
    return config.max_batch;
  }
  SelectShape shape() const {
    return {config_.max_batch, config_.q_heads, config_.kv_heads, config_.head_dim, config_.max_seq_len};
  }

  S selector_;
  DecodeStepConfig config_;
  std::int32_t capacity_;
  cpu::Array<std::int32_t> lengths_, indices_, counts_;
  cpu::Array<std::byte> append_workspace_, select_workspace_;
  cuda::HybridDecoder<T> decoder_;
};

}  // namespace kvsift
