#pragma once
/// The fidelity harness's backend (eval/fidelity.hpp FidelityBackend), written once for both contexts: the
/// capture layer, each step's workspace and its output live in the context's memory (Context::array), and each
/// step is a DecodeStep of AnySelector<half, Context>. `Copy` is the one thing that differs, host <-> context
/// memory: Copy::copy(dst, src, bytes, ctx) in the context's order (either side may be host memory) and
/// Copy::wait(ctx) until those copies are done. Instantiated by src/eval/fidelity.cpp (cpu::Context) and
/// src/cuda/fidelity.cpp (cuda::Context), after their backend header (the DecodeStep's calls are found there).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/selection_buffer.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/eval/fidelity.hpp"
#include "kvsift/step/decode_step.hpp"

namespace kvsift::detail {

template <class Context, class Copy>
class SelectorBackend final : public FidelityBackend {
 public:
  template <class T>
  using Array = typename Context::template array<T>;

  SelectorBackend(std::string name, std::vector<BasicSelectorEntry<Context>> entries, const Context& ctx)
      : name_(std::move(name)), entries_(std::move(entries)), ctx_(ctx) {}

  std::string_view name() const override { return name_; }
  std::size_t selectors() const override { return entries_.size(); }
  std::string_view selector(std::size_t i) const override { return entries_.at(i).name; }

  void load(const Capture& capture, const CaptureLayer& layer) override {
    tokens_ = capture.tokens;
    q_heads_ = capture.q_heads;
    kv_heads_ = capture.kv_heads;
    head_dim_ = capture.head_dim;
    layer_ = layer.layer;
    rope_ = capture.rope;
    q_ = upload(layer.q);
    k_ = upload(layer.k);
    k_pre_ = upload(layer.k_pre);
    v_ = upload(layer.v);
    // lengths_[t] = t + 1: the cache holding [0, t] is read through &lengths_[t], no per-step copy.
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(tokens_));
    std::iota(lengths.begin(), lengths.end(), 1);
    lengths_ = upload(lengths);
    slot_ = upload(std::vector<std::int32_t>{0});
    Copy::wait(ctx_);  // the host vectors above end here
  }

  std::unique_ptr<FidelityStep> step(std::size_t i, std::int32_t budget_tokens) override {
    const SelectorLimits limits{.max_slots = 1, .max_tokens = tokens_, .q_heads = q_heads_, .kv_heads = kv_heads_,
                                .head_dim = head_dim_};
    return std::make_unique<Step>(*this, entries_.at(i).make(budget_tokens, limits, layer_));
  }

 private:
  class Step final : public FidelityStep {
   public:
    Step(SelectorBackend& layer, BasicSelectorSetup<Context> setup)
        : layer_(layer), window_(setup.window),
          step_(std::move(setup.selector),
                DecodeStepConfig{.attention = {.window = setup.window}, .max_batch = 1, .q_heads = layer.q_heads_,
                                 .kv_heads = layer.kv_heads_, .head_dim = layer.head_dim_,
                                 .max_seq_len = layer.tokens_},
                layer.ctx_),
          workspace_(step_.workspace_bytes()), o_(std::size_t(layer.q_heads_) * layer.head_dim_),
          lse_(std::size_t(layer.q_heads_)),
          selection_(1, layer.kv_heads_, step_.selection(workspace(), 1).capacity, false) {}

