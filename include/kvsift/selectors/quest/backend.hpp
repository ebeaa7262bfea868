#pragma once
/// Quest's calls that are more than one primitive, written once for both backends: the page bounds updates on a
/// KVCache (dispatched to the primitive's contiguous or paged instantiation) and select_pages (its checks, then
/// three primitives). The selector calls these and the primitives themselves (selectors/quest/cpu/page_bounds.hpp,
/// selectors/quest/cuda/page_bounds.hpp) alike: unqualified, the context last. Here the primitives are found by
/// argument-dependent lookup on the context; cpu/backend.hpp and cuda/backend.hpp include this file with them.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/selectors/quest/detail/page_bounds_checks.hpp"
#include "kvsift/selectors/quest/detail/select_pages_in_steps.hpp"
#include "kvsift/selectors/quest/page_bounds_view.hpp"

namespace kvsift {

template <class T, class Context>
void build_page_bounds(const KVCache<const T>& cache, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                       const Context& ctx) {
  cache.visit([&](const auto& kv) { build_page_bounds(kv, slots, bounds, ctx); });
}
template <class T, class Context>
void append_page_bounds(const KVCache<const T>& cache, const std::int32_t* slots, const PageBoundsView<T>& bounds,
                        const Context& ctx) {
  cache.visit([&](const auto& kv) { append_page_bounds(kv, slots, bounds, ctx); });
}

/// Quest's selection: page scores of sequences of up to max_pages pages (<= bounds.max_pages: the planned bound;
/// a longer one is refused on the CPU and gets count -1 on CUDA), the best pages_per_row pages, and, with
/// PagesOut::tokens, their middle tokens (out.capacity >= pages_per_row * page_size); with PagesOut::pages the page
/// ids themselves (out.capacity >= pages_per_row), which sparse decode attends with
/// AttentionOptions::selection_page_size = bounds.page_size.
template <class Context>
std::size_t select_pages_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t max_pages,
                                         std::int32_t pages_per_row, const Context& ctx) {
  return detail::select_pages_in_steps_workspace_bytes(batch, kv_heads, max_pages, pages_per_row, ctx);
}
template <class T, class Context>
void select_pages(const QueryView<const T>& q, const PageBoundsView<const T>& bounds, const std::int32_t* slots,
                  const std::int32_t* lengths, const AttentionWindow& window, std::int32_t max_pages,
                  std::int32_t pages_per_row, PagesOut what, const SelectionView& out, std::span<std::byte> workspace,
                  const Context& ctx) {
  // Refusals name the backend, as its primitives' do.
  constexpr const char* where = Context::memory == MemorySpace::host ? "cpu::select_pages" : "cuda::select_pages";
  detail::check_select_pages(where, q, bounds, slots, lengths, window, max_pages, pages_per_row, what, out);
  detail::select_pages_in_steps(q, bounds, slots, lengths, window, max_pages, pages_per_row, what, out, workspace,
                                ctx);
}

}  // namespace kvsift
