// The merge store's CPU primitives (selectors/centroid_kv/cpu/merge_store.hpp). A round runs in two passes: the cosine matching per
// (row, chunk) on the pool, each chunk's A keys scored against its B keys in fixed tiles with the SIMD level's
// blocked dot products (cpu/detail score_rows); then per row the ranking of its links, the merges and the
// compaction of `order`.
#include "kvsift/selectors/centroid_kv/cpu/merge_store.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvsift/core/dtype.hpp"
#include "kvsift/selectors/centroid_kv/detail/merge_store_checks.hpp"
#include "kvsift/selectors/centroid_kv/detail/merge_store_instances.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/detail/primitives_kernels.hpp"
#include "kvsift/cpu/kmeans.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu {
namespace {

using kvsift::detail::MergeChunks;
using kvsift::detail::merge_round_links;

/// The matching's tiles: A keys (rows) by B keys (panel columns). Fixed, so the workspace depends on neither the
/// chunk nor head_dim (<= kMaxHeadDim); a chunk's B tiles are packed once and each meets every A tile.
constexpr std::int64_t kATile = 64;
constexpr std::int64_t kBTile = 64;  // a multiple of ScorePanel::kPanelPadding
constexpr std::int32_t kMaxHeadDim = 256;
static_assert(kBTile % detail::ScorePanel::kPanelPadding == 0);

struct MergeRoundWorkspace {
  std::int32_t* merges;     ///< [rows]: links each row merges (0: the row sits out)
  float* similarity;        ///< [rows, capacity]: per A position, the similarity of its link
  std::int32_t* link;       ///< [rows, capacity]: per A position, its B position; then -1 but for merged A entries
  float* inverse_norm;      ///< [rows, capacity]: per middle position, 1 / |key| (0 for a zero key)
  std::int32_t* ranked;     ///< [rows, capacity]: the row's A positions, best links first
  std::int32_t* freed;      ///< [rows, capacity]: the slots the merged A entries free, in sequence order
  float* a_rows;            ///< [threads, kATile, kMaxHeadDim]: normalized A keys
  float* b_tiles;           ///< [threads, kBTile, kMaxHeadDim]: normalized B keys, ScorePanel layout
  float* b_offsets;         ///< [threads, kBTile]: zeros (the panel's offsets)
  float* scores;            ///< [threads, kATile, kBTile]
};

std::int64_t round_threads(ThreadPool* pool) { return pool != nullptr ? pool->size() : 1; }

MergeRoundWorkspace layout_merge_round(WorkspaceLayout& layout, std::int64_t rows, std::int32_t capacity,
                                       std::int64_t threads) {
  const std::size_t entries = std::size_t(rows) * std::size_t(capacity), t = std::size_t(threads);
  MergeRoundWorkspace ws{};
  ws.merges = layout.allocate<std::int32_t>(std::size_t(rows), "merge_round merges");
  ws.similarity = layout.allocate<float>(entries, "merge_round similarities");
  ws.link = layout.allocate<std::int32_t>(entries, "merge_round links");
  ws.inverse_norm = layout.allocate<float>(entries, "merge_round inverse norms");
  ws.ranked = layout.allocate<std::int32_t>(entries, "merge_round ranked links");
  ws.freed = layout.allocate<std::int32_t>(entries, "merge_round freed slots");
  ws.a_rows = layout.allocate<float>(t * kATile * kMaxHeadDim, "merge_round A tiles");
  ws.b_tiles = layout.allocate<float>(t * kBTile * kMaxHeadDim, "merge_round B tiles");
  ws.b_offsets = layout.allocate<float>(t * kBTile, "merge_round B offsets");
  ws.scores = layout.allocate<float>(t * kATile * kBTile, "merge_round scores");
  return ws;
}

/// Slots of a call in [0, store.slots), for `batch` rows.
template <class T>
void check_slots(const char* where, const char* name, const std::int32_t* slots, std::int32_t batch,
                 const MergeStoreView<T>& store) {
  KVSIFT_CHECK(slots != nullptr, where, "{} must be non-null", name);
  for (std::int32_t b = 0; b < batch; ++b) {
    KVSIFT_CHECK(slots[b] >= 0 && slots[b] < store.slots, where, "{}[{}] (= {}) is outside [0, store.slots = {})", name,
                 b, slots[b], store.slots);
  }
}

/// Every row's count within [0, capacity] (host values: a corrupted store is refused rather than read past).
template <class T>
void check_counts(const char* where, const char* name, const std::int32_t* slots, std::int32_t batch,
                  const MergeStoreView<T>& store) {
  for (std::int32_t b = 0; b < batch; ++b) {
    for (std::int32_t h = 0; h < store.kv_heads; ++h) {
      const std::int32_t count = store.count[store.row(slots[b], h)];
      KVSIFT_CHECK(count >= 0 && count <= store.capacity, where,
                   "{}: the row of slot {}, kv head {} has count {}, outside [0, capacity = {}]", name, slots[b], h,
                   count, store.capacity);
    }
  }
}

template <class T>
float squared_norm(const T* x, std::int32_t d) {
  float sum = 0.0f;
  for (std::int32_t c = 0; c < d; ++c) sum += to_float(x[c]) * to_float(x[c]);
  return sum;
}

/// Links of one chunk of one row: every A entry's most similar B entry (ties: the earlier B entry) and that
/// similarity, into the row's link and similarity arrays; `thread` picks the tiles.
template <SimdLevel L, class T>
void match_chunk(const MergeStoreView<T>& store, std::int64_t row, const MergeChunks& chunks, std::int32_t j,
                 const MergeRoundWorkspace& ws, std::int64_t ws_row, std::int64_t thread) {
  constexpr std::int64_t kPad = detail::ScorePanel::kPanelPadding;
  const std::int32_t d = store.head_dim, first = chunks.chunk_begin(j), size = chunks.chunk_size(j);
  const std::int32_t n_b = (size + 1) / 2, n_a = size / 2;
  if (n_a == 0) return;
  const std::int32_t* order = store.row_order(row);
  float* const similarity = ws.similarity + ws_row * store.capacity;
  std::int32_t* const link = ws.link + ws_row * store.capacity;
  float* const inverse_norm = ws.inverse_norm + ws_row * store.capacity;
  for (std::int32_t p = first; p < first + size; ++p) {
    const float norm2 = squared_norm(store.k_slot(row, order[p]), d);
    inverse_norm[p] = norm2 > 0.0f ? 1.0f / std::sqrt(norm2) : 0.0f;
  }
  for (std::int32_t i = 0; i < n_a; ++i) {
    similarity[first + 2 * i + 1] = -std::numeric_limits<float>::infinity();
    link[first + 2 * i + 1] = first;
  }
  float* const a_rows = ws.a_rows + thread * kATile * kMaxHeadDim;
  float* const tiles = ws.b_tiles + thread * kBTile * kMaxHeadDim;
  float* const offsets = ws.b_offsets + thread * kBTile;
  float* const scores = ws.scores + thread * kATile * kBTile;
  const auto normalized = [&](std::int32_t p, auto&& put) {
    const T* key = store.k_slot(row, order[p]);
    for (std::int32_t c = 0; c < d; ++c) put(c, to_float(key[c]) * inverse_norm[p]);
  };
  for (std::int32_t b0 = 0; b0 < n_b; b0 += std::int32_t(kBTile)) {
    const std::int32_t nb = std::min<std::int32_t>(std::int32_t(kBTile), n_b - b0);
    const std::int64_t padded = (nb + kPad - 1) / kPad * kPad;
    std::fill_n(tiles, padded * d, 0.0f);
    std::fill_n(offsets, padded, 0.0f);
    for (std::int32_t c = 0; c < nb; ++c) {
      float* column = tiles + (c / kPad) * d * kPad + c % kPad;
      normalized(first + 2 * (b0 + c), [&](std::int32_t ch, float x) { column[std::int64_t(ch) * kPad] = x; });
    }
    const detail::ScorePanel panel{.tiles = tiles, .offsets = offsets, .dim = d, .count = nb, .padded = padded};
    for (std::int32_t a0 = 0; a0 < n_a; a0 += std::int32_t(kATile)) {
      const std::int32_t na = std::min<std::int32_t>(std::int32_t(kATile), n_a - a0);
      for (std::int32_t i = 0; i < na; ++i) {
        float* out = a_rows + std::int64_t(i) * d;
        normalized(first + 2 * (a0 + i) + 1, [&](std::int32_t ch, float x) { out[ch] = x; });
      }
      detail::score_rows<L>(MatrixView<const float>::packed(a_rows, na, d), panel, scores, kBTile, 0, nb);
      for (std::int32_t i = 0; i < na; ++i) {
        const std::int32_t a = first + 2 * (a0 + i) + 1;
        for (std::int32_t c = 0; c < nb; ++c) {
          // Strict: an equal later B entry (and a NaN) never replaces the best so far.
          if (scores[i * kBTile + c] > similarity[a]) {
            similarity[a] = scores[i * kBTile + c];
            link[a] = first + 2 * (b0 + c);
          }
        }
      }
    }
  }
}

/// Ranks a row's links, merges the best `merges` of them into their B entries and compacts `order`.
template <class T>
void merge_row(const MergeStoreView<T>& store, std::int64_t row, std::int32_t merges, const MergeRoundParams& params,
               const MergeRoundWorkspace& ws, std::int64_t ws_row) {
  const std::int32_t count = store.count[row], d = store.head_dim;
  const MergeChunks chunks = MergeChunks::of(count, params);
  const float* const similarity = ws.similarity + ws_row * store.capacity;
  std::int32_t* const link = ws.link + ws_row * store.capacity;
  std::int32_t* const ranked = ws.ranked + ws_row * store.capacity;
  std::int32_t* const freed = ws.freed + ws_row * store.capacity;
  std::int32_t* const order = store.row_order(row);
  std::int32_t* const degree = store.row_degree(row);
  float* const log_degree = store.row_log_degree(row);

  std::int32_t links = 0;
  for (std::int32_t j = 0; j < chunks.chunks(); ++j) {
    const std::int32_t first = chunks.chunk_begin(j), size = chunks.chunk_size(j);
    for (std::int32_t p = first + 1; p < first + size; p += 2) ranked[links++] = p;
  }
  KVSIFT_DASSERT(links == chunks.links() && merges <= links);
  // NaN ranks last, so that the order stays strict and weak.
  const auto key = [&](std::int32_t p) {
    return std::isnan(similarity[p]) ? -std::numeric_limits<float>::infinity() : similarity[p];
  };
  const auto better = [&](std::int32_t x, std::int32_t y) { return key(x) > key(y) || (key(x) == key(y) && x < y); };
  if (merges < links) std::nth_element(ranked, ranked + merges, ranked + links, better);
  // From here link[p] >= 0 marks exactly the merged A entries.
  for (std::int32_t i = merges; i < links; ++i) link[ranked[i]] = -1;
  std::fill_n(link, chunks.middle_begin, -1);
  std::fill(link + chunks.middle_end, link + count, -1);
  for (std::int32_t j = 0; j < chunks.chunks(); ++j) {
    const std::int32_t first = chunks.chunk_begin(j), size = chunks.chunk_size(j);
    for (std::int32_t p = first; p < first + size; p += 2) link[p] = -1;
  }

  // Degree-weighted means, fp32 sums in sequence order with the B entry first, rounded once.
  float sum_k[kMaxHeadDim], sum_v[kMaxHeadDim];
  for (std::int32_t j = 0; j < chunks.chunks(); ++j) {
    const std::int32_t first = chunks.chunk_begin(j), end = first + chunks.chunk_size(j);
    for (std::int32_t b = first; b < end; b += 2) {
      std::int32_t total = 0;
      for (std::int32_t a = first + 1; a < end; a += 2) {
        if (link[a] != b) continue;
        if (total == 0) {
          const T *kb = store.k_slot(row, order[b]), *vb = store.v_slot(row, order[b]);
          const float w = float(degree[b]);
          for (std::int32_t c = 0; c < d; ++c) sum_k[c] = w * to_float(kb[c]), sum_v[c] = w * to_float(vb[c]);
          total = degree[b];
        }
        const T *ka = store.k_slot(row, order[a]), *va = store.v_slot(row, order[a]);
        const float w = float(degree[a]);
        for (std::int32_t c = 0; c < d; ++c) sum_k[c] += w * to_float(ka[c]), sum_v[c] += w * to_float(va[c]);
        total += degree[a];
      }
      if (total == 0) continue;
      T *kb = store.k_slot(row, order[b]), *vb = store.v_slot(row, order[b]);
      const float n = float(total);
      for (std::int32_t c = 0; c < d; ++c) kb[c] = from_float<T>(sum_k[c] / n), vb[c] = from_float<T>(sum_v[c] / n);
      degree[b] = total;
      log_degree[b] = std::log(n);
    }
  }

  // Stable partition: survivors (their degrees with them), then the freed slots in sequence order; the free slots
  // past count stay where they are.
  std::int32_t kept = 0, released = 0;
  for (std::int32_t p = 0; p < count; ++p) {
    if (link[p] >= 0) {
      freed[released++] = order[p];
    } else {
      order[kept] = order[p], degree[kept] = degree[p], log_degree[kept] = log_degree[p];
      ++kept;
    }
  }
  KVSIFT_DASSERT(released == merges);
  std::copy_n(freed, released, order + kept);
  store.count[row] = kept;
}

/// Runs fn(b, h) for every row of a call, rows split over the pool.
template <class Fn>
void for_rows(ThreadPool* pool, std::int32_t batch, std::int32_t kv_heads, Fn&& fn) {
  parallel_for(pool, std::int64_t(batch) * kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) fn(std::int32_t(r / kv_heads), std::int32_t(r % kv_heads));
  });
}

}  // namespace

