// Page bounds on CUDA: the shape checks shared with the CPU (selectors/quest/detail/page_bounds_checks.hpp, device
// contents unread), the launch-size limits, then the launchers of kernels/page_bounds.cu.
#include "kvsift/selectors/quest/cuda/page_bounds.hpp"

#include <algorithm>
#include <climits>

#include "kvsift/selectors/quest/detail/page_bounds_checks.hpp"
#include "kvsift/selectors/quest/detail/page_bounds_instances.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/selectors/quest/cuda/detail/page_bounds_kernels.cuh"

namespace kvsift::cuda {

template <class T, KVCacheView KV>
void build_page_bounds(const KV& kv, const std::int32_t* d_slots, const PageBoundsView<T>& bounds,
                       const Context& ctx) {
  kvsift::detail::check_page_bounds_update("cuda::build_page_bounds", kv, d_slots, bounds, MemorySpace::device);
  KVSIFT_CUDA_CHECK(detail::launch_build_page_bounds(kv, d_slots, bounds, ctx.stream));
}

template <class T, KVCacheView KV>
void append_page_bounds(const KV& kv, const std::int32_t* d_slots, const PageBoundsView<T>& bounds,
                        const Context& ctx) {
  constexpr const char* where = "cuda::append_page_bounds";
  kvsift::detail::check_page_bounds_update(where, kv, d_slots, bounds, MemorySpace::device);
  KVSIFT_CHECK(std::int64_t(kv.batch) * kv.kv_heads * bounds.head_dim <= std::int64_t(INT32_MAX), where,
               "kv.batch * kv_heads * head_dim (= {} * {} * {}) exceeds 2^31 - 1 threads", kv.batch, kv.kv_heads,
               bounds.head_dim);
  KVSIFT_CUDA_CHECK(detail::launch_append_page_bounds(kv, d_slots, bounds, ctx.stream));
}

template <class T>
void page_scores(const QueryView<const T>& q, const PageBoundsView<const T>& bounds, const std::int32_t* d_slots,
                 const std::int32_t* d_lengths, const AttentionWindow& window, const MatrixView<float>& scores,
                 std::int32_t* d_page_counts, const Context& ctx) {
  constexpr const char* where = "cuda::page_scores";
  kvsift::detail::check_page_scores(where, q, bounds, d_slots, d_lengths, window, scores, d_page_counts,
                                    MemorySpace::device);
  kvsift::detail::check_supported(where, "bounds.head_dim", bounds.head_dim, kCudaAttentionHeadDims,
                                  "the CUDA page-score kernels");
  const auto params = detail::plan_page_scores(q, bounds, d_slots, d_lengths, window, scores, d_page_counts,
                                               multiprocessor_count());
  KVSIFT_CHECK(scores.rows * params.chunks <= std::int64_t(INT32_MAX), where,
               "scores.rows * page chunks (= {} * {}) exceeds 2^31 - 1 CTAs", scores.rows, params.chunks);
  KVSIFT_CUDA_CHECK(detail::launch_page_scores(params, ctx.stream));
}

void expand_pages(const SelectionView& pages, std::int32_t page_size, const std::int32_t* d_lengths,
                  const AttentionWindow& window, const SelectionView& out, const Context& ctx) {
  kvsift::detail::check_expand_pages("cuda::expand_pages", pages, page_size, d_lengths, window, out,
                                     MemorySpace::device);
  KVSIFT_CUDA_CHECK(detail::launch_expand_pages(pages, page_size, d_lengths, window, out, ctx.stream));
}

KVSIFT_STORAGE_TYPES(KVSIFT_PAGE_BOUNDS_INSTANCES)

}  // namespace kvsift::cuda
