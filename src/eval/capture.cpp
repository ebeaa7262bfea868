#include "kvsift/eval/capture.hpp"

#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "kvsift/core/error.hpp"

namespace kvsift {
namespace {

constexpr const char* kWhere = "read_capture";
constexpr char kMagic[8] = {'K', 'V', 'S', 'C', 'A', 'P', '0', '1'};

/// Reads the next header line and checks that it starts with `key`; returns the rest of the line.
std::string expect_line(std::istringstream& header, const char* key, const std::string& path) {
  std::string line;
  KVSIFT_CHECK(std::getline(header, line), kWhere, "{}: header ends before '{}'", path, key);
  const std::string prefix = std::string(key) + " ";
  KVSIFT_CHECK(line.rfind(prefix, 0) == 0, kWhere, "{}: expected header line '{} ...', found '{}'", path, key, line);
  return line.substr(prefix.size());
}

std::int64_t parse_int(const std::string& text, const char* key, const std::string& path, std::int64_t min = 1) {
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  KVSIFT_CHECK(used == text.size() && value >= min, kWhere, "{}: '{}' must be an integer >= {}, found '{}'", path, key,
               min, text);
  return value;
}

}  // namespace

Capture read_capture(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  KVSIFT_CHECK(file.good(), kWhere, "cannot open '{}'", path);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  KVSIFT_CHECK(bytes.size() >= 12 && std::memcmp(bytes.data(), kMagic, 8) == 0, kWhere,
               "{}: not a kvsift capture (the file does not start with 'KVSCAP01')", path);
  std::uint32_t header_size = 0;
  std::memcpy(&header_size, bytes.data() + 8, 4);
  KVSIFT_CHECK(12 + std::size_t(header_size) <= bytes.size(), kWhere,
               "{}: truncated: the header needs {} bytes but the file has {}", path, 12 + std::size_t(header_size),
               bytes.size());
  std::istringstream header(std::string(bytes.data() + 12, header_size));

  Capture c;
  c.model = expect_line(header, "model", path);
  c.text_id = expect_line(header, "text_id", path);
  c.tokens = std::int32_t(parse_int(expect_line(header, "tokens", path), "tokens", path));
  std::vector<std::int32_t> layer_ids;
  {
    std::istringstream list(expect_line(header, "layers", path));
    for (std::string item; list >> item;) layer_ids.push_back(std::int32_t(parse_int(item, "layers", path, 0)));
  }
  c.q_heads = std::int32_t(parse_int(expect_line(header, "q_heads", path), "q_heads", path));
  c.kv_heads = std::int32_t(parse_int(expect_line(header, "kv_heads", path), "kv_heads", path));
  c.head_dim = std::int32_t(parse_int(expect_line(header, "head_dim", path), "head_dim", path));
  KVSIFT_CHECK(c.q_heads % c.kv_heads == 0, kWhere, "{}: q_heads (= {}) is not a multiple of kv_heads (= {})", path,
               c.q_heads, c.kv_heads);
  c.rope.theta = std::stod(expect_line(header, "rope_theta", path));
  c.rope.rotary_dim = std::int32_t(parse_int(expect_line(header, "rope_dim", path), "rope_dim", path));
  const std::string layout = expect_line(header, "rope_layout", path);
  KVSIFT_CHECK(layout == "interleaved" || layout == "neox", kWhere, "{}: rope_layout '{}' is not interleaved or neox",
               path, layout);
  c.rope.layout = layout == "neox" ? RopeLayout::neox : RopeLayout::interleaved;
  const std::string dtype = expect_line(header, "dtype", path);
  KVSIFT_CHECK(dtype == "f16", kWhere, "{}: dtype '{}' is not supported (only f16)", path, dtype);

  const char* names[] = {"q_pre", "q", "k_pre", "k", "v"};
  for (std::int32_t id : layer_ids) {
    CaptureLayer& layer = c.layers.emplace_back();
    layer.layer = id;
    std::vector<half>* targets[] = {&layer.q_pre, &layer.q, &layer.k_pre, &layer.k, &layer.v};
    for (int a = 0; a < 5; ++a) {
      std::istringstream fields(expect_line(header, "array", path));
      std::string name;
      std::int64_t layer_index = -1, d0 = 0, d1 = 0, d2 = 0, offset = -1, size = -1;
      fields >> name >> layer_index >> d0 >> d1 >> d2 >> offset >> size;
      KVSIFT_CHECK(!fields.fail() && name == names[a] && layer_index == id, kWhere,
                   "{}: expected array '{}' of layer {}, found '{}' of layer {}", path, names[a], id, name, layer_index);
      const std::int64_t heads = a < 2 ? c.q_heads : c.kv_heads;
      KVSIFT_CHECK(d0 == c.tokens && d1 == heads && d2 == c.head_dim, kWhere,
                   "{}: array {} of layer {} has shape [{}, {}, {}], expected [{}, {}, {}]", path, name, id, d0, d1,
                   d2, c.tokens, heads, c.head_dim);
      KVSIFT_CHECK(size == d0 * d1 * d2 * 2, kWhere, "{}: array {} of layer {} has {} bytes, expected {}", path, name,
                   id, size, d0 * d1 * d2 * 2);
      KVSIFT_CHECK(offset >= 12 + std::int64_t(header_size) && offset + size <= std::int64_t(bytes.size()), kWhere,
                   "{}: truncated: array {} of layer {} spans bytes [{}, {}) but the file has {}", path, name, id,
                   offset, offset + size, bytes.size());
      targets[a]->resize(std::size_t(d0 * d1 * d2));
      std::memcpy(targets[a]->data(), bytes.data() + offset, std::size_t(size));
    }
  }
  return c;
}

}  // namespace kvsift
