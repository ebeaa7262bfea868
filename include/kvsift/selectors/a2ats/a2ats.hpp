#pragma once
/// A²ATS (He et al., 2025): windowed RoPE and query-aware vector quantization of the keys (its eqs. 10-21). Each
/// key of a sequence keeps a uint16 code, the nearest codeword of its kv head's codebook after the Cholesky
/// transform of the offline calibration (selectors/a2ats/codebook.hpp, selectors/a2ats/vq.hpp's math); a decode query is
/// rotated to the fixed position b (q~ = q R_b: windowed RoPE scores every non-local key as if it were b tokens
/// away), and token t of query head h scores q~_h . C_code(t), a table lookup. Per query head the best
/// K = floor(budget_fraction * length) tokens of the middle are selected (the step's token counted in the length)
/// and the kv head's selection is the union over its GQA group (the authors' rule; capacity g * max_budget), or,
/// with A2atsGroupRule::group_max, the top K of the group's maximum scores (capacity max_budget).
///
/// Exact mode (issue 23): A²ATS only selects; the decode step attends the selection, the sinks and the recent
/// window with ordinary RoPE over the post-RoPE cache. The sinks (4) and the recent window (64, the step's own
/// token included) that the authors always attend are the step's AttentionOptions::window, set by the user
/// (DecodeStepConfig::attention.window = {.sink = 4, .recent = 64}); select leaves SelectInputs::attention.window
/// out of the candidates (topk_rows' window), so they are never listed twice. The fraction of a sequence's KV rows
/// one kv head reads in a step (the paper's "sparsity", 0.06 at K = 3% with its union over 4 heads and the window)
/// is rows_touched(length, count, window) of that row's selection count.
///
/// Codes. prepare codes every prompt key: the pre-RoPE keys PrefillInputs::k_pre_rope when given (exact), else the
/// cache's post-RoPE keys gathered in chunks of config.prepare_chunk tokens and rotated back (the shared RoPE
/// primitive's inverse, YaRN's attention factor divided out; recovered bf16 keys may code differently from the
/// exact ones where two codewords are near a tie). append codes the step's token at lengths[b] - 1 the same way
/// (AppendInputs::k_pre_rope, or the cache's row rotated back in the workspace). A codebook built without
/// windowed RoPE (A2atsLayerCodebooks::windowed_rope false, the paper's ablation) codes the post-RoPE keys as they
/// are and scores with the post-RoPE query as it is; k_pre_rope is then not read.
///
/// Memory, in the context's (index_bytes, index_parts): codes [max_slots, kv_heads, max_tokens] uint16; the layer's
/// codebooks: L and C^z fp32, |C^z_c|^2 fp32, C in T (16-byte aligned, VqCodebook); with windowed RoPE a cos/sin
/// table of max(max_tokens, b + 1) positions (the rotations by b - p and back from any position < max_tokens),
/// 4 * rotary_dim bytes per position: at 128K tokens and head_dim 128, 64 MiB per selector, the largest part
/// unless the codes of many slots outweigh it.
/// Workspaces (one layout function each for the query and the run): select: q~ [batch, q_heads, head_dim] in T
/// (windowed RoPE only), the budgets and vq_topk_rows' workspace (the scores [batch * (union ? q_heads : kv_heads),
/// N] fp32 of its composed form, N the planned bound min(max_seq_len, max_tokens) (detail::planned_tokens),
/// vq_lut_scan's and topk_rows' scratch, on CUDA the query heads' tables of its fused form). A
/// sequence longer than N gets count -1 on CUDA and is refused on the CPU (topk_rows). append: the step's keys
/// gathered from the cache [batch, kv_heads, head_dim] in T (gather_keys: no values), their positions, vq_encode's
/// scratch.
/// prepare allocates its scratch (chunk-bounded) and reads the lengths and slots on the host (CUDA: synchronizes
/// the stream, as CTKVR's and CSAttention's prepare do). append and select neither allocate nor synchronize.
///
/// Written once for both backends (cpu/backend.hpp or cuda/backend.hpp before instantiating it). CPU and CUDA
/// select the same tokens where the codes agree (they may differ at fp32 near-ties of two codewords) and no two
/// table entries of a row's candidates are within the backends' fp32 rounding of the K-th (the tables' sums run in
/// different orders).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <string_view>
#include <vector>

