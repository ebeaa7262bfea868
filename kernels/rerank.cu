// Rerank on CUDA (cuda/rerank.hpp): candidates' exact group scores, remapping and range appends. Every dot product
// is split over lanes and reduced by a fixed shuffle tree (cuda/detail/group_dot.cuh), so results do not depend on
// scheduling; no atomics.
#include <array>
#include <cmath>
#include <cstdint>

#include "kvsift/core/inverted_lists.hpp"
#include "kvsift/core/supported_values.hpp"
#include "kvsift/cuda/detail/group_dot.cuh"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/head_rows_mma.cuh"
#include "kvsift/cuda/detail/rerank_launch.hpp"
#include "kvsift/cuda/dtype.cuh"

namespace kvsift::cuda::detail {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxGroup = kGroupDotMaxGroup;  ///< query heads per kv head kept in shared memory
constexpr int kMaxHeadDim = kGroupDotMaxHeadDim;
constexpr int kRemapThreads = 1024;
/// 16-byte vectors per lane of a key row that candidate_logits_kernel holds in registers (head_dim 64, 128, 256 of
/// 16-bit types; 32, 64, 128 of fp32); other sizes take the element-by-element path.
constexpr std::array<int, 3> kHeldKeyVectors{1, 2, 4};
/// Two CTAs of candidate_logits_kernel per SM (at most 128 registers a thread): 256 CTAs of a batch-1 row set in
/// one wave on 132 SMs.
constexpr int kLogitsCtasPerSm = 2;  ///< a block per row: 1024 threads keep ~3 dependent gathers per thread
static_assert(kCandidatesPerBlock == kThreads, "the softmax partials take one candidate per thread");

/// The block's maximum (NaN kept) or sum of x, in a fixed order; every thread gets it. `scratch`: kWarps floats,
/// free again when it returns.
template <bool Max>
__device__ float block_reduce(float x, float* scratch) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  x = Max ? warp_max_nan(x) : warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < kWarps; ++w) total = Max ? max_nan(total, scratch[w]) : total + scratch[w];
  __syncthreads();
  return total;
}

/// acc[u] += dot(q, key[u]) for every held step u: a lane's share of kSteps key rows held as kVecs 16-byte vectors
/// each (its d / 8 contiguous elements, octet_dot_part's span), against the same span of q (fp32, shared memory,
/// 16-byte aligned). Each q load serves all kSteps rows: with one load per multiply-add, shared memory (4-way bank
/// conflicts between the 8 lanes' spans) bounded the kernel at 29 µs where its keys take 4.
template <class T, int kVecs, int kSteps>
__device__ __forceinline__ void octet_dot_held(const float* q, const uint4 (&key)[kSteps][kVecs],
                                               float (&acc)[kSteps]) {
  constexpr int kPerLoad = int(16 / sizeof(T));
  static_assert(kPerLoad % 4 == 0, "q read as float4");
#pragma unroll
  for (int m = 0; m < kVecs; ++m) {
#pragma unroll
    for (int e4 = 0; e4 < kPerLoad; e4 += 4) {
      const float4 x = *reinterpret_cast<const float4*>(q + m * kPerLoad + e4);
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const T* v = reinterpret_cast<const T*>(&key[u][m]) + e4;
        acc[u] = fmaf(x.x, to_float_device(v[0]), acc[u]);
        acc[u] = fmaf(x.y, to_float_device(v[1]), acc[u]);
        acc[u] = fmaf(x.z, to_float_device(v[2]), acc[u]);
        acc[u] = fmaf(x.w, to_float_device(v[3]), acc[u]);
      }
    }
  }
}

/// Whether candidate_logits_kernel takes T's products on tensor cores: 16-bit keys of kVecs * 64 channels.
template <class T, int kVecs>
inline constexpr bool kLogitsOnTensorCores = sizeof(T) == 2 && kVecs > 0;

