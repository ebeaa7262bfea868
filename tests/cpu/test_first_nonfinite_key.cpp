// cpu::first_nonfinite_key (cpu/cache_ops.hpp) against a scalar loop over (b, h, t, i) that tests std::isfinite
// of every key as a float: fresh random caches, contiguous and paged (NHD and HND pages, shuffled), fp16, bf16 and
// fp32, several NaN / +inf / -inf offenders planted at random positions (the first in (b, h, t, i) order is
// reported, not the first in memory), finite extremes that must not count (the largest finite values,
// subnormals), rows of length 0, and NaN in every element the lengths leave out (tokens past a row's length,
// spare pages), which must not be read as keys. Then detail::check_finite_prompt's refusal on the CPU, paged, with
// the offending value in its message.
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "kvsift/cpu/backend.hpp"
#include "kvsift/cpu/cache_ops.hpp"
#include "kvsift/selectors/detail/checks.hpp"
#include "nonfinite_values.hpp"
#include "test_util.hpp"

namespace kvsift::test {
namespace {

using Position = KeyPosition;
constexpr Position kNone = kNoKey;

/// The scalar loop: the first key in (b, h, t, i) order whose float value is not finite.
template <class T>
Position scalar_first_nonfinite(const KVCache<const T>& cache, const std::vector<std::int32_t>& lengths) {
  for (std::int32_t b = 0; b < cache.batch(); ++b) {
    for (std::int32_t h = 0; h < cache.kv_heads(); ++h) {
      for (std::int32_t t = 0; t < lengths[std::size_t(b)]; ++t) {
        for (std::int32_t i = 0; i < cache.head_dim(); ++i) {
          if (!std::isfinite(to_float(cache.k_row(b, h, t)[i]))) return {b, h, t, i};
        }
      }
    }
  }
  return kNone;
}

/// A random cache in storage type T, contiguous [batch, kv_heads, capacity, head_dim] and, when page_size > 0, the
/// same tokens in shuffled pages (with spare pages); keys are planted in both copies alike.
template <class T>
struct KeyProblem {
  HostKV kv;
  std::unique_ptr<HostPagedKV> paged_kv;
  std::vector<T> k, k_pages;

