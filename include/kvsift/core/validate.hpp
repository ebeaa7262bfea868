#pragma once
/// Argument checks shared by every public entry point. Each takes `where` (the public function's name) and
/// `name` (the argument's name) so that messages read like
/// `kvsift::sparse_decode: kv.head_dim (= 64) != q.head_dim (= 128)`.
///
/// Shape checks read only the view's own fields. Content checks (sequence lengths, page tables, selection
/// counts and indices) read the arrays the view points to, so they run only on views of host memory; CUDA
/// entry points check selections on the device in their validation mode instead, and report through
/// check_selection_count / check_selection_entries, so both backends word their refusals alike.

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <cstddef>
#include <span>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/supported_values.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift {

enum class MemorySpace : std::uint8_t { host, device };

namespace detail {

struct Dim {
  const char* name;
  std::int64_t extent;
  std::int64_t stride;
};

/// Refuses `value` of `name` unless it is one of `values` (core/supported_values.hpp); `by`, when given, names what
/// supports them ("the CUDA decode kernels").
inline void check_supported(const char* where, const char* name, std::int64_t value, std::span<const int> values,
                            const char* by = nullptr) {
  KVSIFT_CHECK(is_supported(values, value), where, "{} (= {}) is not supported{}{} (supported: {})", name, value,
               by != nullptr ? " by " : "", by != nullptr ? by : "", supported_text(values));
}

inline void check_positive(const char* where, const char* name, const char* field, std::int64_t value) {
  KVSIFT_CHECK(value > 0, where, "{}.{} (= {}) must be positive", name, field, value);
}

inline void check_pointer(const char* where, const char* name, const char* field, const void* p) {
  KVSIFT_CHECK(p != nullptr, where, "{}.{} is a null pointer", name, field);
}

/// Strides are consistent with the shape when no two distinct elements share an address: sorted by stride,
/// each dimension must step over the whole extent of the next smaller one. head_dim is the innermost
/// dimension with stride 1.
template <std::size_t N>
void check_no_overlap(const char* where, const char* name, std::array<Dim, N> dims) {
  std::sort(dims.begin(), dims.end(), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  const Dim* inner = nullptr;
  for (const Dim& d : dims) {
    if (d.extent <= 1) continue;
    KVSIFT_CHECK(d.stride > 0, where, "{}: {} stride (= {}) must be positive", name, d.name, d.stride);
    if (inner != nullptr) {
      const std::int64_t span = inner->extent * inner->stride;
      KVSIFT_CHECK(d.stride >= span, where,
                   "{}: strides inconsistent with shape: {} stride (= {}) < {} extent * stride (= {} * {}), "
                   "so rows overlap",
                   name, d.name, d.stride, inner->name, inner->extent, inner->stride);
    }
    inner = &d;
  }
}

/// A view's strided dimension: the field that holds its extent (refused by that name unless positive), the
/// dimension's name in stride messages, its extent and stride.
struct ShapeDim {
  const char* field;
  std::int64_t extent;
  const char* dim;
  std::int64_t stride;
};

/// Every extent positive, then check_no_overlap over the same dimensions.
template <std::size_t N>
void check_shape(const char* where, const char* name, const std::array<ShapeDim, N>& dims) {
  std::array<Dim, N> strided{};
  for (std::size_t i = 0; i < N; ++i) {
    check_positive(where, name, dims[i].field, dims[i].extent);
    strided[i] = {dims[i].dim, dims[i].extent, dims[i].stride};
  }
  check_no_overlap<N>(where, name, strided);
}

}  // namespace detail

template <class T>
void validate(const MatrixView<T>& v, const char* where, const char* name) {
  detail::check_pointer(where, name, "data", v.data);
  detail::check_shape<2>(where, name, {{{"rows", v.rows, "row", v.row_stride}, {"cols", v.cols, "col", 1}}});
}

template <class T>
void validate(const SequenceView<T>& v, const char* where, const char* name) {
  detail::check_pointer(where, name, "data", v.data);
  detail::check_shape<4>(where, name,
                         {{{"batch", v.batch, "batch", v.batch_stride},
                           {"heads", v.heads, "head", v.head_stride},
                           {"tokens", v.tokens, "token", v.token_stride},
                           {"head_dim", v.head_dim, "head_dim", 1}}});
}

/// A HeadsView is a SequenceView of one token per (sequence, head).
template <class T>
void validate(const HeadsView<T>& v, const char* where, const char* name) {
  validate(SequenceView<T>{v.data, v.batch, v.heads, 1, v.head_dim, v.batch_stride, v.head_stride, v.head_dim}, where,
           name);
}

template <class T>
void validate(const StateView<T>& v, const char* where, const char* name) {
  detail::check_pointer(where, name, "o", v.o);
  detail::check_pointer(where, name, "lse", v.lse);
  detail::check_shape<3>(where, name,
                         {{{"batch", v.batch, "batch", v.o_batch_stride},
                           {"heads", v.heads, "head", v.o_head_stride},
                           {"head_dim", v.head_dim, "head_dim", 1}}});
  detail::check_no_overlap<2>(where, name, {{{"lse batch", v.batch, v.lse_batch_stride}, {"lse head", v.heads, 1}}});
}

template <class T>
void validate(const ContiguousKVView<T>& v, const char* where, const char* name, MemorySpace contents) {
  detail::check_pointer(where, name, "k", v.k);
  detail::check_pointer(where, name, "v", v.v);
  detail::check_positive(where, name, "batch", v.batch);
  // A read-only view may broadcast one sequence over its batch (batch_stride 0: every row reads the same tokens,
  // with its own length), as CTKVR's prefill scores many centroid queries against one sequence.
  const bool broadcast = std::is_const_v<T> && v.batch_stride == 0;
  detail::check_shape<4>(where, name,
                         {{{"batch", broadcast ? 1 : v.batch, "batch", v.batch_stride},
                           {"kv_heads", v.kv_heads, "head", v.head_stride},
                           {"capacity", v.capacity, "token", v.token_stride},
                           {"head_dim", v.head_dim, "head_dim", 1}}});
  if (contents == MemorySpace::host && v.seq_lens != nullptr) {
    for (std::int32_t b = 0; b < v.batch; ++b) {
      KVSIFT_CHECK(v.seq_lens[b] >= 0 && v.seq_lens[b] <= v.capacity, where,
                   "{}.seq_lens[{}] (= {}) is outside [0, capacity = {}]", name, b, v.seq_lens[b], v.capacity);
    }
  }
}

/// A paged view in either form (views.hpp): the block-table form (block_table_stride > 0) needs seq_lens and reads
/// neither page_indptr nor last_page_len; the CSR form needs page_indptr, and last_page_len unless seq_lens is set.
/// With host contents, every length is checked against the pages its table gives it and every page read against
/// [0, num_pages).
template <class T>
void validate(const PagedKVView<T>& v, const char* where, const char* name, MemorySpace contents) {
  detail::check_pointer(where, name, "k_pages", v.k_pages);
  detail::check_pointer(where, name, "v_pages", v.v_pages);
  KVSIFT_CHECK(v.block_table_stride >= 0, where,
               "{}.block_table_stride (= {}) must be >= 0 (0: a CSR page table; > 0: a block table's row stride)", name,
               v.block_table_stride);
  const bool block_table = v.block_table_stride > 0;
  if (block_table) {
    detail::check_pointer(where, name, "page_indices", v.page_indices);
    KVSIFT_CHECK(v.seq_lens != nullptr, where,
                 "{}.seq_lens is a null pointer: the block-table form (block_table_stride = {}) takes the lengths from "
                 "it",
                 name, v.block_table_stride);
  } else {
    KVSIFT_CHECK(v.page_indptr != nullptr, where,
                 "{}.page_indptr is a null pointer: the CSR form (block_table_stride = 0) reads it", name);
    detail::check_pointer(where, name, "page_indices", v.page_indices);
    if (v.seq_lens == nullptr) detail::check_pointer(where, name, "last_page_len", v.last_page_len);
  }
  detail::check_positive(where, name, "batch", v.batch);
  detail::check_shape<4>(where, name,
                         {{{"kv_heads", v.kv_heads, "head", v.head_stride},
                           {"head_dim", v.head_dim, "head_dim", 1},
                           {"page_size", v.page_size, "token", v.token_stride},
                           {"num_pages", v.num_pages, "page", v.page_stride}}});
  if (contents != MemorySpace::host) return;
  if (block_table) {
    for (std::int32_t b = 0; b < v.batch; ++b) {
      const std::int32_t len = v.seq_lens[b];
      KVSIFT_CHECK(len >= 0, where, "{}.seq_lens[{}] (= {}) is negative", name, b, len);
      const std::int64_t pages = (std::int64_t(len) + v.page_size - 1) / v.page_size;
      KVSIFT_CHECK(pages <= v.block_table_stride, where,
                   "{}.block_table_stride (= {}) is smaller than the {} pages of {}.seq_lens[{}] (= {} tokens, "
                   "page_size = {})",
                   name, v.block_table_stride, pages, name, b, len, v.page_size);
      for (std::int64_t i = 0; i < pages; ++i) {
        const std::int64_t at = std::int64_t(b) * v.block_table_stride + i;
        KVSIFT_CHECK(v.page_indices[at] >= 0 && v.page_indices[at] < v.num_pages, where,
                     "{}.page_indices[{}] (= {}, block {} of sequence {}'s block-table row) is outside [0, num_pages "
                     "= {})",
                     name, at, v.page_indices[at], i, b, v.num_pages);
      }
    }
    return;
  }
  KVSIFT_CHECK(v.page_indptr[0] == 0, where, "{}.page_indptr[0] (= {}) must be 0", name, v.page_indptr[0]);
  // Monotonicity first: page_indices is only read within [0, page_indptr[batch]).
  for (std::int32_t b = 0; b < v.batch; ++b) {
    KVSIFT_CHECK(v.page_indptr[b + 1] >= v.page_indptr[b], where, "{}.page_indptr decreases at sequence {} ({} -> {})",
                 name, b, v.page_indptr[b], v.page_indptr[b + 1]);
  }
  for (std::int32_t b = 0; b < v.batch; ++b) {
    const std::int32_t begin = v.page_indptr[b], end = v.page_indptr[b + 1];
    if (v.seq_lens != nullptr) {
      const std::int64_t room = std::int64_t(end - begin) * v.page_size;
      KVSIFT_CHECK(v.seq_lens[b] >= 0 && v.seq_lens[b] <= room, where,
                   "{}.seq_lens[{}] (= {}) is outside [0, its {} pages * page_size = {}]", name, b, v.seq_lens[b],
                   end - begin, room);
    } else if (end > begin) {
      KVSIFT_CHECK(v.last_page_len[b] >= 1 && v.last_page_len[b] <= v.page_size, where,
                   "{}.last_page_len[{}] (= {}) is outside [1, page_size = {}]", name, b, v.last_page_len[b],
                   v.page_size);
    }
    for (std::int32_t i = begin; i < end; ++i) {
      KVSIFT_CHECK(v.page_indices[i] >= 0 && v.page_indices[i] < v.num_pages, where,
                   "{}.page_indices[{}] (= {}, sequence {}) is outside [0, num_pages = {})", name, i,
                   v.page_indices[i], b, v.num_pages);
    }
  }
}

/// Checks the selection's shape against the KV cache (its own fields only, so any memory space). With a row map
/// (AttentionOptions::selection_rows) the selection's batch is its own rows, any number >= 1.
template <KVCacheView KV>
void validate(const SelectionView& s, const KV& kv, const char* where, const char* name,
              const std::int32_t* selection_rows = nullptr) {
  detail::check_pointer(where, name, "indices", s.indices);
  detail::check_pointer(where, name, "counts", s.counts);
  detail::check_positive(where, name, "capacity", s.capacity);
  if (selection_rows != nullptr) {
    detail::check_positive(where, name, "batch (the rows options selection_rows maps into)", s.batch);
  } else {
    KVSIFT_CHECK(s.batch == kv.batch, where, "{}.batch (= {}) != kv.batch (= {})", name, s.batch, kv.batch);
  }
  KVSIFT_CHECK(s.kv_heads == kv.kv_heads, where, "{}.kv_heads (= {}) != kv.kv_heads (= {})", name, s.kv_heads,
               kv.kv_heads);
}

/// Checks a row map's value for batch row b (AttentionOptions::selection_rows): a row of the selection's `rows`.
inline void check_mapped_row(const char* where, const char* name, std::int64_t b, std::int32_t mapped,
                             std::int32_t rows) {
  KVSIFT_CHECK(mapped >= 0 && mapped < rows, where, "options selection_rows[{}] (= {}) is outside [0, {}.batch = {})",
               b, mapped, name, rows);
}

/// Checks the count of one selection row (sequence b, kv head h) against the capacity.
inline void check_selection_count(const char* where, const char* name, std::int64_t b, std::int64_t h,
                                  std::int32_t count, std::int32_t capacity) {
  KVSIFT_CHECK(count >= 0 && count <= capacity, where,
               "{}.counts (= {}) at batch {}, kv_head {} is outside [0, capacity = {}]", name, count, b, h, capacity);
}

/// Sets entry i's bit in `seen` (a bitmap over the row's values, checked in range), refusing a value listed before,
/// naming its first listing; `unit` words the rule ("token", "page").
inline void mark_once(const char* where, const char* name, std::int64_t b, std::int64_t h, const std::int32_t* idx,
                      std::int32_t i, std::span<std::uint64_t> seen, const char* unit) {
  std::uint64_t& word = seen[std::size_t(idx[i]) / 64];
  const std::uint64_t bit = std::uint64_t(1) << (idx[i] % 64);
  if (word & bit) {
    const std::int32_t first = std::int32_t(std::find(idx, idx + i, idx[i]) - idx);
    KVSIFT_CHECK(false, where,
                 "{}.indices[{}] (= {}) at batch {}, kv_head {} repeats {}.indices[{}]: a row lists each {} at most "
                 "once",
                 name, i, idx[i], b, h, name, first, unit);
  }
  word |= bit;
}

/// Checks the entries of one selection row (host memory): every index in [0, seq_len) and outside the
/// attention window (which sparse decode attends anyway) and, when `seen` is given, no index twice. `seen` is
/// a bitmap of at least seq_len bits, all clear; it is cleared again before returning normally. The first
/// offending position is reported.
inline void check_selection_entries(const char* where, const char* name, std::int64_t b, std::int64_t h,
                                    const std::int32_t* idx, std::int32_t count, std::int32_t seq_len,
                                    const AttentionWindow& window = {}, std::span<std::uint64_t> seen = {}) {
  const std::int32_t lo = window.sink_end(seq_len), hi = window.recent_begin(seq_len);
  for (std::int32_t i = 0; i < count; ++i) {
    KVSIFT_CHECK(idx[i] >= 0 && idx[i] < seq_len, where,
                 "{}.indices[{}] (= {}) at batch {}, kv_head {} is outside [0, seq_len = {})", name, i, idx[i], b,
                 h, seq_len);
    KVSIFT_CHECK(idx[i] >= lo && idx[i] < hi, where,
                 "{}.indices[{}] (= {}) at batch {}, kv_head {} is in the attention window (sink [0, {}), recent "
                 "[{}, {})), which is attended without being selected",
                 name, i, idx[i], b, h, lo, hi, seq_len);
    if (!seen.empty()) mark_once(where, name, b, h, idx, i, seen, "token");
  }
  for (std::int32_t i = 0; i < count && !seen.empty(); ++i) seen[std::size_t(idx[i]) / 64] = 0;
}

/// A page-level selection's row (AttentionOptions::selection_page_size > 1): page ids, each within the sequence's
/// pages [0, ceil(seq_len / page_size)) and, with `seen` (a clear bitmap of at least that many bits, cleared again
/// on return), listed once. Pages holding window tokens are allowed: the kernels attend only their middle tokens.
inline void check_page_entries(const char* where, const char* name, std::int64_t b, std::int64_t h,
                               const std::int32_t* idx, std::int32_t count, std::int32_t seq_len,
                               std::int32_t page_size, std::span<std::uint64_t> seen = {}) {
  const std::int32_t pages = std::int32_t((std::int64_t(seq_len) + page_size - 1) / page_size);
  for (std::int32_t i = 0; i < count; ++i) {
    KVSIFT_CHECK(idx[i] >= 0 && idx[i] < pages, where,
                 "{}.indices[{}] (= {}) at batch {}, kv_head {} is outside the sequence's pages [0, {}) (page_size "
                 "{}, seq_len {})",
                 name, i, idx[i], b, h, pages, page_size, seq_len);
    if (!seen.empty()) mark_once(where, name, b, h, idx, i, seen, "page");
  }
  for (std::int32_t i = 0; i < count && !seen.empty(); ++i) seen[std::size_t(idx[i]) / 64] = 0;
}

/// Checks every count and index of a selection in host memory against the cache's sequence lengths and the
/// attention window (tokens), or the sequences' pages (page_size > 1: AttentionOptions::selection_page_size),
/// and, with `refuse_duplicates`, that no row lists a token (page) twice (allocates a bitmap of the longest
/// sequence). Rows that attend every token (SelectionView::attend_all) are skipped: their count and indices are
/// not read. With a row map (AttentionOptions::selection_rows, host memory too) batch row b's checks apply to
/// selection row selection_rows[b], which must lie in [0, s.batch).
template <KVCacheView KV>
void check_selection_contents(const SelectionView& s, const KV& kv, const char* where, const char* name,
                              bool refuse_duplicates, const AttentionWindow& window = {}, std::int32_t page_size = 1,
                              const std::int32_t* selection_rows = nullptr) {
  std::vector<std::uint64_t> seen;
  if (refuse_duplicates) {
    std::int32_t longest = 0;
    for (std::int32_t b = 0; b < kv.batch; ++b) longest = std::max(longest, kv.seq_len(b));
    seen.assign(std::size_t(longest) / 64 + 1, 0);
  }
  for (std::int32_t b = 0; b < kv.batch; ++b) {
    if (selection_rows != nullptr) check_mapped_row(where, name, b, selection_rows[b], s.batch);
    const std::int64_t r = attended_selection_row(selection_rows, b, s.batch);
    for (std::int32_t h = 0; h < s.kv_heads; ++h) {
      if (s.attend_all != nullptr && s.attend_all[s.row_index(r, h)] != 0) continue;
      const std::int32_t count = s.count(r, h);
      check_selection_count(where, name, b, h, count, s.capacity);
      if (page_size > 1) {
        check_page_entries(where, name, b, h, s.row(r, h), count, kv.seq_len(b), page_size, seen);
      } else {
        check_selection_entries(where, name, b, h, s.row(r, h), count, kv.seq_len(b), window, seen);
      }
    }
  }
}

/// Dense decode attends every token: a window, selection pages or a selection row map there is a caller's mistake,
/// refused.
inline void check_no_window(const char* where, const AttentionOptions& options) {
  KVSIFT_CHECK(options.window.empty(), where,
               "options window (sink = {}, recent = {}) applies to sparse decode; dense decode attends every token",
               options.window.sink, options.window.recent);
  KVSIFT_CHECK(options.selection_page_size == 1, where,
               "options selection_page_size (= {}) applies to sparse decode; dense decode attends every token",
               options.selection_page_size);
  KVSIFT_CHECK(options.selection_rows == nullptr, where,
               "options selection_rows (a row map) applies to sparse decode; dense decode has no selection");
}

/// What a selection entry names: a token (1) or a page of that many tokens.
inline void check_selection_page_size(const char* where, const char* name, std::int32_t page_size) {
  KVSIFT_CHECK(page_size >= 1, where, "{} (= {}) must be >= 1 (1: selections list tokens)", name, page_size);
}

/// A window's sizes are token counts.
inline void validate(const AttentionWindow& window, const char* where, const char* name) {
  KVSIFT_CHECK(window.sink >= 0 && window.recent >= 0, where, "{}.sink (= {}) and {}.recent (= {}) must be >= 0", name,
               window.sink, name, window.recent);
}

/// The query-versus-cache rules of decode attention: same batch and head_dim, q_heads a multiple of kv_heads.
template <class TQ, KVCacheView KV>
void check_query_matches_kv(const char* where, const QueryView<TQ>& q, const KV& kv) {
  KVSIFT_CHECK(kv.head_dim == q.head_dim, where, "kv.head_dim (= {}) != q.head_dim (= {})", kv.head_dim,
               q.head_dim);
  KVSIFT_CHECK(kv.batch == q.batch, where, "kv.batch (= {}) != q.batch (= {})", kv.batch, q.batch);
  KVSIFT_CHECK(q.heads % kv.kv_heads == 0, where, "q.heads (= {}) is not a multiple of kv.kv_heads (= {})", q.heads,
               kv.kv_heads);
}

/// An attention output has the query's shape.
template <class TQ, class TO>
void check_output_matches_query(const char* where, const QueryView<TQ>& q, const StateView<TO>& out) {
  KVSIFT_CHECK(out.batch == q.batch && out.heads == q.heads && out.head_dim == q.head_dim, where,
               "out shape [{}, {}, {}] != q shape [{}, {}, {}]", out.batch, out.heads, out.head_dim, q.batch, q.heads,
               q.head_dim);
}

/// All cross-view rules of decode attention.
template <class TQ, KVCacheView KV, class TO>
void check_decode_shapes(const char* where, const QueryView<TQ>& q, const KV& kv, const StateView<TO>& out) {
  check_query_matches_kv(where, q, kv);
  check_output_matches_query(where, q, out);
}

inline void validate(const RopeConfig& rope, std::int32_t head_dim, const char* where) {
  const std::int32_t r = rope.resolved_rotary_dim(head_dim);
  KVSIFT_CHECK(rope.theta > 1.0, where, "rope.theta (= {}) must exceed 1", rope.theta);
  KVSIFT_CHECK(r > 0 && r <= head_dim && r % 2 == 0, where, "rope.rotary_dim (= {}) must be even and in [2, head_dim = {}]",
               r, head_dim);
}

/// The rules of every LSE merge: at least one partial, every partial and the output valid and of one shape.
template <class TI, class TO>
void validate_merge_inputs(const char* where, std::span<const StateView<const TI>> partials, const StateView<TO>& out) {
  KVSIFT_CHECK(!partials.empty(), where, "partials is empty");
  validate(out, where, "out");
  for (std::size_t i = 0; i < partials.size(); ++i) {
    validate(partials[i], where, "partials[i]");
    KVSIFT_CHECK(partials[i].batch == out.batch && partials[i].heads == out.heads &&
                     partials[i].head_dim == out.head_dim,
                 where, "partials[{}] shape [{}, {}, {}] != out shape [{}, {}, {}]", i, partials[i].batch,
                 partials[i].heads, partials[i].head_dim, out.batch, out.heads, out.head_dim);
  }
}

}  // namespace kvsift