/// Block (row (b, g), chunk)'s place in candidate_logits: the row's ids and logits [group, capacity], the chunk's
/// first candidate. The row's count is each path's to read: the tensor-core path loads its ids beside it.
struct LogitsChunk {
  std::int64_t row;
  std::int32_t b, g, group, cap, begin;
  const std::int32_t* ids;
  float* logits;

  template <class T, class KV>
  __device__ static LogitsChunk of(const QueryView<const T>& q, const KV& kv, const SelectionView& candidates,
                                   float* logits) {
    LogitsChunk c;
    c.row = blockIdx.x;
    c.b = std::int32_t(c.row / kv.kv_heads);
    c.g = std::int32_t(c.row % kv.kv_heads);
    c.group = q.heads / kv.kv_heads;
    c.cap = candidates.capacity;
    c.begin = std::int32_t(blockIdx.y) * kCandidatesPerBlock;
    c.ids = candidates.indices + c.row * c.cap;
    c.logits = logits + c.row * std::int64_t(c.group) * c.cap;
    return c;
  }
};

/// A block's whole chunk on tensor cores (kLogitsOnTensorCores; cuda/detail/head_rows_mma.cuh): its logits and,
/// with `partials` (softmax), each head's maximum over the chunk and sum of exp(logit - maximum). A warp's batch is
/// kTiles n-tiles of 8 candidates (kMaxGroup is 16, so one m-tile holds the group); a warp takes kRounds batches
/// (one up to 128 channels). The CUDA-core path spent ~45 instructions per candidate, head and 16 channels, and
/// issued, not loaded, at 0.39 instructions per cycle (27.6 us for 20.6 MB of keys at 128K, batch 1, H200). Every
/// batch's ids within the row's capacity are loaded beside the row's count, so the two latencies overlap; q is
/// staged only once the chunk is known to hold candidates (the grid covers the capacity; a chunk past the count
/// returns after one round of loads). The softmax partials come from the logits in registers: the chunk's maximum
/// of each head over the warps (shuffles, one barrier), then the sums of exp(logit - maximum) likewise; every sum
/// in a fixed order.
template <class T, int kVecs, class KV>
__device__ __forceinline__ void tensor_core_chunk(const QueryView<const T>& q, const KV& kv,
                                                  const SelectionView& candidates, float scale, float* logits,
                                                  float* partials) {
  constexpr int kPairs = 2 * kVecs;                          ///< 32-channel spans of a key row
  constexpr int kTiles = 16 / kPairs < 4 ? 16 / kPairs : 4;  ///< 16 key vectors in flight
  constexpr int kBatch = 8 * kTiles;
  constexpr int kRounds = kCandidatesPerBlock / (kWarps * kBatch);
  static_assert(kRounds * kWarps * kBatch == kCandidatesPerBlock, "a chunk is whole rounds of batches");
  __shared__ __align__(16) std::uint16_t q_bits[16 * head_rows_stride(32 * kPairs)];
  __shared__ float warp_partial[kWarps][kMaxGroup];  // each warp's maximum, then its sum, of each head
  const LogitsChunk chunk = LogitsChunk::of(q, kv, candidates, logits);
  const std::int64_t row = chunk.row;
  const std::int32_t b = chunk.b, g = chunk.g, group = chunk.group, cap = chunk.cap, begin = chunk.begin;
  const std::int32_t d = 32 * kPairs;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, n = lane / 4, t = lane % 4;
  const std::int32_t* ids = chunk.ids;
  const std::int32_t count = candidates.counts[row];
  std::int32_t loaded_id[kRounds];  // lane < kBatch: candidate i0(round) + lane, read within the capacity
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const std::int32_t i = begin + (round * kWarps + warp) * kBatch + lane;
    loaded_id[round] = lane < kBatch && i < cap ? ids[i] : -1;
  }
  if (count < 0 || count > cap) return;  // the same for the whole block
  const std::int32_t end = min(begin + kCandidatesPerBlock, count);
  if (begin >= end) return;  // the same for the whole block
  stage_head_rows<kThreads>(q, b, g * group, group, d, q_bits);
  __syncthreads();  // q
  const std::int32_t length = kv.seq_len(b);
  float* s = chunk.logits;
  // x[round][nt][2 r + e]: head n + 8 r, candidate i0(round) + 8 nt + 2 t + e; NaN for one outside [0, length).
  float x[kRounds][kTiles][4];
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const std::int32_t i0 = begin + (round * kWarps + warp) * kBatch;
    const std::int32_t my_id = i0 + lane < end ? loaded_id[round] : -1;
    const unsigned inside = __ballot_sync(0xffffffffu, my_id >= 0 && my_id < length);  // bit c: candidate i0 + c
    uint4 key[kTiles][kPairs];
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      const std::int32_t id = __shfl_sync(0xffffffffu, my_id, nt * 8 + n);
      load_row_pieces((inside >> (nt * 8 + n)) & 1u ? kv.k_row(b, g, id) : nullptr, t, key[nt]);
    }
    float acc[kTiles][4] = {};
    mma_head_rows<T>(q_bits, n, t, key, acc);
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const std::int32_t head = n + 8 * r;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + 2 * t + e;
          x[round][nt][2 * r + e] = (inside >> c) & 1u ? scale * acc[nt][2 * r + e] : __int_as_float(0x7fffffff);
          if (head < group && i0 + c < end) s[std::int64_t(head) * cap + i0 + c] = x[round][nt][2 * r + e];
        }
      }
    }
  }
  if (partials == nullptr) return;  // the same for the whole block
  // Each head's maximum over the chunk (NaN kept), then its sum of exp(logit - maximum): a lane's values, the four
  // lanes of its heads (xor 1, 2), the warps in order.
  float top[2];
  const auto reduce_chunk = [&](const float (&lane_value)[2], bool maximum, float (&chunk)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float v = lane_value[r];
#pragma unroll
      for (int offset = 1; offset < 4; offset *= 2) {
        const float other = __shfl_xor_sync(0xffffffffu, v, offset);
        v = maximum ? max_nan(v, other) : v + other;
      }
      if (t == 0 && n + 8 * r < group) warp_partial[warp][n + 8 * r] = v;
    }
    __syncthreads();  // every warp's value
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const std::int32_t head = min(n + 8 * r, group - 1);  // heads past the group are not used
      float v = warp_partial[0][head];
      for (int w = 1; w < kWarps; ++w) v = maximum ? max_nan(v, warp_partial[w][head]) : v + warp_partial[w][head];
      chunk[r] = v;
    }
    __syncthreads();  // every read of warp_partial is done before it is written again
  };
  // f(r, value) for each of the lane's logits of the chunk, r: its head n + 8 r.
  const auto for_each_logit = [&](auto f) {
#pragma unroll
    for (int round = 0; round < kRounds; ++round) {
      const std::int32_t i0 = begin + (round * kWarps + warp) * kBatch;
#pragma unroll
      for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          if (i0 + nt * 8 + 2 * t + v % 2 < end) f(v / 2, x[round][nt][v]);
        }
      }
    }
  };
  float lane_top[2] = {-INFINITY, -INFINITY}, lane_sum[2] = {0.0f, 0.0f}, sum[2];
  for_each_logit([&](int r, float value) { lane_top[r] = max_nan(lane_top[r], value); });
  reduce_chunk(lane_top, true, top);
  for_each_logit([&](int r, float value) { lane_sum[r] += expf(value - top[r]); });
  reduce_chunk(lane_sum, false, sum);
  float* out = partials + (row * gridDim.y + blockIdx.y) * std::int64_t(group) * 2;
  if (warp == 0 && t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (n + 8 * r >= group) continue;
      out[(n + 8 * r) * 2] = top[r];
      out[(n + 8 * r) * 2 + 1] = sum[r];
    }
  }
}

