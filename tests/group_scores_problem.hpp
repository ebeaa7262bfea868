#pragma once
/// group_scores problems and their fp64 logits, shared by the CPU tests (tests/cpu/test_selection_primitives.cpp,
/// against fp64) and the CUDA tests (tests/cuda/test_cuda_group_scores.cpp, against the CPU twin within bounds
/// derived from the same fp64 logits): a decode query and a KV cache in storage type T with given lengths,
/// contiguous and, with page_size > 0, the same tokens in a paged cache with shuffled pages (NHD or HND).

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_check.hpp"
#include "kvsift/core/group_scores_options.hpp"
#include "test_util.hpp"

namespace kvsift::test {

template <class T>
std::string type_name() {
  return std::is_same_v<T, float> ? "f32" : dtype_label<T>();
}

inline std::string describe(const GroupScoreOptions& o) {
  return fmt::format("sm_scale {} reduce {} softmax {}", o.sm_scale, o.reduce == GroupReduce::sum ? "sum" : "max",
                     o.softmax);
}

/// One fp32 rounding (2^-24 of the magnitude rounded).
constexpr double kUlp = 1.0 / (1 << 24);
/// A softmax weight's relative error beyond its logits' (one backend): the fp32 sum of the exponentials (up to
/// ~5000 of them, ~sqrt(n) 2^-24 in practice), the rounding of the exponent argument (|s - LSE| and |LSE| times a
/// few 2^-24) and the exp2 polynomial's ~1e-7; about 3x the largest seen in the CPU tests.
constexpr double kSoftmaxRel = 3e-5;

/// The host problem (storage values and their float copies).
template <class T>
struct GroupScoresProblem {
  std::int32_t batch, q_heads, kv_heads, head_dim;
  HostKV values;  ///< the cache as floats, already rounded to T
  std::vector<T> q, k, v;
  std::vector<float> q_values;  ///< q as floats
  std::unique_ptr<HostPagedKV> paged_values;
  std::vector<T> k_pages, v_pages;

  GroupScoresProblem(Random& rng, std::int32_t batch_, std::int32_t q_heads_, std::int32_t kv_heads_,
                     std::int32_t head_dim_, const std::vector<std::int32_t>& lengths, std::int32_t page_size)
      : batch(batch_), q_heads(q_heads_), kv_heads(kv_heads_), head_dim(head_dim_),
        values(rng, batch_, kv_heads_, std::max(1, *std::max_element(lengths.begin(), lengths.end())), head_dim_,
               lengths) {
    q = to_storage<T>(rng.normal(std::size_t(batch) * q_heads * head_dim));
    for (const T x : q) q_values.push_back(to_float(x));
    k = to_storage<T>(values.k);
    v = to_storage<T>(values.v);
    for (std::size_t i = 0; i < k.size(); ++i) values.k[i] = to_float(k[i]);
    if (page_size > 0) {
      paged_values = std::make_unique<HostPagedKV>(values, page_size, /*hnd=*/rng.uniform_int(0, 1) == 1, rng);
      k_pages = to_storage<T>(paged_values->k_pages);
      v_pages = to_storage<T>(paged_values->v_pages);
    }
  }
  /// Sets q of head h, channel c, in storage and float copies.
  void set_q(std::int32_t b, std::int32_t h, std::int32_t c, float x) {
    const std::size_t i = (std::size_t(b) * q_heads + h) * head_dim + c;
    q[i] = from_float<T>(x);
    q_values[i] = to_float(q[i]);
  }
  /// Sets channel c of the key of (b, g, t) in the contiguous cache (and its float copy).
  void set_k(std::int32_t b, std::int32_t g, std::int32_t t, std::int32_t c, float x) {
    const std::size_t i = std::size_t(values.view().offset(b, g, t)) + c;
    k[i] = from_float<T>(x);
    values.k[i] = to_float(k[i]);
  }
  std::int64_t rows() const { return std::int64_t(batch) * kv_heads; }
  std::int32_t longest() const { return values.capacity; }
  QueryView<const T> q_view() const { return QueryView<const T>::packed(q.data(), batch, q_heads, head_dim); }
  ContiguousKVView<const T> contiguous(const std::int32_t* seq_lens) const {
    return ContiguousKVView<const T>::packed(k.data(), v.data(), batch, kv_heads, values.capacity, head_dim, seq_lens);
  }
  ContiguousKVView<const T> contiguous() const { return contiguous(values.seq_lens.data()); }
  /// The paged layout over the given pages and tables (the host's, or device copies of them).
  PagedKVView<const T> paged_view(const T* k_data, const T* v_data, const std::int32_t* indptr,
                                  const std::int32_t* indices, const std::int32_t* last) const {
    const auto& h = paged_values->view;
    return {k_data, v_data, indptr, indices, last, h.batch, h.kv_heads, h.head_dim, h.page_size, h.num_pages,
            h.page_stride, h.token_stride, h.head_stride};
  }
  PagedKVView<const T> paged() const {
    return paged_view(k_pages.data(), v_pages.data(), paged_values->indptr.data(), paged_values->indices.data(),
                      paged_values->last_len.data());
  }
};

/// The fp64 logits of kv head g's query heads over tokens [0, n) of sequence b: logit [group, n] = scale * q . k,
/// magnitude [group, n] = scale * sum_c |q_c k_c| (what a dot product's rounding error scales with), lse [group].
struct GroupLogits {
  std::vector<double> logit, magnitude, lse;
};

template <class T>
GroupLogits group_logits(const GroupScoresProblem<T>& p, std::int32_t b, std::int32_t g, std::int32_t n,
                         double scale) {
  const std::int32_t group = p.q_heads / p.kv_heads, d = p.head_dim;
  GroupLogits out{std::vector<double>(std::size_t(group) * n), std::vector<double>(std::size_t(group) * n),
                  std::vector<double>(std::size_t(group))};
  const auto kv = p.values.view();
  for (std::int32_t h = 0; h < group; ++h) {
    const float* q = p.q_values.data() + (std::size_t(b) * p.q_heads + g * group + h) * d;
    double m = -INFINITY;
    for (std::int32_t t = 0; t < n; ++t) {
      const float* k = kv.k_row(b, g, t);
      double dot = 0.0, magnitude = 0.0;
      for (std::int32_t c = 0; c < d; ++c) {
        dot += double(q[c]) * k[c];
        magnitude += std::abs(double(q[c]) * k[c]);
      }
      const std::size_t i = std::size_t(h) * n + t;
      out.logit[i] = scale * dot;
      out.magnitude[i] = std::abs(scale) * magnitude;
      m = std::max(m, out.logit[i]);
    }
    double z = 0.0;
    for (std::int32_t t = 0; t < n; ++t) z += std::exp(out.logit[std::size_t(h) * n + t] - m);
    out.lse[h] = m + std::log(z);
  }
  return out;
}

/// The scale group_scores applies: options.sm_scale, or 1 / sqrt(head_dim) where it is 0.
inline double score_scale(const GroupScoreOptions& options, std::int32_t head_dim) {
  return options.sm_scale != 0.0f ? double(options.sm_scale) : 1.0 / std::sqrt(double(head_dim));
}

}  // namespace kvsift::test
