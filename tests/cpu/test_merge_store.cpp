// The merge store's CPU primitives (selectors/centroid_kv/cpu/merge_store.hpp): one round against an independent fp64 scalar reference
// written here (links, ranking, degree-weighted means, the partition of `order`) on random stores with planted
// near-duplicates, scrambled orders and degrees above 1; fan-in; the trigger; load, append, copy and selection;
// the workspace contract; the eviction of the window fallback; every refusal.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>

#include "kvsift/selectors/centroid_kv/cpu/merge_store.hpp"
#include "merge_store_problem.hpp"
#include "test_util.hpp"
#include "workspace_check.hpp"

namespace kvsift::test {
namespace {

using cpu::merge_round;
using cpu::merge_round_workspace_bytes;
using cpu::merge_store_append;
using cpu::merge_store_copy;
using cpu::merge_store_evict;
using cpu::merge_store_load;
using cpu::merge_store_selection;
using cpu::ThreadPool;
using MergeStore = SeededTest;

/// A row of `count` entries in random slots (a random permutation), degrees 1..4, random keys and values in
/// sequence order; about half of the middle's A entries are near-duplicates of a neighbouring B entry (noise of
/// random scale, so that their similarities spread), and one key of the middle is zero.
template <class T>
void fill_row(Random& rng, HostStore<T>& s, std::int64_t row, std::int32_t count, const MergeRoundParams& p) {
  std::int32_t* order = &s.order[row * s.capacity];
  std::iota(order, order + s.capacity, 0);
  std::shuffle(order, order + s.capacity, rng.engine);
  s.count[row] = count;
  std::vector<float> keys = rng.normal(std::size_t(count) * s.head_dim), values = rng.normal(keys.size());
  const auto c = detail::MergeChunks::of(count, p);
  for (std::int32_t j = 0; j < c.chunks(); ++j) {
    const std::int32_t first = c.chunk_begin(j), size = c.chunk_size(j);
    for (std::int32_t a = first + 1; a < first + size; a += 2) {
      if (rng.uniform_int(0, 1) == 0) continue;
      const std::int32_t b = (a + 1 < first + size && rng.uniform_int(0, 1) == 0) ? a + 1 : a - 1;
      const float noise = rng.uniform(0.02f, 0.7f);
      for (std::int32_t x = 0; x < s.head_dim; ++x) {
        keys[a * s.head_dim + x] = keys[b * s.head_dim + x] + noise * rng.normal(1)[0];
      }
    }
  }
  if (c.middle_end - c.middle_begin > 2) {
    const std::int32_t zero = rng.uniform_int(c.middle_begin, c.middle_end - 1);
    std::fill_n(&keys[std::size_t(zero) * s.head_dim], s.head_dim, 0.0f);
  }
  for (std::int32_t p_ = 0; p_ < count; ++p_) {
    const std::int32_t deg = rng.uniform_int(1, 4);
    s.degree[row * s.capacity + p_] = deg;
    s.log_degree[row * s.capacity + p_] = std::log(float(deg));
    for (std::int32_t x = 0; x < s.head_dim; ++x) {
      s.k[(row * s.capacity + order[p_]) * s.head_dim + x] = from_float<T>(keys[std::size_t(p_) * s.head_dim + x]);
      s.v[(row * s.capacity + order[p_]) * s.head_dim + x] = from_float<T>(values[std::size_t(p_) * s.head_dim + x]);
    }
  }
}

/// The fp64 reference of one round over the given rows (written from selectors/centroid_kv/merge_store.hpp's rules, sharing no
/// code with the implementation). Returns false when the data is ambiguous for fp32 (two candidate similarities
/// within 1e-4 of each other where the choice matters): the caller draws again.
template <class T>
bool reference_round(HostStore<T>& s, const std::vector<std::int32_t>& slots, const std::vector<std::int32_t>& budgets,
                     const MergeRoundParams& p) {
  const std::int32_t d = s.head_dim;
  const auto key = [&](std::int64_t row, std::int32_t pos, std::int32_t x) {
    return double(to_float(s.k[(row * s.capacity + s.order[row * s.capacity + pos]) * d + x]));
  };
  for (const std::int32_t slot : slots) {
    for (std::int32_t h = 0; h < s.kv_heads; ++h) {
      const std::int64_t row = std::int64_t(slot) * s.kv_heads + h;
      const std::int32_t count = s.count[row], budget = budgets[slot];
      if (count < budget + p.trigger || count <= p.sinks + p.recent) continue;
      const std::int32_t lo = p.sinks, hi = count - p.recent;
      // Chunks [lo + j c, ...): even local positions B, odd A.
      std::vector<std::int32_t> a_pos, target;
      std::vector<double> sim;
      bool ambiguous = false;
      const auto cosine = [&](std::int32_t x, std::int32_t y) {
        double dot = 0, nx = 0, ny = 0;
        for (std::int32_t c = 0; c < d; ++c) {
          dot += key(row, x, c) * key(row, y, c);
          nx += key(row, x, c) * key(row, x, c);
          ny += key(row, y, c) * key(row, y, c);
        }
        return nx == 0 || ny == 0 ? 0.0 : dot / std::sqrt(nx * ny);
      };
      std::vector<double> margin;
      for (std::int32_t first = lo; first < hi; first += p.chunk) {
        const std::int32_t end = std::min(hi, first + p.chunk);
        for (std::int32_t a = first + 1; a < end; a += 2) {
          double best = -2, second = -2;
          std::int32_t best_b = -1;
          for (std::int32_t b = first; b < end; b += 2) {
            const double c = cosine(a, b);
            if (c > best) {
              second = best, best = c, best_b = b;
            } else if (c > second) {
              second = c;
            }
          }
          a_pos.push_back(a);
          target.push_back(best_b);
          sim.push_back(best);
          margin.push_back(best - second);
        }
      }
      const auto links = std::int32_t(a_pos.size());
      const std::int32_t m = std::min(std::int32_t(std::floor(double(p.ratio) * links)), count - budget);
      if (m <= 0) continue;
      std::vector<std::int32_t> rank(links);
      std::iota(rank.begin(), rank.end(), 0);
      std::stable_sort(rank.begin(), rank.end(), [&](std::int32_t x, std::int32_t y) { return sim[x] > sim[y]; });
      if (m < links && sim[rank[m - 1]] - sim[rank[m]] < 1e-4) ambiguous = true;
      std::vector<std::int32_t> into(count, -1);
      for (std::int32_t i = 0; i < m; ++i) {
        const std::int32_t l = rank[i];
        if (margin[l] > 0 && margin[l] < 1e-4) ambiguous = true;
        into[a_pos[l]] = target[l];
      }
      if (ambiguous) return false;
      std::int32_t* order = &s.order[row * s.capacity];
      std::int32_t* degree = &s.degree[row * s.capacity];
      float* log_degree = &s.log_degree[row * s.capacity];
      for (std::int32_t b = 0; b < count; ++b) {
        std::vector<std::int32_t> members{b};
        for (std::int32_t a = 0; a < count; ++a) {
          if (into[a] == b) members.push_back(a);
        }
        if (members.size() == 1) continue;
        std::vector<double> sk(d, 0.0), sv(d, 0.0);
        std::int64_t total = 0;
        for (const std::int32_t e : members) {
          for (std::int32_t c = 0; c < d; ++c) {
            sk[c] += degree[e] * key(row, e, c);
            sv[c] += degree[e] * double(to_float(s.v[(row * s.capacity + order[e]) * d + c]));
          }
          total += degree[e];
        }
        for (std::int32_t c = 0; c < d; ++c) {
          s.k[(row * s.capacity + order[b]) * d + c] = from_float<T>(float(sk[c] / double(total)));
          s.v[(row * s.capacity + order[b]) * d + c] = from_float<T>(float(sv[c] / double(total)));
        }
        degree[b] = std::int32_t(total);
        log_degree[b] = float(std::log(double(total)));
      }
      std::vector<std::int32_t> new_order, new_degree, freed;
      std::vector<float> new_log;
      for (std::int32_t e = 0; e < count; ++e) {
        if (into[e] >= 0) {
          freed.push_back(order[e]);
        } else {
          new_order.push_back(order[e]), new_degree.push_back(degree[e]), new_log.push_back(log_degree[e]);
        }
      }
      new_order.insert(new_order.end(), freed.begin(), freed.end());
      std::copy(new_order.begin(), new_order.end(), order);
      std::copy(new_degree.begin(), new_degree.end(), degree);
      std::copy(new_log.begin(), new_log.end(), log_degree);
      s.count[row] = count - m;
    }
  }
  return true;
}

template <class T>
float storage_eps() {
  if constexpr (std::is_same_v<T, float>) return 1e-6f;
  if constexpr (std::is_same_v<T, half>) return 1.0f / 1024;
  return 1.0f / 128;
}

/// The round's result against the reference: counts, the whole order, degrees and log-degrees of the live
/// entries, and their K/V (the reference's fp64 means rounded once; the implementation's fp32 sums may land one
/// rounding step away).
template <class T>
void expect_same_store(const HostStore<T>& got, const HostStore<T>& want, const std::vector<std::int32_t>& slots) {
  for (const std::int32_t slot : slots) {
    for (std::int32_t h = 0; h < got.kv_heads; ++h) {
      const std::int64_t row = std::int64_t(slot) * got.kv_heads + h;
      ASSERT_EQ(got.count[row], want.count[row]) << "slot " << slot << " head " << h;
      for (std::int32_t i = 0; i < got.capacity; ++i) {
        ASSERT_EQ(got.order[row * got.capacity + i], want.order[row * got.capacity + i]) << "order " << i;
      }
      for (std::int32_t i = 0; i < got.count[row]; ++i) {
        const std::int64_t at = row * got.capacity + i;
        ASSERT_EQ(got.degree[at], want.degree[at]) << "degree " << i;
        ASSERT_NEAR(got.log_degree[at], want.log_degree[at], 1e-6) << "log_degree " << i;
        const std::int64_t slot_at = (row * got.capacity + got.order[at]) * got.head_dim;
        for (std::int32_t c = 0; c < got.head_dim; ++c) {
          const float gk = to_float(got.k[slot_at + c]), wk = to_float(want.k[slot_at + c]);
          const float gv = to_float(got.v[slot_at + c]), wv = to_float(want.v[slot_at + c]);
          ASSERT_NEAR(gk, wk, 2 * storage_eps<T>() * std::max(1.0f, std::abs(wk))) << "K of entry " << i << " ch " << c;
          ASSERT_NEAR(gv, wv, 2 * storage_eps<T>() * std::max(1.0f, std::abs(wv))) << "V of entry " << i << " ch " << c;
        }
      }
    }
  }
}

template <class T>
void expect_round_matches_reference(Random& rng, const MergeRoundParams& p, std::int32_t d) {
  SCOPED_TRACE(fmt::format("{} chunk {} sinks {} recent {} ratio {} trigger {} d {}", std::is_same_v<T, float> ? "f32" : std::is_same_v<T, half> ? "f16" : "bf16", p.chunk,
                           p.sinks, p.recent, p.ratio, p.trigger, d));
  const std::int32_t capacity = 700;
  const std::vector<std::int32_t> slots{3, 0, 2};  // slot 1 is not in the call: untouched
  const std::vector<std::int32_t> budgets{300, 10, 520, 200};
  for (int attempt = 0; attempt < 20; ++attempt) {
    HostStore<T> s(4, 2, capacity, d);
    for (std::int32_t r = 0; r < 8; ++r) fill_row(rng, s, r, rng.uniform_int(capacity / 2, capacity), p);
    s.count[0] = 100;  // slot 0, head 0: below its budget (300), it sits out
    HostStore<T> want = s;
    if (!reference_round(want, slots, budgets, p)) continue;
    const MergeStoreView<T> view = s.view();
    const HostStore<T> before = s;
    ThreadPool pool(3);
    const std::vector<std::byte> result = check_workspace(
        merge_round_workspace_bytes(3, 2, capacity, &pool),
        [&](std::span<std::byte> ws) { merge_round(view, slots.data(), 3, budgets.data(), p, ws, &pool); },
        [&] { return s.bytes(); }, [&] { s = before; });
    expect_same_store(s, want, slots);
    std::int64_t merged = 0;
    for (std::size_t r = 0; r < s.count.size(); ++r) merged += before.count[r] - s.count[r];
    EXPECT_GT(merged, 0) << "the draw merges something";
    // The pool does not change a bit.
    s = before;
    cpu::Array<std::byte> ws(merge_round_workspace_bytes(3, 2, capacity));
    merge_round(view, slots.data(), 3, budgets.data(), p, ws.bytes());
    EXPECT_TRUE(s.bytes() == result) << "one thread vs three";
    return;
  }
  FAIL() << "20 draws were all ambiguous";
}

TEST_F(MergeStore, RoundMatchesTheFp64Reference) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const MergeRoundParams p : {MergeRoundParams{.sinks = 16, .recent = 64, .chunk = 256, .ratio = 0.8f, .trigger = 1},
                                   MergeRoundParams{.sinks = 5, .recent = 7, .chunk = 37, .ratio = 0.3f, .trigger = 1},
                                   MergeRoundParams{.sinks = 0, .recent = 0, .chunk = 2, .ratio = 1.0f, .trigger = 64}}) {
    for (const cpu::SimdLevel level : available_simd_levels()) {
      const cpu::ScopedSimdLevel scoped(level);
      SCOPED_TRACE(cpu::simd_level_name(level));
      expect_round_matches_reference<float>(rng, p, 72);
      expect_round_matches_reference<bfloat16>(rng, p, 64);
      expect_round_matches_reference<half>(rng, p, 128);
    }
  }
}

