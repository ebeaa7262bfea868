#pragma once
/// The decode-attention kernel behind both sparse and dense decode (see cuda/decode.hpp for the contract).
///
/// Work split: grid (num_splits, kv_heads * head_tiles, batch). A CTA owns one (sequence, kv head, tile of up
/// to kHeadsPerTile query heads) and a contiguous chunk of that row's tokens (or selection entries); its
/// Warps warps (4 or 8: p.cta_warps) take interleaved steps of kDecodeRowsPerStep rows. Both products run on
/// tensor cores (mma.sync m16n8k16, fp32 accumulation): S = Q K^T with the tile's query heads as the 16 rows
/// of A (heads past the GQA group are zero), and O += P V with P rounded to the storage type, as
/// FlashAttention-2 does. Each K/V row is read from HBM once per CTA and serves every query head of the
/// tile: that is what makes GQA cost one K/V read per kv head, and tensor cores keep the instruction count
/// per byte low enough that the loop is bound by memory, not by issue.
///
/// Each warp streams its rows through its own kDecodeStages-deep cp.async pipeline in shared memory (no
/// block-wide barrier in the loop; a warp barrier makes the lanes' copies visible to ldmatrix). Rows are
/// stored with a 16-byte XOR swizzle so that ldmatrix reads them without bank conflicts. The warps merge
/// their online-softmax states through shared memory at the end, and CTAs of one row merge in
/// merge_splits_kernel when num_splits > 1.

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvsift/core/supported_values.hpp"
#include "kvsift/cuda/detail/decode_launch.hpp"
#include "kvsift/cuda/detail/decode_params.hpp"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/merge_kernels.cuh"
#include "kvsift/cuda/detail/mma.cuh"
#include "kvsift/attention/state.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {

template <int HeadDim>
struct DecodeShape {
  static_assert(HeadDim % 32 == 0, "ldmatrix.x4 covers 32 channels of a row");
  static constexpr int kPiecesPerRow = HeadDim / 8;          ///< 16-byte pieces of one K or V row
  static constexpr int kRowsPerCopy = 32 / kPiecesPerRow;    ///< whole rows one warp-wide 16-byte copy moves
  static constexpr int kTileBytes = kDecodeRowsPerStep * HeadDim * 2;
  static constexpr int kStageBytes = int(decode_stage_bytes(HeadDim));  ///< K tile, V tile, logit biases
  static constexpr int kMergeRowFloats = decode_merge_row_floats(HeadDim);
  static_assert(kStageBytes == 2 * kTileBytes + kDecodeRowsPerStep * 4);
};

/// Byte offset of 16-byte piece `piece` of row `row` in a swizzled [kDecodeRowsPerStep][HeadDim] tile: the XOR
/// spreads the 8 rows that one ldmatrix matrix reads over all 32 banks.
template <int HeadDim>
__device__ __forceinline__ unsigned swizzled(int row, int piece) {
  return unsigned(row * DecodeShape<HeadDim>::kPiecesPerRow + (piece ^ (row & 7))) * 16u;
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
/// 16-byte global-to-shared copy that bypasses L1 (rows are read once); writes zeros when !valid. The L2
/// prefetch-size hint of a whole 128-byte line, which a warp's copy reads in full anyway, made dense decode
/// 0.7-1.1% faster on the H100 (sparse unchanged; a 256-byte hint was no better).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}
__device__ __forceinline__ void store_shared(unsigned dst, float value) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(dst), "f"(value));
}
__device__ __forceinline__ float2 load_shared2(unsigned src) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(src));
  return v;
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(src));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(src));
}
/// Two fp32 values rounded to T and packed, `low` in the lower half (the lower column of an MMA fragment).
template <class T>
__device__ __forceinline__ unsigned pack2(float low, float high) {
  unsigned r;
  if constexpr (std::is_same_v<T, half>) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(high), "f"(low));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(high), "f"(low));
  }
  return r;
}

