/// Host side of CUDA decode attention: validation, workspace layout, split planning, error reporting.
/// Compiled by the host compiler only (src/cuda/decode.cpp); kernels/ holds the device code and launchers.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <span>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kvsift/cuda/decode.hpp"
#include "kvsift/attention/state.hpp"
#include "kvsift/cuda/detail/decode_launch.hpp"
#include "kvsift/cuda/detail/decode_plan.hpp"
#include "kvsift/cuda/detail/per_device.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"

namespace kvsift::cuda {
namespace detail {

inline constexpr int kMinTokensPerSplit = 64;
inline constexpr int kMinTokensToSplitInTwo = 8192;

struct DecodeWorkspace {
  float* partial_o = nullptr;
  float* partial_lse = nullptr;
  unsigned long long* first_bad_row = nullptr;
};

/// The single layout function behind both the size query (counting layout) and the run (carving layout). Split
/// partials only for the merge kernel: a cluster merge keeps its CTAs' states in shared memory.
inline DecodeWorkspace layout_workspace(WorkspaceLayout& layout, std::int64_t batch, std::int64_t q_heads,
                                        std::int64_t head_dim, std::int32_t num_splits, bool cluster_merge,
                                        bool validate_indices) {
  DecodeWorkspace ws;
  if (num_splits > 1 && !cluster_merge) {
    const std::size_t rows = checked_mul(std::size_t(batch * q_heads), std::size_t(num_splits), "decode workspace");
    ws.partial_o = layout.allocate<float>(checked_mul(rows, std::size_t(head_dim), "decode workspace"), "partial_o");
    ws.partial_lse = layout.allocate<float>(rows, "partial_lse");
  }
  if (validate_indices) ws.first_bad_row = layout.allocate<unsigned long long>(1, "first_bad_row");
  return ws;
}

inline void check_aligned(const char* where, const char* name, const void* p, std::int64_t row_stride_a,
                          std::int64_t row_stride_b, std::int64_t row_stride_c = 0) {
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(p) % 16 == 0, where,
               "{} (= {}) is not 16-byte aligned, which the CUDA decode kernels' vector loads need", name, p);
  for (std::int64_t s : {row_stride_a, row_stride_b, row_stride_c}) {
    KVSIFT_CHECK(s % 8 == 0, where, "{}: stride {} is not a multiple of 8 elements (16 bytes)", name, s);
  }
}

template <class T>
void check_kv_aligned(const char* where, const ContiguousKVView<const T>& kv) {
  check_aligned(where, "kv.k", kv.k, kv.batch_stride, kv.head_stride, kv.token_stride);
  check_aligned(where, "kv.v", kv.v, kv.batch_stride, kv.head_stride, kv.token_stride);
}
template <class T>
void check_kv_aligned(const char* where, const PagedKVView<const T>& kv) {
  check_aligned(where, "kv.k_pages", kv.k_pages, kv.page_stride, kv.head_stride, kv.token_stride);
  check_aligned(where, "kv.v_pages", kv.v_pages, kv.page_stride, kv.head_stride, kv.token_stride);
}

template <class T>
std::int32_t max_tokens_of(const ContiguousKVView<const T>& kv, const DecodeOptions&) {
  return kv.capacity;
}
template <class T>
std::int32_t max_tokens_of(const PagedKVView<const T>&, const DecodeOptions& options) {
  return options.max_seq_len;
}

DeviceLimits current_device_limits() {
  static PerDeviceCounts<std::tuple_size_v<DecodeClusterCapacity>> clusters;
  DeviceLimits limits{multiprocessor_count(), std::size_t(max_shared_memory_per_block()), {}};
  KVSIFT_CUDA_CHECK(clusters.get(&limits.clusters, [](DecodeClusterCapacity* c) { return decode_cluster_capacity(c); }));
  return limits;
}

void check_decode_options(const char* where, const DecodeOptions& options) {
  KVSIFT_CHECK(options.num_splits >= 0, where, "options.num_splits (= {}) must be >= 0", options.num_splits);
  KVSIFT_CHECK(options.cta_warps == 0 || options.cta_warps == kDecodeMinWarps || options.cta_warps == kDecodeMaxWarps,
               where, "options.cta_warps (= {}) must be 0 (chosen per GPU), {} or {}", options.cta_warps,
               kDecodeMinWarps, kDecodeMaxWarps);
  KVSIFT_CHECK(std::size_t(options.split_merge) < kSplitMergeNames.size(), where,
               "options.split_merge (= {}) is not a SplitMerge (automatic, cluster or kernel)", int(options.split_merge));
  KVSIFT_CHECK(options.split_merge != SplitMerge::cluster || options.num_splits <= kClusterMergeMaxSplits, where,
               "options.num_splits (= {}) exceeds {}, the most CTAs options.split_merge (= cluster) merges in a cluster",
               options.num_splits, kClusterMergeMaxSplits);
}

/// Warps per CTA: the caller's 4 or 8, or 8 where the GPU gives a block the shared memory for it, else 4.
///
/// Splits so that the grid has about one CTA per multiprocessor, with at least kMinTokensPerSplit tokens per
/// CTA. Measured on the H100 (docs/bench/decode_h100.md, split sweeps): one CTA per SM streams as fast as
/// two, and every extra split is one more partial for the merge to read, which small batches pay for
/// directly. Where the rows alone fill a third of the SMs or more (two splits), a split of eight-warp CTAs
/// buys little bandwidth and costs the merge pass (partial stores, a second kernel, ~2 us), so only rows of
/// at least kMinTokensToSplitInTwo are split. H100, one run: sparse K = 2048 / batch 8 took 29.4 us unsplit
/// against 31.5 in two, K = 4096 52.5 against 53.9, K = 8192 98.6 against 97.7; dense 128K / batch 8 1532
/// against 1344. Four-warp CTAs keep the second split: unsplit, they read too slowly (sparse K = 2048 /
/// batch 8: 36.6 against 33.5 us).
DecodePlan plan_decode(const char* where, std::int64_t rows, std::int32_t max_tokens, int head_dim,
                       const DecodeOptions& options, const DeviceLimits& limits) {
  check_decode_options(where, options);
  DecodePlan plan;
  plan.cta_warps = options.cta_warps;
  if (plan.cta_warps == 0) {
    plan.cta_warps = decode_shared_bytes(head_dim, kDecodeMaxWarps) <= limits.shared_memory_per_block ? kDecodeMaxWarps
                                                                                                   : kDecodeMinWarps;
  }
  const std::size_t shared_bytes = decode_shared_bytes(head_dim, plan.cta_warps);
  KVSIFT_CHECK(shared_bytes <= limits.shared_memory_per_block, where,
               "{} warps per CTA need {} bytes of shared memory per block at head_dim {}; this GPU allows {}",
               plan.cta_warps, shared_bytes, head_dim, limits.shared_memory_per_block);

  const bool short_rows = max_tokens <= kClusterMergeMaxTokens;
  if (options.num_splits > 0) {
    plan.num_splits = options.num_splits;
  } else {
    std::int64_t splits = std::max<std::int64_t>(limits.multiprocessors / rows, 1);
    splits = std::min<std::int64_t>(splits, (std::int64_t(max_tokens) + kMinTokensPerSplit - 1) / kMinTokensPerSplit);
    if (splits == 2 && plan.cta_warps == kDecodeMaxWarps && max_tokens < kMinTokensToSplitInTwo) splits = 1;
    // Short rows merge in a cluster (SplitMerge::automatic): at most kClusterMergeMaxSplits CTAs a row.
    const bool capped = options.split_merge == SplitMerge::cluster ||
                        (options.split_merge == SplitMerge::automatic && short_rows &&
                         rows <= limits.clusters[std::size_t(kClusterMergeMaxSplits)]);
    if (capped) splits = std::min<std::int64_t>(splits, kClusterMergeMaxSplits);
    plan.num_splits = static_cast<std::int32_t>(std::max<std::int64_t>(splits, 1));
  }
  if (plan.num_splits == 1 || options.split_merge == SplitMerge::kernel) return plan;
  // Every row's cluster at once: a cluster left for a second wave would double the call.
  const bool placed = plan.num_splits <= kClusterMergeMaxSplits && rows <= limits.clusters[std::size_t(plan.num_splits)];
  if (options.split_merge == SplitMerge::cluster) {
    KVSIFT_CHECK(placed, where,
                 "options.split_merge (= cluster): this GPU holds {} clusters of {} decode CTAs at once, fewer than the "
                 "{} rows (0: its code has no clusters, which need sm_90)",
                 plan.num_splits <= kClusterMergeMaxSplits ? limits.clusters[std::size_t(plan.num_splits)] : 0,
                 plan.num_splits, rows);
  }
  plan.cluster_merge = placed && (short_rows || options.split_merge == SplitMerge::cluster);
  return plan;
}

/// The most entries a sparse row attends: its capacity in tokens (or pages of selection_page_size tokens) and the
/// window's, which sizes the split plan.
std::int32_t sparse_max_tokens(std::int32_t capacity, const AttentionOptions& attention) {
  return std::int32_t(std::min<std::int64_t>(INT_MAX, std::int64_t(capacity) * attention.selection_page_size +
                                                          attention.window.sink + attention.window.recent));
}

/// Validates everything the kernels rely on and fills the parameters (workspace pointers excepted). `out`
/// (nullptr for the workspace queries) is in the storage type or fp32 (TO = T or float).
template <class T, class KV, class TO = T>
DecodeParams<T> make_params(const char* where, const QueryView<const T>& q, const KV& kv, const SelectionView* selection,
                            const StateView<TO>* out, const DecodeOptions& options) {
  static_assert(std::is_same_v<TO, T> || std::is_same_v<TO, float>, "outputs are in the storage type or fp32");
  validate(q, where, "q");
  validate(kv, where, "kv", MemorySpace::device);
  check_query_matches_kv(where, q, kv);
  kvsift::detail::check_supported(where, "head_dim", q.head_dim, kCudaAttentionHeadDims, "the CUDA decode kernels");
  KVSIFT_CHECK(q.batch <= 65535, where, "q.batch (= {}) exceeds the CUDA grid limit 65535", q.batch);
  check_decode_options(where, options);  // before any device query, so that bad options fail on any machine
  check_aligned(where, "q.data", q.data, q.batch_stride, q.head_stride);
  check_kv_aligned(where, kv);
  if (out != nullptr) {
    validate(*out, where, "out");
    check_output_matches_query(where, q, *out);
  }

  DecodeParams<T> p;
  p.q = q;
  if constexpr (std::is_same_v<KV, PagedKVView<const T>>) {
    p.paged = true;
    p.paged_kv = kv;
  } else {
    p.kv = kv;
  }
  std::int32_t max_tokens = 0;
  if (selection != nullptr) {
    validate(*selection, kv, where, "selection", options.attention.selection_rows);
    validate(options.attention.window, where, "options.attention.window");
    check_selection_page_size(where, "options.attention.selection_page_size", options.attention.selection_page_size);
    p.selection = *selection;
    p.selection_rows = options.attention.selection_rows;
    p.window = options.attention.window;
    p.page_size = options.attention.selection_page_size;
    p.pages = FastDivisor(std::uint32_t(p.page_size));
    max_tokens = sparse_max_tokens(selection->capacity, options.attention);
  } else {
    check_no_window(where, options.attention);
    max_tokens = max_tokens_of(kv, options);
    KVSIFT_CHECK(max_tokens > 0, where,
                 "options.max_seq_len (= {}) must be positive for dense decode on a paged cache (an upper bound on "
                 "every sequence's length)",
                 options.max_seq_len);
  }
  if (out != nullptr) {
    if constexpr (std::is_same_v<TO, float>) {
      p.out_f32 = *out;
    } else {
      p.out = *out;
    }
  }
  p.group = q.heads / kv.kv_heads;
  p.head_tiles = (p.group + kHeadsPerTile - 1) / kHeadsPerTile;
  KVSIFT_CHECK(std::int64_t(kv.kv_heads) * p.head_tiles <= 65535, where,
               "kv.kv_heads (= {}) * GQA tiles (= {}) exceeds the CUDA grid limit 65535", kv.kv_heads, p.head_tiles);
  const DecodePlan plan = plan_decode(where, std::int64_t(q.batch) * kv.kv_heads * p.head_tiles, max_tokens,
                                      q.head_dim, options, current_device_limits());
  p.num_splits = plan.num_splits;
  p.cta_warps = plan.cta_warps;
  p.cluster_merge = plan.cluster_merge;
  p.scale_log2 = options.attention.resolved_scale(q.head_dim) * kLog2e;
  return p;
}

/// Validation mode: checks the selection on the device and, when a row is refused, reads that row back
/// and throws naming its first offending position, with the same words as the CPU. Synchronizes the stream.
template <class T>
void check_selection(const char* where, const DecodeParams<T>& p, cudaStream_t stream) {
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(p.first_bad_row, 0xff, sizeof(unsigned long long), stream));
  KVSIFT_CUDA_CHECK(launch_check_selection(p, stream));
  unsigned long long first = 0;
  KVSIFT_CUDA_CHECK(cudaMemcpyAsync(&first, p.first_bad_row, sizeof(first), cudaMemcpyDeviceToHost, stream));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (first == ~0ull) return;
  const std::int64_t row = static_cast<std::int64_t>(first);  // batch row b's kv head h
  const std::int64_t b = row / p.selection.kv_heads, h = row % p.selection.kv_heads;
  std::int64_t selection_b = b;  // the selection row it attends (AttentionOptions::selection_rows)
  if (p.selection_rows != nullptr) {
    std::int32_t mapped = 0;
    KVSIFT_CUDA_CHECK(cudaMemcpy(&mapped, p.selection_rows + b, sizeof(mapped), cudaMemcpyDeviceToHost));
    check_mapped_row(where, "selection", b, mapped, p.selection.batch);
    selection_b = mapped;
  }
  const std::int64_t selection_row = selection_b * p.selection.kv_heads + h;
  std::int32_t count = 0;
  KVSIFT_CUDA_CHECK(cudaMemcpy(&count, p.selection.counts + selection_row, sizeof(count), cudaMemcpyDeviceToHost));
  check_selection_count(where, "selection", b, h, count, p.selection.capacity);
  std::int32_t seq_len = 0;
  if (!p.paged && p.kv.seq_lens == nullptr) {
    seq_len = p.kv.capacity;
  } else if (!p.paged) {
    KVSIFT_CUDA_CHECK(cudaMemcpy(&seq_len, p.kv.seq_lens + b, sizeof(seq_len), cudaMemcpyDeviceToHost));
  } else if (p.paged_kv.seq_lens != nullptr) {  // the block-table form, or CSR with seq_lens
    KVSIFT_CUDA_CHECK(cudaMemcpy(&seq_len, p.paged_kv.seq_lens + b, sizeof(seq_len), cudaMemcpyDeviceToHost));
  } else {
    std::int32_t indptr[2], last = 0;
    KVSIFT_CUDA_CHECK(cudaMemcpy(indptr, p.paged_kv.page_indptr + b, sizeof(indptr), cudaMemcpyDeviceToHost));
    KVSIFT_CUDA_CHECK(cudaMemcpy(&last, p.paged_kv.last_page_len + b, sizeof(last), cudaMemcpyDeviceToHost));
    seq_len = indptr[1] == indptr[0] ? 0 : (indptr[1] - indptr[0] - 1) * p.paged_kv.page_size + last;
  }
  // The error path only: a host copy of the refused row and a bitmap of its sequence.
  std::vector<std::int32_t> indices(static_cast<std::size_t>(count));
  KVSIFT_CUDA_CHECK(cudaMemcpy(indices.data(), p.selection.indices + selection_row * p.selection.capacity,
                               indices.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  std::vector<std::uint64_t> seen(std::size_t(std::max(seq_len, 0)) / 64 + 1, 0);
  if (p.page_size > 1) {
    check_page_entries(where, "selection", b, h, indices.data(), count, seq_len, p.page_size, seen);
  } else {
    check_selection_entries(where, "selection", b, h, indices.data(), count, seq_len, p.window, seen);
  }
  KVSIFT_CHECK(false, where, "the device check refused selection row (batch {}, kv_head {}), but its host copy "
               "passes: was the selection written concurrently with this call?", b, h);
}

template <class T>
void run_decode(const char* where, DecodeParams<T> p, std::span<std::byte> workspace, cudaStream_t stream,
                const DecodeOptions& options) {
  const bool validate_indices = options.validate_indices;
  WorkspaceLayout layout(workspace, where);
  const DecodeWorkspace ws =
      layout_workspace(layout, p.q.batch, p.q.heads, p.q.head_dim, p.num_splits, p.cluster_merge, validate_indices);
  if (ws.partial_o != nullptr) {  // [batch, q_heads, num_splits, head_dim] in the workspace
    const std::int64_t splits = p.num_splits;
    p.partials = {ws.partial_o, ws.partial_lse, p.q.heads * splits * p.q.head_dim, splits * p.q.head_dim,
                  p.q.heads * splits, splits};
  } else if (p.out_f32.o != nullptr && p.num_splits == 1) {  // unsplit with an fp32 output: written by the kernel
    p.partials = {p.out_f32.o, p.out_f32.lse, p.out_f32.o_batch_stride, p.out_f32.o_head_stride,
                  p.out_f32.lse_batch_stride, 1};
  }
  p.first_bad_row = ws.first_bad_row;
  if (validate_indices) check_selection(where, p, stream);  // before any output is written
  KVSIFT_CUDA_CHECK(launch_decode(p, stream, options.programmatic_launch));
}

}  // namespace detail

template <class T, class KV>
std::size_t sparse_decode_workspace_bytes(const QueryView<const T>& q, const KV& kv, const SelectionView& selection,
                                          const DecodeOptions& options) {
  const auto p = detail::make_params<T, KV, T>("cuda::sparse_decode_workspace_bytes", q, kv, &selection, nullptr, options);
  WorkspaceLayout counting;
  detail::layout_workspace(counting, q.batch, q.heads, q.head_dim, p.num_splits, p.cluster_merge,
                           options.validate_indices);
  return counting.bytes();
}

std::size_t sparse_decode_workspace_bytes(const SparseDecodeShape& shape, const DecodeOptions& options) {
  constexpr const char* where = "cuda::sparse_decode_workspace_bytes";
  KVSIFT_CHECK(shape.batch > 0 && shape.batch <= 65535, where, "shape.batch (= {}) is outside [1, 65535]", shape.batch);
  KVSIFT_CHECK(shape.kv_heads > 0 && shape.q_heads > 0 && shape.q_heads % shape.kv_heads == 0, where,
               "shape.q_heads (= {}) must be a positive multiple of shape.kv_heads (= {})", shape.q_heads,
               shape.kv_heads);
  kvsift::detail::check_supported(where, "head_dim", shape.head_dim, kCudaAttentionHeadDims, "the CUDA decode kernels");
  KVSIFT_CHECK(shape.capacity >= 0, where, "shape.capacity (= {}) must be >= 0", shape.capacity);
  detail::check_decode_options(where, options);
  validate(options.attention.window, where, "options.attention.window");
  check_selection_page_size(where, "options.attention.selection_page_size", options.attention.selection_page_size);
  const std::int32_t head_tiles = (shape.q_heads / shape.kv_heads + kHeadsPerTile - 1) / kHeadsPerTile;
  const std::int32_t max_tokens = detail::sparse_max_tokens(shape.capacity, options.attention);
  const detail::DecodePlan plan = detail::plan_decode(where, std::int64_t(shape.batch) * shape.kv_heads * head_tiles,
                                                      max_tokens, shape.head_dim, options, detail::current_device_limits());
  WorkspaceLayout counting;
  detail::layout_workspace(counting, shape.batch, shape.q_heads, shape.head_dim, plan.num_splits,
                           plan.cluster_merge, options.validate_indices);
  return counting.bytes();
}

template <class T, class KV, class TO>
void sparse_decode(const QueryView<const T>& q, const KV& kv, const SelectionView& selection, const StateView<TO>& out,
                   std::span<std::byte> workspace, cudaStream_t stream, const DecodeOptions& options) {
  constexpr const char* where = "cuda::sparse_decode";
  detail::run_decode(where, detail::make_params<T, KV, TO>(where, q, kv, &selection, &out, options), workspace, stream,
                     options);
}

template <class T, class KV>
std::size_t dense_decode_workspace_bytes(const QueryView<const T>& q, const KV& kv, const DecodeOptions& options) {
  const auto p = detail::make_params<T, KV, T>("cuda::dense_decode_workspace_bytes", q, kv, nullptr, nullptr, options);
  WorkspaceLayout counting;
  detail::layout_workspace(counting, q.batch, q.heads, q.head_dim, p.num_splits, p.cluster_merge, false);
  return counting.bytes();
}

template <class T, class KV, class TO>
void dense_decode(const QueryView<const T>& q, const KV& kv, const StateView<TO>& out, std::span<std::byte> workspace,
                  cudaStream_t stream, const DecodeOptions& options) {
  constexpr const char* where = "cuda::dense_decode";
  DecodeOptions dense_options = options;
  dense_options.validate_indices = false;  // there are no indices to check
  detail::run_decode(where, detail::make_params<T, KV, TO>(where, q, kv, nullptr, &out, options), workspace, stream,
                     dense_options);
}

template <class TI, class TO>
void merge_states(std::span<const StateView<const TI>> partials, const StateView<TO>& out, cudaStream_t stream) {
  constexpr const char* where = "cuda::merge_states";
  constexpr int kMax = MergeParams<TI, TO>::kMaxPartials;
  KVSIFT_CHECK(!partials.empty() && partials.size() <= std::size_t(kMax), where,
               "number of partials (= {}) is outside [1, {}]: one launch takes at most {} (merge larger sets in "
               "groups, each into an fp32 state)",
               partials.size(), kMax, kMax);
  validate_merge_inputs(where, partials, out);
  KVSIFT_CHECK(out.head_dim <= kMergeMaxHeadDim, where, "out.head_dim (= {}) exceeds the merge kernel's limit of {}",
               out.head_dim, kMergeMaxHeadDim);
  MergeParams<TI, TO> p;
  p.num_partials = static_cast<std::int32_t>(partials.size());
  p.out = out;
  std::copy(partials.begin(), partials.end(), p.partials);
  KVSIFT_CHECK(std::int64_t(out.batch) * out.heads <= INT_MAX, where, "batch * heads (= {}) exceeds the grid limit",
               std::int64_t(out.batch) * out.heads);
  KVSIFT_CUDA_CHECK(detail::launch_merge_states(p, stream));
}

// Host entry points only: both output types share the launchers (and so the kernels) of kernels/decode_*.cu.
#define KVSIFT_INSTANTIATE_DECODE(T, KV) KVSIFT_CUDA_DECODE(, T, KV)
#define KVSIFT_INSTANTIATE_MERGE(TI, TO) KVSIFT_CUDA_MERGE(, TI, TO)
KVSIFT_DECODE_TYPES(KVSIFT_INSTANTIATE_DECODE)
KVSIFT_MERGE_TYPES(KVSIFT_INSTANTIATE_MERGE)
#undef KVSIFT_INSTANTIATE_DECODE
#undef KVSIFT_INSTANTIATE_MERGE

}  // namespace kvsift::cuda
