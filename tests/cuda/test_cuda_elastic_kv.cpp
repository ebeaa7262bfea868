// ElasticKV (selectors/specontext/elastic_kv.hpp), SpeContext's elastic loading, against references written from its contract:
// after every update of a run of random overlapping selections (the first step with nothing resident, a sequence
// shorter than the budget listing all its tokens, sequences leaving and joining slots), each offloaded layer's
// resident rows read on the main stream after wait() through the slot-space selection equal the CPU gather of its
// pinned host cache by the token-space selection, bit for bit; each row's copied rows equal |new \ resident| and the
// slots follow the contract's rule (tests/gather_problem.hpp's std::map reference, per sequence slot); the step's
// token written through write_current is attended from its slot; a captured update + waits replays as the eager
// run; a row listing a token past the host length is bad, nothing of it kept; the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <set>
#include <vector>

#include "cuda/gpu_test.hpp"
#include "gather_problem.hpp"
#include "kvsift/cpu/gather.hpp"
#include "kvsift/cuda/decode.hpp"
#include "kvsift/cuda/gather.hpp"
#include "kvsift/selectors/specontext/elastic_kv.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;
using test::PinnedBuffer;
using test::Random;
using test::same_bytes;

class CudaElasticKV : public test::GpuTest {};

/// A main and a side stream, destroyed at the end. Non-blocking, as an engine's: nothing orders the side stream's
/// copies before the main stream's reads but ElasticKV's events. So between an update and the reads of its rows the
/// tests make no call on the legacy stream and no device-wide sync (either would order them too): buffers are
/// allocated and uploaded before the update, followed by cudaDeviceSynchronize, and poisoned on the main stream.
struct Streams {
  cudaStream_t main = nullptr, side = nullptr;
  Streams() {
    KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&main, cudaStreamNonBlocking));
    KVSIFT_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  }
  ~Streams() {
    cudaStreamDestroy(main);
    cudaStreamDestroy(side);
  }
};

/// The offloaded layers' host caches: per layer a pool [max_slots, kv_heads, max_len, head_dim] in pinned memory,
/// one sequence per slot, read through a paged view of one page per sequence whose page table is the step's slots
/// (so batches may change composition), or through a contiguous view of the first `batch` slots.
template <class T>
struct HostPool {
  std::int32_t layers, max_slots, kv_heads, max_len, head_dim;
  std::vector<std::vector<float>> k_f, v_f;  // per layer, the pool's values
  std::vector<std::unique_ptr<PinnedBuffer<T>>> k, v;
  std::vector<std::int32_t> lens;  // per slot
  std::unique_ptr<PinnedBuffer<std::int32_t>> indptr, page_slots, page_lens, contiguous_lens;

  HostPool(Random& rng, std::int32_t layers_, std::int32_t max_slots_, std::int32_t kv_heads_, std::int32_t max_len_,
           std::int32_t head_dim_)
      : layers(layers_),
        max_slots(max_slots_),
        kv_heads(kv_heads_),
        max_len(max_len_),
        head_dim(head_dim_),
        lens(std::size_t(max_slots_), 0) {
    const std::size_t n = std::size_t(max_slots) * kv_heads * max_len * head_dim;
    for (std::int32_t l = 0; l < layers; ++l) {
      k_f.push_back(rng.normal(n));
      v_f.push_back(rng.normal(n));
      k.push_back(std::make_unique<PinnedBuffer<T>>(test::to_storage<T>(k_f.back())));
      v.push_back(std::make_unique<PinnedBuffer<T>>(test::to_storage<T>(v_f.back())));
    }
    indptr = std::make_unique<PinnedBuffer<std::int32_t>>(std::vector<std::int32_t>(std::size_t(max_slots) + 1));
    for (std::int32_t i = 0; i <= max_slots; ++i) indptr->data()[i] = i;
    page_slots = std::make_unique<PinnedBuffer<std::int32_t>>(std::vector<std::int32_t>(std::size_t(max_slots)));
    page_lens = std::make_unique<PinnedBuffer<std::int32_t>>(std::vector<std::int32_t>(std::size_t(max_slots)));
    contiguous_lens = std::make_unique<PinnedBuffer<std::int32_t>>(std::vector<std::int32_t>(std::size_t(max_slots)));
  }
  /// A new sequence of `len` tokens in `slot`: fresh rows in every layer.
  void join(Random& rng, std::int32_t slot, std::int32_t len) {
    lens[std::size_t(slot)] = len;
    const std::size_t per_slot = std::size_t(kv_heads) * max_len * head_dim;
    for (std::int32_t l = 0; l < layers; ++l) {
      const auto fresh_k = rng.normal(per_slot), fresh_v = rng.normal(per_slot);
      std::copy(fresh_k.begin(), fresh_k.end(), k_f[std::size_t(l)].begin() + std::ptrdiff_t(slot * per_slot));
      std::copy(fresh_v.begin(), fresh_v.end(), v_f[std::size_t(l)].begin() + std::ptrdiff_t(slot * per_slot));
      for (std::size_t i = 0; i < per_slot; ++i) {
        k[std::size_t(l)]->data()[slot * per_slot + i] = from_float<T>(fresh_k[i]);
        v[std::size_t(l)]->data()[slot * per_slot + i] = from_float<T>(fresh_v[i]);
      }
    }
  }
  /// Layer l's cache for a batch whose row b is sequence slots[b] (host memory, pinned).
  KVCache<T> view(std::int32_t l, const std::vector<std::int32_t>& slots, bool paged) {
    const auto batch = std::int32_t(slots.size());
    if (!paged) {  // rows are the pool's first slots
      for (std::int32_t b = 0; b < batch; ++b) contiguous_lens->data()[b] = lens[std::size_t(b)];
      return ContiguousKVView<T>::packed(k[std::size_t(l)]->data(), v[std::size_t(l)]->data(), batch, kv_heads, max_len,
                                         head_dim, contiguous_lens->data());
    }
    for (std::int32_t b = 0; b < batch; ++b) {
      page_slots->data()[b] = slots[std::size_t(b)];
      page_lens->data()[b] = lens[std::size_t(slots[std::size_t(b)])];
    }
    const std::int64_t row = std::int64_t(max_len) * head_dim;
    return PagedKVView<T>{.k_pages = k[std::size_t(l)]->data(),
                          .v_pages = v[std::size_t(l)]->data(),
                          .page_indptr = indptr->data(),
                          .page_indices = page_slots->data(),
                          .last_page_len = page_lens->data(),
                          .batch = batch,
                          .kv_heads = kv_heads,
                          .head_dim = head_dim,
                          .page_size = max_len,
                          .num_pages = max_slots,
                          .page_stride = row * kv_heads,
                          .token_stride = head_dim,
                          .head_stride = row};
  }
};

