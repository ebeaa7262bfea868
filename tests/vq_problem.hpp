#pragma once
/// Random codebook problems for the vq tests (tests/cpu/test_vq.cpp, tests/cuda/test_cuda_vq.cpp) and their fp64
/// references, written from the paper's definitions, not from kvsift's formulation: a key's code minimises the
/// quadratic form (k - C_c) H (k - C_c)^T with H = L L^T and C = C^z L^-1 in key space; a table entry is q . C_c.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kvsift/selectors/a2ats/vq.hpp"
#include "test_util.hpp"

namespace kvsift::test {

/// Codes of a problem compare with the fp64 argmin exactly, except where the best two quadratic forms are within
/// kVqTieTolerance * (k H k^T + C_c H C_c^T) of each other: fp32 sums of head_dim <= 128 products, rounded at
/// each step (relative 2^-24 each, <= 128 * 2^-24 = 7.6e-6 of the terms' magnitude), twice over (z, then the
/// dot), plus the norm. There either of the near-tied codewords is accepted.
constexpr double kVqTieTolerance = 4e-5;
/// Table entries: fp32 sums of head_dim <= 128 products: |error| <= 128 * 2^-24 * sum |q_j C_j| = 7.6e-6 of it.
constexpr double kVqLutTolerance = 1e-5;

struct VqProblem {
  std::int32_t kv_heads, codewords, d;
  std::vector<float> transform;   ///< [kv_heads, d, d] L, upper triangle NaN (must not be read)
  std::vector<float> centroids;   ///< [kv_heads, codewords, d] C^z
  std::vector<double> key_space;  ///< [kv_heads, codewords, d] C = C^z L^-1 in fp64
  std::vector<double> h;          ///< [kv_heads, d, d] H = L L^T
  std::vector<double> form_c;     ///< [kv_heads, codewords] C_c H C_c^T

  const float* l(std::int32_t g) const { return transform.data() + std::size_t(g) * d * d; }
};

/// A well-conditioned lower-triangular L per head (diagonal in [0.5, 1.5], off-diagonal entries of size
/// 0.3 / sqrt(d)) and codewords that are transformed random keys, so keys fall among them.
inline VqProblem make_vq_problem(Random& rng, std::int32_t kv_heads, std::int32_t codewords, std::int32_t d) {
  VqProblem p{kv_heads, codewords, d, {}, {}, {}, {}, {}};
  const std::size_t dd = std::size_t(d) * d, cd = std::size_t(codewords) * d;
  p.transform.assign(std::size_t(kv_heads) * dd, std::numeric_limits<float>::quiet_NaN());
  p.centroids.resize(std::size_t(kv_heads) * cd);
  p.key_space.resize(p.centroids.size());
  p.h.assign(std::size_t(kv_heads) * dd, 0.0);
  p.form_c.resize(std::size_t(kv_heads) * codewords);
  for (std::int32_t g = 0; g < kv_heads; ++g) {
    float* l = p.transform.data() + g * dd;
    const auto off = rng.normal(dd, 0.3f / std::sqrt(float(d)));
    for (std::int32_t i = 0; i < d; ++i) {
      for (std::int32_t j = 0; j < i; ++j) l[i * d + j] = off[i * d + j];
      l[i * d + i] = rng.uniform(0.5f, 1.5f);
    }
    double* h = p.h.data() + g * dd;
    for (std::int32_t i = 0; i < d; ++i) {
      for (std::int32_t j = 0; j < d; ++j) {
        double s = 0;
        for (std::int32_t m = 0; m <= std::min(i, j); ++m) s += double(l[i * d + m]) * l[j * d + m];
        h[i * d + j] = s;
      }
    }
    const auto keys = rng.normal(cd);
    for (std::int32_t c = 0; c < codewords; ++c) {
      float* z = p.centroids.data() + g * cd + std::size_t(c) * d;
      for (std::int32_t j = 0; j < d; ++j) {
        double s = 0;
        for (std::int32_t i = j; i < d; ++i) s += double(keys[std::size_t(c) * d + i]) * l[i * d + j];
        z[j] = float(s);
      }
      // x L = z, L lower-triangular: z_j = sum_{i >= j} x_i L[i][j], solved from j = d - 1 down.
      double* x = p.key_space.data() + g * cd + std::size_t(c) * d;
      for (std::int32_t j = d - 1; j >= 0; --j) {
        double s = z[j];
        for (std::int32_t i = j + 1; i < d; ++i) s -= x[i] * l[i * d + j];
        x[j] = s / l[j * d + j];
      }
      double form = 0;
      for (std::int32_t i = 0; i < d; ++i) {
        for (std::int32_t j = 0; j < d; ++j) form += x[i] * h[i * d + j] * x[j];
      }
      p.form_c[g * std::size_t(codewords) + c] = form;
    }
  }
  return p;
}

/// (k - C_c) H (k - C_c)^T for every codeword c of head g, in fp64 from the key space: kHk - 2 kH.C_c + C_c H C_c;
/// the last entry holds kHk (the tie rule's scale).
inline std::vector<double> vq_forms(const VqProblem& p, std::int32_t g, const std::vector<double>& k) {
  const std::int32_t d = p.d;
  const double* h = p.h.data() + std::size_t(g) * d * d;
  std::vector<double> kh(d, 0.0);
  double khk = 0;
  for (std::int32_t j = 0; j < d; ++j) {
    for (std::int32_t i = 0; i < d; ++i) kh[j] += k[i] * h[i * d + j];
    khk += kh[j] * k[j];
  }
  std::vector<double> forms(std::size_t(p.codewords) + 1);
  forms[p.codewords] = khk;
  for (std::int32_t c = 0; c < p.codewords; ++c) {
    const double* x = p.key_space.data() + (std::size_t(g) * p.codewords + c) * d;
    double cross = 0;
    for (std::int32_t j = 0; j < d; ++j) cross += kh[j] * x[j];
    forms[c] = khk - 2 * cross + p.form_c[std::size_t(g) * p.codewords + c];
  }
  return forms;
}

/// Checks a code against the fp64 forms (the tie rule above); returns whether the row was a near tie.
inline bool expect_vq_code(const std::vector<double>& forms, const VqProblem& p,
                           std::int32_t g, std::int32_t code) {
  std::int32_t best = 0;
  for (std::int32_t c = 1; c < p.codewords; ++c) {
    if (forms[c] < forms[best]) best = c;
  }
  double second = INFINITY;
  for (std::int32_t c = 0; c < p.codewords; ++c) {
    if (c != best) second = std::min(second, forms[c]);
  }
  const double scale = forms[p.codewords] + p.form_c[std::size_t(g) * p.codewords + best];
  const double eps = kVqTieTolerance * scale;
  EXPECT_TRUE(code >= 0 && code < p.codewords) << "code " << code;
  if (code < 0 || code >= p.codewords) return false;
  if (second - forms[best] > eps) {
    EXPECT_EQ(code, best) << "forms " << forms[code] << " vs best " << forms[best];
    return false;
  }
  EXPECT_LE(forms[code] - forms[best], eps) << "code " << code << " best " << best;
  return true;
}

/// The tolerance of a table entry q . C_c against its fp64 value.
inline double vq_lut_bound(const double* q, const double* c, std::int32_t d) {
  double s = 0;
  for (std::int32_t j = 0; j < d; ++j) s += std::abs(q[j] * c[j]);
  return kVqLutTolerance * s + 1e-30;
}

/// A score past a row's length must keep this.
constexpr float kScoreSentinel = 1234.5f;

/// A scan problem: random tables, codes with some past the codebook, slots out of order (one invalid), ragged
/// lengths (0, past the scores' columns).
struct ScanProblem {
  std::int32_t batch, q_heads, kv_heads, codewords, cols, slots, max_tokens;
  std::vector<float> lut;
  std::vector<std::uint16_t> codes;
  std::vector<std::int32_t> slot_of, lengths;

