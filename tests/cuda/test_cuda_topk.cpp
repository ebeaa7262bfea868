// CUDA top-K against its CPU twin, exactly: cuda::topk_rows == cpu::topk_rows (index sets, order, counts,
// log-weights) over fresh random shapes, ties, NaN and infinities, windows, per-row k and GQA unions; the -1
// counts of device inputs out of range; mass_budgets equal to its CPU twin bit for bit; graph capture and replay; the workspace contract. The launch-shape plan
// and every refusal also run without a GPU.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/topk.hpp"
#include "kvsift/cuda/detail/topk_launch.hpp"
#include "kvsift/cuda/topk.hpp"
#include "mass_budgets_problem.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::Random;

/// A 256-byte aligned host buffer for cpu::topk_rows' workspace.
struct HostWorkspace {
  struct alignas(WorkspaceLayout::kAlignment) Block {
    std::byte bytes[WorkspaceLayout::kAlignment];
  };
  std::vector<Block> blocks;
  std::size_t bytes;
  explicit HostWorkspace(std::size_t n) : blocks(n / sizeof(Block) + 1), bytes(n) {}
  std::span<std::byte> span() { return {reinterpret_cast<std::byte*>(blocks.data()), bytes}; }
};

enum class Scores { continuous, few_values, all_equal };

/// One topk_rows problem in host memory: scores [batch * kv_heads * heads_per_row, cols] with a padded row
/// stride, NaN, ±inf and -0 sprinkled in (not for all_equal); ragged lengths; optional per-row k; with one score
/// row per selection row, half of the problems write their picks through a random id table (TopKRowsOptions::ids).
struct Problem {
  std::int32_t batch, kv_heads, heads_per_row, cols, k;
  AttentionWindow window;
  bool weights;
  bool nan_marks_row;  ///< TopKRowsOptions::nan_marks_row, drawn for rows of one score row each
  std::vector<float> scores;
  std::vector<std::int32_t> lengths, row_k;
  std::vector<float> seed;  ///< TopKRowsOptions::seed per selection row, or empty
  std::vector<std::int32_t> ids;  ///< TopKRowsOptions::ids [selection rows, ids_stride()], or empty

  std::int64_t rows() const { return std::int64_t(batch) * kv_heads * heads_per_row; }
  std::int32_t selection_rows() const { return batch * kv_heads; }
  std::int64_t stride() const { return cols + 5; }
  std::int32_t capacity() const { return heads_per_row * k + 1; }
  std::int64_t ids_stride() const { return cols + 3; }

  Problem(Random& rng, std::int32_t batch_, std::int32_t kv_heads_, std::int32_t heads_per_row_, std::int32_t cols_,
          std::int32_t k_, AttentionWindow window_, Scores kind, bool per_row_k)
      : batch(batch_), kv_heads(kv_heads_), heads_per_row(heads_per_row_), cols(cols_), k(k_), window(window_),
        weights(rng.uniform_int(0, 1) == 1), nan_marks_row(heads_per_row_ == 1 && rng.uniform_int(0, 1) == 1) {
    if (kind == Scores::continuous) {
      scores = rng.normal(std::size_t(rows() * stride()), rng.uniform(0.01f, 100.0f));
    } else {
      scores.resize(std::size_t(rows() * stride()));
      for (auto& s : scores) s = kind == Scores::few_values ? float(rng.uniform_int(-3, 3)) : 0.5f;
    }
    if (kind != Scores::all_equal) {
      for (std::int64_t i = 0; i < std::int64_t(scores.size()) / 500 + 4; ++i) {
        const float specials[] = {NAN, -INFINITY, INFINITY, -0.0f};
        scores[std::size_t(rng.uniform_int(0, std::int32_t(scores.size()) - 1))] = specials[rng.uniform_int(0, 3)];
      }
    }
    for (std::int32_t b = 0; b < batch; ++b) {
      const int what = rng.uniform_int(0, 5);
      lengths.push_back(what == 0   ? 0
                        : what == 1 ? std::min(cols, window.sink + window.recent + rng.uniform_int(0, k))  // middle <= k
                        : what == 2 ? cols
                                    : rng.uniform_int(0, cols));
    }
    if (per_row_k) {
      for (std::int32_t s = 0; s < selection_rows(); ++s) {
        const int what = rng.uniform_int(0, 3);
        row_k.push_back(what == 0 ? 0 : what == 1 ? k : rng.uniform_int(0, k));
      }
    }
    if (heads_per_row == 1 && rng.uniform_int(0, 1) == 1) {
      ids.resize(std::size_t(selection_rows() * ids_stride()));
      for (auto& id : ids) id = rng.uniform_int(0, 1 << 30);
    }
  }

