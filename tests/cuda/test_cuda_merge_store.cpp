// The merge store on CUDA (selectors/centroid_kv/cuda/merge_store.hpp) against its CPU twin (selectors/centroid_kv/cpu/merge_store.hpp, itself tested against
// an fp64 reference in tests/cpu): load, append, copy and selection bit for bit; merge rounds (prefill schedules and
// a decode-time round) on keys with planted near-duplicates, fp32, fp16 and bf16, device outputs and workspace
// poisoned. The round's similarities are fp32 sums in another order on each backend, so a row whose merges hinge
// on two similarities closer than kTieEpsilon (fp64, an A entry's best two B entries, or the m-th and (m+1)-th best
// links) may merge otherwise: such rows are detected and skipped, and their share must stay small. Each round
// starts both backends from the same (CPU) state. Also the device-value rules (count -1), the host refusals, and
// CentroidKV<bf16, cuda::Context> against CentroidKV<bf16, cpu::Context> through DecodeStep (prepare + 130 steps,
// two decode-time rounds), with a CUDA graph of one step replayed beside the eager steps, bit for bit. The window
// fallback (issue 40): the eviction against the CPU's bit for bit, and a fallback selector's stores and steps
// against the CPU's.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/centroid_kv/cpu/merge_store.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/centroid_kv/cuda/merge_store.hpp"
#include "kvsift/selectors/centroid_kv/centroid_kv.hpp"
#include "kvsift/step/decode_step.hpp"
#include "merge_store_problem.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::HostStore;
using test::Random;

/// Two similarities closer than this (fp64) may order either way in fp32 on the two backends.
constexpr double kTieEpsilon = 3e-6;

template <class T>
struct DeviceStore {
  std::int32_t slots, kv_heads, capacity, head_dim;
  DeviceBuffer<T> k, v;
  DeviceBuffer<std::int32_t> order, degree, count;
  DeviceBuffer<float> log_degree;

  explicit DeviceStore(const HostStore<T>& h)
      : slots(h.slots), kv_heads(h.kv_heads), capacity(h.capacity), head_dim(h.head_dim), k(h.k), v(h.v),
        order(h.order), degree(h.degree), count(h.count), log_degree(h.log_degree) {}
  void upload(const HostStore<T>& h) {
    k.upload(h.k), v.upload(h.v), order.upload(h.order), degree.upload(h.degree), count.upload(h.count);
    log_degree.upload(h.log_degree);
  }
  void poison() { k.poison(), v.poison(), order.poison(), degree.poison(), count.poison(), log_degree.poison(); }
  HostStore<T> download() const {
    HostStore<T> h(slots, kv_heads, capacity, head_dim);
    h.k = k.download(), h.v = v.download(), h.order = order.download(), h.degree = degree.download();
    h.count = count.download(), h.log_degree = log_degree.download();
    return h;
  }
  MergeStoreView<T> view() {
    return {k.data(), v.data(), order.data(), degree.data(), log_degree.data(), count.data(),
            slots,    kv_heads, capacity,     head_dim};
  }
};

/// Keys with planted near-duplicates: about half the tokens repeat one of the three before them plus noise (cosine
/// about 0.95, spread enough that the ranking rarely meets a near tie).
inline std::vector<float> planted_keys(Random& rng, std::int64_t rows, std::int32_t tokens, std::int32_t head_dim) {
  std::vector<float> k = rng.normal(std::size_t(rows) * tokens * head_dim);
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = k.data() + r * tokens * head_dim;
    for (std::int32_t t = 1; t < tokens; ++t) {
      if (rng.uniform(0.0f, 1.0f) >= 0.5f) continue;
      const std::int32_t from = t - rng.uniform_int(1, std::min(t, 3));
      const std::vector<float> noise = rng.normal(std::size_t(head_dim), 0.3f);
      for (std::int32_t d = 0; d < head_dim; ++d) row[t * head_dim + d] = row[from * head_dim + d] + noise[d];
    }
  }
  return k;
}

/// A cache [batch, kv_heads, tokens, head_dim] in T with planted keys, on the host and the device.
template <class T>
struct CacheProblem {
  std::int32_t batch, kv_heads, tokens, head_dim;
  std::vector<T> k, v;
  std::vector<std::int32_t> lens;
  DeviceBuffer<T> d_k, d_v;
  DeviceBuffer<std::int32_t> d_lens;

  CacheProblem(Random& rng, std::int32_t kv_heads_, std::int32_t tokens_, std::int32_t head_dim_,
               std::vector<std::int32_t> lens_)
      : batch(std::int32_t(lens_.size())), kv_heads(kv_heads_), tokens(tokens_), head_dim(head_dim_),
        k(test::to_storage<T>(planted_keys(rng, std::int64_t(batch) * kv_heads, tokens, head_dim))),
        v(test::to_storage<T>(rng.normal(k.size()))), lens(std::move(lens_)), d_k(k), d_v(v), d_lens(lens) {}
  KVCache<const T> host() const {
    return ContiguousKVView<const T>::packed(k.data(), v.data(), batch, kv_heads, tokens, head_dim, lens.data());
  }
  KVCache<const T> device() const {
    return ContiguousKVView<const T>::packed(d_k.data(), d_v.data(), batch, kv_heads, tokens, head_dim, d_lens.data());
  }
};

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 1e-6 : std::is_same_v<T, half> ? 1e-3 : 8e-3;
}

