#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "kvsift/eval/metrics.hpp"
#include "kvsift/attention/reference.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::HostKV;
using test::HostPagedKV;
using test::HostSelection;
using test::HostState;
using test::Random;

struct Shape {
  std::int32_t batch, q_heads, kv_heads, head_dim, capacity;
};

Shape random_shape(Random& rng) {
  const std::int32_t kv_heads = rng.uniform_int(1, 3);
  const std::int32_t group = std::vector<std::int32_t>{1, 2, 4, 5}[rng.uniform_int(0, 3)];
  const std::int32_t head_dim = std::vector<std::int32_t>{1, 7, 16, 33, 64, 128}[rng.uniform_int(0, 5)];
  return {rng.uniform_int(1, 3), kv_heads * group, kv_heads, head_dim, rng.uniform_int(1, 300)};
}

std::vector<std::int32_t> random_lens(Random& rng, const Shape& s) {
  std::vector<std::int32_t> lens(s.batch);
  for (auto& l : lens) l = rng.uniform_int(1, s.capacity);
  return lens;
}

/// Expected (O, LSE) of every (b, q head) from the naive fp64 attention over the tokens `tokens_of(b, g)`.
template <class TokensOf, class WeightOf>
void expect_matches_naive(const std::vector<float>& q, const Shape& s, const HostKV& kv, const HostState& out,
                          double scale, TokensOf tokens_of, WeightOf weight_of) {
  const auto view = kv.view();
  const std::int32_t group = s.q_heads / s.kv_heads;
  std::vector<double> o_ref;
  for (std::int32_t b = 0; b < s.batch; ++b) {
    for (std::int32_t h = 0; h < s.q_heads; ++h) {
      const std::int32_t g = h / group;
      std::vector<const float*> ks, vs;
      std::vector<double> lw;
      const std::vector<std::int32_t> tokens = tokens_of(b, g);
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        ks.push_back(view.k_row(b, g, tokens[i]));
        vs.push_back(view.v_row(b, g, tokens[i]));
        lw.push_back(weight_of(b, g, i));
      }
      const double lse = test::naive_attention(&q[(std::size_t(b) * s.q_heads + h) * s.head_dim], ks, vs, lw,
                                               s.head_dim, scale, o_ref);
      const std::vector<float> o(out.o.begin() + (std::size_t(b) * s.q_heads + h) * s.head_dim,
                                 out.o.begin() + (std::size_t(b) * s.q_heads + h + 1) * s.head_dim);
      EXPECT_LE(test::max_abs_diff(o, o_ref), 1e-5) << "b=" << b << " h=" << h;
      if (std::isinf(lse)) {
        EXPECT_EQ(out.lse[b * s.q_heads + h], -INFINITY) << "empty: b=" << b << " h=" << h;
      } else {
        EXPECT_NEAR(out.lse[b * s.q_heads + h], lse, 1e-5 * std::max(1.0, std::abs(lse))) << "b=" << b << " h=" << h;
      }
    }
  }
}

TEST(ReferenceAttention, DenseMatchesNaiveFp64OnRandomShapes) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  Random rng(seed);
  for (int trial = 0; trial < 12; ++trial) {
    const Shape s = random_shape(rng);
    SCOPED_TRACE(testing::Message() << "batch " << s.batch << " q_heads " << s.q_heads << " kv_heads " << s.kv_heads
                                    << " head_dim " << s.head_dim << " capacity " << s.capacity);
    HostKV kv(rng, s.batch, s.kv_heads, s.capacity, s.head_dim, random_lens(rng, s));
    const auto q = rng.normal(std::size_t(s.batch) * s.q_heads * s.head_dim);
    HostState out(s.batch, s.q_heads, s.head_dim);
    const float scale = trial % 2 ? 0.0f : rng.uniform(0.05f, 0.5f);
    reference::dense_decode(QueryView<const float>::packed(q.data(), s.batch, s.q_heads, s.head_dim), kv.view(),
                            out.view, {.sm_scale = scale});
    const double resolved = scale != 0.0f ? scale : 1.0 / std::sqrt(double(s.head_dim));
    expect_matches_naive(
        q, s, kv, out, resolved,
        [&](std::int32_t b, std::int32_t) {
          std::vector<std::int32_t> t(kv.seq_lens[b]);
          std::iota(t.begin(), t.end(), 0);
          return t;
        },
        [](std::int32_t, std::int32_t, std::size_t) { return 0.0; });
  }
}