/// The token-space selection of a step: random overlapping rows (gather_problem.hpp), a sequence no longer than
/// the budget listing all its tokens.
void next_step_selection(Random& rng, const test::HostSelection& previous, test::HostSelection& current,
                         const std::vector<std::int32_t>& lens) {
  test::next_selection(rng, previous, current, lens);
  const std::int32_t cap = current.view.capacity, kv_heads = current.view.kv_heads;
  for (std::int32_t r = 0; r < current.view.batch * kv_heads; ++r) {
    const std::int32_t len = lens[std::size_t(r / kv_heads)];
    if (len > cap) continue;
    for (std::int32_t i = 0; i < len; ++i) current.indices[std::size_t(r) * cap + i] = i;
    current.counts[std::size_t(r)] = len;
  }
}

/// Per (sequence slot, kv head) the contract's slots (test::ResidentSlots on one row).
struct SlotReference {
  std::int32_t kv_heads, capacity;
  std::vector<test::ResidentSlots> rows;
  SlotReference(std::int32_t max_slots, std::int32_t kv_heads_, std::int32_t capacity_)
      : kv_heads(kv_heads_),
        capacity(capacity_),
        rows(std::size_t(max_slots) * kv_heads_, test::ResidentSlots(1, capacity_)) {}
  void release(std::int32_t slot) {
    for (std::int32_t h = 0; h < kv_heads; ++h)
      rows[std::size_t(slot * kv_heads + h)] = test::ResidentSlots(1, capacity);
  }
  /// Expected slot-space indices (entries past a count kPoisonIndex) and copied counts of a step.
  test::ResidentSlots::Step step(const test::HostSelection& current, const std::vector<std::int32_t>& slots) {
    test::ResidentSlots::Step out{std::vector<std::int32_t>(current.indices.size(), test::kPoisonIndex),
                                  std::vector<std::int32_t>(current.counts.size(), 0)};
    for (std::size_t b = 0; b < slots.size(); ++b) {
      for (std::int32_t h = 0; h < kv_heads; ++h) {
        const std::size_t r = b * std::size_t(kv_heads) + std::size_t(h);
        test::HostSelection one(1, 1, capacity, false);
        std::copy_n(current.indices.begin() + std::ptrdiff_t(r * capacity), capacity, one.indices.begin());
        one.counts[0] = current.counts[r];
        const auto s = rows[std::size_t(slots[b]) * kv_heads + std::size_t(h)].step(one);
        std::copy(s.slots.begin(), s.slots.end(), out.slots.begin() + std::ptrdiff_t(r * capacity));
        out.copied[r] = s.copied[0];
      }
    }
    return out;
  }
};

/// Device copies of a host selection and the step's slots.
struct DeviceSelection {
  DeviceBuffer<std::int32_t> indices, counts, slots;
  SelectionView view;
  DeviceSelection(const test::HostSelection& s, const std::vector<std::int32_t>& slots_)
      : indices(s.indices), counts(s.counts), slots(slots_) {
    view = s.view;
    view.indices = indices.data();
    view.counts = counts.data();
  }
};

/// Poisons a device buffer on `stream` (DeviceBuffer::poison runs on the legacy stream).
template <class T>
void poison_on(DeviceBuffer<T>& buffer, cudaStream_t stream) {
  KVSIFT_CUDA_CHECK(cudaMemsetAsync(buffer.data(), 0xff, buffer.size() * sizeof(T), stream));
}