/// Row `row` of two stores: count, live order, degrees, log-degrees and the live entries' K and V (merged means
/// within one rounding of T: the sums are the same, but the CPU's compiler may contract them; `exact`: the same
/// bits).
template <class T>
void expect_same_row(const HostStore<T>& want, const HostStore<T>& got, std::int64_t row, const std::string& what,
                     bool exact = false) {
  SCOPED_TRACE(what + " store row " + std::to_string(row));
  const std::int32_t count = want.count[std::size_t(row)];
  ASSERT_EQ(got.count[std::size_t(row)], count);
  if (count < 0) return;
  const std::size_t base = std::size_t(row) * want.capacity;
  for (std::int32_t i = 0; i < count; ++i) {
    ASSERT_EQ(got.order[base + i], want.order[base + i]) << "position " << i;
    ASSERT_EQ(got.degree[base + i], want.degree[base + i]) << "position " << i;
    ASSERT_NEAR(got.log_degree[base + i], want.log_degree[base + i], exact ? 0.0 : 1e-6) << "position " << i;
    const std::size_t at = (base + std::size_t(want.order[base + i])) * want.head_dim;
    for (std::int32_t d = 0; d < want.head_dim; ++d) {
      const double a = to_float(want.k[at + d]), b = to_float(got.k[at + d]);
      const double c = to_float(want.v[at + d]), e = to_float(got.v[at + d]);
      const double tol = exact ? 0.0 : tolerance<T>();
      ASSERT_NEAR(b, a, tol * std::max(1.0, std::abs(a))) << "K, position " << i << " dim " << d;
      ASSERT_NEAR(e, c, tol * std::max(1.0, std::abs(c))) << "V, position " << i << " dim " << d;
    }
  }
  // The free positions hold the row's other slots, each once.
  std::vector<std::int32_t> all(got.order.begin() + std::ptrdiff_t(base),
                                got.order.begin() + std::ptrdiff_t(base + want.capacity));
  std::sort(all.begin(), all.end());
  for (std::int32_t i = 0; i < want.capacity; ++i) ASSERT_EQ(all[std::size_t(i)], i) << "order is no permutation";
}

/// Whether the round's merges in `row` hinge on two similarities within kTieEpsilon (fp64 over the keys).
template <class T>
bool near_tie(const HostStore<T>& s, std::int64_t row, std::int32_t budget, const MergeRoundParams& params) {
  const std::int32_t count = s.count[std::size_t(row)];
  if (count < 0) return false;
  const std::int32_t merges = detail::merge_round_links(count, budget, params);
  if (merges == 0) return false;
  const detail::MergeChunks chunks = detail::MergeChunks::of(count, params);
  const auto key = [&](std::int32_t p) {
    const std::size_t slot = std::size_t(s.order[std::size_t(row) * s.capacity + p]);
    const T* x = s.k.data() + (std::size_t(row) * s.capacity + slot) * s.head_dim;
    std::vector<double> out(std::size_t(s.head_dim));
    for (std::int32_t d = 0; d < s.head_dim; ++d) out[std::size_t(d)] = to_float(x[d]);
    return out;
  };
  const auto cosine = [](const std::vector<double>& a, const std::vector<double>& b) {
    double dot = 0, na = 0, nb = 0;
    for (std::size_t d = 0; d < a.size(); ++d) dot += a[d] * b[d], na += a[d] * a[d], nb += b[d] * b[d];
    return na > 0 && nb > 0 ? dot / std::sqrt(na * nb) : 0.0;
  };
  std::vector<double> best;
  for (std::int32_t j = 0; j < chunks.chunks(); ++j) {
    const std::int32_t first = chunks.chunk_begin(j), size = chunks.chunk_size(j);
    std::vector<std::vector<double>> bs;
    for (std::int32_t p = first; p < first + size; p += 2) bs.push_back(key(p));
    for (std::int32_t p = first + 1; p < first + size; p += 2) {
      const std::vector<double> a = key(p);
      double top = -2, second = -2;
      for (const auto& b : bs) {
        const double c = cosine(a, b);
        if (c > top) second = top, top = c;
        else second = std::max(second, c);
      }
      if (top - second < kTieEpsilon) return true;
      best.push_back(top);
    }
  }
  std::sort(best.rbegin(), best.rend());
  return merges < std::int32_t(best.size()) && best[std::size_t(merges - 1)] - best[std::size_t(merges)] < kTieEpsilon;
}

class CudaMergeStore : public test::GpuTest {};

