#pragma once
/// Codebook (vector) quantization of keys, per-query lookup tables and the scan of codes to scores: A²ATS's
/// primitives (its eqs. 15-21), shared by selectors/a2ats/cpu/vq.hpp and cuda/vq.hpp. Views, the argument checks both backends
/// make with the same words, and the host-device rules both apply to values they only meet in their own memory.
///
/// The math, with row vectors as in the paper. Per (layer, kv head) an offline calibration gives a lower-
/// triangular L [d, d] (the Cholesky factor of the queries' second moment H = L L^T) and a codebook C^z
/// [codewords, d] of transformed keys z = k L; the key-space codebook is C = C^z L^-1. A key's code is the
/// codeword nearest to z = k L in L2, which is the codeword minimising (k - C_c) H (k - C_c)^T:
///   code(k) = argmin_c |C^z_c|^2 - 2 z . C^z_c   (ties: the smaller c).
/// A decode query q~ (already rotated to A²ATS's fixed position) scores token t as q~ . C_code(t): a lookup table
/// lut[c] = q~ . C_c per query head, then scores[t] = lut[codes[t]] (or, VqScanOptions::group_max, the maximum of
/// the GQA group's entries).

#include <array>
#include <cstdint>

#include <type_traits>

#include "kvsift/core/config.hpp"
#include "kvsift/core/supported_values.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

/// head_dim of the codebook primitives, on both backends (their kernels are compiled for these).
inline constexpr std::array<int, 2> kVqHeadDims{64, 128};

/// Codes are uint16: at most 65536 codewords (A²ATS uses 4096).
inline constexpr std::int32_t kVqMaxCodewords = 65536;

/// Codes of every token of every slot: [slots, kv_heads, max_tokens] uint16 (C = std::uint16_t, or const for
/// reading), token t of (slot s, kv head h) at data[s * slot_stride + h * head_stride + t].
template <class C>
struct VqCodesView {
  C* data = nullptr;
  std::int32_t slots = 0;
  std::int32_t kv_heads = 0;
  std::int32_t max_tokens = 0;
  std::int64_t slot_stride = 0;
  std::int64_t head_stride = 0;

  KVSIFT_HOST_DEVICE C* row(std::int64_t slot, std::int64_t h) const { return data + slot * slot_stride + h * head_stride; }

  static constexpr VqCodesView packed(C* data, std::int32_t slots, std::int32_t kv_heads, std::int32_t max_tokens) {
    return {data, slots, kv_heads, max_tokens, std::int64_t{kv_heads} * max_tokens, max_tokens};
  }
  constexpr VqCodesView<const C> as_const() const
    requires(!std::is_const_v<C>)
  {
    return {data, slots, kv_heads, max_tokens, slot_stride, head_stride};
  }
};

/// What vq_encode assigns codes with, per kv head h (fp32, packed, in the backend's memory):
/// transform + h * d * d is L, row-major, lower-triangular: z_j = sum_{i >= j} k_i L[i][j] (the upper triangle is
/// never read); centroids + h * codewords * d is C^z; norms + h * codewords holds |C^z_c|^2, computed once when
/// the codebooks load by vq_codeword_norms (both backends' encoders rank by the same stored norms).
struct VqEncodeCodebook {
  const float* transform = nullptr;  ///< [kv_heads, head_dim, head_dim]
  const float* centroids = nullptr;  ///< [kv_heads, codewords, head_dim]
  const float* norms = nullptr;      ///< [kv_heads, codewords]
  std::int32_t kv_heads = 0;
  std::int32_t codewords = 0;
  std::int32_t head_dim = 0;
};

/// The key-space codebooks the lookup tables are built from: C [kv_heads, codewords, head_dim], packed, in the
/// query's storage type T (C = C^z L^-1 rounded once, when the codebooks load: bf16 halves the bytes every decode
/// step reads, and its 2^-9 relative rounding is far below the quantization error itself; pass T = float for
/// fp32 tables). On CUDA the pointer must be 16-byte aligned (rows are read 16 bytes at a time).
template <class T>
struct VqCodebook {
  const T* data = nullptr;  ///< [kv_heads, codewords, head_dim]
  std::int32_t kv_heads = 0;
  std::int32_t codewords = 0;
  std::int32_t head_dim = 0;

