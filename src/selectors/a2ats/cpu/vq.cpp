// Codebook quantization, lookup tables and code scan on the CPU (selectors/a2ats/cpu/vq.hpp). Encoding packs one kv head's
// codebook at a time for blocked scoring and ranks codewords with the k-means assignment kernel (the same
// -|c|^2 / 2 + z . c ranking, ties to the smaller column); the scan dispatches to AVX-512 gathers or scalar loads.
#include "kvsift/selectors/a2ats/cpu/vq.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kvsift/core/detail/topk_rows_checks.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/selectors/a2ats/detail/vq_checks.hpp"
#include "kvsift/selectors/a2ats/detail/vq_instances.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/detail/primitives_kernels.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu {
namespace detail::isa_avx512 {
// src/selectors/a2ats/cpu/vq_avx512.cpp: out[t] = lut[codes[t]] for t < n, NaN where codes[t] >= codewords.
void vq_scan_row_avx512(const float* lut, std::int32_t codewords, const std::uint16_t* codes, std::int32_t n, float* out);
}  // namespace detail::isa_avx512

namespace {

constexpr std::int32_t kEncodeBlock = 64;  ///< keys transformed and ranked together (the panel is read once per block)
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::int32_t threads_of(const ThreadPool* pool) { return pool != nullptr ? std::int32_t(pool->size()) : 1; }

struct EncodeWorkspace {
  float* tiles;            ///< [padded codewords * head_dim]: one kv head's C^z, ScorePanel layout
  float* offsets;          ///< [padded codewords]: -|C^z_c|^2 / 2, 0 past the codewords (never ranked)
  float* z;                ///< [threads, kEncodeBlock, head_dim]
  std::int32_t* assigned;  ///< [threads, kEncodeBlock]
};

std::int64_t padded_codewords(std::int32_t codewords) {
  constexpr std::int64_t kPad = detail::ScorePanel::kPanelPadding;
  return (codewords + kPad - 1) / kPad * kPad;
}

EncodeWorkspace layout_encode(WorkspaceLayout& layout, std::int32_t codewords, std::int32_t head_dim, std::int32_t threads) {
  const auto padded = std::size_t(padded_codewords(codewords));
  return {layout.allocate<float>(checked_mul(padded, std::size_t(head_dim), "vq_encode tiles"), "vq_encode tiles"),
          layout.allocate<float>(padded, "vq_encode offsets"),
          layout.allocate<float>(std::size_t(threads) * kEncodeBlock * std::size_t(head_dim), "vq_encode transformed keys"),
          layout.allocate<std::int32_t>(std::size_t(threads) * kEncodeBlock, "vq_encode codes")};
}

/// z = k L with L lower-triangular (row-major [d, d]): z_j = sum_{i >= j} k_i L[i][j], ascending i.
template <class T>
void transform_key(const T* k, const float* transform, std::int32_t d, float* z) {
  std::fill_n(z, d, 0.0f);
  for (std::int32_t i = 0; i < d; ++i) {
    const float ki = to_float(k[i]);
    const float* l = transform + std::int64_t(i) * d;
    for (std::int32_t j = 0; j <= i; ++j) z[j] += ki * l[j];
  }
}

/// lut[h * lut_stride + c] = q_h . C[c] for the group's heads and every codeword: one SIMD GEMV per head over the
/// kv head's codebook rows (group_scores' kernel), the same at a given level in vq_lut and vq_lut_scan.
template <SimdLevel L, class T>
void group_lut(const QueryView<const T>& q, std::int64_t b, std::int32_t first_head, std::int32_t group,
               const VqCodebook<T>& codebook, std::int32_t kv_head, float* lut, std::int64_t lut_stride) {
  const std::int32_t d = codebook.head_dim;
  const MatrixView<const T> rows{codebook.row(kv_head, 0), codebook.codewords, d, d};
  float qf[128];
  for (std::int32_t u = 0; u < group; ++u) {
    const T* row = q.row(b, first_head + u);
    for (std::int32_t j = 0; j < d; ++j) qf[j] = to_float(row[j]);
    detail::gemv_rows<L, T>(qf, rows, 1.0f, lut + u * lut_stride, 0, codebook.codewords);
  }
}

void scan_row_scalar(const float* lut, std::int32_t codewords, const std::uint16_t* codes, std::int32_t n, float* out) {
  for (std::int32_t t = 0; t < n; ++t) out[t] = codes[t] < codewords ? lut[codes[t]] : kNaN;
}

/// out[t] = max over the group's tables of lut(u)[codes[t]] (vq_group_max in head order), NaN for a code past the
/// codebook: one code read per token, the group's entries reduced in registers.
template <class Lut>
void scan_row_group_max(const Lut& lut, std::int32_t group, std::int32_t codewords, const std::uint16_t* codes,
                        std::int32_t n, float* out) {
  for (std::int32_t t = 0; t < n; ++t) {
    const std::int32_t code = codes[t];
    if (code >= codewords) {
      out[t] = kNaN;
      continue;
    }
    float m = lut(0)[code];
    for (std::int32_t u = 1; u < group; ++u) m = kvsift::detail::vq_group_max(m, lut(u)[code]);
    out[t] = m;
  }
}

/// Scans the codes of (sequence b, kv head g) into the group's score rows, or its one row with group_max;
/// lut(h) is head h's table.
template <class Lut>
void scan_group(const Lut& lut, std::int32_t codewords, std::int64_t b, std::int32_t g, std::int32_t group,
                const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots, const std::int32_t* lengths,
                const MatrixView<float>& scores, const VqScanOptions& options, bool avx512) {
  const std::int32_t n = kvsift::detail::vq_scan_length(lengths[b], scores.cols, codes.max_tokens);
  const std::int32_t slot = slots[b];
  const bool valid = slot >= 0 && slot < codes.slots;
  if (options.group_max) {
    float* out = scores.row(b * codes.kv_heads + g);
    if (!valid) {
      std::fill_n(out, n, kNaN);
    } else {
      scan_row_group_max(lut, group, codewords, codes.row(slot, g), n, out);
    }
    return;
  }
  for (std::int32_t u = 0; u < group; ++u) {
    float* out = scores.row((b * codes.kv_heads + g) * group + u);
    if (!valid) {
      std::fill_n(out, n, kNaN);
    } else if (avx512) {
      detail::isa_avx512::vq_scan_row_avx512(lut(u), codewords, codes.row(slot, g), n, out);
    } else {
      scan_row_scalar(lut(u), codewords, codes.row(slot, g), n, out);
    }
  }
}

}  // namespace