  MatrixView<const float> view(const float* data) const { return {data, rows(), cols, stride()}; }
  TopKRowsOptions options(const std::int32_t* row_k_data, const float* seed_data = nullptr,
                          const std::int32_t* ids_data = nullptr) const {
    return {.window = window, .row_k = row_k.empty() ? nullptr : row_k_data, .heads_per_row = heads_per_row,
            .nan_marks_row = nan_marks_row, .seed = seed.empty() ? nullptr : seed_data,
            .ids = ids.empty() ? nullptr : ids_data, .ids_stride = ids.empty() ? 0 : ids_stride()};
  }
  std::string label() const {
    return fmt::format("batch {} kv_heads {} heads_per_row {} cols {} k {} window {}+{} nan_marks_row {} lengths [{}] "
                       "row_k [{}]",
                       batch, kv_heads, heads_per_row, cols, k, window.sink, window.recent, nan_marks_row,
                       fmt::join(lengths, ", "), fmt::join(row_k, ", ")) +
           (ids.empty() ? std::string() : std::string(" ids")) +
           (seed.empty() ? std::string() : fmt::format(" seed [{}]", fmt::join(seed, ", ")));
  }
};

struct Selection {
  std::vector<std::int32_t> indices, counts;
  std::vector<float> weights;
};

Selection cpu_topk_rows(const Problem& p) {
  Selection sel{std::vector<std::int32_t>(std::size_t(p.selection_rows()) * p.capacity(), -1),
                std::vector<std::int32_t>(std::size_t(p.selection_rows()), -1), {}};
  if (p.weights) sel.weights.assign(sel.indices.size(), NAN);
  const SelectionView view{sel.indices.data(), sel.counts.data(), p.weights ? sel.weights.data() : nullptr, p.batch,
                           p.kv_heads, p.capacity()};
  HostWorkspace ws(cpu::topk_rows_workspace_bytes(p.rows(), p.cols, p.k, p.options(p.row_k.data()), nullptr));
  cpu::topk_rows(p.view(p.scores.data()), p.lengths.data(), p.k, p.options(p.row_k.data(), nullptr, p.ids.data()), view,
                 ws.span());
  return sel;
}

/// The problem's device inputs and poisoned outputs (all bytes 0xff: index and count -1, weight NaN).
struct DeviceProblem {
  DeviceBuffer<float> scores, seed;
  DeviceBuffer<std::int32_t> lengths, row_k, ids, indices, counts;
  DeviceBuffer<float> weights;
  DeviceBuffer<std::byte> workspace;
  std::size_t workspace_bytes;

  explicit DeviceProblem(const Problem& p)
      : scores(p.scores), seed(p.seed.empty() ? DeviceBuffer<float>() : DeviceBuffer<float>(p.seed)), lengths(p.lengths),
        row_k(p.row_k.empty() ? DeviceBuffer<std::int32_t>() : DeviceBuffer<std::int32_t>(p.row_k)),
        ids(p.ids.empty() ? DeviceBuffer<std::int32_t>() : DeviceBuffer<std::int32_t>(p.ids)),
        indices(std::size_t(p.selection_rows()) * p.capacity()), counts(std::size_t(p.selection_rows())),
        weights(p.weights ? indices.size() : 0),
        workspace_bytes(cuda::topk_rows_workspace_bytes(p.rows(), p.cols, p.k, p.options(nullptr))) {
    workspace = DeviceBuffer<std::byte>(workspace_bytes);
  }
  void poison() {
    indices.poison();
    counts.poison();
    weights.poison();
    workspace.poison();
  }
  SelectionView out(const Problem& p) const {
    return {indices.data(), counts.data(), p.weights ? weights.data() : nullptr, p.batch, p.kv_heads, p.capacity()};
  }
  void run(const Problem& p, cudaStream_t stream) {
    cuda::topk_rows(p.view(scores.data()), lengths.data(), p.k, p.options(row_k.data(), seed.data(), ids.data()), out(p),
                    {workspace.data(), workspace_bytes}, stream);
  }
  Selection download() const { return {indices.download(), counts.download(), weights.download()}; }
};

/// Exact equality with the CPU twin: counts of every row, its indices and weights up to the count, and nothing
/// written past it. Rows listed in `invalid` must have count -1 and nothing written.
void expect_same(const Problem& p, const Selection& want, const Selection& got, const std::vector<bool>& invalid = {}) {
  for (std::int32_t s = 0; s < p.selection_rows(); ++s) {
    const bool bad = !invalid.empty() && invalid[std::size_t(s)];
    if (!bad && want.counts[std::size_t(s)] < 0) {  // a row nan_marks_row marked: its entries are not compared
      ASSERT_EQ(got.counts[std::size_t(s)], -1) << "selection row " << s << " (a NaN candidate)";
      continue;
    }
    const std::int32_t count = bad ? 0 : want.counts[std::size_t(s)];
    ASSERT_EQ(got.counts[std::size_t(s)], bad ? -1 : count) << "selection row " << s;
    const auto row = [&](const std::vector<std::int32_t>& v, std::int32_t end) {
      return std::vector<std::int32_t>(v.begin() + std::int64_t(s) * p.capacity(), v.begin() + std::int64_t(s) * p.capacity() + end);
    };
    ASSERT_EQ(row(got.indices, count), row(want.indices, count)) << "selection row " << s;
    for (std::int32_t i = count; i < p.capacity(); ++i) {
      ASSERT_EQ(got.indices[std::size_t(std::int64_t(s) * p.capacity() + i)], -1) << "written past the count: row " << s;
    }
    if (p.weights) {
      for (std::int32_t i = 0; i < p.capacity(); ++i) {
        const float w = got.weights[std::size_t(std::int64_t(s) * p.capacity() + i)];
        if (i < count) {
          ASSERT_EQ(w, 0.0f) << "row " << s << " entry " << i;
        } else {
          ASSERT_TRUE(std::isnan(w)) << "weight written past the count: row " << s << " entry " << i;
        }
      }
    }
  }
}

