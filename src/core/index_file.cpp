#include "kvsift/core/index_file.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <ostream>

namespace kvsift {
namespace {

/// Slicing-by-8 tables of the reflected polynomial: table[0] the bytewise one, table[k][i] the CRC of byte i
/// followed by k zero bytes. Eight bytes per step instead of one (files run to gigabytes).
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_crc_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) != 0 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xffu];
  }
  return t;
}
constexpr auto kCrcTables = make_crc_tables();

/// The magic as text, a byte outside printable ASCII as \xNN (a file of another kind starts with anything).
std::string magic_text(const std::array<char, 8>& magic) {
  std::string text;
  for (const char c : magic) {
    const auto byte = static_cast<unsigned char>(c);
    text += byte >= 0x20 && byte < 0x7f && c != '\\' ? std::string(1, c) : fmt::format("\\x{:02x}", byte);
  }
  return text;
}

}  // namespace

std::uint32_t crc32(std::span<const std::byte> bytes, std::uint32_t crc) {
  const auto& t = kCrcTables;
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t n = bytes.size();
  crc = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = t[7][lo & 0xffu] ^ t[6][(lo >> 8) & 0xffu] ^ t[5][(lo >> 16) & 0xffu] ^ t[4][lo >> 24] ^
          t[3][hi & 0xffu] ^ t[2][(hi >> 8) & 0xffu] ^ t[1][(hi >> 16) & 0xffu] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) crc = t[0][(crc ^ *p) & 0xffu] ^ (crc >> 8);
  return ~crc;
}

IndexFileWriter::IndexFileWriter(std::ostream& out, const IndexFileFormat& format, const char* where)
    : out_(out), where_(where) {
  write_array(std::span<const char>(format.magic));
  write(format.version);
}

void IndexFileWriter::write_bytes(const void* data, std::size_t bytes) {
  crc_ = crc32({static_cast<const std::byte*>(data), bytes}, crc_);
  out_.write(static_cast<const char*>(data), std::streamsize(bytes));
  offset_ += bytes;
}

void IndexFileWriter::finish() {
  const std::uint32_t crc = crc_;
  out_.write(reinterpret_cast<const char*>(&crc), sizeof(crc));
  out_.flush();
  KVSIFT_CHECK(out_.good(), where_, "writing failed after {} bytes (the stream is closed, or the disk full)",
               offset_ + sizeof(crc));
}

IndexFileReader::IndexFileReader(std::istream& in, const IndexFileFormat& format, std::string source,
                                 const char* where)
    : in_(in), source_(std::move(source)), where_(where) {
  std::array<char, 8> magic{};
  read_array(std::span<char>(magic), "the magic");
  KVSIFT_CHECK(magic == format.magic, where_, "{}: not a {} file: it starts with '{}', not the magic '{}'", source_,
               format.name, magic_text(magic), magic_text(format.magic));
  const auto version = read<std::uint32_t>("the format version");
  KVSIFT_CHECK(version == format.version, where_,
               "{}: {} file format version {} is not supported: this build reads version {}", source_, format.name,
               version, format.version);
}

void IndexFileReader::read_bytes(void* data, std::size_t bytes, std::string_view field) {
  in_.read(static_cast<char*>(data), std::streamsize(bytes));
  const auto got = static_cast<std::size_t>(in_.gcount());
  KVSIFT_CHECK(got == bytes, where_, "{}: truncated: the file ends at byte {}, inside {} (bytes [{}, {}))", source_,
               offset_ + got, field, offset_, offset_ + bytes);
  crc_ = crc32({static_cast<const std::byte*>(data), bytes}, crc_);
  offset_ += bytes;
}

void IndexFileReader::finish() {
  const std::uint32_t contents = crc_;
  const auto stored = read<std::uint32_t>("the checksum");
  KVSIFT_CHECK(stored == contents, where_,
               "{}: corrupted: the stored checksum is {:#010x}, the contents' CRC-32 is {:#010x}", source_, stored,
               contents);
  KVSIFT_CHECK(non_finite_.empty(), where_, "{}: {}: a floating-point value of an index file must be finite", source_,
               non_finite_);
}

void write_index_file(const std::string& path, const char* where, const std::function<void(std::ostream&)>& write) {
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    KVSIFT_CHECK(out.is_open(), where, "cannot open '{}' for writing", partial);
    try {
      write(out);
      out.close();
      KVSIFT_CHECK(!out.fail(), where, "writing '{}' failed (is the disk full?)", partial);
    } catch (...) {
      out.close();
      std::error_code ignored;
      std::filesystem::remove(partial, ignored);
      throw;
    }
  }
  std::error_code error;
  std::filesystem::rename(partial, path, error);
  KVSIFT_CHECK(!error, where, "cannot rename '{}' to '{}': {}", partial, path, error.message());
}

void read_index_file(const std::string& path, const char* where, const std::function<void(std::istream&)>& read) {
  std::ifstream in = open_input_file(path, where);
  read(in);
  KVSIFT_CHECK(in.peek() == std::ifstream::traits_type::eof(), where,
               "{}: bytes follow the checksum: not one index file (or a corrupted one)", path);
}

std::ifstream open_input_file(const std::string& path, const char* where) {
  std::ifstream in(path, std::ios::binary);
  KVSIFT_CHECK(in.is_open(), where, "cannot open '{}'", path);
  std::error_code error;
  KVSIFT_CHECK(!std::filesystem::is_directory(path, error), where, "'{}' is a directory, not a file", path);
  return in;
}

}  // namespace kvsift
