#pragma once
/// Device-side LSE merge of partial attention states, shared by the split-K epilogue of decode and the
/// standalone merge_states kernel. One thread block merges one (sequence, head) row.

#include <cuda_runtime.h>

#include <cmath>

#include "kvsift/cuda/detail/decode_params.hpp"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/attention/state.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {

inline constexpr int kMergeThreads = 128;  ///< block size of both merge kernels
static_assert(kMergeMaxHeadDim % kMergeThreads == 0);

/// Merges `n` partials of one row with the whole block: lse_of(i) gives LSE_i (natural log), o_of(i, c)
/// element c of O_i. Thread t owns channels t, t + blockDim.x, ... (head_dim <= kMergeMaxHeadDim, checked by
/// the launchers) and reads every partial's LSE itself (the same addresses across the block), so there is
/// no barrier and no reduction. Partials go in chunks whose LSE and O loads are all independent: a row costs
/// one round trip to L2 per chunk, where a max-then-weights-then-values pass would cost three plus barriers
/// (measured on the H100: the split merge took ~3.8 us after its wait for 16 partials, a third of a 12 us
/// call). Chunks are merged online (running maximum); an empty partial (LSE = -inf) contributes exactly
/// nothing: its O is selected away, never multiplied, so garbage in it cannot leak. Only LSE = -inf is
/// empty: a partial whose weight underflows to 0 still multiplies its O, so a NaN there shows (0 * NaN), as
/// in the CPU and reference merges (attention/state.hpp).
template <class LseOf, class OOf, class WriteO, class WriteLse>
__device__ void merge_row(int n, int head_dim, LseOf lse_of, OOf o_of, WriteO write_o, WriteLse write_lse) {
  constexpr int kChunk = 16;
  constexpr int kChannels = kMergeMaxHeadDim / kMergeThreads;
  const auto channel = [&](int r) { return int(threadIdx.x) + r * int(blockDim.x); };
  float lse_max = negative_infinity<float>(), weight_sum = 0.0f, acc[kChannels] = {};
  for (int first = 0; first < n; first += kChunk) {
    float lse[kChunk], o[kChunk][kChannels];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const bool present = first + i < n;
      lse[i] = present ? lse_of(first + i) : negative_infinity<float>();
#pragma unroll
      for (int r = 0; r < kChannels; ++r) {
        o[i][r] = present && channel(r) < head_dim ? o_of(first + i, channel(r)) : 0.0f;
      }
    }
    float chunk_max = negative_infinity<float>();
#pragma unroll
    for (int i = 0; i < kChunk; ++i) chunk_max = max_nan(chunk_max, lse[i]);
    const float new_max = max_nan(lse_max, chunk_max);  // a NaN partial makes the row NaN (state.hpp)
    if (new_max == negative_infinity<float>()) continue;  // every partial so far is empty
    const float rescale = state_weight(lse_max, new_max);  // 0 while nothing was merged
    weight_sum *= rescale;
#pragma unroll
    for (int r = 0; r < kChannels; ++r) acc[r] *= rescale;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const float w = state_weight(lse[i], new_max);
      weight_sum += w;
#pragma unroll
      for (int r = 0; r < kChannels; ++r) acc[r] = lse[i] != negative_infinity<float>() ? fmaf(w, o[i][r], acc[r]) : acc[r];
    }
    lse_max = new_max;
  }
#pragma unroll
  for (int r = 0; r < kChannels; ++r) {
    if (channel(r) < head_dim) write_o(channel(r), weight_sum == 0.0f ? 0.0f : acc[r] / weight_sum);
  }
  if (threadIdx.x == 0) write_lse(merged_lse(lse_max, weight_sum));
}

/// The split merge of (sequence b, q head h): merge_row over the num_splits fp32 states that lse_of(i) and o_of(i, c)
/// read, into the output, in the storage type or, for an fp32 output (p.out_f32), in fp32: rounded once either way.
/// The merge kernel reads the workspace's partials, a cluster merge its CTAs' shared memory: the same result.
template <class T, class LseOf, class OOf>
__device__ void merge_split_row(const DecodeParams<T>& p, int b, int h, LseOf lse_of, OOf o_of) {
  const bool f32 = p.out_f32.o != nullptr;
  T* out = p.out.o_row(b, h);
  float* out_f32 = p.out_f32.o_row(b, h);
  merge_row(
      p.num_splits, p.q.head_dim, lse_of, o_of,
      [&](int c, float v) {
        if (f32) {
          out_f32[c] = v;
        } else {
          out[c] = from_float_device<T>(v);
        }
      },
      [&](float v) { (f32 ? p.out_f32.lse_at(b, h) : p.out.lse_at(b, h)) = v; });
}

/// Split-K epilogue: merges the num_splits fp32 partials of each (sequence, q head) into the output.
template <class T>
__global__ void merge_splits_kernel(const __grid_constant__ DecodeParams<T> p) {
  programmatic_start();  // the decode grid's partials are complete and visible; the next decode may be scheduled
  const int b = blockIdx.x / p.q.heads, h = blockIdx.x % p.q.heads;
  const float* lse = &p.partials.lse_at(b, h, 0);
  const float* o = p.partials.o_row(b, h, 0, p.q.head_dim);
  merge_split_row(
      p, b, h, [&](int i) { return lse[i]; }, [&](int i, int c) { return o[std::int64_t(i) * p.q.head_dim + c]; });
}

template <class TI, class TO>
__global__ void merge_states_kernel(const __grid_constant__ MergeParams<TI, TO> p) {
  const int b = blockIdx.x / p.out.heads, h = blockIdx.x % p.out.heads;
  TO* out = p.out.o_row(b, h);
  merge_row(
      p.num_partials, p.out.head_dim, [&](int i) { return p.partials[i].lse_at(b, h); },
      [&](int i, int c) { return to_float_device(p.partials[i].o_row(b, h)[c]); },
      [&](int c, float v) { out[c] = from_float_device<TO>(v); }, [&](float v) { p.out.lse_at(b, h) = v; });
}

}  // namespace kvsift::cuda::detail
