#pragma once
/// CTKVR's query centroids, CPU overloads: what the selector, written once for both backends, calls unqualified
/// (argument-dependent lookup on cpu::Context). cpu/backend.hpp includes this file; selectors/ctkvr/cuda/backend.hpp is
/// the CUDA twin. Each overload forwards to the primitive documented in its own header.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/backend.hpp"  // the shared overloads (which include this file at their end)
#include "kvsift/cpu/context.hpp"
#include "kvsift/selectors/ctkvr/cpu/query_centroids.hpp"
#include "kvsift/selectors/ctkvr/query_centroids.hpp"

namespace kvsift::cpu {

template <class T>
void centroid_scores(const QueryView<const T>& q, const QueryCentroidsView<const T>& centroids, const std::int32_t* slots,
                     std::int32_t kv_heads, const MatrixView<float>& scores, const Context& ctx) {
  cpu::centroid_scores(q, centroids, slots, kv_heads, scores, ctx.pool);
}
template <class T>
void store_centroids(const SequenceView<const T>& queries, const std::int32_t* slots, const std::int32_t* first,
                     std::int32_t kv_heads, const QueryCentroidsView<T>& centroids, const Context& ctx) {
  cpu::store_centroids(queries, slots, first, kv_heads, centroids, ctx.pool);
}

}  // namespace kvsift::cpu
