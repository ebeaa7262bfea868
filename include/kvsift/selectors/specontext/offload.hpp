#pragma once
/// SpeContextOffload: SpeContextStep (selectors/specontext/step.hpp) with the model's last layers offloaded, their KV in
/// pinned host caches, attended from ElasticKV's resident rows (selectors/specontext/elastic_kv.hpp; docs/specontext.md, "Offloaded
/// layers"). A thin composition beside the step, which it does not own: the step keeps the selector (the head's
/// cache), so a new placement is a new SpeContextOffload over the same step.
///   - select(step, head inputs, host caches): the step's select on the main stream (ctx.stream), then
///     ElasticKV::update of every offloaded layer on `side` from that selection: the copies start before layer 0;
///   - attend(step, layer inputs): a GPU layer (layer < first_offloaded()) is step.attend; an offloaded one writes
///     the step's token (in.k, in.v, required) into its resident slot and, through, into its host cache (in.cache,
///     pinned, its lengths counting the token), waits for that layer's copies and attends the resident rows with the
///     slot-space selection and the window {0, 1} (the token's slot). Attend every layer, every step: the waits join
///     the side stream back to the main one (under stream capture too).
///
/// The window: offloaded layers attend the selection and the step's token, so the step's window must be {0, 1}
/// (config.attention.window {0, 0} or {0, 1}, the paper's): the tokens of a wider window (4 + 64) are on the host
/// only and the selection leaves them out. Refused otherwise, rather than attended differently by the two
/// placements (docs/specontext.md says why no union yet).
///
/// Placement: fixed per object, the last `offloaded` layers [layers - offloaded, layers) (the planner's algorithm
/// 2 order, selectors/specontext/offload_planner.hpp). When the planner offloads one more layer as sequences grow, build a new
/// SpeContextOffload over the same step (allocation, outside the step): its resident rows are cold, so its first
/// update copies every selected row of every offloaded layer, as on the first step; the layer moved to the host must
/// have its host cache complete before that select (the engine copies it down once).
///
/// Memory and calls: ElasticKV's (all allocated in the constructor; select and attend allocate nothing and never
/// synchronize the host, CUDA-graph capturable: the side stream forks from the main one in update and joins it at
/// every offloaded layer's wait). Slots are the selector's (in [0, its max_slots)); release() frees them here too.
/// Thread safety: one object serves one thread at a time, with its step.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "kvsift/core/error.hpp"
#include "kvsift/cuda/context.hpp"
#include "kvsift/selectors/specontext/elastic_kv.hpp"
#include "kvsift/selectors/specontext/step.hpp"

namespace kvsift {

template <class T>
class SpeContextOffload {
 public:
  using value_type = T;
  using Step = SpeContextStep<T, cuda::Context>;

  /// The last `offloaded` of step's layers, for its batches and the selector's slots. Refused: offloaded outside
  /// [1, step.layers()] (0: use the step alone), a step whose window is not {0, 1}.
  SpeContextOffload(const Step& step, std::int32_t offloaded)
      : first_(checked_first(step, offloaded)),
        elastic_(ElasticKVConfig{.layers = offloaded,
                                 .max_slots = step.selector().limits().max_slots,
                                 .max_batch = step.config().max_batch,
                                 .kv_heads = step.config().kv_heads,
                                 .head_dim = step.config().head_dim,
                                 .capacity = step.capacity()}) {}

  /// The first offloaded layer: layers [first_offloaded(), step.layers()) are on the host.
  std::int32_t first_offloaded() const { return first_; }
  std::int32_t offloaded_layers() const { return elastic_.config().layers; }
  bool offloaded(std::int32_t layer) const { return layer >= first_; }
  /// For the counters (last_step_stats, moved_rows_total) and inspection.
  const ElasticKV<T>& elastic() const { return elastic_; }

  /// The step's selection (step.select on ctx.stream), then the copies of every offloaded layer on `side` (not
  /// ctx.stream). host_caches: one per offloaded layer, in order, pinned (ElasticInputs::host_caches), lengths
  /// counting the step's token. Refused: what step.select and ElasticKV::update refuse.
  void select(Step& step, const SpeContextHeadInputs<T>& in, std::span<const KVCache<const T>> host_caches,
              std::span<std::byte> workspace, const cuda::Context& ctx, cudaStream_t side) {
    step.select(in, workspace, ctx);
    load(step, in.q.batch, in.slots, host_caches, workspace, ctx, side);
  }

  /// select()'s second half: the copies for the step's selection of its first `batch` rows as it is now in
  /// `workspace`, for an engine (or a benchmark) that edits the selection between step.select and the copies.
  void load(const Step& step, std::int32_t batch, const std::int32_t* slots,
            std::span<const KVCache<const T>> host_caches, std::span<std::byte> workspace, const cuda::Context& ctx,
            cudaStream_t side) {
    elastic_.update({.selection = step.selection(workspace, batch), .slots = slots, .host_caches = host_caches},
                    ctx.stream, side);
  }

  /// Layer in.layer's attention (see above); for an offloaded layer in.cache is its host cache and in.k, in.v the
  /// step's token. Refused: an offloaded layer without in.k and in.v, or before any select; what step.attend refuses.
  template <class TO>
  void attend(Step& step, const SpeContextLayerInputs<T>& in, const StateView<TO>& out, std::span<std::byte> workspace,
              const cuda::Context& ctx) {
    if (!offloaded(in.layer) || in.layer >= step.layers()) {  // a GPU layer, or one the step refuses
      step.attend(in, out, workspace, ctx);
      return;
    }
    KVSIFT_CHECK(in.k.data != nullptr && in.v.data != nullptr, "SpeContextOffload::attend",
                 "layer {} is offloaded: in.k and in.v (the step's token, written to its resident slot and its host "
                 "cache) are required",
                 in.layer);
    const std::int32_t local = in.layer - first_;
    elastic_.write_current(local, in.cache, in.k, in.v, ctx.stream);
    elastic_.wait(local, ctx.stream);
    step.attend_selection({.q = in.q, .cache = elastic_.resident(local), .layer = in.layer}, elastic_.selection(),
                          ElasticKV<T>::attention_options(step.attention()).window, out, workspace, ctx);
  }

  /// Sequences leave their slots: the next update of such a slot copies everything (on ctx.stream, before it).
  void release(std::span<const std::int32_t> slots, const cuda::Context& ctx) { elastic_.release(slots, ctx.stream); }

 private:
  static std::int32_t checked_first(const Step& step, std::int32_t offloaded) {
    constexpr const char* where = "SpeContextOffload";
    const std::int32_t layers = step.layers();
    KVSIFT_CHECK(offloaded >= 1 && offloaded <= layers, where,
                 "offloaded (= {}) is outside [1, step.layers() = {}]: with none offloaded use the step alone",
                 offloaded, layers);
    const AttentionWindow window = step.attention().window;
    KVSIFT_CHECK(window.sink == 0 && window.recent == 1, where,
                 "the step's window is {} + {}; offloaded layers attend the selection and the step's token only, so "
                 "it must be 0 + 1 (config.attention.window 0 + 0 or 0 + 1): a wider window's tokens are not "
                 "resident",
                 window.sink, window.recent);
    return layers - offloaded;
  }

  std::int32_t first_;
  ElasticKV<T> elastic_;
};

}  // namespace kvsift
