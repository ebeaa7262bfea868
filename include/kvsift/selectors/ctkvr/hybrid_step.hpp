#pragma once
/// CtkvrHybridStep: CTKVR in the paper's hybrid placement (its §3.2). The index (centroids and lists) and the
/// recall stay on the GPU; the rerank and the attention of the selection run on the CPU over the pinned host copy
/// of the middle; the window is attended on the GPU; the two partial states merge by LSE on the GPU
/// (cuda::HybridDecoder, step/hybrid_decoder.hpp). The dynamic update's new list comes out of the CPU's rerank and
/// is copied back into the GPU's index. HybridDecodeStep (step/hybrid_step.hpp) is the other arrangement: the
/// whole selector on the CPU.
///
/// run() per step, on the calling thread and ctx.pool:
///   1. GPU (`stream`): the lengths from the device cache, then Ctkvr::recall into device candidates;
///   2. the candidates' counts, then their rows (up to the longest count), copied into pinned host memory: two
///      stream synchronizations, since the CPU needs them;
///   3. CPU: CtkvrRerank over the host cache gives the selection (host memory) and the new list;
///   4. GPU (`stream`): the new list copied in, Ctkvr::update (replace_list, store_centroids);
///   5. HybridDecoder::decode: the window on the GPU while the CPU attends the selection, then the merge on `stream`.
/// It returns once the merge is enqueued; last_step_times() tells where the host's time went.
///
/// Memory: q_device, device_cache and `out` on the device; q_host, host_cache (pinned, the middle's rows at their
/// positions, lengths on the host) and slots on the host, as HybridDecodeStep. The device cache holds the whole
/// prompt at prepare (the index is built on the GPU from it); afterwards only the window's rows are read from
/// it. The engine writes each step's token to both caches before run(). Every step has config.max_batch rows.
/// Allocation: every buffer in the constructor (prepare allocates its scratch); run() allocates nothing.
/// Thread safety: one step serves one thread at a time.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <cuda_runtime_api.h>

#include "kvsift/core/error.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/selectors/ctkvr/ctkvr.hpp"
#include "kvsift/step/decode_step.hpp"
#include "kvsift/step/hybrid_decoder.hpp"
#include "kvsift/step/hybrid_step.hpp"

namespace kvsift {

/// Host-side times of the last CtkvrHybridStep::run, in seconds.
struct CtkvrHybridTimes {
  double recall = 0;  ///< enqueue the recall and wait for its candidates on the host (steps 1 and 2)
  double rerank = 0;  ///< the CPU's rerank (step 3)
  cuda::HybridStepTimes attention;  ///< the decoder's: the CPU's attention, and its whole call (step 5)
};

template <class T>
class CtkvrHybridStep {
 public:
  using value_type = T;

  CtkvrHybridStep(const SelectorLimits& limits, const CtkvrConfig& config, const DecodeStepConfig& step,
                  cpu::ThreadPool* pool = nullptr)
      : index_(checked(step, limits), config),
        rerank_(limits, index_.config()),
        config_(step),
        rows_(std::size_t(step.max_batch) * std::size_t(limits.kv_heads)),
        candidate_capacity_(index_.candidate_capacity(max_seq_len(step, limits))),
        recall_workspace_(index_.recall_workspace_bytes({.batch = step.max_batch, .q_heads = step.q_heads,
                                                         .kv_heads = step.kv_heads, .head_dim = step.head_dim,
                                                         .max_seq_len = step.max_seq_len},
                                                        {})),
        d_candidates_(rows_ * std::size_t(candidate_capacity_)),
        d_counts_(rows_),
        d_lengths_(std::size_t(step.max_batch)),
        d_slots_(std::size_t(step.max_batch)),
        d_entries_(rows_ * std::size_t(index_.config().list_size)),
        d_entry_counts_(rows_),
        d_replaced_(rows_),
        h_candidates_(rows_ * std::size_t(candidate_capacity_)),
        h_counts_(rows_),
        h_slots_(std::size_t(step.max_batch)),
        h_entries_(rows_ * std::size_t(index_.config().list_size)),
        h_entry_counts_(rows_),
        h_lengths_(std::size_t(step.max_batch)),
        selected_(rows_ * std::size_t(index_.capacity())),
        selected_counts_(rows_),
        rerank_workspace_(rerank_.workspace_bytes(step.max_batch, candidate_capacity_, cpu::Context{pool})),
        decoder_({.batch = step.max_batch, .q_heads = step.q_heads, .kv_heads = step.kv_heads,
                  .head_dim = step.head_dim, .attention = step.attention, .validate_indices = step.validate_indices},
                 pool) {}

