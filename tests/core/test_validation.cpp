// Every bad input the foundation names is refused with a message naming the argument and its value.
#include <gtest/gtest.h>

#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kvsift/eval/metrics.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/core/rope.hpp"
#include "kvsift/core/selection_buffer.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::HostKV;
using test::HostSelection;
using test::HostState;
using test::Random;

using test::expect_error;

class BadInput : public testing::Test {
 protected:
  Random rng{test::test_seed()};
  HostKV kv{rng, 2, 2, 40, 16};
  std::vector<float> q = rng.normal(2 * 4 * 16);
  HostState out{2, 4, 16};
  QueryView<const float> qv = QueryView<const float>::packed(q.data(), 2, 4, 16);
};

TEST_F(BadInput, HeadDimMismatch) {
  auto q8 = QueryView<const float>::packed(q.data(), 2, 4, 8);
  HostState out8(2, 4, 8);
  expect_error([&] { reference::dense_decode(q8, kv.view(), out8.view); },
               {"reference::dense_decode", "kv.head_dim (= 16) != q.head_dim (= 8)"});
}

TEST_F(BadInput, QHeadsNotAMultipleOfKvHeads) {
  auto q3 = QueryView<const float>::packed(q.data(), 2, 3, 16);
  HostState out3(2, 3, 16);
  expect_error([&] { reference::dense_decode(q3, kv.view(), out3.view); },
               {"q.heads (= 3) is not a multiple of kv.kv_heads (= 2)"});
}

TEST_F(BadInput, NullPointers) {
  auto no_q = qv;
  no_q.data = nullptr;
  expect_error([&] { reference::dense_decode(no_q, kv.view(), out.view); }, {"q.data is a null pointer"});
  auto no_v = kv.view();
  no_v.v = nullptr;
  expect_error([&] { reference::dense_decode(qv, no_v, out.view); }, {"kv.v is a null pointer"});
  auto no_lse = out.view;
  no_lse.lse = nullptr;
  expect_error([&] { reference::dense_decode(qv, kv.view(), no_lse); }, {"out.lse is a null pointer"});
}

TEST_F(BadInput, ZeroOrNegativeSizes) {
  auto zero_batch = qv;
  zero_batch.batch = 0;
  expect_error([&] { reference::dense_decode(zero_batch, kv.view(), out.view); }, {"q.batch (= 0) must be positive"});
  auto neg = kv.view();
  neg.capacity = -5;
  expect_error([&] { reference::dense_decode(qv, neg, out.view); }, {"kv.capacity (= -5) must be positive"});
}

TEST_F(BadInput, SequenceLengthBeyondCapacity) {
  kv.seq_lens[1] = 41;
  expect_error([&] { reference::dense_decode(qv, kv.view(), out.view); },
               {"kv.seq_lens[1] (= 41) is outside [0, capacity = 40]"});
}

TEST_F(BadInput, StridesInconsistentWithShape) {
  auto overlapping = kv.view();
  overlapping.token_stride = 8;  // rows of 16 channels overlap
  expect_error([&] { reference::dense_decode(qv, overlapping, out.view); },
               {"kv: strides inconsistent with shape", "token stride (= 8)"});
  auto bad_out = out.view;
  bad_out.o_head_stride = 15;
  expect_error([&] { reference::dense_decode(qv, kv.view(), bad_out); }, {"out: strides inconsistent with shape"});
}

TEST_F(BadInput, PageTableEntriesOutOfRange) {
  test::HostPagedKV paged(kv, 16, false, rng);
  paged.indices[1] = paged.view.num_pages;
  expect_error([&] { reference::dense_decode(qv, paged.view, out.view); },
               {"kv.page_indices[1]", "is outside [0, num_pages"});
  paged.indices[1] = 0;
  paged.last_len[0] = 17;
  expect_error([&] { reference::dense_decode(qv, paged.view, out.view); },
               {"kv.last_page_len[0] (= 17) is outside [1, page_size = 16]"});
  paged.last_len[0] = 8;
  paged.indptr[2] = paged.indptr[1] - 1;
  expect_error([&] { reference::dense_decode(qv, paged.view, out.view); }, {"kv.page_indptr decreases"});
}

TEST_F(BadInput, SelectionCountsAndIndicesOutOfRange) {
  HostSelection sel(2, 2, 8, false);
  std::fill(sel.counts.begin(), sel.counts.end(), 2);
  std::fill(sel.indices.begin(), sel.indices.end(), 3);
  sel.counts[3] = 9;
  expect_error([&] { reference::sparse_decode(qv, kv.view(), sel.view, out.view); },
               {"selection.counts (= 9) at batch 1, kv_head 1 is outside [0, capacity = 8]"});
  sel.counts[3] = 2;
  sel.view.row(1, 0)[1] = 40;
  expect_error([&] { reference::sparse_decode(qv, kv.view(), sel.view, out.view); },
               {"selection.indices[1] (= 40) at batch 1, kv_head 0 is outside [0, seq_len = 40)"});
  HostSelection wrong_heads(2, 1, 8, false);
  expect_error([&] { reference::sparse_decode(qv, kv.view(), wrong_heads.view, out.view); },
               {"selection.kv_heads (= 1) != kv.kv_heads (= 2)"});
}

