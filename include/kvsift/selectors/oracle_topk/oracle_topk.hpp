#pragma once
/// OracleTopK: the exact top-K selector, the upper bound every retrieval method is measured against.
///
/// Score of token t for kv head g: the largest softmax weight any query head of g's GQA group gives t, over
/// all of the sequence's tokens (as CTKVR and SpeContext reduce a group, by max): group_scores with softmax
/// and max (fp32, fp32 accumulation). Of the middle tokens (the attention window's tokens are the kernel's),
/// the `budget` best are selected by topk_rows (ties: the smaller index); a middle of at most `budget` tokens
/// is taken whole. No index: it reads the engine's cache at every step (index_bytes() = {0, 0}). NaN never
/// vanishes: a NaN (or +inf) logit makes its head's weights NaN, and a row with a NaN candidate gets count -1
/// (TopKRowsOptions::nan_marks_row), so the step's output there is NaN, as dense attention's.
/// Written once for both backends (S::context_type cpu::Context or cuda::Context); CPU and CUDA pick the same
/// tokens except among candidates whose fp32 scores differ by less than the two backends' rounding (the
/// scores' sums run in different orders), which the tests state.
///
/// Include cpu/backend.hpp or cuda/backend.hpp (the primitives of the context) before instantiating it.
/// Workspace of select: the scores [batch * kv_heads, N] fp32, group_scores' and topk_rows' scratch, N the
/// planned bound min(shape.max_seq_len, limits.max_tokens) (selector.hpp SelectShape). A sequence past N gets
/// count -1 on CUDA (group_scores writes its first N scores, topk_rows marks the row) and is refused on the CPU.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "kvsift/core/error.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "kvsift/core/ranking.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "kvsift/selectors/detail/selector_core.hpp"
#include "kvsift/selectors/selector.hpp"

namespace kvsift {

struct OracleTopKConfig {
  std::int32_t budget = 0;  ///< middle tokens selected per (sequence, kv head), besides the attention window
};

template <class T, class Context>
class OracleTopK : public SelectorTypes<T, Context>, public detail::SelectorCore<"OracleTopK"> {
 public:
  OracleTopK(const SelectorLimits& limits, const OracleTopKConfig& config)
      : SelectorCore(limits), config_(config) {
    KVSIFT_CHECK(config.budget > 0, "OracleTopK", "config.budget (= {}) must be positive", config.budget);
  }

  std::string_view name() const { return "OracleTopK"; }
  std::int32_t capacity() const { return config_.budget; }
  IndexBytes index_bytes() const { return {}; }

  std::size_t select_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return planned_select_bytes(
        shape, [&](WorkspaceLayout& counting, std::int32_t tokens) { layout(counting, shape.batch, tokens, ctx); });
  }

  /// No index, but the life cycle of every selector: a slot is prepared before its steps (slot_states.hpp).
  void prepare(const PrefillInputs<T>& in, const Context& ctx) {
    detail::check_cache(entry_point<"prepare">(), limits_, in.cache, in.slots, Context::memory);
    slot_states_.mark_prepared(in.slots, in.cache.batch(), ctx);
  }

  /// Nothing to append: the step's inputs are checked all the same.
  void append(const AppendInputs<T>& in, std::span<std::byte>, const Context&) {
    checked_append<Context>(entry_point<"append">(), in);
  }
  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = entry_point<"select">();
    const std::int32_t tokens = checked_planned_select<Context>(where, in, out, capacity());
    const std::int32_t batch = in.q.batch;
    WorkspaceLayout carving(workspace, where);
    const Buffers buffers = layout(carving, batch, tokens, ctx);
    const std::int64_t rows = std::int64_t(batch) * limits_.kv_heads;
    const auto scores = MatrixView<float>::packed(buffers.scores, rows, tokens);
    group_scores(in.q, in.cache, scores, score_options(in.attention), buffers.group_scores, ctx);
    // A NaN key or query makes its heads' every softmax weight NaN: the row is marked bad (count -1, NaN output),
    // as dense attention's output is NaN there.
    topk_rows(MatrixView<const float>::packed(buffers.scores, rows, tokens), in.lengths, config_.budget,
              TopKRowsOptions{.window = in.attention.window, .nan_marks_row = true}, out, buffers.topk, ctx);
  }

 private:
  struct Buffers {
    float* scores;
    std::span<std::byte> group_scores, topk;
  };
  static GroupScoreOptions score_options(const AttentionOptions& attention) {
    return {.sm_scale = attention.sm_scale, .reduce = GroupReduce::max, .softmax = true};
  }
  /// The one layout behind the workspace query (counting) and select (carving): the scores, then group_scores'
  /// and topk_rows' scratch side by side (the group's scratch is dead once topk_rows runs, but sharing it would
  /// tie the two primitives' layouts together for a few MB). tokens: the score columns (planned_tokens).
  Buffers layout(WorkspaceLayout& layout, std::int32_t batch, std::int32_t tokens, const Context& ctx) const {
    const std::int64_t rows = std::int64_t(batch) * limits_.kv_heads;
    Buffers b{};
    b.scores = layout.allocate<float>(std::size_t(rows) * std::size_t(tokens), "OracleTopK scores");
    const std::size_t group_bytes = group_scores_workspace_bytes(batch, limits_.q_heads, limits_.kv_heads, tokens,
                                                                 score_options({}), ctx);
    const std::size_t topk_bytes = topk_rows_workspace_bytes(rows, tokens, config_.budget, TopKRowsOptions{}, ctx);
    b.group_scores = layout.span(group_bytes, "OracleTopK group_scores scratch");
    b.topk = layout.span(topk_bytes, "OracleTopK topk_rows scratch");
    return b;
  }

  OracleTopKConfig config_;
};

}  // namespace kvsift
