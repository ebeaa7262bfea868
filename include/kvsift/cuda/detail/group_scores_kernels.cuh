#pragma once
/// cuda::group_scores (cuda/primitives.hpp): its parameters and launcher, which src/cuda/group_scores.cpp
/// (host compiler) calls, and, for nvcc only, the two kernels behind it (instantiated in kernels/group_scores.cu).
///
/// Pass 1, group_logits_kernel: a CTA owns one (sequence, kv head) row and one fixed chunk of
/// kGroupScoreChunk of its tokens; its warps take interleaved steps of kDecodeRowsPerStep key rows, each
/// streamed through the warp's own cp.async pipeline in shared memory with the decode kernel's helpers
/// (decode_kernels.cuh: the same 16-byte copies, swizzle, ldmatrix and m16n8k16 MMA). The tile's up to
/// kHeadsPerTile query heads are the 16 rows of the MMA's A operand, so one read of a key row scores the whole
/// tile; larger groups loop over tiles in the CTA, reading the chunk's keys again per tile. fp16/bf16 keys use
/// tensor cores (products exact in fp32, fp32 accumulation); fp32 keys, which tensor cores would round to tf32,
/// use fp32 FMAs into the same fragment layout, so that everything after the logits is written once.
///   raw: the heads' scaled logits reduced (max keeping NaN, or sum) across the fragment's lanes and into the
///        earlier tiles' result in the scores row;
///   softmax: the scaled logits to the workspace, and per (row, head, chunk) the largest logit and the sum of
///        exp(logit - largest), merged over the CTA's warps in warp order.
/// Pass 2 (softmax only), group_softmax_kernel: per (row, chunk) CTA, every head's LSE from the row's chunk
/// partials (a warp per head, lanes over chunks, fixed shuffle trees: every CTA of a row computes the same
/// bits), then per token the heads' exp(logit - LSE) reduced in head order.
/// The chunking and every reduction order are fixed, so results are bit-identical run to run and do not
/// depend on the GPU's size; nothing uses atomics.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

/// Tokens of one row that one CTA scores (both passes). Fixed, because each chunk's softmax partials are
/// merged in a fixed order. 1024: a 128K-token row gives 128 CTAs (8 kv heads: 1024 CTAs, two waves of four
/// per SM on an H100), a 32K one 32.
inline constexpr std::int32_t kGroupScoreChunk = 1024;
inline constexpr int kGroupScoreWarps = 4;
inline constexpr int kGroupSoftmaxThreads = 256;
/// Largest GQA group whose LSEs pass 2 holds in shared memory (48 KB, the limit without an opt-in).
inline constexpr std::int32_t kGroupScoreMaxGroup = 12288;

/// Pipeline stages per warp: three (two copies in flight while one is consumed); two for fp32 keys at
/// head_dim 256, whose three stages (192 KB per CTA) would not fit an sm_80 block.
constexpr int group_score_stages(int head_dim, int element_bytes) { return head_dim * element_bytes > 512 ? 2 : 3; }
/// Dynamic shared memory of a pass-1 CTA: the warps' pipelines of 16 key rows per stage.
constexpr std::size_t group_score_shared_bytes(int head_dim, int element_bytes) {
  return std::size_t(kGroupScoreWarps) * group_score_stages(head_dim, element_bytes) * 16 * head_dim * element_bytes;
}

template <class T, class KV>
struct GroupScoreParams {
  QueryView<const T> q;
  KV kv;                        ///< ContiguousKVView<const T> or PagedKVView<const T>; V is never read
  MatrixView<float> scores;     ///< [batch * kv_heads * (group / heads_per_row), cols]
  std::int32_t group = 1;       ///< q_heads / kv_heads
  std::int32_t heads_per_row = 1;  ///< softmax: heads reduced into each score row (the group, or a divisor)
  std::int32_t head_tiles = 1;  ///< ceil(group / kHeadsPerTile)
  std::int32_t chunks = 1;      ///< ceil(scores.cols / kGroupScoreChunk): CTAs per row
  float scale = 1.0f;           ///< resolved sm_scale
  bool sum = false;             ///< reduce over the group by sum (else max)
  bool softmax = false;
  float* logits = nullptr;        ///< softmax: [rows, group, logit_stride] scaled logits (natural units)
  std::int64_t logit_stride = 0;  ///< scores.cols rounded up to 4 floats (aligned pair stores)
  float* chunk_max = nullptr;     ///< softmax: [rows, chunks, group]
  float* chunk_sum = nullptr;     ///< softmax: [rows, chunks, group]: sum of exp(logit - chunk_max)

