// select_pages on CUDA (Quest's selection: page_scores, topk_rows over the pages, expand_pages, each tested against
// its CPU twin elsewhere) as a whole: device values out of range, and sequences longer than the planned page bound,
// give count -1 where the CPU refuses them; a graph replay equals the eager run; the host refuses bad arguments
// by name. Outputs poisoned first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "kvsift/cuda/backend.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::Random;

struct Shape {
  std::int32_t q_heads, kv_heads, head_dim, page_size, max_pages, pages_per_row;
  AttentionWindow window;
  std::vector<std::int32_t> lens;
};

/// Bounds of every slot drawn at random (lo <= hi per channel; a few pages NaN), a query, and the lengths.
template <class T>
struct Problem {
  Shape shape;
  std::int32_t batch, slots;
  DeviceBuffer<T> q, bounds;
  DeviceBuffer<std::int32_t> lengths, slot_of_row;

  Problem(Random& rng, const Shape& s)
      : shape(s), batch(std::int32_t(s.lens.size())), slots(batch + 1) {
    const std::size_t q_elems = std::size_t(batch) * s.q_heads * s.head_dim;
    q = DeviceBuffer<T>(test::to_storage<T>(rng.normal(q_elems)));
    const std::size_t bound_elems = PageBoundsView<T>::bytes(slots, s.kv_heads, s.max_pages, s.head_dim) / sizeof(T);
    std::vector<float> lo_hi(bound_elems);
    const std::size_t page_elems = 2 * std::size_t(s.head_dim);
    for (std::size_t page = 0; page < bound_elems / page_elems; ++page) {
      float* lo = lo_hi.data() + page * page_elems;
      float* hi = lo + s.head_dim;
      const bool nan_page = rng.uniform_int(0, 199) == 0;
      for (std::int32_t c = 0; c < s.head_dim; ++c) {
        const float a = rng.uniform(-2.0f, 2.0f), b = rng.uniform(-2.0f, 2.0f);
        lo[c] = std::min(a, b);
        hi[c] = std::max(a, b);
      }
      if (nan_page) hi[rng.uniform_int(0, s.head_dim - 1)] = NAN;
    }
    bounds = DeviceBuffer<T>(test::to_storage<T>(lo_hi));
    lengths = DeviceBuffer<std::int32_t>(s.lens);
    std::vector<std::int32_t> row_slots(batch);
    for (std::int32_t b = 0; b < batch; ++b) row_slots[b] = slots - 1 - b;  // out of order
    slot_of_row = DeviceBuffer<std::int32_t>(row_slots);
  }
  QueryView<const T> query() const { return QueryView<const T>::packed(q.data(), batch, shape.q_heads, shape.head_dim); }
  PageBoundsView<const T> view() const {
    return PageBoundsView<const T>::packed(bounds.data(), slots, shape.kv_heads, shape.max_pages, shape.head_dim,
                                           shape.page_size);
  }
};

/// A poisoned selection on the device: indices, counts -1 bytes; log-weights NaN.
struct Selection {
  DeviceBuffer<std::int32_t> indices, counts;
  DeviceBuffer<float> weights;
  SelectionView view;
  Selection(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity)
      : indices(std::size_t(batch) * kv_heads * capacity), counts(std::size_t(batch) * kv_heads),
        weights(indices.size()) {
    indices.poison();
    counts.poison();
    weights.poison();
    view = {indices.data(), counts.data(), weights.data(), batch, kv_heads, capacity};
  }
};

/// Rows equal: counts, then each row's first count entries (the rest is not defined), weights 0.
void expect_same_rows(const Selection& got, const Selection& want, const std::string& what) {
  const auto counts = got.counts.download(), want_counts = want.counts.download();
  const auto indices = got.indices.download(), want_indices = want.indices.download();
  const auto weights = got.weights.download();
  ASSERT_EQ(counts, want_counts) << what;
  const std::int32_t capacity = got.view.capacity;
  for (std::size_t row = 0; row < counts.size(); ++row) {
    for (std::int32_t i = 0; i < counts[row]; ++i) {
      const std::size_t at = row * capacity + i;
      ASSERT_EQ(indices[at], want_indices[at]) << what << " row " << row << " entry " << i;
      ASSERT_EQ(weights[at], 0.0f) << what << " row " << row << " entry " << i;
    }
  }
}

/// select_pages on CUDA, with its workspace.
template <class T>
void select(const Problem<T>& p, std::int32_t max_pages, const SelectionView& out, cudaStream_t stream,
            DeviceBuffer<std::byte>& workspace) {
  const cuda::Context ctx{stream};
  workspace = DeviceBuffer<std::byte>(
      std::max<std::size_t>(1, select_pages_workspace_bytes(p.batch, p.shape.kv_heads, max_pages,
                                                                  p.shape.pages_per_row, ctx)));
  select_pages(p.query(), p.view(), p.slot_of_row.data(), p.lengths.data(), p.shape.window, max_pages,
                     p.shape.pages_per_row, PagesOut::tokens, out, {workspace.data(), workspace.size()}, ctx);
}

