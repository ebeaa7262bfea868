// Kernels of the decode step's cache operations (cuda/cache_ops.hpp): one small launch each.
#include "kvsift/core/dtype.hpp"
#include "kvsift/cuda/detail/cache_ops_launch.hpp"

namespace kvsift::cuda::detail {
namespace {

template <class T>
__global__ void sequence_lengths_kernel(KVCache<const T> cache, std::int32_t* lengths) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < cache.batch()) lengths[b] = cache.seq_len(b);
}

/// One CTA per (batch row, kv head); a row of length 0 has no position for the token, and a row whose length its
/// storage cannot hold (KVCache::seq_len_fits) has a bad one: both are skipped.
template <class T>
__global__ void write_step_kv_kernel(KVCache<T> cache, HeadsView<const T> k, HeadsView<const T> v) {
  const int b = blockIdx.x / cache.kv_heads(), h = blockIdx.x % cache.kv_heads();
  const std::int32_t t = cache.seq_len(b) - 1;
  if (t < 0 || !cache.seq_len_fits(b)) return;
  T* k_dst = cache.k_row(b, h, t);
  T* v_dst = cache.v_row(b, h, t);
  const T* k_src = k.row(b, h);
  const T* v_src = v.row(b, h);
  for (int c = threadIdx.x; c < k.head_dim; c += blockDim.x) {
    k_dst[c] = k_src[c];
    v_dst[c] = v_src[c];
  }
}

}  // namespace

template <class T>
cudaError_t launch_sequence_lengths(const KVCache<const T>& cache, std::int32_t* lengths, cudaStream_t stream) {
  sequence_lengths_kernel<T><<<(cache.batch() + 127) / 128, 128, 0, stream>>>(cache, lengths);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_write_step_kv(const KVCache<T>& cache, const HeadsView<const T>& k, const HeadsView<const T>& v,
                                 cudaStream_t stream) {
  write_step_kv_kernel<T><<<cache.batch() * cache.kv_heads(), 64, 0, stream>>>(cache, k, v);
  return cudaGetLastError();
}

#define KVSIFT_INSTANTIATE_CACHE_OPS(T)                                                                          \
  template cudaError_t launch_sequence_lengths<T>(const KVCache<const T>&, std::int32_t*, cudaStream_t);         \
  template cudaError_t launch_write_step_kv<T>(const KVCache<T>&, const HeadsView<const T>&,                     \
                                               const HeadsView<const T>&, cudaStream_t);
KVSIFT_INSTANTIATE_CACHE_OPS(half)
KVSIFT_INSTANTIATE_CACHE_OPS(bfloat16)
KVSIFT_INSTANTIATE_CACHE_OPS(float)
#undef KVSIFT_INSTANTIATE_CACHE_OPS

}  // namespace kvsift::cuda::detail