// Several A entries join one B entry: the degree-weighted means of all of them, in the B entry's slot, and the
// freed slots after the survivors in sequence order. Ties (equal similarities) go to the earlier A entry.
TEST_F(MergeStore, FanInMergesSeveralAIntoOneB) {
  // One chunk of 8: B = 0, 2, 4, 6; A = 1, 3, 5, 7. Keys: A1, A3 = B2 = e1 (similarity 1), A7 = B0 = e0
  // (similarity 1, but the latest), A5 = e3 against B6 = e2 + e3 (0.707). Budget 6: m = min(4, 8 - 6) = 2.
  HostStore<float> s(1, 1, 10, 4);
  const std::vector<std::vector<float>> keys{{1, 0, 0, 0}, {0, 1, 0, 0}, {0, 2, 0, 0}, {0, 3, 0, 0},
                                             {0, 0, 1, 0}, {0, 0, 0, 1}, {0, 0, 1, 1}, {4, 0, 0, 0}};
  const std::vector<std::int32_t> order{7, 2, 9, 0, 4, 1, 3, 8, 5, 6}, degree{1, 2, 3, 1, 1, 1, 1, 1};
  s.order = order;
  s.count = {8};
  for (std::int32_t p = 0; p < 8; ++p) {
    s.degree[p] = degree[p];
    s.log_degree[p] = std::log(float(degree[p]));
    for (std::int32_t c = 0; c < 4; ++c) {
      s.k[order[p] * 4 + c] = keys[p][c];
      s.v[order[p] * 4 + c] = float(10 * p + c);
    }
  }
  const std::vector<std::int32_t> slots{0}, budgets{6};
  cpu::Array<std::byte> ws(merge_round_workspace_bytes(1, 1, 10));
  merge_round(s.view(), slots.data(), 1, budgets.data(), {.sinks = 0, .recent = 0, .chunk = 8, .ratio = 1.0f},
              ws.bytes());
  ASSERT_EQ(s.count[0], 6);
  EXPECT_EQ(std::vector<std::int32_t>(s.order.begin(), s.order.end()),
            (std::vector<std::int32_t>{7, 9, 4, 1, 3, 8, 2, 0, 5, 6}));
  EXPECT_EQ(std::vector<std::int32_t>(s.degree.begin(), s.degree.begin() + 6), (std::vector<std::int32_t>{1, 6, 1, 1, 1, 1}));
  EXPECT_FLOAT_EQ(s.log_degree[1], std::log(6.0f));
  // Entry 2 (slot 9) = (3 * row2 + 2 * row1 + 1 * row3) / 6.
  for (std::int32_t c = 0; c < 4; ++c) {
    const float want_k = (3 * keys[2][c] + 2 * keys[1][c] + keys[3][c]) / 6;
    const float want_v = (3 * float(20 + c) + 2 * float(10 + c) + float(30 + c)) / 6;
    EXPECT_FLOAT_EQ(s.k[9 * 4 + c], want_k) << c;
    EXPECT_FLOAT_EQ(s.v[9 * 4 + c], want_v) << c;
  }
}

