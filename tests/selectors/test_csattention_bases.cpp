// CSAttention's base pool and base files (selectors/csattention/csattention.hpp) on the CPU. The reference of a slot that
// shares or loads a base is a sequence with the same prompt prepared alone in its own selector: after share or
// load, and at every decode step after (same tokens, appends included), the slot reads the same index (centroids,
// lists, overlay) and selects the same tokens; another slot's inserts and a re-prepare of the source never touch a
// shared base. Base files: a round trip into another selector, byte-identical re-saves, and every refusal (a cut
// at many offsets, flipped bytes, another magic or version, each differing shape or configuration field, a list
// length above L_max, bad slots), after which the selector is unchanged.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "ctkvr_problem.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/csattention/csattention.hpp"
#include "kvsift/step/decode_step.hpp"
#include "score_table_contents.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::BaseContents;
using test::CtkvrProblem;
using test::expect_error;
using test::OverlayContents;
using test::Random;
using Selector = Csattention<half, cpu::Context>;
using Step = DecodeStep<Selector>;
using Rows = std::vector<std::vector<std::int32_t>>;

CsattentionConfig config(CsattentionTables tables = CsattentionTables::per_kv_head) {
  return {.subspaces = 8, .tables = tables, .centroids = 6, .list_fraction = 0.25, .keep_fraction = 0.2,
          .overlay_capacity = 64, .prepare_chunk = 20};
}
SelectorLimits limits(const CtkvrProblem& p, std::int32_t slots) {
  SelectorLimits l = p.limits();
  l.max_slots = slots;
  return l;
}
/// p's sequence in slot `slot` (its cache and prefill are p's).
CtkvrProblem in_slot(CtkvrProblem p, std::int32_t slot) {
  p.slot = slot;
  return p;
}

BaseContents base_of(const Selector& s, std::int32_t slot) { return test::base_contents(s.index_tables(), slot); }
OverlayContents overlay_of(const Selector& s, std::int32_t slot) {
  return test::overlay_contents(s.index_tables(), slot);
}
void expect_same_index(const Selector& a, std::int32_t slot_a, const Selector& b, std::int32_t slot_b,
                       const std::string& when) {
  test::expect_same_slot(a.index_tables(), slot_a, b.index_tables(), slot_b, when);
}

/// Every byte of a selector's index arrays (all storages and slots, entries past the counts included).
std::vector<unsigned char> raw_state(const Selector& s) {
  const auto t = s.index_tables();
  const std::size_t base_lists = ScoreTablesView<std::int32_t>::list_count(t.bases, t.table_heads, t.subspaces,
                                                                           t.centroids_per_subspace);
  const std::size_t slot_lists = ScoreTablesView<std::int32_t>::list_count(t.slots, t.table_heads, t.subspaces,
                                                                           t.centroids_per_subspace);
  std::vector<unsigned char> bytes;
  const auto add = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    bytes.insert(bytes.end(), b, b + n);
  };
  add(t.centroids, base_lists * std::size_t(t.width) * sizeof(float));
  add(t.base_ids, base_lists * std::size_t(t.length) * 4);
  add(t.base_scores, base_lists * std::size_t(t.length) * 2);
  add(t.base_counts, base_lists * 4);
  add(t.slot_base, std::size_t(t.slots) * 4);
  add(t.evicted, slot_lists * 4);
  add(t.overlay_ids, slot_lists * std::size_t(t.overlay_capacity) * 4);
  add(t.overlay_scores, slot_lists * std::size_t(t.overlay_capacity) * 2);
  add(t.overlay_sizes, slot_lists * 4);
  return bytes;
}

std::string saved(const Selector& s, std::int32_t slot) {
  std::ostringstream out(std::ios::binary);
  s.save_base(slot, out, {});
  return out.str();
}
void load(Selector& s, const std::string& file, std::vector<std::int32_t> slots) {
  std::istringstream in(file, std::ios::binary);
  s.load_base(in, slots, {});
}