TEST(ReferenceAttention, SparseWithLogWeightsMatchesNaiveFp64) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  Random rng(seed);
  for (int trial = 0; trial < 12; ++trial) {
    const Shape s = random_shape(rng);
    HostKV kv(rng, s.batch, s.kv_heads, s.capacity, s.head_dim, random_lens(rng, s));
    const auto q = rng.normal(std::size_t(s.batch) * s.q_heads * s.head_dim);
    const bool weighted = trial % 2 == 0;
    HostSelection sel(s.batch, s.kv_heads, s.capacity, weighted);
    for (std::int32_t b = 0; b < s.batch; ++b) {
      for (std::int32_t g = 0; g < s.kv_heads; ++g) {
        std::vector<std::int32_t> all(kv.seq_lens[b]);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng.engine);
        const std::int32_t count = rng.uniform_int(0, kv.seq_lens[b]);
        std::copy_n(all.begin(), count, sel.view.row(b, g));
        sel.view.counts[sel.view.row_index(b, g)] = count;
        if (weighted) {
          for (std::int32_t i = 0; i < count; ++i) sel.view.weights_row(b, g)[i] = std::log(rng.uniform(1.0f, 50.0f));
        }
      }
    }
    HostState out(s.batch, s.q_heads, s.head_dim);
    reference::sparse_decode(QueryView<const float>::packed(q.data(), s.batch, s.q_heads, s.head_dim), kv.view(),
                             sel.view, out.view);
    expect_matches_naive(
        q, s, kv, out, 1.0 / std::sqrt(double(s.head_dim)),
        [&](std::int32_t b, std::int32_t g) {
          const std::int32_t* row = sel.view.row(b, g);
          return std::vector<std::int32_t>(row, row + sel.view.count(b, g));
        },
        [&](std::int32_t b, std::int32_t g, std::size_t i) {
          return weighted ? double(sel.view.weights_row(b, g)[i]) : 0.0;
        });
    for (std::int32_t b = 0; b < s.batch; ++b) {
      for (std::int32_t h = 0; h < s.q_heads; ++h) {
        if (sel.view.count(b, h / (s.q_heads / s.kv_heads)) == 0) {
          EXPECT_EQ(out.lse[b * s.q_heads + h], -INFINITY);
        }
      }
    }
  }
}

TEST(ReferenceAttention, AttendAllRowsAttendEveryTokenOnceAndIgnoreTheirEntries) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  Random rng(seed);
  for (int trial = 0; trial < 8; ++trial) {
    const Shape s = random_shape(rng);
    HostKV kv(rng, s.batch, s.kv_heads, s.capacity, s.head_dim, random_lens(rng, s));
    const auto q = rng.normal(std::size_t(s.batch) * s.q_heads * s.head_dim);
    const AttentionWindow window{rng.uniform_int(0, 5), rng.uniform_int(0, 40)};
    HostSelection sel(s.batch, s.kv_heads, s.capacity, /*with_weights=*/true);
    std::vector<std::uint8_t> attend_all(std::size_t(s.batch) * s.kv_heads);
    for (std::int32_t b = 0; b < s.batch; ++b) {
      const std::int32_t n = kv.seq_lens[b], lo = window.sink_end(n), hi = window.recent_begin(n);
      for (std::int32_t g = 0; g < s.kv_heads; ++g) {
        const std::int64_t row = sel.view.row_index(b, g);
        attend_all[row] = std::uint8_t(rng.uniform_int(0, 1) * rng.uniform_int(1, 255));
        if (attend_all[row] != 0) continue;  // count and entries stay poisoned: they must not be read
        std::vector<std::int32_t> middle(hi - lo);
        std::iota(middle.begin(), middle.end(), lo);
        std::shuffle(middle.begin(), middle.end(), rng.engine);
        const std::int32_t count = rng.uniform_int(0, hi - lo);
        std::copy_n(middle.begin(), count, sel.view.row(b, g));
        sel.view.counts[row] = count;
        for (std::int32_t i = 0; i < count; ++i) sel.view.weights_row(b, g)[i] = std::log(rng.uniform(1.0f, 50.0f));
      }
    }
    sel.view.attend_all = attend_all.data();
    HostState out(s.batch, s.q_heads, s.head_dim);
    reference::sparse_decode(QueryView<const float>::packed(q.data(), s.batch, s.q_heads, s.head_dim), kv.view(),
                             sel.view, out.view, {.window = window});
    const auto all = [&](std::int32_t b, std::int32_t g) { return attend_all[sel.view.row_index(b, g)] != 0; };
    expect_matches_naive(
        q, s, kv, out, 1.0 / std::sqrt(double(s.head_dim)),
        [&](std::int32_t b, std::int32_t g) {
          const std::int32_t n = kv.seq_lens[b];
          std::vector<std::int32_t> tokens;
          if (all(b, g)) {
            tokens.resize(n);
            std::iota(tokens.begin(), tokens.end(), 0);
            return tokens;
          }
          for (std::int32_t i = 0; i < window.size(n); ++i) tokens.push_back(window.token(i, n));
          const std::int32_t* row = sel.view.row(b, g);
          tokens.insert(tokens.end(), row, row + sel.view.count(b, g));
          return tokens;
        },
        [&](std::int32_t b, std::int32_t g, std::size_t i) {
          const std::size_t w = std::size_t(window.size(kv.seq_lens[b]));
          return all(b, g) || i < w ? 0.0 : double(sel.view.weights_row(b, g)[i - w]);
        });
  }
}

