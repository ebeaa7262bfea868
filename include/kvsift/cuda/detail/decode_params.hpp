#pragma once
/// Parameters of kvsift's one CUDA decode-attention kernel family, which serves both dense decode (no
/// selection: every token of the sequence) and sparse decode (the tokens a selection lists). Passed by value
/// as a __grid_constant__ kernel parameter. Pointers are device memory.

#include <cstddef>
#include <cstdint>

#include "kvsift/core/fast_divisor.hpp"
#include "kvsift/attention/options.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda {

/// Query heads of one GQA group that one CTA serves: the 16 rows of the tensor-core tile (a smaller group
/// leaves rows empty; a larger one takes several tiles).
inline constexpr int kHeadsPerTile = 16;
/// Largest head_dim the merge kernels take (merge_states and the split merge).
inline constexpr int kMergeMaxHeadDim = 512;

/// The decode kernel's CTA shape. Each warp streams its own steps of kDecodeRowsPerStep K/V rows through a
/// kDecodeStages-deep cp.async pipeline in shared memory; a CTA has 4 or 8 warps (kDecodeMaxWarps where
/// the GPU gives a block that much shared memory: 198 KB at head_dim 128, i.e. sm_90; see
/// DecodeOptions::cta_warps).
inline constexpr int kDecodeStages = 3;       ///< per-warp stages: two in flight while one is consumed
inline constexpr int kDecodeRowsPerStep = 16;  ///< K/V rows a warp consumes per step: the k extent of one P·V MMA
inline constexpr int kDecodeMinWarps = 4;
inline constexpr int kDecodeMaxWarps = 8;
/// The most dynamic shared memory any GPU kvsift supports gives a block (sm_90: 227 KB). CTA shapes needing
/// more are never instantiated (eight warps at head_dim 256).
inline constexpr std::size_t kLargestBlockSharedMemory = 232448;

/// Bytes of one warp's pipeline stage: its K tile, its V tile (kDecodeRowsPerStep rows each, 2-byte
/// elements) and the rows' base-e logit biases.
constexpr std::size_t decode_stage_bytes(int head_dim) {
  return 2 * std::size_t(kDecodeRowsPerStep) * head_dim * 2 + kDecodeRowsPerStep * 4;
}
/// A head's O row in the warps' final merge, padded by 8 floats: the accumulator fragments' float2 stores
/// (8 heads x 4 column pairs per warp) then fall on 32 distinct banks per half-warp, where unpadded rows put
/// the 8 heads on one bank (an 8-way conflict; removing it saved 0.3-0.4 us per call on the H100).
constexpr int decode_merge_row_floats(int head_dim) { return head_dim + 8; }
/// Bytes of the warps' states in the CTA's final merge: per warp and head, O (padded) and the running max and sum.
constexpr std::size_t decode_warp_states_bytes(int head_dim, int warps) {
  return std::size_t(warps) * kHeadsPerTile * (decode_merge_row_floats(head_dim) + 2) * 4;
}
/// Bytes of the CTA's merged state, which its cluster reads in a cluster merge: O [kHeadsPerTile][head_dim] and
/// LSE [kHeadsPerTile], after the warps' states.
constexpr std::size_t decode_cta_state_bytes(int head_dim) { return std::size_t(kHeadsPerTile) * (head_dim + 1) * 4; }
/// Dynamic shared memory of a decode CTA with `warps` warps: the warps' pipelines, whose bytes later hold
/// the warps' states for the final merge, then the CTA's state.
constexpr std::size_t decode_shared_bytes(int head_dim, int warps) {
  const std::size_t pipelines = std::size_t(warps) * kDecodeStages * decode_stage_bytes(head_dim);
  const std::size_t merge = decode_warp_states_bytes(head_dim, warps) + decode_cta_state_bytes(head_dim);
  return pipelines > merge ? pipelines : merge;
}

/// Where fp32 states go: state (b, h, split) has its O at o + b * o_batch_stride + h * o_head_stride +
/// split * head_dim and its LSE (natural log) at lse + b * lse_batch_stride + h * lse_head_stride + split.
/// The split partials in the workspace are [batch, q_heads, num_splits, head_dim]; an unsplit call with an
/// fp32 output writes that output through the same strides (split 0).
struct PartialStates {
  float* o = nullptr;
  float* lse = nullptr;
  std::int64_t o_batch_stride = 0;
  std::int64_t o_head_stride = 0;
  std::int64_t lse_batch_stride = 0;
  std::int64_t lse_head_stride = 0;

