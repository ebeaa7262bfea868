#pragma once
/// SelectionBuffer: owning host storage for a selection ([batch, kv_heads, capacity] indices, counts and,
/// optionally, log-weights) with a SelectionView over it, for host code that runs selectors (the fidelity
/// harness, the demo). Not copyable, since the view points into its own vectors; moving keeps the view valid.

#include <cstdint>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

class SelectionBuffer {
 public:
  /// batch, kv_heads and capacity must be positive (kvsift::Error otherwise).
  SelectionBuffer(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity, bool with_log_weights)
      : indices_(entries(batch, kv_heads, capacity)), counts_(std::size_t(batch) * kv_heads),
        log_weights_(with_log_weights ? indices_.size() : 0),
        view_{indices_.data(), counts_.data(), with_log_weights ? log_weights_.data() : nullptr, batch, kv_heads,
              capacity} {}
  SelectionBuffer(const SelectionBuffer&) = delete;
  SelectionBuffer& operator=(const SelectionBuffer&) = delete;
  SelectionBuffer(SelectionBuffer&&) noexcept = default;
  SelectionBuffer& operator=(SelectionBuffer&&) noexcept = default;

  const SelectionView& view() const { return view_; }
  std::vector<float>& log_weights() { return log_weights_; }

 private:
  static std::size_t entries(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity) {
    KVSIFT_CHECK(batch > 0 && kv_heads > 0 && capacity > 0, "SelectionBuffer",
                 "batch (= {}), kv_heads (= {}) and capacity (= {}) must be positive", batch, kv_heads, capacity);
    return checked_mul(std::size_t(batch) * std::size_t(kv_heads), std::size_t(capacity), "SelectionBuffer");
  }

  std::vector<std::int32_t> indices_, counts_;
  std::vector<float> log_weights_;
  SelectionView view_;
};

}  // namespace kvsift
