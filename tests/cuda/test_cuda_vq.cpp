// CUDA codebook quantization, lookup tables and code scan (selectors/a2ats/cuda/vq.hpp) against the fp64 references of
// tests/vq_problem.hpp and against the CPU twins: codes the fp64 argmin and the CPU's except within the stated
// epsilon of a tie; tables within fp32 rounding of fp64 and of the CPU's; scans of one table equal to the CPU's
// bit for bit (per head and the group maximum); the fused form equal to vq_lut then vq_code_scan bit for bit (one-launch form and the two-launch
// form of tables too large for shared memory). Prefill and append destinations, slots out of order, ragged and
// clamped lengths, invalid codes and slots; outputs and workspaces poisoned; every call also captured in a CUDA
// graph and replayed (workspace_check.hpp); refusals before any device call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/cpu/topk.hpp"
#include "kvsift/selectors/a2ats/cpu/vq.hpp"
#include "kvsift/selectors/a2ats/cuda/vq.hpp"
#include "test_util.hpp"
#include "vq_problem.hpp"
#include "workspace_check.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::Random;
using test::ScanProblem;
using test::VqProblem;

class CudaVq : public test::GpuTest {};

template <class... B>
auto poison_all(B&... buffers) {
  return [&buffers...] { (buffers.poison(), ...); };
}
template <class... B>
auto download_all(const B&... buffers) {
  return [&buffers...] { return test::bytes_of(buffers.download()...); };
}

template <class T>
void check_encode(Random& rng, std::int32_t kv_heads, std::int32_t codewords, std::int32_t d, std::int32_t rows) {
  SCOPED_TRACE(testing::Message() << "codewords " << codewords << " d " << d << " rows " << rows);
  const VqProblem p = test::make_vq_problem(rng, kv_heads, codewords, d);
  const std::int64_t centroid_rows = std::int64_t(kv_heads) * codewords;
  std::vector<float> norms(static_cast<std::size_t>(centroid_rows));
  cpu::vq_codeword_norms(MatrixView<const float>::packed(p.centroids.data(), centroid_rows, d), norms.data());
  DeviceBuffer<float> d_transform(p.transform), d_centroids(p.centroids), d_norms(norms.size());
  d_norms.poison();
  cuda::vq_codeword_norms(MatrixView<const float>::packed(d_centroids.data(), centroid_rows, d), d_norms.data(), nullptr);
  const std::vector<float> gpu_norms = d_norms.download();
  for (std::size_t i = 0; i < norms.size(); ++i) ASSERT_NEAR(gpu_norms[i], norms[i], 1e-5 * norms[i]) << "norm " << i;

  const std::int32_t pitch = d + 3, slots = 3, max_tokens = rows + 10, first = 7;
  const std::vector<T> keys = test::to_storage<T>(rng.normal(std::size_t(rows) * kv_heads * pitch));
  DeviceBuffer<T> d_keys(keys);
  const HeadsView<const T> key_view{d_keys.data(), rows, kv_heads, d, std::int64_t(kv_heads) * pitch, pitch};
  const VqEncodeCodebook codebook{d_transform.data(), d_centroids.data(), d_norms.data(), kv_heads, codewords, d};
  DeviceBuffer<std::uint16_t> d_codes(std::size_t(slots) * kv_heads * max_tokens);
  const auto codes_view = VqCodesView<std::uint16_t>::packed(d_codes.data(), slots, kv_heads, max_tokens);
  test::check_device_workspace(
      cuda::vq_encode_workspace_bytes(codewords, d),
      [&](std::span<std::byte> ws, cudaStream_t stream) {
        cuda::vq_encode(key_view, codebook, codes_view, {.slot = 1, .position_offset = first}, ws, stream);
      },
      download_all(d_codes), poison_all(d_codes));
  const std::vector<std::uint16_t> codes = d_codes.download();

  // The CPU twin on the same keys (its own norms).
  std::vector<std::uint16_t> cpu_codes(codes.size(), 0xffff);
  cpu::Array<std::byte> cpu_ws(cpu::vq_encode_workspace_bytes(codewords, d, nullptr));
  const VqEncodeCodebook host_codebook{p.transform.data(), p.centroids.data(), norms.data(), kv_heads, codewords, d};
  cpu::vq_encode(HeadsView<const T>{keys.data(), rows, kv_heads, d, std::int64_t(kv_heads) * pitch, pitch}, host_codebook,
                 VqCodesView<std::uint16_t>::packed(cpu_codes.data(), slots, kv_heads, max_tokens),
                 {.slot = 1, .position_offset = first}, cpu_ws.bytes());

  std::int32_t near_ties = 0;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    const auto t = std::int32_t(i % max_tokens), h = std::int32_t(i / max_tokens % kv_heads);
    const auto s = std::int32_t(i / max_tokens / kv_heads);
    if (s != 1 || t < first || t >= first + rows) {
      ASSERT_EQ(codes[i], 0xffff) << "written outside the destination at slot " << s << " token " << t;
      continue;
    }
    std::vector<double> k(d);
    for (std::int32_t j = 0; j < d; ++j) k[j] = to_float(keys[(std::size_t(t - first) * kv_heads + h) * pitch + j]);
    const auto forms = test::vq_forms(p, h, k);
    const bool tie = test::expect_vq_code(forms, p, h, codes[i]);
    near_ties += tie ? 1 : 0;
    if (!tie) {
      EXPECT_EQ(codes[i], cpu_codes[i]) << "row " << t - first << " head " << h << ": CUDA and CPU codes differ";
    }
  }
  EXPECT_LE(near_ties, rows * kv_heads / 20 + 1) << "too many rows excused as near ties";

  // Append: each sequence's new key at (slot, length - 1); a slot past the codes and an empty sequence write nothing.
  const std::vector<std::int32_t> row_slots = {2, 0, 1, 3, 0}, lengths = {5, 1, max_tokens, 4, 0};
  const std::int32_t appended = std::min(rows, 5);
  DeviceBuffer<std::int32_t> d_slots(row_slots), d_lengths(lengths);
  DeviceBuffer<std::uint16_t> d_step(codes.size());
  d_step.poison();
  cuda::vq_encode(HeadsView<const T>{d_keys.data(), appended, kv_heads, d, std::int64_t(kv_heads) * pitch, pitch},
                  codebook, VqCodesView<std::uint16_t>::packed(d_step.data(), slots, kv_heads, max_tokens),
                  {.slots = d_slots.data(), .positions = d_lengths.data(), .position_offset = -1}, {}, nullptr);
  const std::vector<std::uint16_t> step = d_step.download();
  std::size_t valid = 0, written = 0;
  for (std::int32_t r = 0; r < appended; ++r) {
    const std::int32_t slot = row_slots[r], position = lengths[r] - 1;
    if (slot >= slots || position < 0) continue;
    for (std::int32_t h = 0; h < kv_heads; ++h, ++valid) {
      EXPECT_EQ(step[(std::size_t(slot) * kv_heads + h) * max_tokens + position],
                codes[(std::size_t(1) * kv_heads + h) * max_tokens + first + r])
          << "row " << r << " head " << h << ": the appended key's code differs from its prefill code";
    }
  }
  for (const std::uint16_t c : step) written += c != 0xffff ? 1 : 0;
  EXPECT_EQ(written, valid) << "codes written outside the rows' destinations";
}

