// CUDA cache operations of the decode step: checks (host compiler); kernels in kernels/cache_ops.cu.
#include "kvsift/cuda/cache_ops.hpp"

#include <cstdint>

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

template <class T>
void first_nonfinite_key(const KVCache<const T>& cache, const std::int32_t* d_lengths, std::int32_t* d_out,
                         cudaStream_t stream) {
  constexpr const char* where = "cuda::first_nonfinite_key";
  KVSIFT_CHECK(d_out != nullptr && reinterpret_cast<std::uintptr_t>(d_out) % 8 == 0, where,
               "d_out must be non-null and 8-byte aligned");
  KVSIFT_CHECK(cache.batch() >= 0 && cache.kv_heads() >= 0 && cache.head_dim() >= 0, where,
               "cache [batch = {}, kv_heads = {}, head_dim = {}] must not be negative", cache.batch(), cache.kv_heads(),
               cache.head_dim());
  const std::int64_t elements = std::int64_t(cache.batch()) * cache.kv_heads() * cache.head_dim();
  KVSIFT_CHECK(elements == 0 || d_lengths != nullptr, where, "d_lengths must be non-null");
  KVSIFT_CHECK(elements < (std::int64_t(1) << 33), where,
               "cache.batch() * kv_heads * head_dim (= {}) must be below 2^33 (the scan's 64-bit positions)", elements);
  KVSIFT_CUDA_CHECK(detail::launch_first_nonfinite_key(cache, d_lengths, d_out, elements > 0 ? multiprocessor_count() : 0,
                                                       stream));
}

void clear_counts(const SelectionView& out, cudaStream_t stream) {
  KVSIFT_CHECK(out.counts != nullptr, "cuda::clear_counts", "out.counts must be non-null");
  KVSIFT_CHECK(out.batch >= 0 && out.kv_heads >= 0, "cuda::clear_counts",
               "out's batch (= {}) and kv_heads (= {}) must not be negative", out.batch, out.kv_heads);
  KVSIFT_CUDA_CHECK(detail::launch_clear_counts(out.counts, std::int64_t(out.batch) * out.kv_heads, stream));
}

void write_identity_indices(const SelectionView& out, cudaStream_t stream) {
  constexpr const char* where = "cuda::write_identity_indices";
  KVSIFT_CHECK(out.batch >= 0 && out.kv_heads >= 0 && out.capacity >= 0, where,
               "out's batch (= {}), kv_heads (= {}) and capacity (= {}) must not be negative", out.batch, out.kv_heads,
               out.capacity);
  const std::int64_t rows = std::int64_t(out.batch) * out.kv_heads;
  if (rows == 0 || out.capacity == 0) return;
  KVSIFT_CHECK(out.indices != nullptr, where, "out.indices must be non-null");
  KVSIFT_CUDA_CHECK(detail::launch_identity_indices(out.indices, rows, out.capacity, stream));
}

#define KVSIFT_INSTANTIATE_CACHE_OPS(T)                                                                     \
  template void sequence_lengths<T>(const KVCache<const T>&, std::int32_t*, cudaStream_t);                  \
  template void write_step_kv<T>(const KVCache<T>&, const HeadsView<const T>&, const HeadsView<const T>&, \
                                 cudaStream_t);                                                         \
  template void first_nonfinite_key<T>(const KVCache<const T>&, const std::int32_t*, std::int32_t*, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE_CACHE_OPS)
#undef KVSIFT_INSTANTIATE_CACHE_OPS

}  // namespace kvsift::cuda
