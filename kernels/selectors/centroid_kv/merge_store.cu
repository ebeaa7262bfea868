// The merge store's kernels (selectors/centroid_kv/cuda/merge_store.hpp). A round: the matching (a CTA per (row, chunk): the chunk's
// keys through shared memory in tiles of dimensions, A x B dot products on tensor cores for 16-bit keys or SIMT
// fp32 for float keys, the argmax per A entry), then cuda::topk_rows ranks the links, then the merges and the
// compaction, each a CTA per (row, chunk) that finds its chunk's chosen links by binary search in the row's sorted
// list (the list's position of a chunk's first link is the number of entries merged away before the chunk).
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kvsift/core/dtype.hpp"
#include "kvsift/selectors/centroid_kv/cuda/detail/merge_store_launch.hpp"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/primitives_kernels.cuh"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

using kvsift::detail::MergeChunks;
using kvsift::detail::merge_round_links;

constexpr int kThreads = 256;                        // round kernels: a thread per entry of a full chunk
constexpr int kSetSize = kMergeMaxDeviceChunk / 2;   // A (and B) entries of a chunk, at most
constexpr int kWarps = kThreads / 32;
constexpr int kCopyThreads = 256;
static_assert(kMergeMaxDeviceChunk == kThreads && kSetSize == 16 * kWarps);

// ---- the row a round's CTA works on ------------------------------------------------------------------------

struct RoundRow {
  std::int64_t row = 0;    // store row
  std::int32_t count = -1; // at the round's start
  std::int32_t merges = 0;
};

/// The store row of call row r and what the round does there, decided alike by every CTA of the matching.
template <class T>
__device__ RoundRow round_row(const MergeRoundLaunch<T>& p, std::int32_t r) {
  const std::int32_t b = r / p.store.kv_heads, h = r % p.store.kv_heads, slot = p.slots[b];
  RoundRow out;
  if (slot < 0 || slot >= p.store.slots) return out;
  out.row = p.store.row(slot, h);
  const std::int32_t count = p.store.count[out.row];
  if (count < 0 || count > p.store.capacity) return out;
  out.count = count;
  out.merges = merge_round_links(count, p.budgets[slot], p.params);
  return out;
}