// A row below its trigger (s < B + trigger), or with no middle beyond sinks and recent, is left bit for bit.
TEST_F(MergeStore, RowsBelowTheTriggerAreUntouched) {
  const MergeRoundParams p{.sinks = 4, .recent = 4, .chunk = 16, .ratio = 0.8f, .trigger = 64};
  HostStore<bfloat16> s(2, 2, 300, 32);
  for (std::int32_t r = 0; r < 4; ++r) fill_row(rng, s, r, 200, p);
  const std::vector<std::int32_t> slots{0, 1}, budgets{137, 136};  // 200 < 137 + 64; 200 >= 136 + 64
  const HostStore<bfloat16> before = s;
  cpu::Array<std::byte> ws(merge_round_workspace_bytes(2, 2, 300));
  merge_round(s.view(), slots.data(), 2, budgets.data(), p, ws.bytes());
  EXPECT_EQ(s.count[0], 200);
  EXPECT_EQ(s.count[1], 200);
  EXPECT_EQ(s.count[2], 136) << "a decode-time round merges exactly s - B when the ratio allows it";
  for (std::int64_t i = 0; i < 2 * 300; ++i) ASSERT_EQ(s.order[i], before.order[i]);
  EXPECT_TRUE(std::equal(s.k.begin(), s.k.begin() + 2 * 300 * 32, before.k.begin(),
                         [](bfloat16 a, bfloat16 b) { return a.bits == b.bits; }));
}