  KeyProblem(Random& rng, std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity, std::int32_t head_dim,
             std::vector<std::int32_t> lens, std::int32_t page_size)
      : kv(rng, batch, kv_heads, capacity, head_dim, std::move(lens)) {
    k = to_storage<T>(kv.k);
    if (page_size > 0) {
      paged_kv = std::make_unique<HostPagedKV>(kv, page_size, /*hnd=*/rng.uniform_int(0, 1) == 1, rng);
      k_pages.resize(paged_kv->k_pages.size());
      for (std::size_t e = 0; e < k_pages.size(); ++e) k_pages[e] = from_float<T>(paged_kv->k_pages[e]);
      // Tokens of a row sit where the contiguous copy has them: the same values, bit for bit.
      for (std::int32_t b = 0; b < batch; ++b) {
        for (std::int32_t h = 0; h < kv_heads; ++h) {
          for (std::int32_t t = 0; t < kv.seq_lens[std::size_t(b)]; ++t) {
            std::copy_n(k.begin() + contiguous_offset(b, h, t), head_dim, k_pages.begin() + paged_kv->view.offset(b, h, t));
          }
        }
      }
    }
  }
  const std::vector<std::int32_t>& lengths() const { return kv.seq_lens; }
  std::size_t contiguous_offset(std::int32_t b, std::int32_t h, std::int32_t t) const {
    return ((std::size_t(b) * kv.kv_heads + std::size_t(h)) * kv.capacity + std::size_t(t)) * kv.head_dim;
  }
  /// Key (b, h, t, i) := x in both copies (t < the row's length).
  void set(const Position& p, T x) {
    k[contiguous_offset(p[0], p[1], p[2]) + std::size_t(p[3])] = x;
    if (paged_kv) k_pages[std::size_t(paged_kv->view.offset(p[0], p[1], p[2])) + std::size_t(p[3])] = x;
  }
  /// NaN in every element that no scanned key occupies: tokens past each row's length, spare pages, the tails of
  /// last pages.
  void poison_unscanned() {
    const T nan = from_float<T>(std::numeric_limits<float>::quiet_NaN());
    std::vector<bool> scanned(k_pages.size());
    for (std::int32_t b = 0; b < kv.batch; ++b) {
      for (std::int32_t h = 0; h < kv.kv_heads; ++h) {
        for (std::int32_t t = 0; t < kv.capacity; ++t) {
          const bool in_row = t < kv.seq_lens[std::size_t(b)];
          if (!in_row) std::fill_n(k.begin() + contiguous_offset(b, h, t), kv.head_dim, nan);
          if (in_row && paged_kv) {
            std::fill_n(scanned.begin() + paged_kv->view.offset(b, h, t), kv.head_dim, true);
          }
        }
      }
    }
    for (std::size_t e = 0; e < k_pages.size(); ++e) {
      if (!scanned[e]) k_pages[e] = nan;
    }
  }
  KVCache<const T> contiguous() const {
    return ContiguousKVView<const T>::packed(k.data(), nullptr, kv.batch, kv.kv_heads, kv.capacity, kv.head_dim,
                                             kv.seq_lens.data());
  }
  KVCache<const T> paged() const {
    const auto& h = paged_kv->view;
    return PagedKVView<const T>{k_pages.data(), nullptr, h.page_indptr, h.page_indices, h.last_page_len, h.batch,
                                h.kv_heads, h.head_dim, h.page_size, h.num_pages, h.page_stride, h.token_stride,
                                h.head_stride};
  }
};

template <class T>
Position run_cpu(const KVCache<const T>& cache, const std::vector<std::int32_t>& lengths) {
  Position out{7, 7, 7, 7};  // overwritten on every path
  cpu::first_nonfinite_key(cache, lengths.data(), out.data());
  return out;
}

template <class T>
class FirstNonfiniteKey : public SeededTest {};
using KeyTypes = testing::Types<half, bfloat16, float>;
TYPED_TEST_SUITE(FirstNonfiniteKey, KeyTypes);

TYPED_TEST(FirstNonfiniteKey, EqualsTheScalarLoopOnRandomCaches) {
  using T = TypeParam;
  SCOPED_TRACE(testing::Message() << "seed " << this->seed);
  Random& rng = this->rng;
  const std::vector<T> bad = nonfinite_values<T>(), extremes = finite_extremes<T>();
  std::int32_t found = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const std::int32_t batch = rng.uniform_int(1, 5), kv_heads = rng.uniform_int(1, 4),
                       capacity = rng.uniform_int(1, 70);
    const std::int32_t head_dim = std::array{1, 2, 3, 5, 8, 16, 24, 64, 100, 128}[std::size_t(rng.uniform_int(0, 9))];
    const std::int32_t page_size = std::array{1, 4, 16}[std::size_t(rng.uniform_int(0, 2))];
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(batch));
    for (auto& l : lengths) l = rng.uniform_int(0, 3) == 0 ? 0 : rng.uniform_int(1, capacity);
    SCOPED_TRACE(testing::Message() << "trial " << trial << ": batch " << batch << " kv_heads " << kv_heads
                                    << " capacity " << capacity << " head_dim " << head_dim << " page_size "
                                    << page_size);
    KeyProblem<T> p(rng, batch, kv_heads, capacity, head_dim, lengths, page_size);
    if (rng.uniform_int(0, 1) == 1) p.poison_unscanned();
    const auto random_position = [&] { return random_key_position(rng, lengths, kv_heads, head_dim); };
    for (int e = 0; e < 4; ++e) {
      if (const auto at = random_position()) p.set(*at, extremes[std::size_t(rng.uniform_int(0, 3))]);
    }
    std::set<Position> planted;  // ordered as (b, h, t, i)
    const std::int32_t offenders = rng.uniform_int(0, 5);
    for (std::int32_t o = 0; o < offenders; ++o) {
      const auto at = random_position();
      if (!at) continue;
      p.set(*at, bad[std::size_t(rng.uniform_int(0, std::int32_t(bad.size()) - 1))]);
      planted.insert(*at);
      if (rng.uniform_int(0, 2) == 0) {  // a second offender later in the same token
        Position later = *at;
        later[3] = rng.uniform_int(later[3], head_dim - 1);
        p.set(later, bad[std::size_t(rng.uniform_int(0, std::int32_t(bad.size()) - 1))]);
        planted.insert(later);
      }
    }
    const Position want = planted.empty() ? kNone : *planted.begin();
    found += planted.empty() ? 0 : 1;
    ASSERT_EQ(scalar_first_nonfinite(p.contiguous(), lengths), want) << "the planting";
    ASSERT_EQ(scalar_first_nonfinite(p.paged(), lengths), want) << "the planting, paged";
    EXPECT_EQ(run_cpu(p.contiguous(), lengths), want) << "contiguous";
    EXPECT_EQ(run_cpu(p.paged(), lengths), want) << "paged";
  }
  EXPECT_GT(found, 20) << "most trials plant an offender";
}

