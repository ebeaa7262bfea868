// SpeContext on CUDA against its CPU twin: the head's rotated keys (bit for bit but where the backends' RoPE tables
// differ by an fp32 ulp: then one ulp of T, on under 1% of them), the selections (per kv head and batch-level, owned
// and engine-kept paged head caches) against the fp64 brute force and equal to the CPU's but at near-ties (each
// token only one backend picks scores within eps of the k-th), every layer's output against the fp64 reference and,
// for the rows both backends select alike, the CPU's; the graph capture of select and
// the attention of all layers, replayed, equal to the eager run bit for bit; a length past max_tokens contained to
// its row; max_score_rows equal to the CPU's.
// Offloaded layers (selectors/specontext/offload.hpp): a 4-layer model over 5 steps of growing sequences with the last 2
// layers' KV in pinned host caches equals the same step with every layer on the GPU (the selections identical, the
// GPU layers bit for bit, every layer within rounding of fp64 attention over the selection and the step's token),
// moves |new \ resident| rows per step; its captured step (select, copies, every layer) replays as the eager one;
// the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <functional>
#include <iterator>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <set>

#include "gpu_test.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cuda/backend.hpp"
#include "kvsift/selectors/specontext/groups.hpp"
#include "kvsift/selectors/specontext/specontext.hpp"
#include "kvsift/selectors/specontext/offload.hpp"
#include "kvsift/selectors/specontext/step.hpp"
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
  /// With a rerank per layer: each layer's kept rows [batch, kv_heads, rerank.budget] and counts (eager run).
  std::vector<std::vector<std::int32_t>> kept, kept_counts;
};

/// The distance in ulps of two 16-bit floats of one format (bf16 or half): their bits as ordered integers.
std::int32_t ulps_apart(std::uint16_t a, std::uint16_t b) {
  const auto ordered = [](std::uint16_t x) { return (x & 0x8000u) ? -std::int32_t(x & 0x7fffu) : std::int32_t(x); };
  return std::abs(ordered(a) - ordered(b));
}

/// Row `row` of two selections that differ: every token in their symmetric difference scores (fp64 reference)
/// within kSpeContextScoreEps x the row's largest score of the k-th score of its middle (a near-tie).
template <class T>
void expect_near_ties(const SpeContextProblem<T>& p, std::int32_t row, const std::vector<std::int32_t>& a,
                      const std::vector<std::int32_t>& b, std::int32_t budget, const AttentionWindow& window,
                      bool batch_level, const std::string& what) {
  const std::int32_t kv = p.spec.kv_heads, seq = row / kv, len = p.lengths[std::size_t(seq)];
  const auto scores = p.scores(seq, row % kv, batch_level);
  std::vector<double> middle(scores.begin() + window.sink_end(len), scores.begin() + window.recent_begin(len));
  ASSERT_GT(std::int32_t(middle.size()), budget) << what << ": row " << row << " differs but takes its middle whole";
  std::sort(middle.begin(), middle.end(), std::greater<>());
  const double kth = middle[std::size_t(budget) - 1];
  const double eps = kSpeContextScoreEps * *std::max_element(scores.begin(), scores.end());
  std::vector<std::int32_t> differ;
  std::set_symmetric_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(differ));
  for (const std::int32_t t : differ) {
    EXPECT_NEAR(scores[std::size_t(t)], kth, eps)
        << what << ": row " << row << " token " << t << " is picked by one backend only but is no near-tie";
  }
}

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
SpeContextStepConfig step_config(const SpeContextProblem<T>& p, const AttentionWindow& window,
                                 const RerankConfig& rerank = {}) {
  const auto& c = p.spec;
  return {.step = {.attention = {.window = window}, .max_batch = c.batch, .q_heads = c.q_heads, .kv_heads = c.kv_heads,
                   .head_dim = c.head_dim, .max_seq_len = c.max_tokens},
          .layers = c.layers,
          .rerank = rerank};
}
template <class T>
SpeContextConfig selector_config(const SpeContextProblem<T>& p, SpeContextMode mode, std::int32_t budget) {
  return {.budget = budget, .mode = mode,
          .head_cache = p.spec.head_page_size > 0 ? SpeContextHeadCache::engine : SpeContextHeadCache::owned,
          .rope = test_head_rope()};
}

