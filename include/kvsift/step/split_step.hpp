#pragma once
/// The placements of DecodeStep that split a layer's step over the GPU and the CPU (step/placement.hpp has the
/// table): DecodeStep<S, placement::MiddleOnCpu> and DecodeStep<S, placement::MiddleOnGpu>, specializations of the
/// one class template of step/decode_step.hpp. They share with the local placement the configuration
/// (DecodeStepConfig), the inputs (StepInputs), the selector's part of the step (step/selector_part.hpp: lengths,
/// append, select, run on the selector's context) and the life cycle (prepare, release); they add:
///   - a SplitContext: the GPU's stream and the CPU's pool (a CPU selector runs on that pool, a GPU one on that
///     stream; the CPU's scratch is planned for the pool given at construction, and run() refuses another);
///   - a caller-owned SplitWorkspace of workspace_bytes(): a device block and a pinned host block (256-byte aligned,
///     contents irrelevant: every run writes what it reads). The GPU reads the host block until the stream passes
///     the run's merge; the next run over it waits for that (an event), so one workspace serves consecutive steps.
///     The constructors plan and create events; they allocate no buffer;
///   - last_step_stats(): the host's times and the bytes over PCIe of the last run (StepStats).
/// Neither is graph-capturable: the CPU works between the GPU's parts every step. Both refuse a selector with a
/// second source (selectors/selector.hpp; its rows would need a third partial): run it in placement::Local. Both
/// read caches the engine has written the step's token to (all of them): in.k and in.v are refused. A selection row
/// whose count is outside [0, capacity] (a primitive's -1) gets NaN in O and LSE of its query heads, carried by the
/// merge. Thread safety: one step serves one thread at a time; it owns its selector.
///
/// placement::MiddleOnCpu (CTKVR's and A²ATS's hybrid, CSAttention's CPU search): the window is attended on the GPU
/// from the device cache while the CPU attends the selection from the pinned host cache; the CPU's fp32 state is
/// copied to the GPU and merged there (cuda::HybridDecoder, step/hybrid_decoder.hpp), rounded once into `out` (T).
/// Every run has config.max_batch rows; the window must not be empty. Per run:
///   - a CPU selector (its context a cpu::Context) selects over in.cache, the pinned host cache (lengths and page
///     table in host memory), with in.q and in.slots in host memory; the GPU reads in.q_device and in.device_cache;
///   - a GPU selector selects over in.cache (device) with in.q and in.slots in device memory; then its counts, its
///     indices (whole capacity), its log-weights and the query are copied into the host block, one stream
///     synchronization; the CPU reads in.host_cache (pinned). Bytes to the host: 4 * rows * (1 + capacity) (twice
///     the capacity part with log-weights) plus the query; rows = batch * kv_heads;
///   - a GPU selector with a host stage (selectors/selector.hpp HasHostStage: CTKVR) runs only its lengths, append
///     and recall on the GPU; the candidates' counts and the query, then their rows up to the longest, are copied to
///     the host (two synchronizations); the host stage finishes the selection on the CPU over in.host_cache, and
///     its index update goes back to the GPU (the entries copied, the selector's update on the stream). The device
///     cache then need hold only the window's rows.
///
/// placement::MiddleOnGpu (CSAttention's CPU<->GPU mode), CPU selectors only (a GPU selector's middle on the GPU is
/// placement::Local): 1. the window from in.device_cache into an fp32 partial, enqueued first so that it overlaps the
/// search; 2. the selector over in.cache (pinned host) into the host block, once the previous run's copies of it
/// are done; 3. counts, then indices and log-weights up to the longest row, copied to the device; 4. cuda::gather_kv
/// of the selected rows from in.cache (the GPU reads them over PCIe) into staging slots in the device block;
/// 5. one sparse decode of the staging rows (no window) into a second partial, merged with the first into `out` (T
/// or fp32). The GPU reads in.cache's rows, lengths and page table until the stream passes the run: the engine may
/// append to it meanwhile, not rewrite listed rows. 1 .. config.max_batch rows per run.
///
/// The caches' lengths agree (the device's are not read on the host, so this is not checked); the device cache
/// holds at least the window's rows at their positions, the host cache the middle's.

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <variant>

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
#include "kvsift/step/hybrid_decoder.hpp"
#include "kvsift/step/placement.hpp"
#include "kvsift/step/selector_part.hpp"

