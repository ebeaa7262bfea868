#pragma once
/// Query centroids on the CPU (selectors/ctkvr/query_centroids.hpp): scoring a decode query against its centroids (CTKVR's
/// recall) and storing normalised queries as centroids (CTKVR's index and its dynamic update). Host memory; no
/// allocation; deterministic and independent of the thread count; every argument is checked, contents included.

#include <cstdint>

#include "kvsift/selectors/ctkvr/query_centroids.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// For row (b, g) = b * kv_heads + g of scores and centroid c of slot s = slots[b]:
///   scores.row(b * kv_heads + g)[c] = max over the group's query heads h of cos(q_h, centroid(s, h, c))
///   = q_h . centroid(s, h, c) / |q_h| (centroids are unit vectors; a zero query scores 0),
/// fp32, accumulated in ascending dimension order; -inf for c in [counts[s], centroids.capacity). Columns past
/// the capacity are not written. q [batch, q_heads, head_dim]; slots [batch], each in [0, centroids.slots), with
/// counts[s] in [0, capacity]. Threads: rows on ctx.pool.
template <class T>
void centroid_scores(const QueryView<const T>& q, const QueryCentroidsView<const T>& centroids, const std::int32_t* slots,
                     std::int32_t kv_heads, const MatrixView<float>& scores, const Context& ctx = {});

/// Query i < n of head h of batch row b, normalised to unit length in fp32 (a zero query stays zero) and rounded
/// to T, becomes centroid first[b * kv_heads + h / group] + i of slot slots[b] (first == nullptr: 0), and the
/// slot's count grows to cover the stored columns: counts[s] = max(counts[s], max over its rows' first + n)
/// (CTKVR's index fills its spare columns before the FIFO wraps). queries [batch, q_heads, n, head_dim] (a decode
/// query: n = 1). Refused: a slot outside [0, centroids.slots), a slot twice, a centroid index outside [0,
/// capacity).
template <class T>
void store_centroids(const SequenceView<const T>& queries, const std::int32_t* slots, const std::int32_t* first,
                     std::int32_t kv_heads, const QueryCentroidsView<T>& centroids, const Context& ctx = {});

}  // namespace kvsift::cpu
