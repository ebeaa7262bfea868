// Page bounds (cuda/page_bounds.hpp): build, append and page scores for the storage types and both cache
// layouts, and expand. Kernels in cuda/detail/page_bounds_kernels.cuh.
#include "kvsift/cuda/detail/page_bounds_kernels.cuh"

namespace kvsift::cuda::detail {

cudaError_t launch_expand_pages(const SelectionView& pages, std::int32_t page_size, const std::int32_t* lengths,
                                const AttentionWindow& window, const SelectionView& out, cudaStream_t stream) {
  expand_pages_kernel<kExpandThreads><<<unsigned(std::int64_t(pages.batch) * pages.kv_heads), kExpandThreads, 0, stream>>>(
      pages, page_size, lengths, window, out);
  return cudaGetLastError();
}

namespace {

template <class T, int HeadDim>
cudaError_t launch_select_pages_for(PageSelectParams<T> p, cudaStream_t stream) {
  constexpr auto kernel = select_pages_kernel<T, HeadDim>;
  // Always the largest size select_pages_fits admits, never lowered: a launch from another host thread may rely
  // on it.
  if (cudaError_t s = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(kSelectPagesMaxSmemBytes));
      s != cudaSuccess) {
    return s;
  }
  p.cluster = kSelectPagesCluster;
  p.slice = (p.page_limit + p.cluster - 1) / p.cluster;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(std::int64_t(p.out.batch) * p.out.kv_heads * p.cluster));
  config.blockDim = dim3(kSelectPagesThreads);
  config.dynamicSmemBytes = select_pages_smem_bytes(p.slice, p.pages_per_row);
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = unsigned(p.cluster);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace

template <class T>
cudaError_t launch_select_pages(PageSelectParams<T> params, cudaStream_t stream) {
  if (std::int64_t(params.out.batch) * params.out.kv_heads == 0) return cudaSuccess;
  switch (params.bounds.head_dim) {
    case 64: return launch_select_pages_for<T, 64>(params, stream);
    case 128: return launch_select_pages_for<T, 128>(params, stream);
    case 256: return launch_select_pages_for<T, 256>(params, stream);
    default: return cudaErrorInvalidValue;
  }
}

#define KVSIFT_INSTANTIATE_UPDATES(T, KV)                                                                           \
  template cudaError_t launch_build_page_bounds<T, KV>(const KV&, const std::int32_t*, const PageBoundsView<T>&,     \
                                                       cudaStream_t);                                               \
  template cudaError_t launch_append_page_bounds<T, KV>(const KV&, const std::int32_t*, const PageBoundsView<T>&,    \
                                                        cudaStream_t);
#define KVSIFT_INSTANTIATE(T)                                                                                       \
  KVSIFT_INSTANTIATE_UPDATES(T, ContiguousKVView<const T>)                                                          \
  KVSIFT_INSTANTIATE_UPDATES(T, PagedKVView<const T>)                                                               \
  template cudaError_t launch_page_scores<T>(const PageScoreParams<T>&, cudaStream_t);                            \
  template cudaError_t launch_select_pages<T>(PageSelectParams<T>, cudaStream_t);
KVSIFT_INSTANTIATE(float)
KVSIFT_INSTANTIATE(half)
KVSIFT_INSTANTIATE(bfloat16)
#undef KVSIFT_INSTANTIATE
#undef KVSIFT_INSTANTIATE_UPDATES

}  // namespace kvsift::cuda::detail
