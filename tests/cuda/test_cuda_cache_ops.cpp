// The decode step's cache operations on CUDA against their CPU twins: lengths, the step token's write (at
// seq_len - 1 of each row, nothing else touched; a row of length 0 is skipped, as documented), contiguous and
// paged, fp16 and bf16; the empty selection; the first non-finite key (fp16, bf16 and fp32, each load width:
// random shapes, offsets of the base pointer, rows of length 0, several planted offenders, NaN everywhere the
// lengths leave out; 128K-token rows, contiguous and paged; a graph replay) and its refusals.
#include <gtest/gtest.h>

#include <array>
#include <bit>
#include <cstdio>
#include <limits>
#include <optional>
#include <set>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "nonfinite_values.hpp"
#include "kvsift/cpu/cache_ops.hpp"
#include "kvsift/cuda/cache_ops.hpp"

namespace kvsift::test {
namespace {

template <class T>
class CudaCacheOps : public GpuTest {};
using StorageTypes = testing::Types<bfloat16, half>;
TYPED_TEST_SUITE(CudaCacheOps, StorageTypes);

TYPED_TEST(CudaCacheOps, EqualTheCpuTwins) {
  using T = TypeParam;
  for (const std::int32_t page_size : {0, 8}) {
    const CaseSpec spec{.batch = 4, .q_heads = 4, .kv_heads = 2, .head_dim = 64, .tokens = 50, .k = 0,
                        .page_size = page_size, .log_weights = false};
    SCOPED_TRACE(describe(spec) + fmt::format(" seed {}", this->seed));
    HostDecodeProblem<T> p(this->rng, spec);
    std::vector<T> host_k = page_size == 0 ? p.k : p.k_pages, host_v = page_size == 0 ? p.v : p.v_pages;
    DeviceBuffer<T> d_k(host_k), d_v(host_v);
    DeviceBuffer<std::int32_t> d_lens(p.kv_values.seq_lens);
    std::unique_ptr<DeviceBuffer<std::int32_t>> indptr, pages, last;
    const auto cache_of = [&](T* k, T* v, const std::int32_t* lens, const std::int32_t* ip, const std::int32_t* pg,
                              const std::int32_t* ll) {
      if (page_size == 0) {
        return KVCache<T>(ContiguousKVView<T>::packed(k, v, spec.batch, spec.kv_heads, spec.tokens, spec.head_dim, lens));
      }
      const auto h = p.paged(k, v, ip, pg, ll);
      return KVCache<T>(PagedKVView<T>{k, v, ip, pg, ll, h.batch, h.kv_heads, h.head_dim, h.page_size, h.num_pages,
                                       h.page_stride, h.token_stride, h.head_stride});
    };
    KVCache<T> host_cache = cache_of(host_k.data(), host_v.data(), p.kv_values.seq_lens.data(),
                                     page_size ? p.paged_values->indptr.data() : nullptr,
                                     page_size ? p.paged_values->indices.data() : nullptr,
                                     page_size ? p.paged_values->last_len.data() : nullptr);
    if (page_size > 0) {
      indptr = std::make_unique<DeviceBuffer<std::int32_t>>(p.paged_values->indptr);
      pages = std::make_unique<DeviceBuffer<std::int32_t>>(p.paged_values->indices);
      last = std::make_unique<DeviceBuffer<std::int32_t>>(p.paged_values->last_len);
    }
    const KVCache<T> device_cache = cache_of(d_k.data(), d_v.data(), d_lens.data(), indptr ? indptr->data() : nullptr,
                                             pages ? pages->data() : nullptr, last ? last->data() : nullptr);
    DeviceBuffer<std::int32_t> d_lengths(std::size_t(spec.batch));
    d_lengths.poison();
    cuda::sequence_lengths(KVCache<const T>(device_cache), d_lengths.data(), nullptr);
    std::vector<std::int32_t> want(std::size_t(spec.batch));
    cpu::sequence_lengths(KVCache<const T>(host_cache), want.data());
    EXPECT_EQ(d_lengths.download(), want);

    const auto new_k = to_storage<T>(this->rng.normal(std::size_t(spec.batch) * spec.kv_heads * spec.head_dim));
    const auto new_v = to_storage<T>(this->rng.normal(new_k.size()));
    const DeviceBuffer<T> d_new_k(new_k), d_new_v(new_v);
    cuda::write_step_kv(device_cache, HeadsView<const T>::packed(d_new_k.data(), spec.batch, spec.kv_heads, spec.head_dim),
                        HeadsView<const T>::packed(d_new_v.data(), spec.batch, spec.kv_heads, spec.head_dim), nullptr);
    cpu::write_step_kv(host_cache, HeadsView<const T>::packed(new_k.data(), spec.batch, spec.kv_heads, spec.head_dim),
                       HeadsView<const T>::packed(new_v.data(), spec.batch, spec.kv_heads, spec.head_dim));
    const auto got_k = d_k.download(), got_v = d_v.download();
    ASSERT_EQ(0, std::memcmp(got_k.data(), host_k.data(), got_k.size() * sizeof(T)));  // every byte, pages included
    ASSERT_EQ(0, std::memcmp(got_v.data(), host_v.data(), got_v.size() * sizeof(T)));
  }
  // clear_counts: every count 0, nothing else written.
  DeviceBuffer<std::int32_t> counts(6), indices(24);
  counts.poison();
  indices.poison();
  cuda::clear_counts(SelectionView{indices.data(), counts.data(), nullptr, 3, 2, 4}, nullptr);
  EXPECT_EQ(counts.download(), std::vector<std::int32_t>(6, 0));
  EXPECT_EQ(indices.download(), std::vector<std::int32_t>(24, -1));
  // Past 1024 blocks of rows (the grid strides); an empty selection writes nothing; bad views are refused.
  DeviceBuffer<std::int32_t> many(1024 * 256 * 2 + 7);
  many.poison();
  cuda::clear_counts(SelectionView{nullptr, many.data(), nullptr, std::int32_t(many.size()), 1, 1}, nullptr);
  EXPECT_EQ(many.download(), std::vector<std::int32_t>(many.size(), 0));
  cuda::clear_counts(SelectionView{nullptr, counts.data(), nullptr, 0, 2, 4}, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  expect_error([&] { cuda::clear_counts(SelectionView{indices.data(), nullptr, nullptr, 1, 1, 4}, nullptr); },
               "cuda::clear_counts: out.counts must be non-null");
  expect_error([&] { cuda::clear_counts(SelectionView{nullptr, counts.data(), nullptr, -1, 2, 4}, nullptr); },
               "cuda::clear_counts: out's batch (= -1) and kv_heads (= 2) must not be negative");
}

// write_identity_indices: entry i of every row is i (past 1024 blocks' worth of entries, so the grid strides), the
// counts untouched; an empty selection writes nothing; a negative shape and missing indices are refused.
class CudaIdentityIndices : public GpuTest {};
TEST_F(CudaIdentityIndices, EveryRowListsItsSlotsInOrder) {
  constexpr std::int32_t kBatch = 3, kHeads = 4, kCapacity = 30000;
  DeviceBuffer<std::int32_t> counts(kBatch * kHeads), indices(std::size_t(kBatch) * kHeads * kCapacity);
  counts.poison();
  indices.poison();
  const SelectionView rows{indices.data(), counts.data(), nullptr, kBatch, kHeads, kCapacity};
  cuda::write_identity_indices(rows, nullptr);
  const std::vector<std::int32_t> got = indices.download();
  for (std::size_t e = 0; e < got.size(); ++e) ASSERT_EQ(got[e], std::int32_t(e % kCapacity)) << "entry " << e;
  EXPECT_EQ(counts.download(), std::vector<std::int32_t>(kBatch * kHeads, -1));
  cuda::write_identity_indices(SelectionView{nullptr, nullptr, nullptr, 0, kHeads, kCapacity}, nullptr);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  expect_error([&] { cuda::write_identity_indices(SelectionView{nullptr, counts.data(), nullptr, 1, 1, 4}, nullptr); },
               "cuda::write_identity_indices: out.indices must be non-null");
  expect_error([&] { cuda::write_identity_indices(SelectionView{indices.data(), nullptr, nullptr, 1, 1, -2}, nullptr); },
               "cuda::write_identity_indices: out's batch (= 1), kv_heads (= 1) and capacity (= -2) must not be negative");
}

TYPED_TEST(CudaCacheOps, ARowOfLengthZeroIsSkipped) {
  using T = TypeParam;
  std::vector<T> k(2 * 1 * 8 * 16, from_float<T>(1.0f));
  const std::vector<std::int32_t> lens{3, 0};
  DeviceBuffer<T> d_k(k), d_v(k);
  DeviceBuffer<std::int32_t> d_lens(lens);
  const std::vector<T> token = to_storage<T>(this->rng.normal(2 * 16));
  const DeviceBuffer<T> d_token(token);
  cuda::write_step_kv(KVCache<T>(ContiguousKVView<T>::packed(d_k.data(), d_v.data(), 2, 1, 8, 16, d_lens.data())),
                      HeadsView<const T>::packed(d_token.data(), 2, 1, 16), HeadsView<const T>::packed(d_token.data(), 2, 1, 16),
                      nullptr);
  std::vector<T> want = k;
  std::copy_n(token.begin(), 16, want.begin() + 2 * 16);  // row 0, position 2
  const auto got = d_k.download();
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(T)));
}

// A length its storage cannot hold (a device value the host cannot refuse) would address another row's memory:
// the row is skipped, the others written.
TYPED_TEST(CudaCacheOps, ARowLongerThanItsStorageIsSkipped) {
  using T = TypeParam;
  const std::vector<T> k(2 * 1 * 8 * 16, from_float<T>(1.0f));
  const std::vector<T> token = to_storage<T>(this->rng.normal(2 * 16));
  const DeviceBuffer<T> d_token(token);
  const HeadsView<const T> step = HeadsView<const T>::packed(d_token.data(), 2, 1, 16);
  std::vector<T> want = k;
  std::copy_n(token.begin(), 16, want.begin() + 2 * 16);  // row 0, position 2
  {  // contiguous, capacity 8: row 1's length 9
    DeviceBuffer<T> d_k(k), d_v(k);
    DeviceBuffer<std::int32_t> d_lens(std::vector<std::int32_t>{3, 9});
    cuda::write_step_kv(KVCache<T>(ContiguousKVView<T>::packed(d_k.data(), d_v.data(), 2, 1, 8, 16, d_lens.data())),
                        step, step, nullptr);
    const auto got = d_k.download();
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(T)));
  }
  {  // paged, pages of 4: row 0 in page 0 (3 tokens), row 1 in page 2, whose last page claims 5 tokens
    DeviceBuffer<T> d_k(k), d_v(k);
    DeviceBuffer<std::int32_t> d_indptr(std::vector<std::int32_t>{0, 1, 2}), d_pages(std::vector<std::int32_t>{0, 2}),
        d_last(std::vector<std::int32_t>{3, 5});
    const PagedKVView<T> paged{.k_pages = d_k.data(), .v_pages = d_v.data(), .page_indptr = d_indptr.data(),
                               .page_indices = d_pages.data(), .last_page_len = d_last.data(), .batch = 2,
                               .kv_heads = 1, .head_dim = 16, .page_size = 4, .num_pages = 4,
                               .page_stride = 4 * 16, .token_stride = 16, .head_stride = 4 * 16};
    cuda::write_step_kv(KVCache<T>(paged), step, step, nullptr);
    const auto got = d_k.download();
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(T)));  // page 0, position 2 = element 32
  }
}


