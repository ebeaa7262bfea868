#pragma once
/// Kernels and launchers of cuda/page_bounds.hpp. The launchers' declarations compile anywhere (the host
/// compiler's src/selectors/quest/cuda/page_bounds.cpp checks the arguments and calls them); their bodies and the kernels
/// compile under nvcc only, instantiated once in kernels/page_bounds.cu. Launchers return the launch status and
/// never throw. Every kernel reads the device values it depends on (slots, lengths, counts) itself and follows
/// the out-of-range rules of cuda/page_bounds.hpp.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/supported_values.hpp"
#include "kvsift/selectors/quest/page_bounds_view.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

/// page_scores: pages per CTA, a power of two between these bounds (plan_score_chunk): the shortest chunk whose
/// CTAs fit in one wave (kScoreCtasPerSm per SM), so that each CTA streams its pages through the ring and no SM
/// waits on a second, short wave; rows too many for one wave take the longest. The streamed kernel at 128K, batch
/// 1 (8 rows of 8192 pages): 25.7 us in 512 CTAs of 128 pages (two waves, every CTA's chunk one ring's load, not
/// streamed), 21.5 us in one wave of 256 CTAs of 256 pages (H200).
inline constexpr int kScoreMinPagesPerCta = 64;
inline constexpr int kScoreMaxPagesPerCta = 8192;
inline constexpr int kScoreHeadTile = 8;
inline constexpr int kScoreThreads = 256;
/// Two CTAs per SM: at most 128 registers a thread (q takes 64; unbounded, ptxas gave the direct kernel 144
/// registers and one CTA fit), and the streamed kernel's 64 KB ring plus q's 8 KB at most, twice, fit in 228 KB.
inline constexpr int kScoreCtasPerSm = 2;
/// The direct kernel (page_scores_direct_kernel, code built before sm_90): steps of kPagesPerWarp pages whose
/// loads a warp issues before it uses the first (four spill at the kernel's 128 registers). That is one or two
/// 16-byte loads per lane in flight, about 32 KB per SM: it streamed at 1.4 TB/s on the H100, latency-bound
/// (docs/experiments.md#fused-quest-select).
inline constexpr int kScoreStepsInFlight = 2;
/// The streamed kernel (page_scores_kernel, sm_90): each CTA's pages pass through a ring of kScoreStages buffers
/// of kScoreStageBytes in shared memory, each filled by one bulk asynchronous copy, so up to 64 KB per CTA and
/// 128 KB per SM (two CTAs) are in flight while the warps score a stage that has landed. Bandwidth times loaded
/// latency asks for about 32 KB per SM (4.2 TB/s over 132 SMs is 32 bytes per ns per SM, at ~1 us); four times
/// that covers the start of each CTA, whose first stages are all in flight at once, and latency above 1 us.
/// 16 KB stages hold 8 (fp32, head_dim 256) to 64 (16-bit, head_dim 64) pages: one or two page steps of every
/// warp between the CTA barriers that free a buffer.
inline constexpr int kScoreStages = 4;
inline constexpr int kScoreStageBytes = 16 * 1024;
inline constexpr int kScoreRingBytes = kScoreStages * kScoreStageBytes;
/// The tensor-core kernel (page_scores_mma_kernel, sm_90, 16-bit bounds and groups of at most
/// kScoreMmaMaxGroup heads: one n8 tile): the same grid and chunk plan, a ring of kScoreMmaStages stages of
/// kScoreMmaStageBytes of bounds each (128, 64 or 32 pages at head_dim 64, 128, 256; about 33 KB padded), so
/// two CTAs (about 99-102 KB of ring each) still fit an SM's 228 KB and the grid stays one wave: up to 192 KB
/// per SM in flight as a CTA starts, 128 KB while its warps score a stage, as the streamed kernel's ring.
inline constexpr std::int32_t kScoreMmaMaxGroup = 8;
inline constexpr int kScoreMmaStages = 3;
inline constexpr int kScoreMmaStageBytes = 32 * 1024;
/// expand_pages: a CTA per chunk of kExpandPagesPerCta chosen pages of a row (a lane of its first warp each).
inline constexpr int kExpandThreads = 256;
inline constexpr std::int32_t kExpandPagesPerCta = 32;
inline std::int32_t expand_chunks(std::int32_t pages_capacity) {
  return std::max<std::int32_t>(1, (pages_capacity + kExpandPagesPerCta - 1) / kExpandPagesPerCta);
}

template <class T>
struct PageScoreParams {
  QueryView<const T> q;
  PageBoundsView<const T> bounds;
  const std::int32_t* slots;
  const std::int32_t* lengths;
  AttentionWindow window;
  MatrixView<float> scores;
  std::int32_t* page_counts;
  std::int32_t group;       ///< q.heads / bounds.kv_heads
  std::int32_t page_limit;  ///< min(bounds.max_pages, scores.cols): a row with more pages is refused on the device
  std::int32_t chunk;       ///< pages per CTA (plan_score_chunk)
  std::int32_t chunks;      ///< CTAs per row: ceil(page_limit / chunk)
};

/// page_scores' pages per CTA for `rows` rows of `page_limit` pages on `sms` SMs (kScoreMinPagesPerCta).
inline std::int32_t plan_score_chunk(std::int64_t rows, std::int32_t page_limit, int sms) {
  std::int32_t chunk = kScoreMinPagesPerCta;
  while (chunk < kScoreMaxPagesPerCta &&
         rows * ((page_limit + chunk - 1) / chunk) > std::int64_t(kScoreCtasPerSm) * sms) {
    chunk *= 2;
  }
  return chunk;
}

