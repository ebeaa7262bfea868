#pragma once
/// The CUDA execution context of selectors and the decode step: device memory, work on one stream.

#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

#include "kvsift/core/validate.hpp"
#include "kvsift/cuda/check.hpp"

namespace kvsift::cuda {

/// Owning device array of a selector's or step's state: allocated at construction or prepare (cudaMalloc), never
/// in the hot path. Move-only; resize() discards the contents.
template <class T>
class Array {
 public:
  Array() = default;
  explicit Array(std::size_t count) { resize(count); }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  Array(Array&& other) noexcept : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  Array& operator=(Array&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    return *this;
  }
  ~Array() {
    if (data_ != nullptr) cudaFree(data_);
  }
  void resize(std::size_t count) {
    if (data_ != nullptr) KVSIFT_CUDA_CHECK(cudaFree(data_));
    data_ = nullptr;
    size_ = 0;
    if (count > 0) KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(T)));
    size_ = count;
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Owning pinned host array (cudaMallocHost): the staging buffers of a step that moves data between the GPU and
/// the CPU every step, so that its stream-ordered copies do not go through pageable memory. Allocated at
/// construction, never in the hot path. Move-only.
template <class T>
class PinnedArray {
 public:
  PinnedArray() = default;
  explicit PinnedArray(std::size_t count) : size_(count) {
    if (count > 0) KVSIFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&data_), count * sizeof(T)));
  }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  PinnedArray(PinnedArray&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  PinnedArray& operator=(PinnedArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    return *this;
  }
  ~PinnedArray() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

struct Context {
  static constexpr MemorySpace memory = MemorySpace::device;
  template <class T>
  using array = Array<T>;

  cudaStream_t stream = nullptr;
};

}  // namespace kvsift::cuda