  /// Tokens of sequence b scored: its length, read on the device, kept within [0, scores.cols] (and a
  /// contiguous cache's capacity), so that a length the host could not check never reads past the cache or
  /// writes past the scores and the workspace.
  KVSIFT_HOST_DEVICE std::int32_t length(std::int64_t b) const {
    std::int32_t n = kv.seq_len(b);
    if constexpr (requires { kv.capacity; }) n = n < kv.capacity ? n : kv.capacity;
    return n < 0 ? 0 : n < scores.cols ? n : scores.cols;
  }
};

/// Launches pass 1, and pass 2 when p.softmax, on `stream`. Returns the launch status, never throws.
template <class T, class KV>
cudaError_t launch_group_scores(const GroupScoreParams<T, KV>& p, cudaStream_t stream);

// The (type, cache) list both backends are built for, written once (core/group_scores_options.hpp).
#define KVSIFT_CUDA_GROUP_SCORES_EXTERN(T, KV) \
  extern template cudaError_t launch_group_scores<T, KV>(const GroupScoreParams<T, KV>&, cudaStream_t);
KVSIFT_GROUP_SCORE_TYPES(KVSIFT_CUDA_GROUP_SCORES_EXTERN)
#undef KVSIFT_CUDA_GROUP_SCORES_EXTERN

}  // namespace kvsift::cuda::detail

// The kernels: device code, seen by nvcc only, so that the host entry point can include the declarations above.
#if defined(__CUDACC__)

#include <cuda_runtime.h>

#include <limits>
#include <type_traits>

#include "kvsift/attention/state.hpp"
#include "kvsift/cuda/detail/decode_kernels.cuh"

namespace kvsift::cuda::detail {

template <class T>
__device__ __forceinline__ const T* key_base(const ContiguousKVView<const T>& kv) {
  return kv.k;
}
template <class T>
__device__ __forceinline__ const T* key_base(const PagedKVView<const T>& kv) {
  return kv.k_pages;
}

/// Tokens [first, last) of chunk `chunk` of a row of `length` tokens; empty past the row's end.
__device__ __forceinline__ int2 group_chunk_tokens(std::int64_t chunk, int length) {
  const std::int64_t start = chunk * kGroupScoreChunk;
  const int first = start < length ? int(start) : length;
  return make_int2(first, min(length, first + kGroupScoreChunk));
}

/// The fp32-key logits of one step into the MMA's C-fragment layout (s[nt][2h + e]: head frag_row + 8h of the
/// tile against row nt * 8 + frag_col + e of the step), by FMAs over the swizzled tile; a null query row
/// (a head past the group) gives 0.
template <int HeadDim>
__device__ __forceinline__ void fp32_step_logits(float (&s)[2][4], const unsigned char* tile, const float* const* q_rows,
                                                 int frag_col) {
  constexpr int kPieces = HeadDim / 4, kSwizzleWidth = 2 * HeadDim;  // a row of HeadDim floats, in 2-byte units
#pragma unroll 4
  for (int piece = 0; piece < kPieces; ++piece) {
    float4 k[2][2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        k[nt][e] = *reinterpret_cast<const float4*>(tile + swizzled<kSwizzleWidth>(nt * 8 + frag_col + e, piece));
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float4 q = q_rows[h] != nullptr ? *reinterpret_cast<const float4*>(q_rows[h] + 4 * piece)
                                            : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& acc = s[nt][2 * h + e];
          acc = fmaf(q.x, k[nt][e].x, acc);
          acc = fmaf(q.y, k[nt][e].y, acc);
          acc = fmaf(q.z, k[nt][e].z, acc);
          acc = fmaf(q.w, k[nt][e].w, acc);
        }
      }
    }
  }
}