/// A chunk's logits on CUDA cores (fp32 keys, or a head_dim of no held shape): each group of 8 lanes computes one
/// candidate's scaled logits for the group's heads (the dot split over the 8 lanes, then a 3-step shuffle tree), 4
/// candidates per warp at once. With kVecs > 0 (head_dim * sizeof(T) = kVecs * 128 bytes) a warp first reads the
/// ids of kSteps such steps (one per lane), then issues all their key loads, then computes: two dependent memory
/// latencies per batch of candidates instead of two per 4 candidates (35.7 us for 8192 candidates per kv head at
/// 128K, batch 1, H200, when each step waited on its id and then its key). A key row that is not 16-byte aligned,
/// and kVecs = 0 (any head_dim), take octet_dot_part.
template <class T, int kVecs, class KV>
__device__ __forceinline__ void cuda_core_logits(const QueryView<const T>& q, const KV& kv, const std::int32_t* ids,
                                                 std::int32_t begin, std::int32_t end, std::int32_t b,
                                                 std::int32_t g, std::int32_t cap, float scale, float* s) {
  __shared__ __align__(16) float q_s[kMaxGroup * kMaxHeadDim];
  constexpr int kLanes = 8, kPerWarp = 32 / kLanes;
  // Steps whose keys a lane holds at once: 16 vectors (64 registers) but at most one id per lane; 12 at kVecs 4,
  // where 16 spilled under the 128-register bound.
  constexpr int kVectorsInFlight = kVecs == 4 ? 12 : 16;
  constexpr int kSteps = kVecs == 0 ? 1 : (kVectorsInFlight / kVecs < 32 / kPerWarp ? kVectorsInFlight / kVecs : 32 / kPerWarp);
  constexpr int kBatch = kPerWarp * kSteps;  ///< candidates of a warp's batch
  const std::int32_t group = q.heads / kv.kv_heads, d = q.head_dim;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int sub = lane / kLanes, sublane = lane % kLanes;
  const std::int32_t length = kv.seq_len(b);
  for (std::int32_t e = std::int32_t(threadIdx.x); e < group * d; e += kThreads) {
    q_s[e] = to_float_device(q.row(b, g * group + e / d)[e % d]);
  }
  __syncthreads();
  const int span = d / kLanes;
  // i0 depends on the warp only, so every lane of a warp takes each iteration (the shuffles need them all).
  for (std::int32_t i0 = begin + warp * kBatch; i0 < end; i0 += kWarps * kBatch) {
    const std::int32_t my_id = lane < kBatch && i0 + lane < end ? ids[i0 + lane] : -1;
    uint4 key[kSteps][kVecs > 0 ? kVecs : 1];
    std::uint32_t inside = 0, held = 0;  // bit u: step u's candidate lies in [0, length); its key is in key[u]
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const std::int32_t t = __shfl_sync(0xffffffffu, my_id, u * kPerWarp + sub);
#pragma unroll
      for (int m = 0; m < (kVecs > 0 ? kVecs : 1); ++m) key[u][m] = make_uint4(0, 0, 0, 0);
      if (t < 0 || t >= length) continue;
      inside |= 1u << u;
      if constexpr (kVecs > 0) {
        const T* k = kv.k_row(b, g, t);
        if (reinterpret_cast<std::uintptr_t>(k) % 16 != 0) continue;
        held |= 1u << u;
        const uint4* src = reinterpret_cast<const uint4*>(k + sublane * span);
#pragma unroll
        for (int m = 0; m < kVecs; ++m) key[u][m] = src[m];
      }
    }
    for (std::int32_t j = 0; j < group; ++j) {
      const float* qj = q_s + j * d;
      float acc[kSteps] = {};
      if constexpr (kVecs > 0) octet_dot_held<T, kVecs, kSteps>(qj + sublane * span, key, acc);
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        const std::int32_t i = i0 + u * kPerWarp + sub;
        const bool active = i < end, in = (inside >> u) & 1u, in_registers = (held >> u) & 1u;
        // The element-by-element path (kVecs = 0, or a row not 16-byte aligned) finds its row again.
        const std::int32_t t = __shfl_sync(0xffffffffu, my_id, u * kPerWarp + sub);
        float part = in_registers ? acc[u] : 0.0f;
        if (in && !in_registers) part = octet_dot_part(qj, kv.k_row(b, g, t), d, sublane);
        part = octet_sum(part);
        if (active && sublane == 0) s[std::int64_t(j) * cap + i] = in ? scale * part : __int_as_float(0x7fffffff);
      }
    }
  }
}

