#pragma once
/// The explicit instantiations of the codebook quantization primitives, one list for both backends: the CPU and the
/// CUDA declarations match argument for argument, the context last, so src/selectors/a2ats/{cpu,cuda}/vq.cpp each
/// expand KVSIFT_STORAGE_TYPES(KVSIFT_VQ_INSTANCES) inside their namespace, where Context names their backend's
/// context.

#define KVSIFT_VQ_INSTANCES(T)                                                                                       \
  template void vq_encode<T>(const HeadsView<const T>&, const VqEncodeCodebook&, const VqCodesView<std::uint16_t>&,  \
                             const VqCodeDestination&, std::span<std::byte>, const Context&);                        \
  template void vq_lut<T>(const QueryView<const T>&, const VqCodebook<T>&, const MatrixView<float>&, const Context&); \
  template void vq_lut_scan<T>(const QueryView<const T>&, const VqCodebook<T>&, const VqCodesView<const std::uint16_t>&, \
                               const std::int32_t*, const std::int32_t*, const MatrixView<float>&,                   \
                               const VqScanOptions&, std::span<std::byte>, const Context&);                   \
  template void vq_topk_rows<T>(const QueryView<const T>&, const VqCodebook<T>&, const VqCodesView<const std::uint16_t>&, \
                                const std::int32_t*, const std::int32_t*, const VqTopKShape&, const TopKRowsOptions&,  \
                                const SelectionView&, std::span<std::byte>, const Context&);
