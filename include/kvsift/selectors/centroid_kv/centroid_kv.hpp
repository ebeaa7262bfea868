#pragma once
/// CentroidKV (chunked soft matching, docs/centroidkv.md): per layer and kv head the prompt's K/V are merged into at
/// most B = floor(R n) entries (n the prompt's length), each the degree-weighted mean of the tokens it absorbed,
/// attended whole with weight log(degree) added to its scaled logit (the paper's equation 3). It does not select from
/// the engine's cache: it replaces it by its merge store (selectors/centroid_kv/merge_store.hpp), the decode step's
/// second source (selectors/selector.hpp SecondSource), attended in place: K/V through a paged view whose page table is
/// the step's slots, the entries through the store's own order, counts and log-degrees by slot, which sparse decode
/// reads through the step's slots as its row map (AttentionOptions::selection_rows: no per-step copy). Its primary
/// selection is empty (counts 0: every token, sinks and recent ones included, lives in the store), so the step's
/// attention window must be empty: prepare and select refuse one.
///
/// Life cycle, per layer (written once for both backends: only backend calls and context arrays):
///   - prepare: each joining prompt in turn is loaded into a temporary prompt-sized store, merged by rounds
///     j = 0, 1, ... at ratio r_j = max(r_init - j r_step, r_min), trigger 1, until every row has s <= B; a round
///     whose ratio would merge nothing, and every round past max_rounds, runs at ratio 1 (the schedule is a host
///     function of n: detail::centroid_kv_prefill_schedule), so no budget above the minimum stalls; then copied into
///     the selector's store. Refused: a slot twice, B <= sinks + recent (the budget cannot be met: the message names
///     the smallest) unless config.below_minimum chooses the window fallback: such a slot keeps a window of B
///     tokens instead (the first s = detail::centroid_kv_window_sinks(config, B) and the last B - s, degree 1, never
///     merged; its temporary store's order is rewritten from the host). Allocates, once per call, a one-sequence
///     store of the longest joining prompt (K and V [kv_heads, n, head_dim] in T, order, degree and log_degree
///     [kv_heads, n]) and merge_round's workspace for it; on CUDA synchronizes (the lengths are read on the host,
///     each budget is copied from it).
///   - append (each decode step, the token already in the cache): one decode-time round at ratio 1 with trigger
///     `interval` (a row with s >= B + interval merges min(links, s - B) links, decided per row
///     inside the primitive: no host sync; a window row, at B, never takes part), with the window fallback chosen
///     an eviction (merge_store_evict: a window row at B drops its oldest entry after the s sinks, decided per row
///     on the device; other rows untouched), then the token enters with degree 1. This is algorithm 1's order
///     (add, attend, then compress), shifted by one step: the compression of step i runs before step i + 1's
///     token is added.
///   - select: clears the primary counts (one launch); the second source is the store itself.
///
/// Memory (the context's; index_bytes): K and V [max_slots, kv_heads, capacity, head_dim] in T, order, degree (int32)
/// and log_degree (fp32) [max_slots, kv_heads, capacity], counts, budgets, window sinks and the second source's page
/// table; capacity = ceil(R max_tokens) + interval. Workspace of append: merge_round's for the step's batch; of
/// select: none.
/// Include cpu/backend.hpp or cuda/backend.hpp (the primitives of the context) before instantiating it.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvsift/selectors/centroid_kv/detail/merge_store_checks.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/selectors/centroid_kv/merge_store.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/detail/selector_core.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

/// What prepare does with a prompt whose budget B = floor(R n) is at or below the merge's minimum, B <= sinks +
/// recent (issue 40; docs/centroidkv.md's choices).
enum class CentroidKVBelowMinimum : std::uint8_t {
  refuse,  ///< refused, the message naming the smallest budget (sinks + recent + 1) and its ratio
  window,  ///< a window of B tokens: the first s = detail::centroid_kv_window_sinks(config, B) and the last B - s,
           ///< degree 1, never merged; each decode step evicts the oldest after the s sinks. B = 0 is refused.
};

