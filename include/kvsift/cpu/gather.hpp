#pragma once
/// Gathers of KV rows on the CPU: selected tokens into a resident buffer (gather_kv) and SpeContext's elastic
/// loading (gather_kv_difference: only the tokens a selection adds to the one resident now are copied, into the
/// slots of the tokens it drops). The twin of cuda/gather.hpp, with the same arguments but the context and the same
/// results. Host memory. No allocation; deterministic and independent of the thread count; reentrant with
/// distinct outputs. Every argument is checked, array contents included (counts, token ids, slots, lengths).

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/context.hpp"

namespace kvsift::cpu {

/// For each selection row (b, h) and i < rows.count(b, h): dst's K and V rows (b, h, i) = src's rows (b, h,
/// rows.row(b, h)[i]) (slot i of dst's row holds the i-th selected token; dst's other rows are not written).
/// Bit copies, no conversion. src and dst: contiguous or paged, the same batch, kv_heads and head_dim; rows
/// [batch, kv_heads]. dst.seq_len(b) is the number of slots of dst's row b (a contiguous buffer without seq_lens
/// has `capacity`). Refused: a count outside [0, rows.capacity] or above dst.seq_len(b), a token outside [0,
/// src.seq_len(b)). Threads: selection rows on ctx.pool.
template <class T>
void gather_kv(const KVCache<const T>& src, const SelectionView& rows, const KVCache<T>& dst,
               const Context& ctx = {});

/// gather_kv's K rows alone: dst[b, h, i] = src's K row (b, h, rows.row(b, h)[i]) for i < rows.count(b, h), into a
/// [batch, kv_heads, tokens, head_dim] view (A2ATS's codes need no values). Refused as gather_kv, a count above
/// dst.tokens in place of dst.seq_len(b). Threads: selection rows on ctx.pool.
template <class T>
void gather_keys(const KVCache<const T>& src, const SelectionView& rows, const SequenceView<T>& dst,
                 const Context& ctx = {});

/// Bytes of host workspace of gather_kv_difference: a bitmap of resident_capacity bits for each of min(batch *
/// kv_heads, threads) threads. A run on a larger pool than the query's is refused.
std::size_t gather_kv_difference_workspace_bytes(std::int32_t batch, std::int32_t kv_heads,
                                                 std::int32_t current_capacity, std::int32_t resident_capacity,
                                                 const Context& ctx = {});

/// Elastic loading (SpeContext): the resident buffer holds, in row (b, h), the K/V of the tokens of `previous`,
/// token previous.row(b, h)[i] in slot previous_slots[(b * kv_heads + h) * previous.capacity + i] (the slot map:
/// one slot per selection entry, in the selection's own layout). For `current`, this step's selection:
/// - a token also in `previous` keeps its slot: nothing is copied;
/// - the other tokens ("new"), in ascending order, take the free slots (those no kept token holds: the dropped
///   tokens' and any never used, up to resident.capacity) in ascending order, and their K/V rows are copied from
///   src (bit copies).
/// current_slots (same layout, current.capacity per row) receives every current entry's slot, so that (current's
/// counts, current_slots) is the selection of the resident buffer the attention reads; copied[b * kv_heads + h]
/// receives the number of new tokens (rows copied). Slot rows of dropped tokens that no new token takes keep
/// their stale K/V; entries of current_slots past the count are not written. previous_slots and current_slots are
/// distinct arrays (swap them per step). To start, pass an empty previous (counts 0).
/// Shapes: previous and current [src.batch, kv_heads]; resident contiguous [src.batch, kv_heads, capacity,
/// head_dim] with capacity >= current.capacity and <= 65536 (its seq_lens are not read). Refused: a count outside
/// [0, capacity] (previous's also above resident.capacity), a row not strictly ascending, a token outside [0,
/// src.seq_len(b)), a previous slot outside [0, resident.capacity) or repeated within its row.
/// workspace: gather_kv_difference_workspace_bytes(batch, kv_heads, current.capacity, resident.capacity, pool).
/// Threads: selection rows on ctx.pool.
template <class T>
void gather_kv_difference(const KVCache<const T>& src, const SelectionView& previous,
                          const std::int32_t* previous_slots, const SelectionView& current,
                          std::int32_t* current_slots, const ContiguousKVView<T>& resident, std::int32_t* copied,
                          std::span<std::byte> workspace, const Context& ctx = {});

}  // namespace kvsift::cpu
