#pragma once
/// GpuSelectHybridStep: GPU search, CPU attention (A²ATS's placement, its §4.3, for any selector whose context is a
/// cuda::Context). The selector's index (codes, page bounds, ...) lives on the GPU and its append and select run
/// there; the whole KV cache lives in pinned host memory, where the CPU attends the selection; the GPU attends the
/// window from its device cache; the two partial states merge by LSE on the GPU. OffloadDecodeStep
/// (step/offload_step.hpp) is the mirror arrangement (CPU search, GPU attention), HybridDecodeStep
/// (step/hybrid_step.hpp) runs both the search and the attention of the selection on the CPU.
///
/// run() per step, on the calling thread, the decoder's pool and ctx.stream:
///   1. GPU: lengths from the device cache, the selector's append and select into a device selection
///      (step/selector_part.hpp, the sequence every placement runs);
///   2. copies to pinned host buffers the step owns, one cudaMemcpyAsync each: the counts, the indices (every row's
///      whole capacity: the counts are not on the host yet), the log-weights when the selector writes them, and
///      the query; then one stream synchronization (the CPU needs them);
///   3. cuda::HybridDecoder::decode (step/hybrid_decoder.hpp): the window enqueued on the stream from the device
///      cache, the selection attended on the CPU from the pinned host cache meanwhile, the CPU's fp32 state copied
///      to the device and merged with the window's there, rounded once into `out`.
/// It returns once the merge is enqueued; the GPU is not waited for after step 2.
///
/// Bytes over PCIe per step (bytes_per_step()): to the host 4 * rows * (1 + capacity) (twice the capacity part with
/// log-weights) plus the query, batch * q_heads * head_dim * sizeof(T), rows = batch * kv_heads; to the device the
/// CPU's fp32 state, batch * q_heads * (head_dim + 1) * 4 (plus alignment padding). A²ATS's K = 3% of 128K per query
/// head, united over a group of 4 (capacity ~15.7K), 8 kv heads, head_dim 128: ~0.5 MB to the host, 17 KB back. The
/// K/V rows never cross: the CPU reads them in host memory.
///
/// Memory: q, device_cache, slots, k_pre_rope and `out` in device memory; host_cache in pinned host memory, its
/// lengths or page table in host memory. The device cache holds what the selector reads (OracleTopK: every key;
/// Quest: the step's new key, its bounds were built at prepare; A²ATS: the step's new key, or k_pre_rope) and the
/// window's rows at their positions; the host cache the middle's rows at theirs; their lengths agree (the device
/// lengths are not read on the host, so this is not checked). The engine writes each step's token to both caches
/// before run().
/// Owned, all allocated in the constructor (run() allocates nothing; config.validate_indices makes the decoder
/// check the host selection with a bitmap): device, the selector part's buffers (lengths, the selection and its
/// log-weights, the selector's scratch); pinned host, the selection's and the query's copies; the decoder's buffers.
/// Sync points: one cudaStreamSynchronize per run (step 2), and the decoder's wait for its previous copy of the CPU
/// state (an event, normally long done). Not graph-capturable: the CPU attends every step between the GPU's two
/// parts (steps 1-2 alone are stream-ordered work, as DecodeStep's select). Every run has config.max_batch rows (the
/// decoder's buffers are sized for them).
/// A selection row whose count is outside [0, capacity] (a primitive's -1: a sequence past the planned bound) gets
/// NaN in O and LSE of its query heads (cpu::sparse_decode's rule, carried by the merge).
/// Thread safety: one step serves one thread at a time; it owns its selector.

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include <cuda_runtime_api.h>

#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/pinned_host.hpp"
#include "kvsift/selectors/selector.hpp"
#include "kvsift/step/decode_step.hpp"
#include "kvsift/step/hybrid_decoder.hpp"
#include "kvsift/step/selector_part.hpp"

namespace kvsift {

template <class T>
struct GpuSelectStepInputs {
  QueryView<const T> q{};               ///< [batch, q_heads, head_dim] post-RoPE, device memory
  KVCache<const T> device_cache{};      ///< what the selector reads, and the window's rows; lengths on the device
  KVCache<const T> host_cache{};        ///< pinned host cache: the middle's rows at their positions; lengths on the host
  const std::int32_t* slots = nullptr;  ///< [batch] each row's selector slot, device memory
  HeadsView<const T> k_pre_rope{};      ///< optional, device memory, for selectors that index pre-RoPE keys
  std::int32_t layer = 0;
};

/// Host-side times of the last GpuSelectHybridStep::run, in seconds.
struct GpuSelectStepTimes {
  double select = 0;         ///< enqueue the GPU's lengths, append, select and the copies, and wait for them
  double cpu_attention = 0;  ///< the CPU's attention of the selection (the decoder's cpu_seconds)
  double total = 0;          ///< the whole run(); the GPU is not waited for after the select
};

/// Bytes one run moves over PCIe (the same every step: the copies are sized by the plan, not the counts).
struct GpuSelectStepBytes {
  std::size_t to_host = 0;    ///< counts, indices (and log-weights) at full capacity, and the query
  std::size_t to_device = 0;  ///< the CPU's fp32 partial state (its payload; the decoder's block adds padding)
};

template <KVSelector S>
  requires std::same_as<typename S::context_type, cuda::Context>
class GpuSelectHybridStep {
 public:
  using value_type = typename S::value_type;
  using T = value_type;