TEST_F(CudaVq, EncodeIsTheFp64ArgminAndTheCpus) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_encode<float>(rng, 2, 16, 64, 70);
  check_encode<bfloat16>(rng, 2, 256, 128, 45);
  check_encode<half>(rng, 1, 4096, 64, 33);
  check_encode<bfloat16>(rng, 1, 4096, 128, 100);
  check_encode<half>(rng, 3, 256, 64, 130);
  // Several blocks of 256 keys, the last one partial (the tensor-core kernel's row tiles).
  check_encode<bfloat16>(rng, 2, 4096, 128, 600);
  check_encode<half>(rng, 2, 64, 64, 530);
  check_encode<float>(rng, 1, 1000, 128, 257);  // a partial last tile of 32 codewords
}

TEST_F(CudaVq, EncodeOfFewRowsIsTheFp64ArgminAndTheCpus) {
  // Up to 256 rows the few-rows kernel runs: a cluster of blocks per (8 rows, kv head), each a slice of the
  // codewords (8 kv heads: clusters of 8; 33 rows: 5 row groups, clusters of 3).
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const std::int32_t rows : {1, 3, 8, 33}) {
    check_encode<bfloat16>(rng, 8, 4096, 128, rows);
    check_encode<half>(rng, 8, 64, 64, rows);
  }
  check_encode<half>(rng, 2, 1000, 128, 3);     // slices of 125 codewords: partial 64-codeword stages
  check_encode<float>(rng, 1, 4096, 64, 256);   // the most rows it takes: 32 row groups
  check_encode<bfloat16>(rng, 3, 40, 128, 17);  // fewer codewords than one stage
}

TEST(CudaVqBadInput, EncodeRefusesUnalignedCentroids) {
  // Host pointers stand in for device memory: the refusal comes before a device call reads them.
  alignas(16) static float f[64];
  alignas(16) static half h[64];
  static std::uint16_t c[64];
  const VqEncodeCodebook cb{f, f + 1, f, 2, 16, 64};
  test::expect_error([&] { cuda::vq_encode(HeadsView<const half>::packed(h, 64, 2, 64), cb,
                                           VqCodesView<std::uint16_t>::packed(c, 2, 2, 10), {}, {}, nullptr); },
                     {"cuda::vq_encode: codebook.centroids (", ") is not 16-byte aligned"});
}

