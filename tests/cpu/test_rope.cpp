// RoPE on the CPU (core/rope.hpp, cpu/rope.hpp) against fp64 references written here from Hugging Face
// transformers' rope_init formulas (modeling_rope_utils.py: default, linear, llama3, yarn): inverse
// frequencies and attention factors of shipped configurations, the cos/sin table, rotations of fp32, fp16 and
// bf16 heads and key rows in both layouts with full and partial rotary dims, inverse, rotation from a position to another, thread
// independence, and every refused input.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <string>
#include <vector>

#include "kvsift/core/rope.hpp"
#include "kvsift/cpu/rope.hpp"
#include "kvsift/cpu/thread_pool.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::Random;

// ---- fp64 references from the HF formulas -----------------------------------------------------------------

/// _compute_default_rope_parameters: 1 / base^(arange(0, dim, 2) / dim).
double ref_default(double base, int i, int dim) { return 1.0 / std::pow(base, double(2 * i) / dim); }

/// transformers' rope_init functions, transcribed: inv_freq for pair i of a rotary dim `dim`.
double ref_inv_freq(const RopeConfig& c, int i, int dim) {
  const RopeScalingConfig& s = c.scaling;
  const double inv = ref_default(c.theta, i, dim);
  switch (s.kind) {
    case RopeScaling::none:
      return inv;
    case RopeScaling::linear:  // _compute_linear_scaling_rope_parameters: inv_freq /= factor
      return inv / s.factor;
    case RopeScaling::llama3: {  // _compute_llama3_parameters
      const double old_context_len = s.original_max_position_embeddings;
      const double low_freq_wavelen = old_context_len / s.low_freq_factor;
      const double high_freq_wavelen = old_context_len / s.high_freq_factor;
      const double wavelen = 2 * std::numbers::pi / inv;
      double inv_freq_llama = wavelen > low_freq_wavelen ? inv / s.factor : inv;
      const double smooth_factor = (old_context_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      const double smoothed = (1 - smooth_factor) * inv_freq_llama / s.factor + smooth_factor * inv_freq_llama;
      const bool is_medium_freq = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
      return is_medium_freq ? smoothed : inv_freq_llama;
    }
    case RopeScaling::yarn: {  // _compute_yarn_parameters
      const auto find_correction_dim = [&](double num_rotations) {
        return (dim * std::log(s.original_max_position_embeddings / (num_rotations * 2 * std::numbers::pi))) /
               (2 * std::log(c.theta));
      };
      double low = find_correction_dim(s.beta_fast), high = find_correction_dim(s.beta_slow);
      if (s.truncate) low = std::floor(low), high = std::ceil(high);
      low = std::max(low, 0.0);
      high = std::min(high, double(dim - 1));
      if (low == high) high += 0.001;
      const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);  // linear_ramp_factor
      const double extrapolation_factor = 1 - ramp;
      const double pos_freq = std::pow(c.theta, double(2 * i) / dim);
      return 1.0 / (s.factor * pos_freq) * (1 - extrapolation_factor) + 1.0 / pos_freq * extrapolation_factor;
    }
  }
  return inv;
}

/// HF's get_mscale and the attention factor it derives.
double ref_attention_factor(const RopeConfig& c) {
  const RopeScalingConfig& s = c.scaling;
  if (s.kind != RopeScaling::yarn) return 1.0;
  if (s.attention_factor != 0.0) return s.attention_factor;
  const auto get_mscale = [](double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; };
  if (s.mscale != 0.0 && s.mscale_all_dim != 0.0) return get_mscale(s.factor, s.mscale) / get_mscale(s.factor, s.mscale_all_dim);
  return get_mscale(s.factor, 1.0);
}

/// ref_inv_freq of every pair.
std::vector<double> ref_inv_freqs(const RopeConfig& c, std::int32_t rotary) {
  std::vector<double> f(rotary / 2);
  for (int i = 0; i < rotary / 2; ++i) f[i] = ref_inv_freq(c, i, rotary);
  return f;
}

