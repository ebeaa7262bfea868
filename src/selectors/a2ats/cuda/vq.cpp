// Codebook quantization, lookup tables and code scan on CUDA (selectors/a2ats/cuda/vq.hpp): the checks shared with the CPU, the
// launch shapes (blocks per sequence and kv head, the cluster of the fused form), then kernels/selectors/a2ats/vq.cu's launchers.
#include "kvsift/selectors/a2ats/cuda/vq.hpp"

#include <algorithm>
#include <optional>
#include <span>

#include "kvsift/cuda/backend.hpp"
#include "kvsift/cuda/detail/topk_launch.hpp"
#include "kvsift/selectors/a2ats/detail/vq_checks.hpp"
#include "kvsift/selectors/a2ats/detail/vq_topk.hpp"
#include "kvsift/selectors/a2ats/detail/vq_instances.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cuda/check.hpp"
#include "kvsift/selectors/a2ats/cuda/detail/vq_encode_launch.hpp"
#include "kvsift/selectors/a2ats/cuda/detail/vq_launch.hpp"

namespace kvsift::cuda {
namespace {

constexpr std::int32_t kScanThreads = 256;
constexpr std::int32_t kTokensPerThread = 8;  ///< a block's share is at least this many tokens per thread
constexpr std::int32_t kBlocksPerSm = 2;      ///< scan blocks in flight per SM aimed at (fused: the tables' shared memory allows ~3 at 64 KB)
constexpr std::int32_t kFusedCluster = 8;     ///< portable cluster size on sm_90

/// Blocks per (sequence, kv head): enough for kBlocksPerSm per SM over all rows, no more than the longest row needs,
/// a multiple of `cluster`.
detail::VqScanGrid scan_grid(std::int32_t batch, std::int32_t kv_heads, std::int32_t cols, std::int32_t cluster) {
  const std::int64_t rows = std::int64_t(batch) * kv_heads;
  const std::int64_t wanted = (std::int64_t(kBlocksPerSm) * multiprocessor_count() + rows - 1) / rows;
  const std::int64_t useful = (std::int64_t(cols) + kScanThreads * kTokensPerThread - 1) / (kScanThreads * kTokensPerThread);
  std::int64_t parts = std::max<std::int64_t>(1, std::min(wanted, useful));
  parts = (parts + cluster - 1) / cluster * cluster;
  return {std::int32_t(parts), cluster};
}

int compute_capability_major() {
  int device = 0, major = 0;
  KVSIFT_CUDA_CHECK(cudaGetDevice(&device));
  KVSIFT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major;
}

void check_grid(const char* where, std::int32_t batch) {
  KVSIFT_CHECK(batch <= 65535, where, "batch (= {}) exceeds the launch limit of 65535 sequences", batch);
}

void check_group(const char* where, std::int32_t q_heads, std::int32_t kv_heads) {
  KVSIFT_CHECK(q_heads / kv_heads <= detail::kVqMaxGroup, where,
               "q_heads / kv_heads (= {}) exceeds {} query heads per kv head", q_heads / kv_heads, detail::kVqMaxGroup);
}

bool fused_fits(std::int32_t group, std::int32_t codewords, std::int32_t head_dim) {
  return detail::vq_fused_smem_bytes(group, codewords, head_dim) <= std::size_t(max_shared_memory_per_block());
}

MatrixView<const float> as_const(const MatrixView<float>& m) { return {m.data, m.rows, m.cols, m.row_stride}; }

/// Blocks per (row group, kv head) of the few-rows encode: as many as give every SM one block, at most a portable
/// cluster (sm_90; else 1) and one per 64-codeword stage of the codebook.
std::int32_t encode_split(std::int64_t rows, std::int32_t kv_heads, std::int32_t codewords) {
  if (compute_capability_major() < 9) return 1;
  const std::int64_t pairs = (rows + detail::kVqEncodeGroupRows - 1) / detail::kVqEncodeGroupRows * kv_heads;
  const std::int64_t stages = (std::int64_t(codewords) + detail::kVqEncodeChunk - 1) / detail::kVqEncodeChunk;
  const std::int64_t split = std::min({std::int64_t(multiprocessor_count()) / pairs,
                                       std::int64_t(detail::kVqEncodeMaxSplit), stages});
  return std::int32_t(std::max<std::int64_t>(1, split));
}

}  // namespace

void vq_codeword_norms(const MatrixView<const float>& centroids, float* d_norms, const Context& ctx) {
  kvsift::detail::check_vq_norms_shape("cuda::vq_codeword_norms", centroids, d_norms);
  KVSIFT_CUDA_CHECK(detail::launch_vq_codeword_norms(centroids, d_norms, ctx.stream));
}

std::size_t vq_encode_workspace_bytes(std::int32_t codewords, std::int32_t head_dim, const Context&) {
  constexpr const char* where = "cuda::vq_encode_workspace_bytes";
  kvsift::detail::check_vq_codewords(where, "codewords", codewords);
  kvsift::detail::check_supported(where, "codebook.head_dim", head_dim, kVqHeadDims);
  return 0;
}

template <class T>
void vq_encode(const HeadsView<const T>& keys, const VqEncodeCodebook& codebook, const VqCodesView<std::uint16_t>& codes,
               const VqCodeDestination& destination, std::span<std::byte>, const Context& ctx) {
  constexpr const char* where = "cuda::vq_encode";
  kvsift::detail::check_vq_encode(where, keys, codebook, codes);
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(codebook.centroids) % 16 == 0, where,
               "codebook.centroids ({}) is not 16-byte aligned", static_cast<const void*>(codebook.centroids));
  if (keys.batch <= detail::kVqEncodeFewRows) {
    KVSIFT_CUDA_CHECK(detail::launch_vq_encode_few(keys, codebook, codes, destination,
                                                   encode_split(keys.batch, keys.heads, codebook.codewords), ctx.stream));
    return;
  }
  KVSIFT_CUDA_CHECK(detail::launch_vq_encode_mma(keys, codebook, codes, destination, ctx.stream));
}