/// Block (row (b, g), chunk of kCandidatesPerBlock candidates): the chunk's scaled logits for the group's heads into
/// the row's scratch [group, capacity], on tensor cores or CUDA cores (above). NaN for a candidate outside [0,
/// seq_len) (its key is not read). A row with a bad count is written NaN by candidate_finish_kernel. With
/// `partials` (softmax), each head's maximum over the chunk and sum of exp(logit - maximum), into partials [rows,
/// chunks, group, 2].
template <class T, class KV, int kVecs>
__global__ void __launch_bounds__(kThreads, kLogitsCtasPerSm)
    candidate_logits_kernel(QueryView<const T> q, KV kv, SelectionView candidates, float scale, float* logits,
                            float* partials) {
  programmatic_wait();  // the candidates (a programmatic dependent: launch.cuh); many waves, so no early signal
  if constexpr (kLogitsOnTensorCores<T, kVecs>) {
    tensor_core_chunk<T, kVecs>(q, kv, candidates, scale, logits, partials);
  } else {
    __shared__ float scratch[kWarps];
    const LogitsChunk c = LogitsChunk::of(q, kv, candidates, logits);
    const std::int32_t count = candidates.counts[c.row];
    if (count < 0 || count > c.cap) return;
    const std::int32_t begin = c.begin, end = min(begin + kCandidatesPerBlock, count), group = c.group;
    if (begin >= end) return;  // the same for the whole block
    cuda_core_logits<T, kVecs>(q, kv, c.ids, begin, end, c.b, c.g, c.cap, scale, c.logits);
    if (partials == nullptr) return;  // the same for the whole block
    __syncthreads();  // the chunk's logits, written by other lanes, are visible to the block
    const std::int32_t i = begin + std::int32_t(threadIdx.x);
    float* out = partials + (c.row * gridDim.y + blockIdx.y) * std::int64_t(group) * 2;
    for (std::int32_t j = 0; j < group; ++j) {
      const float x = i < end ? c.logits[std::int64_t(j) * c.cap + i] : -INFINITY;
      const float top = block_reduce<true>(x, scratch);
      const float sum = block_reduce<false>(i < end ? expf(x - top) : 0.0f, scratch);
      if (threadIdx.x == 0) {
        out[j * 2] = top;
        out[j * 2 + 1] = sum;
      }
    }
  }
}

