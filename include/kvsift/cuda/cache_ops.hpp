#pragma once
/// CUDA twins of cpu/cache_ops.hpp: each batch row's length, writing a step's new token, an empty selection, the
/// identity selection, the first non-finite key. Device memory; stream-ordered, no allocation, no host sync, CUDA-graph capturable. The lengths live on the
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

/// cpu::clear_counts on the device: one launch (a programmatic dependent, not a memset, so that a step's chain of
/// dependents goes on through it). Refused: null counts, a negative batch or kv_heads.
void clear_counts(const SelectionView& out, cudaStream_t stream);

/// Entry i of every row of `out` is i, for i < out.capacity (its counts are not written): the selection that lists
/// a staging buffer's slots in order (DecodeStep<S, placement::MiddleOnGpu> attends its gathered rows so). One
/// launch; no-op for an empty selection.
void write_identity_indices(const SelectionView& out, cudaStream_t stream);

/// The first non-finite key (NaN, +inf or -inf) of the cache's rows, in (b, h, t, i) order: rows b <
/// cache.batch(), kv heads h, tokens t < d_lengths[b] (device memory; a length <= 0 scans nothing, a longer one
/// than row b's storage holds reads past it), channels i < head_dim. Writes d_out[0..4) = {b, h, t, i} of that
/// element, or four -1 when every scanned key is finite; the same answer as cpu::first_nonfinite_key, whichever
/// offenders there are. d_out: 4 int32 of device memory, 8-byte aligned (the scan keeps a 64-bit key there
/// before the answer overwrites it). Three stream-ordered steps: a memset of the key, one grid-stride scan
/// (16-byte loads where head_dim, the base pointer and the strides allow, 4-byte or 2-byte ones otherwise; a
/// 64-bit atomicMin of the offender's flat position), and a one-thread kernel decoding the key into d_out. No
/// allocation, no host sync, graph capturable: the caller reads d_out after synchronizing. Refused (on the
/// host): cache.batch() * kv_heads * head_dim >= 2^33, whose positions the key cannot hold.
template <class T>
void first_nonfinite_key(const KVCache<const T>& cache, const std::int32_t* d_lengths, std::int32_t* d_out,
                         cudaStream_t stream);

}  // namespace kvsift::cuda
