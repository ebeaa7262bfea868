#include "kvsift/step/hybrid_decoder.hpp"

#include <chrono>
#include <cstdint>

#include "kvsift/cuda/decode.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/decode.hpp"
#include "kvsift/cuda/check.hpp"

namespace kvsift::cuda {

/// Everything a step needs besides its arguments, allocated once.
template <class T>
struct HybridDecoder<T>::Buffers {
  std::size_t state_elems = 0, lse_elems = 0, workspace_bytes = 0;
  float* d_window_o = nullptr;  ///< the window's fp32 partial state (device)
  float* d_window_lse = nullptr;
  std::int32_t* d_empty_counts = nullptr;   ///< [batch, kv_heads] zeros: the window's selection attends nothing else
  std::int32_t* d_empty_indices = nullptr;  ///< [batch, kv_heads, 1], never read
  // The CPU's fp32 partial, O then LSE, as one block in pinned host memory (as computed) and one on the
  // device (for the merge), so that a single copy moves it: one copy call in the step's serial tail.
  std::size_t cpu_partial_bytes = 0;
  std::byte* h_cpu_partial = nullptr;
  std::byte* d_cpu_partial = nullptr;
  float* h_cpu_o = nullptr;  ///< views into the blocks
  float* h_cpu_lse = nullptr;
  float* d_cpu_o = nullptr;
  float* d_cpu_lse = nullptr;
  std::byte* d_workspace = nullptr;
  std::size_t cpu_workspace_bytes = 0;
  std::byte* h_cpu_workspace = nullptr;  ///< lets the CPU part split rows over all of the pool's threads
  cudaEvent_t copy_done = nullptr;
  bool copy_pending = false;

  ~Buffers() {
    cudaFree(d_window_o);
    cudaFree(d_window_lse);
    cudaFree(d_empty_counts);
    cudaFree(d_empty_indices);
    cudaFree(d_cpu_partial);
    cudaFree(d_workspace);
    cudaFreeHost(h_cpu_partial);
    cudaFreeHost(h_cpu_workspace);
    if (copy_done) cudaEventDestroy(copy_done);
  }

  SelectionView empty_selection(const HybridDecoderConfig& c) const {
    return {d_empty_indices, d_empty_counts, nullptr, c.batch, c.kv_heads, 1};
  }
};

template <class T>
HybridDecoder<T>::HybridDecoder(const HybridDecoderConfig& config, cpu::ThreadPool* pool)
    : config_(config), pool_(pool), buffers_(std::make_unique<Buffers>()) {
  constexpr const char* where = "cuda::HybridDecoder";
  KVSIFT_CHECK(config.batch > 0 && config.q_heads > 0 && config.kv_heads > 0 && config.head_dim > 0, where,
               "batch (= {}), q_heads (= {}), kv_heads (= {}) and head_dim (= {}) must be positive", config.batch,
               config.q_heads, config.kv_heads, config.head_dim);
  validate(config.attention.window, where, "config.attention.window");
  KVSIFT_CHECK(!config.attention.window.empty(), where,
               "config.attention.window is empty: the GPU part attends the window (sink + recent > 0)");
  auto& b = *buffers_;
  const std::size_t rows = std::size_t(config.batch) * config.kv_heads;
  b.state_elems = std::size_t(config.batch) * config.q_heads * config.head_dim;
  b.lse_elems = std::size_t(config.batch) * config.q_heads;
  KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.d_empty_counts), rows * sizeof(std::int32_t)));
  KVSIFT_CUDA_CHECK(cudaMemset(b.d_empty_counts, 0, rows * sizeof(std::int32_t)));
  KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.d_empty_indices), rows * sizeof(std::int32_t)));
  // The window's workspace, from the sparse-decode query for this shape. The query reads shapes only (the
  // split plan does not depend on the cache's layout); it is given an aligned placeholder address (never
  // dereferenced) because views must not be null.
  const T* const shape_only = reinterpret_cast<const T*>(std::uintptr_t{WorkspaceLayout::kAlignment});
  const auto q_shape = QueryView<const T>::packed(shape_only, config.batch, config.q_heads, config.head_dim);
  const auto kv_shape =
      ContiguousKVView<const T>::packed(shape_only, shape_only, config.batch, config.kv_heads, 1, config.head_dim);
  b.workspace_bytes = sparse_decode_workspace_bytes(q_shape, kv_shape, b.empty_selection(config),
                                                    {.attention = config.attention});
  KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.d_window_o), b.state_elems * sizeof(float)));
  KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.d_window_lse), b.lse_elems * sizeof(float)));
  // One layout, run once counting and once per block carving, places O and LSE alike in both blocks.
  const auto lay_out_cpu_partial = [&](WorkspaceLayout& layout, float*& o, float*& lse) {
    o = layout.allocate<float>(b.state_elems, "CPU partial O");
    lse = layout.allocate<float>(b.lse_elems, "CPU partial LSE");
  };
  WorkspaceLayout counting;
  lay_out_cpu_partial(counting, b.h_cpu_o, b.h_cpu_lse);
  b.cpu_partial_bytes = counting.bytes();
  KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.d_cpu_partial), b.cpu_partial_bytes));
  KVSIFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&b.h_cpu_partial), b.cpu_partial_bytes));
  WorkspaceLayout device_block({b.d_cpu_partial, b.cpu_partial_bytes}, where);
  lay_out_cpu_partial(device_block, b.d_cpu_o, b.d_cpu_lse);
  WorkspaceLayout host_block({b.h_cpu_partial, b.cpu_partial_bytes}, where);
  lay_out_cpu_partial(host_block, b.h_cpu_o, b.h_cpu_lse);
  if (b.workspace_bytes > 0) KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.d_workspace), b.workspace_bytes));
  b.cpu_workspace_bytes =
      cpu::decode_workspace_bytes(config.batch, config.q_heads, config.kv_heads, config.head_dim, pool);
  if (b.cpu_workspace_bytes > 0) {
    KVSIFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&b.h_cpu_workspace), b.cpu_workspace_bytes));
  }
  KVSIFT_CUDA_CHECK(cudaEventCreateWithFlags(&b.copy_done, cudaEventDisableTiming));
}

