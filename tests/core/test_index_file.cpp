// The index-file framing (core/index_file.hpp) against references written here: a bitwise CRC-32 (and zlib's
// published check values), the documented byte layout, and every refusal: a cut at every byte, a flipped bit at
// every byte after the version, another magic and version, a differing field, a non-finite value, a failed stream,
// the path helpers' missing files, directories and trailing bytes.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/index_file.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::expect_error;

constexpr IndexFileFormat kFormat{
    .name = "test index", .magic = {'K', 'V', 'T', 'E', 'S', 'T', 'I', 'X'}, .version = 1};

/// CRC-32 one bit at a time, straight from the definition (reflected 0xEDB88320, init and final xor ~0).
std::uint32_t bitwise_crc32(const std::string& bytes) {
  std::uint32_t crc = 0xffffffffu;
  for (const char c : bytes) {
    crc ^= static_cast<unsigned char>(c);
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1u) != 0 ? (crc >> 1) ^ 0xEDB88320u : crc >> 1;
  }
  return ~crc;
}
std::uint32_t crc_of(const std::string& bytes, std::uint32_t crc = 0) {
  return crc32({reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()}, crc);
}

/// The fields a test file holds, random per test.
struct Fields {
  std::int32_t heads;
  std::uint64_t seed;
  double fraction;
  std::vector<float> values;
  std::vector<half> scores;
};

Fields random_fields(test::Random& rng) {
  Fields f{.heads = rng.uniform_int(1, 64), .seed = rng.engine(), .fraction = rng.uniform(0.0f, 1.0f),
           .values = rng.normal(std::size_t(rng.uniform_int(1, 40))), .scores = {}};
  f.scores = test::to_storage<half>(rng.normal(std::size_t(rng.uniform_int(1, 40))));
  return f;
}

std::string write_file(const Fields& f) {
  std::ostringstream out(std::ios::binary);
  IndexFileWriter w(out, kFormat, "test::write");
  w.write(f.heads);
  w.write(f.seed);
  w.write(f.fraction);
  w.write(std::int32_t(f.values.size()));
  w.write_array(std::span<const float>(f.values));
  w.write(std::int32_t(f.scores.size()));
  w.write_array(std::span<const half>(f.scores));
  w.finish();
  return out.str();
}

/// Reads a file write_file wrote of `shape`'s array sizes (as a format's reader checks the fields that size its
/// arrays), every other field as stored.
Fields read_file(std::istream& in, const Fields& shape, const std::string& source = "stream") {
  IndexFileReader r(in, kFormat, source, "test::read");
  Fields f{};
  f.heads = r.read<std::int32_t>("heads");
  f.seed = r.read<std::uint64_t>("seed");
  f.fraction = r.read<double>("fraction");
  f.values.resize(std::size_t(r.read_expected("the value count", std::int32_t(shape.values.size()))));
  r.read_array(std::span<float>(f.values), "the values");
  f.scores.resize(std::size_t(r.read_expected("the score count", std::int32_t(shape.scores.size()))));
  r.read_array(std::span<half>(f.scores), "the scores");
  r.finish();
  return f;
}
Fields read_bytes(const std::string& bytes, const Fields& shape) {
  std::istringstream in(bytes, std::ios::binary);
  return read_file(in, shape);
}

void expect_same(const Fields& a, const Fields& b) {
  EXPECT_EQ(a.heads, b.heads);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.fraction, b.fraction);
  EXPECT_EQ(a.values, b.values);
  ASSERT_EQ(a.scores.size(), b.scores.size());
  for (std::size_t i = 0; i < a.scores.size(); ++i) EXPECT_EQ(a.scores[i].bits, b.scores[i].bits) << i;
}

class IndexFile : public test::SeededTest {};

TEST_F(IndexFile, Crc32IsZlibsInOneCallOrInParts) {
  SCOPED_TRACE(seed);
  EXPECT_EQ(crc_of(""), 0u);
  EXPECT_EQ(crc_of("123456789"), 0xCBF43926u);  // the CRC-32 check value
  EXPECT_EQ(crc_of("The quick brown fox jumps over the lazy dog"), 0x414FA339u);
  for (const std::size_t n : {1, 7, 8, 9, 15, 16, 17, 1000, 4099}) {
    std::string bytes(n, '\0');
    for (char& c : bytes) c = static_cast<char>(rng.uniform_int(0, 255));
    ASSERT_EQ(crc_of(bytes), bitwise_crc32(bytes)) << n << " bytes";
    const std::size_t cut = std::size_t(rng.uniform_int(0, std::int32_t(n)));
    EXPECT_EQ(crc_of(bytes.substr(cut), crc_of(bytes.substr(0, cut))), bitwise_crc32(bytes)) << n << " cut " << cut;
  }
}

