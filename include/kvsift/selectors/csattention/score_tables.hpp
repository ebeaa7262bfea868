#pragma once
/// Subspace score tables: CSAttention's index (selectors/csattention/csattention.hpp, docs/csattention.md), backend-neutral.
/// selectors/csattention/cpu/score_tables.hpp and selectors/csattention/cuda/score_tables.hpp implement the same primitives over this view with the same
/// results, bit for bit; the rules both follow are here, written once for host and device.
///
/// head_dim splits into `subspaces` sub-vectors of width w = head_dim / subspaces (SubspaceSplit). A table head
/// (a query head, or a kv head whose GQA group shares its tables) has, per subspace, `centroids` unit centroids
/// of the prefill queries' sub-vectors; each (subspace s, centroid c) owns list s * centroids + c: the `length`
/// keys with the largest partial scores c . k^(s) over the prompt, ids and fp16 scores.
///
/// A base is the index of one prompt: centroids and lists, immutable once built. Slots (live sequences) point at
/// a base, so sequences that share a prompt share its index. What a sequence's decoding inserts lives in its slot's
/// overlay: per list, the `evicted` lowest entries of the base list no longer count, and an overlay min-heap holds
/// the inserted keys. The list a sequence reads is base[0, base_count - evicted) + overlay[0, overlay_size): it
/// keeps the size its base built it with (base_count, at most `length`, the storage per list), and holds the top
/// base_count (by the list order) of the prompt's keys and of the keys inserted since. Every insert that enters
/// either evicts a base entry and grows the overlay or replaces the overlay's root, so overlay_size == evicted
/// while the overlay has room; overlay_capacity bounds the evictions.
///
/// Scores: a partial score is rounded to fp16 when it is computed (table_score), and is ranked and compared as
/// stored. Sums over lists are exact: an fp16 value is a multiple of 2^-24 and a weight (table_weight) an integer
/// count of 2^-6, so weighted sums run in int64 units of 2^-30 in any order with one result, rounded to fp32 once
/// at the end (fixed_to_float). Bounds that keep them exact: |score| <= 65504 (2^40 units), weights <= 2^12, at
/// most kMaxTableBlock entries per query head's sum: below 2^63.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvsift/core/config.hpp"
#include "kvsift/core/dtype.hpp"
#include "kvsift/core/inverted_lists.hpp"
#include "kvsift/core/slot_grid.hpp"

