#pragma once
/// The selector conformance suite: every KVSelector runs one shared set of checks by adding one line,
///   INSTANTIATE_TYPED_TEST_SUITE_P(<Name>, Conformance, OnCpu<Case>);   (OnCuda<Case> in the CUDA tests)
/// where Case says how to build the selector (its limits are the suite's, below; its configuration and the extra
/// prepare inputs it takes, such as A²ATS's codebooks, the prefill queries CTKVR and CSAttention cluster, or the
/// pre-RoPE keys A²ATS and SpeContext code) and Backend says on which context it runs (CpuBackend here; the CUDA
/// tests define CudaBackend). The checks are independent facts about any selection, each on fresh random inputs
/// (KVSIFT_TEST_SEED reproduces a run), with the selection outputs and the workspaces poisoned before each call:
///   - per (sequence, kv head) the listed positions are strictly ascending (so distinct), inside [0, length), and
///     never inside the attention window (sink + recent) the selector is given; counts are within [0, capacity]
///     and at most the middle's size; a selector with capacity > 0 lists at least one token of a middle of
///     >= 90 tokens, one with capacity 0 lists none; a second source (CentroidKV's store) lists distinct rows of
///     its store, at least one and at most second_source_capacity();
///   - refusals (kvsift::Error): a slot outside [0, max_slots), a slot never prepared, one released, one listed
///     twice in a release, each naming the call and the slot ("<Name>::select: slots[0] (= 2) is outside ...";
///     append and select check host slots only: a CUDA step's slots are device values, checked by DecodeStep's
///     validate_indices instead; release checks them everywhere); a sequence longer than limits.max_tokens, at
///     prepare or else by its first step (the CPU's select throws, CUDA's gives its rows count -1), naming the
///     length; a workspace one byte short (append and select), naming the bytes it has;
///   - joining and leaving sequences: two sequences prepared into slots 0 and 1; slot 1 released and a third
///     sequence prepared into it; the survivor's selection (and the newcomer's) equals that of a fresh selector
///     that never saw the leaving sequence;
///   - determinism: two selectors on the same inputs, their outputs and workspaces poisoned differently, select
///     the same.
/// The suite drives the selector's own calls (prepare, append, select, release), not a decode step, so that each
/// output is the selector's; Session and Bound below keep every input and output in the context's memory, at
/// fixed addresses per batch, so the CUDA tests capture enqueue() in a graph and replay it.
///
/// The cases of kvsift's eight selectors, and of the rerank stage after Quest, are defined at the end of this file
/// (shared by the CPU and the CUDA instantiations). A new selector adds its case there and its INSTANTIATE line in
/// tests/selectors/test_conformance.cpp (and tests/cuda/test_cuda_conformance.cpp for CUDA).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <numeric>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "a2ats_problem.hpp"
#include "kvsift/cpu/context.hpp"
#include "kvsift/selectors/a2ats/a2ats.hpp"
#include "kvsift/selectors/centroid_kv/centroid_kv.hpp"
#include "kvsift/selectors/csattention/csattention.hpp"
#include "kvsift/selectors/ctkvr/ctkvr.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
#include "kvsift/selectors/quest/quest.hpp"
#include "kvsift/selectors/rerank.hpp"
#include "kvsift/selectors/selector.hpp"
#include "kvsift/selectors/specontext/specontext.hpp"
#include "kvsift/selectors/streaming_llm/streaming_llm.hpp"
#include "test_util.hpp"

namespace kvsift::test::conformance {

// The suite's shapes: small enough that all eight selectors run every check in a few seconds on the CPU.
inline constexpr std::int32_t kQHeads = 8, kKvHeads = 2, kHeadDim = 64;  // A²ATS takes head_dim 64 or 128
inline constexpr std::int32_t kMaxTokens = 256;                         // limits.max_tokens
inline constexpr std::int32_t kStorage = kMaxTokens + 8;  // cache room per row: a prompt may exceed max_tokens
inline constexpr std::int32_t kPrefillQueries = 16;       // W (CTKVR and CSAttention cluster them)
inline constexpr std::int32_t kMaxSlots = 2;
inline constexpr std::int32_t kShortestPrompt = 110, kLongestPrompt = 200;
/// Decode steps per phase of a check: each appends a token (which the later selections read) and selects.
inline constexpr std::int32_t kSteps = 3;

inline SelectorLimits limits() {
  return {.max_slots = kMaxSlots, .max_tokens = kMaxTokens, .q_heads = kQHeads, .kv_heads = kKvHeads,
          .head_dim = kHeadDim};
}

/// One sequence on the host: its cache row (K, V and the pre-RoPE keys [kv_heads, kStorage, head_dim]; the first
/// `length` tokens are its tokens), its last W prefill queries [q_heads, W, head_dim] and the current step's query
/// [q_heads, head_dim]. Values are normal (never 0), rounded to fp16.
struct Sequence {
  std::int32_t length = 0;
  std::vector<half> k, v, k_pre, prefill_q, q;

  Sequence(Random& rng, std::int32_t prompt) : length(prompt) {
    const std::size_t elements = std::size_t(kKvHeads) * kStorage * kHeadDim;
    k = to_storage<half>(rng.normal(elements));
    v = to_storage<half>(rng.normal(elements));
    k_pre = to_storage<half>(rng.normal(elements));
    prefill_q = to_storage<half>(rng.normal(std::size_t(kQHeads) * kPrefillQueries * kHeadDim));
    q = to_storage<half>(rng.normal(std::size_t(kQHeads) * kHeadDim));
  }
  /// A decode step's token: fresh K, V and pre-RoPE key at position `length` (then counted), a fresh query.
  void grow(Random& rng) {
    for (std::vector<half>* row : {&k, &v, &k_pre}) {
      const std::vector<float> token = rng.normal(std::size_t(kKvHeads) * kHeadDim);
      for (std::int32_t h = 0; h < kKvHeads; ++h) {
        for (std::int32_t i = 0; i < kHeadDim; ++i) {
          (*row)[(std::size_t(h) * kStorage + std::size_t(length)) * kHeadDim + std::size_t(i)] =
              from_float<half>(token[std::size_t(h) * kHeadDim + std::size_t(i)]);
        }
      }
    }
    q = to_storage<half>(rng.normal(q.size()));
    ++length;
  }
};

/// A selection read back to the host: per (batch row, kv head) row its first min(count, capacity) entries; the
/// second source's likewise (empty without one).
struct Picked {
  std::int32_t batch = 0, capacity = 0, second_capacity = 0;
  std::vector<std::int32_t> counts, second_counts;
  std::vector<std::vector<std::int32_t>> rows, second_rows;