  /// Plans the selector part for config.max_batch rows on `ctx` and allocates every buffer; `pool` runs the CPU's
  /// attention (nullptr: the calling thread). Refuses a selector with a second source (selectors/selector.hpp): its
  /// rows live on the GPU and would need a third partial; use DecodeStep for such a method.
  GpuSelectHybridStep(S selector, const DecodeStepConfig& config, const cuda::Context& ctx,
                      cpu::ThreadPool* pool = nullptr)
      : selector_(std::move(selector)),
        config_(checked(config, selector_)),
        part_(selector_, {config.max_batch, config.q_heads, config.kv_heads, config.head_dim, config.max_seq_len}, ctx),
        log_weights_(selector_writes_log_weights(selector_)),
        rows_(std::size_t(config.max_batch) * std::size_t(config.kv_heads)),
        query_elements_(std::size_t(config.max_batch) * std::size_t(config.q_heads) * std::size_t(config.head_dim)),
        device_memory_(part_.workspace_bytes()),
        device_(part_.carve({device_memory_.data(), device_memory_.size()}, "GpuSelectHybridStep")),
        h_counts_(rows_),
        h_indices_(rows_ * std::size_t(part_.capacity())),
        h_log_weights_(log_weights_ ? rows_ * std::size_t(part_.capacity()) : 0),
        h_q_(query_elements_),
        decoder_({.batch = config.max_batch, .q_heads = config.q_heads, .kv_heads = config.kv_heads,
                  .head_dim = config.head_dim, .attention = config.attention,
                  .validate_indices = config.validate_indices},
                 pool) {}

  S& selector() { return selector_; }
  const S& selector() const { return selector_; }
  const DecodeStepConfig& config() const { return config_; }
  /// The last run's selection (pinned host memory, token ids; its log-weights when the selector writes them), valid
  /// until the next run.
  SelectionView selection() const {
    return {const_cast<std::int32_t*>(h_indices_.data()), const_cast<std::int32_t*>(h_counts_.data()),
            log_weights_ ? const_cast<float*>(h_log_weights_.data()) : nullptr, config_.max_batch, config_.kv_heads,
            part_.capacity()};
  }
  const GpuSelectStepTimes& last_step_times() const { return times_; }
  GpuSelectStepBytes bytes_per_step() const {
    const std::size_t index_bytes = rows_ * std::size_t(part_.capacity()) * sizeof(std::int32_t);
    const std::size_t states = std::size_t(config_.max_batch) * std::size_t(config_.q_heads);
    return {.to_host = rows_ * sizeof(std::int32_t) + index_bytes * (log_weights_ ? 2 : 1) + query_elements_ * sizeof(T),
            .to_device = states * (std::size_t(config_.head_dim) + 1) * sizeof(float)};
  }

  /// Prefill of joining sequences on the GPU (in.cache, in.slots, in.queries in device memory): the selector's
  /// prepare (may allocate and synchronize), with the step's attention options.
  void prepare(PrefillInputs<T> in, const cuda::Context& ctx) {
    in.attention = config_.attention;
    selector_.prepare(in, ctx);
  }
  /// Sequences leave: the selector's release.
  void release(std::span<const std::int32_t> slots) { selector_.release(slots); }