/// The first index of sorted[0, n) not below x.
__device__ __forceinline__ std::int32_t lower_bound(const std::int32_t* sorted, std::int32_t n, std::int32_t x) {
  std::int32_t lo = 0, hi = n;
  while (lo < hi) {
    const std::int32_t mid = (lo + hi) / 2;
    if (sorted[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// ---- matching ----------------------------------------------------------------------------------------------

/// 16-bit keys go through mma.sync m16n8k16 (fp32 accumulation); float keys through SIMT fp32 (tf32 would round
/// the keys).
template <class T>
inline constexpr bool kTensorCores = !std::is_same_v<T, float>;

template <class T>
struct MatchTiles {
  using Elem = std::conditional_t<kTensorCores<T>, T, float>;
  static constexpr int kDims = kTensorCores<T> ? 64 : 32;
  // Padding: the mma fragment loads (rows g = 0..7, words t = 0..3) and the SIMT column walks hit 32 banks.
  static constexpr int kStride = kTensorCores<T> ? kDims + 8 : kDims + 1;
  alignas(16) Elem a[kSetSize][kStride];
  alignas(16) Elem b[kSetSize][kStride];
};

__device__ __forceinline__ void mma_16816(float* c, const std::uint32_t* a, const std::uint32_t* b, half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_16816(float* c, const std::uint32_t* a, const std::uint32_t* b, bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <class E>
__device__ __forceinline__ std::uint32_t word(const E* x) {
  return *reinterpret_cast<const std::uint32_t*>(x);
}

/// The better of two (similarity, B index) candidates: higher similarity, on a tie the earlier B entry.
__device__ __forceinline__ void keep_better(float& sim, std::int32_t& idx, float other_sim, std::int32_t other_idx) {
  if (other_sim > sim || (other_sim == sim && other_idx < idx)) sim = other_sim, idx = other_idx;
}

/// Writes link a_index of chunk j of call row r.
template <class T>
__device__ __forceinline__ void put_link(const MergeRoundLaunch<T>& p, std::int32_t r, std::int32_t j,
                                         std::int32_t a_index, float sim, std::int32_t b_index) {
  const std::int64_t at = std::int64_t(r) * p.max_links + std::int64_t(j) * (p.params.chunk / 2) + a_index;
  p.similarity[at] = sim;
  p.target[at] = std::uint8_t(b_index);
}

/// Links of chunk j of call row r (the matching kernel's work per chunk; every thread of the CTA calls it).
template <class T>
__device__ void match_chunk(const MergeRoundLaunch<T>& p, std::int32_t r, const RoundRow& rr, const MergeChunks& chunks,
                            std::int32_t j, MatchTiles<T>& tiles, std::int32_t* slot_of, float* inverse_norm) {
  using Tiles = MatchTiles<T>;
  const std::int32_t tid = threadIdx.x;
  const std::int32_t first = chunks.chunk_begin(j), size = chunks.chunk_size(j);
  const std::int32_t n_b = (size + 1) / 2, n_a = size / 2, dim = p.store.head_dim;
  if (n_a == 0) return;
  __syncthreads();  // the CTA's previous chunk is done with slot_of and inverse_norm
  slot_of[tid] = tid < size ? p.store.row_order(rr.row)[first + tid] : -1;

  const int lane = tid % 32, warp = tid / 32, g = lane / 4, t4 = lane % 4;
  // 16-bit keys whose rows are whole 16-byte words (the tile rows are: kStride * 2 bytes = 144).
  const bool vec16 = kTensorCores<T> && dim % 8 == 0 && reinterpret_cast<std::uintptr_t>(p.store.k) % 16 == 0;
  float norm2 = 0.0f;  // of entry tid
  // Tensor cores: warp w owns A rows 16w .. 16w + 15 against every B entry (16 tiles of 8); SIMT: thread tid owns
  // A row tid / 2 against the B entries of parity tid % 2.
  constexpr int kAcc = kTensorCores<T> ? 16 * 4 : kSetSize / 2;
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;

  for (std::int32_t d0 = 0; d0 < dim; d0 += Tiles::kDims) {
    __syncthreads();  // slot_of written; the previous tile consumed
    if (vec16) {
      // 16-byte loads: 8 keys' elements a thread, consecutive threads along a key.
      constexpr int kVecs = Tiles::kDims / 8;
      for (std::int32_t i = tid; i < kMergeMaxDeviceChunk * kVecs; i += kThreads) {
        const std::int32_t e = i / kVecs, c = i % kVecs * 8, d = d0 + c;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (e < size && d < dim) x = *reinterpret_cast<const uint4*>(p.store.k_slot(rr.row, slot_of[e]) + d);
        *reinterpret_cast<uint4*>(&(e % 2 == 1 ? tiles.a : tiles.b)[e / 2][c]) = x;
      }
    } else {
      for (std::int32_t i = tid; i < kMergeMaxDeviceChunk * Tiles::kDims; i += kThreads) {
        const std::int32_t e = i / Tiles::kDims, c = i % Tiles::kDims, d = d0 + c;
        const T x = e < size && d < dim ? p.store.k_slot(rr.row, slot_of[e])[d] : T{};  // T{}: +0
        auto& set = e % 2 == 1 ? tiles.a : tiles.b;
        if constexpr (kTensorCores<T>) {
          set[e / 2][c] = x;
        } else {
          set[e / 2][c] = to_float_device(x);
        }
      }
    }
    __syncthreads();
    {
      // Rotated walk: the threads of a warp start at different columns (fewer bank conflicts).
      const auto& mine = tid % 2 == 1 ? tiles.a[tid / 2] : tiles.b[tid / 2];
      for (int c = 0; c < Tiles::kDims; ++c) {
        const float x = to_float_device(mine[(c + tid / 2) % Tiles::kDims]);
        norm2 += x * x;
      }
    }
    if constexpr (kTensorCores<T>) {
      if (16 * warp < n_a) {
#pragma unroll
        for (int kk = 0; kk < Tiles::kDims; kk += 16) {
          const int a_row = 16 * warp + g, col = kk + 2 * t4;
          const std::uint32_t a[4] = {word(&tiles.a[a_row][col]), word(&tiles.a[a_row + 8][col]),
                                      word(&tiles.a[a_row][col + 8]), word(&tiles.a[a_row + 8][col + 8])};
#pragma unroll
          for (int nt = 0; nt < 16; ++nt) {
            if (8 * nt < n_b) {
              const std::uint32_t b[2] = {word(&tiles.b[8 * nt + g][col]), word(&tiles.b[8 * nt + g][col + 8])};
              mma_16816(&acc[4 * nt], a, b, T{});
            }
          }
        }
      }
    } else {
      const int a_row = tid / 2, parity = tid % 2;
      for (int c = 0; c < Tiles::kDims; ++c) {
        const float x = tiles.a[a_row][c];
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[i] = fmaf(x, tiles.b[2 * i + parity][c], acc[i]);
      }
    }
  }
  inverse_norm[tid] = norm2 > 0.0f ? 1.0f / sqrtf(norm2) : 0.0f;
  __syncthreads();

  // Argmax per A entry; a lane walks its B entries in ascending order, strict > keeps the earlier on a tie.
  if constexpr (kTensorCores<T>) {
#pragma unroll
    for (int half_row = 0; half_row < 2; ++half_row) {
      const int a = 16 * warp + g + 8 * half_row;
      const float inv_a = a < n_a ? inverse_norm[2 * a + 1] : 0.0f;
      float best = -__int_as_float(0x7f800000);
      std::int32_t best_b = 0;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int bi = 8 * nt + 2 * t4 + e;
          if (bi < n_b) {
            const float sim = acc[4 * nt + 2 * half_row + e] * inv_a * inverse_norm[2 * bi];
            if (sim > best) best = sim, best_b = bi;
          }
        }
      }
#pragma unroll
      for (int offset = 1; offset < 4; offset *= 2) {
        keep_better(best, best_b, __shfl_xor_sync(0xffffffffu, best, offset),
                    __shfl_xor_sync(0xffffffffu, best_b, offset));
      }
      if (t4 == 0 && a < n_a) put_link(p, r, j, a, best, best_b);
    }
  } else {
    const int a = tid / 2, parity = tid % 2;
    const float inv_a = a < n_a ? inverse_norm[2 * a + 1] : 0.0f;
    float best = -__int_as_float(0x7f800000);
    std::int32_t best_b = 0;
    for (int i = 0; i < kAcc; ++i) {
      const int bi = 2 * i + parity;
      if (bi < n_b) {
        const float sim = acc[i] * inv_a * inverse_norm[2 * bi];
        if (sim > best) best = sim, best_b = bi;
      }
    }
    keep_better(best, best_b, __shfl_xor_sync(0xffffffffu, best, 1), __shfl_xor_sync(0xffffffffu, best_b, 1));
    if (parity == 0 && a < n_a) put_link(p, r, j, a, best, best_b);
  }
}

/// CTAs per call row r = blockIdx.y, each over every gridDim.x-th chunk from blockIdx.x: few enough that a round
/// where no row merges costs one wave of CTAs that exit at once.
template <class T>
__global__ void __launch_bounds__(kThreads) merge_match_kernel(MergeRoundLaunch<T> p) {
  programmatic_start();  // the store (a programmatic dependent: launch.cuh; one wave)
  __shared__ MatchTiles<T> tiles;
  __shared__ std::int32_t slot_of[kMergeMaxDeviceChunk];
  __shared__ float inverse_norm[kMergeMaxDeviceChunk];
  const std::int32_t r = blockIdx.y;
  const RoundRow rr = round_row(p, r);
  const MergeChunks chunks = MergeChunks::of(rr.count, p.params);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    p.counts[r] = rr.count;
    p.merges[r] = rr.merges;
    p.lengths[r] = rr.merges > 0 ? chunks.links() : 0;
  }
  if (rr.merges == 0) return;
  for (std::int32_t j = blockIdx.x; j < chunks.chunks(); j += gridDim.x) {
    match_chunk(p, r, rr, chunks, j, tiles, slot_of, inverse_norm);
  }
}

// ---- merges and compaction -----------------------------------------------------------------------------------

/// What the apply kernels' CTA works on at (chunk j, call row r): the row, the chosen links of its chunk [lo, hi).
struct ApplyChunk {
  std::int64_t row = 0;
  std::int32_t count = 0, merged = 0;  // merged: the row's chosen links
  MergeChunks chunks;
  std::int32_t lo = 0, hi = 0;
};

template <class T>
__device__ bool apply_chunk(const MergeRoundLaunch<T>& p, std::int32_t r, std::int32_t j, ApplyChunk& out) {
  if (p.merges[r] == 0) return false;
  const std::int32_t merged = p.chosen_counts[r];
  if (merged <= 0) return false;
  out.row = p.store.row(p.slots[r / p.store.kv_heads], r % p.store.kv_heads);
  out.count = p.counts[r];
  out.merged = merged;
  out.chunks = MergeChunks::of(out.count, p.params);
  if (j > out.chunks.chunks()) return false;
  if (j < out.chunks.chunks()) {
    const std::int32_t* chosen = p.chosen + std::int64_t(r) * p.max_links;
    const std::int32_t link0 = j * (p.params.chunk / 2);
    out.lo = lower_bound(chosen, merged, link0);
    out.hi = lower_bound(chosen, merged, link0 + out.chunks.chunk_size(j) / 2);
  }
  return true;
}

/// CTAs per call row r, each over every gridDim.x-th chunk j; j = chunks copies the recent entries into the
/// workspace instead. Each B entry
/// with chosen A entries becomes their degree-weighted mean in its own slot; the chunk's order, degrees (the new
/// ones of merged B entries) and log-degrees go to the workspace copy.
template <class T>
__global__ void __launch_bounds__(kThreads) merge_apply_kernel(MergeRoundLaunch<T> p) {
  programmatic_start();  // the chosen links
  using BlockScan = cub::BlockScan<std::int32_t, kThreads>;
  __shared__ typename BlockScan::TempStorage scan;
  __shared__ std::int32_t member_of[kSetSize];  // per A entry: its B entry if chosen, else -1
  __shared__ std::int32_t members[kSetSize];    // the chosen A entries grouped by B entry, each group ascending
  __shared__ std::int32_t group_begin[kSetSize], group_size[kSetSize], total_degree[kSetSize];
  const std::int32_t r = blockIdx.y, tid = threadIdx.x;
  for (std::int32_t j = blockIdx.x;; j += gridDim.x) {
    ApplyChunk c;
    if (!apply_chunk(p, r, j, c)) return;
    const std::int64_t w = std::int64_t(r) * p.store.capacity;
    const std::int32_t* order = p.store.row_order(c.row);
    const std::int32_t* degree = p.store.row_degree(c.row);
    const float* log_degree = p.store.row_log_degree(c.row);
    if (j == c.chunks.chunks()) {
      for (std::int32_t pos = c.chunks.middle_end + tid; pos < c.count; pos += kThreads) {
        p.order[w + pos] = order[pos], p.degree[w + pos] = degree[pos], p.log_degree[w + pos] = log_degree[pos];
      }
      continue;
    }
    const std::int32_t first = c.chunks.chunk_begin(j), size = c.chunks.chunk_size(j);
    const std::int32_t n_b = (size + 1) / 2, n_a = size / 2, link0 = j * (p.params.chunk / 2);
    if (tid < kSetSize) member_of[tid] = -1;
    __syncthreads();
    for (std::int32_t q = c.lo + tid; q < c.hi; q += kThreads) {
      const std::int32_t link = p.chosen[std::int64_t(r) * p.max_links + q];
      member_of[link - link0] = p.target[std::int64_t(r) * p.max_links + link];
    }
    __syncthreads();
    std::int32_t mine = 0, total = 0;
    if (tid < n_b) {
      total = degree[first + 2 * tid];
      for (std::int32_t a = 0; a < n_a; ++a) {
        if (member_of[a] == tid) ++mine, total += degree[first + 2 * a + 1];
      }
    }
    std::int32_t begin = 0;
    BlockScan(scan).ExclusiveSum(mine, begin);
    if (tid < n_b) {
      group_begin[tid] = begin, group_size[tid] = mine, total_degree[tid] = total;
      for (std::int32_t a = 0, k = begin; a < n_a; ++a) {
        if (member_of[a] == tid) members[k++] = a;
      }
    }
    __syncthreads();
    const int lane = tid % 32, dim = p.store.head_dim;
    for (std::int32_t bi = tid / 32; bi < n_b; bi += kWarps) {
      if (group_size[bi] == 0) continue;
      const std::int32_t pb = first + 2 * bi;
      T* kb = p.store.k_slot(c.row, order[pb]);
      T* vb = p.store.v_slot(c.row, order[pb]);
      const float wb = float(degree[pb]), n = float(total_degree[bi]);
      for (std::int32_t d = lane; d < dim; d += 32) {
        // The CPU's sums: sequence order with the B entry first, separate multiply and add, one division.
        float sk = __fmul_rn(wb, to_float_device(kb[d])), sv = __fmul_rn(wb, to_float_device(vb[d]));
        for (std::int32_t k = group_begin[bi]; k < group_begin[bi] + group_size[bi]; ++k) {
          const std::int32_t pa = first + 2 * members[k] + 1;
          const float wa = float(degree[pa]);
          sk = __fadd_rn(sk, __fmul_rn(wa, to_float_device(p.store.k_slot(c.row, order[pa])[d])));
          sv = __fadd_rn(sv, __fmul_rn(wa, to_float_device(p.store.v_slot(c.row, order[pa])[d])));
        }
        kb[d] = from_float_device<T>(__fdiv_rn(sk, n));
        vb[d] = from_float_device<T>(__fdiv_rn(sv, n));
      }
    }
    if (tid < size) {
      const std::int32_t pos = first + tid;
      const bool grown = tid % 2 == 0 && group_size[tid / 2] > 0;
      p.order[w + pos] = order[pos];
      p.degree[w + pos] = grown ? total_degree[tid / 2] : degree[pos];
      p.log_degree[w + pos] = grown ? logf(float(total_degree[tid / 2])) : log_degree[pos];
    }
    __syncthreads();  // the shared arrays are the next chunk's
  }
}

/// CTAs per call row as merge_apply_kernel's, after it: the stable partition of the row's order positions
/// [sinks, count) from the workspace copy (survivors move down by the merged entries before them, the freed slots
/// follow the survivors in sequence order); j = chunks moves the recent entries. Sets count.
template <class T>
__global__ void __launch_bounds__(kThreads) merge_compact_kernel(MergeRoundLaunch<T> p) {
  programmatic_start();  // the workspace copy
  using BlockScan = cub::BlockScan<std::int32_t, kThreads>;
  __shared__ typename BlockScan::TempStorage scan;
  __shared__ std::uint8_t chosen_a[kSetSize];
  const std::int32_t r = blockIdx.y, tid = threadIdx.x;
  for (std::int32_t j = blockIdx.x;; j += gridDim.x) {
    ApplyChunk c;
    if (!apply_chunk(p, r, j, c)) return;
    const std::int64_t w = std::int64_t(r) * p.store.capacity;
    std::int32_t* order = p.store.row_order(c.row);
    std::int32_t* degree = p.store.row_degree(c.row);
    float* log_degree = p.store.row_log_degree(c.row);
    const auto move = [&](std::int32_t from, std::int32_t to) {
      order[to] = p.order[w + from], degree[to] = p.degree[w + from], log_degree[to] = p.log_degree[w + from];
    };
    if (j == 0 && tid == 0) p.store.count[c.row] = c.count - c.merged;
    if (j == c.chunks.chunks()) {
      for (std::int32_t pos = c.chunks.middle_end + tid; pos < c.count; pos += kThreads) move(pos, pos - c.merged);
      continue;
    }
    const std::int32_t first = c.chunks.chunk_begin(j), size = c.chunks.chunk_size(j);
    const std::int32_t link0 = j * (p.params.chunk / 2);
    if (tid < kSetSize) chosen_a[tid] = 0;
    __syncthreads();
    for (std::int32_t q = c.lo + tid; q < c.hi; q += kThreads) {
      chosen_a[p.chosen[std::int64_t(r) * p.max_links + q] - link0] = 1;
    }
    __syncthreads();
    const bool gone = tid < size && tid % 2 == 1 && chosen_a[tid / 2] != 0;
    std::int32_t gone_before = 0;
    BlockScan(scan).ExclusiveSum(gone ? 1 : 0, gone_before);
    if (tid < size) {
      const std::int32_t to = gone ? c.count - c.merged + c.lo + gone_before : first + tid - c.lo - gone_before;
      move(first + tid, to);
    }
    __syncthreads();  // the shared arrays are the next chunk's
  }
}

// ---- load, append, copy, selection -----------------------------------------------------------------------------

/// A K row and a V row of `dim` values by one warp. 16-byte vectors, K's and V's in one index space so that every
/// lane has work (head_dim 128 in 16 bits: 16 vectors each), where the four rows start 16-byte aligned and a row is
/// a whole number of vectors (every packed store, and a cache of head_dim a multiple of 8 16-bit values); else
/// value by value. Load and copy move whole stores with it: element-wise they ran at under half of the bandwidth.
template <class T>
__device__ __forceinline__ void copy_kv_rows(const T* src_k, const T* src_v, T* dst_k, T* dst_v, std::int32_t dim,
                                             int lane) {
  const std::size_t bytes = std::size_t(dim) * sizeof(T);
  const auto address = [](const void* x) { return reinterpret_cast<std::uintptr_t>(x); };
  if (((address(src_k) | address(src_v) | address(dst_k) | address(dst_v) | bytes) % sizeof(uint4)) == 0) {
    const auto vectors = std::int32_t(bytes / sizeof(uint4));
    for (std::int32_t i = lane; i < 2 * vectors; i += 32) {
      const bool is_k = i < vectors;
      const std::int32_t at = is_k ? i : i - vectors;
      reinterpret_cast<uint4*>(is_k ? dst_k : dst_v)[at] = reinterpret_cast<const uint4*>(is_k ? src_k : src_v)[at];
    }
    return;
  }
  for (std::int32_t d = lane; d < dim; d += 32) dst_k[d] = src_k[d], dst_v[d] = src_v[d];
}

/// A warp per (batch row b, kv head h, slot t).
template <class T>
__global__ void __launch_bounds__(kCopyThreads) merge_store_load_kernel(KVCache<const T> cache,
                                                                        const std::int32_t* slots,
                                                                        MergeStoreView<T> store) {
  programmatic_wait();  // the cache (many waves: no early signal)
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = std::int64_t(gridDim.x) * (blockDim.x / 32);
  const std::int64_t items = std::int64_t(cache.batch()) * store.kv_heads * store.capacity;
  for (std::int64_t item = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / 32; item < items; item += warps) {
    const std::int64_t bh = item / store.capacity, b = bh / store.kv_heads, h = bh % store.kv_heads;
    const std::int32_t t = std::int32_t(item % store.capacity), slot = slots[b];
    if (slot < 0 || slot >= store.slots) continue;
    const std::int64_t row = store.row(slot, h);
    const std::int32_t n = cache.seq_len(b);
    const bool fits = n >= 0 && n <= store.capacity;
    if (fits && t < n) {
      copy_kv_rows(cache.k_row(b, h, t), cache.v_row(b, h, t), store.k_slot(row, t), store.v_slot(row, t),
                   store.head_dim, lane);
    }
    if (lane == 0) {
      store.row_order(row)[t] = t;
      if (fits && t < n) store.row_degree(row)[t] = 1, store.row_log_degree(row)[t] = 0.0f;
      if (t == 0) store.count[row] = fits ? n : -1;
    }
  }
}

/// A warp per (batch row b, kv head h).
template <class T>
__global__ void __launch_bounds__(kCopyThreads) merge_store_append_kernel(KVCache<const T> cache,
                                                                          const std::int32_t* slots,
                                                                          const std::int32_t* lengths,
                                                                          MergeStoreView<T> store) {
  programmatic_start();  // the round's store
  const int lane = threadIdx.x % 32;
  const std::int64_t item = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / 32;
  if (item >= std::int64_t(cache.batch()) * store.kv_heads) return;
  const std::int64_t b = item / store.kv_heads, h = item % store.kv_heads;
  const std::int32_t slot = slots[b];
  if (slot < 0 || slot >= store.slots) return;
  const std::int64_t row = store.row(slot, h);
  const std::int32_t count = store.count[row], length = lengths[b];
  const std::int32_t at = count >= 0 && count < store.capacity ? store.row_order(row)[count] : -1;
  const bool ok = at >= 0 && at < store.capacity && length >= 1 && length <= cache.seq_len(b);
  if (ok) {
    copy_kv_rows(cache.k_row(b, h, length - 1), cache.v_row(b, h, length - 1), store.k_slot(row, at),
                 store.v_slot(row, at), store.head_dim, lane);
  }
  __syncwarp();  // every lane has read count
  if (lane == 0) {
    if (ok) store.row_degree(row)[count] = 1, store.row_log_degree(row)[count] = 0.0f;
    store.count[row] = ok ? count + 1 : -1;
  }
}

/// A warp per (batch row b, kv head h): positions sinks + 1 .. count - 1 move down by one, 32 at a time (each group
/// read before it is written, the later groups' reads after the earlier groups' writes).
template <class T>
__global__ void __launch_bounds__(kCopyThreads) merge_store_evict_kernel(MergeStoreView<T> store,
                                                                         const std::int32_t* slots, std::int32_t batch,
                                                                         const std::int32_t* budgets,
                                                                         const std::int32_t* sinks) {
  programmatic_start();  // the round's store
  const int lane = threadIdx.x % 32;
  const std::int64_t item = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / 32;
  if (item >= std::int64_t(batch) * store.kv_heads) return;
  const std::int32_t slot = slots[item / store.kv_heads];
  if (slot < 0 || slot >= store.slots) return;
  const std::int64_t row = store.row(slot, item % store.kv_heads);
  const std::int32_t count = store.count[row], first = sinks[slot];
  if (count > store.capacity || !kvsift::detail::merge_store_evicts(count, budgets[slot], first)) return;
  std::int32_t* const order = store.row_order(row);
  std::int32_t* const degree = store.row_degree(row);
  float* const log_degree = store.row_log_degree(row);
  const std::int32_t freed = order[first];
  for (std::int32_t base = first; base < count - 1; base += 32) {
    const std::int32_t p = base + lane;
    const bool moves = p < count - 1;
    const std::int32_t o = moves ? order[p + 1] : 0, d = moves ? degree[p + 1] : 0;
    const float l = moves ? log_degree[p + 1] : 0.0f;
    __syncwarp();
    if (moves) order[p] = o, degree[p] = d, log_degree[p] = l;
    __syncwarp();
  }
  __syncwarp();  // every lane has read count and freed
  if (lane == 0) order[count - 1] = freed, store.count[row] = count - 1;
}

/// A warp per (batch row b, kv head h, dst slot i).
template <class T>
__global__ void __launch_bounds__(kCopyThreads) merge_store_copy_kernel(MergeStoreView<const T> src,
                                                                        const std::int32_t* src_slots,
                                                                        MergeStoreView<T> dst,
                                                                        const std::int32_t* dst_slots,
                                                                        std::int32_t batch) {
  programmatic_wait();  // the source store (many waves: no early signal)
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = std::int64_t(gridDim.x) * (blockDim.x / 32);
  const std::int64_t items = std::int64_t(batch) * dst.kv_heads * dst.capacity;
  for (std::int64_t item = (blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x) / 32; item < items; item += warps) {
    const std::int64_t bh = item / dst.capacity, b = bh / dst.kv_heads, h = bh % dst.kv_heads;
    const std::int32_t i = std::int32_t(item % dst.capacity), from_slot = src_slots[b], to_slot = dst_slots[b];
    if (to_slot < 0 || to_slot >= dst.slots) continue;
    const std::int64_t to = dst.row(to_slot, h);
    const bool src_ok = from_slot >= 0 && from_slot < src.slots;
    const std::int64_t from = src_ok ? src.row(from_slot, h) : 0;
    const std::int32_t count = src_ok ? src.count[from] : -1;
    const bool fits = count >= 0 && count <= src.capacity && count <= dst.capacity;
    if (fits && i < count) {
      const std::int32_t slot = src.row_order(from)[i];
      if (slot >= 0 && slot < src.capacity) {
        copy_kv_rows(src.k_slot(from, slot), src.v_slot(from, slot), dst.k_slot(to, i), dst.v_slot(to, i),
                     dst.head_dim, lane);
      }
    }
    if (lane == 0) {
      dst.row_order(to)[i] = i;
      if (fits && i < count) {
        dst.row_degree(to)[i] = src.row_degree(from)[i];
        dst.row_log_degree(to)[i] = src.row_log_degree(from)[i];
      }
      if (i == 0) dst.count[to] = fits ? count : -1;
    }
  }
}

/// A thread per (selection row, position i < store.capacity).
template <class T>
__global__ void __launch_bounds__(kCopyThreads) merge_store_selection_kernel(MergeStoreView<const T> store,
                                                                             const std::int32_t* slots,
                                                                             SelectionView out) {
  programmatic_wait();  // the appended store (many waves at batch 8: no early signal)
  const std::int64_t threads = std::int64_t(gridDim.x) * blockDim.x;
  const std::int64_t items = std::int64_t(out.batch) * out.kv_heads * store.capacity;
  for (std::int64_t item = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; item < items; item += threads) {
    const std::int64_t s = item / store.capacity, b = s / out.kv_heads, h = s % out.kv_heads;
    const std::int32_t i = std::int32_t(item % store.capacity), slot = slots[b];
    const bool slot_ok = slot >= 0 && slot < store.slots;
    const std::int64_t row = slot_ok ? store.row(slot, h) : 0;
    const std::int32_t count = slot_ok ? store.count[row] : -1;
    const bool ok = count >= 0 && count <= store.capacity;
    if (i == 0) out.counts[s] = ok ? count : -1;
    if (ok && i < count) {
      out.indices[s * out.capacity + i] = store.row_order(row)[i];
      out.log_weights[s * out.capacity + i] = store.row_log_degree(row)[i];
    }
  }
}

}  // namespace

template <class T>
cudaError_t launch_merge_match(const MergeRoundLaunch<T>& p, cudaStream_t stream) {
  const dim3 grid(unsigned(std::min(p.blocks_per_row, p.max_chunks)),
                  unsigned(std::int64_t(p.batch) * p.store.kv_heads));
  return launch(merge_match_kernel<T>, {.grid = grid, .block = dim3(kThreads), .stream = stream, .programmatic = true},
                p);
}

template <class T>
cudaError_t launch_merge_apply(const MergeRoundLaunch<T>& p, cudaStream_t stream) {
  const dim3 grid(unsigned(std::min(p.blocks_per_row, p.max_chunks + 1)),
                  unsigned(std::int64_t(p.batch) * p.store.kv_heads));
  const LaunchShape shape{.grid = grid, .block = dim3(kThreads), .stream = stream, .programmatic = true};
  if (cudaError_t s = launch(merge_apply_kernel<T>, shape, p); s != cudaSuccess) return s;
  return launch(merge_compact_kernel<T>, shape, p);
}

template <class T>
cudaError_t launch_merge_store_load(const KVCache<const T>& cache, const std::int32_t* slots,
                                    const MergeStoreView<T>& store, cudaStream_t stream) {
  const std::int64_t threads = std::int64_t(cache.batch()) * store.kv_heads * store.capacity * 32;
  return launch(merge_store_load_kernel<T>,
                {.grid = dim3(grid_stride_blocks(threads, kCopyThreads)), .block = dim3(kCopyThreads), .stream = stream,
                 .programmatic = true},
                cache, slots, store);
}

template <class T>
cudaError_t launch_merge_store_append(const KVCache<const T>& cache, const std::int32_t* slots,
                                      const std::int32_t* lengths, const MergeStoreView<T>& store,
                                      cudaStream_t stream) {
  const std::int64_t threads = std::int64_t(cache.batch()) * store.kv_heads * 32;
  const unsigned blocks = unsigned((threads + kCopyThreads - 1) / kCopyThreads);
  return launch(merge_store_append_kernel<T>,
                {.grid = dim3(blocks), .block = dim3(kCopyThreads), .stream = stream, .programmatic = true}, cache, slots,
                lengths, store);
}

template <class T>
cudaError_t launch_merge_store_evict(const MergeStoreView<T>& store, const std::int32_t* slots, std::int32_t batch,
                                     const std::int32_t* budgets, const std::int32_t* sinks, cudaStream_t stream) {
  const std::int64_t threads = std::int64_t(batch) * store.kv_heads * 32;
  const unsigned blocks = unsigned((threads + kCopyThreads - 1) / kCopyThreads);
  return launch(merge_store_evict_kernel<T>,
                {.grid = dim3(blocks), .block = dim3(kCopyThreads), .stream = stream, .programmatic = true}, store, slots,
                batch, budgets, sinks);
}

template <class T>
cudaError_t launch_merge_store_copy(const MergeStoreView<const T>& src, const std::int32_t* src_slots,
                                    const MergeStoreView<T>& dst, const std::int32_t* dst_slots, std::int32_t batch,
                                    cudaStream_t stream) {
  const std::int64_t threads = std::int64_t(batch) * dst.kv_heads * dst.capacity * 32;
  return launch(merge_store_copy_kernel<T>,
                {.grid = dim3(grid_stride_blocks(threads, kCopyThreads)), .block = dim3(kCopyThreads), .stream = stream,
                 .programmatic = true},
                src, src_slots, dst, dst_slots, batch);
}

template <class T>
cudaError_t launch_merge_store_selection(const MergeStoreView<const T>& store, const std::int32_t* slots,
                                         const SelectionView& out, cudaStream_t stream) {
  const std::int64_t threads = std::int64_t(out.batch) * out.kv_heads * store.capacity;
  return launch(merge_store_selection_kernel<T>,
                {.grid = dim3(grid_stride_blocks(threads, kCopyThreads)), .block = dim3(kCopyThreads), .stream = stream,
                 .programmatic = true},
                store, slots, out);
}

#define KVSIFT_INSTANTIATE(T)                                                                                      \
  template cudaError_t launch_merge_match<T>(const MergeRoundLaunch<T>&, cudaStream_t);                            \
  template cudaError_t launch_merge_apply<T>(const MergeRoundLaunch<T>&, cudaStream_t);                            \
  template cudaError_t launch_merge_store_load<T>(const KVCache<const T>&, const std::int32_t*,                    \
                                                  const MergeStoreView<T>&, cudaStream_t);                         \
  template cudaError_t launch_merge_store_append<T>(const KVCache<const T>&, const std::int32_t*,                  \
                                                    const std::int32_t*, const MergeStoreView<T>&, cudaStream_t);  \
  template cudaError_t launch_merge_store_evict<T>(const MergeStoreView<T>&, const std::int32_t*, std::int32_t,    \
                                                   const std::int32_t*, const std::int32_t*, cudaStream_t);        \
  template cudaError_t launch_merge_store_copy<T>(const MergeStoreView<const T>&, const std::int32_t*,             \
                                                  const MergeStoreView<T>&, const std::int32_t*, std::int32_t,     \
                                                  cudaStream_t);                                                   \
  template cudaError_t launch_merge_store_selection<T>(const MergeStoreView<const T>&, const std::int32_t*,        \
                                                       const SelectionView&, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
