// Score tables on the CPU: checks (selectors/csattention/detail/score_tables_checks.hpp, shared with CUDA), then plain loops.
// Sums are exact int64 fixed-point (selectors/csattention/score_tables.hpp), so the dense accumulator and the sort agree with each
// other and with the CUDA twin's atomics whatever the order.
#include "kvsift/selectors/csattention/cpu/score_tables.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kvsift/selectors/csattention/detail/score_tables_checks.hpp"
#include "kvsift/selectors/csattention/detail/score_tables_instances.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"

namespace kvsift::cpu {
namespace {

std::int64_t workers_for(std::int64_t items, const ThreadPool* pool) {
  return std::max<std::int64_t>(1, std::min<std::int64_t>(items, pool != nullptr ? pool->size() : 1));
}

/// Runs fn(worker, item) for items [0, count) split into contiguous runs, one per worker.
template <class F>
void for_workers(ThreadPool* pool, std::int64_t count, std::int64_t workers, F&& fn) {
  parallel_for(pool, workers, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t w = begin; w < end; ++w) {
      for (std::int64_t i = w * count / workers; i < (w + 1) * count / workers; ++i) fn(w, i);
    }
  });
}

/// The fp32 dot of a centroid and subspace s of a vector (FMAs in ascending element order).
template <class T>
float subspace_dot(const float* centroid, const T* x, SubspaceSplit split, std::int32_t s, std::int32_t width,
                   std::int32_t head_dim) {
  float sum = 0.0f;
  for (std::int32_t j = 0; j < width; ++j) {
    sum = std::fma(centroid[j], to_float(x[subspace_channel(split, s, j, width, head_dim)]), sum);
  }
  return sum;
}

/// One chosen list of a slot: its kept base part and its overlay.
struct ChosenList {
  const std::int32_t* base_ids;
  const half* base_scores;
  std::int32_t kept;
  const std::int32_t* overlay_ids;
  const half* overlay_scores;
  std::int32_t overlay_size;

  template <class F>
  void for_each(F&& f) const {
    for (std::int32_t p = 0; p < kept; ++p) f(base_ids[p], base_scores[p]);
    for (std::int32_t p = 0; p < overlay_size; ++p) f(overlay_ids[p], overlay_scores[p]);
  }
  std::int64_t floor() const {
    return kvsift::detail::list_floor(base_ids, base_scores, kept, overlay_ids, overlay_scores, overlay_size,
                              [](half x) { return half_to_float(x); });
  }
};

/// Each chosen entry's contribution to its block's sum: weight * (fixed score - floor).
struct EntryValue {
  std::int64_t weight, floor;
  std::int64_t operator()(half score) const { return weight * (fixed_score(half_to_float(score)) - floor); }
};
EntryValue entry_value(const TableScoreOptions& options, const ChosenList& list, const SelectionView& chosen,
                       std::int64_t row, std::int32_t i) {
  return {options.weights != nullptr ? options.weights[row * chosen.capacity + i] : kTableWeightOne,
          options.from_floor ? list.floor() : 0};
}
ChosenList chosen_list(const ScoreTablesView<const std::int32_t>& t, std::int32_t slot, std::int32_t id) {
  const std::int32_t base = t.slot_base[slot], h = id / t.lists(), l = id % t.lists();
  const std::int64_t list = t.list_index(base, h, l), own = t.list_index(slot, h, l);
  return {t.base_ids + t.base_entry(base, h, l), t.base_scores + t.base_entry(base, h, l),
          t.base_counts[list] - t.evicted[own],    t.overlay_ids + t.overlay_entry(slot, h, l),
          t.overlay_scores + t.overlay_entry(slot, h, l), t.overlay_sizes[own]};
}

constexpr std::int32_t kMaxProbes = kMaxTableProbes;
constexpr float kNoCandidate = -std::numeric_limits<float>::infinity();

}  // namespace

