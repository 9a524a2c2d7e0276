// The cost model behind an Engine's draft length (engine.hpp), from what the engine measures.
//
// A step of b rows drafting k tokens each, m of the rows with the drafter model, costs
//   T(b (k + 1)) + D(k) + O_k,   T(x) = A + B x,   D(k) = f k + p m (k + 1)  (D(0) = 0)
// T is the target's forward over x positions: a fixed part A (the weights read once) and B per
// position. D is the drafting: f per drafted column (one drafter forward for the batch, or the
// host's lookups) and p per position the drafter computes (its first forward of a step feeds
// each row what was emitted since its last draft, about 2 positions, then 1 a column). O_k is
// the rest of a step (verification, sampling, the host copy), measured apart for k = 0 and
// k > 0. Row r, whose drafts are accepted with probability alpha_r each and whose own gamma caps
// it at g_r, emits in expectation E_r(k) = 1 + alpha_r + ... + alpha_r^min(k, g_r) tokens
// (Leviathan et al., 2023, under their i.i.d. acceptance model). The step drafts the k in
// [0, max g_r] that maximises the batch's tokens per second, sum_r E_r(k) / cost(k); k = 0 is the
// target alone (the drafter does not run). On a memory-bound target A dominates and k grows with
// acceptance; where the forward's cost grows with its positions (a compute-bound device, a full
// batch) B dominates and k falls, down to 0.
//
// What is fitted, and from which steps:
// - A and B: decayed least squares over the steps whose forward was no wider than a draft step
//   (rows times the largest gamma + 1). A prompt prefilled in the same forward makes it wider for
//   reasons the draft length does not control, and on a cache-resident model T is not linear
//   that far out: such steps would overstate B several times. Until two widths are seen, B is 0 (drafting looks free), so the
//   engine measures a drafting step before it judges one.
// - f and p: decayed least squares without intercept of the drafting's seconds on its columns
//   and its drafter positions. A row's first draft feeds the drafter its whole prompt and a
//   draft after target-only steps feeds it those steps' tokens: p takes that cost, so it does not
//   inflate f, the cost of one more column.
// - O_0, O_1: decayed means of what the step took beyond the target's and the drafter's forwards.
// - Stalls: the time a step measures only ever grows by what is not its work (the first call's
//   one-time setup, the thread preempted by another process), and a fixed cost inflated by one
//   stall makes drafting look cheap beside it for the tens of steps the decay takes. So the first
//   observation of each kind is dropped, and later ones count at most kOutlier times what the
//   fit predicted for them.
// - alpha_r: the row's decayed count of accepted drafts over drafts tested (accepted plus the
//   first rejected), with one of each as a prior. A request that joins starts from the engine's
//   pooled estimate for its draft method (worth a few steps of its own), not from 1/2: requests
//   are often shorter than the steps an estimate needs to settle.
// While k stays 0 the drafter and the EAGLE head fall behind: a row's next draft first feeds them
// what was emitted since (or the whole prompt of a row that joined meanwhile), every row padded
// to the widest, c positions beyond the usual. Where the batch changes so that drafting pays
// again (it got smaller, say), the next step drafts, catch-up included. Otherwise, after at least
// kExploreEvery target-only steps, one column is drafted to keep alpha, D and B current, once its
// predicted cost beyond a target-only step (one column, and p c for the catch-up) is at most
// kExploreShare of the time the target-only steps took since the last draft: exploring costs at
// most about that share of a run, and a batch whose drafters fall further behind explores less
// often. Each exploration after which drafting still does not pay halves that share, down to
// kExploreShare / 2^kExploreBackoff; the first step that drafts by choice (not to explore) brings
// it back. A batch where speculation does not pay (on the bundled pair on a CPU, anything beyond
// one or two rows) thus pays about 2^-kExploreBackoff of the first share once it has settled, and
// a batch that changes so that drafting pays drafts at once, by the estimates it already has.
// The rule only chooses how many tokens are drafted: what is emitted stays exactly the target's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <utility>

namespace specdec::detail {

// A row's per-draft acceptance, decayed.
class AcceptanceEstimate {
 public:
  static constexpr double kDecay = 0.9;          // per observed step, for a request's own estimate
  static constexpr double kPooledDecay = 0.98;   // for the engine's estimate over all its requests
  static constexpr double kStartWeight = 8.0;    // drafts tested that a pooled start is worth

  explicit AcceptanceEstimate(double decay = kDecay) noexcept : decay_(decay) {}

