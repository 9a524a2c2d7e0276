// The cost model behind an Engine's draft length (engine.hpp), from what the engine measures.
//
// A step of b rows drafting k tokens each costs
//   T(b (k + 1)) + k d,   with T(x) = A + B x
// the target's forward over x positions (a fixed part A, the weights read once, and B per
// position), and d the drafting of one column for the batch (the drafter's forwards, or host
// lookups). Row r, whose drafts are accepted with probability alpha_r each and whose own gamma
// caps it at g_r, emits in expectation E_r(k) = 1 + alpha_r + ... + alpha_r^min(k, g_r) tokens
// (Leviathan et al., 2023, under their i.i.d. acceptance model). The step drafts the k in
// [0, max g_r] that maximises the batch's tokens per second, sum_r E_r(k) / (T(b (k + 1)) + k d);
// k = 0 is the target alone (the drafter does not run). On a memory-bound target A dominates and
// k grows with acceptance; where the forward's cost grows with its positions (a compute-bound
// device, a full batch) B dominates and k falls, down to 0.
//
// A, B and d are decayed least-squares fits to the steps the engine ran; alpha_r is the row's
// decayed count of accepted drafts over drafts tested (accepted plus the first rejected), with one
// of each as a prior. Until two different widths are seen, B is taken as 0 (drafting looks free),
// so the engine measures a drafting step before it judges one; while k stays 0 it drafts one
// column every kExploreEvery steps to keep alpha, d and B current. The rule only chooses how many
// tokens are drafted: what is emitted stays exactly the target's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

namespace specdec::detail {

// A row's per-draft acceptance, decayed.
class AcceptanceEstimate {
 public:
  static constexpr double kDecay = 0.9;  // per observed step

  // A step verified `drafted` drafts of the row and accepted the leading `accepted`.
  void observe(int64_t drafted, int64_t accepted) {
    if (drafted <= 0) return;
    accepted_ = kDecay * accepted_ + static_cast<double>(accepted);
    rejected_ = kDecay * rejected_ + (accepted < drafted ? 1.0 : 0.0);
  }
  [[nodiscard]] double alpha() const noexcept { return (accepted_ + 1.0) / (accepted_ + rejected_ + 2.0); }

 private:
  double accepted_ = 0, rejected_ = 0;
};

// E(k) = 1 + alpha + ... + alpha^k: the tokens a step of k drafts emits in expectation.
inline double expected_tokens(double alpha, int64_t k) {
  return alpha >= 1.0 ? static_cast<double>(k + 1) : (1.0 - std::pow(alpha, static_cast<double>(k + 1))) / (1.0 - alpha);
}

// The fitted costs of the top of this file.
class DraftCostModel {
 public:
  static constexpr double kDecay = 0.95;        // per observed step
  static constexpr int64_t kExploreEvery = 16;  // steps at k = 0 between two one-column steps

  // One step: `positions` computed by the target in `target_seconds`; `columns` drafted in
  // `drafter_seconds`.
  void observe(int64_t positions, double target_seconds, int64_t columns, double drafter_seconds) {
    const auto x = static_cast<double>(positions);
    s0_ = kDecay * s0_ + 1.0;
    s1_ = kDecay * s1_ + x;
    s2_ = kDecay * s2_ + x * x;
    t0_ = kDecay * t0_ + target_seconds;
    t1_ = kDecay * t1_ + x * target_seconds;
    if (columns > 0) {
      c0_ = kDecay * c0_ + static_cast<double>(columns);
      d0_ = kDecay * d0_ + drafter_seconds;
    }
  }

  // A and B (seconds, seconds per position).
  [[nodiscard]] double fixed_seconds() const noexcept { return fit().first; }
  [[nodiscard]] double seconds_per_position() const noexcept { return fit().second; }
  // d: seconds per drafted column (0 before any drafting step).
  [[nodiscard]] double seconds_per_column() const noexcept { return c0_ > 0 ? d0_ / c0_ : 0.0; }

  // The k in [0, max caps] with the most expected tokens per second for rows of acceptances
  // `alphas` and caps `caps` (0: the row drafts nothing). With nothing measured yet: the largest.
  [[nodiscard]] int64_t choose(std::span<const double> alphas, std::span<const int64_t> caps) const {
    const int64_t most = caps.empty() ? 0 : *std::max_element(caps.begin(), caps.end());
    if (most == 0 || s0_ == 0.0) return most;
    const auto [a, b] = fit();
    const double d = seconds_per_column();
    const auto rows = static_cast<double>(alphas.size());
    int64_t best = 0;
    double best_rate = -1;
    for (int64_t k = 0; k <= most; ++k) {
      double tokens = 0;
      for (size_t r = 0; r < alphas.size(); ++r) tokens += expected_tokens(alphas[r], std::min(k, caps[r]));
      const double seconds = a + b * rows * static_cast<double>(k + 1) + d * static_cast<double>(k);
      const double rate = seconds > 0 ? tokens / seconds : tokens;
      if (rate > best_rate) {
        best_rate = rate;
        best = k;
      }
    }
    return best;
  }

 private:
  // Decayed least squares of seconds on positions, clamped to A, B >= 0; flat (B = 0) until the
  // positions vary.
  [[nodiscard]] std::pair<double, double> fit() const noexcept {
    if (s0_ == 0.0) return {0.0, 0.0};
    const double spread = s0_ * s2_ - s1_ * s1_;
    if (!(spread > 1e-9 * s0_ * s2_)) return {t0_ / s0_, 0.0};
    const double b = (s0_ * t1_ - s1_ * t0_) / spread;
    const double a = (t0_ - b * s1_) / s0_;
    if (b < 0) return {t0_ / s0_, 0.0};
    if (a < 0) return {0.0, t1_ / s2_};
    return {a, b};
  }

  double s0_ = 0, s1_ = 0, s2_ = 0, t0_ = 0, t1_ = 0;  // positions and target seconds
  double c0_ = 0, d0_ = 0;                             // drafted columns and drafter seconds
};

}  // namespace specdec::detail