using CudaSelectPages = test::GpuTest;

TEST_F(CudaSelectPages, OutOfRangeDeviceValuesGiveCountMinusOne) {
  Shape s{32, 8, 128, 16, 256, 16, {4, 64}, {4096, 1000, 100, 3300}};
  Problem<bfloat16> p(rng, s);
  // Row 0: a length past bounds.max_pages * page_size; row 1: a slot outside [0, slots); row 2 valid; row 3 longer
  // than the planned 200 pages.
  p.lengths.upload({4096 + 1, 1000, 100, 3300});
  p.slot_of_row.upload({0, p.slots, 1, 2});
  Selection out(p.batch, s.kv_heads, s.pages_per_row * s.page_size);
  DeviceBuffer<std::byte> workspace;
  select(p, 200, out.view, nullptr, workspace);
  const auto counts = out.counts.download();
  for (std::int32_t g = 0; g < s.kv_heads; ++g) {
    EXPECT_EQ(counts[g], -1) << "row 0 head " << g;
    EXPECT_EQ(counts[s.kv_heads + g], -1) << "row 1 head " << g;
    EXPECT_EQ(counts[3 * s.kv_heads + g], -1) << "row 3 head " << g;
    EXPECT_EQ(counts[2 * s.kv_heads + g], 100 - 64 - 4) << "row 2 head " << g;  // every middle token
  }
}

TEST_F(CudaSelectPages, GraphReplaysEqualTheEagerRun) {
  Shape s{32, 8, 128, 16, 4096, 64, {4, 64}, {65536, 30000}};
  Problem<bfloat16> p(rng, s);
  const test::Stream stream;
  Selection eager(p.batch, s.kv_heads, s.pages_per_row * s.page_size), replay(p.batch, s.kv_heads, s.pages_per_row * s.page_size);
  DeviceBuffer<std::byte> workspace;
  select(p, s.max_pages, eager.view, stream, workspace);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  const test::CapturedGraph graph(stream, [&] {
    select_pages(p.query(), p.view(), p.slot_of_row.data(), p.lengths.data(), s.window, s.max_pages,
                       s.pages_per_row, PagesOut::tokens, replay.view, {workspace.data(), workspace.size()}, cuda::Context{stream});
  });
  for (int run = 0; run < 2; ++run) {
    replay.indices.poison();
    replay.counts.poison();
    replay.weights.poison();  // each replay writes its own log-weights
    graph.launch();
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_same_rows(replay, eager, "replay");
  }
}

TEST(CudaSelectPagesBadInput, RefusedBeforeAnyDeviceCall) {
  // Host pointers stand in for device ones: every call below must throw before a launch.
  std::vector<bfloat16> q(2 * 8 * 128), bounds(PageBoundsView<bfloat16>::bytes(2, 2, 64, 128) / sizeof(bfloat16));
  std::vector<std::int32_t> lens{100, 200}, slots{0, 1}, indices(2 * 2 * 256), counts(4);
  std::vector<std::byte> workspace(1 << 20);
  const auto qv = QueryView<const bfloat16>::packed(q.data(), 2, 8, 128);
  const auto bv = PageBoundsView<const bfloat16>::packed(bounds.data(), 2, 2, 64, 128, 16);
  const SelectionView out{indices.data(), counts.data(), nullptr, 2, 2, 256};
  const auto call = [&](std::int32_t max_pages, std::int32_t pages_per_row, const SelectionView& o,
                        const QueryView<const bfloat16>& qq) {
    return [=, &workspace] {
      select_pages(qq, bv, slots.data(), lens.data(), AttentionWindow{}, max_pages, pages_per_row, PagesOut::tokens, o,
                         workspace, cuda::Context{});
    };
  };
  test::expect_error(call(64, 0, out, qv), {"cuda::select_pages", "pages_per_row (= 0)"});
  test::expect_error(call(64, 17, out, qv), {"out.capacity (= 256) < pages_per_row * page_size (= 17 * 16)"});
  test::expect_error(call(65, 16, out, qv), {"max_pages (= 65) is outside [1, bounds.max_pages = 64]"});
  SelectionView wrong_batch = out;
  wrong_batch.batch = 1;
  test::expect_error(call(64, 16, wrong_batch, qv), {"out is [batch = 1"});
  auto odd_heads = qv;
  odd_heads.heads = 7;
  test::expect_error(call(64, 16, out, odd_heads), {"q.heads (= 7) is not a multiple of bounds.kv_heads (= 2)"});
}

}  // namespace
}  // namespace kvsift