/// The cluster merge (p.cluster_merge): the CTAs of a row, one cluster along x (rank = split), hold their states in
/// shared memory (cta_o [kHeadsPerTile][HeadDim], cta_lse [kHeadsPerTile]); after a cluster barrier, CTA r merges
/// the tile's heads r, r + num_splits, ... from every CTA's memory (merge_split_row, as the merge kernel does from
/// the workspace: the same output, bit for bit), and a second barrier keeps each CTA's memory alive until the last
/// read. Replaces the partials' stores, the merge kernel's launch and its loads. sm_90 code only: elsewhere it traps
/// (the plan never sets cluster_merge there).
template <int HeadDim, class T>
__device__ __forceinline__ void merge_in_cluster(const DecodeParams<T>& p, int b, int kv_head, int first_head,
                                                 float* cta_o, float* cta_lse) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();  // every CTA's state is complete
  const int heads = min(kHeadsPerTile, p.group - first_head);
  for (int head = int(cluster.block_rank()); head < heads; head += p.num_splits) {
    merge_split_row(
        p, b, kv_head * p.group + first_head + head,
        [&](int i) { return cluster.map_shared_rank(cta_lse, i)[head]; },
        [&](int i, int c) { return cluster.map_shared_rank(cta_o, i)[head * HeadDim + c]; });
  }
  cluster.sync();  // no CTA's memory goes while another reads it
#elif defined(__CUDA_ARCH__)
  __trap();  // the plan never sets cluster_merge without sm_90 code (decode_cluster_capacity): fail loudly, not silently
#endif
}

