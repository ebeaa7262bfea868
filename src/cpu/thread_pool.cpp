#include "kvsift/cpu/thread_pool.hpp"

#include "kvsift/core/error.hpp"

namespace kvsift::cpu {

thread_local const ThreadPool::Frame* ThreadPool::current_frame_ = nullptr;

ThreadPool::ThreadPool(int threads) {
  KVSIFT_CHECK(threads >= 1, "cpu::ThreadPool", "threads (= {}) must be >= 1", threads);
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_chunk(int index) {
  const std::int64_t n = size();
  const std::int64_t begin = count_ * index / n, end = count_ * (index + 1) / n;
  if (begin == end) return;
  try {
    (*fn_)(begin, end);
  } catch (...) {
    std::lock_guard lock(mutex_);
    if (!error_) error_ = std::current_exception();
  }
}

void ThreadPool::worker_loop(int index) {
  std::uint64_t seen = 0;
  for (;;) {
    const Frame* frame = nullptr;
    {
      std::unique_lock lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      frame = caller_frame_;
    }
    current_frame_ = frame;  // fn calling parallel_for on a pool in this chain runs inline
    run_chunk(index);
    current_frame_ = nullptr;
    {
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) work_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(std::int64_t count, const std::function<void(std::int64_t, std::int64_t)>& fn) {
  // Called from a chunk of this pool (directly, or through chunks of other pools): the pool is busy with
  // the outer call, which waits for this thread, so run here.
  for (const Frame* f = current_frame_; f != nullptr; f = f->outer) {
    if (f->pool == this) {
      if (count > 0) fn(0, count);
      return;
    }
  }
  std::lock_guard call_lock(call_mutex_);
  const Frame frame{this, current_frame_};
  {
    std::lock_guard lock(mutex_);
    fn_ = &fn;
    caller_frame_ = &frame;
    count_ = count;
    pending_ = static_cast<int>(workers_.size());
    error_ = nullptr;
    ++generation_;
  }
  work_ready_.notify_all();
  current_frame_ = &frame;
  run_chunk(0);  // catches fn's exceptions, so the frame is always restored
  current_frame_ = frame.outer;
  std::exception_ptr error;
  {
    std::unique_lock lock(mutex_);
    work_done_.wait(lock, [&] { return pending_ == 0; });
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace kvsift::cpu
