#pragma once
/// The decode-attention kernel behind both sparse and dense decode (see decode_cuda.hpp for the contract).
///
/// Work split: grid (num_splits, kv_heads * head_tiles, batch). A CTA owns one (sequence, kv head, tile of
/// up to GroupTile query heads) and a contiguous chunk of that row's tokens (or selection entries). Each
/// token's K and V rows are read once per CTA with 16-byte loads by a "row group" of HeadDim / 8 threads,
/// and serve every query head of the tile: that is what makes GQA cost one K/V read per kv head.
/// K/V rows stream through a kDecodeStages-deep cp.async pipeline in shared memory, so that bytes in flight
/// cost no registers. Each thread keeps an online-softmax state per query head (running max in base 2,
/// denominator, and its 8 channels of the unnormalized output); row groups merge through shared memory at
/// the end, and CTAs of one row merge in merge_splits_kernel when num_splits > 1.

#include <cuda_runtime.h>

#include <cmath>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "kvsift/attention/decode_launch.hpp"
#include "kvsift/attention/decode_params.hpp"
#include "kvsift/attention/merge_state.cuh"
#include "kvsift/attention/state.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {

inline constexpr int kDecodeThreads = 128;
inline constexpr int kDecodeUnroll = 4;  ///< rows per row group per pipeline stage
inline constexpr int kDecodeStages = 3;  ///< cp.async stages: two in flight while one is consumed

template <int HeadDim, int GroupTile>
struct DecodeShape {
  static constexpr int kVec = 8;  ///< 16-bit elements per 16-byte copy
  static constexpr int kThreadsPerRow = HeadDim / kVec;
  static constexpr int kRowGroups = kDecodeThreads / kThreadsPerRow;
  static constexpr int kRowsPerIteration = kRowGroups * kDecodeUnroll;
  static_assert(HeadDim % kVec == 0 && 32 % kThreadsPerRow == 0, "a row group must fit in a warp");

  // Dynamic shared memory: the K/V pipeline (each thread's own 16-byte pieces) and one logit bias per thread,
  // row and stage; after the main loop the same bytes hold the row groups' states for the final merge.
  static constexpr int kPieces = kDecodeStages * kDecodeUnroll * kDecodeThreads;  // 16-byte pieces of K (or V)
  static constexpr std::size_t kPipelineBytes = 2 * std::size_t(kPieces) * 16 + std::size_t(kPieces) * 4;
  static constexpr std::size_t kMergeBytes = std::size_t(kRowGroups) * GroupTile * (HeadDim + 2) * 4;
  static constexpr std::size_t kSmemBytes = kPipelineBytes > kMergeBytes ? kPipelineBytes : kMergeBytes;
};

/// 16-byte global-to-shared copy that bypasses L1 (rows are read once); copies zeros when !valid.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

/// Records the smallest offending (selection row, position) seen, for the host to report.
__device__ __forceinline__ void record_bad_index(unsigned long long* slot, std::int64_t row, std::int32_t position) {
  atomicMin(slot, (static_cast<unsigned long long>(row) << 32) | static_cast<std::uint32_t>(position));
}

