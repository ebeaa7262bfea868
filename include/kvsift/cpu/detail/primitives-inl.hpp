#pragma once
/// Bodies of the per-ISA primitive kernels (see primitives_kernels.hpp), written once over Vec<L>.

#include <limits>

#include "kvsift/cpu/detail/decode-inl.hpp"
#include "kvsift/cpu/detail/primitives_kernels.hpp"

namespace kvsift::cpu::detail {

template <SimdLevel L, class T>
void gemv_rows(const float* q, const MatrixView<const T>& rows, float scale, float* scores, std::int64_t begin,
               std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) scores[i] = scale * dot<L>(q, rows.row(i), rows.cols);
}

template <SimdLevel L>
void assign_rows(const MatrixView<const float>& points, const MatrixView<const float>& centroids,
                 const float* centroid_norms, bool cosine, std::int32_t* assignment, std::int64_t begin,
                 std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) {
    // Nearest in L2 is the largest x.c - |c|^2 / 2 (|x|^2 is the same for every centroid); for unit
    // vectors, the largest x.c.
    float best = -std::numeric_limits<float>::infinity();
    std::int32_t best_id = 0;
    for (std::int64_t c = 0; c < centroids.rows; ++c) {
      float score = dot<L>(points.row(i), centroids.row(c), points.cols);
      if (!cosine) score -= 0.5f * centroid_norms[c];
      if (score > best) {  // strict: on a tie the smaller id stays
        best = score;
        best_id = std::int32_t(c);
      }
    }
    assignment[i] = best_id;
  }
}

}  // namespace kvsift::cpu::detail