/// Layer l's inputs from a problem's device copies: its query, its cache, the step's K/V rows.
template <class T>
SpeContextLayerInputs<T> device_layer_inputs(const SpeContextSpec& c, const DeviceBuffer<T>& layer_q,
                                             const DeviceBuffer<T>& step_k, const DeviceBuffer<T>& step_v,
                                             KVCache<T> cache, std::int32_t l) {
  const std::size_t at = std::size_t(l) * c.batch * c.kv_heads * c.head_dim;
  return {.q = QueryView<const T>::packed(layer_q.data() + std::size_t(l) * c.batch * c.q_heads * c.head_dim, c.batch,
                                          c.q_heads, c.head_dim),
          .cache = cache,
          .k = HeadsView<const T>::packed(step_k.data() + at, c.batch, c.kv_heads, c.head_dim),
          .v = HeadsView<const T>::packed(step_v.data() + at, c.batch, c.kv_heads, c.head_dim),
          .layer = l};
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
/// the replays must equal the eager run bit for bit. Returns the eager run (with `rerank`: each layer's kept rows).
template <class T>
Run run_gpu(const SpeContextProblem<T>& p, SpeContextMode mode, std::int32_t budget, const AttentionWindow& window,
            bool graph, const RerankConfig& rerank = {}) {
  const auto& c = p.spec;
  const test::Stream stream;
  const cuda::Context ctx{stream};
  SpeContextStep<T, cuda::Context> step(SpeContext<T, cuda::Context>(p.limits(), selector_config(p, mode, budget), ctx),
                                        step_config(p, window, rerank), ctx);
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
  Run run;
  // record: each layer's kept rows, read after its attention (eager only: it synchronizes)
  const auto work_recording = [&](bool record) {
    step.select({.q = QueryView<const T>::packed(q_r.data(), c.batch, c.q_heads, c.head_dim),
                 .k = HeadsView<const T>::packed(k_step.data(), c.batch, c.kv_heads, c.head_dim),
                 .cache = head_input(), .slots = slots.data()},
                {ws.data(), ws.size()}, ctx);
    for (std::int32_t l = 0; l < c.layers; ++l) {
      step.attend(device_layer_inputs(c, layer_q, step_k, step_v, layer(l), l),
                  StateView<T>::packed(o[std::size_t(l)].data(), lse[std::size_t(l)].data(), c.batch, c.q_heads,
                                       c.head_dim),
                  {ws.data(), ws.size()}, ctx);
      if (record && rerank.budget > 0) {
        const SelectionView kept = step.reranked_selection({ws.data(), ws.size()}, c.batch);
        std::vector<std::int32_t> rows(std::size_t(c.batch) * c.kv_heads * kept.capacity);
        std::vector<std::int32_t> counts(std::size_t(c.batch) * c.kv_heads);
        KVSIFT_CUDA_CHECK(cudaMemcpyAsync(rows.data(), kept.indices, rows.size() * 4, cudaMemcpyDeviceToHost, stream));
        KVSIFT_CUDA_CHECK(cudaMemcpyAsync(counts.data(), kept.counts, counts.size() * 4, cudaMemcpyDeviceToHost, stream));
        KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        run.kept.push_back(std::move(rows));
        run.kept_counts.push_back(std::move(counts));
      }
    }
  };
  const auto work = [&] { work_recording(false); };
  work_recording(true);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
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
        {  // the rotated head keys: the CPU's but where the two backends' tables differ by an fp32 ulp: one ulp of T
          ASSERT_EQ(gpu.head_keys.size(), cpu.head_keys.size());
          std::size_t differ = 0, far = 0;
          for (std::size_t i = 0; i < gpu.head_keys.size(); ++i) {
            const std::int32_t apart = ulps_apart(gpu.head_keys[i], cpu.head_keys[i]);
            differ += apart != 0;
            far += apart > 1;
          }
          EXPECT_EQ(far, 0u) << "head keys differ from the CPU's by more than one ulp";
          EXPECT_LE(differ * 100, gpu.head_keys.size()) << "over 1% of the head keys differ from the CPU's";
        }
        const AttentionWindow effective = specontext_window(window);
        expect_head_selection(p, gpu.indices, gpu.counts, budget, budget, effective, batch_level, "CUDA " + what);
        // Rows may differ only at near-ties: every token one backend picks and the other not scores (fp64) within
        // the selection check's eps of the row's k-th score. Outputs are compared where the rows match.
        const std::int32_t kv = p.spec.kv_heads, group = p.spec.q_heads / kv, d = p.spec.head_dim;
        std::int32_t same_rows = 0;
        std::vector<std::int32_t> same_heads;  // query heads (b * q_heads + h) of the rows equal on both backends
        for (std::int32_t row = 0; row < p.spec.batch * kv; ++row) {
          const auto g_row = selection_row(gpu.indices, gpu.counts, row, budget);
          const auto c_row = selection_row(cpu.indices, cpu.counts, row, budget);
          if (g_row == c_row) {
            ++same_rows;
            for (std::int32_t h = 0; h < group; ++h) same_heads.push_back((row / kv) * p.spec.q_heads + (row % kv) * group + h);
            continue;
          }
          expect_near_ties(p, row, g_row, c_row, budget, effective, batch_level, what);
        }
        EXPECT_GE(same_rows * 2, p.spec.batch * kv) << "fewer than half the rows equal the CPU's";
        for (std::int32_t l = 0; l < p.spec.layers; ++l) {
          std::vector<T> o(gpu.o[std::size_t(l)].size());
          std::memcpy(o.data(), gpu.o[std::size_t(l)].data(), o.size() * sizeof(T));
          expect_close(o, gpu.lse[std::size_t(l)], p.attention(l, gpu.indices, gpu.counts, budget, effective),
                       fmt::format("CUDA layer {}", l));
          if (same_heads.empty()) continue;
          std::vector<T> got(same_heads.size() * std::size_t(d)), want(got.size());
          std::vector<float> got_lse(same_heads.size());
          HostState cpu_state(1, std::int32_t(same_heads.size()), d);
          for (std::size_t i = 0; i < same_heads.size(); ++i) {
            const std::size_t head = std::size_t(same_heads[i]);
            std::memcpy(got.data() + i * d, gpu.o[std::size_t(l)].data() + head * d, std::size_t(d) * sizeof(T));
            std::memcpy(want.data() + i * d, cpu.o[std::size_t(l)].data() + head * d, std::size_t(d) * sizeof(T));
            got_lse[i] = gpu.lse[std::size_t(l)][head];
            cpu_state.lse[i] = cpu.lse[std::size_t(l)][head];
          }
          for (std::size_t i = 0; i < want.size(); ++i) cpu_state.o[i] = to_float(want[i]);
          expect_close(got, got_lse, cpu_state, fmt::format("CUDA vs CPU layer {} (the rows both select alike)", l));
        }
      }
    }
  }
}

/// config.rerank on the GPU: each layer keeps the best 16 of the step's 48 candidates by its own exact scores
/// (fp64: the layer's group softmax over the candidates, max over the group) and attends them (fp64 attention);
/// the captured step replays bit for bit.
TYPED_TEST(CudaSpeContext, RerankPerLayerKeepsEachLayersBestCandidates) {
  using T = TypeParam;
  SCOPED_TRACE(this->seed);
  constexpr std::int32_t kCandidates = 48, kKept = 16;
  const SpeContextProblem<T> p(this->rng, {.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128,
                                           .max_tokens = 512, .min_length = 120, .max_length = 500});
  const auto& c = p.spec;
  const AttentionWindow window = specontext_window({4, 64});
  const Run gpu = run_gpu(p, SpeContextMode::per_kv_head, kCandidates, window, /*graph=*/true, {.budget = kKept});
  ASSERT_EQ(std::int32_t(gpu.kept.size()), c.layers);
  for (std::int32_t l = 0; l < c.layers; ++l) {
    SCOPED_TRACE(fmt::format("layer {}", l));
    for (std::int32_t row = 0; row < c.batch * c.kv_heads; ++row) {
      const std::int32_t b = row / c.kv_heads, g = row % c.kv_heads;
      const auto candidates = selection_row(gpu.indices, gpu.counts, row, kCandidates);
      ASSERT_GT(candidates.size(), std::size_t(kKept));
      const auto scores = p.layer_rerank_scores(l, b, g, candidates);
      double top = 0;
      for (const auto& [id, score] : scores) top = std::max(top, score);
      expect_top_k(selection_row(gpu.kept[std::size_t(l)], gpu.kept_counts[std::size_t(l)], row, kKept), scores, kKept,
                   1e-4 * top, fmt::format("row {}", row));
    }
    std::vector<T> o(gpu.o[std::size_t(l)].size());
    std::memcpy(o.data(), gpu.o[std::size_t(l)].data(), o.size() * sizeof(T));
    expect_close(o, gpu.lse[std::size_t(l)],
                 p.attention(l, gpu.kept[std::size_t(l)], gpu.kept_counts[std::size_t(l)], kKept, window),
                 fmt::format("CUDA layer {}", l));
  }
}