void vq_codeword_norms(const MatrixView<const float>& centroids, float* norms, const Context& ctx) {
  kvsift::detail::check_vq_norms_shape("cpu::vq_codeword_norms", centroids, norms);
  parallel_for(ctx.pool, centroids.rows, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      float norm = 0.0f;
      for (std::int32_t j = 0; j < centroids.cols; ++j) norm += centroids.row(i)[j] * centroids.row(i)[j];
      norms[i] = norm;
    }
  });
}

std::size_t vq_encode_workspace_bytes(std::int32_t codewords, std::int32_t head_dim, const Context& ctx) {
  constexpr const char* where = "cpu::vq_encode_workspace_bytes";
  kvsift::detail::check_vq_codewords(where, "codewords", codewords);
  kvsift::detail::check_supported(where, "codebook.head_dim", head_dim, kVqHeadDims);
  WorkspaceLayout counting;
  layout_encode(counting, codewords, head_dim, threads_of(ctx.pool));
  return counting.bytes();
}

template <class T>
void vq_encode(const HeadsView<const T>& keys, const VqEncodeCodebook& codebook, const VqCodesView<std::uint16_t>& codes,
               const VqCodeDestination& destination, std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cpu::vq_encode";
  kvsift::detail::check_vq_encode(where, keys, codebook, codes);
  const std::int32_t d = keys.head_dim, count = codebook.codewords, threads = threads_of(ctx.pool);
  WorkspaceLayout layout(workspace, where);
  const EncodeWorkspace ws = layout_encode(layout, count, d, threads);
  const std::int64_t padded = padded_codewords(count), blocks = (keys.batch + kEncodeBlock - 1) / kEncodeBlock;
  constexpr std::int64_t kPad = detail::ScorePanel::kPanelPadding;
  const detail::ScorePanel panel{ws.tiles, ws.offsets, d, count, padded};

  with_simd_level([&]<SimdLevel L>() {
    for (std::int32_t h = 0; h < keys.heads; ++h) {
      const float* centroids = codebook.centroids + std::int64_t(h) * count * d;
      const float* norms = codebook.norms + std::int64_t(h) * count;
      std::fill_n(ws.tiles + std::int64_t(count / kPad) * kPad * d, (padded - count / kPad * kPad) * d, 0.0f);
      std::fill_n(ws.offsets + count, padded - count, 0.0f);
      for (std::int64_t c = 0; c < count; ++c) {
        float* column = ws.tiles + (c / kPad) * d * kPad + c % kPad;
        for (std::int32_t j = 0; j < d; ++j) column[j * kPad] = centroids[c * d + j];
        ws.offsets[c] = -0.5f * norms[c];  // exact: ranks z . c - |c|^2 / 2, half of -(|c|^2 - 2 z . c)
      }
      const float* transform = codebook.transform + std::int64_t(h) * d * d;
      // Thread slots, not chunks of rows: each slot owns its scratch and takes every threads-th block.
      parallel_for(ctx.pool, threads, [&](std::int64_t slot_begin, std::int64_t slot_end) {
        for (std::int64_t s = slot_begin; s < slot_end; ++s) {
          float* z = ws.z + s * kEncodeBlock * d;
          std::int32_t* assigned = ws.assigned + s * kEncodeBlock;
          for (std::int64_t block = s; block < blocks; block += threads) {
            const std::int64_t r0 = block * kEncodeBlock, n = std::min<std::int64_t>(kEncodeBlock, keys.batch - r0);
            for (std::int64_t r = 0; r < n; ++r) transform_key(keys.row(r0 + r, h), transform, d, z + r * d);
            detail::assign_rows<L>(MatrixView<const float>::packed(z, n, d), panel, assigned, 0, n);
            for (std::int64_t r = 0; r < n; ++r) {
              std::int32_t slot = 0, position = 0;
              if (kvsift::detail::vq_destination(destination, codes, r0 + r, &slot, &position)) {
                codes.row(slot, h)[position] = std::uint16_t(assigned[r]);
              }
            }
          }
        }
      });
    }
  });
}