  /// Batch row b's part (its kv heads' rows), as a one-row Picked: to compare a sequence across batches.
  Picked row(std::int32_t b) const {
    Picked one;
    one.batch = 1;
    one.capacity = capacity;
    one.second_capacity = second_capacity;
    for (std::int32_t g = 0; g < kKvHeads; ++g) {
      const std::size_t r = std::size_t(b) * kKvHeads + std::size_t(g);
      one.counts.push_back(counts[r]);
      one.rows.push_back(rows[r]);
      if (!second_counts.empty()) {
        one.second_counts.push_back(second_counts[r]);
        one.second_rows.push_back(second_rows[r]);
      }
    }
    return one;
  }
  bool operator==(const Picked&) const = default;
};

inline std::string describe(const Picked& p) {
  std::string s;
  for (std::size_t r = 0; r < p.rows.size(); ++r) {
    s += fmt::format("row {} count {}: [{}]\n", r, p.counts[r], fmt::join(p.rows[r], " "));
    if (!p.second_rows.empty()) {
      s += fmt::format("  second count {}: [{}]\n", p.second_counts[r], fmt::join(p.second_rows[r], " "));
    }
  }
  return s;
}

template <class V>
std::vector<V> repeat(std::size_t n, V value) {
  return std::vector<V>(std::max<std::size_t>(n, 1), value);
}

/// An array of the context's memory holding `host` (at least one element, so that data() is never null).
template <class V, class Context>
typename Context::template array<V> upload(const std::vector<V>& host, const Context& ctx) {
  typename Context::template array<V> out(std::max<std::size_t>(host.size(), 1));
  if (!host.empty()) copy_from_host(host.data(), host.size(), out.data(), ctx);
  return out;
}
template <class V, class Context>
void upload_into(const std::vector<V>& host, typename Context::template array<V>& out, const Context& ctx) {
  if (!host.empty()) copy_from_host(host.data(), host.size(), out.data(), ctx);
}
template <class V, class Context>
std::vector<V> download(const V* src, std::size_t n, const Context& ctx) {
  std::vector<V> host(n);
  if (n > 0) copy_to_host(src, n, host.data(), ctx);
  return host;
}

/// One batch of sequences (batch row b is seqs[b], in slot slots[b]) in the context's memory, at fixed addresses:
/// the contiguous cache [batch, kv_heads, kStorage, head_dim] and its lengths, the slots, the step's queries and
/// pre-RoPE keys, the prefill queries, the selection outputs and both workspaces. load() writes the sequences'
/// current contents into the same arrays, so a graph captured over them replays on each step's values.
template <class Context>
struct Bound {
  template <class V>
  using Array = typename Context::template array<V>;

  std::int32_t batch;
  std::vector<std::int32_t> host_slots;
  std::int32_t capacity;
  std::size_t append_bytes, select_bytes;
  Array<half> k, v, k_pre, prefill_q, q, k_step;
  Array<std::int32_t> lengths, slots, indices, counts;
  Array<float> log_weights;
  Array<std::byte> append_ws, select_ws;
  bool with_weights;

  Bound(const Context& ctx, std::vector<std::int32_t> slots_, std::int32_t capacity_, bool with_weights_,
        std::size_t append_bytes_, std::size_t select_bytes_)
      : batch(std::int32_t(slots_.size())), host_slots(std::move(slots_)), capacity(capacity_),
        append_bytes(append_bytes_), select_bytes(select_bytes_),
        k(std::size_t(batch) * kKvHeads * kStorage * kHeadDim), v(k.size()), k_pre(k.size()),
        prefill_q(std::size_t(batch) * kQHeads * kPrefillQueries * kHeadDim), q(std::size_t(batch) * kQHeads * kHeadDim),
        k_step(std::size_t(batch) * kKvHeads * kHeadDim), lengths(std::size_t(batch)), slots(upload(host_slots, ctx)),
        indices(std::max<std::size_t>(std::size_t(batch) * kKvHeads * std::size_t(capacity), 1)),
        counts(std::size_t(batch) * kKvHeads), log_weights(with_weights_ ? indices.size() : 1),
        append_ws(std::max<std::size_t>(append_bytes, 1)), select_ws(std::max<std::size_t>(select_bytes, 1)),
        with_weights(with_weights_) {}