  KVSIFT_HOST_DEVICE const T* row(std::int64_t h, std::int64_t c) const {
    return data + (h * codewords + c) * head_dim;
  }
};

/// Where vq_encode writes the code of key row r (for every kv head h): codes.row(slot_r, h)[position_r] with
///   slot_r = slots ? slots[r] : slot,   position_r = (positions ? positions[r] : r) + position_offset.
/// Prefill of one sequence: slots = positions = nullptr, slot = its slot, position_offset = its first token.
/// Append of one token per sequence: slots = the batch's slots, positions = the lengths (the new token
/// included), position_offset = -1. Arrays in the backend's memory. A row whose destination falls outside
/// [0, codes.slots) x [0, codes.max_tokens) is not written (on both backends; the device cannot report it).
struct VqCodeDestination {
  const std::int32_t* slots = nullptr;      ///< [rows] or nullptr
  const std::int32_t* positions = nullptr;  ///< [rows] or nullptr
  std::int32_t slot = 0;
  std::int32_t position_offset = 0;
};

/// Options of the code scans (vq_code_scan, vq_lut_scan on both backends).
struct VqScanOptions {
  /// One score row per (sequence, kv head) instead of one per query head: scores [batch * kv_heads, cols], row
  /// b * kv_heads + g holding for each token the maximum over g's query heads of their table entries (NaN when
  /// any is NaN). Each code is still read once; the group's scores are reduced before they are written, so the
  /// scan writes a group's worth fewer bytes (A²ATS's group-maximum rule, where topk_rows then takes one row per
  /// kv head).
  bool group_max = false;
};

/// The shapes behind vq_topk_rows' workspace (both backends): the scan's, the score rows' length and the top-k.
struct VqTopKShape {
  std::int32_t batch = 0, q_heads = 0, kv_heads = 0, codewords = 0, head_dim = 0;
  std::int32_t max_tokens = 0;  ///< the score rows' length: topk_rows' scores.cols
  std::int32_t k = 0;           ///< topk_rows' k
  VqScanOptions scan;           ///< group_max: one score row per kv head, else one per query head and their union
};

namespace detail {

/// The group maximum's reduction, in head order: the larger of the running maximum m and a head's entry x, NaN
/// once either is NaN; the same function on both backends, so their group maxima agree bit for bit.
KVSIFT_HOST_DEVICE inline float vq_group_max(float m, float x) { return (m > x || m != m) ? m : x; }

/// Where row r's codes go: false when outside the codes view (the row is skipped).
template <class C>
KVSIFT_HOST_DEVICE inline bool vq_destination(const VqCodeDestination& dest, const VqCodesView<C>& codes,
                                              std::int64_t r, std::int32_t* slot, std::int32_t* position) {
  const std::int64_t s = dest.slots != nullptr ? dest.slots[r] : dest.slot;
  const std::int64_t p = (dest.positions != nullptr ? std::int64_t(dest.positions[r]) : r) + dest.position_offset;
  *slot = std::int32_t(s);
  *position = std::int32_t(p);
  return s >= 0 && s < codes.slots && p >= 0 && p < codes.max_tokens;
}

/// The tokens a scan writes for batch row b: min(length, scores.cols, codes.max_tokens), never negative. A slot
/// outside [0, codes.slots) writes NaN over those tokens (the rows must not pass for scores).
KVSIFT_HOST_DEVICE inline std::int32_t vq_scan_length(std::int32_t length, std::int32_t cols, std::int32_t max_tokens) {
  const std::int32_t limit = cols < max_tokens ? cols : max_tokens;
  return length < 0 ? 0 : (length > limit ? limit : length);
}

}  // namespace detail
}  // namespace kvsift