namespace {
/// vq_lut, checked under `where`; the launch also zeroes `zeroed` (vq_topk_rows' count select scratch).
template <class T>
void checked_vq_lut(const char* where, const QueryView<const T>& q, const VqCodebook<T>& codebook,
                    const MatrixView<float>& lut, std::span<std::uint32_t> zeroed, const Context& ctx) {
  kvsift::detail::check_vq_query(where, q, codebook);
  kvsift::detail::check_vq_lut_shape(where, "lut", as_const(lut), q.batch, q.heads, codebook.codewords);
  check_grid(where, q.batch);
  check_group(where, q.heads, codebook.kv_heads);
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(codebook.data) % 16 == 0, where,
               "codebook.data ({}) is not 16-byte aligned", static_cast<const void*>(codebook.data));
  KVSIFT_CUDA_CHECK(detail::launch_vq_lut(q, codebook, lut, zeroed, ctx.stream));
}
}  // namespace

template <class T>
void vq_lut(const QueryView<const T>& q, const VqCodebook<T>& codebook, const MatrixView<float>& lut, const Context& ctx) {
  checked_vq_lut("cuda::vq_lut", q, codebook, lut, {}, ctx);
}

void vq_code_scan(const MatrixView<const float>& lut, std::int32_t batch, const VqCodesView<const std::uint16_t>& codes,
                  const std::int32_t* d_slots, const std::int32_t* d_lengths, const MatrixView<float>& scores,
                  const VqScanOptions& options, const Context& ctx) {
  constexpr const char* where = "cuda::vq_code_scan";
  KVSIFT_CHECK(batch > 0 && lut.rows % batch == 0, where, "lut.rows (= {}) is not a positive multiple of batch (= {})",
               lut.rows, batch);
  const auto q_heads = std::int32_t(lut.rows / batch);
  kvsift::detail::check_vq_lut_shape(where, "lut", lut, batch, q_heads, lut.cols);
  kvsift::detail::check_vq_codewords(where, "lut.cols", lut.cols);
  kvsift::detail::check_vq_scan(where, batch, q_heads, codes, d_slots, d_lengths, scores, options);
  check_grid(where, batch);
  KVSIFT_CUDA_CHECK(detail::launch_vq_code_scan(lut, batch, codes, d_slots, d_lengths, scores, options,
                                                scan_grid(batch, codes.kv_heads, scores.cols, 1), ctx.stream));
}