/// SpeContextGroups on the GPU: three heads for the groups {0}, {1, 2} and {3} of four layers sharing one
/// workspace; each group's selection against its head's fp64 brute force, each layer's output against fp64 attention
/// over its group's selection; then the whole step (three selects, four layers) captured and replayed twice, equal
/// to the eager run bit for bit.
TYPED_TEST(CudaSpeContext, GroupsAttendEachLayerWithItsHeadsSelection) {
  using T = TypeParam;
  SCOPED_TRACE(this->seed);
  constexpr std::int32_t kBudget = 48, kGroups = 3;
  const SpeContextProblem<T> p(this->rng, {.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 128, .max_tokens = 512,
                                           .min_length = 120, .max_length = 500, .layers = 4});
  const auto& c = p.spec;
  const std::vector<SpeContextProblem<T>> heads{p, p.with_new_head(this->rng), p.with_new_head(this->rng)};
  const std::vector<std::int32_t> first_layers{0, 1, 3}, group_of{0, 1, 1, 2};
  const AttentionWindow window = specontext_window({4, 64});
  const test::Stream stream;
  const cuda::Context ctx{stream};
  std::vector<SpeContext<T, cuda::Context>> selectors;
  for (std::int32_t g = 0; g < kGroups; ++g) {
    selectors.emplace_back(p.limits(), selector_config(p, SpeContextMode::per_kv_head, kBudget), ctx);
  }
  SpeContextGroups<T, cuda::Context> groups(std::move(selectors),
                                            {.step = step_config(p, window), .first_layers = first_layers}, ctx);
  DeviceBuffer<std::byte> ws(groups.workspace_bytes());
  ws.poison();
  DeviceBuffer<std::int32_t> slots(p.slots), lens(p.prompt_lengths);
  std::vector<DeviceBuffer<T>> layer_k, layer_v, k_r, q_r, k_step, o;
  std::vector<DeviceBuffer<float>> lse;
  for (std::int32_t l = 0; l < c.layers; ++l) {
    layer_k.emplace_back(p.layer_k[std::size_t(l)]);
    layer_v.emplace_back(p.layer_v[std::size_t(l)]);
    o.emplace_back(std::size_t(c.batch) * c.q_heads * c.head_dim);
    lse.emplace_back(std::size_t(c.batch) * c.q_heads);
  }
  for (const auto& h : heads) {
    k_r.emplace_back(h.k_r);
    q_r.emplace_back(h.q_r);
    k_step.emplace_back(h.k_step);
  }
  DeviceBuffer<T> step_k(p.step_k), step_v(p.step_v), layer_q(p.layer_q);
  const auto layer = [&](std::int32_t l) {
    return KVCache<T>(ContiguousKVView<T>::packed(layer_k[std::size_t(l)].data(), layer_v[std::size_t(l)].data(), c.batch,
                                                  c.kv_heads, c.max_tokens, c.head_dim, lens.data()));
  };
  for (std::int32_t g = 0; g < kGroups; ++g) {
    groups.prepare(g,
                   {.cache = KVCache<const T>(layer(0)), .slots = slots.data(),
                    .k_pre_rope = SequenceView<const T>::packed(k_r[std::size_t(g)].data(), c.batch, c.kv_heads,
                                                                c.max_tokens, c.head_dim)},
                   ctx);
  }
  lens.upload(p.lengths);
  // One decode step: each group's select before its first layer, then its layers. `check`: read each group's
  // selection after its select (eager only: it synchronizes).
  std::vector<std::vector<std::int32_t>> indices(kGroups), counts(kGroups);
  const auto step = [&](bool check) {
    for (std::int32_t l = 0; l < c.layers; ++l) {
      const std::int32_t g = group_of[std::size_t(l)];
      if (first_layers[std::size_t(g)] == l) {
        groups.select(g,
                      {.q = QueryView<const T>::packed(q_r[std::size_t(g)].data(), c.batch, c.q_heads, c.head_dim),
                       .k = HeadsView<const T>::packed(k_step[std::size_t(g)].data(), c.batch, c.kv_heads, c.head_dim),
                       .cache = KVCache<const T>(layer(0)), .slots = slots.data()},
                      {ws.data(), ws.size()}, ctx);
        if (check) {
          const SelectionView sel = groups.step(g).selection({ws.data(), ws.size()}, c.batch);
          indices[std::size_t(g)].resize(std::size_t(c.batch) * c.kv_heads * sel.capacity);
          counts[std::size_t(g)].resize(std::size_t(c.batch) * c.kv_heads);
          KVSIFT_CUDA_CHECK(cudaMemcpyAsync(indices[std::size_t(g)].data(), sel.indices, indices[std::size_t(g)].size() * 4,
                                            cudaMemcpyDeviceToHost, stream));
          KVSIFT_CUDA_CHECK(cudaMemcpyAsync(counts[std::size_t(g)].data(), sel.counts, counts[std::size_t(g)].size() * 4,
                                            cudaMemcpyDeviceToHost, stream));
          KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
        }
      }
      groups.attend(device_layer_inputs(c, layer_q, step_k, step_v, layer(l), l),
                    StateView<T>::packed(o[std::size_t(l)].data(), lse[std::size_t(l)].data(), c.batch, c.q_heads,
                                         c.head_dim),
                    {ws.data(), ws.size()}, ctx);
    }
  };
  for (auto& x : o) x.poison();
  for (auto& x : lse) x.poison();
  step(true);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<std::vector<T>> eager_o;
  std::vector<std::vector<float>> eager_lse;
  for (std::int32_t g = 0; g < kGroups; ++g) {
    expect_head_selection(heads[std::size_t(g)], indices[std::size_t(g)], counts[std::size_t(g)], kBudget, kBudget,
                          window, false, fmt::format("CUDA group {}", g));
  }
  for (std::int32_t l = 0; l < c.layers; ++l) {
    const std::size_t g = std::size_t(group_of[std::size_t(l)]);
    eager_o.push_back(o[std::size_t(l)].download());
    eager_lse.push_back(lse[std::size_t(l)].download());
    expect_close(eager_o.back(), eager_lse.back(), p.attention(l, indices[g], counts[g], kBudget, window),
                 fmt::format("CUDA layer {} (group {})", l, g));
  }
  for (auto& x : o) x.poison();
  for (auto& x : lse) x.poison();
  ws.poison();
  const CapturedGraph captured(stream, [&] { step(false); });
  for (int replay = 0; replay < 2; ++replay) {
    captured.launch();
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (std::int32_t l = 0; l < c.layers; ++l) {
      EXPECT_EQ(bits(o[std::size_t(l)].download()), bits(eager_o[std::size_t(l)])) << "replay " << replay << " layer " << l;
      EXPECT_EQ(lse[std::size_t(l)].download(), eager_lse[std::size_t(l)]) << "replay " << replay << " layer " << l;
    }
  }
}

