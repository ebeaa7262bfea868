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

/// Block (codeword tile, kv head g, sequence b): the group's tables for kThreads codewords; the grid's threads also
/// zero `zeroed` (launch_vq_lut).
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    lut_kernel(QueryView<const T> q, VqCodebook<T> codebook, MatrixView<float> lut, std::uint32_t* zeroed,
               std::size_t zeroed_words) {
  extern __shared__ float q_s[];  // [group, D]
  programmatic_start();  // the query (rotated by the launch before), and whatever read `zeroed` before
  const std::int32_t b = blockIdx.z, g = blockIdx.y, group = q.heads / codebook.kv_heads;
  const std::size_t block = (std::size_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const std::size_t threads = std::size_t(gridDim.x) * gridDim.y * gridDim.z * blockDim.x;
  for (std::size_t i = block * blockDim.x + threadIdx.x; i < zeroed_words; i += threads) zeroed[i] = 0;
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

// The count select of vq_topk_rows (cuda/vq.hpp). A row's scores are table entries, so its tokens take at most
// `codewords` distinct values, and NaN: from the row's tokens per code (NaN tokens as one more code, `codewords`,
// of word 0: rank_word's NaN) each head's threshold word follows by a radix select over the codes weighted by their
// counts, and from the thresholds each code's class per head (better, tied, worse: 2 bits). A token is then decided
// by one lookup: chosen when some head finds it better than its threshold, or tied with it and fewer than the head's
// quota of tied tokens come before it in index order. The same picks as the per-head top-k and their union, ties to
// the smaller index as topk_rows breaks them. Two forms (vq_launch.hpp says where each is taken):
//   - a CTA per selection row (vq_count_row_kernel): counts, thresholds, classes and one walk of the middle;
//   - each row in slices, after a memset of the scratch:
//     1. counts: a CTA per (row, slice) counts its slice's tokens per code and adds them to the row's counts;
//     2. thresholds: a CTA per (row, head) finds the head's threshold and quota and ors its class of each code
//        into the row's classes;
//     3. picks: a CTA per (row, slice), slices in the order the CTAs start (a ticket), walks its slice three times:
//        its tied tokens per head, published, then with those of the slices before it the tied tokens it takes (a
//        head's first quota tied tokens are its slices' first ones); its picks, published; its picks written after
//        those of the slices before. Each CTA publishes before it waits, and waits only on CTAs that started before
//        it: no deadlock however the CTAs are scheduled.
// Every walk reads 8 codes a 16-byte load.

/// The codes of tokens [first, first + 8) of a row, first a multiple of 8: `codewords` (NaN) at or past n and for a
/// row without codes. One 16-byte load where the row is 16-byte aligned and the eight are codes.
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

/// One selection row (sequence b, kv head g) of the count select, as every kernel of it sees the row: its middle
/// [lo, hi) in p.slices slices (one for the CTA per row) from lo rounded down to a load.
struct CountRow {
  bool valid;  ///< topk_rows' valid row: length in [0, max_tokens], budget in [0, k]
  std::int32_t lo, hi, picks, n;
  const std::uint16_t* codes;  ///< nullptr: a bad slot (every token NaN)
  bool aligned;
  std::int32_t slice_tokens;  ///< a multiple of 8

  __device__ CountRow(const VqCountSelectParams& p, std::int64_t row) {
    const VqTopKWords& w = p.words;
    const std::int32_t b = std::int32_t(row / w.codes.kv_heads), g = std::int32_t(row % w.codes.kv_heads);
    const std::int32_t length = w.lengths[b];
    const std::int32_t k = p.row_k != nullptr ? p.row_k[row] : p.k;
    valid = length >= 0 && length <= p.max_tokens && k >= 0 && k <= p.k;
    lo = valid ? p.window.sink_end(length) : 0;
    hi = valid ? p.window.recent_begin(length) : 0;
    picks = valid ? min(k, hi - lo) : 0;
    n = valid ? vq_scan_length(length, p.max_tokens, w.codes.max_tokens) : 0;
    const std::int32_t slot = w.slots[b];
    codes = slot >= 0 && slot < w.codes.slots ? w.codes.row(slot, g) : nullptr;
    aligned = reinterpret_cast<std::uintptr_t>(codes) % 16 == 0;
    const std::int32_t span = max(hi - (lo & ~7), 0);
    const std::int32_t slices = max(p.slices, 1);  // a CTA per row: one slice
    slice_tokens = ((span + slices - 1) / slices + 7) & ~7;
  }
  __device__ std::int32_t slice_begin(std::int32_t s) const { return (lo & ~7) + s * slice_tokens; }
  __device__ std::int32_t slice_end(std::int32_t s) const { return min(hi, slice_begin(s) + slice_tokens); }
  /// Nothing to rank: an invalid row, no budget, or the whole middle with no NaN to look for (write_unranked).
  __device__ bool unranked(const VqCountSelectParams& p) const {
    return !valid || picks == 0 || (picks == hi - lo && !p.nan_marks_row);
  }
};

/// The selection of a row not ranked: count -1 for an invalid row or one nan_marks_row marks, else the middle's first
/// picks tokens (the CTA's threads share the writes).
__device__ void write_unranked(const VqCountSelectParams& p, const CountRow& r, std::int64_t row, bool marked) {
  if (!r.valid || marked) {
    if (threadIdx.x == 0) p.out.counts[row] = -1;
    return;
  }
  std::int32_t* const indices = p.out.indices + row * p.out.capacity;
  float* const weights = p.out.log_weights != nullptr ? p.out.log_weights + row * p.out.capacity : nullptr;
  for (std::int32_t i = threadIdx.x; i < r.picks; i += blockDim.x) {
    indices[i] = r.lo + i;
    if (weights != nullptr) weights[i] = 0.0f;
  }
  if (threadIdx.x == 0) p.out.counts[row] = r.picks;
}

/// Adds slice s's middle tokens per code (NaN tokens at `codewords`) into `counts` (shared memory); kLoads 8-code
/// loads in flight per thread.
template <int kThreads>
__device__ void count_slice(const CountRow& r, std::int32_t s, std::int32_t codewords, std::uint32_t* counts) {
  constexpr int kLoads = 4;
  const std::int32_t first = max(r.lo, r.slice_begin(s)), end = r.slice_end(s);
  const std::int32_t load_end = (end + 7) / 8;
  for (std::int32_t l0 = r.slice_begin(s) / 8 + std::int32_t(threadIdx.x); l0 < load_end; l0 += kThreads * kLoads) {
    std::uint32_t code[kLoads][8];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      if (l0 + u * kThreads < load_end) load_codes8(r.codes, r.aligned, 8 * (l0 + u * kThreads), r.n, codewords, code[u]);
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const std::int32_t t = 8 * (l0 + u * kThreads) + j;
        if (t >= first && t < end) atomicAdd(counts + min(code[u][j], std::uint32_t(codewords)), 1u);
      }
    }
  }
}