template <class T>
void subspace_scores(const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                     std::int32_t list_count, const KVCache<const T>& cache, std::int32_t row,
                     std::int32_t token_begin, std::int32_t tokens, const MatrixView<float>& out, const Context& ctx) {
  constexpr const char* where = "cpu::subspace_scores";
  cache.visit([&](const auto& kv) { validate(kv, where, "cache", MemorySpace::host); });
  kvsift::detail::check_subspace_scores(where, base, table_head, list_begin, list_count, cache, row, token_begin, tokens,
                                        out);
  KVSIFT_CHECK(std::int64_t(token_begin) + tokens <= cache.seq_len(row), where,
               "tokens [{}, {} + {}) reach past sequence {}'s length {}", token_begin, token_begin, tokens, row,
               cache.seq_len(row));
  const std::int32_t head_dim = cache.head_dim(), kv = table_head * cache.kv_heads() / base.table_heads;
  const std::int32_t c_count = base.centroids_per_subspace;
  parallel_for(ctx.pool, list_count, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const std::int32_t l = list_begin + std::int32_t(r), s = l / c_count;
      const float* centroid =
          base.centroids + ((std::int64_t(table_head) * base.subspaces + s) * c_count + l % c_count) * base.width;
      float* dst = out.row(r);
      for (std::int32_t t = 0; t < tokens; ++t) {
        dst[t] = table_score(subspace_dot(centroid, cache.k_row(row, kv, token_begin + t), base.split, s, base.width,
                                          head_dim));
      }
    }
  });
}

std::size_t store_table_lists_workspace_bytes(std::int32_t list_rows, std::int32_t tokens, const Context& ctx) {
  KVSIFT_CHECK(list_rows > 0 && tokens >= 0, "cpu::store_table_lists_workspace_bytes",
               "list_rows (= {}) must be positive and tokens (= {}) >= 0", list_rows, tokens);
  WorkspaceLayout layout;
  layout.allocate<std::uint64_t>(std::size_t(workers_for(list_rows, ctx.pool)) * std::size_t(tokens), "rank keys");
  return layout.bytes();
}

void store_table_lists(const MatrixView<const float>& scores, std::int32_t tokens, std::int32_t keep,
                       const BaseTablesView& base, std::int32_t table_head, std::int32_t list_begin,
                       std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cpu::store_table_lists";
  kvsift::detail::check_store_table_lists(where, scores, tokens, keep, base, table_head, list_begin);
  const std::int64_t workers = workers_for(scores.rows, ctx.pool);
  WorkspaceLayout layout(workspace, where);
  std::uint64_t* const scratch = layout.allocate<std::uint64_t>(std::size_t(workers) * std::size_t(tokens), "rank keys");
  const std::int32_t kept = std::min(keep, tokens);
  for_workers(ctx.pool, scores.rows, workers, [&](std::int64_t w, std::int64_t r) {
    std::uint64_t* keys = scratch + w * tokens;
    const float* row = scores.row(r);
    for (std::int32_t t = 0; t < tokens; ++t) keys[t] = rank_key(table_score(row[t]), t);
    std::nth_element(keys, keys + kept, keys + tokens);
    std::sort(keys, keys + kept);
    const std::int64_t list = std::int64_t(table_head) * base.lists() + list_begin + r;
    std::int32_t* ids = base.ids + list * base.length;
    half* dst = base.scores + list * base.length;
    for (std::int32_t p = 0; p < kept; ++p) {
      ids[p] = std::int32_t(keys[p] & 0xffffffffu);
      dst[p] = float_to_half(table_score(row[ids[p]]));
    }
    base.counts[list] = kept;
  });
}

