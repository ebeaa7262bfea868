// Codebook quantization, lookup tables and code scan on CUDA (selectors/a2ats/cuda/vq.hpp). The lookup-table entries of the
// two-launch and the fused forms come from one device function (same FMAs in the same order), so the fused
// scores equal vq_lut then vq_code_scan bit for bit; the scan itself only copies table entries. vq_topk_rows' fused
// form feeds topk_rows' one-CTA and held kernels words made from the codes and vq_lut's tables (VqWords).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/detail/topk_words_launch.cuh"
#include "kvsift/cuda/dtype.cuh"
#include "kvsift/selectors/a2ats/cuda/detail/vq_launch.hpp"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;

using kvsift::detail::vq_destination;
using kvsift::detail::vq_scan_length;

__device__ __forceinline__ float vq_nan() { return __int_as_float(0x7fc00000); }

/// A score of codeword `code`: head h's table entry, or with group_max the group's maximum over its heads
/// (vq_group_max in head order, as the CPU's scan reduces it). table(h, code) reads an entry. The one definition the
/// scan, VqWords and the count select share.
template <class Table>
__device__ __forceinline__ float vq_entry(const Table& table, bool group_max, std::int32_t group, std::int32_t h,
                                          std::int32_t code) {
  if (!group_max) return table(h, code);
  float m = table(0, code);
  for (std::int32_t u = 1; u < group; ++u) m = kvsift::detail::vq_group_max(m, table(u, code));
  return m;
}

/// Eight consecutive elements as fp32 (16-byte aligned for 2-byte types, 32-byte aligned for float).
__device__ __forceinline__ void load8(const float* p, float* x) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
template <class T>
__device__ __forceinline__ void load8(const T* p, float* x) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = to_float_device(T{std::uint16_t(words[i] & 0xffffu)});
    x[2 * i + 1] = to_float_device(T{std::uint16_t(words[i] >> 16)});
  }
}

/// out[h * out_stride + c] = q_h . C_c for the group's heads h < group (queries q_s [group, D] fp32 in shared
/// memory) and codewords c in [begin, end), one thread per codeword; ascending-j FMAs, four heads per pass.
template <class T, int D>
__device__ void lut_entries(const float* q_s, std::int32_t group, const T* head_codewords, std::int32_t begin,
                            std::int32_t end, float* out, std::int64_t out_stride) {
  for (std::int32_t c = begin + std::int32_t(threadIdx.x); c < end; c += blockDim.x) {
    const T* w = head_codewords + std::int64_t(c) * D;
    for (std::int32_t h0 = 0; h0 < group; h0 += 4) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const float* qh[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) qh[u] = q_s + std::int64_t(h0 + u < group ? h0 + u : h0) * D;
#pragma unroll 4
      for (int j = 0; j < D; j += 8) {
        float x[8];
        load8(w + j, x);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[u] = fmaf(qh[u][j + e], x[e], acc[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (h0 + u < group) out[(h0 + u) * out_stride + c] = acc[u];
      }
    }
  }
}

/// The group's queries of sequence b, kv head g into q_s [group, D] as fp32.
template <class T, int D>
__device__ void load_group_queries(const QueryView<const T>& q, std::int32_t b, std::int32_t g, std::int32_t group,
                                   float* q_s) {
  for (std::int32_t i = threadIdx.x; i < group * D; i += blockDim.x) {
    q_s[i] = to_float_device(q.row(b, std::int64_t(g) * group + i / D)[i % D]);
  }
}

/// This block's share (part of parts) of the tokens of (sequence b, kv head g): each code read once, written to the
/// group's score rows through table(h, code), or with group_max their maximum (vq_group_max in head order) to the
/// kv head's one row.
template <class Table>
__device__ void scan_tokens(const Table& table, std::int32_t codewords, std::int32_t b, std::int32_t g,
                            std::int32_t group, const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots,
                            const std::int32_t* lengths, const MatrixView<float>& scores, bool group_max,
                            std::int32_t part, std::int32_t parts) {
  const std::int32_t n = vq_scan_length(lengths[b], scores.cols, codes.max_tokens);
  const std::int32_t slot = slots[b];
  const bool valid = slot >= 0 && slot < codes.slots;
  const std::uint16_t* row = valid ? codes.row(slot, g) : nullptr;
  const std::int64_t kv_row = std::int64_t(b) * codes.kv_heads + g;
  float* out = scores.row(group_max ? kv_row : kv_row * group);
  const std::int64_t stride = std::int64_t(parts) * blockDim.x;
  if (group_max) {
#pragma unroll 4
    for (std::int64_t t = std::int64_t(part) * blockDim.x + threadIdx.x; t < n; t += stride) {
      const std::int32_t code = valid ? std::int32_t(row[t]) : codewords;
      out[t] = code < codewords ? vq_entry(table, true, group, 0, code) : vq_nan();
    }
    return;
  }
#pragma unroll 4
  for (std::int64_t t = std::int64_t(part) * blockDim.x + threadIdx.x; t < n; t += stride) {
    const std::int32_t code = valid ? std::int32_t(row[t]) : codewords;
    for (std::int32_t h = 0; h < group; ++h) out[h * scores.row_stride + t] = code < codewords ? table(h, code) : vq_nan();
  }
}

__global__ void codeword_norms(MatrixView<const float> centroids, float* norms) {
  const std::int64_t warp = (std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x % 32);
  if (warp >= centroids.rows) return;  // whole warps leave together: rows are per warp
  float sum = 0.0f;
  for (std::int32_t j = lane; j < centroids.cols; j += 32) sum = fmaf(centroids.row(warp)[j], centroids.row(warp)[j], sum);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) norms[warp] = sum;
}