/// Head h's rank word of every code into words[0, codewords]: its table entry's (or the group's maximum's), NaN's 0.
__device__ void head_words(const VqTopKWords& w, std::int64_t row, std::int32_t h, std::uint32_t* words) {
  const float* const tables = w.tables + row * w.group * std::int64_t(w.codewords);  // the group's first table
  const auto table = [&](std::int32_t u, std::int32_t c) { return __ldg(tables + std::int64_t(u) * w.codewords + c); };
  for (std::int32_t c = threadIdx.x; c <= w.codewords; c += blockDim.x) {
    words[c] = c < w.codewords ? rank_word(vq_entry(table, w.group_max, w.group, h, c)) : 0u;
  }
}

/// What nan_marks_row decides once a row is counted (one score head): a token of the middle is NaN (counted with word
/// 0: NaN's code, or a table entry NaN) marks the row; else a middle of picks tokens is taken whole. decided: the row
/// is written unranked (write_unranked(marked)). Every thread of the CTA gets the answer.
struct NanMarksRow {
  bool decided = false, marked = false;
};
__device__ NanMarksRow nan_marks_decision(const VqCountSelectParams& p, const CountRow& r, const std::uint32_t* counts,
                                          const std::uint32_t* words, std::int32_t codes) {
  if (!p.nan_marks_row) return {};
  bool nan = false;
  for (std::int32_t c = threadIdx.x; c < codes && !nan; c += blockDim.x) nan = counts[c] > 0 && words[c] == 0u;
  const bool marked = __syncthreads_or(nan) != 0;
  return {marked || r.picks == r.hi - r.lo, marked};
}