class CudaSpeContextPrimitives : public GpuTest {};

TEST_F(CudaSpeContextPrimitives, MaxScoreRowsEqualsCpuBitForBit) {
  const std::int32_t rows = 5, group = 8, cols = 3000;
  auto scores = rng.normal(std::size_t(rows) * group * cols);
  // A NaN in one head of row 0 (column 17, group member 3): the maximum there is NaN on both (payloads may differ).
  scores[std::size_t(3) * cols + 17] = std::numeric_limits<float>::quiet_NaN();
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
  auto got = d_out.download();
  EXPECT_TRUE(std::isnan(got[17]) && std::isnan(want[17])) << got[17] << " " << want[17];
  got[17] = want[17] = 0.0f;
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
}

/// CUDA trusts the lengths: one of max_tokens + 1 (the owned head cache's page is max_tokens rows) in batch row 1.
/// append skips that row's write (no other sequence's head keys change; the valid rows' step keys are written at
/// their positions) and select gives the row count -1; the other rows are selected.
/// A SpeContext selector on the GPU over a problem's retrieval head (owned head cache, layer 0's lengths): the
/// problem's device copies, prepare of every prompt, and one step (append, then select into counts [batch *
/// kv_heads], counts poisoned with 0x7f bytes rather than -1 so that an unwritten count shows).
template <class T>
struct DeviceHeadStep {
  static constexpr std::int32_t kBudget = 16;
  const SpeContextProblem<T>& p;
  cuda::Context ctx{};
  SpeContext<T, cuda::Context> s;
  DeviceBuffer<std::int32_t> slots, lens;
  DeviceBuffer<T> layer_k, layer_v, k_r, q_r, k_step;
  KVCache<const T> cache;

  DeviceHeadStep(const SpeContextProblem<T>& problem, SpeContextMode mode)
      : p(problem), s(p.limits(), selector_config(p, mode, kBudget), ctx), slots(p.slots), lens(p.prompt_lengths),
        layer_k(p.layer_k[0]), layer_v(p.layer_v[0]), k_r(p.k_r), q_r(p.q_r), k_step(p.k_step) {
    const auto& c = p.spec;
    cache = ContiguousKVView<const T>::packed(layer_k.data(), layer_v.data(), c.batch, c.kv_heads, c.max_tokens,
                                              c.head_dim, lens.data());
    s.prepare({.cache = cache, .slots = slots.data(),
               .k_pre_rope = SequenceView<const T>::packed(k_r.data(), c.batch, c.kv_heads, c.max_tokens, c.head_dim)},
              ctx);
  }
  std::vector<std::int32_t> step(const DeviceBuffer<std::int32_t>& step_lens) {
    const auto& c = p.spec;
    const SelectShape shape{c.batch, c.q_heads, c.kv_heads, c.head_dim, 0};
    DeviceBuffer<std::byte> append_ws(s.append_workspace_bytes(shape, ctx)), select_ws(s.select_workspace_bytes(shape, ctx));
    append_ws.poison();
    select_ws.poison();
    s.append({.cache = cache, .slots = slots.data(), .lengths = step_lens.data(),
              .k_pre_rope = HeadsView<const T>::packed(k_step.data(), c.batch, c.kv_heads, c.head_dim)},
             {append_ws.data(), append_ws.size()}, ctx);
    DeviceBuffer<std::int32_t> indices(std::size_t(c.batch) * c.kv_heads * kBudget), counts(std::size_t(c.batch) * c.kv_heads);
    indices.poison();
    KVSIFT_CUDA_CHECK(cudaMemset(counts.data(), 0x7f, counts.size() * sizeof(std::int32_t)));
    s.select({.q = QueryView<const T>::packed(q_r.data(), c.batch, c.q_heads, c.head_dim), .cache = cache,
              .slots = slots.data(), .lengths = step_lens.data(), .attention = {.window = specontext_window({})}},
             SelectionView{indices.data(), counts.data(), nullptr, c.batch, c.kv_heads, kBudget},
             {select_ws.data(), select_ws.size()}, ctx);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    return counts.download();
  }
};

TEST_F(CudaSpeContextPrimitives, LengthPastMaxTokensIsContained) {
  using T = bfloat16;
  const SpeContextProblem<T> p(rng, {.batch = 3, .max_tokens = 256, .min_length = 40, .max_length = 200});
  const auto& c = p.spec;
  DeviceHeadStep<T> d(p, SpeContextMode::per_kv_head);
  std::vector<std::int32_t> lengths = p.lengths;
  lengths[1] = c.max_tokens + 1;
  DeviceBuffer<std::int32_t> step_lens(lengths);
  const std::size_t owned_size = std::size_t(p.max_slots) * c.kv_heads * c.max_tokens * c.head_dim;
  const T* owned = d.s.head_cache(d.cache, d.slots.data(), step_lens.data(), c.batch).paged.k_pages;
  const auto read_owned = [&] {
    std::vector<T> x(owned_size);
    KVSIFT_CUDA_CHECK(cudaMemcpy(x.data(), owned, owned_size * sizeof(T), cudaMemcpyDeviceToHost));
    return bits(x);
  };
  const auto before = read_owned();
  const auto got_counts = d.step(step_lens);
  auto after = read_owned();
  for (std::int32_t b = 0; b < c.batch; ++b) {
    if (b == 1) continue;
    for (std::int32_t g = 0; g < c.kv_heads; ++g) {  // the valid rows' step keys: written, then masked
      const std::size_t at =
          ((std::size_t(p.slots[std::size_t(b)]) * c.kv_heads + g) * c.max_tokens + std::size_t(lengths[std::size_t(b)] - 1)) *
          c.head_dim;
      EXPECT_FALSE(std::equal(after.begin() + std::ptrdiff_t(at), after.begin() + std::ptrdiff_t(at + c.head_dim),
                              before.begin() + std::ptrdiff_t(at)))
          << "row " << b << " head " << g << ": the step's key was not written";
      std::copy_n(before.begin() + std::ptrdiff_t(at), c.head_dim, after.begin() + std::ptrdiff_t(at));
    }
  }
  EXPECT_EQ(after, before) << "the row past max_tokens wrote into the head cache";
  for (std::int32_t row = 0; row < c.batch * c.kv_heads; ++row) {
    EXPECT_EQ(got_counts[std::size_t(row)], row / c.kv_heads == 1 ? -1 : DeviceHeadStep<T>::kBudget) << "row " << row;
  }
}