using CudaTopK = test::GpuTest;

void check_against_cpu(const Problem& p) {
  SCOPED_TRACE(p.label());
  const Selection want = cpu_topk_rows(p);
  DeviceProblem d(p);
  // Twice on the same workspace: what one call leaves behind must not change the next.
  for (int call = 0; call < 2; ++call) {
    SCOPED_TRACE(testing::Message() << "call " << call);
    d.poison();
    // Counts poisoned with another value than -1 where a row may be marked -1, so that an unwritten count shows.
    if (p.nan_marks_row) KVSIFT_CUDA_CHECK(cudaMemset(d.counts.data(), 0x7f, d.counts.size() * sizeof(std::int32_t)));
    d.run(p, nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    expect_same(p, want, d.download());
  }
}

/// The number whose rank_word is `word` (a word of a number: neither 0, NaN's, nor above -inf's).
float score_of_word(std::uint32_t word) {
  const std::uint32_t ascending = ~word;
  const std::uint32_t bits = (ascending & 0x80000000u) != 0 ? ascending ^ 0x80000000u : ~ascending;
  float score;
  std::memcpy(&score, &bits, sizeof(score));
  return score;
}

/// Seeds for every selection row of `p` (its first score row's middle, ranked by the ranking rule on the host):
/// its exact k-th best score; just above its (k+1)-th best; its best scores' (1.2 k)-th and (0.8 k)-th; +-inf,
/// NaN; a random score; and three at the picks' edge after the kernel widens the seed by kSeedSlack: the widened
/// word at the k-th best's word (the candidates are the picks and their ties), one below the (k+1)-th's, and at
/// it (one candidate too many: the last bin must not be taken whole past the seed).
void seed_rows(Problem& p, Random& rng) {
  p.seed.clear();
  for (std::int32_t s = 0; s < p.selection_rows(); ++s) {
    const std::int32_t length = p.lengths[std::size_t(s / p.kv_heads)];
    const std::int32_t lo = p.window.sink_end(length), hi = p.window.recent_begin(length);
    const float* row = p.scores.data() + std::int64_t(s) * p.heads_per_row * p.stride();
    std::vector<float> middle(row + std::max(lo, 0), row + std::max(hi, lo));
    std::sort(middle.begin(), middle.end(), [](float a, float b) { return rank_word(a) < rank_word(b); });
    const auto at = [&](std::int64_t i) {
      return middle.empty() ? 0.0f : middle[std::size_t(std::clamp<std::int64_t>(i, 0, std::int64_t(middle.size()) - 1))];
    };
    const std::int32_t k = p.row_k.empty() ? p.k : p.row_k[std::size_t(s)];
    // The seed whose word, widened by kSeedSlack, is the word of the middle's i-th best (shifted by `offset`).
    const auto widened_at = [&](std::int64_t i, std::int64_t offset) {
      const std::int64_t word = std::int64_t(rank_word(at(i))) + offset - std::int64_t(cuda::detail::kSeedSlack);
      return word > 0x007fffff ? score_of_word(std::uint32_t(word)) : INFINITY;
    };
    float seed = 0.0f;
    switch (rng.uniform_int(0, 10)) {
      case 8: seed = widened_at(k - 1, 0); break;
      case 9: seed = widened_at(k, -1); break;
      case 10: seed = widened_at(k, 0); break;
      case 0: seed = at(k - 1); break;
      case 1: seed = std::nextafter(at(k), INFINITY); break;
      case 2: seed = at(k * 6 / 5); break;
      case 3: seed = at(k * 4 / 5 - 1); break;
      case 4: seed = INFINITY; break;
      case 5: seed = -INFINITY; break;
      case 6: seed = NAN; break;
      default: seed = rng.uniform(-3.0f, 3.0f); break;
    }
    p.seed.push_back(seed);
  }
}

TEST_F(CudaTopK, RowsEqualTheCpuTwinExactly) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const AttentionWindow windows[] = {{0, 0}, {4, 64}, {1, 0}, {0, 1000}};
  const Scores kinds[] = {Scores::continuous, Scores::few_values, Scores::all_equal};
  struct Shape {
    std::int32_t batch, kv_heads, heads_per_row;
  };
  // Score rows 1, 8, 64, and 8 as 2 selection rows of 4 (a GQA group).
  const Shape shapes[] = {{1, 1, 1}, {1, 8, 1}, {8, 8, 1}, {1, 2, 4}};
  for (const Shape& shape : shapes) {
    for (const std::int32_t k : {1, 128, 2048}) {
      for (int trial = 0; trial < 3; ++trial) {
        const std::int32_t cols = std::vector<std::int32_t>{131072, 8192, rng.uniform_int(1, 40000)}[trial];
        const Problem p(rng, shape.batch, shape.kv_heads, shape.heads_per_row, cols, k,
                        windows[rng.uniform_int(0, 3)], kinds[rng.uniform_int(0, 2)], rng.uniform_int(0, 2) == 0);
        check_against_cpu(p);
      }
    }
  }
}

