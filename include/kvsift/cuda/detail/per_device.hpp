#pragma once
/// Values that do not change while a process runs, computed once per device: a device attribute
/// (device_attribute<A>), a kernel attribute set once (cuda/detail/launch.cuh). After the first call on a device,
/// one atomic load. Host code, no exceptions: returns the CUDA status (the launchers' .cu files and the host entry
/// points, src/cuda/device.cpp, share it).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

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

/// N small non-negative counts per device, computed together once per device (a GPU's cluster capacities): packed
/// into one atomic word, 63 / N bits each (counts clamped to that range), bit 63 set once computed. Devices past
/// kCachedDevices compute them at every call.
template <std::size_t N>
class PerDeviceCounts {
  static constexpr int kBits = 63 / int(N);
  static_assert(N >= 2 && kBits >= 6, "2 to 10 counts of 6 to 31 bits (each clamped to an int's range)");
  static constexpr std::uint64_t kComputed = std::uint64_t(1) << 63, kMask = (std::uint64_t(1) << kBits) - 1;

 public:
  /// The counts for the current device, compute(counts) the first time.
  template <class Compute>
  cudaError_t get(std::array<int, N>* counts, Compute&& compute) {
    int device = 0;
    if (const cudaError_t s = cudaGetDevice(&device); s != cudaSuccess) return s;
    std::uint64_t packed = device < kCachedDevices ? known_[std::size_t(device)].load(std::memory_order_relaxed) : 0;
    if (packed == 0) {
      if (const cudaError_t s = compute(counts); s != cudaSuccess) return s;
      packed = kComputed;
      for (std::size_t i = 0; i < N; ++i) {
        packed |= std::uint64_t(std::clamp<int>((*counts)[i], 0, int(kMask))) << (kBits * int(i));
      }
      if (device < kCachedDevices) known_[std::size_t(device)].store(packed, std::memory_order_relaxed);
    }
    for (std::size_t i = 0; i < N; ++i) (*counts)[i] = int((packed >> (kBits * int(i))) & kMask);
    return cudaSuccess;
  }

 private:
  std::array<std::atomic<std::uint64_t>, kCachedDevices> known_{};
};

}  // namespace kvsift::cuda::detail