/// The key-space codebook rounded to T, [kv_heads, codewords, d].
template <class T>
std::vector<T> key_codebook(const VqProblem& p) {
  std::vector<float> c(p.key_space.size());
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = float(p.key_space[i]);
  return test::to_storage<T>(c);
}

template <class T>
void check_lut(Random& rng, std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads, std::int32_t codewords,
               std::int32_t d) {
  SCOPED_TRACE(testing::Message() << "batch " << batch << " heads " << q_heads << "/" << kv_heads << " codewords "
                                  << codewords << " d " << d);
  const VqProblem p = test::make_vq_problem(rng, kv_heads, codewords, d);
  const std::vector<T> cb = key_codebook<T>(p);
  const std::vector<T> q = test::to_storage<T>(rng.normal(std::size_t(batch) * q_heads * d));
  const std::int64_t rows = std::int64_t(batch) * q_heads, stride = codewords + 5;
  DeviceBuffer<T> d_cb(cb), d_q(q);
  DeviceBuffer<float> d_lut(std::size_t(rows * stride));
  d_lut.poison();
  cuda::vq_lut(QueryView<const T>::packed(d_q.data(), batch, q_heads, d), VqCodebook<T>{d_cb.data(), kv_heads, codewords, d},
               MatrixView<float>{d_lut.data(), rows, codewords, stride}, nullptr);
  const std::vector<float> lut = d_lut.download();
  std::vector<float> cpu_lut(std::size_t(rows) * codewords);
  cpu::vq_lut(QueryView<const T>::packed(q.data(), batch, q_heads, d), VqCodebook<T>{cb.data(), kv_heads, codewords, d},
              MatrixView<float>::packed(cpu_lut.data(), rows, codewords));
  const std::int32_t group = q_heads / kv_heads;
  std::vector<double> qd(d), cd(d);
  for (std::int64_t row = 0; row < rows; ++row) {
    for (std::int32_t j = 0; j < d; ++j) qd[j] = to_float(q[row * d + j]);
    const std::int32_t g = std::int32_t(row % q_heads) / group;
    for (std::int32_t c = 0; c < codewords; ++c) {
      double want = 0;
      for (std::int32_t j = 0; j < d; ++j) {
        cd[j] = to_float(cb[(std::size_t(g) * codewords + c) * d + j]);
        want += qd[j] * cd[j];
      }
      const double bound = test::vq_lut_bound(qd.data(), cd.data(), d);
      ASSERT_NEAR(lut[row * stride + c], want, bound) << "row " << row << " c " << c;
      ASSERT_NEAR(lut[row * stride + c], cpu_lut[row * codewords + c], 2 * bound) << "row " << row << " c " << c;
    }
    for (std::int64_t c = codewords; c < stride; ++c) ASSERT_TRUE(std::isnan(lut[row * stride + c])) << "padding written";
  }
}

TEST_F(CudaVq, TablesAreQueryDotCodewordAsOnTheCpu) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_lut<float>(rng, 2, 8, 2, 16, 64);
  check_lut<bfloat16>(rng, 3, 12, 4, 256, 128);
  check_lut<half>(rng, 1, 32, 8, 4096, 64);
  check_lut<bfloat16>(rng, 2, 10, 2, 1000, 128);  // group 5: a partial pass of four heads
}

TEST_F(CudaVq, CodeScanEqualsTheCpuBitForBit) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const auto& [batch, q_heads, kv_heads, codewords, cols] :
       {std::tuple{5, 8, 2, 16, 333}, std::tuple{4, 4, 4, 256, 1000}, std::tuple{2, 32, 8, 4096, 20051},
        std::tuple{1, 6, 2, 65536, 100}}) {
    SCOPED_TRACE(testing::Message() << "batch " << batch << " codewords " << codewords << " cols " << cols);
    const ScanProblem sp(rng, batch, q_heads, kv_heads, codewords, cols, true);
    const std::int64_t rows = std::int64_t(batch) * q_heads;
    std::vector<float> want(std::size_t(rows) * cols, test::kScoreSentinel);
    cpu::vq_code_scan(sp.lut_view(), batch, sp.codes_view(), sp.slot_of.data(), sp.lengths.data(),
                      MatrixView<float>::packed(want.data(), rows, cols), {});
    EXPECT_TRUE(test::same_bytes(want, sp.expected(sp.lut)));
    DeviceBuffer<float> d_lut(sp.lut), d_scores(want.size());
    DeviceBuffer<std::uint16_t> d_codes(sp.codes);
    DeviceBuffer<std::int32_t> d_slots(sp.slot_of), d_lengths(sp.lengths);
    const std::vector<float> sentinel(want.size(), test::kScoreSentinel);
    test::check_device_workspace(
        0,
        [&](std::span<std::byte>, cudaStream_t stream) {
          cuda::vq_code_scan(MatrixView<const float>::packed(d_lut.data(), rows, codewords), batch,
                             VqCodesView<const std::uint16_t>::packed(d_codes.data(), sp.slots, kv_heads, sp.max_tokens),
                             d_slots.data(), d_lengths.data(), MatrixView<float>::packed(d_scores.data(), rows, cols),
                             {}, stream);
        },
        download_all(d_scores), [&] { d_scores.upload(sentinel); });
    EXPECT_TRUE(test::same_bytes(d_scores.download(), want));
    // The group maximum (one row per kv head) equals the CPU's bit for bit (the CPU test checks it against the
    // maximum of the per-head rows).
    const std::int64_t kv_rows = std::int64_t(batch) * kv_heads;
    std::vector<float> want_max(std::size_t(kv_rows) * cols, test::kScoreSentinel);
    cpu::vq_code_scan(sp.lut_view(), batch, sp.codes_view(), sp.slot_of.data(), sp.lengths.data(),
                      MatrixView<float>::packed(want_max.data(), kv_rows, cols), {.group_max = true});
    DeviceBuffer<float> d_max(want_max.size());
    d_max.upload(std::vector<float>(want_max.size(), test::kScoreSentinel));
    cuda::vq_code_scan(MatrixView<const float>::packed(d_lut.data(), rows, codewords), batch,
                       VqCodesView<const std::uint16_t>::packed(d_codes.data(), sp.slots, kv_heads, sp.max_tokens),
                       d_slots.data(), d_lengths.data(), MatrixView<float>::packed(d_max.data(), kv_rows, cols),
                       {.group_max = true}, nullptr);
    EXPECT_TRUE(test::same_bytes(d_max.download(), want_max)) << "group maximum";
  }
}

