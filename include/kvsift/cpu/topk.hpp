#pragma once
/// CPU top-K selection shared by every selector.
///
/// Order and ties: the K largest scores win; on equal scores the smaller index wins; NaN ranks below every
/// number. Output indices are written in ascending index order, so CPU and CUDA results compare exactly.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "kvsift/attention/options.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/thread_pool.hpp"

namespace kvsift::cpu {

namespace detail {
/// The score half of rank_key: ascending order is higher score first, NaN last; -0 and +0 are equal.
/// Integer operations only (no branch on the sign, which random scores would mispredict half the time).
inline std::uint32_t rank_word(float score) {
  std::uint32_t bits;
  std::memcpy(&bits, &score, sizeof(bits));
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  bits = magnitude == 0 ? 0u : bits;  // -0 and +0 are equal scores
  // Ascending float order as unsigned integers: negative numbers flip every bit, the others the sign bit.
  const std::uint32_t ascending = bits ^ (std::uint32_t(std::int32_t(bits) >> 31) | 0x80000000u);
  return magnitude > 0x7f800000u ? 0xffffffffu : ~ascending;  // NaN last
}
}  // namespace detail

/// Packs a score and its index into one integer whose ascending order is kvsift's ranking: higher score
/// first, NaN last, and on equal scores the smaller index first.
inline std::uint64_t rank_key(float score, std::int32_t index) {
  return (std::uint64_t(detail::rank_word(score)) << 32) | std::uint32_t(index);
}

namespace detail {
/// Writes into out[0, k) the indices held by the k smallest of keys[0, n) (rank_key order), ascending;
/// reorders the keys. 0 <= k <= n.
inline void best_of_keys(std::uint64_t* keys, std::int64_t n, std::int32_t k, std::int32_t* out) {
  std::nth_element(keys, keys + k, keys + n);
  for (std::int32_t i = 0; i < k; ++i) out[i] = std::int32_t(keys[i] & 0xffffffffu);
  std::sort(out, out + k);
}
}  // namespace detail

/// Writes into out[0, k) the indices of the k best of `scores`, ascending. `scratch` is reused between
/// calls to avoid allocation (it grows to scores.size()).
inline void topk_indices(std::span<const float> scores, std::int32_t k, std::span<std::int32_t> out,
                         std::vector<std::uint64_t>& scratch) {
  constexpr const char* where = "cpu::topk_indices";
  KVSIFT_CHECK(k >= 0 && static_cast<std::size_t>(k) <= scores.size(), where,
               "k (= {}) is outside [0, number of scores = {}]", k, scores.size());
  KVSIFT_CHECK(out.size() >= static_cast<std::size_t>(k), where, "out.size() (= {}) < k (= {})", out.size(), k);
  KVSIFT_CHECK(scores.size() <= std::size_t(INT32_MAX), where, "number of scores (= {}) exceeds 2^31 - 1",
               scores.size());
  scratch.resize(scores.size());
  for (std::size_t i = 0; i < scores.size(); ++i) scratch[i] = rank_key(scores[i], std::int32_t(i));
  detail::best_of_keys(scratch.data(), std::int64_t(scores.size()), k, out.data());
}

/// Bytes of host workspace (256-byte aligned) topk_rows needs for `rows` rows of max_tokens = scores.cols
/// scores on `pool` (nullptr: one thread): 8 * max_tokens bytes of rank keys for each of min(rows, threads)
/// threads. A run on a larger pool than the query's needs more and is refused.
std::size_t topk_rows_workspace_bytes(std::int64_t rows, std::int32_t max_tokens, const ThreadPool* pool);

/// Top-K per (sequence b, kv head g) row into a selection, among the tokens that the attention window leaves:
/// row = b * kv_heads + g of scores [batch * kv_heads, max_tokens] fp32 (group_scores' layout) holds the scores
/// of tokens [0, h_lengths[b]); the candidates are the middle [window.sink_end(len), window.recent_begin(len))
/// (sparse decode attends the window anyway, attention/options.hpp). Into out.row(b, g) go the indices of the
/// min(k, middle size) best candidates, ascending, and that number into out.counts[row]: higher score first,
/// NaN below every number, on equal scores the smaller index (rank_key); a middle of at most k tokens is
/// taken whole, an empty sequence gets count 0. Log-weights, if out has them, are set to 0 for the written
/// entries; entries past the count are not written.
///
/// Checked: k > 0, out.capacity >= k, scores.rows == out.batch * out.kv_heads, window sizes >= 0, every
/// h_lengths[b] in [0, scores.cols]. Memory: scores, h_lengths [out.batch], out and workspace in host memory.
/// workspace: topk_rows_workspace_bytes(scores.rows, scores.cols, pool) bytes, 256-byte aligned, contents
/// need not be initialized; a smaller buffer is refused. Rows run in parallel on `pool` (nullptr: the calling
/// thread); each row's result depends on that row alone, so it is identical for every thread count. No
/// allocation. Reentrant with distinct workspaces and outputs.
void topk_rows(const MatrixView<const float>& scores, const std::int32_t* h_lengths, std::int32_t k,
               const AttentionWindow& window, const SelectionView& out, std::span<std::byte> workspace,
               ThreadPool* pool = nullptr);

}  // namespace kvsift::cpu