  /// Writes the sequences' current contents (the batch's rows, in order).
  void load(const std::vector<const Sequence*>& seqs, const Context& ctx) {
    EXPECT_EQ(std::int32_t(seqs.size()), batch);
    std::vector<half> hk, hv, hk_pre, hpq, hq, hstep;
    std::vector<std::int32_t> hlen;
    for (const Sequence* s : seqs) {
      hk.insert(hk.end(), s->k.begin(), s->k.end());
      hv.insert(hv.end(), s->v.begin(), s->v.end());
      hk_pre.insert(hk_pre.end(), s->k_pre.begin(), s->k_pre.end());
      hpq.insert(hpq.end(), s->prefill_q.begin(), s->prefill_q.end());
      hq.insert(hq.end(), s->q.begin(), s->q.end());
      for (std::int32_t h = 0; h < kKvHeads; ++h) {  // the pre-RoPE key of the last token
        const auto first = s->k_pre.begin() + std::ptrdiff_t((std::size_t(h) * kStorage + std::size_t(s->length - 1)) * kHeadDim);
        hstep.insert(hstep.end(), first, first + kHeadDim);
      }
      hlen.push_back(s->length);
    }
    upload_into(hk, k, ctx);
    upload_into(hv, v, ctx);
    upload_into(hk_pre, k_pre, ctx);
    upload_into(hpq, prefill_q, ctx);
    upload_into(hq, q, ctx);
    upload_into(hstep, k_step, ctx);
    upload_into(hlen, lengths, ctx);
  }
  /// Outputs and workspaces poisoned: indices and counts `index` (-777: outside every range), log-weights NaN,
  /// workspace bytes `workspace_byte` (their contents must not matter).
  void poison(const Context& ctx, std::byte workspace_byte = std::byte{0xff}, std::int32_t index = kPoisonIndex) {
    upload_into(repeat(indices.size(), index), indices, ctx);
    upload_into(repeat(counts.size(), index), counts, ctx);
    upload_into(repeat(log_weights.size(), kPoison), log_weights, ctx);
    upload_into(repeat(append_ws.size(), workspace_byte), append_ws, ctx);
    upload_into(repeat(select_ws.size(), workspace_byte), select_ws, ctx);
  }

  KVCache<const half> cache() const {
    return ContiguousKVView<const half>::packed(k.data(), v.data(), batch, kKvHeads, kStorage, kHeadDim,
                                                lengths.data());
  }
  SelectionView out() const {
    return {const_cast<std::int32_t*>(indices.data()), const_cast<std::int32_t*>(counts.data()),
            with_weights ? const_cast<float*>(log_weights.data()) : nullptr, batch, kKvHeads, capacity};
  }
  std::span<std::byte> append_workspace() { return {append_ws.data(), append_bytes}; }
  std::span<std::byte> select_workspace() { return {select_ws.data(), select_bytes}; }
};

/// A selector of `Case` on `Context` and the calls the checks make.
template <class Case, class Context>
class Session {
 public:
  using Selector = typename Case::template selector<Context>;

  explicit Session(const Context& ctx) : ctx_(ctx), selector_(std::make_unique<Selector>(Case::make(limits(), ctx))) {}

  Selector& selector() { return *selector_; }
  const Context& context() const { return ctx_; }
  static SelectShape shape(std::int32_t batch) { return {batch, kQHeads, kKvHeads, kHeadDim, 0}; }

  /// A batch's buffers for this selector: its capacity, its workspaces for the batch.
  std::unique_ptr<Bound<Context>> bind(std::vector<std::int32_t> slots) const {
    const std::int32_t batch = std::int32_t(slots.size());
    return std::make_unique<Bound<Context>>(ctx_, std::move(slots), selector_->capacity(),
                                            selector_writes_log_weights(*selector_),
                                            selector_->append_workspace_bytes(shape(batch), ctx_),
                                            selector_->select_workspace_bytes(shape(batch), ctx_));
  }

  PrefillInputs<half> prefill_inputs(const Bound<Context>& b) const {
    PrefillInputs<half> in{.cache = b.cache(), .slots = b.slots.data(), .attention = {.window = Case::window}};
    if (Case::prefill_queries) {
      in.queries = SequenceView<const half>::packed(b.prefill_q.data(), b.batch, kQHeads, kPrefillQueries, kHeadDim);
    }
    if (Case::pre_rope_keys) {
      in.k_pre_rope = SequenceView<const half>::packed(b.k_pre.data(), b.batch, kKvHeads, kStorage, kHeadDim);
    }
    return in;
  }
  AppendInputs<half> append_inputs(const Bound<Context>& b) const {
    AppendInputs<half> in{.cache = b.cache(), .slots = b.slots.data(), .lengths = b.lengths.data()};
    if (Case::pre_rope_keys) in.k_pre_rope = HeadsView<const half>::packed(b.k_step.data(), b.batch, kKvHeads, kHeadDim);
    return in;
  }
  SelectInputs<half> select_inputs(const Bound<Context>& b) const {
    return {.q = QueryView<const half>::packed(b.q.data(), b.batch, kQHeads, kHeadDim), .cache = b.cache(),
            .slots = b.slots.data(), .lengths = b.lengths.data(), .attention = {.window = Case::window}};
  }

  /// prepare of the sequences (batch row b into slots[b]).
  void prepare(const std::vector<const Sequence*>& seqs, const std::vector<std::int32_t>& slots) {
    const auto b = bind(slots);
    b->load(seqs, ctx_);
    selector_->prepare(prefill_inputs(*b), ctx_);
  }
  void release(std::vector<std::int32_t> slots) { selector_->release(slots); }

  /// append then select on b's current contents, enqueued on the context (no host synchronization on CUDA).
  void enqueue(Bound<Context>& b) {
    selector_->append(append_inputs(b), b.append_workspace(), ctx_);
    enqueue_select(b);
  }
  void enqueue_select(Bound<Context>& b) { selector_->select(select_inputs(b), b.out(), b.select_workspace(), ctx_); }

