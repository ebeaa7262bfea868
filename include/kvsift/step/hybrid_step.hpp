#pragma once
/// HybridDecodeStep: the decode step's hybrid placement (docs/selector_framework.md, placement (b)). The selector
/// runs on the CPU (its context is a cpu::Context) over a pinned host copy of the cache; the attention window is
/// attended on the GPU from the engine's device cache and the selected middle on the CPU, overlapped, then
/// merged on the GPU (cuda::HybridDecoder, step/hybrid_decoder.hpp: absolute positions everywhere, fp32
/// partials, one rounding). This is CTKVR's and A²ATS's arrangement, and CSAttention's CPU-search mode.
///
/// run() per step: lengths from the host cache (which counts the step's token: the engine has written it to
/// both caches), the selector's append and select on the calling thread and ctx.pool (step/selector_part.hpp,
/// the same sequence as DecodeStep's), then
/// HybridDecoder::decode (the window's attention enqueued on `stream`, the selection attended on the CPU, the
/// CPU's state copied and merged on `stream`). It returns once the merge is enqueued; the GPU is not waited for.
///
/// Memory: q_device, device_cache and `out` in device memory; q_host, host_cache (pinned), slots in host memory.
/// A selection row with a count outside [0, capacity] gets NaN in O and LSE (cpu::sparse_decode's rule, carried
/// by the merge). The step owns its host scratch (lengths, the selection and its log-weights, the selector's
/// workspaces) and the decoder's
/// buffers, all allocated in the constructor; run() allocates nothing. Every step has config.max_batch rows (the
/// decoder's buffers are sized for them). Thread safety: one step serves one thread at a time.

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "kvsift/core/error.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/selector.hpp"
#include "kvsift/step/decode_step.hpp"
#include "kvsift/step/hybrid_decoder.hpp"
#include "kvsift/step/selector_part.hpp"

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

  /// Refuses a selector with a second source (selectors/selector.hpp): its compressed rows live in host memory
  /// and would need a third partial; use the GPU or CPU placement (DecodeStep) for such a method.
  HybridDecodeStep(S selector, const DecodeStepConfig& config, const cpu::Context& ctx)
      : selector_(std::move(selector)),
        config_(checked(config, selector_)),
        part_(selector_, {config.max_batch, config.q_heads, config.kv_heads, config.head_dim, config.max_seq_len}, ctx),
        workspace_(part_.workspace_bytes()),
        buffers_(part_.carve(workspace_.bytes(), "HybridDecodeStep")),
        decoder_({.batch = config.max_batch, .q_heads = config.q_heads, .kv_heads = config.kv_heads,
                  .head_dim = config.head_dim, .attention = config.attention,
                  .validate_indices = config.validate_indices},
                 ctx.pool) {}

  S& selector() { return selector_; }
  const DecodeStepConfig& config() const { return config_; }
  /// The last run's selection (host memory; its log-weights when the selector writes them), valid until the
  /// next run.
  SelectionView selection() const { return part_.selection(buffers_, config_.max_batch); }
  /// The decoder's host timings of the last run (CPU part and whole call), for overlap measurements.
  const cuda::HybridStepTimes& last_step_times() const { return decoder_.last_step_times(); }

  /// Prefill of joining sequences over the host cache: the selector's prepare (may allocate), with the step's
  /// attention options.
  void prepare(PrefillInputs<T> in, const cpu::Context& ctx) {
    in.attention = config_.attention;
    selector_.prepare(in, ctx);
  }

  void run(const HybridStepInputs<T>& in, const StateView<T>& out, cudaStream_t stream, const cpu::Context& ctx) {
    constexpr const char* where = "HybridDecodeStep::run";
    KVSIFT_CHECK(in.q_host.batch == config_.max_batch && in.host_cache.batch() == config_.max_batch, where,
                 "in.q_host.batch (= {}) and the host cache's batch (= {}) must be config.max_batch (= {})",
                 in.q_host.batch, in.host_cache.batch(), config_.max_batch);
    part_.run(selector_,
              {.q = in.q_host, .cache = in.host_cache, .slots = in.slots, .k_pre_rope = in.k_pre_rope,
               .attention = config_.attention, .layer = in.layer},
              buffers_, ctx);
    const SelectionView sel = selection();
    in.device_cache.visit([&](const auto& device_kv) {
      in.host_cache.visit([&](const auto& host_kv) {
        decoder_.decode(in.q_device, in.q_host, device_kv, host_kv, sel, out, stream);
      });
    });
  }

 private:
  using Part = detail::SelectorPart<S>;

  static const DecodeStepConfig& checked(const DecodeStepConfig& config, const S& selector) {
    constexpr const char* where = "HybridDecodeStep";
    KVSIFT_CHECK(config.max_batch > 0, where, "config.max_batch (= {}) must be positive", config.max_batch);
    detail::refuse_second_source(where, selector, "on the GPU or the CPU");
    return config;
  }

  S selector_;
  DecodeStepConfig config_;
  Part part_;
  cpu::Array<std::byte> workspace_;  ///< the selector part's host buffers, carved once
  typename Part::Buffers buffers_;
  cuda::HybridDecoder<T> decoder_;
};

}  // namespace kvsift
