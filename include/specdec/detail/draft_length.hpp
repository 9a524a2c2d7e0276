// The draft-length policies of speculative_generate: fixed gamma, EGAG, the success schedule, and
// the confidence stop inside a step. Host-side arithmetic only; the drafter's entropy and top
// probability are computed on its device by drafter_signal and read with one copy.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>

#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/options.hpp"

namespace specdec::detail {

// What the policies read from the drafter's distribution at one position.
struct DrafterSignal {
  double entropy = 0;  // entropy / log(vocab), in [0, 1] (0 for a vocabulary of one token)
  double top = 1;      // the largest probability
};

// The normalised entropy and top probability of softmax(logits) for logits [1, vocab]: the
// drafter's own distribution, before any processor. One device-to-host copy (counted).
inline DrafterSignal drafter_signal(const at::Tensor& logits) {
  const int64_t vocab = logits.size(-1);
  const at::Tensor log_p = logits.reshape({vocab}).to(at::kDouble).log_softmax(0);
  const at::Tensor p = log_p.exp();
  // p * log p with 0 * log 0 = 0, for tokens whose logit is -inf.
  const at::Tensor plogp = at::where(p > 0, p * log_p, at::zeros_like(p));
  const at::Tensor host = to_host(at::stack({-plogp.sum(), p.max()}));
  const double* values = host.data_ptr<double>();
  if (!std::isfinite(values[0]) || !std::isfinite(values[1])) {
    throw_non_finite("speculative_generate", "drafter", /*logits_finite=*/false);
  }
  const double entropy = vocab > 1 ? values[0] / std::log(static_cast<double>(vocab)) : 0.0;
  return {std::clamp(entropy, 0.0, 1.0), values[1]};
}

// Validates the draft-length and verification options of SpeculativeOptions.
inline void check_draft_length_options(const SpeculativeOptions& options) {
  if (options.gamma < 1) throw_invalid("gamma", "be >= 1", options.gamma);
  if (options.gamma_min < 1) throw_invalid("gamma_min", "be >= 1", options.gamma_min);
  const int64_t gamma_max = options.gamma_max.value_or(options.gamma);
  if (gamma_max < options.gamma_min) {
    throw_invalid_message("gamma_max must be >= gamma_min = ", options.gamma_min, ", got ",
                          gamma_max);
  }
  if (!(options.egag_ema_beta >= 0.0 && options.egag_ema_beta < 1.0)) {
    throw_invalid("egag_ema_beta", "be in [0, 1)", options.egag_ema_beta);
  }
  if (!(options.p_min >= 0.0 && options.p_min <= 1.0)) {
    throw_invalid("p_min", "be in [0, 1]", options.p_min);
  }
  if (!(options.entropy_gate >= 0.0 && options.entropy_gate <= 1.0)) {
    throw_invalid("entropy_gate", "be in [0, 1]", options.entropy_gate);
  }
  if (!(options.threshold >= 0.0) || std::isinf(options.threshold)) {
    throw_invalid("threshold", "be finite and >= 0", options.threshold);
  }
  switch (options.gamma_policy) {
    case GammaPolicy::fixed:
    case GammaPolicy::egag:
    case GammaPolicy::schedule:
      break;
    default:
      throw_invalid("gamma_policy", "be fixed, egag or schedule", static_cast<int>(options.gamma_policy));
  }
  if (options.verification != Verification::rejection && options.verification != Verification::threshold) {
    throw_invalid("verification", "be rejection or threshold", static_cast<int>(options.verification));
  }
}

// The number of drafts of each step. Use per step: limit(room) before drafting; with
// uses_entropy(), choose(signal, room) once the first drafter distribution is known; stop(signal)
// before each draft; after(drafted, accepted) once the step is verified.
class DraftLength {
 public:
  explicit DraftLength(const SpeculativeOptions& options)
      : policy_(options.gamma_policy),
        gamma_min_(options.gamma_min),
        gamma_max_(options.gamma_max.value_or(options.gamma)),
        beta_(options.egag_ema_beta),
        p_min_(options.p_min),
        entropy_gate_(options.entropy_gate),
        current_(policy_ == GammaPolicy::schedule
                     ? std::clamp(options.gamma, gamma_min_, gamma_max_)
                     : options.gamma) {}

  // The drafts of the next step, or with EGAG their upper bound until choose() is called. `room`
  // is how many drafts fit before the length limit.
  [[nodiscard]] int64_t limit(int64_t room) const {
    return std::max<int64_t>(0, std::min(policy_ == GammaPolicy::egag ? gamma_max_ : current_, room));
  }

  // Whether the drafter's signal is needed at draft position `index` of a step.
  [[nodiscard]] bool needs_signal(int64_t index) const {
    return (policy_ == GammaPolicy::egag && index == 0) || p_min_ > 0.0 || entropy_gate_ < 1.0;
  }
  [[nodiscard]] bool uses_entropy() const { return policy_ == GammaPolicy::egag; }

  // EGAG: smooths the entropy and returns gamma for this step (clamped to [gamma_min, gamma_max]
  // and to room).
  int64_t choose(const DrafterSignal& signal, int64_t room) {
    smoothed_ = has_smoothed_ ? beta_ * smoothed_ + (1.0 - beta_) * signal.entropy : signal.entropy;
    has_smoothed_ = true;
    const auto span = static_cast<double>(gamma_max_ - gamma_min_);
    // Clamped in double first: gamma_max may be as large as int64 allows.
    const double gamma = std::clamp(std::round(static_cast<double>(gamma_max_) - smoothed_ * span),
                                    static_cast<double>(gamma_min_), static_cast<double>(gamma_max_));
    current_ = gamma >= static_cast<double>(gamma_max_) ? gamma_max_
               : gamma <= static_cast<double>(gamma_min_) ? gamma_min_
                                                          : static_cast<int64_t>(gamma);
    return std::min(current_, room);
  }
  // The smoothed entropy behind the last choose(); NaN before the first.
  [[nodiscard]] double smoothed_entropy() const {
    return has_smoothed_ ? smoothed_ : std::numeric_limits<double>::quiet_NaN();
  }

  // The confidence stop: whether to stop drafting before a position with this signal.
  [[nodiscard]] bool stop(const DrafterSignal& signal) const {
    return signal.top < p_min_ || signal.entropy > entropy_gate_;
  }

  // The success schedule: +2 after a step whose drafts were all accepted, -1 otherwise.
  void after(int64_t drafted, int64_t accepted) {
    if (policy_ != GammaPolicy::schedule || drafted == 0) return;
    const int64_t grown = current_ > gamma_max_ - 2 ? gamma_max_ : current_ + 2;  // no overflow
    current_ = std::clamp(accepted == drafted ? grown : current_ - 1, gamma_min_, gamma_max_);
  }

 private:
  GammaPolicy policy_;
  int64_t gamma_min_;
  int64_t gamma_max_;
  double beta_;
  double p_min_;
  double entropy_gate_;
  int64_t current_;
  double smoothed_ = 0;
  bool has_smoothed_ = false;
};

}  // namespace specdec::detail