  /// The last select's selection in b (and the second source's, for a selector with one).
  Picked read(const Bound<Context>& b) const {
    Picked p;
    p.batch = b.batch;
    p.capacity = b.capacity;
    p.counts = download(b.counts.data(), std::size_t(b.batch) * kKvHeads, ctx_);
    const std::vector<std::int32_t> indices =
        download(b.indices.data(), std::size_t(b.batch) * kKvHeads * std::size_t(b.capacity), ctx_);
    p.rows = rows_of(indices, p.counts, b.capacity);
    if constexpr (HasSecondSource<Selector>) {
      if (selector_->second_source_capacity() > 0) {
        // The second source's rows of the step's batch rows: row b, or through its row map (CentroidKV reads its
        // store in place, by slot).
        const SecondSource<typename Selector::value_type> source = selector_->second_source(select_inputs(b));
        const SelectionView& second = source.selection;
        const std::size_t width = std::size_t(second.capacity);
        const std::vector<std::int32_t> counts = download(second.counts, std::size_t(second.batch) * kKvHeads, ctx_);
        const std::vector<std::int32_t> indices =
            download(second.indices, std::size_t(second.batch) * kKvHeads * width, ctx_);
        std::vector<std::int32_t> map(std::size_t(b.batch));
        std::iota(map.begin(), map.end(), 0);
        if (source.selection_rows != nullptr) map = download(source.selection_rows, std::size_t(b.batch), ctx_);
        std::vector<std::int32_t> picked_indices;
        for (const std::int32_t row : map) {
          EXPECT_TRUE(row >= 0 && row < second.batch) << "the second source's row map names row " << row << " of "
                                                      << second.batch;
          const std::size_t first = std::size_t(std::clamp(row, 0, second.batch - 1)) * kKvHeads;
          for (std::size_t g = 0; g < std::size_t(kKvHeads); ++g) {
            p.second_counts.push_back(counts[first + g]);
            picked_indices.insert(picked_indices.end(), indices.begin() + std::ptrdiff_t((first + g) * width),
                                  indices.begin() + std::ptrdiff_t((first + g + 1) * width));
          }
        }
        p.second_capacity = second.capacity;
        p.second_rows = rows_of(picked_indices, p.second_counts, second.capacity);
      }
    }
    return p;
  }

  /// One decode step of the sequences (their current contents: grow them first) in the slots, on poisoned
  /// outputs and workspaces; returns the selection.
  Picked step(const std::vector<const Sequence*>& seqs, const std::vector<std::int32_t>& slots) {
    const auto b = bind(slots);
    b->load(seqs, ctx_);
    b->poison(ctx_);
    enqueue(*b);
    return read(*b);
  }

 private:
  static std::vector<std::vector<std::int32_t>> rows_of(const std::vector<std::int32_t>& indices,
                                                        const std::vector<std::int32_t>& counts,
                                                        std::int32_t capacity) {
    std::vector<std::vector<std::int32_t>> rows;
    for (std::size_t r = 0; r < counts.size(); ++r) {
      const std::int32_t n = std::clamp(counts[r], 0, capacity);
      const auto first = indices.begin() + std::ptrdiff_t(r * std::size_t(capacity));
      rows.emplace_back(first, first + n);
    }
    return rows;
  }

  Context ctx_;
  std::unique_ptr<Selector> selector_;
};

/// The independent facts about one selection of sequences `seqs` (batch row b is seqs[b]) under `window`.
inline void expect_valid(const Picked& p, const std::vector<const Sequence*>& seqs, const AttentionWindow& window,
                         const std::string& what) {
  ASSERT_EQ(p.counts.size(), seqs.size() * kKvHeads) << what;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    const std::int32_t length = seqs[b]->length, lo = window.sink_end(length), hi = window.recent_begin(length);
    for (std::int32_t g = 0; g < kKvHeads; ++g) {
      const std::size_t r = b * kKvHeads + std::size_t(g);
      const std::string where = fmt::format("{}: row {} kv head {} (length {}, middle [{}, {}))", what, b, g, length, lo, hi);
      const std::int32_t count = p.counts[r];
      EXPECT_GE(count, 0) << where;
      EXPECT_LE(count, p.capacity) << where << ": more than the capacity";
      EXPECT_LE(count, hi - lo) << where << ": more tokens than the middle holds";
      if (p.capacity > 0) {
        // Every case's budget selects from a middle of >= kShortestPrompt - 20 tokens: an empty row is a defect.
        EXPECT_GT(count, 0) << where << ": selects nothing from a middle of " << hi - lo << " tokens";
      } else {
        EXPECT_EQ(count, 0) << where << ": a selector of capacity 0 lists nothing";
      }
      const std::vector<std::int32_t>& row = p.rows[r];
      for (std::size_t i = 0; i < row.size(); ++i) {
        EXPECT_TRUE(row[i] >= 0 && row[i] < length) << where << ": entry " << i << " = " << row[i] << " outside [0, length)";
        EXPECT_TRUE(row[i] >= lo && row[i] < hi) << where << ": entry " << i << " = " << row[i] << " is in the window";
        if (i > 0) {
          EXPECT_LT(row[i - 1], row[i]) << where << ": entries " << i - 1 << ", " << i << " not strictly ascending";
        }
      }
      if (!p.second_counts.empty()) {
        const std::int32_t second = p.second_counts[r];
        EXPECT_GT(second, 0) << where << ": the second source lists nothing";
        EXPECT_LE(second, p.second_capacity) << where << ": the second source lists more than its capacity";
        const std::set<std::int32_t> distinct(p.second_rows[r].begin(), p.second_rows[r].end());
        EXPECT_EQ(distinct.size(), p.second_rows[r].size()) << where << ": the second source lists a row twice";
        for (const std::int32_t e : p.second_rows[r]) {
          EXPECT_TRUE(e >= 0 && e < p.second_capacity) << where << ": second-source entry " << e << " outside its store";
        }
      }
    }
  }
}

inline std::vector<const Sequence*> as_batch(std::initializer_list<const Sequence*> seqs) { return seqs; }

/// The case and the backend one instantiation runs.
template <class Case_, class Backend_>
struct On {
  using Case = Case_;
  using Backend = Backend_;
};

/// Case on the CPU: the argument of the instantiation line (one type, so that the macro sees no comma).
struct CpuBackend;
template <class Case>
using OnCpu = On<Case, CpuBackend>;

/// The CPU: the calling thread (a pool's splits are each primitive's own tests').
struct CpuBackend {
  using Context = cpu::Context;
  static bool available() { return true; }
  Context context() const { return {}; }
};

template <class Binding>
class Conformance : public SeededTest {
 protected:
  using Case = typename Binding::Case;
  using Backend = typename Binding::Backend;
  using Context = typename Backend::Context;
  using Sess = Session<Case, Context>;

