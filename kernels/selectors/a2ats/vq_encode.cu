// cuda::vq_encode (selectors/a2ats/cuda/vq.hpp) on tensor cores: code = argmin_c |C^z_c|^2 - 2 z . C^z_c, ranked as the largest
// s_c = z . C^z_c - |C^z_c|^2 / 2, without ever writing the [keys, codewords] scores.
//
// A block owns 256 keys of one kv head (8 warps x 32 rows). It first computes z = k L for them in fp32 on CUDA
// cores (32 keys at a time staged in shared memory; each warp sums two column blocks of L, one near the diagonal
// and one far from it, so that every warp does the same number of FMAs of the triangle) and keeps z in shared
// memory [256, D + 4] fp32; each warp rounds its 32 rows to bf16 MMA fragments held in registers for the whole
// codebook. The codebook then streams through shared memory in tiles of 32 codewords: every thread loads its share
// of the next fp32 tile (16-byte loads, L2-resident: one kv head's C^z is 2 MiB) while the warps run the current
// one, and rounds it to bf16 into the other of two buffers (rows padded by 16 bytes: ldmatrix without bank
// conflicts); one barrier per tile. (Starting each block at its own tile, with loads two tiles ahead, ran 2x
// slower on the H100: 17.2 ms against 8.7 ms at 128K keys x 8 kv heads.) Each warp runs mma.sync m16n8k16 (bf16,
// fp32 accumulation) of its 32 rows against the tile, adds -|C^z_c|^2 / 2 and keeps, per row, the best two
// (score, code) of the codewords its lane sees (a quarter of them: the accumulator layout gives a lane two of
// every eight columns).
//
// Exactness. bf16 rounding of z and C^z (2^-8 relative each) moves a score by at most
//   E = 2^-7 (1 + 1/16) |z| max_c |C^z_c| + 2^-20 max_c |C^z_c|^2 / 2
// (Cauchy-Schwarz over the products, the 1/16 and the second term covering fp32 accumulation and the offset's
// rounding). After the loop the quad of lanes sharing a row merges its lists into the row's best four bf16
// scores (ties: smaller code). Every codeword whose bf16 score is within 2E of the leader's is a possible winner;
// when the leader is alone there, it is the fp32 argmin and no fp32 work is done. Otherwise the kept candidates
// in that window are re-scored in fp32 (z from shared memory, C^z from L2, the quad splitting the dimensions)
// and the best fp32 score wins (ties: smaller code), as on the CPU. The codes therefore equal the fp32 argmin
// except where the fp32 scores are within rounding of a tie, or (not seen in the tests) where more than three
// other codewords crowd the leader's window and the fp32 winner ranked fifth or lower in bf16.
//
// Few rows (an append's one key per sequence, the last rows of a prefill: up to kVqEncodeFewRows) go to a second
// kernel on CUDA cores, since the tensor-core one would run one block per kv head, each streaming 2 MiB (121 us
// for one row x 8 kv heads on the H100). A block takes 8 rows of one kv head and a slice of its codewords; the
// slices of a (row group, kv head) are the blocks of one thread-block cluster (sm_90; up to 8, as many as keep
// every SM busy), so the whole GPU streams each codebook once. A block copies L's lower triangle and its first
// three 64-codeword stages of C^z with cp.async, transforms its keys while they land, then scores each stage in
// fp32 (four lanes per codeword, the next two stages in flight) and keeps each row's best: the fp32 argmin of its
// slice, ties to the smaller code, with no bf16 step and so no window. The block's winners then merge in fixed
// order (lanes, warps, then the cluster's blocks in rank order through distributed shared memory; ties: smaller
// code), and the cluster's first block writes the codes. Code built without sm_90 runs one block per (row group,
// kv head) over the whole codebook.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kvsift/cuda/detail/decode_kernels.cuh"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/selectors/a2ats/cuda/detail/vq_encode_launch.hpp"
#include "kvsift/selectors/a2ats/cuda/detail/vq_launch.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kWarpRows = 32;                   ///< two m16 tiles per warp
constexpr int kBlockRows = kWarps * kWarpRows;  ///< keys per block
constexpr int kTile = 32;                       ///< codewords per shared-memory tile: four n8 tiles
constexpr int kChunk = 32;                      ///< keys per z = k L pass
constexpr std::int32_t kNoCode = 0x7fffffff;
constexpr float kRelError = (1.0f + 1.0f / 16) / 128, kAbsError = 1.0f / (1 << 20);  ///< E above

