// Internals of the generation loop: validation of the common options and the growing output.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/options.hpp"
#include "specdec/result.hpp"

namespace specdec::detail {

// Validates what every generation function takes (the target's sequence limit applies). Throws
// std::invalid_argument.
template <class Options>
void check_common(const Options& options, std::span<const int64_t> prompt, int64_t vocab,
                  int64_t sequence_limit) {
  if (prompt.empty()) throw std::invalid_argument("prompt must not be empty");
  check_tokens("prompt", prompt, vocab);
  check_tokens("eos_token_ids", options.eos_token_ids, vocab);
  if constexpr (requires { options.stop_sequences; }) {
    for (size_t i = 0; i < options.stop_sequences.size(); ++i) {
      const std::string name = "stop_sequences[" + std::to_string(i) + "]";
      if (options.stop_sequences[i].empty()) throw std::invalid_argument(name + " must not be empty");
      check_tokens(name, options.stop_sequences[i], vocab);
    }
  }
  if (options.max_new_tokens < 0) throw_invalid("max_new_tokens", "be >= 0", options.max_new_tokens);
  if (static_cast<int64_t>(prompt.size()) > sequence_limit) {
    throw_invalid_message("prompt length ", prompt.size(),
                          " must not exceed the target's max_sequence_length ", sequence_limit);
  }
}

// What one step emits: the drafts it reports, how many leading drafts were accepted, the token
// the target sampled after them, and what the step callback and stats see beyond that.
struct EmittedStep {
  std::span<const int64_t> drafts{};  // StepInfo::drafts
  int64_t accepted = 0;
  int64_t token = 0;
  int64_t gamma = -1;                 // drafts the policy chose; -1: drafts.size()
  double entropy = std::numeric_limits<double>::quiet_NaN();
  int64_t verified = -1;              // draft tokens the target scored (stats.drafted); -1:
                                      // drafts.size() (a tree verifies more than it reports)
  double rtt_seconds = 0;             // remote verification: StepInfo::rtt_seconds
  double prefill_seconds = 0;         // remote verification: StepInfo::prefill_seconds
};

// The sequence being generated (prompt plus output, in a vector the caller owns: a session's
// tokens or a call's own copy of the prompt), the stopping rules and the step callback.
class GenerationState {
 public:
  template <class Options>
  GenerationState(std::vector<int64_t>& sequence, const Options& options, int64_t sequence_limit)
      : sequence_(sequence),
        prompt_length_(static_cast<int64_t>(sequence.size())),
        limit_(sequence_limit),
        max_new_tokens_(options.max_new_tokens),
        end_(prompt_length_ + std::min(options.max_new_tokens, sequence_limit - prompt_length_)),
        eos_(options.eos_token_ids),
        on_step_(options.on_step),
        start_(std::chrono::steady_clock::now()) {
    if constexpr (requires { options.stop_sequences; }) stop_sequences_ = options.stop_sequences;
    if (room() <= 0) set_reason(stop_reason_at_end());
  }

  // Tokens so far, prompt included.
  [[nodiscard]] std::span<const int64_t> sequence() const noexcept { return sequence_; }
  [[nodiscard]] int64_t length() const noexcept { return static_cast<int64_t>(sequence_.size()); }
  // The most tokens the sequence may hold: the target's limit.
  [[nodiscard]] int64_t limit() const noexcept { return limit_; }
  // Tokens that can still be appended.
  [[nodiscard]] int64_t room() const noexcept { return stopped_ ? 0 : end_ - length(); }
  [[nodiscard]] bool finished() const noexcept { return room() <= 0; }

  GenerationStats& stats() noexcept { return stats_; }
  // The batch row StepInfo reports (batch generation).
  void set_row(int64_t row) noexcept { row_ = row; }

