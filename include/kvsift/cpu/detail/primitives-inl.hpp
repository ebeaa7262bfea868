#pragma once
/// Bodies of the per-ISA primitive kernels (see primitives_kernels.hpp), written once over Vec<L>.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "kvsift/cpu/detail/decode-inl.hpp"
#include "kvsift/cpu/detail/primitives_kernels.hpp"

namespace kvsift::cpu::detail {

template <SimdLevel L, class T>
void gemv_rows(const float* q, const MatrixView<const T>& rows, float scale, float* scores, std::int64_t begin,
               std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) scores[i] = scale * dot<L>(q, rows.row(i), rows.cols);
}

namespace KVSIFT_CPU_ISA {  // this level's own symbols (instantiate-inl.hpp)

/// Rows and columns of one register block: kBlockRows rows times two vectors of columns, held in
/// 2 * kBlockRows accumulators; per channel, kBlockRows broadcasts and two column loads feed 2 * kBlockRows
/// FMAs, and no horizontal reduction is needed (the columns are the vector lanes).
inline constexpr int kBlockRows = 4;
template <SimdLevel L>
inline constexpr int kBlockColumns = 2 * Vec<L>::kWidth;

/// out[r][c] = offsets[c0 + c] + x[r] . column (c0 + c), for the kBlockRows rows x and kBlockColumns columns.
template <SimdLevel L>
inline void score_block(const float* const (&x)[kBlockRows], const ScorePanel& panel, std::int64_t c0,
                        float (&out)[kBlockRows][kBlockColumns<L>]) {
  using V = Vec<L>;
  static_assert(ScorePanel::kPanelPadding % kBlockColumns<L> == 0);
  typename V::V acc[kBlockRows][2];
  const typename V::V offset0 = V::load(panel.offsets + c0), offset1 = V::load(panel.offsets + c0 + V::kWidth);
  for (int r = 0; r < kBlockRows; ++r) acc[r][0] = offset0, acc[r][1] = offset1;
  constexpr std::int64_t kTile = ScorePanel::kPanelPadding;
  const float* column = panel.tiles + (c0 / kTile) * panel.dim * kTile + c0 % kTile;
  for (std::int32_t j = 0; j < panel.dim; ++j, column += kTile) {
    const typename V::V c_lo = V::load(column), c_hi = V::load(column + V::kWidth);
    for (int r = 0; r < kBlockRows; ++r) {
      const typename V::V xr = V::set1(x[r][j]);
      acc[r][0] = V::fma(xr, c_lo, acc[r][0]);
      acc[r][1] = V::fma(xr, c_hi, acc[r][1]);
    }
  }
  for (int r = 0; r < kBlockRows; ++r) {
    V::store(&out[r][0], acc[r][0]);
    V::store(&out[r][V::kWidth], acc[r][1]);
  }
}

/// Row pointers of the block starting at `first`; rows past `end` repeat the last row (results unused).
inline void block_rows(const MatrixView<const float>& rows, std::int64_t first, std::int64_t end,
                       const float* (&x)[kBlockRows]) {
  for (int r = 0; r < kBlockRows; ++r) x[r] = rows.row(std::min(first + r, end - 1));
}

}  // namespace KVSIFT_CPU_ISA
using namespace KVSIFT_CPU_ISA;

template <SimdLevel L>
void score_rows(const MatrixView<const float>& rows, const ScorePanel& panel, float* scores, std::int64_t score_stride,
                std::int64_t column_begin, std::int64_t column_end) {
  float out[kBlockRows][kBlockColumns<L>];
  const float* x[kBlockRows];
  for (std::int64_t first = 0; first < rows.rows; first += kBlockRows) {
    block_rows(rows, first, rows.rows, x);
    for (std::int64_t c0 = column_begin; c0 < column_end; c0 += kBlockColumns<L>) {
      score_block<L>(x, panel, c0, out);
      const std::int64_t columns = std::min<std::int64_t>(kBlockColumns<L>, column_end - c0);
      for (std::int64_t r = first; r < std::min(first + kBlockRows, rows.rows); ++r) {
        std::copy_n(out[r - first], columns, scores + r * score_stride + c0);
      }
    }
  }
}

