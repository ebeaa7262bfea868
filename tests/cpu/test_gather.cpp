// KV gathers on the CPU (cpu/gather.hpp) against references: gather_kv and gather_keys row by row from the source
// cache's own row addresses; gather_kv_difference over several steps of overlapping selections against
// gather_problem.hpp's ResidentSlots (a std::map token -> slot and a std::set of free slots: kept tokens keep their
// slots, new ones take the smallest free slots in ascending token order), then every resident row checked against its
// token's K and V. Contiguous and paged sources and destinations, ragged lengths, with and without a pool; every
// refusal has its message checked.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "gather_problem.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/gather.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::Random;

bool same_row(const float* a, const float* b, std::int32_t d) { return std::equal(a, a + d, b); }

void check_gather_kv(Random& rng, bool paged_src, bool paged_dst, cpu::ThreadPool* pool) {
  SCOPED_TRACE(testing::Message() << (paged_src ? "paged" : "contiguous") << " src, "
                                  << (paged_dst ? "paged" : "contiguous") << " dst");
  const std::vector<std::int32_t> lens = {0, 9, 40, 33};
  const std::int32_t kv_heads = 2, d = 16, capacity = 12;
  test::HostKV src(rng, 4, kv_heads, 40, d, lens);
  test::HostPagedKV src_paged(src, 8, true, rng);
  test::HostKV dst(rng, 4, kv_heads, capacity, d);  // random contents: unwritten rows must keep them
  test::HostPagedKV dst_paged(dst, 5, false, rng);
  const auto dst_before = dst.k;
  const auto dst_paged_before = dst_paged.k_pages;
  test::HostSelection rows(4, kv_heads, capacity, false);
  test::random_rows(rng, rows, lens);
  const KVCache<const float> s = paged_src ? KVCache<const float>(src_paged.view) : KVCache<const float>(src.view());
  PagedKVView<float> dp{dst_paged.k_pages.data(), dst_paged.v_pages.data(), dst_paged.indptr.data(),
                        dst_paged.indices.data(), dst_paged.last_len.data(), 4, kv_heads, d,
                        dst_paged.view.page_size, dst_paged.view.num_pages, dst_paged.view.page_stride,
                        dst_paged.view.token_stride, dst_paged.view.head_stride};
  const auto dc = ContiguousKVView<float>::packed(dst.k.data(), dst.v.data(), 4, kv_heads, capacity, d);
  const KVCache<float> out = paged_dst ? KVCache<float>(dp) : KVCache<float>(dc);
  cpu::gather_kv(s, rows.view, out, pool);
  for (std::int32_t b = 0; b < 4; ++b) {
    for (std::int32_t h = 0; h < kv_heads; ++h) {
      const std::int32_t n = rows.counts[b * kv_heads + h];
      for (std::int32_t i = 0; i < capacity; ++i) {
        if (i < n) {
          const std::int32_t t = rows.view.row(b, h)[i];
          EXPECT_TRUE(same_row(out.k_row(b, h, i), src.view().k_row(b, h, t), d)) << b << " " << h << " " << i;
          EXPECT_TRUE(same_row(out.v_row(b, h, i), src.view().v_row(b, h, t), d)) << b << " " << h << " " << i;
        } else {
          const float* before = paged_dst ? dst_paged_before.data() + dp.offset(b, h, i) : dst_before.data() + dc.offset(b, h, i);
          EXPECT_TRUE(same_row(out.k_row(b, h, i), before, d)) << "slot " << i << " past the count was written";
        }
      }
    }
  }
}

