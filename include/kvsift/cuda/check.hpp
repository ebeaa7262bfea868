#pragma once
/// Every CUDA runtime call in kvsift goes through KVSIFT_CUDA_CHECK, which throws kvsift::Error quoting the
/// failing call, the CUDA error and the source location.

#include <cuda_runtime_api.h>

#include "kvsift/core/error.hpp"

#define KVSIFT_CUDA_CHECK(call)                                                                              \
  do {                                                                                                       \
    const cudaError_t kvsift_status_ = (call);                                                               \
    if (kvsift_status_ != cudaSuccess) [[unlikely]] {                                                        \
      ::kvsift::detail::throw_error("cuda", fmt::format("{} failed: {} ({}) at {}:{}", #call,                \
                                                        cudaGetErrorString(kvsift_status_),                  \
                                                        cudaGetErrorName(kvsift_status_), __FILE__, __LINE__)); \
    }                                                                                                        \
  } while (0)

namespace kvsift::cuda {

/// Number of multiprocessors of the current device, queried once per device and cached (no host sync).
int multiprocessor_count();
/// Most dynamic shared memory one block may opt in to on the current device, in bytes (cached likewise).
int max_shared_memory_per_block();

/// True when at least one CUDA device is usable (false on machines without a GPU or driver).
bool device_available();

}  // namespace kvsift::cuda
