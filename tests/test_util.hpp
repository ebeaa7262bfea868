#pragma once
/// Helpers shared by kvsift's tests: seeded fresh randomness, poisoned outputs, owning host tensors and
/// conversions between KV layouts.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"
#include "kvsift/core/views.hpp"
#include "kvsift/cpu/simd.hpp"

namespace kvsift::test {

/// A fresh seed per test run (override with KVSIFT_TEST_SEED to reproduce); tests print it in SCOPED_TRACE.
inline std::uint64_t test_seed() {
  if (const char* s = std::getenv("KVSIFT_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return std::random_device{}() ^ (std::uint64_t(std::random_device{}()) << 32);
}

struct Random {
  explicit Random(std::uint64_t seed) : engine(seed) {}
  std::mt19937_64 engine;

  std::int32_t uniform_int(std::int32_t lo, std::int32_t hi) {  // inclusive
    return std::uniform_int_distribution<std::int32_t>(lo, hi)(engine);
  }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(engine); }
  /// Normal values that are never exactly zero, so an unwritten output cannot pass as a right one.
  std::vector<float> normal(std::size_t n, float stddev = 1.0f) {
    std::normal_distribution<float> dist(0.0f, stddev);
    std::vector<float> out(n);
    for (float& x : out) {
      do x = dist(engine);
      while (x == 0.0f);
    }
    return out;
  }
};

constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();
constexpr std::int32_t kPoisonIndex = -777;

/// fp32 values rounded to the storage type T.
template <class T>
std::vector<T> to_storage(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = from_float<T>(x[i]);
  return out;
}

/// Bit-for-bit equality of two arrays (NaN payloads included).
template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// Contiguous host KV cache [batch, kv_heads, capacity, head_dim] of floats, with random contents.
struct HostKV {
  std::int32_t batch, kv_heads, capacity, head_dim;
  std::vector<float> k, v;
  std::vector<std::int32_t> seq_lens;

  HostKV(Random& rng, std::int32_t batch_, std::int32_t kv_heads_, std::int32_t capacity_, std::int32_t head_dim_,
         std::vector<std::int32_t> lens = {})
      : batch(batch_), kv_heads(kv_heads_), capacity(capacity_), head_dim(head_dim_) {
    const std::size_t n = std::size_t(batch) * kv_heads * capacity * head_dim;
    k = rng.normal(n);
    v = rng.normal(n);
    seq_lens = lens.empty() ? std::vector<std::int32_t>(batch, capacity) : std::move(lens);
  }
  ContiguousKVView<const float> view() const {
    return ContiguousKVView<const float>::packed(k.data(), v.data(), batch, kv_heads, capacity, head_dim,
                                                 seq_lens.data());
  }
};

/// The same tokens as a HostKV, in a paged cache with shuffled pages (NHD or HND page layout).
struct HostPagedKV {
  std::vector<float> k_pages, v_pages;
  std::vector<std::int32_t> indptr, indices, last_len;
  PagedKVView<const float> view;

  HostPagedKV(const HostKV& src, std::int32_t page_size, bool hnd, Random& rng) {
    indptr.push_back(0);
    for (std::int32_t b = 0; b < src.batch; ++b) {
      const std::int32_t pages = (src.seq_lens[b] + page_size - 1) / page_size;
      indptr.push_back(indptr.back() + pages);
      last_len.push_back(pages == 0 ? 0 : src.seq_lens[b] - (pages - 1) * page_size);
    }
    const std::int32_t spare = 3;  // unused pages, so that indices do not simply cover [0, num_pages)
    const std::int32_t num_pages = indptr.back() + spare;
    std::vector<std::int32_t> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng.engine);
    indices.assign(perm.begin(), perm.begin() + indptr.back());
    const std::size_t page_elems = std::size_t(page_size) * src.kv_heads * src.head_dim;
    k_pages = rng.normal(page_elems * num_pages);
    v_pages = rng.normal(page_elems * num_pages);
    view = PagedKVView<const float>{
        .k_pages = k_pages.data(),
        .v_pages = v_pages.data(),
        .page_indptr = indptr.data(),
        .page_indices = indices.data(),
        .last_page_len = last_len.data(),
        .batch = src.batch,
        .kv_heads = src.kv_heads,
        .head_dim = src.head_dim,
        .page_size = page_size,
        .num_pages = num_pages,
        .page_stride = std::int64_t(page_elems),
        .token_stride = hnd ? src.head_dim : std::int64_t(src.kv_heads) * src.head_dim,
        .head_stride = hnd ? std::int64_t(page_size) * src.head_dim : src.head_dim,
    };
    const auto src_view = src.view();
    for (std::int32_t b = 0; b < src.batch; ++b) {
      for (std::int32_t h = 0; h < src.kv_heads; ++h) {
        for (std::int32_t t = 0; t < src.seq_lens[b]; ++t) {
          const std::int64_t off = view.offset(b, h, t);
          std::copy_n(src_view.k_row(b, h, t), src.head_dim, k_pages.data() + off);
          std::copy_n(src_view.v_row(b, h, t), src.head_dim, v_pages.data() + off);
        }
      }
    }
  }
};

/// Owning selection buffers with a SelectionView over them; indices and counts start poisoned.
struct HostSelection {
  std::vector<std::int32_t> indices, counts;
  std::vector<float> log_weights;
  SelectionView view;

