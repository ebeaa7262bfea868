// CPU decode attention: validation and dispatch (baseline ISA flags); kernels in kernels_<level>.cpp.
#include "kvsift/cpu/decode.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvsift/attention/state.hpp"
#include "kvsift/core/validate.hpp"
#include "kvsift/core/workspace.hpp"
#include "kvsift/cpu/detail/decode_kernels.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::cpu {
namespace {

struct SplitWorkspace {
  float* partial_o = nullptr;
  float* partial_lse = nullptr;
};

/// The single layout behind decode_workspace_bytes and the carving in run().
SplitWorkspace layout_split_workspace(WorkspaceLayout& layout, std::int64_t batch, std::int64_t q_heads,
                                      std::int64_t head_dim, std::int32_t splits) {
  SplitWorkspace ws;
  if (splits > 1) {
    const std::size_t states = checked_mul(std::size_t(splits), std::size_t(batch * q_heads), "cpu decode workspace");
    ws.partial_o =
        layout.allocate<float>(checked_mul(states, std::size_t(head_dim), "cpu decode workspace"), "partial_o");
    ws.partial_lse = layout.allocate<float>(states, "partial_lse");
  }
  return ws;
}

template <class T, class KV>
std::int32_t longest_row(const QueryView<const T>& q, const KV& kv, const SelectionView* selection,
                         const AttentionOptions& attention) {
  const AttentionWindow& window = attention.window;
  const std::int32_t page_size = attention.selection_page_size;
  std::int32_t longest = 0;
  for (std::int32_t b = 0; b < q.batch; ++b) {
    if (selection == nullptr) {
      longest = std::max(longest, kv.seq_len(b));
    } else {
      const std::int64_t r = attended_selection_row(attention.selection_rows, b, selection->batch);
      if (r < 0) continue;  // a bad row: it attends nothing
      for (std::int32_t h = 0; h < kv.kv_heads; ++h) {
        const bool all = selection->attend_all != nullptr && selection->attend_all[selection->row_index(r, h)] != 0;
        const std::int32_t count = selection->count(r, h);
        const bool bad = count < 0 || count > selection->capacity;  // attends nothing (SelectionView::counts)
        const std::int64_t entries = window.size(kv.seq_len(b)) + std::int64_t(count) * page_size;
        longest = std::max(longest, all ? kv.seq_len(b) : bad ? 0 : std::int32_t(std::min<std::int64_t>(entries, INT32_MAX)));
      }
    }
  }
  return longest;
}

template <class T, class KV, class TO>
void run(const char* where, const QueryView<const T>& q, const KV& kv, const SelectionView* selection,
         const StateView<TO>& out, const DecodeOptions& options, ThreadPool* pool, std::span<std::byte> workspace) {
  validate(q, where, "q");
  validate(kv, where, "kv", MemorySpace::host);
  validate(out, where, "out");
  check_decode_shapes(where, q, kv, out);
  KVSIFT_CHECK(q.head_dim <= detail::kMaxHeadDim, where,
               "head_dim (= {}) exceeds the CPU decode kernels' limit of {}", q.head_dim, detail::kMaxHeadDim);
  detail::DecodeJob<T, KV, TO> job{q, kv, {}, out, q.heads / kv.kv_heads,
                               options.attention.resolved_scale(q.head_dim) * kLog2e};
  if (selection == nullptr) check_no_window(where, options.attention);
  if (selection != nullptr) {
    validate(*selection, kv, where, "selection", options.attention.selection_rows);
    validate(options.attention.window, where, "options.attention.window");
    check_selection_page_size(where, "options.attention.selection_page_size", options.attention.selection_page_size);
    job.window = options.attention.window;
    job.page_size = options.attention.selection_page_size;
    // Without validation a count outside [0, capacity], or a row map value outside the selection, is not refused
    // but makes its row NaN, as on CUDA, where the host cannot see it (SelectionView::counts).
    if (options.validate_indices) {
      check_selection_contents(*selection, kv, where, "selection", /*refuse_duplicates=*/true, job.window,
                               job.page_size, options.attention.selection_rows);
    }
    job.selection = *selection;
    job.selection_rows = options.attention.selection_rows;
  }
  const std::int64_t rows = std::int64_t(q.batch) * kv.kv_heads;
  if (!workspace.empty() && pool != nullptr) {
    job.splits = detail::decode_splits(rows, pool->size(), longest_row(q, kv, selection, options.attention));
  }
  WorkspaceLayout layout(workspace, where);
  const SplitWorkspace ws = layout_split_workspace(layout, q.batch, q.heads, q.head_dim, job.splits);
  job.partial_o = ws.partial_o;
  job.partial_lse = ws.partial_lse;
  with_simd_level([&]<SimdLevel L>() {
    const bool bf16_dot = L == SimdLevel::avx512 && std::is_same_v<T, bfloat16> && cpu_has_avx512_bf16();
    parallel_for(pool, rows * job.splits, [&](std::int64_t begin, std::int64_t end) {
      detail::decode_items<L, T, KV, TO>(job, begin, end, bf16_dot);
    });
  });
  if (job.splits == 1) return;
  std::array<StateView<const float>, detail::kMaxDecodeSplits> partials;
  const std::size_t states = std::size_t(q.batch) * q.heads;
  for (std::int32_t s = 0; s < job.splits; ++s) {
    partials[s] = StateView<const float>::packed(job.partial_o + s * states * q.head_dim, job.partial_lse + s * states,
                                                 q.batch, q.heads, q.head_dim);
  }
  merge_states<float, TO>(std::span(partials.data(), std::size_t(job.splits)), out);
}

}  // namespace