// Load, append, copy and selection move entries as documented; the degrees sum to the tokens seen.
TEST_F(MergeStore, LoadAppendCopyAndSelection) {
  using T = half;
  HostKV kv(rng, 2, 2, 50, 16, {40, 50});
  std::vector<T> k = to_storage<T>(kv.k), v = to_storage<T>(kv.v);
  const auto cache = ContiguousKVView<const T>::packed(k.data(), v.data(), 2, 2, 50, 16, kv.seq_lens.data());
  HostStore<T> s(3, 2, 60, 16);
  const std::vector<std::int32_t> slots{2, 0};
  ThreadPool pool(2);
  merge_store_load(KVCache<const T>(cache), slots.data(), s.view(), &pool);
  for (std::int32_t b = 0; b < 2; ++b) {
    for (std::int32_t h = 0; h < 2; ++h) {
      const std::int64_t row = slots[b] * 2 + h;
      ASSERT_EQ(s.count[row], kv.seq_lens[b]);
      for (std::int32_t i = 0; i < 60; ++i) ASSERT_EQ(s.order[row * 60 + i], i);
      for (std::int32_t t = 0; t < kv.seq_lens[b]; ++t) {
        ASSERT_EQ(s.degree[row * 60 + t], 1);
        ASSERT_EQ(s.log_degree[row * 60 + t], 0.0f);
        ASSERT_EQ(to_float(s.k[(row * 60 + t) * 16 + 3]), to_float(cache.k_row(b, h, t)[3]));
      }
    }
  }
  // Merge a little, then append the cache's last tokens: they go to slot order[count].
  const std::vector<std::int32_t> budgets{30, 0, 20};
  cpu::Array<std::byte> ws(merge_round_workspace_bytes(2, 2, 60, &pool));
  merge_round(s.view(), slots.data(), 2, budgets.data(), {.sinks = 2, .recent = 2, .chunk = 8, .ratio = 0.5f}, ws.bytes(),
              &pool);
  const HostStore<T> merged = s;
  const std::vector<std::int32_t> lengths{40, 50};
  merge_store_append(KVCache<const T>(cache), slots.data(), lengths.data(), s.view(), &pool);
  for (std::int32_t b = 0; b < 2; ++b) {
    for (std::int32_t h = 0; h < 2; ++h) {
      const std::int64_t row = slots[b] * 2 + h;
      const std::int32_t at = merged.count[row];
      ASSERT_EQ(s.count[row], at + 1);
      ASSERT_EQ(s.degree[row * 60 + at], 1);
      const std::int32_t slot = s.order[row * 60 + at];
      ASSERT_EQ(slot, merged.order[row * 60 + at]);
      for (std::int32_t c = 0; c < 16; ++c) {
        ASSERT_EQ(to_float(s.v[(row * 60 + slot) * 16 + c]), to_float(cache.v_row(b, h, lengths[b] - 1)[c]));
      }
      std::int64_t total = 0;
      for (std::int32_t i = 0; i < s.count[row]; ++i) total += s.degree[row * 60 + i];
      EXPECT_EQ(total, kv.seq_lens[b] + 1) << "degrees sum to the tokens seen";
    }
  }
  // Copy into another store, entries compacted to slots 0 .. count - 1.
  HostStore<T> dst(2, 2, 51, 16);
  const std::vector<std::int32_t> dst_slots{0, 1};
  merge_store_copy(s.view().as_const(), slots.data(), dst.view(), dst_slots.data(), 2, &pool);
  HostSelection sel(2, 2, 60, true), sel_dst(2, 2, 51, true);
  merge_store_selection(s.view().as_const(), slots.data(), sel.view, &pool);
  merge_store_selection(dst.view().as_const(), dst_slots.data(), sel_dst.view, &pool);
  for (std::int32_t b = 0; b < 2; ++b) {
    for (std::int32_t h = 0; h < 2; ++h) {
      const std::int64_t row = slots[b] * 2 + h, to = dst_slots[b] * 2 + h;
      ASSERT_EQ(sel.view.count(b, h), s.count[row]);
      ASSERT_EQ(sel_dst.view.count(b, h), s.count[row]);
      for (std::int32_t i = 0; i < 51; ++i) ASSERT_EQ(dst.order[to * 51 + i], i);
      for (std::int32_t i = 0; i < s.count[row]; ++i) {
        ASSERT_EQ(sel.view.row(b, h)[i], s.order[row * 60 + i]);
        ASSERT_EQ(sel.view.weights_row(b, h)[i], s.log_degree[row * 60 + i]);
        ASSERT_EQ(sel_dst.view.row(b, h)[i], i);
        ASSERT_EQ(sel_dst.view.weights_row(b, h)[i], s.log_degree[row * 60 + i]);
        ASSERT_EQ(dst.degree[to * 51 + i], s.degree[row * 60 + i]);
        for (std::int32_t c = 0; c < 16; ++c) {
          ASSERT_EQ(to_float(dst.k[(to * 51 + i) * 16 + c]), to_float(s.k[(row * 60 + s.order[row * 60 + i]) * 16 + c]));
        }
      }
    }
  }
}