// The held kernel's clusters (8 or 16 CTAs a row: 1 score row of 32K words in CTAs of 2048, 64K in CTAs of 8192, 8
// rows in CTAs of 8192) at sizes compute-sanitizer's racecheck gets through quickly: bench/run_device.sh's racecheck
// runs this test instead of the 128K-row ones.
TEST_F(CudaTopK, HeldClustersAtSanitizerSizes) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const AttentionWindow windows[] = {{0, 0}, {4, 64}};
  for (const std::int32_t cols : {32768, 65536}) {
    for (const std::int32_t k : {128, 2048}) {
      check_against_cpu(Problem(rng, 1, 1, 1, cols, k, windows[rng.uniform_int(0, 1)], Scores::continuous, false));
      check_against_cpu(Problem(rng, 1, 2, 4, cols, k, windows[rng.uniform_int(0, 1)], Scores::few_values, true));
      Problem seeded(rng, 1, 4, 1, cols, k, windows[rng.uniform_int(0, 1)], Scores::continuous, true);
      seed_rows(seeded, rng);
      check_against_cpu(seeded);
    }
  }
}

// TopKRowsOptions::seed on the held kernel's rows (1 and 8 rows of 131072, 4 of 65536, groups of 4): the same
// selection as the CPU twin (which reads no seed) for seeds that give exactly the picks, a few more, too many,
// too few, none, every score, and NaN; scores of one magnitude (the seed's word shares their leading bits) and
// rows with NaN among them (nan_marks_row).
TEST_F(CudaTopK, SeededRowsEqualTheCpuTwin) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  struct Shape {
    std::int32_t batch, kv_heads, heads_per_row, cols;
  };
  const Shape shapes[] = {{1, 1, 1, 131072}, {1, 8, 1, 131072}, {2, 2, 1, 65536}, {1, 2, 4, 65536}};
  for (const Shape& shape : shapes) {
    for (const std::int32_t k : {128, 2048, 5000}) {
      const AttentionWindow window = rng.uniform_int(0, 1) == 0 ? AttentionWindow{} : AttentionWindow{4, 64};
      Problem p(rng, shape.batch, shape.kv_heads, shape.heads_per_row, shape.cols, k, window, Scores::continuous,
                rng.uniform_int(0, 1) == 1);
      if (rng.uniform_int(0, 1) == 1) {
        for (float& x : p.scores) x = std::isfinite(x) ? 50.0f + std::abs(x) / 8 : x;
      }
      for (int draw = 0; draw < 3; ++draw) {
        seed_rows(p, rng);
        check_against_cpu(p);
      }
    }
  }
}

// The one-CTA kernel (rows of at most 16384 scores, at most one row per SM): both shapes (1024 x 8 and 1024 x 16
// words), k from 1 to the whole row, scores of one magnitude among NaN and -inf (Quest's page bounds and window
// pages: the digits start below the bits the typical scores share), rows mostly -inf (the k-th score -inf or NaN:
// digits from the top), ties, unions of groups of 4.
TEST_F(CudaTopK, OneCtaRowsEqualTheCpuTwin) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const AttentionWindow windows[] = {{0, 0}, {4, 64}, {1, 3}};
  for (const std::int32_t cols : {8192, 16384, rng.uniform_int(1, 16384)}) {
    for (const std::int32_t k : {1, 128, 2048, cols}) {
      const AttentionWindow window = windows[rng.uniform_int(0, 2)];
      check_against_cpu(Problem(rng, 2, 4, 1, cols, k, window, Scores::continuous, rng.uniform_int(0, 1) == 1));
      check_against_cpu(Problem(rng, 1, 2, 1, cols, k, window, Scores::few_values, false));
      check_against_cpu(Problem(rng, 1, 1, 1, cols, k, window, Scores::all_equal, false));
      check_against_cpu(Problem(rng, 1, 2, 4, cols, k, window, Scores::continuous, true));
      Problem magnitude(rng, 1, 8, 1, cols, k, window, Scores::continuous, false);
      for (float& s : magnitude.scores) s = std::isfinite(s) ? 50.0f + std::abs(s) / 8 : s;
      check_against_cpu(magnitude);
      // Mostly -inf (Quest's window pages, all of a short row's): k past the finite scores takes -inf ones.
      Problem masked(rng, 1, 4, 1, cols, k, window, Scores::continuous, false);
      for (float& s : masked.scores) s = rng.uniform_int(0, 9) == 0 ? s : -INFINITY;
      check_against_cpu(masked);
    }
  }
}

TEST_F(CudaTopK, GroupUnionsOfEverySizeAndLongRows) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const std::int32_t heads : {2, 3, 8, 16}) {
    check_against_cpu(Problem(rng, 2, 2, heads, rng.uniform_int(1000, 20000), 64, {4, 16}, Scores::continuous, true));
  }
  // Past 360,416 tokens the union's bitmap lives in the workspace.
  check_against_cpu(Problem(rng, 1, 2, 4, 500000, 2048, {4, 64}, Scores::few_values, false));
  // One row past a cluster's shared memory (re-read from L2 on each pass), and many short rows.
  check_against_cpu(Problem(rng, 1, 1, 1, 1 << 21, 2048, {}, Scores::continuous, false));
  check_against_cpu(Problem(rng, 64, 8, 1, 3000, 128, {4, 64}, Scores::few_values, true));
}

