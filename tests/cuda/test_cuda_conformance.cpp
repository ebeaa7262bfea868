// The selector conformance suite (tests/selectors/conformance.hpp) on CUDA: the same checks as on the CPU, one
// line per selector, with every input, output and workspace in device memory (append and select trust device
// slots, so their slot refusals are the CPU's alone; release's and prepare's length refusal run here too). Two
// checks of the CUDA twin besides, one line per selector as well:
//   - CPU equals CUDA: both twins prepared from the same prompts and decoding the same tokens select the same,
//     bit for bit where the selector's header or CUDA test states it (CSAttention, StreamingLLM, CentroidKV), else
//     by its stated near-tie rule: the backends sum fp32 scores in different orders, so at most one row per step
//     may differ, trading at most the case's cpu_cuda_slack entries per side (conformance.hpp's cases);
//   - graph replay equals eager: append + select captured once in a CUDA graph over fixed buffers, replayed on each
//     step's new token, query and lengths, equal bit for bit to the same calls run eagerly by a twin selector.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "gpu_test.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "selectors/conformance.hpp"

namespace kvsift::test::conformance {
namespace {

/// A stream of its own per test: graph capture needs one other than the legacy default stream.
struct CudaBackend {
  using Context = cuda::Context;
  static bool available() { return cuda::device_available(); }
  CudaBackend() { KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;
  ~CudaBackend() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  Context context() const { return {stream}; }
  cudaStream_t stream = nullptr;
};
template <class Case>
using OnCuda = On<Case, CudaBackend>;

INSTANTIATE_TYPED_TEST_SUITE_P(OracleTopK, Conformance, OnCuda<OracleTopKCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(Quest, Conformance, OnCuda<QuestCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedQuest, Conformance, OnCuda<RerankedQuestCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedMassQuest, Conformance, OnCuda<RerankedMassQuestCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(StreamingLLM, Conformance, OnCuda<StreamingLLMCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(Ctkvr, Conformance, OnCuda<CtkvrCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(Csattention, Conformance, OnCuda<CsattentionCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedCsattention, Conformance, OnCuda<RerankedCsattentionCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(A2ats, Conformance, OnCuda<A2atsCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedA2ats, Conformance, OnCuda<RerankedA2atsCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(CentroidKV, Conformance, OnCuda<CentroidKVCase>);
INSTANTIATE_TYPED_TEST_SUITE_P(SpeContext, Conformance, OnCuda<SpeContextCase>);

/// Entries of `a` not in `b` (both ascending or not: compared as sets).
std::vector<std::int32_t> only_in(std::vector<std::int32_t> a, std::vector<std::int32_t> b) {
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  std::vector<std::int32_t> out;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

/// The CPU-equals-CUDA rule of a case (the file comment): slack 0, equal; else at most one row of the step differs,
/// by at most `slack` entries each way.
void expect_twins(const Picked& cpu, const Picked& gpu, std::int32_t slack, const std::string& what) {
  if (slack == 0) {
    EXPECT_EQ(gpu, cpu) << what << ": CUDA\n" << describe(gpu) << "CPU\n" << describe(cpu);
    return;
  }
  ASSERT_EQ(gpu.rows.size(), cpu.rows.size()) << what;
  ASSERT_EQ(gpu.second_rows.size(), cpu.second_rows.size()) << what;
  std::int32_t differing = 0;
  const auto compare = [&](const std::vector<std::int32_t>& c, const std::vector<std::int32_t>& g, std::size_t r,
                           const char* part) {
    if (c == g) return;
    ++differing;
    EXPECT_LE(only_in(c, g).size(), std::size_t(slack)) << what << ", " << part << " row " << r << ": CPU-only entries";
    EXPECT_LE(only_in(g, c).size(), std::size_t(slack)) << what << ", " << part << " row " << r << ": CUDA-only entries";
  };
  for (std::size_t r = 0; r < cpu.rows.size(); ++r) compare(cpu.rows[r], gpu.rows[r], r, "selection");
  for (std::size_t r = 0; r < cpu.second_rows.size(); ++r) compare(cpu.second_rows[r], gpu.second_rows[r], r, "second source");
  EXPECT_LE(differing, 1) << what << ": more rows differ than near-ties explain\nCUDA\n"
                          << describe(gpu) << "CPU\n" << describe(cpu);
}

template <class Case>
class CudaTwin : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    backend_.emplace();
  }
  cuda::Context ctx() const { return backend_->context(); }
  Sequence sequence() { return Sequence(rng, rng.uniform_int(kShortestPrompt, kLongestPrompt)); }
  std::string trace() const { return fmt::format("{} seed {}", Case::where, seed); }

  std::optional<CudaBackend> backend_;
};

TYPED_TEST_SUITE_P(CudaTwin);

TYPED_TEST_P(CudaTwin, SelectsAsTheCpuTwin) {
  using Case = TypeParam;
  SCOPED_TRACE(this->trace());
  Session<Case, cpu::Context> on_cpu(cpu::Context{});
  Session<Case, cuda::Context> on_gpu(this->ctx());
  Sequence a = this->sequence(), b = this->sequence(), c = this->sequence();
  std::vector<Sequence*> live{&a, &b};
  const std::vector<std::int32_t> slots{1, 0};
  on_cpu.prepare(as_batch({&a, &b}), slots);
  on_gpu.prepare(as_batch({&a, &b}), slots);
  for (std::int32_t step = 0; step < 2 * kSteps; ++step) {
    if (step == kSteps) {  // b leaves, c joins its slot (0): the twins' life cycles too
      on_cpu.release({0});
      on_gpu.release({0});
      on_cpu.prepare(as_batch({&c}), {0});
      on_gpu.prepare(as_batch({&c}), {0});
      live = {&a, &c};
    }
    for (Sequence* s : live) s->grow(this->rng);
    const std::vector<const Sequence*> batch(live.begin(), live.end());
    const Picked want = on_cpu.step(batch, slots), got = on_gpu.step(batch, slots);
    const std::string what = fmt::format("step {}", step);
    expect_valid(got, batch, Case::window, what + " (CUDA)");
    expect_valid(want, batch, Case::window, what + " (CPU)");
    expect_twins(want, got, Case::cpu_cuda_slack, what);
  }
}

TYPED_TEST_P(CudaTwin, GraphReplayEqualsEager) {
  using Case = TypeParam;
  SCOPED_TRACE(this->trace());
  const cuda::Context ctx = this->ctx();
  Session<Case, cuda::Context> eager(ctx), graphed(ctx);
  Sequence a = this->sequence(), b = this->sequence();
  const auto batch = as_batch({&a, &b});
  const std::vector<std::int32_t> slots{1, 0};
  eager.prepare(batch, slots);
  graphed.prepare(batch, slots);
  const auto eager_buffers = eager.bind(slots), graph_buffers = graphed.bind(slots);
  const auto next_step = [&] {  // the new token, query and lengths, in the same buffers; outputs poisoned
    a.grow(this->rng);
    b.grow(this->rng);
    eager_buffers->load(batch, ctx);
    graph_buffers->load(batch, ctx);
    eager_buffers->poison(ctx);
    graph_buffers->poison(ctx, std::byte{0}, 0);  // otherwise than the eager run's: nothing left unwritten passes
  };
  next_step();
  const CapturedGraph graph(ctx.stream, [&] { graphed.enqueue(*graph_buffers); });
  for (std::int32_t step = 0; step < kSteps; ++step) {
    if (step > 0) next_step();
    graph.launch();
    eager.enqueue(*eager_buffers);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(ctx.stream));
    const Picked replayed = graphed.read(*graph_buffers), want = eager.read(*eager_buffers);
    expect_valid(replayed, batch, Case::window, fmt::format("replay {}", step));
    EXPECT_EQ(replayed, want) << "replay " << step << "\n" << describe(replayed) << "eager\n" << describe(want);
  }
}

REGISTER_TYPED_TEST_SUITE_P(CudaTwin, SelectsAsTheCpuTwin, GraphReplayEqualsEager);

INSTANTIATE_TYPED_TEST_SUITE_P(OracleTopK, CudaTwin, OracleTopKCase);
INSTANTIATE_TYPED_TEST_SUITE_P(Quest, CudaTwin, QuestCase);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedQuest, CudaTwin, RerankedQuestCase);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedMassQuest, CudaTwin, RerankedMassQuestCase);
INSTANTIATE_TYPED_TEST_SUITE_P(StreamingLLM, CudaTwin, StreamingLLMCase);
INSTANTIATE_TYPED_TEST_SUITE_P(Ctkvr, CudaTwin, CtkvrCase);
INSTANTIATE_TYPED_TEST_SUITE_P(Csattention, CudaTwin, CsattentionCase);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedCsattention, CudaTwin, RerankedCsattentionCase);
INSTANTIATE_TYPED_TEST_SUITE_P(A2ats, CudaTwin, A2atsCase);
INSTANTIATE_TYPED_TEST_SUITE_P(RerankedA2ats, CudaTwin, RerankedA2atsCase);
INSTANTIATE_TYPED_TEST_SUITE_P(CentroidKV, CudaTwin, CentroidKVCase);
INSTANTIATE_TYPED_TEST_SUITE_P(SpeContext, CudaTwin, SpeContextCase);

}  // namespace
}  // namespace kvsift::test::conformance