  // A step verified `drafted` drafts of the row and accepted the leading `accepted`.
  void observe(int64_t drafted, int64_t accepted) noexcept {
    if (drafted <= 0) return;
    accepted_ = decay_ * accepted_ + static_cast<double>(accepted);
    rejected_ = decay_ * rejected_ + (accepted < drafted ? 1.0 : 0.0);
  }
  // Starts from `pooled`'s counts, scaled down to at most `weight` drafts tested.
  void start_from(const AcceptanceEstimate& pooled, double weight = kStartWeight) noexcept {
    const double tested = pooled.accepted_ + pooled.rejected_;
    const double scale = tested > weight ? weight / tested : 1.0;
    accepted_ = pooled.accepted_ * scale;
    rejected_ = pooled.rejected_ * scale;
  }
  [[nodiscard]] double alpha() const noexcept { return (accepted_ + 1.0) / (accepted_ + rejected_ + 2.0); }

 private:
  double decay_;
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
  static constexpr double kOutlier = 3.0;            // most an observation counts, times the fit's
  static constexpr int64_t kExploreEvery = 16;      // fewest target-only steps before a draft
  static constexpr double kExploreShare = 1.0 / 32;  // most of the target-only time an exploring
                                                     // column may cost (see the top of this file)
  static constexpr int64_t kExploreBackoff = 3;      // most halvings of that share

  // A step in which no row was prefilled: the target computed `positions` in `seconds`.
  void observe_target(int64_t positions, double seconds) noexcept {
    if (!std::exchange(seen_[0], true)) return;
    const auto x = static_cast<double>(positions);
    if (s0_ > 0) {
      const auto [a, b] = target_fit();
      seconds = bounded(seconds, a + b * x);
    }
    s0_ = kDecay * s0_ + 1.0;
    s1_ = kDecay * s1_ + x;
    s2_ = kDecay * s2_ + x * x;
    t0_ = kDecay * t0_ + seconds;
    t1_ = kDecay * t1_ + x * seconds;
  }
  // A step that drafted `columns` (> 0) with the drafter computing `positions` (0 for host
  // drafting), in `seconds`.
  void observe_drafting(int64_t columns, int64_t positions, double seconds) noexcept {
    if (columns <= 0 || !std::exchange(seen_[1], true)) return;
    const auto c = static_cast<double>(columns);
    const auto p = static_cast<double>(positions);
    if (cc_ > 0) {
      const auto [f, per_position] = drafting_fit();
      seconds = bounded(seconds, f * c + per_position * p);
    }
    cc_ = kDecay * cc_ + c * c;
    cp_ = kDecay * cp_ + c * p;
    pp_ = kDecay * pp_ + p * p;
    cs_ = kDecay * cs_ + c * seconds;
    ps_ = kDecay * ps_ + p * seconds;
  }
  // What a step (of drafts, or without) took beyond the target's and the drafter's forwards.
  void observe_overhead(bool drafted, double seconds) noexcept {
    if (!std::exchange(seen_[drafted ? 3 : 2], true)) return;
    auto& [weight, sum] = overhead_[drafted ? 1 : 0];
    if (weight > 0) seconds = bounded(seconds, sum / weight);
    weight = kDecay * weight + 1.0;
    sum = kDecay * sum + seconds;
  }

  // A and B (seconds, seconds per position).
  [[nodiscard]] double fixed_seconds() const noexcept { return target_fit().first; }
  [[nodiscard]] double seconds_per_position() const noexcept { return target_fit().second; }
  // f and p: seconds per drafted column and per drafter position (0 before any drafting step).
  [[nodiscard]] double seconds_per_column() const noexcept { return drafting_fit().first; }
  [[nodiscard]] double seconds_per_drafter_position() const noexcept { return drafting_fit().second; }
  // O_0 or O_1.
  [[nodiscard]] double overhead_seconds(bool drafted) const noexcept {
    const auto& measured = overhead_[drafted ? 1 : 0];
    if (measured.first > 0) return measured.second / measured.first;
    const auto& other = overhead_[drafted ? 0 : 1];
    return other.first > 0 ? other.second / other.first : 0.0;
  }

  // The predicted seconds of a step of `rows` rows, `model_rows` of them drafting with the
  // drafter model, drafting k, the drafters catching up on `catch_up` positions if k > 0.
  [[nodiscard]] double step_seconds(int64_t rows, int64_t model_rows, int64_t k, int64_t catch_up = 0) const noexcept {
    const auto [a, b] = target_fit();
    const auto kk = static_cast<double>(k);
    double seconds = a + b * static_cast<double>(rows) * (kk + 1.0) + overhead_seconds(k > 0);
    if (k > 0) {
      const auto [f, p] = drafting_fit();
      seconds += f * kk + p * (static_cast<double>(model_rows) * (kk + 1.0) + static_cast<double>(catch_up));
    }
    return seconds;
  }