  const Ctkvr<T, cuda::Context>& index() const { return index_; }
  const DecodeStepConfig& config() const { return config_; }
  /// The last run's selection (host memory, token ids), valid until the next run.
  SelectionView selection() const {
    return {selected_.data(), selected_counts_.data(), nullptr, config_.max_batch, config_.kv_heads, index_.capacity()};
  }
  const CtkvrHybridTimes& last_step_times() const { return times_; }

  /// Builds the joining sequences' index on the GPU: in.cache (device) holds their prompts, in.queries and in.slots
  /// are in device memory. Allocates scratch and synchronizes the stream (Ctkvr::prepare).
  void prepare(PrefillInputs<T> in, const cuda::Context& ctx) {
    in.attention = config_.attention;
    index_.prepare(in, ctx);
  }

  void run(const HybridStepInputs<T>& in, const StateView<T>& out, cudaStream_t stream, const cpu::Context& cpu) {
    constexpr const char* where = "CtkvrHybridStep::run";
    const std::int32_t batch = config_.max_batch;
    KVSIFT_CHECK(in.q_device.batch == batch && in.q_host.batch == batch && in.host_cache.batch() == batch &&
                     in.device_cache.batch() == batch,
                 where,
                 "in.q_device.batch (= {}), in.q_host.batch (= {}) and the caches' batches (device {}, host {}) must "
                 "be config.max_batch (= {})",
                 in.q_device.batch, in.q_host.batch, in.device_cache.batch(), in.host_cache.batch(), batch);
    KVSIFT_CHECK(in.slots != nullptr, where, "in.slots is a null pointer");
    detail::check_slots_prepared(where, index_, std::span<const std::int32_t>(in.slots, std::size_t(batch)));
    const cuda::Context gpu{stream};
    const auto begin = std::chrono::steady_clock::now();

    // 1. The recall on the GPU.
    std::copy_n(in.slots, batch, h_slots_.data());
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_slots_.data(), h_slots_.data(), std::size_t(batch) * sizeof(std::int32_t),
                                      cudaMemcpyHostToDevice, stream));
    sequence_lengths(in.device_cache, d_lengths_.data(), gpu);
    const SelectInputs<T> device_in{.q = in.q_device, .cache = in.device_cache, .slots = d_slots_.data(),
                                    .lengths = d_lengths_.data(), .attention = config_.attention,
                                    .layer = in.layer, .max_seq_len = config_.max_seq_len};
    index_.recall(device_in, candidates(d_candidates_.data(), d_counts_.data()),
                  {recall_workspace_.data(), recall_workspace_.size()}, gpu);

