// CUDA KV gathers (cuda/gather.hpp): a thread per 16-byte piece of a copied K or V row, and for the difference gather
// a CTA per selection row that assigns slots first (launched apart from the copies: selectors/specontext/elastic_kv.hpp
// copies one assignment into several layers, and commits it as its per-slot resident state). The source may be
// pinned host memory read through its device-accessible pointers: each thread issues several independent loads
// before its stores, so that many PCIe reads are in flight from few CTAs.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <type_traits>

#include "kvsift/core/dtype.hpp"
#include "kvsift/cuda/detail/gather_launch.hpp"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/primitives_kernels.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kAssignThreads = 256;
constexpr int kResidentWords = kDifferenceMaxSlots / 32;

/// Pieces of K/V rows one thread copies per round: all its loads are issued before any store, so that each thread
/// keeps this many reads in flight (from pinned host memory each is a PCIe round trip of about a microsecond).
constexpr int kCopyUnroll = 8;
/// CTAs of a difference copy at most (its sources are pinned host memory: ElasticKV's layers on the host). A copy
/// of zero-copy reads slows the latency-bound kernels beside it, the more the more SMs it holds: over the whole GPU it
/// made an 8-CTA kernel reading HBM 5x slower (11 -> 57 us, H200), over 32 CTAs 2.7x. SpeContext's 9 offloaded layers at 128K (H200): copies
/// alone 583 / 604 / 695 / 845 us with no bound / 128 / 64 / 32 CTAs, the step beside the attention 1216 / 1150 /
/// 1146 / 1288 us (experiments.md#specontext-offload-overlap-h200). gather_kv, often between device buffers, takes the
/// whole GPU.
constexpr unsigned kCopyMaxCtas = 128;

/// An entry's rows: source and destination of its K and V rows (V unused by a keys-only copy); a null source K row:
/// nothing to copy.
template <class T>
struct EntryRows {
  const T* src_k = nullptr;
  const T* src_v = nullptr;
  T* dst_k = nullptr;
  T* dst_v = nullptr;
};

/// The K rows (Parts 1) or the K and V rows (Parts 2) of entries [0, entries) (entry(e) gives an EntryRows), a thread
/// per piece of a row (a 16-byte word when Vec16, else an element), kCopyUnroll pieces per thread and round:
/// consecutive threads take one entry's K row, then its V row, so the reads of a row are coalesced.
template <class T, bool Vec16, int Parts, class Entry>
__device__ __forceinline__ void copy_entries(std::int64_t entries, std::int32_t head_dim, const Entry& entry) {
  static_assert(Parts == 1 || Parts == 2, "K rows, or K and V rows");
  using Piece = std::conditional_t<Vec16, uint4, T>;
  const std::int32_t row_pieces = Vec16 ? std::int32_t(head_dim * sizeof(T) / 16) : head_dim;
  const std::int64_t pieces = entries * Parts * row_pieces, stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t first = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; first < pieces;
       first += stride * kCopyUnroll) {
    Piece value[kCopyUnroll];
    Piece* to[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const std::int64_t piece = first + u * stride;
      to[u] = nullptr;
      if (piece >= pieces) continue;
      const EntryRows<T> rows = entry(piece / (Parts * row_pieces));
      if (rows.src_k == nullptr) continue;
      std::int32_t within = std::int32_t(piece % (Parts * row_pieces));
      const bool is_v = within >= row_pieces;
      within -= is_v ? row_pieces : 0;
      value[u] = reinterpret_cast<const Piece*>(is_v ? rows.src_v : rows.src_k)[within];
      to[u] = reinterpret_cast<Piece*>(is_v ? rows.dst_v : rows.dst_k) + within;
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (to[u] != nullptr) *to[u] = value[u];
    }
  }
}

/// The rows an entry copies into slot `slot` of destination row (b, h), and whether that row has slot i: a KV cache
/// takes K and V (its seq_len(b) bounds the slots), a [batch, heads, tokens, head_dim] view the K rows alone
/// (dst.tokens bounds them).
template <class T>
__device__ __forceinline__ EntryRows<T> entry_rows(const KVCache<const T>& src, std::int64_t b, std::int64_t h,
                                                   std::int64_t token, const KVCache<T>& dst, std::int64_t slot) {
  return {src.k_row(b, h, token), src.v_row(b, h, token), dst.k_row(b, h, slot), dst.v_row(b, h, slot)};
}
template <class T>
__device__ __forceinline__ bool has_slot(const KVCache<T>& dst, std::int64_t b, std::int32_t i) {
  return i < dst.seq_len(b);
}
template <class T>
__device__ __forceinline__ bool has_slot(const SequenceView<T>& dst, std::int64_t, std::int32_t i) {
  return i < dst.tokens;
}
template <class T>
__device__ __forceinline__ EntryRows<T> entry_rows(const KVCache<const T>& src, std::int64_t b, std::int64_t h,
                                                   std::int64_t token, const SequenceView<T>& dst, std::int64_t slot) {
  return {.src_k = src.k_row(b, h, token), .dst_k = dst.row(b, h, slot)};
}

