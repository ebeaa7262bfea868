// The decode step's selection beyond positions, on CUDA: a selector's log-weights reach the attention through the
// step's workspace, and a second source (a selector-owned compressed cache attended whole) is merged with the
// primary selection by LSE on the stream. Against the fp64 reference over window ∪ selection ∪ weighted second
// rows (second_source_check.hpp); contiguous and paged caches, fp16 and bf16, slots out of order, outputs and
// workspace poisoned; several steps captured in a CUDA graph replay as the eager run, bit for bit.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <tuple>
#include <type_traits>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/step/decode_step.hpp"
#include "second_source_check.hpp"

namespace kvsift::test {

template <>
void copy_to_context<cuda::Context>(void* dst, const void* src, std::size_t bytes, const cuda::Context& ctx) {
  if (bytes > 0) KVSIFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, ctx.stream));
}

namespace {

class CudaSecondSourceStep : public GpuTest {};

/// One step's problem on the device: the cache (contiguous or paged), slots out of order (max_slots 4 for 3
/// rows), the primary weights table and the second source.
template <class T>
struct DeviceStepProblem {
  static constexpr std::int32_t kBatch = 3, kQHeads = 8, kKvHeads = 2, kHeadDim = 128, kTokens = 700;
  static constexpr std::int32_t kBudget = 40, kSecondRows = 8, kMaxSlots = 4;
  HostDecodeProblem<T> p;
  std::vector<std::int32_t> slots{2, 0, 3};
  std::vector<float> weights;
  SecondSourceData<T> second;
  SelectorLimits limits{.max_slots = kMaxSlots, .max_tokens = kTokens, .q_heads = kQHeads, .kv_heads = kKvHeads,
                        .head_dim = kHeadDim};
  DecodeStepConfig config{.attention = {.window = {4, 16}}, .max_batch = kBatch, .q_heads = kQHeads,
                          .kv_heads = kKvHeads, .head_dim = kHeadDim, .max_seq_len = kTokens};
  DeviceBuffer<T> d_q, d_k, d_v;
  DeviceBuffer<std::int32_t> d_lens, d_indptr, d_pages, d_last, d_slots;

  DeviceStepProblem(Random& rng, std::int32_t page_size)
      : p(rng, CaseSpec{.batch = kBatch, .q_heads = kQHeads, .kv_heads = kKvHeads, .head_dim = kHeadDim,
                        .tokens = kTokens, .k = 0, .page_size = page_size, .log_weights = false}),
        second(make_second_source<T>(rng, p.kv_values, slots, kMaxSlots, kBatch, kSecondRows)),
        d_q(p.q), d_k(page_size == 0 ? p.k : p.k_pages), d_v(page_size == 0 ? p.v : p.v_pages),
        d_lens(p.kv_values.seq_lens), d_slots(slots) {
    weights.resize(std::size_t(kBatch) * kKvHeads * kBudget);
    for (float& w : weights) w = rng.uniform(-2.0f, 2.0f);
    if (page_size > 0) {
      d_indptr = DeviceBuffer<std::int32_t>(p.paged_values->indptr);
      d_pages = DeviceBuffer<std::int32_t>(p.paged_values->indices);
      d_last = DeviceBuffer<std::int32_t>(p.paged_values->last_len);
    }
  }
  KVCache<T> cache() const {
    if (p.spec.page_size == 0) {
      return ContiguousKVView<T>::packed(d_k.data(), d_v.data(), kBatch, kKvHeads, kTokens, kHeadDim, d_lens.data());
    }
    const auto v = p.paged(d_k.data(), d_v.data(), d_indptr.data(), d_pages.data(), d_last.data());
    return PagedKVView<T>{d_k.data(), d_v.data(), v.page_indptr, v.page_indices, v.last_page_len, v.batch, v.kv_heads,
                          v.head_dim, v.page_size, v.num_pages, v.page_stride, v.token_stride, v.head_stride};
  }
  template <bool Weights, bool Second>
  TwoSources<T, cuda::Context, Weights, Second> selector(const cuda::Context& ctx) const {
    return {limits, kBudget, kBatch, weights, second, ctx};
  }
  StepInputs<T> inputs(const T* q) const {
    return {.q = QueryView<const T>::packed(q, kBatch, kQHeads, kHeadDim), .cache = cache(), .slots = d_slots.data()};
  }
  HostState reference(const std::vector<std::int32_t>& indices, const std::vector<std::int32_t>& counts, bool weighted,
                      bool with_second) const {
    return two_source_reference(p.q, kQHeads, p.kv_values, config.attention.window, indices, counts, kBudget,
                                weighted ? &weights : nullptr, with_second ? &second : nullptr, slots,
                                1.0 / std::sqrt(double(kHeadDim)));
  }
};

template <class T, bool Weights, bool Second>
void expect_step_matches_reference(Random& rng, std::int32_t page_size, cudaStream_t stream) {
  SCOPED_TRACE(fmt::format("{} page_size {} weights {} second source {}", dtype_label<T>(), page_size, Weights, Second));
  using P = DeviceStepProblem<T>;
  P sp(rng, page_size);
  const cuda::Context ctx{stream};
  DecodeStep step(sp.template selector<Weights, Second>(ctx), sp.config, ctx);
  step.prepare({.cache = sp.cache(), .slots = sp.d_slots.data()}, ctx);
  DeviceBuffer<std::byte> workspace(step.workspace_bytes());
  workspace.poison();
  DeviceBuffer<T> d_o(sp.p.q.size());
  DeviceBuffer<float> d_o32(sp.p.q.size()), d_lse(std::size_t(P::kBatch) * P::kQHeads);
  d_o.poison();
  d_o32.poison();
  d_lse.poison();
  const std::span<std::byte> ws(workspace.data(), workspace.size());
  step.run(sp.inputs(sp.d_q.data()), StateView<T>::packed(d_o.data(), d_lse.data(), P::kBatch, P::kQHeads, P::kHeadDim),
           ws, ctx);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  const SelectionView s = step.selection(ws, P::kBatch);
  ASSERT_EQ(s.log_weights != nullptr, Weights) << "the selection has log-weights iff the selector writes them";
  const std::size_t rows = std::size_t(P::kBatch) * P::kKvHeads;
  std::vector<std::int32_t> indices(rows * s.capacity), counts(rows);
  KVSIFT_CUDA_CHECK(cudaMemcpy(indices.data(), s.indices, indices.size() * 4, cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), s.counts, counts.size() * 4, cudaMemcpyDeviceToHost));
  if (Weights) {
    std::vector<float> w(rows * s.capacity);
    KVSIFT_CUDA_CHECK(cudaMemcpy(w.data(), s.log_weights, w.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(same_bytes(w, sp.weights)) << "the selection's log-weights are the selector's";
  }
  for (std::size_t r = 0; r < rows; ++r) ASSERT_EQ(counts[r], P::kBudget) << "row " << r;
  const HostState ref = sp.reference(indices, counts, Weights, Second);
  expect_close(d_o.download(), d_lse.download(), ref, "step output");
  // An fp32 output: the merge writes it unrounded. What remains is the attention's own error: P·V multiplies
  // 16-bit probabilities (bf16 keeps 8 significant bits, fp16 11), so bf16's bound is looser.
  step.run(sp.inputs(sp.d_q.data()), StateView<float>::packed(d_o32.data(), d_lse.data(), P::kBatch, P::kQHeads,
                                                                P::kHeadDim),
           ws, ctx);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<float> o32 = d_o32.download(), lse32 = d_lse.download();
  constexpr double o32_tolerance = std::is_same_v<T, half> ? 2e-3 : 4e-3;
  for (std::size_t i = 0; i < o32.size(); ++i) ASSERT_NEAR(o32[i], ref.o[i], o32_tolerance) << "fp32 O " << i;
  for (std::size_t i = 0; i < lse32.size(); ++i) ASSERT_NEAR(lse32[i], ref.lse[i], 1e-3) << "fp32 LSE " << i;
}

TEST_F(CudaSecondSourceStep, WeightsAndSecondSourceMatchTheReference) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreate(&stream));
  for (const std::int32_t page_size : {0, 16}) {
    expect_step_matches_reference<half, true, false>(rng, page_size, stream);
    expect_step_matches_reference<half, false, true>(rng, page_size, stream);
    expect_step_matches_reference<half, true, true>(rng, page_size, stream);
    expect_step_matches_reference<bfloat16, true, false>(rng, page_size, stream);
    expect_step_matches_reference<bfloat16, false, true>(rng, page_size, stream);
    expect_step_matches_reference<bfloat16, true, true>(rng, page_size, stream);
  }
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
}

