// vLLM's paged KV cache read in place (issue 41): PagedKVView's block-table form (core/views.hpp) over the layouts
// vLLM documents (NHD with K and V separate or interleaved per block, HND), built by tests/vllm_layout.hpp from a
// contiguous cache with ragged lengths, shuffled blocks and garbage in the unused block-table entries. Every token's
// rows are the contiguous cache's; CPU dense and sparse decode on the block-table view equal the same calls on the
// contiguous view bit for bit; decode steps (OracleTopK, Quest, CentroidKV, CTKVR) growing the sequences give the
// same outputs, selections and written tokens on the block-table view as on the CSR view of the same blocks, and a
// non-finite prompt key is found at the same position; malformed block tables are refused by name.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "attention_check.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/cpu/decode.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "kvsift/selectors/centroid_kv/centroid_kv.hpp"
#include "kvsift/selectors/ctkvr/ctkvr.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/step/decode_step.hpp"
#include "selector_check.hpp"
#include "test_util.hpp"
#include "vllm_layout.hpp"

namespace kvsift::test {
namespace {

using VllmBlockTables = SeededTest;

/// A problem of ragged lengths over a contiguous cache: 3 rows, GQA 8 / 2, head_dim 64, up to `tokens` tokens,
/// a selection of up to k tokens from the middle that the window leaves.
CaseSpec ragged_case(std::int32_t tokens, std::int32_t k, bool random_lengths = true) {
  return {.batch = 3, .q_heads = 8, .kv_heads = 2, .head_dim = 64, .tokens = tokens, .k = k, .page_size = 0,
          .log_weights = k > 0, .random_lengths = random_lengths, .window = {4, 16}};
}

template <class T>
bool same_row(const T* a, const T* b, std::int32_t d) {
  return std::memcmp(a, b, std::size_t(d) * sizeof(T)) == 0;
}

TEST_F(VllmBlockTables, EveryTokensRowsAreTheContiguousCaches) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const VllmLayout layout : kVllmLayouts) {
    for (const std::int32_t block_size : {16, 5, 1}) {
      for (const bool ragged : {true, false}) {  // not ragged: every length a multiple of 16, 5 and 1 (240 tokens)
        SCOPED_TRACE(fmt::format("{}, block_size {}, ragged {}", vllm_layout_name(layout), block_size, ragged));
        HostDecodeProblem<bfloat16> p(rng, ragged_case(240, 0, ragged));
        const ContiguousKVView<const bfloat16> contiguous = p.contiguous();
        VllmCache<bfloat16> c(contiguous, block_size, layout, rng);
        const PagedKVView<const bfloat16> view = c.view().as_const();
        EXPECT_NO_THROW(validate(view, "test", "kv", MemorySpace::host));
        EXPECT_TRUE(view.is_block_table());
        EXPECT_EQ(view.block_table_stride, c.max_blocks);
        if (c.interleaved()) {  // [num_blocks, 2, ...]: a block's V right after its K, blocks twice as far apart
          EXPECT_EQ(view.v_pages - view.k_pages, std::int64_t(block_size) * 2 * 64);
          EXPECT_EQ(view.page_stride, 2 * std::int64_t(block_size) * 2 * 64);
        }
        const typename VllmCache<bfloat16>::Csr csr = c.csr();
        const auto as_csr = VllmCache<bfloat16>::as_csr(view, csr);
        EXPECT_NO_THROW(validate(as_csr, "test", "kv", MemorySpace::host));
        auto with_lengths = as_csr;  // CSR with seq_lens in place of last_page_len
        with_lengths.seq_lens = c.seq_lens.data();
        with_lengths.last_page_len = nullptr;
        EXPECT_NO_THROW(validate(with_lengths, "test", "kv", MemorySpace::host));
        for (std::int32_t b = 0; b < p.spec.batch; ++b) {
          ASSERT_EQ(view.seq_len(b), contiguous.seq_len(b));
          ASSERT_EQ(as_csr.seq_len(b), contiguous.seq_len(b));
          ASSERT_EQ(view.page_entries(b), c.max_blocks);
          const PagedKVView<const bfloat16> alone = view.sequence(b);
          ASSERT_EQ(alone.batch, 1);
          ASSERT_EQ(alone.seq_len(0), contiguous.seq_len(b));
          for (std::int32_t h = 0; h < p.spec.kv_heads; ++h) {
            for (std::int32_t t = 0; t < contiguous.seq_len(b); ++t) {
              // The view addresses vLLM's element (from its tensor shapes), which holds the contiguous cache's row.
              ASSERT_EQ(view.k_row(b, h, t), c.k_at(b, h, t)) << b << " " << h << " " << t;
              ASSERT_EQ(view.v_row(b, h, t), c.v_at(b, h, t)) << b << " " << h << " " << t;
              ASSERT_TRUE(same_row(view.k_row(b, h, t), contiguous.k_row(b, h, t), 64)) << b << " " << h << " " << t;
              ASSERT_TRUE(same_row(view.v_row(b, h, t), contiguous.v_row(b, h, t), 64)) << b << " " << h << " " << t;
              ASSERT_EQ(as_csr.k_row(b, h, t), view.k_row(b, h, t));
              ASSERT_EQ(with_lengths.v_row(b, h, t), view.v_row(b, h, t));
              ASSERT_EQ(alone.k_row(0, h, t), view.k_row(b, h, t));
              ASSERT_EQ(alone.v_row(0, h, t), view.v_row(b, h, t));
            }
          }
        }
      }
    }
  }
}