/// The parameters cuda::page_scores launches with on a device of `sms` SMs (its arguments checked).
template <class T>
PageScoreParams<T> plan_page_scores(const QueryView<const T>& q, const PageBoundsView<const T>& bounds,
                                    const std::int32_t* slots, const std::int32_t* lengths,
                                    const AttentionWindow& window, const MatrixView<float>& scores,
                                    std::int32_t* page_counts, int sms) {
  const std::int32_t page_limit = std::int32_t(std::min<std::int64_t>(bounds.max_pages, scores.cols));
  const std::int32_t chunk = plan_score_chunk(scores.rows, page_limit, sms);
  return {.q = q,
          .bounds = bounds,
          .slots = slots,
          .lengths = lengths,
          .window = window,
          .scores = scores,
          .page_counts = page_counts,
          .group = q.heads / bounds.kv_heads,
          .page_limit = page_limit,
          .chunk = chunk,
          .chunks = (page_limit + chunk - 1) / chunk};
}

template <class T, class KV>
cudaError_t launch_build_page_bounds(const KV& kv, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                                     cudaStream_t stream);
template <class T, class KV>
cudaError_t launch_append_page_bounds(const KV& kv, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                                      cudaStream_t stream);
/// Whether page_scores' bounds of type T may go through tensor cores: 16-bit types, whose products are exact in
/// fp32 (mma.sync accumulates in fp32); fp32 bounds would be rounded to tf32.
template <class T>
inline constexpr bool kScoresOnTensorCores = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;
/// The kernel launch_page_scores runs.
enum class PageScoreKernel {
  tensor_cores,  ///< page_scores_mma_kernel: kScoresOnTensorCores<T>, group <= kScoreMmaMaxGroup, code for sm_90
  streamed,      ///< page_scores_kernel: the other cases where the device runs code built for sm_90 or later
  direct,        ///< page_scores_direct_kernel: code built before sm_90
};
/// The kernel launch_page_scores runs for `params` on the current device (once per device and kernel: launch.cuh's
/// built_for_sm90); cudaErrorInvalidValue for a head_dim outside kCudaAttentionHeadDims.
template <class T>
cudaError_t choose_page_score_kernel(const PageScoreParams<T>& params, PageScoreKernel* kernel);
/// params.chunks * rows CTAs; head_dim must be one of kCudaAttentionHeadDims (core/supported_values.hpp). The
/// kernel choose_page_score_kernel names.
template <class T>
cudaError_t launch_page_scores(const PageScoreParams<T>& params, cudaStream_t stream);
/// The streamed kernel's scores, bit for bit, from the direct kernel (each warp loads its pages' bounds into
/// registers): the path of code built before sm_90, which has no bulk copies. Tests run it on any device.
template <class T>
cudaError_t launch_page_scores_direct(const PageScoreParams<T>& params, cudaStream_t stream);
cudaError_t launch_expand_pages(const SelectionView& pages, std::int32_t page_size, const std::int32_t* lengths,
                                const AttentionWindow& window, const SelectionView& out, cudaStream_t stream);

}  // namespace kvsift::cuda::detail

#if defined(__CUDACC__)

#include "kvsift/cuda/detail/decode_kernels.cuh"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {

inline constexpr int kPageBoundsThreads = 256;

/// One thread per (batch row, kv head, page, channel): consecutive threads read consecutive channels of a key
/// row, so each token's row is one coalesced read. Build runs at prefill; nothing here is tuned.
template <class T, class KV>
__global__ void build_page_bounds_kernel(KV kv, const std::int32_t* slots, PageBoundsView<T> bounds) {
  const std::int64_t per_row = std::int64_t(bounds.max_pages) * bounds.head_dim;
  const std::int64_t total = std::int64_t(kv.batch) * kv.kv_heads * per_row;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < total;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / per_row, page = i % per_row / bounds.head_dim, c = i % bounds.head_dim;
    const std::int64_t b = row / kv.kv_heads, h = row % kv.kv_heads;
    const std::int32_t slot = slots[b], len = kv.seq_len(b);
    const std::int64_t first = page * bounds.page_size;
    if (slot < 0 || slot >= bounds.slots || len > bounds.max_tokens() || first >= len) continue;
    const std::int64_t end = min(std::int64_t(len), first + bounds.page_size);
    T lo = kv.k_row(b, h, first)[c], hi = lo;
    float lo_f = to_float_device(lo), hi_f = lo_f;
    for (std::int64_t t = first + 1; t < end; ++t) {
      const T k = kv.k_row(b, h, t)[c];
      const float x = to_float_device(k);
      if (kvsift::detail::replaces_min(x, lo_f)) lo = k, lo_f = x;
      if (kvsift::detail::replaces_max(x, hi_f)) hi = k, hi_f = x;
    }
    bounds.lo(slot, h, page)[c] = lo;
    bounds.hi(slot, h, page)[c] = hi;
  }
}

/// One thread per (batch row, kv head, channel) of the step's token.
template <class T, class KV>
__global__ void append_page_bounds_kernel(KV kv, const std::int32_t* slots, PageBoundsView<T> bounds) {
  programmatic_start();  // the step's token in the cache
  const std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  if (i >= std::int64_t(kv.batch) * kv.kv_heads * bounds.head_dim) return;
  const std::int64_t row = i / bounds.head_dim, c = i % bounds.head_dim;
  const std::int64_t b = row / kv.kv_heads, h = row % kv.kv_heads;
  const std::int32_t slot = slots[b], len = kv.seq_len(b);
  if (slot < 0 || slot >= bounds.slots || len <= 0 || len > bounds.max_tokens()) return;
  const std::int32_t t = len - 1;
  const bool starts_page = t % bounds.page_size == 0;
  const T k = kv.k_row(b, h, t)[c];
  const float x = to_float_device(k);
  T* lo = bounds.lo(slot, h, t / bounds.page_size) + c;
  T* hi = lo + bounds.head_dim;
  if (starts_page || kvsift::detail::replaces_min(x, to_float_device(*lo))) *lo = k;
  if (starts_page || kvsift::detail::replaces_max(x, to_float_device(*hi))) *hi = k;
}

