#pragma once
/// A windowed-RoPE problem (selectors/a2ats/windowed_rope.hpp, A²ATS's eq. 11) and its fp64 reference, in host memory;
/// shared by the CPU and CUDA tests.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "kvsift/selectors/a2ats/windowed_rope.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/cpu/rope.hpp"
#include "test_util.hpp"

namespace kvsift::test {

struct WropeSpec {
  std::int32_t batch = 2, q_heads = 8, kv_heads = 2, head_dim = 128, tokens = 700;
  std::int32_t window = 64, offset = 2048, sink = 4;
  std::int32_t k = 96;           ///< selection capacity; 0: dense (every middle token, capacity = tokens)
  std::int32_t page_size = 0;    ///< 0: contiguous
  bool equal_lengths = false;    ///< every sequence `tokens` long
};

inline std::string describe(const WropeSpec& s) {
  return fmt::format("batch {} q_heads {} kv_heads {} head_dim {} tokens {} w {} b {} sink {} k {} page_size {}",
                     s.batch, s.q_heads, s.kv_heads, s.head_dim, s.tokens, s.window, s.offset, s.sink, s.k,
                     s.page_size);
}

/// One problem: pre-RoPE keys, their post-RoPE rows (at their absolute positions), V, post-RoPE queries at each
/// sequence's last position, all rounded to T; both caches (contiguous or paged); a selection of the middle; the
/// model's cos/sin table.
template <class T>
struct WropeProblem {
  WropeSpec spec;
  RopeConfig rope{.theta = 10000.0};
  HostKV post, pre;  ///< the values (floats already rounded to T); pre.v == post.v
  std::vector<T> q, k_post, k_pre, v;
  std::unique_ptr<HostPagedKV> post_paged, pre_paged;
  std::vector<T> post_k_pages, post_v_pages, pre_k_pages, pre_v_pages;
  std::vector<std::int32_t> sel_indices, sel_counts;
  std::vector<float> cos, sin;
  RopeTableView table;

  WropeProblem(Random& rng, const WropeSpec& s)
      : spec(s), post(rng, s.batch, s.kv_heads, s.tokens, s.head_dim, lengths(rng, s)),
        pre(rng, s.batch, s.kv_heads, s.tokens, s.head_dim, post.seq_lens) {
    const std::int32_t d = s.head_dim;
    for (std::size_t i = 0; i < pre.k.size(); ++i) pre.k[i] = to_float(from_float<T>(pre.k[i]));
    for (std::size_t i = 0; i < post.v.size(); ++i) post.v[i] = to_float(from_float<T>(post.v[i]));
    pre.v = post.v;
    // Token t's key at position t, rounded to T as a model's cache stores it.
    for (std::size_t row = 0; row < pre.k.size() / std::size_t(d); ++row) {
      const std::int32_t t = std::int32_t(row % std::size_t(s.tokens));
      std::copy_n(pre.k.begin() + row * d, d, post.k.begin() + row * d);
      apply_rope(post.k.data() + row * d, d, t, rope);
      for (std::int32_t c = 0; c < d; ++c) post.k[row * d + c] = to_float(from_float<T>(post.k[row * d + c]));
    }
    // The step's queries, at position length - 1.
    std::vector<float> qf = rng.normal(std::size_t(s.batch) * s.q_heads * d);
    for (std::int32_t b = 0; b < s.batch; ++b) {
      for (std::int32_t h = 0; h < s.q_heads; ++h) {
        apply_rope(qf.data() + (std::size_t(b) * s.q_heads + h) * d, d, post.seq_lens[b] - 1, rope);
      }
    }
    q = to_storage<T>(qf);
    k_post = to_storage<T>(post.k);
    k_pre = to_storage<T>(pre.k);
    v = to_storage<T>(post.v);
    if (s.page_size > 0) {
      post_paged = std::make_unique<HostPagedKV>(post, s.page_size, rng.uniform_int(0, 1) == 1, rng);
      pre_paged = std::make_unique<HostPagedKV>(pre, s.page_size, rng.uniform_int(0, 1) == 1, rng);
      post_k_pages = to_storage<T>(post_paged->k_pages);
      post_v_pages = to_storage<T>(post_paged->v_pages);
      pre_k_pages = to_storage<T>(pre_paged->k_pages);
      pre_v_pages = to_storage<T>(pre_paged->v_pages);
    }
    make_selection(rng);
    // The table covers b and every distance |b - p|.
    const std::int32_t positions = std::max(s.offset, s.tokens) + 1;
    cos.resize(std::size_t(RopeTableView::elements(rope, d, positions)));
    sin.resize(cos.size());
    table = RopeTableView::make(rope, d, positions, cos.data(), sin.data());
    cpu::build_rope_table(rope, table);
  }

  static std::vector<std::int32_t> lengths(Random& rng, const WropeSpec& s) {
    std::vector<std::int32_t> lens(std::size_t(s.batch), s.tokens);
    if (!s.equal_lengths) {
      for (auto& l : lens) l = rng.uniform_int(std::max(s.sink + s.window, s.tokens / 2), s.tokens);
    }
    return lens;
  }

  std::int32_t capacity() const { return spec.k > 0 ? spec.k : spec.tokens; }