template <int D>
struct EncodeLayout {
  static constexpr int kZPitch = D + 4;  ///< floats; keeps 16-byte rows
  static constexpr int kBPitch = D + 8;  ///< bf16; the 16-byte shift per row spreads ldmatrix over all banks
  static constexpr std::size_t kZBytes = sizeof(float) * kBlockRows * kZPitch;
  static constexpr std::size_t kTileBytes = 2 * std::size_t(kTile) * kBPitch;
  static constexpr std::size_t kBytes = kZBytes + 2 * kTileBytes + 2 * kTile * sizeof(float);
  static_assert(kChunk * D * sizeof(float) <= 2 * kTileBytes, "a chunk of keys is staged in the tile buffers");
  static_assert(kTile * D / 4 % kThreads == 0, "whole 16-byte loads per thread per tile");
};

struct Candidate {
  float s;
  std::int32_t c;
};

/// The ranking order: higher score, then smaller code.
__device__ __forceinline__ bool better(const Candidate& a, const Candidate& b) {
  return a.s > b.s || (a.s == b.s && a.c < b.c);
}

/// The best four of two sorted lists of four, sorted, into a: a against b reversed keeps the best four as a
/// bitonic sequence, which two compare-exchange rounds sort (fixed register indices throughout).
__device__ __forceinline__ void merge_best4(Candidate (&a)[4], const Candidate (&b)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (better(b[3 - i], a[i])) a[i] = b[3 - i];
  }
  const auto exchange = [](Candidate& x, Candidate& y) {
    if (better(y, x)) {
      const Candidate t = x;
      x = y;
      y = t;
    }
  };
  exchange(a[0], a[2]);
  exchange(a[1], a[3]);
  exchange(a[0], a[1]);
  exchange(a[2], a[3]);
}

/// Offers (s, c) to a lane's best two of a row. A lane sees its codes in ascending order, so the strict
/// comparisons keep the smaller code of equal scores; NaN never enters.
__device__ __forceinline__ void offer(Candidate (&best)[2], float s, std::int32_t c) {
  if (s > best[1].s) {
    if (s > best[0].s) {
      best[1] = best[0];
      best[0] = {s, c};
    } else {
      best[1] = {s, c};
    }
  }
}

