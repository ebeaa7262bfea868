#pragma once
/// Launchers of the decode and merge kernels, defined in kernels/*.cu and called by the host entry points
/// (src/cuda/decode.cpp) after validation. They return the launch status and never throw.

#include <cuda_runtime_api.h>

#include "kvsift/cuda/detail/decode_params.hpp"
#include "kvsift/cuda/detail/decode_plan.hpp"
#include "kvsift/core/dtype.hpp"

namespace kvsift::cuda::detail {

/// Launches the decode kernel for p (grid from p's shape), as a programmatic dependent of the stream's
/// previous kernel when `programmatic` (in clusters of p.num_splits CTAs with p.cluster_merge), and, when
/// p.num_splits > 1 without the cluster merge, the merge kernel.
template <class T>
cudaError_t launch_decode(const DecodeParams<T>& p, cudaStream_t stream, bool programmatic);

/// The GPU's DecodeClusterCapacity (cudaOccupancyMaxActiveClusters of the eight-warp head_dim 128 decode kernel, the
/// largest in shared memory); all 0 where that kernel's code was not built for sm_90.
cudaError_t decode_cluster_capacity(DecodeClusterCapacity* capacity);

/// Validation mode: checks every selection row's count and indices (range, duplicates) on the device and
/// writes the smallest offending row to *p.first_bad_row (left as is when every row is valid).
template <class T>
cudaError_t launch_check_selection(const DecodeParams<T>& p, cudaStream_t stream);

template <class TI, class TO>
cudaError_t launch_merge_states(const MergeParams<TI, TO>& p, cudaStream_t stream);

/// The decode family's instances: KVSIFT_DECODE_STORAGE_TYPES (core/dtype.hpp) for decode, its validation pass and
/// its same-type merge, and every storage type as the output of the merge of fp32 partials (a decode step's
/// partials, the CPU side of hybrid decode). The lists generate the extern declarations below and the explicit
/// instantiations (kernels/decode.cu).
#define KVSIFT_DECODE_LAUNCHERS(PREFIX, T)                                                         \
  PREFIX template cudaError_t launch_decode<T>(const DecodeParams<T>&, cudaStream_t, bool);        \
  PREFIX template cudaError_t launch_check_selection<T>(const DecodeParams<T>&, cudaStream_t);     \
  PREFIX template cudaError_t launch_merge_states<T, T>(const MergeParams<T, T>&, cudaStream_t);
#define KVSIFT_MERGE_FP32_LAUNCHER(PREFIX, TO) \
  PREFIX template cudaError_t launch_merge_states<float, TO>(const MergeParams<float, TO>&, cudaStream_t);

#define KVSIFT_DECODE_EXTERN(T) KVSIFT_DECODE_LAUNCHERS(extern, T)
#define KVSIFT_MERGE_FP32_EXTERN(TO) KVSIFT_MERGE_FP32_LAUNCHER(extern, TO)
KVSIFT_DECODE_STORAGE_TYPES(KVSIFT_DECODE_EXTERN)
KVSIFT_STORAGE_TYPES(KVSIFT_MERGE_FP32_EXTERN)
#undef KVSIFT_DECODE_EXTERN
#undef KVSIFT_MERGE_FP32_EXTERN

}  // namespace kvsift::cuda::detail