TEST(ReferenceAttention, MergeOfAnyPartitionEqualsDenseInAnyOrder) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  Random rng(seed);
  for (int trial = 0; trial < 10; ++trial) {
    const Shape s = random_shape(rng);
    HostKV kv(rng, s.batch, s.kv_heads, s.capacity, s.head_dim, random_lens(rng, s));
    const auto q = rng.normal(std::size_t(s.batch) * s.q_heads * s.head_dim);
    const auto qv = QueryView<const float>::packed(q.data(), s.batch, s.q_heads, s.head_dim);
    HostState dense(s.batch, s.q_heads, s.head_dim);
    reference::dense_decode(qv, kv.view(), dense.view);

    // Each token goes to one of `parts` random parts (some parts may be empty); each part is a selection.
    const std::int32_t parts = rng.uniform_int(1, 6);
    std::vector<HostSelection> selections;
    for (std::int32_t p = 0; p < parts; ++p) selections.emplace_back(s.batch, s.kv_heads, s.capacity, false);
    for (auto& sel : selections) std::fill(sel.counts.begin(), sel.counts.end(), 0);
    for (std::int32_t b = 0; b < s.batch; ++b) {
      for (std::int32_t g = 0; g < s.kv_heads; ++g) {
        for (std::int32_t t = 0; t < kv.seq_lens[b]; ++t) {
          auto& sel = selections[rng.uniform_int(0, parts - 1)].view;
          sel.row(b, g)[sel.counts[sel.row_index(b, g)]++] = t;
        }
      }
    }
    std::vector<HostState> partial_states;
    for (auto& sel : selections) {
      partial_states.emplace_back(s.batch, s.q_heads, s.head_dim);
      reference::sparse_decode(qv, kv.view(), sel.view, partial_states.back().view);
    }
    std::vector<StateView<const float>> partials;
    for (auto& ps : partial_states) partials.push_back(ps.view.as_const());
    std::shuffle(partials.begin(), partials.end(), rng.engine);
    HostState merged(s.batch, s.q_heads, s.head_dim);
    reference::merge_states<float, float>(partials, merged.view);

    // Each partial's O is rounded to float, so the merge's error scales with the partials' weighted norms
    // sum_p exp(lse_p - lse) |O_p|, not with |O|: the partials' values may cancel, leaving |O| far smaller.
    for (std::size_t row = 0; row < dense.lse.size(); ++row) {
      double error = 0, weighted_norms = 0;
      for (std::size_t i = row * s.head_dim; i < (row + 1) * s.head_dim; ++i) {
        error += std::pow(double(merged.o[i]) - dense.o[i], 2);
      }
      for (const auto& ps : partial_states) {
        if (ps.lse[row] == -INFINITY) continue;  // an empty part: its O is never read
        double norm = 0;
        for (std::size_t i = row * s.head_dim; i < (row + 1) * s.head_dim; ++i) norm += std::pow(double(ps.o[i]), 2);
        weighted_norms += std::exp(double(ps.lse[row]) - dense.lse[row]) * std::sqrt(norm);
      }
      EXPECT_LE(std::sqrt(error), 1e-5 * weighted_norms) << "parts " << parts << ", row " << row;
    }
    for (std::size_t i = 0; i < dense.lse.size(); ++i) {
      EXPECT_NEAR(merged.lse[i], dense.lse[i], 1e-5 * std::max(1.0f, std::abs(dense.lse[i])));
    }
  }
}

