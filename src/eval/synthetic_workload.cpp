#include "kvsift/eval/synthetic_workload.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "kvsift/core/error.hpp"
#include "kvsift/core/validate.hpp"

namespace kvsift {
namespace {

// Scales chosen so that with head_dim 128 and sm_scale 1/sqrt(128) the logits spread over a few units, as in
// real heads: noise keys give logit std near 1, a focused topic adds about +3, sinks and needles stand out.
constexpr float kTopicScale = 3.0f;
constexpr float kKeyNoise = 0.6f;
constexpr float kDominantBias = 4.0f;
constexpr int kDominantPairs = 4;
constexpr float kQueryFocus = 0.04f;
constexpr float kQueryDrift = 0.05f;
constexpr float kSinkScale = 6.0f;
constexpr float kNeedleLogitMargin = 0.5f;

using Rng = std::mt19937_64;

void fill_normal(Rng& rng, float* x, std::size_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  for (std::size_t i = 0; i < n; ++i) x[i] = dist(rng);
}

float dot(const float* a, const float* b, std::int32_t n) {
  double s = 0.0;
  for (std::int32_t i = 0; i < n; ++i) s += double(a[i]) * double(b[i]);
  return float(s);
}

/// Channels of the `kDominantPairs` lowest-frequency rotary pairs (both members of each pair).
std::vector<std::int32_t> dominant_channels(std::int32_t head_dim, const RopeConfig& rope) {
  const std::int32_t rotary = rope.resolved_rotary_dim(head_dim);
  const std::int32_t half = rotary / 2;
  std::vector<std::int32_t> channels;
  for (std::int32_t i = std::max(0, half - kDominantPairs); i < half; ++i) {
    channels.push_back(rope.layout == RopeLayout::neox ? i : 2 * i);
    channels.push_back(rope.layout == RopeLayout::neox ? i + half : 2 * i + 1);
  }
  return channels;
}

}  // namespace

SyntheticWorkload make_synthetic_workload(const SyntheticWorkloadConfig& c) {
  constexpr const char* where = "make_synthetic_workload";
  KVSIFT_CHECK(c.tokens > 0 && c.batch > 0 && c.q_heads > 0 && c.kv_heads > 0 && c.head_dim > 0, where,
               "tokens (= {}), batch (= {}), q_heads (= {}), kv_heads (= {}), head_dim (= {}) must be positive",
               c.tokens, c.batch, c.q_heads, c.kv_heads, c.head_dim);
  KVSIFT_CHECK(c.q_heads % c.kv_heads == 0, where, "q_heads (= {}) is not a multiple of kv_heads (= {})", c.q_heads,
               c.kv_heads);
  KVSIFT_CHECK(c.topics > 0 && c.focus_topics >= 0 && c.focus_topics <= c.topics, where,
               "topics (= {}) must be positive and focus_topics (= {}) in [0, topics]", c.topics, c.focus_topics);
  KVSIFT_CHECK(c.sink_tokens >= 0 && c.needles >= 0 && c.sink_tokens + c.needles < c.tokens, where,
               "sink_tokens (= {}) + needles (= {}) must be below tokens (= {})", c.sink_tokens, c.needles, c.tokens);
  validate(c.rope, c.head_dim, where);

  // Needles go in the middle three quarters of the non-sink tokens, at distinct positions.
  const std::int32_t needle_lo = c.sink_tokens + (c.tokens - c.sink_tokens) / 8;
  const std::int32_t needle_hi = c.tokens - 1 - (c.tokens - c.sink_tokens) / 8;
  KVSIFT_CHECK(needle_hi - needle_lo + 1 >= c.needles, where,
               "needles (= {}) do not fit in the middle of {} tokens (positions {}..{})", c.needles, c.tokens,
               needle_lo, needle_hi);

  SyntheticWorkload w;
  w.config = c;
  const std::int32_t d = c.head_dim, n = c.tokens, group = c.q_heads / c.kv_heads;
  const std::size_t kv_size = std::size_t(c.batch) * c.kv_heads * n * d;
  w.k.resize(kv_size);
  w.k_pre_rope.resize(kv_size);
  w.v.resize(kv_size);
  w.q.resize(std::size_t(c.batch) * c.q_heads * d);
  w.q_pre_rope.resize(w.q.size());
  if (c.prefill_queries) w.prefill_q.resize(std::size_t(c.batch) * c.q_heads * n * d);
  w.needle_positions.resize(std::size_t(c.batch) * c.kv_heads * c.needles);

  const std::vector<std::int32_t> dominant = dominant_channels(d, c.rope);
  const float scale = 1.0f / std::sqrt(float(d));
  Rng rng(c.seed);
  std::vector<float> bias(d), topic_keys(std::size_t(c.topics) * d), topic_values(std::size_t(c.topics) * d);
  std::vector<float> drift(d), step(d), noise(d);
  std::vector<std::int32_t> topic_of(n);

  for (std::int32_t b = 0; b < c.batch; ++b) {
    for (std::int32_t g = 0; g < c.kv_heads; ++g) {
      const std::size_t head_base = (std::size_t(b) * c.kv_heads + g) * n * d;
      float* k_pre = w.k_pre_rope.data() + head_base;
      float* k_post = w.k.data() + head_base;
      float* v = w.v.data() + head_base;

      std::fill(bias.begin(), bias.end(), 0.0f);
      for (std::int32_t ch : dominant) bias[ch] = kDominantBias * (rng() % 2 ? 1.0f : -1.0f);
      fill_normal(rng, topic_keys.data(), topic_keys.size(), kTopicScale);
      fill_normal(rng, topic_values.data(), topic_values.size(), 1.0f);

      std::uniform_real_distribution<float> unit(0.0f, 1.0f);
      std::uniform_int_distribution<std::int32_t> any_topic(0, c.topics - 1);
      std::int32_t topic = any_topic(rng);
      for (std::int32_t t = 0; t < n; ++t) {
        if (unit(rng) > c.topic_persistence) topic = any_topic(rng);
        topic_of[t] = topic;
        float* kt = k_pre + std::size_t(t) * d;
        float* vt = v + std::size_t(t) * d;
        fill_normal(rng, kt, d, kKeyNoise);
        fill_normal(rng, vt, d, 0.5f);
        for (std::int32_t i = 0; i < d; ++i) {
          kt[i] += bias[i] + topic_keys[std::size_t(topic) * d + i];
          vt[i] += topic_values[std::size_t(topic) * d + i];
        }
      }
      for (std::int32_t t = 0; t < std::min(c.sink_tokens, n); ++t) {
        float* kt = k_pre + std::size_t(t) * d;
        for (std::int32_t ch : dominant) kt[ch] = kSinkScale * bias[ch];
      }

      // Queries of this group: a shared bias match on the dominant channels, a per-head direction that drifts
      // along the sequence, and a pull towards the focus topics.
      std::vector<std::int32_t> focus(c.focus_topics);
      for (auto& f : focus) f = any_topic(rng);
      for (std::int32_t hq = g * group; hq < (g + 1) * group; ++hq) {
        fill_normal(rng, drift.data(), d, 1.0f);
        const auto make_query = [&](float* out) {
          for (std::int32_t i = 0; i < d; ++i) out[i] = drift[i] + 0.25f * bias[i];
          for (std::int32_t f : focus) {
            for (std::int32_t i = 0; i < d; ++i) out[i] += kQueryFocus * topic_keys[std::size_t(f) * d + i];
          }
        };
        const auto advance_drift = [&] {
          fill_normal(rng, step.data(), d, 1.0f);
          double norm = 0.0;
          for (std::int32_t i = 0; i < d; ++i) {
            drift[i] = drift[i] + kQueryDrift * step[i];
            norm += double(drift[i]) * drift[i];
          }
          const float rescale = float(std::sqrt(double(d) / norm));
          for (float& x : drift) x *= rescale;
        };
        for (std::int32_t t = 0; t < n; ++t) {
          if (c.prefill_queries) {
            float* qt = w.prefill_q.data() + ((std::size_t(b) * c.q_heads + hq) * n + t) * d;
            make_query(qt);
            apply_rope(qt, d, t, c.rope);
          }
          advance_drift();
        }
        float* q_pre = w.q_pre_rope.data() + (std::size_t(b) * c.q_heads + hq) * d;
        make_query(q_pre);
        float* q_post = w.q.data() + (std::size_t(b) * c.q_heads + hq) * d;
        std::copy_n(q_pre, d, q_post);
        apply_rope(q_post, d, n, c.rope);
      }

      for (std::int32_t t = 0; t < n; ++t) {
        std::copy_n(k_pre + std::size_t(t) * d, d, k_post + std::size_t(t) * d);
        apply_rope(k_post + std::size_t(t) * d, d, t, c.rope);
      }

      // Needles: post-RoPE keys along the group's mean decode query, scaled so that for every query head of
      // the group the needle's logit is kNeedleLogitMargin above that head's strongest non-sink key; their
      // pre-RoPE form is recovered by the inverse rotation.
      std::vector<float> q_mean(d, 0.0f);
      for (std::int32_t hq = g * group; hq < (g + 1) * group; ++hq) {
        const float* qh = w.q.data() + (std::size_t(b) * c.q_heads + hq) * d;
        for (std::int32_t i = 0; i < d; ++i) q_mean[i] += qh[i] / float(group);
      }
      float alpha = 0.0f;
      for (std::int32_t hq = g * group; hq < (g + 1) * group; ++hq) {
        const float* qh = w.q.data() + (std::size_t(b) * c.q_heads + hq) * d;
        float best = -INFINITY;
        for (std::int32_t t = c.sink_tokens; t < n; ++t) best = std::max(best, scale * dot(qh, k_post + std::size_t(t) * d, d));
        const float along = scale * dot(qh, q_mean.data(), d);
        KVSIFT_CHECK(along > 0.0f, where, "query head {} points away from its group's mean; use another seed", hq);
        alpha = std::max(alpha, (best + kNeedleLogitMargin) / along);
      }
      std::int32_t* needles = w.needle_positions.data() + (std::size_t(b) * c.kv_heads + g) * c.needles;
      std::uniform_int_distribution<std::int32_t> middle(needle_lo, needle_hi);
      for (std::int32_t i = 0; i < c.needles; ++i) {
        std::int32_t pos;
        do {
          pos = middle(rng);
        } while (std::find(needles, needles + i, pos) != needles + i);
        needles[i] = pos;
        float* kt = k_post + std::size_t(pos) * d;
        fill_normal(rng, noise.data(), d, 0.05f);
        for (std::int32_t ch = 0; ch < d; ++ch) kt[ch] = alpha * q_mean[ch] + noise[ch];
        float* kp = k_pre + std::size_t(pos) * d;
        std::copy_n(kt, d, kp);
        apply_rope(kp, d, pos, c.rope, /*inverse=*/true);
      }
      std::sort(needles, needles + c.needles);
    }
  }
  return w;
}

}  // namespace kvsift
