#pragma once
/// A fixed-size pool of worker threads for the CPU backend; the caller chooses its size.
///
/// Contract: parallel_for splits [0, count) into contiguous chunks and runs them on the pool's threads and
/// the calling thread, returning when all are done. One pool runs one parallel_for at a time: calls from
/// several engine threads on the same pool are serialized (they queue on a mutex), so a pool never runs more
/// than size() threads and never oversubscribes. Engine threads that must run concurrently should each own a
/// pool sized to its share of the cores. A CPU function given no pool runs on the calling thread.
/// An exception thrown by fn in any chunk is rethrown by parallel_for (the first one).
///
/// Nesting: a parallel_for called from inside a chunk of this pool (fn calling parallel_for on the same pool,
/// on a worker or on the calling thread) runs fn(0, count) inline on that thread instead of waiting for the
/// pool, which is busy with the outer call (waiting would deadlock). This holds through other pools too: a
/// chunk of pool A may call parallel_for on pool B, which runs on B's threads as usual, and a chunk of that
/// call that comes back to A runs inline. A nested inline call rethrows fn's exception to its caller.
/// Only nesting within one call chain is detected: two engine threads that nest the same two pools in
/// opposite orders (thread 1: A, then B inside it; thread 2: B, then A inside it) can deadlock, each holding
/// one pool; such threads should own separate pools.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvsift::cpu {

class ThreadPool {
 public:
  /// `threads` >= 1 counts the calling thread: ThreadPool(1) starts no worker.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  /// Runs fn(begin, end) over chunks covering [0, count); inline when called from one of this pool's chunks.
  void parallel_for(std::int64_t count, const std::function<void(std::int64_t, std::int64_t)>& fn);

 private:
  /// The pools whose chunks the current thread is running, innermost first: a list of frames on the stacks
  /// of the parallel_for calls that handed out those chunks.
  struct Frame {
    const ThreadPool* pool;
    const Frame* outer;
  };
  static thread_local const Frame* current_frame_;

  void worker_loop(int index);
  void run_chunk(int index);

  std::vector<std::thread> workers_;
  std::mutex call_mutex_;  ///< serializes parallel_for calls
  std::mutex mutex_;
  std::condition_variable work_ready_, work_done_;
  const std::function<void(std::int64_t, std::int64_t)>* fn_ = nullptr;
  const Frame* caller_frame_ = nullptr;  ///< the running call's frame: its workers run chunks inside it
  std::int64_t count_ = 0;
  std::uint64_t generation_ = 0;
  int pending_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
};

/// Runs fn over [0, count) on `pool`, or inline when pool is nullptr.
inline void parallel_for(ThreadPool* pool, std::int64_t count, const std::function<void(std::int64_t, std::int64_t)>& fn) {
  if (pool == nullptr || pool->size() == 1 || count <= 1) {
    if (count > 0) fn(0, count);
  } else {
    pool->parallel_for(count, fn);
  }
}

/// Rows [0, rows) in `workers` shares of consecutive rows (share w: [w * rows / workers, (w + 1) * rows / workers)),
/// the shares run as parallel_for items: f(w, row) for each row of share w in order, so that a share's rows may
/// reuse scratch of worker w's.
template <class F>
void parallel_for_shares(ThreadPool* pool, std::int64_t rows, std::int64_t workers, F&& f) {
  parallel_for(pool, workers, [&](std::int64_t share_begin, std::int64_t share_end) {
    for (std::int64_t w = share_begin; w < share_end; ++w) {
      for (std::int64_t row = w * rows / workers; row < (w + 1) * rows / workers; ++row) f(w, row);
    }
  });
}

}  // namespace kvsift::cpu
