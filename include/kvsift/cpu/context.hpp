#pragma once
/// The CPU execution context of selectors and the decode step: host memory, work on a thread pool.

#include <cstddef>
#include <vector>

#include "kvsift/core/validate.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cpu {

/// Owning host array of a selector's or step's state: sized at construction or prepare, never in the hot path.
template <class T>
class Array {
 public:
  Array() = default;
  explicit Array(std::size_t count) : data_(count) {}
  /// Discards the contents (as the device twin does).
  void resize(std::size_t count) { data_.assign(count, T{}); }
  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  std::size_t size() const { return data_.size(); }

 private:
  std::vector<T> data_;
};

struct Context {
  static constexpr MemorySpace memory = MemorySpace::host;
  template <class T>
  using array = Array<T>;

  ThreadPool* pool = nullptr;  ///< nullptr: the calling thread
};

}  // namespace kvsift::cpu