/// Each head's threshold word and quota (its tied tokens to take) among the counted tokens, picks of them wanted:
/// four 8-bit radix passes over the codes' words (head h's at words + h * codes), each code weighing its count; warp
/// h finds head h's bin. The caller has synchronized the CTA after writing counts and words.
template <int kThreads, int kHeads>
__device__ void count_thresholds(const std::uint32_t* counts, const std::uint32_t* words, std::int32_t codes,
                                 std::int32_t heads, std::int32_t picks, std::uint32_t (*histogram)[256],
                                 std::uint32_t* threshold, std::uint32_t* quota) {
  static_assert(kHeads <= kThreads / 32, "a warp per head's bins");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid < kHeads) {
    threshold[tid] = 0;
    quota[tid] = std::uint32_t(picks);
  }
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    const std::uint32_t decided = pass == 0 ? 0u : ~0u << (shift + 8);
    for (int i = tid; i < kHeads * 256; i += kThreads) histogram[i / 256][i % 256] = 0;
    __syncthreads();
    for (std::int32_t c = tid; c < codes; c += kThreads) {
      const std::uint32_t count = counts[c];
      if (count == 0) continue;
#pragma unroll
      for (int h = 0; h < kHeads; ++h) {
        if (h == heads) break;
        const std::uint32_t x = words[std::int64_t(h) * codes + c];
        if ((x & decided) == threshold[h]) atomicAdd(&histogram[h][(x >> shift) & 255u], count);
      }
    }
    __syncthreads();
    if (warp < heads) {  // the bin holding the quota-th word
      std::uint32_t bins[8], sum = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        bins[i] = histogram[warp][lane * 8 + i];
        sum += bins[i];
      }
      const std::uint32_t inclusive = warp_inclusive_sum(sum);
      const std::uint32_t want = quota[warp];
      __syncwarp();  // every lane has read the quota before one lane rewrites it
      std::uint32_t before = inclusive - sum;
      if (before < want && want <= inclusive) {
        int d = 0;
        while (before + bins[d] < want) before += bins[d++];
        threshold[warp] |= std::uint32_t(lane * 8 + d) << shift;
        quota[warp] = want - before;
      }
    }
    __syncthreads();
  }
}

/// A code's class for a head of threshold word `threshold`: 1 better, 2 tied, 0 worse.
__device__ __forceinline__ std::uint32_t count_class(std::uint32_t word, std::uint32_t threshold) {
  return word < threshold ? 1u : word == threshold ? 2u : 0u;
}

/// Walks a slice of a row in passes of kStride tokens from its start (a multiple of 8), kTokens consecutive tokens a
/// thread, each token's classes by one lookup (0 outside [first, end)). tied_before: each head's tied tokens in the
/// passes decided since start(). The codes are loaded as a pass starts: holding the next pass's in registers took
/// the picks kernel from 40 to 86 registers (one head), a CTA per SM where 3 fit (1M tokens, group max: 218 µs
/// a step against 184).
template <int kThreads, int kHeads>
struct PicksWalk {
  static constexpr int kTokens = kVqCountPassTokens;
  static constexpr int kPassLoads = kTokens / 8;
  static_assert(kTokens % 8 == 0 && kTokens <= 16, "8-code loads; a pass's picks in a 16-bit mask per thread");
  static constexpr int kStride = kThreads * kTokens;
  static constexpr std::uint32_t kBetter = 0x5555u, kTied = 0xaaaau;  // the class bits of up to 8 heads