/// Block (codeword tile, kv head g, sequence b): the group's tables for kThreads codewords.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    lut_kernel(QueryView<const T> q, VqCodebook<T> codebook, MatrixView<float> lut) {
  extern __shared__ float q_s[];  // [group, D]
  const std::int32_t b = blockIdx.z, g = blockIdx.y, group = q.heads / codebook.kv_heads;
  load_group_queries<T, D>(q, b, g, group, q_s);
  __syncthreads();
  const std::int32_t begin = std::int32_t(blockIdx.x) * kThreads;
  const std::int32_t end = min(begin + kThreads, codebook.codewords);
  lut_entries<T, D>(q_s, group, codebook.row(g, 0), begin, end, lut.row(std::int64_t(b) * q.heads + std::int64_t(g) * group),
                    lut.row_stride);
}

/// Block (part, kv head g, sequence b) of the two-launch scan: tables read from global memory.
__global__ void __launch_bounds__(kThreads)
    scan_kernel(MatrixView<const float> lut, std::int32_t q_heads, VqCodesView<const std::uint16_t> codes,
                const std::int32_t* slots, const std::int32_t* lengths, MatrixView<float> scores, bool group_max) {
  const std::int32_t b = blockIdx.z, g = blockIdx.y, group = q_heads / codes.kv_heads;
  const float* first = lut.row(std::int64_t(b) * q_heads + std::int64_t(g) * group);
  const std::int64_t stride = lut.row_stride;
  const auto table = [&](std::int32_t h, std::int32_t code) { return __ldg(first + h * stride + code); };
  scan_tokens(table, lut.cols, b, g, group, codes, slots, lengths, scores, group_max, blockIdx.x, gridDim.x);
}

/// Block (part, kv head g, sequence b) of the fused form. The `cluster` blocks of a cluster (consecutive in x)
/// build one eighth of the tables each into their own shared memory, then copy the other eighths through
/// distributed shared memory; every thread reaches both cluster barriers (no early exit before the scan). The
/// second barrier also keeps each block's tables alive until every block of its cluster has copied them.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    lut_scan_kernel(QueryView<const T> q, VqCodebook<T> codebook, VqCodesView<const std::uint16_t> codes,
                    const std::int32_t* slots, const std::int32_t* lengths, MatrixView<float> scores, bool group_max,
                    std::int32_t cluster) {
  extern __shared__ float smem[];
  const std::int32_t b = blockIdx.z, g = blockIdx.y, group = q.heads / codebook.kv_heads;
  const std::int32_t count = codebook.codewords;
  float* lut_s = smem;                                 // [group, count]
  float* q_s = smem + std::int64_t(group) * count;     // [group, D]
  load_group_queries<T, D>(q, b, g, group, q_s);
  __syncthreads();
  std::int32_t rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) rank = std::int32_t(cooperative_groups::this_cluster().block_rank());