/// Entry i of selection row (b, h) to slot i of dst (gather_kv: a KVCache<T>, K and V rows; gather_keys: a
/// SequenceView<T>, K rows). Entries are taken position-major (e = i * rows + row), so that the rows' live entries
/// come first and a round of loads is mostly live.
template <class T, bool Vec16, class Dst>
__global__ void __launch_bounds__(kCopyThreads) gather_kernel(KVCache<const T> src, SelectionView rows, Dst dst) {
  programmatic_start_if_one_wave();  // the selection (a programmatic dependent: launch.cuh)
  constexpr int kParts = std::is_same_v<Dst, KVCache<T>> ? 2 : 1;
  const std::int64_t selection_rows = std::int64_t(rows.batch) * rows.kv_heads;
  copy_entries<T, Vec16, kParts>(selection_rows * rows.capacity, src.head_dim(), [&](std::int64_t e) -> EntryRows<T> {
    const std::int64_t row = e % selection_rows, b = row / rows.kv_heads, h = row % rows.kv_heads;
    const std::int32_t i = std::int32_t(e / selection_rows), count = rows.counts[row];
    if (count < 0 || count > rows.capacity || i >= count || !has_slot(dst, b, i)) return {};
    const std::int32_t token = rows.indices[row * rows.capacity + i];
    if (token < 0 || token >= src.seq_len(b)) return {};
    return entry_rows(src, b, h, token, dst, i);
  });
}

/// The free slots of word w of a row's bitmap: the clear bits below the row's capacity.
__device__ __forceinline__ std::uint32_t free_bits(const std::uint32_t* used, std::int32_t w, std::int32_t capacity) {
  const std::int32_t valid = capacity - w * 32;
  return ~used[w] & (valid >= 32 ? 0xffffffffu : (1u << valid) - 1u);
}

/// One CTA per selection row: kept tokens keep their slots (marked in `used`), new ones take the free slots in
/// ascending order, their positions in current listed in params.fresh for the copy kernel.
__global__ void __launch_bounds__(kAssignThreads) assign_slots_kernel(DifferenceSlots p) {
  using BlockScan = cub::BlockScan<std::int32_t, kAssignThreads>;
  __shared__ typename BlockScan::TempStorage scan;
  __shared__ std::uint32_t used[kResidentWords];
  __shared__ std::int32_t free_before[kResidentWords];  // free slots in the words before each word
  const std::int64_t row = blockIdx.x;
  const std::int32_t capacity = p.resident_capacity;
  std::int64_t prev_row = row;
  if (p.previous_rows != nullptr) {
    const std::int32_t slot = p.previous_rows[row / p.current.kv_heads];
    if (slot < 0 || slot >= p.previous.batch) {
      if (threadIdx.x == 0) p.copied[row] = -1;
      return;  // the whole CTA
    }
    prev_row = std::int64_t(slot) * p.current.kv_heads + row % p.current.kv_heads;
  }
  const std::int32_t prev_count = p.previous.counts[prev_row], cur_count = p.current.counts[row];
  if (prev_count < 0 || prev_count > min(p.previous.capacity, capacity) || cur_count < 0 ||
      cur_count > p.current.capacity) {
    if (threadIdx.x == 0) p.copied[row] = -1;
    return;  // the whole CTA
  }
  const std::int32_t words = (capacity + 31) / 32;
  for (std::int32_t w = threadIdx.x; w < words; w += kAssignThreads) used[w] = 0;
  __syncthreads();
  const std::int32_t* prev = p.previous.indices + prev_row * p.previous.capacity;
  const std::int32_t* prev_slots = p.previous_slots + prev_row * p.previous.capacity;
  const std::int32_t* cur = p.current.indices + row * p.current.capacity;
  std::int32_t* cur_slots = p.current_slots + row * p.current.capacity;
  const std::int32_t token_end =
      p.source_lengths != nullptr ? p.source_lengths[row / p.current.kv_heads] : 0x7fffffff;
  int outside = 0;  // a token the copies would skip: the row is bad rather than recorded resident unloaded
  for (std::int32_t j = threadIdx.x; j < cur_count; j += kAssignThreads) {
    const std::int32_t token = cur[j];
    if (p.source_lengths != nullptr && (token < 0 || token >= token_end)) outside = 1;
    std::int32_t lo = 0, hi = prev_count;  // the first previous token >= token
    while (lo < hi) {
      const std::int32_t mid = (lo + hi) / 2;
      if (prev[mid] < token) lo = mid + 1;
      else hi = mid;
    }
    std::int32_t slot = lo < prev_count && prev[lo] == token ? prev_slots[lo] : -1;
    if (slot >= capacity) slot = -1;
    if (slot >= 0) atomicOr(&used[slot / 32], 1u << (slot % 32));
    cur_slots[j] = slot;
  }
  if (__syncthreads_or(outside)) {
    if (threadIdx.x == 0) p.copied[row] = -1;
    return;  // the whole CTA
  }
  // Exclusive prefix of the words' free counts: each thread sums a run of consecutive words.
  const std::int32_t per_thread = (words + kAssignThreads - 1) / kAssignThreads;
  const std::int32_t w_begin = min(words, std::int32_t(threadIdx.x) * per_thread);
  const std::int32_t w_end = min(words, w_begin + per_thread);
  std::int32_t mine = 0;
  for (std::int32_t w = w_begin; w < w_end; ++w) mine += __popc(free_bits(used, w, capacity));
  std::int32_t before = 0, total_free = 0;
  BlockScan(scan).ExclusiveSum(mine, before, total_free);
  for (std::int32_t w = w_begin; w < w_end; ++w) {
    free_before[w] = before;
    before += __popc(free_bits(used, w, capacity));
  }
  __syncthreads();  // free_before is read by every thread; the scan storage is reused below
  std::int32_t fresh = 0;
  for (std::int32_t tile = 0; tile < cur_count; tile += kAssignThreads) {
    const std::int32_t j = tile + std::int32_t(threadIdx.x);
    const bool is_new = j < cur_count && cur_slots[j] < 0;  // written by this thread above
    std::int32_t rank = 0, tile_new = 0;
    BlockScan(scan).ExclusiveSum(is_new ? 1 : 0, rank, tile_new);
    const std::int32_t k = fresh + rank;
    if (is_new && k < total_free) {
      std::int32_t lo = 0, hi = words - 1;  // the last word with free_before <= k
      while (lo < hi) {
        const std::int32_t mid = (lo + hi + 1) / 2;
        if (free_before[mid] <= k) lo = mid;
        else hi = mid - 1;
      }
      std::uint32_t bits = free_bits(used, lo, capacity);
      for (std::int32_t r = k - free_before[lo]; r > 0; --r) bits &= bits - 1;
      cur_slots[j] = lo * 32 + (__ffs(bits) - 1);
      p.fresh[row * p.current.capacity + k] = j;
    }
    fresh += tile_new;
    __syncthreads();  // the scan storage is reused by the next tile
  }
  if (threadIdx.x == 0) p.copied[row] = min(fresh, total_free);
}

