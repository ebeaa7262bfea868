#pragma once
/// StreamFork: a second stream and two events, owned, that fork work off a stream and join it back, so that
/// independent work of one step runs side by side, in eager launches and in a captured graph alike (an event recorded
/// on a capturing stream and waited on by another stream brings that stream into the capture: its work becomes a
/// parallel branch of the graph, and the join brings it back before the capture ends).

#include <utility>

#include <cuda_runtime_api.h>

#include "kvsift/cuda/check.hpp"

namespace kvsift::cuda {

/// Created on the current device (a stream and two events: never in a hot path); move-only. Not synchronized: one
/// thread at a time, as the step that owns it. Every fork() must be joined on the same stream before that stream's
/// capture ends or its work is waited for.
class StreamFork {
 public:
  StreamFork() {
    try {
      KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
      KVSIFT_CUDA_CHECK(cudaEventCreateWithFlags(&forked_, cudaEventDisableTiming));
      KVSIFT_CUDA_CHECK(cudaEventCreateWithFlags(&joined_, cudaEventDisableTiming));
    } catch (...) {
      destroy();
      throw;
    }
  }
  StreamFork(const StreamFork&) = delete;
  StreamFork& operator=(const StreamFork&) = delete;
  StreamFork(StreamFork&& other) noexcept
      : side_(std::exchange(other.side_, nullptr)), forked_(std::exchange(other.forked_, nullptr)),
        joined_(std::exchange(other.joined_, nullptr)) {}
  StreamFork& operator=(StreamFork&& other) noexcept {
    std::swap(side_, other.side_);
    std::swap(forked_, other.forked_);
    std::swap(joined_, other.joined_);
    return *this;
  }
  ~StreamFork() { destroy(); }

  /// The second stream, after everything queued on `main` so far.
  cudaStream_t fork(cudaStream_t main) {
    KVSIFT_CUDA_CHECK(cudaEventRecord(forked_, main));
    KVSIFT_CUDA_CHECK(cudaStreamWaitEvent(side_, forked_, 0));
    return side_;
  }
  /// `main` waits for everything queued on the second stream so far.
  void join(cudaStream_t main) {
    KVSIFT_CUDA_CHECK(cudaEventRecord(joined_, side_));
    KVSIFT_CUDA_CHECK(cudaStreamWaitEvent(main, joined_, 0));
  }
  /// beside(second stream) forked off `main`, then on_main() on `main`, then the join: the longer of the two, not
  /// their sum. An exception from either still joins (reporting nothing more: the first failure is the one
  /// reported) and goes on.
  template <class Beside, class OnMain>
  void run_beside(cudaStream_t main, Beside&& beside, OnMain&& on_main) {
    const cudaStream_t side = fork(main);
    try {
      beside(side);
      on_main();
    } catch (...) {
      if (cudaEventRecord(joined_, side_) == cudaSuccess) static_cast<void>(cudaStreamWaitEvent(main, joined_, 0));
      throw;
    }
    join(main);
  }

 private:
  void destroy() noexcept {
    if (joined_ != nullptr) static_cast<void>(cudaEventDestroy(joined_));
    if (forked_ != nullptr) static_cast<void>(cudaEventDestroy(forked_));
    if (side_ != nullptr) static_cast<void>(cudaStreamDestroy(side_));
    side_ = nullptr, forked_ = nullptr, joined_ = nullptr;
  }

  cudaStream_t side_ = nullptr;
  cudaEvent_t forked_ = nullptr, joined_ = nullptr;
};

}  // namespace kvsift::cuda
