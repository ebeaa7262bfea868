#pragma once
/// Comparing decode outputs stored in 16 bits (fp16, bf16) with kvsift's fp64 reference; shared by the CPU
/// and CUDA backend tests.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <utility>

#include "kvsift/attention/reference.hpp"
#include "kvsift/core/dtype.hpp"
#include "test_util.hpp"

namespace kvsift::test {

template <class T>
constexpr const char* dtype_label() {
  return std::is_same_v<T, half> ? "f16" : "bf16";
}

/// Tolerances for outputs stored in 16 bits after fp32 accumulation: the final rounding dominates
/// (bf16 keeps 8 significant bits, fp16 11); LSE stays fp32, limited by exp2/log2 approximations.
template <class T>
struct Tolerance {
  static constexpr double max_abs_over_max_ref = std::is_same_v<T, half> ? 2e-3 : 1e-2;
  static constexpr double rel_l2 = std::is_same_v<T, half> ? 1e-3 : 5e-3;
  static constexpr double lse_abs = 1e-3;
};


/// Compares a device result (O in T, LSE fp32) with the fp32 reference, element by element; NaN fails.
template <class T>
void expect_close(const std::vector<T>& o, const std::vector<float>& lse, const HostState& ref,
                  const std::string& what) {
  double max_ref = 0, max_err = 0, num = 0, den = 0;
  for (std::size_t i = 0; i < o.size(); ++i) {
    const double got = to_float(o[i]), want = ref.o[i];
    const double err = std::abs(got - want);
    if (!(err <= max_err)) max_err = err;  // keeps NaN
    max_ref = std::max(max_ref, std::abs(want));
    num += err * err;
    den += want * want;
  }
  if (max_ref > 0) {
    EXPECT_LE(max_err / max_ref, Tolerance<T>::max_abs_over_max_ref) << what;
    EXPECT_LE(std::sqrt(num / den), Tolerance<T>::rel_l2) << what;
  } else {
    EXPECT_EQ(max_err, 0.0) << what;
  }
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      EXPECT_EQ(lse[i], ref.lse[i]) << what << " lse " << i;
    } else {
      EXPECT_NEAR(lse[i], ref.lse[i], Tolerance<T>::lse_abs * std::max(1.0f, std::abs(ref.lse[i]))) << what << " lse " << i;
    }
  }
}

struct CaseSpec {
  std::int32_t batch, q_heads, kv_heads, head_dim, tokens;
  std::int32_t k;          ///< selection capacity; each row selects min(k, seq_len) tokens; 0: dense only
  std::int32_t page_size;  ///< 0: contiguous
  bool log_weights;
  bool random_lengths = true;
  AttentionWindow window{};  ///< sparse decode's window; selections then come from the middle of each sequence
};

inline std::string describe(const CaseSpec& c) {
  return fmt::format("batch {} q_heads {} kv_heads {} head_dim {} tokens {} k {} page_size {} log_weights {} window {}+{}",
                     c.batch, c.q_heads, c.kv_heads, c.head_dim, c.tokens, c.k, c.page_size, c.log_weights,
                     c.window.sink, c.window.recent);
}

/// One randomly filled decode problem in host memory, in storage type T: queries, a contiguous cache, the
/// same tokens in a shuffled paged cache (when page_size > 0), and a selection of up to k distinct tokens per
/// row in random order (when k > 0), from the part of the sequence that the window leaves.
template <class T>
struct HostDecodeProblem {
  CaseSpec spec;
  HostKV kv_values;  ///< the cache's values as floats (already rounded to T)
  std::vector<T> q, k, v;
  std::unique_ptr<HostPagedKV> paged_values;
  std::vector<T> k_pages, v_pages;
  std::vector<std::int32_t> sel_indices, sel_counts;
  std::vector<float> sel_weights;
  std::vector<std::uint8_t> sel_attend_all;  ///< SelectionView::attend_all; empty: no row attends all