/// gather_keys into a strided [batch, kv_heads, tokens, d] view (padded rows and heads): each selected K row, and
/// nothing else (the padding and the rows past the counts keep their poison).
void check_gather_keys(Random& rng, bool paged_src, cpu::ThreadPool* pool) {
  SCOPED_TRACE(testing::Message() << (paged_src ? "paged" : "contiguous") << " src");
  const std::vector<std::int32_t> lens = {0, 9, 40, 33};
  const std::int32_t kv_heads = 2, d = 16, capacity = 12, tokens = 13, row = d + 3, head = tokens * row + 5;
  test::HostKV src(rng, 4, kv_heads, 40, d, lens);
  test::HostPagedKV src_paged(src, 8, true, rng);
  test::HostSelection rows(4, kv_heads, capacity, false);
  test::random_rows(rng, rows, lens);
  const float poison = -12345.0f;
  std::vector<float> keys(std::size_t(4) * kv_heads * head, poison);
  const SequenceView<float> dst{keys.data(), 4, kv_heads, tokens, d, std::int64_t(kv_heads) * head, head, row};
  const KVCache<const float> s = paged_src ? KVCache<const float>(src_paged.view) : KVCache<const float>(src.view());
  cpu::gather_keys(s, rows.view, dst, pool);
  std::size_t written = 0;
  for (std::int32_t b = 0; b < 4; ++b) {
    for (std::int32_t h = 0; h < kv_heads; ++h) {
      const std::int32_t n = rows.counts[b * kv_heads + h];
      for (std::int32_t i = 0; i < n; ++i) {
        EXPECT_TRUE(same_row(dst.row(b, h, i), src.view().k_row(b, h, rows.view.row(b, h)[i]), d)) << b << h << i;
      }
      written += std::size_t(n) * d;
    }
  }
  EXPECT_EQ(std::size_t(std::count(keys.begin(), keys.end(), poison)), keys.size() - written);
}

class Gather : public test::SeededTest {};

TEST_F(Gather, GatherKeysCopiesSelectedKeyRowsOnly) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(3);
  for (int repeat = 0; repeat < 4; ++repeat) {
    for (bool ps : {false, true}) check_gather_keys(rng, ps, repeat % 2 ? &pool : nullptr);
  }
}

TEST_F(Gather, GatherKvCopiesSelectedRowsToLeadingSlots) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(3);
  for (int repeat = 0; repeat < 5; ++repeat) {
    for (bool ps : {false, true}) {
      for (bool pd : {false, true}) check_gather_kv(rng, ps, pd, repeat % 2 ? &pool : nullptr);
    }
  }
}

/// The difference gather over `steps` steps of selections that keep part of the last one.
void check_difference(Random& rng, bool paged_src, cpu::ThreadPool* pool) {
  SCOPED_TRACE(testing::Message() << (paged_src ? "paged" : "contiguous") << " src");
  const std::vector<std::int32_t> lens = {50, 7, 64};
  const std::int32_t batch = 3, kv_heads = 2, d = 8, cap = 10, resident_cap = cap + rng.uniform_int(0, 3);
  const std::int32_t rows = batch * kv_heads;
  test::HostKV src(rng, batch, kv_heads, 64, d, lens);
  test::HostPagedKV src_paged(src, 16, false, rng);
  const KVCache<const float> s = paged_src ? KVCache<const float>(src_paged.view) : KVCache<const float>(src.view());
  test::HostKV resident(rng, batch, kv_heads, resident_cap, d);
  const auto res_view = ContiguousKVView<float>::packed(resident.k.data(), resident.v.data(), batch, kv_heads,
                                                        resident_cap, d);
  test::HostSelection prev(batch, kv_heads, cap, false), cur(batch, kv_heads, cap, false);
  std::fill(prev.counts.begin(), prev.counts.end(), 0);
  std::vector<std::int32_t> prev_slots(prev.indices.size(), test::kPoisonIndex), cur_slots(prev_slots);
  test::ResidentSlots reference(rows, resident_cap);
  cpu::Array<std::byte> ws(cpu::gather_kv_difference_workspace_bytes(batch, kv_heads, cap, resident_cap, pool));
  for (int step = 0; step < 8; ++step) {
    std::vector<std::int32_t> copied(rows, test::kPoisonIndex);
    std::fill(cur_slots.begin(), cur_slots.end(), test::kPoisonIndex);
    test::next_selection(rng, prev, cur, lens);
    cpu::gather_kv_difference(s, prev.view, prev_slots.data(), cur.view, cur_slots.data(), res_view, copied.data(),
                              ws.bytes(), pool);
    const auto want = reference.step(cur);
    EXPECT_EQ(copied, want.copied) << "step " << step;
    ASSERT_EQ(cur_slots, want.slots) << "step " << step;  // entries past the counts not written
    for (std::int32_t r = 0; r < rows; ++r) {
      const std::int32_t b = r / kv_heads, h = r % kv_heads;
      for (std::int32_t i = 0; i < cur.counts[r]; ++i) {
        const std::int32_t t = cur.indices[r * cap + i], slot = cur_slots[r * cap + i];
        EXPECT_TRUE(same_row(res_view.k_row(b, h, slot), src.view().k_row(b, h, t), d)) << "row " << r << " token " << t;
        EXPECT_TRUE(same_row(res_view.v_row(b, h, slot), src.view().v_row(b, h, t), d)) << "row " << r << " token " << t;
      }
    }
    prev.indices = cur.indices;  // same sizes: the views stay valid
    prev.counts = cur.counts;
    std::swap(prev_slots, cur_slots);
  }
}