/// Eight warps per CTA where the shared memory allows, where four was the first choice: with one CTA per SM,
/// the SM then has twice the independent row streams to issue from while others wait on their copies. H100,
/// same run: sparse K = 8192 / batch 8 100 against 106 us, K = 2048 / batch 1 10.4 against 10.7, dense 128K /
/// batch 8 1390 against 1395; short calls pay for merging eight warps' states (K = 256 / batch 1 6.9
/// against 6.7 us, dense 32K / batch 1 51.5 against 51.0). Deeper per-warp pipelines, which put as many bytes
/// in flight, were slower (docs/cuda_attention.md). The warp count is a template argument, not a runtime
/// value: a kernel reading it from its parameters was 0.5-0.6 us slower per call on every shape measured
/// (H100 A/B, two rounds: sparse K = 256 / batch 1 7.5 against 6.9 us, K = 2048 / batch 1 10.9 against 10.4).
/// Four-warp CTAs (99 KB at head_dim 128) may share an SM two at a time; eight-warp CTAs take one.
///
/// Windowed: sparse decode with an attention window (p.window), whose tokens come before each row's selected
/// entries. A compile-time choice: the window's index arithmetic on the dependent chain count -> index ->
/// row cost the windowless calls 1.2 us at K = 2048 / batch 1 (10.2 -> 11.4) and 1.8 us at batch 8 (30.1 ->
/// 31.9) when it was a runtime branch (H100 A/B, two rounds); the windowless kernel is the code it was.
///
/// Pages (implies Windowed, whose window may be empty): the selection lists pages of p.page_size tokens
/// (AttentionOptions::selection_page_size), entry window + j being token j % page_size of page indices[j /
/// page_size]; a page's tokens outside the middle [sink_end, recent_begin) are masked entries (no copy, bias -inf),
/// so no expansion into tokens runs before the kernel and no page can make it read outside the sequence.
template <int HeadDim, class T, int Warps, bool Windowed, bool Pages = false>
__global__ void __launch_bounds__(32 * Warps, Warps == kDecodeMinWarps ? 2 : 1)
    decode_attention_kernel(const __grid_constant__ DecodeParams<T> p) {
  using Shape = DecodeShape<HeadDim>;
  constexpr int kStages = kDecodeStages, kRowsPerStep = kDecodeRowsPerStep, kRowsPerCtaStep = Warps * kRowsPerStep;
  constexpr int kKSteps = HeadDim / 16, kNTiles = HeadDim / 8;

  // Launched as a programmatic dependent: the split merge (this grid's programmatic dependent) may be scheduled
  // once this grid's predecessor is done; it waits for this grid in turn.
  programmatic_start();
  extern __shared__ uint4 smem[];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int frag_row = lane / 4, frag_col = 2 * (lane % 4);  // this lane's place in MMA fragments
  const int own_row = lane % kRowsPerStep;                   // the row whose token and bias this lane loads
  const unsigned warp_smem = shared_address(smem) + unsigned(warp * kStages * Shape::kStageBytes);
  const auto k_tile = [&](int stage) { return warp_smem + unsigned(stage * Shape::kStageBytes); };
  const auto v_tile = [&](int stage) { return k_tile(stage) + unsigned(Shape::kTileBytes); };
  const auto biases = [&](int stage) { return k_tile(stage) + unsigned(2 * Shape::kTileBytes); };

  const int split = blockIdx.x;
  const int kv_head = blockIdx.y / p.head_tiles, tile = blockIdx.y % p.head_tiles;
  const int b = blockIdx.z;
  // The selection row this batch row attends (AttentionOptions::selection_rows); where the map names none, a bad
  // row, whose pointers stay those of row 0 and are not read.
  const std::int64_t mapped =
      p.selection.indices != nullptr ? attended_selection_row(p.selection_rows, b, p.selection.batch) : b;
  const std::int64_t sel_row = max(mapped, std::int64_t(0)) * p.selection.kv_heads + kv_head;
  // The row's count and attend_all flag are independent loads, issued together.
  int selected = 0;
  bool attend_all = false;
  if (p.selection.indices != nullptr) {
    selected = mapped < 0 ? -1 : p.selection.counts[sel_row];
    attend_all = mapped >= 0 && p.selection.attend_all != nullptr && p.selection.attend_all[sel_row] != 0;
  }
  // A row's entries: every token (dense decode, or a selection row that attends all), the selected ones
  // (sparse), or the window's tokens and then the selected ones (sparse, Windowed).
  const bool dense = p.selection.indices == nullptr || attend_all;
  // A count outside [0, capacity] marks a bad row (SelectionView::counts: a primitive's -1): it reads nothing,
  // not even the window, and its running maxima start at NaN, which the warp merge, the split merge and the
  // LSE carry into O and LSE of every head. One compare on values already loaded, before the loop.
  const bool bad_row = !dense && unsigned(selected) > unsigned(p.selection.capacity);
  static_assert(Windowed || !Pages, "a page-level selection runs in the windowed kernel");
  int seq_len = 0, window = 0, count;
  [[maybe_unused]] int middle_begin = 0, middle_end = 0;
  if constexpr (Windowed) {
    seq_len = p.seq_len(b);
    window = dense || bad_row ? 0 : p.window.size(seq_len);
    if constexpr (Pages) {
      middle_begin = p.window.sink_end(seq_len);
      middle_end = p.window.recent_begin(seq_len);
      count = dense ? seq_len : bad_row ? 0 : int(min(std::int64_t(window) + std::int64_t(selected) * p.page_size,
                                                           std::int64_t(INT_MAX)));
    } else {
      count = dense ? seq_len : bad_row ? 0 : window + selected;
    }
  } else {
    count = dense ? p.seq_len(b) : bad_row ? 0 : selected;
  }
  const int chunk = (count + p.num_splits - 1) / p.num_splits;
  const int begin = min(count, split * chunk), end = min(count, begin + chunk);
  const int steps = (end - begin + kRowsPerCtaStep - 1) / kRowsPerCtaStep;

  const std::int32_t* indices = dense ? nullptr : p.selection.indices + sel_row * p.selection.capacity;
  const float* log_weights = dense || p.selection.log_weights == nullptr
                                 ? nullptr
                                 : p.selection.log_weights + sel_row * p.selection.capacity;

  // The entry of this lane's own row at a step, and its token, loaded one step before its copies are issued
  // so that no lane waits on an index load between issuing copies and computing.
  const auto entry_of = [&](int step) { return begin + step * kRowsPerCtaStep + warp * kRowsPerStep + own_row; };
  // A masked entry of a page (Pages) loads token -1.
  const auto load_token = [&](int step) {
    const int i = entry_of(step);
    if constexpr (Pages) {
      if (i >= end) return 0;
      if (dense) return i;
      if (i < window) return p.window.token(i, seq_len);
      // Unsigned arithmetic: any page id, however wild, gives a token that the range check keeps inside the
      // sequence (or masks), with no signed overflow.
      const std::uint32_t j = std::uint32_t(i - window), slot = p.pages.quotient(j);
      const std::uint32_t token = std::uint32_t(indices[slot]) * std::uint32_t(p.page_size) + (j - slot * p.page_size);
      return token >= std::uint32_t(middle_begin) && token < std::uint32_t(middle_end) ? int(token) : -1;
    } else if constexpr (Windowed) {
      if (i >= end) return 0;
      if (dense) return i;
      return i < window ? p.window.token(i, seq_len) : indices[i - window];
    } else {
      return i < end ? (dense ? i : indices[i]) : 0;
    }
  };
  // Issues the copies of `step` into its stage. Each warp-wide copy moves kRowsPerCopy whole rows (every
  // lane one 16-byte piece), so that a copy instruction requests full 128-byte lines; the rows' element
  // offsets come from their owner lanes. Owners also set the rows' logit biases: a selected row's log-weight,
  // 0 for a window row, or -inf for rows past the end (offset -1 marks those rows).
  const auto issue = [&](int step, int token) {
    const int stage = step % kStages, i = entry_of(step);
    const bool valid = i < end && (!Pages || token >= 0);
    const long long offset = valid ? p.kv_offset(b, kv_head, token) : -1;
    const int piece = lane % Shape::kPiecesPerRow;
#pragma unroll
    for (int first_row = 0; first_row < kRowsPerStep; first_row += Shape::kRowsPerCopy) {
      const int row = first_row + lane / Shape::kPiecesPerRow;
      const long long row_offset = __shfl_sync(0xffffffffu, offset, row);
      const bool row_valid = row_offset >= 0;
      const long long source = row_valid ? row_offset + piece * 8 : 0;
      cp_async16(k_tile(stage) + swizzled<HeadDim>(row, piece), p.k_base() + source, row_valid);
      cp_async16(v_tile(stage) + swizzled<HeadDim>(row, piece), p.v_base() + source, row_valid);
    }
    if (lane < kRowsPerStep) {
      const unsigned bias = biases(stage) + unsigned(own_row * 4);
      bool weighted = valid && log_weights != nullptr;
      if constexpr (Windowed) weighted = weighted && i >= window;  // window rows have no log-weight
      if (weighted) {
        cp_async4(bias, log_weights + (Pages ? int(p.pages.quotient(std::uint32_t(i - window))) : i - window));
      } else {
        store_shared(bias, valid ? 0.0f : negative_infinity<float>());
      }
    }
  };
  int token = 0;
#pragma unroll
  for (int step = 0; step < kStages - 1; ++step) {
    token = load_token(step);
    if (step < steps) issue(step, token);
    cp_async_commit();
  }
  token = load_token(kStages - 1);

  // A fragments of this tile's query heads (rows frag_row and frag_row + 8 of the 16-row tile), raw: the
  // softmax scale is applied to the fp32 scores.
  const int first_head = tile * kHeadsPerTile;
  const auto q_pair = [&](int head, int channel) -> unsigned {
    if (first_head + head >= p.group) return 0u;
    return *reinterpret_cast<const unsigned*>(p.q.row(b, kv_head * p.group + first_head + head) + channel);
  };
  unsigned q_frag[kKSteps][4];
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    q_frag[ks][0] = q_pair(frag_row, 16 * ks + frag_col);
    q_frag[ks][1] = q_pair(frag_row + 8, 16 * ks + frag_col);
    q_frag[ks][2] = q_pair(frag_row, 16 * ks + frag_col + 8);
    q_frag[ks][3] = q_pair(frag_row + 8, 16 * ks + frag_col + 8);
  }

  // Online softmax in base 2 for the lane's two heads (frag_row, frag_row + 8): running max, this lane's
  // share of the denominator (summed over the lane quad at the end), and its accumulator fragments.
  const float m_start = bad_row ? __int_as_float(0x7fffffff) : negative_infinity<float>();  // NaN: a bad row
  float m[2] = {m_start, m_start}, l[2] = {0.0f, 0.0f};
  float acc[kNTiles][4];
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

  for (int step = 0; step < steps; ++step) {
    __syncwarp();  // every lane is done reading the stage that the next copies overwrite
    if (step + kStages - 1 < steps) issue(step + kStages - 1, token);
    token = load_token(step + kStages);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncwarp();  // this step's copies, made by all lanes, are visible to the whole warp
    const int stage = step % kStages;

    // S = Q K^T for the step's 16 rows: two 8-row n-tiles; one ldmatrix.x4 feeds two k-steps.
    float s[2][4] = {};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ks += 2) {
        unsigned k_frag[4];
        ldmatrix_x4(k_frag, k_tile(stage) + swizzled<HeadDim>(nt * 8 + (lane & 7), 2 * ks + (lane >> 3)));
        mma_16x8x16<T>(s[nt], q_frag[ks], k_frag[0], k_frag[1]);
        mma_16x8x16<T>(s[nt], q_frag[ks + 1], k_frag[2], k_frag[3]);
      }
    }
    // s[nt][2 * h + e] is the score of head frag_row + 8h against row nt * 8 + frag_col + e.
    float bias[2][2];
    bool row_valid[2][2];
    const int step_first = begin + step * kRowsPerCtaStep + warp * kRowsPerStep;  // the entry of the step's row 0
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float2 pair = load_shared2(biases(stage) + unsigned((nt * 8 + frag_col) * 4));
      bias[nt][0] = pair.x * kLog2e;
      bias[nt][1] = pair.y * kLog2e;
      row_valid[nt][0] = step_first + nt * 8 + frag_col < end;
      row_valid[nt][1] = step_first + nt * 8 + frag_col + 1 < end;
      if constexpr (Pages) {
        // A page's masked entry (bias -inf; without log-weights nothing else has that bias) is masked outright, as
        // a row past the end is: its zero-filled K times an infinite scale would be NaN. With log-weights a weight
        // of -inf is indistinguishable from it and stays a biased row.
        if (log_weights == nullptr) {
          row_valid[nt][0] = row_valid[nt][0] && pair.x != negative_infinity<float>();
          row_valid[nt][1] = row_valid[nt][1] && pair.y != negative_infinity<float>();
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float step_max = negative_infinity<float>();
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // Rows past the end are masked to -inf outright: their zero-filled K gives 0 * inf = NaN with an
          // infinite query or sm_scale, which a -inf bias would not hide.
          s[nt][2 * h + e] = row_valid[nt][e] ? fmaf(s[nt][2 * h + e], p.scale_log2, bias[nt][e])
                                              : negative_infinity<float>();
          step_max = max_nan(step_max, s[nt][2 * h + e]);
        }
      }
      // The maximum keeps a NaN logit (fmaxf would drop it), so a NaN or +inf logit turns the whole state
      // NaN through the exponentials below, as in the reference (attention/state.hpp).
      step_max = max_nan(step_max, __shfl_xor_sync(0xffffffffu, step_max, 1));
      step_max = max_nan(step_max, __shfl_xor_sync(0xffffffffu, step_max, 2));
      const float m_new = max_nan(m[h], step_max);
      const bool any = m_new != negative_infinity<float>();
      const float correction = any ? exp2f(m[h] - m_new) : 1.0f;  // 0 when m[h] = -inf
      l[h] *= correction;
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) {
        acc[n][2 * h] *= correction;
        acc[n][2 * h + 1] *= correction;
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[nt][2 * h + e] = any ? exp2f(s[nt][2 * h + e] - m_new) : 0.0f;  // 0 for invalid rows
          l[h] += s[nt][2 * h + e];
        }
      }
      m[h] = m_new;
    }
    // P as the A fragment of O += P V (rows = heads, k = the step's 16 rows).
    const unsigned p_frag[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]), pack2<T>(s[1][0], s[1][1]),
                                pack2<T>(s[1][2], s[1][3])};