namespace kvsift {

/// Where a split step runs: the GPU's work on `gpu.stream`, the CPU's on `cpu.pool` (nullptr: the calling thread).
struct SplitContext {
  cuda::Context gpu{};
  cpu::Context cpu{};
};

/// What the last run of a split step cost on the host and moved over PCIe.
struct StepStats {
  double select_seconds = 0;         ///< the selector's part on the host, with the waits for its results
  double cpu_attention_seconds = 0;  ///< the CPU's attention of the selection (MiddleOnCpu)
  double call_seconds = 0;           ///< the whole run() on the host; the GPU is not waited for
  std::size_t to_host_bytes = 0;     ///< copied to the host: a GPU selector's selection and the query
  std::size_t to_device_bytes = 0;   ///< copied to the device: the CPU's fp32 state, or a CPU selection (MiddleOnGpu)
  std::size_t gathered_kv_bytes = 0; ///< K and V rows the GPU read from the pinned host cache (MiddleOnGpu)
};

namespace detail {

/// What both split placements add to the shared part: the contexts, the checks of a split run (the pinned-memory
/// ones among them) and the statistics.
template <KVSelector S>
class SplitStepBase : public StepBase<S> {
 public:
  /// The caller-owned workspace run() carves: a device block and a pinned host block (fixed at construction).
  SplitWorkspaceBytes workspace_bytes() const { return bytes_; }
  /// The last run's host times and bytes over PCIe.
  const StepStats& last_step_stats() const { return stats_; }

 protected:
  using T = typename S::value_type;
  using Clock = std::chrono::steady_clock;
  static constexpr bool kGpuSelector = S::context_type::memory == MemorySpace::device;
  /// A run's caches by side: the host's (the CPU reads it, pinned), the device's (the GPU attends the window from it).
  static KVCache<const T> host_cache_of(const StepInputs<T>& in) {
    return kGpuSelector ? in.host_cache : KVCache<const T>(in.cache);
  }
  static KVCache<const T> device_cache_of(const StepInputs<T>& in) {
    return kGpuSelector ? KVCache<const T>(in.cache) : in.device_cache;
  }

  static const typename S::context_type& selector_context(const SplitContext& ctx) {
    if constexpr (kGpuSelector) {
      return ctx.gpu;
    } else {
      return ctx.cpu;
    }
  }

  SplitStepBase(S selector, const DecodeStepConfig& config, const SplitContext& ctx, const char* where)
      : StepBase<S>(std::move(selector), config, selector_context(ctx), where), planned_pool_(ctx.cpu.pool) {
    refuse_second_source(where, this->selector_, "in placement::Local");
  }

  /// The checks every split run makes before the selector runs (a refused call leaves the selector as it was).
  void check_split_run(const char* where, const StepInputs<T>& in, std::int32_t batch, const SplitContext& ctx,
                       const SplitWorkspace& workspace) {
    this->check_run(where, batch, selector_context(ctx));
    KVSIFT_CHECK(ctx.cpu.pool == planned_pool_, where,
                 "ctx.cpu.pool ({}) is not the pool the step was planned with ({}): the CPU's scratch is sized for it",
                 static_cast<const void*>(ctx.cpu.pool), static_cast<const void*>(planned_pool_));
    KVSIFT_CHECK(in.k.data == nullptr && in.v.data == nullptr, where,
                 "in.k or in.v is set: a split step reads caches the engine has written the step's token to");
    KVSIFT_CHECK(in.q.batch == batch && in.cache.batch() == batch, where,
                 "in.q.batch (= {}) and in.cache's batch (= {}) must be the run's batch (= {})", in.q.batch,
                 in.cache.batch(), batch);
    KVSIFT_CHECK(in.slots != nullptr, where, "in.slots is a null pointer");
    const KVCache<const T> host_cache = host_cache_of(in);
    const char* host_name = kGpuSelector ? "in.host_cache" : "in.cache";
    if constexpr (kGpuSelector) {
      KVSIFT_CHECK(in.q_device.data == nullptr && in.device_cache.batch() == 0, where,
                   "in.q_device or in.device_cache is set: a GPU selector's in.q and in.cache are the device's");
      KVSIFT_CHECK(in.host_cache.batch() == batch, where, "in.host_cache's batch (= {}) must be the run's (= {})",
                   in.host_cache.batch(), batch);
    } else {
      KVSIFT_CHECK(in.host_cache.batch() == 0, where,
                   "in.host_cache is set: a CPU selector's host cache is in.cache, its device cache in.device_cache");
      KVSIFT_CHECK(in.q_device.batch == batch && in.device_cache.batch() == batch, where,
                   "in.q_device.batch (= {}) and in.device_cache's batch (= {}) must be the run's batch (= {})",
                   in.q_device.batch, in.device_cache.batch(), batch);
    }
    const auto& c = this->config_;
    host_cache.visit([&](const auto& kv) {
      validate(kv, where, host_name, MemorySpace::host);
      KVSIFT_CHECK(kv.kv_heads == c.kv_heads && kv.head_dim == c.head_dim, where,
                   "{} has {} kv heads of head_dim {}; the step was planned for {} and {}", host_name, kv.kv_heads,
                   kv.head_dim, c.kv_heads, c.head_dim);
    });
    pinned_.require(host_cache, gpu_reads_host_tables_, where, host_name);
    pinned_.require(workspace.host.data(), where, "workspace.host");
  }