/// How page_scores spreads a page over lanes: each lane holds kChannels channels of lo and of hi, read as
/// kVecsPerLane 16-byte vectors per half; the kLanes lanes of a page read consecutive vectors, so one load
/// instruction covers whole 32-byte sectors of kPagesPerWarp pages (in shared memory, every quarter-warp reads
/// 128 contiguous bytes: no bank conflict).
template <class T, int HeadDim>
struct ScoreShape {
  static constexpr int kVec = 16 / int(sizeof(T));
  static constexpr int kVecsPerHalf = HeadDim / kVec;
  static constexpr int kLanes = kVecsPerHalf < 32 ? kVecsPerHalf : 32;
  static constexpr int kVecsPerLane = kVecsPerHalf / kLanes;
  static constexpr int kChannels = kVecsPerLane * kVec;
  static constexpr int kPagesPerWarp = 32 / kLanes;
  static constexpr int kPagesPerCtaStep = kPagesPerWarp * (kScoreThreads / 32);
  static constexpr int kPageElems = 2 * HeadDim;  ///< lo then hi
  static_assert(HeadDim % kVec == 0 && kVecsPerHalf % kLanes == 0);
};

/// Channel e of vector j of a lane (lane_in_page) of a page.
template <class S>
__device__ __forceinline__ int score_channel(int j, int e, int lane_in_page) {
  return (j * S::kLanes + lane_in_page) * S::kVec + e;
}

/// Stages the q of query heads [tile, tile + kScoreHeadTile) of kv head g's group in q_tile (zeros past the
/// group), then each lane's channels of it in q; returns the tile's head count. Called by every thread of the
/// CTA, once no thread reads q_tile any more (a barrier of the caller's); the barrier inside publishes the tile.
template <class T, int HeadDim>
__device__ __forceinline__ int load_q_tile(const QueryView<const T>& q_view, std::int64_t b, std::int64_t g,
                                           std::int32_t group, std::int32_t tile,
                                           float (&q_tile)[kScoreHeadTile][HeadDim],
                                           float (&q)[kScoreHeadTile][ScoreShape<T, HeadDim>::kChannels],
                                           int lane_in_page) {
  using S = ScoreShape<T, HeadDim>;
  const int heads = min(kScoreHeadTile, group - tile);
  for (int i = threadIdx.x; i < kScoreHeadTile * HeadDim; i += blockDim.x) {
    const int h = i / HeadDim, c = i % HeadDim;
    q_tile[h][c] = h < heads ? to_float_device(q_view.row(b, g * group + tile + h)[c]) : 0.0f;
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < kScoreHeadTile; ++h) {
#pragma unroll
    for (int j = 0; j < S::kVecsPerLane; ++j) {
#pragma unroll
      for (int e = 0; e < S::kVec; ++e) q[h][j * S::kVec + e] = q_tile[h][score_channel<S>(j, e, lane_in_page)];
    }
  }
  return heads;
}

/// A page's bound for the tile's first `heads` heads, from the vectors of lo and hi its lanes read: the maximum
/// over the heads of sum_c max(q_c lo_c, q_c hi_c) (partial sums per lane, added by shuffles over the page's
/// lanes), NaN where a lane of the page (page_lanes) holds a NaN bound. Every lane of the warp calls it with the
/// same `heads` (the shuffles), lanes of no page with any values, whose result nobody stores.
template <class T, int HeadDim>
__device__ __forceinline__ float page_bound(const float (&q)[kScoreHeadTile][ScoreShape<T, HeadDim>::kChannels],
                                            const uint4 (&lo_v)[ScoreShape<T, HeadDim>::kVecsPerLane],
                                            const uint4 (&hi_v)[ScoreShape<T, HeadDim>::kVecsPerLane], int heads,
                                            unsigned page_lanes) {
  using S = ScoreShape<T, HeadDim>;
  float lo[S::kChannels], hi[S::kChannels];
  bool nan = false;
#pragma unroll
  for (int j = 0; j < S::kVecsPerLane; ++j) {
    const T* lo_t = reinterpret_cast<const T*>(&lo_v[j]);
    const T* hi_t = reinterpret_cast<const T*>(&hi_v[j]);
#pragma unroll
    for (int e = 0; e < S::kVec; ++e) {
      lo[j * S::kVec + e] = to_float_device(lo_t[e]);
      hi[j * S::kVec + e] = to_float_device(hi_t[e]);
      nan |= kvsift::detail::bound_is_nan(lo[j * S::kVec + e], hi[j * S::kVec + e]);
    }
  }
  float best = -INFINITY;
#pragma unroll
  for (int h = 0; h < kScoreHeadTile; ++h) {
    if (h >= heads) break;  // uniform across the warp, so every lane reaches the same shuffles
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < S::kChannels; ++c) {
      sum = fmaf(q[h][c], kvsift::detail::bound_factor(q[h][c], lo[c], hi[c]), sum);
    }
#pragma unroll
    for (int offset = S::kLanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    best = kvsift::detail::max_keep_nan(best, sum);
  }
  nan = (__ballot_sync(0xffffffffu, nan) & page_lanes) != 0;
  return nan ? __int_as_float(0x7fffffff) : best;
}

/// A page's score: -inf when all its tokens are in the window, else its bound.
__device__ __forceinline__ float windowed_score(std::int64_t page, float bound, std::int32_t page_size,
                                                std::int32_t len, const AttentionWindow& window) {
  std::int64_t middle_first = 0, middle_last = 0;
  kvsift::detail::page_middle(page, page_size, len, window, &middle_first, &middle_last);
  return middle_first >= middle_last ? -INFINITY : bound;
}

/// The lanes of a warp that read the page of lane `lane` (a shuffle and ballot group of page_bound).
template <class S>
__device__ __forceinline__ unsigned page_lane_mask(int lane) {
  return (S::kLanes == 32 ? 0xffffffffu : (1u << S::kLanes) - 1u) << (lane / S::kLanes * S::kLanes);
}

