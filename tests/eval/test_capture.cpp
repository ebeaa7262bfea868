// Reading real-model captures (tools/capture): validation, and the data's own consistency.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <span>
#include <string>

#include "kvsift/eval/metrics.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/cpu/backend.hpp"
#include "kvsift/selectors/oracle_topk/oracle_topk.hpp"
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
  oracle.prepare({.cache = cache, .slots = &slot}, {});
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

/// `bytes` (a capture) with header line `from` replaced by `to`: the header's size is rewritten, the arrays stay
/// at their offsets (the header is padded, so a slightly longer line fits).
std::string with_header_line(std::string bytes, const std::string& from, const std::string& to) {
  std::uint32_t size = 0;
  std::memcpy(&size, bytes.data() + 8, 4);
  std::string header = bytes.substr(12, size);
  const auto at = header.find(from + "\n");
  EXPECT_NE(at, std::string::npos) << from;
  header.replace(at, from.size(), to);
  size = std::uint32_t(header.size());
  std::memcpy(bytes.data() + 8, &size, 4);
  bytes.replace(12, header.size(), header);
  return bytes;
}

TEST(Capture, HeaderNumbersMustBeWholeNumbersOfTheirKind) {
  const std::string good = read_all(kCapture);
  const std::string prefix = "kvsift::read_capture: " + testing::TempDir() + "kvsift_bad_capture.kvscap: ";
  const std::string theta = "rope_theta 100000.0";
  for (const std::string text : {"nan", "-5", "1e5xyz", "inf", "0", "", "0x10"}) {
    EXPECT_EQ(error_for(with_header_line(good, theta, "rope_theta " + text)),
              prefix + "'rope_theta' must be a finite number > 0, found '" + text + "'");
  }
  EXPECT_EQ(error_for(with_header_line(good, theta, "rope_theta 1e5")), "");  // Python's repr of large floats
  EXPECT_EQ(error_for(with_header_line(good, "tokens 512", "tokens 99999999999")),
            prefix + "'tokens' must be an integer in [1, 2147483647], found '99999999999'");
  EXPECT_EQ(error_for(with_header_line(good, "layers 3 15", "layers 3 -15")),
            prefix + "'layers' must be an integer in [0, 2147483647], found '-15'");
  const std::string k = "array k 3 512 3 64 1376896 196608";
  EXPECT_EQ(error_for(with_header_line(good, k, k + "x")),
            prefix + "'array bytes' must be an integer in [0, 9223372036854775807], found '196608x'");
  EXPECT_EQ(error_for(with_header_line(good, k, "array k 3 512 3 64.0 1376896 196608")),
            prefix + "'array head_dim' must be an integer in [1, 2147483647], found '64.0'");
  EXPECT_EQ(error_for(with_header_line(good, k, k + " 7")),
            prefix + "header line 'array " + k.substr(6) + " 7' is not 'array NAME LAYER TOKENS HEADS HEAD_DIM "
                     "OFFSET BYTES'");
}

TEST(Capture, NonFiniteArraysAreRefusedNamingTheArrayAndTheFirstPosition) {
  const std::string good = read_all(kCapture);
  const std::string prefix = "kvsift::read_capture: " + testing::TempDir() + "kvsift_bad_capture.kvscap: ";
  // Offsets from the header (array NAME LAYER TOKENS HEADS HEAD_DIM OFFSET BYTES), element [token, head, channel].
  const struct {
    std::size_t offset;
    std::int32_t heads, token, head, channel;
    std::uint16_t bits;
    std::string message;
  } cases[] = {
      {3146368, 3, 5, 1, 7, 0x7e00,
       "array k of layer 15 holds a non-finite value (nan) at token 5, head 1, channel 7"},
      {1573504, 3, 511, 2, 63, 0x7c00,
       "array v of layer 3 holds a non-finite value (inf) at token 511, head 2, channel 63"},
      {640, 9, 0, 0, 0, 0xfc00,
       "array q_pre of layer 3 holds a non-finite value (-inf) at token 0, head 0, channel 0"},
  };
  for (const auto& c : cases) {
    std::string bad = good;
    const std::size_t at = c.offset + 2 * ((std::size_t(c.token) * c.heads + c.head) * 64 + c.channel);
    std::memcpy(bad.data() + at, &c.bits, 2);
    EXPECT_EQ(error_for(bad), prefix + c.message + ": a capture's arrays must be finite");
  }
}

TEST(Capture, ADirectoryIsRefusedAsADirectory) {
  test::expect_error([] { read_capture(testing::TempDir()); },
                     "kvsift::read_capture: '" + testing::TempDir() + "' is a directory, not a file");
}

}  // namespace
}  // namespace kvsift