template <int HeadDim, class T, class KV>
__global__ void __launch_bounds__(32 * kGroupScoreWarps)
    group_logits_kernel(const __grid_constant__ GroupScoreParams<T, KV> p) {
  constexpr bool kFp32 = std::is_same_v<T, float>;
  constexpr int kWarps = kGroupScoreWarps, kRows = kDecodeRowsPerStep;
  constexpr int kStages = group_score_stages(HeadDim, int(sizeof(T)));
  constexpr int kPieces = HeadDim * int(sizeof(T)) / 16;       ///< 16-byte pieces of one key row
  constexpr int kSwizzleWidth = HeadDim * int(sizeof(T)) / 2;  ///< the row's width in 2-byte units
  constexpr unsigned kStageBytes = unsigned(kRows * HeadDim * sizeof(T));
  constexpr int kKSteps = HeadDim / 16;
  static_assert(kRows == 16 && (kRows * kPieces) % 32 == 0, "a step is two 8-row n-tiles; copies fill whole warps");
  const float neg_inf = negative_infinity<float>(), pos_inf = -neg_inf;

  extern __shared__ uint4 smem[];
  __shared__ float s_m[kWarps][kHeadsPerTile], s_l[kWarps][kHeadsPerTile];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int frag_row = lane / 4, frag_col = 2 * (lane % 4);  // this lane's place in MMA fragments
  const std::int64_t chunk = blockIdx.x % unsigned(p.chunks), row = blockIdx.x / unsigned(p.chunks);
  const std::int64_t b = row / p.kv.kv_heads, g = row % p.kv.kv_heads;
  const int2 range = group_chunk_tokens(chunk, p.length(b));
  const int first = range.x, last = range.y;
  if (first == last) return;  // the whole CTA: the chunk is past the row's end

  const int steps = (last - first + kRows - 1) / kRows;  // the chunk's steps, dealt to the warps in turn
  const int warp_steps = warp < steps ? (steps - warp + kWarps - 1) / kWarps : 0;
  const auto step_start = [&](int j) { return first + (j * kWarps + warp) * kRows; };
  const unsigned warp_smem = shared_address(smem) + unsigned(warp) * kStages * kStageBytes;
  const auto* warp_tiles = reinterpret_cast<const unsigned char*>(smem) + std::size_t(warp) * kStages * kStageBytes;
  const T* const k_base = key_base(p.kv);

  // Step j's 16 key rows into stage j % kStages: lane r (and r + 16) finds row r's offset, and the warp copies
  // the rows' 16-byte pieces, 8 lanes per 128-byte line. Rows past the chunk are zero-filled.
  const auto issue = [&](int j) {
    const unsigned stage = warp_smem + unsigned(j % kStages) * kStageBytes;
    const int token = step_start(j) + lane % kRows;
    const long long offset = token < last ? static_cast<long long>(p.kv.offset(b, g, token)) : -1;
#pragma unroll
    for (int i = lane; i < kRows * kPieces; i += 32) {
      const int r = i / kPieces, piece = i % kPieces;
      const long long row_offset = __shfl_sync(0xffffffffu, offset, r);
      const bool valid = row_offset >= 0;
      const auto* source = reinterpret_cast<const unsigned char*>(k_base + (valid ? row_offset : 0)) + piece * 16;
      cp_async16(stage + swizzled<kSwizzleWidth>(r, piece), source, valid);
    }
  };

  const std::int64_t partial_base = (row * p.chunks + chunk) * p.group;
  for (int tile = 0; tile < p.head_tiles; ++tile) {
    const int first_head = tile * kHeadsPerTile;
    // The two query heads of the tile this lane's fragments hold: frag_row and frag_row + 8 (null past the group).
    const T* q_rows[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int head = first_head + frag_row + 8 * h;
      q_rows[h] = head < p.group ? p.q.row(b, g * p.group + head) : nullptr;
    }
    [[maybe_unused]] unsigned q_frag[kKSteps][4];
    if constexpr (!kFp32) {
      // A fragments (rows frag_row and frag_row + 8 of the 16-row tile), as decode_attention_kernel loads them.
      const auto q_pair = [&](int h, int channel) -> unsigned {
        return q_rows[h] != nullptr ? *reinterpret_cast<const unsigned*>(q_rows[h] + channel) : 0u;
      };
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        q_frag[ks][0] = q_pair(0, 16 * ks + frag_col);
        q_frag[ks][1] = q_pair(1, 16 * ks + frag_col);
        q_frag[ks][2] = q_pair(0, 16 * ks + frag_col + 8);
        q_frag[ks][3] = q_pair(1, 16 * ks + frag_col + 8);
      }
    }
    // Softmax: this warp's running maximum of each of the lane's two heads, and the lane's share of the sum.
    float m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};

    __syncwarp();  // the previous tile's last reads of the stages are done before they are refilled