  static double seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }
  /// Sizes the workspace by running the placement's layout in counting mode.
  template <class Layout>
  void count_workspace(Layout&& layout) {
    WorkspaceLayout device, host;
    layout(device, host);
    bytes_ = {.device = device.bytes(), .host = host.bytes()};
  }

  /// Which of the host cache's arrays must be pinned: K and V (MiddleOnCpu, as cuda::HybridDecoder requires), or
  /// also its lengths and page table, which MiddleOnGpu's gather reads from the GPU.
  cuda::PinnedHostCheck::Arrays gpu_reads_host_tables_ = cuda::PinnedHostCheck::Arrays::kv;
  StepStats stats_;
  SplitWorkspaceBytes bytes_;

 private:
  cpu::ThreadPool* planned_pool_;
  cuda::PinnedHostCheck pinned_;  ///< the host cache's arrays and the workspace's host block, checked once each
};

/// A GPU selector's host stage object (selectors/selector.hpp HasHostStage); nothing for other selectors.
template <class S>
struct HostStageOf {
  using type = std::monostate;
};
template <class S>
  requires(HasHostStage<S> && S::context_type::memory == MemorySpace::device)
struct HostStageOf<S> {
  using type = decltype(std::declval<const S&>().host_stage());
};

}  // namespace detail

template <KVSelector S>
  requires placement::Fits<placement::MiddleOnCpu, typename S::context_type>
class DecodeStep<S, placement::MiddleOnCpu> : public detail::SplitStepBase<S> {
  using Base = detail::SplitStepBase<S>;
  using Base::config_;
  using Base::kGpuSelector;
  using Base::part_;
  using Base::selector_;
  using Base::stats_;
  using Part = detail::SelectorPart<S>;
  static constexpr const char* kName = "DecodeStep<MiddleOnCpu>";
  /// A GPU selector with a host stage runs only its recall on the GPU (selectors/selector.hpp HasHostStage).
  static constexpr bool kHostStage = kGpuSelector && HasHostStage<S>;

 public:
  using value_type = typename S::value_type;
  using T = value_type;
  using context_type = SplitContext;

  /// Plans the selector's part for config.max_batch rows on its context and the decoder for ctx.cpu.pool.
  DecodeStep(S selector, const DecodeStepConfig& config, const SplitContext& ctx)
      : Base(std::move(selector), config, ctx, kName),
        log_weights_(selector_writes_log_weights(selector_)),
        decoder_({.batch = config.max_batch, .q_heads = config.q_heads, .kv_heads = config.kv_heads,
                  .head_dim = config.head_dim, .attention = config.attention,
                  .validate_indices = config.validate_indices},
                 ctx.cpu.pool),
        host_stage_(make_host_stage(selector_)) {
    if constexpr (kHostStage) {
      candidate_capacity_ = selector_.candidate_capacity(config.max_seq_len);
      recall_bytes_ = selector_.recall_workspace_bytes(
          {config.max_batch, config.q_heads, config.kv_heads, config.head_dim, config.max_seq_len}, ctx.gpu);
      host_stage_bytes_ = host_stage_.workspace_bytes(config.max_batch, candidate_capacity_, ctx.cpu);
    }
    this->count_workspace([&](WorkspaceLayout& device, WorkspaceLayout& host) { layout(device, host); });
  }

  /// The last run over `workspace`: its selection (host memory, token ids; its log-weights when the selector
  /// writes them), valid until the next run.
  SelectionView selection(const SplitWorkspace& workspace) const {
    WorkspaceLayout device(workspace.device, "DecodeStep::selection"), host(workspace.host, "DecodeStep::selection");
    return host_selection(layout(device, host));
  }