  void SetUp() override {
    if (!Backend::available()) GTEST_SKIP() << "no device for this backend on this machine";
    backend_.emplace();
  }
  Context ctx() const { return backend_->context(); }
  Sequence sequence() { return Sequence(rng, rng.uniform_int(kShortestPrompt, kLongestPrompt)); }
  std::string trace() const { return fmt::format("{} seed {}", Case::where, seed); }
  /// The refusal's text: "<where>::<call>: <message>".
  static std::string at(std::string_view call, std::string_view message) {
    return fmt::format("{}::{}: {}", Case::where, call, message);
  }

  std::optional<Backend> backend_;
};

TYPED_TEST_SUITE_P(Conformance);

TYPED_TEST_P(Conformance, SelectionsAreAscendingInRangeOutsideTheWindowAndWithinCapacity) {
  using Case = typename TestFixture::Case;
  SCOPED_TRACE(this->trace());
  typename TestFixture::Sess s(this->ctx());
  Sequence a = this->sequence(), b = this->sequence();
  const auto batch = as_batch({&a, &b});
  const std::vector<std::int32_t> slots{1, 0};  // batch rows are not slots
  s.prepare(batch, slots);
  for (std::int32_t step = 0; step < kSteps; ++step) {
    a.grow(this->rng);
    b.grow(this->rng);
    expect_valid(s.step(batch, slots), batch, Case::window, fmt::format("step {}", step));
  }
  // One row alone, from the same selector: a batch of any size up to max_slots.
  a.grow(this->rng);
  expect_valid(s.step(as_batch({&a}), {1}), as_batch({&a}), Case::window, "a batch of one");
}

TYPED_TEST_P(Conformance, RefusesSlotsOutsideTheSlotsOrWithoutASequence) {
  using Context = typename TestFixture::Context;
  SCOPED_TRACE(this->trace());
  typename TestFixture::Sess s(this->ctx());
  Sequence a = this->sequence();
  constexpr bool host_slots = Context::memory == MemorySpace::host;
  const auto one = as_batch({&a});
  const std::string outside = "slots[0] (= 2) is outside [0, limits.max_slots = 2)";
  if constexpr (host_slots) {
    expect_error([&] { s.prepare(one, {kMaxSlots}); }, {this->at("prepare", ""), outside});
    EXPECT_FALSE(selector_slot_prepared(s.selector(), 0));
  }
  s.prepare(one, {0});
  EXPECT_TRUE(selector_slot_prepared(s.selector(), 0));
  EXPECT_FALSE(selector_slot_prepared(s.selector(), 1));
  a.grow(this->rng);
  if constexpr (host_slots) {
    for (const std::int32_t slot : {kMaxSlots, -1}) {
      const auto bound = s.bind({slot});
      bound->load(one, s.context());
      const std::string message = fmt::format("slots[0] (= {}) is outside [0, limits.max_slots = 2)", slot);
      expect_error([&] { s.selector().append(s.append_inputs(*bound), bound->append_workspace(), s.context()); },
                   this->at("append", message));
      expect_error([&] { s.enqueue_select(*bound); }, this->at("select", message));
    }
    const auto never = s.bind({1});
    never->load(one, s.context());
    const std::string never_prepared = "slots[0] (= 1) holds no sequence: it was never prepared";
    expect_error([&] { s.selector().append(s.append_inputs(*never), never->append_workspace(), s.context()); },
                 this->at("append", never_prepared));
    expect_error([&] { s.enqueue_select(*never); }, this->at("select", never_prepared));
  }
  expect_error([&] { s.release({kMaxSlots}); }, this->at("release", outside));
  expect_error([&] { s.release({1}); }, this->at("release", "slots[0] (= 1) holds no sequence: it was never prepared"));
  expect_error([&] { s.release({0, 1}); }, this->at("release", "slots[1] (= 1) holds no sequence: it was never prepared"));
  expect_error([&] { s.release({0, 0}); }, this->at("release", "slots lists slot 0 twice"));
  EXPECT_TRUE(selector_slot_prepared(s.selector(), 0)) << "a refused release released nothing";
  expect_valid(s.step(one, {0}), one, TestFixture::Case::window, "after the refusals");
  s.release({0});
  EXPECT_FALSE(selector_slot_prepared(s.selector(), 0));
  const std::string released = "slots[0] (= 0) holds no sequence: it was released";
  expect_error([&] { s.release({0}); }, this->at("release", released));
  if constexpr (host_slots) {
    const auto bound = s.bind({0});
    bound->load(one, s.context());
    expect_error([&] { s.selector().append(s.append_inputs(*bound), bound->append_workspace(), s.context()); },
                 this->at("append", released));
    expect_error([&] { s.enqueue_select(*bound); }, this->at("select", released));
  }
}

TYPED_TEST_P(Conformance, RefusesASequenceLongerThanMaxTokens) {
  // selectors/selector.hpp: a sequence longer than the bound is never cut to it. Refused at prepare (the lengths
  // are read on the host there, on either backend), or else by its first step: on the CPU select throws naming the
  // length; on CUDA, where lengths are device values, its rows get count -1. Either way naming the length.
  using Context = typename TestFixture::Context;
  SCOPED_TRACE(this->trace());
  typename TestFixture::Sess s(this->ctx());
  Sequence ok = this->sequence(), too_long(this->rng, kMaxTokens + 1);
  const auto batch = as_batch({&ok, &too_long});
  const std::string length = fmt::format("{}", kMaxTokens + 1);
  bool refused_at_prepare = false;
  try {
    s.prepare(batch, {0, 1});
  } catch (const Error& e) {
    refused_at_prepare = true;
    EXPECT_NE(std::string(e.what()).find(length), std::string::npos) << "the refusal names the length: " << e.what();
    EXPECT_FALSE(selector_slot_prepared(s.selector(), 0)) << "a refused prepare prepares no slot of its batch";
    EXPECT_FALSE(selector_slot_prepared(s.selector(), 1));
  }
  if (!refused_at_prepare) {
    if constexpr (Context::memory == MemorySpace::host) {
      try {
        s.step(batch, {0, 1});
        ADD_FAILURE() << "a sequence of " << length << " tokens (limits.max_tokens " << kMaxTokens
                      << ") was accepted by prepare and by a step";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(length), std::string::npos) << "the refusal names the length: " << e.what();
      }
    } else {
      const Picked p = s.step(batch, {0, 1});
      for (std::int32_t g = 0; g < kKvHeads; ++g) {
        EXPECT_EQ(p.counts[std::size_t(kKvHeads + g)], -1) << "kv head " << g << " of the sequence past max_tokens";
      }
    }
  }
  // A sequence of max_tokens exactly is taken.
  Sequence longest(this->rng, kMaxTokens - 1);
  typename TestFixture::Sess fresh(this->ctx());
  fresh.prepare(as_batch({&longest}), {1});
  longest.grow(this->rng);
  expect_valid(fresh.step(as_batch({&longest}), {1}), as_batch({&longest}), TestFixture::Case::window, "max_tokens");
}

