#pragma once
/// The CPU decode-attention kernel body, written once for every SimdLevel (see vec-inl.hpp). One call
/// handles a range of (sequence, kv head) rows; each K/V row is read once for every query head of the GQA
/// group (in tiles of kHeadTile heads). Logits are kept in base 2; tokens go in blocks of kTokenBlock:
/// logits of the block, one online-softmax rescale per head, then V streamed through the accumulators.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kvsift/core/views.hpp"
#include "kvsift/cpu/detail/decode_kernels.hpp"
#include "kvsift/cpu/detail/vec-inl.hpp"

namespace kvsift::cpu::detail {

inline constexpr int kPrefetchTokens = 16;

template <class T>
inline void prefetch_row(const T* row, int d) {
  const char* p = reinterpret_cast<const char*>(row);
  // Into L2 (prefetcht1): the L2 miss queue keeps more rows in flight than the L1 fill buffers (measured).
  for (int offset = 0; offset < d * int(sizeof(T)); offset += 64) __builtin_prefetch(p + offset, 0, 2);
}

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

#if defined(__AVX512BF16__)
/// bf16 x bf16 products are exact in fp32, so vdpbf16ps on the unscaled bf16 query loses nothing.
inline float dot_bf16_avx512(const bfloat16* q, const bfloat16* k, int d) {
  __m512 acc = _mm512_setzero_ps();
  int c = 0;
  for (; c + 32 <= d; c += 32) {
    const __m512i qv = _mm512_loadu_si512(q + c), kv = _mm512_loadu_si512(k + c);
    acc = _mm512_dpbf16_ps(acc, reinterpret_cast<const __m512bh&>(qv), reinterpret_cast<const __m512bh&>(kv));
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; c < d; ++c) sum += Vec<SimdLevel::scalar>::load(q + c) * Vec<SimdLevel::scalar>::load(k + c);
  return sum;
}
#endif

template <SimdLevel L, class T, class KV>
void decode_rows(const DecodeJob<T, KV>& job, std::int64_t row_begin, std::int64_t row_end, bool use_bf16_dot) {
  using Ops = Vec<L>;
  using V = typename Ops::V;
  constexpr int W = Ops::kWidth;
  const int d = job.q.head_dim;
  const int d_vec = d / W * W;
  const bool dense = job.selection.indices == nullptr;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  alignas(64) float q[kHeadTile][kMaxHeadDim];
  alignas(64) float acc[kHeadTile][kMaxHeadDim];
  alignas(64) float logits[kHeadTile][kTokenBlock];
  float m[kHeadTile], l[kHeadTile];

  for (std::int64_t row = row_begin; row < row_end; ++row) {
    const std::int64_t b = row / job.kv.kv_heads, g = row % job.kv.kv_heads;
    const std::int32_t count = dense ? job.kv.seq_len(b) : job.selection.count(b, g);
    const std::int32_t* indices = dense ? nullptr : job.selection.row(b, g);
    const float* log_weights = dense ? nullptr : job.selection.weights_row(b, g);
    const auto token = [&](std::int32_t i) { return dense ? i : indices[i]; };

    for (int h0 = 0; h0 < job.group; h0 += kHeadTile) {
      const int heads = std::min(kHeadTile, job.group - h0);
      const std::int64_t first_head = g * job.group + h0;
      for (int h = 0; h < heads; ++h) {
        const T* qh = job.q.row(b, first_head + h);
        for (int c = 0; c < d; ++c) q[h][c] = Vec<SimdLevel::scalar>::load(qh + c) * job.scale_log2;
        std::fill_n(acc[h], d, 0.0f);
        m[h] = neg_inf;
        l[h] = 0.0f;
      }

      for (std::int32_t start = 0; start < count; start += kTokenBlock) {
        const int block = std::min<std::int32_t>(kTokenBlock, count - start);
        for (int t = 0; t < block; ++t) {
          // Selected rows are scattered, so hardware prefetchers cannot see them coming: request the K and V
          // rows kPrefetchTokens ahead, keeping many misses in flight instead of one or two.
          if (start + t + kPrefetchTokens < count) {
            const std::int32_t ahead = token(start + t + kPrefetchTokens);
            prefetch_row(job.kv.k_row(b, g, ahead), d);
            prefetch_row(job.kv.v_row(b, g, ahead), d);
          }
          const T* k = job.kv.k_row(b, g, token(start + t));
          const float bias = log_weights ? log_weights[start + t] * kLog2e : 0.0f;
          for (int h = 0; h < heads; ++h) {
            float s;
#if defined(__AVX512BF16__)
            if constexpr (std::is_same_v<T, bfloat16>) {
              s = use_bf16_dot ? dot_bf16_avx512(job.q.row(b, first_head + h), k, d) * job.scale_log2
                               : dot<L>(q[h], k, d);
            } else {
              s = dot<L>(q[h], k, d);
            }
#else
            s = dot<L>(q[h], k, d);
#endif
            logits[h][t] = s + bias;
          }
        }
        const int block_padded = (block + W - 1) / W * W;
        for (int h = 0; h < heads; ++h) {
          for (int t = block; t < block_padded; ++t) logits[h][t] = neg_inf;
          float block_max = neg_inf;
          for (int t = 0; t < block; ++t) block_max = std::max(block_max, logits[h][t]);
          const float m_new = std::max(m[h], block_max);
          if (m_new == neg_inf) {  // nothing attended yet: weights of this block are all 0
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
        for (int t = 0; t < block; ++t) {
          const T* v = job.kv.v_row(b, g, token(start + t));
          for (int c = 0; c < d_vec; c += W) {
            const V vv = Ops::load(v + c);
            for (int h = 0; h < heads; ++h) Ops::store(acc[h] + c, Ops::fma(Ops::set1(logits[h][t]), vv, Ops::load(acc[h] + c)));
          }
          for (int c = d_vec; c < d; ++c) {
            const float vc = Vec<SimdLevel::scalar>::load(v + c);
            for (int h = 0; h < heads; ++h) acc[h][c] += logits[h][t] * vc;
          }
        }
      }

      for (int h = 0; h < heads; ++h) {
        T* o = job.out.o_row(b, first_head + h);
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int c = 0; c < d; ++c) o[c] = store_as<L, T>(acc[h][c] * inv);
        job.out.lse_at(b, first_head + h) = l[h] > 0.0f ? (m[h] + std::log2(l[h])) * kLn2 : neg_inf;
      }
    }
  }
}

}  // namespace kvsift::cpu::detail
