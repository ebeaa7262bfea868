#pragma once
/// A test-only selector with log-weights and a second source, and the fp64 reference of a decode step over
/// window ∪ primary selection ∪ weighted second rows; shared by the CPU and CUDA tests of the decode step.
///
/// TwoSources wraps OracleTopK (the primary selection) and adds, as the template flags ask:
///   - log-weights: after OracleTopK's select it writes a fixed table of weights [max_batch, kv_heads,
///     capacity] over the step's weights array (a copy on the context: memcpy, or cudaMemcpyAsync on the
///     stream), so every selected entry carries a known weight;
///   - a second source: a store [max_slots, kv_heads, rows, head_dim] of "merged" K/V rows (the test fills them
///     with copies of cache rows, means of two rows, or random rows) seen through a paged view whose page
///     table is the step's slots (one page of `rows` tokens per slot: how a per-slot store maps to batch rows),
///     and a fixed selection per (batch row, kv head) of its first counts[g] rows with known log-weights.
/// Its memory is the context's: host vectors are copied in at construction with copy_to_context, which a GPU
/// test defines for cuda::Context.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "kvsift/core/kv_cache.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/selector.hpp"
#include "test_util.hpp"

namespace kvsift::test {

/// Copies `bytes` from host or context memory into context memory, ordered on the context (a GPU test defines
/// the cuda::Context specialization).
template <class Context>
void copy_to_context(void* dst, const void* src, std::size_t bytes, const Context& ctx);

/// What the test decides about the second source (host values).
template <class T>
struct SecondSourceData {
  std::int32_t rows = 0;                 ///< merged rows per (slot, kv head): the page size and the capacity
  std::vector<T> k, v;                   ///< [max_slots, kv_heads, rows, head_dim]
  std::vector<std::int32_t> counts;      ///< [kv_heads]: row (b, g) lists rows 0 .. counts[g] - 1 of its slot
  std::vector<float> log_weights;        ///< [max_batch, kv_heads, rows]
};

template <class T, class Context, bool Weights, bool Second>
class TwoSources {
 public:
  using value_type = T;
  using context_type = Context;

  TwoSources(const SelectorLimits& limits, std::int32_t budget, std::int32_t max_batch,
             const std::vector<float>& primary_weights, const SecondSourceData<T>& second, const Context& ctx)
      : inner_(limits, {.budget = budget}), limits_(limits), max_batch_(max_batch), second_rows_(second.rows) {
    const std::size_t rows = std::size_t(max_batch) * limits.kv_heads;
    if constexpr (Weights) upload(weights_, primary_weights, rows * std::size_t(budget), ctx);
    if constexpr (Second) {
      upload(k_, second.k, std::size_t(limits.max_slots) * limits.kv_heads * second.rows * limits.head_dim, ctx);
      upload(v_, second.v, k_.size(), ctx);
      std::vector<std::int32_t> indptr(std::size_t(max_batch) + 1), last(std::size_t(max_batch), second.rows);
      for (std::size_t b = 0; b < indptr.size(); ++b) indptr[b] = std::int32_t(b);
      upload(indptr_, indptr, indptr.size(), ctx);
      upload(last_, last, last.size(), ctx);
      std::vector<std::int32_t> indices(rows * second.rows, -1), counts(rows);
      for (std::size_t r = 0; r < rows; ++r) {
        counts[r] = second.counts[r % limits.kv_heads];
        for (std::int32_t i = 0; i < counts[r]; ++i) indices[r * second.rows + i] = i;
      }
      upload(second_indices_, indices, indices.size(), ctx);
      upload(second_counts_, counts, counts.size(), ctx);
      upload(second_weights_, second.log_weights, rows * second.rows, ctx);
    }
  }

  std::string_view name() const { return "TwoSources"; }
  std::int32_t capacity() const { return inner_.capacity(); }
  IndexBytes index_bytes() const { return {}; }
  std::size_t select_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return inner_.select_workspace_bytes(shape, ctx);
  }
  std::size_t append_workspace_bytes(const SelectShape& shape, const Context& ctx) const {
    return inner_.append_workspace_bytes(shape, ctx);
  }
  void prepare(const PrefillInputs<T>& in, const Context& ctx) { inner_.prepare(in, ctx); }
  void append(const AppendInputs<T>& in, std::span<std::byte> ws, const Context& ctx) { inner_.append(in, ws, ctx); }
  void release(std::span<const std::int32_t> slots) { inner_.release(slots); }

  static constexpr bool writes_log_weights() { return Weights; }

