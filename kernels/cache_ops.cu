// Kernels of the decode step's cache operations (cuda/cache_ops.hpp): one small launch each.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kvsift/core/dtype.hpp"
#include "kvsift/cuda/detail/cache_ops_launch.hpp"
#include "kvsift/cuda/detail/launch.cuh"

namespace kvsift::cuda::detail {
namespace {

template <class T>
__global__ void sequence_lengths_kernel(KVCache<const T> cache, std::int32_t* lengths) {
  programmatic_start();  // the engine's lengths and page table for this step
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < cache.batch()) lengths[b] = cache.seq_len(b);
}

/// One CTA per (batch row, kv head); a row of length 0 has no position for the token, and a row whose length its
/// storage cannot hold (KVCache::seq_len_fits) has a bad one: both are skipped.
template <class T>
__global__ void write_step_kv_kernel(KVCache<T> cache, HeadsView<const T> k, HeadsView<const T> v) {
  const int b = blockIdx.x / cache.kv_heads(), h = blockIdx.x % cache.kv_heads();
  const std::int32_t t = cache.seq_len(b) - 1;
  if (t < 0 || !cache.seq_len_fits(b)) return;
  T* k_dst = cache.k_row(b, h, t);
  T* v_dst = cache.v_row(b, h, t);
  const T* k_src = k.row(b, h);
  const T* v_src = v.row(b, h);
  for (int c = threadIdx.x; c < k.head_dim; c += blockDim.x) {
    k_dst[c] = k_src[c];
    v_dst[c] = v_src[c];
  }
}

/// counts[0, rows) = 0 (clear_counts): a kernel, not a memset, so that the step's chain of programmatic
/// dependents goes on through it.
__global__ void clear_counts_kernel(std::int32_t* counts, std::int64_t rows) {
  programmatic_start();  // the previous kernel may still read the counts
  for (std::int64_t r = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += std::int64_t(gridDim.x) * blockDim.x) {
    counts[r] = 0;
  }
}

/// Entry i of every row is i (write_identity_indices), grid-stride over rows x capacity.
__global__ void identity_indices_kernel(std::int32_t* indices, std::int64_t rows, std::int32_t capacity) {
  const std::int64_t total = rows * capacity;
  for (std::int64_t e = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += std::int64_t(gridDim.x) * blockDim.x) {
    indices[e] = std::int32_t(e % capacity);
  }
}

/// first_nonfinite_key's scan. The key of element (b, h, t, i) is its flat position with 2^31 token slots per
/// (b, h) row, ((b * kv_heads + h) * 2^31 + t) * head_dim + i: order-preserving, so the smallest key written by any
/// thread is the first offender in (b, h, t, i) order whatever the threads' schedule; ~0 means none.
constexpr unsigned long long kNoKey = ~0ull;
constexpr int kScanThreads = 256;
constexpr int kScanUnroll = 4;  // tokens whose loads a thread has in flight at once

/// Exponent-all-ones test of every lane of a 32-bit word holding 32 / (8 * sizeof(T)) elements of T: a lane's
/// sign bit of ((w & mask) + low) & sign is set iff its exponent is all ones (NaN or inf); the add cannot carry
/// into the next lane, as an exponent field plus its lowest bit stays below the lane's sign bit.
template <class T>
struct NonFiniteLanes;
template <>
struct NonFiniteLanes<half> {
  static constexpr std::uint32_t mask = 0x7c007c00u, low = 0x04000400u, sign = 0x80008000u;
};
template <>
struct NonFiniteLanes<bfloat16> {
  static constexpr std::uint32_t mask = 0x7f807f80u, low = 0x00800080u, sign = 0x80008000u;
};
template <>
struct NonFiniteLanes<float> {
  static constexpr std::uint32_t mask = 0x7f800000u, low = 0x00800000u, sign = 0x80000000u;
};

/// kVec elements of T read as one load of kVec * sizeof(T) bytes (16, 4 or 2), as 32-bit words (a 2-byte load
/// zero-extended: its empty upper lane is finite).
template <class T, int kVec>
struct KeyVector {
  static constexpr int bytes = kVec * int(sizeof(T));
  static constexpr int words = bytes >= 4 ? bytes / 4 : 1;
  std::uint32_t w[words];

