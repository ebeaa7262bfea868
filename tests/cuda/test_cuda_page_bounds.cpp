// CUDA page bounds (selectors/quest/cuda/page_bounds.hpp) against their CPU twins (whose own tests check them against fp64):
// build, append and expand bit for bit, page scores within fp32 summation order; contiguous and paged caches,
// fp32, fp16 and bf16, every supported head_dim; outputs poisoned first. Page scores also run the direct kernel
// (cuda::detail::launch_page_scores_direct, the path of code built before sm_90): where cuda::page_scores ran the
// streamed kernel (sm_90: fp32 bounds, groups above 8), the two agree bit for bit; where it ran the tensor-core
// kernel (sm_90: 16-bit bounds, groups up to 8), which sums in another order, both are checked against the CPU.
// A page's score does not depend on the chunk plan (one CTA per row gives the same bits). Also: append +
// page_scores + expand captured in a CUDA graph and replayed equal the eager run (through workspace_check.hpp), and
// the device-value rules (a bad slot, length or count writes nothing, or -1 where there is a count).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "kvsift/selectors/quest/cpu/page_bounds.hpp"
#include "kvsift/selectors/quest/cuda/detail/page_bounds_kernels.cuh"
#include "kvsift/selectors/quest/cuda/page_bounds.hpp"
#include "page_bounds_problem.hpp"
#include "test_util.hpp"
#include "workspace_check.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::same_bytes;
using test::kUntouched;
using test::random_pages;
using test::Random;

/// page_bounds_problem.hpp's problem (HND pages of 16 tokens, 2 unused slots) and its device copy.
template <class T>
struct Problem : test::PageBoundsProblem<T> {
  using Host = test::PageBoundsProblem<T>;
  DeviceBuffer<T> d_k, d_v, d_paged_k, d_paged_v, d_bounds;
  DeviceBuffer<std::int32_t> d_lens, d_slots, d_indptr, d_indices, d_last_len;

  Problem(Random& rng, const std::vector<std::int32_t>& lens, std::int32_t kv_heads, std::int32_t head_dim,
          std::int32_t page_size)
      : Host(rng, lens, kv_heads, head_dim, page_size, /*cache_page_size=*/16, /*hnd=*/true, /*extra_slots=*/2),
        d_k(this->k), d_v(this->v), d_paged_k(this->paged_k), d_paged_v(this->paged_v), d_bounds(this->bounds),
        d_lens(this->kv.seq_lens), d_slots(this->slots), d_indptr(this->paged.indptr),
        d_indices(this->paged.indices), d_last_len(this->paged.last_len) {}
  ContiguousKVView<const T> contiguous(bool device) const {
    return device ? Host::contiguous(d_k.data(), d_v.data(), d_lens.data()) : Host::contiguous();
  }
  PagedKVView<const T> paged_view(bool device) const {
    return device ? Host::paged_view(d_paged_k.data(), d_paged_v.data(), d_indptr.data(), d_indices.data(),
                                     d_last_len.data())
                  : Host::paged_view();
  }
  PageBoundsView<T> view(bool device) { return Host::view(device ? d_bounds.data() : this->bounds.data()); }
  const std::int32_t* slot_ptr(bool device) const { return device ? d_slots.data() : this->slots.data(); }
};

/// Device twin of a HostSelection's buffers, poisoned (indices and counts -1, log-weights NaN).
struct DeviceSelection {
  DeviceBuffer<std::int32_t> indices, counts;
  DeviceBuffer<float> weights;
  SelectionView view;
  DeviceSelection(const SelectionView& like, bool with_weights)
      : indices(std::size_t(like.batch) * like.kv_heads * like.capacity),
        counts(std::size_t(like.batch) * like.kv_heads),
        weights(with_weights ? indices.size() : 0) {
    indices.poison();
    counts.poison();
    weights.poison();
    view = {indices.data(), counts.data(), with_weights ? weights.data() : nullptr, like.batch, like.kv_heads,
            like.capacity};
  }
};