#pragma unroll
    for (int n = 0; n < kNTiles; n += 2) {
      unsigned v_frag[4];
      ldmatrix_x4_trans(v_frag, v_tile(stage) + swizzled<HeadDim>((lane & 7) + (lane & 8), n + (lane >> 4)));
      mma_16x8x16<T>(acc[n], p_frag, v_frag[0], v_frag[1]);
      mma_16x8x16<T>(acc[n + 1], p_frag, v_frag[2], v_frag[3]);
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }

  // Merge the warps' states through shared memory (reusing the pipeline's bytes).
  __syncthreads();
  float* s_m = reinterpret_cast<float*>(smem);   // [warp][head]
  float* s_l = s_m + Warps * kHeadsPerTile;      // [warp][head]
  float* s_o = s_l + Warps * kHeadsPerTile;      // [warp][head][kMergeRowFloats]
  float* cta_o = reinterpret_cast<float*>(smem) + decode_warp_states_bytes(HeadDim, Warps) / 4;  // [head][HeadDim]
  float* cta_lse = cta_o + kHeadsPerTile * HeadDim;                                              // [head]
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = frag_row + 8 * h;
    if (first_head + head >= p.group) continue;  // rows past the GQA group are never read
    if (lane % 4 == 0) {
      s_m[warp * kHeadsPerTile + head] = m[h];
      s_l[warp * kHeadsPerTile + head] = l[h];
    }
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
      *reinterpret_cast<float2*>(s_o + (warp * kHeadsPerTile + head) * Shape::kMergeRowFloats + n * 8 + frag_col) =
          make_float2(acc[n][2 * h], acc[n][2 * h + 1]);
    }
  }
  __syncthreads();

  for (int e = threadIdx.x; e < kHeadsPerTile * HeadDim; e += 32 * Warps) {
    const int head = e / HeadDim, c = e % HeadDim;
    if (first_head + head >= p.group) break;  // heads are visited in order
    float m_max = negative_infinity<float>();
#pragma unroll
    for (int w = 0; w < Warps; ++w) m_max = max_nan(m_max, s_m[w * kHeadsPerTile + head]);
    float denom = 0.0f, value = 0.0f;
    if (m_max != negative_infinity<float>()) {
#pragma unroll
      for (int w = 0; w < Warps; ++w) {
        const float weight = exp2f(s_m[w * kHeadsPerTile + head] - m_max);
        denom = fmaf(s_l[w * kHeadsPerTile + head], weight, denom);
        value = fmaf(s_o[(w * kHeadsPerTile + head) * Shape::kMergeRowFloats + c], weight, value);
      }
    }
    const float o = denom == 0.0f ? 0.0f : value / denom;
    const float lse = denom == 0.0f ? negative_infinity<float>() : (m_max + log2f(denom)) * kLn2;
    const int h = kv_head * p.group + first_head + head;
    if (p.cluster_merge) {
      cta_o[head * HeadDim + c] = o;
      if (c == 0) cta_lse[head] = lse;
    } else if (p.partials.o == nullptr) {
      p.out.o_row(b, h)[c] = from_float_device<T>(o);
      if (c == 0) p.out.lse_at(b, h) = lse;
    } else {  // split partials, or an fp32 output
      p.partials.o_row(b, h, split, HeadDim)[c] = o;
      if (c == 0) p.partials.lse_at(b, h, split) = lse;
    }
  }
  if (p.cluster_merge) merge_in_cluster<HeadDim>(p, b, kv_head, first_head, cta_o, cta_lse);
}

}  // namespace kvsift::cuda::detail