/// The pages of one (row, kv head g) in [first_page, last_page), scored by the CTA from global memory: per tile of
/// up to kScoreHeadTile query heads of the group (load_q_tile), each warp takes kPagesPerWarp pages per step,
/// kScoreStepsInFlight steps at a time (every load of those steps issued before the first is used: a short read
/// needs many bytes in flight per SM): every lane reads its vectors of lo and hi once into registers and the
/// page's lanes form the bound (page_bound). store(page, score, tile) is called by one lane per page and tile,
/// the same lane in every tile; from the second tile on, the caller keeps the maximum (max_keep_nan).
template <class T, int HeadDim, class Store>
__device__ __forceinline__ void score_pages(const QueryView<const T>& q_view, const PageBoundsView<const T>& bounds,
                                            std::int32_t slot, std::int64_t b, std::int64_t g, std::int32_t group,
                                            std::int32_t len, const AttentionWindow& window, std::int64_t first_page,
                                            std::int64_t last_page, float (&q_tile)[kScoreHeadTile][HeadDim],
                                            Store store) {
  using S = ScoreShape<T, HeadDim>;
  constexpr int kSteps = kScoreStepsInFlight / S::kVecsPerLane > 0 ? kScoreStepsInFlight / S::kVecsPerLane : 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lane_in_page = lane % S::kLanes, page_in_warp = lane / S::kLanes;
  const unsigned page_lanes = page_lane_mask<S>(lane);
  for (std::int32_t tile = 0; tile < group; tile += kScoreHeadTile) {
    __syncthreads();  // the previous tile's q is read into registers by every thread
    float q[kScoreHeadTile][S::kChannels];
    const int heads = load_q_tile<T, HeadDim>(q_view, b, g, group, tile, q_tile, q, lane_in_page);
    const std::int64_t pages_per_cta_step = std::int64_t(S::kPagesPerWarp) * (blockDim.x / 32);
    for (std::int64_t step0 = first_page + warp * S::kPagesPerWarp; step0 < last_page;
         step0 += kSteps * pages_per_cta_step) {
      // Every lane of the warp goes through the shuffles below; inactive ones read nothing and write nothing.
      uint4 lo_v[kSteps][S::kVecsPerLane], hi_v[kSteps][S::kVecsPerLane];
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const std::int64_t page = step0 + u * pages_per_cta_step + page_in_warp;
        const bool active = page < last_page;
        const uint4* src = reinterpret_cast<const uint4*>(bounds.lo(slot, g, active ? page : first_page));
#pragma unroll
        for (int j = 0; j < S::kVecsPerLane; ++j) {
          lo_v[u][j] = active ? src[j * S::kLanes + lane_in_page] : make_uint4(0, 0, 0, 0);
          hi_v[u][j] = active ? src[S::kVecsPerHalf + j * S::kLanes + lane_in_page] : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const std::int64_t page = step0 + u * pages_per_cta_step + page_in_warp;
        const float bound = page_bound<T, HeadDim>(q, lo_v[u], hi_v[u], heads, page_lanes);
        if (page >= last_page || lane_in_page != 0) continue;
        store(page, windowed_score(page, bound, bounds.page_size, len, window), tile);
      }
    }
  }
}

/// What every page-score CTA does first (score_chunk): the row's slot and length, page_counts (by the row's first
/// CTA of kv head 0), and the CTA's pages of the row; inactive when it has none (the same for the whole CTA, so no
/// barrier after the test is skipped by part of it).
struct ScoreChunk {
  std::int64_t row, b, g;              ///< the row (b * kv_heads + g), its sequence and kv head
  std::int32_t slot, len;              ///< the row's slot and length
  std::int64_t first_page, last_page;  ///< the CTA's pages of the row
  bool active;                         ///< false: no pages (a bad slot or length, or a chunk past the row's pages)
};
template <class T>
__device__ __forceinline__ ScoreChunk score_chunk(const PageScoreParams<T>& p) {
  ScoreChunk c{};
  c.row = blockIdx.x / p.chunks;
  const std::int64_t chunk = blockIdx.x % p.chunks;
  c.b = c.row / p.bounds.kv_heads, c.g = c.row % p.bounds.kv_heads;
  c.slot = p.slots[c.b];
  c.len = p.lengths[c.b];
  const std::int64_t pages = kvsift::detail::page_count(c.len, p.bounds.page_size);
  const bool valid = c.slot >= 0 && c.slot < p.bounds.slots && c.len >= 0 && pages <= p.page_limit;
  if (chunk == 0 && c.g == 0 && threadIdx.x == 0) p.page_counts[c.b] = valid ? std::int32_t(pages) : -1;
  c.first_page = chunk * p.chunk;
  c.last_page = min(c.first_page + p.chunk, pages);
  c.active = valid && c.first_page < pages;
  return c;
}

/// One CTA per (row, chunk of p.chunk pages), scoring them into p.scores from global memory (score_pages).
template <class T, int HeadDim>
__global__ void __launch_bounds__(kScoreThreads, kScoreCtasPerSm)
    page_scores_direct_kernel(const __grid_constant__ PageScoreParams<T> p) {
  __shared__ float q_tile[kScoreHeadTile][HeadDim];
  programmatic_start();  // the lengths, the bounds' append
  const ScoreChunk c = score_chunk(p);
  if (!c.active) return;  // the whole CTA: no barrier below is skipped by part of it
  float* out = p.scores.row(c.row);
  score_pages<T, HeadDim>(p.q, p.bounds, c.slot, c.b, c.g, p.group, c.len, p.window, c.first_page, c.last_page,
                          q_tile,
                          [&](std::int64_t page, float score, std::int32_t tile) {
                            out[page] = tile == 0 ? score : kvsift::detail::max_keep_nan(out[page], score);
                          });
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
/// sm_90 bulk asynchronous copies: global to shared memory, `bytes` a multiple of 16 from and to 16-byte aligned
/// addresses, completing their bytes on an mbarrier of the CTA (whose phase ends when the bytes its arrival
/// expected have landed).
__device__ __forceinline__ unsigned shared_word(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init(std::uint64_t* barrier, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_word(barrier)), "r"(arrivals) : "memory");
}
/// Orders this thread's shared-memory accesses so far (generic proxy) before later bulk copies' (async proxy):
/// the mbarriers' initialization before their completions, a stage's reads before its refill.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
/// This thread's arrival, expecting `bytes` more of copies before the phase ends.
__device__ __forceinline__ void mbarrier_arrive_expect(std::uint64_t* barrier, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_word(barrier)), "r"(bytes)
               : "memory");
}
/// Waits until the phase of parity `parity` has ended.
__device__ __forceinline__ void mbarrier_wait(std::uint64_t* barrier, unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_word(barrier)), "r"(parity)
        : "memory");
  } while (done == 0);
}
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, unsigned bytes,
                                                    std::uint64_t* barrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_word(dst)),
               "l"(src), "r"(bytes), "r"(shared_word(barrier))
               : "memory");
}
#endif

