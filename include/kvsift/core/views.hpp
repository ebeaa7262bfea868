#pragma once
/// Non-owning views of the tensors kvsift reads and writes. Strides are in elements, head_dim is always the
/// contiguous (stride 1) dimension. A view does not say where its memory lives: a CPU function reads host
/// memory, a CUDA function device memory; each function's documentation says which.
///
/// All views are POD aggregates usable on host and device. Build them with designated initializers or the
/// `packed` helpers, then pass them by value.

#include <concepts>
#include <cstdint>
#include <type_traits>

#include "kvsift/core/config.hpp"

namespace kvsift {

/// One vector per (sequence, head): [batch, heads, head_dim]. Used for decode queries (heads = q_heads), the
/// new token's K or V (heads = kv_heads), and attention outputs.
template <class T>
struct HeadsView {
  T* data = nullptr;
  std::int32_t batch = 0;
  std::int32_t heads = 0;
  std::int32_t head_dim = 0;
  std::int64_t batch_stride = 0;
  std::int64_t head_stride = 0;

  KVSIFT_HOST_DEVICE T* row(std::int64_t b, std::int64_t h) const { return data + b * batch_stride + h * head_stride; }

  static constexpr HeadsView packed(T* data, std::int32_t batch, std::int32_t heads, std::int32_t head_dim) {
    return {data, batch, heads, head_dim, std::int64_t{heads} * head_dim, head_dim};
  }
};

/// A row-major matrix [rows, cols] with a row stride (elements): vectors to score, cluster or gather.
template <class T>
struct MatrixView {
  T* data = nullptr;
  std::int64_t rows = 0;
  std::int32_t cols = 0;
  std::int64_t row_stride = 0;

  KVSIFT_HOST_DEVICE T* row(std::int64_t i) const { return data + i * row_stride; }

  static constexpr MatrixView packed(T* data, std::int64_t rows, std::int32_t cols) { return {data, rows, cols, cols}; }
};

/// P problems of [rows, cols] each: row i of problem p at data + p * problem_stride + i * row_stride (elements;
/// cols is the contiguous dimension). Both strides are free, so the subspace columns of a query matrix
/// [n, heads * head_dim] are problems without a copy (batched k-means): problem (head h, subspace s) of width w
/// starts at column h * head_dim + s * w, i.e. problem_stride = w when problems enumerate (h, s) in order,
/// row_stride = heads * head_dim. A HeadsView's vectors are one too: problem h, row b (the RoPE kernel's rows).
template <class T>
struct BatchedMatrixView {
  T* data = nullptr;
  std::int32_t problems = 0;
  std::int64_t rows = 0;
  std::int32_t cols = 0;
  std::int64_t problem_stride = 0;
  std::int64_t row_stride = 0;

  KVSIFT_HOST_DEVICE T* row(std::int64_t p, std::int64_t i) const { return data + p * problem_stride + i * row_stride; }
  KVSIFT_HOST_DEVICE MatrixView<T> problem(std::int64_t p) const { return {data + p * problem_stride, rows, cols, row_stride}; }

  static constexpr BatchedMatrixView packed(T* data, std::int32_t problems, std::int64_t rows, std::int32_t cols) {
    return {data, problems, rows, cols, rows * cols, cols};
  }
};

/// Decode query: one token per sequence, [batch, q_heads, head_dim].
template <class T>
using QueryView = HeadsView<T>;

/// Many tokens per (sequence, head): [batch, heads, tokens, head_dim]. Used for prefill queries.
template <class T>
struct SequenceView {
  T* data = nullptr;
  std::int32_t batch = 0;
  std::int32_t heads = 0;
  std::int32_t tokens = 0;
  std::int32_t head_dim = 0;
  std::int64_t batch_stride = 0;
  std::int64_t head_stride = 0;
  std::int64_t token_stride = 0;

  KVSIFT_HOST_DEVICE T* row(std::int64_t b, std::int64_t h, std::int64_t t) const {
    return data + b * batch_stride + h * head_stride + t * token_stride;
  }