/// Reads layer l's resident rows through the slot-space selection on `main` after wait(), as an attention would:
/// cuda::gather_kv into k and v ([batch, kv_heads, capacity, head_dim], allocated before the update), poisoned on
/// `main` first; returns them.
template <class T>
std::pair<std::vector<T>, std::vector<T>> read_resident(const ElasticKV<T>& elastic, std::int32_t layer,
                                                        std::int32_t batch, DeviceBuffer<T>& k, DeviceBuffer<T>& v,
                                                        cudaStream_t main) {
  const auto& c = elastic.config();
  poison_on(k, main);
  poison_on(v, main);
  elastic.wait(layer, main);
  cuda::gather_kv(
      KVCache<const T>(elastic.resident(layer)), elastic.selection(),
      KVCache<T>(ContiguousKVView<T>::packed(k.data(), v.data(), batch, c.kv_heads, c.capacity, c.head_dim)), main);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(main));
  return {k.download(), v.download()};
}

/// The CPU gather of layer l's host cache by the token-space selection, into a buffer poisoned as read_resident's.
template <class T>
std::pair<std::vector<T>, std::vector<T>> expected_rows(const KVCache<T>& host, const test::HostSelection& sel,
                                                        std::int32_t capacity, std::int32_t head_dim) {
  std::vector<T> k(std::size_t(sel.view.batch) * sel.view.kv_heads * capacity * head_dim), v(k.size());
  std::memset(k.data(), 0xff, k.size() * sizeof(T));
  std::memset(v.data(), 0xff, v.size() * sizeof(T));
  cpu::gather_kv(KVCache<const T>(host), sel.view,
                 KVCache<T>(ContiguousKVView<T>::packed(k.data(), v.data(), sel.view.batch, sel.view.kv_heads, capacity,
                                                        head_dim)));
  return {std::move(k), std::move(v)};
}

/// Steps of updates; at `join_step` slot schedule changes (a sequence leaves, two join).
template <class T>
void check_steps(Random& rng, std::int32_t head_dim, bool paged) {
  SCOPED_TRACE(testing::Message() << "head_dim " << head_dim << (paged ? " paged" : " contiguous") << " host caches");
  const ElasticKVConfig config{
      .layers = 3, .max_slots = 5, .max_batch = 3, .kv_heads = 2, .head_dim = head_dim, .capacity = 64};
  Streams streams;
  HostPool<T> pool(rng, config.layers, config.max_slots, config.kv_heads, 400, head_dim);
  ElasticKV<T> elastic(config);
  SlotReference reference(config.max_slots, config.kv_heads, config.capacity);
  // Contiguous views map batch row b to pool row b, so the slots are then any distinct values per row, fixed.
  std::vector<std::int32_t> slots = paged ? std::vector<std::int32_t>{4, 1} : std::vector<std::int32_t>{4, 0, 2};
  const std::vector<std::int32_t> initial_lens = {300, 40, 399, 64, 250};  // 40 and 64: everything selected
  for (std::int32_t s = 0; s < config.max_slots; ++s) pool.join(rng, s, initial_lens[std::size_t(s)]);
  test::HostSelection previous(std::int32_t(slots.size()), config.kv_heads, config.capacity, false);
  std::fill(previous.counts.begin(), previous.counts.end(), 0);
  std::int64_t total = 0;
  for (int step = 0; step < 7; ++step) {
    SCOPED_TRACE(testing::Message() << "step " << step);
    std::set<std::int32_t> empty_slots;  // nothing resident: every token is copied
    if (step == 0) empty_slots.insert(slots.begin(), slots.end());
    if (paged && step == 4) {  // slot 4's sequence leaves, a new one joins it, another joins slot 0; slot 1 stays
      elastic.release(std::vector<std::int32_t>{4}, streams.main);
      reference.release(4);
      pool.join(rng, 4, 120);
      pool.join(rng, 0, 33);
      test::HostSelection moved(3, config.kv_heads, config.capacity, false);
      std::fill(moved.counts.begin(), moved.counts.end(), 0);
      for (std::int32_t h = 0; h < config.kv_heads; ++h) {  // slot 1: batch row 1 before, row 0 now
        const std::size_t from = std::size_t(config.kv_heads + h), to = std::size_t(h);
        moved.counts[to] = previous.counts[from];
        std::copy_n(previous.indices.begin() + std::ptrdiff_t(from * config.capacity), config.capacity,
                    moved.indices.begin() + std::ptrdiff_t(to * config.capacity));
      }
      previous = moved;
      previous.view.indices = previous.indices.data();
      previous.view.counts = previous.counts.data();
      slots = {1, 4, 0};
      empty_slots = {4, 0};
    }
    const auto batch = std::int32_t(slots.size());
    std::vector<std::int32_t> lens(slots.size());
    for (std::size_t b = 0; b < slots.size(); ++b) lens[b] = pool.lens[std::size_t(paged ? slots[b] : std::int32_t(b))];
    test::HostSelection current(batch, config.kv_heads, config.capacity, false);
    next_step_selection(rng, previous, current, lens);
    const DeviceSelection d(current, slots);
    std::vector<DeviceBuffer<T>> read_k, read_v;
    for (std::int32_t l = 0; l < config.layers; ++l) {
      read_k.emplace_back(std::size_t(batch) * config.kv_heads * config.capacity * head_dim);
      read_v.emplace_back(read_k.back().size());
    }
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<KVCache<const T>> hosts;
    for (std::int32_t l = 0; l < config.layers; ++l) hosts.push_back(KVCache<const T>(pool.view(l, slots, paged)));
    elastic.update({.selection = d.view, .slots = d.slots.data(), .host_caches = hosts}, streams.main, streams.side);

    const auto expected = reference.step(current, slots);
    for (std::int32_t l = 0; l < config.layers; ++l) {
      const auto [k, v] = read_resident(elastic, l, batch, read_k[std::size_t(l)], read_v[std::size_t(l)],
                                        streams.main);
      const auto [ek, ev] = expected_rows(pool.view(l, slots, paged), current, config.capacity, head_dim);
      ASSERT_TRUE(same_bytes(k, ek)) << "resident K of layer " << l;
      ASSERT_TRUE(same_bytes(v, ev)) << "resident V of layer " << l;
    }
    DeviceBuffer<std::int32_t> copied(expected.copied.size());
    KVSIFT_CUDA_CHECK(
        cudaMemcpy(copied.data(), elastic.copied(), copied.size() * sizeof(std::int32_t), cudaMemcpyDeviceToDevice));
    ASSERT_EQ(copied.download(), expected.copied);
    for (std::size_t r = 0; r < expected.copied.size(); ++r) {
      if (empty_slots.count(slots[r / std::size_t(config.kv_heads)])) {
        EXPECT_EQ(expected.copied[r], current.counts[r]) << "nothing resident: every token copied, row " << r;
      }
    }
    const SelectionView slot_space = elastic.selection();
    DeviceBuffer<std::int32_t> slot_indices(current.indices.size()), slot_counts(current.counts.size());
    KVSIFT_CUDA_CHECK(cudaMemcpy(slot_indices.data(), slot_space.indices, slot_indices.size() * sizeof(std::int32_t),
                                 cudaMemcpyDeviceToDevice));
    KVSIFT_CUDA_CHECK(cudaMemcpy(slot_counts.data(), slot_space.counts, slot_counts.size() * sizeof(std::int32_t),
                                 cudaMemcpyDeviceToDevice));
    ASSERT_EQ(slot_counts.download(), current.counts);
    auto got_slots = slot_indices.download();
    for (std::size_t r = 0; r < current.counts.size(); ++r) {
      std::fill(got_slots.begin() + std::ptrdiff_t(r * config.capacity + std::size_t(current.counts[r])),
                got_slots.begin() + std::ptrdiff_t((r + 1) * config.capacity), test::kPoisonIndex);
    }
    ASSERT_EQ(got_slots, expected.slots);
    const ElasticStats stats = elastic.last_step_stats(streams.main);
    std::int64_t rows = 0;
    for (const std::int32_t c : expected.copied) rows += c;
    total += rows;
    EXPECT_EQ(stats.rows_per_layer, rows);
    EXPECT_EQ(stats.rows, rows * config.layers);
    EXPECT_EQ(stats.bytes, rows * config.layers * 2 * head_dim * std::int64_t(sizeof(T)));
    EXPECT_EQ(elastic.moved_rows_total(streams.main), total);
    previous = current;
    previous.view.indices = previous.indices.data();
    previous.view.counts = previous.counts.data();
  }
}