template <class T>
void append_tables(const ScoreTablesView<std::int32_t>& tables, const KVCache<const T>& cache,
                   const std::int32_t* slots, const std::int32_t* lengths, const Context& ctx) {
  constexpr const char* where = "cpu::append_tables";
  cache.visit([&](const auto& kv) { validate(kv, where, "cache", MemorySpace::host); });
  kvsift::detail::check_append_tables(where, tables, cache, slots, lengths, MemorySpace::host);
  const ScoreTablesView<std::int32_t>& t = tables;
  const std::int32_t head_dim = cache.head_dim();
  const std::int64_t items = std::int64_t(cache.batch()) * t.table_heads;
  parallel_for(ctx.pool, items, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int32_t b = std::int32_t(item / t.table_heads), h = std::int32_t(item % t.table_heads);
      const std::int32_t slot = slots[b], base = t.slot_base[slot], id = lengths[b] - 1;
      const T* key = cache.k_row(b, h * cache.kv_heads() / t.table_heads, id);
      for (std::int32_t l = 0; l < t.lists(); ++l) {
        const std::int32_t s = l / t.centroids_per_subspace;
        const float value = table_score(
            subspace_dot(t.centroid(base, h, s, l % t.centroids_per_subspace), key, t.split, s, t.width, head_dim));
        const std::int64_t own = t.list_index(slot, h, l);
        kvsift::detail::insert_table_key(t.base_ids + t.base_entry(base, h, l), t.base_scores + t.base_entry(base, h, l),
                                 t.base_counts[t.list_index(base, h, l)], t.evicted[own],
                                 t.overlay_ids + t.overlay_entry(slot, h, l),
                                 t.overlay_scores + t.overlay_entry(slot, h, l), t.overlay_sizes[own],
                                 t.overlay_capacity, id, value, [](half x) { return half_to_float(x); },
                                 [](float x) { return float_to_half(x); });
      }
    }
  });
}

template <class T>
void nearest_centroids(const QueryView<const T>& q, const ScoreTablesView<const std::int32_t>& tables,
                       const std::int32_t* slots, std::int32_t probes, const SelectionView& chosen,
                       std::int32_t* weights, const Context& ctx) {
  constexpr const char* where = "cpu::nearest_centroids";
  kvsift::detail::check_nearest_centroids(where, q, tables, slots, probes, chosen, MemorySpace::host);
  const ScoreTablesView<const std::int32_t>& t = tables;
  const std::int32_t group = q.heads / chosen.kv_heads, heads_per_table = q.heads / t.table_heads;
  const std::int32_t c_count = t.centroids_per_subspace;
  const std::int64_t rows = std::int64_t(chosen.batch) * chosen.kv_heads;
  parallel_for(ctx.pool, rows, [&](std::int64_t begin, std::int64_t end) {
    std::uint64_t best[kMaxProbes];  // the probes best so far, ascending rank keys
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / chosen.kv_heads, g = row % chosen.kv_heads;
      const std::int32_t base = t.slot_base[slots[b]];
      std::int32_t* dst = chosen.row(b, g);
      for (std::int32_t j = 0; j < group; ++j) {
        const std::int32_t h = std::int32_t(g) * group + j, table_head = h / heads_per_table;
        const T* query = q.row(b, h);
        for (std::int32_t s = 0; s < t.subspaces; ++s) {
          std::int32_t held = 0;
          for (std::int32_t c = 0; c < c_count; ++c) {
            const std::uint64_t key =
                rank_key(subspace_dot(t.centroid(base, table_head, s, c), query, t.split, s, t.width, q.head_dim), c);
            if (held == probes && key >= best[held - 1]) continue;
            std::int32_t p = held < probes ? held++ : held - 1;
            for (; p > 0 && best[p - 1] > key; --p) best[p] = best[p - 1];
            best[p] = key;
          }
          const std::int64_t at = (j * t.subspaces + s) * probes;
          for (std::int32_t p = 0; p < probes; ++p) {
            dst[at + p] = table_head * t.lists() + s * c_count + std::int32_t(best[p] & 0xffffffffu);
          }
          if (weights == nullptr) continue;
          float square_sum = 0.0f;
          for (std::int32_t e = 0; e < t.width; ++e) {
            const float x = to_float(query[subspace_channel(t.split, s, e, t.width, q.head_dim)]);
            square_sum = std::fma(x, x, square_sum);
          }
          std::fill_n(weights + row * chosen.capacity + at, probes, table_weight(std::sqrt(square_sum)));
        }
      }
      chosen.counts[row] = group * t.subspaces * probes;
    }
  });
}

std::size_t table_scores_dense_workspace_bytes(std::int64_t rows, std::int32_t heads_per_row, std::int32_t max_tokens,
                                               const Context& ctx) {
  KVSIFT_CHECK(rows > 0 && heads_per_row > 0 && max_tokens >= 0, "cpu::table_scores_dense_workspace_bytes",
               "rows (= {}) and heads_per_row (= {}) must be positive, max_tokens (= {}) >= 0", rows, heads_per_row,
               max_tokens);
  WorkspaceLayout layout;
  const auto workers = std::size_t(workers_for(rows, ctx.pool));
  layout.allocate<std::int64_t>(workers * std::size_t(heads_per_row) * std::size_t(max_tokens), "block sums");
  layout.allocate<std::uint8_t>(workers * std::size_t(max_tokens), "candidate flags");
  return layout.bytes();
}