// Three steps (different queries, different outputs) of a weighting selector with a second source, captured in
// a graph and replayed twice: every output equal to the eager run's, bit for bit.
TEST_F(CudaSecondSourceStep, StepsCapturedInAGraphReplayAsEager) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = bfloat16;
  using P = DeviceStepProblem<T>;
  for (const std::int32_t page_size : {0, 16}) {
    P sp(rng, page_size);
    const test::Stream stream;
    const cuda::Context ctx{stream};
    DecodeStep step(sp.selector<true, true>(ctx), sp.config, ctx);
    step.prepare({.cache = sp.cache(), .slots = sp.d_slots.data()}, ctx);
    DeviceBuffer<std::byte> workspace(step.workspace_bytes());
    const std::span<std::byte> ws(workspace.data(), workspace.size());
    constexpr int kSteps = 3;
    std::vector<DeviceBuffer<T>> queries, outputs;
    std::vector<DeviceBuffer<float>> lses;
    for (int i = 0; i < kSteps; ++i) {
      queries.emplace_back(to_storage<T>(rng.normal(sp.p.q.size())));
      outputs.emplace_back(sp.p.q.size());
      lses.emplace_back(std::size_t(P::kBatch) * P::kQHeads);
    }
    const auto steps = [&] {
      for (int i = 0; i < kSteps; ++i) {
        step.run(sp.inputs(queries[i].data()),
                 StateView<T>::packed(outputs[i].data(), lses[i].data(), P::kBatch, P::kQHeads, P::kHeadDim), ws, ctx);
      }
    };
    const auto poison = [&] {
      workspace.poison();
      for (int i = 0; i < kSteps; ++i) {
        outputs[i].poison();
        lses[i].poison();
      }
    };
    poison();
    steps();
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<std::vector<T>> eager_o;
    std::vector<std::vector<float>> eager_lse;
    for (int i = 0; i < kSteps; ++i) {
      eager_o.push_back(outputs[i].download());
      eager_lse.push_back(lses[i].download());
      for (const float x : eager_lse.back()) ASSERT_TRUE(std::isfinite(x)) << "step " << i;
    }
    const test::CapturedGraph graph(stream, [&] {
      steps();
    });
    for (int replay = 0; replay < 2; ++replay) {
      poison();
      graph.launch();
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      for (int i = 0; i < kSteps; ++i) {
        EXPECT_TRUE(same_bytes(outputs[i].download(), eager_o[i])) << "page_size " << page_size << " replay " << replay
                                                                    << " step " << i << " O";
        EXPECT_TRUE(same_bytes(lses[i].download(), eager_lse[i])) << "replay " << replay << " step " << i << " LSE";
      }
    }
  }
}

}  // namespace
}  // namespace kvsift::test
