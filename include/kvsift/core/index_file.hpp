#pragma once
/// kvsift's binary index files: the framing every persisted index shares (CSAttention bases,
/// selectors/csattention/csattention.hpp; the A²ATS codebook next), so that a format only writes and checks its own fields.
/// (Captures, eval/capture.hpp, are another thing: a text header that tools/capture writes, no checksum.)
///
/// Layout, values little-endian, no padding:
///   [0, 8)      magic: 8 bytes naming the format (IndexFileFormat::magic)
///   [8, 12)     u32 format version (IndexFileFormat::version)
///   [12, n)     the format's fields and arrays, in the order its documentation gives
///   [n, n + 4)  u32 CRC-32 of bytes [0, n): zlib's crc32 (reflected polynomial 0xEDB88320, initial value and final
///               xor 0xFFFFFFFF), so that Python's `zlib.crc32(data[:-4])` checks a file
/// A value is written as its bytes on the host: kvsift builds for little-endian hosts only (checked below), and
/// the formats use fixed-width types (int32, uint32, uint64, fp64, fp32, fp16).
///
/// IndexFileReader refuses, with kvsift::Error naming `where` (the public call), the source (a path, or "stream")
/// and what is wrong: a magic other than the format's (not that kind of file), a version other than the one the
/// reader reads, a stream that ends before a value (truncated: the byte offset and the field), a checksum that
/// differs (corrupted), and, through expect(), a field that differs from what the caller needs (its name, the
/// file's value and the expected one), and a floating-point value (fp64, fp32, fp16, bf16; a field or an array
/// element) that is NaN or infinite: no format stores one, and a selector reading one from a well-formed file would
/// hide it (a NaN centroid or codeword is never the nearest, so the output stays finite). That refusal names the
/// field or array, the first bad element and its byte offset; it comes from finish(), after the checksum, so that a
/// damaged file is reported as corrupted rather than as holding a NaN. The caller stages what it reads and commits
/// nothing before finish() has checked the checksum, so that bad input loses nothing. Fields are checked as they
/// are read, so a file of another shape is refused before its arrays (sized from checked fields) are read.
///
/// Thread safety: a writer or reader is one stream's state; distinct objects are independent.

#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iosfwd>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "kvsift/core/dtype.hpp"
#include "kvsift/core/error.hpp"

namespace kvsift {

static_assert(std::endian::native == std::endian::little,
              "kvsift's index files store host bytes as little-endian: a big-endian host needs byte swaps here");

/// zlib's CRC-32 of `bytes`, continuing from `crc` (0 to start; the result of the previous part to continue).
std::uint32_t crc32(std::span<const std::byte> bytes, std::uint32_t crc = 0);

/// One kind of index file.
struct IndexFileFormat {
  std::string_view name;        ///< what the file holds, for messages ("CSAttention base")
  std::array<char, 8> magic{};  ///< its first 8 bytes
  std::uint32_t version = 0;    ///< the version this build writes and reads
};

/// A value the framing stores as its host bytes: fixed layout, no pointers.
template <class V>
concept IndexFileValue = std::is_trivially_copyable_v<V> && !std::is_pointer_v<V>;

/// Writes one file to a stream: the magic and the version at construction, the format's values in order, the
/// checksum at finish(). Refuses a stream that failed (finish()).
class IndexFileWriter {
 public:
  IndexFileWriter(std::ostream& out, const IndexFileFormat& format, const char* where);

  template <IndexFileValue V>
  void write(const V& value) {
    write_bytes(&value, sizeof(V));
  }
  template <IndexFileValue V>
  void write_array(std::span<const V> values) {
    write_bytes(values.data(), values.size_bytes());
  }
  /// Writes the checksum and flushes; refuses a stream that failed on the way (a full disk, a closed stream).
  void finish();

 private:
  void write_bytes(const void* data, std::size_t bytes);

  std::ostream& out_;
  const char* where_;
  std::uint32_t crc_ = 0;
  std::uint64_t offset_ = 0;
};

/// Reads one file from a stream, checking the magic and the version at construction and the checksum at
/// finish(); the stream is left after the checksum (a path's reader, read_index_file, refuses bytes after it).
class IndexFileReader {
 public:
  /// source: the path, or a name for a stream, quoted in every refusal.
  IndexFileReader(std::istream& in, const IndexFileFormat& format, std::string source, const char* where);

  template <IndexFileValue V>
  V read(std::string_view field) {
    V value;
    read_bytes(&value, sizeof(V), field);
    note_non_finite(std::span<const V>(&value, 1), field);
    return value;
  }
  template <IndexFileValue V>
  void read_array(std::span<V> values, std::string_view field) {
    read_bytes(values.data(), values.size_bytes(), field);
    note_non_finite(std::span<const V>(values), field);
  }
  /// Refuses a field whose value in the file (`found`) differs from `expected`, naming it and both values.
  template <class V>
  void expect(std::string_view field, const V& found, const V& expected) const {
    KVSIFT_CHECK(found == expected, where_, "{}: {} differs: the file has {}, expected {}", source_, field, found,
                 expected);
  }
  /// read() and expect() in one.
  template <IndexFileValue V>
  V read_expected(std::string_view field, const V& expected) {
    const V found = read<V>(field);
    expect(field, found, expected);
    return found;
  }
  /// Reads the checksum and refuses a file whose contents do not give it, then one that holds a non-finite value.
  void finish();

  const std::string& source() const { return source_; }
  const char* where() const { return where_; }

 private:
  void read_bytes(void* data, std::size_t bytes, std::string_view field);
  /// Records the first non-finite value of `values`, just read as `field`, for finish() to refuse.
  template <class V>
  void note_non_finite(std::span<const V> values, std::string_view field) {
    if constexpr (StorageType<V> || std::is_same_v<V, double>) {
      if (!non_finite_.empty()) return;
      for (std::size_t i = 0; i < values.size(); ++i) {
        double x = 0.0;
        if constexpr (std::is_same_v<V, double>) {
          x = values[i];
        } else {
          x = to_float(values[i]);
        }
        if (!std::isfinite(x)) {
          non_finite_ = fmt::format("{} holds a non-finite value ({}) at element {} (byte {})", field, x, i,
                                    offset_ - values.size_bytes() + i * sizeof(V));
          return;
        }
      }
    }
  }

  std::istream& in_;
  std::string source_;
  const char* where_;
  std::uint32_t crc_ = 0;
  std::uint64_t offset_ = 0;
  std::string non_finite_;  ///< the first non-finite value read (note_non_finite); empty: none
};

/// Writes `path` through write(stream): into `path`.partial, renamed over `path` once complete, so that a failed
/// write never leaves a truncated file under `path`. Refuses a file that cannot be opened or written.
void write_index_file(const std::string& path, const char* where, const std::function<void(std::ostream&)>& write);
/// Opens `path` for read(stream), which reads one file with an IndexFileReader whose source is `path` and only
/// stages it: bytes after what read consumed are refused after it returns, so commit once this call has returned.
/// Refuses a file that cannot be opened (open_input_file).
void read_index_file(const std::string& path, const char* where, const std::function<void(std::istream&)>& read);

/// Opens `path` for binary reading, refusing with kvsift::Error naming `where` and the path one that cannot be
/// opened and one that is a directory (which opens on Linux, then reads as an empty file: "truncated at byte 0"
/// would be the message otherwise). Index files and captures (eval/capture.hpp) open their paths with it.
std::ifstream open_input_file(const std::string& path, const char* where);

}  // namespace kvsift