/// cuda::expand_pages of `pages` (host) equals cpu::expand_pages bit for bit: counts, entries, weights 0 where
/// asked; entries past each count stay as they were (the host's poison, the device's -1 and NaN).
void expect_expand_equals_cpu(const test::HostSelection& pages, std::int32_t ps, const std::vector<std::int32_t>& lens,
                              const std::int32_t* d_lens, const AttentionWindow& window, bool weights) {
  const std::int32_t rows = pages.view.batch * pages.view.kv_heads;
  test::HostSelection out(pages.view.batch, pages.view.kv_heads, pages.view.capacity * ps, weights);
  cpu::expand_pages(pages.view, ps, lens.data(), window, out.view);
  DeviceBuffer<std::int32_t> d_page_ids(pages.indices), d_page_counts(pages.counts);
  SelectionView d_pages = pages.view;
  d_pages.indices = d_page_ids.data();
  d_pages.counts = d_page_counts.data();
  DeviceSelection d_out(out.view, weights);
  cuda::expand_pages(d_pages, ps, d_lens, window, d_out.view, nullptr);
  ASSERT_EQ(d_out.counts.download(), out.counts);
  const auto got = d_out.indices.download();
  const auto got_weights = d_out.weights.download();
  for (std::int32_t row = 0; row < rows; ++row) {
    const std::size_t base = std::size_t(row) * out.view.capacity;
    for (std::int32_t i = 0; i < out.view.capacity; ++i) {
      const std::int32_t want = i < out.counts[row] ? out.indices[base + i] : -1;
      ASSERT_EQ(got[base + i], want) << "row " << row << " entry " << i;
      if (weights) {
        ASSERT_TRUE(i < out.counts[row] ? got_weights[base + i] == 0.0f : std::isnan(got_weights[base + i]))
            << "row " << row << " weight " << i;
      }
    }
  }
}