#include "kvsift/selectors/a2ats/windowed_rope.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/selectors/a2ats/vq.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/a2ats/codebook.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/detail/selector_core.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

/// How the query heads of a GQA group make the kv head's selection.
enum class A2atsGroupRule : std::uint8_t {
  union_of_heads,  ///< each query head's top K, united (the authors' code); capacity g * max_budget
  group_max,       ///< the top K of the maximum over the group's heads of each token's score; capacity max_budget
};

struct A2atsConfig {
  /// f: each query head selects K = floor(f * length) middle tokens, length counting the step's token (the
  /// paper's 3%; topk_rows' per-row budget, length_budgets).
  double budget_fraction = 0.03;
  /// Bound on K and the selection's size: capacity() is (union ? g : 1) * max_budget. 0: floor(f * max_tokens)
  /// (at least 1), the K of the longest sequence.
  std::int32_t max_budget = 0;
  A2atsGroupRule group_rule = A2atsGroupRule::union_of_heads;
  /// Prompt keys gathered, rotated back and coded per pass of prepare when k_pre_rope is not given (bounds its
  /// scratch: batch * kv_heads * chunk * head_dim elements of T, the keys gather_keys copies).
  std::int32_t prepare_chunk = 8192;
};

/// The selector's memory by part, bytes in its context's memory (host for cpu::Context, device for cuda::Context).
struct A2atsIndexBytes {
  std::size_t codes = 0;       ///< [max_slots, kv_heads, max_tokens] uint16, and append's [max_slots * kv_heads] ones
  std::size_t codebooks = 0;   ///< L, C^z and norms fp32, C in T
  std::size_t rope_table = 0;  ///< cos and sin (windowed RoPE only)
};

template <class T, class Context>
class A2ats : public SelectorTypes<T, Context>, public detail::SelectorCore<"A2ats"> {
 public:
  /// Uploads one layer's codebooks (host fp32; the view may be dropped afterwards) into the context's memory and
  /// builds the RoPE table, or, with `shared_table` (its cos non-null), rotates with that one: the table is the same
  /// for every layer of a model, so the layers' selectors can share one (64 MiB at 128K tokens and head_dim 128;
  /// it must outlive them). Refused: limits as every selector's; a codebook whose kv_heads or head_dim differ
  /// from the limits', head_dim other than 64 or 128, codewords outside [1, 65536], null arrays, a negative
  /// offset; budget_fraction outside (0, 1], max_budget outside [0, max_tokens], prepare_chunk <= 0, an unknown
  /// rule; a shared table of fewer than table_positions(limits, codebooks) positions or of another rotary dim,
  /// layout or attention factor than the codebooks' RoPE.
  A2ats(const SelectorLimits& limits, const A2atsConfig& config, const A2atsLayerCodebooks& codebooks,
        const Context& ctx, const RopeTableView& shared_table = {})
      : SelectorCore(limits), config_(checked(limits, config, codebooks)),
        max_budget_(config_.max_budget > 0
                        ? config_.max_budget
                        : std::max(1, std::int32_t(config_.budget_fraction * double(limits.max_tokens)))),
        codewords_(codebooks.codewords), offset_(codebooks.offset), windowed_rope_(codebooks.windowed_rope),
        rope_(codebooks.rope), table_positions_(table_positions(limits, codebooks)) {
    const std::int32_t kv = limits.kv_heads, d = limits.head_dim;
    const std::size_t entries = std::size_t(kv) * std::size_t(codewords_) * std::size_t(d);
    transform_.resize(std::size_t(kv) * std::size_t(d) * std::size_t(d));
    centroids_.resize(entries);
    norms_.resize(std::size_t(kv) * std::size_t(codewords_));
    codebook_.resize(entries);
    copy_from_host(codebooks.transform, transform_.size(), transform_.data(), ctx);
    copy_from_host(codebooks.centroids, centroids_.size(), centroids_.data(), ctx);
    vq_codeword_norms(MatrixView<const float>::packed(centroids_.data(), std::int64_t(kv) * codewords_, d),
                      norms_.data(), ctx);
    std::vector<T> rounded(entries);  // C in the query's type, rounded once (selectors/a2ats/vq.hpp VqCodebook)
    for (std::size_t i = 0; i < entries; ++i) rounded[i] = from_float<T>(codebooks.codebook[i]);
    copy_from_host(rounded.data(), rounded.size(), codebook_.data(), ctx);
    codes_.resize(std::size_t(limits.max_slots) * std::size_t(kv) * std::size_t(limits.max_tokens));
    if (windowed_rope_ && shared_table.cos != nullptr) {
      check_shared_table(shared_table);
      table_ = shared_table;
    } else if (windowed_rope_) {
      cos_.resize(std::size_t(RopeTableView::elements(rope_, d, table_positions_)));
      sin_.resize(cos_.size());
      table_ = RopeTableView::make(rope_, d, table_positions_, cos_.data(), sin_.data());
      build_rope_table(rope_, table_, ctx);
    }
    // Last, and synchronizing (copy_from_host waits for its stream): the norms and the table are built when the
    // constructor returns, whatever stream the selector later runs on.
    const std::vector<std::int32_t> ones(std::size_t(limits.max_slots) * std::size_t(kv), 1);
    ones_.resize(ones.size());
    copy_from_host(ones.data(), ones.size(), ones_.data(), ctx);
  }