template <class T>
void merge_store_load(const KVCache<const T>& cache, const std::int32_t* slots, const MergeStoreView<T>& store,
                      const Context& ctx) {
  constexpr const char* where = "cpu::merge_store_load";
  kvsift::detail::check_merge_store(where, "store", store);
  kvsift::detail::check_cache_matches(where, cache, store);
  check_slots(where, "slots", slots, cache.batch(), store);
  for (std::int32_t b = 0; b < cache.batch(); ++b) {
    KVSIFT_CHECK(cache.seq_len(b) >= 0 && cache.seq_len(b) <= store.capacity, where,
                 "batch row {} has {} tokens, more than the store's capacity (= {})", b, cache.seq_len(b),
                 store.capacity);
  }
  cache.visit([&](const auto& kv) {
    for_rows(ctx.pool, kv.batch, store.kv_heads, [&](std::int32_t b, std::int32_t h) {
      const std::int64_t row = store.row(slots[b], h);
      const std::int32_t n = kv.seq_len(b), d = store.head_dim;
      for (std::int32_t t = 0; t < n; ++t) {
        std::copy_n(kv.k_row(b, h, t), d, store.k_slot(row, t));
        std::copy_n(kv.v_row(b, h, t), d, store.v_slot(row, t));
      }
      for (std::int32_t i = 0; i < store.capacity; ++i) store.row_order(row)[i] = i;
      std::fill_n(store.row_degree(row), n, 1);
      std::fill_n(store.row_log_degree(row), n, 0.0f);
      store.count[row] = n;
    });
  });
}