#endif
  const auto slice_begin = [&](std::int32_t r) { return std::int32_t(std::int64_t(count) * r / cluster); };
  lut_entries<T, D>(q_s, group, codebook.row(g, 0), slice_begin(rank), slice_begin(rank + 1), lut_s, count);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (cluster > 1) {
    cooperative_groups::cluster_group blocks = cooperative_groups::this_cluster();
    blocks.sync();
    for (std::int32_t r = 0; r < cluster; ++r) {
      if (r == rank) continue;
      const float* remote = blocks.map_shared_rank(lut_s, unsigned(r));
      const std::int32_t begin = slice_begin(r), width = slice_begin(r + 1) - begin;
      for (std::int32_t i = threadIdx.x; i < group * width; i += blockDim.x) {
        const std::int64_t at = std::int64_t(i / width) * count + begin + i % width;
        lut_s[at] = remote[at];
      }
    }
    blocks.sync();
  }
#endif
  __syncthreads();
  const auto table = [&](std::int32_t h, std::int32_t code) { return lut_s[std::int64_t(h) * count + code]; };
  scan_tokens(table, count, b, g, group, codes, slots, lengths, scores, group_max, blockIdx.x, gridDim.x);
}

/// vq_topk_rows' word source for topk_rows' one-CTA and held kernels (cuda/detail/topk_held_kernels.cuh ScoreWords):
/// a score row's table into shared memory (with group_max the group's maximum per codeword, vq_group_max in head
/// order, as scan_tokens reduces it), then each token's word from its code: the scan's score of every token it
/// writes, NaN past them.
struct VqWords {
  VqTopKWords w;

  std::size_t smem_bytes() const { return sizeof(float) * std::size_t(w.codewords); }

  template <int kThreads, int kItems>
  __device__ __forceinline__ void load(const TopKRowsParams& p, std::int64_t score_row, std::int32_t first,
                                       std::int32_t count, std::uint32_t (&word)[kItems], unsigned char* smem) const {
    float* table = reinterpret_cast<float*>(smem);
    const std::int64_t kv_row = w.group_max ? score_row : score_row / w.group;  // b * kv_heads + g
    const float* tables = w.tables + (w.group_max ? kv_row * w.group : score_row) * std::int64_t(w.codewords);
    const auto entry = [&](std::int32_t h, std::int32_t c) { return tables[std::int64_t(h) * w.codewords + c]; };
    for (std::int32_t c = std::int32_t(threadIdx.x); c < w.codewords; c += kThreads) {
      table[c] = vq_entry(entry, w.group_max, w.group, 0, c);
    }
    __syncthreads();
    const std::int32_t b = std::int32_t(kv_row / w.codes.kv_heads), g = std::int32_t(kv_row % w.codes.kv_heads);
    const std::int32_t n = vq_scan_length(w.lengths[b], p.scores.cols, w.codes.max_tokens);
    const std::int32_t slot = w.slots[b];
    const std::uint16_t* codes = slot >= 0 && slot < w.codes.slots ? w.codes.row(slot, g) : nullptr;
    held_words_from<kThreads>(
        count,
        [&](std::int32_t i) {
          const std::int32_t t = first + i;
          const std::int32_t code = codes != nullptr && t < n ? std::int32_t(codes[t]) : w.codewords;
          return rank_word(code < w.codewords ? table[code] : vq_nan());
        },
        word);
  }
};

/// The codes of tokens [first, first + 8) of a row, first a multiple of 8: `codewords` (NaN) at or past n and for a
/// row without codes. One 16-byte load where the row is 16-byte aligned and the eight are codes (a 2-byte load per
/// token cost the count select's walks an instruction and a load each).
__device__ __forceinline__ void load_codes8(const std::uint16_t* codes, bool aligned, std::int32_t first,
                                            std::int32_t n, std::int32_t codewords, std::uint32_t (&code)[8]) {
  if (codes != nullptr && aligned && first + 8 <= n) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(codes + first));
    const std::uint32_t pairs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      code[2 * i] = pairs[i] & 0xffffu;
      code[2 * i + 1] = pairs[i] >> 16;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    code[j] = codes != nullptr && first + j < n ? std::uint32_t(codes[first + j]) : std::uint32_t(codewords);
  }
}

