#pragma once
/// Values that do not change while a process runs, computed once per device: a device attribute
/// (device_attribute<A>), a kernel attribute set once (cuda/detail/launch.cuh). After the first call on a device,
/// one atomic load. Host code, no exceptions: returns the CUDA status (the launchers' .cu files and the host entry
/// points, src/cuda/device.cpp, share it).
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstddef>

namespace kvsift::cuda::detail {

inline constexpr int kCachedDevices = 64;

/// A non-negative int per device, computed once per device (stored + 1: 0 means not computed yet). Devices past
/// kCachedDevices compute it at every call.
class PerDeviceValue {
 public:
  /// The value for the current device.
  template <class Compute>
  cudaError_t get(int* value, Compute&& compute) {
    int device = 0;
    if (const cudaError_t s = cudaGetDevice(&device); s != cudaSuccess) return s;
    return get(device, value, compute);
  }
  /// The value for `device` (>= 0), compute(device, value) the first time.
  template <class Compute>
  cudaError_t get(int device, int* value, Compute&& compute) {
    if (device < kCachedDevices) {
      if (const int stored = known_[std::size_t(device)].load(std::memory_order_relaxed); stored != 0) {
        *value = stored - 1;
        return cudaSuccess;
      }
    }
    if (const cudaError_t s = compute(device, value); s != cudaSuccess) return s;
    if (device < kCachedDevices) known_[std::size_t(device)].store(*value + 1, std::memory_order_relaxed);
    return cudaSuccess;
  }

 private:
  std::array<std::atomic<int>, kCachedDevices> known_{};
};

/// `*value` = attribute A of `device`, queried from the driver once per device.
template <cudaDeviceAttr A>
cudaError_t device_attribute(int device, int* value) {
  static PerDeviceValue memo;
  return memo.get(device, value, [](int d, int* v) { return cudaDeviceGetAttribute(v, A, d); });
}
/// `*value` = attribute A of the current device.
template <cudaDeviceAttr A>
cudaError_t device_attribute(int* value) {
  int device = 0;
  if (const cudaError_t s = cudaGetDevice(&device); s != cudaSuccess) return s;
  return device_attribute<A>(device, value);
}

}  // namespace kvsift::cuda::detail