  /// One step (see step/split_step.hpp); `out` [max_batch, q_heads, head_dim] in T, LSE natural log, device memory.
  void run(const StepInputs<T>& in, const StateView<T>& out, const SplitWorkspace& workspace, const SplitContext& ctx) {
    constexpr const char* where = "DecodeStep<MiddleOnCpu>::run";
    const auto begin = Base::Clock::now();
    const std::int32_t batch = config_.max_batch;
    KVSIFT_CHECK(in.q.batch == batch, where, "in.q.batch (= {}) must be config.max_batch (= {})", in.q.batch, batch);
    this->check_split_run(where, in, batch, ctx, workspace);
    if constexpr (kGpuSelector) {
      // One 2D copy moves the query: its head rows must be evenly spaced across batch rows too.
      KVSIFT_CHECK(in.q.batch_stride == std::int64_t(in.q.heads) * in.q.head_stride, where,
                   "in.q.batch_stride (= {}) must be heads * head_stride (= {}): the step copies the query's rows to "
                   "the host in one copy",
                   in.q.batch_stride, std::int64_t(in.q.heads) * in.q.head_stride);
    }
    validate(in.q, where, "in.q");
    KVSIFT_CHECK(in.q.heads == config_.q_heads && in.q.head_dim == config_.head_dim, where,
                 "in.q has {} heads of head_dim {}; the step was planned for {} and {}", in.q.heads, in.q.head_dim,
                 config_.q_heads, config_.head_dim);
    validate(out, where, "out");
    KVSIFT_CHECK(out.batch == batch && out.heads == config_.q_heads && out.head_dim == config_.head_dim, where,
                 "out is [{}, {}, {}]; the step writes [{}, {}, {}]", out.batch, out.heads, out.head_dim, batch,
                 config_.q_heads, config_.head_dim);
    WorkspaceLayout device_block(workspace.device, where), host_block(workspace.host, where);
    const Buffers b = layout(device_block, host_block);

    // The selection, on the selector's side; a GPU selector's copied to the host with the query (a host stage's
    // candidates instead, the selection finished on the CPU).
    const auto& selector_ctx = Base::selector_context(ctx);
    if (config_.validate_indices) detail::check_device_slots(where, selector_, in.slots, batch, selector_ctx);
    QueryView<const T> q_host = in.q;
    if constexpr (kHostStage) {
      q_host = select_in_stages(in, b, ctx);
    } else if constexpr (kGpuSelector) {
      part_.run(selector_, this->selector_inputs(in), b.part, selector_ctx);
      const std::size_t rows = this->rows(), index_bytes = rows * std::size_t(part_.capacity()) * sizeof(std::int32_t);
      const cudaStream_t stream = ctx.gpu.stream;
      copy_to_host(b.part.counts, b.h_counts, rows * sizeof(std::int32_t), stream);
      copy_to_host(b.part.indices, b.h_indices, index_bytes, stream);
      if (log_weights_) copy_to_host(b.part.log_weights, b.h_log_weights, index_bytes, stream);
      q_host = copy_query_to_host(in.q, b, stream);
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      stats_.to_host_bytes = rows * sizeof(std::int32_t) + index_bytes * (log_weights_ ? 2 : 1) + query_bytes();
    } else {
      part_.run(selector_, this->selector_inputs(in), b.part, selector_ctx);
    }
    const auto selected = Base::Clock::now();

    // The window on the GPU, the selection on the CPU, merged on the stream.
    const QueryView<const T> q_device = kGpuSelector ? in.q : in.q_device;
    const KVCache<const T> device_cache = Base::device_cache_of(in), host_cache = Base::host_cache_of(in);
    device_cache.visit([&](const auto& device_kv) {
      host_cache.visit([&](const auto& host_kv) {
        decoder_.decode(q_device, q_host, device_kv, host_kv, host_selection(b), out, b.decoder, ctx.gpu.stream);
      });
    });
    stats_.select_seconds = Base::seconds(begin, selected);
    stats_.cpu_attention_seconds = decoder_.last_step_times().cpu_seconds;
    stats_.to_device_bytes = std::size_t(batch) * std::size_t(config_.q_heads) *
                                 (std::size_t(config_.head_dim) + 1) * sizeof(float) +
                             update_bytes_;
    stats_.call_seconds = Base::seconds(begin, Base::Clock::now());
  }

 private:
  struct Buffers {
    typename Part::Buffers part;  ///< in the selector's memory: the device block for a GPU selector, else the host's
    std::int32_t* h_counts = nullptr;  ///< a GPU selector's selection (copied, or a host stage's) and query
    std::int32_t* h_indices = nullptr;
    float* h_log_weights = nullptr;
    T* h_q = nullptr;
    /// A host stage's: the recall's candidates and the update's entries on both sides, the host lengths, scratch.
    std::int32_t *d_candidates = nullptr, *d_candidate_counts = nullptr, *h_candidates = nullptr,
                 *h_candidate_counts = nullptr;
    std::int32_t *d_entries = nullptr, *d_entry_counts = nullptr, *h_entries = nullptr, *h_entry_counts = nullptr;
    std::int32_t *d_replaced = nullptr, *h_lengths = nullptr;
    std::span<std::byte> recall, host_stage;
    SplitWorkspace decoder;
  };