  HostDecodeProblem(Random& rng, const CaseSpec& c) : spec(c), kv_values(rng, c.batch, c.kv_heads, c.tokens, c.head_dim, lengths(rng, c)) {
    q = to_storage<T>(rng.normal(std::size_t(c.batch) * c.q_heads * c.head_dim));
    k = to_storage<T>(kv_values.k);
    v = to_storage<T>(kv_values.v);
    for (std::size_t i = 0; i < k.size(); ++i) {
      kv_values.k[i] = to_float(k[i]);
      kv_values.v[i] = to_float(v[i]);
    }
    if (c.page_size > 0) {
      paged_values = std::make_unique<HostPagedKV>(kv_values, c.page_size, /*hnd=*/rng.uniform_int(0, 1) == 1, rng);
      k_pages = to_storage<T>(paged_values->k_pages);
      v_pages = to_storage<T>(paged_values->v_pages);
    }
    if (c.k > 0) make_selection(rng);
  }

  static std::vector<std::int32_t> lengths(Random& rng, const CaseSpec& c) {
    std::vector<std::int32_t> lens(c.batch, c.tokens);
    if (c.random_lengths) {
      for (auto& l : lens) l = rng.uniform_int(std::max(1, c.tokens / 2), c.tokens);
    }
    return lens;
  }

  void make_selection(Random& rng) {
    const auto& c = spec;
    sel_indices.assign(std::size_t(c.batch) * c.kv_heads * c.k, kPoisonIndex);
    sel_counts.assign(std::size_t(c.batch) * c.kv_heads, 0);
    if (c.log_weights) sel_weights.assign(sel_indices.size(), kPoison);
    std::vector<std::int32_t> all;
    for (std::int32_t b = 0; b < c.batch; ++b) {
      for (std::int32_t g = 0; g < c.kv_heads; ++g) {
        const std::int32_t len = kv_values.seq_lens[b];
        const std::int32_t lo = c.window.sink_end(len), hi = c.window.recent_begin(len);
        const std::int32_t count = std::min(c.k, hi - lo);
        all.resize(hi - lo);
        std::iota(all.begin(), all.end(), lo);
        std::shuffle(all.begin(), all.end(), rng.engine);  // any order: consumers must not assume sorted rows
        const std::size_t row = std::size_t(b) * c.kv_heads + g;
        std::copy_n(all.begin(), count, sel_indices.begin() + row * c.k);
        sel_counts[row] = count;
        if (c.log_weights) {
          for (std::int32_t i = 0; i < count; ++i) sel_weights[row * c.k + i] = std::log(rng.uniform(1.0f, 40.0f));
        }
      }
    }
  }

  /// Makes about half of the selection rows (at least one) attend every token, and poisons those rows'
  /// counts, indices and log-weights, which must then never be read.
  void mark_attend_all(Random& rng) {
    sel_attend_all.assign(sel_counts.size(), 0);
    for (std::size_t row = 0; row < sel_counts.size(); ++row) {
      if (row != 0 && rng.uniform_int(0, 1) == 0) continue;
      sel_attend_all[row] = std::uint8_t(rng.uniform_int(1, 255));  // any nonzero value
      sel_counts[row] = -spec.k - 3;
      std::fill_n(sel_indices.begin() + row * spec.k, spec.k, kPoisonIndex);
      if (spec.log_weights) std::fill_n(sel_weights.begin() + row * spec.k, spec.k, kPoison);
    }
  }

