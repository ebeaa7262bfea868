#pragma once
/// Per-ISA kernels of the CPU primitives (cpu/primitives.hpp): defined in primitives-inl.hpp, instantiated
/// only in src/cpu/primitives_<level>.cpp, dispatched once per call from src/cpu/primitives.cpp.

#include <cstdint>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu::detail {

/// scores[i] = scale * dot(q, rows.row(i)) for i in [begin, end).
template <SimdLevel L, class T>
void gemv_rows(const float* q, const MatrixView<const T>& rows, float scale, float* scores, std::int64_t begin,
               std::int64_t end);

/// assignment[i] = the centroid nearest point i (squared L2, or largest dot for unit vectors when cosine;
/// ties: smaller id) for i in [begin, end). centroid_norms holds each centroid's squared norm (L2 only).
template <SimdLevel L>
void assign_rows(const MatrixView<const float>& points, const MatrixView<const float>& centroids,
                 const float* centroid_norms, bool cosine, std::int32_t* assignment, std::int64_t begin,
                 std::int64_t end);

}  // namespace kvsift::cpu::detail
