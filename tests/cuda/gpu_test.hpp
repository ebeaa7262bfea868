#pragma once
/// GPU test support: RAII device memory with host round trips and poisoning, and the GpuTest fixture.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "kvsift/cuda/check.hpp"
#include "kvsift/step/hybrid_decoder.hpp"

namespace kvsift::test {

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t count) : count_(count) {
    if (count > 0) KVSIFT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), count * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    swap(other);
    return *this;
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }

  T* data() const { return data_; }
  std::size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    KVSIFT_CUDA_CHECK(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_ > 0) KVSIFT_CUDA_CHECK(cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  /// All bytes 0xff: NaN in fp32, fp16 and bf16, and -1 in int32.
  void poison() {
    if (count_ > 0) KVSIFT_CUDA_CHECK(cudaMemset(data_, 0xff, count_ * sizeof(T)));
  }

 private:
  void swap(DeviceBuffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
  }
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

/// A copy of a host array in pinned host memory (an offloading engine's host cache), freed on destruction.
template <class T>
class PinnedBuffer {
 public:
  explicit PinnedBuffer(const std::vector<T>& host) : count_(host.size()) {
    KVSIFT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&data_), std::max<std::size_t>(count_, 1) * sizeof(T)));
    std::copy(host.begin(), host.end(), data_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { cudaFreeHost(data_); }
  T* data() const { return data_; }
  std::size_t size() const { return count_; }

 private:
  T* data_ = nullptr;
  std::size_t count_ = 0;
};

/// A split step's or cuda::HybridDecoder's workspace: a device block and a pinned host block of the planned
/// bytes, both poisoned (0xff bytes: NaN floats, -1 integers), since a run must write everything it reads.
class SplitBuffers {
 public:
  explicit SplitBuffers(const SplitWorkspaceBytes& bytes)
      : device_(bytes.device), host_(std::vector<std::byte>(bytes.host, std::byte{0xff})) {
    if (bytes.device > 0) KVSIFT_CUDA_CHECK(cudaMemset(device_.data(), 0xff, bytes.device));
  }
  SplitWorkspace view() const { return {{device_.data(), device_.size()}, {host_.data(), host_.size()}}; }

 private:
  DeviceBuffer<std::byte> device_;
  PinnedBuffer<std::byte> host_;
};

/// A non-blocking stream, destroyed with the object (so a failed assertion's early return leaks none); converts to
/// the cudaStream_t it owns.
class Stream {
 public:
  Stream() { KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() { cudaStreamDestroy(stream_); }
  operator cudaStream_t() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

/// Work on `stream` captured once into a CUDA graph and replayed by launch(): the graph tests' boilerplate. Owns
/// the graph and its executable (the stream stays the caller's). A capture whose work throws is ended first.
class CapturedGraph {
 public:
  template <class Work>
  CapturedGraph(cudaStream_t stream, Work&& work, cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal)
      : stream_(stream) {
    KVSIFT_CUDA_CHECK(cudaStreamBeginCapture(stream, mode));
    try {
      work();
    } catch (...) {
      cudaGraph_t partial = nullptr;
      if (cudaStreamEndCapture(stream, &partial) == cudaSuccess && partial != nullptr) cudaGraphDestroy(partial);
      throw;
    }
    KVSIFT_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    KVSIFT_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }
  /// One replay, enqueued on the stream.
  void launch() const { KVSIFT_CUDA_CHECK(cudaGraphLaunch(exec_, stream_)); }

 private:
  cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace kvsift::test

#include <gtest/gtest.h>

#include "test_util.hpp"

namespace kvsift::test {

/// Base fixture of every GPU test: a SeededTest that skips with a reason where no CUDA device exists (CI).
class GpuTest : public SeededTest {
 protected:
  void SetUp() override {
    if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device on this machine; these tests run on a GPU host";
  }
};

}  // namespace kvsift::test