/// Scores of the CPU and the GPU agree: counts exactly, unwritten, NaN and +-inf entries exactly, others within
/// the fp32 rounding of the two summation orders, which this bounds by 2 * head_dim roundings of the magnitude
/// sum_c |q_c| * max(|lo_c|, |hi_c|) (taken over the group's heads). The tensor-core kernel's fp32 accumulation
/// (mma.sync, whose additions need not round to nearest) is held to the same rule.
template <class T>
void expect_scores_match(const std::vector<float>& cpu, const std::vector<float>& gpu, const std::vector<T>& q,
                         const Problem<T>& p, std::int32_t q_heads, std::int32_t cols, const std::string& what) {
  const std::int32_t kv_heads = p.kv.kv_heads, d = p.kv.head_dim, group = q_heads / kv_heads;
  const auto bounds = PageBoundsView<const T>::packed(p.bounds.data(), p.slot_count, kv_heads, p.max_pages, d,
                                                      p.page_size);
  std::int64_t bad = 0;
  for (std::int32_t b = 0; b < p.kv.batch; ++b) {
    for (std::int32_t g = 0; g < kv_heads; ++g) {
      for (std::int32_t page = 0; page < cols; ++page) {
        const std::size_t i = (std::size_t(b) * kv_heads + g) * cols + page;
        if (!(std::abs(cpu[i]) < INFINITY) || cpu[i] == kUntouched) {
          bad += std::memcmp(&cpu[i], &gpu[i], sizeof(float)) != 0 && !(std::isnan(cpu[i]) && std::isnan(gpu[i]));
          continue;
        }
        double scale = 0;
        for (std::int32_t h = g * group; h < (g + 1) * group; ++h) {
          double sum = 0;
          for (std::int32_t c = 0; c < d; ++c) {
            const double qc = to_float(q[(std::size_t(b) * q_heads + h) * d + c]);
            sum += std::abs(qc) * std::max(std::abs(to_float(bounds.lo(p.slots[b], g, page)[c])),
                                           std::abs(to_float(bounds.hi(p.slots[b], g, page)[c])));
          }
          scale = std::max(scale, sum);
        }
        if (!(std::abs(double(cpu[i]) - gpu[i]) <= 2 * d * 0x1p-24 * scale)) {
          if (bad++ < 5) ADD_FAILURE() << what << ": row " << b * kv_heads + g << " page " << page << " cpu " << cpu[i] << " gpu " << gpu[i];
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

/// The direct kernel (cuda::detail::launch_page_scores_direct, with the parameters cuda::page_scores plans)
/// against cuda::page_scores' `scores` and `counts`: counts equal; scores bit for bit where cuda::page_scores ran a
/// kernel of the direct one's lane layout and arithmetic (the streamed kernel, or the direct one itself); where it
/// ran the tensor-core kernel, which sums in another order, `against_cpu` checks the direct kernel's scores
/// instead (expect_scores_match). The choice itself is checked too: the tensor-core kernel exactly for 16-bit
/// bounds and groups up to kScoreMmaMaxGroup, wherever the device runs sm_90 code.
template <class T>
void expect_direct_agrees(const std::vector<float>& scores, const std::vector<std::int32_t>& counts,
                          const QueryView<const T>& q, const PageBoundsView<const T>& bounds,
                          const std::int32_t* d_slots, const std::int32_t* d_lengths, const AttentionWindow& window,
                          std::int32_t rows, std::int32_t cols, const std::string& what,
                          const std::function<void(const std::vector<float>&)>& against_cpu = nullptr) {
  DeviceBuffer<float> d_scores(std::vector<float>(scores.size(), kUntouched));
  DeviceBuffer<std::int32_t> d_counts(counts.size());
  d_counts.poison();
  const auto params = cuda::detail::plan_page_scores(q, bounds, d_slots, d_lengths, window,
                                                     MatrixView<float>::packed(d_scores.data(), rows, cols),
                                                     d_counts.data(), cuda::multiprocessor_count());
  using cuda::detail::PageScoreKernel;
  PageScoreKernel kernel = PageScoreKernel::direct;
  KVSIFT_CUDA_CHECK(cuda::detail::choose_page_score_kernel(params, &kernel));
  if (kernel != PageScoreKernel::direct) {
    EXPECT_EQ(kernel == PageScoreKernel::tensor_cores,
              cuda::detail::kScoresOnTensorCores<T> && params.group <= cuda::detail::kScoreMmaMaxGroup)
        << what << ": the kernel chosen";
  }
  KVSIFT_CUDA_CHECK(cuda::detail::launch_page_scores_direct(params, nullptr));
  EXPECT_EQ(d_counts.download(), counts) << what << ": direct kernel";
  if (kernel != PageScoreKernel::tensor_cores) {
    EXPECT_TRUE(same_bytes(d_scores.download(), scores)) << what << ": direct kernel";
    return;
  }
  ASSERT_TRUE(against_cpu) << what << ": the tensor-core kernel ran, and nothing to compare the direct one with";
  against_cpu(d_scores.download());
}

template <class T>
void check_against_cpu(Random& rng, std::int32_t head_dim, bool paged) {
  SCOPED_TRACE(testing::Message() << "head_dim " << head_dim << (paged ? " paged" : " contiguous"));
  const std::vector<std::int32_t> full = {0, 1, 37, 64, 129, 200};
  const std::int32_t kv_heads = 2, group = 4, ps = 16, q_heads = kv_heads * group, batch = std::int32_t(full.size());
  Problem<T> p(rng, full, kv_heads, head_dim, ps);
  const auto build = [&](bool device) {
    if (paged) {
      device ? cuda::build_page_bounds(p.paged_view(true), p.slot_ptr(true), p.view(true), nullptr)
             : cpu::build_page_bounds(p.paged_view(false), p.slot_ptr(false), p.view(false));
    } else {
      device ? cuda::build_page_bounds(p.contiguous(true), p.slot_ptr(true), p.view(true), nullptr)
             : cpu::build_page_bounds(p.contiguous(false), p.slot_ptr(false), p.view(false));
    }
  };
  build(false);
  build(true);
  ASSERT_TRUE(same_bytes(p.d_bounds.download(), p.bounds)) << "build";

  // Append: rebuild at shorter lengths, then grow one token per step across page boundaries. The paged view's
  // lengths come from its page table: the same pages, the first ceil(len / cache page) of them in use.
  std::vector<std::int32_t> lens = full;
  for (auto& l : lens) l = std::max(0, l - 19);
  const auto full_indptr = p.paged.indptr, full_indices = p.paged.indices;
  const auto grow_to = [&](const std::vector<std::int32_t>& now) {
    p.kv.seq_lens = now;
    p.d_lens.upload(now);
    const std::int32_t cache_page = p.paged.view.page_size;
    std::vector<std::int32_t> indptr = {0}, indices, last_len;
    for (std::size_t b = 0; b < now.size(); ++b) {
      const std::int32_t pages = std::int32_t(detail::page_count(now[b], cache_page));
      indices.insert(indices.end(), full_indices.begin() + full_indptr[b],
                     full_indices.begin() + full_indptr[b] + pages);
      indptr.push_back(indptr.back() + pages);
      last_len.push_back(pages == 0 ? 0 : now[b] - (pages - 1) * cache_page);
    }
    indices.resize(full_indices.size(), 0);  // the device buffer keeps its size
    p.paged.indptr = indptr;
    p.paged.indices = indices;
    p.paged.last_len = last_len;
    p.paged.view.page_indptr = p.paged.indptr.data();
    p.paged.view.page_indices = p.paged.indices.data();
    p.paged.view.last_page_len = p.paged.last_len.data();
    p.d_indptr.upload(indptr);
    p.d_indices.upload(indices);
    p.d_last_len.upload(last_len);
  };
  const auto append = [&] {
    if (paged) {
      cpu::append_page_bounds(p.paged_view(false), p.slot_ptr(false), p.view(false));
      cuda::append_page_bounds(p.paged_view(true), p.slot_ptr(true), p.view(true), nullptr);
    } else {
      cpu::append_page_bounds(p.contiguous(false), p.slot_ptr(false), p.view(false));
      cuda::append_page_bounds(p.contiguous(true), p.slot_ptr(true), p.view(true), nullptr);
    }
  };
  grow_to(lens);
  p.bounds.assign(p.bounds.size(), from_float<T>(kUntouched));
  p.d_bounds.upload(p.bounds);
  build(false);
  build(true);
  for (int step = 0; step < 19; ++step) {
    for (std::size_t b = 0; b < lens.size(); ++b) lens[b] = std::min(full[b], lens[b] + 1);
    grow_to(lens);
    append();
  }
  ASSERT_TRUE(same_bytes(p.d_bounds.download(), p.bounds)) << "append";

  const auto q = test::to_storage<T>(rng.normal(std::size_t(batch) * q_heads * head_dim));
  DeviceBuffer<T> d_q(q);
  const std::int32_t cols = p.max_pages + 3;
  for (const AttentionWindow window : {AttentionWindow{}, AttentionWindow{4, 40}}) {
    std::vector<float> scores(std::size_t(batch) * kv_heads * cols, kUntouched);
    std::vector<std::int32_t> counts(batch);
    DeviceBuffer<float> d_scores(scores);
    DeviceBuffer<std::int32_t> d_counts(counts.size());
    d_counts.poison();
    cpu::page_scores(QueryView<const T>::packed(q.data(), batch, q_heads, head_dim), p.view(false).as_const(),
                     p.slot_ptr(false), full.data(), window, MatrixView<float>::packed(scores.data(), batch * kv_heads, cols),
                     counts.data());
    cuda::page_scores(QueryView<const T>::packed(d_q.data(), batch, q_heads, head_dim), p.view(true).as_const(),
                      p.slot_ptr(true), p.d_lens.data(), window,
                      MatrixView<float>::packed(d_scores.data(), batch * kv_heads, cols), d_counts.data(), nullptr);
    EXPECT_EQ(d_counts.download(), counts);
    const auto gpu = d_scores.download();
    expect_scores_match(scores, gpu, q, p, q_heads, cols, "page_scores");
    expect_direct_agrees(gpu, counts, QueryView<const T>::packed(d_q.data(), batch, q_heads, head_dim),
                         p.view(true).as_const(), p.slot_ptr(true), p.d_lens.data(), window, batch * kv_heads, cols,
                         "page_scores", [&](const std::vector<float>& direct) {
                           expect_scores_match(scores, direct, q, p, q_heads, cols, "page_scores: direct kernel");
                         });

    for (bool weights : {false, true}) {
      expect_expand_equals_cpu(random_pages(rng, full, kv_heads, 5, ps), ps, full, p.d_lens.data(), window, weights);
    }
  }
}

using CudaPageBounds = test::GpuTest;

TEST_F(CudaPageBounds, EqualsTheCpuForEveryTypeLayoutAndHeadDim) {
  for (bool paged : {false, true}) {
    for (std::int32_t d : {64, 128, 256}) check_against_cpu<bfloat16>(rng, d, paged);
    check_against_cpu<half>(rng, 128, paged);
    check_against_cpu<float>(rng, 64, paged);
    check_against_cpu<float>(rng, 256, paged);
  }
}

/// expand_pages over rows of up to 300 chosen pages (ten chunks of the kernel's 32), page sizes below, at and above
/// a warp's 32 lanes, with and without a window and weights, against the CPU twin; entries past each count stay
/// poisoned.
TEST_F(CudaPageBounds, ExpandOfManyPagesEqualsTheCpu) {
  const std::vector<std::int32_t> lens = {4097, 3000, 1, 700, 9600};
  const std::int32_t kv_heads = 3, capacity = 300;
  DeviceBuffer<std::int32_t> d_lens(lens);
  for (const std::int32_t ps : {8, 16, 64}) {
    for (const AttentionWindow window : {AttentionWindow{}, AttentionWindow{4, 40}, AttentionWindow{0, 700}}) {
      for (const bool weights : {false, true}) {
        SCOPED_TRACE("page_size " + std::to_string(ps) + ", window " + std::to_string(window.sink) + " + " +
                     std::to_string(window.recent) + (weights ? ", weights" : ""));
        expect_expand_equals_cpu(random_pages(rng, lens, kv_heads, capacity, ps), ps, lens, d_lens.data(), window,
                                 weights);
      }
    }
  }
}

/// Page scores of long rows, at the planned chunk (64 pages here) and with one CTA per row (chunks of 8192: the
/// plan of a one-SM GPU), whose scores must be the same bits: a page's score does not depend on where it lies in
/// a chunk. Rows long enough to go round each kernel's ring: the streamed kernel's four 16 KB stages, more than
/// once per 64-page chunk in fp32 at head_dim 256 (8 stages of 8 pages) and, with two head tiles, in bf16 at
/// head_dim 256; the tensor-core kernel's three stages of 128, 64 or 32 pages (head_dim 64, 128, 256) in the
/// one-CTA runs (6200 tokens: 388 pages, 4 to 13 stages). Row ends that cut a chunk, a stage and an m16 tile short
/// (388 pages: the last chunk 4 pages, and the one-CTA runs' last stage; 1037 tokens: 65 pages, the last chunk 1), an
/// empty row and one mostly in the window (-inf pages); groups of 1 to 8 heads (one head tile, and for 16-bit
/// bounds the tensor-core kernel) and 12 (two tiles: the streamed kernel); a page with one NaN channel, which
/// scores NaN. Against the CPU, and the direct kernel (expect_direct_agrees).
template <class T>
void check_long_rows(Random& rng, std::int32_t head_dim, std::int32_t group) {
  SCOPED_TRACE(testing::Message() << "head_dim " << head_dim << ", group " << group << ", " << sizeof(T)
                                  << "-byte type");
  const std::vector<std::int32_t> lens = {6200, 1037, 0, 61};
  const std::int32_t kv_heads = 2, ps = 16, batch = std::int32_t(lens.size()), q_heads = kv_heads * group;
  Problem<T> p(rng, lens, kv_heads, head_dim, ps);
  cpu::build_page_bounds(p.contiguous(false), p.slot_ptr(false), p.view(false));
  const std::int32_t nan_page = 100;
  p.view(false).hi(p.slots[0], 1, nan_page)[head_dim / 2] = from_float<T>(NAN);
  p.d_bounds.upload(p.bounds);
  const auto q = test::to_storage<T>(rng.normal(std::size_t(batch) * q_heads * head_dim));
  DeviceBuffer<T> d_q(q);
  const std::int32_t cols = p.max_pages + 5, rows = batch * kv_heads;
  const AttentionWindow window{4, 40};
  std::vector<float> scores(std::size_t(rows) * cols, kUntouched);
  std::vector<std::int32_t> counts(batch);
  DeviceBuffer<float> d_scores(scores);
  DeviceBuffer<std::int32_t> d_counts(counts.size());
  d_counts.poison();
  const auto d_query = QueryView<const T>::packed(d_q.data(), batch, q_heads, head_dim);
  cpu::page_scores(QueryView<const T>::packed(q.data(), batch, q_heads, head_dim), p.view(false).as_const(),
                   p.slot_ptr(false), lens.data(), window, MatrixView<float>::packed(scores.data(), rows, cols),
                   counts.data());
  cuda::page_scores(d_query, p.view(true).as_const(), p.slot_ptr(true), p.d_lens.data(), window,
                    MatrixView<float>::packed(d_scores.data(), rows, cols), d_counts.data(), nullptr);
  EXPECT_EQ(d_counts.download(), counts);
  const auto gpu = d_scores.download();
  expect_scores_match(scores, gpu, q, p, q_heads, cols, "long rows");
  EXPECT_TRUE(std::isnan(gpu[std::size_t(1) * cols + nan_page])) << "row 0, kv head 1: the NaN page";
  EXPECT_EQ(gpu[std::size_t(6) * cols + 3], -INFINITY) << "row 3, kv head 0: page 3 is in the window";
  expect_direct_agrees(gpu, counts, d_query, p.view(true).as_const(), p.slot_ptr(true), p.d_lens.data(), window, rows,
                       cols, "long rows", [&](const std::vector<float>& direct) {
                         expect_scores_match(scores, direct, q, p, q_heads, cols, "long rows: direct kernel");
                       });

  DeviceBuffer<float> d_whole(std::vector<float>(scores.size(), kUntouched));
  d_counts.poison();
  const auto one_cta = cuda::detail::plan_page_scores(d_query, p.view(true).as_const(), p.slot_ptr(true),
                                                      p.d_lens.data(), window,
                                                      MatrixView<float>::packed(d_whole.data(), rows, cols),
                                                      d_counts.data(), /*sms=*/1);
  ASSERT_EQ(one_cta.chunks, 1);
  KVSIFT_CUDA_CHECK(cuda::detail::launch_page_scores(one_cta, nullptr));
  EXPECT_EQ(d_counts.download(), counts) << "one CTA per row";
  EXPECT_TRUE(same_bytes(d_whole.download(), gpu)) << "one CTA per row";
}

TEST_F(CudaPageBounds, ScoresOfLongRowsEqualTheCpu) {
  for (std::int32_t group : {1, 4, 8, 12}) {
    for (std::int32_t d : {64, 128, 256}) {
      check_long_rows<half>(rng, d, group);
      check_long_rows<bfloat16>(rng, d, group);
    }
  }
  for (std::int32_t group : {4, 12}) {
    for (std::int32_t d : {64, 256}) check_long_rows<float>(rng, d, group);
  }
}

/// Group sizes from 1 to 16 (two head tiles) against the CPU, with a window.
TEST_F(CudaPageBounds, ScoresEqualTheCpuForEveryGroupSize) {
  const std::vector<std::int32_t> lens = {300, 1000, 17};
  for (std::int32_t group : {1, 2, 8, 12, 16}) {
    SCOPED_TRACE(testing::Message() << "group " << group);
    const std::int32_t kv_heads = 2, d = 128, ps = 16, batch = 3, q_heads = kv_heads * group;
    Problem<bfloat16> p(rng, lens, kv_heads, d, ps);
    cpu::build_page_bounds(p.contiguous(false), p.slot_ptr(false), p.view(false));
    p.d_bounds.upload(p.bounds);
    const auto q = test::to_storage<bfloat16>(rng.normal(std::size_t(batch) * q_heads * d));
    DeviceBuffer<bfloat16> d_q(q);
    const std::int32_t cols = p.max_pages;
    std::vector<float> scores(std::size_t(batch) * kv_heads * cols, kUntouched);
    std::vector<std::int32_t> counts(batch);
    DeviceBuffer<float> d_scores(scores);
    DeviceBuffer<std::int32_t> d_counts(counts.size());
    const AttentionWindow window{16, 64};
    cpu::page_scores(QueryView<const bfloat16>::packed(q.data(), batch, q_heads, d), p.view(false).as_const(),
                     p.slot_ptr(false), lens.data(), window, MatrixView<float>::packed(scores.data(), batch * kv_heads, cols),
                     counts.data());
    cuda::page_scores(QueryView<const bfloat16>::packed(d_q.data(), batch, q_heads, d), p.view(true).as_const(),
                      p.slot_ptr(true), p.d_lens.data(), window,
                      MatrixView<float>::packed(d_scores.data(), batch * kv_heads, cols), d_counts.data(), nullptr);
    EXPECT_EQ(d_counts.download(), counts);
    const auto gpu = d_scores.download();
    expect_scores_match(scores, gpu, q, p, q_heads, cols, "group scores");
    expect_direct_agrees(gpu, counts, QueryView<const bfloat16>::packed(d_q.data(), batch, q_heads, d),
                         p.view(true).as_const(), p.slot_ptr(true), p.d_lens.data(), window, batch * kv_heads, cols,
                         "group scores", [&](const std::vector<float>& direct) {
                           expect_scores_match(scores, direct, q, p, q_heads, cols, "group scores: direct kernel");
                         });
  }
}

/// append + page_scores + expand as one call through workspace_check.hpp (they take no workspace: the eager run,
/// then the call captured in a CUDA graph and replayed twice, outputs poisoned and the bounds restored before
/// each run): every replay equals the eager run bit for bit (append is idempotent for an unchanged length).
TEST_F(CudaPageBounds, GraphReplayEqualsTheEagerRun) {
  const std::vector<std::int32_t> lens = {513, 64, 250};
  const std::int32_t kv_heads = 2, d = 128, ps = 16, batch = 3, q_heads = 8, cols = 40, capacity = 6;
  Problem<bfloat16> p(rng, lens, kv_heads, d, ps);
  cuda::build_page_bounds(p.contiguous(true), p.slot_ptr(true), p.view(true), nullptr);
  const auto before = p.d_bounds.download();  // cudaMemcpy to the host waits for the build
  const auto q = test::to_storage<bfloat16>(rng.normal(std::size_t(batch) * q_heads * d));
  DeviceBuffer<bfloat16> d_q(q);
  DeviceBuffer<float> d_scores(std::size_t(batch) * kv_heads * cols);
  DeviceBuffer<std::int32_t> d_counts(batch);
  const auto pages = random_pages(rng, lens, kv_heads, capacity, ps);
  DeviceBuffer<std::int32_t> d_page_ids(pages.indices), d_page_counts(pages.counts);
  SelectionView d_pages = pages.view;
  d_pages.indices = d_page_ids.data();
  d_pages.counts = d_page_counts.data();
  DeviceSelection d_out(SelectionView{.batch = batch, .kv_heads = kv_heads, .capacity = capacity * ps}, true);
  const AttentionWindow window{4, 64};
  test::check_device_workspace(
      0,
      [&](std::span<std::byte>, cudaStream_t stream) {
        cuda::append_page_bounds(p.contiguous(true), p.slot_ptr(true), p.view(true), stream);
        cuda::page_scores(QueryView<const bfloat16>::packed(d_q.data(), batch, q_heads, d), p.view(true).as_const(),
                          p.slot_ptr(true), p.d_lens.data(), window,
                          MatrixView<float>::packed(d_scores.data(), batch * kv_heads, cols), d_counts.data(), stream);
        cuda::expand_pages(d_pages, ps, p.d_lens.data(), window, d_out.view, stream);
      },
      [&] {
        return test::bytes_of(p.d_bounds.download(), d_scores.download(), d_counts.download(),
                              d_out.indices.download(), d_out.counts.download(), d_out.weights.download());
      },
      [&] {
        p.d_bounds.upload(before);
        d_scores.poison();
        d_counts.poison();
        d_out.indices.poison();
        d_out.counts.poison();
        d_out.weights.poison();
      });
  EXPECT_EQ(d_counts.download(), (std::vector<std::int32_t>{33, 4, 16})) << "page counts: ceil(length / 16)";
}

/// Device values the host cannot check: a slot outside [0, slots), a sequence longer than the bounds cover, a
/// negative length, a selection count outside [0, capacity] or page ids past the sequence. Nothing is read or
/// written out of bounds (compute-sanitizer's memcheck run covers this test), and the results are the defined
/// ones: no bounds written, page_counts -1 without scores, out count -1 without entries.
TEST_F(CudaPageBounds, OutOfRangeDeviceValuesHaveTheDefinedResult) {
  const std::vector<std::int32_t> lens = {40, 33, 20, 48};
  const std::int32_t kv_heads = 1, d = 64, ps = 8, batch = 4, cols = 6;
  Problem<float> p(rng, lens, kv_heads, d, ps);
  // Row 1's slot is outside; row 3 holds 48 tokens but the bounds are made to cover 40 (5 pages).
  p.max_pages = 5;
  const std::vector<std::int32_t> slots = {p.slots[0], p.slot_count + 7, p.slots[2], p.slots[3]};
  p.d_slots.upload(slots);
  p.bounds.assign(PageBoundsView<float>::bytes(p.slot_count, kv_heads, 5, d) / sizeof(float), kUntouched);
  p.d_bounds.upload(std::vector<float>(p.d_bounds.size(), kUntouched));
  cuda::build_page_bounds(p.contiguous(true), p.slot_ptr(true), p.view(true), nullptr);
  cuda::append_page_bounds(p.contiguous(true), p.slot_ptr(true), p.view(true), nullptr);
  // The CPU twin on the valid rows only (0 and 2) gives the expected bounds.
  auto valid = p.contiguous(false);
  std::vector<std::int32_t> valid_lens = {lens[0], 0, lens[2], 0};
  valid.seq_lens = valid_lens.data();
  std::vector<std::int32_t> valid_slots = slots;
  valid_slots[1] = p.slots[1];
  cpu::build_page_bounds(valid, valid_slots.data(), p.view(false));
  const auto got = p.d_bounds.download();
  ASSERT_TRUE(std::equal(p.bounds.begin(), p.bounds.end(), got.begin(),
                         [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }));

  // Scores: row 1's slot, row 3's length over the bounds, and a negative length in row 2 give -1 and no scores;
  // the fp32 bounds (the streamed kernel on sm_90, and the direct one), then the same bounds in bf16 (the
  // tensor-core kernel on sm_90).
  const std::vector<std::int32_t> score_lens = {40, 33, -5, 48};
  DeviceBuffer<std::int32_t> d_score_lens(score_lens);
  const auto q = rng.normal(std::size_t(batch) * 2 * d);
  const auto expect_defined_scores = [&]<class T>(const PageBoundsView<const T>& bounds, const char* what) {
    DeviceBuffer<T> d_q(test::to_storage<T>(q));
    DeviceBuffer<float> d_scores(std::vector<float>(std::size_t(batch) * cols, kUntouched));
    DeviceBuffer<std::int32_t> d_counts(batch);
    const auto qv = QueryView<const T>::packed(d_q.data(), batch, 2, d);
    cuda::page_scores(qv, bounds, p.slot_ptr(true), d_score_lens.data(), {},
                      MatrixView<float>::packed(d_scores.data(), batch, cols), d_counts.data(), nullptr);
    const auto counts = d_counts.download();
    EXPECT_EQ(counts, (std::vector<std::int32_t>{5, -1, -1, -1})) << what;
    const auto scores = d_scores.download();
    if constexpr (std::is_same_v<T, float>) {
      expect_direct_agrees(scores, counts, qv, bounds, p.slot_ptr(true), d_score_lens.data(), {}, batch, cols,
                           "out-of-range values");
    }
    for (std::int32_t row = 1; row < batch; ++row) {
      for (std::int32_t c = 0; c < cols; ++c) {
        EXPECT_EQ(scores[row * cols + c], kUntouched) << what << " " << row << " " << c;
      }
    }
    for (std::int32_t c = 0; c < 5; ++c) EXPECT_NE(scores[c], kUntouched) << what << " " << c;
  };
  expect_defined_scores(p.view(true).as_const(), "fp32");
  const DeviceBuffer<bfloat16> d_bounds16(test::to_storage<bfloat16>(p.d_bounds.download()));
  expect_defined_scores(
      PageBoundsView<const bfloat16>::packed(d_bounds16.data(), p.slot_count, kv_heads, p.max_pages, d, ps), "bf16");

  // Expand: counts -1 and capacity + 1 give out count -1 and no entries; page ids past the sequence or
  // negative give no tokens.
  test::HostSelection pages(batch, kv_heads, 3, false);
  pages.counts = {-1, 4, 3, 2};
  pages.indices = {0, 0, 0, 0, 0, 0, -2, 1, 7, 4, 9, 0};
  DeviceBuffer<std::int32_t> d_page_ids(pages.indices), d_page_counts(pages.counts);
  const SelectionView d_pages{d_page_ids.data(), d_page_counts.data(), nullptr, batch, kv_heads, 3};
  DeviceSelection d_out(SelectionView{.batch = batch, .kv_heads = kv_heads, .capacity = 3 * ps}, false);
  cuda::expand_pages(d_pages, ps, d_score_lens.data(), {}, d_out.view, nullptr);
  EXPECT_EQ(d_out.counts.download(), (std::vector<std::int32_t>{-1, -1, 0, 8}));
  const auto out = d_out.indices.download();
  for (std::int32_t i = 0; i < 3 * 3 * ps; ++i) EXPECT_EQ(out[i], -1) << i;  // rows 0 to 2 untouched
  for (std::int32_t i = 0; i < 8; ++i) EXPECT_EQ(out[3 * 3 * ps + i], 32 + i);
}

TEST(CudaPageBoundsBadInput, RefusedBeforeAnyDeviceCall) {
  alignas(16) static float bounds_data[2 * 2 * 4 * 2 * 96];
  std::vector<float> q(2 * 4 * 96), scores(4 * 4);
  std::int32_t slots[] = {0, 1}, lens[] = {32, 0}, counts[2];
  test::expect_error(
      [&] {
        cuda::page_scores(QueryView<const float>::packed(q.data(), 2, 4, 96),
                          PageBoundsView<const float>::packed(bounds_data, 2, 2, 4, 96, 8), slots, lens, {},
                          MatrixView<float>::packed(scores.data(), 4, 4), counts, nullptr);
      },
      {"cuda::page_scores", "bounds.head_dim (= 96) is not supported by the CUDA page-score kernels (supported: 64, 128, 256)"});
  test::expect_error(
      [&] {
        cuda::page_scores(QueryView<const float>::packed(q.data(), 2, 4, 64),
                          PageBoundsView<const float>::packed(bounds_data, 2, 2, 4, 96, 8), slots, lens, {},
                          MatrixView<float>::packed(scores.data(), 4, 4), counts, nullptr);
      },
      {"cuda::page_scores", "q.head_dim (= 64) != bounds.head_dim (= 96)"});
  // The device contents are not read: an out-of-range slot or length passes the host checks (not run here).
  std::vector<float> k(2 * 2 * 8 * 96);
  const auto kv = ContiguousKVView<const float>::packed(k.data(), k.data(), 2, 2, 8, 96);
  test::expect_error(
      [&] { cuda::build_page_bounds(kv, slots, PageBoundsView<float>::packed(bounds_data, 2, 1, 4, 96, 8), nullptr); },
      {"cuda::build_page_bounds", "kv.kv_heads (= 2) != bounds.kv_heads (= 1)"});
  test::expect_error(
      [&] { cuda::append_page_bounds(kv, nullptr, PageBoundsView<float>::packed(bounds_data, 2, 2, 4, 96, 8), nullptr); },
      {"cuda::append_page_bounds", "slots is a null pointer"});
  test::HostSelection pages(2, 2, 3, false), out(2, 2, 3 * 8 - 1, false);
  test::expect_error([&] { cuda::expand_pages(pages.view, 8, lens, {}, out.view, nullptr); },
                     {"cuda::expand_pages", "out.capacity (= 23) < pages.capacity * page_size (= 3 * 8)"});
}

}  // namespace
}  // namespace kvsift