/// Rotates fp64 copies of x's pairs to position `pos` (the other way with inverse), times the attention factor
/// (divided with inverse), straight from the formulas (inv_freq: ref_inv_freqs).
std::vector<double> ref_rotate(const std::vector<double>& x, const RopeConfig& c, const std::vector<double>& inv_freq,
                               double pos, bool inverse) {
  std::vector<double> y = x;
  const int half = int(inv_freq.size());
  const double af = inverse ? 1.0 / ref_attention_factor(c) : ref_attention_factor(c);
  for (int i = 0; i < half; ++i) {
    const double angle = (inverse ? -pos : pos) * inv_freq[i];
    const int a = c.layout == RopeLayout::neox ? i : 2 * i;
    const int b = c.layout == RopeLayout::neox ? i + half : 2 * i + 1;
    y[a] = (x[a] * std::cos(angle) - x[b] * std::sin(angle)) * af;
    y[b] = (x[a] * std::sin(angle) + x[b] * std::cos(angle)) * af;
  }
  return y;
}

// ---- shipped configurations ----------------------------------------------------------------------------------

struct NamedConfig {
  const char* name;
  RopeConfig config;
};

std::vector<NamedConfig> configs(std::int32_t rotary_dim, RopeLayout layout) {
  return {
      {"default", {.theta = 10000.0, .rotary_dim = rotary_dim, .layout = layout}},
      {"linear x4", {.theta = 10000.0, .rotary_dim = rotary_dim, .layout = layout,
                     .scaling = {.kind = RopeScaling::linear, .factor = 4.0}}},
      // Llama 3.1 8B's config.json.
      {"llama3", {.theta = 500000.0, .rotary_dim = rotary_dim, .layout = layout,
                  .scaling = {.kind = RopeScaling::llama3, .factor = 8.0, .original_max_position_embeddings = 8192,
                              .low_freq_factor = 1.0, .high_freq_factor = 4.0}}},
      // Qwen2.5's documented YaRN setting.
      {"yarn x4", {.theta = 1000000.0, .rotary_dim = rotary_dim, .layout = layout,
                   .scaling = {.kind = RopeScaling::yarn, .factor = 4.0, .original_max_position_embeddings = 32768}}},
      // DeepSeek-V2's (mscale = mscale_all_dim: attention factor 1), without truncation.
      {"yarn deepseek", {.theta = 10000.0, .rotary_dim = rotary_dim, .layout = layout,
                         .scaling = {.kind = RopeScaling::yarn, .factor = 40.0, .original_max_position_embeddings = 4096,
                                     .truncate = false, .mscale = 0.707, .mscale_all_dim = 0.707}}},
      // An explicit attention factor (EAGLE-3's draft head stretched to a long context, as SpeContext does).
      {"yarn explicit", {.theta = 10000.0, .rotary_dim = rotary_dim, .layout = layout,
                         .scaling = {.kind = RopeScaling::yarn, .factor = 16.0, .original_max_position_embeddings = 2048,
                                     .beta_fast = 16.0, .beta_slow = 2.0, .attention_factor = 1.25}}},
  };
}

TEST(Rope, InverseFrequenciesAndAttentionFactorsFollowTheHfFormulas) {
  for (const std::int32_t rotary : {64, 96, 128}) {
    for (const auto& [name, c] : configs(rotary, RopeLayout::neox)) {
      SCOPED_TRACE(testing::Message() << name << " rotary " << rotary);
      for (int i = 0; i < rotary / 2; ++i) {
        const double expected = ref_inv_freq(c, i, rotary);
        EXPECT_NEAR(c.inv_freq(i, rotary), expected, 1e-14 * expected) << "pair " << i;
      }
      EXPECT_NEAR(c.attention_factor(), ref_attention_factor(c), 1e-15);
    }
  }
  // Spot values: llama3 keeps the highest frequency and divides the lowest by factor; yarn's attention factor.
  const auto c = configs(128, RopeLayout::neox);
  EXPECT_EQ(c[2].config.inv_freq(0, 128), 1.0);
  EXPECT_NEAR(c[2].config.inv_freq(63, 128), std::pow(500000.0, -126.0 / 128) / 8, 1e-20);
  EXPECT_NEAR(c[3].config.attention_factor(), 0.1 * std::log(4.0) + 1.0, 1e-15);
  EXPECT_EQ(c[4].config.attention_factor(), 1.0);
  EXPECT_EQ(c[5].config.attention_factor(), 1.25);
  EXPECT_EQ(c[0].config.attention_factor(), 1.0);
}