  KVSIFT_HOST_DEVICE float* o_row(std::int64_t b, std::int64_t h, std::int64_t split, std::int64_t head_dim) const {
    return o + b * o_batch_stride + h * o_head_stride + split * head_dim;
  }
  KVSIFT_HOST_DEVICE float& lse_at(std::int64_t b, std::int64_t h, std::int64_t split) const {
    return lse[b * lse_batch_stride + h * lse_head_stride + split];
  }
};

template <class T>
struct DecodeParams {
  using DType = T;  ///< storage type of Q, K, V and O: kvsift::half or kvsift::bfloat16

  QueryView<const T> q;
  ContiguousKVView<const T> kv;      ///< used when !paged
  PagedKVView<const T> paged_kv;     ///< used when paged
  bool paged = false;
  SelectionView selection;           ///< indices == nullptr means dense decode
  StateView<T> out;                  ///< the output in the storage type, unless out_f32.o is set
  StateView<float> out_f32;          ///< the output in fp32 (a partial state for a later merge), when o is set
  /// fp32 states the decode kernel writes instead of `out`, when o is set: the split partials (workspace) when
  /// num_splits > 1 with the merge kernel, else out_f32 itself (unsplit); null with a cluster merge, which writes out
  /// or out_f32 from shared memory. The merge kernel reads the partials and writes out or out_f32.
  PartialStates partials;
  unsigned long long* first_bad_row = nullptr;  ///< validation mode: the smallest selection row refused

  std::int32_t group = 1;            ///< q_heads / kv_heads
  std::int32_t head_tiles = 1;       ///< CTAs along the GQA group (group split into tiles of kHeadsPerTile heads)
  std::int32_t num_splits = 1;       ///< CTAs along the tokens of one (sequence, kv head)
  /// num_splits > 1: the row's CTAs form a cluster (along x) and merge their states over distributed shared memory
  /// into out or out_f32 (SplitMerge::cluster); partials unused. Else the split merge kernel reads the partials.
  bool cluster_merge = false;
  std::int32_t cta_warps = kDecodeMaxWarps;  ///< warps per CTA: kDecodeMinWarps or kDecodeMaxWarps
  float scale_log2 = 0.0f;           ///< sm_scale * log2(e): logits are kept in base 2 inside the kernel
  AttentionWindow window{};          ///< sparse decode: attended before each row's selected entries
  std::int32_t page_size = 1;        ///< sparse decode: tokens per selection entry (AttentionOptions::selection_page_size)
  FastDivisor pages{};               ///< division by page_size in the entries' address path
  const std::int32_t* selection_rows = nullptr;  ///< sparse decode: AttentionOptions::selection_rows, or nullptr

  KVSIFT_HOST_DEVICE std::int32_t seq_len(std::int64_t b) const { return paged ? paged_kv.seq_len(b) : kv.seq_len(b); }
  /// Element offset of a token's row from k_base() and v_base() (K and V share their strides).
  KVSIFT_HOST_DEVICE std::int64_t kv_offset(std::int64_t b, std::int64_t h, std::int64_t t) const {
    return paged ? paged_kv.offset(b, h, t) : kv.offset(b, h, t);
  }
  KVSIFT_HOST_DEVICE const T* k_base() const { return paged ? paged_kv.k_pages : kv.k; }
  KVSIFT_HOST_DEVICE const T* v_base() const { return paged ? paged_kv.v_pages : kv.v; }
};

/// Parameters of the standalone merge of up to kMaxPartials states (hybrid CPU/GPU, context shards): inputs
/// in TI, output in TO. The partials' views travel by value in the kernel's parameters (56 bytes each), which
/// keeps the merge one launch with nothing to copy or allocate; kMaxPartials views fit the 4 KB that every
/// architecture kvsift builds for accepts.
template <class TI, class TO>
struct MergeParams {
  static constexpr int kMaxPartials = 64;
  StateView<const TI> partials[kMaxPartials];
  std::int32_t num_partials = 0;
  StateView<TO> out;
};

}  // namespace kvsift::cuda
