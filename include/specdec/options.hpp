// Options of the generation functions, and what the per-step callback sees.
//
// Options are flat aggregates so that callers write designated initializers:
//   specdec::SpeculativeOptions{.max_new_tokens = 64, .eos_token_ids = {2}, .seed = 7, .gamma = 4}
// The fields every function shares come first, in the same order, in every options struct.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <ostream>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/ngram_options.hpp"

namespace specdec {

// What one generation step did, passed to the on_step callback after the step. Views are valid
// during the call only.
struct StepInfo {
  int64_t step = 0;                      // 0-based index of the step in this generation
  int64_t position = 0;                  // sequence position of the first token emitted by the step
  std::span<const int64_t> drafts{};     // the tokens drafted in this step (empty: target only)
  int64_t accepted = 0;                  // how many leading drafts the target accepted
  int64_t token = 0;                     // the token the target sampled after the accepted drafts
  std::span<const int64_t> emitted{};    // tokens appended to the output (accepted drafts + token,
                                         // cut after an end token or at the length limit)
  int64_t gamma = 0;                     // drafts the draft-length policy chose for the step (a
                                         // confidence stop may draft fewer; see drafts.size())
  double entropy = std::numeric_limits<double>::quiet_NaN();
                                         // the drafter's normalised entropy that set gamma (EGAG:
                                         // after smoothing); NaN when the step did not compute it
  double target_seconds = 0;             // wall time of the step's target forwards
  double drafter_seconds = 0;            // wall time of the step's drafting
  int64_t row = 0;                       // batch generation: the prompt's index; 0 otherwise
  double rtt_seconds = 0;                // remote verification: the step's round trip (0 locally)
  double prefill_seconds = 0;            // remote verification: the server's target forward
                                         // within that round trip (0 locally)
};

// What a step callback tells the generation loop.
enum class StepAction {
  proceed,  // go on generating
  stop,     // stop now: the tokens emitted so far are returned, with StopReason::callback
};

// The step callback: any callable taking const StepInfo&, returning void (never stops) or
// StepAction. Empty (default, or nullptr) when no callback is set.
class StepCallback {
 public:
  StepCallback() = default;
  StepCallback(std::nullptr_t) noexcept {}  // NOLINT(google-explicit-constructor)

  template <class F>
    requires(!std::same_as<std::remove_cvref_t<F>, StepCallback> &&
             std::invocable<std::remove_cvref_t<F>&, const StepInfo&>)
  StepCallback(F&& f) {  // NOLINT(google-explicit-constructor)
    using Result = std::invoke_result_t<std::remove_cvref_t<F>&, const StepInfo&>;
    if constexpr (std::is_constructible_v<bool, const std::remove_cvref_t<F>&>) {
      if (!static_cast<bool>(f)) return;  // an empty std::function or a null function pointer
    }
    if constexpr (std::is_void_v<Result>) {
      callback_ = [g = std::forward<F>(f)](const StepInfo& info) mutable {
        g(info);
        return StepAction::proceed;
      };
    } else {
      static_assert(std::same_as<Result, StepAction>, "a step callback returns void or StepAction");
      callback_ = std::forward<F>(f);
    }
  }

  explicit operator bool() const noexcept { return static_cast<bool>(callback_); }
  // Requires a callback to be set.
  StepAction operator()(const StepInfo& info) const { return callback_(info); }