  const CountRow& r;
  const std::uint32_t* classes;  ///< shared memory, [codewords + 1]
  std::int32_t codewords, first, end;
  std::uint32_t (*scan_buffer)[kHeads * 32];  ///< two of held_block_scan's: tied ranks, picks' positions
  std::uint32_t tied_before[kHeads];

  __device__ void start() {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) tied_before[h] = 0;
  }
  /// This thread's picks of the pass at base (a bit per token), head h taking its first takes[h] tied tokens counted
  /// from start(): the tied tokens' ranks per head, scanned only in passes that hold one (a few codes are tied).
  __device__ std::uint32_t picks(std::int32_t base, const std::uint32_t* takes) {
    const std::int32_t at = base + threadIdx.x * kTokens;
    std::uint32_t code[kPassLoads][8], cls[kTokens], picked = 0;
#pragma unroll
    for (int u = 0; u < kPassLoads; ++u) load_codes8(r.codes, r.aligned, at + 8 * u, r.n, codewords, code[u]);
    bool tied_here = false;
#pragma unroll
    for (int j = 0; j < kTokens; ++j) {
      cls[j] = at + j < first || at + j >= end ? 0u : classes[min(code[j / 8][j % 8], std::uint32_t(codewords))];
      if ((cls[j] & kBetter) != 0) picked |= 1u << j;
      tied_here = tied_here || (cls[j] & kTied) != 0;
    }
    if (__syncthreads_or(tied_here)) {
      std::uint32_t tied[kHeads] = {}, rank[kHeads], total[kHeads];
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        if ((cls[j] & kTied) == 0) continue;
#pragma unroll
        for (int h = 0; h < kHeads; ++h) tied[h] += cls[j] >> (2 * h + 1) & 1u;
      }
      held_block_scan<kThreads, kHeads>(tied, rank, total, scan_buffer[0]);
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        if ((cls[j] & kTied) == 0) continue;
#pragma unroll
        for (int h = 0; h < kHeads; ++h) {
          if ((cls[j] >> (2 * h + 1) & 1u) == 0) continue;
          if (tied_before[h] + rank[h] < takes[h]) picked |= 1u << j;  // every tied token counts toward its head's
          ++rank[h];                                                   // rank, taken or not
        }
      }
#pragma unroll
      for (int h = 0; h < kHeads; ++h) tied_before[h] += total[h];
    }
    return picked;
  }
  /// The CTA's picks of a pass (every thread gets the total); with `indices`, written from position `written` in
  /// index order.
  __device__ std::uint32_t emit(std::uint32_t picked, std::int32_t base, std::uint32_t written, std::int32_t* indices,
                                float* weights) {
    const std::uint32_t count[1] = {std::uint32_t(__popc(picked))};
    std::uint32_t position[1], total[1];
    held_block_scan<kThreads, 1>(count, position, total, scan_buffer[1]);
    if (indices != nullptr) {
      std::uint32_t at = written + position[0];
#pragma unroll
      for (int j = 0; j < kTokens; ++j) {
        if ((picked >> j & 1u) == 0) continue;
        indices[at] = base + threadIdx.x * kTokens + j;
        if (weights != nullptr) weights[at] = 0.0f;
        ++at;
      }
    }
    return total[0];
  }
};