TEST(ReferenceAttention, MergingAnEmptyStateChangesNothingBitForBit) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  Random rng(seed);
  const std::int32_t batch = 2, heads = 4, d = 33;
  auto o_a = rng.normal(std::size_t(batch) * heads * d), o_b = rng.normal(o_a.size());
  auto lse_a = rng.normal(std::size_t(batch) * heads, 3.0f), lse_b = rng.normal(lse_a.size(), 3.0f);
  std::vector<float> o_empty(o_a.size(), test::kPoison), lse_empty(lse_a.size(), -INFINITY);
  const auto a = StateView<const float>::packed(o_a.data(), lse_a.data(), batch, heads, d);
  const auto bb = StateView<const float>::packed(o_b.data(), lse_b.data(), batch, heads, d);
  const auto e = StateView<const float>::packed(o_empty.data(), lse_empty.data(), batch, heads, d);

  HostState alone(batch, heads, d), with_empty(batch, heads, d);
  reference::merge_states<float, float>(std::vector{a}, alone.view);
  reference::merge_states<float, float>(std::vector{e, a, e}, with_empty.view);
  EXPECT_EQ(alone.o, o_a);  // one non-empty partial passes through exactly
  EXPECT_EQ(alone.lse, lse_a);
  EXPECT_EQ(with_empty.o, o_a);
  EXPECT_EQ(with_empty.lse, lse_a);

  HostState two(batch, heads, d), two_with_empty(batch, heads, d);
  reference::merge_states<float, float>(std::vector{a, bb}, two.view);
  reference::merge_states<float, float>(std::vector{a, e, bb}, two_with_empty.view);
  EXPECT_EQ(two.o, two_with_empty.o);
  EXPECT_EQ(two.lse, two_with_empty.lse);

  HostState all_empty(batch, heads, d);
  reference::merge_states<float, float>(std::vector{e, e}, all_empty.view);
  for (float x : all_empty.o) EXPECT_EQ(x, 0.0f);
  for (float x : all_empty.lse) EXPECT_EQ(x, -INFINITY);
}

TEST(ReferenceAttention, ExtremeLogitsStayFiniteAndCorrect) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  Random rng(seed);
  const std::int32_t d = 64, n = 97, q_heads = 2;
  HostKV kv(rng, 1, 1, n, d);
  auto q = rng.normal(std::size_t(q_heads) * d);
  // Keys along +-q scaled so the scaled logits reach +-80: exp(80) overflows fp32 without max subtraction.
  for (std::int32_t h = 0; h < q_heads; ++h) {
    double norm2 = 0;
    for (std::int32_t c = 0; c < d; ++c) norm2 += double(q[h * d + c]) * q[h * d + c];
    for (std::int32_t t = h; t < n; t += q_heads) {
      const double target = (t % 3 == 0 ? 80.0 : -80.0) * rng.uniform(0.9f, 1.0f);
      const double alpha = target / (norm2 / std::sqrt(double(d)));
      for (std::int32_t c = 0; c < d; ++c) kv.k[std::size_t(t) * d + c] = float(alpha * q[h * d + c]);
    }
  }
  HostState out(1, q_heads, d);
  reference::dense_decode(QueryView<const float>::packed(q.data(), 1, q_heads, d), kv.view(), out.view);
  for (float x : out.o) ASSERT_TRUE(std::isfinite(x));
  for (float x : out.lse) {
    ASSERT_TRUE(std::isfinite(x));
    EXPECT_GT(x, 70.0f);
  }
  const Shape s{1, q_heads, 1, d, n};
  expect_matches_naive(
      q, s, kv, out, 1.0 / std::sqrt(double(d)),
      [&](std::int32_t, std::int32_t) {
        std::vector<std::int32_t> t(n);
        std::iota(t.begin(), t.end(), 0);
        return t;
      },
      [](std::int32_t, std::int32_t, std::size_t) { return 0.0; });
}