  HostSelection(std::int32_t batch, std::int32_t kv_heads, std::int32_t capacity, bool with_weights)
      : indices(std::size_t(batch) * kv_heads * capacity, kPoisonIndex), counts(std::size_t(batch) * kv_heads, kPoisonIndex) {
    if (with_weights) log_weights.assign(indices.size(), kPoison);
    view = {indices.data(), counts.data(), with_weights ? log_weights.data() : nullptr, batch, kv_heads, capacity};
  }
};

/// Owning output state [batch, heads, head_dim] + LSE, poisoned with NaN.
struct HostState {
  std::vector<float> o, lse;
  StateView<float> view;
  HostState(std::int32_t batch, std::int32_t heads, std::int32_t head_dim)
      : o(std::size_t(batch) * heads * head_dim, kPoison), lse(std::size_t(batch) * heads, kPoison) {
    view = StateView<float>::packed(o.data(), lse.data(), batch, heads, head_dim);
  }
};

/// Naive fp64 attention of one query row over explicit (k, v, log-weight) rows: softmax over the full logit
/// vector, written independently of kvsift's reference. Returns LSE; o receives the output.
inline double naive_attention(const float* q, const std::vector<const float*>& ks, const std::vector<const float*>& vs,
                              const std::vector<double>& log_weights, std::int32_t d, double scale,
                              std::vector<double>& o) {
  o.assign(d, 0.0);
  if (ks.empty()) return -std::numeric_limits<double>::infinity();
  std::vector<long double> logits(ks.size());
  for (std::size_t i = 0; i < ks.size(); ++i) {
    long double s = 0;
    for (std::int32_t c = 0; c < d; ++c) s += (long double)q[c] * ks[i][c];
    logits[i] = s * scale + log_weights[i];
  }
  const long double m = *std::max_element(logits.begin(), logits.end());
  long double z = 0;
  for (auto l : logits) z += std::exp(l - m);
  for (std::size_t i = 0; i < ks.size(); ++i) {
    const long double p = std::exp(logits[i] - m) / z;
    for (std::int32_t c = 0; c < d; ++c) o[c] += double(p * vs[i][c]);
  }
  return double(m + std::log(z));
}

/// Tolerance for fp32 outputs rounded once from fp64 accumulation: a few ulps of fp32.
constexpr double kFp32RoundTol = 1e-6;

inline double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(double(a[i]) - b[i]);
    if (!(d <= m)) m = d;  // written so that a NaN difference sticks
  }
  return std::isnan(m) ? INFINITY : m;
}

/// Points around `k` well-separated centres; returns the points and each point's true centre.
inline std::pair<std::vector<float>, std::vector<std::int32_t>> planted_clusters(Random& rng, std::int32_t k,
                                                                                 std::int32_t per, std::int32_t d) {
  const auto centres = rng.normal(std::size_t(k) * d, 10.0f);
  std::vector<float> points;
  std::vector<std::int32_t> truth;
  for (std::int32_t c = 0; c < k; ++c) {
    for (std::int32_t i = 0; i < per; ++i) {
      const auto noise = rng.normal(d, 0.3f);
      for (std::int32_t j = 0; j < d; ++j) points.push_back(centres[std::size_t(c) * d + j] + noise[j]);
      truth.push_back(c);
    }
  }
  return {points, truth};
}

/// Base fixture of the randomized tests: a fresh seed per test (KVSIFT_TEST_SEED reproduces one) and a
/// generator drawn from it.
class SeededTest : public testing::Test {
 protected:
  std::uint64_t seed = test_seed();
  Random rng{seed};
};

/// The SIMD levels this machine runs, lowest first: CPU tests run each with cpu::ScopedSimdLevel.
inline std::vector<cpu::SimdLevel> available_simd_levels() {
  std::vector<cpu::SimdLevel> levels;
  for (cpu::SimdLevel l : {cpu::SimdLevel::scalar, cpu::SimdLevel::avx2, cpu::SimdLevel::avx512}) {
    if (l <= cpu::detected_simd_level()) levels.push_back(l);
  }
  return levels;
}

/// Runs `fn`, expecting a kvsift::Error whose message contains every string in `parts`.
template <class Fn>
void expect_error(Fn fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected kvsift::Error containing '" << *parts.begin() << "'";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}
template <class Fn>
void expect_error(Fn fn, const std::string& part) {
  expect_error(fn, {part});
}

}  // namespace kvsift::test