TEST_F(CudaTopK, A2atsDecodeStepSizes) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  // A²ATS's decode step at 128K (q 32 / kv 8, K = 3% = 3932): 32 score rows united by 4, and the group-max
  // rule's 8 rows of one head, at full length and with ties; then batch 8 (256 and 64 score rows), ragged.
  // Per-row k and the window throughout.
  for (const Scores kind : {Scores::continuous, Scores::few_values}) {
    for (const std::int32_t heads : {4, 1}) {
      Problem p(rng, 1, 8, heads, 131072, 3932, {4, 64}, kind, true);
      p.lengths.assign(1, p.cols);
      check_against_cpu(p);
    }
  }
  check_against_cpu(Problem(rng, 8, 8, 4, 131072, 3932, {4, 64}, Scores::continuous, true));
  check_against_cpu(Problem(rng, 8, 8, 1, 131072, 3932, {0, 0}, Scores::few_values, true));
}

TEST_F(CudaTopK, OutOfRangeDeviceInputsGiveCountMinusOne) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const std::int32_t heads : {1, 4}) {
    Problem p(rng, 4, 2, heads, 5000, 100, {4, 64}, Scores::continuous, true);
    // The CPU twin refuses these inputs: its expectation comes from valid stand-ins on the same rows.
    Problem valid = p;
    p.lengths[1] = -1;
    valid.lengths[1] = 0;
    p.lengths[2] = p.cols + 1;
    valid.lengths[2] = 0;
    p.row_k[0] = p.k + 1;
    valid.row_k[0] = 0;
    p.row_k[7] = -5;
    valid.row_k[7] = 0;
    std::vector<bool> invalid(std::size_t(p.selection_rows()), false);
    for (const std::int32_t s : {0, 2, 3, 4, 5, 7}) invalid[std::size_t(s)] = true;  // sequences 1 and 2: rows 2-5
    SCOPED_TRACE(p.label());
    DeviceProblem d(p);
    d.poison();
    // Counts start at a value that is neither -1 nor a real count.
    d.counts.upload(std::vector<std::int32_t>(std::size_t(p.selection_rows()), 12345));
    d.run(p, nullptr);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    expect_same(p, cpu_topk_rows(valid), d.download(), invalid);
  }
}

TEST_F(CudaTopK, GraphReplaysEqualEagerRuns) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const std::int32_t heads : {1, 4}) {
    Problem p(rng, 2, 2, heads, 131072, 2048, {4, 64}, Scores::continuous, true);
    SCOPED_TRACE(p.label());
    DeviceProblem d(p);
    const test::Stream stream;
    const test::CapturedGraph graph(stream, [&] {
      d.run(p, stream);
    });
    // Two replays, each on fresh scores uploaded into the captured buffers, each against an eager run.
    for (int replay = 0; replay < 2; ++replay) {
      SCOPED_TRACE(testing::Message() << "replay " << replay);
      const Problem fresh(rng, p.batch, p.kv_heads, heads, p.cols, p.k, p.window, Scores::few_values, true);
      p.scores = fresh.scores;
      p.row_k = fresh.row_k;
      d.scores.upload(p.scores);
      d.row_k.upload(p.row_k);
      d.poison();
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // cudaMemset runs on the legacy stream, which `stream` does not wait for
      graph.launch();
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const Selection replayed = d.download();
      d.poison();
      KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
      d.run(p, stream);
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      const Selection eager = d.download();
      EXPECT_EQ(replayed.indices, eager.indices);
      EXPECT_EQ(replayed.counts, eager.counts);
      expect_same(p, cpu_topk_rows(p), eager);
    }
  }
}

TEST_F(CudaTopK, WorkspaceTooSmallIsRefused) {
  Problem p(rng, 1, 2, 4, 1000, 16, {}, Scores::continuous, false);
  DeviceProblem d(p);
  ASSERT_GT(d.workspace_bytes, 0u);
  test::expect_error(
      [&] {
        cuda::topk_rows(p.view(d.scores.data()), d.lengths.data(), p.k, p.options(nullptr), d.out(p),
                        {d.workspace.data(), d.workspace_bytes - 1}, nullptr);
      },
      {"kvsift::cuda::topk_rows: workspace too small", "needs bytes"});
}

