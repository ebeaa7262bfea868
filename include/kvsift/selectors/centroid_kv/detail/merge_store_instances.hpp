#pragma once
/// The explicit instantiations of the merge store primitives, one list for both backends: the CPU and the CUDA
/// declarations match argument for argument, the context last, so src/selectors/centroid_kv/{cpu,cuda}/merge_store.cpp
/// each expand KVSIFT_STORAGE_TYPES(KVSIFT_MERGE_STORE_INSTANCES) inside their namespace, where Context names their
/// backend's context.

#define KVSIFT_MERGE_STORE_INSTANCES(T)                                                                               \
  template void merge_store_load<T>(const KVCache<const T>&, const std::int32_t*, const MergeStoreView<T>&,           \
                                    const Context&);                                                                  \
  template void merge_round<T>(const MergeStoreView<T>&, const std::int32_t*, std::int32_t, const std::int32_t*,      \
                               const MergeRoundParams&, std::span<std::byte>, const Context&);                        \
  template void merge_store_append<T>(const KVCache<const T>&, const std::int32_t*, const std::int32_t*,              \
                                      const MergeStoreView<T>&, const Context&);                                      \
  template void merge_store_evict<T>(const MergeStoreView<T>&, const std::int32_t*, std::int32_t,                    \
                                     const std::int32_t*, const std::int32_t*, const Context&);                       \
  template void merge_store_copy<T>(const MergeStoreView<const T>&, const std::int32_t*, const MergeStoreView<T>&,    \
                                    const std::int32_t*, std::int32_t, const Context&);                               \
  template void merge_store_selection<T>(const MergeStoreView<const T>&, const std::int32_t*, const SelectionView&,   \
                                         const Context&);