TEST(ReferenceAttention, PagedAndContiguousViewsGiveIdenticalResults) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  Random rng(seed);
  for (std::int32_t page_size : {1, 16, 64}) {
    for (bool hnd : {false, true}) {
      const Shape s = random_shape(rng);
      HostKV kv(rng, s.batch, s.kv_heads, s.capacity, s.head_dim, random_lens(rng, s));
      HostPagedKV paged(kv, page_size, hnd, rng);
      const auto q = rng.normal(std::size_t(s.batch) * s.q_heads * s.head_dim);
      const auto qv = QueryView<const float>::packed(q.data(), s.batch, s.q_heads, s.head_dim);
      HostState a(s.batch, s.q_heads, s.head_dim), b(s.batch, s.q_heads, s.head_dim);
      reference::dense_decode(qv, kv.view(), a.view);
      reference::dense_decode(qv, paged.view, b.view);
      EXPECT_EQ(a.o, b.o) << "page_size " << page_size << " hnd " << hnd;
      EXPECT_EQ(a.lse, b.lse);
    }
  }
}

TEST(ReferenceAttention, ReadsHalfAndBfloat16StorageAsTheirFloatValues) {
  const auto seed = test::test_seed();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  Random rng(seed);
  const std::int32_t batch = 2, q_heads = 4, kv_heads = 2, n = 77, d = 64;
  HostKV kv(rng, batch, kv_heads, n, d);
  auto q = rng.normal(std::size_t(batch) * q_heads * d);
  // Round the float data through each 16-bit type so that both runs see the same values.
  const auto run = [&]<class T>(T) {
    std::vector<T> k16(kv.k.size()), v16(kv.v.size()), q16(q.size());
    std::vector<float> kf(kv.k.size()), vf(kv.v.size()), qf(q.size());
    for (std::size_t i = 0; i < k16.size(); ++i) {
      k16[i] = from_float<T>(kv.k[i]);
      v16[i] = from_float<T>(kv.v[i]);
      kf[i] = to_float(k16[i]);
      vf[i] = to_float(v16[i]);
    }
    for (std::size_t i = 0; i < q.size(); ++i) qf[i] = to_float(q16[i] = from_float<T>(q[i]));
    HostState a(batch, q_heads, d), b(batch, q_heads, d);
    reference::dense_decode(QueryView<const T>::packed(q16.data(), batch, q_heads, d),
                            ContiguousKVView<const T>::packed(k16.data(), v16.data(), batch, kv_heads, n, d), a.view);
    reference::dense_decode(QueryView<const float>::packed(qf.data(), batch, q_heads, d),
                            ContiguousKVView<const float>::packed(kf.data(), vf.data(), batch, kv_heads, n, d), b.view);
    EXPECT_EQ(a.o, b.o);
    EXPECT_EQ(a.lse, b.lse);
  };
  run(half{});
  run(bfloat16{});
}

TEST(AttentionMassRecall, CountsTheSoftmaxMassOfTheSelectionOncePrecomputed) {
  // One head, head_dim 1 (scale 1), q = 1, keys 0, ln 2, ln 4: softmax weights 1/7, 2/7, 4/7.
  const float q = 1.0f;
  const std::vector<float> k{0.0f, std::log(2.0f), std::log(4.0f)}, v(3, 0.5f);
  const std::int32_t seq_len = 3;
  const auto qv = QueryView<const float>::packed(&q, 1, 1, 1);
  const auto kv = ContiguousKVView<const float>::packed(k.data(), v.data(), 1, 1, 3, 1, &seq_len);
  const AttentionWeights attention = attention_weights(qv, kv);
  std::vector<std::int32_t> indices{2, 0};
  std::int32_t count = 1;
  const SelectionView selection{indices.data(), &count, nullptr, 1, 1, 2};
  EXPECT_NEAR(attention_mass_recall(attention, selection), 4.0 / 7.0, 1e-7);
  EXPECT_EQ(attention_mass_recall(attention, selection), attention_mass_recall(qv, kv, selection));
  count = 2;
  EXPECT_NEAR(attention_mass_recall(attention, selection), 5.0 / 7.0, 1e-7);
  indices[1] = 3;
  test::expect_error([&] { attention_mass_recall(attention, selection); },
                     "selection index 3 at batch 0, kv_head 0 is outside [0, seq_len = 3)");
  const SelectionView two_heads{indices.data(), &count, nullptr, 1, 2, 1};
  test::expect_error([&] { attention_mass_recall(attention, two_heads); }, "does not match the attention");
}

}  // namespace
}  // namespace kvsift
