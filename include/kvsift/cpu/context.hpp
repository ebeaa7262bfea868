#pragma once
/// The CPU execution context of selectors and the decode step: host memory, work on a thread pool.

#include <cstddef>
#include <new>
#include <span>
#include <vector>

#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cpu {

namespace detail {
template <class T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U>&) {}  // NOLINT: rebinding, as std::allocator
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{WorkspaceLayout::kAlignment}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{WorkspaceLayout::kAlignment}); }
  template <class U>
  bool operator==(const AlignedAllocator<U>&) const { return true; }
};
}  // namespace detail

/// Owning host array of a selector's or step's state, or a workspace (Array<std::byte>): 256-byte aligned
/// (WorkspaceLayout::kAlignment), value-initialized; sized at construction or prepare, never in the hot path.
template <class T>
class Array {
 public:
  Array() = default;
  explicit Array(std::size_t count) { resize(count); }
  /// Discards the contents (as the device twin does).
  void resize(std::size_t count) { data_ = std::vector<T, Allocator>(count); }
  T* data() { return data_.data(); }
  const T* data() const { return data_.data(); }
  std::size_t size() const { return data_.size(); }
  /// The array as a workspace span.
  std::span<std::byte> bytes() { return {reinterpret_cast<std::byte*>(data_.data()), data_.size() * sizeof(T)}; }

 private:
  using Allocator = detail::AlignedAllocator<T>;
  std::vector<T, Allocator> data_;
};

struct Context {
  static constexpr MemorySpace memory = MemorySpace::host;
  template <class T>
  using array = Array<T>;

  /// Implicit: a primitive takes the context last, and a caller holding only a pool passes the pool.
  constexpr Context(ThreadPool* pool = nullptr) : pool(pool) {}  // NOLINT: implicit

  ThreadPool* pool;  ///< nullptr: the calling thread
};

}  // namespace kvsift::cpu