  static constexpr SequenceView packed(T* data, std::int32_t batch, std::int32_t heads, std::int32_t tokens,
                                       std::int32_t head_dim) {
    return {data,  batch, heads, tokens, head_dim, std::int64_t{heads} * tokens * head_dim,
            std::int64_t{tokens} * head_dim, head_dim};
  }
};

/// Contiguous KV cache: K and V each [batch, kv_heads, capacity, head_dim] with the same strides.
/// Sequence b holds tokens [0, seq_lens[b]); with seq_lens == nullptr every sequence holds `capacity` tokens.
template <class T>
struct ContiguousKVView {
  T* k = nullptr;
  T* v = nullptr;
  const std::int32_t* seq_lens = nullptr;
  std::int32_t batch = 0;
  std::int32_t kv_heads = 0;
  std::int32_t capacity = 0;
  std::int32_t head_dim = 0;
  std::int64_t batch_stride = 0;
  std::int64_t head_stride = 0;
  std::int64_t token_stride = 0;

  KVSIFT_HOST_DEVICE std::int32_t seq_len(std::int64_t b) const { return seq_lens ? seq_lens[b] : capacity; }
  KVSIFT_HOST_DEVICE std::int64_t offset(std::int64_t b, std::int64_t h, std::int64_t t) const {
    return b * batch_stride + h * head_stride + t * token_stride;
  }
  KVSIFT_HOST_DEVICE T* k_row(std::int64_t b, std::int64_t h, std::int64_t t) const { return k + offset(b, h, t); }
  KVSIFT_HOST_DEVICE T* v_row(std::int64_t b, std::int64_t h, std::int64_t t) const { return v + offset(b, h, t); }

  static constexpr ContiguousKVView packed(T* k, T* v, std::int32_t batch, std::int32_t kv_heads,
                                           std::int32_t capacity, std::int32_t head_dim,
                                           const std::int32_t* seq_lens = nullptr) {
    return {k,        v,        seq_lens, batch, kv_heads, capacity, head_dim, std::int64_t{kv_heads} * capacity * head_dim,
            std::int64_t{capacity} * head_dim, head_dim};
  }  /// The same cache, read-only.
  constexpr ContiguousKVView<const T> as_const() const
    requires(!std::is_const_v<T>)
  {
    return {k, v, seq_lens, batch, kv_heads, capacity, head_dim, batch_stride, head_stride, token_stride};
  }
};

/// How a page (a vLLM block) orders its tokens and kv heads: NHD [page_size, kv_heads, head_dim] (token-major) or
/// HND [kv_heads, page_size, head_dim] (head-major).
enum class PageLayout : std::uint8_t { nhd, hnd };

/// Paged KV cache: pages of page_size tokens, K and V in page arrays of the same strides. Token t of sequence b,
/// kv head h, lives at pages + page * page_stride + (t % page_size) * token_stride + h * head_stride, with
/// page = page_indices[first_page(b) + t / page_size]. Strides in elements, head_dim contiguous:
/// - NHD pages [num_pages, page_size, kv_heads, head_dim]: token_stride = kv_heads * head_dim, head_stride =
///   head_dim, page_stride = page_size * kv_heads * head_dim;
/// - HND pages [num_pages, kv_heads, page_size, head_dim]: head_stride = page_size * head_dim, token_stride =
///   head_dim, page_stride as NHD's;
/// - K and V interleaved per page ([num_pages, 2, page ...]): v_pages = k_pages + one page's elements and
///   page_stride twice a page's elements.
///
/// The page table takes one of two forms, told apart by block_table_stride:
/// - CSR, FlashInfer's (block_table_stride == 0): sequence b owns pages page_indices[page_indptr[b] ..
///   page_indptr[b+1]); all are full except the last, which holds last_page_len[b] tokens (1..page_size). A
///   sequence with no pages holds no tokens.
/// - Block table, vLLM's (block_table_stride > 0): page_indices is a row-major [batch, block_table_stride] table
///   (vLLM's block_tables [batch, max_num_blocks_per_seq], int32) and sequence b's pages are its row, from
///   page_indices + b * block_table_stride. Only the first ceil(seq_len(b) / page_size) entries of a row are read;
///   the rest may hold anything. seq_lens is required; page_indptr and last_page_len are not read (may be null).
/// seq_lens [batch] (vLLM's seq_lens, the step's new token counted), when set, in either form: seq_len(b) =
/// seq_lens[b], and last_page_len is not read. In the CSR form it must fit the sequence's pages.
///
/// vLLM's caches, all with block_tables and seq_lens as above (vllm() and vllm_interleaved() build the views):
/// - NHD, K and V separate (its FlashAttention backend): key_cache and value_cache, each [num_blocks, block_size,
///   num_kv_heads, head_size];
/// - NHD, K and V interleaved (its FlashInfer backend): kv_cache [num_blocks, 2, block_size, num_kv_heads,
///   head_size];
/// - HND: [num_blocks, num_kv_heads, block_size, head_size] per K and V (interleaved: [num_blocks, 2, num_kv_heads,
///   block_size, head_size]).
template <class T>
struct PagedKVView {
  T* k_pages = nullptr;
  T* v_pages = nullptr;
  const std::int32_t* page_indptr = nullptr;    ///< CSR: [batch + 1], page_indptr[0] == 0, non-decreasing
  /// CSR: [page_indptr[batch]], each in [0, num_pages). Block table: [batch, block_table_stride], each used entry in
  /// [0, num_pages).
  const std::int32_t* page_indices = nullptr;
  const std::int32_t* last_page_len = nullptr;  ///< CSR without seq_lens: [batch]
  std::int32_t batch = 0;
  std::int32_t kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t page_size = 0;
  std::int32_t num_pages = 0;
  std::int64_t page_stride = 0;
  std::int64_t token_stride = 0;
  std::int64_t head_stride = 0;
  /// 0: the CSR form; > 0: page_indices is a block table of this many entries per sequence (its row stride).
  std::int64_t block_table_stride = 0;
  /// Optional in the CSR form, required in the block-table form: [batch] each sequence's length.
  const std::int32_t* seq_lens = nullptr;

