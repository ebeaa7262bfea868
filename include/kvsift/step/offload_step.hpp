#pragma once
/// OffloadDecodeStep: CPU search, GPU attention (CSAttention's CPU<->GPU mode, docs/selector_framework.md
/// placement (b)'s twin). Any selector whose context is a cpu::Context searches on the host over a pinned host
/// copy of the cache; only its selection crosses to the GPU, the selected K/V rows are read there from the pinned
/// host cache, and the GPU attends them with the window. HybridDecodeStep (step/hybrid_step.hpp) is the other
/// arrangement of the same inputs: there the CPU attends the selection itself.
///
/// run() per step, on the calling thread, ctx.pool and `stream`:
///   1. GPU: the window (config.attention.window) from the device cache, one sparse decode with an empty selection
///      into an fp32 partial. Enqueued first: it needs no selection, so it overlaps the host's search.
///   2. host: lengths from the host cache (which counts the step's token: the engine has written it to both
///      caches), the selector's append and select (step/selector_part.hpp, the sequence every placement runs),
///      into pinned buffers the step owns.
///   3. copies: counts, then indices and log-weights (when the selector writes them) up to the longest row, by
///      cudaMemcpyAsync from those pinned buffers (two or three copies);
///   4. GPU: cuda::gather_kv of the selected rows from the pinned host cache (zero-copy: the kernel reads them over
///      PCIe) into a device staging buffer, row i of a selection row to staging slot i;
///   5. GPU: one sparse decode of the staging rows (identity indices, the copied counts and log-weights, no window)
///      into a second fp32 partial, then merge_states of both into `out`, rounded once.
/// It returns once the merge is enqueued; the GPU is not waited for. One sparse-decode launch over both sources is
/// not possible: a launch reads one cache, and the window is in the device cache, the staging rows in their buffer.
///
/// Bytes per step (last_step_stats()): host to device by cudaMemcpyAsync, 4 * rows + 4 * rows * longest (twice with
/// log-weights), rows = batch * kv_heads and longest the largest count; over PCIe by the gather, the selected K and V
/// rows, sum of counts * 2 * head_dim * sizeof(T) (at CSAttention's defaults, rho = 5% of 128K tokens, 8 kv heads,
/// head_dim 128, bf16: 27 MB per sequence and layer).
///
/// Memory: q_device, device_cache and `out` in device memory; q_host and slots in host memory; host_cache in pinned
/// host memory (cudaMallocHost or cudaHostRegister) as the GPU reads it, its K and V and also its lengths or page
/// table, which the CPU reads too. The device cache holds at least the window's rows at their positions (no other
/// row is read: the middle may be gone); the host cache the middle's rows at theirs; their lengths agree (the device
/// lengths are not read on the host, so this is not checked). The GPU reads the host cache until the stream passes
/// this step: the engine may append to it meanwhile, not rewrite listed rows or pages.
/// Owned, all allocated in the constructor (run() allocates nothing; config.validate_indices allocates a bitmap):
/// pinned host, the selector part's buffers (lengths, the selection and its log-weights, the selector's scratch);
/// device, the selection's copy, identity indices, the staging K/V [max_batch, kv_heads, capacity, head_dim], the two
/// fp32 partials and the decode scratch.
///
/// Sync points: before the selector overwrites the pinned selection, the host waits for the previous step's copies
/// of it (an event: normally long done). With config.validate_indices the selection is checked on the host, with no
/// stream sync. Not graph-capturable: the search runs on the host every step and the copies are sized from its
/// counts (the GPU work of a step is stream-ordered and could be, the search not). The step's device buffers are
/// reused by every run and guarded by stream order alone: consecutive runs take the same stream (or the caller
/// orders a new stream after the previous one).
/// A selection row whose count is outside [0, capacity] (a primitive's -1) gathers nothing and gets NaN in O and LSE
/// of its query heads, carried by the merge. Rows must be in the middle of their sequences, distinct, inside the
/// host cache: a token outside it is not gathered (its staging slot keeps an older row), which validate_indices
/// refuses by name instead. Every run has 1 .. config.max_batch rows.
/// Thread safety: one step serves one thread at a time.

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/pinned_host.hpp"
#include "kvsift/selectors/selector.hpp"
#include "kvsift/step/decode_step.hpp"
#include "kvsift/step/hybrid_step.hpp"
#include "kvsift/step/selector_part.hpp"

namespace kvsift {

/// What the last OffloadDecodeStep::run cost on the host and moved to the device.
struct OffloadStepStats {
  double select_seconds = 0;        ///< the host's lengths, append and select (step 2)
  double call_seconds = 0;          ///< the whole run() on the host; the GPU is not waited for
  std::size_t selection_bytes = 0;  ///< copied by cudaMemcpyAsync: counts, indices (and log-weights) to the longest row
  std::size_t kv_bytes = 0;         ///< the gathered K and V rows, read over PCIe from the pinned host cache
};

template <KVSelector S>
  requires std::same_as<typename S::context_type, cpu::Context>
class OffloadDecodeStep {
 public:
  using value_type = typename S::value_type;
  using T = value_type;