template <class T>
void check_lut_scan(Random& rng, std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads, std::int32_t codewords,
                    std::int32_t d, std::int32_t cols, bool expect_fused) {
  SCOPED_TRACE(testing::Message() << "batch " << batch << " heads " << q_heads << "/" << kv_heads << " codewords "
                                  << codewords << " d " << d << " cols " << cols);
  const VqProblem p = test::make_vq_problem(rng, kv_heads, codewords, d);
  const std::vector<T> cb = key_codebook<T>(p);
  const std::vector<T> q = test::to_storage<T>(rng.normal(std::size_t(batch) * q_heads * d));
  const ScanProblem sp(rng, batch, q_heads, kv_heads, codewords, cols, true);
  const std::int64_t rows = std::int64_t(batch) * q_heads;
  DeviceBuffer<T> d_cb(cb), d_q(q);
  DeviceBuffer<float> d_lut(std::size_t(rows) * codewords), d_scores(std::size_t(rows) * cols);
  DeviceBuffer<std::uint16_t> d_codes(sp.codes);
  DeviceBuffer<std::int32_t> d_slots(sp.slot_of), d_lengths(sp.lengths);
  const auto qv = QueryView<const T>::packed(d_q.data(), batch, q_heads, d);
  const VqCodebook<T> codebook{d_cb.data(), kv_heads, codewords, d};
  const auto codes = VqCodesView<const std::uint16_t>::packed(d_codes.data(), sp.slots, kv_heads, sp.max_tokens);
  const auto scores = MatrixView<float>::packed(d_scores.data(), rows, cols);

  // vq_lut then vq_code_scan on the device, and the CPU's scan of that table: the reference.
  cuda::vq_lut(qv, codebook, MatrixView<float>::packed(d_lut.data(), rows, codewords), nullptr);
  const std::vector<float> lut = d_lut.download();
  const std::vector<float> want = sp.expected(lut);
  const std::vector<float> sentinel(want.size(), test::kScoreSentinel);
  d_scores.upload(sentinel);
  cuda::vq_code_scan(MatrixView<const float>::packed(d_lut.data(), rows, codewords), batch, codes, d_slots.data(),
                     d_lengths.data(), scores, {}, nullptr);
  EXPECT_TRUE(test::same_bytes(d_scores.download(), want)) << "vq_lut then vq_code_scan";

  const std::size_t bytes = cuda::vq_lut_scan_workspace_bytes(batch, q_heads, kv_heads, codewords, d);
  EXPECT_EQ(bytes == 0, expect_fused) << "workspace " << bytes;
  test::check_device_workspace(
      bytes,
      [&](std::span<std::byte> ws, cudaStream_t stream) {
        cuda::vq_lut_scan(qv, codebook, codes, d_slots.data(), d_lengths.data(), scores, {}, ws, stream);
      },
      download_all(d_scores), [&] { d_scores.upload(sentinel); });
  EXPECT_TRUE(test::same_bytes(d_scores.download(), want)) << "the fused form differs from vq_lut then vq_code_scan";
  // The group maximum of the fused (or two-launch) form: the CPU's group-maximum scan of the device's tables.
  const std::int64_t kv_rows = std::int64_t(batch) * kv_heads;
  std::vector<float> want_max(std::size_t(kv_rows) * cols, test::kScoreSentinel);
  cpu::vq_code_scan(MatrixView<const float>::packed(lut.data(), rows, codewords), batch, sp.codes_view(),
                    sp.slot_of.data(), sp.lengths.data(), MatrixView<float>::packed(want_max.data(), kv_rows, cols),
                    {.group_max = true});
  DeviceBuffer<float> d_max(want_max.size());
  const std::vector<float> max_sentinel(want_max.size(), test::kScoreSentinel);
  test::check_device_workspace(
      bytes,
      [&](std::span<std::byte> ws, cudaStream_t stream) {
        cuda::vq_lut_scan(qv, codebook, codes, d_slots.data(), d_lengths.data(),
                          MatrixView<float>::packed(d_max.data(), kv_rows, cols), {.group_max = true}, ws, stream);
      },
      download_all(d_max), [&] { d_max.upload(max_sentinel); });
  EXPECT_TRUE(test::same_bytes(d_max.download(), want_max)) << "group maximum";
}