    AttentionWindow window() const override { return window_; }
    void prepare(std::int32_t prefill) override {
      const std::int64_t token_stride = std::int64_t(layer_.q_heads_) * layer_.head_dim_;
      const SequenceView<const half> queries{layer_.q_.data(), 1, layer_.q_heads_, prefill, layer_.head_dim_,
                                             layer_.tokens_ * token_stride, layer_.head_dim_, token_stride};
      step_.prepare({.cache = layer_.cache(prefill),
                     .slots = layer_.slot_.data(),
                     .queries = queries,
                     .k_pre_rope = layer_.pre_rope_keys(prefill),
                     .rope = layer_.rope_},
                    layer_.ctx_);
    }
    void run(std::int32_t position) override {
      const std::size_t q_offset = std::size_t(position) * layer_.q_heads_ * layer_.head_dim_;
      step_.run(StepInputs<half>{.q = QueryView<const half>::packed(layer_.q_.data() + q_offset, 1, layer_.q_heads_,
                                                                    layer_.head_dim_),
                                 .cache = layer_.cache(position + 1),
                                 .k_pre_rope = layer_.pre_rope_key(position),
                                 .slots = layer_.slot_.data()},
                StateView<float>::packed(o_.data(), lse_.data(), 1, layer_.q_heads_, layer_.head_dim_), workspace(),
                layer_.ctx_);
    }
    SelectionView read(std::span<float> o, std::span<float> lse) override {
      const SelectionView from = step_.selection(workspace(), 1);
      const SelectionView& to = selection_.view();
      const std::size_t rows = std::size_t(layer_.kv_heads_);
      KVSIFT_CHECK(o.size() == o_.size() && lse.size() == lse_.size(), "FidelityStep::read",
                   "o holds {} values and lse {}; the output has {} and {}", o.size(), lse.size(), o_.size(),
                   lse_.size());
      Copy::copy(o.data(), o_.data(), o_.size() * sizeof(float), layer_.ctx_);
      Copy::copy(lse.data(), lse_.data(), lse_.size() * sizeof(float), layer_.ctx_);
      Copy::copy(to.indices, from.indices, rows * std::size_t(from.capacity) * sizeof(std::int32_t), layer_.ctx_);
      Copy::copy(to.counts, from.counts, rows * sizeof(std::int32_t), layer_.ctx_);
      Copy::wait(layer_.ctx_);
      return to;
    }

   private:
    std::span<std::byte> workspace() { return {workspace_.data(), workspace_.size()}; }

    SelectorBackend& layer_;
    AttentionWindow window_;
    DecodeStep<AnySelector<half, Context>> step_;
    Array<std::byte> workspace_;
    Array<float> o_, lse_;
    SelectionBuffer selection_;  ///< host copy of the last read selection
  };

  template <class T>
  Array<T> upload(const std::vector<T>& host) {
    Array<T> out(host.size());
    Copy::copy(out.data(), host.data(), host.size() * sizeof(T), ctx_);
    return out;
  }
  /// The loaded layer's cache holding tokens [0, length), in its [token][kv head][channel] layout.
  KVCache<half> cache(std::int32_t length) {
    const std::int64_t token_stride = std::int64_t(kv_heads_) * head_dim_;
    return ContiguousKVView<half>{k_.data(), v_.data(), lengths_.data() + (length - 1), 1, kv_heads_, tokens_,
                                  head_dim_, tokens_ * token_stride, head_dim_, token_stride};
  }

  /// The capture's pre-RoPE keys of tokens [0, length) as [1, kv_heads, length, head_dim], and of token t alone
  /// as [1, kv_heads, head_dim]: the keys an engine has before RoPE, for selectors that code them (A²ATS).
  SequenceView<const half> pre_rope_keys(std::int32_t length) const {
    const std::int64_t token_stride = std::int64_t(kv_heads_) * head_dim_;
    return {k_pre_.data(), 1, kv_heads_, length, head_dim_, tokens_ * token_stride, head_dim_, token_stride};
  }
  HeadsView<const half> pre_rope_key(std::int32_t t) const {
    return HeadsView<const half>::packed(k_pre_.data() + std::size_t(t) * kv_heads_ * head_dim_, 1, kv_heads_,
                                         head_dim_);
  }

  std::string name_;
  std::vector<BasicSelectorEntry<Context>> entries_;
  Context ctx_;
  RopeConfig rope_{};
  std::int32_t layer_ = 0, tokens_ = 0, q_heads_ = 0, kv_heads_ = 0, head_dim_ = 0;
  Array<half> q_, k_, k_pre_, v_;
  Array<std::int32_t> lengths_, slot_;
};

}  // namespace kvsift::detail