/// z = k L for the block's keys [r0, r0 + kBlockRows) of kv head h into z_s (keys past the batch: z = 0), in
/// chunks of kChunk keys staged in k_s [kChunk, D] fp32. z_j = sum_{i >= j} k_i L[i][j] in ascending i; the upper
/// triangle of L is never read.
template <class T, int D>
__device__ void transform_keys(const HeadsView<const T>& keys, std::int32_t h, std::int64_t r0, const float* transform,
                               float* k_s, float* z_s) {
  constexpr int kPairs = D / 64, kGroups = kWarps / kPairs, kRowsPer = kChunk / kGroups;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int pair = warp % kPairs, group = warp / kPairs;
  for (int chunk = 0; chunk < kBlockRows / kChunk; ++chunk) {
    if (r0 + chunk * kChunk >= keys.batch) {  // the same in the whole block: no key left
      for (int i = int(threadIdx.x); i < kChunk * D; i += kThreads) {
        z_s[(chunk * kChunk + i / D) * EncodeLayout<D>::kZPitch + i % D] = 0.0f;
      }
      continue;
    }
    for (int i = int(threadIdx.x); i < kChunk * D; i += kThreads) {
      const std::int64_t r = r0 + chunk * kChunk + i / D;
      k_s[i] = r < keys.batch ? to_float_device(keys.row(r, h)[i % D]) : 0.0f;
    }
    __syncthreads();
    // Column blocks `pair` and D / 32 - 1 - pair: D - 32 pair and 32 (pair + 1) terms, the same sum for every warp.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int first = 32 * (half == 0 ? pair : D / 32 - 1 - pair), j = first + lane;
      float acc[kRowsPer];
#pragma unroll
      for (int r = 0; r < kRowsPer; ++r) acc[r] = 0.0f;
#pragma unroll 2
      for (int i0 = first; i0 < D; i0 += 4) {
        bool on[4];
        float l[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          on[u] = i0 + u >= j;
          l[u] = on[u] ? __ldg(transform + (i0 + u) * D + j) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < kRowsPer; ++r) {
          const float4 k = *reinterpret_cast<const float4*>(k_s + (group * kRowsPer + r) * D + i0);
          if (on[0]) acc[r] = fmaf(k.x, l[0], acc[r]);
          if (on[1]) acc[r] = fmaf(k.y, l[1], acc[r]);
          if (on[2]) acc[r] = fmaf(k.z, l[2], acc[r]);
          if (on[3]) acc[r] = fmaf(k.w, l[3], acc[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < kRowsPer; ++r) {
        z_s[(chunk * kChunk + group * kRowsPer + r) * EncodeLayout<D>::kZPitch + j] = acc[r];
      }
    }
    __syncthreads();  // k_s is rewritten by the next chunk (or becomes the codeword tiles)
  }
  __syncthreads();  // the zeroed rows
}

/// The largest |C^z_c|^2 of the kv head (the bound E above), reduced over the block.
__device__ float max_norm(const float* norms, std::int32_t count) {
  __shared__ float warp_max[kWarps];
  float m = 0.0f;
  for (std::int32_t c = std::int32_t(threadIdx.x); c < count; c += kThreads) m = fmaxf(m, norms[c]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  m = warp_max[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, warp_max[w]);
  return m;
}

/// z . C^z_c in fp32 by the quad of lanes t = 0..3 sharing a row: lane t sums dimensions 16 i + 4 t .. + 3 in
/// ascending order, then the quad adds its four sums (the same bits in every lane of the quad).
template <int D>
__device__ __forceinline__ float quad_dot(const float* z, const float* centroid, int t, unsigned quad) {
  float acc = 0.0f;
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    const float4 a = *reinterpret_cast<const float4*>(z + 16 * i + 4 * t);
    const float4 b = __ldg(reinterpret_cast<const float4*>(centroid + 16 * i + 4 * t));
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    acc = fmaf(a.w, b.w, acc);
  }
  acc += __shfl_xor_sync(quad, acc, 1);
  acc += __shfl_xor_sync(quad, acc, 2);
  return acc;
}

/// Block (row tile, kv head h): see the file comment.
template <class T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    encode_mma_kernel(HeadsView<const T> keys, VqEncodeCodebook codebook, VqCodesView<std::uint16_t> codes,
                      VqCodeDestination destination) {
  using Layout = EncodeLayout<D>;
  constexpr int kSteps = D / 16, kLoads = kTile * D / 4 / kThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  float* z_s = reinterpret_cast<float*>(smem);                                                       // [256, kZPitch]
  unsigned char* tiles = smem + Layout::kZBytes;                                                    // 2 x [kTile, kBPitch] bf16
  float* offset_s = reinterpret_cast<float*>(smem + Layout::kZBytes + 2 * Layout::kTileBytes);  // 2 x [kTile]
  const std::int32_t h = blockIdx.y, count = codebook.codewords;
  const std::int64_t r0 = std::int64_t(blockIdx.x) * kBlockRows;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const float* centroids = codebook.centroids + std::int64_t(h) * count * D;
  const float* norms = codebook.norms + std::int64_t(h) * count;

  const float largest_norm = max_norm(norms, count);
  transform_keys<T, D>(keys, h, r0, codebook.transform + std::int64_t(h) * D * D, reinterpret_cast<float*>(tiles), z_s);

  // This warp's rows as bf16 A fragments (m16n8k16: a0 row g, a1 row g + 8, a2/a3 the same 8 columns on).
  unsigned a[2][kSteps][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int kk = 0; kk < kSteps; ++kk) {
      const float* z0 = z_s + (warp * kWarpRows + mi * 16 + g) * Layout::kZPitch + kk * 16 + 2 * t;
      const float* z1 = z0 + 8 * Layout::kZPitch;
      a[mi][kk][0] = pack2<bfloat16>(z0[0], z0[1]);
      a[mi][kk][1] = pack2<bfloat16>(z1[0], z1[1]);
      a[mi][kk][2] = pack2<bfloat16>(z0[8], z0[9]);
      a[mi][kk][3] = pack2<bfloat16>(z1[8], z1[9]);
    }
  }

  float4 next[kLoads];
  float next_offset = 0.0f;
  const auto load_tile = [&](std::int32_t c0) {
#pragma unroll
    for (int v = 0; v < kLoads; ++v) {
      const int f = tid + v * kThreads;
      const std::int32_t c = c0 + f / (D / 4);
      next[v] = c < count ? __ldg(reinterpret_cast<const float4*>(centroids + std::int64_t(c) * D) + f % (D / 4))
                          : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    if (tid < kTile) next_offset = c0 + tid < count ? -0.5f * norms[c0 + tid] : -INFINITY;
  };
  const auto store_tile = [&](int buffer) {
    unsigned char* tile = tiles + buffer * Layout::kTileBytes;
#pragma unroll
    for (int v = 0; v < kLoads; ++v) {
      const int f = tid + v * kThreads, row = f / (D / 4), col = 4 * (f % (D / 4));
      *reinterpret_cast<uint2*>(tile + 2 * (row * Layout::kBPitch + col)) =
          make_uint2(pack2<bfloat16>(next[v].x, next[v].y), pack2<bfloat16>(next[v].z, next[v].w));
    }
    if (tid < kTile) offset_s[buffer * kTile + tid] = next_offset;
  };

  // Lane's ldmatrix row: matrix m = lane / 8 holds codewords 8 (m / 2) + lane % 8 of an n16 pair, k offset 8 (m % 2).
  const int m = lane / 8;
  const unsigned lane_offset = unsigned(2 * ((8 * (m / 2) + lane % 8) * Layout::kBPitch + 8 * (m % 2)));
  Candidate best[4][2];  // row slots (mi, half): rows 16 mi + g + 8 half of the warp's 32
#pragma unroll
  for (int q = 0; q < 4; ++q) best[q][0] = best[q][1] = {-INFINITY, kNoCode};

  // A warp whose rows are all past the batch only helps stage the tiles (small batches: appends).
  const bool active = r0 + warp * kWarpRows < keys.batch;
  const std::int32_t tile_count = (count + kTile - 1) / kTile;
  load_tile(0);
  store_tile(0);
  __syncthreads();
  for (std::int32_t tile = 0; tile < tile_count; ++tile) {
    const int buffer = tile & 1;
    const std::int32_t c0 = tile * kTile;
    if (tile + 1 < tile_count) load_tile(c0 + kTile);  // in flight during the MMAs
    if (active) {
      float acc[2][4][4] = {};
      const unsigned base = shared_address(tiles + buffer * Layout::kTileBytes) + lane_offset;
#pragma unroll
      for (int kk = 0; kk < kSteps; ++kk) {
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          unsigned b[4];
          ldmatrix_x4(b, base + unsigned(2 * (16 * np * Layout::kBPitch + 16 * kk)));
#pragma unroll
          for (int mi = 0; mi < 2; ++mi) {
            mma_16x8x16<bfloat16>(acc[mi][2 * np], a[mi][kk], b[0], b[1]);
            mma_16x8x16<bfloat16>(acc[mi][2 * np + 1], a[mi][kk], b[2], b[3]);
          }
        }
      }
      // Accumulator (mi, ni): c0, c1 row g columns 2t, 2t + 1 of n8 tile ni; c2, c3 row g + 8.
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const float2 offset = *reinterpret_cast<const float2*>(offset_s + buffer * kTile + ni * 8 + 2 * t);
        const std::int32_t c = c0 + ni * 8 + 2 * t;
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          offer(best[2 * mi], acc[mi][ni][0] + offset.x, c);
          offer(best[2 * mi], acc[mi][ni][1] + offset.y, c + 1);
          offer(best[2 * mi + 1], acc[mi][ni][2] + offset.x, c);
          offer(best[2 * mi + 1], acc[mi][ni][3] + offset.y, c + 1);
        }
      }
    }
    if (tile + 1 < tile_count) store_tile(buffer ^ 1);  // its last readers passed the previous barrier
    __syncthreads();
  }

  if (!active) return;  // whole warps: the shuffles below stay warp-wide
  const unsigned quad = 0xfu << (lane & ~3);
  const float norm_bound = kRelError * sqrtf(largest_norm), abs_bound = kAbsError * 0.5f * largest_norm;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    Candidate list[4] = {best[q][0], best[q][1], {-INFINITY, kNoCode}, {-INFINITY, kNoCode}};
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) {
      Candidate other[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        other[i] = {__shfl_xor_sync(0xffffffffu, list[i].s, offset), __shfl_xor_sync(0xffffffffu, list[i].c, offset)};
      }
      merge_best4(list, other);
    }
    const int row = warp * kWarpRows + (q / 2) * 16 + (q % 2) * 8 + g;
    const float* z = z_s + row * Layout::kZPitch;
    float zz = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      const float4 v = *reinterpret_cast<const float4*>(z + 16 * i + 4 * t);
      zz = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, zz))));
    }
    zz += __shfl_xor_sync(quad, zz, 1);
    zz += __shfl_xor_sync(quad, zz, 2);
    const float window = list[0].s - 2.0f * (norm_bound * sqrtf(zz) + abs_bound);
    bool contest = false;