  /// One step (see above); `out` [batch, q_heads, head_dim] in T, LSE natural log, device memory.
  void run(const GpuSelectStepInputs<T>& in, const StateView<T>& out, const cuda::Context& ctx) {
    constexpr const char* where = "GpuSelectHybridStep::run";
    using Clock = std::chrono::steady_clock;
    const auto begin = Clock::now();
    const std::int32_t batch = config_.max_batch;
    KVSIFT_CHECK(in.q.batch == batch && in.device_cache.batch() == batch && in.host_cache.batch() == batch, where,
                 "in.q.batch (= {}) and the caches' batches (device {}, host {}) must be config.max_batch (= {})",
                 in.q.batch, in.device_cache.batch(), in.host_cache.batch(), batch);
    validate(in.q, where, "in.q");
    KVSIFT_CHECK(in.q.heads == config_.q_heads && in.q.head_dim == config_.head_dim, where,
                 "in.q has {} heads of head_dim {}; the step was planned for {} and {}", in.q.heads, in.q.head_dim,
                 config_.q_heads, config_.head_dim);
    // One 2D copy moves the query: its head rows must be evenly spaced across batch rows too.
    KVSIFT_CHECK(in.q.batch_stride == std::int64_t(in.q.heads) * in.q.head_stride, where,
                 "in.q.batch_stride (= {}) must be heads * head_stride (= {}): the step copies the query's rows "
                 "to the host in one copy",
                 in.q.batch_stride, std::int64_t(in.q.heads) * in.q.head_stride);
    KVSIFT_CHECK(in.slots != nullptr, where, "in.slots is a null pointer");
    // What the decoder would refuse after the search, refused before it: a refused call leaves the selector as it
    // was (an append that ran would not run again the same way for every selector).
    in.host_cache.visit([&](const auto& kv) {
      validate(kv, where, "in.host_cache", MemorySpace::host);
      KVSIFT_CHECK(kv.kv_heads == config_.kv_heads && kv.head_dim == config_.head_dim, where,
                   "in.host_cache has {} kv heads of head_dim {}; the step was planned for {} and {}", kv.kv_heads,
                   kv.head_dim, config_.kv_heads, config_.head_dim);
    });
    pinned_.require(in.host_cache, cuda::PinnedHostCheck::Arrays::kv, where, "in.host_cache");
    validate(out, where, "out");
    KVSIFT_CHECK(out.batch == batch && out.heads == config_.q_heads && out.head_dim == config_.head_dim, where,
                 "out is [{}, {}, {}]; the step writes [{}, {}, {}]", out.batch, out.heads, out.head_dim, batch,
                 config_.q_heads, config_.head_dim);

    if (config_.validate_indices) detail::check_device_slots(where, selector_, in.slots, batch, ctx);
    // 1. The search on the GPU.
    part_.run(selector_,
              {.q = in.q, .cache = in.device_cache, .slots = in.slots, .k_pre_rope = in.k_pre_rope,
               .attention = config_.attention, .layer = in.layer},
              device_, ctx);

    // 2. The selection and the query on the host.
    const std::size_t index_bytes = rows_ * std::size_t(part_.capacity()) * sizeof(std::int32_t);
    copy_to_host(device_.counts, h_counts_.data(), rows_ * sizeof(std::int32_t), ctx);
    copy_to_host(device_.indices, h_indices_.data(), index_bytes, ctx);
    if (log_weights_) copy_to_host(device_.log_weights, h_log_weights_.data(), index_bytes, ctx);
    const std::size_t row_bytes = std::size_t(config_.head_dim) * sizeof(T);
    KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(h_q_.data(), row_bytes, in.q.data, std::size_t(in.q.head_stride) * sizeof(T),
                                        row_bytes, std::size_t(batch) * std::size_t(config_.q_heads),
                                        cudaMemcpyDeviceToHost, ctx.stream));
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    const auto selected = Clock::now();

    // 3. The window on the GPU, the selection on the CPU, merged on the stream.
    const auto q_host = QueryView<const T>::packed(h_q_.data(), batch, config_.q_heads, config_.head_dim);
    const SelectionView sel = selection();
    in.device_cache.visit([&](const auto& device_kv) {
      in.host_cache.visit([&](const auto& host_kv) {
        decoder_.decode(in.q, q_host, device_kv, host_kv, sel, out, ctx.stream);
      });
    });
    times_.select = std::chrono::duration<double>(selected - begin).count();
    times_.cpu_attention = decoder_.last_step_times().cpu_seconds;
    times_.total = std::chrono::duration<double>(Clock::now() - begin).count();
  }

 private:
  using Part = detail::SelectorPart<S>;

  static const DecodeStepConfig& checked(const DecodeStepConfig& config, const S& selector) {
    constexpr const char* where = "GpuSelectHybridStep";
    KVSIFT_CHECK(config.max_batch > 0, where, "config.max_batch (= {}) must be positive", config.max_batch);
    KVSIFT_CHECK(config.max_seq_len > 0, where, "config.max_seq_len (= {}) must be positive", config.max_seq_len);
    detail::refuse_second_source(where, selector, "on the GPU");
    return config;
  }
  static void copy_to_host(const void* src, void* dst, std::size_t bytes, const cuda::Context& ctx) {
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx.stream));
  }

  S selector_;
  DecodeStepConfig config_;
  Part part_;
  bool log_weights_;
  std::size_t rows_, query_elements_;
  cuda::Array<std::byte> device_memory_;  ///< the selector part's device buffers, carved once
  typename Part::Buffers device_;
  cuda::PinnedArray<std::int32_t> h_counts_, h_indices_;
  cuda::PinnedArray<float> h_log_weights_;
  cuda::PinnedArray<T> h_q_;
  cuda::HybridDecoder<T> decoder_;
  GpuSelectStepTimes times_;
  cuda::PinnedHostCheck pinned_;  ///< the host cache's K and V, checked once per array
};

}  // namespace kvsift