/// The count select's CTA per row (blockIdx.x): the row's counts, each head's words and threshold, each code's
/// classes in place of its count, and one walk of the middle writing the picks.
template <int kThreads, int kHeads>
__global__ void __launch_bounds__(kThreads) vq_count_row_kernel(const __grid_constant__ VqCountSelectParams p) {
  __shared__ std::uint32_t histogram[kHeads][256];
  __shared__ std::uint32_t threshold[kHeads], quota[kHeads];
  __shared__ __align__(16) std::uint32_t scan_buffer[2][kHeads * 32];
  extern __shared__ __align__(16) unsigned char count_row_smem[];
  const VqTopKWords& w = p.words;
  const std::int32_t codewords = w.codewords, codes = codewords + 1;
  const std::int32_t heads = w.group_max ? 1 : w.group;
  auto* counts = reinterpret_cast<std::uint32_t*>(count_row_smem);  // [codes]
  std::uint32_t* const words = counts + codes;                      // [heads, codes]
  const int tid = threadIdx.x;

  programmatic_start();  // the tables, codes, lengths and budgets
  const std::int64_t row = blockIdx.x;
  const CountRow r(p, row);
  if (r.unranked(p)) {
    write_unranked(p, r, row, false);
    return;
  }
  for (std::int32_t h = 0; h < heads; ++h) head_words(w, row, h, words + std::int64_t(h) * codes);
  for (std::int32_t c = tid; c < codes; c += kThreads) counts[c] = 0;
  __syncthreads();
  count_slice<kThreads>(r, 0, codewords, counts);
  __syncthreads();
  if (const NanMarksRow nan = nan_marks_decision(p, r, counts, words, codes); nan.decided) {
    write_unranked(p, r, row, nan.marked);
    return;
  }
  count_thresholds<kThreads, kHeads>(counts, words, codes, heads, r.picks, histogram, threshold, quota);
  std::uint32_t* const classes = counts;
  for (std::int32_t c = tid; c < codes; c += kThreads) {
    std::uint32_t packed = 0;
    for (std::int32_t h = 0; h < heads; ++h) packed |= count_class(words[std::int64_t(h) * codes + c], threshold[h]) << (2 * h);
    classes[c] = packed;
  }
  __syncthreads();

  using Walk = PicksWalk<kThreads, kHeads>;
  Walk walk{r, classes, codewords, r.lo, r.hi, scan_buffer};
  std::int32_t* const indices = p.out.indices + row * p.out.capacity;
  float* const weights = p.out.log_weights != nullptr ? p.out.log_weights + row * p.out.capacity : nullptr;
  std::uint32_t written = 0;
  walk.start();
  for (std::int32_t base = r.slice_begin(0); base < r.hi; base += Walk::kStride) {
    written += walk.emit(walk.picks(base, quota), base, written, indices, weights);
  }
  if (tid == 0) p.out.counts[row] = std::int32_t(written);
}

/// Split form, kernel 1: the tokens per code (NaN last) of slice blockIdx.y of row blockIdx.x, added to the row's
/// counts.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) vq_slice_counts_kernel(const __grid_constant__ VqCountSelectParams p) {
  extern __shared__ __align__(16) unsigned char slice_counts_smem[];
  auto* counts = reinterpret_cast<std::uint32_t*>(slice_counts_smem);  // [codewords + 1]
  programmatic_start();  // the lengths, budgets and codes; the scratch, zeroed by the tables' launch
  const std::int32_t codewords = p.words.codewords;
  const std::int64_t row = blockIdx.x;
  const CountRow r(p, row);
  if (r.unranked(p)) return;  // the thresholds kernel writes the row
  for (std::int32_t c = threadIdx.x; c <= codewords; c += kThreads) counts[c] = 0;
  __syncthreads();
  count_slice<kThreads>(r, std::int32_t(blockIdx.y), codewords, counts);
  __syncthreads();
  std::uint32_t* const row_counts = p.scratch.counts + row * (std::int64_t(codewords) + 1);
  for (std::int32_t c = threadIdx.x; c <= codewords; c += kThreads) {
    if (counts[c] != 0) atomicAdd(row_counts + c, counts[c]);
  }
}