std::size_t merge_round_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity,
                                        const Context& ctx) {
  constexpr const char* where = "cpu::merge_round_workspace_bytes";
  KVSIFT_CHECK(batch > 0 && kv_heads > 0 && capacity > 0, where,
               "batch (= {}), kv_heads (= {}) and capacity (= {}) must be positive", batch, kv_heads, capacity);
  WorkspaceLayout counting;
  layout_merge_round(counting, std::int64_t(batch) * kv_heads, capacity, round_threads(ctx.pool));
  return counting.bytes();
}

template <class T>
void merge_round(const MergeStoreView<T>& store, const std::int32_t* slots, std::int32_t batch,
                 const std::int32_t* budgets, const MergeRoundParams& params, std::span<std::byte> workspace,
                 const Context& ctx) {
  constexpr const char* where = "cpu::merge_round";
  kvsift::detail::check_merge_store(where, "store", store);
  kvsift::detail::check_merge_round_params(where, params);
  KVSIFT_CHECK(batch > 0, where, "batch (= {}) must be positive", batch);
  KVSIFT_CHECK(budgets != nullptr, where, "budgets must be non-null");
  check_slots(where, "slots", slots, batch, store);
  kvsift::detail::check_distinct_slots(where, "slots", slots, batch);
  check_counts(where, "store", slots, batch, store);
  const std::int64_t rows = std::int64_t(batch) * store.kv_heads, threads = round_threads(ctx.pool);
  WorkspaceLayout carving(workspace, where);
  const MergeRoundWorkspace ws = layout_merge_round(carving, rows, store.capacity, threads);

  const auto store_row = [&](std::int64_t r) { return store.row(slots[r / store.kv_heads], r % store.kv_heads); };
  for (std::int64_t r = 0; r < rows; ++r) {
    ws.merges[r] = merge_round_links(store.count[store_row(r)], budgets[slots[r / store.kv_heads]], params);
  }
  // Matching: (row, chunk) items, each run of items on one thread with its own tiles.
  const std::int64_t max_chunks = (std::int64_t(store.capacity) + params.chunk - 1) / params.chunk;
  const std::int64_t items = rows * max_chunks, runs = std::min(items, threads);
  with_simd_level([&]<SimdLevel L>() {
    parallel_for(ctx.pool, runs, [&](std::int64_t run_begin, std::int64_t run_end) {
      for (std::int64_t run = run_begin; run < run_end; ++run) {
        for (std::int64_t item = run * items / runs; item < (run + 1) * items / runs; ++item) {
          const std::int64_t r = item / max_chunks;
          const auto j = std::int32_t(item % max_chunks);
          if (ws.merges[r] == 0) continue;
          const MergeChunks chunks = MergeChunks::of(store.count[store_row(r)], params);
          if (j < chunks.chunks()) match_chunk<L>(store, store_row(r), chunks, j, ws, r, run);
        }
      }
    });
  });
  parallel_for(ctx.pool, rows, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      if (ws.merges[r] > 0) merge_row(store, store_row(r), ws.merges[r], params, ws, r);
    }
  });
}

