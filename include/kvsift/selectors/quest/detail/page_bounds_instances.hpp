#pragma once
/// The explicit instantiations of the page bounds primitives, one list for both backends: the CPU and the CUDA
/// declarations match argument for argument, the context last, so src/selectors/quest/{cpu,cuda}/page_bounds.cpp
/// each expand KVSIFT_STORAGE_TYPES(KVSIFT_PAGE_BOUNDS_INSTANCES) inside their namespace, where Context names their
/// backend's context.

#define KVSIFT_PAGE_BOUNDS_UPDATE_INSTANCES(T, KV)                                                                  \
  template void build_page_bounds<T, KV>(const KV&, const std::int32_t*, const PageBoundsView<T>&, const Context&); \
  template void append_page_bounds<T, KV>(const KV&, const std::int32_t*, const PageBoundsView<T>&, const Context&);
#define KVSIFT_PAGE_BOUNDS_INSTANCES(T)                                                                             \
  KVSIFT_PAGE_BOUNDS_UPDATE_INSTANCES(T, ContiguousKVView<const T>)                                                 \
  KVSIFT_PAGE_BOUNDS_UPDATE_INSTANCES(T, PagedKVView<const T>)                                                      \
  template void page_scores<T>(const QueryView<const T>&, const PageBoundsView<const T>&, const std::int32_t*,      \
                               const std::int32_t*, const AttentionWindow&, const MatrixView<float>&,               \
                               std::int32_t*, const Context&);