 private:
  std::function<StepAction(const StepInfo&)> callback_;
};

// Why a generation ended.
enum class StopReason {
  max_new_tokens,   // max_new_tokens tokens were generated
  end_token,        // an end token (eos_token_ids) was generated; it ends the output
  stop_sequence,    // a stop sequence was generated; the output ends with its last token
  callback,         // on_step returned StepAction::stop
  sequence_limit,   // the model's max_sequence_length() was reached
  cancelled,        // the request was cancelled (Engine::cancel)
};

inline std::ostream& operator<<(std::ostream& out, StopReason reason) {
  switch (reason) {
    case StopReason::max_new_tokens: return out << "max_new_tokens";
    case StopReason::end_token: return out << "end_token";
    case StopReason::stop_sequence: return out << "stop_sequence";
    case StopReason::callback: return out << "callback";
    case StopReason::sequence_limit: return out << "sequence_limit";
    case StopReason::cancelled: return out << "cancelled";
  }
  return out << "unknown";
}

// Options of autoregressive_generate.
struct GenerationOptions {
  int64_t max_new_tokens = 40;           // most tokens to generate (>= 0); the seeds' max_gen_len
  std::vector<int64_t> eos_token_ids{};  // tokens that end generation (kept in the output); empty:
                                         // generate until max_new_tokens
  std::vector<std::vector<int64_t>> stop_sequences{};  // token sequences that end generation when
                                         // generated (kept in the output); matched over
                                         // the generated tokens, across step boundaries
  std::optional<uint64_t> seed{};        // seed of the sampling generator; unset: nondeterministic
  bool use_cache = true;                 // false recomputes the whole sequence at every forward
  StepCallback on_step{};                // called after every step (may stop); empty: not called
};

// How speculative_generate chooses the number of drafts of each step.
enum class GammaPolicy {
  fixed,     // gamma drafts every step
  egag,      // entropy-adaptive (seed 002 §7): from the drafter's normalised entropy H at the
             // step's first draft position, smoothed by an EMA with egag_ema_beta,
             // gamma = round(gamma_max - H * (gamma_max - gamma_min)); the seeds' use_egag
  schedule,  // start at gamma; +2 after a step whose drafts were all accepted, -1 otherwise
};

// How speculative_generate decides which drafts to keep.
enum class Verification {
  rejection,  // rejection sampling: the output is distributed exactly as the target's
  threshold,  // LOSSY (seed 003): keep draft i while p_i(draft) >= threshold, sample the first
              // failure's replacement from p at that position; under sampling the output is NOT
              // the target's distribution (greedy decoding is unchanged for 0 < threshold <= 1)
};

// Options of speculative_generate (seeds 001, 002, 003).
struct SpeculativeOptions {
  int64_t max_new_tokens = 40;           // most tokens to generate (>= 0); the seeds' max_gen_len
  std::vector<int64_t> eos_token_ids{};  // tokens that end generation (kept in the output)
  std::vector<std::vector<int64_t>> stop_sequences{};  // token sequences that end generation when
                                         // generated (kept in the output); matched over
                                         // the generated tokens, across step boundaries
  std::optional<uint64_t> seed{};        // seed of the sampling generator; unset: nondeterministic
  bool use_cache = true;                 // false recomputes the whole sequence at every forward
  StepCallback on_step{};                // called after every step (may stop); empty: not called
  int64_t gamma = 5;                     // drafts per step (>= 1); fewer near the length limit
  bool first_target = true;              // the first token comes from the target alone (seed 002)
  bool skip_sample_adjustment = false;   // after a rejection sample from p instead of the residual
                                         // max(0, p - q): biased, for experiments only (seed 002)
  GammaPolicy gamma_policy = GammaPolicy::fixed;
  int64_t gamma_min = 1;                // egag, schedule: fewest drafts per step (>= 1)
  std::optional<int64_t> gamma_max{};   // egag, schedule: most drafts per step; unset: gamma
  double egag_ema_beta = 0.0;           // egag: H_t = beta * H_(t-1) + (1 - beta) * H, in [0, 1);
                                        // 0 uses each step's entropy as it is
  // Confidence stop (seed 003's entropy gating), with any policy: drafting ends before a position
  // where the drafter's top probability is below p_min or its normalised entropy above
  // entropy_gate; a step may then draft nothing and sample from the target alone. Both are read
  // from the drafter's own distribution (softmax of its logits, before the processor).
  double p_min = 0.0;                   // in [0, 1]; 0: off
  double entropy_gate = 1.0;            // in [0, 1]; 1: off
  Verification verification = Verification::rejection;
  double threshold = 0.25;              // threshold verification's tau (>= 0; 0 accepts every
                                        // draft, > 1 none)
  bool cuda_graph = false;              // replay each step of gamma drafts as one CUDA graph (the
                                        // drafter's chain, the target's verification and the
                                        // acceptance) where it applies: a drafter model and a
                                        // target that model StaticForwardModel on a CUDA device,
                                        // greedy decoding, a fixed gamma without the confidence
                                        // stop, rejection verification; other steps run eagerly
                                        // (cuda_graph.hpp). On another device those steps run the
                                        // same static-shape computation eagerly (slower than the
                                        // usual step: for tests). Off: the usual steps
};

// Options of ngram_assisted_generate (seed 000, NASD).
struct NGramAssistedOptions {
  int64_t max_new_tokens = 40;           // most tokens to generate (>= 0)
  std::vector<int64_t> eos_token_ids{};  // tokens that end generation (kept in the output)
  std::vector<std::vector<int64_t>> stop_sequences{};  // token sequences that end generation when
                                         // generated (kept in the output); matched over
                                         // the generated tokens, across step boundaries
  std::optional<uint64_t> seed{};        // seed of the sampling generator; unset: nondeterministic
  bool use_cache = true;                 // false recomputes the whole sequence at every forward
  StepCallback on_step{};                // called after every step (may stop); empty: not called
  int64_t gamma = 5;                     // most drafts per step (>= 1)
  int64_t filler_top_k = 3;              // after verification, also teach the storage the target's
                                         // top-k tokens at every verified position (>= 1; 1: only
                                         // the emitted tokens, NAPD-style)
  bool stop_if_unknown = false;          // stop drafting at a context the storage does not know;
                                         // false drafts the context's last token again there
  NGramDraftRule draft_rule{};           // confident drafting: stop a draft where the storage's
                                         // counts are not confident (NGramStorage and
                                         // OneLevelNGramStorage); neutral: draft while known.
                                         // {.min_share = 0.9, .min_context = n - 1} reached 2.66
                                         // accepted tokens per draft at n = 4 (bench_ngram)
  bool first_target = true;              // the first token comes from the target alone
};

}  // namespace specdec