template <class T>
void merge_store_append(const KVCache<const T>& cache, const std::int32_t* slots, const std::int32_t* lengths,
                        const MergeStoreView<T>& store, const Context& ctx) {
  constexpr const char* where = "cpu::merge_store_append";
  kvsift::detail::check_merge_store(where, "store", store);
  kvsift::detail::check_cache_matches(where, cache, store);
  check_slots(where, "slots", slots, cache.batch(), store);
  kvsift::detail::check_distinct_slots(where, "slots", slots, cache.batch());
  check_counts(where, "store", slots, cache.batch(), store);
  KVSIFT_CHECK(lengths != nullptr, where, "lengths must be non-null");
  for (std::int32_t b = 0; b < cache.batch(); ++b) {
    KVSIFT_CHECK(lengths[b] >= 1 && lengths[b] <= cache.seq_len(b), where,
                 "lengths[{}] (= {}) is outside [1, the cache's length = {}]", b, lengths[b], cache.seq_len(b));
    for (std::int32_t h = 0; h < store.kv_heads; ++h) {
      KVSIFT_CHECK(store.count[store.row(slots[b], h)] < store.capacity, where,
                   "the row of slot {}, kv head {} is full (count = capacity = {})", slots[b], h, store.capacity);
    }
  }
  cache.visit([&](const auto& kv) {
    for_rows(ctx.pool, kv.batch, store.kv_heads, [&](std::int32_t b, std::int32_t h) {
      const std::int64_t row = store.row(slots[b], h);
      const std::int32_t at = store.count[row], slot = store.row_order(row)[at];
      std::copy_n(kv.k_row(b, h, lengths[b] - 1), store.head_dim, store.k_slot(row, slot));
      std::copy_n(kv.v_row(b, h, lengths[b] - 1), store.head_dim, store.v_slot(row, slot));
      store.row_degree(row)[at] = 1;
      store.row_log_degree(row)[at] = 0.0f;
      store.count[row] = at + 1;
    });
  });
}

