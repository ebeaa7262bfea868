#pragma once
// A²ATS's codebooks for the benchmarks (bench_gpu_step.cpp, bench_gpu_select_step.cpp): 4096 random codewords per kv
// head with L = I (so C = C^z), Llama 3's RoPE base, b = 2048. Speed does not depend on the values, except through
// how much a group's heads' choices overlap (the benchmarks' `selected` counters say).
#include <cstdint>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "kvsift/selectors/a2ats/codebook.hpp"

namespace kvsift::bench {

inline const A2atsLayerCodebooks& a2ats_bench_codebooks(std::int32_t kv_heads, std::int32_t head_dim) {
  constexpr std::int32_t kCodewords = 4096;
  struct Arrays {
    std::vector<float> transform, centroids;
    A2atsLayerCodebooks view;
  };
  static std::map<std::pair<std::int32_t, std::int32_t>, Arrays> made;  // one set per shape, for the process
  auto [it, fresh] = made.try_emplace({kv_heads, head_dim});
  Arrays& a = it->second;
  if (fresh) {
    a.transform.assign(std::size_t(kv_heads) * head_dim * head_dim, 0.0f);
    for (std::int32_t h = 0; h < kv_heads; ++h) {
      for (std::int32_t i = 0; i < head_dim; ++i) a.transform[(std::size_t(h) * head_dim + i) * head_dim + i] = 1.0f;
    }
    std::mt19937_64 rng(7);
    std::normal_distribution<float> dist;
    a.centroids.resize(std::size_t(kv_heads) * kCodewords * head_dim);
    for (float& x : a.centroids) x = dist(rng);
    a.view = {.transform = a.transform.data(), .centroids = a.centroids.data(), .codebook = a.centroids.data(),
              .kv_heads = kv_heads, .codewords = kCodewords, .head_dim = head_dim, .rope = {.theta = 500000.0},
              .offset = 2048, .windowed_rope = true};
  }
  return a.view;
}

}  // namespace kvsift::bench