#pragma unroll
    for (int j = 0; j < kStages - 1; ++j) {
      if (j < warp_steps) issue(j);
      cp_async_commit();
    }
    for (int j = 0; j < warp_steps; ++j) {
      __syncwarp();  // every lane is done reading the stage that the next copies overwrite
      if (j + kStages - 1 < warp_steps) issue(j + kStages - 1);
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      __syncwarp();  // this step's copies, made by all lanes, are visible to the whole warp
      const int stage = j % kStages;

      float s[2][4] = {};
      if constexpr (kFp32) {
        fp32_step_logits<HeadDim>(s, warp_tiles + stage * kStageBytes, q_rows, frag_col);
      } else {
        const unsigned k_tile = warp_smem + unsigned(stage) * kStageBytes;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int ks = 0; ks < kKSteps; ks += 2) {
            unsigned k_frag[4];
            ldmatrix_x4(k_frag, k_tile + swizzled<HeadDim>(nt * 8 + (lane & 7), 2 * ks + (lane >> 3)));
            mma_16x8x16<T>(s[nt], q_frag[ks], k_frag[0], k_frag[1]);
            mma_16x8x16<T>(s[nt], q_frag[ks + 1], k_frag[2], k_frag[3]);
          }
        }
      }
      const int start = step_start(j);
      if (!p.softmax) {
        // Raw: the lane's two heads, then the other lanes of its column (xor 4, 8, 16 reach all 8 frag_rows),
        // then the earlier tiles' result, which this same lane wrote.
        float* out = p.scores.row(row);
        const float identity = p.sum ? 0.0f : neg_inf;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x0 = q_rows[0] != nullptr ? s[nt][e] * p.scale : identity;
            const float x1 = q_rows[1] != nullptr ? s[nt][2 + e] * p.scale : identity;
            float v = p.sum ? x0 + x1 : max_nan(x0, x1);
#pragma unroll
            for (int offset = 4; offset < 32; offset *= 2) {
              const float other = __shfl_xor_sync(0xffffffffu, v, offset);
              v = p.sum ? v + other : max_nan(v, other);
            }
            const int t = start + nt * 8 + frag_col + e;
            if (frag_row == 0 && t < last) out[t] = tile == 0 ? v : p.sum ? out[t] + v : max_nan(out[t], v);
          }
        }
        continue;
      }
      // Softmax: scaled logits out (rows past the chunk become -inf and are not written), then the online
      // maximum and sum in natural units, as the CPU twin keeps them.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float step_max = neg_inf;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int t = start + nt * 8 + frag_col;
          float& x0 = s[nt][2 * h];
          float& x1 = s[nt][2 * h + 1];
          x0 = t < last ? x0 * p.scale : neg_inf;
          x1 = t + 1 < last ? x1 * p.scale : neg_inf;
          if (q_rows[h] != nullptr && t < last) {
            float* dst = p.logits + (row * p.group + first_head + frag_row + 8 * h) * p.logit_stride + t;
            if (t + 1 < last) {
              *reinterpret_cast<float2*>(dst) = make_float2(x0, x1);  // t is even, the stride a multiple of 4
            } else {
              *dst = x0;
            }
          }
          step_max = max_nan(step_max, max_nan(x0, x1));
        }
        step_max = max_nan(step_max, __shfl_xor_sync(0xffffffffu, step_max, 1));
        step_max = max_nan(step_max, __shfl_xor_sync(0xffffffffu, step_max, 2));
        const float m_new = max_nan(m[h], step_max);
        if (m_new == neg_inf) continue;  // every logit so far is -inf: nothing to sum yet
        if (!(m_new < pos_inf)) {        // a NaN or +inf logit: this head's softmax is NaN for good
          m[h] = l[h] = m_new - m_new;
          continue;
        }
        float sum = l[h] * exp2f((m[h] - m_new) * kLog2e);  // m[h] = -inf: 0
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          sum += exp2f((s[nt][2 * h] - m_new) * kLog2e);
          sum += exp2f((s[nt][2 * h + 1] - m_new) * kLog2e);
        }
        l[h] = sum;
        m[h] = m_new;
      }
    }
    cp_async_wait<0>();
    if (!p.softmax) continue;

    // The chunk's partials of the tile's heads: each quad's shares summed, then the warps merged in order.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
      if (lane % 4 == 0) {
        s_m[warp][frag_row + 8 * h] = m[h];
        s_l[warp][frag_row + 8 * h] = l[h];
      }
    }
    __syncthreads();
    const int head = int(threadIdx.x);
    if (head < kHeadsPerTile && first_head + head < p.group) {
      float chunk_max = neg_inf;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) chunk_max = max_nan(chunk_max, s_m[w][head]);
      float chunk_sum = 0.0f;
      if (!(chunk_max < pos_inf)) {
        chunk_sum = chunk_max - chunk_max;  // NaN: chunk_max is NaN or +inf
      } else if (chunk_max != neg_inf) {
#pragma unroll
        for (int w = 0; w < kWarps; ++w) chunk_sum += s_l[w][head] * exp2f((s_m[w][head] - chunk_max) * kLog2e);
      }
      p.chunk_max[partial_base + first_head + head] = chunk_max;
      p.chunk_sum[partial_base + first_head + head] = chunk_sum;
    }
    __syncthreads();  // s_m and s_l are read before the next tile writes them
  }
}