/// The paper's defaults (§6: 16 sinks, 64 recent, chunk 256, r_init 0.8, decay 0.2); r_min, interval and
/// max_rounds are kvsift's (the paper gives none, issue 24), and so is below_minimum (issue 40).
struct CentroidKVConfig {
  float budget_ratio = 0.25f;    ///< R: each sequence keeps B = floor(R n) entries after its prefill of n tokens
  std::int32_t sinks = 16;       ///< n1: the first entries, never merged
  std::int32_t recent = 64;      ///< n2: the last entries, never merged
  std::int32_t chunk = 256;      ///< c: entries per chunk of the middle
  float r_init = 0.8f;           ///< ratio of the first prefill round (decode-time rounds: 1)
  float r_step = 0.2f;           ///< δ_r: decrease per prefill round
  float r_min = 0.2f;            ///< floor of the prefill schedule
  std::int32_t interval = 64;    ///< g: a decode-time round runs once s >= B + g
  std::int32_t max_rounds = 64;  ///< prefill rounds at the schedule's ratios; later rounds run at ratio 1
  CentroidKVBelowMinimum below_minimum = CentroidKVBelowMinimum::refuse;  ///< B <= sinks + recent: refuse or window
};

namespace detail {

inline void check_centroid_kv_config(const char* where, const CentroidKVConfig& c) {
  KVSIFT_CHECK(c.budget_ratio > 0.0f && c.budget_ratio <= 1.0f, where, "config.budget_ratio (= {}) is outside (0, 1]",
               c.budget_ratio);
  KVSIFT_CHECK(c.sinks >= 0 && c.recent >= 0, where, "config.sinks (= {}) and config.recent (= {}) must be >= 0",
               c.sinks, c.recent);
  KVSIFT_CHECK(c.chunk >= 2, where, "config.chunk (= {}) must be >= 2", c.chunk);
  KVSIFT_CHECK(c.r_min >= 0.0f && c.r_min <= c.r_init && c.r_init <= 1.0f && c.r_step >= 0.0f, where,
               "config.r_min (= {}), r_init (= {}) and r_step (= {}) need 0 <= r_min <= r_init <= 1 and r_step >= 0",
               c.r_min, c.r_init, c.r_step);
  KVSIFT_CHECK(c.interval >= 1, where, "config.interval (= {}) must be >= 1", c.interval);
  KVSIFT_CHECK(c.max_rounds >= 0, where, "config.max_rounds (= {}) must be >= 0", c.max_rounds);
  KVSIFT_CHECK(c.below_minimum == CentroidKVBelowMinimum::refuse || c.below_minimum == CentroidKVBelowMinimum::window,
               where, "config.below_minimum (= {}) must be refuse (0) or window (1)", int(c.below_minimum));
}

/// A prompt's budget B = floor(R n).
inline std::int32_t centroid_kv_budget(const CentroidKVConfig& c, std::int32_t n) {
  return std::int32_t(std::floor(double(c.budget_ratio) * double(n)));
}

/// The sinks s of a window-fallback budget B, 1 <= B <= sinks + recent: the configured split scaled to B,
/// s = floor(B sinks / (sinks + recent)), at most B - 1 so that the newest token always has a place. So the window
/// holds at most the configured sinks and recent tokens (s <= sinks, B - s <= recent), and all of them at
/// B = sinks + recent.
inline std::int32_t centroid_kv_window_sinks(const CentroidKVConfig& c, std::int32_t budget) {
  const auto scaled = std::int32_t(std::int64_t(budget) * c.sinks / (std::int64_t(c.sinks) + c.recent));
  return std::min(scaled, budget - 1);
}

/// How a prompt of n tokens is kept: -1, merged by its schedule (B > sinks + recent; or B below that without the
/// fallback, which centroid_kv_prefill_schedule refuses); else a window of B tokens with s sinks, returned. Refused:
/// B = 0 with the fallback (a window needs one entry).
inline std::int32_t centroid_kv_window(const char* where, const CentroidKVConfig& c, std::int32_t n) {
  const std::int32_t budget = centroid_kv_budget(c, n);
  if (budget > c.sinks + c.recent || c.below_minimum != CentroidKVBelowMinimum::window) return -1;
  KVSIFT_CHECK(budget >= 1, where,
               "a prompt of n = {} tokens at budget_ratio R = {} has budget B = 0: even the window fallback needs "
               "B >= 1 (R >= {:.4g} for this prompt)",
               n, c.budget_ratio, 1.0 / double(n));
  return centroid_kv_window_sinks(c, budget);
}

/// Round j's parameters at prefill (ratio r_j, trigger 1) and at decoding (below).
inline MergeRoundParams centroid_kv_prefill_params(const CentroidKVConfig& c, std::int32_t j) {
  const float r = std::max(c.r_init - float(j) * c.r_step, c.r_min);
  return {.sinks = c.sinks, .recent = c.recent, .chunk = c.chunk, .ratio = r, .trigger = 1};
}
/// The decode-time round runs at ratio 1 (issue 24): it merges min(links, s - B), so a row is back to exactly B after
/// each round once its middle has s - B links (B >= sinks + recent + interval for an even chunk: 144 at the defaults).
/// At r_init it merged min(floor(r_init links), s - B), short of s - B for small B (B = 175 at the defaults: 63 of
/// 64), and could merge nothing (interval 1, B = 81: floor(0.8 * 1) = 0), so the row overflowed. At ratio 1 every
/// round makes progress: prepare ensures B > sinks + recent, so a row of B + interval entries has a middle of >= 2
/// entries, >= 1 link, and s stays <= B + interval (the store's capacity holds it, B <= ceil(R max_tokens)); with
/// fewer than interval links the row stays between B + 1 and B + interval. r_init only shapes the prefill schedule.
/// A window-fallback row (B <= sinks + recent) stays at B (the eviction before each append), below the trigger.
inline MergeRoundParams centroid_kv_decode_params(const CentroidKVConfig& c) {
  return {.sinks = c.sinks, .recent = c.recent, .chunk = c.chunk, .ratio = 1.0f, .trigger = c.interval};
}

/// The prefill schedule of a prompt of n tokens: its rounds' parameters, until it holds at most B = floor(R n) entries
/// (the counts of the rounds follow from n alone: detail::merge_round_links). Round j merges at ratio
/// r_j = max(r_init - j r_step, r_min), trigger 1, for j < max_rounds while that ratio merges something; a round whose
/// ratio would merge nothing (too few links for it: a small budget) and every round past max_rounds runs at ratio 1,
/// merging min(links, s - B). Such a round always merges: B > sinks + recent leaves a middle of >= 2 entries while
/// s > B, so >= 1 link (chunk >= 2). So every budget above sinks + recent is met, and no prompt stalls. Refused: B <=
/// sinks + recent, naming the smallest budget (and ratio) this prompt can have.
inline std::vector<MergeRoundParams> centroid_kv_prefill_schedule(const char* where, const CentroidKVConfig& c,
                                                                 std::int32_t n) {
  const std::int32_t budget = centroid_kv_budget(c, n);
  KVSIFT_CHECK(budget > c.sinks + c.recent, where,
               "a prompt of n = {} tokens at budget_ratio R = {} has budget B = {} <= sinks + recent (= {}): "
               "CentroidKV cannot meet it; its smallest budget is {} tokens (R >= {:.4g} for this prompt), or "
               "config.below_minimum = window keeps a window of B tokens",
               n, c.budget_ratio, budget, c.sinks + c.recent, c.sinks + c.recent + 1,
               double(c.sinks + c.recent + 1) / double(n));
  std::vector<MergeRoundParams> schedule;
  std::int32_t s = n;
  while (s > budget) {
    MergeRoundParams round = centroid_kv_prefill_params(c, std::int32_t(schedule.size()));
    std::int32_t merged = std::int32_t(schedule.size()) < c.max_rounds ? merge_round_links(s, budget, round) : 0;
    if (merged == 0) {
      round.ratio = 1.0f;
      merged = merge_round_links(s, budget, round);
    }
    KVSIFT_CHECK(merged > 0, where, "a prompt of n = {} tokens (B = {}) has no link to merge at {} entries", n,
                 budget, s);  // unreachable while B > sinks + recent and chunk >= 2 (checked)
    schedule.push_back(round);
    s -= merged;
  }
  return schedule;
}

}  // namespace detail