  std::size_t rows() const { return std::size_t(config_.max_batch) * std::size_t(config_.kv_heads); }
  std::size_t query_bytes() const {
    return std::size_t(config_.max_batch) * std::size_t(config_.q_heads) * std::size_t(config_.head_dim) * sizeof(T);
  }

  /// Enqueues the query's copy into the host block (one 2D copy) and returns its host view.
  QueryView<const T> copy_query_to_host(const QueryView<const T>& q, const Buffers& b, cudaStream_t stream) const {
    const std::size_t row_bytes = std::size_t(config_.head_dim) * sizeof(T);
    KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(b.h_q, row_bytes, q.data, std::size_t(q.head_stride) * sizeof(T), row_bytes,
                                        std::size_t(config_.max_batch) * std::size_t(config_.q_heads),
                                        cudaMemcpyDeviceToHost, stream));
    return QueryView<const T>::packed(b.h_q, config_.max_batch, config_.q_heads, config_.head_dim);
  }

  /// A host stage's select (selectors/selector.hpp HasHostStage, CTKVR's §3.2): lengths, append and recall on the
  /// GPU; the candidates' counts and the query copied to the host, then their rows up to the longest (two stream
  /// synchronizations); the host stage over the host cache on the CPU into the host selection (and the update's
  /// entries); the entries copied back and the update applied on the GPU. Returns the query's host view.
  QueryView<const T> select_in_stages(const StepInputs<T>& in, const Buffers& b, const SplitContext& ctx)
    requires kHostStage
  {
    const cudaStream_t stream = ctx.gpu.stream;
    const std::size_t rows = this->rows();
    const detail::SelectorStepInputs<T> selector_in = this->selector_inputs(in);
    part_.append(selector_, selector_in, b.part, ctx.gpu);
    selector_.recall(part_.select_inputs(selector_in, b.part), candidates(b.d_candidates, b.d_candidate_counts),
                     b.recall, ctx.gpu);
    copy_to_host(b.d_candidate_counts, b.h_candidate_counts, rows * sizeof(std::int32_t), stream);
    const QueryView<const T> q_host = copy_query_to_host(in.q, b, stream);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::int32_t longest = std::max(0, *std::max_element(b.h_candidate_counts, b.h_candidate_counts + rows));
    const std::size_t pitch = std::size_t(candidate_capacity_) * sizeof(std::int32_t);
    if (longest > 0) {
      KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(b.h_candidates, pitch, b.d_candidates, pitch,
                                          std::size_t(longest) * sizeof(std::int32_t), rows, cudaMemcpyDeviceToHost,
                                          stream));
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    stats_.to_host_bytes = rows * sizeof(std::int32_t) * (1 + std::size_t(longest)) + query_bytes();

    sequence_lengths(in.host_cache, b.h_lengths, ctx.cpu);
    const std::int32_t update = selector_.update_capacity();
    const SelectionView host_entries{b.h_entries, b.h_entry_counts, nullptr, config_.max_batch, config_.kv_heads,
                                     update};
    host_stage_.run(q_host, in.host_cache, b.h_lengths, config_.attention,
                    candidates(b.h_candidates, b.h_candidate_counts), host_selection(b),
                    update > 0 ? host_entries : SelectionView{}, b.host_stage, ctx.cpu);
    update_bytes_ = 0;
    if (update > 0) {
      // The copies leave the host block before the next run writes it: that run synchronizes the stream first.
      const std::size_t entry_bytes = rows * std::size_t(update) * sizeof(std::int32_t);
      KVSIFT_CUDA_CHECK(cudaMemcpyAsync(b.d_entries, b.h_entries, entry_bytes, cudaMemcpyHostToDevice, stream));
      KVSIFT_CUDA_CHECK(cudaMemcpyAsync(b.d_entry_counts, b.h_entry_counts, rows * sizeof(std::int32_t),
                                        cudaMemcpyHostToDevice, stream));
      selector_.update(in.q, in.slots,
                       {b.d_entries, b.d_entry_counts, nullptr, config_.max_batch, config_.kv_heads, update},
                       b.d_replaced, ctx.gpu);
      update_bytes_ = entry_bytes + rows * sizeof(std::int32_t);
    }
    return q_host;
  }
  SelectionView candidates(std::int32_t* ids, std::int32_t* counts) const {
    return {ids, counts, nullptr, config_.max_batch, config_.kv_heads, candidate_capacity_};
  }

  SelectionView host_selection(const Buffers& b) const {
    if constexpr (kGpuSelector) {
      return {b.h_indices, b.h_counts, b.h_log_weights, config_.max_batch, config_.kv_heads, part_.capacity()};
    } else {
      return part_.selection(b.part, config_.max_batch);
    }
  }

  static void copy_to_host(const void* src, void* dst, std::size_t bytes, cudaStream_t stream) {
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  }

  /// The one layout behind workspace_bytes() (counting) and run() (carving).
  Buffers layout(WorkspaceLayout& device, WorkspaceLayout& host) const {
    Buffers b;
    b.part = part_.layout(kGpuSelector ? device : host);
    if constexpr (kGpuSelector) {
      const std::size_t entries = rows() * std::size_t(part_.capacity());
      b.h_counts = host.allocate<std::int32_t>(rows(), "DecodeStep host selection counts");
      b.h_indices = host.allocate<std::int32_t>(entries, "DecodeStep host selection indices");
      if (log_weights_) b.h_log_weights = host.allocate<float>(entries, "DecodeStep host selection log-weights");
      b.h_q = host.allocate<T>(std::size_t(config_.max_batch) * std::size_t(config_.q_heads) *
                                   std::size_t(config_.head_dim),
                               "DecodeStep host query");
    }
    if constexpr (kHostStage) {
      const std::size_t candidates = rows() * std::size_t(candidate_capacity_);
      const std::size_t entries = rows() * std::size_t(selector_.update_capacity());
      b.d_candidates = device.allocate<std::int32_t>(candidates, "DecodeStep candidates");
      b.d_candidate_counts = device.allocate<std::int32_t>(rows(), "DecodeStep candidate counts");
      b.d_entries = device.allocate<std::int32_t>(entries, "DecodeStep update entries");
      b.d_entry_counts = device.allocate<std::int32_t>(rows(), "DecodeStep update entry counts");
      b.d_replaced = device.allocate<std::int32_t>(rows(), "DecodeStep update scratch");
      b.recall = device.span(recall_bytes_, "DecodeStep recall scratch");
      b.h_candidates = host.allocate<std::int32_t>(candidates, "DecodeStep host candidates");
      b.h_candidate_counts = host.allocate<std::int32_t>(rows(), "DecodeStep host candidate counts");
      b.h_entries = host.allocate<std::int32_t>(entries, "DecodeStep host update entries");
      b.h_entry_counts = host.allocate<std::int32_t>(rows(), "DecodeStep host update entry counts");
      b.h_lengths = host.allocate<std::int32_t>(std::size_t(config_.max_batch), "DecodeStep host lengths");
      b.host_stage = host.span(host_stage_bytes_, "DecodeStep host stage scratch");
    }
    const SplitWorkspaceBytes decoder = decoder_.workspace_bytes();
    b.decoder = {.device = device.span(decoder.device, "DecodeStep decoder (device)"),
                 .host = host.span(decoder.host, "DecodeStep decoder (host)")};
    return b;
  }

  static typename detail::HostStageOf<S>::type make_host_stage(const S& selector) {
    if constexpr (kHostStage) {
      return selector.host_stage();
    } else {
      return {};
    }
  }

  bool log_weights_;
  cuda::HybridDecoder<T> decoder_;
  [[no_unique_address]] typename detail::HostStageOf<S>::type host_stage_;  ///< a host stage's object, if any
  std::int32_t candidate_capacity_ = 0;
  std::size_t recall_bytes_ = 0, host_stage_bytes_ = 0, update_bytes_ = 0;
};