/// One CPU decode call (sparse with the problem's window and selection, or dense) on `kv`, outputs poisoned with
/// NaN; with a pool, a workspace (poisoned too) that lets rows split over its threads.
template <class T, class KV>
std::pair<std::vector<T>, std::vector<float>> decode(HostDecodeProblem<T>& p, const KV& kv, bool sparse,
                                                     cpu::ThreadPool* pool, bool validate_indices) {
  std::vector<T> o(p.q.size(), from_float<T>(kPoison));
  std::vector<float> lse(std::size_t(p.spec.batch) * p.spec.q_heads, kPoison);
  const auto out = StateView<T>::packed(o.data(), lse.data(), p.spec.batch, p.spec.q_heads, p.spec.head_dim);
  cpu::Array<std::byte> workspace(
      pool != nullptr ? cpu::decode_workspace_bytes(p.spec.batch, p.spec.q_heads, p.spec.kv_heads, p.spec.head_dim, pool)
                      : 0);
  std::fill_n(workspace.data(), workspace.size(), std::byte{0xff});
  const std::span<std::byte> bytes(workspace.data(), workspace.size());
  cpu::DecodeOptions options{.validate_indices = validate_indices};
  if (sparse) {
    options.attention.window = p.spec.window;
    cpu::sparse_decode(p.q_view(), kv, p.selection(), out, options, pool, bytes);
  } else {
    cpu::dense_decode(p.q_view(), kv, out, options, pool, bytes);
  }
  return {o, lse};
}

template <class T>
void expect_decode_matches_contiguous(Random& rng, VllmLayout layout, std::int32_t block_size) {
  SCOPED_TRACE(fmt::format("{} {}, block_size {}", dtype_label<T>(), vllm_layout_name(layout), block_size));
  HostDecodeProblem<T> p(rng, ragged_case(700, 96));
  VllmCache<T> c(p.contiguous(), block_size, layout, rng);
  const PagedKVView<const T> view = c.view().as_const();
  cpu::ThreadPool pool(16);  // 6 rows on 16 threads: rows split, and their partial states merge
  for (const bool sparse : {false, true}) {
    for (cpu::ThreadPool* threads : {static_cast<cpu::ThreadPool*>(nullptr), &pool}) {
      SCOPED_TRACE(fmt::format("{}, {}", sparse ? "sparse" : "dense", threads != nullptr ? "split rows" : "one thread"));
      const auto want = decode(p, p.contiguous(), sparse, threads, false);
      const auto got = decode(p, view, sparse, threads, sparse);  // sparse: with validate_indices too
      for (const float x : want.second) ASSERT_FALSE(std::isnan(x)) << "the contiguous call wrote its output";
      EXPECT_TRUE(same_bytes(got.first, want.first)) << "O";
      EXPECT_TRUE(same_bytes(got.second, want.second)) << "LSE";
    }
  }
}

TEST_F(VllmBlockTables, CpuDecodeEqualsTheContiguousCacheBitForBit) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const VllmLayout layout : kVllmLayouts) {
    for (const std::int32_t block_size : {16, 7}) {
      expect_decode_matches_contiguous<bfloat16>(rng, layout, block_size);
      expect_decode_matches_contiguous<half>(rng, layout, block_size);
    }
  }
}