TEST_F(CudaElasticKV, ResidentRowsEqualTheGatherOfHostKV) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  for (bool paged : {false, true}) {
    check_steps<bfloat16>(rng, 128, paged);
    check_steps<half>(rng, 64, paged);
    check_steps<float>(rng, 36, paged);  // 144-byte rows: the element-wise copy
  }
}

/// The step's token: written through to its resident slot (bit for bit) and the host cache, and attended by sparse
/// decode over the resident rows with attention_options(): equal to fp64 attention over the host rows of the
/// selection plus the token, within the rounding of the kernel's P to bf16 for its P V product (2^-8 max |v|). The
/// token's key is half the group's first query, so it holds a large share of that head's weight (missing it would
/// be far outside the tolerance).
TEST_F(CudaElasticKV, StepTokenIsAttendedAndWrittenThrough) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = bfloat16;
  const ElasticKVConfig config{
      .layers = 2, .max_slots = 4, .max_batch = 2, .kv_heads = 2, .head_dim = 64, .capacity = 48};
  const std::int32_t q_heads = 4, group = q_heads / config.kv_heads, d = config.head_dim;
  Streams streams;
  HostPool<T> pool(rng, config.layers, config.max_slots, config.kv_heads, 300, d);
  pool.join(rng, 2, 201);  // the lengths count the step's token (position 200)
  pool.join(rng, 0, 30);
  const std::vector<std::int32_t> slots = {2, 0};
  ElasticKV<T> elastic(config);
  test::HostSelection none(2, config.kv_heads, config.capacity, false),
      current(2, config.kv_heads, config.capacity, false);
  std::fill(none.counts.begin(), none.counts.end(), 0);
  // Tokens before the step's own (lengths less one): its row is not on the host yet.
  next_step_selection(rng, none, current, {200, 29});
  const DeviceSelection sel(current, slots);
  const auto q_f = rng.normal(std::size_t(2) * q_heads * d);
  const auto q = test::to_storage<T>(q_f);
  DeviceBuffer<T> d_q(q);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<KVCache<const T>> hosts;
  for (std::int32_t l = 0; l < config.layers; ++l) hosts.push_back(KVCache<const T>(pool.view(l, slots, true)));
  elastic.update({.selection = sel.view, .slots = sel.slots.data(), .host_caches = hosts}, streams.main, streams.side);

  const QueryView<const T> qv = QueryView<const T>::packed(d_q.data(), 2, q_heads, d);
  for (std::int32_t l = 0; l < config.layers; ++l) {
    SCOPED_TRACE(testing::Message() << "layer " << l);
    std::vector<float> k_new_f = rng.normal(std::size_t(2) * config.kv_heads * d);
    for (std::int32_t b = 0; b < 2; ++b) {
      for (std::int32_t h = 0; h < config.kv_heads; ++h) {
        for (std::int32_t c = 0; c < d; ++c) {
          k_new_f[(std::size_t(b) * config.kv_heads + h) * d + c] =
              0.5f * q_f[(std::size_t(b) * q_heads + h * group) * d + c];
        }
      }
    }
    const auto k_new = test::to_storage<T>(k_new_f);
    const auto v_new = test::to_storage<T>(rng.normal(k_new.size()));
    DeviceBuffer<T> dk(k_new), dv(v_new);
    const KVCache<const T> resident = elastic.resident(l);
    const cuda::DecodeOptions options{.attention = ElasticKV<T>::attention_options({})};
    DeviceBuffer<std::byte> ws(cuda::sparse_decode_workspace_bytes(qv, resident.paged, elastic.selection(), options));
    DeviceBuffer<float> o(std::size_t(2) * q_heads * d), lse(std::size_t(2) * q_heads);
    o.poison();
    lse.poison();
    // The resident slot `capacity` of every row, read back below through a selection of that slot alone.
    const std::vector<std::int32_t> last_slot(std::size_t(2) * config.kv_heads, config.capacity),
        ones(last_slot.size(), 1);
    DeviceBuffer<std::int32_t> d_last(last_slot), d_ones(ones);
    DeviceBuffer<T> slot_k(std::size_t(2) * config.kv_heads * d), slot_v(slot_k.size());
    slot_k.poison();
    slot_v.poison();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads and poisons above ran on the legacy stream
    elastic.write_current(l, pool.view(l, slots, true), HeadsView<const T>::packed(dk.data(), 2, config.kv_heads, d),
                          HeadsView<const T>::packed(dv.data(), 2, config.kv_heads, d), streams.main);
    elastic.wait(l, streams.main);
    cuda::sparse_decode(qv, resident.paged, elastic.selection(),
                        StateView<float>::packed(o.data(), lse.data(), 2, q_heads, d), {ws.data(), ws.size()},
                        streams.main, options);
    cuda::gather_kv(
        KVCache<const T>(resident), SelectionView{d_last.data(), d_ones.data(), nullptr, 2, config.kv_heads, 1},
        KVCache<T>(ContiguousKVView<T>::packed(slot_k.data(), slot_v.data(), 2, config.kv_heads, 1, d)), streams.main);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(streams.main));
    EXPECT_TRUE(same_bytes(slot_k.download(), k_new)) << "the step's K in its resident slot";
    EXPECT_TRUE(same_bytes(slot_v.download(), v_new)) << "the step's V in its resident slot";
    const auto got_o = o.download(), got_lse = lse.download();
    const KVCache<T> host = pool.view(l, slots, true);
    for (std::int32_t b = 0; b < 2; ++b) {
      const std::int32_t len = host.seq_len(b);
      for (std::int32_t h = 0; h < config.kv_heads; ++h) {
        // The write-through: the host row at len - 1 is the step's token.
        for (std::int32_t c = 0; c < d; ++c) {
          const std::size_t at = (std::size_t(b) * config.kv_heads + h) * d + c;
          ASSERT_EQ(to_float(host.k_row(b, h, len - 1)[c]), to_float(k_new[at]));
          ASSERT_EQ(to_float(host.v_row(b, h, len - 1)[c]), to_float(v_new[at]));
        }
        std::vector<std::vector<float>> rows_k, rows_v;
        const std::size_t r = std::size_t(b) * config.kv_heads + std::size_t(h);
        for (std::int32_t i = 0; i <= current.counts[r]; ++i) {
          const std::int32_t token = i < current.counts[r] ? current.indices[r * config.capacity + i] : len - 1;
          std::vector<float> kr(static_cast<std::size_t>(d)), vr(static_cast<std::size_t>(d));
          for (std::int32_t c = 0; c < d; ++c) {
            kr[std::size_t(c)] = to_float(host.k_row(b, h, token)[c]);
            vr[std::size_t(c)] = to_float(host.v_row(b, h, token)[c]);
          }
          rows_k.push_back(std::move(kr));
          rows_v.push_back(std::move(vr));
        }
        std::vector<const float*> ks, vs;
        double max_v = 0;
        for (std::size_t i = 0; i < rows_k.size(); ++i) {
          ks.push_back(rows_k[i].data());
          vs.push_back(rows_v[i].data());
          for (const float x : rows_v[i]) max_v = std::max(max_v, double(std::abs(x)));
        }
        const double tolerance = std::ldexp(max_v, -8);
        for (std::int32_t g = 0; g < group; ++g) {
          const std::int32_t qh = h * group + g;
          std::vector<float> qf(static_cast<std::size_t>(d));
          for (std::int32_t c = 0; c < d; ++c)
            qf[std::size_t(c)] = to_float(q[(std::size_t(b) * q_heads + qh) * d + c]);
          std::vector<double> ref;
          const double ref_lse = test::naive_attention(qf.data(), ks, vs, std::vector<double>(ks.size(), 0.0), d,
                                                       1.0 / std::sqrt(double(d)), ref);
          const std::vector<float> got(got_o.begin() + std::ptrdiff_t((std::size_t(b) * q_heads + qh) * d),
                                       got_o.begin() + std::ptrdiff_t((std::size_t(b) * q_heads + qh + 1) * d));
          EXPECT_LT(test::max_abs_diff(got, ref), tolerance) << "b " << b << " q head " << qh;
          EXPECT_NEAR(got_lse[std::size_t(b) * q_heads + qh], ref_lse, 1e-4) << "b " << b << " q head " << qh;
        }
      }
    }
  }
}