/// NaN in the retrieval head's query never vanishes on CUDA either: the rows it scores get count -1 (per kv head,
/// or the whole sequence in batch_level mode, through max_score_rows' NaN-keeping maximum), the others select.
TEST_F(CudaSpeContextPrimitives, ANanHeadQueryMarksTheRowsItScores) {
  using T = bfloat16;
  for (const SpeContextMode mode : {SpeContextMode::per_kv_head, SpeContextMode::batch_level}) {
    SCOPED_TRACE(mode == SpeContextMode::per_kv_head ? "per_kv_head" : "batch_level");
    SpeContextProblem<T> p(rng, {.batch = 2, .max_tokens = 256, .min_length = 40, .max_length = 200});
    const auto& c = p.spec;
    const std::int32_t group = c.q_heads / c.kv_heads;
    p.q_r[(std::size_t(1) * c.q_heads + group) * c.head_dim + 3] = from_float<T>(std::numeric_limits<float>::quiet_NaN());
    DeviceHeadStep<T> d(p, mode);
    const auto got = d.step(DeviceBuffer<std::int32_t>(p.lengths));
    for (std::int32_t b = 0; b < c.batch; ++b) {
      for (std::int32_t g = 0; g < c.kv_heads; ++g) {
        const bool marked = b == 1 && (g == 1 || mode == SpeContextMode::batch_level);
        EXPECT_EQ(got[std::size_t(b) * c.kv_heads + g], marked ? -1 : DeviceHeadStep<T>::kBudget)
            << "row (" << b << ", " << g << ")";
      }
    }
  }
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

// ---- Offloaded layers ----

/// A model over `steps` decode steps of growing sequences, every value a T's (fp32 copies for the reference): the
/// head's pre-RoPE keys and each layer's K/V at every position (the step's token of step t sits at prompt + t), the
/// head's query per step (drifting from one step to the next, so selections overlap as real ones do) and every
/// layer's query per step. One sequence is shorter than the budget (all its tokens selected).
template <class T>
struct OffloadModel {
  static constexpr std::int32_t batch = 3, q_heads = 8, kv_heads = 2, head_dim = 128, max_tokens = 512, layers = 4,
                                steps = 5, budget = 48, max_slots = 4;
  std::vector<std::int32_t> prompt = {29, 300, 449};  ///< tokens before step 0
  std::vector<std::int32_t> slots = {2, 0, 3};
  std::vector<float> head_k;             ///< [batch, kv_heads, max_tokens, head_dim]
  std::vector<std::vector<float>> k, v;  ///< per layer [batch, kv_heads, max_tokens, head_dim]
  std::vector<std::vector<float>> q_r;   ///< per step [batch, q_heads, head_dim]
  std::vector<std::vector<float>> q;     ///< per step [layers, batch, q_heads, head_dim]

  explicit OffloadModel(Random& rng) {
    const auto values = [&](std::size_t n, float stddev) {
      std::vector<float> x = rng.normal(n, stddev);
      for (float& f : x) f = to_float(from_float<T>(f));
      return x;
    };
    const std::size_t cache = std::size_t(batch) * kv_heads * max_tokens * head_dim;
    head_k = values(cache, 1.0f);
    for (std::int32_t l = 0; l < layers; ++l) {
      k.push_back(values(cache, 1.0f));
      v.push_back(values(cache, 1.0f));
    }
    const std::size_t query = std::size_t(batch) * q_heads * head_dim;
    const std::vector<float> q0 = rng.normal(query);
    for (std::int32_t t = 0; t < steps; ++t) {
      std::vector<float> drift = rng.normal(query, 0.3f);
      for (std::size_t i = 0; i < query; ++i) drift[i] = to_float(from_float<T>(q0[i] + drift[i]));
      q_r.push_back(std::move(drift));
      q.push_back(values(query * layers, 1.0f));
    }
  }
  std::size_t at(std::int32_t b, std::int32_t h, std::int32_t token) const {
    return ((std::size_t(b) * kv_heads + h) * max_tokens + token) * head_dim;
  }
  std::int32_t length(std::int32_t b, std::int32_t step) const { return prompt[std::size_t(b)] + step + 1; }
  /// The step's token's rows of `x` (positions prompt + step) [batch, kv_heads, head_dim].
  std::vector<T> step_rows(const std::vector<float>& x, std::int32_t step) const {
    std::vector<float> rows;
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t h = 0; h < kv_heads; ++h) {
        const auto row = x.begin() + std::ptrdiff_t(at(b, h, length(b, step) - 1));
        rows.insert(rows.end(), row, row + head_dim);
      }
    }
    return test::to_storage<T>(rows);
  }
  /// A cache's initial contents: the prompt's rows, NaN from the first step's token on (written by the steps).
  std::vector<T> stored(const std::vector<float>& x) const {
    std::vector<T> s = test::to_storage<T>(x);
    for (std::int32_t b = 0; b < batch; ++b) {
      for (std::int32_t h = 0; h < kv_heads; ++h) {
        std::fill(s.begin() + std::ptrdiff_t(at(b, h, prompt[std::size_t(b)])),
                  s.begin() + std::ptrdiff_t(at(b, h, max_tokens)), from_float<T>(kPoison));
      }
    }
    return s;
  }
};

struct OffloadRun {
  std::vector<std::vector<std::int32_t>> indices, counts;  ///< per step
  std::vector<std::vector<std::vector<float>>> o, lse;     ///< per step, per layer
  std::vector<std::int64_t> rows_moved;                    ///< per step, rows copied per offloaded layer
};

