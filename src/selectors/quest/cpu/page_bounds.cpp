// Page bounds on the CPU: checks (selectors/quest/detail/page_bounds_checks.hpp, shared with CUDA), then plain loops over
// the shared per-element math of core/page_bounds_view.hpp. Compiled without ISA flags: the index is built at
// prefill and the scores are the CUDA twin's oracle and the CPU placement's path.
#include "kvsift/selectors/quest/cpu/page_bounds.hpp"

#include <algorithm>
#include <limits>

#include "kvsift/selectors/quest/detail/page_bounds_checks.hpp"
#include "kvsift/selectors/quest/detail/page_bounds_instances.hpp"
#include "kvsift/core/dtype.hpp"

namespace kvsift::cpu {
namespace {

/// Pages per work item of page_scores and build: enough to amortize the item, few enough to balance rows.
constexpr std::int64_t kPagesPerItem = 256;

/// sum_c q_c * (q_c >= 0 ? hi_c : lo_c) over n channels, in 16 interleaved partial sums (channel c adds to
/// lane c % 16, the lanes then in order): a fixed order that the compiler can vectorize without fast-math.
float bound_dot(const float* q, const float* lo, const float* hi, std::int32_t n) {
  constexpr std::int32_t kLanes = 16;
  float lanes[kLanes] = {};
  std::int32_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (std::int32_t j = 0; j < kLanes; ++j) lanes[j] += q[c + j] * kvsift::detail::bound_factor(q[c + j], lo[c + j], hi[c + j]);
  }
  for (std::int32_t j = 0; c < n; ++c, ++j) lanes[j] += q[c] * kvsift::detail::bound_factor(q[c], lo[c], hi[c]);
  float sum = 0.0f;
  for (const float lane : lanes) sum += lane;
  return sum;
}

/// Folds key row k into the bounds lo / hi (head_dim values each); `first` starts the page at k.
template <class T>
void fold_key(const T* k, T* lo, T* hi, std::int32_t head_dim, bool first) {
  for (std::int32_t c = 0; c < head_dim; ++c) {
    const float x = to_float(k[c]);
    if (first || kvsift::detail::replaces_min(x, to_float(lo[c]))) lo[c] = k[c];
    if (first || kvsift::detail::replaces_max(x, to_float(hi[c]))) hi[c] = k[c];
  }
}

}  // namespace

template <class T, KVCacheView KV>
void build_page_bounds(const KV& kv, const std::int32_t* slots, const PageBoundsView<T>& bounds, const Context& ctx) {
  kvsift::detail::check_page_bounds_update("cpu::build_page_bounds", kv, slots, bounds, MemorySpace::host);
  const std::int64_t rows = std::int64_t(kv.batch) * kv.kv_heads;
  const std::int64_t chunks = kvsift::detail::page_count(bounds.max_pages, std::int32_t(kPagesPerItem));
  parallel_for(ctx.pool, rows * chunks, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int64_t b = item / chunks / kv.kv_heads, h = item / chunks % kv.kv_heads;
      const std::int32_t len = kv.seq_len(b);
      const std::int64_t first_page = item % chunks * kPagesPerItem;
      const std::int64_t last_page = std::min(first_page + kPagesPerItem, kvsift::detail::page_count(len, bounds.page_size));
      for (std::int64_t p = first_page; p < last_page; ++p) {
        T* lo = bounds.lo(slots[b], h, p);
        const std::int64_t t_end = std::min<std::int64_t>(len, (p + 1) * bounds.page_size);
        for (std::int64_t t = p * bounds.page_size; t < t_end; ++t) {
          fold_key(kv.k_row(b, h, t), lo, lo + bounds.head_dim, bounds.head_dim, t == p * bounds.page_size);
        }
      }
    }
  });
}

template <class T, KVCacheView KV>
void append_page_bounds(const KV& kv, const std::int32_t* slots, const PageBoundsView<T>& bounds, const Context& ctx) {
  kvsift::detail::check_page_bounds_update("cpu::append_page_bounds", kv, slots, bounds, MemorySpace::host);
  parallel_for(ctx.pool, std::int64_t(kv.batch) * kv.kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / kv.kv_heads, h = row % kv.kv_heads;
      const std::int32_t t = kv.seq_len(b) - 1;
      if (t < 0) continue;
      T* lo = bounds.lo(slots[b], h, t / bounds.page_size);
      fold_key(kv.k_row(b, h, t), lo, lo + bounds.head_dim, bounds.head_dim, t % bounds.page_size == 0);
    }
  });
}