/// Prefill schedules (rounds until every row meets its budget) and then a decode-time round after appends, on
/// rows of different lengths in slots out of order (one slot unused), each round from the same state on both.
template <class T>
void check_rounds(Random& rng) {
  SCOPED_TRACE((std::is_same_v<T, float> ? "fp32" : std::is_same_v<T, half> ? "fp16" : "bf16"));
  constexpr std::int32_t kSlots = 4, kKvHeads = 2, kHeadDim = 128, kTokens = 1400;
  const std::vector<std::int32_t> slots{2, 0, 3};
  CacheProblem<T> cache(rng, kKvHeads, kTokens, kHeadDim, {1300, 1000, 517});
  const std::int32_t batch = cache.batch, capacity = kTokens;
  HostStore<T> host(kSlots, kKvHeads, capacity, kHeadDim);
  DeviceStore<T> device(host);
  DeviceBuffer<std::int32_t> d_slots(slots);
  std::vector<std::int32_t> budgets(kSlots, 0);
  for (std::int32_t b = 0; b < batch; ++b) budgets[std::size_t(slots[std::size_t(b)])] = cache.lens[std::size_t(b)] / 4;
  DeviceBuffer<std::int32_t> d_budgets(budgets);

  cpu::merge_store_load(cache.host(), slots.data(), host.view());
  cuda::merge_store_load(cache.device(), d_slots.data(), device.view(), nullptr);
  {
    const HostStore<T> got = device.download();
    EXPECT_EQ(got.count, host.count);
    EXPECT_EQ(got.order, host.order);
    EXPECT_TRUE(test::same_bytes(got.k, host.k) && test::same_bytes(got.v, host.v)) << "load";
  }

  DeviceBuffer<std::byte> workspace(cuda::merge_round_workspace_bytes(batch, kKvHeads, capacity));
  cpu::Array<std::byte> host_workspace(cpu::merge_round_workspace_bytes(batch, kKvHeads, capacity));
  std::int32_t checked = 0, skipped = 0;
  const auto round = [&](const MergeRoundParams& params, const std::string& what) {
    std::vector<bool> tie(host.count.size(), false);
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t h = 0; h < kKvHeads; ++h) {
        const std::int64_t row = std::int64_t(slots[std::size_t(b)]) * kKvHeads + h;
        tie[std::size_t(row)] = near_tie(host, row, budgets[std::size_t(slots[std::size_t(b)])], params);
      }
    }
    device.upload(host);
    workspace.poison();
    cuda::merge_round(device.view(), d_slots.data(), batch, d_budgets.data(), params,
                      {workspace.data(), workspace.size()}, nullptr);
    cpu::merge_round(host.view(), slots.data(), batch, budgets.data(), params, host_workspace.bytes());
    const HostStore<T> got = device.download();
    for (std::int64_t row = 0; row < std::int64_t(host.count.size()); ++row) {
      if (tie[std::size_t(row)]) {
        ++skipped;
        continue;
      }
      ++checked;
      expect_same_row(host, got, row, what);
    }
  };
  for (std::int32_t j = 0; j < 12; ++j) {
    const MergeRoundParams params{.ratio = std::max(0.8f - 0.2f * float(j), 0.2f), .trigger = 1};
    round(params, "prefill round " + std::to_string(j));
    bool done = true;
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t h = 0; h < kKvHeads; ++h) {
        const std::int32_t slot = slots[std::size_t(b)];
        done &= host.count[std::size_t(slot * kKvHeads + h)] <= budgets[std::size_t(slot)];
      }
    }
    if (done) break;
  }
  // Decode: batch rows 0 and 2 take 70 tokens, row 1 takes 10, so that the round at trigger 64 merges only rows 0
  // and 2 (the others must come back unchanged).
  std::vector<std::int32_t> lens = cache.lens;
  for (std::int32_t step = 0; step < 70; ++step) {
    for (std::int32_t b = 0; b < batch; ++b) {
      if (b == 1 && step >= 10) continue;
      ++lens[std::size_t(b)];
      const std::size_t at = std::size_t(b) * kKvHeads * kTokens * kHeadDim;
      const auto row = ContiguousKVView<const T>::packed(cache.k.data() + at, cache.v.data() + at, 1, kKvHeads, kTokens,
                                                         kHeadDim, lens.data() + b);
      cpu::merge_store_append(KVCache<const T>(row), slots.data() + b, lens.data() + b, host.view());
    }
  }
  round(MergeRoundParams{.ratio = 0.8f, .trigger = 64}, "decode round");
  EXPECT_LE(skipped, std::max(2, (checked + skipped) / 5)) << "checked " << checked << " rows, skipped " << skipped;
}

TEST_F(CudaMergeStore, RoundsEqualTheCpusFp16) { check_rounds<half>(rng); }
TEST_F(CudaMergeStore, RoundsEqualTheCpusBf16) { check_rounds<bfloat16>(rng); }
TEST_F(CudaMergeStore, RoundsEqualTheCpusFp32) { check_rounds<float>(rng); }

