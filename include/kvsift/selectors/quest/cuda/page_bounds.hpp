#pragma once
/// Page bounds on the GPU, the twin of selectors/quest/cpu/page_bounds.hpp (read its contracts; the differences are here).
/// Device memory for every pointer and view; stream-ordered; no allocation, no host sync, no workspace;
/// CUDA-graph capturable; deterministic; reentrant with distinct outputs; page_scores and expand_pages are launched as
/// programmatic dependents (PDL, sm_90), as topk_rows between them is (cuda/topk.hpp). build, append and expand equal the
/// CPU's results exactly; page_scores sums each head's channels in another order (within fp32 rounding of the
/// CPU's sum, a few ulps of sum_c |q_c| * max(|lo_c|, |hi_c|)).
///
/// Shapes are checked on the host before the launch as on the CPU; the arrays' contents (slots, lengths, page
/// tables, counts, page ids) live on the device and are not, so each function defines what a bad value does,
/// and none reads or writes out of bounds:
/// - build / append: a batch row whose slot is outside [0, bounds.slots) or whose sequence is longer than
///   bounds.max_pages * page_size writes nothing (two rows naming one slot race: the CPU refuses it).
/// - page_scores: a row whose slot is outside [0, bounds.slots), whose length is negative, or whose page count
///   exceeds min(bounds.max_pages, scores.cols) gets page_counts[b] = -1 and no scores.
/// - expand_pages: a row whose count is outside [0, pages.capacity] gets out count -1 and no entries; a page id
///   outside the sequence, or a negative length, contributes no token. Page ids out of order or repeated (the
///   CPU refuses them) give tokens in that order, repeated; out.capacity >= pages.capacity * page_size still
///   bounds every row.
/// The cache's own page table (paged KV) is trusted, as by the decode kernels.
/// Supported head_dim: 64, 128, 256 (refused otherwise, naming the set).

#include <cstdint>

#include "kvsift/attention/options.hpp"
#include "kvsift/selectors/quest/page_bounds_view.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

/// cpu::build_page_bounds. kv: ContiguousKVView<const T> or PagedKVView<const T>; slots [kv.batch].
template <class T, KVCacheView KV>
void build_page_bounds(const KV& kv, const std::int32_t* d_slots, const PageBoundsView<T>& bounds,
                       const Context& ctx);

/// cpu::append_page_bounds: one launch of batch * kv_heads * head_dim threads; the length is read on the device.
template <class T, KVCacheView KV>
void append_page_bounds(const KV& kv, const std::int32_t* d_slots, const PageBoundsView<T>& bounds,
                        const Context& ctx);

/// cpu::page_scores. One launch; each page's bounds are read from memory once for up to 8 query heads of its
/// group (a larger group re-reads them per tile of 8, from L2 where they fit).
template <class T>
void page_scores(const QueryView<const T>& q, const PageBoundsView<const T>& bounds, const std::int32_t* d_slots,
                 const std::int32_t* d_lengths, const AttentionWindow& window, const MatrixView<float>& scores,
                 std::int32_t* d_page_counts, const Context& ctx);

/// cpu::expand_pages. One launch, one CTA per selection row.
void expand_pages(const SelectionView& pages, std::int32_t page_size, const std::int32_t* d_lengths,
                  const AttentionWindow& window, const SelectionView& out, const Context& ctx);

}  // namespace kvsift::cuda