/// update + every layer's wait + the read-backs captured on the main stream (the side stream forks from and joins
/// it) and replayed over three steps' selections equal an eager ElasticKV fed the same steps.
TEST_F(CudaElasticKV, CapturedUpdateEqualsEager) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = half;
  const ElasticKVConfig config{
      .layers = 3, .max_slots = 3, .max_batch = 3, .kv_heads = 2, .head_dim = 64, .capacity = 40};
  Streams streams;
  HostPool<T> pool(rng, config.layers, config.max_slots, config.kv_heads, 200, config.head_dim);
  pool.join(rng, 0, 180);
  pool.join(rng, 1, 25);
  pool.join(rng, 2, 90);
  const std::vector<std::int32_t> slots = {2, 0, 1};
  std::vector<KVCache<const T>> hosts;
  for (std::int32_t l = 0; l < config.layers; ++l) hosts.push_back(KVCache<const T>(pool.view(l, slots, true)));
  ElasticKV<T> eager(config), captured(config);
  test::HostSelection previous(3, config.kv_heads, config.capacity, false),
      current(3, config.kv_heads, config.capacity, false);
  std::fill(previous.counts.begin(), previous.counts.end(), 0);
  DeviceSelection d(previous, slots);
  const std::size_t out_elems = std::size_t(3) * config.kv_heads * config.capacity * config.head_dim;
  DeviceBuffer<T> out_k(out_elems * config.layers), out_v(out_k.size());
  const auto read_all = [&](const ElasticKV<T>& e) {
    for (std::int32_t l = 0; l < config.layers; ++l) {
      e.wait(l, streams.main);
      cuda::gather_kv(KVCache<const T>(e.resident(l)), e.selection(),
                      KVCache<T>(ContiguousKVView<T>::packed(out_k.data() + l * out_elems, out_v.data() + l * out_elems,
                                                             3, config.kv_heads, config.capacity, config.head_dim)),
                      streams.main);
    }
  };
  const ElasticInputs<T> inputs{.selection = d.view, .slots = d.slots.data(), .host_caches = hosts};
  test::CapturedGraph graph(streams.main, [&] {
    captured.update(inputs, streams.main, streams.side);
    read_all(captured);
  });
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(testing::Message() << "step " << step);
    next_step_selection(rng, previous, current, {180, 25, 90});
    d.indices.upload(current.indices);
    d.counts.upload(current.counts);
    out_k.poison();
    out_v.poison();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads and poisons ran on the legacy stream
    eager.update(inputs, streams.main, streams.side);
    read_all(eager);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(streams.main));
    const auto eager_k = out_k.download(), eager_v = out_v.download();
    out_k.poison();
    out_v.poison();
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    graph.launch();
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(streams.main));
    ASSERT_TRUE(same_bytes(out_k.download(), eager_k));
    ASSERT_TRUE(same_bytes(out_v.download(), eager_v));
    const std::int64_t captured_rows = captured.moved_rows_total(streams.main);
    EXPECT_EQ(captured_rows, eager.moved_rows_total(streams.main));
    previous = current;
    previous.view.indices = previous.indices.data();
    previous.view.counts = previous.counts.data();
  }
}

