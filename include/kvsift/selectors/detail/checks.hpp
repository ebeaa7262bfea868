#pragma once
/// Checks every selector makes of its limits and of each call's inputs, written once so that all of them
/// refuse bad inputs with the same messages.

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/detail/slot_states.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift::detail {

/// The longest sequence a selector is built for: token counts and sums of them (a row's candidates, C' * rho + N;
/// pages rounded up) are int32 in the kernels' arithmetic, and 2^30 keeps every such sum in range.
inline constexpr std::int32_t kMaxSelectorTokens = std::int32_t(1) << 30;

inline void check_limits(const char* where, const SelectorLimits& limits) {
  KVSIFT_CHECK(limits.max_slots > 0, where, "limits.max_slots (= {}) must be positive", limits.max_slots);
  KVSIFT_CHECK(limits.max_tokens > 0 && limits.max_tokens <= kMaxSelectorTokens, where,
               "limits.max_tokens (= {}) is outside [1, 2^30 = {}]", limits.max_tokens, kMaxSelectorTokens);
  KVSIFT_CHECK(limits.kv_heads > 0 && limits.q_heads > 0 && limits.q_heads % limits.kv_heads == 0, where,
               "limits.q_heads (= {}) must be a positive multiple of limits.kv_heads (= {})", limits.q_heads,
               limits.kv_heads);
  KVSIFT_CHECK(limits.head_dim > 0, where, "limits.head_dim (= {}) must be positive", limits.head_dim);
}

/// A step's shape against the limits (workspace queries).
inline void check_shape(const char* where, const SelectorLimits& limits, const SelectShape& shape) {
  KVSIFT_CHECK(shape.batch > 0 && shape.batch <= limits.max_slots, where,
               "shape.batch (= {}) is outside [1, limits.max_slots = {}]", shape.batch, limits.max_slots);
  KVSIFT_CHECK(shape.q_heads == limits.q_heads && shape.kv_heads == limits.kv_heads &&
                   shape.head_dim == limits.head_dim,
               where, "shape heads/head_dim ({}, {}, {}) != limits ({}, {}, {})", shape.q_heads, shape.kv_heads,
               shape.head_dim, limits.q_heads, limits.kv_heads, limits.head_dim);
  KVSIFT_CHECK(shape.max_seq_len >= 0 && shape.max_seq_len <= limits.max_tokens, where,
               "shape.max_seq_len (= {}) is outside [0, limits.max_tokens = {}]", shape.max_seq_len,
               limits.max_tokens);
}

/// The cache of a call against the limits; returns its batch. Slots in host memory are checked too (on the
/// device they are trusted, as every device-side value), and so is a host cache itself (core/validate.hpp: its
/// lengths against its storage, a paged cache's page table against its pages), before a selector reads a key: a
/// wild page id would otherwise be read outside the pages. O(pages) per call, beside the keys every call reads.
template <class T>
std::int32_t check_cache(const char* where, const SelectorLimits& limits, const KVCache<const T>& cache,
                         const std::int32_t* slots, MemorySpace memory) {
  KVSIFT_CHECK(cache.batch() > 0 && cache.batch() <= limits.max_slots, where,
               "cache batch (= {}) is outside [1, limits.max_slots = {}]", cache.batch(), limits.max_slots);
  KVSIFT_CHECK(cache.kv_heads() == limits.kv_heads && cache.head_dim() == limits.head_dim, where,
               "cache kv_heads (= {}) / head_dim (= {}) != limits ({}, {})", cache.kv_heads(), cache.head_dim(),
               limits.kv_heads, limits.head_dim);
  KVSIFT_CHECK(slots != nullptr, where, "slots must be non-null");
  cache.visit([&](const auto& view) { validate(view, where, "in.cache", memory); });
  if (memory == MemorySpace::host) {
    for (std::int32_t b = 0; b < cache.batch(); ++b) {
      KVSIFT_CHECK(slots[b] >= 0 && slots[b] < limits.max_slots, where,
                   "slots[{}] (= {}) is outside [0, limits.max_slots = {})", b, slots[b], limits.max_slots);
    }
  }
  return cache.batch();
}

/// A prepare's rows, read to the host: each sequence's slot and prompt length (its cache's seq_len). Refused by
/// name, before the caller changes any slot: a slot outside [0, limits.max_slots), a prompt longer than
/// limits.max_tokens. The lengths are also left in `context_lengths` (batch ints of the context's memory) for the
/// primitives that read them. On CUDA it synchronizes the stream: prepare only.
struct PrefillRows {
  std::vector<std::int32_t> lengths, slots;
};
template <class T, class Context>
PrefillRows read_prefill_rows(const char* where, const SelectorLimits& limits, const KVCache<const T>& cache,
                              const std::int32_t* slots, std::int32_t* context_lengths, const Context& ctx) {
  const auto rows = std::size_t(cache.batch());
  PrefillRows r{std::vector<std::int32_t>(rows), std::vector<std::int32_t>(rows)};
  sequence_lengths(cache, context_lengths, ctx);
  copy_to_host(context_lengths, rows, r.lengths.data(), ctx);
  copy_to_host(slots, rows, r.slots.data(), ctx);
  for (std::size_t b = 0; b < rows; ++b) {
    KVSIFT_CHECK(r.slots[b] >= 0 && r.slots[b] < limits.max_slots, where,
                 "in.slots[{}] (= {}) is outside [0, limits.max_slots = {})", b, r.slots[b], limits.max_slots);
    KVSIFT_CHECK(r.lengths[b] <= limits.max_tokens, where,
                 "sequence {}'s prompt ({} tokens) exceeds limits.max_tokens (= {})", b, r.lengths[b], limits.max_tokens);
  }
  return r;
}

/// An append's cache against the limits, and its slots against the selector's life cycle (slot_states.hpp: host
/// slots must hold a prepared sequence); returns its batch.
template <class T>
std::int32_t check_step_cache(const char* where, const SelectorLimits& limits, const SlotStates& states,
                              const KVCache<const T>& cache, const std::int32_t* slots, MemorySpace memory) {
  const std::int32_t batch = check_cache(where, limits, cache, slots, memory);
  states.require(where, slots, batch, memory);
  return batch;
}

/// A select call's query and output against the limits and the cache; capacity: the selector's.
template <class T>
/// `page_size`: the selector's page-level selections (selector.hpp selection_page_size; 1: tokens only), which
/// in.attention.selection_page_size may ask for; `capacity` is then the out.capacity needed for pages.
void check_select(const char* where, const SelectorLimits& limits, const SelectInputs<T>& in,
                  const SelectionView& out, std::int32_t capacity, MemorySpace memory, std::int32_t page_size = 1) {
  const std::int32_t batch = check_cache(where, limits, in.cache, in.slots, memory);
  validate(in.q, where, "in.q");
  KVSIFT_CHECK(in.q.batch == batch && in.q.heads == limits.q_heads && in.q.head_dim == limits.head_dim, where,
               "in.q [{}, {}, {}] != [batch = {}, q_heads = {}, head_dim = {}]", in.q.batch, in.q.heads,
               in.q.head_dim, batch, limits.q_heads, limits.head_dim);
  KVSIFT_CHECK(in.lengths != nullptr, where, "in.lengths must be non-null");
  validate(in.attention.window, where, "in.attention.window");
  const std::int32_t asked = in.attention.selection_page_size;
  KVSIFT_CHECK(asked == 1 || (asked == page_size && page_size > 1), where,
               "in.attention.selection_page_size (= {}) is neither 1 (tokens) nor the selector's page size ({})", asked,
               page_size == 1 ? std::string("none: it selects tokens") : std::to_string(page_size));
  KVSIFT_CHECK(in.attention.selection_rows == nullptr, where,
               "in.attention.selection_rows is set: a selector writes its selection by batch row, with no row map");
  KVSIFT_CHECK(out.counts != nullptr && (out.indices != nullptr || out.capacity == 0), where,
               "out.counts, and out.indices unless out.capacity is 0, must be non-null");
  KVSIFT_CHECK(out.batch == batch && out.kv_heads == limits.kv_heads, where,
               "out [batch = {}, kv_heads = {}] != [{}, {}]", out.batch, out.kv_heads, batch, limits.kv_heads);
  KVSIFT_CHECK(out.capacity >= capacity, where, "out.capacity (= {}) is smaller than the selector's capacity (= {})",
               out.capacity, capacity);
}

/// check_select, and the selector's life cycle: host slots must hold a prepared sequence (slot_states.hpp).
template <class T>
void check_select(const char* where, const SelectorLimits& limits, const SlotStates& states, const SelectInputs<T>& in,
                  const SelectionView& out, std::int32_t capacity, MemorySpace memory, std::int32_t page_size = 1) {
  check_select(where, limits, in, out, capacity, memory, page_size);
  states.require(where, in.slots, in.q.batch, memory);
}

/// NaN never vanishes in an index built at prepare: a non-finite prompt key or prefill query would poison the
/// centroids or lists it joins (or be left out of them), and the steps after it would look finite where dense
/// attention is not. Refused by position instead, the first offender in (sequence, kv head, token, channel) order,
/// on either backend. The keys of row b's first `lengths[b]` tokens (context memory, [cache.batch()]) are scanned
/// in the cache's memory by first_nonfinite_key (on CUDA one pass at memory bandwidth); its answer, and the
/// offending value for the message, come back by copy_to_host (on CUDA, synchronizing the stream, as prepare does
/// anyway). The prefill queries, W per head, are read on the host on either backend. Allocates 16 bytes of
/// context memory.
template <class T, class Context>
void check_finite_prompt(const char* where, const KVCache<const T>& cache, const std::int32_t* lengths,
                         const SequenceView<const T>& queries, const Context& ctx) {
  typename Context::template array<std::int32_t> found(4);
  first_nonfinite_key(cache, lengths, found.data(), ctx);
  std::array<std::int32_t, 4> at{};
  copy_to_host(found.data(), at.size(), at.data(), ctx);
  if (at[0] >= 0) {
    const auto [b, h, t, i] = at;
    const T* row = nullptr;
    std::int32_t page = 0;
    const std::int32_t page_entries[2] = {0, 1};
    if (cache.is_paged()) {  // the page of token t, read from the table by copy; then addressed by the view itself
      std::int64_t first_page = std::int64_t(b) * cache.paged.block_table_stride;  // the block-table form
      if (!cache.paged.is_block_table()) {
        std::int32_t entry = 0;
        copy_to_host(cache.paged.page_indptr + b, 1, &entry, ctx);
        first_page = entry;
      }
      copy_to_host(cache.paged.page_indices + first_page + t / cache.paged.page_size, 1, &page, ctx);
      PagedKVView<const T> one_page = cache.paged;  // a CSR view of the one page (its length is not read)
      one_page.page_indptr = page_entries;
      one_page.page_indices = &page;
      one_page.block_table_stride = 0;
      row = one_page.k_row(0, h, t % one_page.page_size);
    } else {
      row = cache.contiguous.k_row(b, h, t);
    }
    T value{};
    copy_to_host(row + i, 1, &value, ctx);
    KVSIFT_CHECK(false, where,
                 "the prompt's keys hold a non-finite value at sequence {}, kv head {}, token {}, channel {} "
                 "(= {}): NaN and inf are refused rather than indexed",
                 b, h, t, i, to_float(value));
  }
  if (queries.tokens <= 0 || queries.head_dim <= 0) return;
  // One copy per (sequence, head): its W queries, strides and all.
  const std::size_t span = std::size_t(queries.tokens - 1) * std::size_t(queries.token_stride) + std::size_t(queries.head_dim);
  std::vector<T> block(span);
  for (std::int32_t b = 0; b < queries.batch; ++b) {
    for (std::int32_t h = 0; h < queries.heads; ++h) {
      copy_to_host(queries.row(b, h, 0), span, block.data(), ctx);
      for (std::int32_t w = 0; w < queries.tokens; ++w) {
        for (std::int32_t i = 0; i < queries.head_dim; ++i) {
          const float x = to_float(block[std::size_t(w) * std::size_t(queries.token_stride) + std::size_t(i)]);
          KVSIFT_CHECK(std::isfinite(x), where,
                       "in.queries holds a non-finite value at sequence {}, head {}, query {}, channel {} (= {}): NaN "
                       "and inf are refused rather than indexed",
                       b, h, w, i, x);
        }
      }
    }
  }
}

/// The token columns of a select workspace sized for a bound on the sequences' lengths (SelectShape::max_seq_len
/// in a query, SelectInputs::max_seq_len in select: one function, so that the two cannot disagree).
/// name: the argument's name, for the refusal.
inline std::int32_t planned_tokens(const char* where, const char* name, const SelectorLimits& limits,
                                   std::int32_t max_seq_len) {
  KVSIFT_CHECK(max_seq_len >= 0 && max_seq_len <= limits.max_tokens, where,
               "{} (= {}) is outside [0, limits.max_tokens = {}]", name, max_seq_len, limits.max_tokens);
  return max_seq_len > 0 ? max_seq_len : limits.max_tokens;
}

/// A workspace query: `shape` checked against the limits, then the bytes of `layout(counting)`, the same layout
/// code the call carves with.
template <class Layout>
std::size_t workspace_bytes(const char* where, const SelectorLimits& limits, const SelectShape& shape,
                            Layout&& layout) {
  check_shape(where, limits, shape);
  WorkspaceLayout counting;
  layout(counting);
  return counting.bytes();
}

/// The workspace query of a call that takes none: `shape` checked against the limits all the same, 0 bytes.
inline std::size_t no_workspace_bytes(const char* where, const SelectorLimits& limits, const SelectShape& shape) {
  check_shape(where, limits, shape);
  return 0;
}

/// A select workspace query: workspace_bytes of `layout(counting, tokens)` (tokens: the planned sequence bound,
/// detail::planned_tokens).
template <class Layout>
std::size_t planned_workspace_bytes(const char* where, const SelectorLimits& limits, const SelectShape& shape,
                                    Layout&& layout) {
  return workspace_bytes(where, limits, shape, [&](WorkspaceLayout& counting) {
    layout(counting, planned_tokens(where, "shape.max_seq_len", limits, shape.max_seq_len));
  });
}

/// A prepare's prefill queries (the last W of each head, W free) against its batch and the limits.
template <class T>
void check_prefill_queries(const char* where, const SelectorLimits& limits, const SequenceView<const T>& queries,
                           std::int32_t batch) {
  validate(queries, where, "in.queries");
  KVSIFT_CHECK(queries.batch == batch && queries.heads == limits.q_heads && queries.head_dim == limits.head_dim,
               where, "in.queries [{}, {}, W, {}] != [batch = {}, q_heads = {}, W, head_dim = {}]", queries.batch,
               queries.heads, queries.head_dim, batch, limits.q_heads, limits.head_dim);
}

/// A selector's IndexBytes: `context_bytes` in Context's memory (host for cpu::Context, device for cuda::Context)
/// and `host_bytes` the host keeps on either.
template <class Context>
IndexBytes context_index_bytes(std::size_t context_bytes, std::size_t host_bytes = 0) {
  return Context::memory == MemorySpace::host ? IndexBytes{context_bytes + host_bytes, 0}
                                              : IndexBytes{host_bytes, context_bytes};
}

}  // namespace kvsift::detail