template <SimdLevel L>
void assign_rows(const MatrixView<const float>& points, const ScorePanel& panel, std::int32_t* assignment,
                 std::int64_t begin, std::int64_t end) {
  float out[kBlockRows][kBlockColumns<L>];
  const float* x[kBlockRows];
  for (std::int64_t first = begin; first < end; first += kBlockRows) {
    block_rows(points, first, end, x);
    float best[kBlockRows];
    std::int32_t best_id[kBlockRows] = {};
    std::fill_n(best, kBlockRows, -std::numeric_limits<float>::infinity());
    for (std::int64_t c0 = 0; c0 < panel.count; c0 += kBlockColumns<L>) {
      score_block<L>(x, panel, c0, out);
      const int columns = int(std::min<std::int64_t>(kBlockColumns<L>, panel.count - c0));
      for (int r = 0; r < kBlockRows; ++r) {
        for (int c = 0; c < columns; ++c) {
          if (out[r][c] > best[r]) {  // strict: on a tie the smaller id stays
            best[r] = out[r][c];
            best_id[r] = std::int32_t(c0 + c);
          }
        }
      }
    }
    for (std::int64_t i = first; i < std::min(first + kBlockRows, end); ++i) assignment[i] = best_id[i - first];
  }
}

namespace KVSIFT_CPU_ISA {

/// Tokens [first, last) of chunk `chunk` of a row of `length` tokens; empty past the row's end.
inline std::pair<std::int32_t, std::int32_t> chunk_tokens(std::int64_t chunk, std::int32_t length) {
  const auto first = std::int32_t(std::min<std::int64_t>(length, chunk * kScoreChunk));
  return {first, std::min(length, first + kScoreChunk)};
}

/// Natural-log LSE of head h of a row from its chunks' partials ([row_chunks, group] maxima and sums): the
/// chunks merged in order, so the result depends on nothing but the row. NaN when the head has no finite
/// largest logit (a NaN or +inf logit, or every logit -inf).
inline float head_lse(const float* chunk_max, const float* chunk_sum, std::int32_t row_chunks, std::int32_t group,
                      std::int32_t h) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::int32_t c = 0; c < row_chunks; ++c) m = max_nan(m, chunk_max[c * group + h]);
  if (!(m > -std::numeric_limits<float>::infinity() && m < std::numeric_limits<float>::infinity())) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  float sum = 0.0f;  // >= 1: the chunk holding the maximum contributes exp(0) = 1 to its own sum
  for (std::int32_t c = 0; c < row_chunks; ++c) {
    sum += chunk_sum[c * group + h] * std::exp2((chunk_max[c * group + h] - m) * kLog2e);
  }
  return m + std::log(sum);
}

}  // namespace KVSIFT_CPU_ISA