/// One CTA per (row, chunk of p.chunk pages), as page_scores_direct_kernel, with the chunk's bounds streamed
/// through shared memory. They are contiguous (pages [first_page, last_page) of one slot and kv head, 2 x head_dim
/// values each, 16-byte aligned: bounds.data is, and a page is a multiple of 256 bytes), cut into stages of
/// kStagePages pages. Thread 0 fills a ring of kScoreStages buffers, one cp.async.bulk per stage completing on
/// the buffer's mbarrier; every warp waits for the stage in turn and scores its pages in steps of kPagesPerWarp
/// from shared memory (page_bound: the lane layout and arithmetic of the direct kernel, so the same scores bit
/// for bit); after a proxy fence and a CTA barrier (every warp done with the buffer) thread 0 refills it with the
/// stage kScoreStages ahead, so the ring keeps up to kScoreRingBytes in flight. A group of more than kScoreHeadTile
/// heads streams the chunk once per tile of heads, as the direct kernel reads it; the ring runs on across tiles.
/// Code built before sm_90 has an empty body: launch_page_scores runs the direct kernel there.
template <class T, int HeadDim>
__global__ void __launch_bounds__(kScoreThreads, kScoreCtasPerSm)
    page_scores_kernel(const __grid_constant__ PageScoreParams<T> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = ScoreShape<T, HeadDim>;
  constexpr int kPageBytes = S::kPageElems * int(sizeof(T));
  constexpr int kStagePages = kScoreStageBytes / kPageBytes;
  constexpr int kWarpSteps = (kStagePages + S::kPagesPerCtaStep - 1) / S::kPagesPerCtaStep;
  static_assert(kPageBytes % 16 == 0 && kStagePages >= 1, "bulk copies move whole 16-byte units of whole pages");
  extern __shared__ __align__(128) unsigned char ring[];  // kScoreStages buffers of kScoreStageBytes
  __shared__ float q_tile[kScoreHeadTile][HeadDim];
  __shared__ std::uint64_t landed[kScoreStages];  // buffer i's stage has landed (one phase per fill)
  programmatic_start();  // the lengths, the bounds' append
  const ScoreChunk c = score_chunk(p);
  if (!c.active) return;  // the whole CTA: no barrier below is skipped by part of it
  const int pages = int(c.last_page - c.first_page);  // at most p.chunk
  const int stages = (pages + kStagePages - 1) / kStagePages;
  const int items = stages * ((p.group + kScoreHeadTile - 1) / kScoreHeadTile);  // (tile, stage) in order
  const T* source = p.bounds.lo(c.slot, c.g, c.first_page);
  const auto fill = [&](int item) {
    const int stage = item % stages, buffer = item % kScoreStages;
    const unsigned bytes = unsigned(min(kStagePages, pages - stage * kStagePages) * kPageBytes);
    mbarrier_arrive_expect(&landed[buffer], bytes);
    bulk_copy_to_shared(ring + buffer * kScoreStageBytes, source + std::int64_t(stage) * kStagePages * S::kPageElems,
                        bytes, &landed[buffer]);
  };
  if (threadIdx.x == 0) {
    for (int i = 0; i < kScoreStages; ++i) mbarrier_init(&landed[i], 1);
    fence_proxy_async();
    for (int item = 0; item < min(kScoreStages, items); ++item) fill(item);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int lane_in_page = lane % S::kLanes, page_in_warp = lane / S::kLanes;
  const unsigned page_lanes = page_lane_mask<S>(lane);
  float* out = p.scores.row(c.row);
  float q[kScoreHeadTile][S::kChannels];
  int heads = 0;
  for (int item = 0; item < items; ++item) {
    const int stage = item % stages, tile = item / stages * kScoreHeadTile, buffer = item % kScoreStages;
    // A new tile: the barrier ending the previous item ordered every read of q_tile; the first tile's barrier
    // also orders thread 0's mbarrier initialization before every thread's wait.
    if (stage == 0) heads = load_q_tile<T, HeadDim>(p.q, c.b, c.g, p.group, tile, q_tile, q, lane_in_page);
    mbarrier_wait(&landed[buffer], unsigned(item / kScoreStages) & 1u);
    const T* staged = reinterpret_cast<const T*>(ring + buffer * kScoreStageBytes);
    const int stage_pages = min(kStagePages, pages - stage * kStagePages);
#pragma unroll
    for (int step = 0; step < kWarpSteps; ++step) {
      const int warp_first = step * S::kPagesPerCtaStep + warp * S::kPagesPerWarp;
      if (warp_first >= stage_pages) break;  // uniform across the warp, so every lane reaches the same shuffles
      // Lanes past the stage's pages read its first page (landed) and store nothing.
      const int local = warp_first + page_in_warp;
      const bool active = local < stage_pages;
      const uint4* src = reinterpret_cast<const uint4*>(staged + (active ? local : 0) * S::kPageElems);
      uint4 lo_v[S::kVecsPerLane], hi_v[S::kVecsPerLane];
#pragma unroll
      for (int j = 0; j < S::kVecsPerLane; ++j) {
        lo_v[j] = src[j * S::kLanes + lane_in_page];
        hi_v[j] = src[S::kVecsPerHalf + j * S::kLanes + lane_in_page];
      }
      const float bound = page_bound<T, HeadDim>(q, lo_v, hi_v, heads, page_lanes);
      if (!active || lane_in_page != 0) continue;
      const std::int64_t page = c.first_page + std::int64_t(stage) * kStagePages + local;
      const float score = windowed_score(page, bound, p.bounds.page_size, c.len, p.window);
      out[page] = tile == 0 ? score : kvsift::detail::max_keep_nan(out[page], score);
    }
    fence_proxy_async();  // this thread's reads of the buffer before thread 0's refill of it
    __syncthreads();      // every warp is done with the buffer
    if (threadIdx.x == 0 && item + kScoreStages < items) fill(item + kScoreStages);
  }
#endif
}

/// The tensor-core kernel's shape at one head_dim (16-bit bounds): a page's bounds row [lo | hi] is one row of A,
/// K = 2 * HeadDim. Stages hold whole m16 tiles in rows padded by 16 bytes: unpadded, the 8 rows one ldmatrix
/// matrix reads lie a multiple of 256 bytes apart, in the same 4 banks (8-way conflicts); padded, each row starts
/// 4 banks after the previous one, so the 8 rows cover all 32.
template <int HeadDim>
struct MmaScoreShape {
  static constexpr int kPageBytes = 2 * HeadDim * 2;
  static constexpr int kRowBytes = kPageBytes + 16;
  static constexpr int kStagePages = kScoreMmaStageBytes / kPageBytes;
  static constexpr int kBufferBytes = kStagePages * kRowBytes;
  static constexpr int kRingBytes = kScoreMmaStages * kBufferBytes;
  static constexpr int kKSteps = 2 * HeadDim / 16;
  static_assert(kStagePages % 16 == 0, "stages of whole m16 tiles");
  static_assert(kRowBytes % 128 == 16, "rows 4 banks apart");
};

/// One CTA per (row, chunk of p.chunk pages), as page_scores_kernel, for 16-bit bounds and groups of at most
/// kScoreMmaMaxGroup heads. A page's bound for head h,
///   sum_c max(q_c lo_c, q_c hi_c) = sum_c min(q_c, 0) lo_c + max(q_c, 0) hi_c   (exact for lo <= hi)
/// is dot([lo | hi], w_h) with w_h = [q- | q+], so a chunk's scores are the GEMM [pages x 2 head_dim] x [2 head_dim
/// x group] on tensor cores (mma.sync m16n8k16, the group's heads as the 8 columns, zero past the group). The
/// weights are q or zero, exact in T; the products are exact in fp32 and accumulate in fp32, in another order
/// than the CUDA-core kernels', so the scores agree with theirs within fp32 summation, not bit for bit. A page's
/// score is the same wherever it lies in a chunk (each row of C is its own dot products), so it does not depend
/// on the chunk plan.
/// NaN never vanishes: a NaN bound makes every product with it NaN, zero weights included (0 * NaN), so every
/// column of its page; a NaN in q goes to the lo weight, as bound_factor picks lo. What differs from the CUDA-core
/// kernels: an infinite bound multiplies a zero weight too (0 * inf = NaN), so a page with an infinite lo or hi
/// scores NaN where they may give +-inf (build_page_bounds writes infinite bounds only from infinite keys).
/// Warp 0 fills a ring of kScoreMmaStages buffers, one bulk copy per page into a padded row (lane i: the stage's
/// pages i, i + 32, ...) completing on the buffer's mbarrier; each warp takes the stage's 16-page tiles t with
/// t % 8 == warp: ldmatrix.x4 per k-step of 16 channels, one mma into the tile's C, whose rows' maxima over the
/// group's columns (max_keep_nan; columns past the group are left out) are the pages' bounds. After a proxy fence
/// and a CTA barrier warp 0 refills the buffer with the stage kScoreMmaStages ahead. Code built before sm_90 has
/// an empty body: choose_page_score_kernel names the direct kernel there.
template <class T, int HeadDim>
__global__ void __launch_bounds__(kScoreThreads, kScoreCtasPerSm)
    page_scores_mma_kernel(const __grid_constant__ PageScoreParams<T> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(kScoresOnTensorCores<T>);
  using M = MmaScoreShape<HeadDim>;
  constexpr int kWarps = kScoreThreads / 32;
  extern __shared__ __align__(128) unsigned char ring[];  // kScoreMmaStages buffers of M::kBufferBytes
  __shared__ std::uint64_t landed[kScoreMmaStages];       // buffer i's stage has landed (one phase per fill)
  programmatic_start();  // the lengths, the bounds' append
  const ScoreChunk c = score_chunk(p);
  if (!c.active) return;  // the whole CTA: no barrier below is skipped by part of it
  const int pages = int(c.last_page - c.first_page);  // at most p.chunk
  const int stages = (pages + M::kStagePages - 1) / M::kStagePages;
  const T* source = p.bounds.lo(c.slot, c.g, c.first_page);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Called by every lane of warp 0. The expectation comes first, so that no copy's bytes complete before it.
  const auto fill = [&](int stage) {
    const int buffer = stage % kScoreMmaStages, first = stage * M::kStagePages;
    const int count = min(M::kStagePages, pages - first);
    if (lane == 0) mbarrier_arrive_expect(&landed[buffer], unsigned(count * M::kPageBytes));
    __syncwarp();
    for (int i = lane; i < count; i += 32) {
      bulk_copy_to_shared(ring + buffer * M::kBufferBytes + i * M::kRowBytes,
                          source + std::int64_t(first + i) * (2 * HeadDim), M::kPageBytes, &landed[buffer]);
    }
  };
  if (threadIdx.x == 0) {
    for (int i = 0; i < kScoreMmaStages; ++i) mbarrier_init(&landed[i], 1);
    fence_proxy_async();
  }
  __syncthreads();  // the initialization before warp 0's copies and every warp's waits
  if (warp == 0) {
    for (int stage = 0; stage < min(kScoreMmaStages, stages); ++stage) fill(stage);
  }
  // B fragments (while the first stages land), K = 2 * HeadDim rows by 8 columns: lane holds column n = lane / 4
  // (head n of the group, zero past it) at rows 16 s + 2 (lane % 4) + {0, 1} (b[s][0]) and the same + 8 (b[s][1]),
  // two T per register, the lower row in the lower half. Rows below HeadDim weigh lo: q where q < 0 or NaN (where
  // bound_factor picks lo), else 0; rows from HeadDim weigh hi: q where q >= 0, else 0.
  const int col = 2 * (lane % 4);
  unsigned b[M::kKSteps][2];
  {
    const int n = lane / 4;
    const T* q = n < p.group ? p.q.row(c.b, c.g * p.group + n) : nullptr;
#pragma unroll
    for (int s = 0; s < M::kKSteps / 2; ++s) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        unsigned lo_weights = 0, hi_weights = 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const T x = q != nullptr ? q[16 * s + col + 8 * r + e] : T{};
          (to_float_device(x) >= 0.0f ? hi_weights : lo_weights) |= unsigned(x.bits) << (16 * e);
        }
        b[s][r] = lo_weights;
        b[s + M::kKSteps / 2][r] = hi_weights;
      }
    }
  }
  float* out = p.scores.row(c.row);
  const unsigned ring_word = shared_word(ring);
  for (int stage = 0; stage < stages; ++stage) {
    const int buffer = stage % kScoreMmaStages, first = stage * M::kStagePages;
    const int count = min(M::kStagePages, pages - first);
    mbarrier_wait(&landed[buffer], unsigned(stage / kScoreMmaStages) & 1u);
    for (int tile = warp * 16; tile < count; tile += kWarps * 16) {  // uniform across the warp (.sync.aligned)
      // ldmatrix.x4's matrices: rows 0-7 then 8-15 of the tile (lane & 15) at channels k, then the same at k + 8
      // (lane / 16), giving A's a0..a3. Rows past the stage's pages read its last page (landed); nobody stores them.
      const int row = min(tile + (lane & 15), count - 1);
      const unsigned a_row = ring_word + unsigned(buffer * M::kBufferBytes + row * M::kRowBytes + lane / 16 * 16);
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int s = 0; s < M::kKSteps; ++s) {
        unsigned a[4];
        ldmatrix_x4(a, a_row + 32u * s);
        mma_16x8x16<T>(acc, a, b[s][0], b[s][1]);
      }
      // C: this lane holds rows lane / 4 (acc[0], acc[1]) and lane / 4 + 8 (acc[2], acc[3]) at columns col, col + 1;
      // the maximum over the group's columns, then over the row's 4 lanes.
      float bound[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (col + e >= p.group) break;
        bound[0] = kvsift::detail::max_keep_nan(bound[0], acc[e]);
        bound[1] = kvsift::detail::max_keep_nan(bound[1], acc[2 + e]);
      }
#pragma unroll
      for (int offset = 1; offset < 4; offset *= 2) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          bound[h] = kvsift::detail::max_keep_nan(bound[h], __shfl_xor_sync(0xffffffffu, bound[h], offset));
        }
      }
      if (lane % 4 != 0) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int local = tile + lane / 4 + 8 * h;
        if (local >= count) break;
        const std::int64_t page = c.first_page + first + local;
        out[page] = windowed_score(page, bound[h], p.bounds.page_size, c.len, p.window);
      }
    }
    fence_proxy_async();  // this thread's reads of the buffer before warp 0's refill of it
    __syncthreads();      // every warp is done with the buffer
    if (warp == 0 && stage + kScoreMmaStages < stages) fill(stage + kScoreMmaStages);
  }
