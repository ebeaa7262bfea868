// Page bounds (selectors/quest/cuda/page_bounds.hpp): build, append and page scores for the storage types and both cache
// layouts, and expand. Kernels in cuda/detail/page_bounds_kernels.cuh.
#include "kvsift/selectors/quest/cuda/detail/page_bounds_kernels.cuh"

namespace kvsift::cuda::detail {

cudaError_t launch_expand_pages(const SelectionView& pages, std::int32_t page_size, const std::int32_t* lengths,
                                const AttentionWindow& window, const SelectionView& out, cudaStream_t stream) {
  return launch(expand_pages_kernel<kExpandThreads>,
                {.grid = dim3(unsigned(std::int64_t(pages.batch) * pages.kv_heads), unsigned(expand_chunks(pages.capacity))),
                 .block = dim3(kExpandThreads),
                 .stream = stream, .programmatic = true},
                pages, page_size, lengths, window, out);
}

#define KVSIFT_INSTANTIATE_UPDATES(T, KV)                                                                           \
  template cudaError_t launch_build_page_bounds<T, KV>(const KV&, const std::int32_t*, const PageBoundsView<T>&,     \
                                                       cudaStream_t);                                               \
  template cudaError_t launch_append_page_bounds<T, KV>(const KV&, const std::int32_t*, const PageBoundsView<T>&,    \
                                                        cudaStream_t);
#define KVSIFT_INSTANTIATE(T)                                                                                       \
  KVSIFT_INSTANTIATE_UPDATES(T, ContiguousKVView<const T>)                                                          \
  KVSIFT_INSTANTIATE_UPDATES(T, PagedKVView<const T>)                                                               \
  template cudaError_t choose_page_score_kernel<T>(const PageScoreParams<T>&, PageScoreKernel*);                   \
  template cudaError_t launch_page_scores<T>(const PageScoreParams<T>&, cudaStream_t);                              \
  template cudaError_t launch_page_scores_direct<T>(const PageScoreParams<T>&, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE
#undef KVSIFT_INSTANTIATE_UPDATES

}  // namespace kvsift::cuda::detail
