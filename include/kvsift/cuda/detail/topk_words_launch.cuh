#pragma once
/// Launches of topk_rows' one-CTA and held kernels for a word source (topk_held_kernels.cuh ScoreWords and its
/// kin): topk_rows' own launches (kernels/topk_rows.cu) and a selector's that computes the words in the kernel
/// (kernels/selectors/a2ats/vq.cu VqWords). A .cu file includes this and instantiates the kernels it launches.
#include <cuda_runtime.h>

#include <cstddef>

#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/topk_cta_kernels.cuh"
#include "kvsift/cuda/detail/topk_held_kernels.cuh"
#include "kvsift/cuda/detail/topk_launch.hpp"

namespace kvsift::cuda::detail {

template <std::size_t I, class Words>
cudaError_t launch_topk_rows_held(const TopKRowsParams& p, const Words& words, cudaStream_t stream) {
  constexpr auto kernel = topk_rows_held<kTopKHeldShapes[I].threads, kTopKHeldShapes[I].items, Words>;
  if (cudaError_t s = open_shared_memory<kernel>(); s != cudaSuccess) return s;
  if (p.launch.cluster > kTopKMaxPortableCluster) {
    if (cudaError_t s = allow_nonportable_clusters<kernel>(); s != cudaSuccess) return s;
  }
  return launch(kernel,
                {.grid = dim3(unsigned(p.scores.rows * p.launch.cluster)),
                 .block = dim3(unsigned(kTopKHeldShapes[I].threads)),
                 .smem = topk_held_smem_bytes() + words.smem_bytes(),
                 .stream = stream,
                 .cluster = p.launch.cluster,
                 .programmatic = true},
                p, words);
}

template <std::size_t I, class Words>
cudaError_t launch_topk_rows_cta(const TopKRowsParams& p, const Words& words, cudaStream_t stream) {
  constexpr auto kernel = topk_rows_cta<kTopKCtaShapes[I].threads, kTopKCtaShapes[I].items, Words>;
  if (words.smem_bytes() > 0) {
    if (cudaError_t s = open_shared_memory<kernel>(); s != cudaSuccess) return s;
  }
  return launch(kernel,
                {.grid = dim3(unsigned(p.scores.rows)),
                 .block = dim3(unsigned(kTopKCtaShapes[I].threads)),
                 .smem = words.smem_bytes(),
                 .stream = stream,
                 .programmatic = true},
                p, words);
}

/// The planned one-CTA or held kernel (p.launch) with `words`; cudaErrorInvalidValue for a plan of the slice
/// kernel (topk_rows_takes_words false).
template <class Words>
cudaError_t launch_topk_rows_words(const TopKRowsParams& p, const Words& words, cudaStream_t stream) {
  static_assert(kTopKCtaShapes.size() == 2 && kTopKHeldShapes.size() == 3, "one case per shape");
  switch (p.launch.cta) {
    case 1:
      return launch_topk_rows_cta<0>(p, words, stream);
    case 2:
      return launch_topk_rows_cta<1>(p, words, stream);
    default:
      break;
  }
  switch (p.launch.held) {
    case 1:
      return launch_topk_rows_held<0>(p, words, stream);
    case 2:
      return launch_topk_rows_held<1>(p, words, stream);
    case 3:
      return launch_topk_rows_held<2>(p, words, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace kvsift::cuda::detail
