#pragma once
/// Random subspace score tables for the CPU and CUDA score-table tests (selectors/csattention/score_tables.hpp), backend-neutral
/// host arrays consistent with ScoreTablesView's contract: unit centroids (some repeated, so that dot products
/// tie, and some zero); base lists highest first in the list order, from a few table scores so that scores tie,
/// with ragged counts (empty and full lists); per slot overlays whose sizes equal their evictions (a few fall short,
/// as the checks allow), each a min-heap in the list order of keys above the evicted entries, placed after the
/// prompt; a KV cache in T (contiguous, and the same tokens paged) and decode queries; per batch row a distinct
/// slot, a length and chosen list ids (counts multiples of the GQA group) with weights.
///
/// Views are built over any set of arrays with this problem's member names (its own, or a test's device copies):
/// tables(a), base(a, b), cache(a, paged), query(a), chosen_view(a).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/inverted_lists.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/selectors/csattention/score_tables.hpp"
#include "kvsift/core/views.hpp"
#include "test_util.hpp"

namespace kvsift::test {

struct TablesShape {
  std::int32_t batch = 3, q_heads = 8, kv_heads = 2, table_heads = 2, head_dim = 32, subspaces = 4;
  std::int32_t centroids_per_subspace = 12, length = 24, overlay_capacity = 5, bases = 2, probes = 2;
  SubspaceSplit split = SubspaceSplit::contiguous;
  std::int32_t capacity = 160;  ///< cache tokens per sequence; prompts (the lists' ids) are shorter
  std::int32_t page_size = 16;

  std::int32_t width() const { return head_dim / subspaces; }
  std::int32_t lists() const { return subspaces * centroids_per_subspace; }
  std::int32_t group() const { return q_heads / kv_heads; }
  std::int32_t chosen_capacity() const { return group() * subspaces * probes; }
};

template <class T>
struct TablesProblem : TablesShape {
  std::int32_t slot_count;
  std::vector<float> centroids;
  std::vector<std::int32_t> base_ids, base_counts, slot_base, evicted, overlay_ids, overlay_sizes;
  std::vector<half> base_scores, overlay_scores;
  std::vector<std::int32_t> prompt;  ///< [bases]: the lists' ids are below it, the overlays' at or above
  std::vector<std::int32_t> slots, lengths;  ///< [batch]
  AttentionWindow window;
  std::vector<T> k, v, k_pages, v_pages, q;
  std::vector<std::int32_t> seq_lens, page_indptr, page_indices, last_page_len;
  PagedKVView<const T> paged_layout;  ///< sizes and strides (pointers set by cache())
  std::vector<std::int32_t> chosen_indices, chosen_counts, weights;  ///< weights: [rows, chosen capacity]