/// New entry k < copied[row] of every selection row, position-major as gather_kernel.
template <class T, bool Vec16>
__global__ void __launch_bounds__(kCopyThreads) copy_fresh_kernel(KVCache<const T> src, DifferenceSlots p,
                                                                   KVCache<T> dst) {
  const std::int32_t capacity = p.current.capacity;
  const std::int64_t selection_rows = std::int64_t(p.current.batch) * p.current.kv_heads;
  copy_entries<T, Vec16, 2>(selection_rows * capacity, src.head_dim(), [&](std::int64_t e) -> EntryRows<T> {
    const std::int64_t row = e % selection_rows, b = row / p.current.kv_heads, h = row % p.current.kv_heads;
    const std::int32_t k = std::int32_t(e / selection_rows);
    if (k >= p.copied[row]) return {};  // also a row refused with -1
    const std::int32_t j = p.fresh[row * capacity + k];
    const std::int32_t token = p.current.indices[row * capacity + j], slot = p.current_slots[row * capacity + j];
    // The lengths from device memory when given: the source's own may be in host memory, a PCIe round trip per read.
    const std::int32_t length = p.source_lengths != nullptr ? p.source_lengths[b] : src.seq_len(b);
    if (token < 0 || token >= length || slot < 0 || slot >= p.resident_capacity) return {};
    return entry_rows(src, b, h, token, dst, slot);
  });
}

