#pragma once
/// select_pages as three primitives of a backend: page_scores (max_pages columns: a sequence with more pages is
/// refused, on the CPU, or marked count -1, on CUDA), topk_rows over the pages, expand_pages (PagesOut::tokens;
/// PagesOut::pages: topk_rows writes `out` itself, two primitives): select_pages on both backends (a kernel fusing the three was slower on the H100: docs/experiments.md#fused-quest-select).
/// Written once over the context: the primitives are found by argument-dependent lookup on it (cpu/backend.hpp, cuda/backend.hpp,
/// which include this header and declare them).

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/attention/options.hpp"
#include "kvsift/selectors/quest/page_bounds_view.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/core/workspace.hpp"

namespace kvsift::detail {

struct PagesInSteps {
  float* scores;              ///< [batch * kv_heads, max_pages]
  std::int32_t* page_counts;  ///< [batch]
  std::int32_t* pages;        ///< [batch * kv_heads, pages_per_row]
  std::int32_t* picks;        ///< [batch * kv_heads]
  std::span<std::byte> topk;
};

template <class Context>
PagesInSteps pages_in_steps_layout(WorkspaceLayout& layout, std::int32_t batch, std::int32_t kv_heads,
                                   std::int32_t max_pages, std::int32_t pages_per_row, const Context& ctx) {
  const std::int64_t rows = std::int64_t(batch) * kv_heads;
  PagesInSteps b{};
  b.scores = layout.allocate<float>(std::size_t(rows) * std::size_t(max_pages), "select_pages page scores");
  b.page_counts = layout.allocate<std::int32_t>(std::size_t(batch), "select_pages page counts");
  b.pages = layout.allocate<std::int32_t>(std::size_t(rows) * std::size_t(pages_per_row), "select_pages chosen pages");
  b.picks = layout.allocate<std::int32_t>(std::size_t(rows), "select_pages chosen page counts");
  b.topk = layout.span(topk_rows_workspace_bytes(rows, max_pages, pages_per_row, TopKRowsOptions{}, ctx),
                       "select_pages topk_rows scratch");
  return b;
}

template <class Context>
std::size_t select_pages_in_steps_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t max_pages,
                                                  std::int32_t pages_per_row, const Context& ctx) {
  WorkspaceLayout counting;
  pages_in_steps_layout(counting, batch, kv_heads, max_pages, pages_per_row, ctx);
  return counting.bytes();
}

template <class T, class Context>
void select_pages_in_steps(const QueryView<const T>& q, const PageBoundsView<const T>& bounds,
                           const std::int32_t* slots, const std::int32_t* lengths, const AttentionWindow& window,
                           std::int32_t max_pages, std::int32_t pages_per_row, PagesOut what,
                           const SelectionView& out, std::span<std::byte> workspace, const Context& ctx) {
  WorkspaceLayout carving(workspace, "select_pages");
  const PagesInSteps b = pages_in_steps_layout(carving, q.batch, bounds.kv_heads, max_pages, pages_per_row, ctx);
  const std::int64_t rows = std::int64_t(q.batch) * bounds.kv_heads;
  page_scores(q, bounds, slots, lengths, window, MatrixView<float>::packed(b.scores, rows, max_pages), b.page_counts,
              ctx);
  const SelectionView pages = what == PagesOut::pages
                                  ? out
                                  : SelectionView{b.pages, b.picks, nullptr, q.batch, bounds.kv_heads, pages_per_row};
  topk_rows(MatrixView<const float>::packed(b.scores, rows, max_pages), b.page_counts, pages_per_row,
            TopKRowsOptions{}, pages, b.topk, ctx);
  if (what == PagesOut::tokens) expand_pages(pages, bounds.page_size, lengths, window, out, ctx);
}

}  // namespace kvsift::detail
