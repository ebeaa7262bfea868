#pragma once
/// Hybrid CPU–GPU decode, as in CTKVR and A²ATS: each sequence's first `sink` and last `recent` tokens stay in
/// GPU memory (the window); the tokens between them are offloaded to pinned host memory. Per decode step the
/// GPU attends to the window on the caller's stream while the CPU attends to a selection of the offloaded
/// tokens; the CPU's (O, LSE) is copied to the device and merged with the window's by LSE on the stream.
///
/// Layouts: `window` is a device KV cache of capacity sink + recent holding, per sequence, its sink tokens then
/// its recent tokens (every sequence's window is full); `offloaded` is a pinned host KV cache holding, per
/// sequence, tokens [sink, n - recent) at positions 0.. (its seq_lens, host memory, give n - sink - recent);
/// `selection` (host) indexes positions of the offloaded cache. Outputs: O [batch, q_heads, head_dim] and LSE
/// (natural log), device memory.
///
/// Ownership and cost: the decoder owns the device and pinned buffers it needs, allocated once in the
/// constructor; decode() allocates nothing. decode() runs the CPU part on the calling thread (on `pool` if
/// given) and returns once the copy and merge are enqueued; it does not wait for the GPU, except that it first
/// waits for the previous step's copy of the CPU result (normally long finished) before overwriting it.
/// Thread safety: one decoder serves one thread at a time.

#include <cstdint>
#include <memory>
#include <span>

#include <cuda_runtime_api.h>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cuda {

struct HybridDecoderConfig {
  std::int32_t batch = 1;
  std::int32_t q_heads = 32;
  std::int32_t kv_heads = 8;
  std::int32_t head_dim = 128;
  std::int32_t sink = 4;    ///< leading tokens of each sequence kept on the GPU
  std::int32_t recent = 64; ///< trailing tokens of each sequence kept on the GPU
  AttentionOptions attention{};
};

/// Host-side timings of the last decode() (CPU part, and the whole call), for overlap measurements.
struct HybridStepTimes {
  double cpu_seconds = 0.0;
  double call_seconds = 0.0;
};

template <class T>
class HybridDecoder {
 public:
  explicit HybridDecoder(const HybridDecoderConfig& config, cpu::ThreadPool* pool = nullptr);
  ~HybridDecoder();
  HybridDecoder(const HybridDecoder&) = delete;
  HybridDecoder& operator=(const HybridDecoder&) = delete;

  /// q_device and q_host hold the same queries [batch, q_heads, head_dim] (device and host memory);
  /// seq_lens (host) are the sequences' full lengths n.
  void decode(const QueryView<const T>& q_device, const QueryView<const T>& q_host, std::span<const std::int32_t> seq_lens,
              const ContiguousKVView<const T>& window, const ContiguousKVView<const T>& offloaded,
              const SelectionView& selection, const StateView<T>& out, cudaStream_t stream);

  const HybridStepTimes& last_step_times() const { return times_; }

 private:
  struct Buffers;
  HybridDecoderConfig config_;
  cpu::ThreadPool* pool_;
  std::unique_ptr<Buffers> buffers_;
  HybridStepTimes times_;
};

extern template class HybridDecoder<half>;
extern template class HybridDecoder<bfloat16>;

}  // namespace kvsift::cuda
