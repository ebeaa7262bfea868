#pragma once
/// SpeContext (its §3-4): one selection per decode step, made before the model's layers run, from a retrieval
/// head (EAGLE-3's draft layer pruned to its embedding and Q/K projections; the head model itself stays outside
/// kvsift), used by every layer (selectors/specontext/step.hpp). docs/specontext.md has the design and the choices the
/// paper leaves open.
///
/// Inputs are the head's vectors before RoPE: prepare takes every prompt key k_r [batch, kv_heads, n, head_dim]
/// (PrefillInputs::k_pre_rope), append the step's key k_r [batch, kv_heads, head_dim] (AppendInputs::k_pre_rope),
/// select the step's query q_r [batch, q_heads, head_dim] (SelectInputs::q: the head's, not a layer's, and
/// pre-RoPE). kvsift rotates them with the head's RoPE (config.rope: YaRN with its factor for a draft model
/// trained at 2K, specontext_yarn_rope) at the token's position (key t at t, the step's query and key at
/// lengths[b] - 1), keeps the rotated keys, and scores. The head's q_heads and kv_heads are the model's (the
/// limits): every view is checked against them, by name.
///
/// Score and selection: OracleTopK over the head's K cache with the rotated query (composed, not copied): token t
/// of kv head g scores the largest softmax weight exp(s - LSE_h), s = sm_scale * q_r,h . k_r,t, any query head h of
/// g's group gives it; the best `budget` (B, 2048) of the middle tokens (the attention window's tokens are the
/// kernel's; ties: the smaller index) per (sequence, kv head); a middle of at most B tokens is taken whole (the
/// paper's "everything while S <= B"). SpeContextMode::batch_level (kvsift's choice, for comparison; the paper
/// does not say): one set per sequence, the top B of the maximum over all of its kv heads' rows (each the max over
/// its group's query heads: the max over all query heads), copied to every kv head's row.
///
/// The head's K cache, one of:
/// - owned (SpeContextHeadCache::owned, the default): [max_slots, kv_heads, max_tokens, head_dim] in T in the
///   context's memory (256 MiB per 128K-token slot at 8 kv heads, head_dim 128, bf16). The inputs' `cache` is then
///   read only for the sequences' lengths (any of the model's layer caches: they all count the step's token).
///   Batch row b reaches slot slots[b] through a paged view whose page table is the step's slots, one page of
///   max_tokens rows per slot (selector.hpp's pattern for per-slot stores).
/// - kept by the engine (SpeContextHeadCache::engine): the inputs' `cache` is the head's K cache, contiguous or
///   paged like the engine's other caches (its V pointers may alias K: V is never read); prepare and append write
///   the rotated keys into it (prepare at the prompt's positions, append at seq_len(b) - 1: the engine has grown
///   its lengths or page table to count the step's token), the one place a selector writes into a view the
///   inputs hand it read-only. The engine's page allocator then owns the head's memory as it owns the layers'.
///
/// The current token: the head scores it like any other, but the step attends it through its window, whose
/// recent part is at least 1 (specontext_window), and the selection leaves the window out, so it is attended
/// exactly once whether or not the head ranks it.
///
/// Memory and calls. prepare allocates a staging array of one prompt's rotated keys (kv_heads * n * head_dim
/// elements of T) and reads lengths and slots on the host (CUDA: synchronizes). append and select allocate nothing
/// and never synchronize; their scratch is the caller's workspace: append: the step's rotated keys [batch,
/// kv_heads, head_dim]; select: the rotated queries [batch, q_heads, head_dim], then OracleTopK's scratch
/// (per_kv_head), or the scores [batch * kv_heads, N] and [batch, N] fp32, a [batch, B] selection and
/// group_scores' and topk_rows' scratch (batch_level); N = min(max_seq_len, max_tokens). A length past N gets count
/// -1 on CUDA and is refused on the CPU (topk_rows). A length past max_tokens is refused on the CPU (RoPE and the
/// cache view). On CUDA lengths and slots are trusted, as the decode step trusts them; a length past max_tokens is
/// contained: append's write skips that row (the head cache's view fails KVCache::seq_len_fits), its RoPE position
/// is past the table (NaN) and select gives it count -1, other rows untouched. A slot outside [0, max_slots) is
/// not: append writes the step's key into page slots[b], outside the owned array (check slots while integrating).
/// The RoPE table holds max_tokens positions (4 * rotary_dim bytes each: 64 MiB at 128K and head_dim 128).
///
/// Written once for both backends (include cpu/backend.hpp or cuda/backend.hpp before instantiating it). CPU and
/// CUDA pick the same tokens except among candidates whose fp32 scores differ by less than the backends' rounding
/// (OracleTopK's statement). The rotations share their arithmetic (core/rope.hpp) but each backend builds its table
/// with its own fp64 cos/sin and inverse frequencies: an entry may differ by an fp32 ulp, so a rotated element
/// may differ by one ulp of T (rarely: under 1% of them in the tests).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string_view>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/copy_heads.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/detail/selector_core.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