  QueryView<const T> q_view() const { return QueryView<const T>::packed(q.data(), spec.batch, spec.q_heads, spec.head_dim); }
  ContiguousKVView<const T> contiguous() const {
    return ContiguousKVView<const T>::packed(k.data(), v.data(), spec.batch, spec.kv_heads, spec.tokens, spec.head_dim,
                                             kv_values.seq_lens.data());
  }
  /// The paged layout with the page data at (k_data, v_data): host arrays here, device copies in GPU tests.
  PagedKVView<const T> paged(const T* k_data, const T* v_data, const std::int32_t* indptr, const std::int32_t* pages,
                             const std::int32_t* last) const {
    return paged_over<const T>(k_data, v_data, indptr, pages, last);
  }
  /// The same over writable pages (a step's cache).
  PagedKVView<T> writable_paged(T* k_data, T* v_data, const std::int32_t* indptr, const std::int32_t* pages,
                                const std::int32_t* last) const {
    return paged_over<T>(k_data, v_data, indptr, pages, last);
  }
  template <class U>
  PagedKVView<U> paged_over(U* k_data, U* v_data, const std::int32_t* indptr, const std::int32_t* pages,
                            const std::int32_t* last) const {
    const auto& h = paged_values->view;
    return {k_data, v_data, indptr, pages, last, h.batch, h.kv_heads, h.head_dim, h.page_size, h.num_pages,
            h.page_stride, h.token_stride, h.head_stride};
  }
  PagedKVView<const T> paged() const {
    return paged(k_pages.data(), v_pages.data(), paged_values->indptr.data(), paged_values->indices.data(),
                 paged_values->last_len.data());
  }
  SelectionView selection() {
    return {sel_indices.data(), sel_counts.data(), spec.log_weights ? sel_weights.data() : nullptr, spec.batch,
            spec.kv_heads, spec.k, sel_attend_all.empty() ? nullptr : sel_attend_all.data()};
  }
  HostState reference(bool sparse, AttentionOptions options = {}) {
    HostState ref(spec.batch, spec.q_heads, spec.head_dim);
    if (sparse) {
      options.window = spec.window;
      reference::sparse_decode(q_view(), contiguous(), selection(), ref.view, options);
    } else {
      reference::dense_decode(q_view(), contiguous(), ref.view, options);
    }
    return ref;
  }
};

/// The problem's window and selection as one explicit selection without a window: per row the window's
/// tokens (log-weight 0), then the selected ones, in the order sparse decode visits them.
struct UnionSelection {
  std::vector<std::int32_t> indices, counts;
  std::vector<float> log_weights;
  SelectionView view;
};
template <class T>
UnionSelection window_as_selection(HostDecodeProblem<T>& p) {
  const CaseSpec& c = p.spec;
  const std::int32_t capacity = c.k + c.window.sink + c.window.recent;
  UnionSelection u{std::vector<std::int32_t>(std::size_t(c.batch) * c.kv_heads * capacity, kPoisonIndex),
                   std::vector<std::int32_t>(std::size_t(c.batch) * c.kv_heads),
                   std::vector<float>(c.log_weights ? std::size_t(c.batch) * c.kv_heads * capacity : 0, kPoison), {}};
  const SelectionView s = p.selection();
  for (std::int32_t b = 0; b < c.batch; ++b) {
    const std::int32_t len = p.kv_values.seq_lens[b], window = c.window.size(len);
    for (std::int32_t h = 0; h < c.kv_heads; ++h) {
      const std::size_t row = std::size_t(b) * c.kv_heads + h;
      for (std::int32_t i = 0; i < window + s.count(b, h); ++i) {
        u.indices[row * capacity + i] = i < window ? c.window.token(i, len) : s.row(b, h)[i - window];
        if (c.log_weights) u.log_weights[row * capacity + i] = i < window ? 0.0f : s.weights_row(b, h)[i - window];
      }
      u.counts[row] = window + s.count(b, h);
    }
  }
  u.view = {u.indices.data(), u.counts.data(), c.log_weights ? u.log_weights.data() : nullptr, c.batch, c.kv_heads,
            capacity};
  return u;
}

/// The tokens a page-level selection's row attends besides the window: each of its `count` pages' middle tokens, in
/// order (a sequence of `len` tokens).
inline std::vector<std::int32_t> page_middle_tokens(const std::int32_t* pages, std::int32_t count,
                                                    std::int32_t page_size, std::int32_t len,
                                                    const AttentionWindow& window) {
  std::vector<std::int32_t> tokens;
  for (std::int32_t i = 0; i < count; ++i) {
    for (std::int32_t t = pages[i] * page_size; t < (pages[i] + 1) * page_size; ++t) {
      if (t >= window.sink_end(len) && t < window.recent_begin(len)) tokens.push_back(t);
    }
  }
  return tokens;
}