  TablesProblem(Random& rng, const TablesShape& shape) : TablesShape(shape), slot_count(shape.batch + 2) {
    const std::int32_t w = width(), l_count = lists();
    using View = ScoreTablesView<std::int32_t>;
    centroids.resize(View::centroid_elements(bases, table_heads, subspaces, centroids_per_subspace, w));
    for (std::size_t c = 0; c < centroids.size() / w; ++c) {
      float* x = centroids.data() + c * w;
      const int kind = rng.uniform_int(0, 9);
      if (kind == 0) continue;                            // a zero centroid
      if (kind == 1 && c % centroids_per_subspace > 0) {  // the previous one again: equal dots
        std::copy_n(x - w, w, x);
        continue;
      }
      const auto n = rng.normal(std::size_t(w));
      double sq = 0;
      for (float e : n) sq += double(e) * e;
      for (std::int32_t j = 0; j < w; ++j) x[j] = float(n[j] / std::sqrt(sq));
    }
    const std::size_t base_lists = View::list_count(bases, table_heads, subspaces, centroids_per_subspace);
    base_ids.assign(base_lists * length, -1);
    base_scores.assign(base_lists * length, half{0});
    base_counts.resize(base_lists);
    for (std::int32_t b = 0; b < bases; ++b) prompt.push_back(rng.uniform_int(length, capacity * 3 / 4));
    for (std::size_t list = 0; list < base_lists; ++list) {
      const int kind = rng.uniform_int(0, 5);
      const std::int32_t count = kind == 0 ? 0 : kind == 1 ? length : rng.uniform_int(0, length);
      base_counts[list] = count;
      std::vector<std::int32_t> ids(std::size_t(prompt[list / (std::size_t(table_heads) * l_count)]));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng.engine);
      std::vector<Entry> entries(static_cast<std::size_t>(count));
      for (std::int32_t e = 0; e < count; ++e) entries[e] = {ids[e], random_score(rng, -6.0f)};
      std::sort(entries.begin(), entries.end(), above);  // highest first
      for (std::int32_t e = 0; e < count; ++e) {
        base_ids[list * length + e] = entries[e].id;
        base_scores[list * length + e] = float_to_half(entries[e].score);
      }
    }
    slot_base.resize(std::size_t(slot_count));
    for (auto& b : slot_base) b = rng.uniform_int(0, bases - 1);
    const std::size_t slot_lists = View::list_count(slot_count, table_heads, subspaces, centroids_per_subspace);
    evicted.resize(slot_lists);
    overlay_sizes.resize(slot_lists);
    overlay_ids.assign(slot_lists * overlay_capacity, -1);
    overlay_scores.assign(slot_lists * overlay_capacity, half{0});
    for (std::size_t own = 0; own < slot_lists; ++own) fill_overlay(rng, own);
    std::vector<std::int32_t> order(static_cast<std::size_t>(slot_count));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng.engine);
    slots.assign(order.begin(), order.begin() + batch);