TYPED_TEST_P(Conformance, RefusesAnUndersizedWorkspace) {
  SCOPED_TRACE(this->trace());
  typename TestFixture::Sess s(this->ctx());
  Sequence a = this->sequence(), b = this->sequence();
  const auto batch = as_batch({&a, &b});
  s.prepare(batch, {0, 1});
  a.grow(this->rng);
  b.grow(this->rng);
  const auto bound = s.bind({0, 1});
  bound->load(batch, s.context());
  bound->poison(s.context());
  EXPECT_EQ(bound->append_bytes % 256, 0u) << "workspaces are sized in 256-byte blocks";
  EXPECT_EQ(bound->select_bytes % 256, 0u);
  const std::size_t append_bytes = bound->append_bytes, select_bytes = bound->select_bytes;
  if (append_bytes > 0) {
    bound->append_bytes = append_bytes - 1;
    expect_error([&] { s.enqueue(*bound); },
                 {"workspace too small", fmt::format("the workspace has {} bytes", append_bytes - 1)});
    bound->append_bytes = append_bytes;
  }
  if (select_bytes > 0) {
    bound->select_bytes = select_bytes - 1;
    expect_error([&] { s.enqueue(*bound); },
                 {"workspace too small", fmt::format("the workspace has {} bytes", select_bytes - 1)});
    bound->select_bytes = select_bytes;
  }
  // A selector without scratch (both 0) has nothing to refuse: it runs on empty workspaces. Where the refused
  // select's append ran, the token is in the index already.
  bound->poison(s.context());
  if (select_bytes > 0) {
    s.enqueue_select(*bound);
  } else {
    s.enqueue(*bound);
  }
  expect_valid(s.read(*bound), batch, TestFixture::Case::window, "on exact workspaces");
}

TYPED_TEST_P(Conformance, JoiningAndLeavingSequencesLeaveTheOthersSelectionsAsAFreshSelectors) {
  // Continuous batching: A and B join (slots 0, 1) and decode; B leaves, C joins into slot 1 and decodes beside A.
  // The reference selector never saw B: A decodes alone, then C joins slot 1. Every selection of A, and C's, must
  // be the reference's.
  SCOPED_TRACE(this->trace());
  typename TestFixture::Sess churned(this->ctx()), fresh(this->ctx());
  Sequence a = this->sequence(), b = this->sequence(), c = this->sequence();
  churned.prepare(as_batch({&a, &b}), {0, 1});
  fresh.prepare(as_batch({&a}), {0});
  for (std::int32_t step = 0; step < kSteps; ++step) {
    a.grow(this->rng);
    b.grow(this->rng);
    const Picked both = churned.step(as_batch({&a, &b}), {0, 1});
    const Picked alone = fresh.step(as_batch({&a}), {0});
    EXPECT_EQ(both.row(0), alone) << "step " << step << ": A beside B\n"
                                  << describe(both.row(0)) << "A alone\n" << describe(alone);
  }
  churned.release({1});
  churned.prepare(as_batch({&c}), {1});
  fresh.prepare(as_batch({&c}), {1});
  for (std::int32_t step = 0; step < kSteps; ++step) {
    a.grow(this->rng);
    c.grow(this->rng);
    const auto batch = as_batch({&c, &a});
    const Picked after = churned.step(batch, {1, 0});
    const Picked reference = fresh.step(batch, {1, 0});
    expect_valid(after, batch, TestFixture::Case::window, fmt::format("after the churn, step {}", step));
    EXPECT_EQ(after, reference) << "step " << step << " after B left and C joined slot 1\n"
                                << describe(after) << "a selector that never saw B\n" << describe(reference);
  }
}

TYPED_TEST_P(Conformance, RunsAreDeterministic) {
  // Two selectors, the same calls on the same inputs; the second's outputs and workspaces poisoned otherwise
  // (zeros: a valid count and position, so an unwritten one shows as a difference). (A select repeated on one
  // selector need not repeat itself: CTKVR's dynamic update stores each select's query as a centroid.)
  SCOPED_TRACE(this->trace());
  typename TestFixture::Sess first(this->ctx()), second(this->ctx());
  Sequence a = this->sequence(), b = this->sequence();
  const auto batch = as_batch({&a, &b});
  const std::vector<std::int32_t> slots{1, 0};
  first.prepare(batch, slots);
  second.prepare(batch, slots);
  for (std::int32_t step = 0; step < kSteps; ++step) {
    a.grow(this->rng);
    b.grow(this->rng);
    const Picked once = first.step(batch, slots);
    const auto bound = second.bind(slots);
    bound->load(batch, second.context());
    bound->poison(second.context(), std::byte{0}, 0);
    second.enqueue(*bound);
    const Picked again = second.read(*bound);
    expect_valid(once, batch, TestFixture::Case::window, fmt::format("step {}", step));
    EXPECT_EQ(again, once) << "step " << step << ": another selector on the same inputs\n"
                           << describe(again) << "first\n" << describe(once);
  }
}