template <int HeadDim, int GroupTile, class T>
__global__ void __launch_bounds__(kDecodeThreads) decode_attention_kernel(const __grid_constant__ DecodeParams<T> p) {
  using Shape = DecodeShape<HeadDim, GroupTile>;
  constexpr int kVec = Shape::kVec, kTpr = Shape::kThreadsPerRow, kRowGroups = Shape::kRowGroups;
  constexpr int kUnroll = kDecodeUnroll, kStages = kDecodeStages;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Lets the split merge (launched as a programmatic dependent) get scheduled now; it waits for this grid.
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  extern __shared__ uint4 smem[];
  uint4* k_pieces = smem;                                                 // [stage][u][thread]
  uint4* v_pieces = smem + Shape::kPieces;                                // [stage][u][thread]
  float* biases = reinterpret_cast<float*>(smem + 2 * Shape::kPieces);    // [stage][u][thread], base-2 logit bias
  const auto slot = [&](int stage, int u) { return (stage * kUnroll + u) * kDecodeThreads + int(threadIdx.x); };

  const int split = blockIdx.x;
  const int kv_head = blockIdx.y / p.head_tiles, tile = blockIdx.y % p.head_tiles;
  const int b = blockIdx.z;
  const int lane = threadIdx.x % kTpr, row_group = threadIdx.x / kTpr;
  const bool dense = p.selection.indices == nullptr;
  const int seq_len = p.seq_len(b);
  const std::int64_t sel_row = std::int64_t(b) * p.selection.kv_heads + kv_head;

  int count = dense ? seq_len : p.selection.counts[sel_row];
  if (p.first_bad_index != nullptr && !dense && (count < 0 || count > p.selection.capacity)) {
    if (split == 0 && threadIdx.x == 0) record_bad_index(p.first_bad_index, sel_row, 0x7fffffff);
    count = 0;
  }
  const int chunk = (count + p.num_splits - 1) / p.num_splits;
  const int begin = min(count, split * chunk), end = min(count, begin + chunk);
  const int iterations = (end - begin + Shape::kRowsPerIteration - 1) / Shape::kRowsPerIteration;

  const std::int32_t* indices = dense ? nullptr : p.selection.indices + sel_row * p.selection.capacity;
  const float* log_weights = dense || p.selection.log_weights == nullptr
                                 ? nullptr
                                 : p.selection.log_weights + sel_row * p.selection.capacity;

  // Token indices of an iteration's rows, loaded one iteration before their copies are issued so that no
  // thread waits on an index load between issuing copies and computing.
  const auto load_tokens = [&](int it, int (&token)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = begin + it * Shape::kRowsPerIteration + u * kRowGroups + row_group;
      token[u] = i < end ? (dense ? i : indices[i]) : 0;
    }
  };
  // Issues the copies of iteration `it` into its stage: this thread's 16 bytes of each of its rows' K and V,
  // and the rows' logit biases (the log-weight, or -inf for rows past the end or, in validation mode, with
  // an index out of range).
  const auto issue = [&](int it, const int (&token)[kUnroll]) {
    const int stage = it % kStages;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = begin + it * Shape::kRowsPerIteration + u * kRowGroups + row_group;
      bool valid = i < end;
      if (p.first_bad_index != nullptr && valid && (token[u] < 0 || token[u] >= seq_len)) {
        if (lane == 0) record_bad_index(p.first_bad_index, sel_row, i);
        valid = false;
      }
      const T* k_src = valid ? p.k_row(b, kv_head, token[u]) + lane * kVec : p.q.data;
      const T* v_src = valid ? p.v_row(b, kv_head, token[u]) + lane * kVec : p.q.data;
      cp_async16(k_pieces + slot(stage, u), k_src, valid);
      cp_async16(v_pieces + slot(stage, u), v_src, valid);
      if (valid && log_weights != nullptr) {
        cp_async4(biases + slot(stage, u), log_weights + i);
      } else {
        biases[slot(stage, u)] = valid ? 0.0f : negative_infinity<float>();
      }
    }
  };
  int tokens[kUnroll];
#pragma unroll
  for (int it = 0; it < kStages - 1; ++it) {
    load_tokens(it, tokens);
    if (it < iterations) issue(it, tokens);
    cp_async_commit();
  }
  load_tokens(kStages - 1, tokens);

  // This tile's query heads, pre-scaled so that logits come out in base 2.
  const int first_head_in_group = tile * GroupTile;
  float q[GroupTile][kVec];
