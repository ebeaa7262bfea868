#pragma once
/// CUDA decode attention: sparse (over the tokens a selection lists, with optional per-index log-weights),
/// dense (FlashDecoding-style, the baseline), and the standalone LSE merge of partial states.
///
/// Memory: every view points to device memory. Supported: storage kvsift::half and kvsift::bfloat16 with fp32
/// accumulation; head_dim 64, 128 and 256 (256 in four-warp CTAs of 197 KB of shared memory, so on sm_90
/// only); any q_heads that is a multiple of kv_heads (a GQA group of up to 16 heads reads each K/V row once;
/// larger groups are tiled by 16 heads and re-read rows per tile); contiguous or paged KV; per-sequence
/// lengths and selection counts on the device. Q, K, V and O rows must be 16-byte aligned (pointers and
/// strides multiples of 8 elements).
///
/// Outputs: O [batch, q_heads, head_dim] in the storage type (TO = T) or in fp32 (TO = float: a partial state
/// for a later merge_states, e.g. the GPU window of hybrid decode, which then rounds once instead of twice;
/// both use the same kernels, so an fp32 output costs no compile time), and LSE [batch, q_heads] (fp32,
/// natural log). A sequence or selection row with no tokens, or whose every logit is -inf, yields O = 0 and
/// LSE = -inf. NaN
/// never vanishes (attention/state.hpp): a NaN or +inf logit (from Q, K, a log-weight or sm_scale) gives NaN
/// in O and LSE of that (sequence, head), a NaN in V a NaN in O; the split merge and merge_states carry a
/// NaN partial through.
///
/// A selection row whose count is outside [0, capacity] (a primitive's -1 for a bad device value,
/// SelectionView::counts) reads nothing and gets NaN in O and LSE of its every query head (the window is not
/// attended either); validation mode refuses it. Indices are trusted unless options.validate_indices is set:
/// without it an index outside [0, seq_len) is undefined behaviour, and a duplicate index is
/// attended once per occurrence (k copies of a token weigh as one with log-weight + log k). A row whose
/// selection.attend_all entry is nonzero attends every token [0, seq_len) once (window included; its count,
/// indices and log-weights are not read, nor checked in validation mode). The split plan is sized from the
/// selection's capacity plus the window, so such a row, when longer, runs in fewer CTAs than its length
/// would get: correct, and up to seq_len / (capacity + window) times as long for that row.
///
/// The KV cache's device arrays (seq_lens, page tables) are always trusted, in validation mode too: a length
/// outside [0, capacity] (contiguous), a page index outside [0, num_pages), a page_indptr/last_page_len
/// that describes more pages than the sequence owns, or (a paged view with seq_lens, such as vLLM's block-table
/// form) a length whose pages exceed the sequence's page-table entries is undefined behaviour. Check them on the host
/// (validate(kv, ..., MemorySpace::host) in core/validate.hpp) where they are built.
///
/// Hot path contract: no allocation and no host synchronization; the caller passes a stream and a
/// workspace of at least *_workspace_bytes() bytes (same arguments), 256-byte aligned, whose contents do not
/// matter (no zeroing needed; other work may use it between calls). Launches are
/// CUDA-graph capturable, except with validate_indices, which synchronizes the stream to report errors.
/// Deterministic: the same inputs and options on one GPU give bit-identical results.
/// Thread safety: reentrant; concurrent calls need distinct workspaces.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include <cuda_runtime_api.h>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/enum_names.hpp"
#include "kvsift/core/views.hpp"

