#pragma once
/// Quest's page bounds, page scores and page selection, CUDA overloads: what the selector, written once for both
/// backends, calls unqualified (argument-dependent lookup on cuda::Context). cuda/backend.hpp includes this file;
/// selectors/quest/cpu/backend.hpp is the CPU twin. Each overload forwards to the primitive documented in its own
/// header.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/backend.hpp"  // the shared overloads (which include this file at their end)
#include "kvsift/cuda/context.hpp"
#include "kvsift/selectors/quest/cuda/page_bounds.hpp"
#include "kvsift/selectors/quest/detail/page_bounds_checks.hpp"
#include "kvsift/selectors/quest/detail/select_pages_in_steps.hpp"
#include "kvsift/selectors/quest/page_bounds_view.hpp"

namespace kvsift::cuda {

template <class T>
void build_page_bounds(const KVCache<const T>& cache, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                       const Context& ctx) {
  cache.visit([&](const auto& kv) { cuda::build_page_bounds(kv, slots, bounds, ctx.stream); });
}
template <class T>
void append_page_bounds(const KVCache<const T>& cache, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                        const Context& ctx) {
  cache.visit([&](const auto& kv) { cuda::append_page_bounds(kv, slots, bounds, ctx.stream); });
}
template <class T>
void page_scores(const QueryView<const T>& q, const PageBoundsView<const T>& bounds, const std::int32_t* slots,
                 const std::int32_t* lengths, const AttentionWindow& window, const MatrixView<float>& scores,
                 std::int32_t* page_counts, const Context& ctx) {
  cuda::page_scores(q, bounds, slots, lengths, window, scores, page_counts, ctx.stream);
}
inline void expand_pages(const SelectionView& pages, std::int32_t page_size, const std::int32_t* lengths,
                         const AttentionWindow& window, const SelectionView& out, const Context& ctx) {
  cuda::expand_pages(pages, page_size, lengths, window, out, ctx.stream);
}
/// Quest's selection: page scores of sequences of up to max_pages pages (<= bounds.max_pages: the planned bound;
/// longer ones get count -1), the best pages_per_row pages, their middle tokens (three kernels).
inline std::size_t select_pages_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t max_pages,
                                                std::int32_t pages_per_row, const Context& ctx) {
  return kvsift::detail::select_pages_in_steps_workspace_bytes(batch, kv_heads, max_pages, pages_per_row, ctx);
}
template <class T>
void select_pages(const QueryView<const T>& q, const PageBoundsView<const T>& bounds, const std::int32_t* slots,
                  const std::int32_t* lengths, const AttentionWindow& window, std::int32_t max_pages,
                  std::int32_t pages_per_row, const SelectionView& out, std::span<std::byte> workspace,
                  const Context& ctx) {
  kvsift::detail::check_select_pages("cuda::select_pages", q, bounds, slots, lengths, window, max_pages,
                                     pages_per_row, out);
  kvsift::detail::select_pages_in_steps(q, bounds, slots, lengths, window, max_pages, pages_per_row, out, workspace,
                                        ctx);
}

}  // namespace kvsift::cuda