/// Load, copy, append and selection against the CPU's, and the device-value rules.
/// head_dim 64 copies K/V rows in 16-byte vectors, 36 (72-byte rows in 16 bits) value by value.
template <class T>
void check_primitives(Random& rng, std::int32_t head_dim) {
  constexpr std::int32_t kKvHeads = 2, kTokens = 400;
  CacheProblem<T> cache(rng, kKvHeads, kTokens, head_dim, {380, 250, 99});
  const std::int32_t batch = cache.batch;
  // The prompt-sized store (slots = batch rows), one prefill round, then the copy into a 3-slot store.
  const std::vector<std::int32_t> identity{0, 1, 2}, slots{1, 2, 0}, budgets{95, 62, 24};
  DeviceBuffer<std::int32_t> d_identity(identity), d_slots(slots), d_budgets(budgets);
  HostStore<T> temp(batch, kKvHeads, kTokens, head_dim);
  DeviceStore<T> d_temp(temp);
  cpu::merge_store_load(cache.host(), identity.data(), temp.view());
  cuda::merge_store_load(cache.device(), d_identity.data(), d_temp.view(), nullptr);
  {
    const HostStore<T> got = d_temp.download();
    for (std::int64_t row = 0; row < std::int64_t(temp.count.size()); ++row) {
      expect_same_row(temp, got, row, "load", /*exact=*/true);
    }
  }
  cpu::Array<std::byte> ws(cpu::merge_round_workspace_bytes(batch, kKvHeads, kTokens));
  cpu::merge_round(temp.view(), identity.data(), batch, budgets.data(), MergeRoundParams{.trigger = 1}, ws.bytes());
  d_temp.upload(temp);

  constexpr std::int32_t kCapacity = 320;
  HostStore<T> host(3, kKvHeads, kCapacity, head_dim);
  DeviceStore<T> device(host);
  cpu::merge_store_copy(MergeStoreView<T>(temp.view()).as_const(), identity.data(), host.view(), slots.data(), batch);
  cuda::merge_store_copy(d_temp.view().as_const(), d_identity.data(), device.view(), d_slots.data(), batch, nullptr);
  {
    const HostStore<T> got = device.download();
    for (std::int64_t row = 0; row < std::int64_t(host.count.size()); ++row) expect_same_row(host, got, row, "copy");
  }
  // Appends: the cache's next tokens.
  std::vector<std::int32_t> lens = cache.lens;
  for (std::int32_t step = 0; step < 5; ++step) {
    for (auto& l : lens) ++l;
    cache.d_lens.upload(lens);
    const auto host_cache = ContiguousKVView<const T>::packed(cache.k.data(), cache.v.data(), batch, kKvHeads, kTokens,
                                                              head_dim, lens.data());
    cpu::merge_store_append(KVCache<const T>(host_cache), slots.data(), lens.data(), host.view());
    cuda::merge_store_append(cache.device(), d_slots.data(), cache.d_lens.data(), device.view(), nullptr);
  }
  const HostStore<T> got = device.download();
  for (std::int64_t row = 0; row < std::int64_t(host.count.size()); ++row) {
    expect_same_row(host, got, row, "append");
    const std::size_t at = std::size_t(row) * kCapacity;
    EXPECT_TRUE(std::equal(host.order.begin() + std::ptrdiff_t(at), host.order.begin() + std::ptrdiff_t(at + kCapacity),
                           got.order.begin() + std::ptrdiff_t(at)));
  }
  // Selection: the CPU's rows, bit for bit; a bad slot gives count -1.
  const std::vector<std::int32_t> select_slots{0, 2, 1, 7};
  DeviceBuffer<std::int32_t> d_select_slots(select_slots), d_indices(4 * kKvHeads * kCapacity),
      d_counts(4 * kKvHeads);
  DeviceBuffer<float> d_weights(d_indices.size());
  d_indices.poison(), d_counts.poison(), d_weights.poison();
  const SelectionView d_out{d_indices.data(), d_counts.data(), d_weights.data(), 4, kKvHeads, kCapacity};
  cuda::merge_store_selection(device.view().as_const(), d_select_slots.data(), d_out, nullptr);
  std::vector<std::int32_t> indices(d_indices.size(), test::kPoisonIndex), counts(d_counts.size(), test::kPoisonIndex);
  std::vector<float> weights(d_weights.size(), test::kPoison);
  cpu::merge_store_selection(host.view().as_const(), select_slots.data(),
                             SelectionView{indices.data(), counts.data(), weights.data(), 3, kKvHeads, kCapacity});
  const auto got_indices = d_indices.download(), got_counts = d_counts.download();
  const auto got_weights = d_weights.download();
  for (std::int32_t r = 0; r < 3 * kKvHeads; ++r) {
    ASSERT_EQ(got_counts[std::size_t(r)], counts[std::size_t(r)]) << "selection row " << r;
    for (std::int32_t i = 0; i < counts[std::size_t(r)]; ++i) {
      const std::size_t at = std::size_t(r) * kCapacity + i;
      EXPECT_EQ(got_indices[at], indices[at]) << "selection row " << r;
      EXPECT_EQ(got_weights[at], weights[at]) << "selection row " << r;
    }
  }
  for (std::int32_t h = 0; h < kKvHeads; ++h) EXPECT_EQ(got_counts[std::size_t(3 * kKvHeads + h)], -1) << "bad slot";
}

TEST_F(CudaMergeStore, LoadCopyAppendSelectionEqualTheCpusBf16) { check_primitives<bfloat16>(rng, 64); }
TEST_F(CudaMergeStore, LoadCopyAppendSelectionEqualTheCpusFp16) { check_primitives<half>(rng, 64); }
TEST_F(CudaMergeStore, LoadCopyAppendSelectionEqualTheCpusUnvectorizedRows) { check_primitives<bfloat16>(rng, 36); }

