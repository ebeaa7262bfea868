#include "kvsift/step/hybrid_decoder.hpp"

#include <chrono>
#include <cstdint>
#include <span>
#include <tuple>

#include "kvsift/cuda/decode.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/decode.hpp"
#include "kvsift/cuda/check.hpp"

namespace kvsift::cuda {

/// The decoder's share of the caller's workspace, carved per call.
template <class T>
struct HybridDecoder<T>::Buffers {
  float* d_window_o = nullptr;  ///< the window's fp32 partial state (device)
  float* d_window_lse = nullptr;
  std::int32_t* d_empty_counts = nullptr;   ///< [batch, kv_heads], zeroed per call: the window's selection lists nothing
  std::int32_t* d_empty_indices = nullptr;  ///< [batch, kv_heads, 1], never read
  // The CPU's fp32 partial, O then LSE, as one block in pinned host memory (as computed) and one on the
  // device (for the merge), so that a single copy moves it: one copy call in the step's serial tail.
  std::span<std::byte> h_cpu_partial, d_cpu_partial;
  float *h_cpu_o = nullptr, *h_cpu_lse = nullptr, *d_cpu_o = nullptr, *d_cpu_lse = nullptr;
  std::span<std::byte> d_decode;      ///< the window's sparse-decode scratch
  std::span<std::byte> h_cpu_decode;  ///< lets the CPU part split rows over all of the pool's threads

  SelectionView empty_selection(const HybridDecoderConfig& c) const {
    return {d_empty_indices, d_empty_counts, nullptr, c.batch, c.kv_heads, 1};
  }
};

template <class T>
HybridDecoder<T>::HybridDecoder(const HybridDecoderConfig& config, cpu::ThreadPool* pool)
    : config_(config), pool_(pool) {
  constexpr const char* where = "cuda::HybridDecoder";
  KVSIFT_CHECK(config.batch > 0 && config.q_heads > 0 && config.kv_heads > 0 && config.head_dim > 0, where,
               "batch (= {}), q_heads (= {}), kv_heads (= {}) and head_dim (= {}) must be positive", config.batch,
               config.q_heads, config.kv_heads, config.head_dim);
  validate(config.attention.window, where, "config.attention.window");
  KVSIFT_CHECK(!config.attention.window.empty(), where,
               "config.attention.window is empty: the GPU part attends the window (sink + recent > 0)");
  KVSIFT_CHECK(config.attention.selection_page_size == 1, where,
               "config.attention.selection_page_size (= {}) must be 1: the CPU part attends selections of tokens",
               config.attention.selection_page_size);
  KVSIFT_CHECK(config.attention.selection_rows == nullptr, where,
               "config.attention.selection_rows is set: the decoder's selection is given per call, one row per batch "
               "row, with no row map");
  decode_bytes_ = sparse_decode_workspace_bytes(
      SparseDecodeShape{config.batch, config.q_heads, config.kv_heads, config.head_dim, 1}, {.attention = config.attention});
  cpu_decode_bytes_ = cpu::decode_workspace_bytes(config.batch, config.q_heads, config.kv_heads, config.head_dim, pool);
  WorkspaceLayout device, host;
  layout(device, host);
  workspace_bytes_ = {.device = device.bytes(), .host = host.bytes()};
}

template <class T>
HybridDecoder<T>::~HybridDecoder() = default;

template <class T>
SplitWorkspaceBytes HybridDecoder<T>::workspace_bytes() const {
  return workspace_bytes_;
}

template <class T>
typename HybridDecoder<T>::Buffers HybridDecoder<T>::layout(WorkspaceLayout& device, WorkspaceLayout& host) const {
  const auto& c = config_;
  const std::size_t rows = std::size_t(c.batch) * std::size_t(c.kv_heads);
  const std::size_t states = std::size_t(c.batch) * std::size_t(c.q_heads);
  const std::size_t state_elems = states * std::size_t(c.head_dim);
  Buffers b;
  b.d_window_o = device.allocate<float>(state_elems, "HybridDecoder window O");
  b.d_window_lse = device.allocate<float>(states, "HybridDecoder window LSE");
  b.d_empty_counts = device.allocate<std::int32_t>(rows, "HybridDecoder empty counts");
  b.d_empty_indices = device.allocate<std::int32_t>(rows, "HybridDecoder empty indices");
  b.d_decode = device.span(decode_bytes_, "HybridDecoder window scratch");
  // One layout places O and LSE alike in both blocks, so that one copy moves the CPU's state.
  WorkspaceLayout counting;
  counting.allocate<float>(state_elems, "CPU partial O");
  counting.allocate<float>(states, "CPU partial LSE");
  b.d_cpu_partial = device.span(counting.bytes(), "HybridDecoder CPU partial (device)");
  b.h_cpu_partial = host.span(counting.bytes(), "HybridDecoder CPU partial (host)");
  b.h_cpu_decode = host.span(cpu_decode_bytes_, "HybridDecoder CPU decode scratch");
  if (!b.d_cpu_partial.empty()) {
    for (auto [block, o, lse] : {std::tuple{b.d_cpu_partial, &b.d_cpu_o, &b.d_cpu_lse},
                                 std::tuple{b.h_cpu_partial, &b.h_cpu_o, &b.h_cpu_lse}}) {
      WorkspaceLayout carving(block, "cuda::HybridDecoder");
      *o = carving.allocate<float>(state_elems, "CPU partial O");
      *lse = carving.allocate<float>(states, "CPU partial LSE");
    }
  }
  return b;
}

template <class T>
template <class DeviceKV, class HostKV>
void HybridDecoder<T>::decode(const QueryView<const T>& q_device, const QueryView<const T>& q_host,
                              const DeviceKV& device_kv, const HostKV& host_kv, const SelectionView& selection,
                              const StateView<T>& out, const SplitWorkspace& workspace, cudaStream_t stream) {
  using Clock = std::chrono::steady_clock;
  const auto call_start = Clock::now();
  constexpr const char* where = "cuda::HybridDecoder::decode";
  const auto& c = config_;
  for (const auto* q : {&q_device, &q_host}) {
    KVSIFT_CHECK(q->batch == c.batch && q->heads == c.q_heads && q->head_dim == c.head_dim, where,
                 "{} shape [{}, {}, {}] != configured [batch = {}, q_heads = {}, head_dim = {}]",
                 q == &q_device ? "q_device" : "q_host", q->batch, q->heads, q->head_dim, c.batch, c.q_heads,
                 c.head_dim);
  }
  KVSIFT_CHECK(selection.attend_all == nullptr, where,
               "selection.attend_all is set: the host cache holds only the middle, so a row lists the middle "
               "tokens it attends (all of them for a sequence shorter than its budget)");
  validate(host_kv, where, "host_kv", MemorySpace::host);
  pinned_.require(host_kv, PinnedHostCheck::Arrays::kv, where, "host_kv");
  pinned_.require(workspace.host.data(), where, "workspace.host");
  WorkspaceLayout device_block(workspace.device, where), host_block(workspace.host, where);
  const Buffers b = layout(device_block, host_block);
  if (c.validate_indices) {
    validate(selection, host_kv, where, "selection");
    check_selection_contents(selection, host_kv, where, "selection", /*refuse_duplicates=*/true, c.attention.window);
  }

  // 1. GPU: the window, asynchronously on the caller's stream, into an fp32 state.
  const std::size_t rows = std::size_t(c.batch) * std::size_t(c.kv_heads);
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(b.d_empty_counts, 0, rows * sizeof(std::int32_t), stream));
  const auto window_state = StateView<float>::packed(b.d_window_o, b.d_window_lse, c.batch, c.q_heads, c.head_dim);
  sparse_decode(q_device, device_kv, b.empty_selection(c), window_state, b.d_decode, stream,
                {.attention = c.attention});

