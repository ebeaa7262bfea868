// CTKVR's query centroids on CUDA (selectors/ctkvr/cuda/query_centroids.hpp): the checks shared with the CPU, the
// kernels' own limits, then the launchers of kernels/selectors/ctkvr/query_centroids.cu.
#include "kvsift/selectors/ctkvr/cuda/query_centroids.hpp"

#include "kvsift/core/dtype.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/selectors/ctkvr/cuda/detail/query_centroids_launch.hpp"
#include "kvsift/selectors/ctkvr/detail/query_centroids_checks.hpp"
#include "kvsift/selectors/ctkvr/detail/query_centroids_instances.hpp"

namespace kvsift::cuda {

template <class T>
void centroid_scores(const QueryView<const T>& q, const QueryCentroidsView<const T>& centroids, const std::int32_t* d_slots,
                     std::int32_t kv_heads, const MatrixView<float>& scores, const Context& ctx) {
  constexpr const char* where = "cuda::centroid_scores";
  kvsift::detail::check_centroid_scores(where, q, centroids, d_slots, kv_heads, scores);
  detail::check_group_dot_limits(where, q.heads / kv_heads, q.head_dim);
  KVSIFT_CUDA_CHECK(detail::launch_centroid_scores(q, centroids, d_slots, kv_heads, scores, ctx.stream));
}

template <class T>
void store_centroids(const SequenceView<const T>& queries, const std::int32_t* d_slots, const std::int32_t* d_first,
                     std::int32_t kv_heads, const QueryCentroidsView<T>& centroids, const Context& ctx) {
  kvsift::detail::check_store_centroids("cuda::store_centroids", queries, d_slots, kv_heads, centroids);
  KVSIFT_CUDA_CHECK(detail::launch_store_centroids(queries, d_slots, d_first, kv_heads, centroids, ctx.stream));
}

KVSIFT_STORAGE_TYPES(KVSIFT_QUERY_CENTROIDS_INSTANCES)

}  // namespace kvsift::cuda
