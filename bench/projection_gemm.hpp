#pragma once
// The unrelated kernel that a model step puts between two attention calls, for the benchmarks that time
// attention as an engine calls it (BM_DenseInterleaved, BM_Step with between:1).
#include <cublas_v2.h>

#include <fmt/format.h>

#include <cstddef>

#include "gpu_bench.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift::bench {

/// Y [batch, 4096] = X [batch, 4096] W [4096, 4096], bf16 with fp32 accumulation, through cuBLAS: a
/// projection of a 4096-wide model at decode, the unrelated kernel that a model step puts between two
/// attention calls. W rotates over copies that exceed L2 (every layer of a model has its own weights), so
/// each call reads its 32 MiB from memory, as in a model.
class ProjectionGemm {
 public:
  static constexpr int kDim = 4096;
  explicit ProjectionGemm(int batch)
      : batch_(batch), copies_(copies_for(std::size_t(kDim) * kDim * sizeof(bfloat16))),
        w_(std::size_t(kDim) * kDim * copies_), x_(std::size_t(batch) * kDim), y_(std::size_t(batch) * kDim),
        workspace_(kWorkspaceBytes) {
    fill_random(w_.ptr, std::size_t(kDim) * kDim * copies_, 4);
    fill_random(x_.ptr, std::size_t(batch) * kDim, 5);
    check(cublasCreate(&handle_), "cublasCreate");
    // A workspace of our own, so that cuBLAS allocates nothing while a graph is captured (32 MiB on sm_90).
    check(cublasSetWorkspace(handle_, workspace_.ptr, kWorkspaceBytes), "cublasSetWorkspace");
  }
  ~ProjectionGemm() { cublasDestroy(handle_); }
  ProjectionGemm(const ProjectionGemm&) = delete;

  void operator()(int i, cudaStream_t stream) {
    const float alpha = 1.0f, beta = 0.0f;
    // Column-major, as cuBLAS reads: Y^T [4096, batch] = W^T [4096, 4096] X^T [4096, batch].
    check(cublasSetStream(handle_, stream), "cublasSetStream");
    check(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, kDim, batch_, kDim, &alpha,
                       w_.ptr + std::size_t(i % copies_) * kDim * kDim, CUDA_R_16BF, kDim, x_.ptr, CUDA_R_16BF, kDim,
                       &beta, y_.ptr, CUDA_R_16BF, kDim, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx");
  }

 private:
  static constexpr std::size_t kWorkspaceBytes = std::size_t(32) << 20;
  static void check(cublasStatus_t status, const char* call) {
    if (status != CUBLAS_STATUS_SUCCESS) {
      kvsift::detail::throw_error("ProjectionGemm", fmt::format("{} failed: {}", call, cublasGetStatusString(status)));
    }
  }
  int batch_, copies_;
  Device<bfloat16> w_, x_, y_;
  Device<std::byte> workspace_;
  cublasHandle_t handle_ = nullptr;
};

}  // namespace kvsift::bench