  __device__ __forceinline__ void load(const T* p) {
    if constexpr (bytes == 16) {
      const uint4 x = *reinterpret_cast<const uint4*>(p);
      w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else if constexpr (bytes == 4) {
      w[0] = *reinterpret_cast<const std::uint32_t*>(p);
    } else {
      static_assert(bytes == 2);
      w[0] = *reinterpret_cast<const std::uint16_t*>(p);
    }
  }
  /// The first element of the vector that is NaN or inf, or -1.
  __device__ __forceinline__ int first_nonfinite() const {
    using L = NonFiniteLanes<T>;
    constexpr int lanes = 4 / int(sizeof(T)), lane_bits = 32 / lanes;
    std::uint32_t flags[words], any = 0;
#pragma unroll
    for (int k = 0; k < words; ++k) {
      flags[k] = ((w[k] & L::mask) + L::low) & L::sign;
      any |= flags[k];
    }
    if (any == 0) return -1;  // the common case: one test per vector
    int first = -1;
#pragma unroll
    for (int k = words - 1; k >= 0; --k) {
      if (flags[k] != 0) first = k * lanes + (__ffs(int(flags[k])) - 1) / lane_bits;
    }
    return first;
  }
};

/// Token t's key row of (b, h), for the scan: the paged view's address with 32-bit index arithmetic, its row's
/// first page-table position (either form: PagedKVView::first_page) read once per row (`first_page`).
template <class T>
__device__ __forceinline__ const T* scan_row(const ContiguousKVView<const T>& kv, std::int32_t, std::int32_t b,
                                             std::int32_t h, std::int32_t t) {
  return kv.k_row(b, h, t);
}
template <class T>
__device__ __forceinline__ const T* scan_row(const PagedKVView<const T>& kv, std::int32_t first_page, std::int32_t,
                                             std::int32_t h, std::int32_t t) {
  const std::int64_t page = kv.page_indices[first_page + t / kv.page_size];
  return kv.k_pages + page * kv.page_stride + std::int64_t(t % kv.page_size) * kv.token_stride +
         std::int64_t(h) * kv.head_stride;
}

/// Grid (x: CTAs per row, y: rows, both grid-strided), kScanThreads threads. A CTA's threads split a token's
/// head_dim / kVec vectors (lane) and take blockDim / vectors tokens per pass (sub), kScanUnroll passes per
/// iteration, loads first. Each thread visits its elements in increasing key order and keeps the smallest key
/// of the iteration that first meets an offender: nothing it would visit later can be smaller, so it stops
/// there, and one atomicMin per offending thread leaves the global minimum.
template <class T, class View, int kVec>
__global__ void __launch_bounds__(kScanThreads)
    first_nonfinite_key_kernel(View kv, const std::int32_t* lengths, unsigned long long* key) {
  const std::int32_t vectors = kv.head_dim / kVec;
  const std::int32_t per_pass = max(1, std::int32_t(blockDim.x) / vectors);
  const std::int32_t sub = std::int32_t(threadIdx.x) / vectors, lane = std::int32_t(threadIdx.x) % vectors;
  if (sub >= per_pass) return;
  const std::int64_t rows = std::int64_t(kv.batch) * kv.kv_heads;
  const std::int32_t stride = std::int32_t(gridDim.x) * per_pass;
  unsigned long long best = kNoKey;
  for (std::int64_t row = blockIdx.y; row < rows && best == kNoKey; row += gridDim.y) {
    const std::int32_t b = std::int32_t(row / kv.kv_heads), h = std::int32_t(row % kv.kv_heads);
    const std::int32_t length = lengths[b];
    std::int32_t first_page = 0;  // either page-table form (views.hpp): page_indptr[b] or b * block_table_stride
    if constexpr (std::is_same_v<View, PagedKVView<const T>>) {
      if (length > 0) first_page = std::int32_t(kv.first_page(b));
    }
    const unsigned long long row_key = (unsigned long long)(row) << 31;
    for (std::int64_t t0 = std::int64_t(blockIdx.x) * per_pass + sub; t0 < length && best == kNoKey;
         t0 += std::int64_t(kScanUnroll) * stride) {
      for (std::int32_t c = lane; c < vectors; c += blockDim.x) {
        KeyVector<T, kVec> v[kScanUnroll];
#pragma unroll
        for (int u = 0; u < kScanUnroll; ++u) {
          const std::int64_t t = t0 + std::int64_t(u) * stride;
          if (t < length) v[u].load(scan_row(kv, first_page, b, h, std::int32_t(t)) + std::int64_t(c) * kVec);
        }
#pragma unroll
        for (int u = 0; u < kScanUnroll; ++u) {
          const std::int64_t t = t0 + std::int64_t(u) * stride;
          if (t >= length) break;
          if (const int j = v[u].first_nonfinite(); j >= 0) {
            const unsigned long long found =
                (row_key + (unsigned long long)(t)) * (unsigned long long)(kv.head_dim) + (unsigned long long)(c * kVec + j);
            best = min(best, found);
          }
        }
      }
    }
  }
  if (best != kNoKey) atomicMin(key, best);
}

/// One thread: the scan's key into {b, h, t, i}, or four -1. `out` holds the key in its first 8 bytes.
__global__ void decode_nonfinite_key_kernel(std::int32_t* out, std::int32_t kv_heads, std::int32_t head_dim) {
  const unsigned long long key = *reinterpret_cast<const unsigned long long*>(out);
  if (key == kNoKey) {
    out[0] = out[1] = out[2] = out[3] = -1;
    return;
  }
  const unsigned long long position = key / (unsigned long long)(head_dim);
  const unsigned long long row = position >> 31;
  out[0] = std::int32_t(row / (unsigned long long)(kv_heads));
  out[1] = std::int32_t(row % (unsigned long long)(kv_heads));
  out[2] = std::int32_t(position & 0x7fffffffull);
  out[3] = std::int32_t(key % (unsigned long long)(head_dim));
}

/// The widest load (16, then 4 bytes, then one element) that every key row's start and length allow: base
/// pointer, strides and head_dim all multiples of it.
template <class View>
int scan_load_bytes(const View& kv, std::int64_t element_bytes) {
  const void* base = nullptr;
  std::int64_t strides[3] = {};
  if constexpr (requires(const View& paged) { paged.k_pages; }) {
    base = kv.k_pages;
    strides[0] = kv.page_stride, strides[1] = kv.token_stride, strides[2] = kv.head_stride;
  } else {
    base = kv.k;
    strides[0] = kv.batch_stride, strides[1] = kv.head_stride, strides[2] = kv.token_stride;
  }
  for (const int bytes : {16, 4}) {
    bool fits = reinterpret_cast<std::uintptr_t>(base) % std::uintptr_t(bytes) == 0 &&
                std::int64_t(kv.head_dim) * element_bytes % bytes == 0;
    for (const std::int64_t s : strides) fits = fits && s * element_bytes % bytes == 0;
    if (fits) return bytes;
  }
  return int(element_bytes);
}

/// The scan over a grid of about 8 CTAs of kScanThreads per SM (a full SM's threads), split over the rows.
template <class T, class View>
void launch_scan(const View& kv, const std::int32_t* lengths, unsigned long long* key, int multiprocessors,
                 cudaStream_t stream) {
  const std::int64_t rows = std::int64_t(kv.batch) * kv.kv_heads;
  const std::int64_t y = std::min<std::int64_t>(rows, 65535);
  const std::int64_t wanted = std::int64_t(std::max(multiprocessors, 1)) * (2048 / kScanThreads);
  const dim3 grid(unsigned(std::max<std::int64_t>(1, (wanted + y - 1) / y)), unsigned(y));
  constexpr int kWide = 16 / int(sizeof(T)), kWord = sizeof(T) < 4 ? 4 / int(sizeof(T)) : 1;
  const int bytes = scan_load_bytes(kv, sizeof(T));
  if (bytes == 16) {
    first_nonfinite_key_kernel<T, View, kWide><<<grid, kScanThreads, 0, stream>>>(kv, lengths, key);
  } else if (bytes == 4) {
    first_nonfinite_key_kernel<T, View, kWord><<<grid, kScanThreads, 0, stream>>>(kv, lengths, key);
  } else {
    first_nonfinite_key_kernel<T, View, 1><<<grid, kScanThreads, 0, stream>>>(kv, lengths, key);
  }
}

}  // namespace

template <class T>
cudaError_t launch_sequence_lengths(const KVCache<const T>& cache, std::int32_t* lengths, cudaStream_t stream) {
  return launch(sequence_lengths_kernel<T>,
                {.grid = dim3(unsigned((cache.batch() + 127) / 128)), .block = dim3(128), .stream = stream,
                 .programmatic = true},
                cache, lengths);
}

cudaError_t launch_clear_counts(std::int32_t* counts, std::int64_t rows, cudaStream_t stream) {
  constexpr int threads = 256;
  const std::int64_t blocks = std::min<std::int64_t>((rows + threads - 1) / threads, 1024);
  if (blocks == 0) return cudaSuccess;
  return launch(clear_counts_kernel, {.grid = dim3(unsigned(blocks)), .block = dim3(threads), .stream = stream,
                                      .programmatic = true},
                counts, rows);
}

cudaError_t launch_identity_indices(std::int32_t* indices, std::int64_t rows, std::int32_t capacity,
                                   cudaStream_t stream) {
  constexpr int threads = 256;
  const std::int64_t blocks = std::min<std::int64_t>((rows * capacity + threads - 1) / threads, 1024);
  if (blocks > 0) identity_indices_kernel<<<unsigned(blocks), threads, 0, stream>>>(indices, rows, capacity);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_write_step_kv(const KVCache<T>& cache, const HeadsView<const T>& k, const HeadsView<const T>& v,
                                 cudaStream_t stream) {
  write_step_kv_kernel<T><<<cache.batch() * cache.kv_heads(), 64, 0, stream>>>(cache, k, v);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_first_nonfinite_key(const KVCache<const T>& cache, const std::int32_t* lengths, std::int32_t* out,
                                       int multiprocessors, cudaStream_t stream) {
  auto* key = reinterpret_cast<unsigned long long*>(out);
  if (const cudaError_t status = cudaMemsetAsync(key, 0xff, sizeof(*key), stream); status != cudaSuccess) return status;
  if (std::int64_t(cache.batch()) * cache.kv_heads() > 0 && cache.head_dim() > 0) {
    cache.visit([&](const auto& kv) { launch_scan<T>(kv, lengths, key, multiprocessors, stream); });
    if (const cudaError_t status = cudaGetLastError(); status != cudaSuccess) return status;
  }
  decode_nonfinite_key_kernel<<<1, 1, 0, stream>>>(out, std::max(cache.kv_heads(), 1), std::max(cache.head_dim(), 1));
  return cudaGetLastError();
}

#define KVSIFT_INSTANTIATE_CACHE_OPS(T)                                                                          \
  template cudaError_t launch_sequence_lengths<T>(const KVCache<const T>&, std::int32_t*, cudaStream_t);         \
  template cudaError_t launch_write_step_kv<T>(const KVCache<T>&, const HeadsView<const T>&,                     \
                                               const HeadsView<const T>&, cudaStream_t);               \
  template cudaError_t launch_first_nonfinite_key<T>(const KVCache<const T>&, const std::int32_t*, std::int32_t*, \
                                                     int, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE_CACHE_OPS)
#undef KVSIFT_INSTANTIATE_CACHE_OPS

}  // namespace kvsift::cuda::detail
