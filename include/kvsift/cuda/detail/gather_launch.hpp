#pragma once
/// Launchers of the CUDA KV gathers (cuda/gather.hpp), for the host code in src/cuda/gather.cpp; kernels in
/// kernels/gather.cu. Launchers return the launch status and never throw.

#include <cuda_runtime_api.h>

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

template <class T>
struct DifferenceParams {
  KVCache<const T> src;
  SelectionView previous;
  const std::int32_t* previous_slots;
  SelectionView current;
  std::int32_t* current_slots;
  ContiguousKVView<T> resident;
  std::int32_t* copied;
  std::int32_t* fresh;  ///< workspace [rows, current.capacity]: each row's new entries' positions in current
};

template <class T>
cudaError_t launch_gather_kv_difference(const DifferenceParams<T>& params, bool vec16, cudaStream_t stream);

}  // namespace kvsift::cuda::detail
