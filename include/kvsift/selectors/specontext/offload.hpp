#pragma once
/// SpeContextStep<T, cuda::Context, placement::LayersOnHost>: the model-level step (selectors/specontext/step.hpp)
/// with the model's last layers' KV in pinned host caches, attended from ElasticKV's resident rows
/// (selectors/specontext/elastic_kv.hpp; docs/specontext.md, "Offloaded layers"). It holds the local step (the
/// selector, its head cache, the layers' plan) and the loader:
///   - select(head inputs, with in.host_caches): the local step's select on ctx.gpu.stream, then ElasticKV::update
///     of every offloaded layer on ctx.copy_stream from that selection: the copies start before layer 0;
///   - attend(layer inputs): a GPU layer (layer < first_offloaded()) is the local step's attend; an offloaded one
///     writes the step's token (in.k, in.v, required) into its resident slot and, through, into its host cache
///     (in.cache, pinned, its lengths counting the token), waits for that layer's copies and attends the resident
///     rows with the slot-space selection and the window {0, 1} (the token's slot). Attend every layer, every step:
///     the waits join the copy stream back to the main one (under stream capture too).
///
/// The window: offloaded layers attend the selection and the step's token, so the step's window must be {0, 1}
/// (config.step.attention.window {0, 0} or {0, 1}, the paper's): the tokens of a wider window (4 + 64) are on the
/// host only and the selection leaves them out. Refused otherwise, rather than attended differently by the two
/// kinds of layers (docs/specontext.md says why no union yet).
///
/// Which layers: the last `offloaded` ones [layers - offloaded, layers) (the planner's algorithm 2 order,
/// selectors/specontext/offload_planner.hpp). When the planner changes that count as sequences grow,
/// set_offloaded_layers rebuilds the loader (allocation, outside the step): its resident rows are cold, so the next
/// select copies every selected row of every offloaded layer, as on the first step; a layer moved to the host must
/// have its host cache complete before that select (the engine copies it down once). A local step becomes an
/// offloaded one by moving it in: the selector and its head cache are kept.
///
/// Memory and calls: ElasticKV's (allocated in the constructors and set_offloaded_layers; select and attend
/// allocate nothing and never synchronize the host, CUDA-graph capturable: the copy stream forks from the main one
/// in select and joins it at every offloaded layer's wait). The workspace is the local step's (workspace_bytes()).
/// Slots are the selector's; release() frees them in the loader too. Thread safety: one step serves one thread at
/// a time; it owns its selector and loader.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>

#include "kvsift/core/error.hpp"
#include "kvsift/cuda/context.hpp"
#include "kvsift/selectors/specontext/elastic_kv.hpp"
#include "kvsift/selectors/specontext/step.hpp"
#include "kvsift/step/placement.hpp"

namespace kvsift {

/// Where a LayersOnHost step runs: the selection and every layer's attention on gpu.stream, the offloaded layers'
/// row copies on copy_stream (another stream: forked from gpu.stream in select, joined back at each offloaded
/// layer's attention).
struct OffloadContext {
  cuda::Context gpu{};
  cudaStream_t copy_stream = nullptr;
};

template <class T>
class SpeContextStep<T, cuda::Context, placement::LayersOnHost> {
 public:
  using value_type = T;
  using context_type = OffloadContext;
  using LocalStep = SpeContextStep<T, cuda::Context>;
  using Selector = typename LocalStep::Selector;

  /// Plans the step as the local one does, with its last `offloaded` layers on the host. Refused: what the local
  /// step refuses; offloaded outside [1, config.layers] (0: use the local step); a window other than {0, 1};
  /// config.rerank (a rerank per layer would read the offloaded layers' keys on the host).
  SpeContextStep(Selector selector, const SpeContextStepConfig& config, std::int32_t offloaded,
                 const cuda::Context& ctx)
      : first_(checked_first(config.layers, specontext_window(config.step.attention.window), offloaded,
                             config.rerank.budget > 0)),
        local_(std::move(selector), config, ctx), elastic_(elastic_config(offloaded)) {}
  /// A local step's last `offloaded` layers moved to the host; the step (selector, head cache, plan) is kept.
  /// Refused as above before `local` is moved from.
  SpeContextStep(LocalStep&& local, std::int32_t offloaded)
      : first_(checked_first(local.layers(), local.attention().window, offloaded, local.rerank() != nullptr)),
        local_(std::move(local)),
        elastic_(elastic_config(offloaded)) {}

  Selector& selector() { return local_.selector(); }
  const Selector& selector() const { return local_.selector(); }
  const DecodeStepConfig& config() const { return local_.config(); }
  std::int32_t layers() const { return local_.layers(); }
  std::size_t workspace_bytes() const { return local_.workspace_bytes(); }
  std::int32_t capacity() const { return local_.capacity(); }
  AttentionOptions attention() const { return local_.attention(); }

  /// The first offloaded layer: layers [first_offloaded(), layers()) are on the host.
  std::int32_t first_offloaded() const { return first_; }
  std::int32_t offloaded_layers() const { return elastic_.config().layers; }
  bool offloaded(std::int32_t layer) const { return layer >= first_; }
  /// For the counters (last_step_stats, moved_rows_total) and inspection.
  const ElasticKV<T>& elastic() const { return elastic_; }
  /// The local step it holds, for an engine (or a benchmark) that edits the selection between the selection and the
  /// copies: local_step().select (in.host_caches empty), then load. Its attend is not an offloaded layer's.
  LocalStep& local_step() { return local_; }

  /// Offloads the last `offloaded` layers from now on (see above: the loader is rebuilt, cold; allocates). Refused
  /// as by the constructor, the step unchanged.
  void set_offloaded_layers(std::int32_t offloaded) {
    const std::int32_t first = checked_first(layers(), attention().window, offloaded, local_.rerank() != nullptr);
    elastic_ = ElasticKV<T>(elastic_config(offloaded));
    first_ = first;
    loaded_batch_ = 0;
  }

