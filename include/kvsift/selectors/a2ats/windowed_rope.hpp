#pragma once
/// Windowed-RoPE decode attention: A²ATS's "wrope" mode, its equation 11 as written. For the query of a sequence of
/// `length` tokens, at position p = length - 1, the logit of token j is
///   sm_scale * q . k_j                    for p - j < w (the last w tokens: ordinary RoPE, post-RoPE q and k),
///   sm_scale * (q rotated to b) . k_pre_j  for p - j >= w (a fixed relative position b, the pre-RoPE key),
/// with a softmax over every attended token and V as usual. Attended: the last w tokens (the first rule), the first
/// `sink` tokens and the selection (the second rule: sinks are not local). A selection listing every middle token
/// [sink, length - w) is the dense form, the reference mode.
///
/// Built from the shared primitives, written once for both backends (include cpu/backend.hpp or cuda/backend.hpp
/// before instantiating it; the context's type picks the backend):
///   1. lengths from `cache`; q~ = a copy of q, rotated to position b (rotate_to_position from p = length - 1:
///      q R_{b - p}, the attention factor q carries left alone);
///   2. partial 1: sparse decode of q over `cache` (post-RoPE) with the window {sink 0, recent w} and an empty
///      selection;
///   3. partial 2: sparse decode of q~ over `pre_rope_cache` with the window {sink, recent 0} and `selection`;
///   4. merge_states of both fp32 partials into `out` (T, or fp32 for a later merge), rounded once.
/// On CUDA: five launches (lengths, rotation, two decodes, merge), a 2D copy and a memset, all stream-ordered.
///
/// pre_rope_cache: a KVCache whose K rows are the pre-RoPE keys and whose V is the same V (the engine keeps it, or
/// A²ATS's user does; its V pointers may alias `cache`'s). Both caches hold every sequence's tokens at their
/// absolute positions with the same lengths; partial 1 reads only the last w rows of `cache`, partial 2 only the
/// sinks and the selected rows of `pre_rope_cache`.
///
/// Rules, each refused by name where it can be checked:
/// - every sequence is at least sink + w long (shorter, its sinks would also be recent tokens and be attended
///   twice): checked on the CPU; on CUDA the lengths are on the device and checked with params.validate_indices.
/// - selection rows list tokens of the middle [sink, length - w), each once; attend_all is refused. A count outside
///   [0, capacity] (a primitive's -1) gives NaN in O and LSE of that kv head's query heads, as every sparse decode.
///   params.validate_indices checks every count and index on the host (CUDA: copies and synchronizes).
/// - |b - p| < rope.positions for every query (the table rotates by the difference): refused on the CPU, a NaN
///   query (and so NaN output) on CUDA.
/// YaRN: q carries the attention factor and the pre-RoPE keys do not, so the non-local logits carry it once where
/// the local ones carry its square (as q R_b k_pre with the post-RoPE q of a YaRN model does).
///
/// Memory: every view and the table in the context's memory (device on CUDA); the workspace of
/// windowed_rope_workspace_bytes() bytes (256-byte aligned, contents irrelevant) for the same shape: the run's
/// q.batch, heads and head_dim and selection.capacity. No allocation (but validation), no host sync (but
/// validation on CUDA); CUDA-graph capturable without validation. Deterministic for a given pool size (CPU) or GPU.
/// Thread safety: reentrant; concurrent calls need distinct workspaces.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/copy_heads.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/core/workspace.hpp"