template <class T>
HybridDecoder<T>::~HybridDecoder() = default;

template <class T>
template <class DeviceKV, class HostKV>
void HybridDecoder<T>::decode(const QueryView<const T>& q_device, const QueryView<const T>& q_host,
                              const DeviceKV& device_kv, const HostKV& host_kv, const SelectionView& selection,
                              const StateView<T>& out, cudaStream_t stream) {
  using Clock = std::chrono::steady_clock;
  const auto call_start = Clock::now();
  constexpr const char* where = "cuda::HybridDecoder::decode";
  const auto& c = config_;
  auto& b = *buffers_;
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
  if (c.validate_indices) {
    validate(selection, host_kv, where, "selection");
    check_selection_contents(selection, host_kv, where, "selection", /*refuse_duplicates=*/true, c.attention.window);
  }

  // 1. GPU: the window, asynchronously on the caller's stream, into an fp32 state.
  const auto window_state = StateView<float>::packed(b.d_window_o, b.d_window_lse, c.batch, c.q_heads, c.head_dim);
  sparse_decode(q_device, device_kv, b.empty_selection(c), window_state, {b.d_workspace, b.workspace_bytes}, stream,
                {.attention = c.attention});

  // 2. CPU: the selected middle tokens, while the GPU works. The pinned result buffer must not be
  //    overwritten while the previous step's copy may still read it.
  if (b.copy_pending) KVSIFT_CUDA_CHECK(cudaEventSynchronize(b.copy_done));
  const auto cpu_start = Clock::now();
  const auto cpu_state = StateView<float>::packed(b.h_cpu_o, b.h_cpu_lse, c.batch, c.q_heads, c.head_dim);
  cpu::sparse_decode(q_host, host_kv, selection, cpu_state, {.attention = {.sm_scale = c.attention.sm_scale}}, pool_,
                     {b.h_cpu_workspace, b.cpu_workspace_bytes});
  times_.cpu_seconds = std::chrono::duration<double>(Clock::now() - cpu_start).count();

  // 3. Copy the CPU state over and merge both by LSE on the stream, rounding once into T.
  KVSIFT_CUDA_CHECK(
      cudaMemcpyAsync(b.d_cpu_partial, b.h_cpu_partial, b.cpu_partial_bytes, cudaMemcpyHostToDevice, stream));
  KVSIFT_CUDA_CHECK(cudaEventRecord(b.copy_done, stream));
  b.copy_pending = true;
  const StateView<const float> partials[] = {
      window_state.as_const(), StateView<const float>::packed(b.d_cpu_o, b.d_cpu_lse, c.batch, c.q_heads, c.head_dim)};
  merge_states<float, T>(partials, out, stream);
  times_.call_seconds = std::chrono::duration<double>(Clock::now() - call_start).count();
}

#define KVSIFT_INSTANTIATE_HYBRID_DECODE(T, DeviceKV, HostKV)                                                    \
  template void HybridDecoder<T>::decode<DeviceKV, HostKV>(const QueryView<const T>&, const QueryView<const T>&, \
                                                           const DeviceKV&, const HostKV&, const SelectionView&, \
                                                           const StateView<T>&, cudaStream_t);
#define KVSIFT_INSTANTIATE_HYBRID(T)                                                                             \
  template class HybridDecoder<T>;                                                                              \
  KVSIFT_INSTANTIATE_HYBRID_DECODE(T, ContiguousKVView<const T>, ContiguousKVView<const T>)                     \
  KVSIFT_INSTANTIATE_HYBRID_DECODE(T, ContiguousKVView<const T>, PagedKVView<const T>)                          \
  KVSIFT_INSTANTIATE_HYBRID_DECODE(T, PagedKVView<const T>, ContiguousKVView<const T>)                          \
  KVSIFT_INSTANTIATE_HYBRID_DECODE(T, PagedKVView<const T>, PagedKVView<const T>)
KVSIFT_INSTANTIATE_HYBRID(half)
KVSIFT_INSTANTIATE_HYBRID(bfloat16)
#undef KVSIFT_INSTANTIATE_HYBRID
#undef KVSIFT_INSTANTIATE_HYBRID_DECODE

}  // namespace kvsift::cuda