/// A thread per (row, entry): the row's current tokens and slots into its sequence slot's resident state.
__global__ void commit_difference_kernel(DifferenceSlots p, std::int32_t* prev_indices, std::int32_t* prev_counts,
                                         std::int32_t* prev_slots, std::int32_t* slot_counts,
                                         unsigned long long* moved_rows) {
  const std::int32_t capacity = p.current.capacity;
  const std::int64_t items = std::int64_t(p.current.batch) * p.current.kv_heads * capacity;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t item = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; item < items; item += stride) {
    const std::int64_t row = item / capacity;
    const std::int32_t i = std::int32_t(item % capacity), copied = p.copied[row];
    if (i == 0) slot_counts[row] = copied < 0 ? -1 : p.current.counts[row];
    const std::int32_t slot = p.previous_rows[row / p.current.kv_heads];
    if (slot < 0 || slot >= p.previous.batch) continue;  // a bad slot: no state to write (copied is -1)
    const std::int64_t prev_row = std::int64_t(slot) * p.current.kv_heads + row % p.current.kv_heads;
    const std::int32_t count = copied < 0 ? 0 : p.current.counts[row];  // a bad row forgets what is resident
    if (i == 0) {
      prev_counts[prev_row] = count;
      if (copied > 0) atomicAdd(moved_rows, static_cast<unsigned long long>(copied));
    }
    if (i < count) {
      prev_indices[prev_row * p.previous.capacity + i] = p.current.indices[row * capacity + i];
      prev_slots[prev_row * p.previous.capacity + i] = p.current_slots[row * capacity + i];
    }
  }
}

/// CTAs of a copy of `entries` entries: one round of pieces per thread, as a grid-stride loop allows.
unsigned copy_blocks(std::int64_t entries, std::int32_t head_dim) {
  const std::int64_t pieces = entries * 2 * head_dim;  // an upper bound of 16-byte words or elements
  return grid_stride_blocks((pieces + kCopyUnroll - 1) / kCopyUnroll, kCopyThreads);
}

/// gather_kernel over every entry of `rows` into dst (K and V rows, or K rows alone: copy_blocks' bound covers both).
template <class T, class Dst>
cudaError_t launch_gather(const KVCache<const T>& src, const SelectionView& rows, const Dst& dst, bool vec16,
                          cudaStream_t stream) {
  const unsigned blocks = copy_blocks(std::int64_t(rows.batch) * rows.kv_heads * rows.capacity, src.head_dim());
  const LaunchShape shape{.grid = dim3(blocks), .block = dim3(kCopyThreads), .stream = stream, .programmatic = true};
  return vec16 ? launch(gather_kernel<T, true, Dst>, shape, src, rows, dst)
               : launch(gather_kernel<T, false, Dst>, shape, src, rows, dst);
}

}  // namespace

template <class T>
cudaError_t launch_gather_kv(const KVCache<const T>& src, const SelectionView& rows, const KVCache<T>& dst, bool vec16,
                             cudaStream_t stream) {
  return launch_gather(src, rows, dst, vec16, stream);
}

template <class T>
cudaError_t launch_gather_keys(const KVCache<const T>& src, const SelectionView& rows, const SequenceView<T>& dst,
                               bool vec16, cudaStream_t stream) {
  return launch_gather(src, rows, dst, vec16, stream);
}

cudaError_t launch_assign_difference_slots(const DifferenceSlots& slots, cudaStream_t stream) {
  const std::int64_t rows = std::int64_t(slots.current.batch) * slots.current.kv_heads;
  assign_slots_kernel<<<unsigned(rows), kAssignThreads, 0, stream>>>(slots);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_copy_difference(const KVCache<const T>& src, const DifferenceSlots& slots,
                                   const KVCache<T>& resident, bool vec16, cudaStream_t stream) {
  const std::int64_t rows = std::int64_t(slots.current.batch) * slots.current.kv_heads;
  const unsigned blocks = std::min(kCopyMaxCtas, copy_blocks(rows * slots.current.capacity, src.head_dim()));
  if (vec16) {
    copy_fresh_kernel<T, true><<<blocks, kCopyThreads, 0, stream>>>(src, slots, resident);
  } else {
    copy_fresh_kernel<T, false><<<blocks, kCopyThreads, 0, stream>>>(src, slots, resident);
  }
  return cudaGetLastError();
}

cudaError_t launch_commit_difference(const DifferenceSlots& slots, std::int32_t* previous_indices,
                                     std::int32_t* previous_counts, std::int32_t* previous_slots,
                                     std::int32_t* slot_counts, unsigned long long* moved_rows, cudaStream_t stream) {
  const std::int64_t items = std::int64_t(slots.current.batch) * slots.current.kv_heads * slots.current.capacity;
  commit_difference_kernel<<<grid_stride_blocks(items, kCopyThreads), kCopyThreads, 0, stream>>>(
      slots, previous_indices, previous_counts, previous_slots, slot_counts, moved_rows);
  return cudaGetLastError();
}

#define KVSIFT_INSTANTIATE(T)                                                                                      \
  template cudaError_t launch_gather_kv<T>(const KVCache<const T>&, const SelectionView&, const KVCache<T>&, bool,   \
                                           cudaStream_t);                                                          \
  template cudaError_t launch_gather_keys<T>(const KVCache<const T>&, const SelectionView&, const SequenceView<T>&,   \
                                             bool, cudaStream_t);                                                    \
  template cudaError_t launch_copy_difference<T>(const KVCache<const T>&, const DifferenceSlots&, const KVCache<T>&, \
                                                 bool, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
