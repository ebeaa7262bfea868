// An inference engine's decode loop over kvsift: a paged KV cache (FlashInfer's page_indptr / page_indices /
// last_page_len) from a page pool with a free list, sequences joining and leaving between steps (continuous
// batching), and one DecodeStep per layer with Quest as its selector.
//
// Per step the engine (1) releases the slots of leaving sequences and frees their pages, (2) writes the prompts of
// joining sequences into free pages and prepares their slots, (3) grows every live sequence by the step's token
// (a new page when its last one is full) and (4) runs each layer's step, which writes that token's K/V into the
// pages, lets Quest append and select, and attends window + selection. One workspace, sized once by the steps'
// workspace_bytes(), serves every layer and every step.
//
// The program checks itself: Quest's budget covers the longest sequence, so its selection must hold every token
// outside the window and the step's output must equal dense attention (cpu::dense_decode) over the same cache up
// to fp32 rounding. An engine sets the budget far below the length; nothing else changes. Exits 1 on a mismatch.
//
// CPU backend only. The CUDA backend takes the same calls (include kvsift/cuda/backend.hpp, Quest<T, cuda::Context>,
// a cuda::Context on the engine's stream, the pages, page tables, slots, queries and outputs in device memory).

#include <kvsift/cpu/backend.hpp>
#include <kvsift/selectors/quest/quest.hpp>
#include <kvsift/step/decode_step.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <span>
#include <vector>

namespace {

using T = kvsift::bfloat16;  // the engine's cache dtype
// Any KVSelector drops in with its own config, the rest unchanged: OracleTopK<T, cpu::Context> (exact top-k,
// selectors/oracle_topk/oracle_topk.hpp) with {.budget = kMaxSeqLen} passes the same check.
using Selector = kvsift::Quest<T, kvsift::cpu::Context>;

constexpr int kLayers = 2, kQHeads = 8, kKVHeads = 2, kHeadDim = 64;
constexpr int kPageSize = 16;        // the engine's KV page; Quest's own pages (16 tokens) are independent of it
constexpr int kNumPages = 64;        // the pool: 1024 tokens per layer
constexpr int kMaxSequences = 4;     // selector slots: sequences live at once
constexpr int kMaxSeqLen = 512;
constexpr kvsift::AttentionWindow kWindow{.sink = 4, .recent = 32};
constexpr int kSteps = 6;
struct Join { int step, prompt_tokens; };
constexpr Join kJoins[] = {{0, 100}, {0, 37}, {2, 250}, {5, 60}};  // sequences 0..3; 3 reuses 0's slot and pages
constexpr int kLeaveStep = 4, kLeavingSequence = 0;                  // sequence 0 leaves before step 4
constexpr float kTolerance = 1e-4f;  // fp32 rounding: sparse and dense attention sum in different orders

struct Sequence {
  int id;
  std::int32_t slot;
  int length;
  std::vector<std::int32_t> pages;
};

/// The page tables of a batch of sequences, in FlashInfer's layout.
struct PageTable {
  std::vector<std::int32_t> indptr{0}, indices, last_page_len, slots;

  explicit PageTable(const std::vector<Sequence*>& batch) {
    for (const Sequence* s : batch) {
      indices.insert(indices.end(), s->pages.begin(), s->pages.end());
      indptr.push_back(std::int32_t(indices.size()));
      last_page_len.push_back((s->length - 1) % kPageSize + 1);
      slots.push_back(s->slot);
    }
  }
  int batch() const { return int(slots.size()); }
  /// One layer's pages (NHD: a page is [kPageSize, kKVHeads, kHeadDim]) seen through this table.
  kvsift::PagedKVView<T> view(std::vector<T>& k_pages, std::vector<T>& v_pages) const {
    return {.k_pages = k_pages.data(), .v_pages = v_pages.data(), .page_indptr = indptr.data(),
            .page_indices = indices.data(), .last_page_len = last_page_len.data(), .batch = batch(),
            .kv_heads = kKVHeads, .head_dim = kHeadDim, .page_size = kPageSize, .num_pages = kNumPages,
            .page_stride = kPageSize * kKVHeads * kHeadDim, .token_stride = kKVHeads * kHeadDim,
            .head_stride = kHeadDim};
  }
};

void fill_random(std::mt19937& rng, T* x, std::size_t n) {
  std::normal_distribution<float> normal;
  for (std::size_t i = 0; i < n; ++i) x[i] = kvsift::float_to_bfloat16(normal(rng));
}
std::vector<T> random_values(std::mt19937& rng, std::size_t n) {
  std::vector<T> x(n);
  fill_random(rng, x.data(), n);
  return x;
}

}  // namespace