/// Block (row, chunk): the reduction over the group of each candidate's logits or softmax weights. With softmax,
/// each head's LSE first, from the row's chunk partials (a warp per head, a fixed order).
__global__ void __launch_bounds__(kThreads)
    candidate_finish_kernel(SelectionView candidates, std::int32_t group, GroupScoreOptions options,
                            const float* logits, const float* partials, MatrixView<float> scores) {
  programmatic_wait();  // the logits and softmax partials
  __shared__ float top_s[kMaxGroup], sum_s[kMaxGroup];
  const std::int64_t row = blockIdx.x;
  const std::int32_t cap = candidates.capacity, count = candidates.counts[row];
  const std::int32_t begin = std::int32_t(blockIdx.y) * kCandidatesPerBlock;
  float* out = scores.row(row);
  if (count < 0 || count > cap) {
    for (std::int32_t i = begin + std::int32_t(threadIdx.x); i < min(begin + kCandidatesPerBlock, cap); i += kThreads) {
      out[i] = __int_as_float(0x7fffffff);
    }
    return;
  }
  if (begin >= count) return;  // the same for the whole block
  if (options.softmax) {
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    const std::int32_t chunks = (count + kCandidatesPerBlock - 1) / kCandidatesPerBlock;
    const float* p = partials + row * std::int64_t(gridDim.y) * group * 2;
    for (std::int32_t j = warp; j < group; j += kWarps) {
      float top = -INFINITY;
      for (std::int32_t c = lane; c < chunks; c += 32) top = max_nan(top, p[(std::int64_t(c) * group + j) * 2]);
      top = warp_max_nan(top);
      float sum = 0.0f;
      for (std::int32_t c = lane; c < chunks; c += 32) {
        const float* chunk = p + (std::int64_t(c) * group + j) * 2;
        sum += chunk[1] * expf(chunk[0] - top);
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        top_s[j] = top;
        sum_s[j] = sum;
      }
    }
    __syncthreads();
  }
  const float* s = logits + row * std::int64_t(group) * cap;
  for (std::int32_t i = begin + std::int32_t(threadIdx.x); i < min(begin + kCandidatesPerBlock, count); i += kThreads) {
    float r = 0.0f;
    for (std::int32_t j = 0; j < group; ++j) {
      float x = s[std::int64_t(j) * cap + i];
      if (options.softmax) x = expf(x - top_s[j]) / sum_s[j];
      r = j == 0 ? x : options.reduce == GroupReduce::sum ? r + x : max_nan(r, x);
    }
    out[i] = r;
  }
}

