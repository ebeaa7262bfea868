// KV gathers on CUDA: the shape checks shared with the CPU (core/detail/gather_checks.hpp, device contents
// unread), the 16-byte copy decision, then the launchers of kernels/gather.cu.
#include "kvsift/cuda/gather.hpp"

#include <climits>

#include "kvsift/core/detail/gather_checks.hpp"
#include "kvsift/core/detail/gather_instances.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/detail/gather_launch.hpp"

namespace kvsift::cuda {
namespace {

static_assert(detail::kDifferenceMaxSlots == kvsift::detail::kMaxResidentSlots);
using detail::rows_16b_aligned;

std::int32_t* layout_difference(WorkspaceLayout& layout, std::int32_t batch, std::int32_t kv_heads,
                                std::int32_t current_capacity) {
  return layout.allocate<std::int32_t>(
      checked_mul(std::size_t(batch) * std::size_t(kv_heads), std::size_t(current_capacity),
                  "cuda gather_kv_difference workspace"),
      "fresh_entries");
}

}  // namespace

template <class T>
void gather_kv(const KVCache<const T>& src, const SelectionView& rows, const KVCache<T>& dst, const Context& ctx) {
  kvsift::detail::check_gather_kv("cuda::gather_kv", src, rows, dst, MemorySpace::device);
  KVSIFT_CUDA_CHECK(
      detail::launch_gather_kv(src, rows, dst, rows_16b_aligned(src) && rows_16b_aligned(dst), ctx.stream));
}

template <class T>
void gather_keys(const KVCache<const T>& src, const SelectionView& rows, const SequenceView<T>& dst,
                 const Context& ctx) {
  kvsift::detail::check_gather_keys("cuda::gather_keys", src, rows, dst, MemorySpace::device);
  KVSIFT_CUDA_CHECK(
      detail::launch_gather_keys(src, rows, dst, rows_16b_aligned(src) && rows_16b_aligned(dst), ctx.stream));
}

std::size_t gather_kv_difference_workspace_bytes(std::int32_t batch, std::int32_t kv_heads,
                                                 std::int32_t current_capacity, std::int32_t resident_capacity,
                                                 const Context&) {
  KVSIFT_CHECK(batch > 0 && kv_heads > 0 && current_capacity > 0 && resident_capacity > 0,
               "cuda::gather_kv_difference_workspace_bytes",
               "batch (= {}), kv_heads (= {}), current_capacity (= {}) and resident_capacity (= {}) must be positive",
               batch, kv_heads, current_capacity, resident_capacity);
  WorkspaceLayout counting;
  layout_difference(counting, batch, kv_heads, current_capacity);
  return counting.bytes();
}

template <class T>
void gather_kv_difference(const KVCache<const T>& src, const SelectionView& previous,
                          const std::int32_t* d_previous_slots, const SelectionView& current,
                          std::int32_t* d_current_slots, const ContiguousKVView<T>& resident, std::int32_t* d_copied,
                          std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cuda::gather_kv_difference";
  kvsift::detail::check_gather_difference(where, src, previous, d_previous_slots, current, d_current_slots, resident,
                                          d_copied, MemorySpace::device);
  KVSIFT_CHECK(std::int64_t(current.batch) * current.kv_heads <= INT32_MAX, where,
               "current.batch * kv_heads (= {} * {}) exceeds 2^31 - 1 CTAs", current.batch, current.kv_heads);
  WorkspaceLayout layout(workspace, where);
  const detail::DifferenceSlots slots{
      .previous = previous,
      .previous_slots = d_previous_slots,
      .current = current,
      .current_slots = d_current_slots,
      .resident_capacity = resident.capacity,
      .copied = d_copied,
      .fresh = layout_difference(layout, current.batch, current.kv_heads, current.capacity)};
  const KVCache<T> dst(resident);
  KVSIFT_CUDA_CHECK(detail::launch_assign_difference_slots(slots, ctx.stream));
  KVSIFT_CUDA_CHECK(
      detail::launch_copy_difference(src, slots, dst, rows_16b_aligned(src) && rows_16b_aligned(dst), ctx.stream));
}

KVSIFT_STORAGE_TYPES(KVSIFT_GATHER_INSTANCES)

}  // namespace kvsift::cuda