template <class T>
void vq_lut(const QueryView<const T>& q, const VqCodebook<T>& codebook, const MatrixView<float>& lut, const Context& ctx) {
  constexpr const char* where = "cpu::vq_lut";
  kvsift::detail::check_vq_query(where, q, codebook);
  kvsift::detail::check_vq_lut_shape(where, "lut", MatrixView<const float>{lut.data, lut.rows, lut.cols, lut.row_stride},
                                     q.batch, q.heads, codebook.codewords);
  const std::int32_t group = q.heads / codebook.kv_heads;
  with_simd_level([&]<SimdLevel L>() {
    parallel_for(ctx.pool, std::int64_t(q.batch) * codebook.kv_heads, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t item = begin; item < end; ++item) {
        const std::int64_t b = item / codebook.kv_heads;
        const auto g = std::int32_t(item % codebook.kv_heads);
        group_lut<L>(q, b, g * group, group, codebook, g, lut.row(b * q.heads + std::int64_t(g) * group),
                     lut.row_stride);
      }
    });
  });
}

void vq_code_scan(const MatrixView<const float>& lut, std::int32_t batch, const VqCodesView<const std::uint16_t>& codes,
                  const std::int32_t* slots, const std::int32_t* lengths, const MatrixView<float>& scores,
                  const VqScanOptions& options, const Context& ctx) {
  constexpr const char* where = "cpu::vq_code_scan";
  KVSIFT_CHECK(batch > 0 && lut.rows % batch == 0, where, "lut.rows (= {}) is not a positive multiple of batch (= {})",
               lut.rows, batch);
  const auto q_heads = std::int32_t(lut.rows / batch);
  kvsift::detail::check_vq_lut_shape(where, "lut", lut, batch, q_heads, lut.cols);
  kvsift::detail::check_vq_codewords(where, "lut.cols", lut.cols);
  kvsift::detail::check_vq_scan(where, batch, q_heads, codes, slots, lengths, scores, options);
  const std::int32_t group = q_heads / codes.kv_heads;
  const bool avx512 = active_simd_level() == SimdLevel::avx512;
  parallel_for(ctx.pool, std::int64_t(batch) * codes.kv_heads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t item = begin; item < end; ++item) {
      const std::int64_t b = item / codes.kv_heads;
      const auto g = std::int32_t(item % codes.kv_heads);
      const auto table = [&](std::int32_t u) { return lut.row(b * q_heads + std::int64_t(g) * group + u); };
      scan_group(table, lut.cols, b, g, group, codes, slots, lengths, scores, options, avx512);
    }
  });
}