/// The count select of vq_topk_rows (cuda/vq.hpp): a CTA per selection row (sequence b, kv head g). A row's scores
/// are table entries, so its tokens take at most `codewords` distinct values (and NaN): the CTA keeps each head's
/// word per codeword in shared memory, counts the tokens of each code in the middle, finds each head's threshold
/// word by a radix select over the codewords weighted by their counts (NaN tokens counted at word 0), packs each
/// codeword's class per head against the thresholds, then walks the middle once in index order: a token is chosen
/// when some head takes it (its word better than the head's threshold, or tied with it and fewer than the head's
/// tied quota before it), and the chosen go out ascending.
/// The same picks as the per-head top-k and their union: the threshold, and ties to the smaller index, are
/// topk_rows' rule. Both walks read 8 codes a load, several loads in flight per thread.
template <int kThreads, int kHeads>
__global__ void __launch_bounds__(kThreads) vq_count_select_kernel(const __grid_constant__ VqCountSelectParams p) {
  constexpr int kCountLoads = 4;  // 8-code loads in flight per thread while counting
  constexpr int kPassLoads = 2;   // 8-code loads per thread per pass of the emission
  constexpr int kTokens = 8 * kPassLoads;
  static_assert(kHeads <= kThreads / 32, "a warp per head's bins");
  __shared__ std::uint32_t histogram[kHeads][256];
  __shared__ std::uint32_t threshold[kHeads], quota[kHeads];  // quota: the rank of the threshold, then tied tokens to take
  __shared__ std::uint32_t nan_tokens, nan_classes;
  __shared__ __align__(16) std::uint32_t scan_buffer[2][kHeads * 32];
  extern __shared__ __align__(16) unsigned char count_select_smem[];
  const VqTopKWords& w = p.words;
  const std::int32_t codewords = w.codewords;
  auto* counts = reinterpret_cast<std::uint32_t*>(count_select_smem);  // [codewords]
  std::uint32_t* const words = counts + codewords;                      // [heads, codewords]

  programmatic_start();  // the tables, codes, lengths and budgets
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const std::int64_t row = blockIdx.x;  // b * kv_heads + g: the selection row
  const std::int32_t b = std::int32_t(row / w.codes.kv_heads), g = std::int32_t(row % w.codes.kv_heads);
  const std::int32_t length = w.lengths[b];
  const std::int32_t k = p.row_k != nullptr ? p.row_k[row] : p.k;
  std::int32_t* const count_out = p.out.counts + row;
  if (length < 0 || length > p.max_tokens || k < 0 || k > p.k) {  // topk_rows' invalid row
    if (tid == 0) *count_out = -1;
    return;
  }
  const std::int32_t lo = p.window.sink_end(length), hi = p.window.recent_begin(length);
  const std::int32_t picks = min(k, hi - lo);
  std::int32_t* const indices = p.out.indices + row * p.out.capacity;
  float* const weights = p.out.log_weights != nullptr ? p.out.log_weights + row * p.out.capacity : nullptr;
  const auto take_whole_middle = [&] {
    for (std::int32_t i = tid; i < picks; i += kThreads) {
      indices[i] = lo + i;
      if (weights != nullptr) weights[i] = 0.0f;
    }
    if (tid == 0) *count_out = picks;
  };
  const bool whole = picks == hi - lo;
  if (picks == 0 || (whole && !p.nan_marks_row)) {  // nothing, or the whole middle with no NaN to look for
    take_whole_middle();
    return;
  }
  const std::int32_t heads = w.group_max ? 1 : w.group;
  const std::int32_t n = vq_scan_length(length, p.max_tokens, w.codes.max_tokens);
  const std::int32_t slot = w.slots[b];
  const std::uint16_t* const codes = slot >= 0 && slot < w.codes.slots ? w.codes.row(slot, g) : nullptr;
  const bool aligned = reinterpret_cast<std::uintptr_t>(codes) % 16 == 0;
  const float* const tables = w.tables + row * w.group * std::int64_t(codewords);  // the group's first table
  const auto table = [&](std::int32_t h, std::int32_t c) { return __ldg(tables + std::int64_t(h) * codewords + c); };

  // Each head's word per codeword (NaN tokens take word 0: rank_word's NaN); tokens per code in the middle, NaN
  // tokens (a code past the codebook, a token past the codes, a bad slot) apart.
  for (std::int32_t c = tid; c < codewords; c += kThreads) {
    counts[c] = 0;
    for (std::int32_t h = 0; h < heads; ++h) {
      words[std::int64_t(h) * codewords + c] = rank_word(vq_entry(table, w.group_max, w.group, h, c));
    }
  }
  if (tid == 0) nan_tokens = 0;
  if (tid < kHeads) {
    threshold[tid] = 0;
    quota[tid] = std::uint32_t(picks);
  }
  __syncthreads();
  std::uint32_t nan_here = 0;
  const std::int32_t first_load = lo / 8, loads = (hi + 7) / 8;
  for (std::int32_t l0 = first_load + tid; l0 < loads; l0 += kThreads * kCountLoads) {
    std::uint32_t code[kCountLoads][8];
#pragma unroll
    for (int u = 0; u < kCountLoads; ++u) {
      if (l0 + u * kThreads < loads) load_codes8(codes, aligned, 8 * (l0 + u * kThreads), n, codewords, code[u]);
    }
#pragma unroll
    for (int u = 0; u < kCountLoads; ++u) {
      const std::int32_t first = 8 * (l0 + u * kThreads);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (first + j < lo || first + j >= hi) continue;
        if (code[u][j] < std::uint32_t(codewords)) {
          atomicAdd(counts + code[u][j], 1u);
        } else {
          ++nan_here;
        }
      }
    }
  }
  if (nan_here > 0) atomicAdd(&nan_tokens, nan_here);
  __syncthreads();
  if (p.nan_marks_row) {  // one score row (heads_per_row 1): a NaN token is one past the codes or with NaN's word
    bool nan_code = false;
    for (std::int32_t c = tid; c < codewords && !nan_code; c += kThreads) nan_code = counts[c] > 0 && words[c] == 0u;
    if (__syncthreads_or(nan_code) || nan_tokens > 0) {
      if (tid == 0) *count_out = -1;
      return;
    }
    if (whole) {
      take_whole_middle();
      return;
    }
  }

  // Each head's threshold: four 8-bit passes over the codewords' words, each code weighing its count.
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const std::uint32_t decided = pass == 0 ? 0u : ~0u << (shift + 8);
    for (int i = tid; i < kHeads * 256; i += kThreads) (&histogram[0][0])[i] = 0;
    __syncthreads();
    for (std::int32_t c = tid; c < codewords; c += kThreads) {
      const std::uint32_t count = counts[c];
      if (count == 0) continue;
      for (int h = 0; h < heads; ++h) {
        const std::uint32_t x = words[std::int64_t(h) * codewords + c];
        if ((x & decided) == threshold[h]) atomicAdd(&histogram[h][(x >> shift) & 255u], count);
      }
    }
    if (tid < heads && nan_tokens > 0 && threshold[tid] == 0u) atomicAdd(&histogram[tid][0], nan_tokens);
    __syncthreads();
    if (warp < heads) {  // warp h: the bin holding its head's quota-th word
      const int h = warp;
      std::uint32_t bins[8], sum = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        bins[i] = histogram[h][lane * 8 + i];
        sum += bins[i];
      }
      const std::uint32_t inclusive = warp_inclusive_sum(sum);
      const std::uint32_t want = quota[h];
      __syncwarp();  // every lane has read the quota before one lane rewrites it
      std::uint32_t before = inclusive - sum;
      if (before < want && want <= inclusive) {
        int d = 0;
        while (before + bins[d] < want) before += bins[d++];
        threshold[h] |= std::uint32_t(lane * 8 + d) << shift;
        quota[h] = want - before;
      }
    }
    __syncthreads();
  }

  // Each codeword's classes, 2 bits per head (1 better than the head's threshold, 2 tied with it, 0 worse), in place
  // of its count; NaN tokens' apart (word 0 is never worse). A token then costs one lookup, whatever the heads.
  std::uint32_t* const classes = counts;
  for (std::int32_t c = tid; c < codewords; c += kThreads) {
    std::uint32_t packed = 0;
    for (std::int32_t h = 0; h < heads; ++h) {
      const std::uint32_t x = words[std::int64_t(h) * codewords + c];
      packed |= (x < threshold[h] ? 1u : x == threshold[h] ? 2u : 0u) << (2 * h);
    }
    classes[c] = packed;
  }
  if (tid == 0) {
    std::uint32_t packed = 0;
    for (std::int32_t h = 0; h < heads; ++h) packed |= (threshold[h] > 0u ? 1u : 2u) << (2 * h);
    nan_classes = packed;
  }
  __syncthreads();

  // The middle in index order, kThreads * kTokens tokens a pass from lo rounded down to a load: a token is chosen
  // when some head finds it better, or tied and fewer than the head's quota of tied tokens come before it (the tied
  // tokens' ranks per head, scanned only in the passes that hold one: a few codewords are tied). The next pass's
  // codes load while this pass scans.
  constexpr std::uint32_t kBetter = 0x5555u, kTied = 0xaaaau;  // the class bits of up to 8 heads
  std::uint32_t tied_before[kHeads] = {}, chosen_before = 0;
  std::uint32_t code[kPassLoads][8];
  const std::int32_t start = 8 * first_load;
  const auto load_pass = [&](std::int32_t base) {
#pragma unroll
    for (int u = 0; u < kPassLoads; ++u) load_codes8(codes, aligned, base + tid * kTokens + 8 * u, n, codewords, code[u]);
  };
  load_pass(start);
  for (std::int32_t base = start; base < hi; base += kThreads * kTokens) {
    const std::int32_t first = base + tid * kTokens;
    std::uint32_t cls[kTokens], chosen_mask = 0;
    bool tied_here = false;
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      const std::uint32_t c = code[j / 8][j % 8];
      cls[j] = first + j < lo || first + j >= hi ? 0u : c < std::uint32_t(codewords) ? classes[c] : nan_classes;
      if ((cls[j] & kBetter) != 0) chosen_mask |= 1u << j;
      tied_here = tied_here || (cls[j] & kTied) != 0;
    }
    if (base + kThreads * kTokens < hi) load_pass(base + kThreads * kTokens);
    if (__syncthreads_or(tied_here)) {
      std::uint32_t tied[kHeads] = {}, tied_rank[kHeads], tied_total[kHeads];
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        if ((cls[j] & kTied) == 0) continue;
#pragma unroll
        for (int h = 0; h < kHeads; ++h) tied[h] += cls[j] >> (2 * h + 1) & 1u;
      }
      held_block_scan<kThreads, kHeads>(tied, tied_rank, tied_total, scan_buffer[0]);
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        if ((cls[j] & kTied) == 0) continue;
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          if ((cls[j] >> (2 * h + 1) & 1u) == 0) continue;
          if (tied_before[h] + tied_rank[h] < quota[h]) chosen_mask |= 1u << j;  // every tied token counts toward
          ++tied_rank[h];                                                       // its head's rank, taken or not
        }
      }
