// CPU top-K into selection rows (cpu/topk.hpp): validation, workspace layout and the per-row select.
#include "kvsift/cpu/topk.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kvsift/core/detail/topk_rows_checks.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"

namespace kvsift::cpu {
namespace {

/// Threads of topk_rows: each takes a contiguous run of selection rows and its own rank-key scratch.
std::int64_t topk_slots(std::int64_t score_rows, std::int32_t heads_per_row, const ThreadPool* pool) {
  const std::int64_t selection_rows = (score_rows + heads_per_row - 1) / heads_per_row;
  return std::max<std::int64_t>(1, std::min<std::int64_t>(selection_rows, pool != nullptr ? pool->size() : 1));
}

struct TopKRowsWorkspace {
  std::uint64_t* keys;   ///< [slots, max_tokens]: rank keys of one score row's boundary bin
  std::int32_t* picks;   ///< [slots, heads_per_row * k] when heads_per_row > 1: the score rows' picks, before their union
};

/// The single layout behind topk_rows_workspace_bytes and the carving in topk_rows.
TopKRowsWorkspace layout_topk_rows(WorkspaceLayout& layout, std::int64_t slots, std::int32_t max_tokens, std::int32_t k,
                                   std::int32_t heads_per_row) {
  constexpr const char* what = "cpu topk_rows workspace";
  TopKRowsWorkspace ws{};
  ws.keys = layout.allocate<std::uint64_t>(checked_mul(std::size_t(slots), std::size_t(max_tokens), what), "rank_keys");
  if (heads_per_row > 1) {
    ws.picks = layout.allocate<std::int32_t>(
        checked_mul(std::size_t(slots), checked_mul(std::size_t(heads_per_row), std::size_t(k), what), what), "picks");
  }
  return ws;
}

/// The k best (rank_key order) of the candidates [lo, hi) of a row of scores, k < hi - lo, into out[0, k),
/// ascending. A radix pass first: a histogram of the top 11 bits of each candidate's rank word finds the bin
/// holding the k-th best; candidates of better bins are chosen outright (in ascending order, as the scan
/// meets them), and only those of that bin are ranked by full keys (nth_element over `keys`, room for hi - lo)
/// and merged in. The result is the plain nth_element's over all candidates, exactly.
void best_of_row(const float* scores, std::int32_t lo, std::int32_t hi, std::int32_t k, std::uint64_t* keys,
                 std::int32_t* out) {
  constexpr int kShift = 21;  // 32 - 11 bits
  std::int32_t histogram[1 << (32 - kShift)] = {};
  for (std::int32_t t = lo; t < hi; ++t) ++histogram[rank_word(scores[t]) >> kShift];
  std::uint32_t boundary = 0;
  std::int32_t better = 0;  // candidates in bins before the boundary bin: fewer than k
  while (better + histogram[boundary] < k) better += histogram[boundary++];
  std::int32_t chosen = 0, tied = 0;
  for (std::int32_t t = lo; t < hi; ++t) {
    const std::uint32_t word = rank_word(scores[t]);
    if ((word >> kShift) < boundary) {
      out[chosen++] = t;
    } else if ((word >> kShift) == boundary) {
      keys[tied++] = (std::uint64_t(word) << 32) | std::uint32_t(t);
    }
  }
  const std::int32_t rest = k - better;
  std::nth_element(keys, keys + rest, keys + tied);
  for (std::int32_t i = 0; i < rest; ++i) keys[i] &= 0xffffffffu;  // the chosen ones' indices
  std::sort(keys, keys + rest);
  // Merge the two ascending runs, out[0, better) and keys[0, rest), from the back into out[0, k).
  std::int32_t a = better - 1, b = rest - 1;
  for (std::int32_t i = k - 1; b >= 0; --i) {
    out[i] = a >= 0 && out[a] > std::int32_t(keys[b]) ? out[a--] : std::int32_t(keys[b--]);
  }
}

/// MassBudget's k for one row of n measurable scores (core/ranking.hpp): the fewest largest whose units reach
/// mass_target(mass, U). A radix select over mass_bits, most significant digit first: each pass counts the items
/// and units per digit among the candidates that share the digits found so far, then walks the digits from the
/// top until the units above and in a digit reach what is left of the target; the items of higher digits are
/// kept outright. After the last digit the threshold bin holds one score, so mass_equal_picks finishes.
std::int32_t mass_row_picks(const float* scores, std::int32_t n, double mass) {
  std::int32_t counts[kMassRadixBins];
  std::uint64_t units[kMassRadixBins];
  std::uint64_t remaining = 0;
  std::uint32_t prefix = 0, prefix_mask = 0;  // the digits found so far, and where they lie
  std::int32_t kept = 0;
  for (int pass = 0; pass < kMassRadixPasses; ++pass) {
    const int shift = mass_digit_shift(pass);
    const std::uint32_t digit_mask = mass_digit_mask(pass);
    std::fill_n(counts, kMassRadixBins, 0);
    std::fill_n(units, kMassRadixBins, std::uint64_t(0));
    for (std::int32_t i = 0; i < n; ++i) {
      const std::uint32_t bits = mass_bits(scores[i]);
      if ((bits & prefix_mask) != prefix) continue;
      const std::uint32_t digit = (bits >> shift) & digit_mask;
      ++counts[digit];
      units[digit] += mass_units(scores[i]);
    }
    if (pass == 0) {
      std::uint64_t total = 0;
      for (const std::uint64_t u : units) total += u;
      remaining = mass_target(mass, total);
      if (remaining == 0) return 0;
    }
    std::int32_t digit = std::int32_t(digit_mask);
    for (; units[digit] < remaining; --digit) {  // the target lies within the row's units: some digit reaches it
      remaining -= units[digit];
      kept += counts[digit];
    }
    prefix |= std::uint32_t(digit) << shift;
    prefix_mask |= digit_mask << shift;
    if (pass == kMassRadixPasses - 1) return kept + mass_equal_picks(remaining, units[digit], counts[digit]);
  }
  return kept;  // not reached
}

}  // namespace

std::size_t topk_rows_workspace_bytes(std::int64_t score_rows, std::int32_t max_tokens, std::int32_t k,
                                      const TopKRowsOptions& options, const ThreadPool* pool) {
  kvsift::detail::check_topk_rows_shape("cpu::topk_rows_workspace_bytes", score_rows, max_tokens, k, options);
  WorkspaceLayout counting;
  layout_topk_rows(counting, topk_slots(score_rows, options.heads_per_row, pool), max_tokens, k, options.heads_per_row);
  return counting.bytes();
}

void topk_rows(const MatrixView<const float>& scores, const std::int32_t* lengths, std::int32_t k,
               const TopKRowsOptions& options, const SelectionView& out, std::span<std::byte> workspace,
               ThreadPool* pool) {
  constexpr const char* where = "cpu::topk_rows";
  kvsift::detail::check_topk_rows_call(where, scores, lengths, "lengths", k, options, out);
  kvsift::detail::check_topk_rows_host_values(where, lengths, out, scores.cols, "scores.cols", k, options);
  const std::int32_t heads = options.heads_per_row;
  const std::int64_t selection_rows = std::int64_t(out.batch) * out.kv_heads;
  const AttentionWindow window = options.window;
  const std::int64_t slots = topk_slots(scores.rows, heads, pool);
  WorkspaceLayout layout(workspace, where);
  const TopKRowsWorkspace ws = layout_topk_rows(layout, slots, scores.cols, k, heads);
  parallel_for(pool, slots, [&](std::int64_t slot_begin, std::int64_t slot_end) {
    for (std::int64_t slot = slot_begin; slot < slot_end; ++slot) {
      std::uint64_t* const keys = ws.keys + slot * scores.cols;
      std::int32_t* const picked = heads > 1 ? ws.picks + slot * std::int64_t(heads) * k : nullptr;
      for (std::int64_t s = slot * selection_rows / slots; s < (slot + 1) * selection_rows / slots; ++s) {
        const std::int32_t length = lengths[s / out.kv_heads];
        const std::int32_t lo = window.sink_end(length), hi = window.recent_begin(length);
        const std::int32_t k_s = options.row_k != nullptr ? options.row_k[s] : k;
        const std::int32_t picks = std::min(k_s, hi - lo);
        std::int32_t* const indices = out.indices + s * out.capacity;
        std::int32_t count = picks;
        if (picks == hi - lo) {  // every score row takes the whole middle
          std::iota(indices, indices + count, lo);
        } else if (heads == 1) {
          if (picks > 0) best_of_row(scores.row(s), lo, hi, picks, keys, indices);
        } else if (picks > 0) {
          // Each score row's ascending picks side by side, then their union.
          for (std::int32_t h = 0; h < heads; ++h) {
            best_of_row(scores.row(s * heads + h), lo, hi, picks, keys, picked + std::int64_t(h) * picks);
          }
          std::sort(picked, picked + std::int64_t(heads) * picks);
          count = std::int32_t(std::unique_copy(picked, picked + std::int64_t(heads) * picks, indices) - indices);
        }
        if (options.ids != nullptr) {  // heads == 1: positions to ids, in place
          const std::int32_t* const ids = options.ids + s * options.ids_stride;
          std::transform(indices, indices + count, indices, [ids](std::int32_t position) { return ids[position]; });
        }
        if (out.log_weights != nullptr) std::fill_n(out.log_weights + s * out.capacity, count, 0.0f);
        if (options.nan_marks_row && picks > 0) {
          const float* const row = scores.row(s);
          if (std::any_of(row + lo, row + hi, [](float x) { return std::isnan(x); })) count = -1;
        }
        out.counts[s] = count;
      }
    }
  });
}

void length_budgets(const std::int32_t* lengths, std::int32_t batch, std::int32_t heads, const LengthBudget& budget,
                    std::int32_t* row_k) {
  kvsift::detail::check_length_budgets("cpu::length_budgets", lengths, batch, heads, budget, row_k);
  for (std::int32_t b = 0; b < batch; ++b) std::fill_n(row_k + std::int64_t(b) * heads, heads, budget(lengths[b]));
}

void mass_budgets(const MatrixView<const float>& scores, const std::int32_t* counts, const MassBudget& budget,
                  std::int32_t* row_k, ThreadPool* pool) {
  constexpr const char* where = "cpu::mass_budgets";
  kvsift::detail::check_mass_budgets(where, scores, counts, budget, row_k);
  for (std::int64_t r = 0; r < scores.rows; ++r) {
    KVSIFT_CHECK(counts[r] >= -1 && counts[r] <= scores.cols, where,
                 "counts[{}] (= {}) is outside [-1, scores.cols = {}]", r, counts[r], scores.cols);
    KVSIFT_CHECK(budget.limits == nullptr || (budget.limits[r] >= 0 && budget.limits[r] <= budget.maximum), where,
                 "budget.limits[{}] (= {}) is outside [0, budget.maximum = {}]", r,
                 budget.limits == nullptr ? 0 : budget.limits[r], budget.maximum);
  }
  parallel_for(pool, scores.rows, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const std::int32_t n = counts[r];
      if (n < 0) {
        row_k[r] = -1;
        continue;
      }
      std::int32_t upper = std::min(budget.maximum, n);
      if (budget.limits != nullptr) upper = std::min(upper, budget.limits[r]);
      const float* const row = scores.row(r);
      if (upper == 0 || !std::all_of(row, row + n, [](float s) { return mass_measurable(s); })) {
        row_k[r] = upper;
        continue;
      }
      row_k[r] = mass_row_k(mass_row_picks(row, n, budget.mass), budget.floor, upper);
    }
  });
}

}  // namespace kvsift::cpu