  // Whether to draft one column now to measure, after target-only steps that took
  // `idle_seconds` since the last draft (see the top of this file). An exploration it allows
  // counts as futile, halving the next one's share, until chose() is told of a step that drafts.
  [[nodiscard]] bool explore(double idle_seconds, int64_t rows, int64_t model_rows, int64_t catch_up) noexcept {
    const double extra = step_seconds(rows, model_rows, 1, catch_up) - step_seconds(rows, model_rows, 0);
    if (extra > explore_share() * idle_seconds) return false;
    futile_ = std::min(futile_ + 1, kExploreBackoff);
    return true;
  }
  // The step takes choose()'s k: one that drafts (drafting pays) restores the first share.
  void chose(int64_t k) noexcept {
    if (k > 0) futile_ = 0;
  }
  // The most an exploration may cost now, as a share of the target-only time before it.
  [[nodiscard]] double explore_share() const noexcept { return std::ldexp(kExploreShare, -static_cast<int>(futile_)); }

  // The k in [0, max caps] with the most expected tokens per second for rows of acceptances
  // `alphas` and caps `caps` (0: the row drafts nothing), `model_rows` of them drafting with the
  // drafter model. With no target step measured yet: the largest.
  [[nodiscard]] int64_t choose(std::span<const double> alphas, std::span<const int64_t> caps, int64_t model_rows) const {
    const int64_t most = caps.empty() ? 0 : *std::max_element(caps.begin(), caps.end());
    if (most == 0 || s0_ == 0.0) return most;
    const auto rows = static_cast<int64_t>(alphas.size());
    int64_t best = 0;
    double best_rate = -1;
    for (int64_t k = 0; k <= most; ++k) {
      double tokens = 0;
      for (size_t r = 0; r < alphas.size(); ++r) tokens += expected_tokens(alphas[r], std::min(k, caps[r]));
      const double seconds = step_seconds(rows, model_rows, k);
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
  [[nodiscard]] std::pair<double, double> target_fit() const noexcept {
    if (s0_ == 0.0) return {0.0, 0.0};
    const double spread = s0_ * s2_ - s1_ * s1_;
    if (!(spread > 1e-9 * s0_ * s2_)) return {t0_ / s0_, 0.0};
    const double b = (s0_ * t1_ - s1_ * t0_) / spread;
    const double a = (t0_ - b * s1_) / s0_;
    if (b < 0) return {t0_ / s0_, 0.0};
    if (a < 0) return {0.0, t1_ / s2_};
    return {a, b};
  }

  // Decayed least squares of seconds = f columns + p positions, clamped to f, p >= 0; all in f
  // while columns and positions have not varied apart (host drafting, a batch that never changed).
  [[nodiscard]] std::pair<double, double> drafting_fit() const noexcept {
    if (cc_ == 0.0) return {0.0, 0.0};
    const double det = cc_ * pp_ - cp_ * cp_;
    if (det > 1e-9 * cc_ * pp_) {
      const double f = (cs_ * pp_ - ps_ * cp_) / det;
      const double p = (cc_ * ps_ - cp_ * cs_) / det;
      if (f >= 0 && p >= 0) return {f, p};
      if (f < 0) return {0.0, ps_ / pp_};
    }
    return {cs_ / cc_, 0.0};
  }

  // At most kOutlier times the prediction, where there is one.
  [[nodiscard]] static double bounded(double seconds, double predicted) noexcept {
    return predicted > 0 ? std::min(seconds, kOutlier * predicted) : seconds;
  }

  bool seen_[4]{};  // an observation of each kind so far: target, drafting, overhead O_0, O_1
  int64_t futile_ = 0;  // explorations since a step drafted by choice (at most kExploreBackoff)
  double s0_ = 0, s1_ = 0, s2_ = 0, t0_ = 0, t1_ = 0;  // target: positions and seconds
  double cc_ = 0, cp_ = 0, pp_ = 0, cs_ = 0, ps_ = 0;  // drafting: columns, positions, seconds
  std::pair<double, double> overhead_[2]{};            // O_0, O_1: decayed weight and sum
};

}  // namespace specdec::detail