/// A count outside [0, capacity] or a slot outside [0, max_slots) gives count -1 in the slot-space selection and
/// copied -1; the other rows are served.
TEST_F(CudaElasticKV, BadRowsHaveTheDefinedResult) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = half;
  const ElasticKVConfig config{
      .layers = 1, .max_slots = 2, .max_batch = 2, .kv_heads = 2, .head_dim = 64, .capacity = 16};
  Streams streams;
  HostPool<T> pool(rng, 1, 2, 2, 50, 64);
  pool.join(rng, 0, 50);
  pool.join(rng, 1, 50);
  ElasticKV<T> elastic(config);
  test::HostSelection none(2, 2, 16, false), current(2, 2, 16, false);
  std::fill(none.counts.begin(), none.counts.end(), 0);
  next_step_selection(rng, none, current, {50, 50});
  current.counts[1] = 17;
  DeviceSelection d(current, {1, 0});
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads ran on the legacy stream
  std::vector<KVCache<const T>> hosts{KVCache<const T>(pool.view(0, {1, 0}, true))};
  elastic.update({.selection = d.view, .slots = d.slots.data(), .host_caches = hosts}, streams.main, streams.side);
  elastic.wait(0, streams.main);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(streams.main));
  std::vector<std::int32_t> copied(4), counts(4);
  KVSIFT_CUDA_CHECK(cudaMemcpy(copied.data(), elastic.copied(), 16, cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), elastic.selection().counts, 16, cudaMemcpyDeviceToHost));
  EXPECT_EQ(copied[1], -1);
  EXPECT_EQ(counts[1], -1);
  EXPECT_EQ(copied[0], current.counts[0]);
  EXPECT_EQ(counts[0], current.counts[0]);
  DeviceSelection bad_slot(current, {1, 7});
  current.counts[1] = 3;
  bad_slot.counts.upload(current.counts);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
  elastic.update({.selection = bad_slot.view, .slots = bad_slot.slots.data(), .host_caches = hosts}, streams.main,
                 streams.side);
  elastic.wait(0, streams.main);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(streams.main));
  KVSIFT_CUDA_CHECK(cudaMemcpy(copied.data(), elastic.copied(), 16, cudaMemcpyDeviceToHost));
  KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), elastic.selection().counts, 16, cudaMemcpyDeviceToHost));
  EXPECT_EQ(copied[0], 0) << "row 0 of slot 1 is resident from the last step";
  EXPECT_EQ(counts[2], -1);
  EXPECT_EQ(counts[3], -1);
  EXPECT_EQ(copied[2], -1);
}