/// Split form, kernel 2: head blockIdx.y's threshold and quota in row blockIdx.x, and its class of every code ored
/// into the row's classes. A row not ranked (CountRow::unranked, or a NaN under nan_marks_row) is written by head 0's
/// CTA, which marks it done for the picks kernel.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) vq_count_thresholds_kernel(const __grid_constant__ VqCountSelectParams p) {
  __shared__ std::uint32_t histogram[1][256];
  __shared__ std::uint32_t threshold[1], quota[1];
  extern __shared__ __align__(16) unsigned char thresholds_smem[];
  const std::int32_t codewords = p.words.codewords, codes = codewords + 1, h = blockIdx.y;
  auto* counts = reinterpret_cast<std::uint32_t*>(thresholds_smem);  // [codes]
  std::uint32_t* const words = counts + codes;                        // [codes]: the head's
  const int tid = threadIdx.x;

  programmatic_start();  // the tables and the row's counts
  const std::int64_t row = blockIdx.x;
  const CountRow r(p, row);
  const auto finish_unranked = [&](bool marked) {
    if (h != 0) return;
    write_unranked(p, r, row, marked);
    if (tid == 0) p.scratch.row_state[2 * row] = 1;
  };
  if (r.unranked(p)) {
    finish_unranked(false);
    return;
  }
  const std::uint32_t* const row_counts = p.scratch.counts + row * std::int64_t(codes);
  for (std::int32_t c = tid; c < codes; c += kThreads) counts[c] = row_counts[c];
  head_words(p.words, row, h, words);
  __syncthreads();
  if (const NanMarksRow nan = nan_marks_decision(p, r, counts, words, codes); nan.decided) {
    finish_unranked(nan.marked);
    return;
  }
  count_thresholds<kThreads, 1>(counts, words, codes, 1, r.picks, histogram, threshold, quota);
  std::uint32_t* const classes = p.scratch.classes + row * std::int64_t(codes);
  for (std::int32_t c = tid; c < codes; c += kThreads) {
    const std::uint32_t cls = count_class(words[c], threshold[0]);
    if (cls != 0) atomicOr(classes + c, cls << (2 * h));
  }
  if (tid == 0) p.scratch.quota[row * kVqCountSelectMaxHeads + h] = quota[0];
}

