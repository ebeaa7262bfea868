#include <array>
#include <atomic>

#include "kvsift/cuda/check.hpp"

namespace kvsift::cuda {

int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices> cache{};  // 0: not queried yet
  int device = 0;
  KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
  KVSIFT_CHECK(device >= 0 && device < kMaxDevices, "cuda::multiprocessor_count", "device ordinal {} >= {}", device,
               kMaxDevices);
  int count = cache[device].load(std::memory_order_relaxed);
  if (count == 0) {
    KVSIFT_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    cache[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

bool device_available() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error so later checks are not confused by it
    return false;
  }
  return count > 0;
}

}  // namespace kvsift::cuda