namespace kvsift {

/// Centroids a query may probe per subspace (nearest_centroids' probes).
inline constexpr std::int32_t kMaxTableProbes = 64;

/// Which head_dim channels form a subspace.
enum class SubspaceSplit : std::uint8_t {
  /// Subspace s is channels [s * w, (s + 1) * w): the paper's equal contiguous split.
  contiguous,
  /// Subspace s is channels [s * w/2, (s + 1) * w/2) and the same range shifted by head_dim / 2: with the NeoX RoPE
  /// layout (channel i rotates with i + head_dim / 2), every rotation pair stays inside one subspace. w must be
  /// even. (With the interleaved GPT-J layout, `contiguous` with an even w already keeps pairs.)
  rope_pairs,
};

/// Channel of element j (< width) of subspace s, for head_dim = subspaces * width.
KVSIFT_HOST_DEVICE constexpr std::int32_t subspace_channel(SubspaceSplit split, std::int32_t s, std::int32_t j,
                                                           std::int32_t width, std::int32_t head_dim) {
  if (split == SubspaceSplit::contiguous) return s * width + j;
  const std::int32_t half_width = width / 2;
  return j < half_width ? s * half_width + j : head_dim / 2 + s * half_width + (j - half_width);
}

/// The table form of a partial score: fp16, round to nearest even, saturated to +-65504 (so that sums stay
/// finite), NaN stored as -65504 (a NaN key never outranks a number).
KVSIFT_HOST_DEVICE constexpr float table_score(float x) {
  constexpr float kMax = 65504.0f;
  const float clamped = !(x == x) ? -kMax : x > kMax ? kMax : x < -kMax ? -kMax : x;
  return half_to_float(float_to_half(clamped));
}
/// A table score in int64 units of 2^-24 (exact: fp16 values are multiples of 2^-24 below 2^16 in magnitude).
KVSIFT_HOST_DEVICE constexpr std::int64_t fixed_score(float table_value) {
  return static_cast<std::int64_t>(table_value * 16777216.0f);
}
/// Weights of chosen lists, in units of 2^-6: kTableWeightOne is 1.
inline constexpr std::int32_t kTableWeightOne = 64;
inline constexpr std::int32_t kMaxTableWeight = 4096;
/// Entries of one query head's sum at most: subspaces * probes chosen lists (kvsift checks the product).
inline constexpr std::int32_t kMaxTableBlock = 512;
/// A query sub-vector's norm as a weight: round(norm * 64) (to nearest, ties to even), clamped to [0, 4096]; NaN
/// gives 0. norm is the fp32 square root (correctly rounded) of the fp32 FMA sum of squares in ascending
/// element order.
KVSIFT_HOST_DEVICE inline std::int32_t table_weight(float norm) {
  const float scaled = norm * 64.0f;
  if (!(scaled > 0.0f)) return 0;
  if (scaled >= float(kMaxTableWeight)) return kMaxTableWeight;
#if defined(__CUDA_ARCH__)
  return __float2int_rn(scaled);
#else
  return static_cast<std::int32_t>(std::nearbyint(scaled));
#endif
}
/// An exact weighted sum (units of 2^-30) as fp32: rounded once (to nearest even), then scaled by 2^-30 (exact).
KVSIFT_HOST_DEVICE inline float fixed_to_float(std::int64_t sum) {
  return static_cast<float>(sum) * (1.0f / 1073741824.0f);
}

/// How the reductions weigh an entry of a chosen list: weight * (score - floor).
struct TableScoreOptions {
  /// Optional [rows, chosen.capacity]: each chosen list's weight (nearest_centroids' query sub-vector norms);
  /// nullptr: every list kTableWeightOne (the paper's w_b = 1).
  const std::int32_t* weights = nullptr;
  /// false: floor 0 (the paper: a key absent from a list adds nothing, as if its partial score were 0). true: the
  /// list's lowest entry, so a key absent from a list counts as if it scored that list's lowest, an upper bound on
  /// its true partial (kvsift's option, docs/csattention.md: truncated lists otherwise favour keys whose negative
  /// partials they drop).
  bool from_floor = false;
};

/// Tokens per range of the token order (TokenOrderView).
inline constexpr std::int32_t kTableTokenRange = 1024;
/// Ranges of a token order at most (a CUDA CTA counts a list's ranges in shared memory): prompts of up to 12M tokens.
inline constexpr std::int32_t kMaxTableTokenRanges = 12288;
/// Ranges of the token order for prompts of up to `tokens` tokens.
KVSIFT_HOST_DEVICE constexpr std::int32_t table_token_ranges(std::int32_t tokens) {
  return (tokens + kTableTokenRange - 1) / kTableTokenRange;
}
/// A token-order entry: the fp16 bits of the entry's score above the low 16 bits of its id.
KVSIFT_HOST_DEVICE constexpr std::uint32_t token_order_entry(std::uint16_t score_bits, std::int32_t id) {
  return std::uint32_t(score_bits) << 16 | (std::uint32_t(id) & 0xffffu);
}

/// The base lists' entries grouped by token range, a second copy of each base list for CUDA's table_scores_dense
/// (so that a CTA owning a range of tokens reads the entries of its range alone; cuda::order_table_lists builds it
/// from the lists, CPU backends have none). Per base, table head and list: `offsets` [ranges + 1], ascending, entry
/// offsets[r] .. offsets[r + 1] of `entries` [length] (token_order_entry) the list's entries with ids in range r
/// ([r * kTableTokenRange, (r + 1) * kTableTokenRange)), in no particular order within a range; `prompt` [bases] the
/// tokens a base's lists were built over (its overlays' ids are at or past it). Entries are the whole base list,
/// its evicted ones included: a reader drops an entry below the list's lowest kept one.
template <class U>
struct TokenOrderView {
  U* entries = nullptr;  ///< [bases, table_heads, lists, length]
  std::conditional_t<std::is_const_v<U>, const std::int32_t, std::int32_t>* offsets = nullptr;  ///< [bases, table_heads, lists, ranges + 1]
  std::conditional_t<std::is_const_v<U>, const std::int32_t, std::int32_t>* prompt = nullptr;   ///< [bases]
  std::int32_t ranges = 0;