/// A row listing a token at or past its host cache's length (here the step's own token, listed before the engine
/// has written its host row and grown the length) is bad: copied -1 and count -1, nothing of it kept resident, so
/// the next step copies every token of that row again; the other rows are served.
TEST_F(CudaElasticKV, TokenPastTheHostLengthMakesTheRowBad) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  using T = half;
  const ElasticKVConfig config{
      .layers = 2, .max_slots = 2, .max_batch = 2, .kv_heads = 2, .head_dim = 64, .capacity = 16};
  Streams streams;
  HostPool<T> pool(rng, config.layers, 2, 2, 60, 64);
  pool.join(rng, 0, 50);
  pool.join(rng, 1, 40);
  ElasticKV<T> elastic(config);
  const std::vector<std::int32_t> slots = {1, 0};
  test::HostSelection none(2, 2, 16, false), current(2, 2, 16, false);
  std::fill(none.counts.begin(), none.counts.end(), 0);
  next_step_selection(rng, none, current, {40, 50});
  // Row 1 (batch row 0 = slot 1, kv head 1) ends with token 40, its sequence's next one.
  if (current.counts[1] < 16) ++current.counts[1];
  current.indices[16 + std::size_t(current.counts[1]) - 1] = 40;
  std::vector<DeviceBuffer<T>> read_k, read_v;
  for (std::int32_t l = 0; l < config.layers; ++l) {
    read_k.emplace_back(std::size_t(2) * 2 * 16 * 64);
    read_v.emplace_back(read_k.back().size());
  }
  std::vector<KVCache<const T>> hosts;
  for (std::int32_t l = 0; l < config.layers; ++l) hosts.push_back(KVCache<const T>(pool.view(l, slots, true)));
  std::vector<std::int32_t> copied(4), counts(4);
  // Outlives each run: resident(l), read after it, is a paged view whose page table is the update's slots.
  std::optional<DeviceSelection> d;
  const auto run = [&](const test::HostSelection& sel) {
    d.emplace(sel, slots);
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads ran on the legacy stream
    elastic.update({.selection = d->view, .slots = d->slots.data(), .host_caches = hosts}, streams.main, streams.side);
    for (std::int32_t l = 0; l < config.layers; ++l) elastic.wait(l, streams.main);
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(streams.main));
    KVSIFT_CUDA_CHECK(cudaMemcpy(copied.data(), elastic.copied(), 16, cudaMemcpyDeviceToHost));
    KVSIFT_CUDA_CHECK(cudaMemcpy(counts.data(), elastic.selection().counts, 16, cudaMemcpyDeviceToHost));
  };
  run(current);
  EXPECT_EQ(copied[1], -1);
  EXPECT_EQ(counts[1], -1);
  for (const std::size_t r : {0u, 2u, 3u}) {
    EXPECT_EQ(copied[r], current.counts[r]) << "row " << r;
    EXPECT_EQ(counts[r], current.counts[r]) << "row " << r;
  }
  // The next step lists the row's valid tokens again: none was kept, every one is copied, and every layer's
  // resident rows equal the gather of its host cache.
  current.counts[1] -= 1;
  run(current);
  EXPECT_EQ(copied[1], current.counts[1]) << "the bad row's tokens were kept resident";
  EXPECT_EQ(copied[0], 0);
  EXPECT_EQ(counts[1], current.counts[1]);
  for (std::int32_t l = 0; l < config.layers; ++l) {
    const auto [k, v] = read_resident(elastic, l, 2, read_k[std::size_t(l)], read_v[std::size_t(l)], streams.main);
    const auto [ek, ev] = expected_rows(pool.view(l, slots, true), current, config.capacity, config.head_dim);
    ASSERT_TRUE(same_bytes(k, ek)) << "resident K of layer " << l;
    ASSERT_TRUE(same_bytes(v, ev)) << "resident V of layer " << l;
  }
}

