#pragma once
/// The kernel of cuda::mass_budgets (core/ranking.hpp MassBudget), launched by kernels/topk_rows.cu: one CTA per
/// row, a radix select over the row's score bits (mass_bits, the digits of mass_digit_shift) whose histograms
/// count both items and fixed-point units (mass_units) per digit. Each pass: the histogram of the candidates that
/// share the digits found so far (a thread merges runs of equal digits in registers before its shared atomics:
/// the first digit is the exponent, where continuous scores crowd a few bins), a block scan of the bins from the
/// top, and the one thread whose bins cross what is left of the target names the threshold digit. After the last
/// digit the threshold bin holds one score: mass_equal_picks. Integer sums throughout (uint64 shared atomics
/// commute), so the result is cpu::mass_budgets' bit for bit.

#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <cstdint>

#include "kvsift/core/ranking.hpp"
#include "kvsift/cuda/detail/launch.cuh"
#include "kvsift/cuda/detail/topk_launch.hpp"

namespace kvsift::cuda::detail {

/// Items and units of a run of radix bins.
struct MassSums {
  unsigned long long units;
  std::int32_t count;
};
struct AddMassSums {
  __host__ __device__ MassSums operator()(const MassSums& a, const MassSums& b) const {
    return {a.units + b.units, a.count + b.count};
  }
};

/// A pass's threshold digit, what is left of the target inside it, and the candidates kept above it so far.
struct MassDecision {
  std::uint32_t digit;
  unsigned long long remaining;
  std::int32_t kept;
};

/// Grid: one CTA per row of p.scores.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) mass_budgets_rows(const __grid_constant__ MassBudgetsParams p) {
  constexpr int kBinsPerThread = kMassRadixBins / kThreads;
  static_assert(kMassRadixBins % kThreads == 0, "whole bins per thread");
  using Scan = cub::BlockScan<MassSums, kThreads>;
  __shared__ std::uint32_t bin_counts[kMassRadixBins];
  __shared__ unsigned long long bin_units[kMassRadixBins];
  __shared__ typename Scan::TempStorage scan;
  __shared__ MassDecision decision;
  programmatic_start();  // the scores, counts and limits
  const std::int64_t r = blockIdx.x;
  const MassBudget& budget = p.budget;
  const std::int32_t n = p.counts[r];
  const std::int32_t limit = budget.limits != nullptr ? budget.limits[r] : budget.maximum;
  // Everything below is uniform over the block: each branch is taken by every thread or none.
  if (n < 0 || n > p.scores.cols || limit < 0 || limit > budget.maximum) {
    if (threadIdx.x == 0) p.row_k[r] = -1;
    return;
  }
  const std::int32_t upper = min(min(budget.maximum, n), limit);
  if (upper == 0) {
    if (threadIdx.x == 0) p.row_k[r] = 0;
    return;
  }
  const float* const row = p.scores.row(r);
  unsigned long long remaining = 0;
  std::uint32_t prefix = 0, prefix_mask = 0;  // the digits found so far, and where they lie
  std::int32_t kept = 0;                      // candidates of higher digits, kept outright
  for (int pass = 0; pass < kMassRadixPasses; ++pass) {
    const int shift = mass_digit_shift(pass);
    const std::uint32_t digit_mask = mass_digit_mask(pass);
    for (int b = threadIdx.x; b < kMassRadixBins; b += kThreads) {
      bin_counts[b] = 0;
      bin_units[b] = 0;
    }
    __syncthreads();
    bool unmeasurable = false;
    std::uint32_t run_digit = 0, run_count = 0;
    unsigned long long run_units = 0;
    for (std::int32_t i = threadIdx.x; i < n; i += kThreads) {
      const float s = __ldg(row + i);
      if (!mass_measurable(s)) {  // only pass 0 can meet one: a row with one returns below
        unmeasurable = true;
        continue;
      }
      const std::uint32_t bits = mass_bits(s);
      if ((bits & prefix_mask) != prefix) continue;
      const std::uint32_t digit = (bits >> shift) & digit_mask;
      if (digit != run_digit && run_count > 0) {
        atomicAdd(bin_counts + run_digit, run_count);
        atomicAdd(bin_units + run_digit, run_units);
        run_count = 0;
        run_units = 0;
      }
      run_digit = digit;
      ++run_count;
      run_units += mass_units(s);
    }
    if (run_count > 0) {
      atomicAdd(bin_counts + run_digit, run_count);
      atomicAdd(bin_units + run_digit, run_units);
    }
    if (__syncthreads_or(unmeasurable)) {
      if (threadIdx.x == 0) p.row_k[r] = upper;
      return;
    }
    // This thread's bins, from the top: kMassRadixBins - 1 - (kBinsPerThread * threadIdx.x + j).
    const int top = kMassRadixBins - 1 - kBinsPerThread * int(threadIdx.x);
    MassSums own{0, 0};
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      own = AddMassSums{}(own, MassSums{bin_units[top - j], std::int32_t(bin_counts[top - j])});
    }
    MassSums above{0, 0}, all{0, 0};
    Scan(scan).ExclusiveScan(own, above, MassSums{0, 0}, AddMassSums{}, all);
    if (pass == 0) {
      remaining = mass_target(budget.mass, all.units);
      if (remaining == 0) {  // every score 0: no candidate is needed
        if (threadIdx.x == 0) p.row_k[r] = mass_row_k(0, budget.floor, upper);
        return;
      }
    }
    // The one thread whose bins take the units from above them to at least `remaining` names the digit.
    if (above.units < remaining && remaining <= above.units + own.units) {
      unsigned long long units = above.units;
      std::int32_t count = above.count;
      for (int j = 0; j < kBinsPerThread; ++j) {
        const int b = top - j;
        if (units + bin_units[b] >= remaining) {
          decision.digit = std::uint32_t(b);
          decision.remaining = remaining - units;
          decision.kept = kept + count;
          break;
        }
        units += bin_units[b];
        count += std::int32_t(bin_counts[b]);
      }
    }
    __syncthreads();
    const std::uint32_t digit = decision.digit;
    remaining = decision.remaining;
    kept = decision.kept;
    if (pass == kMassRadixPasses - 1) {
      if (threadIdx.x == 0) {
        const std::int32_t k = kept + mass_equal_picks(remaining, bin_units[digit], std::int32_t(bin_counts[digit]));
        p.row_k[r] = mass_row_k(k, budget.floor, upper);
      }
      return;
    }
    prefix |= digit << shift;
    prefix_mask |= digit_mask << shift;
    __syncthreads();  // every thread read the decision and the bins before the next pass clears them
  }
}

}  // namespace kvsift::cuda::detail