TEST(Rope, TableHoldsFp64AnglesRoundedOnce) {
  const std::int32_t positions = 3000;
  cpu::ThreadPool pool(3);
  for (const auto& [name, c] : configs(96, RopeLayout::interleaved)) {
    SCOPED_TRACE(name);
    std::vector<float> cos(RopeTableView::elements(c, 128, positions), test::kPoison), sin = cos;
    const auto table = RopeTableView::make(c, 128, positions, cos.data(), sin.data());
    ASSERT_EQ(table.rotary_dim, 96);
    ASSERT_EQ(table.attention_factor, float(ref_attention_factor(c)));
    cpu::build_rope_table(c, table, &pool);
    for (std::int32_t p = 0; p < positions; p += 7) {
      for (int i = 0; i < 48; ++i) {
        const double angle = p * ref_inv_freq(c, i, 96);
        ASSERT_NEAR(cos[p * 48 + i], std::cos(angle), 6.0e-8) << p << " " << i;
        ASSERT_NEAR(sin[p * 48 + i], std::sin(angle), 6.0e-8) << p << " " << i;
      }
    }
    // Every entry was written.
    EXPECT_TRUE(std::none_of(cos.begin(), cos.end(), [](float v) { return std::isnan(v); }));
    EXPECT_TRUE(std::none_of(sin.begin(), sin.end(), [](float v) { return std::isnan(v); }));
  }
}

// ---- rotations -------------------------------------------------------------------------------------------------

/// Owning heads [batch, heads, head_dim] in T with padding between heads and rows (strided views), and a
/// table for a config.
template <class T>
struct Heads {
  std::int32_t batch, heads, head_dim;
  std::int64_t head_stride, batch_stride;
  std::vector<T> data;

  Heads(Random& rng, std::int32_t b, std::int32_t h, std::int32_t d)
      : batch(b), heads(h), head_dim(d), head_stride(d + 8), batch_stride(std::int64_t(h) * (d + 8) + 5) {
    const auto values = rng.normal(std::size_t(batch_stride) * b, 2.0f);
    data.resize(values.size());
    std::transform(values.begin(), values.end(), data.begin(), [](float f) { return from_float<T>(f); });
  }
  HeadsView<T> view() { return {data.data(), batch, heads, head_dim, batch_stride, head_stride}; }
  std::vector<double> vector(std::int32_t b, std::int32_t h) const {
    std::vector<double> v(head_dim);
    for (int c = 0; c < head_dim; ++c) v[c] = to_float(data[b * batch_stride + h * head_stride + c]);
    return v;
  }
};

struct Table {
  std::vector<float> cos, sin;
  RopeTableView view;
  Table(const RopeConfig& c, std::int32_t head_dim, std::int32_t positions)
      : cos(RopeTableView::elements(c, head_dim, positions)), sin(cos.size()) {
    view = RopeTableView::make(c, head_dim, positions, cos.data(), sin.data());
    cpu::build_rope_table(c, view);
  }
};

/// Tolerance of a rotated value: fp32 cos/sin (2^-24 relative each), then the storage type's rounding.
template <class T>
double tolerance(double ref, double norm) {
  const double unit = std::is_same_v<T, float> ? 0x1p-24 : std::is_same_v<T, half> ? 0x1p-11 : 0x1p-8;
  return 4e-7 * norm + unit * std::abs(ref) * 1.0001 + (std::is_same_v<T, float> ? 0.0 : 1e-6 * norm);
}

double norm_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