  /// Prefill of joining sequences (the local step's: the head's prompt keys into its cache; may allocate).
  void prepare(const PrefillInputs<T>& in, const OffloadContext& ctx) {
    loaded_batch_ = 0;
    local_.prepare(in, ctx.gpu);
  }
  /// Sequences leave: the selector's slots and the loader's resident rows (freed on ctx.gpu.stream).
  void release(std::span<const std::int32_t> slots, const OffloadContext& ctx) {
    loaded_batch_ = 0;
    elastic_.release(slots, ctx.gpu.stream);
    local_.release(slots);
  }

  /// The step's selection on ctx.gpu.stream, then the copies of every offloaded layer on ctx.copy_stream.
  /// in.host_caches: one per offloaded layer, in order, pinned, lengths counting the step's token. Refused: what
  /// the local select and ElasticKV::update refuse.
  void select(const SpeContextHeadInputs<T>& in, std::span<std::byte> workspace, const OffloadContext& ctx) {
    loaded_batch_ = 0;
    SpeContextHeadInputs<T> head = in;
    head.host_caches = {};
    local_.select(head, workspace, ctx.gpu);
    load(in.q.batch, in.slots, in.host_caches, workspace, ctx);
  }

  /// select()'s second half: the copies for the step's selection of its first `batch` rows as it is now in
  /// `workspace`, for an engine (or a benchmark) that edits the selection between the selection and the copies.
  /// Until a load succeeds, offloaded layers refuse to attend (a refused one leaves nothing loaded).
  void load(std::int32_t batch, const std::int32_t* slots, std::span<const KVCache<const T>> host_caches,
            std::span<std::byte> workspace, const OffloadContext& ctx) {
    loaded_batch_ = 0;
    elastic_.update({.selection = local_.selection(workspace, batch), .slots = slots, .host_caches = host_caches},
                    ctx.gpu.stream, ctx.copy_stream);
    loaded_batch_ = batch;
  }

  /// Layer in.layer's attention (see above); for an offloaded layer in.cache is its host cache and in.k, in.v the
  /// step's token. Refused: an offloaded layer without in.k and in.v, or for more rows than the last load (none
  /// after a refused select or load, a prepare or release); what the local attend refuses.
  template <class TO>
  void attend(const SpeContextLayerInputs<T>& in, const StateView<TO>& out, std::span<std::byte> workspace,
              const OffloadContext& ctx) {
    if (!offloaded(in.layer) || in.layer >= layers()) {  // a GPU layer, or one the local step refuses
      local_.attend(in, out, workspace, ctx.gpu);
      return;
    }
    KVSIFT_CHECK(in.k.data != nullptr && in.v.data != nullptr, "SpeContextStep<LayersOnHost>::attend",
                 "layer {} is offloaded: in.k and in.v (the step's token, written to its resident slot and its host "
                 "cache) are required",
                 in.layer);
    KVSIFT_CHECK(in.q.batch <= loaded_batch_, "SpeContextStep<LayersOnHost>::attend",
                 "layer {} is offloaded and its rows are loaded for {} rows, in.q.batch is {}: select (or load) the "
                 "step first",
                 in.layer, loaded_batch_, in.q.batch);
    const std::int32_t local = in.layer - first_;
    elastic_.write_current(local, in.cache, in.k, in.v, ctx.gpu.stream);
    elastic_.wait(local, ctx.gpu.stream);
    local_.attend_selection({.q = in.q, .cache = elastic_.resident(local), .layer = in.layer}, elastic_.selection(),
                            ElasticKV<T>::attention_options(attention()).window, out, workspace, ctx.gpu);
  }

  /// The selection of the last select over this workspace, for its `batch` rows (token space, device memory).
  SelectionView selection(std::span<std::byte> workspace, std::int32_t batch) const {
    return local_.selection(workspace, batch);
  }

 private:
  /// The first offloaded layer of `layers` with the step's `window`.
  static std::int32_t checked_first(std::int32_t layers, const AttentionWindow& window, std::int32_t offloaded,
                                    bool reranked) {
    constexpr const char* where = "SpeContextStep<LayersOnHost>";
    KVSIFT_CHECK(!reranked, where,
                 "config.rerank is set: a rerank per layer reads each layer's keys, and an offloaded layer's are on "
                 "the host; use the local step");
    KVSIFT_CHECK(offloaded >= 1 && offloaded <= layers, where,
                 "offloaded (= {}) is outside [1, config.layers = {}]: with none offloaded use the local step",
                 offloaded, layers);
    KVSIFT_CHECK(window.sink == 0 && window.recent == 1, where,
                 "the step's window is {} + {}; offloaded layers attend the selection and the step's token only, so "
                 "it must be 0 + 1 (config.step.attention.window 0 + 0 or 0 + 1): a wider window's tokens are not "
                 "resident",
                 window.sink, window.recent);
    return layers - offloaded;
  }

  ElasticKVConfig elastic_config(std::int32_t offloaded) const {
    return {.layers = offloaded,
            .max_slots = local_.selector().limits().max_slots,
            .max_batch = local_.config().max_batch,
            .kv_heads = local_.config().kv_heads,
            .head_dim = local_.config().head_dim,
            .capacity = local_.capacity()};
  }

  std::int32_t first_;  ///< before local_: the constructors check the placement before they move the step in
  LocalStep local_;
  ElasticKV<T> elastic_;
  std::int32_t loaded_batch_ = 0;  ///< rows of the last successful load (0: offloaded layers refuse to attend)
};

}  // namespace kvsift
