#pragma once
/// The CPU decode-attention kernel body, written once for every SimdLevel (see vec-inl.hpp). One call
/// handles a range of work items (chunks of (sequence, kv head) rows); each K/V row is read once for every
/// query head of the GQA group (in tiles of kHeadTile heads). Logits are kept in base 2; tokens go in blocks
/// of kTokenBlock: logits of the block, one online-softmax rescale per head, then V streamed through the
/// accumulators.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "kvsift/core/views.hpp"
#include "kvsift/cpu/detail/decode_kernels.hpp"
#include "kvsift/cpu/detail/vec-inl.hpp"

namespace kvsift::cpu::detail {
namespace KVSIFT_CPU_ISA {  // this level's own symbols (instantiate-inl.hpp)

template <class T>
inline void prefetch_row(const T* row, int d) {
  const char* p = reinterpret_cast<const char*>(row);
  // Into L2 (prefetcht1): the L2 miss queue keeps more rows in flight than the L1 fill buffers (measured).
  for (int offset = 0; offset < d * int(sizeof(T)); offset += 64) __builtin_prefetch(p + offset, 0, 2);
}

/// q . k over d channels (fp32 query, storage-type key); shared with the GEMV and k-means primitives.
template <SimdLevel L, class T>
float dot(const float* q, const T* k, int d) {
  using Ops = Vec<L>;
  typename Ops::V acc = Ops::zero();
  int c = 0;
  for (; c + Ops::kWidth <= d; c += Ops::kWidth) acc = Ops::fma(Ops::load(q + c), Ops::load(k + c), acc);
  float sum = Ops::reduce_sum(acc);
  for (; c < d; ++c) sum += q[c] * Vec<SimdLevel::scalar>::load(k + c);
  return sum;
}

/// Vector registers a kernel may keep as accumulators (the rest hold operands): 32 zmm, 16 ymm.
template <SimdLevel L>
inline constexpr int kAccumulatorRegisters = L == SimdLevel::avx512 ? 24 : L == SimdLevel::avx2 ? 12 : 8;

/// logits[h][t] = q_h . k_t (q pre-scaled to base 2) for the block's rows, every head at once: each K row
/// is loaded once per block for all Heads query heads, and each head's dot product stays in a register
/// until its one horizontal sum.
template <SimdLevel L, int Heads, class T>
void block_logits(const float (*q)[kMaxHeadDim], const T* const* k_rows, int block, int d,
                  float (*logits)[kTokenBlock], const T* const* k_next, int next_block) {
  using Ops = Vec<L>;
  using V = typename Ops::V;
  constexpr int W = Ops::kWidth;
  const int d_vec = d / W * W;
  for (int t = 0; t < block; ++t) {
    if (t < next_block) prefetch_row(k_next[t], d);
    const T* k = k_rows[t];
    V acc[Heads];
    for (int h = 0; h < Heads; ++h) acc[h] = Ops::zero();
    for (int c = 0; c < d_vec; c += W) {
      const V kv = Ops::load(k + c);
      for (int h = 0; h < Heads; ++h) acc[h] = Ops::fma(Ops::load(q[h] + c), kv, acc[h]);
    }
    for (int h = 0; h < Heads; ++h) {
      float sum = Ops::reduce_sum(acc[h]);
      for (int c = d_vec; c < d; ++c) sum += q[h][c] * Vec<SimdLevel::scalar>::load(k + c);
      logits[h][t] = sum;
    }
  }
}

#if KVSIFT_CPU_HAS_AVX512
/// block_logits for bf16 storage with vdpbf16ps on the unscaled bf16 query (bf16 x bf16 products are exact in
/// fp32, so this loses nothing); the caller scales the logits. head_dim must be a multiple of 32.
template <int Heads>
void block_logits_bf16(const bfloat16* const* q_rows, const bfloat16* const* k_rows, int block, int d,
                       float (*logits)[kTokenBlock], const bfloat16* const* k_next, int next_block) {
  for (int t = 0; t < block; ++t) {
    if (t < next_block) prefetch_row(k_next[t], d);
    const bfloat16* k = k_rows[t];
    __m512 acc[Heads];
    for (int h = 0; h < Heads; ++h) acc[h] = _mm512_setzero_ps();
    for (int c = 0; c < d; c += 32) {
      const __m512i kv = _mm512_loadu_si512(k + c);
      for (int h = 0; h < Heads; ++h) {
        const __m512i qv = _mm512_loadu_si512(q_rows[h] + c);
        acc[h] = _mm512_dpbf16_ps(acc[h], reinterpret_cast<const __m512bh&>(qv), reinterpret_cast<const __m512bh&>(kv));
      }
    }
    for (int h = 0; h < Heads; ++h) logits[h][t] = _mm512_reduce_add_ps(acc[h]);
  }
}
#endif

/// block_logits, or block_logits_bf16 on the unscaled bf16 query rows where the level has vdpbf16ps (bf16
/// storage, head_dim a multiple of 32, use_bf16_dot); those logits are then multiplied by `bf16_scale`, the
/// factor by which `q` (the fp32 query the other path reads) is scaled against the stored query.
template <SimdLevel L, int Heads, class T>
void block_logits_any(const float (*q)[kMaxHeadDim], const T* const* q_rows, const T* const* k_rows, int block, int d,
                      float (*logits)[kTokenBlock], const T* const* k_next, int next_block, bool use_bf16_dot,
                      float bf16_scale) {
#if KVSIFT_CPU_HAS_AVX512
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (use_bf16_dot && d % 32 == 0) {
      block_logits_bf16<Heads>(q_rows, k_rows, block, d, logits, k_next, next_block);
      if (bf16_scale != 1.0f) {
        for (int h = 0; h < Heads; ++h) {
          for (int t = 0; t < block; ++t) logits[h][t] *= bf16_scale;
        }
      }
      return;
    }
  }
#endif
  block_logits<L, Heads>(q, k_rows, block, d, logits, k_next, next_block);
}

/// acc[h] += sum_t p[h][t] * v_t over the block's rows, Heads heads at once. The accumulators of a slice of
/// kChunks vectors stay in registers across the whole block (one load and one store per block instead of
/// per row), and each loaded V vector feeds every head.
template <SimdLevel L, int Heads, class T>
void block_values(const float (*p)[kTokenBlock], const T* const* v_rows, int block, int d, float (*acc)[kMaxHeadDim],
                  const T* const* v_next, int next_block) {
  using Ops = Vec<L>;
  using V = typename Ops::V;
  constexpr int W = Ops::kWidth;
  constexpr int kChunks = std::clamp(kAccumulatorRegisters<L> / Heads, 1, 4);
  const int d_vec = d / W * W;
  int c0 = 0;
  const auto slice = [&]<int Chunks>() {
    V a[Heads][Chunks];
    for (int h = 0; h < Heads; ++h) {
      for (int j = 0; j < Chunks; ++j) a[h][j] = Ops::load(acc[h] + c0 + j * W);
    }
    const int prefetches = c0 == 0 ? next_block : 0;  // during the first slice's pass over the rows
    for (int t = 0; t < block; ++t) {
      if (t < prefetches) prefetch_row(v_next[t], d);
      V vv[Chunks];
      for (int j = 0; j < Chunks; ++j) vv[j] = Ops::load(v_rows[t] + c0 + j * W);
      for (int h = 0; h < Heads; ++h) {
        const V w = Ops::set1(p[h][t]);
        for (int j = 0; j < Chunks; ++j) a[h][j] = Ops::fma(w, vv[j], a[h][j]);
      }
    }
    for (int h = 0; h < Heads; ++h) {
      for (int j = 0; j < Chunks; ++j) Ops::store(acc[h] + c0 + j * W, a[h][j]);
    }
    c0 += Chunks * W;
  };
  while (c0 + kChunks * W <= d_vec) slice.template operator()<kChunks>();
  while (c0 < d_vec) slice.template operator()<1>();
  for (int c = d_vec; c < d; ++c) {
    for (int t = 0; t < block; ++t) {
      const float vc = Vec<SimdLevel::scalar>::load(v_rows[t] + c);
      for (int h = 0; h < Heads; ++h) acc[h][c] += p[h][t] * vc;
    }
  }
}

/// Calls fn.template operator()<Heads>() with the runtime head count as a template argument.
template <class Fn>
void with_heads(int heads, Fn&& fn) {
  [&]<int... H>(std::integer_sequence<int, H...>) {
    ((heads == H + 1 ? (fn.template operator()<H + 1>(), true) : false) || ...);
  }(std::make_integer_sequence<int, kHeadTile>{});
}

}  // namespace KVSIFT_CPU_ISA
using namespace KVSIFT_CPU_ISA;