namespace kvsift::cuda::detail {

/// Tokens one pass of the selection check covers: a bitmap of this many bits in shared memory.
inline constexpr int kCheckBitmapWords = 8192;  // 32 KB, 262144 tokens
inline constexpr int kCheckThreads = 256;

/// Validation mode: one CTA per batch row's kv head checks its selection row's count against the capacity, every
/// index against [0, seq_len) less the attention window and, over passes of kCheckBitmapWords * 32 tokens, that no
/// token is listed twice; the smallest offending row goes to p.first_bad_row. The host then reads that row back and
/// names the first offending position (src/cuda/decode.cpp), so a refused call reports exactly what the CPU would.
template <class T>
__global__ void __launch_bounds__(kCheckThreads) check_selection_kernel(const __grid_constant__ DecodeParams<T> p) {
  __shared__ unsigned seen[kCheckBitmapWords];
  constexpr int kBits = kCheckBitmapWords * 32;
  const std::int64_t row = blockIdx.x;  // batch row b's kv head h: b * kv_heads + h
  const std::int64_t b = row / p.selection.kv_heads;
  const std::int64_t mapped = attended_selection_row(p.selection_rows, b, p.selection.batch);
  if (mapped < 0) {  // the row map names no row of the selection
    if (threadIdx.x == 0) atomicMin(p.first_bad_row, static_cast<unsigned long long>(row));
    return;
  }
  const std::int64_t selection_row = mapped * p.selection.kv_heads + row % p.selection.kv_heads;
  if (p.selection.attend_all != nullptr && p.selection.attend_all[selection_row] != 0) return;  // not read
  const int seq_len = p.seq_len(b);
  // The selectable middle, or a page-level selection's pages (every page of the sequence: a page's window tokens
  // are masked in the kernel, not refused).
  const bool pages = p.page_size > 1;
  const int lo = pages ? 0 : p.window.sink_end(seq_len);
  const int hi = pages ? int((std::int64_t(seq_len) + p.page_size - 1) / p.page_size) : p.window.recent_begin(seq_len);
  const int count = p.selection.counts[selection_row];
  const std::int32_t* indices = p.selection.indices + selection_row * p.selection.capacity;
  bool bad = count < 0 || count > p.selection.capacity;  // the same for the whole CTA
  // 64-bit passes: an int base would overflow past the last pass of a sequence near 2^31 tokens.
  for (std::int64_t base = 0; !bad && base < max(seq_len, 1); base += kBits) {
    for (int w = threadIdx.x; w < kCheckBitmapWords; w += blockDim.x) seen[w] = 0u;
    __syncthreads();
    bool mine = false;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
      const int token = indices[i];
      const std::int64_t offset = token - base;
      if (token < lo || token >= hi) {
        mine = true;
      } else if (offset >= 0 && offset < kBits) {
        const unsigned bit = 1u << unsigned(offset % 32);
        mine |= (atomicOr(&seen[offset / 32], bit) & bit) != 0u;
      }
    }
    bad = __syncthreads_or(mine) != 0;
  }
  if (bad && threadIdx.x == 0) atomicMin(p.first_bad_row, static_cast<unsigned long long>(row));
}