/// Split form, kernel 3: one slice of row blockIdx.x (the slice ticket: slices in the order their CTAs start), walked
/// three times: its tied tokens per head; its picks, kept in shared memory; those picks written after those of the
/// slices before.
template <int kThreads, int kHeads>
__global__ void __launch_bounds__(kThreads) vq_count_picks_kernel(const __grid_constant__ VqCountSelectParams p) {
  static_assert(kHeads <= kThreads / 32, "a warp per head's look-back");
  __shared__ __align__(16) std::uint32_t scan_buffer[2][kHeads * 32];
  __shared__ std::uint32_t takes[kHeads], slice_tied[kHeads];
  __shared__ std::int32_t slice;
  __shared__ std::uint32_t before_slice;
  extern __shared__ __align__(16) unsigned char picks_smem[];
  const std::int32_t codewords = p.words.codewords, slices = p.slices;
  const std::int32_t heads = p.words.group_max ? 1 : p.words.group;
  auto* classes = reinterpret_cast<std::uint32_t*>(picks_smem);  // [codewords + 1], NaN last
  auto* kept = reinterpret_cast<std::uint16_t*>(classes + codewords + 1);  // [passes, kThreads]: walk 2's picks
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  programmatic_start();  // the classes, quotas and state
  const std::int64_t row = blockIdx.x;
  const CountRow r(p, row);
  std::uint32_t* const state = p.scratch.row_state + 2 * row;
  if (r.unranked(p) || state[0] != 0u) return;  // written by the thresholds kernel
  if (tid == 0) slice = std::int32_t(atomicAdd(state + 1, 1u));
  const std::uint32_t* const classes_in = p.scratch.classes + row * (std::int64_t(codewords) + 1);
  for (std::int32_t c = tid; c <= codewords; c += kThreads) classes[c] = classes_in[c];
  __syncthreads();
  const std::int32_t s = slice;
  using Walk = PicksWalk<kThreads, kHeads>;
  Walk walk{r, classes, codewords, max(r.lo, r.slice_begin(s)), r.slice_end(s), scan_buffer};
  const std::int32_t start = r.slice_begin(s);

  // A look-back: the sum of entry `at` of the slices before this one (1 + the value once published, 0 before).
  const auto sum_before = [&](const std::uint32_t* published, std::int32_t entries, std::int32_t at) {
    std::uint32_t sum = 0;
    for (std::int32_t i = lane; i < s; i += 32) {
      std::uint32_t v;
      while ((v = *reinterpret_cast<const volatile std::uint32_t*>(published + std::int64_t(i) * entries + at)) == 0u) {
        __nanosleep(64);
      }
      sum += v - 1;
    }
    return __reduce_add_sync(0xffffffffu, sum);
  };

  // Walk 1: the slice's tied tokens per head (taking none), published; the tied tokens it takes.
  const std::uint32_t none[kHeads] = {};
  walk.start();
  for (std::int32_t base = start; base < walk.end; base += Walk::kStride) walk.picks(base, none);
  if (tid == 0) {
#pragma unroll
    for (int h = 0; h < kHeads; ++h) slice_tied[h] = walk.tied_before[h];
  }
  __syncthreads();
  std::uint32_t* const published_tied = p.scratch.published_tied + row * slices * kVqCountSelectMaxHeads;
  if (tid < heads) {
    __threadfence();
    atomicExch(published_tied + s * kVqCountSelectMaxHeads + tid, slice_tied[tid] + 1);
  }
  if (warp < heads) {
    const std::uint32_t before = sum_before(published_tied, kVqCountSelectMaxHeads, warp);
    const std::uint32_t quota = p.scratch.quota[row * kVqCountSelectMaxHeads + warp];
    if (lane == 0) takes[warp] = quota > before ? min(quota - before, slice_tied[warp]) : 0u;
  }
  __syncthreads();

  // Walk 2: the slice's picks, kept (each thread's mask of each pass) and published; the picks of the slices before.
  std::uint32_t slice_picks = 0;
  walk.start();
  for (std::int32_t base = start, pass = 0; base < walk.end; base += Walk::kStride, ++pass) {
    const std::uint32_t picked = walk.picks(base, takes);
    kept[pass * kThreads + tid] = std::uint16_t(picked);
    slice_picks += walk.emit(picked, base, 0, nullptr, nullptr);
  }
  std::uint32_t* const published = p.scratch.published + row * slices;
  if (tid == 0) {
    __threadfence();
    atomicExch(published + s, slice_picks + 1);
  }
  if (warp == 0) {
    const std::uint32_t before = sum_before(published, 1, 0);
    if (lane == 0) before_slice = before;
  }
  __syncthreads();

  // Walk 3: the kept picks (each thread its own masks: no codes, no lookups) written after those of the slices
  // before; the last slice's CTA writes the row's count.
  std::int32_t* const indices = p.out.indices + row * p.out.capacity;
  float* const weights = p.out.log_weights != nullptr ? p.out.log_weights + row * p.out.capacity : nullptr;
  std::uint32_t written = before_slice;
  for (std::int32_t base = start, pass = 0; base < walk.end; base += Walk::kStride, ++pass) {
    written += walk.emit(kept[pass * kThreads + tid], base, written, indices, weights);
  }
  if (s == slices - 1 && tid == 0) p.out.counts[row] = std::int32_t(written);
}

}  // namespace