template <class T>
void check_apply_against_reference(Random& rng) {
  const std::int32_t batch = 5, heads = 4, d = 128, positions = 40000;
  for (const auto& [rotary, layout] : {std::pair{128, RopeLayout::neox}, std::pair{96, RopeLayout::neox},
                                       std::pair{64, RopeLayout::interleaved}, std::pair{128, RopeLayout::interleaved}}) {
    for (const auto& [name, c] : configs(rotary, layout)) {
      SCOPED_TRACE(testing::Message() << name << " rotary " << rotary << " layout " << int(layout));
      Table table(c, d, positions);
      const auto inv_freq = ref_inv_freqs(c, rotary);
      Heads<T> x(rng, batch, heads, d);
      const auto before = x.data;
      std::vector<std::int32_t> pos(batch);
      for (auto& p : pos) p = rng.uniform_int(0, positions - 1);
      pos[0] = 0;
      pos[1] = positions - 1;
      for (const bool inverse : {false, true}) {
        x.data = before;
        cpu::apply_rope(x.view(), pos.data(), table.view, inverse);
        Heads<T> original = x;
        original.data = before;
        for (int b = 0; b < batch; ++b) {
          for (int h = 0; h < heads; ++h) {
            const auto in = original.vector(b, h);
            const auto ref = ref_rotate(in, c, inv_freq, pos[b], inverse);
            const auto got = x.vector(b, h);
            const double n = norm_of(in) * ref_attention_factor(c);
            for (int ch = 0; ch < d; ++ch) {
              if (ch >= rotary) {
                ASSERT_EQ(got[ch], in[ch]) << "channel past rotary_dim changed: " << ch;
              } else {
                ASSERT_NEAR(got[ch], ref[ch], tolerance<T>(ref[ch], n)) << "b " << b << " h " << h << " ch " << ch;
              }
            }
          }
        }
        // The padding between heads and rows is untouched.
        for (std::size_t e = 0; e < x.data.size(); ++e) {
          const std::int64_t in_row = std::int64_t(e) % x.batch_stride;
          if (in_row >= std::int64_t(heads) * x.head_stride || in_row % x.head_stride >= d) {
            ASSERT_EQ(std::memcmp(&x.data[e], &before[e], sizeof(T)), 0) << "padding " << e;
          }
        }
      }
    }
  }
}

class CpuRope : public test::SeededTest {};

TEST_F(CpuRope, ApplyMatchesTheFp64ReferenceF32) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_apply_against_reference<float>(rng);
}
TEST_F(CpuRope, ApplyMatchesTheFp64ReferenceF16) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_apply_against_reference<half>(rng);
}
TEST_F(CpuRope, ApplyMatchesTheFp64ReferenceBf16) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  check_apply_against_reference<bfloat16>(rng);
}

TEST_F(CpuRope, CoreApplyRopeAgreesWithTheTablePath) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t d = 128;
  for (const auto& [name, c] : configs(96, RopeLayout::neox)) {
    SCOPED_TRACE(name);
    Table table(c, d, 70000);
    auto x = rng.normal(d);
    auto y = x;
    const std::int32_t p = rng.uniform_int(0, 69999);
    apply_rope(x.data(), d, p, c);
    cpu::apply_rope(MatrixView<float>::packed(y.data(), 1, d), &p, table.view, false);
    for (int ch = 0; ch < d; ++ch) ASSERT_NEAR(x[ch], y[ch], 2e-6 * (1 + std::abs(x[ch]))) << ch;
  }
}

TEST_F(CpuRope, InverseUndoesAndTheMatrixFormEqualsTheHeadsForm) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t rows = 33, d = 64, positions = 131072;
  for (const auto& [name, c] : configs(64, RopeLayout::interleaved)) {
    SCOPED_TRACE(name);
    Table table(c, d, positions);
    const auto original = rng.normal(std::size_t(rows) * d);
    std::vector<std::int32_t> pos(rows);
    for (auto& p : pos) p = rng.uniform_int(0, positions - 1);
    auto m = original, h = original;
    cpu::ThreadPool pool(4);
    cpu::apply_rope(MatrixView<float>::packed(m.data(), rows, d), pos.data(), table.view, false, &pool);
    cpu::apply_rope(HeadsView<float>::packed(h.data(), rows, 1, d), pos.data(), table.view, false);
    ASSERT_EQ(std::memcmp(m.data(), h.data(), m.size() * sizeof(float)), 0);
    // YaRN scales the norm by its attention factor.
    double n0 = 0, n1 = 0;
    for (int ch = 0; ch < d; ++ch) n0 += double(original[ch]) * original[ch], n1 += double(m[ch]) * m[ch];
    EXPECT_NEAR(std::sqrt(n1 / n0), ref_attention_factor(c), 1e-6);
    cpu::apply_rope(MatrixView<float>::packed(m.data(), rows, d), pos.data(), table.view, true, &pool);
    for (std::size_t e = 0; e < m.size(); ++e) ASSERT_NEAR(m[e], original[e], 2e-6 * (1 + std::abs(original[e]))) << e;
  }
}