  void select(const SelectInputs<T>& in, const SelectionView& out, std::span<std::byte> ws, const Context& ctx) {
    inner_.select(in, out, ws, ctx);
    if constexpr (Weights) {
      KVSIFT_CHECK(out.log_weights != nullptr, "TwoSources::select", "the step passed no log-weights array");
      copy_to_context(out.log_weights, weights_.data(),
                      std::size_t(in.q.batch) * limits_.kv_heads * std::size_t(capacity()) * sizeof(float), ctx);
    }
  }

  std::int32_t second_source_capacity() const
    requires Second
  {
    return second_rows_;
  }
  SecondSource<T> second_source(const SelectInputs<T>& in) const
    requires Second
  {
    const std::int32_t d = limits_.head_dim, heads = limits_.kv_heads;
    const PagedKVView<const T> store{.k_pages = k_.data(), .v_pages = v_.data(), .page_indptr = indptr_.data(),
                                     .page_indices = in.slots, .last_page_len = last_.data(), .batch = in.q.batch,
                                     .kv_heads = heads, .head_dim = d, .page_size = second_rows_,
                                     .num_pages = limits_.max_slots,
                                     .page_stride = std::int64_t(heads) * second_rows_ * d, .token_stride = d,
                                     .head_stride = std::int64_t(second_rows_) * d};
    return {store, SelectionView{const_cast<std::int32_t*>(second_indices_.data()),
                                 const_cast<std::int32_t*>(second_counts_.data()),
                                 const_cast<float*>(second_weights_.data()), in.q.batch, heads, second_rows_}};
  }

 private:
  template <class E>
  static void upload(typename Context::template array<E>& dst, const std::vector<E>& src, std::size_t count,
                     const Context& ctx) {
    KVSIFT_CHECK(src.size() == count, "TwoSources", "a host table has {} entries, {} expected", src.size(), count);
    dst.resize(count);
    copy_to_context(dst.data(), src.data(), count * sizeof(E), ctx);
  }

  OracleTopK<T, Context> inner_;
  SelectorLimits limits_;
  std::int32_t max_batch_, second_rows_;
  typename Context::template array<float> weights_, second_weights_;
  typename Context::template array<T> k_, v_;
  typename Context::template array<std::int32_t> indptr_, last_, second_indices_, second_counts_;
};

/// A second source built from a problem's cache (host floats k/v [batch, kv_heads, capacity, head_dim] already
/// rounded to T, slots[b] the slot of batch row b): per (slot, kv head) rows of three kinds in turn, a copy of a
/// cache token of that sequence, the mean of two of its tokens, a random row; log-weights in [-1, log 4].
template <class T>
SecondSourceData<T> make_second_source(Random& rng, const HostKV& kv, const std::vector<std::int32_t>& slots,
                                       std::int32_t max_slots, std::int32_t max_batch, std::int32_t rows) {
  SecondSourceData<T> s;
  s.rows = rows;
  const std::int32_t d = kv.head_dim, heads = kv.kv_heads;
  std::vector<float> k = rng.normal(std::size_t(max_slots) * heads * rows * d);
  std::vector<float> v = rng.normal(k.size());
  for (std::int32_t b = 0; b < kv.batch; ++b) {
    const std::int32_t len = kv.seq_lens[b];
    for (std::int32_t g = 0; g < heads; ++g) {
      for (std::int32_t i = 0; i < rows; ++i) {
        float* kr = &k[((std::size_t(slots[b]) * heads + g) * rows + i) * d];
        float* vr = &v[((std::size_t(slots[b]) * heads + g) * rows + i) * d];
        const std::size_t t0 = (std::size_t(b) * heads + g) * kv.capacity + rng.uniform_int(0, len - 1);
        const std::size_t t1 = (std::size_t(b) * heads + g) * kv.capacity + rng.uniform_int(0, len - 1);
        if (i % 3 == 2) continue;  // random row
        for (std::int32_t c = 0; c < d; ++c) {
          kr[c] = i % 3 == 0 ? kv.k[t0 * d + c] : 0.5f * (kv.k[t0 * d + c] + kv.k[t1 * d + c]);
          vr[c] = i % 3 == 0 ? kv.v[t0 * d + c] : 0.5f * (kv.v[t0 * d + c] + kv.v[t1 * d + c]);
        }
      }
    }
  }
  s.k = to_storage<T>(k);
  s.v = to_storage<T>(v);
  for (std::int32_t g = 0; g < heads; ++g) s.counts.push_back(rows - g % 3);
  s.log_weights.resize(std::size_t(max_batch) * heads * rows);
  for (float& w : s.log_weights) w = rng.uniform(-1.0f, std::log(4.0f));
  return s;
}

