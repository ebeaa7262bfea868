#pragma once
/// The launchers of kernels/selectors/ctkvr/query_centroids.cu (selectors/ctkvr/cuda/query_centroids.hpp). They
/// return the launch status and never throw; the host entry points (src/selectors/ctkvr/cuda/query_centroids.cpp)
/// check the arguments first, and the group-dot limits of cuda/detail/rerank_launch.hpp.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kvsift/core/views.hpp"
#include "kvsift/cuda/detail/rerank_launch.hpp"
#include "kvsift/selectors/ctkvr/query_centroids.hpp"

namespace kvsift::cuda::detail {

template <class T>
cudaError_t launch_centroid_scores(const QueryView<const T>& q, const QueryCentroidsView<const T>& centroids,
                                   const std::int32_t* slots, std::int32_t kv_heads, const MatrixView<float>& scores,
                                   cudaStream_t stream);

template <class T>
cudaError_t launch_store_centroids(const SequenceView<const T>& queries, const std::int32_t* slots,
                                   const std::int32_t* first, std::int32_t kv_heads,
                                   const QueryCentroidsView<T>& centroids, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