    // 2. Its candidates on the host: the counts, then each row up to the longest.
    const std::size_t row_bytes = std::size_t(candidate_capacity_) * sizeof(std::int32_t);
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(h_counts_.data(), d_counts_.data(), rows_ * sizeof(std::int32_t),
                                      cudaMemcpyDeviceToHost, stream));
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::int32_t longest = *std::max_element(h_counts_.data(), h_counts_.data() + rows_);
    if (longest > 0) {
      KVSIFT_CUDA_CHECK(cudaMemcpy2DAsync(h_candidates_.data(), row_bytes, d_candidates_.data(), row_bytes,
                                          std::size_t(longest) * sizeof(std::int32_t), rows_, cudaMemcpyDeviceToHost,
                                          stream));
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    const auto recalled = std::chrono::steady_clock::now();

    // 3. The rerank on the CPU, over the host cache.
    sequence_lengths(in.host_cache, h_lengths_.data(), cpu);
    const bool update = index_.config().dynamic_update;
    const SelectionView host_entries = entries(h_entries_.data(), h_entry_counts_.data());
    rerank_.run(in.q_host, in.host_cache, h_lengths_.data(), config_.attention,
                candidates(h_candidates_.data(), h_counts_.data()), selection(),
                update ? host_entries : SelectionView{}, rerank_workspace_.bytes(), cpu);
    times_.rerank = seconds(recalled, std::chrono::steady_clock::now());
    times_.recall = seconds(begin, recalled);

    // 4. The dynamic update on the GPU's index.
    if (update) {
      KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_entries_.data(), h_entries_.data(), h_entries_.size() * sizeof(std::int32_t),
                                        cudaMemcpyHostToDevice, stream));
      KVSIFT_CUDA_CHECK(cudaMemcpyAsync(d_entry_counts_.data(), h_entry_counts_.data(), rows_ * sizeof(std::int32_t),
                                        cudaMemcpyHostToDevice, stream));
      index_.update(in.q_device, d_slots_.data(), entries(d_entries_.data(), d_entry_counts_.data()),
                    d_replaced_.data(), gpu);
    }

    // 5. The window on the GPU, the selection on the CPU, merged on the stream.
    const SelectionView sel = selection();
    in.device_cache.visit([&](const auto& device_kv) {
      in.host_cache.visit([&](const auto& host_kv) {
        decoder_.decode(in.q_device, in.q_host, device_kv, host_kv, sel, out, stream);
      });
    });
    times_.attention = decoder_.last_step_times();
  }

 private:
  /// The limits, once the step's configuration agrees with them (before any allocation).
  static const SelectorLimits& checked(const DecodeStepConfig& step, const SelectorLimits& limits) {
    constexpr const char* where = "CtkvrHybridStep";
    KVSIFT_CHECK(step.max_batch > 0 && step.max_batch <= limits.max_slots, where,
                 "config.max_batch (= {}) is outside [1, limits.max_slots = {}]", step.max_batch, limits.max_slots);
    KVSIFT_CHECK(step.q_heads == limits.q_heads && step.kv_heads == limits.kv_heads && step.head_dim == limits.head_dim,
                 where, "config's heads and head_dim ({}, {}, {}) differ from the selector limits' ({}, {}, {})",
                 step.q_heads, step.kv_heads, step.head_dim, limits.q_heads, limits.kv_heads, limits.head_dim);
    return limits;
  }
  static std::int32_t max_seq_len(const DecodeStepConfig& step, const SelectorLimits& limits) {
    return step.max_seq_len > 0 ? step.max_seq_len : limits.max_tokens;
  }
  static double seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }
  SelectionView candidates(std::int32_t* ids, std::int32_t* counts) const {
    return {ids, counts, nullptr, config_.max_batch, config_.kv_heads, candidate_capacity_};
  }
  SelectionView entries(std::int32_t* ids, std::int32_t* counts) const {
    return {ids, counts, nullptr, config_.max_batch, config_.kv_heads, index_.config().list_size};
  }

  Ctkvr<T, cuda::Context> index_;
  CtkvrRerank<T, cpu::Context> rerank_;
  DecodeStepConfig config_;
  std::size_t rows_;
  std::int32_t candidate_capacity_;
  cuda::Array<std::byte> recall_workspace_;
  cuda::Array<std::int32_t> d_candidates_, d_counts_, d_lengths_, d_slots_, d_entries_, d_entry_counts_, d_replaced_;
  cuda::PinnedArray<std::int32_t> h_candidates_, h_counts_, h_slots_, h_entries_, h_entry_counts_;
  std::vector<std::int32_t> h_lengths_;
  mutable std::vector<std::int32_t> selected_, selected_counts_;  ///< written by run(), viewed by selection()
  cpu::Array<std::byte> rerank_workspace_;
  cuda::HybridDecoder<T> decoder_;
  CtkvrHybridTimes times_;
};

}  // namespace kvsift
