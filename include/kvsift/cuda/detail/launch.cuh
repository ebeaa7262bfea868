#pragma once
/// The launch layer of kvsift's kernels: what a launcher needs beyond `<<<>>>`, written once.
///   - device_attribute<A>(): a device attribute of the current device, queried once per device;
///   - open_shared_memory<Kernel>(): a kernel opened to the device's whole dynamic shared memory, once per device
///     and kernel (always the device's limit, never a call's own size, so that a launch from another host thread
///     never finds it lowered);
///   - allow_nonportable_clusters<Kernel>() and built_for_sm90<Kernel>(): the cluster prerequisites, once per
///     device and kernel;
///   - launch(kernel, LaunchShape, args...): one cudaLaunchKernelEx with an optional cluster and an optional
///     programmatic (PDL) dependency on the stream's previous kernel.
/// After the first call on a device each query is one atomic load: hot paths (every decode step) pay no driver
/// call for attributes. Everything returns the CUDA status and never throws (this header is for .cu files).
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace kvsift::cuda::detail {

inline constexpr int kLaunchMaxDevices = 64;

/// A once-per-device bit set: which devices have done a thing. Devices past kLaunchMaxDevices are never marked,
/// so they redo it at every call (correct, only slower).
class PerDeviceOnce {
 public:
  bool done(int device) const {
    return device < kLaunchMaxDevices && (bits_.load(std::memory_order_acquire) & bit(device)) != 0;
  }
  void mark(int device) {
    if (device < kLaunchMaxDevices) bits_.fetch_or(bit(device), std::memory_order_release);
  }

 private:
  static std::uint64_t bit(int device) { return std::uint64_t{1} << device; }
  std::atomic<std::uint64_t> bits_{0};
};

/// `*value` = the current device's attribute A, queried from the driver once per device.
template <cudaDeviceAttr A>
cudaError_t device_attribute(int* value) {
  static std::array<std::atomic<int>, kLaunchMaxDevices> known{};  // the value + 1; 0: not queried yet
  int device = 0;
  if (const cudaError_t s = cudaGetDevice(&device); s != cudaSuccess) return s;
  if (device < kLaunchMaxDevices) {
    if (const int stored = known[std::size_t(device)].load(std::memory_order_relaxed); stored != 0) {
      *value = stored - 1;
      return cudaSuccess;
    }
  }
  if (const cudaError_t s = cudaDeviceGetAttribute(value, A, device); s != cudaSuccess) return s;
  if (device < kLaunchMaxDevices) known[std::size_t(device)].store(*value + 1, std::memory_order_relaxed);
  return cudaSuccess;
}

/// Opens Kernel to the device's opt-in shared memory per block, less the kernel's static shared memory.
template <auto Kernel>
cudaError_t open_shared_memory() {
  static PerDeviceOnce opened;
  int device = 0;
  if (const cudaError_t s = cudaGetDevice(&device); s != cudaSuccess) return s;
  if (opened.done(device)) return cudaSuccess;
  int limit = 0;
  if (const cudaError_t s = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(&limit); s != cudaSuccess) {
    return s;
  }
  cudaFuncAttributes built{};
  if (const cudaError_t s = cudaFuncGetAttributes(&built, Kernel); s != cudaSuccess) return s;
  const cudaError_t s =
      cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit - int(built.sharedSizeBytes));
  if (s == cudaSuccess) opened.mark(device);
  return s;
}

/// Allows Kernel clusters beyond the portable size of 8 CTAs (sm_90). A device without them returns its error
/// (and the caller stays at portable sizes).
template <auto Kernel>
cudaError_t allow_nonportable_clusters() {
  static PerDeviceOnce allowed;
  int device = 0;
  if (const cudaError_t s = cudaGetDevice(&device); s != cudaSuccess) return s;
  if (allowed.done(device)) return cudaSuccess;
  const cudaError_t s = cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (s == cudaSuccess) allowed.mark(device);
  return s;
}

/// Whether the code of Kernel that runs on the current device was built for sm_90 or later (its cluster paths
/// exist only there: PTX of an older architecture JIT-compiled for a newer GPU has none).
template <auto Kernel>
cudaError_t built_for_sm90(bool* yes) {
  static std::array<std::atomic<int>, kLaunchMaxDevices> known{};  // 0: not asked yet, 1: no, 2: yes
  int device = 0;
  if (const cudaError_t s = cudaGetDevice(&device); s != cudaSuccess) return s;
  if (device < kLaunchMaxDevices) {
    if (const int stored = known[std::size_t(device)].load(std::memory_order_relaxed); stored != 0) {
      *yes = stored == 2;
      return cudaSuccess;
    }
  }
  cudaFuncAttributes built{};
  if (const cudaError_t s = cudaFuncGetAttributes(&built, Kernel); s != cudaSuccess) return s;
  *yes = built.ptxVersion >= 90 && built.binaryVersion >= 90;
  if (device < kLaunchMaxDevices) known[std::size_t(device)].store(*yes ? 2 : 1, std::memory_order_relaxed);
  return cudaSuccess;
}

/// Where and how a kernel runs: `cluster` CTAs along x form a thread-block cluster when > 1 (grid.x a multiple
/// of it); `programmatic`: a programmatic dependent of the stream's previous kernel (sm_90: its CTAs may start
/// while that kernel finishes and wait with griddepcontrol.wait before reading its results; elsewhere the
/// attribute only orders the kernels as usual).
struct LaunchShape {
  dim3 grid;
  dim3 block;
  std::size_t smem = 0;
  cudaStream_t stream = nullptr;
  int cluster = 1;
  bool programmatic = false;
};

template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), const LaunchShape& shape, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = shape.grid;
  config.blockDim = shape.block;
  config.dynamicSmemBytes = shape.smem;
  config.stream = shape.stream;
  cudaLaunchAttribute attributes[2]{};
  unsigned count = 0;
  if (shape.cluster > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = unsigned(shape.cluster);
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  if (shape.programmatic) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  config.attrs = count > 0 ? attributes : nullptr;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace kvsift::cuda::detail
