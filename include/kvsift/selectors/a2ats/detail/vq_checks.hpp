#pragma once
/// The argument checks that selectors/a2ats/cpu/vq.hpp and selectors/a2ats/cuda/vq.hpp share: the same refusals with the same words on both
/// backends. Values in the backend's memory (slots, lengths, positions, codes) are not read here.

#include <cstdint>

#include "kvsift/core/detail/topk_rows_checks.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/selectors/a2ats/vq.hpp"

namespace kvsift::detail {

inline void check_vq_codewords(const char* where, const char* name, std::int32_t codewords) {
  KVSIFT_CHECK(codewords >= 1 && codewords <= kVqMaxCodewords, where, "{} (= {}) is outside [1, {}]", name, codewords,
               kVqMaxCodewords);
}

template <class C>
void check_vq_codes(const char* where, const char* name, const VqCodesView<C>& codes) {
  KVSIFT_CHECK(codes.data != nullptr, where, "{}.data is a null pointer", name);
  KVSIFT_CHECK(codes.slots > 0 && codes.kv_heads > 0 && codes.max_tokens > 0, where,
               "{} is [{}, {}, {}]; every dimension must be positive", name, codes.slots, codes.kv_heads,
               codes.max_tokens);
  check_no_overlap<3>(where, name,
                              {{{"slot", codes.slots, codes.slot_stride},
                                {"head", codes.kv_heads, codes.head_stride},
                                {"token", codes.max_tokens, 1}}});
}

inline void check_vq_norms_shape(const char* where, const MatrixView<const float>& centroids, const float* norms) {
  validate(centroids, where, "centroids");
  KVSIFT_CHECK(norms != nullptr, where, "norms is a null pointer");
}

template <class T>
void check_vq_encode(const char* where, const HeadsView<const T>& keys, const VqEncodeCodebook& codebook,
                     const VqCodesView<std::uint16_t>& codes) {
  validate(keys, where, "keys");
  check_supported(where, "keys.head_dim", keys.head_dim, kVqHeadDims);
  check_vq_codewords(where, "codebook.codewords", codebook.codewords);
  KVSIFT_CHECK(codebook.transform != nullptr && codebook.centroids != nullptr && codebook.norms != nullptr, where,
               "codebook.transform, codebook.centroids and codebook.norms must be non-null");
  KVSIFT_CHECK(codebook.kv_heads == keys.heads && codebook.head_dim == keys.head_dim, where,
               "codebook is [kv_heads = {}, head_dim = {}]; keys has {} heads of head_dim {}", codebook.kv_heads,
               codebook.head_dim, keys.heads, keys.head_dim);
  check_vq_codes(where, "codes", codes);
  KVSIFT_CHECK(codes.kv_heads == keys.heads, where, "codes.kv_heads (= {}) != keys.heads (= {})", codes.kv_heads,
               keys.heads);
}

template <class T>
void check_vq_codebook(const char* where, const VqCodebook<T>& codebook) {
  KVSIFT_CHECK(codebook.data != nullptr, where, "codebook.data is a null pointer");
  KVSIFT_CHECK(codebook.kv_heads > 0, where, "codebook.kv_heads (= {}) must be positive", codebook.kv_heads);
  check_vq_codewords(where, "codebook.codewords", codebook.codewords);
  check_supported(where, "codebook.head_dim", codebook.head_dim, kVqHeadDims);
}

/// The group shape of q against the codebook: q.heads a multiple of codebook.kv_heads, the same head_dim.
template <class T>
void check_vq_query(const char* where, const QueryView<const T>& q, const VqCodebook<T>& codebook) {
  validate(q, where, "q");
  check_vq_codebook(where, codebook);
  KVSIFT_CHECK(q.head_dim == codebook.head_dim, where, "q.head_dim (= {}) != codebook.head_dim (= {})", q.head_dim,
               codebook.head_dim);
  KVSIFT_CHECK(q.heads % codebook.kv_heads == 0, where, "q.heads (= {}) is not a multiple of codebook.kv_heads (= {})",
               q.heads, codebook.kv_heads);
}

/// lut [batch * q_heads, codewords]: row b * q_heads + h is query head h of sequence b.
inline void check_vq_lut_shape(const char* where, const char* name, const MatrixView<const float>& lut,
                               std::int32_t batch, std::int32_t q_heads, std::int32_t codewords) {
  validate(lut, where, name);
  KVSIFT_CHECK(lut.rows == std::int64_t(batch) * q_heads && lut.cols == codewords, where,
               "{} is [{}, {}]; expected [batch * q_heads = {} * {}, codewords = {}]", name, lut.rows, lut.cols, batch,
               q_heads, codewords);
}

/// A scan: scores [batch * q_heads, cols] (group_max: [batch * kv_heads, cols]), codes with kv_heads dividing
/// q_heads, slots and lengths [batch].
inline void check_vq_scan(const char* where, std::int32_t batch, std::int32_t q_heads,
                          const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots,
                          const std::int32_t* lengths, const MatrixView<float>& scores, const VqScanOptions& options) {
  check_vq_codes(where, "codes", codes);
  KVSIFT_CHECK(q_heads % codes.kv_heads == 0, where, "q_heads (= {}) is not a multiple of codes.kv_heads (= {})",
               q_heads, codes.kv_heads);
  KVSIFT_CHECK(slots != nullptr && lengths != nullptr, where, "slots and lengths must be non-null");
  validate(scores, where, "scores");
  const std::int32_t heads = options.group_max ? codes.kv_heads : q_heads;
  KVSIFT_CHECK(scores.rows == std::int64_t(batch) * heads, where, "scores.rows (= {}) != batch * {} (= {} * {})",
               scores.rows, options.group_max ? "kv_heads (options.group_max)" : "q_heads", batch, heads);
}

/// Score rows per batch row: one per kv head with scan.group_max, else one per query head (their union).
inline std::int32_t vq_topk_score_heads(const VqTopKShape& shape) {
  return shape.scan.group_max ? shape.kv_heads : shape.q_heads;
}

/// topk_rows' heads_per_row for the shape: 1 with scan.group_max, else the group.
inline std::int32_t vq_topk_heads_per_row(const VqTopKShape& shape) {
  return shape.scan.group_max ? 1 : shape.q_heads / shape.kv_heads;
}

/// Positive sizes, q_heads a multiple of kv_heads (the rest is checked by the primitives the run calls).
inline void check_vq_topk_shape(const char* where, const VqTopKShape& s) {
  KVSIFT_CHECK(s.batch > 0 && s.kv_heads > 0 && s.q_heads > 0 && s.q_heads % s.kv_heads == 0, where,
               "batch (= {}), q_heads (= {}) and kv_heads (= {}) must be positive, q_heads a multiple of kv_heads",
               s.batch, s.q_heads, s.kv_heads);
  KVSIFT_CHECK(s.max_tokens > 0, where, "max_tokens (= {}) must be positive", s.max_tokens);
}

/// The shape must be the arguments' (batch, heads, codewords, head_dim), and the options must name the shape's
/// topk_rows: heads_per_row as vq_topk_heads_per_row says.
template <class T>
void check_vq_topk_call(const char* where, const QueryView<const T>& q, const VqCodebook<T>& codebook,
                        const VqTopKShape& s, const TopKRowsOptions& options) {
  check_vq_topk_shape(where, s);
  KVSIFT_CHECK(s.batch == q.batch && s.q_heads == q.heads && s.kv_heads == codebook.kv_heads &&
                   s.codewords == codebook.codewords && s.head_dim == q.head_dim,
               where,
               "shape (batch {}, q_heads {}, kv_heads {}, codewords {}, head_dim {}) is not the arguments' (q: batch {}, "
               "heads {}, head_dim {}; codebook: kv_heads {}, codewords {})",
               s.batch, s.q_heads, s.kv_heads, s.codewords, s.head_dim, q.batch, q.heads, q.head_dim,
               codebook.kv_heads, codebook.codewords);
  KVSIFT_CHECK(options.heads_per_row == vq_topk_heads_per_row(s), where,
               "options.heads_per_row (= {}) must be {} ({}: q_heads {}, kv_heads {})", options.heads_per_row,
               vq_topk_heads_per_row(s), s.scan.group_max ? "1 with scan.group_max" : "the group without it",
               s.q_heads, s.kv_heads);
}

/// A vq_topk_rows call on either backend, before any form is chosen: the shape against the arguments, the queries
/// against the codebook, the codes, the slots and lengths pointers (lengths named `lengths_name`), and topk_rows'
/// checks of the score rows' shape, the options and the output.
template <class T>
void check_vq_topk_rows(const char* where, const QueryView<const T>& q, const VqCodebook<T>& codebook,
                        const VqCodesView<const std::uint16_t>& codes, const std::int32_t* slots,
                        const std::int32_t* lengths, const char* lengths_name, const VqTopKShape& shape,
                        const TopKRowsOptions& options, const SelectionView& out) {
  check_vq_topk_call(where, q, codebook, shape, options);
  check_vq_query(where, q, codebook);
  check_vq_codes(where, "codes", codes);
  KVSIFT_CHECK(codes.kv_heads == codebook.kv_heads, where, "codes.kv_heads (= {}) != codebook.kv_heads (= {})",
               codes.kv_heads, codebook.kv_heads);
  KVSIFT_CHECK(slots != nullptr, where, "slots must be non-null");
  const std::int64_t score_rows = std::int64_t(shape.batch) * vq_topk_score_heads(shape);
  check_topk_rows_shape(where, score_rows, shape.max_tokens, shape.k, options);
  check_topk_rows_output(where, score_rows, lengths, lengths_name, shape.k, options, out);
}

}  // namespace kvsift::detail
