#pragma once
/// Fidelity of selectors on real attention: replays the decode positions of a capture through any set of
/// selectors at budgets given as fractions of the context, and scores each selection against exact attention.
///
/// Decoding, per layer, as an engine decodes: the capture's fp16 cache is the engine's cache, and every
/// selector (made per budget, with its attention window) runs in a DecodeStep (step/decode_step.hpp) of a
/// backend (FidelityBackend below: a CPU step over host memory, or with eval/cuda_fidelity.hpp a CUDA step over
/// device memory): prepare() on the prefill, then at each decode position p = P, ..., tokens - 1 one step over the cache
/// holding [0, p] (the query at p attends its own token): the selector's append and select, then sparse
/// attention over the window and the selection, with fp32 output. Tokens [0, P) are the prefill,
/// P = round(prefill * tokens) the first decode position.
///
/// Evaluated positions: `decode_positions` of them, spread evenly over the decoded range [P, tokens - 1], both
/// ends included (position i of N is P + round(i * (tokens - 1 - P) / (N - 1)); N = 1 is the last position).
/// Selectors select at every decode position; the scores are taken at the evaluated ones. At an evaluated
/// position the exact attention (fp64 softmax weights of every query head over [0, p]) and the dense output are
/// computed once, and every selector and budget is scored against them; memory is O(context) per position.
///
/// Budget: K = max(1, round(budget * (P + 1))) tokens per (position, kv head), the fraction of the context at
/// the first decode position (P + 1 tokens), the same K at every position (so at most that fraction later).
/// K counts the window's tokens too: a selector entry splits K between its window and its selection.
///
/// The attended set of a row is the window's tokens and the selection. Scores per (position, query head), and
/// per row (layer, budget, selector) their mean and tails over the
/// evaluated positions and heads (p10 / p90: quantiles by linear interpolation between order statistics, as
/// numpy's default: x_sorted[h] interpolated at h = q * (n - 1)):
///   - mass recall: the exact softmax mass of the selected tokens (attention_mass_recall_per_head, fp64);
///   - output error: ||O_step - O_dense|| / ||O_dense|| of the head's output (head_dim values): O_step is the
///     decode step's own output (the backend's kernel, fp32 accumulation and output), O_dense the fp64 reference's
///     (relative_l2_error_per_row);
///   - LSE error: |LSE_step - LSE_dense| of the head's log-sum-exp of scaled scores (natural log; exp of it is the
///     ratio of the two softmax denominators), printed only by fidelity_error_markdown (kvsift_fidelity
///     --centroidkv): for a selector it is -log of the exact mass recall, for CentroidKV it measures how well the
///     log-degree weights stand in for the merged tokens;
/// and per (position, kv head), means only:
///   - id recall: the share of the oracle's top-K ids that the selection holds. The oracle ranks the tokens of
///     a kv head once per position by the largest softmax weight any query head of its GQA group gives them
///     (rounded to fp32; ties: the smaller index), exactly as OracleTopK does; its top-K is every token when
///     the context holds at most K;
///   - tokens selected, since a method may select fewer than K (Quest takes whole pages).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "kvsift/attention/budget_split.hpp"
#include "kvsift/attention/options.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/selectors/a2ats/a2ats.hpp"
#include "kvsift/selectors/a2ats/codebook.hpp"
#include "kvsift/selectors/centroid_kv/centroid_kv.hpp"
#include "kvsift/selectors/csattention/csattention.hpp"
#include "kvsift/selectors/ctkvr/ctkvr.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/selectors/rerank.hpp"
#include "kvsift/selectors/selector.hpp"
#include "kvsift/selectors/streaming_llm/streaming_llm.hpp"

