#pragma once
/// SpeContextGroups: a model's decode step whose layers come in groups of consecutive layers, each group attended
/// with the selection of its own retrieval head (a SpeContext selector). One head for the whole model keeps too little
/// of the deeper layers' attention mass on SmolLM2: its layers fall into blocks that serve each other poorly, and
/// three groups led by layers 0, 3 and 12 (each headed by its first layer's own q/k, which an engine has when the
/// group starts) keep 0.85 of the own oracles' mass where the layer-0 head keeps 0.33 (docs/specontext.md, "Layer
/// groups"). Each group is a SpeContextStep (selectors/specontext/step.hpp) with the model's configuration, so the
/// window, the rerank per layer, validation and PDL are every group's alike; per decode step:
///   - select(g, head inputs) before group g's first layer: head g's lengths, append and select;
///   - attend(layer inputs) for each layer of group g, over that selection (with config.rerank, over the layer's own
///     best K of it).
/// Cost per step: one head select per group (the head's keys read once per group) besides the layers' attention.
///
/// Memory and calls: the groups share one workspace of workspace_bytes() bytes (each group's select overwrites the
/// last one's selection: the layers run in order), allocated by the caller; nothing is allocated or synchronized
/// per call beyond what SpeContextStep does; on CUDA every call is stream-ordered and CUDA-graph capturable. attend
/// is refused for a layer outside the group of the last select, so a layer never attends another group's selection.
/// Thread safety: one object serves one thread at a time; it owns its heads.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/selectors/specontext/specontext.hpp"
#include "kvsift/selectors/specontext/step.hpp"

namespace kvsift {

struct SpeContextGroupsConfig {
  /// Every group's step (config.layers: the model's layers; the rerank per layer applies in every group).
  SpeContextStepConfig step{};
  /// The first layer of each group, ascending, the first 0, each below step.layers: group g holds the layers
  /// [first_layers[g], first_layers[g + 1]) (the last up to step.layers).
  std::vector<std::int32_t> first_layers{};
};

template <class T, class Context>
class SpeContextGroups {
 public:
  using value_type = T;
  using context_type = Context;
  using Selector = SpeContext<T, Context>;
  using Step = SpeContextStep<T, Context>;

  /// One head per group, in the groups' order. Refused: a number of heads other than the groups', first_layers
  /// not ascending from 0 or reaching past config.step.layers, heads whose limits differ, and whatever
  /// SpeContextStep refuses of any group.
  SpeContextGroups(std::vector<Selector> heads, const SpeContextGroupsConfig& config, const Context& ctx)
      : first_layers_(checked(config, heads)) {
    steps_.reserve(heads.size());
    for (Selector& head : heads) {
      steps_.emplace_back(std::move(head), config.step, ctx);
      workspace_bytes_ = std::max(workspace_bytes_, steps_.back().workspace_bytes());
    }
  }

  std::int32_t groups() const { return std::int32_t(steps_.size()); }
  std::int32_t layers() const { return steps_.front().layers(); }
  std::int32_t first_layer(std::int32_t group) const {
    return first_layers_[std::size_t(checked_group("SpeContextGroups::first_layer", group))];
  }
  /// The group that holds `layer` (in [0, layers())).
  std::int32_t group_of(std::int32_t layer) const {
    KVSIFT_CHECK(layer >= 0 && layer < layers(), "SpeContextGroups::group_of", "layer (= {}) is outside [0, {})", layer,
                 layers());
    std::int32_t g = 0;
    while (g + 1 < groups() && first_layers_[std::size_t(g) + 1] <= layer) ++g;
    return g;
  }
  /// Group g's step: its head (step(g).selector()), its last selection (step(g).selection), its rerank.
  Step& step(std::int32_t group) { return steps_[std::size_t(checked_group("SpeContextGroups::step", group))]; }
  const Step& step(std::int32_t group) const {
    return steps_[std::size_t(checked_group("SpeContextGroups::step", group))];
  }
  std::size_t workspace_bytes() const { return workspace_bytes_; }

