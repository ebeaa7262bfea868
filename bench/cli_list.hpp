#pragma once
/// The comma-separated lists of the CPU tools' command lines (kvsift_a2ats_codebook, kvsift_specontext_persistence).

#include <algorithm>
#include <string>
#include <vector>

namespace kvsift::bench {

/// "a,b,,c" -> {"a", "b", "", "c"}; "" -> {""}.
inline std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  for (std::size_t start = 0; start <= list.size();) {
    const std::size_t end = std::min(list.find(',', start), list.size());
    out.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

}  // namespace kvsift::bench