  constexpr TokenOrderView<const U> as_const() const
    requires(!std::is_const_v<U>)
  {
    return {entries, offsets, prompt, ranges};
  }
};

/// The tables of `bases` prompts and the overlays of `slots` sequences. All arrays packed, row-major in the
/// order of their shapes; lists per table head = subspaces * centroids. C (const-qualified or not) is the
/// constness of everything written after prepare: the overlay arrays. The base arrays are const here: they are
/// written by build primitives through BaseTablesView.
///   centroids     [bases, table_heads, subspaces, centroids, width] fp32, unit norm (or zero)
///   base_ids      [bases, table_heads, lists, length] int32, each list highest first in the list order
///                 (core/inverted_lists.hpp list_entry_below: score, then the smaller id higher)
///   base_scores   same shape, fp16 table scores
///   base_counts   [bases, table_heads, lists], in [0, length]
///   slot_base     [slots]: the base each slot reads (a slot without a base is never passed to a primitive)
///   evicted       [slots, table_heads, lists], in [0, base_count]
///   overlay_ids / overlay_scores  [slots, table_heads, lists, overlay_capacity]: a min-heap in the list order
///                 (entry 0 the lowest), of overlay_sizes entries
///   overlay_sizes [slots, table_heads, lists], in [0, overlay_capacity]
template <class C>
struct ScoreTablesView {
  using index_type = std::conditional_t<std::is_const_v<C>, const std::int32_t, std::int32_t>;
  using score_type = std::conditional_t<std::is_const_v<C>, const half, half>;

  const float* centroids = nullptr;
  const std::int32_t* base_ids = nullptr;
  const half* base_scores = nullptr;
  const std::int32_t* base_counts = nullptr;
  const std::int32_t* slot_base = nullptr;
  index_type* evicted = nullptr;
  index_type* overlay_ids = nullptr;
  score_type* overlay_scores = nullptr;
  index_type* overlay_sizes = nullptr;
  std::int32_t bases = 0;
  std::int32_t slots = 0;
  std::int32_t table_heads = 0;
  std::int32_t subspaces = 0;
  std::int32_t centroids_per_subspace = 0;
  std::int32_t width = 0;   ///< head_dim / subspaces
  std::int32_t length = 0;  ///< entries stored per base list (a list's own size L is its base count)
  std::int32_t overlay_capacity = 0;
  SubspaceSplit split = SubspaceSplit::contiguous;
  /// The token order of the base lists (TokenOrderView; CUDA's table_scores_dense reads it, nothing else does).
  TokenOrderView<const std::uint32_t> token_order{};

  KVSIFT_HOST_DEVICE std::int32_t lists() const { return subspaces * centroids_per_subspace; }
  KVSIFT_HOST_DEVICE std::int32_t head_dim() const { return subspaces * width; }
  /// Index of list l of table head t of base (or slot) `owner` in the per-list arrays.
  KVSIFT_HOST_DEVICE std::int64_t list_index(std::int64_t owner, std::int64_t t, std::int64_t l) const {
    return SlotGrid{.heads = table_heads, .rows = lists()}.row_index(owner, t, l);
  }
  KVSIFT_HOST_DEVICE const float* centroid(std::int64_t base, std::int64_t t, std::int64_t s, std::int64_t c) const {
    return centroids + SlotGrid{bases, table_heads, lists(), width}.offset(base, t, s * centroids_per_subspace + c);
  }
  KVSIFT_HOST_DEVICE std::int64_t base_entry(std::int64_t base, std::int64_t t, std::int64_t l) const {
    return list_index(base, t, l) * length;
  }
  KVSIFT_HOST_DEVICE std::int64_t overlay_entry(std::int64_t slot, std::int64_t t, std::int64_t l) const {
    return list_index(slot, t, l) * overlay_capacity;
  }
  constexpr ScoreTablesView<const C> as_const() const
    requires(!std::is_const_v<C>)
  {
    return {centroids, base_ids,   base_scores, base_counts, slot_base, evicted, overlay_ids, overlay_scores,
            overlay_sizes, bases, slots, table_heads, subspaces, centroids_per_subspace, width, length,
            overlay_capacity, split, token_order};
  }