/// What the CPU refuses marks the row: count -1, which a round leaves alone, an append keeps and a selection
/// reports.
TEST_F(CudaMergeStore, BadDeviceValuesMarkTheRow) {
  constexpr std::int32_t kKvHeads = 2, kHeadDim = 32, kTokens = 300, kCapacity = 200;
  CacheProblem<bfloat16> cache(rng, kKvHeads, kTokens, kHeadDim, {150, 260});  // row 1 is longer than the store
  const std::vector<std::int32_t> slots{0, 1}, budgets{37, 37};
  DeviceBuffer<std::int32_t> d_slots(slots), d_budgets(budgets);
  HostStore<bfloat16> host(2, kKvHeads, kCapacity, kHeadDim);
  DeviceStore<bfloat16> device(host);
  cuda::merge_store_load(cache.device(), d_slots.data(), device.view(), nullptr);
  EXPECT_EQ(device.count.download(), (std::vector<std::int32_t>{150, 150, -1, -1})) << "load past the capacity";

  DeviceBuffer<std::byte> workspace(cuda::merge_round_workspace_bytes(2, kKvHeads, kCapacity));
  workspace.poison();
  cuda::merge_round(device.view(), d_slots.data(), 2, d_budgets.data(), MergeRoundParams{.trigger = 1},
                    {workspace.data(), workspace.size()}, nullptr);
  const auto after_round = device.count.download();
  EXPECT_LT(after_round[0], 150);
  EXPECT_EQ(after_round[2], -1);
  EXPECT_EQ(after_round[3], -1);

  // A full row: count = capacity; the append marks it, a -1 row stays -1, a length past the cache marks it.
  std::vector<std::int32_t> counts = after_round;
  counts[1] = kCapacity;
  device.count.upload(counts);
  std::vector<std::int32_t> lens{151, 260};
  cache.d_lens.upload(lens);
  cuda::merge_store_append(cache.device(), d_slots.data(), cache.d_lens.data(), device.view(), nullptr);
  const auto after_append = device.count.download();
  EXPECT_EQ(after_append[0], counts[0] + 1);
  EXPECT_EQ(after_append[1], -1) << "a full row";
  EXPECT_EQ(after_append[2], -1);
  EXPECT_EQ(after_append[3], -1);
  const std::vector<std::int32_t> past{152, 1};  // 152 > seq_len 151
  DeviceBuffer<std::int32_t> d_past(past);
  cuda::merge_store_append(cache.device(), d_slots.data(), d_past.data(), device.view(), nullptr);
  EXPECT_EQ(device.count.download()[0], -1) << "a length past the cache";

  // Copy: a src count above dst's capacity marks dst's row; selection reports -1 rows.
  HostStore<bfloat16> small_host(2, kKvHeads, 100, kHeadDim);
  DeviceStore<bfloat16> small(small_host);
  device.count.upload(std::vector<std::int32_t>{150, 60, 0, -1});
  cuda::merge_store_copy(device.view().as_const(), d_slots.data(), small.view(), d_slots.data(), 2, nullptr);
  EXPECT_EQ(small.count.download(), (std::vector<std::int32_t>{-1, 60, 0, -1}));
  DeviceBuffer<std::int32_t> d_indices(2 * kKvHeads * 100), d_counts(2 * kKvHeads);
  DeviceBuffer<float> d_weights(d_indices.size());
  d_counts.poison();
  cuda::merge_store_selection(small.view().as_const(), d_slots.data(),
                              SelectionView{d_indices.data(), d_counts.data(), d_weights.data(), 2, kKvHeads, 100},
                              nullptr);
  EXPECT_EQ(d_counts.download(), (std::vector<std::int32_t>{-1, 60, 0, -1}));
}

/// The eviction against the CPU's, bit for bit: rows longer than a warp (84 entries move in three groups of 32), a
/// row with no sinks, rows it leaves alone (below the budget, sinks -1), twice (the second time slot 2's row is
/// below its budget); a row of count -1 or above the capacity is untouched.
TEST_F(CudaMergeStore, EvictEqualsTheCpus) {
  constexpr std::int32_t kSlots = 4, kKvHeads = 2, kCapacity = 100, kHeadDim = 16;
  HostStore<bfloat16> host(kSlots, kKvHeads, kCapacity, kHeadDim);
  host.k = test::to_storage<bfloat16>(rng.normal(host.k.size()));
  host.v = test::to_storage<bfloat16>(rng.normal(host.v.size()));
  const std::vector<std::int32_t> counts{70, 40, 90, 3};  // per slot
  for (std::int32_t row = 0; row < kSlots * kKvHeads; ++row) {
    std::int32_t* order = &host.order[std::size_t(row) * kCapacity];
    std::iota(order, order + kCapacity, 0);
    std::shuffle(order, order + kCapacity, rng.engine);
    host.count[std::size_t(row)] = counts[std::size_t(row / kKvHeads)];
    for (std::int32_t i = 0; i < kCapacity; ++i) {
      const std::int32_t degree = rng.uniform_int(1, 5);
      host.degree[std::size_t(row) * kCapacity + i] = degree;
      host.log_degree[std::size_t(row) * kCapacity + i] = std::log(float(degree));
    }
  }
  const std::vector<std::int32_t> slots{2, 0, 3, 1}, budgets{64, 41, 90, 3}, sinks{0, 2, 5, -1};
  DeviceStore<bfloat16> device(host);
  DeviceBuffer<std::int32_t> d_slots(slots), d_budgets(budgets), d_sinks(sinks);
  const auto expect_same = [](const HostStore<bfloat16>& want, const HostStore<bfloat16>& got) {
    EXPECT_TRUE(test::same_bytes(got.count, want.count));
    EXPECT_TRUE(test::same_bytes(got.order, want.order));
    EXPECT_TRUE(test::same_bytes(got.degree, want.degree));
    EXPECT_TRUE(test::same_bytes(got.log_degree, want.log_degree));
    EXPECT_TRUE(test::same_bytes(got.k, want.k) && test::same_bytes(got.v, want.v));
  };
  for (std::int32_t pass = 0; pass < 2; ++pass) {
    cpu::merge_store_evict(host.view(), slots.data(), 4, budgets.data(), sinks.data());
    cuda::merge_store_evict(device.view(), d_slots.data(), 4, d_budgets.data(), d_sinks.data(), nullptr);
    expect_same(host, device.download());
  }
  EXPECT_EQ(host.count, (std::vector<std::int32_t>{68, 68, 40, 40, 89, 89, 3, 3}));
  std::vector<std::int32_t> bad = host.count;
  bad[0] = -1, bad[1] = kCapacity + 1;
  device.count.upload(bad);
  const HostStore<bfloat16> before = device.download();
  cuda::merge_store_evict(device.view(), d_slots.data(), 4, d_budgets.data(), d_sinks.data(), nullptr);
  expect_same(before, device.download());
}

