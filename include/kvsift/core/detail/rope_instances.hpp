#pragma once
/// The explicit instantiations of the RoPE primitives, one list for both backends: the CPU and the CUDA
/// declarations match argument for argument, the context last, so src/{cpu,cuda}/rope.cpp each expand
/// KVSIFT_STORAGE_TYPES(KVSIFT_ROPE_INSTANCES) inside their namespace, where Context names their backend's context.

#define KVSIFT_ROPE_INSTANCES(T)                                                                                       \
  template void apply_rope<T>(const HeadsView<T>&, const std::int32_t*, const RopeTableView&, bool, const Context&);   \
  template void apply_rope<T>(const MatrixView<T>&, const std::int32_t*, const RopeTableView&, bool, const Context&);  \
  template void apply_rope<T>(const HeadsView<T>&, const std::int32_t*, std::int32_t, const RopeTableView&, bool,      \
                              const Context&);                                                                         \
  template void rotate_to_position<T>(const HeadsView<T>&, const std::int32_t*, std::int32_t, std::int32_t,            \
                                      const RopeTableView&, const Context&);