namespace kvsift {

struct WindowedRopeParams {
  std::int32_t window = 64;   ///< w (>= 1): the last w tokens take ordinary RoPE (the query's own token among them)
  std::int32_t offset = 2048; ///< b (>= 0): the fixed relative position of every older token
  std::int32_t sink = 4;      ///< the first tokens, always attended, by the second rule
  float sm_scale = 0.0f;      ///< 0: 1 / sqrt(head_dim)
  RopeTableView rope{};       ///< the model's cos/sin table (context memory)
  /// Check the lengths and the selection on the host before attending and throw naming the first offending entry;
  /// allocates host copies, and on CUDA synchronizes the stream (not graph capturable).
  bool validate_indices = false;
};

/// q~ = q R_b: each query head of batch row b, at position lengths[b] - 1, copied into `out` (packed, in the
/// context's memory) and rotated to position `target` (rotate_to_position; the attention factor q carries is left
/// alone). Any strides of q. The windowed-RoPE query of eq. 11, for A²ATS's tables and windowed_rope_decode alike.
template <class T, class Context>
void rotate_query_to(const QueryView<const T>& q, const std::int32_t* lengths, std::int32_t target,
                     const RopeTableView& table, const QueryView<T>& out, const Context& ctx) {
  copy_heads_packed(q, out.data, ctx);
  rotate_to_position(out, lengths, -1, target, table, ctx);
}

/// The shapes that size the workspace: those of the run's q and selection.
struct WindowedRopeShape {
  std::int32_t batch = 0;
  std::int32_t q_heads = 0;
  std::int32_t kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t capacity = 0;  ///< the selection's
};

namespace detail {

template <class T>
struct WindowedRopeBuffers {
  std::int32_t* lengths = nullptr;      ///< [batch] the cache's lengths (the rotation's positions)
  T* q_rotated = nullptr;               ///< [batch, q_heads, head_dim] q~
  std::int32_t* no_counts = nullptr;    ///< [batch * kv_heads] zeros: partial 1 attends its window only
  std::int32_t* no_indices = nullptr;   ///< [batch * kv_heads], never read
  float* partial_o[2] = {};             ///< [batch, q_heads, head_dim] fp32: partial 1 (local), partial 2 (the rest)
  float* partial_lse[2] = {};
  std::span<std::byte> decode;          ///< both decodes' scratch (they run in turn)
};

inline AttentionOptions windowed_rope_local(const WindowedRopeParams& p) {
  return {.sm_scale = p.sm_scale, .window = {.sink = 0, .recent = p.window}};
}
inline AttentionOptions windowed_rope_distant(const WindowedRopeParams& p) {
  return {.sm_scale = p.sm_scale, .window = {.sink = p.sink, .recent = 0}};
}

/// The one layout behind the workspace query (counting) and the run (carving).
template <class T, class Context>
WindowedRopeBuffers<T> windowed_rope_layout(WorkspaceLayout& layout, const WindowedRopeShape& s,
                                            const WindowedRopeParams& p, const Context& ctx) {
  const std::size_t rows = std::size_t(s.batch) * std::size_t(s.kv_heads);
  const std::size_t states = std::size_t(s.batch) * std::size_t(s.q_heads);
  WindowedRopeBuffers<T> b;
  b.lengths = layout.allocate<std::int32_t>(std::size_t(s.batch), "windowed RoPE lengths");
  b.q_rotated = layout.allocate<T>(states * std::size_t(s.head_dim), "windowed RoPE rotated query");
  b.no_counts = layout.allocate<std::int32_t>(rows, "windowed RoPE empty counts");
  b.no_indices = layout.allocate<std::int32_t>(rows, "windowed RoPE empty indices");
  for (int i = 0; i < 2; ++i) {
    b.partial_o[i] = layout.allocate<float>(states * std::size_t(s.head_dim), "windowed RoPE partial O");
    b.partial_lse[i] = layout.allocate<float>(states, "windowed RoPE partial LSE");
  }
  const auto decode_bytes = [&](std::int32_t capacity, const AttentionOptions& attention) {
    return sparse_decode_workspace_bytes(s.batch, s.q_heads, s.kv_heads, s.head_dim, capacity, 0, attention, false,
                                         ctx);
  };
  b.decode = layout.span(std::max(decode_bytes(1, windowed_rope_local(p)),
                                  decode_bytes(std::max(1, s.capacity), windowed_rope_distant(p))),
                         "windowed RoPE decode scratch");
  return b;
}

inline void check_windowed_rope_params(const char* where, const WindowedRopeParams& p, std::int32_t head_dim) {
  KVSIFT_CHECK(p.window >= 1, where, "params.window (= {}) must be >= 1: the query's own token is local",
               p.window);
  KVSIFT_CHECK(p.sink >= 0, where, "params.sink (= {}) must be >= 0", p.sink);
  KVSIFT_CHECK(p.offset >= 0 && p.offset < p.rope.positions, where,
               "params.offset (= {}) is outside [0, params.rope.positions = {})", p.offset, p.rope.positions);
  KVSIFT_CHECK(p.rope.cos != nullptr && p.rope.sin != nullptr, where, "params.rope has a null cos or sin table");
  KVSIFT_CHECK(p.rope.rotary_dim >= 2 && p.rope.rotary_dim <= head_dim && p.rope.rotary_dim % 2 == 0, where,
               "params.rope.rotary_dim (= {}) must be even and in [2, head_dim = {}]", p.rope.rotary_dim, head_dim);
}

/// The checks of host values: every length at least sink + w and equal in both caches, and, with `selection`, its
/// every count and index (middle only, no duplicates). Pointers in host memory.
template <class T>
void check_windowed_rope_contents(const char* where, const WindowedRopeParams& p, std::int32_t batch,
                                  const std::int32_t* lengths, const std::int32_t* pre_rope_lengths,
                                  const SelectionView* selection) {
  for (std::int32_t b = 0; b < batch; ++b) {
    KVSIFT_CHECK(lengths[b] >= p.sink + p.window, where,
                 "sequence {} has {} tokens, fewer than params.sink + params.window (= {} + {}): its sinks would be "
                 "attended twice",
                 b, lengths[b], p.sink, p.window);
    KVSIFT_CHECK(pre_rope_lengths[b] == lengths[b], where,
                 "sequence {} has {} tokens in pre_rope_cache and {} in cache: they must agree", b,
                 pre_rope_lengths[b], lengths[b]);
  }
  if (selection == nullptr) return;
  // Only the lengths of this view are read.
  const ContiguousKVView<const T> lengths_only{.seq_lens = lengths, .batch = batch,
                                               .kv_heads = selection->kv_heads};
  check_selection_contents(*selection, lengths_only, where, "selection", /*refuse_duplicates=*/true,
                           AttentionWindow{.sink = p.sink, .recent = p.window});
}

}  // namespace detail

/// Bytes of workspace windowed_rope_decode needs for this shape and these params on ctx (a CPU pool's threads
/// split rows: plan with the pool the call runs on).
template <class T, class Context>
std::size_t windowed_rope_workspace_bytes(const WindowedRopeShape& shape, const WindowedRopeParams& params,
                                          const Context& ctx) {
  WorkspaceLayout counting;
  detail::windowed_rope_layout<T>(counting, shape, params, ctx);
  return counting.bytes();
}

/// Windowed-RoPE decode (see above): q [batch, q_heads, head_dim] post-RoPE; out O [batch, q_heads, head_dim] in T
/// or fp32 and LSE [batch, q_heads] (natural log). q's head rows must be evenly spaced (batch_stride = q_heads *
/// head_stride, as in any packed or head-padded query): one copy moves them.
template <class T, class TO, class Context>
void windowed_rope_decode(const QueryView<const T>& q, const KVCache<const std::type_identity_t<T>>& cache,
                          const KVCache<const std::type_identity_t<T>>& pre_rope_cache, const SelectionView& selection,
                          const StateView<TO>& out, const WindowedRopeParams& params, std::span<std::byte> workspace,
                          const Context& ctx) {
  constexpr const char* where = "windowed_rope_decode";
  validate(q, where, "q");
  validate(out, where, "out");
  check_output_matches_query(where, q, out);
  KVSIFT_CHECK(q.batch_stride == std::int64_t(q.heads) * q.head_stride, where,
               "q.batch_stride (= {}) must be q.heads * q.head_stride (= {}): one copy moves the query", q.batch_stride,
               std::int64_t(q.heads) * q.head_stride);
  cache.visit([&](const auto& kv) {
    validate(kv, where, "cache", Context::memory);
    check_query_matches_kv(where, q, kv);
    validate(selection, kv, where, "selection");
  });
  pre_rope_cache.visit([&](const auto& kv) {
    validate(kv, where, "pre_rope_cache", Context::memory);
    check_query_matches_kv(where, q, kv);
  });
  KVSIFT_CHECK(pre_rope_cache.kv_heads() == cache.kv_heads(), where,
               "pre_rope_cache.kv_heads (= {}) != cache.kv_heads (= {})", pre_rope_cache.kv_heads(), cache.kv_heads());
  KVSIFT_CHECK(selection.attend_all == nullptr, where,
               "selection.attend_all is set: every token by the distant rule would take the recent ones twice; list "
               "the middle [sink, length - window) instead");
  detail::check_windowed_rope_params(where, params, q.head_dim);

  const WindowedRopeShape shape{q.batch, q.heads, cache.kv_heads(), q.head_dim, selection.capacity};
  WorkspaceLayout carving(workspace, where);
  const detail::WindowedRopeBuffers<T> b = detail::windowed_rope_layout<T>(carving, shape, params, ctx);

  sequence_lengths(cache, b.lengths, ctx);
  if (Context::memory == MemorySpace::host || params.validate_indices) {
    // On the host every value is readable; on the device they are copied (validation only: it synchronizes).
    std::vector<std::int32_t> lengths, pre_lengths, counts, indices;
    const auto on_host = [&](const std::int32_t* src, std::size_t n, std::vector<std::int32_t>& copy) {
      if constexpr (Context::memory == MemorySpace::host) {
        return src;
      } else {
        copy.resize(n);
        if (n > 0) copy_to_host(src, n, copy.data(), ctx);
        return static_cast<const std::int32_t*>(copy.data());
      }
    };
    const std::int32_t* host_lengths = on_host(b.lengths, std::size_t(q.batch), lengths);
    sequence_lengths(pre_rope_cache, b.no_counts, ctx);  // scratch until the clear below
    const std::int32_t* host_pre_lengths = on_host(b.no_counts, std::size_t(q.batch), pre_lengths);
    SelectionView host_selection = selection;
    if (params.validate_indices) {
      const std::size_t rows = std::size_t(q.batch) * std::size_t(selection.kv_heads);
      host_selection.counts = const_cast<std::int32_t*>(on_host(selection.counts, rows, counts));
      host_selection.indices =
          const_cast<std::int32_t*>(on_host(selection.indices, rows * std::size_t(selection.capacity), indices));
    }
    detail::check_windowed_rope_contents<T>(where, params, q.batch, host_lengths, host_pre_lengths,
                                            params.validate_indices ? &host_selection : nullptr);
  }

  // 1. q~: q rotated from p = length - 1 to b.
  rotate_query_to(q, b.lengths, params.offset, params.rope,
                  QueryView<T>::packed(b.q_rotated, q.batch, q.heads, q.head_dim), ctx);

  // 2-3. The local window over the post-RoPE cache, the sinks and the selection over the pre-RoPE one.
  const auto partial = [&](int i) {
    return StateView<float>::packed(b.partial_o[i], b.partial_lse[i], q.batch, q.heads, q.head_dim);
  };
  const SelectionView nothing{b.no_indices, b.no_counts, nullptr, q.batch, cache.kv_heads(), 1};
  clear_counts(nothing, ctx);
  sparse_decode(q, cache, nothing, partial(0), detail::windowed_rope_local(params), false, true, b.decode, ctx);
  sparse_decode(QueryView<const T>::packed(b.q_rotated, q.batch, q.heads, q.head_dim), pre_rope_cache, selection,
                partial(1), detail::windowed_rope_distant(params), false, true, b.decode, ctx);

  // 4. Both, by LSE, into `out`.
  const StateView<const float> partials[] = {partial(0).as_const(), partial(1).as_const()};
  merge_states(std::span<const StateView<const float>>(partials), out, ctx);
}

}  // namespace kvsift
