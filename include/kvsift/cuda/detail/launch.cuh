#pragma once
/// The launch layer of kvsift's kernels: what a launcher needs beyond `<<<>>>`, written once.
///   - device_attribute<A>() (cuda/detail/per_device.hpp): a device attribute, queried once per device;
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

#include <cstddef>
#include <cstdint>
#include <utility>

#include "kvsift/cuda/detail/per_device.hpp"

namespace kvsift::cuda::detail {

/// Opens Kernel to the device's opt-in shared memory per block, less the kernel's static shared memory.
template <auto Kernel>
cudaError_t open_shared_memory() {
  static PerDeviceValue opened;
  int done = 0;
  return opened.get(&done, [](int, int* v) {
    int limit = 0;
    if (const cudaError_t s = device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(&limit); s != cudaSuccess) {
      return s;
    }
    cudaFuncAttributes built{};
    if (const cudaError_t s = cudaFuncGetAttributes(&built, Kernel); s != cudaSuccess) return s;
    *v = 1;
    return cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit - int(built.sharedSizeBytes));
  });
}

/// Allows Kernel clusters beyond the portable size of 8 CTAs (sm_90). A device without them returns its error
/// (and the caller stays at portable sizes).
template <auto Kernel>
cudaError_t allow_nonportable_clusters() {
  static PerDeviceValue allowed;
  int done = 0;
  return allowed.get(&done, [](int, int* v) {
    *v = 1;
    return cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  });
}

/// Whether the code of Kernel that runs on the current device was built for sm_90 or later (its cluster paths
/// exist only there: PTX of an older architecture JIT-compiled for a newer GPU has none).
template <auto Kernel>
cudaError_t built_for_sm90(bool* yes) {
  static PerDeviceValue memo;
  int built = 0;
  const cudaError_t s = memo.get(&built, [](int, int* v) {
    cudaFuncAttributes attributes{};
    const cudaError_t status = cudaFuncGetAttributes(&attributes, Kernel);
    *v = attributes.ptxVersion >= 90 && attributes.binaryVersion >= 90 ? 1 : 0;
    return status;
  });
  *yes = built == 1;
  return s;
}

/// `*clusters` = how many clusters of `size` CTAs of Kernel (`threads` each, `smem` bytes of dynamic shared memory) the
/// device holds at once (cudaOccupancyMaxActiveClusters); 0, with the error cleared, where it places none of that size.
template <auto Kernel>
void max_active_clusters(int size, int threads, std::size_t smem, int* clusters) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(size));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = unsigned(size);
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  if (cudaOccupancyMaxActiveClusters(clusters, Kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();
    *clusters = 0;
  }
}

/// Waits until the stream's previous kernel has finished and its writes are visible (its programmatic dependent's
/// first statement, alone or through programmatic_start). A no-op for a launch without the attribute and before
/// sm_90.
///
/// Alone: programmatic_start without the early signal, for a kernel of many waves: its dependent is scheduled when
/// it completes, so that the dependent's waiting CTAs never hold SMs its own later CTAs need. CTKVR at 128K, batch 8
/// (H200): 252 µs a step without PDL, 266 with every kernel signalling at once, 245 with its three kernels of many
/// waves (centroid scores, candidate logits and finish) waiting only.
__device__ __forceinline__ void programmatic_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/// Lets the stream's next kernel be scheduled (it waits in turn); after programmatic_wait only.
__device__ __forceinline__ void programmatic_signal() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

/// The first statement of a kernel that may be launched as a programmatic dependent (LaunchShape::programmatic): its
/// CTAs may be resident before the stream's previous kernel has finished, so it waits until that kernel's writes are
/// complete and visible before it reads or writes anything global, then lets the stream's next kernel be scheduled.
__device__ __forceinline__ void programmatic_start() {
  programmatic_wait();
  programmatic_signal();
}

/// programmatic_start for a kernel whose grid is sized by its data (one CTA or thousands): it signals early only
/// when its grid has at most one CTA per SM (%nsmid, an upper bound of the SM count: SM ids need not be
/// contiguous), so that only a grid of about one wave lets its dependent in while it runs. The condition is the
/// same in every CTA: all signal, or none.
__device__ __forceinline__ void programmatic_start_if_one_wave() {
  programmatic_wait();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned sms;
  asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
  if (std::uint64_t(gridDim.x) * gridDim.y * gridDim.z <= sms) programmatic_signal();
#endif
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