/// Host refusals, before any device call (they run without a GPU).
TEST(CudaMergeStoreBadInput, RefusedBeforeAnyDeviceCall) {
  auto* fake = reinterpret_cast<std::int32_t*>(std::uintptr_t(256));
  auto* fake_f = reinterpret_cast<float*>(std::uintptr_t(256));
  auto* fake_t = reinterpret_cast<bfloat16*>(std::uintptr_t(256));
  const MergeStoreView<bfloat16> store{fake_t, fake_t, fake, fake, fake_f, fake, 2, 2, 300, 128};
  const std::size_t bytes = cuda::merge_round_workspace_bytes(2, 2, 300);
  const std::span<std::byte> workspace(reinterpret_cast<std::byte*>(std::uintptr_t(256)), bytes);
  const auto round = [&](const MergeStoreView<bfloat16>& s, MergeRoundParams params, std::span<std::byte> w) {
    cuda::merge_round(s, fake, 2, fake, params, w, nullptr);
  };
  test::expect_error([&] { round(store, {.chunk = 512}, workspace); }, {"cuda::merge_round", "params.chunk (= 512)"});
  test::expect_error([&] { round(store, {.ratio = 1.5f}, workspace); }, {"cuda::merge_round", "params.ratio"});
  test::expect_error([&] { round(store, {.trigger = 0}, workspace); }, {"cuda::merge_round", "params.trigger"});
  test::expect_error([&] { round(store, {}, workspace.first(bytes - 256)); }, "workspace too small");
  auto no_order = store;
  no_order.order = nullptr;
  test::expect_error([&] { round(no_order, {}, workspace); }, {"cuda::merge_round", "must be non-null"});
  auto wide = store;
  wide.head_dim = 512;
  test::expect_error([&] { round(wide, {}, workspace); }, {"cuda::merge_round", "head_dim (= 512)"});
  test::expect_error([&] { cuda::merge_round(store, fake, 2, nullptr, {}, workspace, nullptr); },
                     "budgets must be non-null");
  test::expect_error([&] { cuda::merge_round_workspace_bytes(0, 2, 300); }, "batch (= 0)");
  test::expect_error(
      [&] {
        cuda::merge_store_selection(store.as_const(), fake, SelectionView{fake, fake, nullptr, 2, 2, 300}, nullptr);
      },
      "out.log_weights must be non-null");
  test::expect_error(
      [&] {
        cuda::merge_store_selection(store.as_const(), fake, SelectionView{fake, fake, fake_f, 2, 2, 299}, nullptr);
      },
      "capacity >= the store's");
  HostStore<bfloat16> other(2, 1, 300, 128);
  auto other_view = other.view();
  test::expect_error([&] { cuda::merge_store_copy(store.as_const(), fake, other_view, fake, 2, nullptr); },
                     "src kv_heads (= 2)");
  const auto cache = ContiguousKVView<const bfloat16>::packed(fake_t, fake_t, 2, 1, 300, 128, fake);
  test::expect_error([&] { cuda::merge_store_load(KVCache<const bfloat16>(cache), fake, store, nullptr); },
                     "cache kv_heads (= 1)");
  test::expect_error([&] { cuda::merge_store_append(KVCache<const bfloat16>(cache), fake, fake, store, nullptr); },
                     "cache kv_heads (= 1)");
  test::expect_error([&] { cuda::merge_store_evict(store, fake, 2, fake, nullptr, nullptr); },
                     "cuda::merge_store_evict: budgets and sinks must be non-null");
}

// ---- CentroidKV through DecodeStep ------------------------------------------------------------------------------

using CpuCentroidKV = CentroidKV<bfloat16, cpu::Context>;
using CudaCentroidKV = CentroidKV<bfloat16, cuda::Context>;

/// The kernels' bounds are refused at construction (before any allocation), not at the first prepare or append.
TEST(CudaCentroidKVBadInput, KernelBoundsRefusedAtConstruction) {
  const SelectorLimits limits{.max_slots = 2, .max_tokens = 1000, .q_heads = 8, .kv_heads = 2, .head_dim = 128};
  test::expect_error([&] { (void)CudaCentroidKV(limits, {.chunk = 512}, cuda::Context{}); },
                     "CentroidKV: config.chunk (= 512) exceeds 256 (the CUDA matching kernel's bound)");
  SelectorLimits wide = limits;
  wide.head_dim = 512;
  test::expect_error([&] { (void)CudaCentroidKV(wide, {}, cuda::Context{}); },
                     "CentroidKV: limits.head_dim (= 512) exceeds 256");
}

class CudaCentroidKVStep : public test::GpuTest {};