namespace kvsift {

/// A selector made for a budget on one backend (cpu::Context or cuda::Context): the selector and the attention
/// window it runs with.
template <class Context>
struct BasicSelectorSetup {
  AnySelector<half, Context> selector;
  AttentionWindow window{};
};

/// A selector by name, and how to make one for a budget in tokens (window included), the capture's limits and
/// the model layer it decodes (CaptureLayer::layer: A²ATS loads that layer's codebooks). make() throws
/// kvsift::Error when the method cannot run at that budget (e.g. Quest below one page); the harness reports
/// that instead.
template <class Context>
struct BasicSelectorEntry {
  std::string name;
  std::function<BasicSelectorSetup<Context>(std::int32_t budget_tokens, const SelectorLimits& limits,
                                            std::int32_t layer)>
      make;
};

using SelectorSetup = BasicSelectorSetup<cpu::Context>;
using SelectorEntry = BasicSelectorEntry<cpu::Context>;

/// OracleTopK (the upper bound; no window), StreamingLLM (the window alone: sink min(4, K), recent K - sink)
/// and Quest (K split by split_budget(K, {4, 64}) into a window and a selection of whole pages, the page size by
/// quest_page_size: at most 16, small enough for 16 pages; the recent window holds the current page whenever it is at
/// least a page long, so Quest keeps it): the references every retrieval selector is compared with. One list for
/// both backends; instantiated for cpu::Context in src/eval/fidelity.cpp and for cuda::Context in
/// src/cuda/fidelity.cpp (eval/cuda_fidelity.hpp declares it).
template <class Context = cpu::Context>
std::vector<BasicSelectorEntry<Context>> reference_selectors() {
  using Setup = BasicSelectorSetup<Context>;
  using Any = AnySelector<half, Context>;
  return {
      {"OracleTopK",
       [](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
         return Setup{Any(OracleTopK<half, Context>(limits, {.budget = k}))};
       }},
      {"StreamingLLM",
       [](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
         const std::int32_t sink = std::min(4, k);
         return Setup{Any(StreamingLLM<half, Context>(limits)), {sink, k - sink}};
       }},
      {"Quest",
       [](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
         const BudgetSplit split = split_budget(k, {4, 64});
         const QuestConfig config{.budget = split.selection, .page_size = quest_page_size(split.selection)};
         return Setup{Any(Quest<half, Context>(limits, config)), split.window};
       }},
  };
}
extern template std::vector<BasicSelectorEntry<cpu::Context>> reference_selectors<cpu::Context>();

/// The retrieval selectors built so far, each at a budget of K tokens per kv head, window included, like the
/// references (split into window and selection by split_budget, attention/budget_split.hpp). CTKVR keeps the paper's arrangement: a sink of min(4, K / 8) and a recent window of K / 4 beside
/// rho' = the rest, lists of rho = 2.5 rho', C' = 4, C = P / 16 centroids from the prefill's last queries, the
/// dynamic update on. CSAttention: its defaults (m = 8, C = 128, alpha = 0.2, tables per kv head, one probe)
/// at a fixed K, no sink and a recent window of min(64, K / 4); "CSAttention/q" the same with tables per query head.
/// Same instantiation points as reference_selectors.
template <class Context = cpu::Context>
std::vector<BasicSelectorEntry<Context>> method_selectors() {
  using Setup = BasicSelectorSetup<Context>;
  using Any = AnySelector<half, Context>;
  return {
      {"CTKVR",
       [](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
         const BudgetSplit split = split_budget(k, {.sink = 4, .recent = k});  // 4 sinks, a quarter of K recent
         return Setup{Any(Ctkvr<half, Context>(limits, {.budget = split.selection})), split.window};
       }},
      {"CSAttention",
       [](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
         return Setup{Any(Csattention<half, Context>(limits, {.budget = k})), split_budget(k, {0, 64}).window};
       }},
  };
}

/// The rerank stage (selectors/rerank.hpp) after Quest and CSAttention: each proposes `factor` times the tokens it
/// keeps (capped at the capture's length), the stage keeps them by the exact scores. "CSAttention + rerank" at its
/// own entry's window and budget; "Quest + rerank" with CTKVR's window (a sink of min(4, K / 8), a recent window of
/// K / 4) and the rest K' kept, Quest proposing factor x K' tokens in pages of quest_page_size(K') (the window's
/// recent tokens are worth more than Quest's K'-th page after a rerank: GPL-3 capture, layer 15 at 2%, pages of 16,
/// mass recall 0.440 without it, 0.718 with it; layer 3 0.332 and 0.335). "Quest + rerank (p 0.9)": the same with an adaptive budget (RerankConfig::mass
/// = 0.9, floor 1): each row keeps the fewest of its best candidates holding 90% of their exact mass, at most K'; it
/// selects fewer tokens than its budget, so compare it by FidelityRow::mean_selected (the cost actually paid), not
/// by K. Same instantiation points as reference_selectors.
template <class Context = cpu::Context>
std::vector<BasicSelectorEntry<Context>> rerank_selectors(std::int32_t factor) {
  using Setup = BasicSelectorSetup<Context>;
  using Any = AnySelector<half, Context>;
  KVSIFT_CHECK(factor >= 1, "rerank_selectors", "factor (= {}) must be >= 1", factor);
  const auto proposed = [factor](std::int32_t k, const SelectorLimits& limits) {
    return std::int32_t(std::min<std::int64_t>(std::int64_t(factor) * k, limits.max_tokens));
  };
  // The two Quest entries differ in the rerank's mass alone (0: a fixed budget).
  const auto reranked_quest = [proposed](std::int32_t k, const SelectorLimits& limits, double mass) {
    const BudgetSplit split = split_budget(k, {.sink = 4, .recent = k});
    Quest<half, Context> quest(limits, {.budget = proposed(split.selection, limits),
                                        .page_size = quest_page_size(split.selection)});
    const std::int32_t kept = std::min(split.selection, quest.capacity());
    return Setup{Any(Reranked(std::move(quest), {.budget = kept, .mass = mass})), split.window};
  };
  return {
      {"Quest + rerank",
       [reranked_quest](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
         return reranked_quest(k, limits, 0.0);
       }},
      {"Quest + rerank (p 0.9)",
       [reranked_quest](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
         return reranked_quest(k, limits, 0.9);
       }},
      {"CSAttention + rerank",
       [proposed](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
         // CSAttention's budget holds its window (K less the window selected); the rerank keeps as many.
         const BudgetSplit split = split_budget(k, {0, 64});
         Csattention<half, Context> csattention(limits, {.budget = proposed(k, limits)});
         return Setup{Any(Reranked(std::move(csattention), {.budget = split.selection})), split.window};
       }},
  };
}
extern template std::vector<BasicSelectorEntry<cpu::Context>> rerank_selectors<cpu::Context>(std::int32_t);

/// CentroidKV (selectors/centroid_kv/centroid_kv.hpp, docs/centroidkv.md) holding K entries per kv head after the prefill, as
/// the references hold K tokens: its ratio R = (K + 1/2) / P, P = round(prefill * tokens) the prompt (so B =
/// floor(R P) = K; R <= 1), no window (the store holds sinks and recent tokens). Between decode-time rounds a row
/// grows to at most K + interval - 1 entries. "CentroidKV" has the paper's 16 sinks and 64 recent entries (refused
/// below K = 81); "CentroidKV 4+16" 4 and 16, for small budgets. Same instantiation points as reference_selectors
/// (the CPU for now).
template <class Context = cpu::Context>
std::vector<BasicSelectorEntry<Context>> centroid_kv_selectors(double prefill) {
  using Setup = BasicSelectorSetup<Context>;
  using Any = AnySelector<half, Context>;
  const auto entry = [prefill](std::string name, std::int32_t sinks, std::int32_t recent) {
    return BasicSelectorEntry<Context>{
        std::move(name), [=](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
          const double prompt = std::max(1.0, double(std::lround(prefill * limits.max_tokens)));
          const CentroidKVConfig config{.budget_ratio = float(std::min(1.0, (k + 0.5) / prompt)), .sinks = sinks,
                                        .recent = recent};
          // A budget the prefill cannot meet is refused here, where the harness reports it.
          (void)detail::centroid_kv_prefill_schedule("centroid_kv_selectors", config, std::int32_t(prompt));
          return Setup{Any(CentroidKV<half, Context>(limits, config, Context{}))};
        }};
  };
  return {entry("CentroidKV", 16, 64), entry("CentroidKV 4+16", 4, 16)};
}
extern template std::vector<BasicSelectorEntry<cpu::Context>> centroid_kv_selectors<cpu::Context>(double);

/// CSAttention's variants beside its defaults (docs/csattention.md): the paper's sums (no weights, absent keys 0),
/// each of kvsift's two options alone, tables per query head, two probes, and the alpha sweep. Same window and
/// budget as method_selectors' entry.
template <class Context = cpu::Context>
std::vector<BasicSelectorEntry<Context>> csattention_variants() {
  using Setup = BasicSelectorSetup<Context>;
  using Any = AnySelector<half, Context>;
  const auto entry = [](std::string name, auto edit) {
    return BasicSelectorEntry<Context>{std::move(name), [edit](std::int32_t k, const SelectorLimits& limits, std::int32_t) {
                                         CsattentionConfig config{.budget = k};
                                         edit(config);
                                         return Setup{Any(Csattention<half, Context>(limits, config)),
                                                      split_budget(k, {0, 64}).window};
                                       }};
  };
  std::vector<BasicSelectorEntry<Context>> out{
      entry("CS paper", [](CsattentionConfig& c) { c.weight_by_norm = c.from_floor = false; }),
      entry("CS weights only", [](CsattentionConfig& c) { c.from_floor = false; }),
      entry("CS floor only", [](CsattentionConfig& c) { c.weight_by_norm = false; }),
      entry("CS per q head", [](CsattentionConfig& c) { c.tables = CsattentionTables::per_query_head; }),
      entry("CS probes 2", [](CsattentionConfig& c) { c.probes = 2; }),
  };
  for (const double alpha : {0.05, 0.1, 0.2, 0.25, 0.4}) {
    if (alpha != CsattentionConfig{}.list_fraction) {  // the default is the "CSAttention" entry
      out.push_back(entry(fmt::format("CS alpha {}", alpha), [alpha](CsattentionConfig& c) { c.list_fraction = alpha; }));
    }
    if (alpha != CsattentionConfig{}.list_fraction) {  // the default is the "CS per q head" entry
      out.push_back(entry(fmt::format("CS per q head alpha {}", alpha), [alpha](CsattentionConfig& c) {
        c.tables = CsattentionTables::per_query_head;
        c.list_fraction = alpha;
      }));
    }
  }
  return out;
}
extern template std::vector<BasicSelectorEntry<cpu::Context>> csattention_variants<cpu::Context>();

/// A²ATS over a set of codebooks (selectors/a2ats/a2ats.hpp; they must cover every captured layer, the layer's RoPE and
/// shapes), labelled `name`, at a budget of K tokens per kv head, window included, like the other methods: a sink
/// of min(4, K / 8) and a recent window of min(64, K / 4), the rest K' = K - window for the selection. The entry
/// `name` is the authors' rule at equal tokens: the union of each query head's top floor(K' / g), never more than
/// K' tokens (fewer where the group's heads agree; FidelityRow::mean_selected says how many); with `group_max`
/// also "NAME max", the top K' of the group's maximum score, and with `rerank_factor` > 0 (and group_max) "NAME max
/// + rerank": that selection at rerank_factor x K' (at most the middle), the rerank stage keeping K' of it by the exact
/// scores (selectors/rerank.hpp). The codebooks are shared by every step made.
template <class Context = cpu::Context>
std::vector<BasicSelectorEntry<Context>> a2ats_selectors(const std::string& name,
                                                         std::shared_ptr<const A2atsCodebooks> codebooks,
                                                         bool group_max, std::int32_t rerank_factor = 0) {
  using Setup = BasicSelectorSetup<Context>;
  using Any = AnySelector<half, Context>;
  KVSIFT_CHECK(rerank_factor >= 0, "a2ats_selectors", "rerank_factor (= {}) must be >= 0", rerank_factor);
  // factor 0: the selection itself; else the proposer of a rerank to K'.
  const auto entry = [codebooks](std::string label, A2atsGroupRule rule, std::int32_t factor) {
    return BasicSelectorEntry<Context>{
        std::move(label), [codebooks, rule, factor](std::int32_t k, const SelectorLimits& limits, std::int32_t layer) {
          const BudgetSplit split = split_budget(k, {4, 64});
          const AttentionWindow window = split.window;
          const std::int32_t middle = split.selection;
          const std::int32_t group = limits.q_heads / limits.kv_heads;
          const std::int32_t per_row = rule == A2atsGroupRule::union_of_heads ? middle / group : middle;
          KVSIFT_CHECK(per_row >= 1, "a2ats_selectors", "a budget of {} tokens leaves no query head a token", k);
          const std::int32_t proposed =
              factor == 0 ? per_row : std::int32_t(std::min<std::int64_t>(std::int64_t(factor) * per_row, limits.max_tokens));
          const A2atsConfig config{.budget_fraction = 1.0, .max_budget = proposed, .group_rule = rule};
          A2ats<half, Context> a2ats(limits, config, codebooks->layer(layer), Context{});
          if (factor == 0) return Setup{Any(std::move(a2ats)), window};
          return Setup{Any(Reranked(std::move(a2ats), {.budget = per_row})), window};
        }};
  };
  std::vector<BasicSelectorEntry<Context>> out{entry(name, A2atsGroupRule::union_of_heads, 0)};
  if (group_max) out.push_back(entry(name + " max", A2atsGroupRule::group_max, 0));
  if (group_max && rerank_factor > 0) {
    out.push_back(entry(name + " max + rerank", A2atsGroupRule::group_max, rerank_factor));
  }
  return out;
}
extern template std::vector<BasicSelectorEntry<cpu::Context>> a2ats_selectors<cpu::Context>(
    const std::string&, std::shared_ptr<const A2atsCodebooks>, bool, std::int32_t);
extern template std::vector<BasicSelectorEntry<cpu::Context>> method_selectors<cpu::Context>();

/// One (selector entry, budget) decoding one capture layer on one backend, as an engine runs it. The harness's
/// only contact with where selectors run: prepare() once, then run() at every decode position in order, and
/// read() at the evaluated ones.
class FidelityStep {
 public:
  virtual ~FidelityStep() = default;
  /// The window the step's attention attends besides the selection.
  virtual AttentionWindow window() const = 0;
  /// The selector's prepare on the prefill: the cache holding tokens [0, prefill).
  virtual void prepare(std::int32_t prefill) = 0;
  /// One decode step of the query at `position` over the cache holding [0, position], its own token included:
  /// the selector's append and select, then sparse attention over the window and the selection (fp32 output).
  virtual void run(std::int32_t position) = 0;
  /// The last run's output [q_heads, head_dim] (fp32) into `o`, its LSE [q_heads] into `lse`, and its selection
  /// (batch 1), all in host memory; waits for the run. The view stays valid until the next run().
  virtual SelectionView read(std::span<float> o, std::span<float> lse) = 0;
};

/// Where the harness runs its selector entries: a backend holds one capture layer as the engine's fp16 cache
/// and makes the decode steps over it. fidelity_backend() makes the CPU one (and, in eval/cuda_fidelity.hpp,
/// the CUDA one); evaluate_fidelity drives either through this interface alone.
class FidelityBackend {
 public:
  virtual ~FidelityBackend() = default;
  /// "cpu" or "cuda", for the tables and the comparison.
  virtual std::string_view name() const = 0;
  /// The selector entries, by index.
  virtual std::size_t selectors() const = 0;
  virtual std::string_view selector(std::size_t i) const = 0;
  /// Holds `layer` of `capture` ([token][kv head][channel] fp16 q, k, v) for the steps made next; the steps
  /// made for the previous layer must be gone.
  virtual void load(const Capture& capture, const CaptureLayer& layer) = 0;
  /// Selector entry i at `budget_tokens` on the loaded layer, unprepared. Throws kvsift::Error when the entry
  /// cannot run at that budget.
  virtual std::unique_ptr<FidelityStep> step(std::size_t i, std::int32_t budget_tokens) = 0;
};

/// The CPU backend: each step a CPU DecodeStep of AnySelector<half, cpu::Context> on `ctx`, over host copies of
/// the layer.
std::unique_ptr<FidelityBackend> fidelity_backend(std::vector<SelectorEntry> selectors, const cpu::Context& ctx = {});

struct FidelityOptions {
  std::vector<double> budgets{0.01, 0.02, 0.05};  ///< fractions of the context at the first decode position
  std::int32_t decode_positions = 64;             ///< positions evaluated, spread over the decoded range
  double prefill = 0.5;                           ///< share of the capture's tokens before the first decode position
};

/// Scores of one (layer, budget, selector).
struct FidelityRow {
  std::int32_t layer = 0;           ///< the model's layer number (CaptureLayer::layer)
  std::string selector;
  double budget = 0.0;              ///< fraction of the context at the first decode position
  std::int32_t budget_tokens = 0;   ///< K
  std::string refused;              ///< why the selector could not run at this budget; empty when it ran
  double mass_recall = 0.0;         ///< over (evaluated position, query head): mean, 10th and 90th percentile
  double mass_recall_p10 = 0.0;
  double mass_recall_p90 = 0.0;
  double output_error = 0.0;        ///< over (evaluated position, query head): mean and 90th percentile
  double output_error_p90 = 0.0;
  double lse_error = 0.0;           ///< over (evaluated position, query head): mean and 90th percentile
  double lse_error_p90 = 0.0;
  double id_recall = 0.0;           ///< mean over (evaluated position, kv head)
  double mean_selected = 0.0;       ///< tokens selected per (evaluated position, kv head)
};

struct FidelityResult {
  std::string backend;                  ///< where the selectors ran (FidelityBackend::name)
  std::int32_t first_position = 0;      ///< P: tokens [0, P) are the prefill
  std::vector<std::int32_t> positions;  ///< the evaluated decode positions, ascending
  std::vector<FidelityRow> rows;        ///< per capture layer (capture order), budget (options order), selector
};

/// A selection of a backend that differs from the first backend's at one evaluated (position, kv head): the
/// tokens each attended (window and selection) that the other did not.
struct SelectionMismatch {
  std::int32_t layer = 0;
  std::string selector;
  double budget = 0.0;
  std::int32_t position = 0;
  std::int32_t kv_head = 0;
  std::vector<std::int32_t> only_first;  ///< attended by the first backend only, ascending
  std::vector<std::int32_t> only_this;   ///< attended by this backend only, ascending
  double mass = 0.0;  ///< the largest |mass recall difference| over the kv head's query heads (exact weights)
};

/// How a backend's selections differ from the first backend's on the same capture, position by position.
struct BackendDifference {
  std::string backend, first;             ///< FidelityBackend::name of this backend and of the first
  std::int64_t selections = 0;            ///< (layer, budget, selector, evaluated position, kv head) both ran
  std::vector<SelectionMismatch> mismatches;
  std::vector<std::string> refusals;      ///< rows refused by one backend only: "layer L, NAME, B%: who refused"
  double max_mass() const;                ///< the largest mismatch's mass; 0 without mismatches
};

struct FidelityComparison {
  std::vector<FidelityResult> results;         ///< per backend, in the order given
  std::vector<BackendDifference> differences;  ///< per backend after the first, against the first
};

/// Scores the selector entries of every backend on every layer of `capture` (definitions above), in lockstep:
/// the exact attention of each evaluated position is computed once for all of them, and every backend's
/// attended set is compared with the first backend's. The backends hold the same entries (names, in order).
/// Throws kvsift::Error for no backend (or a null one), backends whose entries differ, an empty capture, arrays
/// that disagree with its shape, a budget outside (0, 1], a prefill share that leaves no prefill or no decode
/// position, or decode_positions outside [1, decoded positions].
FidelityComparison evaluate_fidelity(const Capture& capture, std::span<FidelityBackend* const> backends,
                                     const FidelityOptions& options = {});

/// `selectors` on the CPU backend (single thread): evaluate_fidelity of fidelity_backend(selectors) alone.
FidelityResult evaluate_fidelity(const Capture& capture, std::span<const SelectorEntry> selectors,
                                 const FidelityOptions& options = {});

/// The rows as a markdown table: layer, selector, budget, K, mass recall (mean, p10, p90), output error
/// (mean, p90), id recall, tokens selected.
std::string fidelity_markdown(std::span<const FidelityRow> rows);

/// A line stating the decoded range, the evaluated positions and K's definition, then the table.
std::string fidelity_markdown(const FidelityResult& result);

/// The error columns alone: layer, selector, budget, K, output error (mean, p90), LSE error (mean, p90); for
/// selectors whose selection the other columns do not describe (CentroidKV).
std::string fidelity_error_markdown(std::span<const FidelityRow> rows);

/// One paragraph: how many of the selections differed from the first backend's, by how much mass at most, in
/// which rows, and the rows only one backend refused.
std::string fidelity_markdown(const BackendDifference& difference);

}  // namespace kvsift
