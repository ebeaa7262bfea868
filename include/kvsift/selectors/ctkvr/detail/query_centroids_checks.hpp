#pragma once
/// The argument checks that selectors/ctkvr/cpu/query_centroids.hpp and selectors/ctkvr/cuda/query_centroids.hpp share (shapes, not contents).

#include <cstdint>

#include "kvsift/core/error.hpp"
#include "kvsift/selectors/ctkvr/query_centroids.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::detail {

template <class T>
void check_query_centroids(const char* where, const QueryCentroidsView<T>& c) {
  KVSIFT_CHECK(c.data != nullptr && c.counts != nullptr, where, "centroids.data and centroids.counts must be non-null");
  KVSIFT_CHECK(c.slots >= 1 && c.q_heads >= 1 && c.capacity >= 1 && c.head_dim >= 1, where,
               "centroids has slots = {}, q_heads = {}, capacity = {}, head_dim = {}; each must be positive", c.slots,
               c.q_heads, c.capacity, c.head_dim);
}

/// The checks that centroid_scores shares between backends: q [batch, centroids.q_heads, head_dim], q_heads a
/// multiple of kv_heads, scores [batch * kv_heads, >= capacity].
template <class T>
void check_centroid_scores(const char* where, const QueryView<const T>& q, const QueryCentroidsView<const T>& centroids,
                           const std::int32_t* slots, std::int32_t kv_heads, const MatrixView<float>& scores) {
  validate(q, where, "q");
  check_query_centroids(where, centroids);
  validate(scores, where, "scores");
  KVSIFT_CHECK(slots != nullptr, where, "slots must be non-null");
  KVSIFT_CHECK(q.heads == centroids.q_heads && q.head_dim == centroids.head_dim, where,
               "q has {} heads of dim {}, centroids {} of dim {}", q.heads, q.head_dim, centroids.q_heads,
               centroids.head_dim);
  KVSIFT_CHECK(kv_heads >= 1 && q.heads % kv_heads == 0, where, "kv_heads (= {}) must divide q's heads (= {})",
               kv_heads, q.heads);
  KVSIFT_CHECK(scores.rows == std::int64_t(q.batch) * kv_heads && scores.cols >= centroids.capacity, where,
               "scores is [{}, {}]; expected [batch * kv_heads = {}, >= centroids.capacity = {}]", scores.rows,
               scores.cols, std::int64_t(q.batch) * kv_heads, centroids.capacity);
}

/// The checks that store_centroids shares: queries [batch, centroids.q_heads, n, head_dim], n >= 1.
template <class T>
void check_store_centroids(const char* where, const SequenceView<const T>& queries, const std::int32_t* slots,
                           std::int32_t kv_heads, const QueryCentroidsView<T>& centroids) {
  validate(queries, where, "queries");
  check_query_centroids(where, centroids);
  KVSIFT_CHECK(slots != nullptr, where, "slots must be non-null");
  KVSIFT_CHECK(queries.heads == centroids.q_heads && queries.head_dim == centroids.head_dim, where,
               "queries has {} heads of dim {}, centroids {} of dim {}", queries.heads, queries.head_dim,
               centroids.q_heads, centroids.head_dim);
  KVSIFT_CHECK(kv_heads >= 1 && queries.heads % kv_heads == 0, where, "kv_heads (= {}) must divide the heads (= {})",
               kv_heads, queries.heads);
  KVSIFT_CHECK(queries.tokens >= 1 && queries.tokens <= centroids.capacity, where,
               "queries holds {} per head; expected 1 to centroids.capacity = {}", queries.tokens, centroids.capacity);
}

}  // namespace kvsift::detail