template <class T, class Context>
class CentroidKV : public SelectorTypes<T, Context>, public detail::SelectorCore<"CentroidKV"> {
 public:
  /// Allocates the store for limits.max_slots sequences of up to limits.max_tokens prompt tokens and puts every
  /// row in its empty state (count 0, order identity, budget 0).
  CentroidKV(const SelectorLimits& limits, const CentroidKVConfig& config, const Context& ctx)
      : SelectorCore(limits), config_(config) {
    detail::check_centroid_kv_config("CentroidKV", config);
    // The merge store's bounds, refused here rather than at the first prepare or append.
    KVSIFT_CHECK(limits.head_dim <= kMergeMaxHeadDim, "CentroidKV", "limits.head_dim (= {}) exceeds {} (the merge store's bound)",
                 limits.head_dim, kMergeMaxHeadDim);
    if constexpr (Context::memory == MemorySpace::device) {
      KVSIFT_CHECK(config.chunk <= kMergeMaxDeviceChunk, "CentroidKV",
                   "config.chunk (= {}) exceeds {} (the CUDA matching kernel's bound)", config.chunk, kMergeMaxDeviceChunk);
    }
    capacity_ = std::int32_t(std::ceil(double(config.budget_ratio) * double(limits.max_tokens))) + config.interval;
    const std::size_t rows = std::size_t(limits.max_slots) * std::size_t(limits.kv_heads);
    const std::size_t entries = MergeStoreView<T>::entries(limits.max_slots, limits.kv_heads, capacity_);
    k_.resize(MergeStoreView<T>::kv_elements(limits.max_slots, limits.kv_heads, capacity_, limits.head_dim));
    v_.resize(k_.size());
    order_.resize(entries);
    degree_.resize(entries);
    log_degree_.resize(entries);
    count_.resize(rows);
    budgets_.resize(std::size_t(limits.max_slots));
    window_sinks_.resize(std::size_t(limits.max_slots));
    page_indptr_.resize(std::size_t(limits.max_slots) + 1);
    last_page_len_.resize(std::size_t(limits.max_slots));
    std::vector<std::int32_t> order(entries);
    for (std::size_t i = 0; i < entries; ++i) order[i] = std::int32_t(i % std::size_t(capacity_));
    copy_from_host(order.data(), entries, order_.data(), ctx);
    const std::vector<std::int32_t> zeros(rows, 0), capacities(std::size_t(limits.max_slots), capacity_);
    copy_from_host(zeros.data(), rows, count_.data(), ctx);
    copy_from_host(zeros.data(), budgets_.size(), budgets_.data(), ctx);
    const std::vector<std::int32_t> merged(window_sinks_.size(), -1);
    copy_from_host(merged.data(), merged.size(), window_sinks_.data(), ctx);
    std::vector<std::int32_t> indptr(page_indptr_.size());
    std::iota(indptr.begin(), indptr.end(), 0);
    copy_from_host(indptr.data(), indptr.size(), page_indptr_.data(), ctx);
    copy_from_host(capacities.data(), capacities.size(), last_page_len_.data(), ctx);
  }