  // Array sizes (elements) of a shape.
  static constexpr std::size_t centroid_elements(std::int32_t bases, std::int32_t table_heads, std::int32_t subspaces,
                                                 std::int32_t centroids, std::int32_t width) {
    return std::size_t(bases) * std::size_t(table_heads) * std::size_t(subspaces) * std::size_t(centroids) *
           std::size_t(width);
  }
  static constexpr std::size_t list_count(std::int32_t owners, std::int32_t table_heads, std::int32_t subspaces,
                                          std::int32_t centroids) {
    return std::size_t(owners) * std::size_t(table_heads) * std::size_t(subspaces) * std::size_t(centroids);
  }
};

/// The base arrays of one base, writable: what the build primitives fill (centroids by k-means, lists by
/// store_table_lists). Same layouts as ScoreTablesView's, restricted to base `base`.
struct BaseTablesView {
  float* centroids = nullptr;     ///< [table_heads, subspaces, centroids, width]
  std::int32_t* ids = nullptr;    ///< [table_heads, lists, length]
  half* scores = nullptr;
  std::int32_t* counts = nullptr;  ///< [table_heads, lists]
  std::int32_t table_heads = 0;
  std::int32_t subspaces = 0;
  std::int32_t centroids_per_subspace = 0;
  std::int32_t width = 0;
  std::int32_t length = 0;  ///< entries stored per list
  SubspaceSplit split = SubspaceSplit::contiguous;
  /// This base's token order (pointers at its own arrays, prompt at its one value): cuda::order_table_lists
  /// writes it; empty where the tables keep none.
  TokenOrderView<std::uint32_t> token_order{};

