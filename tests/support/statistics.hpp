// Chi-square goodness of fit for the distribution tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

namespace specdec::test {

// The upper quantile of the chi-square distribution with `dof` degrees of freedom at the normal
// quantile z (z = 4.75 for a tail of 1e-6), by the Wilson-Hilferty approximation (accurate to a
// few percent for dof >= 3, conservative enough with the margins used here).
inline double chi_square_quantile(int64_t dof, double z) {
  const double k = static_cast<double>(dof);
  const double t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

struct ChiSquare {
  double statistic = 0;        // sum over cells of (observed - expected)^2 / expected
  int64_t dof = 0;             // cells with nonzero expectation - 1
  int64_t outside_support = 0; // samples in cells of probability 0
  double min_expected = 0;     // smallest expected count among cells with probability > 0
};

// observed: counts per cell; expected_probability: exact cell probabilities (summing to 1).
template <class Key>
ChiSquare chi_square(const std::map<Key, int64_t>& observed,
                     const std::map<Key, double>& expected_probability, int64_t samples) {
  ChiSquare result;
  result.min_expected = static_cast<double>(samples);
  for (const auto& [cell, count] : observed) {
    const auto it = expected_probability.find(cell);
    if (it == expected_probability.end() || it->second <= 0.0) result.outside_support += count;
  }
  for (const auto& [cell, probability] : expected_probability) {
    if (probability <= 0.0) continue;
    const double expected = probability * static_cast<double>(samples);
    const auto it = observed.find(cell);
    const double count = it == observed.end() ? 0.0 : static_cast<double>(it->second);
    result.statistic += (count - expected) * (count - expected) / expected;
    result.min_expected = std::min(result.min_expected, expected);
    ++result.dof;
  }
  --result.dof;
  return result;
}

}  // namespace specdec::test