/// One decode token's query and new K/V.
struct Token {
  std::vector<half> q, k, v;
};
Token random_token(Random& rng, const CtkvrProblem& p) {
  return {test::to_storage<half>(rng.normal(std::size_t(p.q_heads) * p.head_dim)),
          test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim)),
          test::to_storage<half>(rng.normal(std::size_t(p.kv_heads) * p.head_dim))};
}

/// One decode step of p's sequence (its slot) through `step`: the token's K/V written and appended, the selection
/// (the workspace poisoned first), per kv head.
Rows step_once(Step& step, CtkvrProblem& p, const Token& t) {
  cpu::Array<std::byte> workspace(step.workspace_bytes());
  std::memset(workspace.data(), 0xff, workspace.size());
  std::vector<float> o(std::size_t(p.q_heads) * p.head_dim), lse(std::size_t(p.q_heads));
  ++p.length;
  step.run({.q = QueryView<const half>::packed(t.q.data(), 1, p.q_heads, p.head_dim), .cache = p.cache(),
            .k = HeadsView<const half>::packed(t.k.data(), 1, p.kv_heads, p.head_dim),
            .v = HeadsView<const half>::packed(t.v.data(), 1, p.kv_heads, p.head_dim), .slots = &p.slot},
           StateView<float>::packed(o.data(), lse.data(), 1, p.q_heads, p.head_dim), workspace.bytes(), {});
  const SelectionView sel = step.selection(workspace.bytes(), 1);
  Rows rows;
  for (std::int32_t g = 0; g < p.kv_heads; ++g) rows.emplace_back(sel.row(0, g), sel.row(0, g) + sel.count(0, g));
  return rows;
}

class CpuCsattentionBases : public test::SeededTest {};

TEST_F(CpuCsattentionBases, SharersReadOneBaseAndInsertIntoTheirOwnOverlays) {
  SCOPED_TRACE(seed);
  for (const auto tables : {CsattentionTables::per_kv_head, CsattentionTables::per_query_head}) {
    SCOPED_TRACE(int(tables));
    CtkvrProblem a(rng, 4, 2, 120, 16);
    CtkvrProblem b = in_slot(a, 2);  // the same prompt in slot 2; its decode tokens are its own
    CtkvrProblem alone_a = a, alone_b = in_slot(a, 0);
    Step shared(Selector(limits(a, 3), config(tables)), a.config(), {});
    Step ref_a(Selector(a.limits(), config(tables)), a.config(), {});
    Step ref_b(Selector(a.limits(), config(tables)), a.config(), {});
    shared.prepare(a.prefill(), {});
    const std::vector<std::int32_t> sharers{2};
    shared.selector().share(0, sharers, {});
    ref_a.prepare(alone_a.prefill(), {});
    ref_b.prepare(alone_b.prefill(), {});
    const auto t = shared.selector().index_tables();
    EXPECT_EQ(t.slot_base[2], t.slot_base[0]);
    const BaseContents base = base_of(shared.selector(), 0);
    expect_same_index(shared.selector(), 2, ref_b.selector(), 0, "after share");
    for (std::int32_t s = 0; s < 10; ++s) {
      const Token ta = random_token(rng, a), tb = random_token(rng, b);
      EXPECT_EQ(step_once(shared, a, ta), step_once(ref_a, alone_a, ta)) << "step " << s << ": slot 0";
      EXPECT_EQ(step_once(shared, b, tb), step_once(ref_b, alone_b, tb)) << "step " << s << ": slot 2";
      expect_same_index(shared.selector(), 0, ref_a.selector(), 0, fmt::format("step {}: slot 0", s));
      expect_same_index(shared.selector(), 2, ref_b.selector(), 0, fmt::format("step {}: slot 2", s));
    }
    EXPECT_TRUE(base_of(shared.selector(), 0) == base) << "an insert changed the shared base";
    EXPECT_FALSE(overlay_of(shared.selector(), 0) == overlay_of(shared.selector(), 2)) << "the overlays are one";
    // Slot 0 joins slot 2's base again (the same prompt): its overlay emptied, then the tokens its cache holds
    // after the prompt appended one call each, as the class comment says. It then reads what the sequence
    // prepared alone, which inserted those tokens as it decoded them, reads.
    shared.selector().share(2, std::vector<std::int32_t>{0}, {});
    const OverlayContents emptied = overlay_of(shared.selector(), 0);
    EXPECT_TRUE(std::all_of(emptied.sizes.begin(), emptied.sizes.end(), [](std::int32_t n) { return n == 0; }) &&
                std::all_of(emptied.evicted.begin(), emptied.evicted.end(), [](std::int32_t n) { return n == 0; }));
    for (std::int32_t length = a.prompt + 1; length <= a.length; ++length) {
      shared.selector().append({.cache = a.cache(), .slots = &a.slot, .lengths = &length}, {}, {});
    }
    expect_same_index(shared.selector(), 0, ref_a.selector(), 0, "slot 0 after re-sharing and appending its tokens");
    const Token ta = random_token(rng, a);
    EXPECT_EQ(step_once(shared, a, ta), step_once(ref_a, alone_a, ta)) << "the step after re-sharing";
  }
}

