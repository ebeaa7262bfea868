// SpeContext on CUDA against its CPU twin: the head's rotated keys (bit for bit but where the backends' RoPE tables
// differ by an fp32 ulp), the selections (per kv head and
// batch-level, owned and engine-kept paged head caches) against the fp64 brute force and equal to the CPU's but at
// stated near-ties, every layer's output against the fp64 reference and the CPU's; the graph capture of select and
// the attention of all layers, replayed, equal to the eager run bit for bit; max_score_rows equal to the CPU's.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "gpu_test.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/specontext.hpp"
#include "kvsift/step/specontext_step.hpp"
#include "specontext_problem.hpp"

namespace kvsift::test {
namespace {

static_assert(KVSelector<SpeContext<bfloat16, cuda::Context>>);

template <class T>
class CudaSpeContext : public GpuTest {};
using StorageTypes = testing::Types<bfloat16, half>;
TYPED_TEST_SUITE(CudaSpeContext, StorageTypes);

struct Run {
  std::vector<std::int32_t> indices, counts;
  std::vector<std::vector<std::uint16_t>> o;  ///< per layer, the output's bits
  std::vector<std::vector<float>> lse;
  std::vector<std::uint16_t> head_keys;       ///< the head cache's rows [batch, kv_heads, length, head_dim] bits
};

template <class T>
std::vector<std::uint16_t> bits(const std::vector<T>& x) {
  std::vector<std::uint16_t> out(x.size());
  std::memcpy(out.data(), x.data(), x.size() * sizeof(T));
  return out;
}

/// Host-side tables of a problem: its views for either backend come from arrays in that backend's memory.
template <class T>
struct Arrays {
  std::vector<std::int32_t> seq_lens, prompt_lens;
  typename SpeContextProblem<T>::PageTable prompt_table, step_table;
};

template <class T>
SpeContextStepConfig step_config(const SpeContextProblem<T>& p, const AttentionWindow& window) {
  const auto& c = p.spec;
  return {.attention = {.window = window}, .layers = c.layers, .max_batch = c.batch, .q_heads = c.q_heads,
          .kv_heads = c.kv_heads, .head_dim = c.head_dim, .max_seq_len = c.max_tokens};
}
template <class T>
SpeContextConfig selector_config(const SpeContextProblem<T>& p, SpeContextMode mode, std::int32_t budget) {
  return {.budget = budget, .mode = mode,
          .head_cache = p.spec.head_page_size > 0 ? SpeContextHeadCache::engine : SpeContextHeadCache::owned,
          .rope = test_head_rope()};
}

/// The head cache's rows of every sequence, read on the host (host views of host arrays).
template <class T>
std::vector<std::uint16_t> head_rows(const SpeContextProblem<T>& p, const KVCache<const T>& head) {
  std::vector<T> rows;
  for (std::int32_t b = 0; b < p.spec.batch; ++b) {
    for (std::int32_t g = 0; g < p.spec.kv_heads; ++g) {
      for (std::int32_t t = 0; t < p.lengths[std::size_t(b)]; ++t) {
        const T* row = head.visit([&](const auto& v) { return v.k_row(b, g, t); });
        rows.insert(rows.end(), row, row + p.spec.head_dim);
      }
    }
  }
  return bits(rows);
}

/// One step on the CPU: prepare, select, attend every layer (the problem's layer caches are copied first).
template <class T>
Run run_cpu(SpeContextProblem<T> p, SpeContextMode mode, std::int32_t budget, const AttentionWindow& window) {
  const auto& c = p.spec;
  const cpu::Context ctx{};
  SpeContextStep<T, cpu::Context> step(SpeContext<T, cpu::Context>(p.limits(), selector_config(p, mode, budget), ctx),
                                       step_config(p, window), ctx);
  cpu::Array<std::byte> ws(step.workspace_bytes());
  std::vector<std::int32_t> lens = p.prompt_lengths;
  std::vector<T> pages(std::size_t(std::max(p.head_num_pages, 1)) * std::max(c.head_page_size, 1) * c.kv_heads * c.head_dim);
  auto table = c.head_page_size > 0 ? p.page_table(lens) : typename SpeContextProblem<T>::PageTable{};
  const auto layer = [&](std::int32_t l) {
    return KVCache<T>(ContiguousKVView<T>::packed(p.layer_k[std::size_t(l)].data(), p.layer_v[std::size_t(l)].data(),
                                                  c.batch, c.kv_heads, c.max_tokens, c.head_dim, lens.data()));
  };
  const auto head_input = [&] {
    return c.head_page_size > 0 ? KVCache<const T>(p.head_view(pages.data(), table)) : KVCache<const T>(layer(0));
  };
  step.prepare({.cache = head_input(), .slots = p.slots.data(),
                .k_pre_rope = SequenceView<const T>::packed(p.k_r.data(), c.batch, c.kv_heads, c.max_tokens, c.head_dim)},
               ctx);
  lens = p.lengths;
  if (c.head_page_size > 0) table = p.page_table(lens);
  step.select({.q = QueryView<const T>::packed(p.q_r.data(), c.batch, c.q_heads, c.head_dim),
               .k = HeadsView<const T>::packed(p.k_step.data(), c.batch, c.kv_heads, c.head_dim),
               .cache = head_input(), .slots = p.slots.data()},
              ws.bytes(), ctx);
  Run run;
  const SelectionView sel = step.selection(ws.bytes(), c.batch);
  run.indices.assign(sel.indices, sel.indices + std::size_t(c.batch) * c.kv_heads * sel.capacity);
  run.counts.assign(sel.counts, sel.counts + std::size_t(c.batch) * c.kv_heads);
  for (std::int32_t l = 0; l < c.layers; ++l) {
    std::vector<T> o(std::size_t(c.batch) * c.q_heads * c.head_dim, from_float<T>(kPoison));
    std::vector<float> lse(std::size_t(c.batch) * c.q_heads, kPoison);
    const std::size_t at = std::size_t(l) * c.batch * c.kv_heads * c.head_dim;
    step.attend({.q = QueryView<const T>::packed(p.layer_q.data() + std::size_t(l) * c.batch * c.q_heads * c.head_dim,
                                                 c.batch, c.q_heads, c.head_dim),
                 .cache = layer(l), .k = HeadsView<const T>::packed(p.step_k.data() + at, c.batch, c.kv_heads, c.head_dim),
                 .v = HeadsView<const T>::packed(p.step_v.data() + at, c.batch, c.kv_heads, c.head_dim), .layer = l},
                StateView<T>::packed(o.data(), lse.data(), c.batch, c.q_heads, c.head_dim), ws.bytes(), ctx);
    run.o.push_back(bits(o));
    run.lse.push_back(lse);
  }
  run.head_keys = head_rows(p, step.selector().head_cache(head_input(), p.slots.data(), lens.data(), c.batch));
  return run;
}

/// The same step on the GPU, eager, then (graph) select and every layer's attention captured and replayed twice:
/// the replays must equal the eager run bit for bit. Returns the eager run.
template <class T>
Run run_gpu(const SpeContextProblem<T>& p, SpeContextMode mode, std::int32_t budget, const AttentionWindow& window,
            bool graph) {
  const auto& c = p.spec;
  cudaStream_t stream;
  KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cuda::Context ctx{stream};
  SpeContextStep<T, cuda::Context> step(SpeContext<T, cuda::Context>(p.limits(), selector_config(p, mode, budget), ctx),
                                        step_config(p, window), ctx);
  DeviceBuffer<std::byte> ws(step.workspace_bytes());
  ws.poison();
  DeviceBuffer<std::int32_t> slots(p.slots), lens(p.prompt_lengths);
  std::vector<DeviceBuffer<T>> layer_k, layer_v;
  for (std::int32_t l = 0; l < c.layers; ++l) {
    layer_k.emplace_back(p.layer_k[std::size_t(l)]);
    layer_v.emplace_back(p.layer_v[std::size_t(l)]);
  }
  DeviceBuffer<T> k_r(p.k_r), q_r(p.q_r), k_step(p.k_step), step_k(p.step_k), step_v(p.step_v), layer_q(p.layer_q);
  DeviceBuffer<T> pages(std::size_t(std::max(p.head_num_pages, 1)) * std::max(c.head_page_size, 1) * c.kv_heads * c.head_dim);
  pages.poison();
  // (owned head cache: one-entry dummies, never read)
  auto table = c.head_page_size > 0 ? p.page_table(p.prompt_lengths)
                                    : typename SpeContextProblem<T>::PageTable{{0}, {0}, {0}};
  DeviceBuffer<std::int32_t> indptr(table.indptr), indices(table.indices), last(table.last_len);
  const auto layer = [&](std::int32_t l) {
    return KVCache<T>(ContiguousKVView<T>::packed(layer_k[std::size_t(l)].data(), layer_v[std::size_t(l)].data(), c.batch,
                                                  c.kv_heads, c.max_tokens, c.head_dim, lens.data()));
  };
  const auto head_input = [&] {
    if (c.head_page_size == 0) return KVCache<const T>(layer(0));
    PagedKVView<T> view = p.head_view(pages.data(), table);
    view.page_indptr = indptr.data();
    view.page_indices = indices.data();
    view.last_page_len = last.data();
    return KVCache<const T>(view);
  };
  step.prepare({.cache = head_input(), .slots = slots.data(),
                .k_pre_rope = SequenceView<const T>::packed(k_r.data(), c.batch, c.kv_heads, c.max_tokens, c.head_dim)},
               ctx);
  lens.upload(p.lengths);
  if (c.head_page_size > 0) {
    table = p.page_table(p.lengths);
    indptr = DeviceBuffer<std::int32_t>(table.indptr);
    indices = DeviceBuffer<std::int32_t>(table.indices);
    last = DeviceBuffer<std::int32_t>(table.last_len);
  }
  std::vector<DeviceBuffer<T>> o;
  std::vector<DeviceBuffer<float>> lse;
  for (std::int32_t l = 0; l < c.layers; ++l) {
    o.emplace_back(std::size_t(c.batch) * c.q_heads * c.head_dim);
    lse.emplace_back(std::size_t(c.batch) * c.q_heads);
    o.back().poison();
    lse.back().poison();
  }
  const auto work = [&] {
    step.select({.q = QueryView<const T>::packed(q_r.data(), c.batch, c.q_heads, c.head_dim),
                 .k = HeadsView<const T>::packed(k_step.data(), c.batch, c.kv_heads, c.head_dim),
                 .cache = head_input(), .slots = slots.data()},
                {ws.data(), ws.size()}, ctx);
    for (std::int32_t l = 0; l < c.layers; ++l) {
      const std::size_t at = std::size_t(l) * c.batch * c.kv_heads * c.head_dim;
      step.attend({.q = QueryView<const T>::packed(layer_q.data() + std::size_t(l) * c.batch * c.q_heads * c.head_dim,
                                                   c.batch, c.q_heads, c.head_dim),
                   .cache = layer(l),
                   .k = HeadsView<const T>::packed(step_k.data() + at, c.batch, c.kv_heads, c.head_dim),
                   .v = HeadsView<const T>::packed(step_v.data() + at, c.batch, c.kv_heads, c.head_dim), .layer = l},
                  StateView<T>::packed(o[std::size_t(l)].data(), lse[std::size_t(l)].data(), c.batch, c.q_heads,
                                       c.head_dim),
                  {ws.data(), ws.size()}, ctx);
    }
  };
  work();
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  Run run;
  const auto read = [&](Run& r) {
    const SelectionView sel = step.selection({ws.data(), ws.size()}, c.batch);
    r.indices.resize(std::size_t(c.batch) * c.kv_heads * sel.capacity);
    r.counts.resize(std::size_t(c.batch) * c.kv_heads);
    KVSIFT_CUDA_CHECK(cudaMemcpy(r.indices.data(), sel.indices, r.indices.size() * 4, cudaMemcpyDeviceToHost));
    KVSIFT_CUDA_CHECK(cudaMemcpy(r.counts.data(), sel.counts, r.counts.size() * 4, cudaMemcpyDeviceToHost));
    r.o.clear();
    r.lse.clear();
    for (std::int32_t l = 0; l < c.layers; ++l) {
      r.o.push_back(bits(o[std::size_t(l)].download()));
      r.lse.push_back(lse[std::size_t(l)].download());
    }
  };
  read(run);
  {  // the head cache's rows, copied to the host and read through a host view of the same layout
    const KVCache<const T> head = step.selector().head_cache(head_input(), slots.data(), lens.data(), c.batch);
    if (c.head_page_size > 0) {
      const std::vector<T> host_pages = pages.download();
      run.head_keys = head_rows(p, KVCache<const T>(p.head_view(host_pages.data(), table)));
    } else {
      std::vector<T> owned(std::size_t(p.max_slots) * c.kv_heads * c.max_tokens * c.head_dim);
      KVSIFT_CUDA_CHECK(cudaMemcpy(owned.data(), head.paged.k_pages, owned.size() * sizeof(T), cudaMemcpyDeviceToHost));
      PagedKVView<const T> host = head.paged;
      std::vector<std::int32_t> iota(std::size_t(c.batch) + 1);
      std::iota(iota.begin(), iota.end(), 0);
      host.k_pages = host.v_pages = owned.data();
      host.page_indptr = iota.data();
      host.page_indices = p.slots.data();
      host.last_page_len = p.lengths.data();
      run.head_keys = head_rows(p, KVCache<const T>(host));
    }
  }
  if (graph) {
    for (auto& x : o) x.poison();
    for (auto& x : lse) x.poison();
    ws.poison();
    const CapturedGraph captured(stream, work);
    for (int replay = 0; replay < 2; ++replay) {
      captured.launch();
      KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
      Run again;
      read(again);
      EXPECT_EQ(again.counts, run.counts) << "replay " << replay;
      EXPECT_EQ(again.indices, run.indices) << "replay " << replay;
      EXPECT_EQ(again.o, run.o) << "replay " << replay;
      EXPECT_EQ(again.lse, run.lse) << "replay " << replay;
    }
  }
  KVSIFT_CUDA_CHECK(cudaStreamDestroy(stream));
  return run;
}

TYPED_TEST(CudaSpeContext, EqualsCpuTwinAndReplaysInAGraph) {
  using T = TypeParam;
  SCOPED_TRACE(this->seed);
  for (const bool batch_level : {false, true}) {
    for (const AttentionWindow window : {AttentionWindow{}, AttentionWindow{4, 64}}) {
      for (const std::int32_t page_size : {0, 16}) {
        const SpeContextProblem<T> p(this->rng, {.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
                                                 .max_tokens = 512, .min_length = 60, .max_length = 500,
                                                 .head_page_size = page_size});
        const std::string what = fmt::format("{} window {}+{} {}", batch_level ? "batch-level" : "per kv head",
                                             window.sink, window.recent, page_size > 0 ? "engine paged" : "owned");
        SCOPED_TRACE(what);
        const SpeContextMode mode = batch_level ? SpeContextMode::batch_level : SpeContextMode::per_kv_head;
        const std::int32_t budget = 48;
        const Run cpu = run_cpu(p, mode, budget, specontext_window(window));
        const Run gpu = run_gpu(p, mode, budget, specontext_window(window), /*graph=*/true);
        {  // the rotated head keys: the CPU's but where the two backends' tables differ by an fp32 ulp
          ASSERT_EQ(gpu.head_keys.size(), cpu.head_keys.size());
          std::size_t differ = 0, far = 0;
          for (std::size_t i = 0; i < gpu.head_keys.size(); ++i) {
            if (gpu.head_keys[i] == cpu.head_keys[i]) continue;
            ++differ;
            T a, b;
            std::memcpy(&a, &gpu.head_keys[i], sizeof(T));
            std::memcpy(&b, &cpu.head_keys[i], sizeof(T));
            far += !(std::abs(to_float(a) - to_float(b)) <= 1e-2 * std::abs(to_float(b)));
          }
          EXPECT_EQ(far, 0u) << "head keys differ from the CPU's by more than an ulp";
          EXPECT_LE(differ * 100, gpu.head_keys.size()) << "over 1% of the head keys differ from the CPU's";
        }
        const AttentionWindow effective = specontext_window(window);
        expect_head_selection(p, gpu.indices, gpu.counts, budget, budget, effective, batch_level, "CUDA " + what);
        std::int32_t same_rows = 0;
        for (std::int32_t row = 0; row < p.spec.batch * p.spec.kv_heads; ++row) {
          same_rows += selection_row(gpu.indices, gpu.counts, row, budget) ==
                       selection_row(cpu.indices, cpu.counts, row, budget);
        }
        // Rows may differ only at fp32 near-ties of the k-th score (expect_head_selection bounds them).
        EXPECT_GE(same_rows * 2, p.spec.batch * p.spec.kv_heads) << "fewer than half the rows equal the CPU's";
        for (std::int32_t l = 0; l < p.spec.layers; ++l) {
          std::vector<T> o(gpu.o[std::size_t(l)].size());
          std::memcpy(o.data(), gpu.o[std::size_t(l)].data(), o.size() * sizeof(T));
          expect_close(o, gpu.lse[std::size_t(l)], p.attention(l, gpu.indices, gpu.counts, budget, effective),
                       fmt::format("CUDA layer {}", l));
          if (gpu.indices == cpu.indices && gpu.counts == cpu.counts) {
            std::vector<T> want(o.size());
            std::memcpy(want.data(), cpu.o[std::size_t(l)].data(), want.size() * sizeof(T));
            HostState cpu_state(p.spec.batch, p.spec.q_heads, p.spec.head_dim);
            for (std::size_t i = 0; i < want.size(); ++i) cpu_state.o[i] = to_float(want[i]);
            cpu_state.lse = cpu.lse[std::size_t(l)];
            expect_close(o, gpu.lse[std::size_t(l)], cpu_state, fmt::format("CUDA vs CPU layer {}", l));
          }
        }
      }
    }
  }
}

class CudaSpeContextPrimitives : public GpuTest {};

TEST_F(CudaSpeContextPrimitives, MaxScoreRowsEqualsCpuBitForBit) {
  const std::int32_t rows = 5, group = 8, cols = 3000;
  const auto scores = rng.normal(std::size_t(rows) * group * cols);
  const std::vector<std::int32_t> lengths = {3000, 1, 0, 2999, 5000};
  std::vector<float> want(std::size_t(rows) * cols);
  std::memset(want.data(), 0xff, want.size() * sizeof(float));  // the device poison's bits: unwritten columns compare
  cpu::max_score_rows(MatrixView<const float>::packed(scores.data(), rows * group, cols), group, lengths.data(),
                      MatrixView<float>::packed(want.data(), rows, cols));
  DeviceBuffer<float> d_scores(scores), d_out(want.size());
  DeviceBuffer<std::int32_t> d_lengths(lengths);
  d_out.poison();
  cuda::max_score_rows(MatrixView<const float>::packed(d_scores.data(), rows * group, cols), group, d_lengths.data(),
                       MatrixView<float>::packed(d_out.data(), rows, cols), nullptr);
  const auto got = d_out.download();
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
}

TEST(CudaSpeContextBadInput, MaxScoreRowsRefusesBadShapes) {
  std::vector<float> buffer(64);
  std::vector<std::int32_t> lengths(2, 4);
  const auto in = MatrixView<const float>::packed(buffer.data(), 8, 4);
  expect_error([&] { cuda::max_score_rows(in, 0, lengths.data(), MatrixView<float>::packed(buffer.data(), 2, 4), nullptr); },
               {"cuda::max_score_rows", "group (= 0)"});
  expect_error([&] { cuda::max_score_rows(in, 3, lengths.data(), MatrixView<float>::packed(buffer.data(), 2, 4), nullptr); },
               {"scores.rows (= 8)"});
}

}  // namespace
}  // namespace kvsift::test