  /// Plans every batch of 1 .. config.max_batch rows for ctx's pool (a larger pool is refused by run()). Refuses a
  /// selector with a second source (selectors/selector.hpp): its rows would need a third partial and their own
  /// gather; use DecodeStep for such a method.
  OffloadDecodeStep(S selector, const DecodeStepConfig& config, const cpu::Context& ctx)
      : selector_(std::move(selector)),
        config_(checked(config, selector_)),
        part_(selector_, {config.max_batch, config.q_heads, config.kv_heads, config.head_dim, config.max_seq_len}, ctx),
        planned_threads_(workspace_threads(ctx)),
        log_weights_(selector_writes_log_weights(selector_)) {
    host_memory_.resize(part_.workspace_bytes());
    host_ = part_.carve({host_memory_.data(), host_memory_.size()}, "OffloadDecodeStep");

    for (std::int32_t batch = 1; batch <= config.max_batch; ++batch) {
      const auto bytes = [&](std::int32_t capacity, const AttentionOptions& attention) {
        return cuda::sparse_decode_workspace_bytes(
            cuda::SparseDecodeShape{batch, config.q_heads, config.kv_heads, config.head_dim, capacity},
            cuda::DecodeOptions{.attention = attention});
      };
      decode_bytes_ = std::max({decode_bytes_, bytes(1, config.attention), bytes(part_.capacity(), staged_attention())});
    }
    WorkspaceLayout device_counting;
    device_layout(device_counting);
    device_memory_.resize(device_counting.bytes());
    WorkspaceLayout device_carving({device_memory_.data(), device_memory_.size()}, "OffloadDecodeStep");
    device_ = device_layout(device_carving);

    // Constants: staging slot i of every row is entry i (the staging selection's indices), and the window's empty
    // selection has count 0 everywhere.
    const std::size_t rows = this->rows(config.max_batch), capacity = std::size_t(part_.capacity());
    std::vector<std::int32_t> identity(rows * capacity);
    for (std::size_t i = 0; i < identity.size(); ++i) identity[i] = std::int32_t(i % capacity);
    const std::vector<std::int32_t> zeros(rows, 0);
    KVSIFT_CUDA_CHECK(cudaMemcpy(device_.identity, identity.data(), identity.size() * sizeof(std::int32_t),
                                 cudaMemcpyHostToDevice));
    KVSIFT_CUDA_CHECK(
        cudaMemcpy(device_.no_counts, zeros.data(), zeros.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
    // A copy from pageable memory may return before its DMA ends; run() uses any stream, so finish it here.
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    cudaEvent_t event = nullptr;
    KVSIFT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    copied_.reset(event);
  }

  S& selector() { return selector_; }
  const S& selector() const { return selector_; }
  const DecodeStepConfig& config() const { return config_; }
  /// The last run's selection (pinned host memory, token ids; its log-weights when the selector writes them),
  /// valid until the next run.
  SelectionView selection() const { return part_.selection(host_, last_batch_); }
  const OffloadStepStats& last_step_stats() const { return stats_; }

  /// Prefill of joining sequences over the host cache: the selector's prepare (may allocate), with the step's
  /// attention options.
  void prepare(PrefillInputs<T> in, const cpu::Context& ctx) {
    in.attention = config_.attention;
    selector_.prepare(in, ctx);
  }
  /// Sequences leave: the selector's release.
  void release(std::span<const std::int32_t> slots) { selector_.release(slots); }

  /// One step (see above); `out` [batch, q_heads, head_dim] in T or fp32, LSE natural log, device memory.
  template <class TO>
    requires(std::same_as<TO, T> || std::same_as<TO, float>)
  void run(const HybridStepInputs<T>& in, const StateView<TO>& out, cudaStream_t stream, const cpu::Context& ctx) {
    constexpr const char* where = "OffloadDecodeStep::run";
    using Clock = std::chrono::steady_clock;
    const auto call_start = Clock::now();
    const std::int32_t batch = in.q_host.batch;
    KVSIFT_CHECK(batch > 0 && batch <= config_.max_batch, where,
                 "in.q_host.batch (= {}) is outside [1, config.max_batch = {}]", batch, config_.max_batch);
    KVSIFT_CHECK(in.q_device.batch == batch && in.device_cache.batch() == batch && in.host_cache.batch() == batch,
                 where,
                 "in.q_device.batch (= {}), the device cache's batch (= {}) and the host cache's (= {}) must be "
                 "in.q_host.batch (= {})",
                 in.q_device.batch, in.device_cache.batch(), in.host_cache.batch(), batch);
    KVSIFT_CHECK(workspace_threads(ctx) <= planned_threads_, where,
                 "the context has {} threads, the step was planned for {}: plan the step with the pool it runs on",
                 workspace_threads(ctx), planned_threads_);
    check_host_cache(in.host_cache);
    const cuda::Context gpu{stream};

    // 1. The window, from the device cache, while the host searches.
    const StateView<float> window = partial(device_.window_o, device_.window_lse, batch);
    const SelectionView nothing{device_.identity, device_.no_counts, nullptr, batch, config_.kv_heads, 1};
    cuda::sparse_decode(in.q_device, in.device_cache, nothing, window, config_.attention, false,
                        config_.programmatic_launch, device_.decode, gpu);

    // 2. The search, into the pinned selection, once the previous step's copies of it are done.
    if (copy_pending_) KVSIFT_CUDA_CHECK(cudaEventSynchronize(copied_.get()));
    const auto select_start = Clock::now();
    part_.run(selector_,
              {.q = in.q_host, .cache = in.host_cache, .slots = in.slots, .k_pre_rope = in.k_pre_rope,
               .attention = config_.attention, .layer = in.layer},
              host_, ctx);
    stats_.select_seconds = std::chrono::duration<double>(Clock::now() - select_start).count();
    last_batch_ = batch;
    const SelectionView host_selection = selection();
    if (config_.validate_indices) {
      in.host_cache.visit([&](const auto& kv) {
        validate(host_selection, kv, where, "the selection");
        check_selection_contents(host_selection, kv, where, "the selection", /*refuse_duplicates=*/true,
                                 config_.attention.window);
      });
    }

    // 3. The selection to the device: counts, then the rows up to the longest.
    const std::size_t rows = this->rows(batch), capacity = std::size_t(part_.capacity());
    std::size_t longest = 0, gathered = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      const std::int32_t count = host_.counts[r];
      if (count < 0 || std::size_t(count) > capacity) continue;  // a bad row: nothing gathered, NaN out
      longest = std::max(longest, std::size_t(count));
      gathered += std::size_t(count);
    }
    const std::size_t pitch = capacity * sizeof(std::int32_t), width = longest * sizeof(std::int32_t);
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(device_.counts, host_.counts, rows * sizeof(std::int32_t),
                                      cudaMemcpyHostToDevice, stream));
    stats_.selection_bytes = rows * sizeof(std::int32_t);
    if (longest > 0) {
      KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(device_.indices, pitch, host_.indices, pitch, width, rows,
                                          cudaMemcpyHostToDevice, stream));
      stats_.selection_bytes += rows * width;
      if (log_weights_) {
        static_assert(sizeof(float) == sizeof(std::int32_t));
        KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(device_.log_weights, pitch, host_.log_weights, pitch, width, rows,
                                            cudaMemcpyHostToDevice, stream));
        stats_.selection_bytes += rows * width;
      }
    }
    KVSIFT_CUDA_CHECK(cudaEventRecord(copied_.get(), stream));
    copy_pending_ = true;

