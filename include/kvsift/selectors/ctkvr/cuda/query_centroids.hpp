#pragma once
/// Query centroids on CUDA: selectors/ctkvr/cpu/query_centroids.hpp's twins, with the same arguments but the context. Device
/// memory; no allocation, no host sync; stream-ordered and CUDA-graph capturable. Scores agree with the CPU's
/// within fp32 rounding (the dot products add in another order); stored centroids are the CPU's up to the last
/// bit of the norm.
/// Trusted on the device (checked on the CPU): slots, counts and `first`. A row whose slot or count is out of
/// range gets NaN scores over the whole capacity (memory stays in bounds); a store to a bad slot or column is
/// skipped.

#include <cstdint>

#include "kvsift/selectors/ctkvr/query_centroids.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

/// cpu::centroid_scores' contract, in device memory. One block per (sequence, kv head) row.
template <class T>
void centroid_scores(const QueryView<const T>& q, const QueryCentroidsView<const T>& centroids, const std::int32_t* d_slots,
                     std::int32_t kv_heads, const MatrixView<float>& scores, const Context& ctx);

/// cpu::store_centroids' contract, in device memory (rows must name distinct slots: two rows of one slot would
/// race, as the CPU refuses). A warp per stored query; the warp of (row, head 0, last query) grows the count.
template <class T>
void store_centroids(const SequenceView<const T>& queries, const std::int32_t* d_slots, const std::int32_t* d_first,
                     std::int32_t kv_heads, const QueryCentroidsView<T>& centroids, const Context& ctx);

}  // namespace kvsift::cuda