cudaError_t launch_vq_count_select(const VqCountSelectParams& p, cudaStream_t stream) {
  const std::int32_t heads = p.words.group_max ? 1 : p.words.group;
  // One score head (the group maximum) apart: its per-head registers and scans are an eighth of the union's.
  const auto for_heads = [&](auto&& launch_for) {
    return heads == 1 ? launch_for.template operator()<1>() : launch_for.template operator()<kVqCountSelectMaxHeads>();
  };
  if (p.slices == 0) {
    return for_heads([&]<int kHeads>() {
      constexpr auto kernel = vq_count_row_kernel<kVqCountRowThreads, kHeads>;
      if (cudaError_t s = open_shared_memory<kernel>(); s != cudaSuccess) return s;
      return launch(kernel,
                    {.grid = dim3(unsigned(p.rows)), .block = dim3(kVqCountRowThreads),
                     .smem = vq_count_row_smem_bytes(p.words.codewords, heads), .stream = stream,
                     .programmatic = true},
                    p);
    });
  }
  // The counts, classes, published values and row states start at zero: the tables' launch zeroed them
  // (VqCountSelectScratch).
  const std::size_t code_bytes = sizeof(std::uint32_t) * (std::size_t(p.words.codewords) + 1);
  const dim3 slices_grid(unsigned(p.rows), unsigned(p.slices));
  constexpr auto counts_kernel = vq_slice_counts_kernel<kVqCountSliceThreads>;
  constexpr auto thresholds_kernel = vq_count_thresholds_kernel<kVqCountRowThreads>;
  if (cudaError_t s = open_shared_memory<counts_kernel>(); s != cudaSuccess) return s;
  if (cudaError_t s = open_shared_memory<thresholds_kernel>(); s != cudaSuccess) return s;
  if (cudaError_t s = launch(counts_kernel, {.grid = slices_grid, .block = dim3(kVqCountSliceThreads), .smem = code_bytes,
                                             .stream = stream, .programmatic = true},
                             p);
      s != cudaSuccess) {
    return s;
  }
  if (cudaError_t s = launch(thresholds_kernel,
                             {.grid = dim3(unsigned(p.rows), unsigned(heads)), .block = dim3(kVqCountRowThreads),
                              .smem = vq_count_thresholds_smem_bytes(p.words.codewords), .stream = stream,
                              .programmatic = true},
                             p);
      s != cudaSuccess) {
    return s;
  }
  return for_heads([&]<int kHeads>() {
    constexpr auto picks_kernel = vq_count_picks_kernel<kVqCountSliceThreads, kHeads>;
    if (cudaError_t s = open_shared_memory<picks_kernel>(); s != cudaSuccess) return s;
    return launch(picks_kernel,
                  {.grid = slices_grid, .block = dim3(kVqCountSliceThreads),
                   .smem = vq_count_picks_smem_bytes(p.words.codewords, p.max_tokens, p.slices), .stream = stream,
                   .programmatic = true},
                  p);
  });
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
                          std::span<std::uint32_t> zeroed, cudaStream_t stream) {
  return with_vq_head_dim(q.head_dim, [&]<int D>() {
    const std::size_t smem = sizeof(float) * std::size_t(q.heads / codebook.kv_heads) * D;
    constexpr auto kernel = lut_kernel<T, D>;
    if (cudaError_t s = open_shared_memory<kernel>(); s != cudaSuccess) return s;
    const dim3 grid(unsigned((codebook.codewords + kThreads - 1) / kThreads), unsigned(codebook.kv_heads),
                    unsigned(q.batch));
    return launch(kernel, {.grid = grid, .block = dim3(kThreads), .smem = smem, .stream = stream, .programmatic = true},
                  q, codebook, lut, zeroed.data(), zeroed.size());
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
                                        std::span<std::uint32_t>, cudaStream_t);                                      \
  template cudaError_t launch_vq_lut_scan<T>(const QueryView<const T>&, const VqCodebook<T>&,                        \
                                             const VqCodesView<const std::uint16_t>&, const std::int32_t*,            \
                                             const std::int32_t*, const MatrixView<float>&, const VqScanOptions&,     \
                                             const VqScanGrid&, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