  KVSIFT_HOST_DEVICE std::int32_t lists() const { return subspaces * centroids_per_subspace; }
};

namespace detail {

/// Whether entry (score a, id a) is below (b) in the list order: core/inverted_lists.hpp's rule on stored fp16
/// values (no NaN: table_score has none).
KVSIFT_HOST_DEVICE constexpr bool table_entry_below(float score_a, std::int32_t id_a, float score_b,
                                                    std::int32_t id_b) {
  return list_entry_below(score_a, id_a, score_b, id_b);
}

/// Exchanges entries i and j of a heap (ids and scores).
template <class Score>
KVSIFT_HOST_DEVICE void swap_table_entries(std::int32_t* ids, Score* scores, std::int32_t i, std::int32_t j) {
  const std::int32_t id = ids[i];
  ids[i] = ids[j];
  ids[j] = id;
  const Score s = scores[i];
  scores[i] = scores[j];
  scores[j] = s;
}
/// Restores the min-heap property below position i of a heap of `size` entries (ids, scores as float values).
template <class Score, class ToFloat>
KVSIFT_HOST_DEVICE void sift_down_table_heap(std::int32_t* ids, Score* scores, std::int32_t size, std::int32_t i,
                                             ToFloat to_f) {
  for (;;) {
    const std::int32_t left = 2 * i + 1, right = left + 1;
    std::int32_t lowest = i;
    if (left < size && table_entry_below(to_f(scores[left]), ids[left], to_f(scores[lowest]), ids[lowest])) lowest = left;
    if (right < size && table_entry_below(to_f(scores[right]), ids[right], to_f(scores[lowest]), ids[lowest])) lowest = right;
    if (lowest == i) return;
    swap_table_entries(ids, scores, i, lowest);
    i = lowest;
  }
}
/// Moves the entry at position i up a min-heap until its parent is below it.
template <class Score, class ToFloat>
KVSIFT_HOST_DEVICE void sift_up_table_heap(std::int32_t* ids, Score* scores, std::int32_t i, ToFloat to_f) {
  while (i > 0) {
    const std::int32_t parent = (i - 1) / 2;
    if (!table_entry_below(to_f(scores[i]), ids[i], to_f(scores[parent]), ids[parent])) return;
    swap_table_entries(ids, scores, i, parent);
    i = parent;
  }
}

/// The streaming insert of one key (id, table score `value`) into one list of a slot, the shared rule of both
/// backends. The list holds its base's kept entries base[0, kept) (kept = base_count - evicted, highest first)
/// and the overlay heap. While it holds fewer than base_count entries the key joins the overlay. Otherwise the
/// lowest entry, the lower of base[kept - 1] and the heap's root, is replaced exactly when it is below the key
/// (strictly: the new id is the largest, so an equal score keeps the older entry): a base entry by evicting it
/// (kept - 1) and pushing the key, the root by replacing it and sifting down. When the overlay is full and the
/// base entry is the lowest, the key competes with the root alone (the overlay's bound, docs/csattention.md).
/// Returns whether the key entered.
template <class ToFloat, class FromFloat>
KVSIFT_HOST_DEVICE bool insert_table_key(const std::int32_t* base_ids, const half* base_scores, std::int32_t base_count,
                                         std::int32_t& evicted, std::int32_t* heap_ids, half* heap_scores,
                                         std::int32_t& heap_size, std::int32_t capacity, std::int32_t id,
                                         float value, ToFloat to_f, FromFloat from_f) {
  const std::int32_t kept = base_count - evicted;
  if (kept + heap_size < base_count) {
    if (heap_size == capacity) return false;
    heap_ids[heap_size] = id;
    heap_scores[heap_size] = from_f(value);
    sift_up_table_heap(heap_ids, heap_scores, heap_size, to_f);
    ++heap_size;
    return true;
  }
  const bool base_lowest =
      kept > 0 && (heap_size == 0 || table_entry_below(to_f(base_scores[kept - 1]), base_ids[kept - 1],
                                                       to_f(heap_scores[0]), heap_ids[0]));
  if (base_lowest && heap_size < capacity) {
    if (!table_entry_below(to_f(base_scores[kept - 1]), base_ids[kept - 1], value, id)) return false;
    ++evicted;
    heap_ids[heap_size] = id;
    heap_scores[heap_size] = from_f(value);
    sift_up_table_heap(heap_ids, heap_scores, heap_size, to_f);
    ++heap_size;
    return true;
  }
  if (heap_size == 0 || !table_entry_below(to_f(heap_scores[0]), heap_ids[0], value, id)) return false;
  heap_ids[0] = id;
  heap_scores[0] = from_f(value);
  sift_down_table_heap(heap_ids, heap_scores, heap_size, 0, to_f);
  return true;
}

/// The lowest entry's fixed score of a list (its kept base part highest first, its overlay a min-heap); 0 when the
/// list is empty.
template <class ToFloat>
KVSIFT_HOST_DEVICE std::int64_t list_floor(const std::int32_t* base_ids, const half* base_scores, std::int32_t kept,
                                           const std::int32_t* heap_ids, const half* heap_scores, std::int32_t heap_size,
                                           ToFloat to_f) {
  if (kept == 0 && heap_size == 0) return 0;
  if (heap_size == 0) return fixed_score(to_f(base_scores[kept - 1]));
  if (kept == 0) return fixed_score(to_f(heap_scores[0]));
  const float base = to_f(base_scores[kept - 1]), heap = to_f(heap_scores[0]);
  return fixed_score(table_entry_below(base, base_ids[kept - 1], heap, heap_ids[0]) ? base : heap);
}

}  // namespace detail
}  // namespace kvsift
