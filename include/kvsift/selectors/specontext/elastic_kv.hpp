#pragma once
/// ElasticKV: SpeContext's elastic loading (docs/selector_framework.md placement (d); docs/specontext.md,
/// "Offloaded layers"; in the step: selectors/specontext/offload.hpp).
/// SpeContext makes one selection per decode step, before layer 0, and every layer attends it. For the layers whose
/// KV lives in pinned host memory ("offloaded"), ElasticKV keeps on the GPU, per (offloaded layer, sequence slot, kv
/// head), a resident row of capacity + 1 slots: slots [0, capacity) hold the rows of the last selection, slot
/// `capacity` the step's own token. Per step, update() computes once per (sequence, kv head) the difference between
/// the new selection (token space) and the resident one, and applies it to every offloaded layer: only the new
/// tokens' K/V rows are copied from the host caches, into the slots the dropped tokens free (kept tokens keep their
/// slots; new ones, ascending, take the free slots, ascending: cuda::gather_kv_difference's rule, whose two launches
/// are split here into the slot assignment, once, and the copy, once per layer). The selection comes back in slot
/// space (the same for every offloaded layer) for the layers' attention over resident(layer).
///
/// Streams. update() runs on a side stream: it waits for everything the main stream enqueued before the call (an
/// event: the selection, and the previous step's attention of every layer, which read the slots it rewrites), then
/// assigns the slots, commits them as the resident state, and copies layer 0's rows, layer 1's, ..., recording one
/// event per layer after its copies. wait(layer, main) makes the main stream wait for that layer's event: call it
/// before the layer's attention, for every layer, every step. The copies of later layers overlap the earlier layers'
/// compute. Under stream capture of the main stream this is the fork/join pattern: the side stream joins the capture
/// through the first event and every layer's wait joins it back (a capture that ends before every wait() is refused
/// by CUDA as unjoined).
///
/// The step's own token (attended in the step that produces it, whose K/V no host cache holds yet when update runs):
/// the layer calls write_current(), which writes its K/V both to slot `capacity` of its resident rows and, through
/// pinned memory, to the host cache at seq_len - 1 (the engine's lengths count the token), so later steps can load it.
/// The attention of an offloaded layer is then sparse decode over resident(layer) (every row capacity + 1 long) with
/// the slot-space selection and attention_options(): the window {sink 0, recent 1}, which is that last slot. So the
/// token-space selection must not list the step's token (its host row is not written when update copies), and tokens
/// the GPU-resident layers attend through a sink / recent window must be listed in it (slot 0 is not token 0).
///
/// Rules: the first step after construction or release() of a slot finds nothing resident (every token copied); a
/// sequence shorter than the budget lists all its tokens (count = length <= capacity: attend_all is refused, the rows
/// must name the tokens); rows ascending and distinct. A row with a count outside [0, capacity], a slot outside [0,
/// max_slots) or a token outside [0, seq_len(b)) of the host caches (layer 0's lengths, which every offloaded
/// layer's must equal: one model's layers hold the same tokens) gets count -1 in the slot-space selection (the
/// attention writes NaN) and forgets what is resident, so no unloaded row is ever kept as resident. A token the
/// lengths count but whose host row is not written yet (the step's own, once the engine has grown the lengths) is
/// not detectable: the selection must not list it (SpeContextStep's never does, its window holds the token).
///
/// Counters: copied() [batch * kv_heads] device, each row's rows copied this step (per layer: every layer copies the
/// same rows); a device total of rows copied since construction (per layer). last_step_stats(main) and
/// moved_rows_total(main) read them back on the main stream and synchronize it: call them outside the step.
/// Memory, all allocated in the constructor: device, the resident K and V [layers, max_slots, kv_heads, capacity + 1,
/// head_dim] in T, the resident state per slot (tokens, slots, counts), the slot-space selection, the copied counts,
/// the host lengths and the assignment's scratch. update() allocates nothing and never synchronizes the host; it is
/// capturable. Its check that the host caches are pinned queries CUDA only for a pointer that differs from the one
/// the same layer and field had at the last check (cudaPointerGetAttributes costs about a microsecond, and the
/// engine's caches rarely move): memory freed and reused as pageable at the same address is not detected.
/// Device values (slots, counts, tokens) are trusted as by the CUDA gathers; shapes are checked on the host.
/// Thread safety: one object serves one thread at a time.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime_api.h>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/detail/gather_checks.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/kv_cache.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/cache_ops.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/cuda/context.hpp"
#include "kvsift/cuda/detail/gather_launch.hpp"
#include "kvsift/cuda/pinned_host.hpp"

