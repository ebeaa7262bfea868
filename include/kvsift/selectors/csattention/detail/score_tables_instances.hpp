#pragma once
/// The explicit instantiations of the score table primitives, one list for both backends: the CPU and the CUDA
/// declarations match argument for argument, the context last, so
/// src/selectors/csattention/{cpu,cuda}/score_tables.cpp each expand KVSIFT_STORAGE_TYPES(KVSIFT_SCORE_TABLES_INSTANCES)
/// inside their namespace, where Context names their backend's context.

#define KVSIFT_SCORE_TABLES_INSTANCES(T)                                                                               \
  template void subspace_scores<T>(const BaseTablesView&, std::int32_t, std::int32_t, std::int32_t,                    \
                                   const KVCache<const T>&, std::int32_t, std::int32_t, std::int32_t,                  \
                                   const MatrixView<float>&, const Context&);                                          \
  template void append_tables<T>(const ScoreTablesView<std::int32_t>&, const KVCache<const T>&, const std::int32_t*,   \
                                 const std::int32_t*, const Context&);                                                 \
  template void nearest_centroids<T>(const QueryView<const T>&, const ScoreTablesView<const std::int32_t>&,            \
                                     const std::int32_t*, std::int32_t, const SelectionView&, std::int32_t*,           \
                                     const Context&);