// An eviction drops the entry after a row's sinks where count >= B (order, degree and log-degree move down, the
// freed slot goes last, K/V stay); a row below its budget, with sinks -1 or with no entry past its sinks, and a slot
// not in the call are untouched bit for bit.
TEST_F(MergeStore, EvictDropsTheOldestEntryAfterTheSinks) {
  const MergeRoundParams fill{.sinks = 0, .recent = 0, .chunk = 4};
  HostStore<half> s(5, 2, 20, 8);
  const std::vector<std::int32_t> counts{12, 12, 10, 3, 12};  // per slot
  for (std::int32_t r = 0; r < 10; ++r) fill_row(rng, s, r, counts[std::size_t(r / 2)], fill);
  const std::vector<std::int32_t> slots{0, 2, 1, 3}, budgets{12, 5, 12, 3, 12}, sinks{3, -1, 0, 3, 3};
  const HostStore<half> before = s;
  ThreadPool pool(2);
  merge_store_evict(s.view(), slots.data(), 4, budgets.data(), sinks.data(), &pool);
  EXPECT_EQ(std::memcmp(s.k.data(), before.k.data(), s.k.size() * sizeof(half)), 0) << "K rows do not move";
  EXPECT_EQ(std::memcmp(s.v.data(), before.v.data(), s.v.size() * sizeof(half)), 0) << "V rows do not move";
  for (std::int32_t r = 0; r < 10; ++r) {
    const std::size_t at = std::size_t(r) * 20;
    const auto order = [&](const HostStore<half>& x) {
      return std::vector<std::int32_t>(x.order.begin() + std::ptrdiff_t(at), x.order.begin() + std::ptrdiff_t(at + 20));
    };
    if (r >= 2) {  // slot 1: sinks -1; slot 2: below its budget; slot 3: nothing past its sinks; slot 4: not called
      EXPECT_EQ(s.count[r], before.count[r]) << "row " << r;
      EXPECT_EQ(order(s), order(before)) << "row " << r;
      const auto d = std::ptrdiff_t(at);
      EXPECT_TRUE(std::equal(s.degree.begin() + d, s.degree.begin() + d + 20, before.degree.begin() + d));
      continue;
    }
    std::vector<std::int32_t> want = order(before);
    std::rotate(want.begin() + 3, want.begin() + 4, want.begin() + 12);
    EXPECT_EQ(s.count[r], 11) << "row " << r;
    EXPECT_EQ(order(s), want) << "row " << r;
    for (std::int32_t i = 0; i < 11; ++i) {
      const std::size_t from = at + std::size_t(i < 3 ? i : i + 1);
      EXPECT_EQ(s.degree[at + i], before.degree[from]) << "row " << r << " position " << i;
      EXPECT_EQ(s.log_degree[at + i], before.log_degree[from]) << "row " << r << " position " << i;
    }
  }
  // The next append writes the freed slot.
  HostKV kv(rng, 1, 2, 4, 8, {4});
  const std::vector<half> k = to_storage<half>(kv.k), v = to_storage<half>(kv.v);
  const auto cache = ContiguousKVView<const half>::packed(k.data(), v.data(), 1, 2, 4, 8, kv.seq_lens.data());
  merge_store_append(KVCache<const half>(cache), slots.data(), kv.seq_lens.data(), s.view());
  for (std::int32_t h = 0; h < 2; ++h) {
    EXPECT_EQ(s.count[h], 12);
    const std::int32_t freed = before.order[std::size_t(h) * 20 + 3];
    EXPECT_EQ(std::memcmp(&s.k[(std::size_t(h) * 20 + freed) * 8], cache.k_row(0, h, 3), 8 * sizeof(half)), 0);
  }
}