#endif
}

/// The middle tokens of chosen page `page` ([*first, first + return value)): page_middle's range, empty as 0.
__device__ __forceinline__ std::int32_t page_middle_count(std::int32_t page, std::int32_t page_size, std::int32_t len,
                                                         const AttentionWindow& window, std::int64_t* first) {
  std::int64_t last = 0;
  kvsift::detail::page_middle(page, page_size, len, window, first, &last);
  return *first < last ? std::int32_t(last - *first) : 0;
}

/// Grid: rows x expand_chunks(capacity) CTAs, chunk c of a row writing the middle tokens of its chosen pages
/// [c * kExpandPagesPerCta, ...) in order, weight 0 where out has weights. Each CTA counts the tokens of the row's
/// pages before its chunk itself (a strided sum over at most `count` page ids, from L2), so the chunks need no
/// second launch or grid barrier; chunk 0 sums every page, the row's count. One CTA per row, as first written,
/// spent 7.5 µs on 128 pages and 28 µs on 512 (8 CTAs on the GPU at batch 1, rounds of block scans).
template <int Threads>
__global__ void __launch_bounds__(Threads)
    expand_pages_kernel(SelectionView pages, std::int32_t page_size, const std::int32_t* lengths,
                        AttentionWindow window, SelectionView out) {
  static_assert(Threads % 32 == 0 && kExpandPagesPerCta == 32, "one lane per page of a chunk");
  constexpr int kWarps = Threads / 32;
  __shared__ std::int32_t warp_sums[kWarps];
  __shared__ std::int32_t ends[kExpandPagesPerCta];     ///< one past each page's last output position
  __shared__ std::int64_t firsts[kExpandPagesPerCta];  ///< each page's first middle token
  programmatic_start();  // the chosen pages
  const std::int32_t chunk = std::int32_t(blockIdx.y);
  const std::int64_t row = blockIdx.x, b = row / pages.kv_heads;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const std::int32_t count = pages.counts[row];
  if (count < 0 || count > pages.capacity) {  // the same for the whole CTA
    if (chunk == 0 && threadIdx.x == 0) out.counts[row] = -1;
    return;
  }
  const std::int32_t begin = chunk * kExpandPagesPerCta;
  if (chunk > 0 && begin >= count) return;  // the same for the whole CTA; chunk 0 writes the count even when 0
  const std::int32_t* chosen = pages.indices + row * pages.capacity;
  const std::int32_t len = lengths[b];
  // Tokens of the pages before this chunk; for chunk 0, of every page.
  const std::int32_t summed_pages = chunk == 0 ? count : begin;
  std::int32_t sum = 0;
  for (std::int32_t i = std::int32_t(threadIdx.x); i < summed_pages; i += Threads) {
    std::int64_t first = 0;
    sum += page_middle_count(chosen[i], page_size, len, window, &first);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) warp_sums[warp] = sum;
  // Lane i of warp 0: the chunk's page i, its token count scanned over the chunk.
  std::int64_t first = 0;
  const std::int32_t page = begin + lane;
  const std::int32_t n = warp == 0 && page < count ? page_middle_count(chosen[page], page_size, len, window, &first) : 0;
  const std::int32_t end = warp_inclusive_sum(n);
  __syncthreads();  // warp_sums
  std::int32_t total = 0;
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  const std::int32_t before = chunk == 0 ? 0 : total;
  if (chunk == 0 && threadIdx.x == 0) out.counts[row] = total;
  if (warp == 0) {
    ends[lane] = before + end;
    firsts[lane] = first;
  }
  __syncthreads();
  std::int32_t* dst = out.indices + row * out.capacity;
  float* weights = out.log_weights ? out.log_weights + row * out.capacity : nullptr;
  const std::int32_t pages_here = min(kExpandPagesPerCta, count - begin);
  // A warp per page: its tokens are consecutive, so each store instruction is contiguous.
  for (std::int32_t p = warp; p < pages_here; p += kWarps) {
    const std::int32_t start = p == 0 ? before : ends[p - 1];
    const std::int32_t tokens = ends[p] - start;
    for (std::int32_t k = lane; k < tokens; k += 32) {
      dst[start + k] = std::int32_t(firsts[p] + k);
      if (weights) weights[start + k] = 0.0f;
    }
  }
}