/// A decode step per view form, over separate copies of one vLLM cache whose rows grow by one token per step: the
/// block-table view (the engine's block_tables and seq_lens as they are) and a CSR view of the same blocks rebuilt
/// every step, as a backend without the block-table form would. The prompts' blocks hold the tokens; the positions
/// the steps will write are NaN until the step writes them (from the contiguous cache's rows).
template <class T>
struct GrowingCaches {
  static constexpr std::int32_t kSteps = 20;
  HostDecodeProblem<T> p;
  VllmCache<T> full;                ///< every token of the final lengths
  VllmCache<T> blocks, csr_blocks;  ///< the steps' caches: prompts only at first
  std::vector<std::int32_t> slots, contiguous_lens;
  typename VllmCache<T>::Csr csr;
  static constexpr std::int32_t kQueries = 8;
  std::vector<T> prefill_q;  ///< [batch, q_heads, kQueries, head_dim] the prompts' last queries (CTKVR's centroids)

  GrowingCaches(Random& rng, VllmLayout layout)
      : p(rng, ragged_case(600, 0)), full(p.contiguous(), 16, layout, rng), blocks(full), csr_blocks(full),
        slots(std::size_t(p.spec.batch)),
        prefill_q(to_storage<T>(rng.normal(std::size_t(p.spec.batch) * p.spec.q_heads * kQueries * p.spec.head_dim))) {
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng.engine);
    for (std::int32_t b = 0; b < p.spec.batch; ++b) {
      const std::int32_t prompt = full.seq_lens[std::size_t(b)] - kSteps;
      for (std::int32_t h = 0; h < p.spec.kv_heads; ++h) {
        for (std::int32_t t = prompt; t < full.seq_lens[std::size_t(b)]; ++t) {
          for (VllmCache<T>* c : {&blocks, &csr_blocks}) {
            std::fill_n(c->k_at(b, h, t), p.spec.head_dim, from_float<T>(kPoison));
            std::fill_n(c->v_at(b, h, t), p.spec.head_dim, from_float<T>(kPoison));
          }
        }
      }
      blocks.seq_lens[std::size_t(b)] = csr_blocks.seq_lens[std::size_t(b)] = prompt;
    }
    contiguous_lens = blocks.seq_lens;
    csr = csr_blocks.csr();
  }
  /// Every row one token longer: the engine's seq_lens, the CSR table rebuilt, the reference's lengths.
  void grow() {
    for (std::int32_t b = 0; b < p.spec.batch; ++b) ++blocks.seq_lens[std::size_t(b)], ++csr_blocks.seq_lens[std::size_t(b)];
    contiguous_lens = blocks.seq_lens;
    csr = csr_blocks.csr();
  }
  PrefillInputs<T> prefill(const KVCache<T>& cache) const {
    return {.cache = cache, .slots = slots.data(),
            .queries = SequenceView<const T>::packed(prefill_q.data(), p.spec.batch, p.spec.q_heads, kQueries,
                                                     p.spec.head_dim)};
  }
  KVCache<T> block_table_cache() { return blocks.view(); }
  KVCache<T> csr_cache() { return VllmCache<T>::as_csr(csr_blocks.view(), csr); }
  SelectorLimits limits() const { return case_limits(p.spec); }
  DecodeStepConfig config(const AttentionWindow& window) const { return case_step_config(p.spec, window); }
  /// The step's token of every row (at seq_len - 1), from the contiguous cache: [batch, kv_heads, head_dim] K or V.
  std::vector<T> step_rows(bool value) const {
    std::vector<T> rows;
    const ContiguousKVView<const T> src = p.contiguous();
    for (std::int32_t b = 0; b < p.spec.batch; ++b) {
      for (std::int32_t h = 0; h < p.spec.kv_heads; ++h) {
        const T* row = value ? src.v_row(b, h, contiguous_lens[std::size_t(b)] - 1)
                             : src.k_row(b, h, contiguous_lens[std::size_t(b)] - 1);
        rows.insert(rows.end(), row, row + p.spec.head_dim);
      }
    }
    return rows;
  }
};

struct StepOutput {
  std::vector<std::uint8_t> o;  ///< O's bytes
  std::vector<float> lse;
  std::vector<std::int32_t> indices, counts;
};