template <class T>
void merge_store_evict(const MergeStoreView<T>& store, const std::int32_t* slots, std::int32_t batch,
                       const std::int32_t* budgets, const std::int32_t* sinks, const Context& ctx) {
  constexpr const char* where = "cpu::merge_store_evict";
  kvsift::detail::check_merge_store_evict(where, store, batch, budgets, sinks);
  check_slots(where, "slots", slots, batch, store);
  kvsift::detail::check_distinct_slots(where, "slots", slots, batch);
  check_counts(where, "store", slots, batch, store);
  for_rows(ctx.pool, batch, store.kv_heads, [&](std::int32_t b, std::int32_t h) {
    const std::int64_t row = store.row(slots[b], h);
    const std::int32_t count = store.count[row], first = sinks[slots[b]];
    if (!kvsift::detail::merge_store_evicts(count, budgets[slots[b]], first)) return;
    std::int32_t* const order = store.row_order(row);
    std::int32_t* const degree = store.row_degree(row);
    float* const log_degree = store.row_log_degree(row);
    const std::int32_t freed = order[first];
    std::copy(order + first + 1, order + count, order + first);
    std::copy(degree + first + 1, degree + count, degree + first);
    std::copy(log_degree + first + 1, log_degree + count, log_degree + first);
    order[count - 1] = freed;
    store.count[row] = count - 1;
  });
}

