#pragma once
/// Parameters of kvsift's one CUDA decode-attention kernel family, which serves both dense decode (no
/// selection: every token of the sequence) and sparse decode (the tokens a selection lists). Passed by value
/// as a __grid_constant__ kernel parameter. Pointers are device memory.

#include <cstdint>

#include "kvsift/core/views.hpp"

namespace kvsift::cuda {

/// Query heads of one GQA group that one CTA serves: the 16 rows of the tensor-core tile (a smaller group
/// leaves rows empty; a larger one takes several tiles).
inline constexpr int kHeadsPerTile = 16;
/// Largest head_dim the merge kernels take (merge_states and the split merge).
inline constexpr int kMergeMaxHeadDim = 512;

template <class T>
struct DecodeParams {
  using DType = T;  ///< storage type of Q, K, V and O: kvsift::half or kvsift::bfloat16

  QueryView<const T> q;
  ContiguousKVView<const T> kv;      ///< used when !paged
  PagedKVView<const T> paged_kv;     ///< used when paged
  bool paged = false;
  SelectionView selection;           ///< indices == nullptr means dense decode
  StateView<T> out;

  float* partial_o = nullptr;        ///< [batch, q_heads, num_splits, head_dim] when num_splits > 1
  float* partial_lse = nullptr;      ///< [batch, q_heads, num_splits], natural log
  unsigned long long* first_bad_index = nullptr;  ///< validation mode: smallest (row << 32 | position) found

  std::int32_t group = 1;            ///< q_heads / kv_heads
  std::int32_t head_tiles = 1;       ///< CTAs along the GQA group (group split into tiles of kHeadsPerTile heads)
  std::int32_t num_splits = 1;       ///< CTAs along the tokens of one (sequence, kv head)
  float scale_log2 = 0.0f;           ///< sm_scale * log2(e): logits are kept in base 2 inside the kernel

  KVSIFT_HOST_DEVICE std::int32_t seq_len(std::int64_t b) const { return paged ? paged_kv.seq_len(b) : kv.seq_len(b); }
  /// Element offset of a token's row from k_base() and v_base() (K and V share their strides).
  KVSIFT_HOST_DEVICE std::int64_t kv_offset(std::int64_t b, std::int64_t h, std::int64_t t) const {
    return paged ? paged_kv.offset(b, h, t) : kv.offset(b, h, t);
  }
  KVSIFT_HOST_DEVICE const T* k_base() const { return paged ? paged_kv.k_pages : kv.k; }
  KVSIFT_HOST_DEVICE const T* v_base() const { return paged ? paged_kv.v_pages : kv.v; }
};

/// Parameters of the standalone merge of up to kMaxPartials states (hybrid CPU/GPU, context shards).
template <class T>
struct MergeParams {
  static constexpr int kMaxPartials = 16;
  StateView<const T> partials[kMaxPartials];
  std::int32_t num_partials = 0;
  StateView<T> out;
};

}  // namespace kvsift::cuda