TYPED_TEST_P(Conformance, RefusesAHostPageTableThatLeavesItsPages) {
  // A paged cache whose page table names a page past its pages: on the CPU prepare, append and select would read
  // keys through it (out of bounds), so each refuses it by name first (selectors/detail/checks.hpp's check_cache,
  // core/validate.hpp). A device page table lives on the device, where it is trusted as every device value.
  using Context = typename TestFixture::Context;
  if constexpr (Context::memory != MemorySpace::host) {
    GTEST_SKIP() << "a device page table is not read on the host";
  } else {
    SCOPED_TRACE(this->trace());
    typename TestFixture::Sess s(this->ctx());
    Sequence a = this->sequence();
    const auto bound = s.bind({0});
    bound->load(as_batch({&a}), s.context());
    // NHD pages of 16 over the bound's K and V storage; their contents do not matter, nothing may read them.
    constexpr std::int32_t kPage = 16;
    const std::int32_t pages = (a.length + kPage - 1) / kPage;
    const auto num_pages = std::int32_t(bound->k.size() / (std::size_t(kPage) * kKvHeads * kHeadDim));
    std::vector<std::int32_t> indptr{0, pages}, last{a.length - (pages - 1) * kPage};
    std::vector<std::int32_t> table(static_cast<std::size_t>(pages));
    std::iota(table.begin(), table.end(), 0);
    table.back() = num_pages;  // one past the pages
    const PagedKVView<const half> wild{bound->k.data(), bound->v.data(), indptr.data(), table.data(), last.data(),
                                       1, kKvHeads, kHeadDim, kPage, num_pages,
                                       std::int64_t(kPage) * kKvHeads * kHeadDim, kKvHeads * kHeadDim, kHeadDim};
    const std::initializer_list<std::string> named = {
        fmt::format("in.cache.page_indices[{}] (= {}, sequence 0) is outside [0, num_pages = {})", pages - 1,
                    num_pages, num_pages)};
    auto prefill = s.prefill_inputs(*bound);
    prefill.cache = wild;
    expect_error([&] { s.selector().prepare(prefill, s.context()); }, named);
    EXPECT_FALSE(selector_slot_prepared(s.selector(), 0)) << "a refused prepare prepares no slot";
    // The same sequence prepared from a sound cache; then its step given the wild table.
    s.prepare(as_batch({&a}), {0});
    a.grow(this->rng);
    bound->load(as_batch({&a}), s.context());
    auto append = s.append_inputs(*bound);
    append.cache = wild;
    expect_error([&] { s.selector().append(append, bound->append_workspace(), s.context()); }, named);
    auto select = s.select_inputs(*bound);
    select.cache = wild;
    expect_error([&] { s.selector().select(select, bound->out(), bound->select_workspace(), s.context()); }, named);
  }
}

REGISTER_TYPED_TEST_SUITE_P(Conformance, SelectionsAreAscendingInRangeOutsideTheWindowAndWithinCapacity,
                            RefusesSlotsOutsideTheSlotsOrWithoutASequence, RefusesASequenceLongerThanMaxTokens,
                            RefusesAnUndersizedWorkspace, RefusesAHostPageTableThatLeavesItsPages,
                            JoiningAndLeavingSequencesLeaveTheOthersSelectionsAsAFreshSelectors,
                            RunsAreDeterministic);

// ---------------------------------------------------------------------------------------------------------------
// The cases: how to build each of kvsift's selectors for the suite's limits on any context.
//   selector<Context>: the selector type; make(limits, ctx): one, configured;
//   where: the name its refusals start with ("<where>::<call>: ...");
//   window: the attention window its selections leave out (the step's; empty for CentroidKV, which refuses one);
//   prefill_queries / pre_rope_keys: whether prepare takes the last W prefill queries / the pre-RoPE keys (append
//   then takes the step's pre-RoPE key);
//   cpu_cuda_slack: the CPU-equals-CUDA rule (tests/cuda/test_cuda_conformance.cpp): 0, the same selection bit for
//   bit; n > 0, the selector's documented near-tie rule: the backends' fp32 scores sum in different orders, so a
//   row may trade up to n entries whose scores are within rounding of the k-th (OracleTopK's statement, Quest's
//   pages of page_size tokens, SpeContext's), with counts equal.
// ---------------------------------------------------------------------------------------------------------------

inline constexpr AttentionWindow kWindow{.sink = 4, .recent = 16};

struct OracleTopKCase {
  template <class Context>
  using selector = OracleTopK<half, Context>;
  static constexpr std::string_view where = "OracleTopK";
  static constexpr AttentionWindow window = kWindow;
  static constexpr bool prefill_queries = false, pre_rope_keys = false;
  static constexpr std::int32_t cpu_cuda_slack = 2;
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context&) {
    return selector<Context>(l, {.budget = 32});
  }
};

struct QuestCase {
  template <class Context>
  using selector = Quest<half, Context>;
  static constexpr std::string_view where = "Quest";
  static constexpr AttentionWindow window = kWindow;
  static constexpr bool prefill_queries = false, pre_rope_keys = false;
  static constexpr std::int32_t cpu_cuda_slack = 2 * 8;  // two pages trading places
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context&) {
    return selector<Context>(l, {.budget = 32, .page_size = 8});
  }
};

/// The rerank stage after a proposer (selectors/rerank.hpp): Quest proposing 4 x 16 candidates, 16 kept. Its
/// refusals are the proposer's (Reranked checks its output alone).
struct RerankedQuestCase {
  template <class Context>
  using selector = Reranked<Quest<half, Context>>;
  static constexpr std::string_view where = "Quest";
  static constexpr AttentionWindow window = kWindow;
  static constexpr bool prefill_queries = false, pre_rope_keys = false;
  static constexpr std::int32_t cpu_cuda_slack = 2 * 8 + 2;  // Quest's two pages, then the rerank's fp32 near-ties
  template <class Context>
  static Quest<half, Context> proposer(const SelectorLimits& l) {
    return Quest<half, Context>(l, {.budget = 64, .page_size = 8});
  }
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context&) {
    return selector<Context>(proposer<Context>(l), {.budget = 16});
  }
};

