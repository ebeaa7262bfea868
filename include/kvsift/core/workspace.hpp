#pragma once
/// Caller-owned scratch memory. An API that needs scratch computes its layout with one function run in two
/// modes: counting (no buffer; it only sums aligned sizes, giving *_workspace_bytes) and carving (it hands
/// out aligned sub-buffers of the caller's buffer). Because both modes run the same code, the size query
/// and the real layout cannot drift apart. Every allocation is named, and an undersized buffer is refused
/// with the name, the bytes needed and the bytes given.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/error.hpp"

namespace kvsift {

class WorkspaceLayout {
 public:
  static constexpr std::size_t kAlignment = 256;  ///< matches cudaMalloc's alignment; enough for any vector access

  /// Counting mode: allocate() returns nullptr and only accumulates sizes.
  WorkspaceLayout() = default;
  /// Carving mode over the caller's buffer (device or host memory; never dereferenced here).
  explicit WorkspaceLayout(std::span<std::byte> buffer, const char* where) : buffer_(buffer), where_(where), carving_(true) {
    KVSIFT_CHECK(buffer.empty() || reinterpret_cast<std::uintptr_t>(buffer.data()) % kAlignment == 0, where,
                 "workspace pointer {} is not {}-byte aligned", static_cast<const void*>(buffer.data()), kAlignment);
  }

  template <class T>
  T* allocate(std::size_t count, const char* name) {
    const std::size_t bytes = checked_mul(count, sizeof(T), name);
    const std::size_t offset = used_;
    used_ = round_up(offset + bytes);
    if (!carving_) return nullptr;
    KVSIFT_CHECK(used_ <= buffer_.size(), where_,
                 "workspace too small: '{}' needs bytes [{}, {}) but the workspace has {} bytes; size it with the "
                 "matching *_workspace_bytes() query",
                 name, offset, offset + bytes, buffer_.size());
    return reinterpret_cast<T*>(buffer_.data() + offset);
  }

  /// A sub-workspace of `bytes` bytes for a callee with its own workspace query (empty in counting mode).
  std::span<std::byte> span(std::size_t bytes, const char* name) {
    std::byte* data = allocate<std::byte>(bytes, name);
    return data == nullptr ? std::span<std::byte>{} : std::span<std::byte>(data, bytes);
  }

  std::size_t bytes() const { return used_; }

 private:
  static std::size_t round_up(std::size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

  std::span<std::byte> buffer_{};
  const char* where_ = "workspace";
  bool carving_ = false;
  std::size_t used_ = 0;
};

}  // namespace kvsift
