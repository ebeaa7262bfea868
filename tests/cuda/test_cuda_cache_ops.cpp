// The decode step's cache operations on CUDA against their CPU twins: lengths, the step token's write (at
// seq_len - 1 of each row, nothing else touched; a row of length 0 is skipped, as documented), contiguous and
// paged, fp16 and bf16; the empty selection.
#include <gtest/gtest.h>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
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

}  // namespace
}  // namespace kvsift::test