  // Move-only: table_ points into the selector's own arrays (a move keeps them; a copy would not).
  A2ats(const A2ats&) = delete;
  A2ats& operator=(const A2ats&) = delete;
  A2ats(A2ats&&) noexcept = default;
  A2ats& operator=(A2ats&&) noexcept = default;

  /// Positions the RoPE table of a selector with these limits and codebooks holds: max(max_tokens, b + 1), so that
  /// it rotates a query from any position to b and a key back from any position.
  static std::int32_t table_positions(const SelectorLimits& limits, const A2atsLayerCodebooks& codebooks) {
    return std::max(limits.max_tokens, codebooks.offset + 1);
  }

  std::string_view name() const { return "A2ATS"; }
  const A2atsConfig& config() const { return config_; }
  /// K's bound (config.max_budget, or floor(f * max_tokens)).
  std::int32_t max_budget() const { return max_budget_; }
  std::int32_t capacity() const { return (union_of_heads() ? group() : 1) * max_budget_; }

  /// Fraction of a sequence's KV rows one kv head reads in a step: the attention window's tokens and the
  /// selection's `count` (the row's SelectionView count), over the sequence's `length` (0 for an empty one).
  static double rows_touched(std::int32_t length, std::int32_t count, const AttentionWindow& window) {
    return length > 0 ? double(window.size(length) + count) / double(length) : 0.0;
  }

  /// Whether select reads what append wrote in the same step (selectors/selector.hpp): append codes the step's token
  /// alone, at lengths[b] - 1, inside a recent window, and select ranks the middle only (its 16-byte code loads may
  /// span that code and discard it).
  bool select_reads_append(const AttentionWindow& window) const { return window.recent == 0; }

  A2atsIndexBytes index_parts() const {
    return {.codes = codes_.size() * sizeof(std::uint16_t) + ones_.size() * sizeof(std::int32_t),
            .codebooks = (transform_.size() + centroids_.size() + norms_.size()) * sizeof(float) +
                         codebook_.size() * sizeof(T),
            .rope_table = (cos_.size() + sin_.size()) * sizeof(float)};  // a shared table is not this selector's
  }
  IndexBytes index_bytes() const {
    const A2atsIndexBytes parts = index_parts();
    const std::size_t total = parts.codes + parts.codebooks + parts.rope_table;
    return detail::context_index_bytes<Context>(total);
  }
  /// The codes of every slot, in the context's memory: for tests and inspection.
  VqCodesView<const std::uint16_t> codes() const {
    return VqCodesView<const std::uint16_t>::packed(codes_.data(), limits_.max_slots, limits_.kv_heads,
                                                    limits_.max_tokens);
  }