/// The model's steps through the local SpeContextStep (offloaded 0) or its placement::LayersOnHost with the last
/// `offloaded` layers' KV in pinned host caches, eager or one captured step replayed per step. Outputs poisoned
/// before each step.
template <class T>
OffloadRun run_offload_model(const OffloadModel<T>& m, std::int32_t offloaded, bool graph) {
  using M = OffloadModel<T>;
  constexpr std::int32_t batch = M::batch, kv = M::kv_heads, d = M::head_dim, n = M::max_tokens, qh = M::q_heads;
  const std::int32_t first = M::layers - offloaded;
  const test::Stream main, side;
  const cuda::Context ctx{main};
  const OffloadContext offload_ctx{.gpu = ctx, .copy_stream = side};
  const SelectorLimits limits{.max_slots = M::max_slots, .max_tokens = n, .q_heads = qh, .kv_heads = kv, .head_dim = d};
  std::optional<SpeContextStep<T, cuda::Context>> local;
  std::optional<SpeContextStep<T, cuda::Context, placement::LayersOnHost>> offload;
  local.emplace(SpeContext<T, cuda::Context>(limits, {.budget = M::budget, .rope = test_head_rope()}, ctx),
                SpeContextStepConfig{
                    .step = {.max_batch = batch, .q_heads = qh, .kv_heads = kv, .head_dim = d, .max_seq_len = n},
                    .layers = M::layers},
                ctx);
  if (offloaded > 0) {  // the local step moved into the placement
    offload.emplace(std::move(*local), offloaded);
    local.reset();
  }
  // Calls f(step, its context) on whichever step runs.
  const auto on_step = [&](auto&& f) {
    if (offload) return f(*offload, offload_ctx);
    return f(*local, ctx);
  };
  DeviceBuffer<std::byte> ws(on_step([](auto& step, auto&) { return step.workspace_bytes(); }));
  ws.poison();
  std::vector<DeviceBuffer<T>> dk, dv;
  std::vector<std::unique_ptr<PinnedBuffer<T>>> hk, hv;
  for (std::int32_t l = 0; l < M::layers; ++l) {
    if (l < first) {
      dk.emplace_back(m.stored(m.k[std::size_t(l)]));
      dv.emplace_back(m.stored(m.v[std::size_t(l)]));
    } else {
      hk.push_back(std::make_unique<PinnedBuffer<T>>(m.stored(m.k[std::size_t(l)])));
      hv.push_back(std::make_unique<PinnedBuffer<T>>(m.stored(m.v[std::size_t(l)])));
    }
  }
  DeviceBuffer<std::int32_t> lens(m.prompt), slots(m.slots);
  PinnedBuffer<std::int32_t> host_lens(m.prompt);
  DeviceBuffer<T> head_k(test::to_storage<T>(m.head_k)), q_r(std::size_t(batch) * qh * d),
      k_r(std::size_t(batch) * kv * d);
  DeviceBuffer<T> q(std::size_t(M::layers) * batch * qh * d), step_k(std::size_t(M::layers) * batch * kv * d),
      step_v(step_k.size());
  std::vector<DeviceBuffer<float>> o, lse;
  for (std::int32_t l = 0; l < M::layers; ++l) {
    o.emplace_back(std::size_t(batch) * qh * d);
    lse.emplace_back(std::size_t(batch) * qh);
  }
  const auto cache = [&](std::int32_t l) {
    if (l < first) {
      return KVCache<T>(ContiguousKVView<T>::packed(dk[std::size_t(l)].data(), dv[std::size_t(l)].data(), batch, kv, n,
                                                    d, lens.data()));
    }
    return KVCache<T>(ContiguousKVView<T>::packed(
        hk[std::size_t(l - first)]->data(), hv[std::size_t(l - first)]->data(), batch, kv, n, d, host_lens.data()));
  };
  std::vector<KVCache<const T>> host_caches;
  for (std::int32_t l = first; l < M::layers; ++l) host_caches.emplace_back(cache(l));
  on_step([&](auto& step, const auto& step_ctx) {
    step.prepare({.cache = KVCache<const T>(cache(0)),
                  .slots = slots.data(),
                  .k_pre_rope = SequenceView<const T>::packed(head_k.data(), batch, kv, n, d)},
                 step_ctx);
  });
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(main));
  const std::span<std::byte> workspace{ws.data(), ws.size()};
  const auto work = [&] {
    const SpeContextHeadInputs<T> head{.q = QueryView<const T>::packed(q_r.data(), batch, qh, d),
                                       .k = HeadsView<const T>::packed(k_r.data(), batch, kv, d),
                                       .cache = KVCache<const T>(cache(0)),
                                       .slots = slots.data(),
                                       .host_caches = host_caches};
    on_step([&](auto& step, const auto& step_ctx) { step.select(head, workspace, step_ctx); });
    for (std::int32_t l = 0; l < M::layers; ++l) {
      const std::size_t rows = std::size_t(l) * batch * kv * d;
      const SpeContextLayerInputs<T> in{
          .q = QueryView<const T>::packed(q.data() + std::size_t(l) * batch * qh * d, batch, qh, d),
          .cache = cache(l),
          .k = HeadsView<const T>::packed(step_k.data() + rows, batch, kv, d),
          .v = HeadsView<const T>::packed(step_v.data() + rows, batch, kv, d),
          .layer = l};
      const auto out = StateView<float>::packed(o[std::size_t(l)].data(), lse[std::size_t(l)].data(), batch, qh, d);
      on_step([&](auto& step, const auto& step_ctx) { step.attend(in, out, workspace, step_ctx); });
    }
  };
  std::unique_ptr<CapturedGraph> captured;
  if (graph) captured = std::make_unique<CapturedGraph>(main, work);
  OffloadRun run;
  for (std::int32_t t = 0; t < M::steps; ++t) {
    std::vector<std::int32_t> length(static_cast<std::size_t>(batch));
    for (std::int32_t b = 0; b < batch; ++b) length[std::size_t(b)] = host_lens.data()[b] = m.length(b, t);
    lens.upload(length);
    q_r.upload(test::to_storage<T>(m.q_r[std::size_t(t)]));
    k_r.upload(m.step_rows(m.head_k, t));
    q.upload(test::to_storage<T>(m.q[std::size_t(t)]));
    std::vector<T> ks, vs;
    for (std::int32_t l = 0; l < M::layers; ++l) {
      const auto kl = m.step_rows(m.k[std::size_t(l)], t), vl = m.step_rows(m.v[std::size_t(l)], t);
      ks.insert(ks.end(), kl.begin(), kl.end());
      vs.insert(vs.end(), vl.begin(), vl.end());
    }
    step_k.upload(ks);
    step_v.upload(vs);
    for (std::int32_t l = 0; l < M::layers; ++l) {
      o[std::size_t(l)].poison();
      lse[std::size_t(l)].poison();
    }
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads and poisons ran on the legacy stream
    if (captured) {
      captured->launch();
    } else {
      work();
    }
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(main));
    const SelectionView sel = on_step([&](auto& step, auto&) { return step.selection(workspace, batch); });
    std::vector<std::int32_t> indices(std::size_t(batch) * kv * sel.capacity), counts(std::size_t(batch) * kv);
    KVSIFT_CUDA_CHECK(cudaMemcpy(indices.data(), sel.indices, indices.size() * 4, cudaMemcpyDeviceToHost));
    KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), sel.counts, counts.size() * 4, cudaMemcpyDeviceToHost));
    run.indices.push_back(std::move(indices));
    run.counts.push_back(std::move(counts));
    run.o.emplace_back();
    run.lse.emplace_back();
    for (std::int32_t l = 0; l < M::layers; ++l) {
      run.o.back().push_back(o[std::size_t(l)].download());
      run.lse.back().push_back(lse[std::size_t(l)].download());
    }
    if (offload) run.rows_moved.push_back(offload->elastic().last_step_stats(main).rows_per_layer);
  }
  captured.reset();
  offload.reset();
  return run;
}