#pragma unroll
    for (int k = 1; k < 4; ++k) contest |= list[k].c < count && list[k].s >= window;
    std::int32_t code = list[0].c < count ? list[0].c : 0;  // no candidate: a row of NaN
    if (contest) {  // the same in the whole quad: its lanes hold the same list
      float top = -INFINITY;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (list[k].c >= count || list[k].s < window) continue;
        const float s =
            quad_dot<D>(z, centroids + std::int64_t(list[k].c) * D, t, quad) + -0.5f * __ldg(norms + list[k].c);
        if (k == 0 || s > top || (s == top && list[k].c < code)) top = s, code = list[k].c;
      }
    }
    const std::int64_t r = r0 + row;
    std::int32_t slot = 0, position = 0;
    if (t == 0 && r < keys.batch && kvsift::detail::vq_destination(destination, codes, r, &slot, &position)) {
      codes.row(slot, h)[position] = std::uint16_t(code);
    }
  }
}


// The few-rows kernel (appends, the last rows of a prefill): see the file comment.
constexpr int kFewRows = kVqEncodeGroupRows, kFewChunk = kVqEncodeChunk, kFewStages = 3;

template <int D>
struct FewLayout {  ///< offsets in floats
  static constexpr int kPitch = D + 16;  ///< a phase of 8 lanes (2 codewords x 4 quarters) covers all 32 banks
  static constexpr int kStage = kFewChunk * kPitch;
  static constexpr int kNorms = kFewStages * kStage;                       ///< kFewStages x [kFewChunk]
  static constexpr int kTriangle = kNorms + kFewStages * kFewChunk;        ///< L's lower triangle, row i at i (i + 1) / 2
  static constexpr int kKeys = kTriangle + (D * (D + 1) / 2 + 3) / 4 * 4;  ///< [kFewRows, D]
  static constexpr int kZ = kKeys + kFewRows * D;                          ///< [kFewRows, D]
  static constexpr std::size_t kBytes = sizeof(float) * std::size_t(kZ + kFewRows * D);
  static_assert(kFewChunk * D / 4 % kThreads == 0 && 4 * kFewChunk == kThreads, "four lanes per codeword");
  static_assert(kBytes <= 163 * 1024, "fits an sm_80 block");
};