/// prepare + `steps` decode steps on the CPU, on the GPU eagerly and on the GPU through one captured step replayed:
/// the GPU's stores (after prepare, steps 63, 64 and the last) and outputs equal the CPU's within rounding (the same
/// merges; bit for bit where `exact_stores`), the replay's equal the eager run's bit for bit.
void expect_steps_equal_the_cpus(Random& rng, const CentroidKVConfig& ckv, const std::vector<std::int32_t>& prompts,
                                 std::int32_t steps, bool exact_stores) {
  constexpr std::int32_t kBatch = 2, kQHeads = 8, kKvHeads = 2, kHeadDim = 128, kTokens = 1200;
  const std::vector<std::int32_t> slots{1, 0};
  const SelectorLimits limits{.max_slots = 2, .max_tokens = kTokens, .q_heads = kQHeads, .kv_heads = kKvHeads,
                              .head_dim = kHeadDim};
  const DecodeStepConfig config{.max_batch = kBatch, .q_heads = kQHeads, .kv_heads = kKvHeads, .head_dim = kHeadDim,
                                .max_seq_len = kTokens};
  std::vector<bfloat16> k = test::to_storage<bfloat16>(rng.normal(std::size_t(kBatch) * kKvHeads * kTokens * kHeadDim));
  std::vector<bfloat16> v = test::to_storage<bfloat16>(rng.normal(k.size()));
  std::vector<std::int32_t> lens = prompts;
  DeviceBuffer<bfloat16> dk(k), dv(v);
  DeviceBuffer<std::int32_t> d_lens(lens), d_lens_graph(lens), d_slots(slots);
  const test::Stream stream;
  const cuda::Context ctx{stream};
  const auto host_cache = [&] {
    return ContiguousKVView<bfloat16>::packed(k.data(), v.data(), kBatch, kKvHeads, kTokens, kHeadDim, lens.data());
  };
  const auto device_cache = [&](const DeviceBuffer<std::int32_t>& l) {
    return ContiguousKVView<bfloat16>::packed(dk.data(), dv.data(), kBatch, kKvHeads, kTokens, kHeadDim, l.data());
  };
  DecodeStep cpu(CpuCentroidKV(limits, ckv, {}), config, {});
  DecodeStep gpu(CudaCentroidKV(limits, ckv, ctx), config, ctx);
  DecodeStep replayed(CudaCentroidKV(limits, ckv, ctx), config, ctx);
  const KVCache<const bfloat16> host_prefill =
      ContiguousKVView<const bfloat16>::packed(k.data(), v.data(), kBatch, kKvHeads, kTokens, kHeadDim, lens.data());
  cpu.prepare({.cache = host_prefill, .slots = slots.data()}, {});
  const KVCache<const bfloat16> device_prefill = ContiguousKVView<const bfloat16>::packed(
      dk.data(), dv.data(), kBatch, kKvHeads, kTokens, kHeadDim, d_lens.data());
  gpu.prepare({.cache = device_prefill, .slots = d_slots.data()}, ctx);
  replayed.prepare({.cache = device_prefill, .slots = d_slots.data()}, ctx);
  // As check_rounds: a round whose merges hinge on a near tie may merge differently on the two backends, and the
  // stores (and outputs) differ from then on. Replay the prefill's rounds on the host to find one; from the first
  // near tie (prefill or decode-time round) on, only the graph replay is compared with the eager GPU step.
  bool diverged = false;
  {
    HostStore<bfloat16> pre(kBatch, kKvHeads, kTokens, kHeadDim);
    const std::vector<std::int32_t> rows{0, 1};
    cpu::merge_store_load(host_prefill, rows.data(), pre.view());
    cpu::Array<std::byte> pre_workspace(cpu::merge_round_workspace_bytes(1, kKvHeads, kTokens));
    // Each prompt's own schedule, one prompt at a time, as the selector runs them.
    for (std::int32_t b = 0; b < kBatch && !diverged; ++b) {
      if (detail::centroid_kv_window("test", ckv, prompts[std::size_t(b)]) >= 0) continue;  // no round
      const std::int32_t budget = detail::centroid_kv_budget(ckv, prompts[std::size_t(b)]);
      for (const MergeRoundParams& params : detail::centroid_kv_prefill_schedule("test", ckv, prompts[std::size_t(b)])) {
        for (std::int32_t h = 0; h < kKvHeads; ++h) diverged |= near_tie(pre, std::int64_t(b) * kKvHeads + h, budget, params);
        if (diverged) break;
        cpu::merge_round(pre.view(), rows.data() + b, 1, &budget, params, pre_workspace.bytes());
      }
    }
  }

  const auto compare_stores = [&](const std::string& what) {
    const MergeStoreView<const bfloat16> want = cpu.selector().store();
    const MergeStoreView<const bfloat16> got_view = gpu.selector().store(), graph_view = replayed.selector().store();
    HostStore<bfloat16> a(want.slots, kKvHeads, want.capacity, kHeadDim), b = a, c = a;
    const auto fetch = [&](HostStore<bfloat16>& h, const MergeStoreView<const bfloat16>& s, cudaMemcpyKind kind) {
      KVSIFT_CUDA_CHECK(cudaMemcpy(h.k.data(), s.k, h.k.size() * sizeof(bfloat16), kind));
      KVSIFT_CUDA_CHECK(cudaMemcpy(h.v.data(), s.v, h.v.size() * sizeof(bfloat16), kind));
      KVSIFT_CUDA_CHECK(cudaMemcpy(h.order.data(), s.order, h.order.size() * 4, kind));
      KVSIFT_CUDA_CHECK(cudaMemcpy(h.degree.data(), s.degree, h.degree.size() * 4, kind));
      KVSIFT_CUDA_CHECK(cudaMemcpy(h.log_degree.data(), s.log_degree, h.log_degree.size() * 4, kind));
      KVSIFT_CUDA_CHECK(cudaMemcpy(h.count.data(), s.count, h.count.size() * 4, kind));
    };
    fetch(a, want, cudaMemcpyHostToHost);
    fetch(b, got_view, cudaMemcpyDeviceToHost);
    fetch(c, graph_view, cudaMemcpyDeviceToHost);
    for (std::int64_t row = 0; row < std::int64_t(a.count.size()); ++row) {
      if (!diverged) expect_same_row(a, b, row, what + " (eager)", exact_stores);
      expect_same_row(b, c, row, what + " (graph)", true);
    }
  };
  // Whether the next decode-time round (on the CPU store as it is now) hinges on a near tie.
  const auto decode_tie = [&] {
    const MergeStoreView<const bfloat16> want = cpu.selector().store();
    HostStore<bfloat16> now(want.slots, kKvHeads, want.capacity, kHeadDim);
    std::copy_n(want.k, now.k.size(), now.k.data());
    std::copy_n(want.order, now.order.size(), now.order.data());
    std::copy_n(want.count, now.count.size(), now.count.data());
    bool tie = false;
    for (std::int64_t row = 0; row < std::int64_t(now.count.size()); ++row) {
      tie |= near_tie(now, row, cpu.selector().budgets()[row / kKvHeads], detail::centroid_kv_decode_params(ckv));
    }
    return tie;
  };
  compare_stores("after prepare");

  DeviceBuffer<std::byte> workspace(gpu.workspace_bytes()), graph_workspace(replayed.workspace_bytes());
  cpu::Array<std::byte> host_workspace(cpu.workspace_bytes());
  DeviceBuffer<bfloat16> dq(std::size_t(kBatch) * kQHeads * kHeadDim), o(dq.size()), o_graph(dq.size());
  DeviceBuffer<float> lse(std::size_t(kBatch) * kQHeads), lse_graph(lse.size());
  std::vector<bfloat16> host_o(dq.size());
  std::vector<float> host_lse(lse.size());
  const auto run_gpu = [&](DecodeStep<CudaCentroidKV>& step, const DeviceBuffer<std::int32_t>& l,
                           DeviceBuffer<std::byte>& w, DeviceBuffer<bfloat16>& out, DeviceBuffer<float>& out_lse) {
    step.run({.q = QueryView<const bfloat16>::packed(dq.data(), kBatch, kQHeads, kHeadDim), .cache = device_cache(l),
              .slots = d_slots.data()},
             StateView<bfloat16>::packed(out.data(), out_lse.data(), kBatch, kQHeads, kHeadDim), {w.data(), w.size()},
             ctx);
  };
  const test::CapturedGraph graph(stream, [&] { run_gpu(replayed, d_lens_graph, graph_workspace, o_graph, lse_graph); },
                                  cudaStreamCaptureModeGlobal);
  for (std::int32_t s = 0; s < steps; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    diverged |= decode_tie();
    for (auto& l : lens) ++l;  // the engine wrote the step's token
    d_lens.upload(lens);
    d_lens_graph.upload(lens);
    const std::vector<float> q = rng.normal(dq.size());
    const std::vector<bfloat16> q16 = test::to_storage<bfloat16>(q);
    dq.upload(q16);
    o.poison(), lse.poison(), o_graph.poison(), lse_graph.poison(), workspace.poison(), graph_workspace.poison();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    run_gpu(gpu, d_lens, workspace, o, lse);
    graph.launch();
    cpu.run({.q = QueryView<const bfloat16>::packed(q16.data(), kBatch, kQHeads, kHeadDim), .cache = host_cache(),
             .slots = slots.data()},
            StateView<bfloat16>::packed(host_o.data(), host_lse.data(), kBatch, kQHeads, kHeadDim),
            host_workspace.bytes(), {});
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<bfloat16> got_o = o.download();
    const std::vector<float> got_lse = lse.download();
    ASSERT_TRUE(test::same_bytes(got_o, o_graph.download()) && test::same_bytes(got_lse, lse_graph.download()))
        << "the replay differs from the eager step";
    for (std::size_t i = 0; i < got_o.size() && !diverged; ++i) {
      ASSERT_NEAR(to_float(got_o[i]), to_float(host_o[i]), 2e-2) << "O " << i;
    }
    for (std::size_t i = 0; i < got_lse.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got_lse[i]));
      if (!diverged) {
        ASSERT_NEAR(got_lse[i], host_lse[i], 1e-3 * std::max(1.0f, std::abs(host_lse[i]))) << "LSE " << i;
      }
    }
    if (s == 63 || s == 64 || s == steps - 1) compare_stores("after step " + std::to_string(s));
  }
}

/// 130 steps: decode-time rounds at the 64th and 128th.
TEST_F(CudaCentroidKVStep, PrepareAndDecodeStepsEqualTheCpusAndTheGraphReplaysEqualEager) {
  SCOPED_TRACE(seed);
  expect_steps_equal_the_cpus(rng, {}, {1000, 700}, 130, false);
}

/// The window fallback (issue 40): budgets below the minimum (B = 75: 15 sinks and 60 recent; B = 5: 1 and 4), no
/// merge, so the stores equal the CPU's bit for bit through 70 steps, each evicting on the device (in the graph too).
TEST_F(CudaCentroidKVStep, WindowFallbackEqualsTheCpus) {
  SCOPED_TRACE(seed);
  expect_steps_equal_the_cpus(rng, {.below_minimum = CentroidKVBelowMinimum::window}, {300, 22}, 70, true);
}

}  // namespace
}  // namespace kvsift
