// CUDA KV gathers (cuda/gather.hpp): a warp per copied row (K and V), and for the difference gather a CTA per
// selection row that assigns slots first (launched apart from the copies: selectors/specontext/elastic_kv.hpp copies one
// assignment into several layers, and commits it as its per-slot resident state). The source may be pinned host
// memory read through its device-accessible pointers: the copy loops issue independent 16-byte loads across the
// warp so that many PCIe reads are in flight.
#include <cub/block/block_scan.cuh>

#include "kvsift/core/dtype.hpp"
#include "kvsift/cuda/detail/gather_launch.hpp"
#include "kvsift/cuda/detail/primitives_kernels.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kAssignThreads = 256;
constexpr int kResidentWords = kDifferenceMaxSlots / 32;

template <class T, bool Vec16>
__device__ __forceinline__ void copy_row(const T* src, T* dst, std::int32_t head_dim, int lane) {
  if constexpr (Vec16) {
    const std::int32_t words = std::int32_t(head_dim * sizeof(T) / 16);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (std::int32_t i = lane; i < words; i += 32) d[i] = s[i];
  } else {
    for (std::int32_t i = lane; i < head_dim; i += 32) dst[i] = src[i];
  }
}

template <class T, bool Vec16>
__device__ __forceinline__ void copy_kv(const KVCache<const T>& src, std::int64_t b, std::int64_t h, std::int64_t token,
                                        const KVCache<T>& dst, std::int64_t slot, int lane) {
  copy_row<T, Vec16>(src.k_row(b, h, token), dst.k_row(b, h, slot), src.head_dim(), lane);
  copy_row<T, Vec16>(src.v_row(b, h, token), dst.v_row(b, h, slot), src.head_dim(), lane);
}

/// A warp per (row, entry i): entry i of selection row (b, h) to slot i.
template <class T, bool Vec16>
__global__ void __launch_bounds__(kCopyThreads) gather_kv_kernel(KVCache<const T> src, SelectionView rows,
                                                                  KVCache<T> dst) {
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = std::int64_t(gridDim.x) * (blockDim.x / 32);
  const std::int64_t items = std::int64_t(rows.batch) * rows.kv_heads * rows.capacity;
  for (std::int64_t item = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / 32; item < items; item += warps) {
    const std::int64_t row = item / rows.capacity, b = row / rows.kv_heads, h = row % rows.kv_heads;
    const std::int32_t i = std::int32_t(item % rows.capacity), count = rows.counts[row];
    if (count < 0 || count > rows.capacity || i >= count) continue;
    const std::int32_t token = rows.indices[row * rows.capacity + i];
    if (token < 0 || token >= src.seq_len(b) || i >= dst.seq_len(b)) continue;
    copy_kv<T, Vec16>(src, b, h, token, dst, i, lane);
  }
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

/// A warp per (row, new entry k < copied[row]).
template <class T, bool Vec16>
__global__ void __launch_bounds__(kCopyThreads) copy_fresh_kernel(KVCache<const T> src, DifferenceSlots p,
                                                                   KVCache<T> dst) {
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = std::int64_t(gridDim.x) * (blockDim.x / 32);
  const std::int32_t capacity = p.current.capacity;
  const std::int64_t items = std::int64_t(p.current.batch) * p.current.kv_heads * capacity;
  for (std::int64_t item = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / 32; item < items; item += warps) {
    const std::int64_t row = item / capacity, b = row / p.current.kv_heads, h = row % p.current.kv_heads;
    const std::int32_t k = std::int32_t(item % capacity);
    if (k >= p.copied[row]) continue;  // also a row refused with -1
    const std::int32_t j = p.fresh[row * capacity + k];
    const std::int32_t token = p.current.indices[row * capacity + j], slot = p.current_slots[row * capacity + j];
    if (token < 0 || token >= src.seq_len(b) || slot < 0 || slot >= p.resident_capacity) continue;
    copy_kv<T, Vec16>(src, b, h, token, dst, slot, lane);
  }
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

}  // namespace

template <class T>
cudaError_t launch_gather_kv(const KVCache<const T>& src, const SelectionView& rows, const KVCache<T>& dst, bool vec16,
                             cudaStream_t stream) {
  const std::int64_t threads = std::int64_t(rows.batch) * rows.kv_heads * rows.capacity * 32;
  const unsigned blocks = grid_stride_blocks(threads, kCopyThreads);
  if (vec16) {
    gather_kv_kernel<T, true><<<blocks, kCopyThreads, 0, stream>>>(src, rows, dst);
  } else {
    gather_kv_kernel<T, false><<<blocks, kCopyThreads, 0, stream>>>(src, rows, dst);
  }
  return cudaGetLastError();
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
  const unsigned blocks = grid_stride_blocks(rows * slots.current.capacity * 32, kCopyThreads);
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
  template cudaError_t launch_copy_difference<T>(const KVCache<const T>&, const DifferenceSlots&, const KVCache<T>&, \
                                                 bool, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