TEST_F(BadInput, MergeShapeMismatch) {
  std::vector<float> o(2 * 4 * 8, 1.0f), lse(8, 0.0f);
  const auto other = StateView<const float>::packed(o.data(), lse.data(), 2, 4, 8);
  expect_error([&] { reference::merge_states<float, float>(std::vector{other}, out.view); },
               {"partials[0] shape [2, 4, 8] != out shape [2, 4, 16]"});
  expect_error([&] { reference::merge_states<float, float>(std::span<const StateView<const float>>{}, out.view); },
               {"partials is empty"});
}

TEST_F(BadInput, SelectionDuplicatesAreAttendedOncePerOccurrenceByTheReferenceButRefusedByMetrics) {
  HostSelection sel(2, 2, 8, false);
  std::fill(sel.counts.begin(), sel.counts.end(), 2);
  for (std::size_t r = 0; r < 4; ++r) sel.indices[r * 8] = 3, sel.indices[r * 8 + 1] = 5;
  sel.view.row(1, 1)[1] = 3;
  EXPECT_NO_THROW(reference::sparse_decode(qv, kv.view(), sel.view, out.view));
  expect_error([&] { attention_mass_recall(qv, kv.view(), sel.view); },
               {"attention_mass_recall", "selection.indices[1] (= 3) at batch 1, kv_head 1 repeats selection.indices[0]"});
}

TEST(SelectionBufferBadInput, SizesMustBePositive) {
  expect_error([] { SelectionBuffer(2, -1, 8, false); },
               {"SelectionBuffer", "batch (= 2), kv_heads (= -1) and capacity (= 8) must be positive"});
  expect_error([] { SelectionBuffer(-3, 2, 8, true); }, {"batch (= -3)"});
  expect_error([] { SelectionBuffer(1, 1, 0, false); }, {"capacity (= 0) must be positive"});
  expect_error([] { SelectionBuffer(1 << 30, 1 << 30, 1 << 30, false); }, {"SelectionBuffer", "overflows"});
  const SelectionBuffer ok(2, 3, 4, true);
  EXPECT_EQ(ok.view().capacity, 4);
}

TEST(Metrics, EmptySequencesAndZeroReferencesAreDefined) {
  // relative_l2_error against a zero reference: 0 when the result is zero too, +inf otherwise.
  const std::vector<float> zeros(5, 0.0f), ones(5, 1.0f);
  EXPECT_EQ(relative_l2_error(zeros, zeros), 0.0);
  EXPECT_EQ(relative_l2_error(ones, zeros), std::numeric_limits<double>::infinity());
  EXPECT_EQ(relative_l2_error(std::span<const float>{}, std::span<const float>{}), 0.0);
  EXPECT_DOUBLE_EQ(relative_l2_error(std::vector<float>{1, 1}, std::vector<float>{1, 0}), 1.0);
  // A sequence with no tokens has nothing to drop: its heads count as recall 1.
  test::Random rng(test::test_seed());
  test::HostKV kv(rng, 2, 1, 10, 8, {0, 10});
  const auto q = rng.normal(2 * 2 * 8);
  HostSelection sel(2, 1, 4, false);
  std::fill(sel.counts.begin(), sel.counts.end(), 0);
  const double recall = attention_mass_recall(QueryView<const float>::packed(q.data(), 2, 2, 8), kv.view(), sel.view);
  EXPECT_DOUBLE_EQ(recall, 0.5);  // sequence 0: 1 (empty); sequence 1: 0 (nothing selected)
}

TEST(BadRope, RotaryDimMustBeEvenAndFit) {
  expect_error([] { validate(RopeConfig{.rotary_dim = 7}, 16, "rope"); }, {"rope.rotary_dim (= 7)"});
  expect_error([] { validate(RopeConfig{.rotary_dim = 32}, 16, "rope"); }, {"in [2, head_dim = 16]"});
}

TEST(CheckedMul, RefusesOverflow) {
  expect_error([] { checked_mul(std::size_t(1) << 40, std::size_t(1) << 40, "workspace"); },
               {"workspace", "overflows"});
  EXPECT_EQ(checked_mul(3, 5, "x"), 15u);
}

}  // namespace
}  // namespace kvsift
