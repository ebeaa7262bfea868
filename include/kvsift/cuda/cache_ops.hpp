#pragma once
/// CUDA twins of cpu/cache_ops.hpp: each batch row's length, writing a step's new token, an empty selection.
/// Device memory; stream-ordered, no allocation, no host sync, CUDA-graph capturable. The lengths live on the
/// device, so write_step_kv cannot refuse a row of length 0, or one whose length its storage cannot hold
/// (KVCache::seq_len_fits), before the launch: it skips that row.

#include <cstdint>

#include <cuda_runtime_api.h>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda {

// Instantiated in src/cuda/cache_ops.cpp for T = half, bfloat16 and float.

template <class T>
void sequence_lengths(const KVCache<const T>& cache, std::int32_t* d_lengths, cudaStream_t stream);

template <class T>
void write_step_kv(const KVCache<T>& cache, const HeadsView<const T>& k, const HeadsView<const T>& v,
                   cudaStream_t stream);

void clear_counts(const SelectionView& out, cudaStream_t stream);


}  // namespace kvsift::cuda
