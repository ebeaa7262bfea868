#include "kvsift/step/hybrid_decoder.hpp"

#include <chrono>
#include <vector>

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
  T* d_window_o = nullptr;      ///< the window's partial state (device)
  float* d_window_lse = nullptr;
  // The CPU partial, O then LSE, as one block in pinned host memory (as computed) and one on the device (for
  // the merge), so that a single copy moves it: one copy call and one transfer in the step's serial tail.
  std::size_t cpu_partial_bytes = 0;
  std::byte* h_cpu_partial = nullptr;
  std::byte* d_cpu_partial = nullptr;
  T* h_cpu_o = nullptr;         ///< views into the blocks
  float* h_cpu_lse = nullptr;
  T* d_cpu_o = nullptr;
  float* d_cpu_lse = nullptr;
  std::byte* d_workspace = nullptr;
  std::size_t cpu_workspace_bytes = 0;
  std::byte* h_cpu_workspace = nullptr;  ///< lets the CPU part split rows over all of the pool's threads
  cudaEvent_t copy_done = nullptr;
  bool copy_pending = false;

  ~Buffers() {
    cudaFree(d_window_o);
    cudaFree(d_window_lse);
    cudaFree(d_cpu_partial);
    cudaFree(d_workspace);
    cudaFreeHost(h_cpu_partial);
    cudaFreeHost(h_cpu_workspace);
    if (copy_done) cudaEventDestroy(copy_done);
  }
};