template <class T, class KV>
cudaError_t launch_build_page_bounds(const KV& kv, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                                     cudaStream_t stream) {
  const std::int64_t items = std::int64_t(kv.batch) * kv.kv_heads * bounds.max_pages * bounds.head_dim;
  build_page_bounds_kernel<T, KV><<<grid_stride_blocks(items, kPageBoundsThreads), kPageBoundsThreads, 0, stream>>>(
      kv, slots, bounds);
  return cudaGetLastError();
}

template <class T, class KV>
cudaError_t launch_append_page_bounds(const KV& kv, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                                      cudaStream_t stream) {
  const std::int64_t items = std::int64_t(kv.batch) * kv.kv_heads * bounds.head_dim;
  const unsigned blocks = unsigned((items + kPageBoundsThreads - 1) / kPageBoundsThreads);
  return launch(append_page_bounds_kernel<T, KV>,
                {.grid = dim3(blocks), .block = dim3(kPageBoundsThreads), .stream = stream, .programmatic = true}, kv,
                slots, bounds);
}

template <class T>
cudaError_t choose_page_score_kernel(const PageScoreParams<T>& params, PageScoreKernel* kernel) {
  *kernel = PageScoreKernel::direct;
  cudaError_t status = cudaSuccess;
  const bool dispatched = dispatch_value<kCudaAttentionHeadDims>(params.bounds.head_dim, [&]<int HeadDim>() {
    bool sm90 = false;
    if constexpr (kScoresOnTensorCores<T>) {
      if (params.group <= kScoreMmaMaxGroup) {
        status = built_for_sm90<page_scores_mma_kernel<T, HeadDim>>(&sm90);
        if (sm90) *kernel = PageScoreKernel::tensor_cores;
        return;
      }
    }
    status = built_for_sm90<page_scores_kernel<T, HeadDim>>(&sm90);
    if (sm90) *kernel = PageScoreKernel::streamed;
  });
  return dispatched ? status : cudaErrorInvalidValue;
}