TEST_F(MergeStore, BadInputsAreRefused) {
  using T = bfloat16;
  HostKV kv(rng, 1, 1, 40, 8, {40});
  std::vector<T> k = to_storage<T>(kv.k), v = to_storage<T>(kv.v);
  const KVCache<const T> cache = ContiguousKVView<const T>::packed(k.data(), v.data(), 1, 1, 40, 8, kv.seq_lens.data());
  HostStore<T> small(2, 1, 30, 8), full(2, 1, 40, 8);
  const std::vector<std::int32_t> slot{1}, bad_slot{2}, budgets{10, 10};
  expect_error([&] { merge_store_load(cache, slot.data(), small.view()); },
               "cpu::merge_store_load: batch row 0 has 40 tokens, more than the store's capacity (= 30)");
  expect_error([&] { merge_store_load(cache, bad_slot.data(), full.view()); },
               "cpu::merge_store_load: slots[0] (= 2) is outside [0, store.slots = 2)");
  merge_store_load(cache, slot.data(), full.view());
  const std::vector<std::int32_t> lengths{40};
  expect_error([&] { merge_store_append(cache, slot.data(), lengths.data(), full.view()); },
               "cpu::merge_store_append: the row of slot 1, kv head 0 is full (count = capacity = 40)");
  expect_error([&] { merge_store_copy(full.view().as_const(), slot.data(), small.view(), slot.data(), 1); },
               "cpu::merge_store_copy: the row of src slot 1, kv head 0 has 40 entries, more than dst's capacity (= 30)");
  HostSelection sel(1, 1, 39, true), unweighted(1, 1, 40, false);
  expect_error([&] { merge_store_selection(full.view().as_const(), slot.data(), sel.view); }, "capacity >= the store's (= 40)");
  expect_error([&] { merge_store_selection(full.view().as_const(), slot.data(), unweighted.view); },
               "out.log_weights must be non-null");
  // A slot twice: two rows would merge or append into one store row at once.
  const std::vector<std::int32_t> twice{1, 1}, twice_lengths{40, 40};
  cpu::Array<std::byte> ws2(merge_round_workspace_bytes(2, 1, 40));
  expect_error([&] { merge_round(full.view(), twice.data(), 2, budgets.data(), {}, ws2.bytes()); },
               "cpu::merge_round: slots[0] and slots[1] are both slot 1: each row of a call must be distinct");
  const std::vector<std::int32_t> pair{0, 1};
  HostStore<T> big(2, 1, 50, 8);
  expect_error([&] { merge_store_copy(full.view().as_const(), pair.data(), big.view(), twice.data(), 2); },
               "cpu::merge_store_copy: dst_slots[0] and dst_slots[1] are both slot 1");
  HostKV kv2(rng, 2, 1, 40, 8, {39, 39});
  std::vector<T> k2 = to_storage<T>(kv2.k), v2 = to_storage<T>(kv2.v);
  const KVCache<const T> cache2 =
      ContiguousKVView<const T>::packed(k2.data(), v2.data(), 2, 1, 40, 8, kv2.seq_lens.data());
  expect_error([&] { merge_store_append(cache2, twice.data(), kv2.seq_lens.data(), big.view()); },
               "cpu::merge_store_append: slots[0] and slots[1] are both slot 1");
  const std::vector<std::int32_t> sinks{2, 2};
  expect_error([&] { merge_store_evict(big.view(), twice.data(), 2, budgets.data(), sinks.data()); },
               "cpu::merge_store_evict: slots[0] and slots[1] are both slot 1");
  expect_error([&] { merge_store_evict(big.view(), slot.data(), 1, budgets.data(), nullptr); },
               "cpu::merge_store_evict: budgets and sinks must be non-null");
  expect_error([&] { merge_store_evict(full.view(), bad_slot.data(), 1, budgets.data(), sinks.data()); },
               "cpu::merge_store_evict: slots[0] (= 2) is outside [0, store.slots = 2)");
  cpu::Array<std::byte> ws(merge_round_workspace_bytes(1, 1, 40));
  expect_error([&] { merge_round(full.view(), slot.data(), 1, budgets.data(), {.chunk = 1}, ws.bytes()); },
               "cpu::merge_round: params.chunk (= 1) must be >= 2");
  expect_error([&] { merge_round(full.view(), slot.data(), 1, budgets.data(), {.ratio = 1.5f}, ws.bytes()); },
               "params.ratio (= 1.5) is outside [0, 1]");
  expect_error([&] { merge_round(full.view(), slot.data(), 1, budgets.data(), {.trigger = 0}, ws.bytes()); },
               "params.trigger (= 0) must be >= 1");
  expect_error([&] { merge_round(full.view(), slot.data(), 1, budgets.data(), {}, ws.bytes().first(256)); },
               "workspace too small");
  full.count[1] = 41;
  expect_error([&] { merge_round(full.view(), slot.data(), 1, budgets.data(), {}, ws.bytes()); },
               "cpu::merge_round: store: the row of slot 1, kv head 0 has count 41, outside [0, capacity = 40]");
  HostStore<T> wide(1, 1, 4, 257);
  expect_error([&] { (void)merge_round(wide.view(), slot.data(), 1, budgets.data(), {}, ws.bytes()); },
               "store: head_dim (= 257) is outside [1, 256]");
}