TEST_F(CudaVq, FusedTablesAndScanEqualTheTwoLaunches) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_lut_scan<bfloat16>(rng, 1, 32, 8, 4096, 128, 40000, true);  // A²ATS's shape: group 4, 64 KB of tables
  check_lut_scan<half>(rng, 5, 16, 2, 4096, 64, 3001, true);       // group 8: 128 KB
  check_lut_scan<float>(rng, 3, 4, 4, 16, 64, 300, true);          // group 1, fewer codewords than the cluster's blocks
  check_lut_scan<bfloat16>(rng, 2, 6, 2, 100, 128, 77, true);      // group 3
  check_lut_scan<half>(rng, 2, 16, 2, 16384, 64, 999, false);      // 512 KB of tables: two launches via the workspace
}

/// cuda::vq_topk_rows against cpu::topk_rows (equal to cuda::topk_rows by contract) of the CPU's scan of the device's
/// own tables (equal to the device's scan bit for bit, CodeScanEqualsTheCpuBitForBit): per-head rows and their
/// union, or the group maximum; invalid codes and slots, ragged and too-long lengths, an attention window, budgets
/// per row; outputs and workspace poisoned, the call replayed from a graph.
template <class T>
void check_topk_rows(Random& rng, std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                     std::int32_t codewords, std::int32_t d, std::int32_t cols, std::int32_t k, bool group_max) {
  SCOPED_TRACE(testing::Message() << "batch " << batch << " heads " << q_heads << "/" << kv_heads << " codewords "
                                  << codewords << " cols " << cols << " k " << k << " group_max " << group_max);
  const VqProblem p = test::make_vq_problem(rng, kv_heads, codewords, d);
  const std::vector<T> cb = key_codebook<T>(p);
  const std::vector<T> q = test::to_storage<T>(rng.normal(std::size_t(batch) * q_heads * d));
  const ScanProblem sp(rng, batch, q_heads, kv_heads, codewords, cols, true);
  const std::int32_t group = q_heads / kv_heads, heads_per_row = group_max ? 1 : group;
  const std::int64_t q_rows = std::int64_t(batch) * q_heads;
  const std::int64_t score_rows = std::int64_t(batch) * (group_max ? kv_heads : q_heads);
  std::vector<std::int32_t> row_k(std::size_t(batch) * kv_heads);
  for (auto& r : row_k) r = rng.uniform_int(0, k);
  row_k[0] = std::max(row_k[0], 1);  // the first row is valid and chooses: a call of one row always tests something
  DeviceBuffer<T> d_cb(cb), d_q(q);
  DeviceBuffer<float> d_lut(std::size_t(q_rows) * codewords);
  DeviceBuffer<std::uint16_t> d_codes(sp.codes);
  DeviceBuffer<std::int32_t> d_slots(sp.slot_of), d_lengths(sp.lengths), d_row_k(row_k);
  const auto qv = QueryView<const T>::packed(d_q.data(), batch, q_heads, d);
  const VqCodebook<T> codebook{d_cb.data(), kv_heads, codewords, d};
  const auto codes = VqCodesView<const std::uint16_t>::packed(d_codes.data(), sp.slots, kv_heads, sp.max_tokens);
  cuda::vq_lut(qv, codebook, MatrixView<float>::packed(d_lut.data(), q_rows, codewords), nullptr);
  const std::vector<float> lut = d_lut.download();
  const AttentionWindow window{.sink = 3, .recent = 5};
  const std::int32_t capacity = heads_per_row * k;

  // nan_marks_row (one score row per selection row): a row whose middle holds a NaN token gets count -1. Only from 4
  // sequences, whose third has length 0 (count 0): with one or two rows every row may be marked, and -1 is the
  // outputs' poison, which check_device_workspace takes for a call that wrote nothing.
  for (const auto& [per_row_budgets, nan_marks_row] : {std::pair{false, false}, std::pair{true, false}, std::pair{true, true}}) {
    if (nan_marks_row && (heads_per_row != 1 || batch < 4)) continue;
    SCOPED_TRACE(testing::Message() << "per-row budgets " << per_row_budgets << " nan_marks_row " << nan_marks_row);
    std::vector<float> scores(std::size_t(score_rows) * cols, test::kScoreSentinel);
    cpu::vq_code_scan(MatrixView<const float>::packed(lut.data(), q_rows, codewords), batch, sp.codes_view(),
                      sp.slot_of.data(), sp.lengths.data(), MatrixView<float>::packed(scores.data(), score_rows, cols),
                      {.group_max = group_max});
    std::vector<std::int32_t> want(std::size_t(batch) * kv_heads * capacity, -7), want_counts(row_k.size(), -7);
    const TopKRowsOptions host_options{.window = window,
                                       .row_k = per_row_budgets ? row_k.data() : nullptr,
                                       .heads_per_row = heads_per_row,
                                       .nan_marks_row = nan_marks_row};
    cpu::Array<std::byte> host_ws(cpu::topk_rows_workspace_bytes(score_rows, cols, k, host_options, nullptr));
    // cpu::topk_rows refuses a length past cols; such rows get count -1 on the device, as they do from cuda::topk_rows.
    std::vector<std::int32_t> host_lengths = sp.lengths;
    for (auto& len : host_lengths) len = std::min(len, cols);
    cpu::topk_rows(MatrixView<const float>::packed(scores.data(), score_rows, cols), host_lengths.data(), k,
                   host_options, SelectionView{want.data(), want_counts.data(), nullptr, batch, kv_heads, capacity},
                   host_ws.bytes());

    DeviceBuffer<std::int32_t> d_out(want.size()), d_counts(want_counts.size());
    const VqTopKShape shape{.batch = batch, .q_heads = q_heads, .kv_heads = kv_heads, .codewords = codewords,
                            .head_dim = d, .max_tokens = cols, .k = k, .scan = {.group_max = group_max}};
    const TopKRowsOptions options{.window = window,
                                  .row_k = per_row_budgets ? d_row_k.data() : nullptr,
                                  .heads_per_row = heads_per_row,
                                  .nan_marks_row = nan_marks_row};
    test::check_device_workspace(
        cuda::vq_topk_rows_workspace_bytes(shape),
        [&](std::span<std::byte> ws, cudaStream_t stream) {
          cuda::vq_topk_rows(qv, codebook, codes, d_slots.data(), d_lengths.data(), shape, options,
                             SelectionView{d_out.data(), d_counts.data(), nullptr, batch, kv_heads, capacity}, ws,
                             stream);
        },
        download_all(d_out, d_counts), poison_all(d_out, d_counts));
    const std::vector<std::int32_t> got = d_out.download(), counts = d_counts.download();
    std::int32_t chosen = 0, marked = 0;
    for (std::size_t r = 0; r < row_k.size(); ++r) {
      const std::int32_t b = std::int32_t(r) / kv_heads;
      if (sp.lengths[std::size_t(b)] > cols) {
        EXPECT_EQ(counts[r], -1) << "row " << r << ": a length past max_tokens";
        continue;
      }
      ASSERT_EQ(counts[r], want_counts[r]) << "row " << r;
      for (std::int32_t i = 0; i < counts[r]; ++i) {
        ASSERT_EQ(got[r * capacity + i], want[r * capacity + i]) << "row " << r << " entry " << i;
      }
      chosen += std::max(counts[r], 0);
      marked += counts[r] < 0 ? 1 : 0;
    }
    EXPECT_GT(chosen + marked, 0) << "no row chose a token or was marked: the comparison tested nothing";
  }
}