TEST_F(CpuCsattentionBases, ReprepareAndReleaseNeverTouchAnotherSlotsBase) {
  SCOPED_TRACE(seed);
  CtkvrProblem a(rng, 4, 2, 120, 16), c(rng, 4, 2, 110, 16), d(rng, 4, 2, 100, 16);
  CtkvrProblem b = in_slot(a, 1), alone_b = a;
  Step shared(Selector(limits(a, 2), config()), a.config(), {});
  Step ref_b(Selector(a.limits(), config()), a.config(), {});
  Step ref_c(Selector(c.limits(), config()), c.config(), {});
  shared.prepare(a.prefill(), {});
  shared.selector().share(0, std::vector<std::int32_t>{1}, {});
  ref_b.prepare(alone_b.prefill(), {});
  ref_c.prepare(c.prefill(), {});
  const auto t = shared.selector().index_tables();
  const std::int32_t first = t.slot_base[0];
  for (std::int32_t s = 0; s < 3; ++s) {  // the sharer inserts keys before the source leaves
    const Token tb = random_token(rng, b);
    EXPECT_EQ(step_once(shared, b, tb), step_once(ref_b, alone_b, tb)) << "step " << s;
  }
  // The source slot takes a new prompt while slot 1 reads its old base: built in the other storage.
  shared.prepare(c.prefill(), {});
  EXPECT_EQ(t.slot_base[1], first);
  EXPECT_NE(t.slot_base[0], first);
  expect_same_index(shared.selector(), 1, ref_b.selector(), 0, "after slot 0's re-prepare");
  expect_same_index(shared.selector(), 0, ref_c.selector(), 0, "slot 0's new base");
  for (std::int32_t s = 0; s < 3; ++s) {
    const Token tb = random_token(rng, b);
    EXPECT_EQ(step_once(shared, b, tb), step_once(ref_b, alone_b, tb)) << "step " << s << " after the re-prepare";
  }
  // Release: slot 1's base becomes free and its next prepare may reuse that storage; slot 0 keeps its own.
  shared.release(std::vector<std::int32_t>{1});
  test::expect_error([&] { shared.selector().share(1, std::vector<std::int32_t>{0}, {}); },
                     "Csattention::share: source_slot (= 1) has no base");
  shared.prepare(in_slot(d, 1).prefill(), {});
  EXPECT_EQ(t.slot_base[1], first) << "the freed storage is the free one";
  expect_same_index(shared.selector(), 0, ref_c.selector(), 0, "slot 0 after slot 1's release and prepare");
  // Both share slot 1's base, then leave; releasing a slot without a sequence again is refused and changes nothing.
  shared.selector().share(1, std::vector<std::int32_t>{0}, {});
  EXPECT_EQ(t.slot_base[0], t.slot_base[1]);
  shared.release(std::vector<std::int32_t>{0, 1});
  test::expect_error([&] { shared.release(std::vector<std::int32_t>{1}); },
                     "Csattention::release: slots[0] (= 1) holds no sequence: it was released");
  // Every storage is free again: two new prompts get one each.
  CtkvrProblem e = in_slot(c, 1);
  shared.prepare(a.prefill(), {});
  shared.prepare(e.prefill(), {});
  EXPECT_NE(t.slot_base[0], t.slot_base[1]);
  expect_same_index(shared.selector(), 1, ref_c.selector(), 0, "slot 1 prepared from c's prompt");
}