void table_scores_dense(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                        const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* slots, const std::int32_t* lengths,
                        const AttentionWindow& window, const LengthBudget& budget, const MatrixView<float>& scores,
                        std::int32_t* row_k, std::int32_t max_tokens, std::span<std::byte> workspace,
                        const Context& ctx) {
  constexpr const char* where = "cpu::table_scores_dense";
  kvsift::detail::check_table_scores(where, tables, chosen, options, heads_per_row, slots, lengths, window, budget, scores, max_tokens,
                             row_k, MemorySpace::host);
  for (std::int32_t b = 0; b < chosen.batch; ++b) {
    KVSIFT_CHECK(lengths[b] <= max_tokens, where, "lengths[{}] (= {}) exceeds max_tokens (= {})", b, lengths[b],
                 max_tokens);
  }
  const std::int64_t rows = std::int64_t(chosen.batch) * chosen.kv_heads, workers = workers_for(rows, ctx.pool);
  WorkspaceLayout layout(workspace, where);
  std::int64_t* const sums = layout.allocate<std::int64_t>(
      std::size_t(workers) * std::size_t(heads_per_row) * std::size_t(max_tokens), "block sums");
  std::uint8_t* const flags = layout.allocate<std::uint8_t>(std::size_t(workers) * std::size_t(max_tokens), "candidate flags");
  for_workers(ctx.pool, rows, workers, [&](std::int64_t w, std::int64_t row) {
    const std::int64_t b = row / chosen.kv_heads, g = row % chosen.kv_heads;
    const std::int32_t length = lengths[b], count = chosen.count(b, g), per_head = count / heads_per_row;
    std::int64_t* const block_sums = sums + w * std::int64_t(heads_per_row) * max_tokens;
    std::uint8_t* const candidate = flags + w * std::int64_t(max_tokens);
    std::fill_n(block_sums, std::int64_t(heads_per_row) * length, 0);
    std::fill_n(candidate, length, 0);
    for (std::int32_t i = 0; i < count; ++i) {
      std::int64_t* const head_sums = block_sums + std::int64_t(i / per_head) * length;
      const ChosenList list = chosen_list(tables, slots[b], chosen.row(b, g)[i]);
      const EntryValue value = entry_value(options, list, chosen, row, i);
      list.for_each([&](std::int32_t id, half score) {
        if (!kvsift::detail::list_entry_kept(id, length, window)) return;
        head_sums[id] += value(score);
        candidate[id] = 1;
      });
    }
    float* const dst = scores.row(row);
    std::int32_t candidates = 0;
    for (std::int32_t t = 0; t < length; ++t) {
      if (candidate[t] == 0) {
        dst[t] = kNoCandidate;
        continue;
      }
      std::int64_t best = block_sums[t];
      for (std::int32_t j = 1; j < heads_per_row; ++j) best = std::max(best, block_sums[std::int64_t(j) * length + t]);
      dst[t] = fixed_to_float(best);
      ++candidates;
    }
    row_k[row] = std::min(budget(length), candidates);
  });
}

std::int64_t table_scores_sparse_capacity(std::int32_t chosen_capacity, std::int32_t length, const Context&) {
  return std::int64_t(chosen_capacity) * length;
}

std::size_t table_scores_sparse_workspace_bytes(std::int64_t rows, std::int32_t chosen_capacity, std::int32_t length,
                                                const Context& ctx) {
  KVSIFT_CHECK(rows > 0 && chosen_capacity > 0 && length > 0, "cpu::table_scores_sparse_workspace_bytes",
               "rows (= {}), chosen_capacity (= {}) and length (= {}) must be positive", rows, chosen_capacity, length);
  WorkspaceLayout layout;
  const std::size_t entries = std::size_t(workers_for(rows, ctx.pool)) * std::size_t(table_scores_sparse_capacity(chosen_capacity, length));
  layout.allocate<std::uint64_t>(entries, "entry keys");
  layout.allocate<std::int64_t>(entries, "entry scores");
  return layout.bytes();
}