template <class T>
class CudaSpeContextOffload : public GpuTest {};
TYPED_TEST_SUITE(CudaSpeContextOffload, StorageTypes);

/// The last 2 of 4 layers offloaded against every layer on the GPU, over 5 steps (see the file's comment). The
/// reference: fp64 attention of each layer's query over its rows of the selection and the step's token; the
/// tolerance is the kernel's rounding of P to T for its P V product (2^-8 max |v|, as tests/cuda/test_cuda_elastic_kv).
TYPED_TEST(CudaSpeContextOffload, EqualsEveryLayerOnTheGpu) {
  using T = TypeParam;
  using M = OffloadModel<T>;
  SCOPED_TRACE(this->seed);
  const M m(this->rng);
  const OffloadRun gpu = run_offload_model(m, 0, false), off = run_offload_model(m, 2, false);
  const std::int32_t d = M::head_dim, group = M::q_heads / M::kv_heads, cap = M::budget;
  double max_v = 0;
  for (const auto& layer : m.v) {
    for (const float x : layer) max_v = std::max(max_v, double(std::abs(x)));
  }
  const double tolerance = std::ldexp(max_v, -8);
  std::vector<std::set<std::int32_t>> resident(std::size_t(M::batch) * M::kv_heads);  // per row, the last selection
  for (std::int32_t t = 0; t < M::steps; ++t) {
    SCOPED_TRACE(testing::Message() << "step " << t);
    ASSERT_EQ(off.counts[std::size_t(t)], gpu.counts[std::size_t(t)]);
    ASSERT_EQ(off.indices[std::size_t(t)], gpu.indices[std::size_t(t)]);
    std::int64_t moved = 0, selected = 0;
    for (std::size_t r = 0; r < resident.size(); ++r) {
      const std::int32_t count = gpu.counts[std::size_t(t)][r];
      const auto* row = gpu.indices[std::size_t(t)].data() + r * cap;
      std::set<std::int32_t> now(row, row + count);
      for (const std::int32_t token : now) moved += resident[r].count(token) == 0;
      selected += count;
      resident[r] = std::move(now);
    }
    EXPECT_EQ(off.rows_moved[std::size_t(t)], moved) << "rows copied per offloaded layer";
    if (t > 0) {
      EXPECT_LT(moved, selected) << "overlapping selections copy fewer rows than they list";
    }
    for (std::int32_t l = 0; l < M::layers; ++l) {
      SCOPED_TRACE(testing::Message() << "layer " << l);
      if (l < 2) {  // on the GPU in both runs: the same kernels over the same rows
        EXPECT_TRUE(same_bytes(off.o[std::size_t(t)][std::size_t(l)], gpu.o[std::size_t(t)][std::size_t(l)]));
        EXPECT_TRUE(same_bytes(off.lse[std::size_t(t)][std::size_t(l)], gpu.lse[std::size_t(t)][std::size_t(l)]));
      }
      for (std::int32_t b = 0; b < M::batch; ++b) {
        const std::int32_t len = m.length(b, t);
        for (std::int32_t h = 0; h < M::kv_heads; ++h) {
          const std::size_t r = std::size_t(b) * M::kv_heads + h;
          std::vector<const float*> ks, vs;
          const std::int32_t count = gpu.counts[std::size_t(t)][r];
          for (std::int32_t i = 0; i <= count; ++i) {
            const std::int32_t token = i < count ? gpu.indices[std::size_t(t)][r * cap + i] : len - 1;
            ks.push_back(m.k[std::size_t(l)].data() + m.at(b, h, token));
            vs.push_back(m.v[std::size_t(l)].data() + m.at(b, h, token));
          }
          for (std::int32_t g = 0; g < group; ++g) {
            const std::int32_t qh = h * group + g;
            const std::size_t q_at = ((std::size_t(l) * M::batch + b) * M::q_heads + qh) * d;
            std::vector<double> ref;
            const double ref_lse =
                test::naive_attention(m.q[std::size_t(t)].data() + q_at, ks, vs, std::vector<double>(ks.size(), 0.0), d,
                                      1.0 / std::sqrt(double(d)), ref);
            const std::size_t o_at = (std::size_t(b) * M::q_heads + qh) * d;
            for (const OffloadRun* run : {&gpu, &off}) {
              const auto& o = run->o[std::size_t(t)][std::size_t(l)];
              const std::vector<float> got(o.begin() + std::ptrdiff_t(o_at), o.begin() + std::ptrdiff_t(o_at + d));
              EXPECT_LT(test::max_abs_diff(got, ref), tolerance)
                  << (run == &gpu ? "all on the GPU" : "offloaded") << " b " << b << " q head " << qh;
              EXPECT_NEAR(run->lse[std::size_t(t)][std::size_t(l)][std::size_t(b) * M::q_heads + qh], ref_lse, 5e-4)
                  << (run == &gpu ? "all on the GPU" : "offloaded") << " b " << b << " q head " << qh;
            }
          }
        }
      }
    }
  }
}

/// One captured step (select, the side stream's copies, every layer's attention), replayed per step, equals the
/// eager steps bit for bit, rows moved included.
TYPED_TEST(CudaSpeContextOffload, CapturedStepReplaysAsEager) {
  using T = TypeParam;
  SCOPED_TRACE(this->seed);
  const OffloadModel<T> m(this->rng);
  const OffloadRun eager = run_offload_model(m, 2, false), replayed = run_offload_model(m, 2, true);
  EXPECT_EQ(replayed.counts, eager.counts);
  EXPECT_EQ(replayed.indices, eager.indices);
  EXPECT_EQ(replayed.rows_moved, eager.rows_moved);
  for (std::size_t t = 0; t < eager.o.size(); ++t) {
    for (std::size_t l = 0; l < eager.o[t].size(); ++l) {
      EXPECT_TRUE(same_bytes(replayed.o[t][l], eager.o[t][l])) << "step " << t << " layer " << l;
      EXPECT_TRUE(same_bytes(replayed.lse[t][l], eager.lse[t][l])) << "step " << t << " layer " << l;
    }
  }
}