TEST_F(CudaVq, TopKRowsEqualTheCpuTopKOfTheScan) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const bool group_max : {false, true}) {
    // The count select, a CTA per row (64 selection rows or more, up to 8 score rows each): rows of one CTA's size,
    // A²ATS's heads, long rows, and 16 codewords for 5000 tokens (ties of hundreds of tokens at each head's
    // threshold).
    check_topk_rows<bfloat16>(rng, 16, 8, 4, 256, 128, 3001, 100, group_max);
    check_topk_rows<half>(rng, 8, 32, 8, 4096, 64, 9000, 300, group_max);
    check_topk_rows<bfloat16>(rng, 16, 8, 4, 1000, 128, 40000, 700, group_max);
    check_topk_rows<half>(rng, 32, 8, 2, 16, 64, 5000, 400, group_max);
    // The count select in slices of 8192 tokens (fewer rows, 128 (row, slice) CTAs or more): 16 rows of 9 slices
    // over 16 codewords (ties of thousands across slices), 32 rows of 5, a union of 8 heads, 40 rows of 4 with
    // groups of 4; 64 rows whose 8 heads' words at 8000 codewords leave a CTA per row short of shared memory.
    check_topk_rows<half>(rng, 8, 8, 2, 16, 64, 70001, 900, group_max);
    check_topk_rows<bfloat16>(rng, 4, 16, 8, 1000, 128, 40000, 700, group_max);
    check_topk_rows<half>(rng, 2, 64, 8, 256, 64, 70000, 400, group_max);
    check_topk_rows<float>(rng, 40, 4, 1, 64, 64, 30000, 50, group_max);
    check_topk_rows<bfloat16>(rng, 8, 64, 8, 8000, 64, 9000, 300, group_max);
    // Rows of 2.2M tokens: 256 slices (the most) of up to 8600 tokens, more than one pass of the picks kernel.
    check_topk_rows<half>(rng, 5, 2, 1, 16, 64, 2200000, 500, group_max);
    // Fewer CTAs, or groups of 16 (union): topk_rows' one-CTA and held kernels fed by the codes; with 20000
    // codewords (past their tables' 16384), or with the slice kernel's plan (160 score rows), the composed form.
    // With group_max the groups of 16 take the count select again.
    check_topk_rows<bfloat16>(rng, 5, 8, 2, 256, 128, 3001, 100, group_max);
    check_topk_rows<bfloat16>(rng, 1, 8, 2, 1000, 128, 40000, 700, group_max);
    check_topk_rows<half>(rng, 1, 16, 1, 1000, 64, 9000, 200, group_max);
    check_topk_rows<bfloat16>(rng, 1, 16, 1, 1000, 64, 40000, 300, group_max);
    check_topk_rows<half>(rng, 1, 16, 1, 20000, 64, 3000, 100, group_max);
  }
}