template <class T>
HybridDecoder<T>::HybridDecoder(const HybridDecoderConfig& config, cpu::ThreadPool* pool)
    : config_(config), pool_(pool), buffers_(std::make_unique<Buffers>()) {
  constexpr const char* where = "cuda::HybridDecoder";
  KVSIFT_CHECK(config.batch > 0 && config.q_heads > 0 && config.kv_heads > 0 && config.head_dim > 0, where,
               "batch (= {}), q_heads (= {}), kv_heads (= {}) and head_dim (= {}) must be positive", config.batch,
               config.q_heads, config.kv_heads, config.head_dim);
  KVSIFT_CHECK(config.sink >= 0 && config.recent >= 0 && config.sink + config.recent > 0, where,
               "sink (= {}) and recent (= {}) must be >= 0 with a non-empty window", config.sink, config.recent);
  auto& b = *buffers_;
  b.state_elems = std::size_t(config.batch) * config.q_heads * config.head_dim;
  b.lse_elems = std::size_t(config.batch) * config.q_heads;
  // The window's workspace, sized by the dense-decode query for this shape. The query reads shapes only; it
  // is given an aligned placeholder address (never dereferenced) because views must not be null.
  const T* const shape_only = reinterpret_cast<const T*>(std::uintptr_t{WorkspaceLayout::kAlignment});
  const auto q_shape = QueryView<const T>::packed(shape_only, config.batch, config.q_heads, config.head_dim);
  const auto window_shape = ContiguousKVView<const T>::packed(shape_only, shape_only, config.batch, config.kv_heads,
                                                              config.sink + config.recent, config.head_dim);
  b.workspace_bytes = dense_decode_workspace_bytes(q_shape, window_shape, {.attention = config.attention});
  KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.d_window_o), b.state_elems * sizeof(T)));
  KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.d_window_lse), b.lse_elems * sizeof(float)));
  // One layout, run once counting and once per block carving, places O and LSE alike in both blocks.
  const auto lay_out_cpu_partial = [&](WorkspaceLayout& layout, T*& o, float*& lse) {
    o = layout.allocate<T>(b.state_elems, "CPU partial O");
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

namespace {

bool is_pinned_host(const void* p) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

}  // namespace

template <class T>
void HybridDecoder<T>::decode(const QueryView<const T>& q_device, const QueryView<const T>& q_host,
                              std::span<const std::int32_t> seq_lens, const ContiguousKVView<const T>& window,
                              const ContiguousKVView<const T>& offloaded, const SelectionView& selection,
                              const StateView<T>& out, cudaStream_t stream) {
  using Clock = std::chrono::steady_clock;
  const auto call_start = Clock::now();
  constexpr const char* where = "cuda::HybridDecoder::decode";
  const auto& c = config_;
  auto& b = *buffers_;
  KVSIFT_CHECK(q_device.batch == c.batch && q_device.heads == c.q_heads && q_device.head_dim == c.head_dim, where,
               "q_device shape [{}, {}, {}] != configured [batch = {}, q_heads = {}, head_dim = {}]", q_device.batch,
               q_device.heads, q_device.head_dim, c.batch, c.q_heads, c.head_dim);
  KVSIFT_CHECK(seq_lens.size() == std::size_t(c.batch), where, "seq_lens.size() (= {}) != batch (= {})", seq_lens.size(),
               c.batch);
  KVSIFT_CHECK(window.capacity == c.sink + c.recent && window.seq_lens == nullptr, where,
               "window must hold exactly sink + recent (= {}) tokens per sequence (capacity = {}, seq_lens {})",
               c.sink + c.recent, window.capacity, window.seq_lens ? "set" : "null");
  validate(offloaded, where, "offloaded", MemorySpace::host);
  KVSIFT_CHECK(offloaded.seq_lens != nullptr, where, "offloaded.seq_lens is a null pointer (host lengths are required)");
  KVSIFT_CHECK(is_pinned_host(offloaded.k) && is_pinned_host(offloaded.v), where,
               "offloaded.k and offloaded.v must be pinned host memory (cudaMallocHost or cudaHostRegister)");
  for (std::int32_t s = 0; s < c.batch; ++s) {
    KVSIFT_CHECK(seq_lens[s] >= c.sink + c.recent, where,
                 "the GPU window (sink {} + recent {} = {} tokens) is larger than sequence {} (= {} tokens)", c.sink,
                 c.recent, c.sink + c.recent, s, seq_lens[s]);
    KVSIFT_CHECK(offloaded.seq_len(s) == seq_lens[s] - c.sink - c.recent, where,
                 "offloaded.seq_lens[{}] (= {}) != seq_len - sink - recent (= {})", s, offloaded.seq_len(s),
                 seq_lens[s] - c.sink - c.recent);
  }

  // 1. GPU: the window, asynchronously on the caller's stream.
  const auto window_state = StateView<T>::packed(b.d_window_o, b.d_window_lse, c.batch, c.q_heads, c.head_dim);
  dense_decode(q_device, window, window_state, {b.d_workspace, b.workspace_bytes}, stream, {.attention = c.attention});

  // 2. CPU: the selected offloaded tokens, while the GPU works. The pinned result buffer must not be
  //    overwritten while the previous step's copy may still read it.
  if (b.copy_pending) KVSIFT_CUDA_CHECK(cudaEventSynchronize(b.copy_done));
  const auto cpu_start = Clock::now();
  const auto cpu_state = StateView<T>::packed(b.h_cpu_o, b.h_cpu_lse, c.batch, c.q_heads, c.head_dim);
  cpu::sparse_decode(q_host, offloaded, selection, cpu_state, {.attention = c.attention}, pool_,
                     {b.h_cpu_workspace, b.cpu_workspace_bytes});
  times_.cpu_seconds = std::chrono::duration<double>(Clock::now() - cpu_start).count();

  // 3. Copy the CPU partial over and merge both by LSE on the stream.
  KVSIFT_CUDA_CHECK(
      cudaMemcpyAsync(b.d_cpu_partial, b.h_cpu_partial, b.cpu_partial_bytes, cudaMemcpyHostToDevice, stream));
  KVSIFT_CUDA_CHECK(cudaEventRecord(b.copy_done, stream));
  b.copy_pending = true;
  const StateView<const T> partials[] = {window_state.as_const(),
                                         StateView<const T>::packed(b.d_cpu_o, b.d_cpu_lse, c.batch, c.q_heads, c.head_dim)};
  merge_states<T>(partials, out, stream);
  times_.call_seconds = std::chrono::duration<double>(Clock::now() - call_start).count();
}

template class HybridDecoder<half>;
template class HybridDecoder<bfloat16>;

}  // namespace kvsift::cuda