template <class Step, class T>
StepOutput run_step(Step& step, GrowingCaches<T>& g, const KVCache<T>& cache, const std::vector<T>& q,
                    const std::vector<T>& k, const std::vector<T>& v, cpu::Array<std::byte>& workspace,
                    const cpu::Context& ctx) {
  const CaseSpec& c = g.p.spec;
  std::vector<T> o(q.size(), from_float<T>(kPoison));
  std::vector<float> lse(std::size_t(c.batch) * c.q_heads, kPoison);
  std::fill_n(workspace.data(), workspace.size(), std::byte{0xff});
  StepInputs<T> in;
  in.q = QueryView<const T>::packed(q.data(), c.batch, c.q_heads, c.head_dim);
  in.cache = cache;
  in.k = HeadsView<const T>::packed(k.data(), c.batch, c.kv_heads, c.head_dim);
  in.v = HeadsView<const T>::packed(v.data(), c.batch, c.kv_heads, c.head_dim);
  in.slots = g.slots.data();
  step.run(in, StateView<T>::packed(o.data(), lse.data(), c.batch, c.q_heads, c.head_dim),
           std::span<std::byte>(workspace.data(), workspace.size()), ctx);
  StepOutput out{{}, lse, {}, {}};
  out.o.resize(o.size() * sizeof(T));
  std::memcpy(out.o.data(), o.data(), out.o.size());
  const SelectionView sel = step.selection(std::span<std::byte>(workspace.data(), workspace.size()), c.batch);
  if (sel.capacity > 0) out.indices.assign(sel.indices, sel.indices + std::size_t(sel.batch) * sel.kv_heads * sel.capacity);
  out.counts.assign(sel.counts, sel.counts + std::size_t(sel.batch) * sel.kv_heads);
  return out;
}

/// `make()` twice (a selector per view form) through DecodeSteps of `window` for kSteps growing steps.
template <class T, class Make>
void expect_steps_agree(Random& rng, VllmLayout layout, const AttentionWindow& window, bool check_reference,
                        Make make) {
  SCOPED_TRACE(fmt::format("{} {}", dtype_label<T>(), vllm_layout_name(layout)));
  GrowingCaches<T> g(rng, layout);
  cpu::ThreadPool pool(3);
  const cpu::Context ctx{&pool};
  DecodeStep on_blocks(make(g.limits(), ctx), g.config(window), ctx);
  DecodeStep on_csr(make(g.limits(), ctx), g.config(window), ctx);
  on_blocks.prepare(g.prefill(g.block_table_cache()), ctx);
  on_csr.prepare(g.prefill(g.csr_cache()), ctx);
  cpu::Array<std::byte> blocks_workspace(on_blocks.workspace_bytes()), csr_workspace(on_csr.workspace_bytes());
  for (std::int32_t s = 0; s < GrowingCaches<T>::kSteps; ++s) {
    SCOPED_TRACE(fmt::format("step {}", s));
    g.grow();
    const std::vector<T> q = to_storage<T>(rng.normal(std::size_t(g.p.spec.batch) * g.p.spec.q_heads * g.p.spec.head_dim));
    const std::vector<T> k = g.step_rows(false), v = g.step_rows(true);
    const StepOutput a = run_step(on_blocks, g, g.block_table_cache(), q, k, v, blocks_workspace, ctx);
    const StepOutput b = run_step(on_csr, g, g.csr_cache(), q, k, v, csr_workspace, ctx);
    ASSERT_EQ(a.o, b.o) << "O";
    ASSERT_TRUE(same_bytes(a.lse, b.lse)) << "LSE";
    ASSERT_EQ(a.counts, b.counts);
    ASSERT_EQ(a.indices, b.indices);
    for (const float x : a.lse) ASSERT_FALSE(std::isnan(x)) << "NaN: a position the step should have written";
    if (check_reference) {  // the output is attention over window and selection of the contiguous cache's tokens
      HostKV values = g.p.kv_values;
      values.seq_lens = g.contiguous_lens;
      HostState ref(g.p.spec.batch, g.p.spec.q_heads, g.p.spec.head_dim);
      const SelectionView sel{const_cast<std::int32_t*>(a.indices.data()), const_cast<std::int32_t*>(a.counts.data()),
                              nullptr, g.p.spec.batch, g.p.spec.kv_heads,
                              std::int32_t(a.indices.size() / a.counts.size())};
      reference::sparse_decode(QueryView<const T>::packed(q.data(), g.p.spec.batch, g.p.spec.q_heads, g.p.spec.head_dim),
                               values.view(), sel, ref.view, {.window = window});
      std::vector<T> o(q.size());
      std::memcpy(o.data(), a.o.data(), a.o.size());
      expect_close<T>(o, a.lse, ref, "step output");
    }
  }
  // Both steps wrote every token where vLLM keeps it: the caches are the full one, bit for bit.
  EXPECT_TRUE(same_bytes(g.blocks.key_cache, g.full.key_cache));
  EXPECT_TRUE(same_bytes(g.blocks.value_cache, g.full.value_cache));
  EXPECT_TRUE(same_bytes(g.csr_blocks.key_cache, g.full.key_cache));
  EXPECT_TRUE(same_bytes(g.csr_blocks.value_cache, g.full.value_cache));
}