/// Block per row: out[i] = ids[positions[i]]; a bad count or position marks the row's count -1.
__global__ void __launch_bounds__(kRemapThreads)
    remap_selection_kernel(SelectionView positions, SelectionView ids, SelectionView out) {
  programmatic_start();  // the positions and ids
  const std::int64_t row = blockIdx.x;
  const std::int32_t count = positions.counts[row], available = ids.counts[row];
  bool bad = count < 0 || count > positions.capacity || available < 0 || available > ids.capacity;
  const std::int32_t* p = positions.indices + row * positions.capacity;
  const std::int32_t* from = ids.indices + row * ids.capacity;
  std::int32_t* to = out.indices + row * out.capacity;
  float* weights = out.log_weights != nullptr ? out.log_weights + row * out.capacity : nullptr;
  bool mine = false;
  for (std::int32_t i = threadIdx.x; !bad && i < count; i += kRemapThreads) {
    const std::int32_t position = p[i];  // read before to[i], the same entry when out is positions
    if (position < 0 || position >= available) {
      mine = true;
      continue;
    }
    to[i] = from[position];
    if (weights != nullptr) weights[i] = 0.0f;
  }
  bad = __syncthreads_or(mine || bad) != 0;
  if (threadIdx.x == 0) out.counts[row] = bad ? -1 : count;
}

/// Block per row: the entries below the range stay (ascending: their number is the count of them), the range
/// follows. A bad count or length, or a row that would overflow, gets count -1. counts_before (optional): the count
/// as it came in.
__global__ void __launch_bounds__(kThreads)
    append_range_kernel(SelectionView rows, const std::int32_t* slots, const std::int32_t* first,
                        const std::int32_t* lengths, AttentionWindow window, std::int32_t* counts_before) {
  programmatic_start();  // the rows' counts and ids
  const std::int64_t row = blockIdx.x, b = row / rows.kv_heads;
  const std::int32_t count = rows.counts[row], length = lengths[b];
  std::int32_t* ids = rows.indices + row * rows.capacity;
  if (counts_before != nullptr && threadIdx.x == 0) counts_before[row] = count;
  if (count < 0 || count > rows.capacity || length < 0) {  // the same for the whole block
    if (threadIdx.x == 0) rows.counts[row] = -1;
    return;
  }
  const kvsift::detail::TokenRange range = kvsift::detail::unindexed_range(first[slots[b]], length, window);
  // The row is ascending: the entries below the range are a prefix, found by binary search (every thread alike).
  std::int32_t below = 0, above = count;
  while (below < above) {
    const std::int32_t mid = below + (above - below) / 2;
    if (ids[mid] < range.begin) {
      below = mid + 1;
    } else {
      above = mid;
    }
  }
  const std::int64_t added = max(std::int64_t(0), std::int64_t(range.end) - range.begin);
  if (below + added > rows.capacity) {
    if (threadIdx.x == 0) rows.counts[row] = -1;
    return;
  }
  float* weights = rows.log_weights != nullptr ? rows.log_weights + row * rows.capacity : nullptr;
  for (std::int64_t i = threadIdx.x; i < added; i += kThreads) {
    ids[below + i] = std::int32_t(range.begin + i);
    if (weights != nullptr) weights[below + i] = 0.0f;
  }
  if (threadIdx.x == 0) rows.counts[row] = std::int32_t(below + added);
}

}  // namespace