template <int... Values, class F>
bool dispatch_int(int value, F&& f) {
  return ((value == Values ? (f.template operator()<Values>(), true) : false) || ...);
}

/// The one place where the runtime head_dim, warp count, window and selection pages become template arguments: calls
/// fn(kernel, dynamic_smem_bytes, threads) for the matching decode kernel, once its shared-memory limit is
/// raised (cuda/detail/launch.cuh). Returns cudaErrorInvalidValue for an unsupported head_dim or warp count (the host entry points
/// validate both, the warp count against the device's shared memory, before).
template <class T, class Fn>
cudaError_t with_decode_kernel(const DecodeParams<T>& p, Fn&& fn) {
  cudaError_t status = cudaErrorInvalidValue;
  dispatch_value<kCudaAttentionHeadDims>(p.q.head_dim, [&]<int HeadDim>() {
    dispatch_int<kDecodeMinWarps, kDecodeMaxWarps>(p.cta_warps, [&]<int Warps>() {
      constexpr std::size_t smem = decode_shared_bytes(HeadDim, Warps);
      if constexpr (smem <= kLargestBlockSharedMemory) {
        // 0: tokens, no window; 1: tokens after a window; 2: pages (after a window, which may be empty).
        const int entries = p.page_size > 1 ? 2 : p.window.empty() ? 0 : 1;
        dispatch_int<0, 1, 2>(entries, [&]<int Entries>() {
          constexpr auto kernel = decode_attention_kernel<HeadDim, T, Warps, Entries != 0, Entries == 2>;
          status = open_shared_memory<kernel>();
          if (status == cudaSuccess) status = fn(kernel, smem, 32 * Warps);
        });
      }
    });
  });
  return status;
}