/// Which rows share a selection.
enum class SpeContextMode : std::uint8_t {
  per_kv_head,  ///< the top B per (sequence, kv head) of its group's max softmax weight (the paper)
  batch_level,  ///< one top B per sequence of the max over all of its query heads, copied to every kv head's row
};

/// Where the retrieval head's rotated keys live.
enum class SpeContextHeadCache : std::uint8_t {
  owned,   ///< the selector's [max_slots, kv_heads, max_tokens, head_dim] array
  engine,  ///< the inputs' cache (the engine keeps it, contiguous or paged)
};

struct SpeContextConfig {
  std::int32_t budget = 2048;  ///< B: middle tokens selected per (sequence, kv head), besides the window
  SpeContextMode mode = SpeContextMode::per_kv_head;
  SpeContextHeadCache head_cache = SpeContextHeadCache::owned;
  RopeConfig rope{};           ///< the head's RoPE (specontext_yarn_rope for the paper's YaRN-extended draft)
  float sm_scale = 0.0f;       ///< the head's logit scale; 0: 1/sqrt(head_dim)
};

/// The head's RoPE as the paper extends its 2K-context draft model: YaRN with `factor` over
/// `original_max_position_embeddings`, HF's defaults for the rest (beta_fast 32, beta_slow 1, attention factor
/// 0.1 ln(factor) + 1).
inline RopeConfig specontext_yarn_rope(double theta, double factor, std::int32_t original_max_position_embeddings) {
  RopeConfig rope{.theta = theta};
  rope.scaling = {.kind = RopeScaling::yarn, .factor = factor,
                  .original_max_position_embeddings = original_max_position_embeddings};
  return rope;
}

/// The window the layers attend with a SpeContext selection: `window` (0 + 0, the paper's, or 4 + 64) with at
/// least the current token as its recent part, so the step's own token is always attended, once.
constexpr AttentionWindow specontext_window(AttentionWindow window) {
  window.recent = std::max(window.recent, 1);
  return window;
}

template <class T, class Context>
class SpeContext : public SelectorTypes<T, Context>, public detail::SelectorCore<"SpeContext"> {
 public:
  /// Builds the head's RoPE table (max_tokens positions) and, when owned, its K cache. Refused: limits as every
  /// selector's; budget <= 0 or above max_tokens; an unknown mode or cache kind; a negative sm_scale; a RoPE whose
  /// rotary_dim is odd or above head_dim.
  SpeContext(const SelectorLimits& limits, const SpeContextConfig& config, const Context& ctx)
      : SelectorCore(limits), config_(checked(limits, config)), oracle_(limits, {.budget = config.budget}) {
    const std::int32_t d = limits.head_dim;
    cos_.resize(std::size_t(RopeTableView::elements(config.rope, d, limits.max_tokens)));
    sin_.resize(cos_.size());
    table_ = RopeTableView::make(config.rope, d, limits.max_tokens, cos_.data(), sin_.data());
    build_rope_table(config.rope, table_, ctx);
    if (config.head_cache == SpeContextHeadCache::owned) {
      keys_.resize(std::size_t(limits.max_slots) * std::size_t(limits.kv_heads) * std::size_t(limits.max_tokens) *
                   std::size_t(d));
    }
    // One page per batch row: page_indptr[b] = b. Last, and synchronizing (copy_from_host waits for its stream):
    // the table is built when the constructor returns, whatever stream the selector later runs on.
    std::vector<std::int32_t> iota(std::size_t(limits.max_slots) + 1);
    std::iota(iota.begin(), iota.end(), 0);
    page_indptr_.resize(iota.size());
    copy_from_host(iota.data(), iota.size(), page_indptr_.data(), ctx);
  }