/// A page-level selection over a problem's sequences (AttentionOptions::selection_page_size) and the same as tokens.
struct PagesAndTokens {
  UnionSelection pages;   ///< capacity pages_per_row: distinct page ids in random order, with log-weights when the problem has them
  UnionSelection tokens;  ///< capacity pages_per_row * page_size: each page's middle tokens in order, its weight each
};
/// Per row a random count in [0, min(pages_per_row, the sequence's pages)] of distinct pages of `page_size` tokens
/// from [0, ceil(seq_len / page_size)): pages in the window, across its edges and the partial last page among them.
template <class T>
PagesAndTokens random_page_selection(Random& rng, const HostDecodeProblem<T>& p, std::int32_t page_size,
                                     std::int32_t pages_per_row) {
  const CaseSpec& c = p.spec;
  const std::size_t rows = std::size_t(c.batch) * c.kv_heads;
  const std::int32_t token_capacity = pages_per_row * page_size;
  const auto empty = [&](std::int32_t capacity) {
    return UnionSelection{std::vector<std::int32_t>(rows * capacity, kPoisonIndex), std::vector<std::int32_t>(rows),
                          std::vector<float>(c.log_weights ? rows * capacity : 0, kPoison), {}};
  };
  PagesAndTokens s{empty(pages_per_row), empty(token_capacity)};
  for (std::int32_t b = 0; b < c.batch; ++b) {
    const std::int32_t len = p.kv_values.seq_lens[b];
    const std::int32_t lo = c.window.sink_end(len), hi = c.window.recent_begin(len);
    const std::int32_t sequence_pages = (len + page_size - 1) / page_size;
    std::vector<std::int32_t> order(static_cast<std::size_t>(sequence_pages));
    std::iota(order.begin(), order.end(), 0);
    for (std::int32_t h = 0; h < c.kv_heads; ++h) {
      const std::size_t row = std::size_t(b) * c.kv_heads + h;
      std::shuffle(order.begin(), order.end(), rng.engine);
      const std::int32_t count = rng.uniform_int(0, std::min(pages_per_row, sequence_pages));
      std::int32_t tokens = 0;
      for (std::int32_t i = 0; i < count; ++i) {
        const float weight = c.log_weights ? rng.uniform(-3.0f, 1.0f) : 0.0f;
        s.pages.indices[row * pages_per_row + i] = order[i];
        if (c.log_weights) s.pages.log_weights[row * pages_per_row + i] = weight;
        for (std::int32_t t = order[i] * page_size; t < (order[i] + 1) * page_size; ++t) {
          if (t < lo || t >= hi) continue;
          s.tokens.indices[row * token_capacity + tokens] = t;
          if (c.log_weights) s.tokens.log_weights[row * token_capacity + tokens] = weight;
          ++tokens;
        }
      }
      s.pages.counts[row] = count;
      s.tokens.counts[row] = tokens;
    }
  }
  for (auto [u, capacity] : {std::pair{&s.pages, pages_per_row}, std::pair{&s.tokens, token_capacity}}) {
    u->view = {u->indices.data(), u->counts.data(), c.log_weights ? u->log_weights.data() : nullptr, c.batch,
               c.kv_heads, capacity};
  }
  return s;
}

/// The non-finite inputs of the attention contract (attention/state.hpp), one per case.
enum class Corruption { k_nan, k_inf, v_nan, q_nan, log_weight_nan, log_weight_inf, scale_nan, row_masked };
inline constexpr Corruption kCorruptions[] = {Corruption::k_nan,          Corruption::k_inf,
                                              Corruption::v_nan,          Corruption::q_nan,
                                              Corruption::log_weight_nan, Corruption::log_weight_inf,
                                              Corruption::scale_nan,      Corruption::row_masked};
inline const char* corruption_name(Corruption c) {
  constexpr const char* names[] = {"NaN in a K row",       "+inf in a K row",        "NaN in a V row",
                                   "NaN in a query",       "a NaN log-weight",       "a +inf log-weight",
                                   "sm_scale NaN",         "every log-weight -inf"};
  return names[static_cast<int>(c)];
}
/// Whether a corruption concerns the selection's log-weights (sparse decode with log-weights only).
inline bool needs_log_weights(Corruption c) {
  return c == Corruption::log_weight_nan || c == Corruption::log_weight_inf || c == Corruption::row_masked;
}