std::size_t vq_lut_scan_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                        std::int32_t codewords, std::int32_t head_dim, const Context& ctx) {
  constexpr const char* where = "cpu::vq_lut_scan_workspace_bytes";
  KVSIFT_CHECK(batch > 0 && kv_heads > 0 && q_heads > 0 && q_heads % kv_heads == 0, where,
               "batch (= {}), q_heads (= {}) and kv_heads (= {}) must be positive, q_heads a multiple of kv_heads",
               batch, q_heads, kv_heads);
  kvsift::detail::check_vq_codewords(where, "codewords", codewords);
  kvsift::detail::check_supported(where, "codebook.head_dim", head_dim, kVqHeadDims);
  const std::int64_t threads = std::min<std::int64_t>(threads_of(ctx.pool), std::int64_t(batch) * kv_heads);
  WorkspaceLayout counting;
  counting.allocate<float>(checked_mul(std::size_t(threads) * std::size_t(q_heads / kv_heads), std::size_t(codewords),
                                       "vq_lut_scan tables"),
                           "vq_lut_scan tables");
  return counting.bytes();
}

template <class T>
void vq_lut_scan(const QueryView<const T>& q, const VqCodebook<T>& codebook, const VqCodesView<const std::uint16_t>& codes,
                 const std::int32_t* slots, const std::int32_t* lengths, const MatrixView<float>& scores,
                 const VqScanOptions& options, std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cpu::vq_lut_scan";
  kvsift::detail::check_vq_query(where, q, codebook);
  kvsift::detail::check_vq_scan(where, q.batch, q.heads, codes, slots, lengths, scores, options);
  KVSIFT_CHECK(codes.kv_heads == codebook.kv_heads, where, "codes.kv_heads (= {}) != codebook.kv_heads (= {})",
               codes.kv_heads, codebook.kv_heads);
  const std::int32_t group = q.heads / codebook.kv_heads, count = codebook.codewords;
  const std::int64_t items = std::int64_t(q.batch) * codebook.kv_heads;
  const std::int64_t threads = std::min<std::int64_t>(threads_of(ctx.pool), items);
  WorkspaceLayout layout(workspace, where);
  float* tables = layout.allocate<float>(std::size_t(threads) * std::size_t(group) * std::size_t(count), "vq_lut_scan tables");
  with_simd_level([&]<SimdLevel L>() {
    parallel_for(ctx.pool, threads, [&](std::int64_t slot_begin, std::int64_t slot_end) {
      for (std::int64_t s = slot_begin; s < slot_end; ++s) {
        float* lut = tables + s * group * std::int64_t(count);
        for (std::int64_t item = s; item < items; item += threads) {
          const std::int64_t b = item / codebook.kv_heads;
          const auto g = std::int32_t(item % codebook.kv_heads);
          group_lut<L>(q, b, g * group, group, codebook, g, lut, count);
          const auto table = [&](std::int32_t u) { return lut + std::int64_t(u) * count; };
          scan_group(table, count, b, g, group, codes, slots, lengths, scores, options, L == SimdLevel::avx512);
        }
      }
    });
  });
}