std::size_t vq_lut_scan_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                        std::int32_t codewords, std::int32_t head_dim, const Context&) {
  constexpr const char* where = "cuda::vq_lut_scan_workspace_bytes";
  KVSIFT_CHECK(batch > 0 && kv_heads > 0 && q_heads > 0 && q_heads % kv_heads == 0, where,
               "batch (= {}), q_heads (= {}) and kv_heads (= {}) must be positive, q_heads a multiple of kv_heads",
               batch, q_heads, kv_heads);
  kvsift::detail::check_vq_codewords(where, "codewords", codewords);
  kvsift::detail::check_supported(where, "codebook.head_dim", head_dim, kVqHeadDims);
  check_grid(where, batch);
  check_group(where, q_heads, kv_heads);  // what the run refuses, the query refuses too
  if (fused_fits(q_heads / kv_heads, codewords, head_dim)) return 0;
  WorkspaceLayout counting;
  counting.allocate<float>(checked_mul(std::size_t(batch) * std::size_t(q_heads), std::size_t(codewords), "vq_lut_scan tables"),
                           "vq_lut_scan tables");
  return counting.bytes();
}

template <class T>
void vq_lut_scan(const QueryView<const T>& q, const VqCodebook<T>& codebook, const VqCodesView<const std::uint16_t>& codes,
                 const std::int32_t* d_slots, const std::int32_t* d_lengths, const MatrixView<float>& scores,
                 const VqScanOptions& options, std::span<std::byte> workspace, const Context& ctx) {
  constexpr const char* where = "cuda::vq_lut_scan";
  kvsift::detail::check_vq_query(where, q, codebook);
  kvsift::detail::check_vq_scan(where, q.batch, q.heads, codes, d_slots, d_lengths, scores, options);
  KVSIFT_CHECK(codes.kv_heads == codebook.kv_heads, where, "codes.kv_heads (= {}) != codebook.kv_heads (= {})",
               codes.kv_heads, codebook.kv_heads);
  check_grid(where, q.batch);
  check_group(where, q.heads, codebook.kv_heads);
  KVSIFT_CHECK(reinterpret_cast<std::uintptr_t>(codebook.data) % 16 == 0, where,
               "codebook.data ({}) is not 16-byte aligned", static_cast<const void*>(codebook.data));
  const std::int32_t group = q.heads / codebook.kv_heads, count = codebook.codewords;
  if (fused_fits(group, count, q.head_dim)) {
    const std::int32_t cluster = compute_capability_major() >= 9 ? kFusedCluster : 1;
    KVSIFT_CUDA_CHECK(detail::launch_vq_lut_scan(q, codebook, codes, d_slots, d_lengths, scores, options,
                                                 scan_grid(q.batch, codebook.kv_heads, scores.cols, cluster), ctx.stream));
    return;
  }
  WorkspaceLayout layout(workspace, where);
  const std::size_t entries = std::size_t(q.batch) * std::size_t(q.heads) * std::size_t(count);
  float* tables = layout.allocate<float>(entries, "vq_lut_scan tables");
  const auto lut = MatrixView<float>::packed(tables, std::int64_t(q.batch) * q.heads, count);
  KVSIFT_CUDA_CHECK(detail::launch_vq_lut(q, codebook, lut, {}, ctx.stream));
  KVSIFT_CUDA_CHECK(detail::launch_vq_code_scan(as_const(lut), q.batch, codes, d_slots, d_lengths, scores, options,
                                                scan_grid(q.batch, codebook.kv_heads, scores.cols, 1), ctx.stream));
}