TEST_F(CudaTopK, LengthBudgetsEqualTheCpuTwin) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (int trial = 0; trial < 10; ++trial) {
    const std::int32_t batch = rng.uniform_int(1, 64), heads = rng.uniform_int(1, 8);
    const LengthBudget budget{.fraction = double(rng.uniform(0.001f, 1.0f)), .minimum = rng.uniform_int(0, 8),
                              .maximum = rng.uniform_int(8, 5000)};
    std::vector<std::int32_t> lengths(static_cast<std::size_t>(batch));
    for (auto& n : lengths) n = rng.uniform_int(0, 200000);
    std::vector<std::int32_t> want(std::size_t(batch) * heads);
    cpu::length_budgets(lengths.data(), batch, heads, budget, want.data());
    const test::DeviceBuffer<std::int32_t> d_lengths(lengths);
    test::DeviceBuffer<std::int32_t> d_row_k(want.size());
    d_row_k.poison();
    cuda::length_budgets(d_lengths.data(), batch, heads, budget, d_row_k.data(), nullptr);
    EXPECT_EQ(d_row_k.download(), want);
  }
  test::expect_error([] { cuda::length_budgets(nullptr, 1, 1, {.fraction = 0.5, .maximum = 4}, nullptr, nullptr); },
                     "kvsift::cuda::length_budgets: lengths and row_k must be non-null");
}

/// cuda::mass_budgets of a problem (row_k poisoned first: 0xff bytes, -1, or 0x7f where -1 is an answer) on `stream`.
std::vector<std::int32_t> cuda_mass_budgets(const test::MassBudgetsProblem& p, cudaStream_t stream = nullptr) {
  const DeviceBuffer<float> scores(p.scores);
  const DeviceBuffer<std::int32_t> counts(p.counts);
  const DeviceBuffer<std::int32_t> limits = p.limits.empty() ? DeviceBuffer<std::int32_t>() : DeviceBuffer<std::int32_t>(p.limits);
  DeviceBuffer<std::int32_t> row_k(std::size_t(p.rows));
  KVSIFT_CUDA_CHECK(cudaMemset(row_k.data(), 0x7f, row_k.size() * sizeof(std::int32_t)));
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  cuda::mass_budgets(p.view(scores.data()), counts.data(), p.options(limits.data()), row_k.data(), stream);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  return row_k.download();
}

TEST_F(CudaTopK, MassBudgetsEqualTheCpuTwinBitForBit) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (int trial = 0; trial < 80; ++trial) {
    // The rerank's rows (c x K: 4 x 2048 = 8192, 4 x 512), odd sizes, and rows longer than any CTA's loop.
    const std::int32_t cols_choices[] = {1, 7, 100, 2048, 8192, 33000, rng.uniform_int(1, 10000)};
    const test::MassBudgetsProblem p(rng, rng.uniform_int(1, 16), cols_choices[rng.uniform_int(0, 6)]);
    SCOPED_TRACE(p.label());
    std::vector<std::int32_t> want(std::size_t(p.rows), -77);
    cpu::mass_budgets(p.view(p.scores.data()), p.counts.data(), p.options(p.limits.data()), want.data());
    EXPECT_EQ(want, test::mass_budgets_reference(p));
    ASSERT_EQ(cuda_mass_budgets(p), want);
  }
}

TEST_F(CudaTopK, MassBudgetsOfOutOfRangeDeviceInputsAreMinusOne) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  test::MassBudgetsProblem p(rng, 6, 300, false);
  p.limits.assign(6, p.budget.maximum);
  std::vector<std::int32_t> want = test::mass_budgets_reference(p);
  p.counts[1] = p.cols + 1;  // past the row
  p.counts[2] = -5;
  p.limits[3] = -1;
  p.limits[4] = p.budget.maximum + 1;
  want[1] = want[2] = want[3] = want[4] = -1;
  EXPECT_EQ(cuda_mass_budgets(p), want);
}

TEST_F(CudaTopK, MassBudgetsGraphReplaysEqualEagerRuns) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  test::MassBudgetsProblem p(rng, 8, 8192);
  DeviceBuffer<float> scores(p.scores);
  const DeviceBuffer<std::int32_t> counts(p.counts);
  const DeviceBuffer<std::int32_t> limits = p.limits.empty() ? DeviceBuffer<std::int32_t>() : DeviceBuffer<std::int32_t>(p.limits);
  DeviceBuffer<std::int32_t> row_k(std::size_t(p.rows));
  const test::Stream stream;
  const test::CapturedGraph graph(stream, [&] {
    cuda::mass_budgets(p.view(scores.data()), counts.data(), p.options(limits.data()), row_k.data(), stream);
  });
  for (int replay = 0; replay < 2; ++replay) {
    // Fresh scores into the captured buffer (the same counts, limits and budget).
    for (std::int32_t r = 0; r < p.rows; ++r) {
      float* const row = p.scores.data() + r * p.stride();
      std::fill_n(row, p.stride(), NAN);
      test::MassBudgetsProblem::fill_row(rng, row, std::max(p.counts[std::size_t(r)], 0), test::kMassRows[rng.uniform_int(0, 5)]);
    }
    scores.upload(p.scores);
    row_k.poison();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    graph.launch();
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(row_k.download(), test::mass_budgets_reference(p)) << "replay " << replay;
  }
}

