// cuda::vq_lut_scan, A²ATS's per-step scoring: the lookup tables of 32 bf16 query heads against 4096 codewords of
// head_dim 128 (8 kv heads, group 4) and the scan of N codes per (sequence, kv head) into fp32 scores per query head,
// every sequence N long. GB/s counts the bytes the step must move: codes (2 B per token and kv head), scores (4 B
// per token and query head) and the bf16 codebook once (1 MiB per kv head). Also cuda::vq_encode of N prefill
// keys (z = kL and the nearest of 4096 codewords: 4096 * 128 FMAs per key and kv head; on tensor cores above 256
// keys, in fp32 over every SM's share of the codebook up to 256: rows 256 and 257 compare the two kernels).
#include <random>
#include <vector>

#include "gpu_bench.hpp"
#include "kvsift/selectors/a2ats/cuda/vq.hpp"

namespace kvsift::bench {
namespace {

constexpr std::int32_t kQHeads = 32, kKvHeads = 8, kCodewords = 4096, kHeadDim = 128;

void BM_CudaVqLutScan(benchmark::State& state) {
  const std::int32_t n = std::int32_t(state.range(0)), batch = std::int32_t(state.range(1));
  const std::int64_t rows = std::int64_t(batch) * kQHeads;
  Device<bfloat16> codebook(std::size_t(kKvHeads) * kCodewords * kHeadDim), q(std::size_t(rows) * kHeadDim);
  fill_random(codebook.ptr, std::size_t(kKvHeads) * kCodewords * kHeadDim, 3);
  fill_random(q.ptr, std::size_t(rows) * kHeadDim, 4);
  std::vector<std::uint16_t> host_codes(std::size_t(batch) * kKvHeads * n);
  std::mt19937_64 rng(5);
  for (auto& c : host_codes) c = std::uint16_t(rng() % kCodewords);
  Device<std::uint16_t> codes(host_codes.size());
  KVSIFT_CUDA_CHECK(cudaMemcpy(codes.ptr, host_codes.data(), host_codes.size() * 2, cudaMemcpyHostToDevice));
  std::vector<std::int32_t> host_slots(static_cast<std::size_t>(batch)), host_lengths(static_cast<std::size_t>(batch), n);
  for (std::int32_t b = 0; b < batch; ++b) host_slots[b] = batch - 1 - b;
  Device<std::int32_t> slots(static_cast<std::size_t>(batch)), lengths(static_cast<std::size_t>(batch));
  KVSIFT_CUDA_CHECK(cudaMemcpy(slots.ptr, host_slots.data(), std::size_t(batch) * 4, cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(cudaMemcpy(lengths.ptr, host_lengths.data(), std::size_t(batch) * 4, cudaMemcpyHostToDevice));
  Device<float> scores(std::size_t(rows) * n);
  const std::size_t bytes = cuda::vq_lut_scan_workspace_bytes(batch, kQHeads, kKvHeads, kCodewords, kHeadDim);
  Device<std::byte> workspace(std::max<std::size_t>(bytes, 1));
  const auto qv = QueryView<const bfloat16>::packed(q.ptr, batch, kQHeads, kHeadDim);
  const VqCodebook<bfloat16> book{codebook.ptr, kKvHeads, kCodewords, kHeadDim};
  const auto code_view = VqCodesView<const std::uint16_t>::packed(codes.ptr, batch, kKvHeads, n);
  time_calls(state, [&](int, cudaStream_t stream) {
    cuda::vq_lut_scan(qv, book, code_view, slots.ptr, lengths.ptr, MatrixView<float>::packed(scores.ptr, rows, n), {},
                      {workspace.ptr, bytes}, stream);
  });
  const double moved = 2.0 * batch * kKvHeads * n + 4.0 * rows * n + 2.0 * kKvHeads * kCodewords * kHeadDim;
  state.counters["GB/s"] = benchmark::Counter(moved * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["bytes"] = moved;
  state.counters["fused"] = bytes == 0 ? 1 : 0;
}
BENCHMARK(BM_CudaVqLutScan)
    ->ArgsProduct({{32768, 131072}, {1, 8}})
    ->ArgNames({"N", "batch"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

/// cuda::vq_encode of N keys of every kv head (one prefill): bf16 keys, fp32 L, C^z and norms. bytes: what the call
/// must move at least (keys, codes, each kv head's L, C^z and norms once); flop: 2 x the FMAs of z = kL (the
/// triangle) and of the scores against every codeword, the work any exact encoder does.
void BM_CudaVqEncode(benchmark::State& state) {
  const std::int32_t n = std::int32_t(state.range(0));
  Device<bfloat16> keys(std::size_t(n) * kKvHeads * kHeadDim);
  fill_random(keys.ptr, std::size_t(n) * kKvHeads * kHeadDim, 6);
  std::vector<float> host_transform(std::size_t(kKvHeads) * kHeadDim * kHeadDim, 0.0f), host_centroids;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> dist;
  for (std::int32_t h = 0; h < kKvHeads; ++h) {
    for (std::int32_t i = 0; i < kHeadDim; ++i) {
      for (std::int32_t j = 0; j <= i; ++j) {
        host_transform[(std::size_t(h) * kHeadDim + i) * kHeadDim + j] = i == j ? 1.0f : 0.05f * dist(rng);
      }
    }
  }
  host_centroids.resize(std::size_t(kKvHeads) * kCodewords * kHeadDim);
  for (auto& x : host_centroids) x = dist(rng);
  // Consecutive calls read other copies of the codebooks (as each layer reads its own), so none finds them in L2.
  const std::size_t norm_count = std::size_t(kKvHeads) * kCodewords;
  const int copies = copies_for(4 * (host_transform.size() + host_centroids.size() + norm_count));
  Device<float> transform(copies * host_transform.size()), centroids(copies * host_centroids.size()),
      norms(copies * norm_count);
  KVSIFT_CUDA_CHECK(cudaMemcpy(transform.ptr, host_transform.data(), host_transform.size() * 4, cudaMemcpyHostToDevice));
  KVSIFT_CUDA_CHECK(cudaMemcpy(centroids.ptr, host_centroids.data(), host_centroids.size() * 4, cudaMemcpyHostToDevice));
  cuda::vq_codeword_norms(MatrixView<const float>::packed(centroids.ptr, std::int64_t(kKvHeads) * kCodewords, kHeadDim),
                          norms.ptr, nullptr);
  const auto copy_first = [&](float* p, std::size_t count) {
    for (int c = 1; c < copies; ++c) KVSIFT_CUDA_CHECK(cudaMemcpy(p + c * count, p, count * 4, cudaMemcpyDeviceToDevice));
  };
  copy_first(transform.ptr, host_transform.size());
  copy_first(centroids.ptr, host_centroids.size());
  copy_first(norms.ptr, norm_count);
  Device<std::uint16_t> codes(std::size_t(n) * kKvHeads);
  const auto key_view = HeadsView<const bfloat16>::packed(keys.ptr, n, kKvHeads, kHeadDim);
  const auto code_view = VqCodesView<std::uint16_t>::packed(codes.ptr, 1, kKvHeads, n);
  time_calls(state, [&](int i, cudaStream_t stream) {
    const std::size_t c = std::size_t(i % copies);
    const VqEncodeCodebook book{transform.ptr + c * host_transform.size(), centroids.ptr + c * host_centroids.size(),
                                norms.ptr + c * norm_count, kKvHeads, kCodewords, kHeadDim};
    cuda::vq_encode(key_view, book, code_view, {}, {}, stream);
  });
  state.counters["codebook_copies"] = copies;
  const double fmas = double(n) * kKvHeads * (double(kCodewords) * kHeadDim + kHeadDim * (kHeadDim + 1) / 2.0);
  const double moved = double(n) * kKvHeads * (2.0 * kHeadDim + 2.0) +
                       4.0 * kKvHeads * (double(kHeadDim) * kHeadDim + double(kCodewords) * (kHeadDim + 1));
  state.counters["TFLOP/s"] = benchmark::Counter(2 * fmas * state.iterations() / 1e12, benchmark::Counter::kIsRate);
  state.counters["flop"] = 2 * fmas;
  state.counters["bytes"] = moved;
  state.counters["GB/s"] = benchmark::Counter(moved * state.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CudaVqEncode)
    ->Arg(1)
    ->Arg(8)
    ->Arg(64)
    ->Arg(256)
    ->Arg(257)
    ->Arg(32768)
    ->Arg(131072)
    ->ArgNames({"rows"})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(0.1);

}  // namespace
}  // namespace kvsift::bench