  std::size_t select_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return planned_select_bytes(shape, [&](WorkspaceLayout& counting, std::int32_t tokens) {
      select_layout(counting, shape.batch, tokens, ctx);
    });
  }
  std::size_t append_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return layout_bytes<"append_workspace_bytes">(
        shape, [&](WorkspaceLayout& counting) { append_layout(counting, shape.batch, ctx); });
  }

  /// Codes every prompt token [0, length_b) of each joining sequence into its slot (in.slots distinct): from
  /// in.k_pre_rope when given (and the codebook is windowed), else from the cache's keys rotated back. Refused: a
  /// prompt above limits.max_tokens, a non-finite prompt key in the cache (detail::check_finite_prompt), a
  /// k_pre_rope of another shape or shorter than a prompt, before any slot changes. Allocates scratch; on CUDA
  /// synchronizes the stream.
  void prepare(const PrefillInputs<T>& in, const Context& ctx) {
    constexpr const char* where = entry_point<"prepare">();
    const std::int32_t batch = detail::check_cache(where, limits_, in.cache, in.slots, Context::memory);
    ContextArray<Context, std::int32_t> context_lengths(static_cast<std::size_t>(batch));
    const auto [lengths, slots] =
        detail::read_prefill_rows(where, limits_, in.cache, in.slots, context_lengths.data(), ctx);
    const bool pre_rope = windowed_rope_ && in.k_pre_rope.data != nullptr;
    const std::int32_t longest = *std::max_element(lengths.begin(), lengths.end());
    // A NaN key would be coded as some codeword, whose finite score may leave it out: refused, as CTKVR does.
    detail::check_finite_prompt(where, in.cache, context_lengths.data(), SequenceView<const T>{}, ctx);
    if (pre_rope) {
      const SequenceView<const T>& k = in.k_pre_rope;
      validate(k, where, "in.k_pre_rope");
      KVSIFT_CHECK(k.batch == batch && k.heads == limits_.kv_heads && k.head_dim == limits_.head_dim && k.tokens >= longest,
                   where, "in.k_pre_rope is [{}, {}, {}, {}]; expected [batch = {}, kv_heads = {}, >= {} tokens, head_dim = {}]",
                   k.batch, k.heads, k.tokens, k.head_dim, batch, limits_.kv_heads, longest, limits_.head_dim);
    }
    ContextArray<Context, std::byte> encode_ws(vq_encode_workspace_bytes(codewords_, limits_.head_dim, ctx));
    const std::span<std::byte> encode_bytes(encode_ws.data(), encode_ws.size());
    if (pre_rope) {
      for (std::int32_t b = 0; b < batch; ++b) {
        const SequenceView<const T>& k = in.k_pre_rope;
        const HeadsView<const T> keys{k.row(b, 0, 0), lengths[std::size_t(b)], k.heads, k.head_dim, k.token_stride,
                                      k.head_stride};
        if (keys.batch > 0) {
          vq_encode(keys, encode_codebook(), codes_view(), {.slot = slots[std::size_t(b)]}, encode_bytes, ctx);
        }
      }
    } else {
      encode_from_cache(in.cache, lengths, slots, longest, encode_bytes, ctx);
    }
    slot_states_.mark_prepared(slots);
  }

  /// Codes the step's token (position lengths[b] - 1) of each batch row into its slot.
  void append(const AppendInputs<T>& in, std::span<std::byte> workspace, const Context& ctx) {
    constexpr const char* where = entry_point<"append">();
    const std::int32_t batch = checked_positioned_append<Context>(where, in);
    WorkspaceLayout carving(workspace, where);
    const AppendBuffers w = append_layout(carving, batch, ctx);
    const VqCodeDestination destination{.slots = in.slots, .positions = in.lengths, .position_offset = -1};
    if (windowed_rope_ && in.k_pre_rope.data != nullptr) {
      validate(in.k_pre_rope, where, "in.k_pre_rope");
      KVSIFT_CHECK(in.k_pre_rope.batch == batch && in.k_pre_rope.heads == limits_.kv_heads &&
                       in.k_pre_rope.head_dim == limits_.head_dim,
                   where, "in.k_pre_rope is [{}, {}, {}]; expected [batch = {}, kv_heads = {}, head_dim = {}]",
                   in.k_pre_rope.batch, in.k_pre_rope.heads, in.k_pre_rope.head_dim, batch, limits_.kv_heads,
                   limits_.head_dim);
      vq_encode(in.k_pre_rope, encode_codebook(), codes_view(), destination, w.encode, ctx);
      return;
    }
    // The step's row of every kv head, gathered at lengths[b] - 1 (one entry per selection row), then rotated back.
    const std::int32_t kv = limits_.kv_heads, d = limits_.head_dim;
    length_budgets(in.lengths, batch, kv, {.fraction = 1, .maximum = limits_.max_tokens, .reserved = 1}, w.positions,
                   ctx);
    gather_keys(in.cache, SelectionView{w.positions, ones_.data(), nullptr, batch, kv, 1},
                SequenceView<T>::packed(w.keys, batch, kv, 1, d), ctx);
    const auto keys = HeadsView<T>::packed(w.keys, batch, kv, d);
    if (windowed_rope_) apply_rope(keys, in.lengths, -1, rope_table(), /*inverse=*/true, ctx);
    vq_encode(as_const(keys), encode_codebook(), codes_view(), destination, w.encode, ctx);
  }

  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = entry_point<"select">();
    const std::int32_t tokens = checked_planned_select<Context>(where, in, out, capacity());
    const std::int32_t batch = in.q.batch, kv = limits_.kv_heads;
    WorkspaceLayout carving(workspace, where);
    const SelectBuffers w = select_layout(carving, batch, tokens, ctx);
    QueryView<const T> q = in.q;
    if (windowed_rope_) {  // q~ = q R_b: the step's query, at lengths[b] - 1, rotated to b
      const auto rotated = QueryView<T>::packed(w.rotated, batch, limits_.q_heads, limits_.head_dim);
      rotate_query_to(in.q, in.lengths, offset_, rope_table(), rotated, ctx);
      q = as_const(rotated);
    }
    length_budgets(in.lengths, batch, kv, budget(), w.row_k, ctx);
    vq_topk_rows(q, key_codebook(), codes(), in.slots, in.lengths, topk_shape(batch, tokens),
                 {.window = in.attention.window, .row_k = w.row_k, .heads_per_row = union_of_heads() ? group() : 1}, out,
                 w.topk, ctx);
  }

 private:
  struct SelectBuffers {
    T* rotated;
    std::int32_t* row_k;
    std::span<std::byte> topk;
  };
  struct AppendBuffers {
    std::int32_t* positions;
    T* keys;
    std::span<std::byte> encode;
  };

  static A2atsConfig checked(const SelectorLimits& limits, const A2atsConfig& c, const A2atsLayerCodebooks& cb) {
    constexpr const char* where = "A2ats";
    KVSIFT_CHECK(cb.kv_heads == limits.kv_heads && cb.head_dim == limits.head_dim, where,
                 "the codebook is [kv_heads = {}, head_dim = {}]; limits have kv_heads = {}, head_dim = {}", cb.kv_heads,
                 cb.head_dim, limits.kv_heads, limits.head_dim);
    detail::check_supported(where, "codebook head_dim", cb.head_dim, kVqHeadDims);
    KVSIFT_CHECK(cb.codewords >= 1 && cb.codewords <= kVqMaxCodewords, where,
                 "codebook codewords (= {}) is outside [1, {}]", cb.codewords, kVqMaxCodewords);
    KVSIFT_CHECK(cb.transform != nullptr && cb.centroids != nullptr && cb.codebook != nullptr, where,
                 "the codebook's transform, centroids and codebook must be non-null");
    KVSIFT_CHECK(cb.offset >= 0, where, "codebook offset (b = {}) must be >= 0", cb.offset);
    KVSIFT_CHECK(c.budget_fraction > 0 && c.budget_fraction <= 1, where, "config.budget_fraction (= {}) is outside (0, 1]",
                 c.budget_fraction);
    KVSIFT_CHECK(c.max_budget >= 0 && c.max_budget <= limits.max_tokens, where,
                 "config.max_budget (= {}) is outside [0, limits.max_tokens = {}]", c.max_budget, limits.max_tokens);
    KVSIFT_CHECK(c.prepare_chunk > 0, where, "config.prepare_chunk (= {}) must be positive", c.prepare_chunk);
    KVSIFT_CHECK(c.group_rule == A2atsGroupRule::union_of_heads || c.group_rule == A2atsGroupRule::group_max, where,
                 "config.group_rule (= {}) is not an A2atsGroupRule", int(c.group_rule));
    return c;
  }

  std::int32_t group() const { return limits_.q_heads / limits_.kv_heads; }
  bool union_of_heads() const { return config_.group_rule == A2atsGroupRule::union_of_heads; }
  LengthBudget budget() const { return {.fraction = config_.budget_fraction, .maximum = max_budget_}; }

  const RopeTableView& rope_table() const { return table_; }
  void check_shared_table(const RopeTableView& t) const {
    constexpr const char* where = "A2ats";
    KVSIFT_CHECK(t.sin != nullptr, where, "shared_table.sin is a null pointer");
    KVSIFT_CHECK(t.positions >= table_positions_, where,
                 "shared_table holds {} positions; this selector rotates by up to {} (max(max_tokens, b + 1))",
                 t.positions, table_positions_);
    const RopeTableView own = RopeTableView::make(rope_, limits_.head_dim, table_positions_, nullptr, nullptr);
    KVSIFT_CHECK(t.rotary_dim == own.rotary_dim && t.layout == own.layout &&
                     t.attention_factor == own.attention_factor,
                 where,
                 "shared_table (rotary_dim {}, layout {}, attention factor {}) is not the codebooks' RoPE (rotary_dim "
                 "{}, layout {}, attention factor {})",
                 t.rotary_dim, int(t.layout), t.attention_factor, own.rotary_dim, int(own.layout),
                 own.attention_factor);
  }
  VqCodesView<std::uint16_t> codes_view() {
    return VqCodesView<std::uint16_t>::packed(codes_.data(), limits_.max_slots, limits_.kv_heads, limits_.max_tokens);
  }
  VqEncodeCodebook encode_codebook() const {
    return {transform_.data(), centroids_.data(), norms_.data(), limits_.kv_heads, codewords_, limits_.head_dim};
  }
  VqCodebook<T> key_codebook() const { return {codebook_.data(), limits_.kv_heads, codewords_, limits_.head_dim}; }
  static HeadsView<const T> as_const(const HeadsView<T>& x) {
    return {x.data, x.batch, x.heads, x.head_dim, x.batch_stride, x.head_stride};
  }

  /// The step's queries into the packed q~ buffer: one strided copy where a batch row's heads are evenly spaced
  /// from one row to the next, else one per batch row.
  /// prepare without pre-RoPE keys: chunks of the prompts gathered from the cache (one selection row per (sequence,
  /// kv head), tokens [c0, c0 + n_b)), rotated back from positions c0 + i (an iota with offset c0), coded.
  void encode_from_cache(const KVCache<const T>& cache, const std::vector<std::int32_t>& lengths,
                         const std::vector<std::int32_t>& slots, std::int32_t longest, std::span<std::byte> encode_ws,
                         const Context& ctx) {
    const std::int32_t batch = std::int32_t(lengths.size()), kv = limits_.kv_heads, d = limits_.head_dim;
    const std::int32_t chunk = std::max(1, std::min(config_.prepare_chunk, longest));
    const std::size_t rows = std::size_t(batch) * std::size_t(kv);
    std::vector<std::int32_t> host_indices(rows * std::size_t(chunk)), host_counts(rows);
    std::vector<std::int32_t> offsets(static_cast<std::size_t>(chunk));
    std::iota(offsets.begin(), offsets.end(), 0);
    ContextArray<Context, std::int32_t> indices(host_indices.size()), counts(rows), positions(offsets.size());
    ContextArray<Context, T> keys(rows * std::size_t(chunk) * std::size_t(d));
    copy_from_host(offsets.data(), offsets.size(), positions.data(), ctx);
    const auto gathered = SequenceView<T>::packed(keys.data(), batch, kv, chunk, d);
    for (std::int32_t c0 = 0; c0 < longest; c0 += chunk) {
      for (std::size_t row = 0; row < rows; ++row) {
        const std::int32_t n = std::clamp(lengths[row / std::size_t(kv)] - c0, 0, chunk);
        host_counts[row] = n;
        for (std::int32_t i = 0; i < n; ++i) host_indices[row * std::size_t(chunk) + std::size_t(i)] = c0 + i;
      }
      copy_from_host(host_indices.data(), host_indices.size(), indices.data(), ctx);
      copy_from_host(host_counts.data(), host_counts.size(), counts.data(), ctx);
      gather_keys(cache, SelectionView{indices.data(), counts.data(), nullptr, batch, kv, chunk}, gathered, ctx);
      for (std::int32_t b = 0; b < batch; ++b) {
        const std::int32_t n = host_counts[std::size_t(b) * std::size_t(kv)];
        if (n == 0) continue;
        const HeadsView<T> rows_b{gathered.row(b, 0, 0), n, kv, d, d, std::int64_t(chunk) * d};
        if (windowed_rope_) apply_rope(rows_b, positions.data(), c0, rope_table(), /*inverse=*/true, ctx);
        vq_encode(as_const(rows_b), encode_codebook(), codes_view(),
                  {.slot = slots[std::size_t(b)], .position_offset = c0}, encode_ws, ctx);
      }
    }
  }

  /// The one layout behind select's workspace query and its run.
  /// The code scan's and top-k's shape of a select over `tokens` planned tokens.
  VqTopKShape topk_shape(std::int32_t batch, std::int32_t tokens) const {
    return {.batch = batch,
            .q_heads = limits_.q_heads,
            .kv_heads = limits_.kv_heads,
            .codewords = codewords_,
            .head_dim = limits_.head_dim,
            .max_tokens = tokens,
            .k = max_budget_,
            .scan = {.group_max = !union_of_heads()}};
  }
  SelectBuffers select_layout(WorkspaceLayout& layout, std::int32_t batch, std::int32_t tokens, const Context& ctx) const {
    SelectBuffers b{};
    b.rotated = windowed_rope_ ? layout.allocate<T>(std::size_t(batch) * std::size_t(limits_.q_heads) *
                                                        std::size_t(limits_.head_dim),
                                                    "A2ATS rotated queries")
                               : nullptr;
    b.row_k = layout.allocate<std::int32_t>(std::size_t(batch) * std::size_t(limits_.kv_heads), "A2ATS budgets");
    b.topk = layout.span(vq_topk_rows_workspace_bytes(topk_shape(batch, tokens), ctx), "A2ATS scan and top-k scratch");
    return b;
  }
  /// The one layout behind append's workspace query and its run (sized for the gather even when k_pre_rope comes).
  AppendBuffers append_layout(WorkspaceLayout& layout, std::int32_t batch, const Context& ctx) const {
    const std::size_t rows = std::size_t(batch) * std::size_t(limits_.kv_heads);
    AppendBuffers b{};
    b.positions = layout.allocate<std::int32_t>(rows, "A2ATS step positions");
    b.keys = layout.allocate<T>(rows * std::size_t(limits_.head_dim), "A2ATS step keys");
    b.encode = layout.span(vq_encode_workspace_bytes(codewords_, limits_.head_dim, ctx), "A2ATS encode scratch");
    return b;
  }

  A2atsConfig config_;
  std::int32_t max_budget_, codewords_, offset_;
  bool windowed_rope_;
  RopeConfig rope_;
  std::int32_t table_positions_;
  ContextArray<Context, float> transform_, centroids_, norms_;
  ContextArray<Context, T> codebook_;
  ContextArray<Context, std::uint16_t> codes_;
  ContextArray<Context, std::int32_t> ones_;
  ContextArray<Context, float> cos_, sin_;  ///< the selector's own table (empty when shared)
  RopeTableView table_{};    ///< the table it rotates with: its own or the shared one
};

}  // namespace kvsift
