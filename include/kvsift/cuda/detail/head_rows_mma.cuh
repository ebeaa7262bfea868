#pragma once
/// Dot products of a GQA group's query heads with gathered 16-bit key rows on tensor cores (mma m16n8k16, fp32
/// accumulators), for kernels that read each row once from wherever it lies (a candidate's key, a centroid): the
/// group's heads are the 16 rows of A in shared memory (zero past the group), and each lane loads the 16-byte
/// pieces of its row that serve directly as B fragments. For each 32 channels of a row, lane l loads the 16 bytes at
/// 16 (l % 4) of n-tile column l / 4: they hold its k pairs of the two k-steps of those channels in this order:
/// (2t, 2t + 1), (2t + 8, 2t + 9) of the first, then of the second (t = l % 4). The A fragments are read from
/// shared memory in the same order, so each product still pairs q and k of one channel: a dot product's channels
/// may come in any order, only the fp32 sum's rounding follows it. One load per 16 bytes, no conversion, two mma
/// per 32 channels and 8 rows. C: lane l holds heads l / 4 and l / 4 + 8 of columns 2t and 2t + 1 (acc[2 r + e]:
/// head l / 4 + 8 r, column 2t + e).
#include <cuda_runtime.h>

#include <cstdint>

#include "kvsift/core/views.hpp"
#include "kvsift/cuda/detail/mma.cuh"

namespace kvsift::cuda::detail {

/// Elements between A's rows in shared memory for rows of d channels: 16 bytes of padding put the 8 rows one
/// fragment load reads on distinct banks.
__host__ __device__ constexpr int head_rows_stride(int d) { return d + 8; }

/// 16 bytes of a 16-bit row at `src` (8 channels): one vector load where the row allows it, else channel by channel
/// (a view whose rows are not 16-byte aligned).
template <class T>
__device__ __forceinline__ uint4 load_octet(const T* src) {
  if (reinterpret_cast<std::uintptr_t>(src) % 16 == 0) return *reinterpret_cast<const uint4*>(src);
  const auto* bits = reinterpret_cast<const std::uint16_t*>(src);
  const auto pair = [&](int i) { return std::uint32_t(bits[i]) | std::uint32_t(bits[i + 1]) << 16; };
  return make_uint4(pair(0), pair(2), pair(4), pair(6));
}

/// The block's kThreads threads copy query heads [first, first + heads) of sequence b (d channels each) into rows
/// 0..heads - 1 of A (`rows`, head_rows_stride(d) apart) and zero rows heads..15. The caller syncs before reading.
template <int kThreads, class T>
__device__ __forceinline__ void stage_head_rows(const QueryView<const T>& q, std::int32_t b, std::int32_t first,
                                                std::int32_t heads, std::int32_t d, std::uint16_t* rows) {
  for (std::int32_t e = std::int32_t(threadIdx.x); e < 16 * d; e += kThreads) {
    const std::int32_t h = e / d, c = e % d;
    rows[h * head_rows_stride(d) + c] = h < heads ? q.row(b, first + h)[c].bits : std::uint16_t(0);
  }
}

/// This lane's B pieces of `row` (32 kPairs channels; nullptr: zeros): piece p, the 16 bytes at 8 t + 32 p.
template <int kPairs, class T>
__device__ __forceinline__ void load_row_pieces(const T* row, int t, uint4 (&piece)[kPairs]) {
#pragma unroll
  for (int p = 0; p < kPairs; ++p) piece[p] = row != nullptr ? load_octet(row + 8 * t + 32 * p) : make_uint4(0, 0, 0, 0);
}

/// acc += A x B for kTiles n-tiles of rows whose pieces this lane holds (lane n = l / 4, t = l % 4).
template <class T, int kPairs, int kTiles>
__device__ __forceinline__ void mma_head_rows(const std::uint16_t* rows, int n, int t,
                                              const uint4 (&piece)[kTiles][kPairs], float (&acc)[kTiles][4]) {
  constexpr int kStride = head_rows_stride(32 * kPairs);
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const uint4 lo = *reinterpret_cast<const uint4*>(rows + n * kStride + 32 * p + 8 * t);
    const uint4 hi = *reinterpret_cast<const uint4*>(rows + (n + 8) * kStride + 32 * p + 8 * t);
    const unsigned first[4] = {lo.x, hi.x, lo.y, hi.y}, second[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      mma_16x8x16<T>(acc[nt], first, piece[nt][p].x, piece[nt][p].y);
      mma_16x8x16<T>(acc[nt], second, piece[nt][p].z, piece[nt][p].w);
    }
  }
}

}  // namespace kvsift::cuda::detail
