// Reading real-model captures (tools/capture): validation, and the data's own consistency.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <span>
#include <string>

#include "kvsift/eval/metrics.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/oracle_topk.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

const std::string kCapture = std::string(KVSIFT_TEST_DATA_DIR) + "/gpl3_512_l3_l15.kvscap";

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

/// Writes `bytes` to a temporary file and returns read_capture's error message for it ("" if it reads).
std::string error_for(const std::string& bytes) {
  const std::string path = testing::TempDir() + "kvsift_bad_capture.kvscap";
  std::ofstream(path, std::ios::binary) << bytes;
  try {
    read_capture(path);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(Capture, ReadsTheCommittedSmolLM2Capture) {
  const Capture c = read_capture(kCapture);
  EXPECT_EQ(c.tokens, 512);
  EXPECT_EQ(c.q_heads, 9);
  EXPECT_EQ(c.kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  ASSERT_EQ(c.layers.size(), 2u);
  EXPECT_EQ(c.layers[0].layer, 3);
  EXPECT_EQ(c.layers[1].layer, 15);
  EXPECT_EQ(c.rope.layout, RopeLayout::interleaved);
  EXPECT_EQ(c.rope.theta, 100000.0);
}

TEST(Capture, PostRopeKeysAreThePreRopeKeysRotatedByKvsiftsRope) {
  // The model's own RoPE (numpy, in the capture tool) against kvsift's, on real keys; fp16 storage bounds
  // the agreement.
  const Capture c = read_capture(kCapture);
  test::Random rng(test::test_seed());
  for (const auto& layer : c.layers) {
    for (int trial = 0; trial < 50; ++trial) {
      const std::int32_t t = rng.uniform_int(0, c.tokens - 1), h = rng.uniform_int(0, c.kv_heads - 1);
      std::vector<float> k(c.head_dim);
      double norm = 0;
      for (std::int32_t i = 0; i < c.head_dim; ++i) {
        k[i] = to_float(layer.k_pre[(std::size_t(t) * c.kv_heads + h) * c.head_dim + i]);
        norm += double(k[i]) * k[i];
      }
      apply_rope(k.data(), c.head_dim, t, c.rope);
      for (std::int32_t i = 0; i < c.head_dim; ++i) {
        const float want = to_float(layer.k[(std::size_t(t) * c.kv_heads + h) * c.head_dim + i]);
        ASSERT_NEAR(k[i], want, 2e-3 * std::sqrt(norm) + 1e-3 * std::abs(want)) << "layer " << layer.layer << " t " << t;
      }
    }
  }
}

TEST(Capture, RealAttentionIsConcentratedAndTheOracleKeepsIt) {
  const Capture c = read_capture(kCapture);
  // The last position's query over all 512 positions, layer 15 (as decode would see it).
  std::vector<float> q(std::size_t(c.q_heads) * c.head_dim), keys(std::size_t(c.kv_heads) * c.tokens * c.head_dim);
  const auto& layer = c.layers[1];
  for (std::int32_t h = 0; h < c.q_heads; ++h) {
    for (std::int32_t i = 0; i < c.head_dim; ++i) q[h * c.head_dim + i] = to_float(layer.q[(std::size_t(c.tokens - 1) * c.q_heads + h) * c.head_dim + i]);
  }
  std::vector<float> values(keys.size());
  for (std::int32_t t = 0; t < c.tokens; ++t) {
    for (std::int32_t g = 0; g < c.kv_heads; ++g) {
      for (std::int32_t i = 0; i < c.head_dim; ++i) {
        keys[(std::size_t(g) * c.tokens + t) * c.head_dim + i] = to_float(layer.k[(std::size_t(t) * c.kv_heads + g) * c.head_dim + i]);
        values[(std::size_t(g) * c.tokens + t) * c.head_dim + i] = to_float(layer.v[(std::size_t(t) * c.kv_heads + g) * c.head_dim + i]);
      }
    }
  }
  const auto kv = ContiguousKVView<const float>::packed(keys.data(), values.data(), 1, c.kv_heads, c.tokens, c.head_dim);
  const auto qv = QueryView<const float>::packed(q.data(), 1, c.q_heads, c.head_dim);
  const std::int32_t budget = c.tokens / 20;  // 5%
  // OracleTopK on the capture's own fp16 cache ([token][head][channel]), as an engine would hold it.
  const std::int32_t length = c.tokens, slot = 0, kvd = c.kv_heads * c.head_dim;
  const KVCache<const half> cache = ContiguousKVView<const half>{
      layer.k.data(), layer.v.data(), &length, 1, c.kv_heads, c.tokens, c.head_dim, std::int64_t(c.tokens) * kvd,
      c.head_dim, kvd};
  OracleTopK<half, cpu::Context> oracle(
      {.max_slots = 1, .max_tokens = c.tokens, .q_heads = c.q_heads, .kv_heads = c.kv_heads, .head_dim = c.head_dim},
      {.budget = budget});
  std::vector<std::byte> storage(oracle.select_workspace_bytes({1, c.q_heads, c.kv_heads, c.head_dim, c.tokens}, {}) + 256);
  void* base = storage.data();
  std::size_t space = storage.size();
  const std::span<std::byte> workspace(static_cast<std::byte*>(std::align(256, storage.size() - 256, base, space)),
                                       storage.size() - 256);
  test::HostSelection sel(1, c.kv_heads, budget, false);
  oracle.select({.q = QueryView<const half>::packed(layer.q.data() + std::size_t(c.tokens - 1) * c.q_heads * c.head_dim,
                                                    1, c.q_heads, c.head_dim),
                 .cache = cache, .slots = &slot, .lengths = &length},
                sel.view, workspace, {});
  EXPECT_GT(attention_mass_recall(qv, kv, sel.view), 0.6);
}

TEST(Capture, TruncatedOrInconsistentFilesAreRefused) {
  const std::string good = read_all(kCapture);
  EXPECT_EQ(error_for(good), "");
  EXPECT_NE(error_for(good.substr(0, good.size() - 1000)).find("truncated: array v of layer 15"), std::string::npos);
  EXPECT_NE(error_for(good.substr(0, 40)).find("truncated: the header needs"), std::string::npos);
  EXPECT_NE(error_for("KVSCAP02" + good.substr(8)).find("not a kvsift capture"), std::string::npos);
  std::string wrong_heads = good;
  const auto at = wrong_heads.find("kv_heads 3");
  wrong_heads.replace(at, 10, "kv_heads 9");
  EXPECT_NE(error_for(wrong_heads).find("array k_pre of layer 3 has shape [512, 3, 64], expected [512, 9, 64]"),
            std::string::npos)
      << error_for(wrong_heads);
  test::expect_error([] { read_capture("/nonexistent/capture.kvscap"); }, "cannot open '/nonexistent/capture.kvscap'");
}

}  // namespace
}  // namespace kvsift
