#pragma once
/// The KVSelector interface every retrieval method implements, and AnySelector, its type-erased wrapper for
/// engines that pick the method at run time.
///
/// Life cycle, per layer: prepare() once after prefill (build the index from the prefill queries and keys,
/// and values where the method merges tokens); then per decode step select() fills a SelectionView for the
/// current queries, and append() adds the step's new token so later steps can select it.
///
/// Token indices written by select() are positions in the sequence (0-based, < the selector's current
/// length), distinct, ascending within each (sequence, kv head) row; a method that merges tokens may write
/// a natural-log weight per index. Memory space of every view: the selector's backend (host for CPU
/// selectors).
///
/// Thread safety: a selector is not synchronized. Calls that mutate (prepare, select, append) must not run
/// concurrently on one object; const calls (index_bytes, name) may run concurrently with each other.
/// Distinct objects are independent.

#include <concepts>
#include <cstddef>
#include <memory>
#include <string_view>
#include <type_traits>
#include <utility>

#include "kvsift/core/views.hpp"

namespace kvsift {

/// After prefill: all prefill queries [batch, q_heads, tokens, head_dim] and the KV cache holding the same
/// tokens (post-RoPE keys). kv.seq_len(b) tokens of sequence b are indexed; q.tokens >= every seq_len.
template <class T = float>
struct PrefillInputs {
  SequenceView<const T> q;
  ContiguousKVView<const T> kv;
};

/// One decode step's new token for every sequence: k, v [batch, kv_heads, head_dim], q [batch, q_heads,
/// head_dim]; it becomes token number length (the selector's current length) of its sequence.
template <class T = float>
struct AppendInputs {
  HeadsView<const T> k;
  HeadsView<const T> v;
  QueryView<const T> q;
};

template <class S>
concept KVSelector = requires(S& s, const S& cs, const PrefillInputs<typename S::element_type>& prefill,
                              const QueryView<const typename S::element_type>& q, const SelectionView& out,
                              const AppendInputs<typename S::element_type>& step) {
  typename S::element_type;
  s.prepare(prefill);
  s.select(q, out);
  s.append(step);
  { cs.index_bytes() } -> std::convertible_to<std::size_t>;
  { cs.name() } -> std::convertible_to<std::string_view>;
};

/// Owns any KVSelector behind one runtime interface. Move-only; never empty after construction.
template <class T = float>
class AnySelector {
 public:
  using element_type = T;

  template <KVSelector S>
    requires(std::same_as<typename S::element_type, T> && !std::same_as<std::remove_cvref_t<S>, AnySelector>)
  explicit AnySelector(S selector) : impl_(std::make_unique<Model<S>>(std::move(selector))) {}

  void prepare(const PrefillInputs<T>& prefill) { impl_->prepare(prefill); }
  void select(const QueryView<const T>& q, const SelectionView& out) { impl_->select(q, out); }
  void append(const AppendInputs<T>& step) { impl_->append(step); }
  std::size_t index_bytes() const { return impl_->index_bytes(); }
  std::string_view name() const { return impl_->name(); }

 private:
  struct Interface {
    virtual ~Interface() = default;
    virtual void prepare(const PrefillInputs<T>&) = 0;
    virtual void select(const QueryView<const T>&, const SelectionView&) = 0;
    virtual void append(const AppendInputs<T>&) = 0;
    virtual std::size_t index_bytes() const = 0;
    virtual std::string_view name() const = 0;
  };
  template <class S>
  struct Model final : Interface {
    explicit Model(S s) : selector(std::move(s)) {}
    void prepare(const PrefillInputs<T>& p) override { selector.prepare(p); }
    void select(const QueryView<const T>& q, const SelectionView& out) override { selector.select(q, out); }
    void append(const AppendInputs<T>& step) override { selector.append(step); }
    std::size_t index_bytes() const override { return selector.index_bytes(); }
    std::string_view name() const override { return selector.name(); }
    S selector;
  };
  std::unique_ptr<Interface> impl_;
};

}  // namespace kvsift
