#pragma once
/// Gathers of KV rows on the GPU, the twin of cpu/gather.hpp (read its contracts; the differences are here).
/// Stream-ordered; no allocation, no host sync; CUDA-graph capturable; deterministic; reentrant with distinct
/// outputs. Results equal the CPU's exactly (bit copies; the same slots).
///
/// Memory. Selections, slot maps, copied counts, the destination and the workspace are device memory. The source
/// cache is read by the kernels through its pointers, so it may be device memory or pinned host memory that the
/// device can address (cudaHostAlloc / cudaMallocHost, or cudaHostRegister: on the 64-bit Linux platforms kvsift
/// builds for, unified addressing makes the host pointer itself device-accessible), its length arrays and page table
/// included. Pinned host KV is read by the copy kernel directly over PCIe (zero-copy) rather than by
/// cudaMemcpyAsync: the rows to copy are known only on the device, and a host-issued copy per row (or a
/// cudaMemcpyBatchAsync of host-side address lists, 0.3 GB/s for 256-byte rows on an H200) would need them on the host,
/// a sync that also breaks graph capture. A thread copies 16-byte pieces where the rows are 16-byte aligned (bf16 /
/// fp16 head_dim 128: 16 pieces per K or V row), eight of them loaded before it stores any, so that many reads are
/// in flight; the difference copy runs on at most 128 CTAs, since zero-copy reads slow the latency-bound kernels on
/// the SMs that issue them (kernels/gather.cu).
///
/// Shapes are checked on the host before the launch as on the CPU; device contents are not, and:
/// - gather_kv: a row whose count is outside [0, rows.capacity] copies nothing; an entry whose token is outside
///   [0, src.seq_len(b)) or whose slot i is not below dst.seq_len(b) is skipped.
/// - gather_kv_difference: a row whose previous count is outside [0, min(previous.capacity, resident.capacity)]
///   or whose current count is outside [0, current.capacity] gets copied = -1 and nothing else; a previous slot
///   outside [0, resident.capacity) makes its token count as dropped. Rows not ascending, repeated previous slots
///   or tokens outside [0, src.seq_len(b)) (the CPU refuses them) give some slot assignment without any access out
///   of bounds (a token outside the source is not copied).

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cuda/context.hpp"

namespace kvsift::cuda {

/// cpu::gather_kv. One launch, a thread per 16-byte piece of a copied row.
template <class T>
void gather_kv(const KVCache<const T>& src, const SelectionView& rows, const KVCache<T>& dst, const Context& ctx);

/// Device workspace of gather_kv_difference (shapes only): the new entries' positions, batch * kv_heads *
/// current_capacity int32. The context, for the CPU's call shape, does not change it.
std::size_t gather_kv_difference_workspace_bytes(std::int32_t batch, std::int32_t kv_heads,
                                                 std::int32_t current_capacity, std::int32_t resident_capacity,
                                                 const Context& = {});

/// cpu::gather_keys. One launch, as gather_kv's over the K rows alone.
template <class T>
void gather_keys(const KVCache<const T>& src, const SelectionView& rows, const SequenceView<T>& dst,
                 const Context& ctx);

/// cpu::gather_kv_difference. Two launches: one CTA per row finds the kept tokens (binary search in the previous
/// row), marks their slots in a shared-memory bitmap, and gives the new tokens the free slots in ascending order
/// (a block scan over the bitmap's free counts, then a select within the word); then the copy of the new entries'
/// K and V rows from src, a thread per 16-byte piece. The two launches are separate launchers
/// (cuda/detail/gather_launch.hpp), so that selectors/specontext/elastic_kv.hpp assigns slots once and copies once
/// per offloaded layer.
template <class T>
void gather_kv_difference(const KVCache<const T>& src, const SelectionView& previous,
                          const std::int32_t* d_previous_slots, const SelectionView& current,
                          std::int32_t* d_current_slots, const ContiguousKVView<T>& resident, std::int32_t* d_copied,
                          std::span<std::byte> workspace, const Context& ctx);

}  // namespace kvsift::cuda
