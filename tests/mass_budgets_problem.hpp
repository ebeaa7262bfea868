#pragma once
// Problems and the scalar reference of mass_budgets (cpu/topk.hpp, cuda/topk.hpp; core/ranking.hpp MassBudget),
// shared by the CPU and CUDA tests: rows of softmax weights, ties, zeros and scores too small to count, one score
// holding all the mass, all zeros, and rows with a score outside [0, 1]; ragged counts (0, -1, full); optional
// limits.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kvsift/core/ranking.hpp"
#include "kvsift/core/views.hpp"
#include "test_util.hpp"

namespace kvsift::test {

enum class MassRow { softmax, ties, zeros_and_tiny, one_hot, all_zero, unmeasurable };
inline constexpr MassRow kMassRows[] = {MassRow::softmax,  MassRow::ties,     MassRow::zeros_and_tiny,
                                        MassRow::one_hot,  MassRow::all_zero, MassRow::unmeasurable};

/// `rows` rows of `cols` candidate slots (row stride cols + 3, the slots past a row's count NaN, so that a read
/// past the count shows), a random kind per row.
struct MassBudgetsProblem {
  std::int32_t rows, cols;
  MassBudget budget;  ///< limits: set by options()
  std::vector<float> scores;
  std::vector<std::int32_t> counts, limits;  ///< limits empty: none
  std::vector<MassRow> kinds;

  std::int64_t stride() const { return cols + 3; }

  MassBudgetsProblem(Random& rng, std::int32_t rows_, std::int32_t cols_, bool bad_rows = true)
      : rows(rows_), cols(cols_), scores(std::size_t(rows_ * (cols_ + 3)), std::numeric_limits<float>::quiet_NaN()) {
    budget.mass = rng.uniform_int(0, 3) == 0 ? 1.0 : double(rng.uniform(0.01f, 1.0f));
    budget.maximum = rng.uniform_int(1, cols + 10);
    budget.floor = rng.uniform_int(0, 2) == 0 ? 1 : rng.uniform_int(1, budget.maximum);
    const bool with_limits = rng.uniform_int(0, 2) == 0;
    for (std::int32_t r = 0; r < rows; ++r) {
      const int what = rng.uniform_int(0, 7);
      const std::int32_t n = what == 0 ? 0 : what == 1 && bad_rows ? -1 : what == 2 ? cols : rng.uniform_int(1, cols);
      counts.push_back(n);
      if (with_limits) limits.push_back(rng.uniform_int(0, 3) == 0 ? budget.maximum : rng.uniform_int(0, budget.maximum));
      const MassRow kind = kMassRows[rng.uniform_int(0, 5)];
      kinds.push_back(kind);
      fill_row(rng, scores.data() + r * stride(), std::max(n, 0), kind);
    }
  }

  static void fill_row(Random& rng, float* row, std::int32_t n, MassRow kind) {
    if (n == 0) return;
    if (kind == MassRow::ties) {
      for (std::int32_t i = 0; i < n; ++i) row[i] = float(rng.uniform_int(0, 4)) * 0.0625f;  // few values, 0 too
      return;
    }
    if (kind == MassRow::one_hot || kind == MassRow::all_zero) {
      for (std::int32_t i = 0; i < n; ++i) row[i] = rng.uniform_int(0, 1) == 0 ? 0.0f : -0.0f;
      if (kind == MassRow::one_hot) row[rng.uniform_int(0, n - 1)] = rng.uniform_int(0, 1) == 0 ? 1.0f : 0.7f;
      return;
    }
    // Softmax weights of random logits (a sharp or a flat row).
    const std::vector<float> logits = rng.normal(std::size_t(n), rng.uniform(0.1f, 8.0f));
    const double top = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (const float l : logits) sum += std::exp(double(l) - top);
    for (std::int32_t i = 0; i < n; ++i) row[i] = float(std::exp(double(logits[std::size_t(i)]) - top) / sum);
    if (kind == MassRow::zeros_and_tiny) {
      // Zeros (both signs), scores below half a unit (2^-41: 0 units) and denormals among the weights.
      const float small[] = {0.0f, -0.0f, 1e-13f, 4e-13f, std::numeric_limits<float>::denorm_min(), 5e-13f};
      for (std::int32_t i = 0; i < n; ++i) {
        if (rng.uniform_int(0, 1) == 0) row[i] = small[rng.uniform_int(0, 5)];
      }
    }
    if (kind == MassRow::unmeasurable) {
      const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(), -0.25f, 1.5f, -1e-30f};
      row[rng.uniform_int(0, n - 1)] = bad[rng.uniform_int(0, 5)];
    }
  }

  MatrixView<const float> view(const float* data) const { return {data, rows, cols, stride()}; }
  /// The budget with `limits_data` as its limits where the problem has them.
  MassBudget options(const std::int32_t* limits_data) const {
    MassBudget b = budget;
    b.limits = limits.empty() ? nullptr : limits_data;
    return b;
  }
  std::string label() const {
    std::vector<int> kind_ids;
    for (const MassRow k : kinds) kind_ids.push_back(int(k));
    return fmt::format("rows {} cols {} mass {} floor {} maximum {} counts [{}] limits [{}] kinds [{}]", rows, cols,
                       budget.mass, budget.floor, budget.maximum, fmt::join(counts, ", "), fmt::join(limits, ", "),
                       fmt::join(kind_ids, ", "));
  }
};

/// MassBudget's rule in plain scalar code, written from its statement: units by llround, a full sort, the target
/// as the ceiling of the double product (at most U), then the prefix sums. -1 for a row with count -1.
inline std::int32_t mass_budget_reference(const float* row, std::int32_t n, const MassBudget& b, std::int32_t limit) {
  if (n < 0) return -1;
  const std::int32_t upper = std::min({b.maximum, n, limit});
  if (upper == 0) return 0;
  for (std::int32_t i = 0; i < n; ++i) {
    if (std::isnan(row[i]) || row[i] < 0 || row[i] > 1) return upper;
  }
  std::vector<std::uint64_t> units;
  std::uint64_t total = 0;
  for (std::int32_t i = 0; i < n; ++i) {
    units.push_back(std::uint64_t(std::llround(std::ldexp(double(row[i]), 40))));
    total += units.back();
  }
  std::sort(units.begin(), units.end(), std::greater<>());
  const std::uint64_t target = std::min<std::uint64_t>(total, std::uint64_t(std::ceil(b.mass * double(total))));
  std::int32_t k = 0;
  for (std::uint64_t sum = 0; sum < target; ++k) sum += units[std::size_t(k)];
  return std::min(std::max(k, b.floor), upper);
}

inline std::vector<std::int32_t> mass_budgets_reference(const MassBudgetsProblem& p) {
  std::vector<std::int32_t> want;
  for (std::int32_t r = 0; r < p.rows; ++r) {
    want.push_back(mass_budget_reference(p.scores.data() + r * p.stride(), p.counts[std::size_t(r)], p.budget,
                                         p.limits.empty() ? p.budget.maximum : p.limits[std::size_t(r)]));
  }
  return want;
}

}  // namespace kvsift::test
