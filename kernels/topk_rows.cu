// CUDA top-K into selection rows (cuda/topk.hpp): one CTA per score row where the row fits its registers
// (detail/topk_cta_kernels.cuh), else one thread-block cluster per score row, the held kernel
// (detail/topk_held_kernels.cuh) where a row fits the cluster's registers, else the slice kernel, then the union
// kernel of heads_per_row > 1 (detail/topk_kernels.cuh); mass_budgets' kernel (detail/topk_mass_kernels.cuh).
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/topk_kernels.cuh"
#include "kvsift/cuda/detail/topk_mass_kernels.cuh"
#include "kvsift/cuda/detail/topk_words_launch.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr auto kSelectKernel = topk_rows_select<kTopKRowsThreads>;
constexpr auto kUnionKernel = topk_rows_union<kTopKUnionThreads>;

cudaError_t launch_select(const TopKRowsParams& p, cudaStream_t stream) {
  if (topk_rows_takes_words(p)) return launch_topk_rows_words(p, ScoreWords{}, stream);
  if (cudaError_t s = open_shared_memory<kSelectKernel>(); s != cudaSuccess) return s;
  if (p.launch.cluster > kTopKMaxPortableCluster) {
    if (cudaError_t s = allow_nonportable_clusters<kSelectKernel>(); s != cudaSuccess) return s;
  }
  return launch(kSelectKernel,
                {.grid = dim3(unsigned(p.scores.rows * p.launch.cluster)), .block = dim3(kTopKRowsThreads),
                 .smem = topk_rows_select_smem_bytes(p.launch.smem_words), .stream = stream,
                 .cluster = p.launch.cluster, .programmatic = true},
                p);
}

}  // namespace

cudaError_t topk_rows_cluster_capacity(TopKClusterCapacity* capacity) {
  capacity->fill(0);
  int major = 0;
  if (cudaError_t s = device_attribute<cudaDevAttrComputeCapabilityMajor>(&major); s != cudaSuccess) return s;
  if (major < 9) return cudaSuccess;
  const std::size_t smem = topk_rows_select_smem_bytes(kTopKMaxSmemWords);
  if (cudaError_t s = open_shared_memory<kSelectKernel>(); s != cudaSuccess) return s;
  for (int log2 = 1; log2 < int(capacity->size()); ++log2) {
    const int size = 1 << log2;
    if (size > kTopKMaxPortableCluster && allow_nonportable_clusters<kSelectKernel>() != cudaSuccess) {
      (void)cudaGetLastError();  // no non-portable clusters here
      break;
    }
    max_active_clusters<kSelectKernel>(size, kTopKRowsThreads, smem, &(*capacity)[std::size_t(log2)]);
    if ((*capacity)[std::size_t(log2)] == 0) break;
  }
  return cudaSuccess;
}

cudaError_t launch_topk_rows_union(const TopKRowsParams& p, cudaStream_t stream) {
  if (p.heads_per_row == 1) return cudaSuccess;
  const std::size_t union_smem = p.union_bits != nullptr ? 0 : std::size_t(p.union_words) * sizeof(std::uint32_t);
  return launch(kUnionKernel,
                {.grid = dim3(unsigned(p.scores.rows / p.heads_per_row)), .block = dim3(kTopKUnionThreads),
                 .smem = union_smem, .stream = stream, .programmatic = true},
                p);
}

cudaError_t launch_topk_rows(const TopKRowsParams& p, cudaStream_t stream) {
  if (cudaError_t s = launch_select(p, stream); s != cudaSuccess) return s;
  return launch_topk_rows_union(p, stream);
}

namespace {

__global__ void length_budgets_kernel(const std::int32_t* lengths, std::int32_t batch, std::int32_t heads,
                                      LengthBudget budget, std::int32_t* row_k) {
  programmatic_start();  // the lengths (a programmatic dependent: launch.cuh)
  const std::int64_t s = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s < std::int64_t(batch) * heads) row_k[s] = budget(lengths[s / heads]);
}

}  // namespace

cudaError_t launch_length_budgets(const std::int32_t* lengths, std::int32_t batch, std::int32_t heads,
                                  const LengthBudget& budget, std::int32_t* row_k, cudaStream_t stream) {
  constexpr int threads = 256;
  const std::int64_t rows = std::int64_t(batch) * heads;
  if (rows == 0) return cudaSuccess;
  return launch(length_budgets_kernel,
                {.grid = dim3(unsigned((rows + threads - 1) / threads)), .block = dim3(threads), .stream = stream,
                 .programmatic = true},
                lengths, batch, heads, budget, row_k);
}

cudaError_t launch_mass_budgets(const MassBudgetsParams& p, cudaStream_t stream) {
  return launch(mass_budgets_rows<kMassBudgetsThreads>,
                {.grid = dim3(unsigned(p.scores.rows)), .block = dim3(kMassBudgetsThreads), .stream = stream,
                 .programmatic = true},
                p);
}

}  // namespace kvsift::cuda::detail