TEST_F(CpuCsattentionBases, BadSlotsAreRefusedAndChangeNothing) {
  SCOPED_TRACE(seed);
  CtkvrProblem a(rng, 4, 2, 120, 16);
  Selector s(limits(a, 3), config());
  s.prepare(a.prefill(), {});
  const std::string file = saved(s, 0);
  const auto state = raw_state(s);
  using V = std::vector<std::int32_t>;
  expect_error([&] { s.share(3, V{1}, {}); },
               "Csattention::share: source_slot (= 3) is outside [0, limits.max_slots = 3)");
  expect_error([&] { s.share(2, V{1}, {}); }, "Csattention::share: source_slot (= 2) has no base");
  expect_error([&] { s.share(0, V{1, 1}, {}); }, "Csattention::share: slots lists slot 1 twice");
  expect_error([&] { s.share(0, V{1, -1}, {}); },
               "Csattention::share: slots[1] (= -1) is outside [0, limits.max_slots = 3)");
  expect_error([&] { s.release(V{5}); }, "Csattention::release: slots[0] (= 5) is outside [0, limits.max_slots = 3)");
  expect_error([&] { s.release(V{0, 0}); }, "Csattention::release: slots lists slot 0 twice");
  expect_error([&] { saved(s, 1); }, "Csattention::save_base: slot (= 1) has no base");
  expect_error([&] { saved(s, 3); }, "Csattention::save_base: slot (= 3) is outside [0, limits.max_slots = 3)");
  expect_error([&] { load(s, file, {}); }, "Csattention::load_base: slots is empty");
  expect_error([&] { load(s, file, {2, 2}); }, "Csattention::load_base: slots lists slot 2 twice");
  expect_error([&] { load(s, file, {3}); }, "Csattention::load_base: slots[0] (= 3) is outside");
  // A prepare that lists a slot twice (two rows holding one prompt).
  std::vector<half> k2(a.k), v2(a.v), q2(a.prefill_q);
  k2.insert(k2.end(), a.k.begin(), a.k.end());
  v2.insert(v2.end(), a.v.begin(), a.v.end());
  q2.insert(q2.end(), a.prefill_q.begin(), a.prefill_q.end());
  const std::vector<std::int32_t> lengths{a.length, a.length}, twice{1, 1};
  const PrefillInputs<half> rows{
      .cache =
          ContiguousKVView<half>::packed(k2.data(), v2.data(), 2, a.kv_heads, a.capacity, a.head_dim, lengths.data()),
      .slots = twice.data(),
      .queries = SequenceView<const half>::packed(q2.data(), 2, a.q_heads, a.queries, a.head_dim)};
  expect_error([&] { s.prepare(rows, {}); }, "Csattention::prepare: in.slots lists slot 1 twice");
  EXPECT_EQ(raw_state(s), state) << "a refused call changed the selector";
  EXPECT_EQ(saved(s, 0), file);
}

class CpuCsattentionFiles : public test::SeededTest, public ::testing::WithParamInterface<CsattentionTables> {};
INSTANTIATE_TEST_SUITE_P(Tables, CpuCsattentionFiles,
                         ::testing::Values(CsattentionTables::per_kv_head, CsattentionTables::per_query_head));