namespace {

/// vq_topk_rows' scratch per thread: the group's tables, each score row's word per codeword, the middle's tokens per
/// code, a radix pass's histogram, and per score row its threshold, quota and tied count.
struct CountSelectScratch {
  float* tables;
  std::uint32_t *words, *counts, *histogram;
  std::uint32_t *threshold, *quota, *tied;
};
struct CountSelectLayout {
  std::int64_t threads;
  float* tables;
  std::uint32_t *words, *counts, *state;
  CountSelectScratch of(std::int64_t slot, std::int32_t group, std::int32_t codewords) const {
    const std::int64_t c = codewords;
    std::uint32_t* const own = state + slot * (256 + 3 * group);
    return {tables + slot * group * c, words + slot * group * c, counts + slot * c, own,
            own + 256, own + 256 + group, own + 256 + 2 * group};
  }
};
CountSelectLayout layout_count_select(WorkspaceLayout& layout, const VqTopKShape& shape, const Context& ctx) {
  const std::int64_t threads = std::min<std::int64_t>(threads_of(ctx.pool), std::int64_t(shape.batch) * shape.kv_heads);
  const std::size_t group = std::size_t(shape.q_heads / shape.kv_heads), c = std::size_t(shape.codewords);
  const char* what = "vq_topk_rows scratch";
  CountSelectLayout b{threads, nullptr, nullptr, nullptr, nullptr};
  b.tables = layout.allocate<float>(checked_mul(std::size_t(threads) * group, c, what), "vq_topk_rows tables");
  b.words = layout.allocate<std::uint32_t>(checked_mul(std::size_t(threads) * group, c, what), "vq_topk_rows words");
  b.counts = layout.allocate<std::uint32_t>(checked_mul(std::size_t(threads), c, what), "vq_topk_rows counts");
  b.state = layout.allocate<std::uint32_t>(checked_mul(std::size_t(threads), 256 + 3 * group, what),
                                           "vq_topk_rows histograms and thresholds");
  return b;
}

/// One selection row of vq_topk_rows by counting (the rule of the CUDA count select, kernels/selectors/a2ats/vq.cu):
/// the middle [lo, hi)'s tokens per code, each score row's threshold word and quota of tied tokens by 8-bit radix
/// passes over its codewords' words weighted by their counts (NaN tokens at word 0), then the middle once in index
/// order, a token taken when some row takes it. words [heads, codewords]; codes nullptr for a bad slot (every token NaN); tokens at or past n are
/// NaN. Returns the count (-1 with nan_marks_row where the middle holds a NaN).
std::int32_t count_select_row(const std::uint32_t* words, std::int32_t heads, std::int32_t codewords,
                              const std::uint16_t* codes, std::int32_t n, std::int32_t lo, std::int32_t hi,
                              std::int32_t picks, bool nan_marks_row, const CountSelectScratch& w,
                              std::int32_t* indices) {
  const auto code_at = [&](std::int32_t t) { return codes != nullptr && t < n ? std::int32_t(codes[t]) : codewords; };
  std::fill_n(w.counts, codewords, 0u);
  std::uint32_t nan = 0;
  for (std::int32_t t = lo; t < hi; ++t) {
    const std::int32_t code = code_at(t);
    if (code < codewords) {
      ++w.counts[code];
    } else {
      ++nan;
    }
  }
  if (nan_marks_row) {  // a NaN token: one past the codes, or one whose code's word is NaN's (heads_per_row 1)
    bool has_nan = nan > 0;
    for (std::int32_t c = 0; c < codewords && !has_nan; ++c) has_nan = w.counts[c] > 0 && words[c] == 0u;
    if (has_nan) return -1;
  }
  std::uint32_t *const threshold = w.threshold, *const quota = w.quota, *const tied = w.tied;
  std::fill_n(tied, heads, 0u);
  for (std::int32_t h = 0; h < heads; ++h) {
    const std::uint32_t* row = words + std::int64_t(h) * codewords;
    std::uint32_t prefix = 0, want = std::uint32_t(picks);  // want: the threshold's rank among the words left
    for (int pass = 0; pass < 4; ++pass) {  // 8-bit radix passes, each code weighing its count
      const int shift = 24 - 8 * pass;
      const std::uint32_t decided = pass == 0 ? 0u : ~0u << (shift + 8);
      std::fill_n(w.histogram, 256, 0u);
      for (std::int32_t c = 0; c < codewords; ++c) {
        if (w.counts[c] == 0) continue;
        if ((row[c] & decided) == prefix) w.histogram[(row[c] >> shift) & 255u] += w.counts[c];
      }
      if (prefix == 0u) w.histogram[0] += nan;  // NaN tokens: word 0
      std::uint32_t before = 0, d = 0;
      while (before + w.histogram[d] < want) before += w.histogram[d++];
      prefix |= d << shift;
      want -= before;
    }
    threshold[h] = prefix;
    quota[h] = want;
  }
  std::int32_t count = 0;
  for (std::int32_t t = lo; t < hi; ++t) {
    const std::int32_t code = code_at(t);
    bool take = false;
    for (std::int32_t h = 0; h < heads; ++h) {
      const std::uint32_t x = code < codewords ? words[std::int64_t(h) * codewords + code] : 0u;
      if (x < threshold[h]) take = true;
      if (x == threshold[h]) take = tied[h]++ < quota[h] || take;  // every tied token counts, taken or not
    }
    if (take) indices[count++] = t;
  }
  return count;
}

/// Whether some token of [lo, hi) scores NaN in some table of the group (nan_marks_row where the whole middle is
/// taken): a code past the codebook, a token past the codes, a bad slot (codes nullptr), or a NaN entry. A NaN in
/// one head's table is a NaN in the group's maximum too (vq_group_max).
bool middle_has_nan(const float* tables, std::int32_t group, std::int32_t codewords, const std::uint16_t* codes,
                    std::int32_t n, std::int32_t lo, std::int32_t hi) {
  for (std::int32_t t = lo; t < hi; ++t) {
    if (codes == nullptr || t >= n || codes[t] >= codewords) return true;
    for (std::int32_t u = 0; u < group; ++u) {
      if (std::isnan(tables[std::int64_t(u) * codewords + codes[t]])) return true;
    }
  }
  return false;
}

}  // namespace