  // 2. CPU: the selected middle tokens, while the GPU works. The pinned result buffer must not be
  //    overwritten while the previous step's copy may still read it.
  copied_.wait();
  const auto cpu_start = Clock::now();
  const auto cpu_state = StateView<float>::packed(b.h_cpu_o, b.h_cpu_lse, c.batch, c.q_heads, c.head_dim);
  cpu::sparse_decode(q_host, host_kv, selection, cpu_state, {.attention = {.sm_scale = c.attention.sm_scale}}, pool_,
                     b.h_cpu_decode);
  times_.cpu_seconds = std::chrono::duration<double>(Clock::now() - cpu_start).count();

  // 3. Copy the CPU state over and merge both by LSE on the stream, rounding once into T.
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(b.d_cpu_partial.data(), b.h_cpu_partial.data(), b.h_cpu_partial.size(),
                                    cudaMemcpyHostToDevice, stream));
  copied_.record(stream);
  const StateView<const float> partials[] = {
      window_state.as_const(), StateView<const float>::packed(b.d_cpu_o, b.d_cpu_lse, c.batch, c.q_heads, c.head_dim)};
  merge_states<float, T>(partials, out, stream);
  times_.call_seconds = std::chrono::duration<double>(Clock::now() - call_start).count();
}

#define KVSIFT_INSTANTIATE_HYBRID(T) KVSIFT_HYBRID(, T)
KVSIFT_DECODE_STORAGE_TYPES(KVSIFT_INSTANTIATE_HYBRID)
#undef KVSIFT_INSTANTIATE_HYBRID

}  // namespace kvsift::cuda