void table_scores_sparse(const ScoreTablesView<const std::int32_t>& tables, const SelectionView& chosen,
                         const TableScoreOptions& options, std::int32_t heads_per_row, const std::int32_t* slots, const std::int32_t* lengths,
                         const AttentionWindow& window, const LengthBudget& budget, const SelectionView& out,
                         const MatrixView<float>& sums, std::int32_t* row_k, std::span<std::byte> workspace,
                         const Context& ctx) {
  constexpr const char* where = "cpu::table_scores_sparse";
  const std::int64_t capacity = table_scores_sparse_capacity(chosen.capacity, tables.length);
  kvsift::detail::check_table_scores(where, tables, chosen, options, heads_per_row, slots, lengths, window, budget, sums, out.capacity,
                             row_k, MemorySpace::host);
  kvsift::detail::check_sparse_out(where, out, chosen, heads_per_row, capacity);
  const std::int64_t rows = std::int64_t(chosen.batch) * chosen.kv_heads, workers = workers_for(rows, ctx.pool);
  WorkspaceLayout layout(workspace, where);
  std::uint64_t* const key_scratch = layout.allocate<std::uint64_t>(std::size_t(workers * capacity), "entry keys");
  std::int64_t* const score_scratch = layout.allocate<std::int64_t>(std::size_t(workers * capacity), "entry scores");
  for_workers(ctx.pool, rows, workers, [&](std::int64_t w, std::int64_t row) {
    const std::int64_t b = row / chosen.kv_heads, g = row % chosen.kv_heads;
    const std::int32_t length = lengths[b], count = chosen.count(b, g), per_head = count / heads_per_row;
    std::uint64_t* const keys = key_scratch + w * capacity;
    std::int64_t* const values = score_scratch + w * capacity;
    // Key: id, then the query-head block, then the entry's ordinal (which indexes its value).
    std::int64_t n = 0;
    for (std::int32_t i = 0; i < count; ++i) {
      const std::uint64_t block = std::uint64_t(i / per_head);
      const ChosenList list = chosen_list(tables, slots[b], chosen.row(b, g)[i]);
      const EntryValue value = entry_value(options, list, chosen, row, i);
      list.for_each([&](std::int32_t id, half score) {
        if (!kvsift::detail::list_entry_kept(id, length, window)) return;
        values[n] = value(score);
        keys[n] = std::uint64_t(id) << 32 | block << 24 | std::uint64_t(n);
        ++n;
      });
    }
    std::sort(keys, keys + n, [](std::uint64_t a, std::uint64_t c) { return (a >> 24) < (c >> 24); });
    std::int32_t* const dst = out.row(b, g);
    float* const weights = out.weights_row(b, g);
    float* const sum_row = sums.row(row);
    std::int32_t candidates = 0;
    for (std::int64_t j = 0; j < n; ++candidates) {
      const std::uint64_t id = keys[j] >> 32;
      std::int64_t best = 0;
      std::int32_t blocks = 0;
      while (j < n && keys[j] >> 32 == id) {  // one run per block, blocks ascending
        const std::uint64_t block = (keys[j] >> 24) & 0xff;
        std::int64_t block_sum = 0;
        for (; j < n && keys[j] >> 24 == (id << 8 | block); ++j) block_sum += values[keys[j] & 0xffffff];
        best = blocks == 0 ? block_sum : std::max(best, block_sum);
        ++blocks;
      }
      if (blocks < heads_per_row) best = std::max<std::int64_t>(best, 0);  // absent from a block: 0 there
      dst[candidates] = std::int32_t(id);
      if (weights != nullptr) weights[candidates] = 0.0f;
      sum_row[candidates] = fixed_to_float(best);
    }
    out.counts[row] = candidates;
    row_k[row] = std::min(budget(length), candidates);
  });
}

KVSIFT_STORAGE_TYPES(KVSIFT_SCORE_TABLES_INSTANCES)

}  // namespace kvsift::cpu