    for (std::int32_t b = 0; b < batch; ++b) seq_lens.push_back(rng.uniform_int(capacity / 2, capacity));
    const HostKV kv(rng, batch, kv_heads, capacity, head_dim, seq_lens);
    const HostPagedKV pages(kv, page_size, rng.uniform_int(0, 1) == 1, rng);
    k = to_storage<T>(kv.k);
    v = to_storage<T>(kv.v);
    k_pages = to_storage<T>(pages.k_pages);
    v_pages = to_storage<T>(pages.v_pages);
    page_indptr = pages.indptr;
    page_indices = pages.indices;
    last_page_len = pages.last_len;
    const auto& pv = pages.view;
    paged_layout = {.batch = pv.batch, .kv_heads = pv.kv_heads, .head_dim = pv.head_dim, .page_size = pv.page_size,
                    .num_pages = pv.num_pages, .page_stride = pv.page_stride, .token_stride = pv.token_stride,
                    .head_stride = pv.head_stride};
    q = to_storage<T>(rng.normal(std::size_t(batch) * q_heads * head_dim));
    // Lengths from 1 (list ids past them are no candidates) to the cache's own.
    for (std::int32_t b = 0; b < batch; ++b) lengths.push_back(rng.uniform_int(1, seq_lens[b]));
    window = {rng.uniform_int(0, 4), rng.uniform_int(0, 8)};
    randomize_chosen(rng);
  }

  /// Random chosen lists: per row G * a random count of lists per query head, ids anywhere in the tables; weights
  /// in [0, kMaxTableWeight].
  void randomize_chosen(Random& rng) {
    const std::int32_t cap = chosen_capacity(), rows = batch * kv_heads;
    chosen_indices.assign(std::size_t(rows) * cap, -1);
    chosen_counts.assign(std::size_t(rows), 0);
    weights.assign(std::size_t(rows) * cap, 0);
    for (std::int32_t r = 0; r < rows; ++r) {
      chosen_counts[r] = group() * rng.uniform_int(0, cap / group());
      for (std::int32_t i = 0; i < cap; ++i) {
        chosen_indices[std::size_t(r) * cap + i] = rng.uniform_int(0, table_heads * lists() - 1);
        const int kind = rng.uniform_int(0, 4);
        weights[std::size_t(r) * cap + i] = kind == 0 ? 0 : kind == 1 ? kMaxTableWeight : rng.uniform_int(1, 200);
      }
    }
  }

  /// The tables over a's arrays, with a's token order where a keeps one (a.token_order()).
  template <class A>
  ScoreTablesView<std::int32_t> tables(A& a) const {
    ScoreTablesView<std::int32_t> t{a.centroids.data(), a.base_ids.data(), a.base_scores.data(), a.base_counts.data(),
                                    a.slot_base.data(), a.evicted.data(), a.overlay_ids.data(), a.overlay_scores.data(),
                                    a.overlay_sizes.data(), bases, slot_count, table_heads, subspaces,
                                    centroids_per_subspace, width(), length, overlay_capacity, split};
    if constexpr (requires { a.token_order(); }) t.token_order = a.token_order();
    return t;
  }
  /// Base b's arrays, writable (the build primitives' view).
  template <class A>
  BaseTablesView base(A& a, std::int32_t b) const {
    const std::size_t lists_per_base = std::size_t(table_heads) * lists();
    return {a.centroids.data() + b * lists_per_base * width(),
            a.base_ids.data() + b * lists_per_base * length,
            a.base_scores.data() + b * lists_per_base * length,
            a.base_counts.data() + b * lists_per_base,
            table_heads, subspaces, centroids_per_subspace, width(), length, split};
  }
  template <class A>
  KVCache<const T> cache(A& a, bool paged) const {
    if (!paged) {
      return ContiguousKVView<const T>::packed(a.k.data(), a.v.data(), batch, kv_heads, capacity, head_dim,
                                               a.seq_lens.data());
    }
    PagedKVView<const T> view = paged_layout;
    view.k_pages = a.k_pages.data();
    view.v_pages = a.v_pages.data();
    view.page_indptr = a.page_indptr.data();
    view.page_indices = a.page_indices.data();
    view.last_page_len = a.last_page_len.data();
    return view;
  }
  template <class A>
  QueryView<const T> query(A& a) const {
    return QueryView<const T>::packed(a.q.data(), batch, q_heads, head_dim);
  }
  template <class A>
  SelectionView chosen_view(A& a) const {
    return {a.chosen_indices.data(), a.chosen_counts.data(), nullptr, batch, kv_heads, chosen_capacity()};
  }

 private:
  struct Entry {
    std::int32_t id;
    float score;
  };
  static bool above(const Entry& a, const Entry& b) {
    return kvsift::detail::list_entry_below(b.score, b.id, a.score, a.id);
  }

  /// A table score from few values (ties), at least `low`.
  static float random_score(Random& rng, float low) {
    return table_score(std::max(low, float(rng.uniform_int(-48, 48)) * 0.125f));
  }

  /// Slot list `own`: evictions from its base list's lowest, the overlay as many keys (fewer, now and then) above
  /// the highest evicted entry, at positions past the prompt, in min-heap order.
  void fill_overlay(Random& rng, std::size_t own) {
    const std::size_t per_slot = std::size_t(table_heads) * lists();
    const std::int32_t base = slot_base[own / per_slot];
    const std::size_t list = base * per_slot + own % per_slot;
    const std::int32_t count = base_counts[list];
    const std::int32_t e = rng.uniform_int(0, std::min(count, overlay_capacity));
    const std::int32_t size = rng.uniform_int(0, 4) == 0 ? rng.uniform_int(0, e) : e;
    evicted[own] = e;
    overlay_sizes[own] = size;
    const float low = e > 0 ? half_to_float(base_scores[list * length + (count - e)]) : -6.0f;
    std::vector<Entry> heap(static_cast<std::size_t>(size));
    for (std::int32_t i = 0; i < size; ++i) heap[i] = {prompt[base] + i, random_score(rng, low)};
    std::shuffle(heap.begin(), heap.end(), rng.engine);
    std::make_heap(heap.begin(), heap.end(), above);  // the lowest at the front
    for (std::int32_t i = 0; i < size; ++i) {
      overlay_ids[own * overlay_capacity + i] = heap[i].id;
      overlay_scores[own * overlay_capacity + i] = float_to_half(heap[i].score);
    }
  }
};

}  // namespace kvsift::test