/// Refusals of update and the accessors on a live object (need a GPU: the constructor allocates).
TEST_F(CudaElasticKV, RefusesBadInputs) {
  using T = half;
  const ElasticKVConfig config{
      .layers = 2, .max_slots = 3, .max_batch = 2, .kv_heads = 2, .head_dim = 64, .capacity = 16};
  Streams streams;
  HostPool<T> pool(rng, 2, 3, 2, 40, 64);
  pool.join(rng, 0, 40);
  pool.join(rng, 1, 40);
  ElasticKV<T> elastic(config);
  const std::vector<std::int32_t> slots = {0, 1};
  test::HostSelection sel(2, 2, 16, false);
  std::fill(sel.counts.begin(), sel.counts.end(), 0);
  DeviceSelection d(sel, slots);
  KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads ran on the legacy stream
  std::vector<KVCache<const T>> hosts;
  for (std::int32_t l = 0; l < 2; ++l) hosts.push_back(KVCache<const T>(pool.view(l, slots, true)));
  const auto update = [&](SelectionView s, std::span<const KVCache<const T>> caches, cudaStream_t side) {
    elastic.update({.selection = s, .slots = d.slots.data(), .host_caches = caches}, streams.main, side);
  };
  test::expect_error([&] { elastic.wait(0, streams.main); }, {"ElasticKV::wait", "no update has run"});
  SelectionView s = d.view;
  s.capacity = 8;
  test::expect_error([&] { update(s, hosts, streams.side); },
                     {"ElasticKV::update", "in.selection.capacity (= 8) is not config.capacity (= 16)"});
  s = d.view;
  s.batch = 3;
  test::expect_error([&] { update(s, hosts, streams.side); },
                     "in.selection.batch (= 3) is outside [1, config.max_batch = 2]");
  s = d.view;
  s.kv_heads = 1;
  test::expect_error([&] { update(s, hosts, streams.side); },
                     "in.selection.kv_heads (= 1) is not config.kv_heads (= 2)");
  s = d.view;
  const std::uint8_t all[4] = {1, 1, 1, 1};
  s.attend_all = all;
  test::expect_error([&] { update(s, hosts, streams.side); }, "in.selection has attend_all");
  test::expect_error([&] { update(d.view, std::span(hosts).first(1), streams.side); },
                     "in.host_caches has 1 caches, config.layers is 2");
  test::expect_error([&] { update(d.view, hosts, streams.main); }, "the main and side streams are one stream");
  std::vector<KVCache<const T>> wrong = hosts;
  wrong[1] = KVCache<const T>(pool.view(1, {0}, true));
  test::expect_error([&] { update(d.view, wrong, streams.side); },
                     "in.host_caches[1] is [batch = 1, kv_heads = 2, head_dim = 64], the step [batch = 2");
  std::vector<T> pageable_k(std::size_t(2) * 2 * 40 * 64), pageable_v(pageable_k.size());
  wrong[1] = KVCache<const T>(ContiguousKVView<const T>::packed(pageable_k.data(), pageable_v.data(), 2, 2, 40, 64,
                                                                pool.contiguous_lens->data()));
  test::expect_error([&] { update(d.view, wrong, streams.side); },
                     {"in.host_caches[1]'s k", "is not pinned host memory"});
  update(d.view, hosts, streams.side);
  // The pointers that passed are not queried again; a new one still is.
  test::expect_error([&] { update(d.view, wrong, streams.side); },
                     {"in.host_caches[1]'s k", "is not pinned host memory"});
  update(d.view, hosts, streams.side);
  test::expect_error([&] { elastic.resident(2); },
                     {"ElasticKV::resident", "layer (= 2) is outside [0, config.layers = 2)"});
  test::expect_error([&] { elastic.release(std::vector<std::int32_t>{3}, streams.main); },
                     "slot (= 3) is outside [0, config.max_slots = 3)");
  for (std::int32_t l = 0; l < 2; ++l) elastic.wait(l, streams.main);
  KVSIFT_CUDA_CHECK(cudaStreamSynchronize(streams.main));
}

/// Configuration refusals: before any device call (no GPU needed).
TEST(CudaElasticKVBadInput, RefusesBadConfigs) {
  ElasticKVConfig c{.layers = 2, .max_slots = 3, .max_batch = 4, .kv_heads = 2, .head_dim = 64, .capacity = 16};
  test::expect_error([&] { ElasticKV<half> e(c); },
                     {"ElasticKV", "config.max_batch (= 4) is outside [1, config.max_slots = 3]"});
  c.max_batch = 2;
  c.capacity = 0;
  test::expect_error([&] { ElasticKV<half> e(c); }, "capacity");
  c.capacity = 70000;
  test::expect_error([&] { ElasticKV<half> e(c); }, "config.capacity (= 70000) exceeds 65536 slots");
  c.capacity = 16;
  c.layers = 0;
  test::expect_error([&] { ElasticKV<half> e(c); }, "layers");
}

}  // namespace
}  // namespace kvsift