TEST_F(VllmBlockTables, DecodeStepsGiveTheCsrViewsOutputs) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  constexpr AttentionWindow window{4, 16};
  for (const VllmLayout layout : kVllmLayouts) {
    expect_steps_agree<bfloat16>(rng, layout, window, true, [](const SelectorLimits& limits, const cpu::Context&) {
      return OracleTopK<bfloat16, cpu::Context>(limits, {.budget = 32});
    });
    expect_steps_agree<half>(rng, layout, window, true, [](const SelectorLimits& limits, const cpu::Context&) {
      return Quest<half, cpu::Context>(limits, {.budget = 64, .page_size = 16});
    });
    // CentroidKV reads each prompt through a one-row view of the cache (PagedKVView::sequence) and attends its
    // store as a second source: outputs compared between the forms only.
    expect_steps_agree<bfloat16>(rng, layout, {}, false, [](const SelectorLimits& limits, const cpu::Context& ctx) {
      return CentroidKV<bfloat16, cpu::Context>(limits, {.budget_ratio = 0.5f, .sinks = 4, .recent = 16, .chunk = 32},
                                                ctx);
    });
    // CTKVR scores its centroids against each prompt through a CSR table of the sequence's pages, built on the
    // host from either form.
    expect_steps_agree<half>(rng, layout, window, true, [](const SelectorLimits& limits, const cpu::Context&) {
      return Ctkvr<half, cpu::Context>(limits, {.budget = 32, .list_size = 64, .centroids = 6, .max_centroids = 8,
                                                .recalled_centroids = 4});
    });
    if (HasFatalFailure()) return;
  }
}

TEST_F(VllmBlockTables, ANonFinitePromptKeyIsFoundWhereTheCsrViewFindsIt) {
  // The check every prompt-indexing selector makes (selectors/detail/checks.hpp check_finite_prompt) locates the
  // offending key through the cache's page table: the same position and value in either form.
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (const VllmLayout layout : kVllmLayouts) {
    SCOPED_TRACE(vllm_layout_name(layout));
    GrowingCaches<half> g(rng, layout);
    const std::int32_t t = g.blocks.seq_lens[1] - 17, channel = 5;  // in a prompt's middle, not its first block
    for (VllmCache<half>* c : {&g.blocks, &g.csr_blocks}) c->k_at(1, 1, t)[channel] = from_float<half>(INFINITY);
    const std::string message = fmt::format(
        "the prompt's keys hold a non-finite value at sequence 1, kv head 1, token {}, channel {} (= inf)", t, channel);
    for (const bool block_table : {true, false}) {
      SCOPED_TRACE(block_table ? "block table" : "CSR");
      Ctkvr<half, cpu::Context> selector(g.limits(), {.budget = 32, .list_size = 64, .centroids = 6, .max_centroids = 8});
      expect_error([&] { selector.prepare(g.prefill(block_table ? g.block_table_cache() : g.csr_cache()), {}); },
                   message);
    }
  }
}