namespace detail {

std::int32_t decode_splits(std::int64_t rows, int threads, std::int32_t longest_row) {
  if (rows >= threads) return 1;
  std::int32_t best = 1;
  double best_load = 1.0;  // the busiest thread's work, in rows
  for (std::int32_t s = 2; s <= kMaxDecodeSplits; ++s) {
    const double load = double((rows * s + threads - 1) / threads) / s;
    if (load < best_load - 1e-9) best = s, best_load = load;
  }
  return std::min(best, std::max(1, longest_row / kMinTokensPerSplit));
}

}  // namespace detail

std::size_t decode_workspace_bytes(std::int32_t batch, std::int32_t q_heads, std::int32_t kv_heads,
                                   std::int32_t head_dim, const ThreadPool* pool) {
  KVSIFT_CHECK(batch > 0 && q_heads > 0 && kv_heads > 0 && head_dim > 0, "cpu::decode_workspace_bytes",
               "batch (= {}), q_heads (= {}), kv_heads (= {}) and head_dim (= {}) must be positive", batch, q_heads,
               kv_heads, head_dim);
  if (pool == nullptr) return 0;
  WorkspaceLayout counting;
  layout_split_workspace(counting, batch, q_heads, head_dim,
                         detail::decode_splits(std::int64_t(batch) * kv_heads, pool->size()));
  return counting.bytes();
}

template <class T, class KV, class TO>
void sparse_decode(const QueryView<const T>& q, const KV& kv, const SelectionView& selection, const StateView<TO>& out,
                   const DecodeOptions& options, ThreadPool* pool, std::span<std::byte> workspace) {
  run("cpu::sparse_decode", q, kv, &selection, out, options, pool, workspace);
}

template <class T, class KV, class TO>
void dense_decode(const QueryView<const T>& q, const KV& kv, const StateView<TO>& out, const DecodeOptions& options,
                  ThreadPool* pool, std::span<std::byte> workspace) {
  run("cpu::dense_decode", q, kv, nullptr, out, options, pool, workspace);
}

template <class TI, class TO>
void merge_states(std::span<const StateView<const TI>> partials, const StateView<TO>& out) {
  constexpr const char* where = "cpu::merge_states";
  validate_merge_inputs(where, partials, out);
  for (std::int32_t b = 0; b < out.batch; ++b) {
    for (std::int32_t h = 0; h < out.heads; ++h) {
      float lse_max = negative_infinity<float>();
      for (const auto& p : partials) lse_max = max_nan(lse_max, p.lse_at(b, h));
      float weight_sum = 0.0f;
      for (const auto& p : partials) weight_sum += state_weight(p.lse_at(b, h), lse_max);
      // Channels go in slices whose sums stay on the stack, so each partial's weight (an exp) is computed
      // once per slice rather than once per channel.
      constexpr std::int32_t kSlice = 64;
      TO* o = out.o_row(b, h);
      for (std::int32_t c0 = 0; c0 < out.head_dim; c0 += kSlice) {
        const std::int32_t width = std::min(kSlice, out.head_dim - c0);
        float acc[kSlice] = {};
        for (const auto& p : partials) {
          // Only an empty partial is skipped: a weight that underflowed to 0 still multiplies, so a NaN in
          // that partial's O shows (0 * NaN), as in one pass over all its tokens.
          if (p.lse_at(b, h) == negative_infinity<float>()) continue;
          const float w = state_weight(p.lse_at(b, h), lse_max);
          const TI* po = p.o_row(b, h) + c0;
          for (std::int32_t c = 0; c < width; ++c) acc[c] += w * to_float(po[c]);
        }
        for (std::int32_t c = 0; c < width; ++c) {
          o[c0 + c] = from_float<TO>(weight_sum == 0.0f ? 0.0f : acc[c] / weight_sum);
        }
      }
      out.lse_at(b, h) = merged_lse(lse_max, weight_sum);
    }
  }
}

#define KVSIFT_INSTANTIATE(T, KV, TO)                                                                            \
  template void sparse_decode<T, KV, TO>(const QueryView<const T>&, const KV&, const SelectionView&,            \
                                         const StateView<TO>&, const DecodeOptions&, ThreadPool*, std::span<std::byte>); \
  template void dense_decode<T, KV, TO>(const QueryView<const T>&, const KV&, const StateView<TO>&,              \
                                        const DecodeOptions&, ThreadPool*, std::span<std::byte>);
#define KVSIFT_INSTANTIATE_OUTPUTS(T, KV) KVSIFT_INSTANTIATE(T, KV, T) KVSIFT_INSTANTIATE(T, KV, float)
KVSIFT_DECODE_TYPES(KVSIFT_INSTANTIATE_OUTPUTS)
#undef KVSIFT_INSTANTIATE_OUTPUTS
#undef KVSIFT_INSTANTIATE
#define KVSIFT_INSTANTIATE_MERGE(TI, TO) \
  template void merge_states<TI, TO>(std::span<const StateView<const TI>>, const StateView<TO>&);
KVSIFT_MERGE_TYPES(KVSIFT_INSTANTIATE_MERGE)
#undef KVSIFT_INSTANTIATE_MERGE

}  // namespace kvsift::cpu