/// Corrupts one input of a contiguous problem (k > 0, distinct selected tokens): the first token that row
/// (batch 0, last kv head) selects, in K or V (so dense decode sees it too); the last query head of the last
/// sequence; that row's log-weights. Returns the sm_scale to run with (NaN for scale_nan, else 0: default).
template <class T>
float corrupt(HostDecodeProblem<T>& p, Corruption c) {
  const CaseSpec& s = p.spec;
  const std::size_t row = std::size_t(s.kv_heads) - 1;
  const std::int32_t token = p.sel_indices[row * s.k];
  const auto element = [&](std::int32_t channel) {
    return (row * s.tokens + std::size_t(token)) * s.head_dim + std::size_t(channel);
  };
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  switch (c) {
    case Corruption::k_nan: p.k[element(s.head_dim / 2)] = from_float<T>(nan); break;
    case Corruption::k_inf:  // logit +inf or -inf by the sign of q's channel 0: +inf for the group's first head
      p.k[element(0)] = from_float<T>(inf);
      p.q[row * (s.q_heads / s.kv_heads) * s.head_dim] = from_float<T>(1.0f);
      break;
    case Corruption::v_nan: p.v[element(1)] = from_float<T>(nan); break;
    case Corruption::q_nan: p.q[p.q.size() - 3] = from_float<T>(nan); break;
    case Corruption::log_weight_nan: p.sel_weights[row * s.k] = nan; break;
    case Corruption::log_weight_inf: p.sel_weights[row * s.k] = inf; break;
    case Corruption::scale_nan: return nan;
    case Corruption::row_masked: std::fill_n(p.sel_weights.begin() + row * s.k, p.sel_counts[row], -inf); break;
  }
  return 0.0f;
}

/// Compares a result with the reference where inputs may be non-finite: NaN exactly where the reference has
/// NaN (O element by element, LSE per head), every other element within expect_close's tolerances.
template <class T>
void expect_close_with_nan(std::vector<T> o, std::vector<float> lse, HostState ref, const std::string& what) {
  std::size_t nans = 0;
  for (std::size_t i = 0; i < o.size(); ++i) {
    ASSERT_EQ(std::isnan(to_float(o[i])), std::isnan(ref.o[i])) << what << ": O element " << i;
    if (std::isnan(ref.o[i])) o[i] = from_float<T>(0.0f), ref.o[i] = 0.0f, ++nans;
  }
  for (std::size_t i = 0; i < lse.size(); ++i) {
    ASSERT_EQ(std::isnan(lse[i]), std::isnan(ref.lse[i])) << what << ": LSE of head " << i;
    if (std::isnan(ref.lse[i])) lse[i] = ref.lse[i] = 0.0f;
  }
  expect_close(o, lse, ref, what);
}

/// A selection kept by slot, for AttentionOptions::selection_rows: batch row b's row of `by_batch` (count, every
/// entry, log-weights where both have them) into row slot_of[b] of `store`, whose other rows stay as they are.
inline void copy_rows_by_slot(const SelectionView& by_batch, const std::vector<std::int32_t>& slot_of,
                              const SelectionView& store) {
  for (std::int32_t b = 0; b < by_batch.batch; ++b) {
    const std::int32_t slot = slot_of[std::size_t(b)];
    for (std::int32_t g = 0; g < by_batch.kv_heads; ++g) {
      store.counts[store.row_index(slot, g)] = by_batch.count(b, g);
      std::copy_n(by_batch.row(b, g), by_batch.capacity, store.row(slot, g));
      if (by_batch.log_weights != nullptr && store.log_weights != nullptr) {
        std::copy_n(by_batch.weights_row(b, g), by_batch.capacity, store.weights_row(slot, g));
      }
    }
  }
}

/// `batch` distinct slots of [0, slots) in random order.
inline std::vector<std::int32_t> distinct_slots(Random& rng, std::int32_t slots, std::int32_t batch) {
  std::vector<std::int32_t> all(std::size_t(slots), 0);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng.engine);
  all.resize(std::size_t(batch));
  return all;
}

}  // namespace kvsift::test
