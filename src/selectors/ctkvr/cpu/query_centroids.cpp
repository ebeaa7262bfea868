// Query centroids on the CPU (selectors/ctkvr/cpu/query_centroids.hpp).
#include "kvsift/selectors/ctkvr/cpu/query_centroids.hpp"

#include <algorithm>
#include <limits>
#include <vector>

#include "kvsift/selectors/ctkvr/detail/query_centroids_checks.hpp"
#include "kvsift/selectors/ctkvr/detail/query_centroids_instances.hpp"
#include "kvsift/core/dtype.hpp"

namespace kvsift::cpu {
namespace {

/// Slots must name distinct centroid sets (two rows writing one slot would race).
void check_slots(const char* where, const std::int32_t* slots, std::int32_t batch, std::int32_t capacity,
                 bool distinct) {
  std::vector<bool> seen(std::size_t(capacity), false);
  for (std::int32_t b = 0; b < batch; ++b) {
    KVSIFT_CHECK(slots[b] >= 0 && slots[b] < capacity, where, "slots[{}] (= {}) is outside [0, centroids.slots = {})", b,
                 slots[b], capacity);
    KVSIFT_CHECK(!distinct || !seen[std::size_t(slots[b])], where, "slots[{}] (= {}) repeats an earlier row's slot", b,
                 slots[b]);
    seen[std::size_t(slots[b])] = true;
  }
}

template <class T>
float squared_norm(const T* x, std::int32_t n) {
  float sum = 0.0f;
  for (std::int32_t i = 0; i < n; ++i) sum += to_float(x[i]) * to_float(x[i]);
  return sum;
}

}  // namespace

template <class T>
void centroid_scores(const QueryView<const T>& q, const QueryCentroidsView<const T>& centroids, const std::int32_t* slots,
                     std::int32_t kv_heads, const MatrixView<float>& scores, const Context& ctx) {
  constexpr const char* where = "cpu::centroid_scores";
  kvsift::detail::check_centroid_scores(where, q, centroids, slots, kv_heads, scores);
  check_slots(where, slots, q.batch, centroids.slots, false);
  for (std::int32_t b = 0; b < q.batch; ++b) {
    const std::int32_t count = centroids.counts[slots[b]];
    KVSIFT_CHECK(count >= 0 && count <= centroids.capacity, where,
                 "centroids.counts[{}] (= {}) is outside [0, capacity = {}]", slots[b], count, centroids.capacity);
  }
  const std::int32_t group = q.heads / kv_heads, d = q.head_dim;
  parallel_for(ctx.pool, std::int64_t(q.batch) * kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / kv_heads, g = row % kv_heads;
      const std::int32_t slot = slots[b], count = centroids.counts[slot];
      float* out = scores.row(row);
      std::fill(out, out + centroids.capacity, -std::numeric_limits<float>::infinity());
      for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
        const T* qh = q.row(b, h);
        const float scale = kvsift::detail::inverse_norm(squared_norm(qh, d));
        for (std::int32_t c = 0; c < count; ++c) {
          const T* ch = centroids.row(slot, h, c);
          float dot = 0.0f;
          for (std::int32_t i = 0; i < d; ++i) dot += to_float(qh[i]) * to_float(ch[i]);
          out[c] = std::max(out[c], dot * scale);
        }
      }
    }
  });
}

template <class T>
void store_centroids(const SequenceView<const T>& queries, const std::int32_t* slots, const std::int32_t* first,
                     std::int32_t kv_heads, const QueryCentroidsView<T>& centroids, const Context& ctx) {
  constexpr const char* where = "cpu::store_centroids";
  kvsift::detail::check_store_centroids(where, queries, slots, kv_heads, centroids);
  check_slots(where, slots, queries.batch, centroids.slots, true);
  const std::int32_t group = queries.heads / kv_heads;
  for (std::int64_t row = 0; first != nullptr && row < std::int64_t(queries.batch) * kv_heads; ++row) {
    KVSIFT_CHECK(first[row] >= 0 && first[row] <= centroids.capacity - queries.tokens, where,
                 "first[{}] (= {}) + {} queries passes centroids.capacity (= {})", row, first[row], queries.tokens,
                 centroids.capacity);
  }
  parallel_for(ctx.pool, std::int64_t(queries.batch) * queries.heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int64_t b = item / queries.heads, h = item % queries.heads;
      const std::int32_t start = first != nullptr ? first[b * kv_heads + h / group] : 0;
      for (std::int32_t i = 0; i < queries.tokens; ++i) {
        const T* x = queries.row(b, h, i);
        const float scale = kvsift::detail::inverse_norm(squared_norm(x, queries.head_dim));
        T* out = centroids.row(slots[b], h, start + i);
        for (std::int32_t j = 0; j < queries.head_dim; ++j) out[j] = from_float<T>(to_float(x[j]) * scale);
      }
    }
  });
  for (std::int32_t b = 0; b < queries.batch; ++b) {
    std::int32_t end = queries.tokens;
    for (std::int32_t g = 0; first != nullptr && g < kv_heads; ++g) end = std::max(end, first[b * kv_heads + g] + queries.tokens);
    centroids.counts[slots[b]] = std::max(centroids.counts[slots[b]], end);
  }
}

KVSIFT_STORAGE_TYPES(KVSIFT_QUERY_CENTROIDS_INSTANCES)

}  // namespace kvsift::cpu
