// Every overload of cuda/backend.hpp instantiated once, so that a forward that no selector calls yet still
// compiles against the primitive it names (the call shapes of docs/selector_framework.md).
#include "kvsift/cuda/backend.hpp"

namespace kvsift::cuda {

using T = bfloat16;
template void sequence_lengths<T>(const KVCache<const T>&, std::int32_t*, const Context&);
template void write_step_kv<T>(const KVCache<T>&, const HeadsView<const T>&, const HeadsView<const T>&, const Context&);
template void group_scores<T>(const QueryView<const T>&, const KVCache<const T>&, const MatrixView<float>&,
                              const cpu::GroupScoreOptions&, std::span<std::byte>, const Context&);
template void build_page_bounds<T>(const KVCache<const T>&, const std::int32_t*, const PageBoundsView<T>&, const Context&);
template void append_page_bounds<T>(const KVCache<const T>&, const std::int32_t*, const PageBoundsView<T>&,
                                    const Context&);
template void page_scores<T>(const QueryView<const T>&, const PageBoundsView<const T>&, const std::int32_t*,
                             const std::int32_t*, const AttentionWindow&, const MatrixView<float>&, std::int32_t*,
                             const Context&);
template void sparse_decode<T, T>(const QueryView<const T>&, const KVCache<const T>&, const SelectionView&,
                                  const StateView<T>&, const AttentionOptions&, bool, bool, std::span<std::byte>,
                                  const Context&);
template void sparse_decode<T, float>(const QueryView<const T>&, const KVCache<const T>&, const SelectionView&,
                                      const StateView<float>&, const AttentionOptions&, bool, bool,
                                      std::span<std::byte>, const Context&);
template void apply_rope<T>(const HeadsView<T>&, const std::int32_t*, const RopeTableView&, bool, const Context&);
template void apply_rope<T>(const MatrixView<T>&, const std::int32_t*, const RopeTableView&, bool, const Context&);
template void rotate_by_delta<T>(const HeadsView<T>&, const std::int32_t*, const RopeTableView&, const Context&);
template void segment_mean<T>(const MatrixView<const T>&, const std::int32_t*, std::int32_t, const float*,
                              const MatrixView<float>&, std::int32_t*, std::span<std::byte>, const Context&);
template void union_lists<half>(const InvertedListsView<const half>&, const SelectionView&, const std::int32_t*,
                                const std::int32_t*, const AttentionWindow&, const SelectionView&, std::span<std::byte>,
                                const Context&);
template void reduce_lists_by_key<half>(const InvertedListsView<const half>&, const SelectionView&, const std::int32_t*,
                                        const std::int32_t*, const AttentionWindow&, const SelectionView&,
                                        const MatrixView<float>&, std::span<std::byte>, const Context&);
template void try_insert_lists<half>(const InvertedListsView<half>&, const std::int32_t*, const std::int32_t*,
                                     const MatrixView<const float>&, const Context&);
template void replace_list<half>(const InvertedListsView<half>&, const std::int32_t*, const SelectionView&,
                                 const MatrixView<const float>&, std::int32_t*, const Context&);
template void gather_kv<T>(const KVCache<const T>&, const SelectionView&, const KVCache<T>&, const Context&);
template void gather_kv_difference<T>(const KVCache<const T>&, const SelectionView&, const std::int32_t*,
                                      const SelectionView&, std::int32_t*, const ContiguousKVView<T>&, std::int32_t*,
                                      std::span<std::byte>, const Context&);

}  // namespace kvsift::cuda