template <class T>
void page_scores(const QueryView<const T>& q, const PageBoundsView<const T>& bounds, const std::int32_t* slots,
                 const std::int32_t* lengths, const AttentionWindow& window, const MatrixView<float>& scores,
                 std::int32_t* page_counts, const Context& ctx) {
  kvsift::detail::check_page_scores("cpu::page_scores", q, bounds, slots, lengths, window, scores, page_counts,
                            MemorySpace::host);
  const std::int32_t kv_heads = bounds.kv_heads, group = q.heads / kv_heads, d = bounds.head_dim;
  for (std::int32_t b = 0; b < q.batch; ++b) page_counts[b] = std::int32_t(kvsift::detail::page_count(lengths[b], bounds.page_size));
  const std::int64_t chunks = kvsift::detail::page_count(bounds.max_pages, std::int32_t(kPagesPerItem));
  parallel_for(ctx.pool, scores.rows * chunks, [&](std::int64_t begin, std::int64_t end) {
    // Per item, everything in fp32 on the stack: the group's query channels (a tile of heads, a chunk of
    // channels) converted once, each page's bounds converted once per chunk, so that the inner loop is
    // conversion-free and vectorizes; per (page, head) the chunks' partial sums add up in channel order.
    constexpr std::int32_t kHeadTile = 16, kChannels = 256;
    float q_tile[kHeadTile][kChannels], lo_f[kChannels], hi_f[kChannels];
    float sums[kPagesPerItem][kHeadTile], best[kPagesPerItem];
    bool nan[kPagesPerItem];
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int64_t row = item / chunks, b = row / kv_heads, g = row % kv_heads;
      const std::int32_t len = lengths[b];
      const std::int64_t first_page = item % chunks * kPagesPerItem;
      const std::int64_t last_page = std::min<std::int64_t>(first_page + kPagesPerItem, page_counts[b]);
      const std::int64_t pages = std::max<std::int64_t>(0, last_page - first_page);
      float* out = scores.row(row);
      std::fill_n(best, pages, -std::numeric_limits<float>::infinity());
      std::fill_n(nan, pages, false);
      for (std::int32_t h0 = 0; h0 < group; h0 += kHeadTile) {
        const std::int32_t heads = std::min(kHeadTile, group - h0);
        for (std::int64_t p = 0; p < pages; ++p) std::fill_n(sums[p], heads, 0.0f);
        for (std::int32_t c0 = 0; c0 < d; c0 += kChannels) {
          const std::int32_t channels = std::min(kChannels, d - c0);
          for (std::int32_t h = 0; h < heads; ++h) {
            const T* qh = q.row(b, std::int64_t(g) * group + h0 + h) + c0;
            for (std::int32_t c = 0; c < channels; ++c) q_tile[h][c] = to_float(qh[c]);
          }
          for (std::int64_t i = 0; i < pages; ++i) {
            const T* lo = bounds.lo(slots[b], g, first_page + i) + c0;
            const T* hi = lo + d;
            for (std::int32_t c = 0; c < channels; ++c) {
              lo_f[c] = to_float(lo[c]);
              hi_f[c] = to_float(hi[c]);
              nan[i] |= kvsift::detail::bound_is_nan(lo_f[c], hi_f[c]);
            }
            for (std::int32_t h = 0; h < heads; ++h) sums[i][h] += bound_dot(q_tile[h], lo_f, hi_f, channels);
          }
        }
        for (std::int64_t i = 0; i < pages; ++i) {
          for (std::int32_t h = 0; h < heads; ++h) best[i] = kvsift::detail::max_keep_nan(best[i], sums[i][h]);
        }
      }
      for (std::int64_t i = 0; i < pages; ++i) {
        const std::int64_t p = first_page + i;
        std::int64_t middle_first = 0, middle_last = 0;
        kvsift::detail::page_middle(p, bounds.page_size, len, window, &middle_first, &middle_last);
        out[p] = middle_first >= middle_last ? -std::numeric_limits<float>::infinity()
                 : nan[i]                    ? std::numeric_limits<float>::quiet_NaN()
                                             : best[i];
      }
    }
  });
}

void expand_pages(const SelectionView& pages, std::int32_t page_size, const std::int32_t* lengths,
                  const AttentionWindow& window, const SelectionView& out, const Context& ctx) {
  kvsift::detail::check_expand_pages("cpu::expand_pages", pages, page_size, lengths, window, out, MemorySpace::host);
  parallel_for(ctx.pool, std::int64_t(pages.batch) * pages.kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / pages.kv_heads, g = row % pages.kv_heads;
      const std::int32_t* chosen = pages.row(b, g);
      std::int32_t* dst = out.row(b, g);
      std::int32_t count = 0;
      for (std::int32_t i = 0; i < pages.count(b, g); ++i) {
        std::int64_t first = 0, last = 0;
        kvsift::detail::page_middle(chosen[i], page_size, lengths[b], window, &first, &last);
        for (std::int64_t t = first; t < last; ++t) dst[count++] = std::int32_t(t);
      }
      out.counts[row] = count;
      if (float* lw = out.weights_row(b, g)) std::fill_n(lw, count, 0.0f);
    }
  });
}

KVSIFT_STORAGE_TYPES(KVSIFT_PAGE_BOUNDS_INSTANCES)

}  // namespace kvsift::cpu