/// RerankedQuestCase with an adaptive budget (RerankConfig::mass): each row keeps the fewest of its best candidates
/// holding 90% of their exact mass, 4 to 16 of them. The twins' counts may differ by one where fp32 scores put a
/// row's cumulative mass within rounding of the target.
struct RerankedMassQuestCase : RerankedQuestCase {
  static constexpr std::int32_t cpu_cuda_slack = RerankedQuestCase::cpu_cuda_slack + 1;
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context&) {
    return selector<Context>(proposer<Context>(l), {.budget = 16, .mass = 0.9, .floor = 4});
  }
};

struct StreamingLLMCase {
  template <class Context>
  using selector = StreamingLLM<half, Context>;
  static constexpr std::string_view where = "StreamingLLM";
  static constexpr AttentionWindow window = kWindow;
  static constexpr bool prefill_queries = false, pre_rope_keys = false;
  static constexpr std::int32_t cpu_cuda_slack = 0;
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context&) {
    return selector<Context>(l);
  }
};

struct CtkvrCase {
  template <class Context>
  using selector = Ctkvr<half, Context>;
  static constexpr std::string_view where = "Ctkvr";
  static constexpr AttentionWindow window = kWindow;
  static constexpr bool prefill_queries = true, pre_rope_keys = false;
  static constexpr std::int32_t cpu_cuda_slack = 2;  // its rerank is a top-k of fp32 scores
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context&) {
    return selector<Context>(l, {.budget = 32, .centroids = 8, .max_centroids = 16, .recalled_centroids = 2});
  }
};

struct CsattentionCase {
  template <class Context>
  using selector = Csattention<half, Context>;
  static constexpr std::string_view where = "Csattention";
  static constexpr AttentionWindow window = kWindow;
  static constexpr bool prefill_queries = true, pre_rope_keys = false;
  static constexpr std::int32_t cpu_cuda_slack = 0;  // tests/cuda/test_cuda_csattention.cpp: equal bit for bit
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context&) {
    return selector<Context>(
        l, {.subspaces = 8, .centroids = 6, .list_fraction = 0.25, .keep_fraction = 0.2, .prepare_chunk = 20});
  }
};

/// A²ATS's codebooks for kKvHeads and kHeadDim: clustered codewords of a problem of their own (the selector copies
/// them; the keys it codes are any cache's), as tests/selectors/test_life_cycle.cpp builds them.
inline const A2atsLayerCodebooks& a2ats_codebooks() {
  static Random rng(test_seed());
  static const A2atsProblem<half> problem(rng, A2atsCodebookKind::clustered, 1, kQHeads, kKvHeads, 64, {64}, {}, 2048,
                                          true, 24, kHeadDim);
  static const A2atsLayerCodebooks codebooks = problem.codebooks();
  return codebooks;
}

struct A2atsCase {
  template <class Context>
  using selector = A2ats<half, Context>;
  static constexpr std::string_view where = "A2ats";
  static constexpr AttentionWindow window = kWindow;
  static constexpr bool prefill_queries = false, pre_rope_keys = true;
  /// Its header: CPU and CUDA select alike where the codes agree and no two table entries are within rounding of
  /// the K-th; random keys may sit near a tie of two codewords.
  static constexpr std::int32_t cpu_cuda_slack = 2 * (kQHeads / kKvHeads);
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context& ctx) {
    return selector<Context>(l, {.budget_fraction = 0.1}, a2ats_codebooks(), ctx);
  }
};

/// The rerank stage after CSAttention and after A²ATS, as after Quest: each proposes its configured capacity,
/// a quarter of it kept.
template <class Proposer>
struct RerankedCase {
  template <class Context>
  using selector = Reranked<typename Proposer::template selector<Context>>;
  static constexpr std::string_view where = Proposer::where;
  static constexpr AttentionWindow window = Proposer::window;
  static constexpr bool prefill_queries = Proposer::prefill_queries, pre_rope_keys = Proposer::pre_rope_keys;
  static constexpr std::int32_t cpu_cuda_slack = Proposer::cpu_cuda_slack + 2;  // and the rerank's fp32 near-ties
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context& ctx) {
    auto proposer = Proposer::template make<Context>(l, ctx);
    const std::int32_t kept = std::max(1, proposer.capacity() / 4);
    return selector<Context>(std::move(proposer), {.budget = kept});
  }
};
using RerankedCsattentionCase = RerankedCase<CsattentionCase>;
using RerankedA2atsCase = RerankedCase<A2atsCase>;

struct CentroidKVCase {
  template <class Context>
  using selector = CentroidKV<half, Context>;
  static constexpr std::string_view where = "CentroidKV";
  static constexpr AttentionWindow window{};  // its store holds the sinks and the recent tokens
  static constexpr bool prefill_queries = false, pre_rope_keys = false;
  /// tests/cuda/test_cuda_merge_store.cpp: bit for bit but where a merge hinges on two similarities within fp32
  /// rounding (rare on random keys); its selection lists the store's rows, which such a merge renumbers.
  static constexpr std::int32_t cpu_cuda_slack = 0;
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context& ctx) {
    return selector<Context>(l, {.budget_ratio = 0.5f, .sinks = 4, .recent = 16}, ctx);
  }
};

struct SpeContextCase {
  template <class Context>
  using selector = SpeContext<half, Context>;
  static constexpr std::string_view where = "SpeContext";
  static constexpr AttentionWindow window = kWindow;  // recent >= 1: specontext_window
  static constexpr bool prefill_queries = false, pre_rope_keys = true;
  static constexpr std::int32_t cpu_cuda_slack = 2;  // OracleTopK's statement, and RoPE tables an ulp apart
  template <class Context>
  static selector<Context> make(const SelectorLimits& l, const Context& ctx) {
    return selector<Context>(l, {.budget = 32}, ctx);
  }
};

}  // namespace kvsift::test::conformance
