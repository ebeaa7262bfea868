// A program outside kvsift that uses its headers (reference attention) and its compiled library
// (the synthetic workload generator), to prove the CMake package works.
#include <cmath>
#include <cstdio>
#include <vector>

#include <kvsift/attention/reference.hpp>
#include <kvsift/eval/synthetic_workload.hpp>

int main() {
  const auto w = kvsift::make_synthetic_workload({.tokens = 256, .q_heads = 4, .kv_heads = 2, .head_dim = 32});
  std::vector<float> o(4 * 32), lse(4);
  kvsift::reference::dense_decode(w.query(), w.kv(), kvsift::StateView<float>::packed(o.data(), lse.data(), 1, 4, 32));
  std::printf("consumer: lse[0] = %f\n", lse[0]);
  return std::isfinite(lse[0]) ? 0 : 1;
}