TEST_F(IndexFile, WritesTheDocumentedLayoutAndReadsItBack) {
  SCOPED_TRACE(seed);
  const Fields f = random_fields(rng);
  const std::string bytes = write_file(f);
  const std::size_t payload = 4 + 8 + 8 + 4 + f.values.size() * 4 + 4 + f.scores.size() * 2;
  ASSERT_EQ(bytes.size(), 8 + 4 + payload + 4);
  EXPECT_EQ(bytes.substr(0, 8), "KVTESTIX");
  EXPECT_EQ(bytes.substr(8, 4), std::string("\x01\x00\x00\x00", 4)) << "the version, little-endian";
  std::int32_t heads = 0;
  std::memcpy(&heads, bytes.data() + 12, 4);
  EXPECT_EQ(heads, f.heads);
  std::uint32_t stored = 0;
  std::memcpy(&stored, bytes.data() + bytes.size() - 4, 4);
  EXPECT_EQ(stored, bitwise_crc32(bytes.substr(0, bytes.size() - 4)));
  expect_same(read_bytes(bytes, f), f);
  // A stream of two files: each read leaves the stream after its checksum.
  const Fields g = random_fields(rng);
  std::istringstream both(bytes + write_file(g), std::ios::binary);
  expect_same(read_file(both, f), f);
  expect_same(read_file(both, g), g);
}

TEST_F(IndexFile, RefusesAFileCutAtAnyByte) {
  SCOPED_TRACE(seed);
  const Fields f = random_fields(rng);
  const std::string bytes = write_file(f);
  for (std::size_t cut = 0; cut < bytes.size(); ++cut) {
    SCOPED_TRACE(cut);
    expect_error([&] { read_bytes(bytes.substr(0, cut), f); },
                 {"test::read: stream: truncated: the file ends at byte " + std::to_string(cut) + ", inside "});
  }
  expect_error([&] { read_bytes(bytes.substr(0, 5), f); }, "ends at byte 5, inside the magic (bytes [0, 8))");
  expect_error([&] { read_bytes(bytes.substr(0, bytes.size() - 1), f); },
               fmt::format("inside the checksum (bytes [{}, {}))", bytes.size() - 4, bytes.size()));
}

TEST_F(IndexFile, RefusesAFlippedBitAnywhereAfterTheVersion) {
  SCOPED_TRACE(seed);
  const Fields f = random_fields(rng);
  const std::string bytes = write_file(f);
  // The two array sizes, checked as they are read, refuse a flip there first.
  const std::size_t value_count = 32, score_count = value_count + 4 + 4 * f.values.size();
  for (std::size_t at = 12; at < bytes.size(); ++at) {
    SCOPED_TRACE(at);
    std::string bad = bytes;
    bad[at] = static_cast<char>(bad[at] ^ (1 << rng.uniform_int(0, 7)));
    const bool in_count = (at >= value_count && at < value_count + 4) || (at >= score_count && at < score_count + 4);
    expect_error([&] { read_bytes(bad, f); },
                 in_count ? "count differs: the file has " : "test::read: stream: corrupted: the stored checksum is 0x");
  }
}

TEST_F(IndexFile, RefusesAnotherMagicOrVersion) {
  SCOPED_TRACE(seed);
  const Fields f = random_fields(rng);
  const std::string bytes = write_file(f);
  std::string bad = bytes;
  bad[0] = 'X';
  expect_error([&] { read_bytes(bad, f); },
               "stream: not a test index file: it starts with 'XVTESTIX', not the magic 'KVTESTIX'");
  bad = bytes;
  bad[7] = '\0';
  expect_error([&] { read_bytes(bad, f); }, "it starts with 'KVTESTI\\x00'");
  bad = bytes;
  bad[8] = 2;  // version + 1
  expect_error([&] { read_bytes(bad, f); },
               "stream: test index file format version 2 is not supported: this build reads version 1");
}

TEST_F(IndexFile, ExpectNamesTheFieldAndBothValues) {
  SCOPED_TRACE(seed);
  Fields f = random_fields(rng);
  f.heads = 4;
  f.fraction = 0.25;
  const std::string bytes = write_file(f);
  const auto read_expecting = [&](std::int32_t heads, double fraction) {
    std::istringstream in(bytes, std::ios::binary);
    IndexFileReader r(in, kFormat, "a.idx", "test::read");
    r.read_expected("heads", heads);
    r.read<std::uint64_t>("seed");
    r.read_expected("config.fraction", fraction);
  };
  read_expecting(4, 0.25);
  expect_error([&] { read_expecting(8, 0.25); },
               "kvsift::test::read: a.idx: heads differs: the file has 4, expected 8");
  expect_error([&] { read_expecting(4, 0.5); }, "a.idx: config.fraction differs: the file has 0.25, expected 0.5");
}

