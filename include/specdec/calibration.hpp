// Calibration of threshold verification (seed 003): run speculative_generate with
// Verification::threshold over a grid of thresholds on development prompts, and pick the
// threshold whose acceptance rate is closest to a target.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/generate.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"

namespace specdec {

struct CalibrationOptions {
  std::vector<double> thresholds = {0.15, 0.20, 0.25, 0.30, 0.35};  // the grid (seed 003)
  double target_acceptance = 0.7;  // the acceptance rate to aim at, in [0, 1]
};

// The measurements of one threshold, summed over the prompts.
struct CalibrationPoint {
  double threshold = 0;
  GenerationStats stats{};  // the summed counters and times of all the prompts' generations

  [[nodiscard]] double acceptance_rate() const noexcept { return stats.acceptance_rate(); }
  [[nodiscard]] double tokens_per_target_call() const noexcept { return stats.tokens_per_target_call(); }
  [[nodiscard]] double seconds() const noexcept { return stats.total_seconds; }
};

struct CalibrationResult {
  std::vector<CalibrationPoint> points{};  // one per threshold, in grid order
  double best_threshold = 0;  // acceptance closest to the target; on a tie, the larger threshold
};

// Runs speculative_generate(drafter, target, prompt, options with threshold verification at each
// threshold, processor) for every prompt and threshold. Every threshold sees the same prompts and
// the same options.seed, so the grid compares like with like.
//
// Requires: prompts non-empty, each valid for speculative_generate; thresholds non-empty, each
//   finite and >= 0; target_acceptance in [0, 1]; options valid for speculative_generate (its
//   verification and threshold fields are overridden).
// Returns: the table in grid order and the chosen threshold.
// Throws: std::invalid_argument naming the parameter and value; whatever speculative_generate
//   throws.
template <Drafter D, Target T, LogitsProcessor P = GreedyProcessor>
[[nodiscard]] CalibrationResult calibrate_threshold(D& drafter, T& target,
                                                    std::span<const std::vector<int64_t>> prompts,
                                                    const SpeculativeOptions& options = {},
                                                    const CalibrationOptions& calibration = {},
                                                    const P& processor = {}) {
  if (prompts.empty()) throw std::invalid_argument("prompts must not be empty");
  if (calibration.thresholds.empty()) throw std::invalid_argument("thresholds must not be empty");
  for (size_t i = 0; i < calibration.thresholds.size(); ++i) {
    const double t = calibration.thresholds[i];
    if (!(t >= 0.0) || std::isinf(t)) {
      detail::throw_invalid_message("thresholds[", i, "] must be finite and >= 0, got ", t);
    }
  }
  if (!(calibration.target_acceptance >= 0.0 && calibration.target_acceptance <= 1.0)) {
    detail::throw_invalid("target_acceptance", "be in [0, 1]", calibration.target_acceptance);
  }

  CalibrationResult result;
  double best_distance = 0;
  for (const double threshold : calibration.thresholds) {
    SpeculativeOptions run = options;
    run.verification = Verification::threshold;
    run.threshold = threshold;
    GenerationStats sum;
    for (const auto& prompt : prompts) {
      sum += speculative_generate(drafter, target, prompt, run, processor).stats;
    }
    result.points.push_back({threshold, sum});
    const double distance = std::abs(sum.acceptance_rate() - calibration.target_acceptance);
    if (result.points.size() == 1 || distance < best_distance ||
        (distance == best_distance && threshold > result.best_threshold)) {
      best_distance = distance;
      result.best_threshold = threshold;
    }
  }
  return result;
}

}  // namespace specdec