#pragma unroll
      for (int h = 0; h < kHeads; ++h) tied_before[h] += tied_total[h];
    }
    const std::uint32_t chosen[1] = {std::uint32_t(__popc(chosen_mask))};
    std::uint32_t position[1], total[1];
    held_block_scan<kThreads, 1>(chosen, position, total, scan_buffer[1]);
    std::uint32_t at = chosen_before + position[0];
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      if ((chosen_mask >> j & 1u) == 0) continue;
      indices[at] = first + j;
      if (weights != nullptr) weights[at] = 0.0f;
      ++at;
    }
    chosen_before += total[0];
  }
  if (tid == 0) *count_out = std::int32_t(chosen_before);
}

}  // namespace

cudaError_t launch_vq_count_select(const VqCountSelectParams& p, cudaStream_t stream) {
  // One score head (the group maximum) apart: its per-head registers and scans are an eighth of the union's.
  const std::int32_t heads = p.words.group_max ? 1 : p.words.group;
  const auto launch_for = [&]<int kHeads>() {
    constexpr auto kernel = vq_count_select_kernel<kVqCountSelectThreads, kHeads>;
    if (cudaError_t s = open_shared_memory<kernel>(); s != cudaSuccess) return s;
    return launch(kernel,
                  {.grid = dim3(unsigned(p.rows)), .block = dim3(kVqCountSelectThreads),
                   .smem = vq_count_select_smem_bytes(p.words.codewords, heads), .stream = stream,
                   .programmatic = true},
                  p);
  };
  return heads == 1 ? launch_for.template operator()<1>() : launch_for.template operator()<kVqCountSelectMaxHeads>();
}