// The workspace holds what the call's form reads: vq_lut's tables; the count select in slices (128K, batch 1: 8 rows
// of 16 slices) its counts, classes and look-back values besides; a CTA per row (batch 8: 64 rows) nothing more;
// the composed form (32K, batch 1: 8 rows of 4 slices; groups of 16) the score rows.
TEST_F(CudaVq, TopKRowsWorkspaceHoldsOnlyWhatItsFormReads) {
  for (const bool group_max : {false, true}) {
    SCOPED_TRACE(testing::Message() << "group_max " << group_max);
    const auto shape = [&](std::int32_t batch, std::int32_t tokens) {
      return VqTopKShape{.batch = batch, .q_heads = 32, .kv_heads = 8, .codewords = 4096, .head_dim = 128,
                         .max_tokens = tokens, .k = 3932, .scan = {.group_max = group_max}};
    };
    const auto tables = [](std::int32_t batch) { return sizeof(float) * batch * 32 * 4096; };
    const auto score_rows = [&](std::int32_t batch, std::int32_t tokens) {
      return sizeof(float) * batch * (group_max ? 8 : 32) * std::size_t(tokens);
    };
    EXPECT_GE(cuda::vq_topk_rows_workspace_bytes(shape(8, 131072)), tables(8));
    EXPECT_LT(cuda::vq_topk_rows_workspace_bytes(shape(8, 131072)), tables(8) + tables(8) / 8);
    EXPECT_GT(cuda::vq_topk_rows_workspace_bytes(shape(1, 131072)), tables(1) + 2 * sizeof(std::uint32_t) * 8 * 4097);
    EXPECT_LT(cuda::vq_topk_rows_workspace_bytes(shape(1, 131072)), score_rows(1, 131072) / 4);
    EXPECT_GT(cuda::vq_topk_rows_workspace_bytes(shape(1, 32768)), score_rows(1, 32768));
  }
  const VqTopKShape group_of_16{.batch = 1, .q_heads = 32, .kv_heads = 2, .codewords = 4096, .head_dim = 128,
                                .max_tokens = 131072, .k = 3932, .scan = {}};
  EXPECT_GT(cuda::vq_topk_rows_workspace_bytes(group_of_16), sizeof(float) * 32 * std::size_t(131072));
}