/// CPU selectors only (placement::Fits): a GPU selector's middle on the GPU is placement::Local.
template <KVSelector S>
  requires placement::Fits<placement::MiddleOnGpu, typename S::context_type>
class DecodeStep<S, placement::MiddleOnGpu> : public detail::SplitStepBase<S> {
  using Base = detail::SplitStepBase<S>;
  using Base::config_;
  using Base::part_;
  using Base::selector_;
  using Base::stats_;
  using Part = detail::SelectorPart<S>;

 public:
  using value_type = typename S::value_type;
  using T = value_type;
  using context_type = SplitContext;

  /// Plans every batch of 1 .. config.max_batch rows for ctx.cpu.pool (a larger pool is refused by run()).
  DecodeStep(S selector, const DecodeStepConfig& config, const SplitContext& ctx)
      : Base(std::move(selector), config, ctx, "DecodeStep<MiddleOnGpu>"),
        log_weights_(selector_writes_log_weights(selector_)) {
    this->gpu_reads_host_tables_ = cuda::PinnedHostCheck::Arrays::kv_and_tables;
    for (std::int32_t batch = 1; batch <= config.max_batch; ++batch) {
      const auto bytes = [&](std::int32_t capacity, const AttentionOptions& attention) {
        return cuda::sparse_decode_workspace_bytes(
            cuda::SparseDecodeShape{batch, config.q_heads, config.kv_heads, config.head_dim, capacity},
            cuda::DecodeOptions{.attention = attention});
      };
      decode_bytes_ = std::max({decode_bytes_, bytes(1, config.attention), bytes(part_.capacity(), staged_attention())});
    }
    this->count_workspace([&](WorkspaceLayout& device, WorkspaceLayout& host) { layout(device, host); });
  }