  // Move-only: table_ points into the selector's own arrays (a move keeps them; a copy would not).
  SpeContext(const SpeContext&) = delete;
  SpeContext& operator=(const SpeContext&) = delete;
  SpeContext(SpeContext&&) noexcept = default;
  SpeContext& operator=(SpeContext&&) noexcept = default;

  std::string_view name() const { return "SpeContext"; }
  const SpeContextConfig& config() const { return config_; }
  std::int32_t capacity() const { return config_.budget; }
  /// The head's K cache (when owned) and RoPE table.
  IndexBytes index_bytes() const {
    const std::size_t total = keys_.size() * sizeof(T) + (cos_.size() + sin_.size()) * sizeof(float) +
                              page_indptr_.size() * sizeof(std::int32_t);
    return detail::context_index_bytes<Context>(total);
  }

  std::size_t select_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return planned_select_bytes(
        shape, [&](WorkspaceLayout& counting, std::int32_t tokens) { select_layout(counting, shape, tokens, ctx); });
  }
  std::size_t append_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return layout_bytes<"append_workspace_bytes">(
        shape, [&](WorkspaceLayout& counting) { append_layout(counting, shape.batch, ctx); });
  }

  /// Rotates every prompt key k_r of the joining sequences (in.k_pre_rope, required) to its position and stores
  /// it in the head's cache: the slot's (owned) or in.cache (engine). Lengths come from in.cache. Refused, before
  /// any slot changes: no k_pre_rope, one of another shape or shorter than a prompt, a prompt above max_tokens, a
  /// slot outside [0, max_slots). Allocates its staging; on CUDA synchronizes the stream.
  void prepare(const PrefillInputs<T>& in, const Context& ctx) {
    constexpr const char* where = entry_point<"prepare">();
    const std::int32_t batch = detail::check_cache(where, limits_, in.cache, in.slots, Context::memory);
    const std::int32_t kv = limits_.kv_heads, d = limits_.head_dim;
    const auto rows = std::size_t(batch);
    ContextArray<Context, std::int32_t> context_lengths(rows);
    const auto [lengths, slots] =
        detail::read_prefill_rows(where, limits_, in.cache, in.slots, context_lengths.data(), ctx);
    const std::int32_t longest = *std::max_element(lengths.begin(), lengths.end());
    const SequenceView<const T>& k = in.k_pre_rope;
    KVSIFT_CHECK(k.data != nullptr, where, "in.k_pre_rope (the retrieval head's prompt keys before RoPE) must be given");
    validate(k, where, "in.k_pre_rope");
    KVSIFT_CHECK(k.batch == batch && k.heads == kv && k.head_dim == d && k.tokens >= longest, where,
                 "in.k_pre_rope is [{}, {}, {}, {}]; expected [batch = {}, kv_heads = {}, >= {} tokens, head_dim = {}]",
                 k.batch, k.heads, k.tokens, k.head_dim, batch, kv, longest, d);
    // Nothing is refused past this point: the slots hold their sequences (the scorer's too, for its select).
    slot_states_.mark_prepared(slots);
    oracle_.prepare(in, ctx);
    if (longest == 0) return;
    // Staging of one prompt's rotated keys [kv_heads, n, d]; entry i of every head's row is its token i, so
    // gather_kv copies staging row i to the head cache's position i.
    std::vector<std::int32_t> host_indices(std::size_t(kv) * std::size_t(longest));
    for (std::size_t row = 0; row < std::size_t(kv); ++row) {
      std::iota(host_indices.begin() + std::ptrdiff_t(row * std::size_t(longest)),
                host_indices.begin() + std::ptrdiff_t((row + 1) * std::size_t(longest)), 0);
    }
    ContextArray<Context, T> staging(std::size_t(kv) * std::size_t(longest) * std::size_t(d));
    ContextArray<Context, std::int32_t> indices(host_indices.size()), counts(static_cast<std::size_t>(kv)),
        positions(static_cast<std::size_t>(longest));
    copy_from_host(host_indices.data(), host_indices.size(), indices.data(), ctx);
    copy_from_host(host_indices.data(), std::size_t(longest), positions.data(), ctx);
    // A paged engine cache's row b alone: CSR, its pages from page_indptr[b] on, with a page_indptr of its own; a
    // block table, its row and length (PagedKVView::sequence).
    std::vector<std::int32_t> page_indptr;
    ContextArray<Context, std::int32_t> row_indptr(2);
    if (config_.head_cache == SpeContextHeadCache::engine && in.cache.is_paged() && !in.cache.paged.is_block_table()) {
      page_indptr.resize(rows + 1);
      copy_to_host(in.cache.paged.page_indptr, rows + 1, page_indptr.data(), ctx);
    }
    for (std::int32_t b = 0; b < batch; ++b) {
      const std::int32_t n = lengths[std::size_t(b)];
      if (n == 0) continue;
      for (std::int32_t h = 0; h < kv; ++h) {
        T* head_rows = staging.data() + std::size_t(h) * std::size_t(n) * std::size_t(d);
        copy_rows_within(k.row(b, h, 0), k.token_stride, head_rows, d, d, n, ctx);
      }
      const HeadsView<T> rotated{staging.data(), n, kv, d, d, std::int64_t(n) * d};  // token-major rows of each head
      apply_rope(rotated, positions.data(), 0, table_, /*inverse=*/false, ctx);
      const std::vector<std::int32_t> host_counts(std::size_t(kv), n);
      copy_from_host(host_counts.data(), host_counts.size(), counts.data(), ctx);
      const auto src = ContiguousKVView<const T>::packed(staging.data(), staging.data(), 1, kv, n, d);
      KVCache<T> row;
      if (config_.head_cache == SpeContextHeadCache::owned) {
        row = writable_head_cache(in.cache, in.slots + b, context_lengths.data() + b, 1);
      } else if (in.cache.is_paged()) {
        PagedKVView<T> paged = writable(in.cache).paged.sequence(b);
        if (!paged.is_block_table()) {
          const std::int32_t first = page_indptr[std::size_t(b)], pages = page_indptr[std::size_t(b) + 1] - first;
          const std::int32_t row_pages[2] = {0, pages};
          copy_from_host(row_pages, 2, row_indptr.data(), ctx);
          paged.page_indptr = row_indptr.data();
          paged.page_indices += first;
        }
        row = paged;
      } else {
        ContiguousKVView<T> contiguous = writable(in.cache).contiguous;
        contiguous.k += b * contiguous.batch_stride;
        contiguous.v += b * contiguous.batch_stride;
        if (contiguous.seq_lens != nullptr) contiguous.seq_lens += b;
        contiguous.batch = 1;
        row = contiguous;
      }
      gather_kv(KVCache<const T>(src), SelectionView{indices.data(), counts.data(), nullptr, 1, kv, longest}, row, ctx);
    }
  }

  /// Rotates the step's key k_r (in.k_pre_rope, required) to position lengths[b] - 1 and writes it there in the
  /// head's cache.
  void append(const AppendInputs<T>& in, std::span<std::byte> workspace, const Context& ctx) {
    constexpr const char* where = entry_point<"append">();
    const std::int32_t batch = checked_positioned_append<Context>(where, in);
    KVSIFT_CHECK(in.k_pre_rope.data != nullptr, where,
                 "in.k_pre_rope (the retrieval head's key of the step's token, before RoPE) must be given");
    validate(in.k_pre_rope, where, "in.k_pre_rope");
    KVSIFT_CHECK(in.k_pre_rope.batch == batch && in.k_pre_rope.heads == limits_.kv_heads &&
                     in.k_pre_rope.head_dim == limits_.head_dim,
                 where, "in.k_pre_rope is [{}, {}, {}]; expected [batch = {}, kv_heads = {}, head_dim = {}]",
                 in.k_pre_rope.batch, in.k_pre_rope.heads, in.k_pre_rope.head_dim, batch, limits_.kv_heads,
                 limits_.head_dim);
    WorkspaceLayout carving(workspace, where);
    T* keys = append_layout(carving, batch, ctx);
    const auto rotated = HeadsView<T>::packed(keys, batch, limits_.kv_heads, limits_.head_dim);
    copy_heads_packed(in.k_pre_rope, keys, ctx);
    apply_rope(rotated, in.lengths, -1, table_, /*inverse=*/false, ctx);
    const HeadsView<const T> step_keys = as_const(rotated);
    // V aliases K in the head's cache: the rotated key is the "value" too (never read).
    write_step_kv(writable_head_cache(in.cache, in.slots, in.lengths, batch), step_keys, step_keys, ctx);
  }

  /// The selection for the step's head query q_r (in.q, pre-RoPE), rotated to lengths[b] - 1, over the head's
  /// cache (the step's key appended first); in.attention.window is left out (the step attends it). Refused besides
  /// every selector's checks: a window whose recent part is below 1 (the step's own token would be neither
  /// selected nor attended; specontext_window gives the window to use).
  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = entry_point<"select">();
    checked_select<Context>(where, in, out, capacity());
    KVSIFT_CHECK(in.attention.window.recent >= 1, where,
                 "in.attention.window.recent (= {}) must be >= 1: the selection leaves the window out and the step's "
                 "own token is attended only through it (use specontext_window(window))",
                 in.attention.window.recent);
    const std::int32_t batch = in.q.batch, kv = limits_.kv_heads;
    const std::int32_t tokens = detail::planned_tokens(where, "in.max_seq_len", limits_, in.max_seq_len);
    WorkspaceLayout carving(workspace, where);
    const SelectShape shape{batch, limits_.q_heads, kv, limits_.head_dim, in.max_seq_len};
    const SelectBuffers w = select_layout(carving, shape, tokens, ctx);
    const auto rotated = QueryView<T>::packed(w.rotated, batch, limits_.q_heads, limits_.head_dim);
    copy_heads_packed(in.q, w.rotated, ctx);
    apply_rope(rotated, in.lengths, -1, table_, /*inverse=*/false, ctx);
    const KVCache<const T> head = head_cache(in.cache, in.slots, in.lengths, batch);
    const AttentionOptions attention{.sm_scale = config_.sm_scale, .window = in.attention.window};
    if (config_.mode == SpeContextMode::per_kv_head) {
      oracle_.select({.q = as_const(rotated), .cache = head, .slots = in.slots, .lengths = in.lengths,
                      .attention = attention, .layer = in.layer, .max_seq_len = in.max_seq_len},
                     out, w.oracle, ctx);
      return;
    }
    // batch_level: the group-max rows (OracleTopK's score), their max over the sequence's kv heads, one top B per
    // sequence, copied to every kv head's row.
    const std::int64_t rows = std::int64_t(batch) * kv;
    group_scores(as_const(rotated), head, MatrixView<float>::packed(w.scores, rows, tokens), score_options(), w.group,
                 ctx);
    max_score_rows(MatrixView<const float>::packed(w.scores, rows, tokens), kv, in.lengths,
                   MatrixView<float>::packed(w.sequence_scores, batch, tokens), ctx);
    topk_rows(MatrixView<const float>::packed(w.sequence_scores, batch, tokens), in.lengths, config_.budget,
              TopKRowsOptions{.window = in.attention.window, .nan_marks_row = true},
              SelectionView{w.indices, w.counts, nullptr, batch, 1, config_.budget}, w.topk, ctx);
    for (std::int32_t h = 0; h < kv; ++h) {
      copy_rows_within(w.indices, config_.budget, out.row(0, h), std::int64_t(kv) * out.capacity, config_.budget,
                       batch, ctx);
      copy_rows_within(w.counts, 1, out.counts + h, kv, 1, batch, ctx);
    }
  }

  /// Sequences leave; their keys stay until a prepare of the slot overwrites them.
  void release(std::span<const std::int32_t> slots) {
    SelectorCore::release(slots);
    oracle_.release(slots);
  }

  /// The head's K cache of the step's `batch` rows, post-RoPE (its V aliases K): the slots' pages of the owned
  /// array (lengths[b] tokens), or `cache` itself when the engine keeps it. For tests and inspection.
  KVCache<const T> head_cache(const KVCache<const T>& cache, const std::int32_t* slots, const std::int32_t* lengths,
                              std::int32_t batch) const {
    return writable_head_cache(cache, slots, lengths, batch);
  }

 private:
  struct SelectBuffers {
    T* rotated = nullptr;
    std::span<std::byte> oracle;  ///< per_kv_head
    float* scores = nullptr;      ///< batch_level from here on
    float* sequence_scores = nullptr;
    std::int32_t* indices = nullptr;
    std::int32_t* counts = nullptr;
    std::span<std::byte> group, topk;
  };

  static SpeContextConfig checked(const SelectorLimits& limits, const SpeContextConfig& c) {
    constexpr const char* where = "SpeContext";
    KVSIFT_CHECK(c.budget > 0 && c.budget <= limits.max_tokens, where,
                 "config.budget (= {}) is outside [1, limits.max_tokens = {}]", c.budget, limits.max_tokens);
    KVSIFT_CHECK(c.mode == SpeContextMode::per_kv_head || c.mode == SpeContextMode::batch_level, where,
                 "config.mode (= {}) is not a SpeContextMode", int(c.mode));
    KVSIFT_CHECK(c.head_cache == SpeContextHeadCache::owned || c.head_cache == SpeContextHeadCache::engine, where,
                 "config.head_cache (= {}) is not a SpeContextHeadCache", int(c.head_cache));
    KVSIFT_CHECK(c.sm_scale >= 0.0f, where, "config.sm_scale (= {}) must be >= 0 (0: 1/sqrt(head_dim))", c.sm_scale);
    const std::int32_t rotary = c.rope.resolved_rotary_dim(limits.head_dim);
    KVSIFT_CHECK(rotary > 0 && rotary % 2 == 0 && rotary <= limits.head_dim, where,
                 "config.rope.rotary_dim (= {}) must be even and in [2, head_dim = {}]", rotary, limits.head_dim);
    return c;
  }
  GroupScoreOptions score_options() const {
    return {.sm_scale = config_.sm_scale, .reduce = GroupReduce::max, .softmax = true};
  }
  static HeadsView<const T> as_const(const HeadsView<T>& x) {
    return {x.data, x.batch, x.heads, x.head_dim, x.batch_stride, x.head_stride};
  }
  /// The head's cache as written by prepare and append (const_cast on the engine's: see the class comment).
  KVCache<T> writable_head_cache(const KVCache<const T>& cache, const std::int32_t* slots, const std::int32_t* lengths,
                                 std::int32_t batch) const {
    if (config_.head_cache == SpeContextHeadCache::engine) return writable(cache);
    const std::int32_t kv = limits_.kv_heads, d = limits_.head_dim, n = limits_.max_tokens;
    T* keys = const_cast<T*>(keys_.data());  // the selector's own array; const only through this accessor
    return PagedKVView<T>{.k_pages = keys, .v_pages = keys, .page_indptr = page_indptr_.data(),
                          .page_indices = slots, .last_page_len = lengths, .batch = batch, .kv_heads = kv,
                          .head_dim = d, .page_size = n, .num_pages = limits_.max_slots,
                          .page_stride = std::int64_t(kv) * n * d, .token_stride = d,
                          .head_stride = std::int64_t(n) * d};
  }
  static KVCache<T> writable(const KVCache<const T>& cache) {
    if (cache.is_paged()) {
      const PagedKVView<const T>& p = cache.paged;
      return PagedKVView<T>{const_cast<T*>(p.k_pages), const_cast<T*>(p.v_pages), p.page_indptr, p.page_indices,
                            p.last_page_len, p.batch, p.kv_heads, p.head_dim, p.page_size, p.num_pages,
                            p.page_stride, p.token_stride, p.head_stride, p.block_table_stride, p.seq_lens};
    }
    const ContiguousKVView<const T>& c = cache.contiguous;
    return ContiguousKVView<T>{const_cast<T*>(c.k), const_cast<T*>(c.v), c.seq_lens, c.batch, c.kv_heads, c.capacity,
                               c.head_dim, c.batch_stride, c.head_stride, c.token_stride};
  }

  /// The one layout behind select's workspace query (counting) and its run (carving).
  SelectBuffers select_layout(WorkspaceLayout& layout, const SelectShape& shape, std::int32_t tokens,
                              const Context& ctx) const {
    const std::int32_t batch = shape.batch, kv = limits_.kv_heads;
    SelectBuffers b{};
    b.rotated = layout.allocate<T>(std::size_t(batch) * std::size_t(limits_.q_heads) * std::size_t(limits_.head_dim),
                                   "SpeContext rotated head queries");
    if (config_.mode == SpeContextMode::per_kv_head) {
      b.oracle = layout.span(oracle_.select_workspace_bytes(shape, ctx), "SpeContext OracleTopK scratch");
      return b;
    }
    const std::int64_t rows = std::int64_t(batch) * kv;
    b.scores = layout.allocate<float>(std::size_t(rows) * std::size_t(tokens), "SpeContext kv-head scores");
    b.sequence_scores = layout.allocate<float>(std::size_t(batch) * std::size_t(tokens), "SpeContext sequence scores");
    b.indices = layout.allocate<std::int32_t>(std::size_t(batch) * std::size_t(config_.budget),
                                              "SpeContext sequence selection");
    b.counts = layout.allocate<std::int32_t>(std::size_t(batch), "SpeContext sequence counts");
    b.group = layout.span(group_scores_workspace_bytes(batch, limits_.q_heads, kv, tokens, score_options(), ctx),
                          "SpeContext group_scores scratch");
    b.topk = layout.span(topk_rows_workspace_bytes(batch, tokens, config_.budget, TopKRowsOptions{}, ctx),
                         "SpeContext topk_rows scratch");
    return b;
  }
  /// The one layout behind append's workspace query and its run: the step's rotated keys.
  T* append_layout(WorkspaceLayout& layout, std::int32_t batch, const Context&) const {
    return layout.allocate<T>(std::size_t(batch) * std::size_t(limits_.kv_heads) * std::size_t(limits_.head_dim),
                              "SpeContext rotated head keys");
  }

  SpeContextConfig config_;
  OracleTopK<T, Context> oracle_;
  ContextArray<Context, float> cos_, sin_;
  RopeTableView table_{};
  ContextArray<Context, T> keys_;  ///< owned head cache [max_slots, kv_heads, max_tokens, head_dim] (else empty)
  ContextArray<Context, std::int32_t> page_indptr_;  ///< [max_slots + 1] iota: one page per batch row
};

}  // namespace kvsift