template <SimdLevel L, class T, class KV, class TO>
void decode_items(const DecodeJob<T, KV, TO>& job, std::int64_t item_begin, std::int64_t item_end, bool use_bf16_dot) {
  using Ops = Vec<L>;
  using V = typename Ops::V;
  constexpr int W = Ops::kWidth;
  const int d = job.q.head_dim;
  const int d_vec = d / W * W;
  const float neg_inf = -std::numeric_limits<float>::infinity(), pos_inf = -neg_inf;

  alignas(64) float q[kHeadTile][kMaxHeadDim];
  alignas(64) float acc[kHeadTile][kMaxHeadDim];
  alignas(64) float logits[kHeadTile][kTokenBlock];
  float m[kHeadTile], l[kHeadTile];
  const T* k_rows[2][kTokenBlock];  // this block's rows and the next block's, alternating
  const T* v_rows[2][kTokenBlock];
  bool masked[2][kTokenBlock];      // a page's entry outside the middle: logit -inf, rows from zero_row
  alignas(64) static const T zero_row[kMaxHeadDim] = {};
  [[maybe_unused]] const T* q_rows[kHeadTile];  // the vdpbf16ps path reads the bf16 query directly

  for (std::int64_t item = item_begin; item < item_end; ++item) {
    const std::int64_t row = item / job.splits, chunk = item % job.splits;
    const std::int64_t b = row / job.kv.kv_heads, g = row % job.kv.kv_heads;
    const std::int32_t length = job.kv.seq_len(b);
    // The selection row this batch row attends (AttentionOptions::selection_rows); where the map names none, a bad
    // row, whose pointers stay those of row 0 and are not read.
    const std::int64_t mapped = job.selection.indices == nullptr
                                    ? b
                                    : attended_selection_row(job.selection_rows, b, job.selection.batch);
    const std::int64_t sb = std::max<std::int64_t>(mapped, 0);
    // Dense decode, or a selection row that attends every token (SelectionView::attend_all).
    const bool dense = job.selection.indices == nullptr ||
                       (mapped >= 0 && job.selection.attend_all != nullptr &&
                        job.selection.attend_all[job.selection.row_index(sb, g)] != 0);
    const std::int32_t selected = dense ? 0 : mapped < 0 ? -1 : job.selection.count(sb, g);
    // A count outside [0, capacity], or a row map that names no row, marks a bad row (SelectionView::counts):
    // nothing is read, and the states start at NaN, so every head of the row ends NaN in O and LSE (split chunks
    // too, which the merge keeps).
    const bool bad_row = !dense && (selected < 0 || selected > job.selection.capacity);
    const std::int32_t window = dense || bad_row ? 0 : job.window.size(length);  // entries before the selected ones
    // A page-level selection (job.page_size > 1) has page_size entries per page, its tokens in order; those of the
    // window or past the sequence are masked entries (no row read, logit -inf).
    const std::int32_t page_size = job.page_size;
    const std::int32_t row_count =
        dense ? length
              : bad_row ? 0
                        : std::int32_t(std::min<std::int64_t>(window + std::int64_t(selected) * page_size, INT32_MAX));
    const std::int32_t middle_begin = job.window.sink_end(length), middle_end = job.window.recent_begin(length);
    const std::int32_t chunk_size = (row_count + job.splits - 1) / job.splits;
    const std::int32_t first = std::int32_t(std::min<std::int64_t>(row_count, chunk * chunk_size));
    const std::int32_t count = std::min(row_count, first + chunk_size);  // this item covers entries [first, count)
    const std::int32_t* indices = dense ? nullptr : job.selection.row(sb, g);
    const float* log_weights = dense ? nullptr : job.selection.weights_row(sb, g);
    // Entry i's token, -1 for a masked entry of a page.
    const auto token = [&](std::int32_t i) -> std::int32_t {
      if (dense) return i;
      if (i < window) return job.window.token(i, length);
      if (page_size == 1) return indices[i - window];
      const std::int32_t j = i - window;
      const std::int64_t t = std::int64_t(indices[j / page_size]) * page_size + j % page_size;
      return t >= middle_begin && t < middle_end ? std::int32_t(t) : -1;
    };

    for (int h0 = 0; h0 < job.group; h0 += kHeadTile) {
      const int heads = std::min(kHeadTile, job.group - h0);
      const std::int64_t first_head = g * job.group + h0;
      for (int h = 0; h < heads; ++h) {
        const T* qh = job.q.row(b, first_head + h);
        q_rows[h] = qh;
        for (int c = 0; c < d; ++c) q[h][c] = Vec<SimdLevel::scalar>::load(qh + c) * job.scale_log2;
        std::fill_n(acc[h], d, 0.0f);
        m[h] = bad_row ? std::numeric_limits<float>::quiet_NaN() : neg_inf;
        l[h] = bad_row ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
      }

      // Selected rows are scattered, so hardware prefetchers cannot see them coming. Each pass over a block
      // (the logits over its K rows, the first slice of P.V over its V rows) prefetches the next block's
      // rows of the same kind, one row per row consumed: misses stay in flight while the block computes,
      // at a steady rate rather than in bursts that fill the miss queues and stall. The first block of an
      // item is requested at once.
      const auto fill = [&](int slot, std::int32_t from) {
        const int rows = std::max(0, std::min<std::int32_t>(kTokenBlock, count - from));
        for (int t = 0; t < rows; ++t) {
          const std::int32_t tok = token(from + t);
          masked[slot][t] = tok < 0;
          k_rows[slot][t] = tok < 0 ? zero_row : job.kv.k_row(b, g, tok);
          v_rows[slot][t] = tok < 0 ? zero_row : job.kv.v_row(b, g, tok);
        }
        return rows;
      };
      int slot = 0;
      int block = fill(slot, first);
      for (int t = 0; t < block; ++t) {
        prefetch_row(k_rows[slot][t], d);
        prefetch_row(v_rows[slot][t], d);
      }
      for (std::int32_t start = first; start < count; start += kTokenBlock, slot ^= 1) {
        const int next_block = fill(slot ^ 1, start + kTokenBlock);
        const T* const* k_cur = k_rows[slot];
        const T* const* k_next = k_rows[slot ^ 1];
        with_heads(heads, [&]<int Heads>() {
          block_logits_any<L, Heads>(q, q_rows, k_cur, block, d, logits, k_next, next_block, use_bf16_dot,
                                     job.scale_log2);
        });
        if (log_weights != nullptr) {  // the selected entries' (window entries have none), one per page
          for (int h = 0; h < heads; ++h) {
            for (int t = std::max(0, window - start); t < block; ++t) {
              logits[h][t] += log_weights[(start + t - window) / page_size] * kLog2e;
            }
          }
        }
        if (page_size > 1) {
          for (int t = 0; t < block; ++t) {
            if (!masked[slot][t]) continue;
            for (int h = 0; h < heads; ++h) logits[h][t] = neg_inf;
          }
        }
        const int block_padded = (block + W - 1) / W * W;
        for (int h = 0; h < heads; ++h) {
          for (int t = block; t < block_padded; ++t) logits[h][t] = neg_inf;
          float block_max = neg_inf;
          for (int t = 0; t < block; ++t) block_max = max_nan(block_max, logits[h][t]);
          const float m_new = max_nan(m[h], block_max);
          if (m_new == neg_inf || !(m_new < pos_inf)) {
            // Nothing attended yet (weights of this block are all 0), or a NaN or +inf logit, which makes the
            // head's state NaN for good (attention/state.hpp): the max stays NaN in every later block.
            if (m_new != neg_inf) m[h] = l[h] = m_new - m_new;
            std::fill_n(logits[h], block_padded, 0.0f);
            continue;
          }
          const float correction = std::exp2(m[h] - m_new);  // 0 when m[h] = -inf
          l[h] *= correction;
          const V corr = Ops::set1(correction);
          for (int c = 0; c < d_vec; c += W) Ops::store(acc[h] + c, Ops::mul(Ops::load(acc[h] + c), corr));
          for (int c = d_vec; c < d; ++c) acc[h][c] *= correction;
          const V shift = Ops::set1(m_new);
          V sum = Ops::zero();
          for (int t = 0; t < block_padded; t += W) {
            const V p = Ops::exp2(Ops::sub(Ops::load(logits[h] + t), shift));
            Ops::store(logits[h] + t, p);
            sum = Ops::add(p, sum);
          }
          l[h] += Ops::reduce_sum(sum);
          m[h] = m_new;
        }
        with_heads(heads, [&]<int Heads>() {
          block_values<L, Heads>(logits, v_rows[slot], block, d, acc, v_rows[slot ^ 1], next_block);
        });
        block = next_block;
      }

      for (int h = 0; h < heads; ++h) {
        // l is 0 only for an empty head (the largest logit contributes 1), NaN for a corrupted one.
        const bool empty = l[h] == 0.0f;
        const float inv = empty ? 0.0f : 1.0f / l[h];
        const float lse = empty ? neg_inf : (m[h] + std::log2(l[h])) * kLn2;
        if (job.splits == 1) {
          TO* o = job.out.o_row(b, first_head + h);
          for (int c = 0; c < d; ++c) o[c] = store_as<L, TO>(empty ? 0.0f : acc[h][c] * inv);
          job.out.lse_at(b, first_head + h) = lse;
        } else {
          const std::int64_t state = (chunk * job.q.batch + b) * job.q.heads + first_head + h;
          for (int c = 0; c < d; ++c) job.partial_o[state * d + c] = acc[h][c] * inv;
          job.partial_lse[state] = lse;
        }
      }
    }
  }
}

}  // namespace kvsift::cpu::detail