template <SimdLevel L, class T, class KV>
void group_logits_items(const GroupScoreJob<T, KV>& job, std::int64_t begin, std::int64_t end, bool use_bf16_dot) {
  using Ops = Vec<L>;
  using V = typename Ops::V;
  constexpr int W = Ops::kWidth;
  const int d = job.q.head_dim;
  const float neg_inf = -std::numeric_limits<float>::infinity(), pos_inf = -neg_inf;
  const std::int64_t cols = job.scores.cols;

  alignas(64) float q[kHeadTile][kMaxHeadDim];
  alignas(64) float logits[kHeadTile][kTokenBlock];
  float m[kHeadTile], l[kHeadTile];
  const T* k_rows[2][kTokenBlock];  // this block's rows and the next block's, alternating
  [[maybe_unused]] const T* q_rows[kHeadTile];  // the vdpbf16ps path reads the bf16 query directly

  for (std::int64_t item = begin; item < end; ++item) {
    const std::int64_t row = item / job.chunks, chunk = item % job.chunks;
    const std::int64_t b = row / job.kv.kv_heads, g = row % job.kv.kv_heads;
    const auto [first, last] = chunk_tokens(chunk, job.length(row, b));
    if (first == last) continue;
    float* scores = job.scores.row(row);

    // Heads in tiles of kHeadTile; a group of more heads reads the chunk's keys again for each further tile
    // (from the cache: a chunk is at most kScoreChunk rows).
    for (int h0 = 0; h0 < job.group; h0 += kHeadTile) {
      const int heads = std::min(kHeadTile, job.group - h0);
      for (int h = 0; h < heads; ++h) {
        const T* qh = job.q.row(b, g * job.group + h0 + h);
        q_rows[h] = qh;
        for (int c = 0; c < d; ++c) q[h][c] = Vec<SimdLevel::scalar>::load(qh + c);
        m[h] = neg_inf;
        l[h] = 0.0f;
      }
      const auto fill = [&](int slot, std::int32_t from) {
        const int rows = std::max(0, std::min<std::int32_t>(kTokenBlock, last - from));
        for (int t = 0; t < rows; ++t) k_rows[slot][t] = job.kv.k_row(b, g, job.token(row, from + t));
        return rows;
      };
      int slot = 0;
      int block = fill(slot, first);
      for (int t = 0; t < block; ++t) prefetch_row(k_rows[slot][t], d);
      for (std::int32_t start = first; start < last; start += kTokenBlock, slot ^= 1) {
        const int next_block = fill(slot ^ 1, start + kTokenBlock);
        const T* const* k_cur = k_rows[slot];
        const T* const* k_next = k_rows[slot ^ 1];
        with_heads(heads, [&]<int Heads>() {
          block_logits_any<L, Heads>(q, q_rows, k_cur, block, d, logits, k_next, next_block, use_bf16_dot, 1.0f);
        });
        const int block_vec = block / W * W;  // whole vectors; the rest of the block goes one by one
        const V scale = Ops::set1(job.scale), zero = Ops::zero();
        if (!job.softmax) {
          // Raw logits, reduced over the tile's heads in ascending order, then into the earlier tiles' result.
          // Vector max drops a NaN, so a block where a value is NaN or infinite (a NaN lane in `probe`) is
          // reduced again with max_nan; sums keep NaN by themselves.
          float* out = scores + start;
          alignas(64) float reduced[kTokenBlock];
          V probe = zero;
          for (int t = 0; t < block_vec; t += W) {
            V v = Ops::mul(Ops::load(logits[0] + t), scale);
            if (!job.sum) probe = Ops::fma(v, zero, probe);
            for (int h = 1; h < heads; ++h) {
              const V s = Ops::mul(Ops::load(logits[h] + t), scale);
              if (job.sum) {
                v = Ops::add(v, s);
              } else {
                probe = Ops::fma(s, zero, probe);
                v = Ops::max(v, s);
              }
            }
            if (h0 > 0) {
              const V earlier = Ops::load(out + t);
              if (!job.sum) probe = Ops::fma(earlier, zero, probe);
              v = job.sum ? Ops::add(earlier, v) : Ops::max(earlier, v);
            }
            Ops::store(reduced + t, v);
          }
          const bool vector_ok = job.sum || !std::isnan(Ops::reduce_sum(probe));
          for (int t = vector_ok ? block_vec : 0; t < block; ++t) {
            float v = logits[0][t] * job.scale;
            for (int h = 1; h < heads; ++h) {
              const float s = logits[h][t] * job.scale;
              v = job.sum ? v + s : max_nan(v, s);
            }
            reduced[t] = h0 == 0 ? v : job.sum ? out[t] + v : max_nan(out[t], v);
          }
          std::copy_n(reduced, block, out);
        } else {
          // Scaled logits to the workspace, and the chunk's running maximum and exponential sum per head
          // (the online softmax of the decode kernel, in natural units).
          const int padded = (block + W - 1) / W * W;
          for (int h = 0; h < heads; ++h) {
            float* dst = job.logits + ((row * job.group) + h0 + h) * cols + start;
            V block_max_v = Ops::set1(neg_inf), probe = zero;
            for (int t = 0; t < block_vec; t += W) {
              const V s = Ops::mul(Ops::load(logits[h] + t), scale);
              Ops::store(logits[h] + t, s);
              Ops::store(dst + t, s);
              block_max_v = Ops::max(block_max_v, s);
              probe = Ops::fma(s, zero, probe);
            }
            float block_max = Ops::reduce_max(block_max_v);
            if (std::isnan(Ops::reduce_sum(probe))) {  // a NaN or an infinity: take the maximum that keeps NaN
              block_max = neg_inf;
              for (int t = 0; t < block_vec; ++t) block_max = max_nan(block_max, logits[h][t]);
            }
            for (int t = block_vec; t < block; ++t) {
              const float s = logits[h][t] * job.scale;
              logits[h][t] = dst[t] = s;
              block_max = max_nan(block_max, s);
            }
            for (int t = block; t < padded; ++t) logits[h][t] = neg_inf;
            const float m_new = max_nan(m[h], block_max);
            if (m_new == neg_inf) continue;  // every logit so far is -inf: nothing to sum yet
            if (!(m_new < pos_inf)) {        // a NaN or +inf logit: the head's softmax is NaN for good
              m[h] = l[h] = m_new - m_new;
              continue;
            }
            const V shift = Ops::set1(m_new), log2e = Ops::set1(kLog2e);
            V sum = Ops::zero();
            for (int t = 0; t < padded; t += W) {
              sum = Ops::add(sum, Ops::exp2(Ops::mul(Ops::sub(Ops::load(logits[h] + t), shift), log2e)));
            }
            l[h] = l[h] * std::exp2((m[h] - m_new) * kLog2e) + Ops::reduce_sum(sum);  // m[h] = -inf: 0
            m[h] = m_new;
          }
        }
        block = next_block;
      }
      if (job.softmax) {
        for (int h = 0; h < heads; ++h) {
          const std::int64_t partial = (row * job.chunks + chunk) * job.group + h0 + h;
          job.chunk_max[partial] = m[h];
          job.chunk_sum[partial] = l[h];
        }
      }
    }
  }
}