TEST(CudaTopKPlan, ClustersFillTheGpuInOneWave) {
  using cuda::detail::plan_topk_rows;
  // An H100-like capacity (132 SMs, one select CTA per SM; clusters stay inside a GPC): 30 clusters of 4 at once.
  const cuda::detail::TopKClusterCapacity h100{0, 66, 30, 16, 7}, portable{0, 66, 30, 16, 0}, none{};
  // (cluster, one-CTA shape, held shape, slice words): cta 1, 2 are 1024 x 8 and 1024 x 16 words in registers,
  // held 1, 2, 3 are 512 x 4, 1024 x 8 and 1024 x 16 per CTA of a cluster.
  const auto plan = [](std::int64_t rows, std::int32_t n, const cuda::detail::TopKClusterCapacity& capacity) {
    const auto launch = plan_topk_rows(rows, n, 132, capacity, 32768);
    return std::tuple{launch.cluster, launch.cta, launch.held, launch.smem_words};
  };
  // The one-CTA kernel where a row fits one CTA's registers and the rows are at most the SMs.
  EXPECT_EQ(plan(1, 8192, h100), std::tuple(1, 1, 0, 0));
  EXPECT_EQ(plan(8, 8192, h100), std::tuple(1, 1, 0, 0));     // Quest's pages at 128K, batch 1
  EXPECT_EQ(plan(1, 3000, h100), std::tuple(1, 1, 0, 0));
  EXPECT_EQ(plan(132, 8193, h100), std::tuple(1, 2, 0, 0));
  EXPECT_EQ(plan(1, 16384, none), std::tuple(1, 2, 0, 0));    // no clusters needed (sm_80)
  // Else the held kernel where a row fits a cluster's registers with at most half the SMs busy, or twice the SMs for
  // rows longer than 65,536.
  EXPECT_EQ(plan(1, 131072, h100), std::tuple(16, 0, 2, 0));   // one row: 16 CTAs of 8192 words
  EXPECT_EQ(plan(4, 131072, h100), std::tuple(16, 0, 2, 0));
  EXPECT_EQ(plan(8, 131072, h100), std::tuple(8, 0, 3, 0));    // 8 rows: 16-CTA clusters would not all fit at once
  EXPECT_EQ(plan(1, 131072, portable), std::tuple(8, 0, 3, 0));  // portable clusters only
  EXPECT_EQ(plan(1, 32768, h100), std::tuple(16, 0, 1, 0));
  EXPECT_EQ(plan(1, 20000, none), std::tuple(1, 0, 0, 20000));  // no clusters: the slice kernel
  EXPECT_EQ(plan(32, 131072, h100), std::tuple(8, 0, 3, 0));    // 256 CTAs: A²ATS's union at 128K, batch 1
  EXPECT_EQ(plan(33, 131072, h100), std::tuple(8, 0, 3, 0));    // 264 CTAs: twice the SMs
  EXPECT_EQ(plan(32, 32768, h100), std::tuple(2, 0, 3, 0));     // shorter rows: at most half the SMs (64 CTAs)
  // Else the slice kernel: more CTAs than that.
  EXPECT_EQ(plan(34, 131072, h100), std::tuple(2, 0, 0, 32768));
  EXPECT_EQ(plan(64, 131072, h100), std::tuple(2, 0, 0, 32768));   // 65,536 scores per CTA: the rest from L2
  EXPECT_EQ(plan(700, 3000, h100), std::tuple(1, 0, 0, 3000));     // more rows than SMs
  EXPECT_EQ(plan(1, 1 << 21, h100), std::tuple(16, 0, 0, 32768));  // past 16 x 16384 words
  EXPECT_EQ(plan(1, 131072, none), std::tuple(1, 0, 0, 32768));    // no clusters: one CTA, the rest from L2
  EXPECT_EQ(cuda::detail::topk_union_words(64), 3);          // a middle [lo, hi) spans at most 64/32 + 1 words
  // Shared memory per block: 227 KiB (H100) allows the 176 KiB slice, 99 KiB (sm_89) less; a short limit
  // sends the rest of the slices to L2.
  EXPECT_EQ(cuda::detail::topk_rows_smem_limit_words(227 * 1024), cuda::detail::kTopKMaxSmemWords);
  EXPECT_EQ(cuda::detail::topk_rows_smem_limit_words(99 * 1024), (99 * 1024 - cuda::detail::kTopKStaticSmemBytes) / 4);
  EXPECT_EQ(plan_topk_rows(64, 131072, 132, portable, 16000).smem_words, 16000);
  EXPECT_EQ(plan_topk_rows(64, 131072, 132, portable, 16000).smem_limit_words, 16000);
}