template <class T>
void merge_store_copy(const MergeStoreView<const T>& src, const std::int32_t* src_slots, const MergeStoreView<T>& dst,
                      const std::int32_t* dst_slots, std::int32_t batch, const Context& ctx) {
  constexpr const char* where = "cpu::merge_store_copy";
  kvsift::detail::check_merge_store_copy(where, src, dst, batch);
  check_slots(where, "src_slots", src_slots, batch, src);
  check_slots(where, "dst_slots", dst_slots, batch, dst);
  kvsift::detail::check_distinct_slots(where, "dst_slots", dst_slots, batch);
  check_counts(where, "src", src_slots, batch, src);
  for (std::int32_t b = 0; b < batch; ++b) {
    for (std::int32_t h = 0; h < src.kv_heads; ++h) {
      const std::int32_t count = src.count[src.row(src_slots[b], h)];
      KVSIFT_CHECK(count <= dst.capacity, where,
                   "the row of src slot {}, kv head {} has {} entries, more than dst's capacity (= {})",
                   src_slots[b], h, count, dst.capacity);
    }
  }
  for_rows(ctx.pool, batch, src.kv_heads, [&](std::int32_t b, std::int32_t h) {
    const std::int64_t from = src.row(src_slots[b], h), to = dst.row(dst_slots[b], h);
    const std::int32_t count = src.count[from], d = src.head_dim;
    for (std::int32_t i = 0; i < count; ++i) {
      const std::int32_t slot = src.row_order(from)[i];
      std::copy_n(src.k_slot(from, slot), d, dst.k_slot(to, i));
      std::copy_n(src.v_slot(from, slot), d, dst.v_slot(to, i));
    }
    for (std::int32_t i = 0; i < dst.capacity; ++i) dst.row_order(to)[i] = i;
    std::copy_n(src.row_degree(from), count, dst.row_degree(to));
    std::copy_n(src.row_log_degree(from), count, dst.row_log_degree(to));
    dst.count[to] = count;
  });
}

template <class T>
void merge_store_selection(const MergeStoreView<const T>& store, const std::int32_t* slots, const SelectionView& out,
                           const Context& ctx) {
  constexpr const char* where = "cpu::merge_store_selection";
  kvsift::detail::check_merge_store_selection(where, store, out);
  check_slots(where, "slots", slots, out.batch, store);
  check_counts(where, "store", slots, out.batch, store);
  for_rows(ctx.pool, out.batch, store.kv_heads, [&](std::int32_t b, std::int32_t h) {
    const std::int64_t row = store.row(slots[b], h);
    const std::int32_t count = store.count[row];
    std::copy_n(store.row_order(row), count, out.row(b, h));
    std::copy_n(store.row_log_degree(row), count, out.weights_row(b, h));
    out.counts[out.row_index(b, h)] = count;
  });
}

KVSIFT_STORAGE_TYPES(KVSIFT_MERGE_STORE_INSTANCES)

}  // namespace kvsift::cpu