std::size_t vq_topk_rows_workspace_bytes(const VqTopKShape& shape, const Context& ctx) {
  kvsift::detail::check_vq_topk_shape("cpu::vq_topk_rows_workspace_bytes", shape);
  WorkspaceLayout counting;
  layout_count_select(counting, shape, ctx);
  return counting.bytes();
}

template <class T>
void vq_topk_rows(const QueryView<const T>& q, const VqCodebook<T>& codebook, const VqCodesView<const std::uint16_t>& codes,
                  const std::int32_t* slots, const std::int32_t* lengths, const VqTopKShape& shape,
                  const TopKRowsOptions& options, const SelectionView& out, std::span<std::byte> workspace,
                  const Context& ctx) {
  constexpr const char* where = "cpu::vq_topk_rows";
  kvsift::detail::check_vq_topk_rows(where, q, codebook, codes, slots, lengths, "lengths", shape, options, out);
  const std::int32_t group = q.heads / codebook.kv_heads, count = codebook.codewords;
  const std::int32_t heads = shape.scan.group_max ? 1 : group;
  kvsift::detail::check_topk_rows_host_values(where, lengths, out, shape.max_tokens, "shape.max_tokens", shape.k, options);
  WorkspaceLayout layout(workspace, where);
  const CountSelectLayout scratch = layout_count_select(layout, shape, ctx);
  const std::int64_t items = std::int64_t(q.batch) * codebook.kv_heads;
  with_simd_level([&]<SimdLevel L>() {
    parallel_for(ctx.pool, scratch.threads, [&](std::int64_t slot_begin, std::int64_t slot_end) {
      for (std::int64_t s = slot_begin; s < slot_end; ++s) {
        const CountSelectScratch w = scratch.of(s, group, count);
        for (std::int64_t item = s; item < items; item += scratch.threads) {  // item: the selection row (b, g)
          const std::int64_t b = item / codebook.kv_heads;
          const auto g = std::int32_t(item % codebook.kv_heads);
          const std::int32_t length = lengths[b];
          const std::int32_t lo = options.window.sink_end(length), hi = options.window.recent_begin(length);
          const std::int32_t k = options.row_k != nullptr ? options.row_k[item] : shape.k;
          const std::int32_t picks = std::min(k, hi - lo);
          std::int32_t* const indices = out.indices + item * out.capacity;
          const std::int32_t slot = slots[b];
          const std::uint16_t* row = slot >= 0 && slot < codes.slots ? codes.row(slot, g) : nullptr;
          const std::int32_t n = kvsift::detail::vq_scan_length(length, shape.max_tokens, codes.max_tokens);
          std::int32_t selected = picks;
          const bool whole = picks == hi - lo;  // every score row takes the whole middle (nothing to rank)
          if (picks > 0 && (!whole || options.nan_marks_row)) {
            group_lut<L>(q, b, g * group, group, codebook, g, w.tables, count);
          }
          if (whole) {
            std::iota(indices, indices + picks, lo);  // the tables only for nan_marks_row
            if (options.nan_marks_row && picks > 0 && middle_has_nan(w.tables, group, count, row, n, lo, hi)) selected = -1;
          } else if (picks > 0) {
            for (std::int32_t c = 0; c < count; ++c) {
              if (shape.scan.group_max) {
                float m = w.tables[c];
                for (std::int32_t u = 1; u < group; ++u) m = kvsift::detail::vq_group_max(m, w.tables[std::int64_t(u) * count + c]);
                w.words[c] = rank_word(m);
              } else {
                for (std::int32_t u = 0; u < group; ++u) {
                  w.words[std::int64_t(u) * count + c] = rank_word(w.tables[std::int64_t(u) * count + c]);
                }
              }
            }
            selected = count_select_row(w.words, heads, count, row, n, lo, hi, picks, options.nan_marks_row, w, indices);
          }
          if (out.log_weights != nullptr && selected > 0) std::fill_n(out.log_weights + item * out.capacity, selected, 0.0f);
          out.counts[item] = selected;
        }
      }
    });
  });
}

KVSIFT_STORAGE_TYPES(KVSIFT_VQ_INSTANCES)

}  // namespace kvsift::cpu