TEST(CudaVqBadInput, RefusedBeforeAnyDeviceCall) {
  // Host pointers stand in for device memory: every refusal comes before a device call reads them.
  alignas(16) static float f[64];
  alignas(16) static half h[64];
  static std::uint16_t c[64];
  static std::int32_t ints[4];
  const auto keys = HeadsView<const half>::packed(h, 64, 2, 64);
  const auto codes = VqCodesView<std::uint16_t>::packed(c, 2, 2, 10);
  VqEncodeCodebook cb{f, f, f, 2, 0, 64};
  test::expect_error([&] { cuda::vq_encode(keys, cb, codes, {}, {}, nullptr); },
                     "cuda::vq_encode: codebook.codewords (= 0) is outside [1, 65536]");
  cb.codewords = 65537;
  test::expect_error([&] { cuda::vq_encode(keys, cb, codes, {}, {}, nullptr); }, "(= 65537) is outside [1, 65536]");
  cb.codewords = 16;
  test::expect_error([&] { cuda::vq_encode(HeadsView<const half>::packed(h, 64, 2, 96), cb, codes, {}, {}, nullptr); },
                     "keys.head_dim (= 96) is not supported (supported: 64, 128)");
  test::expect_error([&] { cuda::vq_encode(keys, cb, VqCodesView<std::uint16_t>::packed(c, 2, 1, 10), {}, {}, nullptr); },
                     "codes.kv_heads (= 1) != keys.heads (= 2)");
  test::expect_error([] { (void)cuda::vq_encode_workspace_bytes(16, 256); }, "head_dim (= 256) is not supported");

  const auto q = QueryView<const half>::packed(h, 1, 8, 64);
  const VqCodebook<half> book{h, 2, 16, 64};
  const auto lut = MatrixView<float>::packed(f, 8, 16);
  test::expect_error([&] { cuda::vq_lut(q, book, MatrixView<float>::packed(f, 8, 15), nullptr); },
                     "lut is [8, 15]; expected [batch * q_heads = 1 * 8, codewords = 16]");
  test::expect_error([&] { cuda::vq_lut(q, VqCodebook<half>{h + 1, 2, 16, 64}, lut, nullptr); }, "is not 16-byte aligned");
  test::expect_error([&] { cuda::vq_lut(QueryView<const half>::packed(h, 1, 130, 64), book, MatrixView<float>::packed(f, 130, 16), nullptr); },
                     "q_heads / kv_heads (= 65) exceeds 64 query heads per kv head");
  const auto read = VqCodesView<const std::uint16_t>::packed(c, 2, 2, 10);
  test::expect_error(
      [&] { cuda::vq_code_scan(MatrixView<const float>::packed(f, 8, 16), 1, read, ints, ints, MatrixView<float>::packed(f, 4, 10), {}, nullptr); },
      "scores.rows (= 4) != batch * q_heads (= 1 * 8)");
  test::expect_error(
      [&] {
        cuda::vq_code_scan(MatrixView<const float>::packed(f, 8, 16), 1, read, ints, ints,
                           MatrixView<float>::packed(f, 8, 10), {.group_max = true}, nullptr);
      },
      "scores.rows (= 8) != batch * kv_heads (options.group_max) (= 1 * 2)");
  test::expect_error(
      [&] { cuda::vq_code_scan(MatrixView<const float>::packed(f, 8, 16), 1, VqCodesView<const std::uint16_t>::packed(c, 2, 3, 10), ints, ints, MatrixView<float>::packed(f, 8, 10), {}, nullptr); },
      "q_heads (= 8) is not a multiple of codes.kv_heads (= 3)");
  test::expect_error(
      [&] { cuda::vq_lut_scan(q, book, VqCodesView<const std::uint16_t>::packed(c, 1, 4, 10), ints, ints, MatrixView<float>::packed(f, 8, 10), {}, {}, nullptr); },
      "codes.kv_heads (= 4) != codebook.kv_heads (= 2)");
  test::expect_error([] { (void)cuda::vq_lut_scan_workspace_bytes(1, 8, 2, 70000, 64); }, "codewords (= 70000) is outside");
  // The query refuses what the run refuses.
  test::expect_error([] { (void)cuda::vq_lut_scan_workspace_bytes(1, 130, 2, 4096, 64); },
                     "cuda::vq_lut_scan_workspace_bytes: q_heads / kv_heads (= 65) exceeds 64 query heads per kv head");
  test::expect_error([] { (void)cuda::vq_lut_scan_workspace_bytes(70000, 8, 2, 4096, 64); },
                     "batch (= 70000) exceeds the launch limit of 65535 sequences");

  // vq_topk_rows refuses before it chooses a form (the count select's included): the shared checks.
  const VqTopKShape shape{.batch = 1, .q_heads = 8, .kv_heads = 2, .codewords = 16, .head_dim = 64, .max_tokens = 10, .k = 3, .scan = {}};
  static std::int32_t picked[2 * 12], counts[2];
  const SelectionView out{picked, counts, nullptr, 1, 2, 12};
  const auto topk = [&](const std::int32_t* slots, const TopKRowsOptions& options, const SelectionView& o) {
    return [=, &q, &book, &read] { cuda::vq_topk_rows(q, book, read, slots, ints, shape, options, o, {}, nullptr); };
  };
  test::expect_error(topk(nullptr, {.heads_per_row = 4}, out), "cuda::vq_topk_rows: slots must be non-null");
  test::expect_error(topk(ints, {.heads_per_row = 4}, SelectionView{picked, counts, nullptr, 1, 2, 11}),
                     "out.capacity (= 11) < options.heads_per_row * k (= 4 * 3)");
  test::expect_error(topk(ints, {.heads_per_row = 4, .nan_marks_row = true}, out),
                     "options.nan_marks_row needs options.heads_per_row == 1 (it is 4)");
  test::expect_error(topk(ints, {.heads_per_row = 1}, out), "options.heads_per_row (= 1) must be 4");
}

}  // namespace
}  // namespace kvsift