template <class T, class KV>
__global__ void __launch_bounds__(kGroupSoftmaxThreads)
    group_softmax_kernel(const __grid_constant__ GroupScoreParams<T, KV> p) {
  extern __shared__ float s_lse[];  // [group]
  constexpr int kWarps = kGroupSoftmaxThreads / 32;
  const float neg_inf = negative_infinity<float>();
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const std::int64_t chunk = blockIdx.x % unsigned(p.chunks), row = blockIdx.x / unsigned(p.chunks);
  const int length = p.length(row / p.kv.kv_heads);
  const int2 range = group_chunk_tokens(chunk, length);
  const int first = range.x, last = range.y;
  if (first == last) return;  // the whole CTA

  // Each head's LSE from the row's chunk partials: a warp per head, lanes over the chunks, shuffle trees.
  const int row_chunks = (length + kGroupScoreChunk - 1) / kGroupScoreChunk;
  const float* chunk_max = p.chunk_max + row * p.chunks * p.group;
  const float* chunk_sum = p.chunk_sum + row * p.chunks * p.group;
  for (int h = warp; h < p.group; h += kWarps) {
    float m = neg_inf;
    for (int c = lane; c < row_chunks; c += 32) m = max_nan(m, chunk_max[c * p.group + h]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, offset));
    float lse = std::numeric_limits<float>::quiet_NaN();  // unless the head's largest logit is finite
    if (m > neg_inf && m < -neg_inf) {                      // the same in every lane
      float sum = 0.0f;  // >= 1: the chunk holding the maximum contributes exp(0) = 1 to its own sum
      for (int c = lane; c < row_chunks; c += 32) {
        sum += chunk_sum[c * p.group + h] * exp2f((chunk_max[c * p.group + h] - m) * kLog2e);
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
      lse = m + logf(sum);
    }
    if (lane == 0) s_lse[h] = lse;
  }
  __syncthreads();  // every head's LSE in s_lse

  // The heads in sets of heads_per_row, each reduced into its own score row. NaN never vanishes: a head without
  // a softmax makes its set's whole row NaN. A thread takes kTokens tokens of the chunk, kGroupSoftmaxThreads apart:
  // a head's logits of all of them are independent loads issued together, and no store comes before the set's last
  // head (one token at a time, each head's load waited, and the next token's loads could not pass the store before
  // them: the scores may alias the logits as far as the compiler knows). Per token the same operations in the same
  // head order as one at a time: the same bits.
  constexpr int kTokens = kGroupScoreChunk / kGroupSoftmaxThreads;
  static_assert(kTokens * kGroupSoftmaxThreads == kGroupScoreChunk, "one pass of the threads covers a chunk");
  const int per = p.heads_per_row, sets = p.group / per;
  const int t0 = first + int(threadIdx.x);
  for (int set = 0; set < sets; ++set) {
    bool set_finite = true;
    for (int h = set * per; h < (set + 1) * per; ++h) set_finite = set_finite && isfinite(s_lse[h]);
    // Sum: the heads' weights in head order. Max: the largest logit - LSE, then one exp (exp is increasing).
    float acc[kTokens];
#pragma unroll
    for (int u = 0; u < kTokens; ++u) acc[u] = p.sum ? 0.0f : neg_inf;
    for (int h = set * per; set_finite && h < (set + 1) * per; ++h) {
      const float* logits = p.logits + (row * p.group + h) * p.logit_stride;
      float x[kTokens];
#pragma unroll
      for (int u = 0; u < kTokens; ++u) {
        const int t = t0 + u * kGroupSoftmaxThreads;
        x[u] = t < last ? logits[t] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kTokens; ++u) {
        const float v = x[u] - s_lse[h];
        acc[u] = p.sum ? acc[u] + exp2f(v * kLog2e) : fmaxf(acc[u], v);
      }
    }
    float* out = p.scores.row(row * sets + set);
#pragma unroll
    for (int u = 0; u < kTokens; ++u) {
      const int t = t0 + u * kGroupSoftmaxThreads;
      if (t < last) {
        out[t] = !set_finite ? std::numeric_limits<float>::quiet_NaN() : p.sum ? acc[u] : exp2f(acc[u] * kLog2e);
      }
    }
  }
}