  std::string_view name() const { return "CentroidKV"; }
  const CentroidKVConfig& config() const { return config_; }
  /// The primary selection is empty: every entry is the second source's.
  std::int32_t capacity() const { return 0; }
  static constexpr bool writes_log_weights() { return false; }
  std::int32_t second_source_capacity() const { return capacity_; }

  IndexBytes index_bytes() const {
    const std::size_t bytes = (k_.size() + v_.size()) * sizeof(T) +
                              (order_.size() + degree_.size() + count_.size() + budgets_.size() +
                               window_sinks_.size() + page_indptr_.size() + last_page_len_.size()) *
                                  sizeof(std::int32_t) +
                              log_degree_.size() * sizeof(float);
    return detail::context_index_bytes<Context>(bytes);
  }

  /// The store, in the context's memory: for tests and inspection.
  MergeStoreView<const T> store() const {
    return {k_.data(), v_.data(), order_.data(), degree_.data(), log_degree_.data(), count_.data(),
            limits_.max_slots, limits_.kv_heads, capacity_, limits_.head_dim};
  }
  /// Each slot's budget B (context memory, [max_slots]).
  const std::int32_t* budgets() const { return budgets_.data(); }
  /// Each slot's window sinks s, -1 for a merged slot (context memory, [max_slots]; CentroidKVBelowMinimum::window).
  const std::int32_t* window_sinks() const { return window_sinks_.data(); }

