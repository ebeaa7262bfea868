#pragma once
/// Kernels and launchers of the CUDA primitives (cuda/primitives.hpp). Launchers return the launch status
/// and never throw; src/cuda/primitives.cpp validates and calls them.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/core/rope.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

/// Sizes of the two CUB radix sorts behind top-K (temporary storage only).
cudaError_t topk_cub_bytes(std::int64_t rows, std::int32_t n, std::int32_t k, std::size_t* first_sort,
                           std::size_t* second_sort);

struct TopKBuffers {
  unsigned long long* keys_in;
  unsigned long long* keys_out;
  std::int32_t* values_in;
  std::int32_t* values_out;
  unsigned long long* chosen_in;
  unsigned long long* chosen_out;
  void* cub_temp;
  std::size_t cub_temp_bytes;
};

cudaError_t launch_topk(const MatrixView<const float>& scores, std::int32_t k, std::int32_t* indices,
                        const TopKBuffers& buffers, cudaStream_t stream);

template <class T>
cudaError_t launch_gemv_scores(const float* q, const MatrixView<const T>& rows, float scale, float* scores,
                               cudaStream_t stream);

template <class T>
cudaError_t launch_gather_rows(const MatrixView<const T>& src, const std::int32_t* indices, std::int64_t count,
                               const MatrixView<T>& dst, cudaStream_t stream);

cudaError_t launch_apply_rope_rows(const MatrixView<float>& rows, const std::int64_t* positions, const RopeConfig& rope,
                                   bool inverse, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