/// A finite cache, the extremes of T included: four -1, with NaN everywhere the lengths leave out.
TYPED_TEST(FirstNonfiniteKey, AFiniteCacheGivesMinusOnes) {
  using T = TypeParam;
  KeyProblem<T> p(this->rng, 3, 2, 20, 64, {20, 0, 7}, 8);
  p.poison_unscanned();
  const std::vector<T> extremes = finite_extremes<T>();
  for (std::size_t e = 0; e < extremes.size(); ++e) p.set({0, 1, std::int32_t(e), 5}, extremes[e]);
  EXPECT_EQ(run_cpu(p.contiguous(), p.lengths()), kNone);
  EXPECT_EQ(run_cpu(p.paged(), p.lengths()), kNone);
  EXPECT_EQ(scalar_first_nonfinite(p.contiguous(), p.lengths()), kNone);
  // Shorter lengths than the cache's: the tokens past them are not keys either.
  const std::vector<std::int32_t> shorter{3, 0, 1};
  p.set({0, 0, 3, 0}, from_float<T>(std::numeric_limits<float>::infinity()));
  EXPECT_EQ(run_cpu(p.contiguous(), shorter), kNone);
  EXPECT_EQ(run_cpu(p.paged(), shorter), kNone);
  EXPECT_EQ(run_cpu(p.contiguous(), p.lengths()), (Position{0, 0, 3, 0}));
}

TYPED_TEST(FirstNonfiniteKey, RowsOfLengthZeroAreSkipped) {
  using T = TypeParam;
  const T nan = from_float<T>(std::numeric_limits<float>::quiet_NaN());
  KeyProblem<T> p(this->rng, 3, 2, 10, 16, {0, 4, 0}, 4);
  p.k[p.contiguous_offset(0, 0, 0)] = nan;  // storage of rows that hold no token
  p.k[p.contiguous_offset(2, 1, 9) + 15] = nan;
  EXPECT_EQ(run_cpu(p.contiguous(), p.lengths()), kNone);
  p.set({1, 1, 3, 15}, from_float<T>(-std::numeric_limits<float>::infinity()));
  EXPECT_EQ(run_cpu(p.contiguous(), p.lengths()), (Position{1, 1, 3, 15}));
  EXPECT_EQ(run_cpu(p.paged(), p.lengths()), (Position{1, 1, 3, 15}));
  // Every row empty (and a cache of no rows): nothing is scanned.
  const std::vector<std::int32_t> empty{0, 0, 0};
  EXPECT_EQ(run_cpu(p.contiguous(), empty), kNone);
  KVCache<const T> no_rows = ContiguousKVView<const T>::packed(p.k.data(), nullptr, 0, 2, 10, 16);
  EXPECT_EQ(run_cpu(no_rows, {}), kNone);
}