/// A kernel of the sm_90 ring (page_scores_kernel, page_scores_mma_kernel) with `smem` bytes of ring, opted in to
/// more than 48 KB of dynamic shared memory once per device and kernel (launch.cuh).
template <auto Kernel, class T>
cudaError_t launch_ring_scores(const PageScoreParams<T>& params, int smem, cudaStream_t stream) {
  const cudaError_t status = open_shared_memory<Kernel>();
  if (status != cudaSuccess) return status;
  return launch(Kernel,
                {.grid = dim3(unsigned(std::int64_t(params.chunks) * params.scores.rows)),
                 .block = dim3(kScoreThreads), .smem = std::size_t(smem), .stream = stream, .programmatic = true},
                params);
}

template <class T>
cudaError_t launch_page_scores(const PageScoreParams<T>& params, cudaStream_t stream) {
  PageScoreKernel kernel = PageScoreKernel::direct;
  cudaError_t status = choose_page_score_kernel(params, &kernel);
  if (status != cudaSuccess) return status;
  if (kernel == PageScoreKernel::direct) return launch_page_scores_direct(params, stream);
  dispatch_value<kCudaAttentionHeadDims>(params.bounds.head_dim, [&]<int HeadDim>() {  // choose's head_dims
    if constexpr (kScoresOnTensorCores<T>) {
      if (kernel == PageScoreKernel::tensor_cores) {
        status = launch_ring_scores<page_scores_mma_kernel<T, HeadDim>>(params, MmaScoreShape<HeadDim>::kRingBytes,
                                                                        stream);
        return;
      }
    }
    status = launch_ring_scores<page_scores_kernel<T, HeadDim>>(params, kScoreRingBytes, stream);
  });
  return status;
}

template <class T>
cudaError_t launch_page_scores_direct(const PageScoreParams<T>& params, cudaStream_t stream) {
  const unsigned blocks = unsigned(std::int64_t(params.chunks) * params.scores.rows);
  cudaError_t status = cudaSuccess;
  const bool dispatched = dispatch_value<kCudaAttentionHeadDims>(params.bounds.head_dim, [&]<int HeadDim>() {
    status = launch(page_scores_direct_kernel<T, HeadDim>,
                    {.grid = dim3(blocks), .block = dim3(kScoreThreads), .stream = stream, .programmatic = true}, params);
  });
  return dispatched ? status : cudaErrorInvalidValue;
}

}  // namespace kvsift::cuda::detail

#endif  // defined(__CUDACC__)