namespace kvsift {

struct ElasticKVConfig {
  std::int32_t layers = 1;     ///< offloaded layers (each has its host cache and resident rows)
  std::int32_t max_slots = 1;  ///< sequences live at once (continuous batching); slots in [0, max_slots)
  std::int32_t max_batch = 1;  ///< batch rows per step, <= max_slots
  std::int32_t kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t capacity = 2048;  ///< B: the selection's capacity, resident slots per row besides the step's token
};

/// One step's inputs to ElasticKV::update.
template <class T>
struct ElasticInputs {
  /// Token space, device memory: [batch, kv_heads, capacity], rows ascending and distinct; log-weights (optional)
  /// carry over to the slot-space selection entry by entry. Read by the side stream until every layer's event.
  SelectionView selection;
  const std::int32_t* slots = nullptr;  ///< [batch] each row's sequence slot, device memory, distinct
  /// One per offloaded layer, [batch, kv_heads, ., head_dim], contiguous or paged, in pinned host memory (its
  /// lengths or page table too: the GPU reads them).
  std::span<const KVCache<const T>> host_caches;
};

/// What one update moved (per layer and for all offloaded layers).
struct ElasticStats {
  std::int64_t rows_per_layer = 0;  ///< sum over (sequence, kv head) of |new \ resident|
  std::int64_t rows = 0;            ///< rows_per_layer * layers (a K and a V row each)
  std::int64_t bytes = 0;           ///< rows * 2 * head_dim * sizeof(T)
};

template <class T>
class ElasticKV {
 public:
  using value_type = T;