  /// Prefill of joining sequences for head `group`: its prompt keys (in.k_pre_rope, from that group's head layer).
  /// attend then waits for the next select.
  void prepare(std::int32_t group, PrefillInputs<T> in, const Context& ctx) {
    steps_[std::size_t(checked_group("SpeContextGroups::prepare", group))].prepare(std::move(in), ctx);
    selected_group_ = -1;
  }
  /// Sequences leave every head; attend waits for the next select. Refused, with no head released, for a slot
  /// some head does not hold.
  void release(std::span<const std::int32_t> slots) {
    for (std::size_t g = 0; g < steps_.size(); ++g) {
      for (const std::int32_t slot : slots) {
        KVSIFT_CHECK(steps_[g].selector().prepared(slot), "SpeContextGroups::release",
                     "slot {} is not prepared in head {}: every head must hold the slots released", slot, g);
      }
    }
    for (Step& s : steps_) s.release(slots);
    selected_group_ = -1;
  }

  /// Group `group`'s selection, before its first layer: head `group`'s step inputs (its q_r, the step token's k_r
  /// and the cache its lengths come from).
  void select(std::int32_t group, const SpeContextHeadInputs<T>& in, std::span<std::byte> workspace,
              const Context& ctx) {
    Step& s = steps_[std::size_t(checked_group("SpeContextGroups::select", group))];
    selected_group_ = -1;  // a refused select leaves no selection to attend
    s.select(in, workspace, ctx);
    selected_group_ = group;
  }

  /// Layer in.layer's attention over its group's selection (SpeContextStep::attend). Refused for a layer outside
  /// the group of the last select, and before any select, after a prepare or a release.
  template <class TO>
  void attend(const SpeContextLayerInputs<T>& in, const StateView<TO>& out, std::span<std::byte> workspace,
              const Context& ctx) {
    constexpr const char* where = "SpeContextGroups::attend";
    KVSIFT_CHECK(selected_group_ >= 0, where,
                 "no selection to attend: call select for the layer's group first (after construction, prepare and "
                 "release, attend waits for a select)");
    const std::int32_t group = group_of(in.layer);
    KVSIFT_CHECK(group == selected_group_, where,
                 "in.layer (= {}) is in group {} (layers from {}), but the last select was group {}'s: select group {} "
                 "before its first layer",
                 in.layer, group, first_layers_[std::size_t(group)], selected_group_, group);
    steps_[std::size_t(group)].attend(in, out, workspace, ctx);
  }

 private:
  static std::vector<std::int32_t> checked(const SpeContextGroupsConfig& config, const std::vector<Selector>& heads) {
    constexpr const char* where = "SpeContextGroups";
    const std::vector<std::int32_t>& first = config.first_layers;
    KVSIFT_CHECK(!first.empty() && first.front() == 0, where,
                 "config.first_layers (size {}) must start with layer 0 (the first group's first layer)", first.size());
    for (std::size_t g = 1; g < first.size(); ++g) {
      KVSIFT_CHECK(first[g] > first[g - 1] && first[g] < config.step.layers, where,
                   "config.first_layers[{}] (= {}) must lie in ({}, config.step.layers = {})", g, first[g],
                   first[g - 1], config.step.layers);
    }
    KVSIFT_CHECK(heads.size() == first.size(), where, "{} heads for {} groups (config.first_layers): one head per group",
                 heads.size(), first.size());
    for (std::size_t g = 1; g < heads.size(); ++g) {
      const SelectorLimits &a = heads.front().limits(), &b = heads[g].limits();
      KVSIFT_CHECK(a == b && heads.front().capacity() == heads[g].capacity(), where,
                   "head {} (max_slots {}, max_tokens {}, heads {} / {}, head_dim {}, budget {}) differs from head 0 ({}, "
                   "{}, {} / {}, {}, {}): every group's head must have the same limits and budget",
                   g, b.max_slots, b.max_tokens, b.q_heads, b.kv_heads, b.head_dim, heads[g].capacity(), a.max_slots,
                   a.max_tokens, a.q_heads, a.kv_heads, a.head_dim, heads.front().capacity());
    }
    return first;
  }
  std::int32_t checked_group(const char* where, std::int32_t group) const {
    KVSIFT_CHECK(group >= 0 && group < groups(), where, "group (= {}) is outside [0, {})", group, groups());
    return group;
  }

  std::vector<std::int32_t> first_layers_;
  std::vector<Step> steps_;
  std::size_t workspace_bytes_ = 0;
  std::int32_t selected_group_ = -1;  ///< the group of the last select (-1: none to attend)
};

}  // namespace kvsift
