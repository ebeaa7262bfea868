// cpu::ThreadPool: nested parallel_for on the same pool runs inline instead of deadlocking, results stay
// right, and a chunk of one pool can still use another pool's threads.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift {
namespace {

/// A deadlock must fail the test, not hang it: the body runs on a detached thread that owns (through
/// shared_ptrs captured by `body`) everything it touches, so on a timeout the test can report and move on,
/// leaving the stuck thread and its pools behind. 10 s is far above the milliseconds the bodies take.
constexpr auto kDeadlockTimeout = std::chrono::seconds(10);

::testing::AssertionResult finishes_in_time(std::function<void()> body) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  std::thread([done, body = std::move(body)] {
    try {
      body();
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (finished.wait_for(kDeadlockTimeout) != std::future_status::ready) {
    return ::testing::AssertionFailure() << "did not finish within " << kDeadlockTimeout.count()
                                         << " s (deadlock); its thread is left running";
  }
  finished.get();  // rethrows the body's exception, which gtest reports
  return ::testing::AssertionSuccess();
}

std::int64_t sum_below(std::int64_t n) { return n * (n - 1) / 2; }

TEST(CpuThreadPool, NestedCallOnTheSamePoolRunsInline) {
  // Outer items on every thread of the pool (workers and the caller); each item calls parallel_for on the
  // same pool, which must run on the item's own thread.
  auto pool = std::make_shared<cpu::ThreadPool>(4);
  constexpr std::int64_t kOuter = 16, kInner = 1000;
  auto sums = std::make_shared<std::vector<std::int64_t>>(kOuter, 0);
  auto inline_calls = std::make_shared<std::atomic<int>>(0);
  const auto body = [pool, sums, inline_calls] {
    pool->parallel_for(kOuter, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) {
        const auto outer_thread = std::this_thread::get_id();
        bool same_thread = true;
        std::int64_t covered = 0;
        pool->parallel_for(kInner, [&](std::int64_t b, std::int64_t e) {
          same_thread = same_thread && std::this_thread::get_id() == outer_thread;
          covered += e - b;
          for (std::int64_t j = b; j < e; ++j) (*sums)[i] += j;
        });
        if (same_thread && covered == kInner) ++*inline_calls;
      }
    });
  };
  ASSERT_TRUE(finishes_in_time(body));
  for (std::int64_t i = 0; i < kOuter; ++i) EXPECT_EQ((*sums)[i], sum_below(kInner)) << "outer item " << i;
  EXPECT_EQ(inline_calls->load(), kOuter);
  // The pool still serves ordinary calls afterwards, on all of its threads.
  std::mutex mutex;
  std::set<std::thread::id> threads;
  pool->parallel_for(4, [&](std::int64_t, std::int64_t) {
    std::lock_guard lock(mutex);
    threads.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(threads.size(), 4u);
}

TEST(CpuThreadPool, NestedThroughTheFreeFunctionAndTwoLevelsDeep) {
  auto pool = std::make_shared<cpu::ThreadPool>(3);
  auto total = std::make_shared<std::atomic<std::int64_t>>(0);
  const auto body = [pool, total] {
    cpu::parallel_for(pool.get(), 6, [&](std::int64_t b0, std::int64_t e0) {
      for (auto i = b0; i < e0; ++i) {
        cpu::parallel_for(pool.get(), 5, [&](std::int64_t b1, std::int64_t e1) {
          for (auto j = b1; j < e1; ++j) {
            pool->parallel_for(7, [&](std::int64_t b2, std::int64_t e2) { *total += e2 - b2; });
          }
        });
      }
    });
  };
  ASSERT_TRUE(finishes_in_time(body));
  EXPECT_EQ(total->load(), 6 * 5 * 7);
}

TEST(CpuThreadPool, NestedExceptionReachesTheOuterCaller) {
  auto pool = std::make_shared<cpu::ThreadPool>(4);
  const auto body = [pool] {
    EXPECT_THROW(pool->parallel_for(8,
                                    [&](std::int64_t b, std::int64_t) {
                                      pool->parallel_for(3, [&](std::int64_t, std::int64_t) {
                                        if (b == 4) throw std::runtime_error("inner chunk failed");
                                      });
                                    }),
                 std::runtime_error);
  };
  ASSERT_TRUE(finishes_in_time(body));
  // And the pool is usable afterwards.
  std::atomic<std::int64_t> covered = 0;
  pool->parallel_for(100, [&](std::int64_t b, std::int64_t e) { covered += e - b; });
  EXPECT_EQ(covered.load(), 100);
}

TEST(CpuThreadPool, ChunkOfOnePoolUsesAnotherPoolsThreads) {
  // Every chunk of pool A calls parallel_for on pool B: the calls queue on B (one at a time) and each runs on
  // B's two workers and its caller, three distinct threads, with the right results.
  auto a = std::make_shared<cpu::ThreadPool>(3);
  auto b = std::make_shared<cpu::ThreadPool>(3);
  constexpr std::int64_t kOuter = 6, kInner = 300;
  auto sums = std::make_shared<std::vector<std::int64_t>>(kOuter, 0);
  auto threads_per_call = std::make_shared<std::vector<std::size_t>>(kOuter, 0);
  auto caller_used = std::make_shared<std::vector<int>>(kOuter, 0);  // not vector<bool>: its bits share words
  const auto body = [a, b, sums, threads_per_call, caller_used] {
    a->parallel_for(kOuter, [&](std::int64_t begin, std::int64_t end) {
      for (auto i = begin; i < end; ++i) {
        std::mutex mutex;
        std::set<std::thread::id> threads;
        std::int64_t sum = 0;
        b->parallel_for(kInner, [&](std::int64_t lo, std::int64_t hi) {
          std::int64_t part = 0;
          for (auto j = lo; j < hi; ++j) part += j;
          std::lock_guard lock(mutex);
          sum += part;
          threads.insert(std::this_thread::get_id());
        });
        (*sums)[i] = sum;
        (*threads_per_call)[i] = threads.size();
        (*caller_used)[i] = int(threads.count(std::this_thread::get_id()));
      }
    });
  };
  ASSERT_TRUE(finishes_in_time(body));
  for (std::int64_t i = 0; i < kOuter; ++i) {
    EXPECT_EQ((*sums)[i], sum_below(kInner)) << "outer item " << i;
    EXPECT_EQ((*threads_per_call)[i], 3u) << "outer item " << i;
    EXPECT_EQ((*caller_used)[i], 1) << "outer item " << i;
  }
}

TEST(CpuThreadPool, CallBackIntoTheOuterPoolThroughAnotherRunsInline) {
  // A's chunk -> B.parallel_for -> B's chunk (on B's worker or A's thread) -> A.parallel_for: A is busy with
  // the outermost call, so the innermost call runs inline wherever it is.
  auto a = std::make_shared<cpu::ThreadPool>(2);
  auto b = std::make_shared<cpu::ThreadPool>(2);
  auto total = std::make_shared<std::atomic<std::int64_t>>(0);
  const auto body = [a, b, total] {
    a->parallel_for(4, [&](std::int64_t b0, std::int64_t e0) {
      for (auto i = b0; i < e0; ++i) {
        b->parallel_for(4, [&](std::int64_t b1, std::int64_t e1) {
          for (auto j = b1; j < e1; ++j) {
            const auto here = std::this_thread::get_id();
            a->parallel_for(10, [&](std::int64_t b2, std::int64_t e2) {
              EXPECT_EQ(std::this_thread::get_id(), here);
              *total += e2 - b2;
            });
          }
        });
      }
    });
  };
  ASSERT_TRUE(finishes_in_time(body));
  EXPECT_EQ(total->load(), 4 * 4 * 10);
}

TEST(CpuThreadPool, SeveralEngineThreadsStillSerialize) {
  // The contract for independent callers is unchanged: calls from different threads (none inside a chunk)
  // queue on the pool, so at most size() threads run its chunks at once, and every call is complete.
  auto pool = std::make_shared<cpu::ThreadPool>(3);
  auto running = std::make_shared<std::atomic<int>>(0);
  auto peak = std::make_shared<std::atomic<int>>(0);
  auto covered = std::make_shared<std::atomic<std::int64_t>>(0);
  const auto body = [pool, running, peak, covered] {
    std::vector<std::thread> engines;
    for (int t = 0; t < 4; ++t) {
      engines.emplace_back([&] {
        for (int call = 0; call < 20; ++call) {
          pool->parallel_for(64, [&](std::int64_t b, std::int64_t e) {
            const int now = ++*running;
            int seen = peak->load();
            while (now > seen && !peak->compare_exchange_weak(seen, now)) {
            }
            std::this_thread::sleep_for(std::chrono::microseconds(50));
            *covered += e - b;
            --*running;
          });
        }
      });
    }
    for (auto& e : engines) e.join();
  };
  ASSERT_TRUE(finishes_in_time(body));
  EXPECT_EQ(covered->load(), 4 * 20 * 64);
  EXPECT_LE(peak->load(), 3);
}

}  // namespace
}  // namespace kvsift