// Theorem A.1 of the paper, by brute force: for every convex, decreasing score of the distance, the alternating
// partition that merge rounds use (B = even local positions, A = odd, selectors/centroid_kv/merge_store.hpp) maximizes the sum of
// f(|x - y|) over the pairs (x in A, y in B) among all splits of 2n positions into two halves, 2n <= 12.
TEST(MergeStoreTheorem, AlternatingPartitionIsOptimal) {
  const std::vector<std::pair<const char*, double (*)(double)>> scores{
      {"1/x", [](double x) { return 1.0 / x; }},
      {"exp(-x)", [](double x) { return std::exp(-x); }},
      {"-x", [](double x) { return -x; }},
      {"max(0, 4 - x)", [](double x) { return std::max(0.0, 4.0 - x); }},
      {"1/x^2", [](double x) { return 1.0 / (x * x); }},
      {"exp(-x/5) - x/10", [](double x) { return std::exp(-x / 5.0) - x / 10.0; }}};
  for (std::int32_t n = 1; 2 * n <= 12; ++n) {
    const std::int32_t size = 2 * n;
    for (const auto& [name, f] : scores) {
      const auto objective = [&](std::uint32_t a_mask) {
        double sum = 0;
        for (std::int32_t x = 0; x < size; ++x) {
          for (std::int32_t y = 0; y < size; ++y) {
            if ((a_mask >> x & 1u) && !(a_mask >> y & 1u)) sum += f(std::abs(x - y));
          }
        }
        return sum;
      };
      std::uint32_t alternating = 0;
      for (std::int32_t x = 1; x < size; x += 2) alternating |= 1u << x;  // A: odd local positions
      const double ours = objective(alternating);
      double best = -1e300;
      for (std::uint32_t mask = 0; mask < (1u << size); ++mask) {
        if (std::popcount(mask) == n) best = std::max(best, objective(mask));
      }
      EXPECT_GE(ours, best - 1e-9 * std::max(1.0, std::abs(best))) << name << " 2n = " << size;
    }
  }
}

}  // namespace
}  // namespace kvsift::test