#pragma unroll
  for (int g = 0; g < GroupTile; ++g) {
    if (first_head_in_group + g < p.group) {
      float raw[kVec];
      unpack8<T>(__ldg(reinterpret_cast<const uint4*>(p.q.row(b, kv_head * p.group + first_head_in_group + g) + lane * kVec)),
                 raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) q[g][j] = raw[j] * p.scale_log2;
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) q[g][j] = 0.0f;
    }
  }

  float m[GroupTile], l[GroupTile], acc[GroupTile][kVec];
#pragma unroll
  for (int g = 0; g < GroupTile; ++g) {
    m[g] = negative_infinity<float>();
    l[g] = 0.0f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[g][j] = 0.0f;
  }

  // Every thread runs the same iterations (the bound is per CTA), so the shuffles below never diverge. Each
  // thread reads only the shared memory its own copies wrote, so waiting on its own groups is enough.
  for (int it = 0; it < iterations; ++it) {
    if (it + kStages - 1 < iterations) issue(it + kStages - 1, tokens);
    load_tokens(it + kStages, tokens);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    const int stage = it % kStages;

    float s[kUnroll][GroupTile];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float k[kVec];
      unpack8<T>(k_pieces[slot(stage, u)], k);
      const float bias = biases[slot(stage, u)];
#pragma unroll
      for (int g = 0; g < GroupTile; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < kVec; ++j) dot = fmaf(q[g][j], k[j], dot);
#pragma unroll
        for (int offset = kTpr / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        s[u][g] = dot + bias * kLog2e;
      }
    }

    // Online softmax: rescale each head's state to the new running max once per iteration, turn the scores
    // into weights in place, then stream each V row once through every head's accumulator.
#pragma unroll
    for (int g = 0; g < GroupTile; ++g) {
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, s[u][g]);
      const bool any = m_new != negative_infinity<float>();
      const float correction = any ? exp2f(m[g] - m_new) : 1.0f;  // 0 when m[g] = -inf
      l[g] *= correction;
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[g][j] *= correction;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        s[u][g] = any ? exp2f(s[u][g] - m_new) : 0.0f;  // 0 for invalid rows
        l[g] += s[u][g];
      }
      m[g] = m_new;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float v[kVec];
      unpack8<T>(v_pieces[slot(stage, u)], v);
#pragma unroll
      for (int g = 0; g < GroupTile; ++g) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[g][j] = fmaf(s[u][g], v[j], acc[g][j]);
      }
    }
  }
  cp_async_wait<0>();

  // Merge the row groups' states through shared memory (reusing the pipeline's bytes).
  __syncthreads();
  float* s_m = reinterpret_cast<float*>(smem);                // [row_group][g]
  float* s_l = s_m + kRowGroups * GroupTile;                  // [row_group][g]
  float* s_o = s_l + kRowGroups * GroupTile;                  // [row_group][g][HeadDim]
#pragma unroll
  for (int g = 0; g < GroupTile; ++g) {
    if (lane == 0) {
      s_m[row_group * GroupTile + g] = m[g];
      s_l[row_group * GroupTile + g] = l[g];
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) s_o[(row_group * GroupTile + g) * HeadDim + lane * kVec + j] = acc[g][j];
  }
  __syncthreads();

  for (int e = threadIdx.x; e < GroupTile * HeadDim; e += kDecodeThreads) {
    const int g = e / HeadDim, c = e % HeadDim;
    if (first_head_in_group + g >= p.group) continue;
    float m_max = negative_infinity<float>();
#pragma unroll
    for (int r = 0; r < kRowGroups; ++r) m_max = fmaxf(m_max, s_m[r * GroupTile + g]);
    float denom = 0.0f, value = 0.0f;
    if (m_max != negative_infinity<float>()) {
#pragma unroll
      for (int r = 0; r < kRowGroups; ++r) {
        const float w = exp2f(s_m[r * GroupTile + g] - m_max);
        denom = fmaf(s_l[r * GroupTile + g], w, denom);
        value = fmaf(s_o[(r * GroupTile + g) * HeadDim + c], w, value);
      }
    }
    const float o = denom == 0.0f ? 0.0f : value / denom;
    const float lse = denom == 0.0f ? negative_infinity<float>() : (m_max + log2f(denom)) * kLn2;
    const int h = kv_head * p.group + first_head_in_group + g;
    if (p.num_splits == 1) {
      p.out.o_row(b, h)[c] = from_float_device<T>(o);
      if (c == 0) p.out.lse_at(b, h) = lse;
    } else {
      const std::int64_t row = (std::int64_t(b) * p.q.heads + h) * p.num_splits + split;
      p.partial_o[row * HeadDim + c] = o;
      if (c == 0) p.partial_lse[row] = lse;
    }
  }
}

}  // namespace kvsift::cuda::detail

