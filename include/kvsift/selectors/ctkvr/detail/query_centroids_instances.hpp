#pragma once
/// The explicit instantiations of the query centroid primitives, one list for both backends: the CPU and the CUDA
/// declarations match argument for argument, the context last, so src/selectors/ctkvr/{cpu,cuda}/query_centroids.cpp
/// each expand KVSIFT_STORAGE_TYPES(KVSIFT_QUERY_CENTROIDS_INSTANCES) inside their namespace, where Context names
/// their backend's context.

#define KVSIFT_QUERY_CENTROIDS_INSTANCES(T)                                                                         \
  template void centroid_scores<T>(const QueryView<const T>&, const QueryCentroidsView<const T>&,                   \
                                   const std::int32_t*, std::int32_t, const MatrixView<float>&, const Context&);    \
  template void store_centroids<T>(const SequenceView<const T>&, const std::int32_t*, const std::int32_t*,          \
                                   std::int32_t, const QueryCentroidsView<T>&, const Context&);