/// Block (slice `part` of `split`, kv head h, row group): see the file comment. Every thread reaches both cluster
/// barriers (no early exit), and the second keeps each block's winners alive until the cluster's first block has
/// read them.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    encode_few_kernel(HeadsView<const T> keys, VqEncodeCodebook codebook, VqCodesView<std::uint16_t> codes,
                      VqCodeDestination destination, std::int32_t split) {
  using Layout = FewLayout<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  float* const base = reinterpret_cast<float*>(smem);
  float* const norms_s = base + Layout::kNorms;
  float* const triangle = base + Layout::kTriangle;
  float* const k_s = base + Layout::kKeys;
  float* const z_s = base + Layout::kZ;
  __shared__ Candidate warp_best[kWarps][kFewRows];
  __shared__ Candidate block_best[kFewRows];

  const std::int32_t part = blockIdx.x, h = blockIdx.y, count = codebook.codewords;
  const std::int64_t r0 = std::int64_t(blockIdx.z) * kFewRows;
  const int rows = int(keys.batch - r0 < kFewRows ? keys.batch - r0 : kFewRows);
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const std::int32_t begin = std::int32_t(std::int64_t(count) * part / split);
  const std::int32_t end = std::int32_t(std::int64_t(count) * (part + 1) / split);
  const std::int32_t chunks = (end - begin + kFewChunk - 1) / kFewChunk;
  const float* centroids = codebook.centroids + std::int64_t(h) * count * D;
  const float* norms = codebook.norms + std::int64_t(h) * count;
  const float* transform = codebook.transform + std::int64_t(h) * D * D;

  // L's lower triangle in 4-byte copies (L needs no alignment beyond float's), then the first stages of the slice:
  // all in flight before the keys are read and transformed.
  for (int i = warp; i < D; i += kWarps) {
    for (int j = lane; j <= i; j += 32) cp_async4(shared_address(triangle + i * (i + 1) / 2 + j), transform + i * D + j);
  }
  cp_async_commit();
  const auto load_chunk = [&](std::int32_t chunk) {  // one commit group per chunk, empty past the slice
    const std::int32_t c0 = begin + chunk * kFewChunk;
    if (chunk < chunks) {
      float* stage = base + (chunk % kFewStages) * Layout::kStage;
#pragma unroll
      for (int v = 0; v < kFewChunk * D / 4 / kThreads; ++v) {
        const int f = tid + v * kThreads, row = f / (D / 4), col = 4 * (f % (D / 4));
        const bool valid = c0 + row < end;
        cp_async16(shared_address(stage + row * Layout::kPitch + col),
                   centroids + std::int64_t(valid ? c0 + row : begin) * D + col, valid);
      }
      if (tid < kFewChunk && c0 + tid < end) {
        cp_async4(shared_address(norms_s + (chunk % kFewStages) * kFewChunk + tid), norms + c0 + tid);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kFewStages; ++s) load_chunk(s);
  for (int i = tid; i < kFewRows * D; i += kThreads) {
    k_s[i] = i / D < rows ? to_float_device(keys.row(r0 + i / D, h)[i % D]) : 0.0f;
  }
  cp_async_wait<kFewStages>();  // the triangle
  __syncthreads();

  // z = k L: thread column j, rows group + kGroups r; a warp walks the rows i of L from its first column on, so its
  // lanes read one row of the triangle (consecutive banks) and one key element (broadcast) at a time.
  {
    constexpr int kGroups = kThreads / D, kRowsPer = kFewRows / kGroups;
    const int j = tid % D, group = tid / D;  // group: the same in the whole warp
    float acc[kRowsPer];
#pragma unroll
    for (int r = 0; r < kRowsPer; ++r) acc[r] = 0.0f;
    for (int i = j & ~31; i < D; ++i) {
      const float l = i >= j ? triangle[i * (i + 1) / 2 + j] : 0.0f;
#pragma unroll
      for (int r = 0; r < kRowsPer; ++r) {
        if (group + r * kGroups < rows) acc[r] = fmaf(k_s[(group + r * kGroups) * D + i], l, acc[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPer; ++r) z_s[(group + r * kGroups) * D + j] = acc[r];
  }

  // Scores: the quad of lanes 4 cw .. 4 cw + 3 shares codeword cw of the stage, lane `quarter` summing the
  // dimensions 16 i + 4 quarter .. + 3; every lane of the quad ends with the same sum (the same two additions).
  const int cw = tid / 4, quarter = tid % 4;
  Candidate best[kFewRows];
#pragma unroll
  for (int r = 0; r < kFewRows; ++r) best[r] = {-INFINITY, kNoCode};
  for (std::int32_t chunk = 0; chunk < chunks; ++chunk) {
    const int stage = chunk % kFewStages;
    cp_async_wait<kFewStages - 1>();
    __syncthreads();  // the stage landed for every thread (and z_s is written, the first time)
    const float* w = base + stage * Layout::kStage + cw * Layout::kPitch + 4 * quarter;
    float acc[kFewRows];
#pragma unroll
    for (int r = 0; r < kFewRows; ++r) acc[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      const float4 c = *reinterpret_cast<const float4*>(w + 16 * i);
#pragma unroll
      for (int r = 0; r < kFewRows; ++r) {
        if (r >= rows) continue;  // the same in the whole block
        const float4 z = *reinterpret_cast<const float4*>(z_s + r * D + 16 * i + 4 * quarter);
        acc[r] = fmaf(z.x, c.x, fmaf(z.y, c.y, fmaf(z.z, c.z, fmaf(z.w, c.w, acc[r]))));
      }
    }
    const std::int32_t code = begin + chunk * kFewChunk + cw;
    const float offset = -0.5f * norms_s[stage * kFewChunk + cw];  // not loaded past the slice: never offered
#pragma unroll
    for (int r = 0; r < kFewRows; ++r) {
      if (r >= rows) continue;
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 1);
      acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], 2);
      const float s = acc[r] + offset;
      if (code < end && s > best[r].s) best[r] = {s, code};  // ascending codes: the smaller of equal scores stays
    }
    __syncthreads();  // every thread is done with the stage before it is refilled
    load_chunk(chunk + kFewStages);
  }

  // The block's best per row: across the warp's codewords (the quads hold one each), then the warps in order.
#pragma unroll
  for (int r = 0; r < kFewRows; ++r) {
#pragma unroll
    for (int offset = 16; offset >= 4; offset /= 2) {
      const Candidate other{__shfl_xor_sync(0xffffffffu, best[r].s, offset),
                            __shfl_xor_sync(0xffffffffu, best[r].c, offset)};
      if (better(other, best[r])) best[r] = other;
    }
    if (lane == 0) warp_best[warp][r] = best[r];
  }
  __syncthreads();
  Candidate winner{-INFINITY, kNoCode};
  if (tid < kFewRows) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      if (better(warp_best[w][tid], winner)) winner = warp_best[w][tid];
    }
    block_best[tid] = winner;
  }
  bool writer = tid < rows;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (split > 1) {
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    cluster.sync();  // every block's winners are written
    writer = writer && cluster.block_rank() == 0;
    if (writer) {
      for (std::int32_t q = 1; q < split; ++q) {
        const Candidate other = cluster.map_shared_rank(block_best, unsigned(q))[tid];
        if (better(other, winner)) winner = other;
      }
    }
    cluster.sync();
  }
#endif
  std::int32_t slot = 0, position = 0;
  if (writer && kvsift::detail::vq_destination(destination, codes, r0 + tid, &slot, &position)) {
    codes.row(slot, h)[position] = std::uint16_t(winner.c < count ? winner.c : 0);  // no candidate: a row of NaN
  }
}

}  // namespace