class CudaSpeContextOffloadBadInput : public GpuTest {};

TEST_F(CudaSpeContextOffloadBadInput, Refuses) {
  using T = bfloat16;
  constexpr std::int32_t batch = 1, qh = 4, kv = 2, d = 64, n = 64, layers = 3;
  const test::Stream main;
  const cuda::Context ctx{main};
  const SelectorLimits limits{.max_slots = 2, .max_tokens = n, .q_heads = qh, .kv_heads = kv, .head_dim = d};
  const auto make_step = [&](AttentionWindow window) {
    return SpeContextStep<T, cuda::Context>(
        SpeContext<T, cuda::Context>(limits, {.budget = 16, .rope = test_head_rope()}, ctx),
        {.step = {.attention = {.window = window},
                  .max_batch = batch,
                  .q_heads = qh,
                  .kv_heads = kv,
                  .head_dim = d,
                  .max_seq_len = n},
         .layers = layers},
        ctx);
  };
  using Offloaded = SpeContextStep<T, cuda::Context, placement::LayersOnHost>;
  auto step = make_step({});
  // Refused before the local step is moved from: it is still whole (moved in below).
  expect_error([&] { (void)Offloaded(std::move(step), 0); },
               {"SpeContextStep<LayersOnHost>", "offloaded (= 0)", "use the local step"});
  expect_error([&] { (void)Offloaded(std::move(step), 4); }, {"offloaded (= 4)", "config.layers = 3"});
  {
    auto wide = make_step({4, 64});
    expect_error([&] { (void)Offloaded(std::move(wide), 1); },
                 {"SpeContextStep<LayersOnHost>", "window is 4 + 64", "must be 0 + 1"});
  }
  {  // a rerank per layer would read an offloaded layer's keys on the host
    SpeContextStep<T, cuda::Context> reranked(
        SpeContext<T, cuda::Context>(limits, {.budget = 16, .rope = test_head_rope()}, ctx),
        {.step = {.max_batch = batch, .q_heads = qh, .kv_heads = kv, .head_dim = d, .max_seq_len = n},
         .layers = layers,
         .rerank = {.budget = 4}},
        ctx);
    expect_error([&] { (void)Offloaded(std::move(reranked), 1); },
                 {"SpeContextStep<LayersOnHost>", "config.rerank is set", "use the local step"});
  }
  EXPECT_EQ(step.layers(), layers);
  DeviceBuffer<std::byte> ws(step.workspace_bytes());
  DeviceBuffer<T> q(std::size_t(batch) * qh * d), kr(std::size_t(batch) * kv * d), k(std::size_t(batch) * kv * n * d),
      v(k.size());
  DeviceBuffer<std::int32_t> lens(std::vector<std::int32_t>{8}), slots(std::vector<std::int32_t>{1});
  PinnedBuffer<T> hk(std::vector<T>(k.size())), hv(std::vector<T>(k.size()));
  PinnedBuffer<std::int32_t> host_lens(std::vector<std::int32_t>{8});
  const KVCache<T> gpu_cache(ContiguousKVView<T>::packed(k.data(), v.data(), batch, kv, n, d, lens.data()));
  const KVCache<T> host_cache(ContiguousKVView<T>::packed(hk.data(), hv.data(), batch, kv, n, d, host_lens.data()));
  const auto out_o = DeviceBuffer<float>(std::size_t(batch) * qh * d);
  const auto out_lse = DeviceBuffer<float>(std::size_t(batch) * qh);
  const auto out = StateView<float>::packed(out_o.data(), out_lse.data(), batch, qh, d);
  const auto query = QueryView<const T>::packed(q.data(), batch, qh, d);
  const auto token = HeadsView<const T>::packed(kr.data(), batch, kv, d);
  const std::span<std::byte> workspace{ws.data(), ws.size()};
  const std::vector<KVCache<const T>> hosts = {KVCache<const T>(host_cache)};
  SpeContextHeadInputs<T> head{.q = query, .k = token, .cache = KVCache<const T>(gpu_cache), .slots = slots.data()};
  head.host_caches = hosts;
  expect_error([&] { step.select(head, workspace, ctx); },
               {"SpeContextStep::select", "in.host_caches (size 1)", "placement::LayersOnHost"});

  Offloaded offload(std::move(step), 1);
  EXPECT_EQ(offload.first_offloaded(), 2);
  EXPECT_TRUE(offload.offloaded(2));
  EXPECT_FALSE(offload.offloaded(1));
  expect_error([&] { offload.set_offloaded_layers(4); }, {"offloaded (= 4)", "config.layers = 3"});
  EXPECT_EQ(offload.first_offloaded(), 2) << "a refused change leaves the placement as it was";
  const test::Stream copies;
  const OffloadContext octx{.gpu = ctx, .copy_stream = copies};
  const SpeContextLayerInputs<T> offloaded_layer{.q = query, .cache = host_cache, .k = token, .v = token, .layer = 2};
  expect_error([&] { offload.attend({.q = query, .cache = host_cache, .layer = 3}, out, workspace, octx); },
               {"SpeContextStep::attend", "in.layer (= 3)"});
  expect_error([&] { offload.attend({.q = query, .cache = host_cache, .layer = 2}, out, workspace, octx); },
               {"SpeContextStep<LayersOnHost>::attend", "layer 2 is offloaded", "in.k and in.v"});
  expect_error([&] { offload.attend(offloaded_layer, out, workspace, octx); },
               {"SpeContextStep<LayersOnHost>::attend", "loaded for 0 rows", "select (or load) the step first"});
  head.host_caches = {};
  expect_error([&] { offload.select(head, workspace, octx); },
               {"ElasticKV::update", "in.host_caches has 0 caches", "config.layers is 1"});
  head.host_caches = hosts;
  expect_error([&] { offload.select(head, workspace, {.gpu = ctx, .copy_stream = main}); },
               {"ElasticKV::update", "the main and side streams are one stream"});
  expect_error([&] { offload.attend(offloaded_layer, out, workspace, octx); }, {"loaded for 0 rows"});
  offload.set_offloaded_layers(2);
  EXPECT_EQ(offload.first_offloaded(), 1);
  EXPECT_EQ(offload.offloaded_layers(), 2);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(copies));
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(main));
}

}  // namespace
}  // namespace kvsift::test