  // Appends the accepted drafts and the sampled token, stopping after an end token, a stop
  // sequence or at the length limit, counts the step, runs `after` (what the draft source learns
  // from the step, so that its time is in the step's report) and reports the step to the
  // callback, which may stop generation.
  void emit(const EmittedStep& step) {
    emit(step, [] {});
  }
  template <class After>
  void emit(const EmittedStep& step, After&& after) {
    const int64_t position = length();
    const auto append = [&](int64_t t) {
      if (finished()) return;
      sequence_.push_back(t);
      if (std::find(eos_.begin(), eos_.end(), t) != eos_.end()) {
        set_reason(StopReason::end_token);
      } else if (ends_with_stop_sequence()) {
        set_reason(StopReason::stop_sequence);
      } else if (length() >= end_) {
        set_reason(stop_reason_at_end());
      }
    };
    for (int64_t i = 0; i < step.accepted; ++i) append(step.drafts[static_cast<size_t>(i)]);
    append(step.token);
    const auto reported = static_cast<int64_t>(step.drafts.size());
    ++stats_.steps;
    stats_.drafted += step.verified >= 0 ? step.verified : reported;
    stats_.accepted += step.accepted;
    stats_.rtt_seconds += step.rtt_seconds;
    stats_.prefill_seconds += step.prefill_seconds;
    after();
    if (on_step_) {
      const StepAction action = on_step_(StepInfo{
          .step = stats_.steps - 1,
          .position = position,
          .drafts = step.drafts,
          .accepted = step.accepted,
          .token = step.token,
          .emitted = std::span<const int64_t>(sequence_).subspan(static_cast<size_t>(position)),
          .gamma = step.gamma >= 0 ? step.gamma : reported,
          .entropy = step.entropy,
          .target_seconds = stats_.target_seconds - reported_target_seconds_,
          .drafter_seconds = stats_.drafter_seconds - reported_drafter_seconds_,
          .row = row_,
          .rtt_seconds = step.rtt_seconds,
          .prefill_seconds = step.prefill_seconds});
      if (action == StepAction::stop && !stopped_) set_reason(StopReason::callback);
    }
    reported_target_seconds_ = stats_.target_seconds;
    reported_drafter_seconds_ = stats_.drafter_seconds;
  }

  // The tokens generated by this call, its stats and why it stopped (max_new_tokens when it was
  // left before finishing, which only an exception does).
  [[nodiscard]] GenerationResult finish() && {
    stats_.generated = length() - prompt_length_;
    stats_.total_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    return GenerationResult{
        std::vector<int64_t>(sequence_.begin() + prompt_length_, sequence_.end()), stats_,
        stopped_ ? reason_ : StopReason::max_new_tokens};
  }

 private:
  void set_reason(StopReason reason) noexcept {
    reason_ = reason;
    stopped_ = true;
  }

  // Why the sequence stops at end_: the model's limit when it comes before max_new_tokens.
  [[nodiscard]] StopReason stop_reason_at_end() const noexcept {
    return limit_ - prompt_length_ < max_new_tokens_ ? StopReason::sequence_limit
                                                     : StopReason::max_new_tokens;
  }

  // Whether the generated tokens end with one of the stop sequences.
  [[nodiscard]] bool ends_with_stop_sequence() const noexcept {
    const int64_t generated = length() - prompt_length_;
    for (const auto& stop : stop_sequences_) {
      const auto n = static_cast<int64_t>(stop.size());
      if (n <= generated && std::equal(stop.begin(), stop.end(), sequence_.end() - n)) return true;
    }
    return false;
  }

  std::vector<int64_t>& sequence_;
  int64_t prompt_length_;
  int64_t limit_;
  int64_t max_new_tokens_;
  int64_t end_;
  std::span<const int64_t> eos_;
  std::span<const std::vector<int64_t>> stop_sequences_;
  const StepCallback& on_step_;
  std::chrono::steady_clock::time_point start_;
  GenerationStats stats_;
  double reported_target_seconds_ = 0;   // stats_ times at the last emit, for per-step times
  double reported_drafter_seconds_ = 0;
  // Why it stopped, once stopped_ (a flag beside a value, not an optional: GCC's
  // -Wmaybe-uninitialized misreads an optional's payload where this state is inlined).
  StopReason reason_ = StopReason::max_new_tokens;
  bool stopped_ = false;
  int64_t row_ = 0;
};

}  // namespace specdec::detail