namespace {

/// vq_topk_rows' forms: the count select with a CTA per selection row or in slices of each row (vq_launch.hpp), or
/// the composed form (score rows, then topk_rows' kernels fed by the codes where they take words).
enum class VqTopKForm { count_rows, count_slices, composed };

/// The form that takes the call, from the shape alone (the count select implements every topk_rows option; a seed
/// is a hint it does not need), so the workspace holds only what the form reads: the count select where a
/// selection row has at most kVqCountSelectMaxHeads score rows and the form fits a block's shared memory, a CTA per
/// row from kVqCountSelectMinRows rows, else in slices where those are kVqCountSplitMinCtas CTAs or more.
VqTopKForm vq_topk_form(const VqTopKShape& shape) {
  const std::int32_t heads = kvsift::detail::vq_topk_heads_per_row(shape);
  if (heads > detail::kVqCountSelectMaxHeads) return VqTopKForm::composed;
  const auto fits = [](std::size_t bytes) {
    return bytes + detail::kVqCountSelectStaticSmem <= std::size_t(max_shared_memory_per_block());
  };
  const std::int64_t rows = std::int64_t(shape.batch) * shape.kv_heads;
  if (rows >= detail::kVqCountSelectMinRows && fits(detail::vq_count_row_smem_bytes(shape.codewords, heads))) {
    return VqTopKForm::count_rows;
  }
  const std::int32_t slices = detail::vq_count_slices(shape.max_tokens);
  const bool enough_ctas = rows >= detail::kVqCountSelectMinRows || rows * slices >= detail::kVqCountSplitMinCtas;
  return enough_ctas && fits(detail::vq_count_thresholds_smem_bytes(shape.codewords)) &&
                 fits(detail::vq_count_picks_smem_bytes(shape.codewords, shape.max_tokens, slices))
             ? VqTopKForm::count_slices
             : VqTopKForm::composed;
}

/// vq_topk_rows' layout: vq_lut's tables, then the split count select's scratch, or the composed form's buffers
/// (its score rows: 134 MB at 128K batch 8, union), which the top-k fed by the codes plans its call with.
struct VqTopKLayout {
  VqTopKForm form;
  std::int32_t slices;  ///< the count select's slices of a row (count_slices), else 0
  float* tables;
  std::optional<detail::VqCountSelectScratch> scratch;  ///< count_slices
  std::optional<kvsift::detail::VqTopKBuffers> composed;
};
VqTopKLayout vq_topk_layout(WorkspaceLayout& layout, const VqTopKShape& shape, const Context& ctx) {
  const VqTopKForm form = vq_topk_form(shape);
  VqTopKLayout b{form, form == VqTopKForm::count_slices ? detail::vq_count_slices(shape.max_tokens) : 0,
                 layout.allocate<float>(checked_mul(std::size_t(shape.batch) * std::size_t(shape.q_heads),
                                                    std::size_t(shape.codewords), "vq_topk_rows tables"),
                                        "vq_topk_rows tables"),
                 std::nullopt, std::nullopt};
  if (b.form == VqTopKForm::composed) b.composed = kvsift::detail::vq_topk_layout(layout, shape, ctx);
  if (b.form != VqTopKForm::count_slices) return b;
  const std::size_t rows = std::size_t(shape.batch) * std::size_t(shape.kv_heads);
  const std::size_t slices = std::size_t(b.slices);
  const std::size_t codes = std::size_t(shape.codewords) + 1;
  detail::VqCountSelectScratch scratch{};
  scratch.counts = layout.allocate<std::uint32_t>(rows * codes, "vq_topk_rows counts");
  scratch.classes = layout.allocate<std::uint32_t>(rows * codes, "vq_topk_rows classes");
  scratch.published_tied = layout.allocate<std::uint32_t>(rows * slices * detail::kVqCountSelectMaxHeads,
                                                          "vq_topk_rows published tied tokens");
  scratch.published = layout.allocate<std::uint32_t>(rows * slices, "vq_topk_rows published picks");
  scratch.row_state = layout.allocate<std::uint32_t>(2 * rows, "vq_topk_rows row states");
  if (scratch.counts != nullptr) {  // carving (counting hands out no pointers)
    scratch.zeroed_words = std::size_t(scratch.row_state + 2 * rows - scratch.counts);
  }
  scratch.quota = layout.allocate<std::uint32_t>(rows * detail::kVqCountSelectMaxHeads, "vq_topk_rows quotas");
  b.scratch = scratch;
  return b;
}

}  // namespace