/// Token-major storage ([batch, tokens, kv_heads, head_dim], as NHD pages): kv head 1's token 0 precedes kv head
/// 0's token 3 in memory, but (b, h, t, i) order puts head 0 first.
TYPED_TEST(FirstNonfiniteKey, TheFirstIsInHeadOrderNotMemoryOrder) {
  using T = TypeParam;
  const std::int32_t kv_heads = 2, tokens = 6, head_dim = 8;
  std::vector<T> k = to_storage<T>(this->rng.normal(std::size_t(kv_heads) * tokens * head_dim));
  const std::vector<std::int32_t> lengths{tokens};
  const ContiguousKVView<const T> token_major{.k = k.data(), .batch = 1, .kv_heads = kv_heads, .capacity = tokens,
                                              .head_dim = head_dim, .batch_stride = std::int64_t(tokens) * kv_heads * head_dim,
                                              .head_stride = head_dim, .token_stride = std::int64_t(kv_heads) * head_dim};
  k[std::size_t(1 * head_dim + 2)] = from_float<T>(std::numeric_limits<float>::quiet_NaN());            // h 1, t 0
  k[std::size_t((3 * kv_heads + 0) * head_dim + 6)] = from_float<T>(std::numeric_limits<float>::infinity());  // h 0, t 3
  EXPECT_EQ(run_cpu(KVCache<const T>(token_major), lengths), (Position{0, 0, 3, 6}));
  EXPECT_EQ(scalar_first_nonfinite(KVCache<const T>(token_major), lengths), (Position{0, 0, 3, 6}));
}

TEST(FirstNonfiniteKeyRefusals, NullPointers) {
  std::vector<half> k(16);
  const std::vector<std::int32_t> lengths{1};
  const KVCache<const half> cache = ContiguousKVView<const half>::packed(k.data(), nullptr, 1, 1, 1, 16);
  expect_error([&] { cpu::first_nonfinite_key(cache, lengths.data(), nullptr); },
               "cpu::first_nonfinite_key: out must be non-null");
  Position out{};
  expect_error([&] { cpu::first_nonfinite_key(cache, nullptr, out.data()); },
               "cpu::first_nonfinite_key: lengths must be non-null");
}

/// The prepare check through the CPU backend: a paged cache (the value is read back through its page table), the
/// first offender and its value named; the prefill queries are not reached.
TEST(FirstNonfiniteKeyPrompt, CheckFinitePromptNamesTheFirstOffenderAndItsValue) {
  Random rng(test_seed());
  KeyProblem<half> p(rng, 2, 2, 40, 32, {30, 25}, 8);
  p.poison_unscanned();
  const std::vector<half> queries = to_storage<half>(rng.normal(std::size_t(2) * 4 * 2 * 32));
  const auto view = SequenceView<const half>::packed(queries.data(), 2, 4, 2, 32);
  const cpu::Context ctx{};
  detail::check_finite_prompt("Test::prepare", p.paged(), p.lengths().data(), view, ctx);  // finite: no refusal
  p.set({1, 1, 24, 31}, from_float<half>(-std::numeric_limits<float>::infinity()));
  p.set({1, 1, 24, 30}, from_float<half>(std::numeric_limits<float>::infinity()));
  p.set({1, 1, 20, 0}, from_float<half>(-std::numeric_limits<float>::infinity()));
  expect_error([&] { detail::check_finite_prompt("Test::prepare", p.paged(), p.lengths().data(), view, ctx); },
               {"Test::prepare: the prompt's keys hold a non-finite value at sequence 1, kv head 1, token 20, channel 0 "
                "(= -inf): NaN and inf are refused rather than indexed"});
  p.set({0, 1, 29, 3}, from_float<half>(std::numeric_limits<float>::quiet_NaN()));
  expect_error([&] { detail::check_finite_prompt("Test::prepare", p.contiguous(), p.lengths().data(), view, ctx); },
               {"at sequence 0, kv head 1, token 29, channel 3 (= nan)"});
}

}  // namespace
}  // namespace kvsift::test
