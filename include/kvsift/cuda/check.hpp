#pragma once
/// Every CUDA runtime call in kvsift goes through KVSIFT_CUDA_CHECK, which throws kvsift::Error quoting the
/// failing call, the CUDA error and the source file and line (or, on a machine without a GPU, "no CUDA
/// device on this machine").

#include <cuda_runtime_api.h>

#include "kvsift/core/error.hpp"

#define KVSIFT_CUDA_CHECK(call)                                                                   \
  do {                                                                                            \
    const cudaError_t kvsift_status_ = (call);                                                    \
    if (kvsift_status_ != cudaSuccess) [[unlikely]] {                                             \
      ::kvsift::detail::throw_cuda_error(#call, kvsift_status_, __FILE__, __LINE__);               \
    }                                                                                             \
  } while (0)

namespace kvsift::detail {

/// The file name of a source path: messages name kvsift's source file, not the machine it was built on.
constexpr const char* source_file_name(const char* path) {
  const char* name = path;
  for (const char* p = path; *p != '\0'; ++p) {
    if (*p == '/' || *p == '\\') name = p + 1;
  }
  return name;
}

/// A machine without a GPU or without a driver reports "no CUDA device" (the runtime's own words for a
/// missing driver speak of an insufficient driver version); every other failure quotes the call, the CUDA
/// error and the source line.
[[noreturn]] inline void throw_cuda_error(const char* call, cudaError_t status, const char* file, int line) {
  int driver_version = 0;
  const bool no_driver = status == cudaErrorInsufficientDriver &&
                         (cudaDriverGetVersion(&driver_version) != cudaSuccess || driver_version == 0);
  if (status == cudaErrorNoDevice || no_driver) {
    throw_error("cuda", fmt::format("no CUDA device on this machine ({}: {} failed with {})",
                                    no_driver ? "no CUDA driver is installed" : "the driver sees no GPU", call,
                                    cudaGetErrorName(status)));
  }
  throw_error("cuda", fmt::format("{} failed: {} ({}) at {}:{}", call, cudaGetErrorString(status),
                                  cudaGetErrorName(status), source_file_name(file), line));
}

}  // namespace kvsift::detail

namespace kvsift::cuda {

/// Number of multiprocessors of the current device, queried once per device and cached (no host sync).
int multiprocessor_count();
/// Most dynamic shared memory one block may opt in to on the current device, in bytes (cached likewise).
int max_shared_memory_per_block();

/// True when at least one CUDA device is usable (false on machines without a GPU or driver).
bool device_available();

/// True when the device can read `p` in place: page-locked host memory (cudaMallocHost, cudaHostAlloc,
/// cudaHostRegister) or managed memory. False for pageable or device memory and for null; clears the error a
/// pointer unknown to CUDA leaves behind.
bool device_readable_host(const void* p);

}  // namespace kvsift::cuda