// ---- first_nonfinite_key --------------------------------------------------------------------------------------

using Position = KeyPosition;
constexpr Position kNone = kNoKey;

/// A random one of the non-finite encodings (nonfinite_values.hpp).
template <class T>
T nonfinite(Random& rng) {
  const std::vector<T> values = nonfinite_values<T>();
  return values[std::size_t(rng.uniform_int(0, std::int32_t(values.size()) - 1))];
}
/// The largest finite magnitude of T, either sign.
template <class T>
T largest_finite(Random& rng) {
  return finite_extremes<T>()[std::size_t(rng.uniform_int(0, 1))];
}

/// A cache of storage type T on the host and the device: contiguous [batch, kv_heads, capacity, head_dim] whose
/// device copy starts `shift` elements into its buffer (so that the base pointer has any alignment), and the same
/// tokens in shuffled NHD or HND pages with spare pages.
template <class T>
struct KeyCache {
  HostKV kv;
  HostPagedKV paged_kv;
  std::vector<T> k, k_pages;
  std::int32_t shift;

  KeyCache(Random& rng, std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity, std::int32_t head_dim,
           std::vector<std::int32_t> lens, std::int32_t page_size, std::int32_t shift_)
      : kv(rng, batch, kv_heads, capacity, head_dim, std::move(lens)),
        paged_kv(kv, page_size, rng.uniform_int(0, 1) == 1, rng), k(to_storage<T>(kv.k)),
        k_pages(to_storage<T>(paged_kv.k_pages)), shift(shift_) {}
  std::size_t offset(std::int32_t b, std::int32_t h, std::int32_t t) const {
    return ((std::size_t(b) * kv.kv_heads + std::size_t(h)) * kv.capacity + std::size_t(t)) * kv.head_dim;
  }
  /// Key (b, h, t, i) := x in both layouts.
  void set(const Position& p, T x) {
    k[offset(p[0], p[1], p[2]) + std::size_t(p[3])] = x;
    k_pages[std::size_t(paged_kv.view.offset(p[0], p[1], p[2])) + std::size_t(p[3])] = x;
  }
  /// NaN in every element that holds no scanned key: tokens past the lengths, spare pages, last pages' tails.
  void poison_unscanned() {
    const T nan = from_float<T>(std::numeric_limits<float>::quiet_NaN());
    std::vector<bool> scanned(k_pages.size());
    for (std::int32_t b = 0; b < kv.batch; ++b) {
      for (std::int32_t h = 0; h < kv.kv_heads; ++h) {
        for (std::int32_t t = 0; t < kv.capacity; ++t) {
          if (t >= kv.seq_lens[std::size_t(b)]) {
            std::fill_n(k.begin() + offset(b, h, t), kv.head_dim, nan);
          } else {
            std::fill_n(scanned.begin() + paged_kv.view.offset(b, h, t), kv.head_dim, true);
          }
        }
      }
    }
    for (std::size_t e = 0; e < k_pages.size(); ++e) {
      if (!scanned[e]) k_pages[e] = nan;
    }
  }
  KVCache<const T> contiguous(const T* data) const {
    return ContiguousKVView<const T>::packed(data, nullptr, kv.batch, kv.kv_heads, kv.capacity, kv.head_dim);
  }
  KVCache<const T> paged(const T* pages, const std::int32_t* indptr, const std::int32_t* indices,
                         const std::int32_t* last) const {
    const auto& h = paged_kv.view;
    return PagedKVView<const T>{pages, nullptr, indptr, indices, last, h.batch, h.kv_heads, h.head_dim,
                                h.page_size, h.num_pages, h.page_stride, h.token_stride, h.head_stride};
  }
};