  KVSIFT_HOST_DEVICE bool is_block_table() const { return block_table_stride > 0; }
  KVSIFT_HOST_DEVICE std::int32_t seq_len(std::int64_t b) const {
    if (seq_lens != nullptr) return seq_lens[b];
    const std::int32_t pages = page_indptr[b + 1] - page_indptr[b];
    return pages == 0 ? 0 : (pages - 1) * page_size + last_page_len[b];
  }
  /// The position in page_indices of sequence b's first page.
  KVSIFT_HOST_DEVICE std::int64_t first_page(std::int64_t b) const {
    return block_table_stride > 0 ? b * block_table_stride : std::int64_t(page_indptr[b]);
  }
  /// The page-table entries sequence b may use: its block-table row, or its CSR pages.
  KVSIFT_HOST_DEVICE std::int64_t page_entries(std::int64_t b) const {
    return block_table_stride > 0 ? block_table_stride : std::int64_t(page_indptr[b + 1]) - page_indptr[b];
  }
  KVSIFT_HOST_DEVICE std::int64_t offset(std::int64_t b, std::int64_t h, std::int64_t t) const {
    const std::int64_t page = page_indices[first_page(b) + t / page_size];
    return page * page_stride + (t % page_size) * token_stride + h * head_stride;
  }
  KVSIFT_HOST_DEVICE T* k_row(std::int64_t b, std::int64_t h, std::int64_t t) const { return k_pages + offset(b, h, t); }
  KVSIFT_HOST_DEVICE T* v_row(std::int64_t b, std::int64_t h, std::int64_t t) const { return v_pages + offset(b, h, t); }

  /// Sequence b alone, as a view of batch 1 over the same pages, in the same form. In the CSR form its
  /// page_indptr is page_indptr + b, whose first entry is page_indptr[b], not 0: its rows and length are
  /// sequence b's, but validate() refuses it (give it a page_indptr {0, pages} of its own where it is validated).
  constexpr PagedKVView sequence(std::int64_t b) const {
    PagedKVView v = *this;
    if (block_table_stride > 0) {
      v.page_indices += b * block_table_stride;
    } else {
      v.page_indptr += b;
    }
    if (v.last_page_len != nullptr) v.last_page_len += b;
    if (v.seq_lens != nullptr) v.seq_lens += b;
    v.batch = 1;
    return v;
  }