TEST_P(CpuCsattentionFiles, ASavedBaseLoadsIntoAnotherSelectorAndDecodesTheSame) {
  SCOPED_TRACE(seed);
  CtkvrProblem a(rng, 4, 2, 120, 16), x(rng, 4, 2, 100, 16);
  Step original(Selector(limits(a, 2), config(GetParam())), a.config(), {});
  original.prepare(in_slot(x, 1).prefill(), {});  // storage 0: slot 0's base is storage 1
  original.prepare(a.prefill(), {});
  EXPECT_EQ(original.selector().index_tables().slot_base[0], 1);
  const std::string file = saved(original.selector(), 0);
  const std::string path = testing::TempDir() + "kvsift_csattention_base.kvcsbase";
  original.selector().save_base(0, path, {});
  {
    std::ifstream in(path, std::ios::binary);
    const std::string from_path((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(from_path, file) << "the path and the stream hold different bytes";
  }
  // Another selector: slot 0 prepared from another prompt, the file loaded into slot 1 (storage 1).
  CtkvrProblem b = in_slot(a, 1);
  Step loaded(Selector(limits(a, 2), config(GetParam())), a.config(), {});
  loaded.prepare(x.prefill(), {});
  load(loaded.selector(), file, {1});
  EXPECT_EQ(loaded.selector().index_tables().slot_base[1], 1);
  expect_same_index(loaded.selector(), 1, original.selector(), 0, "after load");
  EXPECT_EQ(saved(loaded.selector(), 1), file) << "a loaded base saves to other bytes";
  for (std::int32_t s = 0; s < 10; ++s) {
    const Token token = random_token(rng, a);
    EXPECT_EQ(step_once(loaded, b, token), step_once(original, a, token)) << "step " << s;
    expect_same_index(loaded.selector(), 1, original.selector(), 0, fmt::format("step {}", s));
  }
  EXPECT_EQ(saved(loaded.selector(), 1), file) << "inserts changed the loaded base";
  // From the path, into two slots of a fresh selector at once: both read one storage.
  Selector both(limits(a, 2), config(GetParam()));
  both.load_base(path, std::vector<std::int32_t>{1, 0}, {});
  EXPECT_EQ(both.index_tables().slot_base[0], both.index_tables().slot_base[1]);
  EXPECT_TRUE(base_of(both, 0) == base_of(loaded.selector(), 1));
  EXPECT_EQ(saved(both, 0), file);
  std::filesystem::remove(path);
}

/// A copy of `file` with the value at `offset` set to `value` and the checksum made valid again: a file written
/// wrong rather than damaged.
template <class V>
std::string rewritten(std::string file, std::size_t offset, V value) {
  std::memcpy(file.data() + offset, &value, sizeof(V));
  const std::uint32_t crc = crc32({reinterpret_cast<const std::byte*>(file.data()), file.size() - 4});
  std::memcpy(file.data() + file.size() - 4, &crc, 4);
  return file;
}

TEST_P(CpuCsattentionFiles, RefusedFilesNameWhatDiffersAndChangeNothing) {
  SCOPED_TRACE(seed);
  const CsattentionTables tables = GetParam();
  const CsattentionTables other = tables == CsattentionTables::per_kv_head ? CsattentionTables::per_query_head
                                                                            : CsattentionTables::per_kv_head;
  CtkvrProblem a(rng, 4, 2, 120, 16), c(rng, 4, 2, 110, 16);
  Selector source(limits(a, 2), config(tables));
  source.prepare(a.prefill(), {});
  const std::string file = saved(source, 0);
  Selector target(limits(a, 2), config(tables));
  target.prepare(c.prefill(), {});
  const auto state = raw_state(target);
  const std::string target_file = saved(target, 0);
  const auto refused = [&](const std::string& bad, const std::string& message) {
    expect_error([&] { load(target, bad, {0, 1}); }, {"kvsift::Csattention::load_base: stream: " + message});
    ASSERT_EQ(raw_state(target), state) << "a refused load changed the selector: " << message;
  };
  // The layout: 88 bytes of framing and fields, the centroids, ids and scores of L = 30 per list, counts, CRC.
  const std::size_t heads = tables == CsattentionTables::per_kv_head ? 2 : 4, lists = heads * 8 * 6;
  const std::size_t centroids = 88, ids = centroids + lists * 4 * 4, scores = ids + lists * 30 * 4,
                    counts = scores + lists * 30 * 2;
  ASSERT_EQ(file.size(), counts + lists * 4 + 4);

  std::vector<std::size_t> cuts{0, 5, 8, 11, 12, 40, 79, 80, ids + 3, scores, counts + 1, file.size() - 1};
  for (std::size_t cut = 0; cut < file.size(); cut += 331) cuts.push_back(cut);
  for (const std::size_t cut : cuts) {
    refused(file.substr(0, cut), fmt::format("truncated: the file ends at byte {}, inside ", cut));
  }
  for (const std::size_t at : {centroids, ids + 1, scores + 7, counts + 2, file.size() - 1}) {
    std::string bad = file;
    bad[at] = static_cast<char>(bad[at] ^ 0x10);
    refused(bad, "corrupted: the stored checksum is 0x");
  }
  std::string bad = file;
  bad[2] = 'X';
  refused(bad, "not a CSAttention base file: it starts with 'KVXSBASE', not the magic 'KVCSBASE'");
  bad = file;
  bad[8] = 2;
  refused(bad, "CSAttention base file format version 2 is not supported: this build reads version 1");

  // Other shapes and configurations, as selectors built for them save them.
  const auto file_of = [&](CtkvrProblem p, const CsattentionConfig& with) {
    Selector s(limits(p, 1), with);
    s.prepare(p.prefill(), {});
    return saved(s, 0);
  };
  const auto with = [&](auto change) {
    CsattentionConfig changed = config(tables);
    change(changed);
    return file_of(a, changed);
  };
  refused(file_of(CtkvrProblem(rng, 8, 4, 120, 16), config(tables)), "kv_heads differs: the file has 4, expected 2");
  refused(file_of(CtkvrProblem(rng, 8, 2, 120, 16), config(tables)), "q_heads differs: the file has 8, expected 4");
  refused(file_of(CtkvrProblem(rng, 4, 2, 120, 16, 64), config(tables)),
          "head_dim differs: the file has 64, expected 32");
  refused(with([](CsattentionConfig& x) { x.subspaces = 4; }), "config.subspaces differs: the file has 4, expected 8");
  refused(with([](CsattentionConfig& x) { x.split = SubspaceSplit::rope_pairs; }),
          "config.split (0 contiguous, 1 rope_pairs) differs: the file has 1, expected 0");
  refused(with([&](CsattentionConfig& x) { x.tables = other; }),
          fmt::format("config.tables (0 per_query_head, 1 per_kv_head) differs: the file has {}, expected {}",
                      int(other), int(tables)));
  refused(with([](CsattentionConfig& x) { x.centroids = 5; }), "config.centroids differs: the file has 5, expected 6");
  refused(with([](CsattentionConfig& x) { x.list_fraction = 0.2; }),
          "config.list_fraction differs: the file has 0.2, expected 0.25");
  refused(with([](CsattentionConfig& x) { x.max_list_length = 20; }),
          "config.max_list_length differs: the file has 20, expected 32768");
  refused(with([](CsattentionConfig& x) { x.seed = 7; }), "config.seed differs: the file has 7, expected 0");
  refused(with([](CsattentionConfig& x) { x.kmeans_iterations = 3; }),
          "config.kmeans_iterations differs: the file has 3, expected 10");
  refused(with([](CsattentionConfig& x) { x.max_points_per_centroid = 64; }),
          "config.max_points_per_centroid differs: the file has 64, expected 256");
  refused(with([](CsattentionConfig& x) { x.kmeans_batch = 16; }),
          "config.kmeans_batch differs: the file has 16, expected 0");
  // A prompt of 200 tokens (L = 50) from a selector for longer sequences: above this one's L_max = 0.25 * 136.
  refused(file_of(CtkvrProblem(rng, 4, 2, 200, 16), config(tables)),
          "the list length (L = 50) is outside [1, this selector's L_max = 34]");
  // Files written wrong, with a valid checksum.
  refused(rewritten(file, 80, 137), "the prompt length (N = 137) is outside [1, limits.max_tokens = 136]");
  refused(rewritten(file, 84, 29), "the list length L of the prompt length N differs: the file has 29, expected 30");
  refused(rewritten(file, counts + 4, 31), "list 1 has count 31, outside [0, L = 30]");
  refused(rewritten(file, ids + 30 * 4 + 8, 120), "list 1 entry 2 has id 120, outside [0, N = 120)");

  // From a path: bytes after the checksum, a missing file.
  const std::string path = testing::TempDir() + "kvsift_csattention_bad_base.kvcsbase";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << file << 'x';
  }
  expect_error([&] { target.load_base(path, std::vector<std::int32_t>{0}, {}); },
               "kvsift::Csattention::load_base: " + path + ": bytes follow the checksum");
  std::filesystem::remove(path);
  expect_error([&] { target.load_base(path, std::vector<std::int32_t>{0}, {}); },
               "kvsift::Csattention::load_base: cannot open '" + path + "'");
  EXPECT_EQ(raw_state(target), state);
  EXPECT_EQ(saved(target, 0), target_file);
  // The good file still loads.
  load(target, file, {1});
  EXPECT_TRUE(base_of(target, 1) == base_of(source, 0));
  EXPECT_EQ(saved(target, 0), target_file);
}

TEST_P(CpuCsattentionFiles, NonFiniteCentroidsOrScoresWithAValidChecksumAreRefused) {
  SCOPED_TRACE(seed);
  CtkvrProblem a(rng, 4, 2, 120, 16);
  Selector source(limits(a, 2), config(GetParam()));
  source.prepare(a.prefill(), {});
  const std::string file = saved(source, 0);
  Selector target(limits(a, 2), config(GetParam()));
  target.prepare(a.prefill(), {});
  const auto state = raw_state(target);
  // The layout of RefusedFilesNameWhatDiffersAndChangeNothing: fields, centroids (4 floats per list), ids and
  // scores of L = 30 per list.
  const std::size_t lists = (GetParam() == CsattentionTables::per_kv_head ? 2 : 4) * 8 * 6;
  const std::size_t centroids = 88, scores = centroids + lists * 4 * 4 + lists * 30 * 4;
  const std::string prefix = "kvsift::Csattention::load_base: stream: ";
  expect_error([&] { load(target, rewritten(file, centroids + 9 * 4, std::numeric_limits<float>::quiet_NaN()), {0}); },
               {prefix + "the centroids holds a non-finite value (nan) at element 9 (byte 124)",
                "a floating-point value of an index file must be finite"});
  const std::size_t at = scores + (5 * 30 + 2) * 2;  // list 5, entry 2 (within its count: lists are full)
  expect_error([&] { load(target, rewritten(file, at, half{0x7c00}), {0}); },
               prefix + fmt::format("the scores of list 5 holds a non-finite value (inf) at element 2 (byte {})", at));
  EXPECT_EQ(raw_state(target), state) << "a refused load changed the selector";
  // A directory given as the path.
  expect_error([&] { target.load_base(testing::TempDir(), std::vector<std::int32_t>{0}, {}); },
               "kvsift::Csattention::load_base: '" + testing::TempDir() + "' is a directory, not a file");
}

}  // namespace
}  // namespace kvsift
