// The merge store on CUDA: the shape checks shared with the CPU (selectors/centroid_kv/detail/merge_store_checks.hpp; device
// contents unread), the round's workspace, then the launchers of kernels/selectors/centroid_kv/merge_store.cu and, between the matching
// and the merges, cuda::topk_rows as the ranking.
#include "kvsift/selectors/centroid_kv/cuda/merge_store.hpp"

#include <algorithm>
#include <climits>

#include "kvsift/core/dtype.hpp"
#include "kvsift/selectors/centroid_kv/detail/merge_store_checks.hpp"
#include "kvsift/selectors/centroid_kv/detail/merge_store_instances.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/selectors/centroid_kv/cuda/detail/merge_store_launch.hpp"
#include "kvsift/cuda/topk.hpp"

namespace kvsift::cuda {
namespace {

/// Ranking window: every link of a row is a candidate (no sinks or recent among links).
TopKRowsOptions ranking_options(const std::int32_t* row_k) {
  return {.window = {}, .row_k = row_k, .heads_per_row = 1};
}

std::int32_t max_links(std::int32_t capacity) { return std::max(1, capacity / 2); }

template <class T>
detail::MergeRoundLaunch<T> layout_merge_round(WorkspaceLayout& layout, std::int32_t batch, std::int32_t kv_heads,
                                               std::int32_t capacity) {
  const std::size_t rows = std::size_t(batch) * std::size_t(kv_heads);
  const std::size_t links = checked_mul(rows, std::size_t(max_links(capacity)), "cuda merge_round links");
  const std::size_t entries = checked_mul(rows, std::size_t(capacity), "cuda merge_round entries");
  detail::MergeRoundLaunch<T> p{};
  p.counts = layout.allocate<std::int32_t>(rows, "merge_round counts");
  p.merges = layout.allocate<std::int32_t>(rows, "merge_round merges");
  p.lengths = layout.allocate<std::int32_t>(rows, "merge_round link counts");
  p.chosen_counts = layout.allocate<std::int32_t>(rows, "merge_round chosen counts");
  p.similarity = layout.allocate<float>(links, "merge_round similarities");
  p.target = layout.allocate<std::uint8_t>(links, "merge_round targets");
  p.chosen = layout.allocate<std::int32_t>(links, "merge_round chosen links");
  p.order = layout.allocate<std::int32_t>(entries, "merge_round order copy");
  p.degree = layout.allocate<std::int32_t>(entries, "merge_round degree copy");
  p.log_degree = layout.allocate<float>(entries, "merge_round log-degree copy");
  return p;
}

void check_rows(const char* where, std::int64_t rows) {
  KVSIFT_CHECK(rows <= 65535, where, "batch * kv_heads (= {}) exceeds 65535 (the kernels' grid rows)", rows);
}

}  // namespace

template <class T>
void merge_store_load(const KVCache<const T>& cache, const std::int32_t* d_slots, const MergeStoreView<T>& store,
                      const Context& ctx) {
  constexpr const char* where = "cuda::merge_store_load";
  kvsift::detail::check_merge_store(where, "store", store);
  kvsift::detail::check_cache_matches(where, cache, store);
  KVSIFT_CHECK(d_slots != nullptr, where, "slots must be non-null");
  KVSIFT_CUDA_CHECK(detail::launch_merge_store_load(cache, d_slots, store, ctx.stream));
}

std::size_t merge_round_workspace_bytes(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity,
                                        const Context&) {
  constexpr const char* where = "cuda::merge_round_workspace_bytes";
  KVSIFT_CHECK(batch > 0 && kv_heads > 0 && capacity > 0, where,
               "batch (= {}), kv_heads (= {}) and capacity (= {}) must be positive", batch, kv_heads, capacity);
  WorkspaceLayout counting;
  layout_merge_round<float>(counting, batch, kv_heads, capacity);
  return counting.bytes() + topk_rows_workspace_bytes(std::int64_t(batch) * kv_heads, max_links(capacity),
                                                      max_links(capacity), ranking_options(nullptr));
}

template <class T>
void merge_round(const MergeStoreView<T>& store, const std::int32_t* d_slots, std::int32_t batch,
                 const std::int32_t* d_budgets, const MergeRoundParams& params, std::span<std::byte> workspace,
                 const Context& ctx) {
  constexpr const char* where = "cuda::merge_round";
  kvsift::detail::check_merge_store(where, "store", store);
  kvsift::detail::check_merge_round_params(where, params);
  KVSIFT_CHECK(params.chunk <= kMergeMaxChunk, where, "params.chunk (= {}) exceeds {} (the matching kernel's bound)",
               params.chunk, kMergeMaxChunk);
  KVSIFT_CHECK(batch > 0, where, "batch (= {}) must be positive", batch);
  KVSIFT_CHECK(d_slots != nullptr && d_budgets != nullptr, where, "slots and budgets must be non-null");
  const std::int64_t rows = std::int64_t(batch) * store.kv_heads;
  check_rows(where, rows);
  WorkspaceLayout layout(workspace, where);
  detail::MergeRoundLaunch<T> p = layout_merge_round<T>(layout, batch, store.kv_heads, store.capacity);
  p.store = store;
  p.slots = d_slots;
  p.budgets = d_budgets;
  p.params = params;
  p.batch = batch;
  p.max_links = max_links(store.capacity);
  p.max_chunks = (store.capacity + params.chunk - 1) / params.chunk;
  // About eight CTAs per SM in all: a prefill round keeps every SM busy, a decode step's no-op round is one wave.
  p.blocks_per_row = std::int32_t(std::max<std::int64_t>(1, 8 * std::int64_t(multiprocessor_count()) / rows));
  const TopKRowsOptions ranking = ranking_options(p.merges);
  const std::span<std::byte> topk_workspace =
      layout.span(topk_rows_workspace_bytes(rows, p.max_links, p.max_links, ranking), "merge_round ranking");
  KVSIFT_CUDA_CHECK(detail::launch_merge_match(p, ctx.stream));
  const SelectionView chosen{.indices = p.chosen,
                             .counts = p.chosen_counts,
                             .batch = std::int32_t(rows),
                             .kv_heads = 1,
                             .capacity = p.max_links};
  topk_rows(MatrixView<const float>::packed(p.similarity, rows, p.max_links), p.lengths, p.max_links, ranking, chosen,
            topk_workspace, ctx.stream);
  KVSIFT_CUDA_CHECK(detail::launch_merge_apply(p, ctx.stream));
}

template <class T>
void merge_store_append(const KVCache<const T>& cache, const std::int32_t* d_slots, const std::int32_t* d_lengths,
                        const MergeStoreView<T>& store, const Context& ctx) {
  constexpr const char* where = "cuda::merge_store_append";
  kvsift::detail::check_merge_store(where, "store", store);
  kvsift::detail::check_cache_matches(where, cache, store);
  KVSIFT_CHECK(d_slots != nullptr && d_lengths != nullptr, where, "slots and lengths must be non-null");
  KVSIFT_CUDA_CHECK(detail::launch_merge_store_append(cache, d_slots, d_lengths, store, ctx.stream));
}

template <class T>
void merge_store_evict(const MergeStoreView<T>& store, const std::int32_t* d_slots, std::int32_t batch,
                       const std::int32_t* d_budgets, const std::int32_t* d_sinks, const Context& ctx) {
  constexpr const char* where = "cuda::merge_store_evict";
  kvsift::detail::check_merge_store_evict(where, store, batch, d_budgets, d_sinks);
  KVSIFT_CHECK(d_slots != nullptr, where, "slots must be non-null");
  KVSIFT_CUDA_CHECK(detail::launch_merge_store_evict(store, d_slots, batch, d_budgets, d_sinks, ctx.stream));
}

template <class T>
void merge_store_copy(const MergeStoreView<const T>& src, const std::int32_t* d_src_slots, const MergeStoreView<T>& dst,
                      const std::int32_t* d_dst_slots, std::int32_t batch, const Context& ctx) {
  constexpr const char* where = "cuda::merge_store_copy";
  kvsift::detail::check_merge_store_copy(where, src, dst, batch);
  KVSIFT_CHECK(d_src_slots != nullptr && d_dst_slots != nullptr, where, "src_slots and dst_slots must be non-null");
  KVSIFT_CUDA_CHECK(detail::launch_merge_store_copy(src, d_src_slots, dst, d_dst_slots, batch, ctx.stream));
}

template <class T>
void merge_store_selection(const MergeStoreView<const T>& store, const std::int32_t* d_slots, const SelectionView& out,
                           const Context& ctx) {
  constexpr const char* where = "cuda::merge_store_selection";
  kvsift::detail::check_merge_store_selection(where, store, out);
  KVSIFT_CHECK(d_slots != nullptr, where, "slots must be non-null");
  KVSIFT_CUDA_CHECK(detail::launch_merge_store_selection(store, d_slots, out, ctx.stream));
}

KVSIFT_STORAGE_TYPES(KVSIFT_MERGE_STORE_INSTANCES)

}  // namespace kvsift::cuda
