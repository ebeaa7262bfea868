#pragma once
/// The explicit instantiations of the inverted list primitives, one list for both backends: the CPU and the CUDA
/// declarations match argument for argument, the context last, so src/{cpu,cuda}/inverted_lists.cpp each expand
/// KVSIFT_LIST_STORAGE_TYPES(KVSIFT_INVERTED_LISTS_INSTANCES) inside their namespace, where Context names their
/// backend's context.

#define KVSIFT_INVERTED_LISTS_INSTANCES(T)                                                                             \
  template void union_lists<T>(const InvertedListsView<const T>&, const SelectionView&, const std::int32_t*,           \
                               const std::int32_t*, const AttentionWindow&, const UnionAppend&, const SelectionView&, \
                               std::span<std::byte>, const Context&);                                                  \
  template void recall_lists<T>(const MatrixView<const float>&, const std::int32_t*, const InvertedListsView<const T>&, \
                                const SelectionView&, const std::int32_t*, const std::int32_t*,                        \
                                const AttentionWindow&, const UnionAppend&, const SelectionView&,                      \
                                std::span<std::byte>, const Context&);                                                 \
  template void replace_list<T>(const InvertedListsView<T>&, const std::int32_t*, const SelectionView&,                \
                                const MatrixView<const float>&, std::int32_t*, const Context&);