  /// Up to `capacity` distinct middle tokens [sink, length - w) per row, shuffled (the kernels accept any order).
  void make_selection(Random& rng) {
    const WropeSpec& s = spec;
    sel_indices.assign(std::size_t(s.batch) * s.kv_heads * capacity(), kPoisonIndex);
    sel_counts.assign(std::size_t(s.batch) * s.kv_heads, 0);
    std::vector<std::int32_t> middle;
    for (std::int32_t b = 0; b < s.batch; ++b) {
      for (std::int32_t g = 0; g < s.kv_heads; ++g) {
        const std::size_t row = std::size_t(b) * s.kv_heads + g;
        middle.resize(std::size_t(std::max(0, post.seq_lens[b] - s.window - s.sink)));
        std::iota(middle.begin(), middle.end(), s.sink);
        std::shuffle(middle.begin(), middle.end(), rng.engine);
        sel_counts[row] = std::min(capacity(), std::int32_t(middle.size()));
        std::copy_n(middle.begin(), sel_counts[row], sel_indices.begin() + row * capacity());
      }
    }
  }

  SelectionView selection() {
    return {sel_indices.data(), sel_counts.data(), nullptr, spec.batch, spec.kv_heads, capacity()};
  }
  QueryView<const T> q_view() const {
    return QueryView<const T>::packed(q.data(), spec.batch, spec.q_heads, spec.head_dim);
  }
  KVCache<const T> post_cache() const { return cache(k_post, v, post_paged.get(), post_k_pages, post_v_pages); }
  KVCache<const T> pre_cache() const { return cache(k_pre, v, pre_paged.get(), pre_k_pages, pre_v_pages); }
  WindowedRopeParams params() const {
    return {.window = spec.window, .offset = spec.offset, .sink = spec.sink, .rope = table};
  }

  /// Equation 11 in fp64 over the window, the sinks and the selection: logits (long double) with the post-RoPE q
  /// against post-RoPE rows for p - j < w, and q R_{b - p} (apply_rope by the distance, fp64) against pre-RoPE rows
  /// otherwise; softmax; O and LSE (natural log).
  HostState reference(double scale) const {
    const WropeSpec& s = spec;
    const std::int32_t d = s.head_dim, group = s.q_heads / s.kv_heads;
    HostState ref(s.batch, s.q_heads, d);
    std::vector<float> q_far(static_cast<std::size_t>(d));
    for (std::int32_t b = 0; b < s.batch; ++b) {
      const std::int32_t length = post.seq_lens[b], p = length - 1;
      for (std::int32_t h = 0; h < s.q_heads; ++h) {
        const std::int32_t g = h / group;
        const std::size_t row = std::size_t(b) * s.kv_heads + g;
        const T* qh = q.data() + (std::size_t(b) * s.q_heads + h) * d;
        for (std::int32_t c = 0; c < d; ++c) q_far[c] = to_float(qh[c]);
        apply_rope(q_far.data(), d, std::int64_t(s.offset) - p, rope);
        std::vector<std::int32_t> tokens;
        for (std::int32_t j = 0; j < std::min(s.sink, length); ++j) tokens.push_back(j);
        tokens.insert(tokens.end(), sel_indices.begin() + row * capacity(),
                      sel_indices.begin() + row * capacity() + sel_counts[row]);
        for (std::int32_t j = std::max(0, length - s.window); j < length; ++j) tokens.push_back(j);
        std::vector<long double> logits;
        for (const std::int32_t j : tokens) {
          const bool local = p - j < s.window;
          const float* k = (local ? post : pre).k.data() + ((row * s.tokens) + std::size_t(j)) * d;
          long double dot = 0;
          for (std::int32_t c = 0; c < d; ++c) dot += (long double)(local ? to_float(qh[c]) : q_far[c]) * k[c];
          logits.push_back(dot * scale);
        }
        const long double m = *std::max_element(logits.begin(), logits.end());
        long double z = 0;
        for (const auto l : logits) z += std::exp(l - m);
        std::vector<long double> o(std::size_t(d), 0);
        for (std::size_t i = 0; i < tokens.size(); ++i) {
          const float* vr = post.v.data() + (row * s.tokens + std::size_t(tokens[i])) * d;
          const long double w = std::exp(logits[i] - m) / z;
          for (std::int32_t c = 0; c < d; ++c) o[c] += w * vr[c];
        }
        const std::size_t at = std::size_t(b) * s.q_heads + h;
        for (std::int32_t c = 0; c < d; ++c) ref.o[at * d + c] = float(o[c]);
        ref.lse[at] = float(m + std::log(z));
      }
    }
    return ref;
  }

 private:
  KVCache<const T> cache(const std::vector<T>& k, const std::vector<T>& vv, const HostPagedKV* paged,
                         const std::vector<T>& k_pages, const std::vector<T>& v_pages) const {
    const WropeSpec& s = spec;
    if (paged == nullptr) {
      return ContiguousKVView<const T>::packed(k.data(), vv.data(), s.batch, s.kv_heads, s.tokens, s.head_dim,
                                               post.seq_lens.data());
    }
    const auto& h = paged->view;
    return PagedKVView<const T>{k_pages.data(), v_pages.data(), h.page_indptr, h.page_indices, h.last_page_len,
                                h.batch, h.kv_heads, h.head_dim, h.page_size, h.num_pages, h.page_stride,
                                h.token_stride, h.head_stride};
  }
};

}  // namespace kvsift::test
