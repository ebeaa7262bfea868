#pragma once
/// CTKVR's query centroids, CUDA overloads: what the selector, written once for both backends, calls unqualified
/// (argument-dependent lookup on cuda::Context). cuda/backend.hpp includes this file; selectors/ctkvr/cpu/backend.hpp
/// is the CPU twin. Each overload forwards to the primitive documented in its own header.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/backend.hpp"  // the shared overloads (which include this file at their end)
#include "kvsift/cuda/context.hpp"
#include "kvsift/selectors/ctkvr/cuda/query_centroids.hpp"
#include "kvsift/selectors/ctkvr/query_centroids.hpp"

namespace kvsift::cuda {

template <class T>
void centroid_scores(const QueryView<const T>& q, const QueryCentroidsView<const T>& centroids, const std::int32_t* slots,
                     std::int32_t kv_heads, const MatrixView<float>& scores, const Context& ctx) {
  cuda::centroid_scores(q, centroids, slots, kv_heads, scores, ctx.stream);
}
template <class T>
void store_centroids(const SequenceView<const T>& queries, const std::int32_t* slots, const std::int32_t* first,
                     std::int32_t kv_heads, const QueryCentroidsView<T>& centroids, const Context& ctx) {
  cuda::store_centroids(queries, slots, first, kv_heads, centroids, ctx.stream);
}

}  // namespace kvsift::cuda
