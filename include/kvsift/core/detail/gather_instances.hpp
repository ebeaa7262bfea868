#pragma once
/// The explicit instantiations of the KV gather primitives, one list for both backends: the CPU and the CUDA
/// declarations match argument for argument, the context last, so src/{cpu,cuda}/gather.cpp each expand
/// KVSIFT_STORAGE_TYPES(KVSIFT_GATHER_INSTANCES) inside their namespace, where Context names their backend's context.

#define KVSIFT_GATHER_INSTANCES(T)                                                                                     \
  template void gather_kv<T>(const KVCache<const T>&, const SelectionView&, const KVCache<T>&, const Context&);        \
  template void gather_keys<T>(const KVCache<const T>&, const SelectionView&, const SequenceView<T>&, const Context&); \
  template void gather_kv_difference<T>(const KVCache<const T>&, const SelectionView&, const std::int32_t*,            \
                                        const SelectionView&, std::int32_t*, const ContiguousKVView<T>&,               \
                                        std::int32_t*, std::span<std::byte>, const Context&);