/// The fp64 reference of one step: for each (b, q head), naive attention over the window's tokens (weight 0),
/// the primary selection's tokens (indices and counts as the step wrote them, weights from `primary_weights`
/// when given), and the second source's listed rows of slot slots[b] with their weights (when given).
template <class T>
HostState two_source_reference(const std::vector<T>& q, std::int32_t q_heads, const HostKV& kv,
                               const AttentionWindow& window, const std::vector<std::int32_t>& indices,
                               const std::vector<std::int32_t>& counts, std::int32_t capacity,
                               const std::vector<float>* primary_weights, const SecondSourceData<T>* second,
                               const std::vector<std::int32_t>& slots, double scale) {
  const std::int32_t d = kv.head_dim, heads = kv.kv_heads, group = q_heads / heads;
  HostState ref(kv.batch, q_heads, d);
  std::vector<float> second_k, second_v, qf(d);
  if (second != nullptr) {
    for (const T x : second->k) second_k.push_back(to_float(x));
    for (const T x : second->v) second_v.push_back(to_float(x));
  }
  std::vector<double> o;
  for (std::int32_t b = 0; b < kv.batch; ++b) {
    const std::int32_t len = kv.seq_lens[b];
    for (std::int32_t g = 0; g < heads; ++g) {
      const std::size_t row = std::size_t(b) * heads + g;
      std::vector<const float*> ks, vs;
      std::vector<double> w;
      const auto token = [&](std::int32_t t, double weight) {
        const std::size_t at = ((std::size_t(b) * heads + g) * kv.capacity + t) * d;
        ks.push_back(&kv.k[at]);
        vs.push_back(&kv.v[at]);
        w.push_back(weight);
      };
      for (std::int32_t i = 0; i < window.size(len); ++i) token(window.token(i, len), 0.0);
      for (std::int32_t i = 0; i < counts[row]; ++i) {
        token(indices[row * capacity + i], primary_weights ? (*primary_weights)[row * capacity + i] : 0.0);
      }
      if (second != nullptr) {
        for (std::int32_t i = 0; i < second->counts[g]; ++i) {
          const std::size_t at = ((std::size_t(slots[b]) * heads + g) * second->rows + i) * d;
          ks.push_back(&second_k[at]);
          vs.push_back(&second_v[at]);
          w.push_back(second->log_weights[row * second->rows + i]);
        }
      }
      for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
        for (std::int32_t c = 0; c < d; ++c) qf[c] = to_float(q[(std::size_t(b) * q_heads + h) * d + c]);
        const double lse = naive_attention(qf.data(), ks, vs, w, d, scale, o);
        ref.lse[std::size_t(b) * q_heads + h] = float(lse);
        for (std::int32_t c = 0; c < d; ++c) ref.o[(std::size_t(b) * q_heads + h) * d + c] = float(o[c]);
      }
    }
  }
  return ref;
}

/// A step's state (O in O_T, LSE fp32) against the reference where kv row `bad_row` had a count outside its
/// capacity: that row's query heads NaN in O and LSE, every other head within `o_tolerance` (O, absolute) and 1e-3
/// relative (LSE). `group` query heads per kv row.
template <class O_T>
void expect_state_with_bad_row(const std::vector<O_T>& o, const std::vector<float>& lse, const HostState& ref,
                               std::int32_t heads, std::int32_t group, std::int32_t head_dim, std::int32_t bad_row,
                               float o_tolerance) {
  for (std::int32_t head = 0; head < heads; ++head) {
    const bool in_bad_row = head / group == bad_row;
    for (std::int32_t c = 0; c < head_dim; ++c) {
      const float got = to_float(o[std::size_t(head) * head_dim + c]);
      if (in_bad_row) {
        ASSERT_TRUE(std::isnan(got)) << "head " << head << " channel " << c;
      } else {
        ASSERT_NEAR(got, ref.o[std::size_t(head) * head_dim + c], o_tolerance) << "head " << head << " channel " << c;
      }
    }
    if (in_bad_row) {
      EXPECT_TRUE(std::isnan(lse[head])) << "head " << head;
    } else {
      EXPECT_NEAR(lse[head], ref.lse[head], 1e-3 * std::max(1.0f, std::abs(ref.lse[head]))) << "head " << head;
    }
  }
}

}  // namespace kvsift::test
