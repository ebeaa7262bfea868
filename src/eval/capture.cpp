#include "kvsift/eval/capture.hpp"

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <vector>

#include "kvsift/core/error.hpp"
#include "kvsift/core/index_file.hpp"
#include "kvsift/eval/parse_number.hpp"

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

/// A header value that must be an integer T in [min, T's maximum]: int32 for the shapes and layer numbers (as
/// kvsift's views hold them), int64 for the arrays' byte offsets and sizes.
template <class T = std::int32_t>
T parse_int(const std::string& text, const char* key, const std::string& path, T min = 1) {
  const auto value = parse_number<T>(text);
  KVSIFT_CHECK(value && *value >= min, kWhere, "{}: '{}' must be an integer in [{}, {}], found '{}'", path, key, min,
               std::numeric_limits<T>::max(), text);
  return *value;
}

/// A header value that must be a finite number > 0 (rope_theta).
double parse_positive(const std::string& text, const char* key, const std::string& path) {
  const auto value = parse_number<double>(text);
  KVSIFT_CHECK(value && std::isfinite(*value) && *value > 0.0, kWhere,
               "{}: '{}' must be a finite number > 0, found '{}'", path, key, text);
  return *value;
}

/// The whitespace-separated words of `text`.
std::vector<std::string> words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string word; in >> word;) out.push_back(word);
  return out;
}

/// Refuses array `name` of `layer` ([tokens, heads, head_dim]) if it holds a NaN or an infinity, naming the first.
void check_finite(const std::vector<half>& data, const std::string& name, std::int32_t layer, std::int64_t heads,
                  std::int64_t head_dim, const std::string& path) {
  for (std::size_t i = 0; i < data.size(); ++i) {
    const float x = to_float(data[i]);
    const auto at = std::int64_t(i);
    KVSIFT_CHECK(std::isfinite(x), kWhere,
                 "{}: array {} of layer {} holds a non-finite value ({}) at token {}, head {}, channel {}: a capture's "
                 "arrays must be finite",
                 path, name, layer, x, at / (heads * head_dim), at / head_dim % heads, at % head_dim);
  }
}

}  // namespace

Capture read_capture(const std::string& path) {
  std::ifstream file = open_input_file(path, kWhere);
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
  c.tokens = parse_int(expect_line(header, "tokens", path), "tokens", path);
  std::vector<std::int32_t> layer_ids;
  for (const std::string& item : words(expect_line(header, "layers", path))) {
    layer_ids.push_back(parse_int(item, "layers", path, 0));
  }
  c.q_heads = parse_int(expect_line(header, "q_heads", path), "q_heads", path);
  c.kv_heads = parse_int(expect_line(header, "kv_heads", path), "kv_heads", path);
  c.head_dim = parse_int(expect_line(header, "head_dim", path), "head_dim", path);
  KVSIFT_CHECK(c.q_heads % c.kv_heads == 0, kWhere, "{}: q_heads (= {}) is not a multiple of kv_heads (= {})", path,
               c.q_heads, c.kv_heads);
  c.rope.theta = parse_positive(expect_line(header, "rope_theta", path), "rope_theta", path);
  c.rope.rotary_dim = parse_int(expect_line(header, "rope_dim", path), "rope_dim", path);
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
      // "array NAME LAYER TOKENS HEADS HEAD_DIM OFFSET BYTES"
      const std::string line = expect_line(header, "array", path);
      const std::vector<std::string> fields = words(line);
      KVSIFT_CHECK(fields.size() == 7, kWhere,
                   "{}: header line 'array {}' is not 'array NAME LAYER TOKENS HEADS HEAD_DIM OFFSET BYTES'", path,
                   line);
      const std::string& name = fields[0];
      const std::int32_t layer_index = parse_int(fields[1], "array layer", path, 0);
      KVSIFT_CHECK(name == names[a] && layer_index == id, kWhere,
                   "{}: expected array '{}' of layer {}, found '{}' of layer {}", path, names[a], id, name,
                   layer_index);
      const std::int64_t d0 = parse_int(fields[2], "array tokens", path);
      const std::int64_t d1 = parse_int(fields[3], "array heads", path);
      const std::int64_t d2 = parse_int(fields[4], "array head_dim", path);
      const auto offset = parse_int<std::int64_t>(fields[5], "array offset", path, 0),
                 size = parse_int<std::int64_t>(fields[6], "array bytes", path, 0);
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
      check_finite(*targets[a], name, id, heads, c.head_dim, path);
    }
  }
  return c;
}

}  // namespace kvsift