TEST_F(VllmBlockTables, MalformedBlockTablesAreRefusedByName) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  HostDecodeProblem<half> p(rng, ragged_case(100, 8));
  VllmCache<half> c(p.contiguous(), 16, VllmLayout::nhd, rng);
  std::vector<half> o(p.q.size());
  std::vector<float> lse(std::size_t(p.spec.batch) * p.spec.q_heads);
  const auto out = StateView<half>::packed(o.data(), lse.data(), p.spec.batch, p.spec.q_heads, p.spec.head_dim);
  const auto refused = [&](const PagedKVView<const half>& kv, std::initializer_list<std::string> parts) {
    expect_error([&] { cpu::dense_decode(p.q_view(), kv, out); }, parts);
    expect_error([&] { cpu::sparse_decode(p.q_view(), kv, p.selection(), out); }, parts);
    expect_error([&] { validate(kv, "test", "kv", MemorySpace::host); }, parts);
  };
  const PagedKVView<const half> good = c.view().as_const();
  ASSERT_NO_THROW(cpu::dense_decode(p.q_view(), good, out));

  PagedKVView<const half> no_lengths = good;
  no_lengths.seq_lens = nullptr;
  refused(no_lengths, {"kv.seq_lens is a null pointer", fmt::format("block_table_stride = {}", c.max_blocks)});
  expect_error([&] { cpu::dense_decode(p.q_view(), no_lengths, out); }, "kvsift::cpu::dense_decode: kv.seq_lens");

  PagedKVView<const half> negative_stride = good;
  negative_stride.block_table_stride = -3;
  refused(negative_stride, {"kv.block_table_stride (= -3) must be >= 0"});

  // A used entry out of range: block 1 of sequence 2 (every sequence has at least 50 tokens: 4 blocks).
  std::vector<std::int32_t> tables = c.block_tables;
  const std::size_t at = 2 * std::size_t(c.max_blocks) + 1;
  for (const std::int32_t bad : {c.num_blocks, -1}) {
    tables[at] = bad;
    PagedKVView<const half> out_of_range = good;
    out_of_range.page_indices = tables.data();
    refused(out_of_range, {fmt::format("kv.page_indices[{}] (= {}, block 1 of sequence 2's block-table row) is outside "
                                       "[0, num_pages = {})",
                                       at, bad, c.num_blocks)});
  }

  // A row too short for its length: the table's stride against the pages seq_lens[b] needs.
  PagedKVView<const half> narrow = good;
  narrow.block_table_stride = 2;  // 32 tokens of blocks per row, every sequence is longer
  refused(narrow, {fmt::format("kv.block_table_stride (= 2) is smaller than the {} pages of kv.seq_lens[0] (= {} tokens, "
                               "page_size = 16)",
                               (c.seq_lens[0] + 15) / 16, c.seq_lens[0])});
  std::vector<std::int32_t> lens = c.seq_lens;
  lens[1] = c.max_blocks * 16 + 1;
  PagedKVView<const half> too_long = good;
  too_long.seq_lens = lens.data();
  refused(too_long, {fmt::format("kv.block_table_stride (= {}) is smaller than the {} pages of kv.seq_lens[1]",
                                 c.max_blocks, c.max_blocks + 1)});

  lens = c.seq_lens;
  lens[2] = -3;
  PagedKVView<const half> negative = good;
  negative.seq_lens = lens.data();
  refused(negative, {"kv.seq_lens[2] (= -3) is negative"});

  // The CSR form with seq_lens: each length within its row's pages.
  const auto csr = c.csr();
  PagedKVView<const half> csr_lengths = VllmCache<half>::as_csr(good, csr);
  csr_lengths.last_page_len = nullptr;
  csr_lengths.seq_lens = c.seq_lens.data();
  ASSERT_NO_THROW(cpu::dense_decode(p.q_view(), csr_lengths, out));
  lens = c.seq_lens;
  const std::int32_t room = (csr.indptr[1] - csr.indptr[0]) * 16;
  lens[0] = room + 1;
  csr_lengths.seq_lens = lens.data();
  refused(csr_lengths, {fmt::format("kv.seq_lens[0] (= {}) is outside [0, its {} pages * page_size = {}]", room + 1,
                                    room / 16, room)});
  csr_lengths.seq_lens = nullptr;  // CSR without lengths needs last_page_len
  refused(csr_lengths, {"kv.last_page_len is a null pointer"});

  // A token write past a row's block-table entries is refused before any row is written.
  lens = c.seq_lens;
  lens[1] = c.max_blocks * 16 + 1;
  PagedKVView<half> writable = c.view();
  writable.seq_lens = lens.data();
  const std::vector<half> rows(std::size_t(p.spec.batch) * p.spec.kv_heads * p.spec.head_dim);
  const auto heads = HeadsView<const half>::packed(rows.data(), p.spec.batch, p.spec.kv_heads, p.spec.head_dim);
  const std::vector<half> before = c.key_cache;
  expect_error([&] { cpu::write_step_kv(KVCache<half>(writable), heads, heads); },
               fmt::format("cpu::write_step_kv: cache.seq_len(1) (= {}) does not fit the cache's storage", lens[1]));
  EXPECT_TRUE(same_bytes(c.key_cache, before));
  lens[1] = c.seq_lens[1];
  ASSERT_NO_THROW(cpu::write_step_kv(KVCache<half>(writable), heads, heads));
  EXPECT_TRUE(same_row(c.k_at(1, 1, lens[1] - 1), rows.data(), p.spec.head_dim));
}

}  // namespace
}  // namespace kvsift::test
