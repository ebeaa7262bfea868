#pragma once
/// copy_heads_packed: a HeadsView of any strides into a packed [batch, heads, head_dim] array, on either backend
/// (copy_rows_within of the context's backend, found by argument-dependent lookup: include cpu/backend.hpp or
/// cuda/backend.hpp before instantiating it). The copy a query or key takes before an in-place rotation.

#include <cstdint>

#include "kvsift/core/views.hpp"

namespace kvsift {

/// One strided copy where a batch row's heads are evenly spaced from one row to the next, else one per batch row.
/// `out` is in the context's memory, batch * heads * head_dim elements.
template <class T, class Context>
void copy_heads_packed(const HeadsView<const T>& x, T* out, const Context& ctx) {
  const std::int32_t d = x.head_dim;
  if (x.batch_stride == std::int64_t(x.heads) * x.head_stride) {
    copy_rows_within(x.data, x.head_stride, out, d, d, std::int64_t(x.batch) * x.heads, ctx);
    return;
  }
  for (std::int32_t b = 0; b < x.batch; ++b) {
    copy_rows_within(x.row(b, 0), x.head_stride, out + std::int64_t(b) * x.heads * d, d, d, x.heads, ctx);
  }
}

}  // namespace kvsift