  ScanProblem(Random& rng, std::int32_t batch_, std::int32_t q_heads_, std::int32_t kv_heads_, std::int32_t codewords_,
              std::int32_t cols_, bool invalid_slot)
      : batch(batch_), q_heads(q_heads_), kv_heads(kv_heads_), codewords(codewords_), cols(cols_), slots(batch_ + 2),
        max_tokens(cols_ + 3), lut(rng.normal(std::size_t(batch_) * q_heads_ * codewords_)),
        codes(std::size_t(slots) * kv_heads_ * max_tokens), slot_of(batch_), lengths(batch_) {
    const std::int32_t top = std::min(65535, codewords + std::max(1, codewords / 50));
    for (auto& c : codes) c = std::uint16_t(rng.uniform_int(0, top));
    std::vector<std::int32_t> order(slots);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng.engine);
    for (std::int32_t b = 0; b < batch; ++b) {
      slot_of[b] = order[b];
      const std::int32_t kind = b % 4;
      lengths[b] = kind == 0 ? rng.uniform_int(1, cols) : kind == 1 ? cols + 7 : kind == 2 ? 0 : rng.uniform_int(1, 40);
    }
    if (invalid_slot && batch > 1) slot_of[1] = slots;
  }
  MatrixView<const float> lut_view() const {
    return MatrixView<const float>::packed(lut.data(), std::int64_t(batch) * q_heads, codewords);
  }
  VqCodesView<const std::uint16_t> codes_view() const {
    return VqCodesView<const std::uint16_t>::packed(codes.data(), slots, kv_heads, max_tokens);
  }
  /// The expected scores [batch * q_heads, cols] (sentinel past each row's length).
  std::vector<float> expected(const std::vector<float>& tables) const {
    std::vector<float> out(std::size_t(batch) * q_heads * cols, kScoreSentinel);
    const std::int32_t group = q_heads / kv_heads;
    for (std::int32_t b = 0; b < batch; ++b) {
      const std::int32_t n = std::clamp(lengths[b], 0, std::min(cols, max_tokens));
      for (std::int32_t h = 0; h < q_heads; ++h) {
        const std::int64_t row = std::int64_t(b) * q_heads + h;
        for (std::int32_t t = 0; t < n; ++t) {
          float v = test::kPoison;
          if (slot_of[b] >= 0 && slot_of[b] < slots) {
            const std::uint16_t c = codes[(std::size_t(slot_of[b]) * kv_heads + h / group) * max_tokens + t];
            if (c < codewords) v = tables[row * codewords + c];
          }
          out[row * cols + t] = v;
        }
      }
    }
    return out;
  }
};

}  // namespace kvsift::test
