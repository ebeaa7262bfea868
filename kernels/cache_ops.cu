// CUDA cache operations of the decode step (cuda/cache_ops.hpp): tiny kernels, one launch each.
#include "kvsift/core/error.hpp"
#include "kvsift/cuda/cache_ops.hpp"
#include "kvsift/cuda/check.hpp"

namespace kvsift::cuda {
namespace {

template <class T>
__global__ void sequence_lengths_kernel(KVCache<const T> cache, std::int32_t* lengths) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < cache.batch()) lengths[b] = cache.seq_len(b);
}

/// One CTA per (batch row, kv head); 16-byte copies where head_dim allows, else elementwise.
template <class T>
__global__ void write_step_kv_kernel(KVCache<T> cache, HeadsView<const T> k, HeadsView<const T> v) {
  const int b = blockIdx.x / cache.kv_heads(), h = blockIdx.x % cache.kv_heads();
  const std::int32_t t = cache.seq_len(b) - 1;
  if (t < 0) return;
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
void sequence_lengths(const KVCache<const T>& cache, std::int32_t* d_lengths, cudaStream_t stream) {
  if (cache.batch() == 0) return;
  sequence_lengths_kernel<T><<<(cache.batch() + 127) / 128, 128, 0, stream>>>(cache, d_lengths);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void write_step_kv(const KVCache<T>& cache, const HeadsView<const T>& k, const HeadsView<const T>& v,
                   cudaStream_t stream) {
  constexpr const char* where = "cuda::write_step_kv";
  KVSIFT_CHECK(k.batch == cache.batch() && k.heads == cache.kv_heads() && k.head_dim == cache.head_dim() &&
                   v.batch == k.batch && v.heads == k.heads && v.head_dim == k.head_dim,
               where, "k [{}, {}, {}] and v [{}, {}, {}] must both be [batch = {}, kv_heads = {}, head_dim = {}]",
               k.batch, k.heads, k.head_dim, v.batch, v.heads, v.head_dim, cache.batch(), cache.kv_heads(),
               cache.head_dim());
  const int blocks = cache.batch() * cache.kv_heads();
  if (blocks == 0) return;
  write_step_kv_kernel<T><<<blocks, 64, 0, stream>>>(cache, k, v);
  KVSIFT_CUDA_CHECK(cudaGetLastError());
}

void clear_counts(const SelectionView& out, cudaStream_t stream) {
  KVSIFT_CUDA_CHECK(
      cudaMemsetAsync(out.counts, 0, std::size_t(out.batch) * std::size_t(out.kv_heads) * sizeof(std::int32_t), stream));
}

#define KVSIFT_INSTANTIATE_CACHE_OPS(T)                                                                     \
  template void sequence_lengths<T>(const KVCache<const T>&, std::int32_t*, cudaStream_t);                  \
  template void write_step_kv<T>(const KVCache<T>&, const HeadsView<const T>&, const HeadsView<const T>&, \
                                 cudaStream_t);
KVSIFT_INSTANTIATE_CACHE_OPS(half)
KVSIFT_INSTANTIATE_CACHE_OPS(bfloat16)
KVSIFT_INSTANTIATE_CACHE_OPS(float)
#undef KVSIFT_INSTANTIATE_CACHE_OPS

}  // namespace kvsift::cuda