  /// vLLM's paged cache, K and V in separate tensors: key_cache and value_cache [num_blocks, block_size,
  /// num_kv_heads, head_size] (NHD) or [num_blocks, num_kv_heads, block_size, head_size] (HND), block_tables
  /// [batch, max_blocks_per_seq] and seq_lens [batch] (int32, the step's token counted), all packed.
  static constexpr PagedKVView vllm(T* key_cache, T* value_cache, const std::int32_t* block_tables,
                                    const std::int32_t* seq_lens, std::int32_t batch, std::int32_t max_blocks_per_seq,
                                    std::int32_t num_blocks, std::int32_t block_size, std::int32_t kv_heads,
                                    std::int32_t head_dim, PageLayout layout = PageLayout::nhd) {
    const std::int64_t page = std::int64_t(block_size) * kv_heads * head_dim;
    const bool hnd = layout == PageLayout::hnd;
    return {.k_pages = key_cache,
            .v_pages = value_cache,
            .page_indptr = nullptr,
            .page_indices = block_tables,
            .last_page_len = nullptr,
            .batch = batch,
            .kv_heads = kv_heads,
            .head_dim = head_dim,
            .page_size = block_size,
            .num_pages = num_blocks,
            .page_stride = page,
            .token_stride = hnd ? std::int64_t(head_dim) : std::int64_t(kv_heads) * head_dim,
            .head_stride = hnd ? std::int64_t(block_size) * head_dim : std::int64_t(head_dim),
            .block_table_stride = max_blocks_per_seq,
            .seq_lens = seq_lens};
  }
  /// vLLM's paged cache with K and V interleaved per block (its FlashInfer backend): kv_cache [num_blocks, 2,
  /// block_size, num_kv_heads, head_size] (NHD) or [num_blocks, 2, num_kv_heads, block_size, head_size] (HND);
  /// block_tables and seq_lens as vllm()'s.
  static constexpr PagedKVView vllm_interleaved(T* kv_cache, const std::int32_t* block_tables,
                                                const std::int32_t* seq_lens, std::int32_t batch,
                                                std::int32_t max_blocks_per_seq, std::int32_t num_blocks,
                                                std::int32_t block_size, std::int32_t kv_heads, std::int32_t head_dim,
                                                PageLayout layout = PageLayout::nhd) {
    const std::int64_t page = std::int64_t(block_size) * kv_heads * head_dim;
    T* value_cache = kv_cache != nullptr ? kv_cache + page : nullptr;
    PagedKVView view = vllm(kv_cache, value_cache, block_tables, seq_lens, batch, max_blocks_per_seq, num_blocks,
                            block_size, kv_heads, head_dim, layout);
    view.page_stride = 2 * page;
    return view;
  }