  explicit ElasticKV(const ElasticKVConfig& config) : config_(checked(config)) {
    const std::size_t row = std::size_t(config.capacity + 1) * std::size_t(config.head_dim);
    const std::size_t per_layer = std::size_t(config.max_slots) * std::size_t(config.kv_heads) * row;
    resident_k_memory_.resize(checked_mul(per_layer, std::size_t(config.layers), "ElasticKV resident K"));
    resident_v_memory_.resize(resident_k_memory_.size());
    resident_k_ = resident_k_memory_.data();
    resident_v_ = resident_v_memory_.data();
    WorkspaceLayout counting;
    layout(counting);
    memory_.resize(counting.bytes());
    WorkspaceLayout carving({memory_.data(), memory_.size()}, "ElasticKV");
    buffers_ = layout(carving);

    // Constants of the resident views: one page of capacity + 1 slots per batch row, full.
    std::vector<std::int32_t> indptr(std::size_t(config.max_batch) + 1), full(std::size_t(config.max_batch));
    for (std::size_t b = 0; b < indptr.size(); ++b) indptr[b] = std::int32_t(b);
    for (std::int32_t& f : full) f = config.capacity + 1;
    KVSIFT_CUDA_CHECK(
        cudaMemcpy(buffers_.page_indptr, indptr.data(), indptr.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
    KVSIFT_CUDA_CHECK(
        cudaMemcpy(buffers_.page_len, full.data(), full.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
    // Nothing resident; no row copied yet.
    KVSIFT_CUDA_CHECK(cudaMemset(buffers_.state_counts, 0, rows(config.max_slots) * sizeof(std::int32_t)));
    KVSIFT_CUDA_CHECK(cudaMemset(buffers_.copied, 0, rows(config.max_batch) * sizeof(std::int32_t)));
    KVSIFT_CUDA_CHECK(cudaMemset(buffers_.moved_rows, 0, sizeof(unsigned long long)));
    // The copies above are from pageable memory and update() may use any stream: finish them here.
    KVSIFT_CUDA_CHECK(cudaDeviceSynchronize());
    fork_ = make_event();
    for (std::int32_t l = 0; l < config.layers; ++l) layer_events_.push_back(make_event());
    pinned_.resize(std::size_t(config.layers));
    for (std::int32_t l = 0; l < config.layers; ++l) pinned_names_.push_back(fmt::format("in.host_caches[{}]", l));
  }

  const ElasticKVConfig& config() const { return config_; }

  /// One step's difference, assigned once and copied for every offloaded layer on `side` (see above). Refused: a
  /// selection whose capacity is not config.capacity, whose batch is outside [1, max_batch], whose kv_heads differ,
  /// with attend_all; host caches not one per layer, of another shape, or (checked outside stream capture: the
  /// pointer query is not a stream operation; once per new pointer) not device-readable host memory; side == main.
  void update(const ElasticInputs<T>& in, cudaStream_t main, cudaStream_t side) {
    constexpr const char* where = "ElasticKV::update";
    const SelectionView& s = in.selection;
    KVSIFT_CHECK(s.capacity == config_.capacity, where,
                 "in.selection.capacity (= {}) is not config.capacity (= {}): the resident rows hold that many slots",
                 s.capacity, config_.capacity);
    KVSIFT_CHECK(s.batch > 0 && s.batch <= config_.max_batch, where,
                 "in.selection.batch (= {}) is outside [1, config.max_batch = {}]", s.batch, config_.max_batch);
    KVSIFT_CHECK(s.kv_heads == config_.kv_heads, where, "in.selection.kv_heads (= {}) is not config.kv_heads (= {})",
                 s.kv_heads, config_.kv_heads);
    detail::check_pointer(where, "in.selection", "indices", s.indices);
    detail::check_pointer(where, "in.selection", "counts", s.counts);
    KVSIFT_CHECK(s.attend_all == nullptr, where,
                 "in.selection has attend_all: elastic rows must list their tokens (a sequence shorter than the "
                 "budget lists all of them)");
    KVSIFT_CHECK(in.slots != nullptr, where, "in.slots is a null pointer");
    KVSIFT_CHECK(in.host_caches.size() == std::size_t(config_.layers), where,
                 "in.host_caches has {} caches, config.layers is {}: one per offloaded layer", in.host_caches.size(),
                 config_.layers);
    KVSIFT_CHECK(main != side, where, "the main and side streams are one stream: the copies would not overlap");
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    KVSIFT_CUDA_CHECK(cudaStreamIsCapturing(main, &capture));
    for (std::size_t l = 0; l < in.host_caches.size(); ++l) {
      const KVCache<const T>& cache = in.host_caches[l];
      KVSIFT_CHECK(
          cache.batch() == s.batch && cache.kv_heads() == config_.kv_heads && cache.head_dim() == config_.head_dim,
          where,
          "in.host_caches[{}] is [batch = {}, kv_heads = {}, head_dim = {}], the step [batch = {}, kv_heads "
          "= {}, head_dim = {}]",
          l, cache.batch(), cache.kv_heads(), cache.head_dim(), s.batch, config_.kv_heads, config_.head_dim);
      detail::validate_cache(cache, where, "in.host_caches[]", MemorySpace::device);
      if (capture == cudaStreamCaptureStatusNone) check_pinned(cache, l);
    }

    // The resident state is the difference's previous selection, one row per (sequence slot, kv head).
    const SelectionView resident_state{.indices = buffers_.state_indices,
                                       .counts = buffers_.state_counts,
                                       .batch = config_.max_slots,
                                       .kv_heads = config_.kv_heads,
                                       .capacity = config_.capacity};
    const cuda::detail::DifferenceSlots assign{.previous = resident_state,
                                               .previous_rows = in.slots,
                                               .previous_slots = buffers_.state_slots,
                                               .current = s,
                                               .current_slots = buffers_.slot_indices,
                                               .resident_capacity = config_.capacity,
                                               .copied = buffers_.copied,
                                               .fresh = buffers_.fresh,
                                               .source_lengths = buffers_.lengths};
    KVSIFT_CUDA_CHECK(cudaEventRecord(fork_.get(), main));
    KVSIFT_CUDA_CHECK(cudaStreamWaitEvent(side, fork_.get(), 0));
    cuda::sequence_lengths(in.host_caches.front(), buffers_.lengths, side);
    KVSIFT_CUDA_CHECK(cuda::detail::launch_assign_difference_slots(assign, side));
    KVSIFT_CUDA_CHECK(cuda::detail::launch_commit_difference(assign, buffers_.state_indices, buffers_.state_counts,
                                                             buffers_.state_slots, buffers_.slot_counts,
                                                             buffers_.moved_rows, side));
    batch_ = s.batch;
    slots_ = in.slots;
    log_weights_ = s.log_weights;
    for (std::int32_t l = 0; l < config_.layers; ++l) {
      const KVCache<T> dst = resident_rows(l);
      const KVCache<const T>& src = in.host_caches[std::size_t(l)];
      KVSIFT_CUDA_CHECK(cuda::detail::launch_copy_difference(
          src, assign, dst, cuda::detail::rows_16b_aligned(src) && cuda::detail::rows_16b_aligned(dst), side));
      KVSIFT_CUDA_CHECK(cudaEventRecord(layer_events_[std::size_t(l)].get(), side));
    }
  }

  /// The main stream waits for layer `layer`'s copies of the last update (before that layer's attention).
  void wait(std::int32_t layer, cudaStream_t main) const {
    check_layer(layer, "ElasticKV::wait");
    KVSIFT_CUDA_CHECK(cudaStreamWaitEvent(main, layer_events_[std::size_t(layer)].get(), 0));
  }

  /// The last update's selection in slot space, for resident(layer) of every offloaded layer: [batch, kv_heads,
  /// capacity] slots, counts (-1 for a bad row), the input's log-weights. Device memory; valid after wait().
  SelectionView selection() const {
    return {buffers_.slot_indices, buffers_.slot_counts, log_weights_, batch_, config_.kv_heads, config_.capacity};
  }

  /// Layer `layer`'s resident rows for the last update's batch (row b is sequence slot slots[b]): a paged view of
  /// one page of capacity + 1 slots per row, every row full, the step's token in the last slot. Its page table is
  /// the update's `slots` array itself: valid while that array is. Writable for that token only
  /// (cuda::write_step_kv writes it there: SpeContextStep::attend_selection given k and v, or write_current);
  /// slots [0, capacity) belong to update.
  KVCache<T> resident(std::int32_t layer) const {
    check_layer(layer, "ElasticKV::resident");
    return resident_rows(layer);
  }

  /// The attention options of an offloaded layer: the step's scale, the window {0, 1} (the step's token's slot).
  static AttentionOptions attention_options(const AttentionOptions& step) {
    return {.sm_scale = step.sm_scale, .window = {.sink = 0, .recent = 1}};
  }

  /// Layer `layer`'s K/V of the step's token, k and v [batch, kv_heads, head_dim] (device), into its resident slot
  /// and, written through, into host_cache at seq_len(b) - 1 (pinned host memory; the lengths count the token), on
  /// `stream` (the main one). The batch is the last update's.
  void write_current(std::int32_t layer, const KVCache<T>& host_cache, const HeadsView<const T>& k,
                     const HeadsView<const T>& v, cudaStream_t stream) const {
    constexpr const char* where = "ElasticKV::write_current";
    check_layer(layer, where);
    KVSIFT_CHECK(k.batch == batch_ && host_cache.batch() == batch_, where,
                 "k.batch (= {}) and host_cache's batch (= {}) must be the last update's batch (= {})", k.batch,
                 host_cache.batch(), batch_);
    cuda::write_step_kv(resident_rows(layer), k, v, stream);
    cuda::write_step_kv(host_cache, k, v, stream);
  }

  /// Sequences leave their slots (host memory, each in [0, max_slots)): the next update of such a slot finds
  /// nothing resident. On `stream`, ordered before the next update by the caller (the main stream).
  void release(std::span<const std::int32_t> slots, cudaStream_t stream) {
    for (const std::int32_t slot : slots) {
      KVSIFT_CHECK(slot >= 0 && slot < config_.max_slots, "ElasticKV::release",
                   "slot (= {}) is outside [0, config.max_slots = {})", slot, config_.max_slots);
      KVSIFT_CUDA_CHECK(cudaMemsetAsync(buffers_.state_counts + std::size_t(slot) * std::size_t(config_.kv_heads), 0,
                                        std::size_t(config_.kv_heads) * sizeof(std::int32_t), stream));
    }
  }

  /// [batch, kv_heads] device: the rows each row copied in the last update (per layer), -1 for a bad row.
  const std::int32_t* copied() const { return buffers_.copied; }

  /// Reads the last update's counters back on `stream` and synchronizes it (outside the step). `stream` must be
  /// ordered after the step's copies: the main stream after every layer's wait(), eager or a replayed graph. (Not
  /// the layer events: an event recorded during a capture cannot be synchronized on.)
  ElasticStats last_step_stats(cudaStream_t stream) const {
    std::vector<std::int32_t> copied(rows(batch_));
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(copied.data(), buffers_.copied, copied.size() * sizeof(std::int32_t),
                                      cudaMemcpyDeviceToHost, stream));
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    ElasticStats stats;
    for (const std::int32_t c : copied) stats.rows_per_layer += c > 0 ? c : 0;
    stats.rows = stats.rows_per_layer * config_.layers;
    stats.bytes = stats.rows * 2 * config_.head_dim * std::int64_t(sizeof(T));
    return stats;
  }
  /// Rows copied per layer since construction (read on `stream`, as last_step_stats).
  std::int64_t moved_rows_total(cudaStream_t stream) const {
    unsigned long long total = 0;
    KVSIFT_CUDA_CHECK(cudaMemcpyAsync(&total, buffers_.moved_rows, sizeof(total), cudaMemcpyDeviceToHost, stream));
    KVSIFT_CUDA_CHECK(cudaStreamSynchronize(stream));
    return std::int64_t(total);
  }

 private:
  struct Buffers {
    std::int32_t *state_indices = nullptr, *state_slots = nullptr;  ///< [max_slots, kv_heads, capacity]
    std::int32_t* state_counts = nullptr;                           ///< [max_slots, kv_heads]
    std::int32_t* slot_indices = nullptr;  ///< [max_batch, kv_heads, capacity] the slot-space selection
    std::int32_t* slot_counts = nullptr;   ///< [max_batch, kv_heads] its counts
    std::int32_t* copied = nullptr;        ///< [max_batch, kv_heads]
    std::int32_t* fresh = nullptr;         ///< [max_batch, kv_heads, capacity] the assignment's new entries
    std::int32_t* page_indptr = nullptr;   ///< [max_batch + 1] 0, 1, ..., max_batch
    std::int32_t* page_len = nullptr;      ///< [max_batch] capacity + 1
    std::int32_t* lengths = nullptr;       ///< [max_batch] the host caches' lengths of the last update
    unsigned long long* moved_rows = nullptr;
  };
  struct EventDeleter {
    void operator()(cudaEvent_t event) const { cudaEventDestroy(event); }
  };
  using Event = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;

  static const ElasticKVConfig& checked(const ElasticKVConfig& config) {
    constexpr const char* where = "ElasticKV";
    detail::check_positive(where, "config", "layers", config.layers);
    detail::check_positive(where, "config", "max_slots", config.max_slots);
    detail::check_positive(where, "config", "kv_heads", config.kv_heads);
    detail::check_positive(where, "config", "head_dim", config.head_dim);
    detail::check_positive(where, "config", "capacity", config.capacity);
    KVSIFT_CHECK(config.max_batch > 0 && config.max_batch <= config.max_slots, where,
                 "config.max_batch (= {}) is outside [1, config.max_slots = {}]", config.max_batch, config.max_slots);
    KVSIFT_CHECK(config.capacity <= kvsift::detail::kMaxResidentSlots, where, "config.capacity (= {}) exceeds {} slots",
                 config.capacity, kvsift::detail::kMaxResidentSlots);
    return config;
  }

  static Event make_event() {
    cudaEvent_t event = nullptr;
    KVSIFT_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return Event(event);
  }

  /// The copies read the host cache's rows and its lengths or page table on the device: pinned host memory,
  /// checked once per array and layer (cuda/pinned_host.hpp).
  void check_pinned(const KVCache<const T>& cache, std::size_t layer) {
    pinned_[layer].require(cache, cuda::PinnedHostCheck::Arrays::kv_and_tables, "ElasticKV::update",
                           pinned_names_[layer]);
  }

  void check_layer(std::int32_t layer, const char* where) const {
    KVSIFT_CHECK(layer >= 0 && layer < config_.layers, where, "layer (= {}) is outside [0, config.layers = {})", layer,
                 config_.layers);
    KVSIFT_CHECK(slots_ != nullptr, where, "no update has run: the resident rows have no batch yet");
  }

  std::size_t rows(std::int32_t batch) const { return std::size_t(batch) * std::size_t(config_.kv_heads); }

  KVCache<T> resident_rows(std::int32_t layer) const {
    const std::int64_t row = std::int64_t(config_.capacity + 1) * config_.head_dim;
    const std::int64_t page = row * config_.kv_heads;
    const std::size_t offset = std::size_t(layer) * std::size_t(config_.max_slots) * std::size_t(page);
    return PagedKVView<T>{.k_pages = resident_k_ + offset,
                          .v_pages = resident_v_ + offset,
                          .page_indptr = buffers_.page_indptr,
                          .page_indices = slots_,
                          .last_page_len = buffers_.page_len,
                          .batch = batch_,
                          .kv_heads = config_.kv_heads,
                          .head_dim = config_.head_dim,
                          .page_size = config_.capacity + 1,
                          .num_pages = config_.max_slots,
                          .page_stride = page,
                          .token_stride = config_.head_dim,
                          .head_stride = row};
  }

  /// The one layout behind the device block's size (counting) and its pointers (carving).
  Buffers layout(WorkspaceLayout& layout) const {
    const std::size_t slot_rows = rows(config_.max_slots), batch_rows = rows(config_.max_batch);
    const std::size_t capacity = std::size_t(config_.capacity);
    Buffers b;
    b.state_indices = layout.allocate<std::int32_t>(slot_rows * capacity, "ElasticKV resident tokens");
    b.state_slots = layout.allocate<std::int32_t>(slot_rows * capacity, "ElasticKV resident slots");
    b.state_counts = layout.allocate<std::int32_t>(slot_rows, "ElasticKV resident counts");
    b.slot_indices = layout.allocate<std::int32_t>(batch_rows * capacity, "ElasticKV slot-space selection");
    b.slot_counts = layout.allocate<std::int32_t>(batch_rows, "ElasticKV slot-space counts");
    b.copied = layout.allocate<std::int32_t>(batch_rows, "ElasticKV copied rows");
    b.fresh = layout.allocate<std::int32_t>(batch_rows * capacity, "ElasticKV new entries");
    b.page_indptr = layout.allocate<std::int32_t>(std::size_t(config_.max_batch) + 1, "ElasticKV page indptr");
    b.page_len = layout.allocate<std::int32_t>(std::size_t(config_.max_batch), "ElasticKV page lengths");
    b.lengths = layout.allocate<std::int32_t>(std::size_t(config_.max_batch), "ElasticKV host lengths");
    b.moved_rows = layout.allocate<unsigned long long>(1, "ElasticKV moved rows");
    return b;
  }

  ElasticKVConfig config_;
  cuda::Array<T> resident_k_memory_, resident_v_memory_;
  T *resident_k_ = nullptr, *resident_v_ = nullptr;  ///< their data: the views of const members write through them
  cuda::Array<std::byte> memory_;
  Buffers buffers_;
  Event fork_;
  std::vector<Event> layer_events_;
  std::vector<cuda::PinnedHostCheck> pinned_;  ///< [layers]: each layer's host cache, its arrays checked once
  std::vector<std::string> pinned_names_;       ///< [layers] "in.host_caches[l]", named in a refusal
  std::int32_t batch_ = 0;
  const std::int32_t* slots_ = nullptr;
  float* log_weights_ = nullptr;
};

}  // namespace kvsift