template <class T>
cudaError_t launch_vq_encode_mma(const HeadsView<const T>& keys, const VqEncodeCodebook& codebook,
                                 const VqCodesView<std::uint16_t>& codes, const VqCodeDestination& destination,
                                 cudaStream_t stream) {
  const auto launch_for = [&]<int D>() {
    constexpr auto kernel = encode_mma_kernel<T, D>;
    constexpr std::size_t smem = EncodeLayout<D>::kBytes;
    if (cudaError_t s = open_shared_memory<kernel>(); s != cudaSuccess) return s;
    const dim3 grid(unsigned((keys.batch + kBlockRows - 1) / kBlockRows), unsigned(keys.heads));
    kernel<<<grid, kThreads, smem, stream>>>(keys, codebook, codes, destination);
    return cudaGetLastError();
  };
  return with_vq_head_dim(keys.head_dim, launch_for);
}

template <class T>
cudaError_t launch_vq_encode_few(const HeadsView<const T>& keys, const VqEncodeCodebook& codebook,
                                 const VqCodesView<std::uint16_t>& codes, const VqCodeDestination& destination,
                                 std::int32_t split, cudaStream_t stream) {
  const auto launch_for = [&]<int D>() {
    constexpr auto kernel = encode_few_kernel<T, D>;
    constexpr std::size_t smem = FewLayout<D>::kBytes;
    if (cudaError_t s = open_shared_memory<kernel>(); s != cudaSuccess) return s;
    // The cluster exists only in code built for sm_90 or later (cuda/detail/launch.cuh built_for_sm90).
    bool sm90 = false;
    if (cudaError_t s = built_for_sm90<kernel>(&sm90); s != cudaSuccess) return s;
    const std::int32_t parts = sm90 ? split : 1;
    return launch(kernel,
                  {.grid = dim3(unsigned(parts), unsigned(keys.heads), unsigned((keys.batch + kFewRows - 1) / kFewRows)),
                   .block = dim3(kThreads), .smem = smem, .stream = stream, .cluster = parts},
                  keys, codebook, codes, destination, parts);
  };
  return with_vq_head_dim(keys.head_dim, launch_for);
}

#define KVSIFT_INSTANTIATE(T)                                                                                  \
  template cudaError_t launch_vq_encode_mma<T>(const HeadsView<const T>&, const VqEncodeCodebook&,           \
                                               const VqCodesView<std::uint16_t>&, const VqCodeDestination&, \
                                               cudaStream_t);                                          \
  template cudaError_t launch_vq_encode_few<T>(const HeadsView<const T>&, const VqEncodeCodebook&,           \
                                               const VqCodesView<std::uint16_t>&, const VqCodeDestination&, \
                                               std::int32_t, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