template <class T>
cudaError_t launch_decode(const DecodeParams<T>& p, cudaStream_t stream, bool programmatic) {
  const int kv_heads = p.paged ? p.paged_kv.kv_heads : p.kv.kv_heads;
  const dim3 grid(p.num_splits, kv_heads * p.head_tiles, p.q.batch);
  const cudaError_t status = with_decode_kernel(p, [&](auto kernel, std::size_t smem, int threads) {
    return launch(kernel,
                  {.grid = grid, .block = dim3(threads), .smem = smem, .stream = stream,
                   .cluster = p.cluster_merge ? p.num_splits : 1, .programmatic = programmatic},
                  p);
  });
  if (status != cudaSuccess || p.num_splits == 1 || p.cluster_merge) return status;
  // The merge is always a programmatic dependent of the decode grid: its launch overlaps the grid's tail.
  return launch(merge_splits_kernel<T>,
                {.grid = dim3(p.q.batch * p.q.heads), .block = dim3(kMergeThreads), .stream = stream, .programmatic = true}, p);
}

template <class T>
cudaError_t launch_check_selection(const DecodeParams<T>& p, cudaStream_t stream) {
  const std::int64_t rows = std::int64_t(p.q.batch) * p.selection.kv_heads;
  check_selection_kernel<T><<<dim3(unsigned(rows)), kCheckThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <class TI, class TO>
cudaError_t launch_merge_states(const MergeParams<TI, TO>& p, cudaStream_t stream) {
  static_assert(sizeof(MergeParams<TI, TO>) <= 4096, "kernel parameters are limited to 4 KB before CUDA 12.1");
  merge_states_kernel<TI, TO><<<p.out.batch * p.out.heads, kMergeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvsift::cuda::detail