TEST_F(IndexFile, RefusesANonFiniteValueWithAValidChecksumNamingTheFieldAndElement) {
  SCOPED_TRACE(seed);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  Fields f = random_fields(rng);
  const std::size_t i = std::size_t(rng.uniform_int(0, std::int32_t(f.values.size()) - 1));
  f.values.back() = inf;  // not before i: the first non-finite value is named
  f.values[i] = nan;
  const std::size_t values_at = 12 + 4 + 8 + 8 + 4;
  expect_error([&] { read_bytes(write_file(f), f); },
               fmt::format("test::read: stream: the values holds a non-finite value (nan) at element {} (byte {}): a "
                           "floating-point value of an index file must be finite",
                           i, values_at + 4 * i));
  f = random_fields(rng);
  f.scores.back() = half{0xfc00};  // -inf in fp16
  const std::size_t scores_at = values_at + 4 * f.values.size() + 4;
  expect_error([&] { read_bytes(write_file(f), f); },
               fmt::format("stream: the scores holds a non-finite value (-inf) at element {} (byte {})",
                           f.scores.size() - 1, scores_at + 2 * (f.scores.size() - 1)));
  f = random_fields(rng);
  f.fraction = std::numeric_limits<double>::quiet_NaN();  // a field, not an array
  expect_error([&] { read_bytes(write_file(f), f); },
               "stream: fraction holds a non-finite value (nan) at element 0 (byte 24)");
  // A damaged file is corrupted first: the checksum is checked before the values.
  std::string damaged = write_file(f);
  damaged[12] = static_cast<char>(damaged[12] ^ 1);
  expect_error([&] { read_bytes(damaged, f); }, "stream: corrupted: the stored checksum is 0x");
}

TEST_F(IndexFile, WriterRefusesAFailedStream) {
  std::ostringstream out(std::ios::binary);
  IndexFileWriter w(out, kFormat, "test::write");
  w.write(std::int32_t(3));
  out.setstate(std::ios::badbit);  // as a full disk leaves a file stream
  expect_error([&] { w.finish(); }, "test::write: writing failed after 20 bytes");
}

TEST_F(IndexFile, PathHelpersWriteWholeFilesAndRefuseMissingOnesAndTrailingBytes) {
  SCOPED_TRACE(seed);
  const Fields f = random_fields(rng);
  const std::string path = testing::TempDir() + "kvsift_index_file_test.idx";
  std::filesystem::remove(path);
  write_index_file(path, "test::write", [&](std::ostream& out) { out << write_file(f); });
  EXPECT_FALSE(std::filesystem::exists(path + ".partial"));
  Fields got{};
  read_index_file(path, "test::read", [&](std::istream& in) { got = read_file(in, f, path); });
  expect_same(got, f);
  // A failed write leaves the old file and no partial one.
  expect_error([&] {
    write_index_file(path, "test::write", [&](std::ostream& out) {
      out << "half a file";
      throw Error("the writer failed");
    });
  }, "the writer failed");
  EXPECT_FALSE(std::filesystem::exists(path + ".partial"));
  read_index_file(path, "test::read", [&](std::istream& in) { got = read_file(in, f, path); });
  expect_same(got, f);
  {
    std::ofstream append(path, std::ios::binary | std::ios::app);
    append << 'x';
  }
  expect_error([&] { read_index_file(path, "test::read", [&](std::istream& in) { read_file(in, f, path); }); },
               {"test::read: " + path + ": bytes follow the checksum"});
  std::filesystem::remove(path);
  expect_error([&] { read_index_file(path, "test::read", [](std::istream&) {}); },
               "test::read: cannot open '" + path + "'");
  const std::string directory = testing::TempDir() + "kvsift_index_file_test_directory";
  std::filesystem::create_directories(directory);
  expect_error([&] { read_index_file(directory, "test::read", [](std::istream&) {}); },
               "test::read: '" + directory + "' is a directory, not a file");
  std::filesystem::remove(directory);
  const std::string nowhere = testing::TempDir() + "kvsift_no_such_directory/a.idx";
  expect_error([&] { write_index_file(nowhere, "test::write", [](std::ostream&) {}); },
               "test::write: cannot open '" + nowhere + ".partial' for writing");
}

}  // namespace
}  // namespace kvsift