/// The device copies of a KeyCache.
template <class T>
struct DeviceKeyCache {
  DeviceBuffer<T> k, pages;
  DeviceBuffer<std::int32_t> lengths, indptr, indices, last;
  explicit DeviceKeyCache(const KeyCache<T>& c)
      : k(std::size_t(c.shift) + c.k.size()), pages(c.k_pages), lengths(c.kv.seq_lens), indptr(c.paged_kv.indptr),
        indices(c.paged_kv.indices), last(c.paged_kv.last_len) {
    KVSIFT_CUDA_CHECK(cudaMemcpy(k.data() + c.shift, c.k.data(), c.k.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
};

template <class T>
Position cpu_first(const KVCache<const T>& cache, const std::vector<std::int32_t>& lengths) {
  Position out{7, 7, 7, 7};
  cpu::first_nonfinite_key(cache, lengths.data(), out.data());
  return out;
}
Position cuda_first_of(const auto& cache, const std::int32_t* d_lengths, cudaStream_t stream = nullptr) {
  DeviceBuffer<std::int32_t> out(4);
  out.poison();
  cuda::first_nonfinite_key(cache, d_lengths, out.data(), stream);
  const auto host = out.download();
  return {host[0], host[1], host[2], host[3]};
}

template <class T>
class CudaFirstNonfiniteKey : public GpuTest {};
using KeyTypes = testing::Types<bfloat16, half, float>;
TYPED_TEST_SUITE(CudaFirstNonfiniteKey, KeyTypes);

/// Random shapes (head_dim and the base pointer's offset choose 16-byte, 4-byte or one-element loads), both
/// layouts, rows of length 0, up to six offenders: the CUDA answer is the CPU twin's, which is the first planted.
TYPED_TEST(CudaFirstNonfiniteKey, EqualsTheCpuTwin) {
  using T = TypeParam;
  Random& rng = this->rng;
  SCOPED_TRACE(fmt::format("seed {}", this->seed));
  std::int32_t found = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const std::int32_t batch = rng.uniform_int(1, 6), kv_heads = rng.uniform_int(1, 4), capacity = rng.uniform_int(1, 90);
    const std::int32_t head_dim = std::array{1, 2, 3, 5, 6, 8, 16, 24, 64, 100, 128, 256}[std::size_t(rng.uniform_int(0, 11))];
    const std::int32_t page_size = std::array{1, 4, 16}[std::size_t(rng.uniform_int(0, 2))];
    const std::int32_t shift = std::array{0, 0, 1, 2, 4}[std::size_t(rng.uniform_int(0, 4))];
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(batch));
    for (auto& l : lengths) l = rng.uniform_int(0, 3) == 0 ? 0 : rng.uniform_int(1, capacity);
    SCOPED_TRACE(fmt::format("trial {}: batch {} kv_heads {} capacity {} head_dim {} page_size {} shift {}", trial,
                             batch, kv_heads, capacity, head_dim, page_size, shift));
    KeyCache<T> c(rng, batch, kv_heads, capacity, head_dim, lengths, page_size, shift);
    if (rng.uniform_int(0, 1) == 1) c.poison_unscanned();
    const auto random_position = [&] { return random_key_position(rng, lengths, kv_heads, head_dim); };
    for (int e = 0; e < 3; ++e) {
      if (const auto at = random_position()) c.set(*at, largest_finite<T>(rng));
    }
    std::set<Position> planted;
    for (std::int32_t o = rng.uniform_int(0, 6); o > 0; --o) {
      if (const auto at = random_position()) {
        c.set(*at, nonfinite<T>(rng));
        planted.insert(*at);
      }
    }
    const Position want = planted.empty() ? kNone : *planted.begin();
    found += planted.empty() ? 0 : 1;
    const Position cpu_contiguous = cpu_first(c.contiguous(c.k.data()), lengths);
    ASSERT_EQ(cpu_contiguous, want);
    ASSERT_EQ(cpu_first(c.paged(c.k_pages.data(), c.paged_kv.indptr.data(), c.paged_kv.indices.data(),
                                c.paged_kv.last_len.data()),
                        lengths),
              want);
    const DeviceKeyCache<T> d(c);
    EXPECT_EQ(cuda_first_of(c.contiguous(d.k.data() + shift), d.lengths.data()), cpu_contiguous) << "contiguous";
    EXPECT_EQ(cuda_first_of(c.paged(d.pages.data(), d.indptr.data(), d.indices.data(), d.last.data()), d.lengths.data()),
              cpu_contiguous)
        << "paged";
  }
  EXPECT_GT(found, 15);
}

/// Captured into a graph, every replay rescans: a key planted between replays is found by the next one.
TYPED_TEST(CudaFirstNonfiniteKey, ReplaysFromACudaGraph) {
  using T = TypeParam;
  KeyCache<T> c(this->rng, 2, 2, 64, 64, {64, 40}, 16, 0);
  DeviceKeyCache<T> d(c);
  DeviceBuffer<std::int32_t> out(4);
  const test::Stream stream;
  const KVCache<const T> cache = c.contiguous(d.k.data());
  const CapturedGraph graph(stream, [&] { cuda::first_nonfinite_key(cache, d.lengths.data(), out.data(), stream); });
  const auto replay = [&] {
    out.poison();
    graph.launch();
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto host = out.download();
    return Position{host[0], host[1], host[2], host[3]};
  };
  EXPECT_EQ(replay(), kNone);
  c.set({1, 0, 39, 63}, from_float<T>(std::numeric_limits<float>::infinity()));
  d.k.upload(c.k);
  EXPECT_EQ(replay(), (Position{1, 0, 39, 63}));
  c.set({0, 1, 63, 0}, from_float<T>(std::numeric_limits<float>::quiet_NaN()));
  d.k.upload(c.k);
  EXPECT_EQ(replay(), (Position{0, 1, 63, 0}));
}

/// 128K-token rows (batch 2, 4 kv heads, head_dim 128: 128M keys): finite, one offender at the last scanned key,
/// several offenders, the same memory read as a paged cache (pages of 16 tokens through a page table). The CPU
/// twin gives the expected answers; the CUDA scan's bandwidth is printed.
TYPED_TEST(CudaFirstNonfiniteKey, LongRowsEqualTheCpuTwin) {
  using T = TypeParam;
  constexpr std::int32_t batch = 2, kv_heads = 4, capacity = 131072, head_dim = 128, page = 16;
  const std::vector<std::int32_t> lengths{capacity, 100000};
  const std::size_t n = std::size_t(batch) * kv_heads * capacity * head_dim;
  std::vector<T> k(n);
  {
    const auto pattern = to_storage<T>(this->rng.normal(1 << 16));
    for (std::size_t e = 0; e < n; ++e) k[e] = pattern[(e * 40503u) & 0xffffu];
  }
  const auto at = [&](std::int32_t b, std::int32_t h, std::int32_t t, std::int32_t i) -> T& {
    return k[((std::size_t(b) * kv_heads + std::size_t(h)) * capacity + std::size_t(t)) * head_dim + std::size_t(i)];
  };
  at(1, 3, 100000, 0) = from_float<T>(std::numeric_limits<float>::quiet_NaN());  // past row 1's length
  DeviceBuffer<T> d_k(k);
  DeviceBuffer<std::int32_t> d_lengths(lengths);
  // The same keys as pages: page j of row b is the j-th run of 16 tokens of (b, head 0), head h head_stride on.
  std::vector<std::int32_t> indptr{0}, indices, last;
  for (std::int32_t b = 0; b < batch; ++b) {
    const std::int32_t pages = (lengths[std::size_t(b)] + page - 1) / page;
    for (std::int32_t j = 0; j < pages; ++j) indices.push_back((b * kv_heads * capacity) / page + j);
    indptr.push_back(std::int32_t(indices.size()));
    last.push_back(lengths[std::size_t(b)] - (pages - 1) * page);
  }
  DeviceBuffer<std::int32_t> d_indptr(indptr), d_indices(indices), d_last(last);
  const auto paged_over = [&](const T* data, const std::int32_t* ip, const std::int32_t* ix, const std::int32_t* ll) {
    return KVCache<const T>(PagedKVView<const T>{.k_pages = data, .page_indptr = ip, .page_indices = ix,
                                                 .last_page_len = ll, .batch = batch, .kv_heads = kv_heads,
                                                 .head_dim = head_dim, .page_size = page,
                                                 .num_pages = batch * kv_heads * capacity / page,
                                                 .page_stride = std::int64_t(page) * head_dim, .token_stride = head_dim,
                                                 .head_stride = std::int64_t(capacity) * head_dim});
  };
  const auto host_cache = ContiguousKVView<const T>::packed(k.data(), nullptr, batch, kv_heads, capacity, head_dim);
  const auto device_cache = ContiguousKVView<const T>::packed(d_k.data(), nullptr, batch, kv_heads, capacity, head_dim);
  const auto check = [&](const Position& want, const char* what) {
    SCOPED_TRACE(what);
    d_k.upload(k);
    ASSERT_EQ(cpu_first(KVCache<const T>(host_cache), lengths), want);
    ASSERT_EQ(cpu_first(paged_over(k.data(), indptr.data(), indices.data(), last.data()), lengths), want);
    EXPECT_EQ(cuda_first_of(KVCache<const T>(device_cache), d_lengths.data()), want) << "contiguous";
    EXPECT_EQ(cuda_first_of(paged_over(d_k.data(), d_indptr.data(), d_indices.data(), d_last.data()), d_lengths.data()),
              want)
        << "paged";
  };
  check(kNone, "finite");
  {  // bandwidth of a full scan (nothing to find), after the warm-up above
    DeviceBuffer<std::int32_t> out(4);
    cudaEvent_t start, stop;
    KVSIFT_CUDA_CHECK(cudaEventCreate(&start));
    KVSIFT_CUDA_CHECK(cudaEventCreate(&stop));
    KVSIFT_CUDA_CHECK(cudaEventRecord(start));
    for (int r = 0; r < 5; ++r) cuda::first_nonfinite_key(KVCache<const T>(device_cache), d_lengths.data(), out.data(), nullptr);
    KVSIFT_CUDA_CHECK(cudaEventRecord(stop));
    KVSIFT_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    KVSIFT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    const double bytes = double(kv_heads) * (capacity + 100000) * head_dim * sizeof(T);
    std::printf("first_nonfinite_key, %zu-byte keys: %.3f ms per scan of %.0f MB, %.0f GB/s\n", sizeof(T), ms / 5,
                bytes / 1e6, bytes / (ms / 5 * 1e-3) / 1e9);
    KVSIFT_CUDA_CHECK(cudaEventDestroy(start));
    KVSIFT_CUDA_CHECK(cudaEventDestroy(stop));
  }
  at(1, 3, 99999, 127) = from_float<T>(-std::numeric_limits<float>::infinity());
  check({1, 3, 99999, 127}, "the last scanned key");
  at(1, 2, 5, 9) = from_float<T>(std::numeric_limits<float>::infinity());
  at(0, 3, 131071, 0) = from_float<T>(std::numeric_limits<float>::quiet_NaN());
  at(0, 3, 131000, 64) = from_float<T>(std::numeric_limits<float>::quiet_NaN());
  at(0, 3, 131000, 65) = from_float<T>(std::numeric_limits<float>::infinity());
  check({0, 3, 131000, 64}, "several offenders");
}

// The host refuses before any device work (no GPU needed): a misaligned or null answer, a cache too large for the
// scan's 64-bit positions.
TEST(CudaFirstNonfiniteKeyRefusals, BadArguments) {
  const std::vector<std::int32_t> lengths{1};
  const KVCache<const half> cache = ContiguousKVView<const half>::packed(reinterpret_cast<const half*>(0x1000), nullptr,
                                                                         1, 1, 1, 16);
  test::expect_error([&] { cuda::first_nonfinite_key(cache, lengths.data(), nullptr, nullptr); },
                     "cuda::first_nonfinite_key: d_out must be non-null and 8-byte aligned");
  test::expect_error(
      [&] { cuda::first_nonfinite_key(cache, lengths.data(), reinterpret_cast<std::int32_t*>(0x1004), nullptr); },
      "cuda::first_nonfinite_key: d_out must be non-null and 8-byte aligned");
  const KVCache<const half> huge = ContiguousKVView<const half>::packed(reinterpret_cast<const half*>(0x1000), nullptr,
                                                                        1 << 20, 64, 1, 128);
  test::expect_error(
      [&] { cuda::first_nonfinite_key(huge, lengths.data(), reinterpret_cast<std::int32_t*>(0x1000), nullptr); },
      "must be below 2^33");
}

}  // namespace
}  // namespace kvsift::test
