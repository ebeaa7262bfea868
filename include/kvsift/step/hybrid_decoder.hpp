#pragma once
/// Hybrid CPU–GPU decode, as in CTKVR and A²ATS: each sequence's attention window (the first `sink` and last
/// `recent` tokens, config.attention.window) is attended on the GPU from the engine's own device KV cache,
/// while the CPU attends to a selection of the middle tokens from a pinned host copy of them. Both produce
/// fp32 partial states; the CPU's is copied to the device and the two are merged by LSE on the stream,
/// rounded once into the output.
///
/// Positions are absolute everywhere, as in every other kvsift call:
/// - `device_kv` (device memory, contiguous or paged, its seq_lens or page table on the device) gives the
///   sequences' full lengths n and holds at least each sequence's window tokens at their positions; no other
///   row is read, so the middle may be gone (its pages freed, its rows stale).
/// - `host_kv` (pinned host memory, contiguous or paged, lengths and page table in host memory) gives the
///   same lengths n and holds the middle tokens [sink, n - recent) at their positions; no other row is read.
/// - `selection` (host memory) lists, per (sequence, kv head), absolute positions of the middle: never a
///   window token (it would be attended twice), never twice the same. A sequence no longer than the window
///   has an empty middle: its rows have count 0. attend_all is refused: the host cache has no window tokens.
/// The two caches' lengths must agree; the device lengths are not read on the host, so this is not checked.
///
/// Per step, decode() (1) enqueues the window's attention on `stream` (cuda::sparse_decode with the window and
/// an all-empty selection the decoder keeps, into an fp32 state), (2) attends the selection on the calling
/// thread and `pool` (cpu::sparse_decode, no window, into an fp32 state in pinned memory) while the GPU works,
/// (3) enqueues the copy of that state to the device and cuda::merge_states<float, T> into `out`, and
/// returns. It does not wait for the GPU, except that before overwriting the pinned CPU state it waits for
/// the previous step's copy of it (normally long finished).
///
/// Memory: the caller's SplitWorkspace of workspace_bytes() (a device block and a pinned host block, 256-byte
/// aligned, contents irrelevant: every call writes what it reads, the window's empty counts included). The stream
/// reads the host block until it passes the merge; the next decode() waits for that copy before writing the block
/// again, so the same workspace serves consecutive steps. The constructor plans and creates one event; decode()
/// allocates nothing (except with config.validate_indices, which checks the selection on the host with a bitmap).
/// Outputs: O [batch, q_heads, head_dim] in T and LSE [batch, q_heads] (natural log), device memory.
/// Thread safety: one decoder serves one thread at a time.

#include <cstddef>
#include <cstdint>
#include <span>

#include <cuda_runtime_api.h>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "kvsift/cuda/pinned_host.hpp"

namespace kvsift {

/// The caller-owned memory of work on both sides of PCIe (cuda::HybridDecoder, the split placements of DecodeStep):
/// `device` in device memory, `host` in pinned host memory (cudaMallocHost or cudaHostRegister: copies read and
/// write it asynchronously), each 256-byte aligned and at least its planned bytes.
struct SplitWorkspace {
  std::span<std::byte> device{};
  std::span<std::byte> host{};
};
struct SplitWorkspaceBytes {
  std::size_t device = 0;
  std::size_t host = 0;
};

}  // namespace kvsift

namespace kvsift::cuda {

struct HybridDecoderConfig {
  std::int32_t batch = 1;
  std::int32_t q_heads = 32;
  std::int32_t kv_heads = 8;
  std::int32_t head_dim = 128;
  /// sm_scale for both parts, and the window the GPU attends (must not be empty).
  AttentionOptions attention{.window = {.sink = 4, .recent = 64}};
  /// Check the selection on the host before each step (counts, every index in the middle of its sequence,
  /// no index twice) and throw naming the first offending entry. Allocates a bitmap per call.
  bool validate_indices = false;
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

  /// The workspace decode() carves (shapes only, fixed at construction).
  SplitWorkspaceBytes workspace_bytes() const;

  /// One decode step (see above). q_device and q_host hold the same queries [batch, q_heads, head_dim]
  /// (device and host memory). DeviceKV and HostKV: ContiguousKVView<const T> or PagedKVView<const T>.
  template <class DeviceKV, class HostKV>
  void decode(const QueryView<const T>& q_device, const QueryView<const T>& q_host, const DeviceKV& device_kv,
              const HostKV& host_kv, const SelectionView& selection, const StateView<T>& out,
              const SplitWorkspace& workspace, cudaStream_t stream);

  const HybridDecoderConfig& config() const { return config_; }
  const HybridStepTimes& last_step_times() const { return times_; }

 private:
  struct Buffers;
  /// The one layout behind workspace_bytes() (counting) and decode() (carving).
  Buffers layout(WorkspaceLayout& device, WorkspaceLayout& host) const;

  HybridDecoderConfig config_;
  cpu::ThreadPool* pool_;
  std::size_t decode_bytes_ = 0, cpu_decode_bytes_ = 0;
  SplitWorkspaceBytes workspace_bytes_;
  HostBlockFence copied_;  ///< the last copy of the CPU state out of the host block
  HybridStepTimes times_;
  PinnedHostCheck pinned_;  ///< host_kv's K and V and the workspace's host block, checked once per array
};

/// The instances, written once with PREFIX: `extern` declares them here, nothing instantiates them
/// (src/step/hybrid_decoder.cpp).
#define KVSIFT_HYBRID_DECODE(PREFIX, T, DeviceKV, HostKV)                                                         \
  PREFIX template void HybridDecoder<T>::decode<DeviceKV, HostKV>(                                               \
      const QueryView<const T>&, const QueryView<const T>&, const DeviceKV&, const HostKV&, const SelectionView&, \
      const StateView<T>&, const SplitWorkspace&, cudaStream_t);
#define KVSIFT_HYBRID(PREFIX, T)                                                                                  \
  PREFIX template class HybridDecoder<T>;                                                                        \
  KVSIFT_HYBRID_DECODE(PREFIX, T, ContiguousKVView<const T>, ContiguousKVView<const T>)                          \
  KVSIFT_HYBRID_DECODE(PREFIX, T, ContiguousKVView<const T>, PagedKVView<const T>)                               \
  KVSIFT_HYBRID_DECODE(PREFIX, T, PagedKVView<const T>, ContiguousKVView<const T>)                               \
  KVSIFT_HYBRID_DECODE(PREFIX, T, PagedKVView<const T>, PagedKVView<const T>)
#define KVSIFT_DECLARE_HYBRID(T) KVSIFT_HYBRID(extern, T)
KVSIFT_DECODE_STORAGE_TYPES(KVSIFT_DECLARE_HYBRID)
#undef KVSIFT_DECLARE_HYBRID

}  // namespace kvsift::cuda