cudaError_t launch_append_range(const SelectionView& rows, const std::int32_t* slots, const std::int32_t* first,
                                const std::int32_t* lengths, AttentionWindow window, std::int32_t* counts_before,
                                cudaStream_t stream) {
  const std::int64_t count = std::int64_t(rows.batch) * rows.kv_heads;
  if (count == 0) return cudaSuccess;
  return launch(append_range_kernel, {.grid = dim3(unsigned(count)), .block = dim3(kThreads), .stream = stream,
                                      .programmatic = true},
                rows, slots, first, lengths, window, counts_before);
}

template <class T, class KV>
cudaError_t launch_candidate_scores(const QueryView<const T>& q, const KV& kv, const SelectionView& candidates,
                                    const GroupScoreOptions& options, const MatrixView<float>& scores, float* logits,
                                    float* stats, cudaStream_t stream) {
  const float scale = options.sm_scale != 0.0f ? options.sm_scale : 1.0f / std::sqrt(float(q.head_dim));
  const std::int32_t group = q.heads / kv.kv_heads;
  // Chunks cover the capacity (the counts live on the device); blocks past a row's count return at once.
  const dim3 grid(unsigned(scores.rows), unsigned((candidates.capacity + kCandidatesPerBlock - 1) / kCandidatesPerBlock));
  float* const partials = options.softmax ? stats : nullptr;
  // A key row of kVecs 16-byte vectors per lane (head_dim * sizeof(T) = kVecs * 128 bytes) is held in registers.
  const std::int64_t row_bytes = std::int64_t(q.head_dim) * std::int64_t(sizeof(T));
  const int vecs = row_bytes % 128 == 0 ? int(row_bytes / 128) : 0;
  const LaunchShape shape{.grid = grid, .block = dim3(kThreads), .stream = stream, .programmatic = true};
  cudaError_t logits_status = cudaSuccess;
  if (!dispatch_value<kHeldKeyVectors>(vecs, [&]<int kVecs>() {
        logits_status = launch(candidate_logits_kernel<T, KV, kVecs>, shape, q, kv, candidates, scale, logits, partials);
      })) {
    logits_status = launch(candidate_logits_kernel<T, KV, 0>, shape, q, kv, candidates, scale, logits, partials);
  }
  if (logits_status != cudaSuccess) return logits_status;
  return launch(candidate_finish_kernel, shape, candidates, group, options, logits, stats, scores);
}

cudaError_t launch_remap_selection(const SelectionView& positions, const SelectionView& ids, const SelectionView& out,
                                   cudaStream_t stream) {
  const std::int64_t rows = std::int64_t(positions.batch) * positions.kv_heads;
  return launch(remap_selection_kernel, {.grid = dim3(unsigned(rows)), .block = dim3(kRemapThreads), .stream = stream,
                                         .programmatic = true},
                positions, ids, out);
}

#define KVSIFT_INSTANTIATE(T)                                                                                         \
  template cudaError_t launch_candidate_scores<T, ContiguousKVView<const T>>(                                        \
      const QueryView<const T>&, const ContiguousKVView<const T>&, const SelectionView&, const GroupScoreOptions&,   \
      const MatrixView<float>&, float*, float*, cudaStream_t);                                                        \
  template cudaError_t launch_candidate_scores<T, PagedKVView<const T>>(                                             \
      const QueryView<const T>&, const PagedKVView<const T>&, const SelectionView&, const GroupScoreOptions&,        \
      const MatrixView<float>&, float*, float*, cudaStream_t);
KVSIFT_STORAGE_TYPES(KVSIFT_INSTANTIATE)
#undef KVSIFT_INSTANTIATE

}  // namespace kvsift::cuda::detail
