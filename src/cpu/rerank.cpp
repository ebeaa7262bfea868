// Reranking candidates on the CPU (cpu/rerank.hpp).
#include "kvsift/cpu/rerank.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvsift/core/detail/rerank_checks.hpp"
#include "kvsift/core/inverted_lists.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"

namespace kvsift::cpu {
namespace {

std::int64_t scratch_threads(std::int64_t rows, const ThreadPool* pool) {
  return std::max<std::int64_t>(1, std::min<std::int64_t>(rows, pool != nullptr ? pool->size() : 1));
}

float* layout_logits(WorkspaceLayout& layout, std::int64_t rows, std::int32_t group, std::int32_t capacity,
                     const ThreadPool* pool) {
  return layout.allocate<float>(std::size_t(scratch_threads(rows, pool)) * std::size_t(group) * std::size_t(capacity),
                                "candidate_scores logits");
}

}  // namespace

std::size_t candidate_scores_workspace_bytes(std::int64_t rows, std::int32_t group, std::int32_t capacity,
                                             const ThreadPool* pool) {
  kvsift::detail::check_candidate_scores_shape("cpu::candidate_scores_workspace_bytes", rows, group, capacity);
  WorkspaceLayout counting;
  layout_logits(counting, rows, group, capacity, pool);
  return counting.bytes();
}

template <class T, class KV>
void candidate_scores(const QueryView<const T>& q, const KV& kv, const SelectionView& candidates,
                      const GroupScoreOptions& options, const MatrixView<float>& scores, std::span<std::byte> workspace,
                      ThreadPool* pool) {
  constexpr const char* where = "cpu::candidate_scores";
  kvsift::detail::check_candidate_scores(where, q, kv, candidates, options, scores, MemorySpace::host);
  const std::int64_t rows = std::int64_t(q.batch) * kv.kv_heads;
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int32_t b = std::int32_t(row / kv.kv_heads), count = candidates.counts[row];
    KVSIFT_CHECK(count >= 0 && count <= candidates.capacity, where,
                 "candidates.counts[{}] (= {}) is outside [0, capacity = {}]", row, count, candidates.capacity);
    const std::int32_t* ids = candidates.indices + row * candidates.capacity;
    for (std::int32_t i = 0; i < count; ++i) {
      KVSIFT_CHECK(ids[i] >= 0 && ids[i] < kv.seq_len(b), where,
                   "candidate {} of row {} (= {}) is outside [0, seq_len = {})", i, row, ids[i], kv.seq_len(b));
    }
  }
  const std::int32_t group = q.heads / kv.kv_heads, d = q.head_dim;
  WorkspaceLayout layout(workspace, where);
  float* logits = layout_logits(layout, rows, group, candidates.capacity, pool);
  const float scale = options.sm_scale != 0.0f ? options.sm_scale : 1.0f / std::sqrt(float(d));
  const std::int64_t threads = scratch_threads(rows, pool);
  // Rows are split into `threads` contiguous chunks, chunk i using scratch i: a fixed split, so the scratch a row
  // uses never depends on the pool's scheduling.
  parallel_for(pool, threads, [&](std::int64_t first_chunk, std::int64_t last_chunk) {
    for (std::int64_t chunk = first_chunk; chunk < last_chunk; ++chunk) {
      float* s = logits + chunk * std::int64_t(group) * candidates.capacity;
      for (std::int64_t row = rows * chunk / threads; row < rows * (chunk + 1) / threads; ++row) {
        const std::int64_t b = row / kv.kv_heads, g = row % kv.kv_heads;
        const std::int32_t count = candidates.counts[row];
        const std::int32_t* ids = candidates.indices + row * candidates.capacity;
        float* out = scores.row(row);
        for (std::int32_t j = 0; j < group; ++j) {
          const T* qh = q.row(b, g * group + j);
          float* sh = s + std::int64_t(j) * candidates.capacity;
          for (std::int32_t i = 0; i < count; ++i) {
            const T* k = kv.k_row(b, g, ids[i]);
            float dot = 0.0f;
            for (std::int32_t c = 0; c < d; ++c) dot += to_float(qh[c]) * to_float(k[c]);
            sh[i] = scale * dot;
          }
          if (options.softmax && count > 0) {
            // exp(s - LSE) = exp(s - m) / sum: the head's softmax over its candidates, NaN kept (as group_scores).
            float m = sh[0];
            for (std::int32_t i = 1; i < count; ++i) m = std::isnan(m) || std::isnan(sh[i]) ? NAN : std::max(m, sh[i]);
            float sum = 0.0f;
            for (std::int32_t i = 0; i < count; ++i) sum += std::exp(sh[i] - m);
            for (std::int32_t i = 0; i < count; ++i) sh[i] = std::exp(sh[i] - m) / sum;
          }
        }
        for (std::int32_t i = 0; i < count; ++i) {
          float r = s[i];
          for (std::int32_t j = 1; j < group; ++j) {
            const float x = s[std::int64_t(j) * candidates.capacity + i];
            r = options.reduce == GroupReduce::sum ? r + x : (std::isnan(r) || std::isnan(x) ? NAN : std::max(r, x));
          }
          out[i] = r;
        }
      }
    }
  });
}