TEST_F(CpuRope, RotationToAPositionMovesAnAlreadyRotatedVector) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t batch = 6, heads = 8, d = 128, positions = 65536, target = 2048;  // A²ATS's fixed position b
  for (const auto& [name, c] : configs(128, RopeLayout::neox)) {
    SCOPED_TRACE(name);
    Table table(c, d, positions);
    const auto pre = rng.normal(std::size_t(batch) * heads * d);
    std::vector<std::int32_t> p(batch), to(batch, target);
    for (int b = 0; b < batch; ++b) p[b] = b == 0 ? target : rng.uniform_int(0, positions - 1);
    // qR_b: rotate to p, then from p to the target; equals rotating to the target directly.
    auto q = pre, direct = pre;
    const auto view = [&](std::vector<float>& v) { return HeadsView<float>::packed(v.data(), batch, heads, d); };
    cpu::apply_rope(view(q), p.data(), table.view, false);
    cpu::rotate_to_position(view(q), p.data(), 0, target, table.view);
    cpu::apply_rope(view(direct), to.data(), table.view, false);
    for (std::size_t e = 0; e < q.size(); ++e) ASSERT_NEAR(q[e], direct[e], 3e-6 * (1 + std::abs(direct[e]))) << e;
    // Rotating to p then from p to 0 leaves the pre-RoPE vector times the attention factor.
    auto r = pre;
    cpu::apply_rope(view(r), p.data(), table.view, false);
    cpu::rotate_to_position(view(r), p.data(), 0, 0, table.view);
    const double af = ref_attention_factor(c);
    for (std::size_t e = 0; e < r.size(); ++e) ASSERT_NEAR(r[e], pre[e] * af, 3e-6 * (1 + std::abs(pre[e]))) << e;
  }
}

TEST_F(CpuRope, PositionOffsetsAndRotationToAFixedPositionFollowTheFp64Reference) {
  // A²ATS's two rotations with the lengths as positions: the step's key at lengths[b] - 1 back to pre-RoPE
  // (apply_rope inverse, offset -1), and the step's query from lengths[b] - 1 to the fixed position b
  // (rotate_to_position), against core/rope.hpp's fp64 apply_rope; the key's equals the plain form bit for bit.
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::int32_t batch = 6, heads = 4, d = 128, positions = 40000;
  for (const auto& [name, c] : configs(96, RopeLayout::neox)) {
    SCOPED_TRACE(name);
    Table table(c, d, positions);
    std::vector<std::int32_t> lengths(batch), last(batch);
    const std::int32_t target = 2048, offset = -1;
    for (int b = 0; b < batch; ++b) {
      lengths[b] = b == 0 ? 1 : rng.uniform_int(1, positions);
      last[b] = lengths[b] + offset;
    }
    const auto pre = rng.normal(std::size_t(batch) * heads * d);
    const auto view = [&](std::vector<float>& v) { return HeadsView<float>::packed(v.data(), batch, heads, d); };
    // Keys: rotated to their positions in fp64, then undone from the lengths with offset -1.
    auto keys = pre;
    for (int b = 0; b < batch; ++b) {
      for (int h = 0; h < heads; ++h) apply_rope(keys.data() + (std::size_t(b) * heads + h) * d, d, last[b], c);
    }
    auto plain = keys;
    cpu::apply_rope(view(keys), lengths.data(), offset, table.view, true);
    cpu::apply_rope(view(plain), last.data(), table.view, true);
    ASSERT_EQ(std::memcmp(keys.data(), plain.data(), keys.size() * sizeof(float)), 0);
    for (std::size_t e = 0; e < keys.size(); ++e) ASSERT_NEAR(keys[e], pre[e], 3e-6 * (1 + std::abs(pre[e]))) << e;
    // Queries: post-RoPE at lengths - 1, rotated to the target: the fp64 rotation of the pre-RoPE query to it.
    auto q = pre;
    for (int b = 0; b < batch; ++b) {
      for (int h = 0; h < heads; ++h) apply_rope(q.data() + (std::size_t(b) * heads + h) * d, d, last[b], c);
    }
    cpu::ThreadPool pool(3);
    cpu::rotate_to_position(view(q), lengths.data(), offset, target, table.view, &pool);
    auto want = pre;
    for (std::size_t v = 0; v < want.size() / d; ++v) apply_rope(want.data() + v * d, d, target, c);
    for (std::size_t e = 0; e < q.size(); ++e) ASSERT_NEAR(q[e], want[e], 4e-6 * (1 + std::abs(want[e]))) << e;
  }
}