cudaError_t launch_vq_topk_rows(const TopKRowsParams& p, const VqTopKWords& words, cudaStream_t stream) {
  if (cudaError_t s = launch_topk_rows_words(p, VqWords{words}, stream); s != cudaSuccess) return s;
  return launch_topk_rows_union(p, stream);
}

cudaError_t launch_vq_codeword_norms(const MatrixView<const float>& centroids, float* norms, cudaStream_t stream) {
  const std::int64_t blocks = (centroids.rows * 32 + kThreads - 1) / kThreads;
  codeword_norms<<<unsigned(blocks), kThreads, 0, stream>>>(centroids, norms);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_vq_lut(const QueryView<const T>& q, const VqCodebook<T>& codebook, const MatrixView<float>& lut,
                          cudaStream_t stream) {
  return with_vq_head_dim(q.head_dim, [&]<int D>() {
    const std::size_t smem = sizeof(float) * std::size_t(q.heads / codebook.kv_heads) * D;
    constexpr auto kernel = lut_kernel<T, D>;
    if (cudaError_t s = open_shared_memory<kernel>(); s != cudaSuccess) return s;
    const dim3 grid(unsigned((codebook.codewords + kThreads - 1) / kThreads), unsigned(codebook.kv_heads),
                    unsigned(q.batch));
    kernel<<<grid, kThreads, smem, stream>>>(q, codebook, lut);
    return cudaGetLastError();
  });
}

cudaError_t launch_vq_code_scan(const MatrixView<const float>& lut, std::int32_t batch,
                                const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots,
                                const std::int32_t* lengths, const MatrixView<float>& scores,
                                const VqScanOptions& options, const VqScanGrid& grid, cudaStream_t stream) {
  const auto q_heads = std::int32_t(lut.rows / batch);
  scan_kernel<<<dim3(unsigned(grid.parts), unsigned(codes.kv_heads), unsigned(batch)), kThreads, 0, stream>>>(
      lut, q_heads, codes, slots, lengths, scores, options.group_max);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_vq_lut_scan(const QueryView<const T>& q, const VqCodebook<T>& codebook,
                               const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots,
                               const std::int32_t* lengths, const MatrixView<float>& scores,
                               const VqScanOptions& options, const VqScanGrid& grid, cudaStream_t stream) {
  return with_vq_head_dim(q.head_dim, [&]<int D>() {
    constexpr auto kernel = lut_scan_kernel<T, D>;
    const std::size_t smem = vq_fused_smem_bytes(q.heads / codebook.kv_heads, codebook.codewords, D);
    if (cudaError_t s = open_shared_memory<kernel>(); s != cudaSuccess) return s;
    // The cluster split exists only in code compiled for sm_90 or later (__CUDA_ARCH__ >= 900): PTX of an older
    // architecture JIT-compiled for a newer GPU (CMAKE_CUDA_ARCHITECTURES=80 on an H100) fills the whole table in
    // every block instead.
    bool sm90 = false;
    if (cudaError_t s = built_for_sm90<kernel>(&sm90); s != cudaSuccess) return s;
    const std::int32_t cluster = sm90 ? grid.cluster : 1;
    return launch(kernel,
                  {.grid = dim3(unsigned(grid.parts), unsigned(codebook.kv_heads), unsigned(q.batch)),
                   .block = dim3(kThreads), .smem = smem, .stream = stream, .cluster = cluster},
                  q, codebook, codes, slots, lengths, scores, options.group_max, cluster);
  });
}

#define KVSIFT_INSTANTIATE(T)                                                                                         \
  template cudaError_t launch_vq_lut<T>(const QueryView<const T>&, const VqCodebook<T>&, const MatrixView<float>&,   \
                                        cudaStream_t);                                                                \
  template cudaError_t launch_vq_lut_scan<T>(const QueryView<const T>&, const VqCodebook<T>&,                        \
                                             const VqCodesView<const std::uint16_t>&, const std::int32_t*,            \
                                             const std::int32_t*, const MatrixView<float>&, const VqScanOptions&,     \
                                             const VqScanGrid&, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
