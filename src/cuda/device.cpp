#include <array>
#include <atomic>

#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/pinned_host.hpp"

namespace kvsift::cuda {

namespace {

/// Device attributes do not change while a process runs: each is queried once per device.
template <cudaDeviceAttr Attribute>
int cached_attribute(const char* where) {
  constexpr int kMaxDevices = 64;
  static std::array<std::atomic<int>, kMaxDevices> cache{};  // 0: not queried yet
  int device = 0;
  KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
  KVSIFT_CHECK(device >= 0 && device < kMaxDevices, where, "device ordinal {} >= {}", device, kMaxDevices);
  int value = cache[device].load(std::memory_order_relaxed);
  if (value == 0) {
    KVSIFT_CUDA_CHECK(cudaDeviceGetAttribute(&value, Attribute, device));
    cache[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

}  // namespace

int multiprocessor_count() {
  return cached_attribute<cudaDevAttrMultiProcessorCount>("cuda::multiprocessor_count");
}

int max_shared_memory_per_block() {
  return cached_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>("cuda::max_shared_memory_per_block");
}

bool device_readable_host(const void* p) {
  if (p == nullptr) return false;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attributes.type == cudaMemoryTypeHost || attributes.type == cudaMemoryTypeManaged;
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

void PinnedHostCheck::require_field(std::size_t field, const void* p, const char* field_name, const char* where,
                                    std::string_view cache) {
  if (p == nullptr || p == known_[field]) return;
  KVSIFT_CHECK(device_readable_host(p), where,
               "{}'s {} ({}) is not pinned host memory: the GPU reads it in place (cudaMallocHost, cudaHostRegister "
               "or managed memory)",
               cache, field_name, p);
  known_[field] = p;
}

}  // namespace kvsift::cuda