template <class T, class KV>
cudaError_t launch_group_scores(const GroupScoreParams<T, KV>& p, cudaStream_t stream) {
  const unsigned ctas = unsigned(std::int64_t(p.kv.batch) * p.kv.kv_heads * p.chunks);
  cudaError_t status = cudaErrorInvalidValue;  // an unsupported head_dim (the host refuses it before)
  dispatch_value<kCudaAttentionHeadDims>(p.q.head_dim, [&]<int HeadDim>() {
    constexpr std::size_t smem = group_score_shared_bytes(HeadDim, int(sizeof(T)));
    constexpr auto kernel = group_logits_kernel<HeadDim, T, KV>;
    status = open_shared_memory<kernel>();
    if (status != cudaSuccess) return;
    kernel<<<ctas, 32 * kGroupScoreWarps, smem, stream>>>(p);
    status = cudaGetLastError();
  });
  if (status != cudaSuccess || !p.softmax) return status;
  // The heads' LSEs, in whole 16-byte words: the compiler may read s_lse with vector loads.
  const std::size_t lse_bytes = (std::size_t(p.group) * sizeof(float) + 15) / 16 * 16;
  group_softmax_kernel<T, KV><<<ctas, kGroupSoftmaxThreads, lse_bytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvsift::cuda::detail

#endif  // defined(__CUDACC__)