TEST_F(CpuRope, ResultsDoNotDependOnTheThreadCount) {
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const auto c = configs(128, RopeLayout::neox)[3].config;
  Table table(c, 128, 5000);
  std::vector<float> cos2(table.cos.size()), sin2(table.cos.size());
  cpu::ThreadPool pool(3);
  cpu::build_rope_table(c, RopeTableView::make(c, 128, 5000, cos2.data(), sin2.data()), &pool);
  ASSERT_EQ(std::memcmp(cos2.data(), table.cos.data(), cos2.size() * sizeof(float)), 0);
  ASSERT_EQ(std::memcmp(sin2.data(), table.sin.data(), sin2.size() * sizeof(float)), 0);
  Heads<bfloat16> a(rng, 7, 9, 128);
  Heads<bfloat16> b = a;
  std::vector<std::int32_t> pos(7);
  for (auto& p : pos) p = rng.uniform_int(0, 4999);
  cpu::apply_rope(a.view(), pos.data(), table.view, false);
  cpu::apply_rope(b.view(), pos.data(), table.view, false, &pool);
  ASSERT_EQ(std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(bfloat16)), 0);
}

TEST(CpuRopeBadInput, RefusedWithTheirMessages) {
  const RopeConfig c{};
  std::vector<float> cos(64 * 100), sin(64 * 100), x(4 * 128);
  const auto table = RopeTableView::make(c, 128, 100, cos.data(), sin.data());
  cpu::build_rope_table(c, table);
  const auto heads = HeadsView<float>::packed(x.data(), 2, 2, 128);
  const auto rows = MatrixView<float>::packed(x.data(), 4, 128);
  std::vector<std::int32_t> pos{0, 99, 3, 4};

  // Positions and deltas.
  test::expect_error([&] { cpu::apply_rope(heads, nullptr, table, false); }, {"cpu::apply_rope", "positions is a null"});
  for (const std::int32_t bad : {-1, 100}) {
    std::vector<std::int32_t> p{0, bad};
    test::expect_error([&] { cpu::apply_rope(heads, p.data(), table, false); },
                       {"cpu::apply_rope", fmt::format("positions[1] + 0 (= {}) is outside the table's positions [0, 100)", bad)});
    std::vector<std::int32_t> r{0, 1, bad, 2};
    test::expect_error([&] { cpu::apply_rope(rows, r.data(), table, true); }, {fmt::format("positions[2] + 0 (= {})", bad)});
    std::vector<std::int32_t> lengths{1, bad + 1};
    test::expect_error([&] { cpu::apply_rope(heads, lengths.data(), -1, table, true); },
                       {"cpu::apply_rope", fmt::format("positions[1] + -1 (= {}) is outside the table's positions", bad)});
  }
  std::vector<std::int32_t> lengths{1, 121};  // rows at positions 0 and 120
  test::expect_error([&] { cpu::rotate_to_position(heads, lengths.data(), -1, 20, table); },
                     {"cpu::rotate_to_position",
                      "the rotation of row 1 (= -100 positions) is not below the table's positions (= 100)"});
  test::expect_error([&] { cpu::rotate_to_position(heads, lengths.data(), -2, 20, table); },
                     {"cpu::rotate_to_position", "positions[0] + -2 (= -1) is a negative position"});
  test::expect_error([&] { cpu::rotate_to_position(heads, lengths.data(), -1, -3, table); },
                     {"cpu::rotate_to_position", "target (= -3) must be >= 0"});
  test::expect_error([&] { cpu::rotate_to_position(heads, nullptr, -1, 3, table); }, {"cpu::rotate_to_position", "positions is a null"});
  // The table.
  auto t = table;
  t.rotary_dim = 130;
  test::expect_error([&] { cpu::apply_rope(heads, pos.data(), t, false); }, {"table.rotary_dim (= 130)", "[2, head_dim = 128]"});
  t = table, t.rotary_dim = 7;
  test::expect_error([&] { cpu::apply_rope(heads, pos.data(), t, false); }, "table.rotary_dim (= 7)");
  t = table, t.cos = nullptr;
  test::expect_error([&] { cpu::apply_rope(heads, pos.data(), t, false); }, "table.cos and table.sin must be non-null");
  t = table, t.positions = 0;
  test::expect_error([&] { cpu::rotate_to_position(heads, pos.data(), 0, 0, t); },
                     "table.positions (= 0) must be positive");
  t = table, t.attention_factor = 0.0f;
  test::expect_error([&] { cpu::apply_rope(rows, pos.data(), t, false); }, "table.attention_factor (= 0)");
  t = table, t.layout = RopeLayout(9);
  test::expect_error([&] { cpu::apply_rope(rows, pos.data(), t, false); }, "unknown table.layout (9)");
  auto bad_heads = heads;
  bad_heads.data = nullptr;
  test::expect_error([&] { cpu::apply_rope(bad_heads, pos.data(), table, false); }, "cpu::apply_rope");

  // The build: the table must be the config's.
  const auto build_error = [&](const RopeConfig& config, const RopeTableView& view, const std::string& part) {
    test::expect_error([&] { cpu::build_rope_table(config, view); }, {"cpu::build_rope_table", part});
  };
  build_error(RopeConfig{.layout = RopeLayout::interleaved}, table, "table.layout (0) != config.layout (1)");
  build_error(RopeConfig{.rotary_dim = 64}, table, "config.rotary_dim (= 64) != table.rotary_dim (= 128)");
  build_error(RopeConfig{.theta = 1.0}, table, "rope.theta (= 1) must exceed 1");
  const RopeConfig yarn{.scaling = {.kind = RopeScaling::yarn, .factor = 4.0, .original_max_position_embeddings = 4096}};
  build_error(yarn, table, "table.attention_factor (= 1) != the config's");
  const auto scaling_error = [&](const RopeScalingConfig& s, const std::string& part) {
    const RopeConfig config{.scaling = s};
    std::vector<float> cs(64 * 10), sn(64 * 10);
    auto view = RopeTableView::make(c, 128, 10, cs.data(), sn.data());
    view.attention_factor = 1.0f;  // so that only the scaling rule is broken
    build_error(config, view, part);
  };
  scaling_error({.kind = RopeScaling(7)}, "unknown RopeScaling (7)");
  scaling_error({.kind = RopeScaling::linear, .factor = 0.5}, "rope.scaling.factor (= 0.5) must be >= 1");
  scaling_error({.kind = RopeScaling::llama3, .factor = 8.0}, "original_max_position_embeddings (= 0) must be positive");
  scaling_error({.kind = RopeScaling::llama3, .factor = 8.0, .original_max_position_embeddings = 8192,
                 .low_freq_factor = 4.0, .high_freq_factor = 4.0},
                "low_freq_factor (= 4) and high_freq_factor (= 4) must satisfy 0 < low < high");
  scaling_error({.kind = RopeScaling::yarn, .factor = 1.0, .original_max_position_embeddings = 4096, .beta_fast = 1.0,
                 .beta_slow = 1.0},
                "beta_fast (= 1) and beta_slow (= 1) must satisfy beta_fast > beta_slow > 0");
  scaling_error({.kind = RopeScaling::yarn, .factor = 1.0, .original_max_position_embeddings = 4096, .mscale = -1.0},
                "mscale (= -1)");
}

}  // namespace
}  // namespace kvsift
