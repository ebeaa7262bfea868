#pragma once
/// Shape bookkeeping shared by the host selectors: prepare() records the batch, heads, head_dim and every
/// sequence's length; append() checks a step's token against them and counts it; select() checks the query
/// and the output view against them. One implementation, so that every selector refuses bad inputs with
/// the same messages.

#include <cstdint>
#include <utility>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/selector.hpp"
#include "kvsift/core/validate.hpp"

namespace kvsift::detail {

class SelectorShape {
 public:
  void prepare(const char* where, const ContiguousKVView<const float>& kv) {
    validate(kv, where, "kv", MemorySpace::host);
    batch_ = kv.batch;
    kv_heads_ = kv.kv_heads;
    head_dim_ = kv.head_dim;
    lengths_.clear();
    for (std::int32_t b = 0; b < batch_; ++b) lengths_.push_back(kv.seq_len(b));
  }

  void append(const char* where, const AppendInputs<float>& step) {
    require_prepared(where);
    validate(step.k, where, "k");
    validate(step.v, where, "v");
    validate(step.q, where, "q");
    for (const auto& [name, kv] : {std::pair{"k", step.k}, std::pair{"v", step.v}}) {
      KVSIFT_CHECK(kv.batch == batch_ && kv.heads == kv_heads_ && kv.head_dim == head_dim_, where,
                   "{} shape [{}, {}, {}] != prepared [batch = {}, kv_heads = {}, head_dim = {}]", name, kv.batch,
                   kv.heads, kv.head_dim, batch_, kv_heads_, head_dim_);
    }
    KVSIFT_CHECK(step.q.batch == batch_ && step.q.head_dim == head_dim_ && step.q.heads % kv_heads_ == 0, where,
                 "q shape [{}, {}, {}] does not fit prepared [batch = {}, kv_heads = {}, head_dim = {}] (q heads a "
                 "multiple of kv_heads)",
                 step.q.batch, step.q.heads, step.q.head_dim, batch_, kv_heads_, head_dim_);
    for (auto& length : lengths_) ++length;
  }

  /// Checks q and out for a selection of up to `row_capacity` entries per row; returns the GQA group size.
  std::int32_t check_select(const char* where, const QueryView<const float>& q, const SelectionView& out,
                            std::int32_t row_capacity) const {
    require_prepared(where);
    validate(q, where, "q");
    KVSIFT_CHECK(q.batch == batch_ && q.head_dim == head_dim_, where,
                 "q batch (= {}) / head_dim (= {}) != prepared batch (= {}) / head_dim (= {})", q.batch, q.head_dim,
                 batch_, head_dim_);
    KVSIFT_CHECK(q.heads % kv_heads_ == 0, where, "q.heads (= {}) is not a multiple of kv_heads (= {})", q.heads,
                 kv_heads_);
    KVSIFT_CHECK(out.indices && out.counts, where, "out.indices and out.counts must be non-null");
    KVSIFT_CHECK(out.batch == batch_ && out.kv_heads == kv_heads_, where,
                 "out [batch = {}, kv_heads = {}] != prepared [batch = {}, kv_heads = {}]", out.batch, out.kv_heads,
                 batch_, kv_heads_);
    KVSIFT_CHECK(out.capacity >= row_capacity, where, "out.capacity (= {}) is smaller than budget (= {})",
                 out.capacity, row_capacity);
    return q.heads / kv_heads_;
  }

  void require_prepared(const char* where) const { KVSIFT_CHECK(batch_ > 0, where, "prepare() has not been called"); }

  std::int32_t batch() const { return batch_; }
  std::int32_t kv_heads() const { return kv_heads_; }
  std::int32_t head_dim() const { return head_dim_; }
  std::int32_t length(std::int32_t b) const { return lengths_[static_cast<std::size_t>(b)]; }
  /// Index of the (sequence, kv head) row, for per-row index storage.
  std::size_t row(std::int32_t b, std::int32_t h) const { return static_cast<std::size_t>(b) * kv_heads_ + h; }

 private:
  std::int32_t batch_ = 0;
  std::int32_t kv_heads_ = 0;
  std::int32_t head_dim_ = 0;
  std::vector<std::int32_t> lengths_;
};

}  // namespace kvsift::detail