std::size_t vq_topk_rows_workspace_bytes(const VqTopKShape& shape, const Context& ctx) {
  kvsift::detail::check_vq_topk_shape("cuda::vq_topk_rows_workspace_bytes", shape);
  WorkspaceLayout counting;
  vq_topk_layout(counting, shape, ctx);
  return counting.bytes();
}

template <class T>
void vq_topk_rows(const QueryView<const T>& q, const VqCodebook<T>& codebook, const VqCodesView<const std::uint16_t>& codes,
                  const std::int32_t* d_slots, const std::int32_t* d_lengths, const VqTopKShape& shape,
                  const TopKRowsOptions& options, const SelectionView& out, std::span<std::byte> workspace,
                  const Context& ctx) {
  constexpr const char* where = "cuda::vq_topk_rows";
  kvsift::detail::check_vq_topk_rows(where, q, codebook, codes, d_slots, d_lengths, "d_lengths", shape, options, out);
  WorkspaceLayout layout(workspace, where);
  const VqTopKLayout b = vq_topk_layout(layout, shape, ctx);
  std::optional<detail::TopKRowsParams> params;
  if (b.form == VqTopKForm::composed) {
    params = detail::topk_rows_params(where, as_const(b.composed->scores), d_lengths, shape.k, options, out,
                                      b.composed->topk);
    if (!detail::topk_rows_takes_words(*params) || shape.codewords > detail::kVqTopKMaxCodewords) {
      kvsift::detail::vq_topk_rows_composed(q, codebook, codes, d_slots, d_lengths, shape, options, out, *b.composed,
                                            ctx);
      return;
    }
  }
  checked_vq_lut(where, q, codebook, MatrixView<float>::packed(b.tables, std::int64_t(q.batch) * q.heads, codebook.codewords),
                 b.scratch ? std::span<std::uint32_t>(b.scratch->counts, b.scratch->zeroed_words) : std::span<std::uint32_t>{},
                 ctx);
  const detail::VqTopKWords words{.tables = b.tables,
                                  .codes = codes,
                                  .slots = d_slots,
                                  .lengths = d_lengths,
                                  .codewords = codebook.codewords,
                                  .group = q.heads / codebook.kv_heads,
                                  .group_max = shape.scan.group_max};
  if (b.form != VqTopKForm::composed) {
    KVSIFT_CUDA_CHECK(detail::launch_vq_count_select({.words = words,
                                                      .row_k = options.row_k,
                                                      .k = shape.k,
                                                      .window = options.window,
                                                      .max_tokens = shape.max_tokens,
                                                      .out = out,
                                                      .rows = std::int64_t(q.batch) * codebook.kv_heads,
                                                      .nan_marks_row = options.nan_marks_row,
                                                      .slices = b.slices,
                                                      .scratch = b.scratch.value_or(detail::VqCountSelectScratch{})},
                                                     ctx.stream));
    return;
  }
  KVSIFT_CUDA_CHECK(detail::launch_vq_topk_rows(*params, words, ctx.stream));
}

KVSIFT_STORAGE_TYPES(KVSIFT_VQ_INSTANCES)

}  // namespace kvsift::cuda