  /// The last run over `workspace`: its selection (pinned host memory, token ids; its log-weights when the selector
  /// writes them), valid until the next run.
  SelectionView selection(const SplitWorkspace& workspace) const {
    WorkspaceLayout device(workspace.device, "DecodeStep::selection"), host(workspace.host, "DecodeStep::selection");
    return part_.selection(layout(device, host).part, last_batch_);
  }

  /// One step (see step/split_step.hpp); `out` [batch, q_heads, head_dim] in T or fp32, LSE natural log, device
  /// memory.
  template <class TO>
    requires(std::same_as<TO, T> || std::same_as<TO, float>)
  void run(const StepInputs<T>& in, const StateView<TO>& out, const SplitWorkspace& workspace,
           const SplitContext& ctx) {
    constexpr const char* where = "DecodeStep<MiddleOnGpu>::run";
    const auto begin = Base::Clock::now();
    const std::int32_t batch = in.q.batch;
    this->check_split_run(where, in, batch, ctx, workspace);
    WorkspaceLayout device_block(workspace.device, where), host_block(workspace.host, where);
    const Buffers b = layout(device_block, host_block);
    const cudaStream_t stream = ctx.gpu.stream;
    const std::size_t rows = std::size_t(batch) * std::size_t(config_.kv_heads);
    const std::int32_t capacity = part_.capacity();

    // 1. The window, from the device cache, while the host searches.
    const StateView<float> window = partial(b.window_o, b.window_lse, batch);
    const SelectionView nothing{b.identity, b.counts, nullptr, batch, config_.kv_heads, 1};
    cuda::clear_counts(nothing, stream);
    cuda::sparse_decode(in.q_device, in.device_cache, nothing, window, config_.attention, false,
                        config_.programmatic_launch, b.decode, ctx.gpu);

    // 2. The search, into the pinned host block, once the previous run's copies out of it are done.
    copied_.wait();
    const auto select_start = Base::Clock::now();
    part_.run(selector_, this->selector_inputs(in), b.part, ctx.cpu);
    stats_.select_seconds = Base::seconds(select_start, Base::Clock::now());
    last_batch_ = batch;
    const SelectionView host_selection = part_.selection(b.part, batch);
    if (config_.validate_indices) {
      KVCache<const T>(in.cache).visit([&](const auto& kv) {
        validate(host_selection, kv, where, "the selection");
        check_selection_contents(host_selection, kv, where, "the selection", /*refuse_duplicates=*/true,
                                 config_.attention.window);
      });
    }

    // 3. The selection to the device: counts, then the rows up to the longest.
    std::size_t longest = 0, gathered = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      const std::int32_t count = b.part.counts[r];
      if (count < 0 || count > capacity) continue;  // a bad row: nothing gathered, NaN out
      longest = std::max(longest, std::size_t(count));
      gathered += std::size_t(count);
    }
    const std::size_t pitch = std::size_t(capacity) * sizeof(std::int32_t), width = longest * sizeof(std::int32_t);
    KVSIFT_CUDA_CHECK(
        cudaMemcpyAsync(b.counts, b.part.counts, rows * sizeof(std::int32_t), cudaMemcpyHostToDevice, stream));
    stats_.to_device_bytes = rows * sizeof(std::int32_t);
    if (longest > 0) {
      KVSIFT_CUDA_CHECK(
          cudaMemcpy2DAsync(b.indices, pitch, b.part.indices, pitch, width, rows, cudaMemcpyHostToDevice, stream));
      stats_.to_device_bytes += rows * width;
      if (log_weights_) {
        static_assert(sizeof(float) == sizeof(std::int32_t));
        KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(b.log_weights, pitch, b.part.log_weights, pitch, width, rows,
                                            cudaMemcpyHostToDevice, stream));
        stats_.to_device_bytes += rows * width;
      }
    }
    copied_.record(stream);

    // 4. The selected rows, from the pinned host cache into staging slots 0 .. count.
    const SelectionView device_selection{b.indices, b.counts, nullptr, batch, config_.kv_heads, capacity};
    const auto staging = ContiguousKVView<T>::packed(b.staging_k, b.staging_v, batch, config_.kv_heads, capacity,
                                                     config_.head_dim);
    cuda::gather_kv(KVCache<const T>(in.cache), device_selection, KVCache<T>(staging), stream);
    stats_.gathered_kv_bytes = gathered * 2 * std::size_t(config_.head_dim) * sizeof(T);

    // 5. The staging rows with their log-weights, then both partials merged into `out`.
    const StateView<float> staged = partial(b.staged_o, b.staged_lse, batch);
    const SelectionView staged_rows{b.identity, b.counts, b.log_weights, batch, config_.kv_heads, capacity};
    cuda::write_identity_indices(staged_rows, stream);
    cuda::sparse_decode(in.q_device, KVCache<const T>(staging), staged_rows, staged, staged_attention(), false,
                        config_.programmatic_launch, b.decode, ctx.gpu);
    const StateView<const float> partials[] = {window.as_const(), staged.as_const()};
    cuda::merge_states<float, TO>(partials, out, stream);
    stats_.call_seconds = Base::seconds(begin, Base::Clock::now());
  }

 private:
  struct Buffers {
    typename Part::Buffers part;                 ///< host block: the selector's buffers, copied from
    float *window_o = nullptr, *window_lse = nullptr;  ///< the window's fp32 partial
    float *staged_o = nullptr, *staged_lse = nullptr;  ///< the staging rows' fp32 partial
    T *staging_k = nullptr, *staging_v = nullptr;      ///< [max_batch, kv_heads, capacity, head_dim]
    std::int32_t *indices = nullptr, *counts = nullptr;  ///< the host selection's copy (token ids)
    float* log_weights = nullptr;                        ///< its log-weights' copy, when the selector writes them
    std::int32_t* identity = nullptr;  ///< [max_batch * kv_heads, capacity]: entry i is i (staging slot i)
    std::span<std::byte> decode;       ///< both sparse decodes' scratch (they run in turn on the stream)
  };

  /// The staging rows are attended whole: the step's scale, no window (the window is the other partial's).
  AttentionOptions staged_attention() const { return {.sm_scale = config_.attention.sm_scale}; }
  StateView<float> partial(float* o, float* lse, std::int32_t batch) const {
    return StateView<float>::packed(o, lse, batch, config_.q_heads, config_.head_dim);
  }

  /// The one layout behind workspace_bytes() (counting) and run() (carving). The window's empty selection reuses
  /// the copied counts (cleared first, then overwritten by the selection's copy in stream order).
  Buffers layout(WorkspaceLayout& device, WorkspaceLayout& host) const {
    const std::size_t rows = std::size_t(config_.max_batch) * std::size_t(config_.kv_heads);
    const std::size_t capacity = std::size_t(part_.capacity());
    const std::size_t states = std::size_t(config_.max_batch) * std::size_t(config_.q_heads);
    const std::size_t staging = rows * capacity * std::size_t(config_.head_dim);
    Buffers b;
    b.part = part_.layout(host);
    b.window_o = device.allocate<float>(states * std::size_t(config_.head_dim), "DecodeStep window O");
    b.window_lse = device.allocate<float>(states, "DecodeStep window LSE");
    b.staged_o = device.allocate<float>(states * std::size_t(config_.head_dim), "DecodeStep staged O");
    b.staged_lse = device.allocate<float>(states, "DecodeStep staged LSE");
    b.staging_k = device.allocate<T>(staging, "DecodeStep staging K");
    b.staging_v = device.allocate<T>(staging, "DecodeStep staging V");
    b.indices = device.allocate<std::int32_t>(rows * capacity, "DecodeStep selection indices");
    b.counts = device.allocate<std::int32_t>(rows, "DecodeStep selection counts");
    if (log_weights_) b.log_weights = device.allocate<float>(rows * capacity, "DecodeStep selection log-weights");
    b.identity = device.allocate<std::int32_t>(rows * capacity, "DecodeStep identity indices");
    b.decode = device.span(decode_bytes_, "DecodeStep decode scratch");
    return b;
  }

  bool log_weights_;
  std::size_t decode_bytes_ = 0;
  std::int32_t last_batch_ = 1;
  cuda::HostBlockFence copied_;  ///< the last run's selection copies out of the host block
};

}  // namespace kvsift