    // 4. The selected rows, from the pinned host cache into staging slots 0 .. count.
    const SelectionView device_selection{device_.indices, device_.counts, nullptr, batch, config_.kv_heads,
                                         part_.capacity()};
    const auto staging = ContiguousKVView<T>::packed(device_.staging_k, device_.staging_v, batch, config_.kv_heads,
                                                     part_.capacity(), config_.head_dim);
    cuda::gather_kv(in.host_cache, device_selection, KVCache<T>(staging), stream);
    stats_.kv_bytes = gathered * 2 * std::size_t(config_.head_dim) * sizeof(T);

    // 5. The staging rows with their log-weights, then both partials merged into `out`.
    const StateView<float> staged = partial(device_.staged_o, device_.staged_lse, batch);
    const SelectionView staged_rows{device_.identity, device_.counts, device_.log_weights, batch, config_.kv_heads,
                                    part_.capacity()};
    cuda::sparse_decode(in.q_device, KVCache<const T>(staging), staged_rows, staged, staged_attention(), false,
                        config_.programmatic_launch, device_.decode, gpu);
    const StateView<const float> partials[] = {window.as_const(), staged.as_const()};
    cuda::merge_states<float, TO>(partials, out, stream);
    stats_.call_seconds = std::chrono::duration<double>(Clock::now() - call_start).count();
  }

 private:
  using Part = detail::SelectorPart<S>;

  struct DeviceBuffers {
    float *window_o = nullptr, *window_lse = nullptr;  ///< the window's fp32 partial
    float *staged_o = nullptr, *staged_lse = nullptr;  ///< the staging rows' fp32 partial
    T *staging_k = nullptr, *staging_v = nullptr;      ///< [max_batch, kv_heads, capacity, head_dim]
    std::int32_t *indices = nullptr, *counts = nullptr;  ///< the host selection's copy (token ids)
    float* log_weights = nullptr;                        ///< its log-weights' copy, when the selector writes them
    std::int32_t* identity = nullptr;   ///< [max_batch * kv_heads, capacity]: entry i is i (staging slot i)
    std::int32_t* no_counts = nullptr;  ///< [max_batch * kv_heads] zeros: the window's selection lists nothing
    std::span<std::byte> decode;        ///< both sparse decodes' scratch (they run in turn on the stream)
  };
  struct EventDeleter {
    void operator()(cudaEvent_t event) const { cudaEventDestroy(event); }
  };

  static const DecodeStepConfig& checked(const DecodeStepConfig& config, const S& selector) {
    constexpr const char* where = "OffloadDecodeStep";
    KVSIFT_CHECK(config.max_batch > 0, where, "config.max_batch (= {}) must be positive", config.max_batch);
    KVSIFT_CHECK(config.max_seq_len > 0, where, "config.max_seq_len (= {}) must be positive", config.max_seq_len);
    validate(config.attention.window, where, "config.attention.window");
    detail::refuse_second_source(where, selector, "on the GPU or the CPU");
    return config;
  }

  /// The GPU reads the host cache's rows, lengths and page table: they must be pinned (or managed) host memory
  /// (checked once per array: cuda/pinned_host.hpp).
  void check_host_cache(const KVCache<const T>& cache) {
    constexpr const char* where = "OffloadDecodeStep::run";
    pinned_.require(cache, cuda::PinnedHostCheck::Arrays::kv_and_tables, where, "in.host_cache");
    cache.visit([&](const auto& kv) { validate(kv, where, "in.host_cache", MemorySpace::host); });
  }

  /// The staging rows are attended whole: the step's scale, no window (the window is the other partial's).
  AttentionOptions staged_attention() const { return {.sm_scale = config_.attention.sm_scale}; }
  std::size_t rows(std::int32_t batch) const { return std::size_t(batch) * std::size_t(config_.kv_heads); }
  StateView<float> partial(float* o, float* lse, std::int32_t batch) const {
    return StateView<float>::packed(o, lse, batch, config_.q_heads, config_.head_dim);
  }

  /// The one layout behind the device block's size (counting) and its pointers (carving).
  DeviceBuffers device_layout(WorkspaceLayout& layout) const {
    const std::size_t rows = this->rows(config_.max_batch), capacity = std::size_t(part_.capacity());
    const std::size_t states = std::size_t(config_.max_batch) * std::size_t(config_.q_heads);
    const std::size_t staging = rows * capacity * std::size_t(config_.head_dim);
    DeviceBuffers b;
    b.window_o = layout.allocate<float>(states * std::size_t(config_.head_dim), "OffloadDecodeStep window O");
    b.window_lse = layout.allocate<float>(states, "OffloadDecodeStep window LSE");
    b.staged_o = layout.allocate<float>(states * std::size_t(config_.head_dim), "OffloadDecodeStep staged O");
    b.staged_lse = layout.allocate<float>(states, "OffloadDecodeStep staged LSE");
    b.staging_k = layout.allocate<T>(staging, "OffloadDecodeStep staging K");
    b.staging_v = layout.allocate<T>(staging, "OffloadDecodeStep staging V");
    b.indices = layout.allocate<std::int32_t>(rows * capacity, "OffloadDecodeStep selection indices");
    b.counts = layout.allocate<std::int32_t>(rows, "OffloadDecodeStep selection counts");
    if (log_weights_) b.log_weights = layout.allocate<float>(rows * capacity, "OffloadDecodeStep selection log-weights");
    b.identity = layout.allocate<std::int32_t>(rows * capacity, "OffloadDecodeStep identity indices");
    b.no_counts = layout.allocate<std::int32_t>(rows, "OffloadDecodeStep empty counts");
    b.decode = layout.span(decode_bytes_, "OffloadDecodeStep decode scratch");
    return b;
  }

  S selector_;
  DecodeStepConfig config_;
  Part part_;
  std::int32_t planned_threads_;
  bool log_weights_;
  cuda::PinnedArray<std::byte> host_memory_;  ///< the selector part's buffers: the copies read the selection here
  typename Part::Buffers host_;
  std::size_t decode_bytes_ = 0;
  cuda::Array<std::byte> device_memory_;
  DeviceBuffers device_;
  std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter> copied_;  ///< the last step's selection copies
  bool copy_pending_ = false;
  std::int32_t last_batch_ = 1;
  OffloadStepStats stats_;
  cuda::PinnedHostCheck pinned_;
};

}  // namespace kvsift
