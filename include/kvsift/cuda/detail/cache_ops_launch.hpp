#pragma once
/// Launchers of the cache operations' kernels (kernels/cache_ops.cu), called by src/cuda/cache_ops.cpp after
/// its checks. Each returns the launch's error.

#include <cstdint>

#include <cuda_runtime_api.h>

#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

template <class T>
cudaError_t launch_sequence_lengths(const KVCache<const T>& cache, std::int32_t* lengths, cudaStream_t stream);

template <class T>
cudaError_t launch_write_step_kv(const KVCache<T>& cache, const HeadsView<const T>& k, const HeadsView<const T>& v,
                                 cudaStream_t stream);

cudaError_t launch_clear_counts(std::int32_t* counts, std::int64_t rows, cudaStream_t stream);

cudaError_t launch_identity_indices(std::int32_t* indices, std::int64_t rows, std::int32_t capacity,
                                   cudaStream_t stream);

/// cuda::first_nonfinite_key after its checks: key memset, scan over `multiprocessors` SMs' worth of CTAs, decode.
template <class T>
cudaError_t launch_first_nonfinite_key(const KVCache<const T>& cache, const std::int32_t* lengths, std::int32_t* out,
                                       int multiprocessors, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
