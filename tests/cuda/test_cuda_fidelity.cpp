// The CUDA path on real attention: selections that the reference selectors make on the committed SmolLM2
// capture, attended by cuda::sparse_decode over the capture's fp16 cache in its own [token][head][channel]
// layout, agree with the reference sparse attention over the same fp16 data.
#include <gtest/gtest.h>

#include <string>

#include "attention_check.hpp"
#include "cuda/gpu_test.hpp"
#include "kvsift/cuda/decode.hpp"
#include "kvsift/attention/reference.hpp"
#include "kvsift/eval/capture.hpp"
#include "kvsift/eval/fidelity.hpp"
#include "test_util.hpp"

namespace kvsift {
namespace {

using test::DeviceBuffer;

class CudaFidelity : public test::GpuTest {};

std::vector<float> widen(const half* data, std::size_t n) {
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = to_float(data[i]);
  return out;
}

TEST_F(CudaFidelity, SelectionsOnARealCaptureAgreeWithTheReference) {
  const Capture c = read_capture(std::string(KVSIFT_TEST_DATA_DIR) + "/gpl3_512_l3_l15.kvscap");
  constexpr std::int32_t kBudget = 48, kPositions = 6;
  const std::int32_t qd = c.q_heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
  for (std::size_t layer = 0; layer < c.layers.size(); ++layer) {
    const CaptureLayer& l = c.layers[layer];
    DeviceBuffer<half> d_k(l.k), d_v(l.v);
    const std::vector<float> k = widen(l.k.data(), l.k.size()), q_all = widen(l.q.data(), l.q.size());
    for (std::int32_t pos = c.tokens - kPositions; pos < c.tokens; ++pos) {
      // The cache before pos, as the kernels see it: tokens [0, pos) of the capture's arrays.
      const auto kv_of = [&](const half* kp, const half* vp) {
        return ContiguousKVView<const half>{kp, vp, nullptr, 1, c.kv_heads, pos, c.head_dim, std::int64_t(c.tokens) * kvd,
                                            c.head_dim, kvd};
      };
      const std::vector<half> q(l.q.begin() + std::size_t(pos) * qd, l.q.begin() + std::size_t(pos + 1) * qd);
      DeviceBuffer<half> d_q(q);
      for (const auto& entry : reference_selectors()) {
        SCOPED_TRACE(testing::Message() << entry.name << ", layer " << l.layer << ", position " << pos);
        AnySelector<float> selector = entry.make(kBudget);
        selector.prepare({{q_all.data(), 1, c.q_heads, pos, c.head_dim, std::int64_t(c.tokens) * qd, c.head_dim, qd},
                          {k.data(), k.data(), nullptr, 1, c.kv_heads, pos, c.head_dim, std::int64_t(c.tokens) * kvd,
                           c.head_dim, kvd}});
        test::HostSelection sel(1, c.kv_heads, kBudget, false);
        selector.select(QueryView<const float>::packed(q_all.data() + std::size_t(pos) * qd, 1, c.q_heads, c.head_dim),
                        sel.view);

        test::HostState ref(1, c.q_heads, c.head_dim);
        reference::sparse_decode(QueryView<const half>::packed(q.data(), 1, c.q_heads, c.head_dim),
                                 kv_of(l.k.data(), l.v.data()), sel.view, ref.view);

        DeviceBuffer<std::int32_t> d_idx(sel.indices), d_counts(sel.counts);
        DeviceBuffer<half> d_o(q.size());
        DeviceBuffer<float> d_lse(c.q_heads);
        d_o.poison();
        d_lse.poison();
        const auto qv = QueryView<const half>::packed(d_q.data(), 1, c.q_heads, c.head_dim);
        const SelectionView d_sel{d_idx.data(), d_counts.data(), nullptr, 1, c.kv_heads, kBudget};
        const auto kv = kv_of(d_k.data(), d_v.data());
        DeviceBuffer<std::byte> ws(std::max<std::size_t>(cuda::sparse_decode_workspace_bytes(qv, kv, d_sel), 1));
        cuda::sparse_decode(qv, kv, d_sel, StateView<half>::packed(d_o.data(), d_lse.data(), 1, c.q_heads, c.head_dim),
                            {ws.data(), ws.size()}, nullptr);
        test::expect_close(d_o.download(), d_lse.download(), ref, entry.name);
      }
    }
  }
}

}  // namespace
}  // namespace kvsift
