// CUDA cache operations of the decode step: checks (host compiler); kernels in kernels/cache_ops.cu.
#include "kvsift/cuda/cache_ops.hpp"

#include "kvsift/core/detail/cache_ops_checks.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/cache_ops_launch.hpp"

namespace kvsift::cuda {

template <class T>
void sequence_lengths(const KVCache<const T>& cache, std::int32_t* d_lengths, cudaStream_t stream) {
  KVSIFT_CHECK(d_lengths != nullptr, "cuda::sequence_lengths", "d_lengths must be non-null");
  if (cache.batch() == 0) return;
  KVSIFT_CUDA_CHECK(detail::launch_sequence_lengths(cache, d_lengths, stream));
}

template <class T>
void write_step_kv(const KVCache<T>& cache, const HeadsView<const T>& k, const HeadsView<const T>& v,
                   cudaStream_t stream) {
  kvsift::detail::check_step_kv("cuda::write_step_kv", cache, k, v);
  if (cache.batch() == 0) return;
  KVSIFT_CUDA_CHECK(detail::launch_write_step_kv(cache, k, v, stream));
}

void clear_counts(const SelectionView& out, cudaStream_t stream) {
  KVSIFT_CHECK(out.counts != nullptr, "cuda::clear_counts", "out.counts must be non-null");
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(out.counts, 0, std::size_t(out.batch) * std::size_t(out.kv_heads) * sizeof(std::int32_t),
                                    stream));
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