  /// The same cache, read-only.
  constexpr PagedKVView<const T> as_const() const
    requires(!std::is_const_v<T>)
  {
    return {k_pages,   v_pages,   page_indptr, page_indices, last_page_len, batch,      kv_heads,
            head_dim,  page_size, num_pages,   page_stride,  token_stride,  head_stride, block_table_stride,
            seq_lens};
  }
};

/// Either KV cache layout; algorithms are written once against this concept.
template <class V>
concept KVCacheView = requires(const V& view, std::int64_t i) {
  { view.seq_len(i) } -> std::convertible_to<std::int32_t>;
  view.k_row(i, i, i);
  view.v_row(i, i, i);
  { view.batch } -> std::convertible_to<std::int32_t>;
  { view.kv_heads } -> std::convertible_to<std::int32_t>;
  { view.head_dim } -> std::convertible_to<std::int32_t>;
};

template <class V>
using kv_element_t = std::remove_const_t<std::remove_pointer_t<decltype(V{}.k_row(0, 0, 0))>>;

/// The tokens chosen for one decode step: per (sequence, kv head) `counts[b * kv_heads + h]` token indices
/// (absolute positions, 0 <= index < seq_len, never re-indexed) in indices[(b * kv_heads + h) * capacity + i],
/// optionally with a natural-log weight per index that is added to that token's scaled logit (sm_scale * q.k +
/// w; a compressed source's merged rows carry log n_t, CentroidKV's degrees: a row of weight log 2 weighs as
/// that row attended twice). Indices within a row are distinct (validation modes refuse a repeat and a token
/// of the attention window); kvsift's selectors write them in ascending order, and the attention kernels
/// accept any order.
struct SelectionView {
  std::int32_t* indices = nullptr;  ///< [batch, kv_heads, capacity]
  /// [batch, kv_heads], each in [0, capacity]. A count outside that range marks the row bad: primitives write
  /// -1 where they meet a device value the host cannot see (a length past the capacity, a bad slot). Sparse
  /// decode (CPU, CUDA, hybrid) then writes NaN to O and LSE of every query head of that kv head, attending
  /// nothing, not even the window; validation modes refuse such a row by name instead.
  std::int32_t* counts = nullptr;
  float* log_weights = nullptr;     ///< optional [batch, kv_heads, capacity]; nullptr means all 0
  std::int32_t batch = 0;
  std::int32_t kv_heads = 0;
  std::int32_t capacity = 0;
  /// Optional [batch, kv_heads]; nullptr means all 0. A nonzero entry makes that row attend every token
  /// [0, seq_len) of its sequence once (the attention window's tokens too, once): its count, indices and
  /// log-weights are ignored, not read. SpeContext needs it while a sequence is shorter than its budget.
  /// Same memory as the other arrays (device memory on CUDA, host memory on the CPU).
  const std::uint8_t* attend_all = nullptr;

  KVSIFT_HOST_DEVICE std::int64_t row_index(std::int64_t b, std::int64_t h) const { return b * kv_heads + h; }
  KVSIFT_HOST_DEVICE std::int32_t* row(std::int64_t b, std::int64_t h) const {
    return indices + row_index(b, h) * capacity;
  }
  KVSIFT_HOST_DEVICE float* weights_row(std::int64_t b, std::int64_t h) const {
    return log_weights ? log_weights + row_index(b, h) * capacity : nullptr;
  }
  KVSIFT_HOST_DEVICE std::int32_t count(std::int64_t b, std::int64_t h) const { return counts[row_index(b, h)]; }
};

/// An attention state: output O [batch, heads, head_dim] and its log-sum-exp LSE [batch, heads], natural
/// log of the softmax denominator over the attended tokens (logits already scaled). An empty state (nothing
/// attended) has LSE = -inf and O = 0.
template <class T>
struct StateView {
  using lse_type = std::conditional_t<std::is_const_v<T>, const float, float>;
  T* o = nullptr;
  lse_type* lse = nullptr;
  std::int32_t batch = 0;
  std::int32_t heads = 0;
  std::int32_t head_dim = 0;
  std::int64_t o_batch_stride = 0;
  std::int64_t o_head_stride = 0;
  std::int64_t lse_batch_stride = 0;

  KVSIFT_HOST_DEVICE T* o_row(std::int64_t b, std::int64_t h) const { return o + b * o_batch_stride + h * o_head_stride; }
  KVSIFT_HOST_DEVICE lse_type& lse_at(std::int64_t b, std::int64_t h) const { return lse[b * lse_batch_stride + h]; }

  static constexpr StateView packed(T* o, lse_type* lse, std::int32_t batch, std::int32_t heads,
                                    std::int32_t head_dim) {
    return {o, lse, batch, heads, head_dim, std::int64_t{heads} * head_dim, head_dim, heads};
  }
  /// The same state, read-only (for passing an output on as a merge input).
  constexpr StateView<const T> as_const() const
    requires(!std::is_const_v<T>)
  {
    return {o, lse, batch, heads, head_dim, o_batch_stride, o_head_stride, lse_batch_stride};
  }
};

}  // namespace kvsift
