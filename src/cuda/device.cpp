#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/per_device.hpp"
#include "kvsift/cuda/pinned_host.hpp"

namespace kvsift::cuda {

namespace {

/// A device attribute of the current device, queried once per device (cuda/detail/per_device.hpp), on devices
/// with an ordinal below the ones cached.
template <cudaDeviceAttr Attribute>
int cached_attribute(const char* where) {
  int device = 0;
  KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
  KVSIFT_CHECK(device >= 0 && device < detail::kCachedDevices, where, "device ordinal {} >= {}", device,
               detail::kCachedDevices);
  int value = 0;
  KVSIFT_CUDA_CHECK(detail::device_attribute<Attribute>(device, &value));
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

HostBlockFence::HostBlockFence() {
  cudaEvent_t event = nullptr;
  KVSIFT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  event_.reset(event);
}

void HostBlockFence::record(cudaStream_t stream) {
  KVSIFT_CUDA_CHECK(cudaEventRecord(event_.get(), stream));
  pending_ = true;
}

void HostBlockFence::wait() {
  if (pending_) KVSIFT_CUDA_CHECK(cudaEventSynchronize(event_.get()));
  pending_ = false;
}

void HostBlockFence::Destroy::operator()(cudaEvent_t event) const { cudaEventDestroy(event); }

}  // namespace kvsift::cuda