namespace kvsift::cuda::detail {

template <int... Values, class F>
bool dispatch_int(int value, F&& f) {
  return ((value == Values ? (f.template operator()<Values>(), true) : false) || ...);
}

/// Raises a kernel's dynamic shared-memory limit past 48 KB, once per kernel and device (the setting is per
/// device). The kernel is a template argument so that every kernel has its own flag.
template <auto Kernel>
cudaError_t allow_dynamic_smem(std::size_t bytes) {
  static std::atomic<unsigned long long> done_on_devices{0};
  int device = 0;
  if (const cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
  const unsigned long long bit = 1ull << (device % 64);
  if (done_on_devices.load(std::memory_order_acquire) & bit) return cudaSuccess;
  const cudaError_t status = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (status == cudaSuccess) done_on_devices.fetch_or(bit, std::memory_order_release);
  return status;
}

/// The one place where runtime head_dim and GQA tile become template arguments: calls
/// fn(kernel, dynamic_smem_bytes) for the matching decode kernel, once its shared-memory limit is raised.
/// Returns cudaErrorInvalidValue for an unsupported head_dim (the host entry points validate it before).
template <class T, class Fn>
cudaError_t with_decode_kernel(int head_dim, int group, Fn&& fn) {
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_int<64, 128>(head_dim, [&]<int HeadDim>() {
    dispatch_int<1, 2, 4, 8>(group_tile_for(group), [&]<int Tile>() {
      constexpr auto kernel = decode_attention_kernel<HeadDim, Tile, T>;
      constexpr std::size_t smem = DecodeShape<HeadDim, Tile>::kSmemBytes;
      status = allow_dynamic_smem<kernel>(smem);
      if (status == cudaSuccess) status = fn(kernel, smem);
    });
  });
  return status;
}

template <class T>
cudaError_t launch_decode(const DecodeParams<T>& p, cudaStream_t stream) {
  const int kv_heads = p.paged ? p.paged_kv.kv_heads : p.kv.kv_heads;
  const dim3 grid(p.num_splits, kv_heads * p.head_tiles, p.q.batch);
  const cudaError_t status = with_decode_kernel<T>(p.q.head_dim, p.group, [&](auto kernel, std::size_t smem) {
    kernel<<<grid, kDecodeThreads, smem, stream>>>(p);
    return cudaGetLastError();
  });
  if (status != cudaSuccess || p.num_splits == 1) return status;
  // Programmatic dependent launch: the merge's launch overlaps the decode grid's tail (sm_90; elsewhere the
  // attribute only orders the kernels as usual).
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(p.q.batch * p.q.heads);
  config.blockDim = dim3(p.q.head_dim);
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, merge_splits_kernel<T>, p);
}

template <class T>
cudaError_t decode_ctas_per_sm(int head_dim, int group, int* ctas) {
  return with_decode_kernel<T>(head_dim, group, [&](auto kernel, std::size_t smem) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, kernel, kDecodeThreads, smem);
  });
}

template <class T>
cudaError_t launch_merge_states(const MergeParams<T>& p, cudaStream_t stream) {
  merge_states_kernel<T><<<p.out.batch * p.out.heads, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvsift::cuda::detail
