#pragma once
/// Launchers of the CUDA KV gathers (cuda/gather.hpp), for the host code in src/cuda/gather.cpp and
/// selectors/specontext/elastic_kv.hpp (which applies one difference to several layers); kernels in
/// kernels/gather.cu. Launchers return the launch status and never throw.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda::detail {

/// The slot bitmap of a difference row lives in shared memory: resident rows of at most this many slots (the
/// checks' kMaxResidentSlots, asserted equal in src/cuda/gather.cpp).
inline constexpr std::int32_t kDifferenceMaxSlots = 65536;

/// vec16: every K/V row of src and dst starts 16-byte aligned and is a whole number of 16-byte words (the
/// host checks pointers and strides), so warps copy in uint4; otherwise element by element.
template <class T>
cudaError_t launch_gather_kv(const KVCache<const T>& src, const SelectionView& rows, const KVCache<T>& dst, bool vec16,
                             cudaStream_t stream);

/// The slot bookkeeping of a difference gather, shared by its two launches. Row r = b * kv_heads + h of `current`
/// (batch row b) takes its previous row from `previous` row previous_rows[b] * kv_heads + h when previous_rows is
/// given (the resident state kept per sequence slot, selectors/specontext/elastic_kv.hpp; a slot outside [0, previous.batch) makes
/// the row bad: copied = -1), else row r.
struct DifferenceSlots {
  SelectionView previous;
  const std::int32_t* previous_rows = nullptr;  ///< optional [current.batch]
  const std::int32_t* previous_slots = nullptr;
  SelectionView current;
  std::int32_t* current_slots = nullptr;
  std::int32_t resident_capacity = 0;  ///< slots of a resident row that new tokens may take, [0, capacity)
  std::int32_t* copied = nullptr;
  std::int32_t* fresh = nullptr;  ///< workspace [rows, current.capacity]: each row's new entries' positions in current
  /// Optional [current.batch], device-readable: the source's lengths. Given, a row listing a token outside [0,
  /// source_lengths[b]) is bad (copied -1), so no state records a row its copy skips; without, such a token is
  /// assigned a slot but not copied (cuda::gather_kv_difference's rule).
  const std::int32_t* source_lengths = nullptr;
};

/// The first launch: current_slots, copied and fresh of every row; no KV is read.
cudaError_t launch_assign_difference_slots(const DifferenceSlots& slots, cudaStream_t stream);

/// The second launch, after the first on the same stream: the new entries' K/V rows from src into their slots of
/// `resident` (batch row b, kv head h, slot). Any number of sources may take one assignment in turn (SpeContext's
/// offloaded layers share their selection).
template <class T>
cudaError_t launch_copy_difference(const KVCache<const T>& src, const DifferenceSlots& slots,
                                   const KVCache<T>& resident, bool vec16, cudaStream_t stream);

/// Elastic state per sequence slot (selectors/specontext/elastic_kv.hpp), after launch_assign_difference_slots (previous_rows
/// given): row previous_rows[b] * kv_heads + h of (previous, previous_slots) becomes current's row and its slots
/// (count 0 for a bad row: nothing is known resident); slot_counts[r] ([current rows]) receives current's count, or
/// -1 for a bad row (copied -1: the attention then writes NaN, not rows of unassigned slots); *moved_rows grows by
/// the rows copied. The slots of one launch are distinct (one writer per state row).
cudaError_t launch_commit_difference(const DifferenceSlots& slots, std::int32_t* previous_indices,
                                     std::int32_t* previous_counts, std::int32_t* previous_slots,
                                     std::int32_t* slot_counts, unsigned long long* moved_rows, cudaStream_t stream);

/// gather_keys' launch: the K rows alone, into dst [batch, kv_heads, tokens, head_dim].
template <class T>
cudaError_t launch_gather_keys(const KVCache<const T>& src, const SelectionView& rows, const SequenceView<T>& dst,
                               bool vec16, cudaStream_t stream);

/// Every K/V row of `cache` starts 16-byte aligned and is a whole number of 16-byte words: the copies' vec16.
template <class T>
bool rows_16b_aligned(const KVCache<T>& cache) {
  const auto aligned = [](auto... values) { return ((std::uintptr_t(values) % 16 == 0) && ...); };
  const std::size_t row_bytes = std::size_t(cache.head_dim()) * sizeof(T);
  if (cache.is_paged()) {
    const auto& v = cache.paged;
    return aligned(v.k_pages, v.v_pages, row_bytes, v.page_stride * sizeof(T), v.token_stride * sizeof(T),
                   v.head_stride * sizeof(T));
  }
  const auto& v = cache.contiguous;
  return aligned(v.k, v.v, row_bytes, v.batch_stride * sizeof(T), v.head_stride * sizeof(T),
                 v.token_stride * sizeof(T));
}
/// The same for the rows of a [batch, heads, tokens, head_dim] view.
template <class T>
bool rows_16b_aligned(const SequenceView<T>& v) {
  return (std::uintptr_t(v.data) | std::size_t(v.head_dim) * sizeof(T) | v.batch_stride * sizeof(T) |
          v.head_stride * sizeof(T) | v.token_stride * sizeof(T)) % 16 == 0;
}

}  // namespace kvsift::cuda::detail