namespace kvsift::cuda {

/// How the CTAs that split a row (num_splits > 1) merge their partial states (the same merge, bit for bit).
enum class SplitMerge : std::uint8_t {
  /// cluster where the device runs the sm_90 code, the row is short (at most kClusterMergeMaxTokens entries, split
  /// in at most kClusterMergeMaxSplits CTAs: the split plan caps the splits there) and the GPU holds every row's
  /// cluster at once (cudaOccupancyMaxActiveClusters, queried once per device), else kernel. On the H200 it times
  /// as the merge kernel in CUDA graphs (12.1 against 12.0 µs, sparse 2048 + window, batch 1) with one launch less.
  automatic,
  /// The row's CTAs form a thread-block cluster and merge over distributed shared memory at their end: no
  /// partials in the workspace and no second kernel. At most kClusterMergeMaxSplits splits; sm_90 code only.
  cluster,
  /// The CTAs write fp32 partials to the workspace and a second kernel merges them (any GPU, any split count).
  kernel,
};
inline constexpr std::array<std::string_view, 3> kSplitMergeNames{"automatic", "cluster", "kernel"};
constexpr std::string_view split_merge_name(SplitMerge m) { return enum_name(kSplitMergeNames, m); }
/// SplitMerge::cluster's largest cluster: the portable size, which every sm_90 GPU places.
inline constexpr std::int32_t kClusterMergeMaxSplits = 8;
/// SplitMerge::automatic merges in a cluster rows of up to this many entries (tokens, or a sparse row's window
/// plus selected tokens): a sparse step's 2K-4K tokens are too few to keep more than 8 CTAs a row busy, and the
/// merge kernel's launch and partials cost more than the SMs left idle. Longer rows keep every SM streaming.
inline constexpr std::int32_t kClusterMergeMaxTokens = 4096;

struct DecodeOptions {
  AttentionOptions attention{};
  /// CTAs along the tokens of each (sequence, kv head); 0 chooses from the shape and the GPU's SM count.
  std::int32_t num_splits = 0;
  /// Warps per CTA, 4 or 8. 0 chooses 8 where the GPU gives a block the shared memory for it (198 KB at
  /// head_dim 128: sm_90; 100 KB at head_dim 64), else 4. Eight streamed 3-10% faster on the H100
  /// (docs/cuda_attention.md); four fit the 99-163 KB of sm_80/86/89.
  std::int32_t cta_warps = 0;
  /// Upper bound on any sequence's length (host value). Required for dense decode on a paged cache; a
  /// contiguous cache uses its capacity.
  std::int32_t max_seq_len = 0;
  /// Check the selection on the device before attending (every count in [0, capacity], every index in
  /// [0, seq_len) and outside the attention window, no index twice in a row) and throw, naming the first offending (sequence, kv head,
  /// position, value), with nothing written. Synchronizes the stream; not capturable in a CUDA graph.
  bool validate_indices = false;
  /// Launch the decode kernel as a programmatic dependent of the stream's previous kernel (sm_90): its
  /// CTAs may be scheduled while that kernel finishes and read no input before its writes are complete and
  /// visible, so results do not change. The overlap hides part of the launch when the previous kernel
  /// signals early (griddepcontrol.launch_dependents), as kvsift's split merge does; otherwise the kernel
  /// starts when the previous one ends, as without it. Ignored before sm_90.
  bool programmatic_launch = true;
  /// How split CTAs merge (SplitMerge). With num_splits > kClusterMergeMaxSplits, cluster is refused.
  SplitMerge split_merge = SplitMerge::automatic;
};

/// The shapes that size sparse decode's workspace, for a query before any view exists (a decode step's plan):
/// the same bytes as the view-taking query for views of these shapes.
struct SparseDecodeShape {
  std::int32_t batch = 0;
  std::int32_t q_heads = 0;
  std::int32_t kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int32_t capacity = 0;  ///< the selection's capacity
};
std::size_t sparse_decode_workspace_bytes(const SparseDecodeShape& shape, const DecodeOptions& options = {});

template <class T, class KV>
std::size_t sparse_decode_workspace_bytes(const QueryView<const T>& q, const KV& kv, const SelectionView& selection,
                                          const DecodeOptions& options = {});
/// Sparse decode: query head h of sequence b attends to the attention window (options.attention.window: the
/// sink and recent tokens, in the same launch) and to selection.row(b, h / group)[0 .. count), each selected
/// logit plus its log-weight when selection.log_weights is set.
template <class T, class KV, class TO>
void sparse_decode(const QueryView<const T>& q, const KV& kv, const SelectionView& selection, const StateView<TO>& out,
                   std::span<std::byte> workspace, cudaStream_t stream, const DecodeOptions& options = {});

template <class T, class KV>
std::size_t dense_decode_workspace_bytes(const QueryView<const T>& q, const KV& kv, const DecodeOptions& options = {});
/// Dense decode: every query attends to all seq_len tokens of its sequence (split over the sequence, then
/// merged by LSE).
template <class T, class KV, class TO>
void dense_decode(const QueryView<const T>& q, const KV& kv, const StateView<TO>& out, std::span<std::byte> workspace,
                  cudaStream_t stream, const DecodeOptions& options = {});

/// Merges 1..64 partial states of one shape into `out` (which must not alias a partial), as
/// cpu::merge_states does: LSE = log sum_i exp(LSE_i), O = sum_i exp(LSE_i - LSE) O_i, accumulated in fp32
/// and rounded once into TO. TI = TO (half, bfloat16, float), or TI = float with TO = half or bfloat16
/// (fp32 partials, e.g. from decode with an fp32 output). Empty partials (LSE = -inf) are skipped, so they
/// change nothing bit for bit; only they are: a partial whose weight underflows to 0 still multiplies its O,
/// so a NaN there shows, and a partial with LSE = NaN makes that row of `out` NaN in O and LSE. More than 64
/// partials are refused (their views travel in the kernel's parameters): merge them in groups into fp32
/// states, then merge those. One launch, no workspace; head_dim up to 512; rows need no special alignment.
template <class TI, class TO>
void merge_states(std::span<const StateView<const TI>> partials, const StateView<TO>& out, cudaStream_t stream);

/// The entry points' instances, written once with PREFIX: `extern` declares them here, nothing instantiates them
/// (src/cuda/decode.cpp), over the lists of core/dtype.hpp.
#define KVSIFT_CUDA_DECODE_OUTPUT(PREFIX, T, KV, TO)                                                           \
  PREFIX template void sparse_decode<T, KV, TO>(const QueryView<const T>&, const KV&, const SelectionView&,      \
                                                const StateView<TO>&, std::span<std::byte>, cudaStream_t,        \
                                                const DecodeOptions&);                                           \
  PREFIX template void dense_decode<T, KV, TO>(const QueryView<const T>&, const KV&, const StateView<TO>&,      \
                                               std::span<std::byte>, cudaStream_t, const DecodeOptions&);
#define KVSIFT_CUDA_DECODE(PREFIX, T, KV)                                                                      \
  PREFIX template std::size_t sparse_decode_workspace_bytes<T, KV>(const QueryView<const T>&, const KV&,         \
                                                                   const SelectionView&, const DecodeOptions&); \
  PREFIX template std::size_t dense_decode_workspace_bytes<T, KV>(const QueryView<const T>&, const KV&,          \
                                                                  const DecodeOptions&);                         \
  KVSIFT_CUDA_DECODE_OUTPUT(PREFIX, T, KV, T)                                                                    \
  KVSIFT_CUDA_DECODE_OUTPUT(PREFIX, T, KV, float)
#define KVSIFT_CUDA_MERGE(PREFIX, TI, TO) \
  PREFIX template void merge_states<TI, TO>(std::span<const StateView<const TI>>, const StateView<TO>&, cudaStream_t);
#define KVSIFT_DECLARE_DECODE(T, KV) KVSIFT_CUDA_DECODE(extern, T, KV)
#define KVSIFT_DECLARE_MERGE(TI, TO) KVSIFT_CUDA_MERGE(extern, TI, TO)
KVSIFT_DECODE_TYPES(KVSIFT_DECLARE_DECODE)
KVSIFT_MERGE_TYPES(KVSIFT_DECLARE_MERGE)
#undef KVSIFT_DECLARE_DECODE
#undef KVSIFT_DECLARE_MERGE

}  // namespace kvsift::cuda