  std::size_t select_workspace_bytes(const SelectShape& shape, const Context&) const {
    return detail::no_workspace_bytes(entry_point<"select_workspace_bytes">(), limits_, shape);
  }
  std::size_t append_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    detail::check_shape(entry_point<"append_workspace_bytes">(), limits_, shape);
    return merge_round_workspace_bytes(shape.batch, limits_.kv_heads, capacity_, ctx);
  }

  void prepare(const PrefillInputs<T>& in, const Context& ctx) {
    constexpr const char* where = entry_point<"prepare">();
    const std::int32_t batch = detail::check_cache(where, limits_, in.cache, in.slots, Context::memory);
    check_no_window(where, in.attention.window);
    const auto rows = std::size_t(batch);
    std::vector<std::int32_t> budgets(rows), windows(rows);
    std::vector<std::vector<MergeRoundParams>> schedules(rows);
    ContextArray<Context, std::int32_t> context_lengths(rows);
    const auto [lengths, slots] =
        detail::read_prefill_rows(where, limits_, in.cache, in.slots, context_lengths.data(), ctx);
    std::int32_t longest = 1;
    for (std::size_t b = 0; b < rows; ++b) {
      KVSIFT_CHECK(lengths[b] > 0, where, "sequence {}'s prompt is empty (0 tokens): nothing to merge", b);
      windows[b] = detail::centroid_kv_window(where, config_, lengths[b]);
      if (windows[b] < 0) schedules[b] = detail::centroid_kv_prefill_schedule(where, config_, lengths[b]);
      budgets[b] = detail::centroid_kv_budget(config_, lengths[b]);
      longest = std::max(longest, lengths[b]);
    }
    detail::check_distinct_slots(where, "in.slots", slots.data(), batch);
    // One prompt-sized store of one row, reused by each joining sequence in turn: its memory is bounded by the
    // longest prompt, not by the batch's (128K tokens x 8 sequences would be ~4.3 GB at once).
    const std::size_t entries = MergeStoreView<T>::entries(1, limits_.kv_heads, longest);
    ContextArray<Context, T> k(MergeStoreView<T>::kv_elements(1, limits_.kv_heads, longest, limits_.head_dim)),
        v(k.size());
    ContextArray<Context, std::int32_t> order(entries), degree(entries), count(std::size_t(limits_.kv_heads));
    ContextArray<Context, float> log_degree(entries);
    ContextArray<Context, std::int32_t> temp_slot(1), temp_budget(1);
    const std::int32_t zero = 0;
    copy_from_host(&zero, 1, temp_slot.data(), ctx);
    const MergeStoreView<T> temp{k.data(),     v.data(), order.data(), degree.data(), log_degree.data(),
                                 count.data(), 1,        limits_.kv_heads, longest,   limits_.head_dim};
    ContextArray<Context, std::byte> workspace(merge_round_workspace_bytes(1, limits_.kv_heads, longest, ctx));
    const std::span<std::byte> bytes(workspace.data(), workspace.size());
    for (std::size_t b = 0; b < rows; ++b) {
      copy_from_host(&budgets[b], 1, temp_budget.data(), ctx);
      merge_store_load(cache_row(in.cache, std::int32_t(b)), temp_slot.data(), temp, ctx);
      if (windows[b] >= 0) set_window(lengths[b], budgets[b], windows[b], temp, ctx);
      for (const MergeRoundParams& round : schedules[b]) {
        merge_round(temp, temp_slot.data(), 1, temp_budget.data(), round, bytes, ctx);
      }
      merge_store_copy(temp.as_const(), temp_slot.data(), mutable_store(), in.slots + b, 1, ctx);
    }
    // Last, and synchronizing (copy_from_host waits for its stream): the temporary store's work is done before its
    // arrays are freed on return.
    for (std::size_t b = 0; b < rows; ++b) {
      copy_from_host(&budgets[b], 1, budgets_.data() + slots[b], ctx);
      copy_from_host(&windows[b], 1, window_sinks_.data() + slots[b], ctx);
    }
    slot_states_.mark_prepared(slots);
  }

  void append(const AppendInputs<T>& in, std::span<std::byte> workspace, const Context& ctx) {
    constexpr const char* where = entry_point<"append">();
    const std::int32_t batch = checked_positioned_append<Context>(where, in);
    WorkspaceLayout carving(workspace, where);
    const std::span<std::byte> round_bytes =
        carving.span(merge_round_workspace_bytes(batch, limits_.kv_heads, capacity_, ctx), "CentroidKV round scratch");
    merge_round(mutable_store(), in.slots, batch, budgets_.data(), detail::centroid_kv_decode_params(config_),
                round_bytes, ctx);
    if (config_.below_minimum == CentroidKVBelowMinimum::window) {
      merge_store_evict(mutable_store(), in.slots, batch, budgets_.data(), window_sinks_.data(), ctx);
    }
    merge_store_append(in.cache, in.slots, in.lengths, mutable_store(), ctx);
  }

  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte>, const Context& ctx) {
    constexpr const char* where = entry_point<"select">();
    checked_select<Context>(where, in, out, capacity());
    check_no_window(where, in.attention.window);
    clear_counts(out, ctx);
  }

  /// The store's rows of the step's slots, read in place: K/V through a paged view whose pages are the slots, the
  /// entries (order), counts and log-degrees by slot through the slots as the selection's row map (valid until
  /// the next append). A slot outside [0, max_slots) makes its row's output NaN (sparse decode's row map).
  SecondSource<T> second_source(const SelectInputs<T>& in) const {
    const MergeStoreView<const T> s = store();
    return {merge_store_paged_view(s, in.slots, page_indptr_.data(), last_page_len_.data(), in.q.batch),
            SelectionView{const_cast<std::int32_t*>(s.order), const_cast<std::int32_t*>(s.count),
                          const_cast<float*>(s.log_degree), s.slots, s.kv_heads, s.capacity},
            in.slots};
  }

 private:
  static void check_no_window(const char* where, const AttentionWindow& window) {
    KVSIFT_CHECK(window.empty(), where,
                 "the attention window (sink {}, recent {}) must be empty: CentroidKV's store holds the sinks and the "
                 "recent tokens itself",
                 window.sink, window.recent);
  }
  /// The window fallback in the temporary store, just loaded with a prompt of n tokens (token t in slot t, degree 1):
  /// each row's order is rewritten so that its first B positions are the window, tokens [0, s) and [n - (B - s), n),
  /// the rest following in ascending order, and its count set to B; merge_store_copy then keeps the window alone.
  static void set_window(std::int32_t n, std::int32_t budget, std::int32_t sinks, const MergeStoreView<T>& temp,
                         const Context& ctx) {
    const std::int32_t first_recent = n - (budget - sinks);
    std::vector<std::int32_t> order(MergeStoreView<T>::entries(1, temp.kv_heads, temp.capacity));
    for (std::int32_t h = 0; h < temp.kv_heads; ++h) {
      std::int32_t* row = order.data() + std::int64_t(h) * temp.capacity;
      std::iota(row, row + sinks, 0);
      std::iota(row + sinks, row + budget, first_recent);
      std::iota(row + budget, row + n, sinks);
      std::iota(row + n, row + temp.capacity, n);
    }
    copy_from_host(order.data(), order.size(), temp.order, ctx);
    const std::vector<std::int32_t> counts(std::size_t(temp.kv_heads), budget);
    copy_from_host(counts.data(), counts.size(), temp.count, ctx);
  }
  /// Row b of a cache as a cache of one row (prepare loads one joining sequence at a time).
  static KVCache<const T> cache_row(const KVCache<const T>& cache, std::int32_t b) {
    return cache.visit([&](auto view) -> KVCache<const T> {
      if constexpr (std::is_same_v<decltype(view), PagedKVView<const T>>) {
        return view.sequence(b);  // either page-table form; CSR: page_indices[page_indptr[b] ...] as before
      } else {
        view.k += b * view.batch_stride;
        view.v += b * view.batch_stride;
        if (view.seq_lens != nullptr) view.seq_lens += b;
        view.batch = 1;
        return view;
      }
    });
  }
  MergeStoreView<T> mutable_store() {
    return {k_.data(), v_.data(), order_.data(), degree_.data(), log_degree_.data(), count_.data(),
            limits_.max_slots, limits_.kv_heads, capacity_, limits_.head_dim};
  }

  CentroidKVConfig config_;
  std::int32_t capacity_ = 0;
  ContextArray<Context, T> k_, v_;
  ContextArray<Context, std::int32_t> order_, degree_, count_, budgets_, window_sinks_, page_indptr_, last_page_len_;
  ContextArray<Context, float> log_degree_;
};

}  // namespace kvsift
