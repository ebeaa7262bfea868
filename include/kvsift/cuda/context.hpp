#pragma once
/// The CUDA execution context of selectors and the decode step: device memory, work on one stream.

#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

#include "kvsift/core/validate.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/stream_fork.hpp"

namespace kvsift::cuda {

namespace detail {

/// Where an OwnedArray's memory comes from: the device (cudaMalloc) or pinned host memory (cudaMallocHost).
struct DeviceMemory {
  static cudaError_t allocate(void** p, std::size_t bytes) { return cudaMalloc(p, bytes); }
  static cudaError_t release(void* p) { return cudaFree(p); }
};
struct PinnedHostMemory {
  static cudaError_t allocate(void** p, std::size_t bytes) { return cudaMallocHost(p, bytes); }
  static cudaError_t release(void* p) { return cudaFreeHost(p); }
};

/// An owning array of `count` T from Memory, allocated at construction or resize() (never in a hot path).
/// Move-only; resize() discards the contents.
template <class T, class Memory>
class OwnedArray {
 public:
  OwnedArray() = default;
  explicit OwnedArray(std::size_t count) { resize(count); }
  OwnedArray(const OwnedArray&) = delete;
  OwnedArray& operator=(const OwnedArray&) = delete;
  OwnedArray(OwnedArray&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  OwnedArray& operator=(OwnedArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    return *this;
  }
  ~OwnedArray() {
    if (data_ != nullptr) Memory::release(data_);
  }
  void resize(std::size_t count) {
    if (data_ != nullptr) KVSIFT_CUDA_CHECK(Memory::release(data_));
    data_ = nullptr;
    size_ = 0;
    if (count > 0) KVSIFT_CUDA_CHECK(Memory::allocate(reinterpret_cast<void**>(&data_), count * sizeof(T)));
    size_ = count;
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace detail

/// Owning device array of a selector's or step's state.
template <class T>
using Array = detail::OwnedArray<T, detail::DeviceMemory>;

/// Owning pinned host array: the staging buffers of a step that moves data between the GPU and the CPU every
/// step, so that its stream-ordered copies do not go through pageable memory.
template <class T>
using PinnedArray = detail::OwnedArray<T, detail::PinnedHostMemory>;

struct Context {
  static constexpr MemorySpace memory = MemorySpace::device;
  template <class T>
  using array = Array<T>;
  /// What runs work beside this context's stream (a decode step's append beside its select).
  using Fork = StreamFork;

  /// Implicit: a primitive takes the context last, and a caller holding only a stream passes the stream.
  constexpr Context(cudaStream_t stream = nullptr) : stream(stream) {}  // NOLINT: implicit

  cudaStream_t stream;
};

}  // namespace kvsift::cuda