template <SimdLevel L, class T, class KV>
void group_softmax_items(const GroupScoreJob<T, KV>& job, std::int64_t begin, std::int64_t end) {
  using Ops = Vec<L>;
  using V = typename Ops::V;
  constexpr int W = Ops::kWidth;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const std::int64_t cols = job.scores.cols;
  alignas(64) float acc[kScoreChunk];  // the chunk's scores, reduced over the heads so far
  alignas(64) float buffer[kTokenBlock];  // one block of a head's logits, padded to whole vectors

  for (std::int64_t item = begin; item < end; ++item) {
    const std::int64_t row = item / job.chunks, chunk = item % job.chunks;
    const std::int64_t b = row / job.kv.kv_heads;
    const std::int32_t length = job.length(row, b);
    const auto [first, last] = chunk_tokens(chunk, length);
    if (first == last) continue;
    const std::int32_t row_chunks = (length + kScoreChunk - 1) / kScoreChunk;
    const float* chunk_max = job.chunk_max + row * job.chunks * job.group;
    const float* chunk_sum = job.chunk_sum + row * job.chunks * job.group;
    // The group's heads in sets of `per`, each reduced into its own score row (one set: the whole group).
    const std::int32_t per = job.heads_per_row > 0 ? job.heads_per_row : job.group, sets = job.group / per;
    for (std::int32_t set = 0; set < sets; ++set) {
      float* scores = job.scores.row(row * sets + set);
      bool finite = true;
      for (std::int32_t h = set * per; h < (set + 1) * per; ++h) {
        finite = finite && std::isfinite(head_lse(chunk_max, chunk_sum, row_chunks, job.group, h));
      }
      if (!finite) {  // NaN never vanishes: a head without a softmax makes its whole score row NaN
        std::fill(scores + first, scores + last, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      // Sum: the heads' weights exp(s - LSE), added in head order. Max: the largest s - LSE over the heads, and
      // one exp at the end (exp is increasing), instead of one per head.
      const V log2e = Ops::set1(kLog2e);
      for (std::int32_t h = set * per; h < (set + 1) * per; ++h) {
        const V shift = Ops::set1(head_lse(chunk_max, chunk_sum, row_chunks, job.group, h));
        const float* head_logits = job.logits + (row * job.group + h) * cols;
        for (std::int32_t start = first; start < last; start += kTokenBlock) {
          const int block = std::min<std::int32_t>(kTokenBlock, last - start), padded = (block + W - 1) / W * W;
          const float* logits = head_logits + start;
          if (block < padded) {  // the row's last block: padded to whole vectors with weight 0, never written out
            std::copy_n(logits, block, buffer);
            std::fill(buffer + block, buffer + padded, neg_inf);
            logits = buffer;
          }
          for (int t = 0; t < padded; t += W) {
            const V x = Ops::sub(Ops::load(logits + t), shift);
            float* a = acc + (start - first) + t;
            if (job.sum) {
              const V w = Ops::exp2(Ops::mul(x, log2e));
              Ops::store(a, h == set * per ? w : Ops::add(Ops::load(a), w));
            } else {
              Ops::store(a, h == set * per ? x : Ops::max(Ops::load(a), x));
            }
          }
        }
      }
      if (!job.sum) {
        for (std::int32_t t = 0; t < last - first; t += W) Ops::store(acc + t, Ops::exp2(Ops::mul(Ops::load(acc + t), log2e)));
      }
      std::copy_n(acc, last - first, scores + first);
    }
  }
}

}  // namespace kvsift::cpu::detail