TEST(CudaTopKBadInput, RefusedBeforeAnyDeviceCall) {
  EXPECT_EQ(cuda::topk_rows_workspace_bytes(8, 131072, 2048, {}), 0u);  // one score row per selection row: none
  // Four rows of 1000 scores, k = 16, 2 per selection row: the picks, bitmaps in shared memory.
  EXPECT_EQ(cuda::topk_rows_workspace_bytes(4, 1000, 16, {.heads_per_row = 2}), 256u);
  // Past 360,416 tokens the bitmaps (one per selection row) join them.
  EXPECT_EQ(cuda::topk_rows_workspace_bytes(4, 500000, 16, {.heads_per_row = 2}),
            256u + (2 * (500000 / 32 + 1) * 4 + 255) / 256 * 256);
  test::expect_error([] { cuda::topk_rows_workspace_bytes(0, 10, 1, {}); },
                     "kvsift::cuda::topk_rows_workspace_bytes: score_rows (= 0) and max_tokens (= 10) must be positive");
  test::expect_error([] { cuda::topk_rows_workspace_bytes(4, 10, 0, {}); }, "k (= 0) must be positive");
  test::expect_error([] { cuda::topk_rows_workspace_bytes(4, 10, 1, {.heads_per_row = 0}); },
                     "options.heads_per_row (= 0) must be >= 1");
  test::expect_error([] { cuda::topk_rows_workspace_bytes(4, 10, 1, {.window = {-1, 2}}); },
                     "options.window.sink (= -1) and options.window.recent (= 2) must be >= 0");
  test::expect_error([] { cuda::topk_rows_workspace_bytes(std::int64_t(1) << 28, 10, 1, {}); },
                     "score_rows (= 268435456) must be below 134217728");

  // The run's checks, on fake device pointers (nothing is launched).
  float* const scores = reinterpret_cast<float*>(std::uintptr_t(1) << 20);
  std::int32_t* const ints = reinterpret_cast<std::int32_t*>(std::uintptr_t(1) << 21);
  const std::int32_t* const lengths = ints;
  const SelectionView out{ints, ints, nullptr, 2, 2, 10};
  const auto view = MatrixView<const float>::packed(scores, 4, 64);
  const auto go = [&](MatrixView<const float> s, const std::int32_t* lens, std::int32_t k, TopKRowsOptions o,
                      SelectionView sel, std::span<std::byte> ws = {}) { cuda::topk_rows(s, lens, k, o, sel, ws, nullptr); };
  test::expect_error([&] { go(view, lengths, 0, {}, out); }, "kvsift::cuda::topk_rows: k (= 0) must be positive");
  test::expect_error([&] { go(view, lengths, 11, {}, out); }, "out.capacity (= 10) < options.heads_per_row * k (= 1 * 11)");
  test::expect_error([&] { go(view, lengths, 5, {.heads_per_row = 0}, out); }, "options.heads_per_row (= 0) must be >= 1");
  test::expect_error([&] { go(view, lengths, 5, {.heads_per_row = 2}, out); },
                     "scores.rows (= 4) != out.batch * out.kv_heads * options.heads_per_row (= 2 * 2 * 2)");
  test::expect_error([&] { go(MatrixView<const float>::packed(scores, 8, 64), lengths, 6, {.heads_per_row = 2}, out); },
                     "out.capacity (= 10) < options.heads_per_row * k (= 2 * 6)");
  test::expect_error([&] { go(view, lengths, 5, {.window = {0, -3}}, out); },
                     "options.window.sink (= 0) and options.window.recent (= -3) must be >= 0");
  test::expect_error([&] { go(view, nullptr, 5, {}, out); }, "d_lengths is a null pointer");
  test::expect_error([&] { go(MatrixView<const float>::packed(scores, 8, 64), lengths, 5, {.heads_per_row = 2, .ids = ints, .ids_stride = 64}, out); },
                     "options.ids needs options.heads_per_row == 1 (it is 2)");
  test::expect_error([&] { go(view, lengths, 5, {.ids = ints, .ids_stride = 63}, out); },
                     "options.ids_stride (= 63) < max_tokens (= 64): a row's ids must cover every position");
  test::expect_error([&] { go(view, lengths, 5, {.ids = ints, .ids_stride = 64}, out); },
                     "options.ids [4 rows of 64] overlaps out.indices [4 rows of 10]: the table must not be the output");
  SelectionView no_counts = out;
  no_counts.counts = nullptr;
  test::expect_error([&] { go(view, lengths, 5, {}, no_counts); }, "out.indices and out.counts must be non-null");
  test::expect_error([&] { go(MatrixView<const float>{scores, 4, 64, 3}, lengths, 5, {}, out); },
                     "scores: strides inconsistent with shape");
  test::expect_error([&] { go(MatrixView<const float>::packed(scores, 8, 64), lengths, 5, {.heads_per_row = 2}, out); },
                     "kvsift::cuda::topk_rows: workspace too small: 'topk picks'");

  // mass_budgets' checks (the shared ones, and the grid's), on the fake pointers.
  const auto mass = [&](MatrixView<const float> s, MassBudget b, const std::int32_t* c = nullptr) {
    cuda::mass_budgets(s, c != nullptr ? c : ints, b, ints, nullptr);
  };
  test::expect_error([&] { mass(view, {.mass = 0, .maximum = 4}); },
                     "kvsift::cuda::mass_budgets: budget.mass (= 0) is outside (0, 1]");
  test::expect_error([&] { mass(view, {.mass = 0.5, .floor = 0, .maximum = 4}); }, "budget.floor (= 0) must be >= 1");
  test::expect_error([&] { mass(view, {.mass = 0.5, .floor = 5, .maximum = 4}); },
                     "budget.maximum (= 4) is below budget.floor (= 5)");
  test::expect_error([&] { cuda::mass_budgets(view, ints, {.mass = 0.5, .maximum = 4}, nullptr, nullptr); },
                     "counts and row_k must be non-null");
  test::expect_error([&] { mass(MatrixView<const float>::packed(scores, 1, kMassMaxCandidates + 1), {.mass = 0.5, .maximum = 4}); },
                     "scores.cols (= 8388609) exceeds 8388608 candidates per row");
}

}  // namespace
}  // namespace kvsift