int main() {
  std::mt19937 rng(2024);
  kvsift::cpu::ThreadPool pool(2);  // the steps are planned for this pool's size: run them on it
  const kvsift::cpu::Context cpu(&pool);

  // Per layer: its K and V page pools and its decode step (which owns that layer's Quest index). The page tables
  // are the engine's, shared by every layer.
  std::vector<std::vector<T>> k_pages(kLayers), v_pages(kLayers);
  std::vector<kvsift::DecodeStep<Selector>> steps;
  steps.reserve(kLayers);
  for (int layer = 0; layer < kLayers; ++layer) {
    k_pages[layer].resize(std::size_t(kNumPages) * kPageSize * kKVHeads * kHeadDim);
    v_pages[layer].resize(k_pages[layer].size());
    steps.emplace_back(Selector({.max_slots = kMaxSequences, .max_tokens = kMaxSeqLen, .q_heads = kQHeads,
                                 .kv_heads = kKVHeads, .head_dim = kHeadDim},
                                {.budget = kMaxSeqLen, .page_size = 16}),
                       kvsift::DecodeStepConfig{.attention = {.window = kWindow}, .max_batch = kMaxSequences,
                                                .q_heads = kQHeads, .kv_heads = kKVHeads, .head_dim = kHeadDim,
                                                // while integrating: a bad selection is refused by name
                                                .max_seq_len = kMaxSeqLen, .validate_indices = true},
                       cpu);
  }
  // Planned for every batch up to max_batch: one workspace, sized once, for every layer and step.
  std::size_t workspace_bytes = 0;
  for (const auto& step : steps) workspace_bytes = std::max(workspace_bytes, step.workspace_bytes());
  kvsift::cpu::Array<std::byte> workspace(workspace_bytes);

  std::vector<std::int32_t> free_pages(kNumPages), free_slots(kMaxSequences);
  for (int i = 0; i < kNumPages; ++i) free_pages[i] = kNumPages - 1 - i;  // pop_back hands out 0, 1, 2, ...
  for (int i = 0; i < kMaxSequences; ++i) free_slots[i] = kMaxSequences - 1 - i;
  const auto take = [](std::vector<std::int32_t>& free_list) {
    const std::int32_t id = free_list.back();
    free_list.pop_back();
    return id;
  };
  std::vector<Sequence> live;
  live.reserve(kMaxSequences);  // the batches below point into it
  int joined = 0;

  for (int step = 0; step < kSteps; ++step) {
    // 1. Leaving: every layer's selector forgets the slot, the pages go back to the pool.
    if (step == kLeaveStep) {
      const auto it = std::find_if(live.begin(), live.end(),
                                   [](const Sequence& s) { return s.id == kLeavingSequence; });
      for (auto& layer_step : steps) layer_step.release(std::span(&it->slot, 1));
      free_pages.insert(free_pages.end(), it->pages.begin(), it->pages.end());
      free_slots.push_back(it->slot);
      live.erase(it);
    }

    // 2. Joining: a free slot and pages for the prompt, the prompt's K/V written (the engine's prefill), then each
    // layer prepares the joining slots from a page table of the joining sequences alone.
    std::vector<Sequence*> joining;
    for (const Join& join : kJoins) {
      if (join.step != step) continue;
      Sequence& s = live.emplace_back(Sequence{joined++, take(free_slots), join.prompt_tokens, {}});
      s.pages.resize((s.length + kPageSize - 1) / kPageSize);
      for (auto& page : s.pages) page = take(free_pages);
      joining.push_back(&s);
    }
    if (!joining.empty()) {
      const PageTable prefill(joining);
      for (int layer = 0; layer < kLayers; ++layer) {
        const kvsift::PagedKVView<T> cache = prefill.view(k_pages[layer], v_pages[layer]);
        for (int b = 0; b < prefill.batch(); ++b) {
          for (int h = 0; h < kKVHeads; ++h) {
            for (int t = 0; t < cache.seq_len(b); ++t) {
              fill_random(rng, cache.k_row(b, h, t), kHeadDim);
              fill_random(rng, cache.v_row(b, h, t), kHeadDim);
            }
          }
        }
        steps[layer].prepare({.cache = cache.as_const(), .slots = prefill.slots.data(), .layer = layer}, cpu);
      }
    }

    // 3. The step's token: each sequence grows by one, on a new page when its last one is full. The step writes
    // the token's K/V at position length - 1 of each layer's pages.
    std::vector<Sequence*> batch;
    for (Sequence& s : live) {
      if (s.length++ % kPageSize == 0) s.pages.push_back(take(free_pages));
      batch.push_back(&s);
    }
    const PageTable table(batch);
    const int rows = table.batch();

    // 4. Every layer: decode step, then the self-check against dense attention over the same cache.
    float worst = 0.0f;
    bool selections_whole = true;
    for (int layer = 0; layer < kLayers; ++layer) {
      const kvsift::PagedKVView<T> cache = table.view(k_pages[layer], v_pages[layer]);
      const std::vector<T> q = random_values(rng, std::size_t(rows) * kQHeads * kHeadDim);
      const std::vector<T> k = random_values(rng, std::size_t(rows) * kKVHeads * kHeadDim);
      const std::vector<T> v = random_values(rng, k.size());
      const auto heads = [rows](const std::vector<T>& x, int n) {
        return kvsift::HeadsView<const T>::packed(x.data(), rows, n, kHeadDim);
      };
      std::vector<float> o(std::size_t(rows) * kQHeads * kHeadDim), lse(std::size_t(rows) * kQHeads);
      steps[layer].run({.q = heads(q, kQHeads), .cache = cache, .k = heads(k, kKVHeads), .v = heads(v, kKVHeads),
                        .slots = table.slots.data(), .layer = layer},
                       kvsift::StateView<float>::packed(o.data(), lse.data(), rows, kQHeads, kHeadDim),
                       workspace.bytes(), cpu);

      const kvsift::SelectionView selection = steps[layer].selection(workspace.bytes(), rows);
      for (int b = 0; b < rows; ++b) {
        for (int h = 0; h < kKVHeads; ++h) {
          const int length = cache.seq_len(b);
          selections_whole = selections_whole && selection.count(b, h) == length - kWindow.size(length);
        }
      }
      std::vector<float> dense_o(o.size()), dense_lse(lse.size());
      kvsift::cpu::dense_decode(heads(q, kQHeads), cache.as_const(),
                                kvsift::StateView<float>::packed(dense_o.data(), dense_lse.data(), rows, kQHeads,
                                                                 kHeadDim),
                                {}, &pool);
      const auto compare = [&worst](const std::vector<float>& x, const std::vector<float>& y) {
        for (std::size_t i = 0; i < x.size(); ++i) {
          const float difference = std::fabs(x[i] - y[i]);
          worst = std::isnan(difference) ? difference : std::max(worst, difference);  // once NaN, NaN stays
        }
      };
      compare(o, dense_o);
      compare(lse, dense_lse);
    }

    const bool ok = selections_whole && worst <= kTolerance;  // a NaN fails too
    std::printf("step %d: %d sequences (", step, rows);
    for (const Sequence* s : batch) {
      std::printf("%s#%d slot %d: %d tokens", s == batch[0] ? "" : ", ", s->id, s->slot, s->length);
    }
    std::printf("), %d pages free, %d layers, max |sparse - dense| = %.2e%s\n", int(free_pages.size()), kLayers, worst,
                ok ? "" : selections_whole ? "  MISMATCH" : "  MISMATCH (a selection misses tokens)");
    if (!ok) return 1;
  }
  std::puts("ok: every step's sparse output equals dense attention over the paged cache");
  return 0;
}