TEST_F(Gather, DifferenceLoadsOnlyNewTokensIntoFreedSlots) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cpu::ThreadPool pool(2);
  for (int repeat = 0; repeat < 10; ++repeat) {
    check_difference(rng, repeat % 2 == 1, repeat % 3 == 0 ? &pool : nullptr);
  }
}

TEST_F(Gather, BadInputIsRefused) {
  const std::int32_t kv_heads = 2, d = 8, cap = 4;
  test::HostKV src(rng, 2, kv_heads, 20, d, {20, 10});
  test::HostKV dst(rng, 2, kv_heads, cap, d);
  const auto dv = ContiguousKVView<float>::packed(dst.k.data(), dst.v.data(), 2, kv_heads, cap, d);
  test::HostSelection rows(2, kv_heads, cap, false);
  std::fill(rows.counts.begin(), rows.counts.end(), 2);
  for (std::size_t r = 0; r < 4; ++r) rows.indices[r * cap] = 1, rows.indices[r * cap + 1] = 5;
  const KVCache<const float> s(src.view());
  cpu::gather_kv(s, rows.view, KVCache<float>(dv));  // the valid call runs
  rows.indices[3 * cap + 1] = 10;
  test::expect_error([&] { cpu::gather_kv(s, rows.view, KVCache<float>(dv)); },
                     {"cpu::gather_kv", "rows.indices[1] (= 10) at batch 1, kv_head 1 is outside [0, seq_len = 10)"});
  rows.indices[3 * cap + 1] = 5;
  std::vector<std::int32_t> dst_lens = {4, 1};
  auto short_dst = dv;
  short_dst.seq_lens = dst_lens.data();
  test::expect_error([&] { cpu::gather_kv(s, rows.view, KVCache<float>(short_dst)); },
                     "rows.counts (= 2) at batch 1, kv_head 0 exceeds the slots of dst's row (dst.seq_len(1) = 1)");
  rows.counts[0] = 5;
  test::expect_error([&] { cpu::gather_kv(s, rows.view, KVCache<float>(dv)); },
                     "rows.counts (= 5) at batch 0, kv_head 0 is outside [0, capacity = 4]");
  rows.counts[0] = 2;
  auto other_dim = ContiguousKVView<float>::packed(dst.k.data(), dst.v.data(), 2, kv_heads, cap / 2, 2 * d);
  test::expect_error([&] { cpu::gather_kv(s, rows.view, KVCache<float>(other_dim)); },
                     "src is [batch = 2, kv_heads = 2, head_dim = 8], dst [batch = 2, kv_heads = 2, head_dim = 16]");
  auto one_head = rows.view;
  one_head.kv_heads = 1;
  test::expect_error([&] { cpu::gather_kv(s, one_head, KVCache<float>(dv)); },
                     "rows is [batch = 2, kv_heads = 1], the cache [batch = 2, kv_heads = 2]");

  // gather_keys: gather_kv's refusals, dst's rows bounding the counts
  std::vector<float> keys(std::size_t(2) * kv_heads * cap * d);
  const auto kd = SequenceView<float>::packed(keys.data(), 2, kv_heads, cap, d);
  cpu::gather_keys(s, rows.view, kd);  // the valid call runs
  rows.indices[3 * cap + 1] = 10;
  test::expect_error([&] { cpu::gather_keys(s, rows.view, kd); },
                     {"cpu::gather_keys", "rows.indices[1] (= 10) at batch 1, kv_head 1 is outside [0, seq_len = 10)"});
  rows.indices[3 * cap + 1] = 5;
  const auto one_row = SequenceView<float>::packed(keys.data(), 2, kv_heads, 1, d);
  test::expect_error([&] { cpu::gather_keys(s, rows.view, one_row); },
                     "rows.counts (= 2) at batch 0, kv_head 0 exceeds dst's rows (dst.tokens = 1)");
  test::expect_error([&] { cpu::gather_keys(s, rows.view, SequenceView<float>::packed(keys.data(), 2, 1, cap, d)); },
                     "src is [batch = 2, kv_heads = 2, head_dim = 8], dst [batch = 2, heads = 1, head_dim = 8]");
  test::expect_error([&] { cpu::gather_keys(s, rows.view, SequenceView<float>::packed(nullptr, 2, kv_heads, cap, d)); },
                     "dst.data is a null pointer");

  // gather_kv_difference
  test::HostSelection prev(2, kv_heads, cap, false), cur(2, kv_heads, cap, false);
  std::fill(prev.counts.begin(), prev.counts.end(), 2);
  std::fill(cur.counts.begin(), cur.counts.end(), 2);
  std::vector<std::int32_t> prev_slots(16, 0), cur_slots(16, 0), copied(4);
  for (std::size_t r = 0; r < 4; ++r) {
    prev.indices[r * cap] = 1, prev.indices[r * cap + 1] = 5;
    cur.indices[r * cap] = 2, cur.indices[r * cap + 1] = 5;
    prev_slots[r * cap] = 3, prev_slots[r * cap + 1] = 0;
  }
  cpu::Array<std::byte> ws(cpu::gather_kv_difference_workspace_bytes(2, kv_heads, cap, cap));
  const auto diff = [&](const SelectionView& p, std::int32_t* ps, const SelectionView& c, std::int32_t* cs,
                        const ContiguousKVView<float>& res) {
    cpu::gather_kv_difference(s, p, ps, c, cs, res, copied.data(), ws.bytes());
  };
  diff(prev.view, prev_slots.data(), cur.view, cur_slots.data(), dv);  // the valid call runs
  EXPECT_EQ(cur_slots[0], 1);  // token 2 takes the smallest free slot; token 5 keeps slot 0
  EXPECT_EQ(cur_slots[1], 0);
  test::expect_error([&] { diff(prev.view, prev_slots.data(), cur.view, prev_slots.data(), dv); },
                     {"cpu::gather_kv_difference", "previous_slots and current_slots are one array"});
  prev_slots[2 * cap + 1] = 3;
  test::expect_error([&] { diff(prev.view, prev_slots.data(), cur.view, cur_slots.data(), dv); },
                     "previous_slots[1] (= 3) at batch 1, kv_head 0 repeats an earlier slot");
  prev_slots[2 * cap + 1] = 4;
  test::expect_error([&] { diff(prev.view, prev_slots.data(), cur.view, cur_slots.data(), dv); },
                     "previous_slots[1] (= 4) at batch 1, kv_head 0 is outside [0, resident.capacity = 4)");
  prev_slots[2 * cap + 1] = 0;
  cur.indices[cap] = 6;
  test::expect_error([&] { diff(prev.view, prev_slots.data(), cur.view, cur_slots.data(), dv); },
                     "current.indices[1] (= 5) at batch 0, kv_head 1 does not exceed current.indices[0] (= 6)");
  cur.indices[cap] = 2;
  auto small = ContiguousKVView<float>::packed(dst.k.data(), dst.v.data(), 2, kv_heads, cap - 1, d);
  test::expect_error([&] { diff(prev.view, prev_slots.data(), cur.view, cur_slots.data(), small); },
                     "resident.capacity (= 3) < current.capacity (= 4)");
  std::vector<float> big(std::size_t(2) * kv_heads * 65537 * d);
  auto huge = ContiguousKVView<float>::packed(big.data(), big.data(), 2, kv_heads, 65537, d);
  test::expect_error([&] { diff(prev.view, prev_slots.data(), cur.view, cur_slots.data(), huge); },
                     "resident.capacity (= 65537) exceeds 65536 slots");
  test::expect_error([&] { cpu::gather_kv_difference(s, prev.view, prev_slots.data(), cur.view, cur_slots.data(), dv,
                                                     copied.data(), ws.bytes().first(0)); },
                     "workspace too small");
}

}  // namespace
}  // namespace kvsift