void remap_selection(const SelectionView& positions, const SelectionView& ids, const SelectionView& out) {
  constexpr const char* where = "cpu::remap_selection";
  kvsift::detail::check_remap_selection(where, positions, ids, out);
  const std::int64_t rows = std::int64_t(positions.batch) * positions.kv_heads;
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int32_t count = positions.counts[row], available = ids.counts[row];
    KVSIFT_CHECK(count >= 0 && count <= positions.capacity, where,
                 "positions.counts[{}] (= {}) is outside [0, capacity = {}]", row, count, positions.capacity);
    KVSIFT_CHECK(available >= 0 && available <= ids.capacity, where, "ids.counts[{}] (= {}) is outside [0, capacity = {}]",
                 row, available, ids.capacity);
    const std::int32_t* p = positions.indices + row * positions.capacity;
    const std::int32_t* from = ids.indices + row * ids.capacity;
    std::int32_t* to = out.indices + row * out.capacity;
    float* weights = out.log_weights != nullptr ? out.log_weights + row * out.capacity : nullptr;
    for (std::int32_t i = 0; i < count; ++i) {
      KVSIFT_CHECK(p[i] >= 0 && p[i] < available, where, "position {} of row {} (= {}) is outside [0, ids.count = {})",
                   i, row, p[i], available);
      to[i] = from[p[i]];  // in place: p[i] is read before to[i] (the same entry) is written
      if (weights != nullptr) weights[i] = 0.0f;
    }
    out.counts[row] = count;
  }
}

void append_range(const SelectionView& rows, const std::int32_t* slots, const std::int32_t* first,
                  const std::int32_t* lengths, const AttentionWindow& window) {
  constexpr const char* where = "cpu::append_range";
  kvsift::detail::check_append_range(where, rows, slots, first, lengths, window);
  for (std::int64_t row = 0; row < std::int64_t(rows.batch) * rows.kv_heads; ++row) {
    const std::int64_t b = row / rows.kv_heads;
    std::int32_t count = rows.counts[row];
    KVSIFT_CHECK(count >= 0 && count <= rows.capacity, where, "rows.counts[{}] (= {}) is outside [0, capacity = {}]",
                 row, count, rows.capacity);
    KVSIFT_CHECK(lengths[b] >= 0, where, "lengths[{}] (= {}) is negative", b, lengths[b]);
    const kvsift::detail::TokenRange range = kvsift::detail::unindexed_range(first[slots[b]], lengths[b], window);
    std::int32_t* ids = rows.indices + row * rows.capacity;
    count = std::int32_t(std::lower_bound(ids, ids + count, range.begin) - ids);
    const std::int64_t added = std::max<std::int64_t>(0, std::int64_t(range.end) - range.begin);
    KVSIFT_CHECK(count + added <= rows.capacity, where,
                 "row {} holds {} entries below {} and the range adds {}: more than its capacity ({})", row, count,
                 range.begin, added, rows.capacity);
    float* weights = rows.log_weights != nullptr ? rows.log_weights + row * rows.capacity : nullptr;
    for (std::int64_t i = 0; i < added; ++i) {
      ids[count + i] = std::int32_t(range.begin + i);
      if (weights != nullptr) weights[count + i] = 0.0f;
    }
    rows.counts[row] = std::int32_t(count + added);
  }
}

#define KVSIFT_INSTANTIATE(T, KV)                                                                                    \
  template void candidate_scores<T, KV>(const QueryView<const T>&, const KV&, const SelectionView&,                  \
                                        const GroupScoreOptions&, const MatrixView<float>&, std::span<std::byte>,    \
                                        ThreadPool*);
#define KVSIFT_INSTANTIATE_LAYOUTS(T) \
  KVSIFT_INSTANTIATE(T, ContiguousKVView<const T>) KVSIFT_INSTANTIATE(T, PagedKVView<const T>)
KVSIFT_INSTANTIATE_LAYOUTS(float)
KVSIFT_INSTANTIATE_LAYOUTS(half)
KVSIFT_INSTANTIATE_LAYOUTS(bfloat16)
#undef KVSIFT_INSTANTIATE_LAYOUTS
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cpu
