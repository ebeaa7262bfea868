#include "kvsift/cpu/thread_pool.hpp"

#include "kvsift/core/error.hpp"

namespace kvsift::cpu {

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
    {
      std::unique_lock lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    run_chunk(index);
    {
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) work_done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(std::int64_t count, const std::function<void(std::int64_t, std::int64_t)>& fn) {
  std::lock_guard call_lock(call_mutex_);
  {
    std::lock_guard lock(mutex_);
    fn_ = &fn;
    count_ = count;
    pending_ = static_cast<int>(workers_.size());
    error_ = nullptr;
    ++generation_;
  }
  work_ready_.notify_all();
  run_chunk(0);
  std::exception_ptr error;
  {
    std::unique_lock lock(mutex_);
    work_done_.wait(lock, [&] { return pending_ == 0; });
    error = error_;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace kvsift::cpu
