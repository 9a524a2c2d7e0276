// Options of the generation functions, and what the per-step callback sees.
//
// Options are flat aggregates so that callers write designated initializers:
//   specdec::SpeculativeOptions{.max_new_tokens = 64, .eos_token_ids = {2}, .seed = 7, .gamma = 4}
// The fields every function shares come first, in the same order, in every options struct.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

namespace specdec {

// What one generation step did, passed to the on_step callback after the step. Views are valid
// during the call only.
struct StepInfo {
  int64_t step = 0;                      // 0-based index of the step in this generation
  int64_t position = 0;                  // sequence position of the first token emitted by the step
  std::span<const int64_t> drafts;       // the tokens drafted in this step (empty: target only)
  int64_t accepted = 0;                  // how many leading drafts the target accepted
  int64_t token = 0;                     // the token the target sampled after the accepted drafts
  std::span<const int64_t> emitted;      // tokens appended to the output (accepted drafts + token,
                                         // cut after an end token or at the length limit)
};

using StepCallback = std::function<void(const StepInfo&)>;

// Options of autoregressive_generate.
struct GenerationOptions {
  int64_t max_new_tokens = 40;          // most tokens to generate (>= 0); the seeds' max_gen_len
  std::vector<int64_t> eos_token_ids;   // tokens that end generation (kept in the output); empty:
                                        // generate until max_new_tokens
  std::optional<uint64_t> seed;         // seed of the sampling generator; unset: nondeterministic
  bool use_cache = true;                // false recomputes the whole sequence at every forward
  StepCallback on_step;                 // called after every step; empty: not called
};

// Options of speculative_generate (seeds 001, 002).
struct SpeculativeOptions {
  int64_t max_new_tokens = 40;          // most tokens to generate (>= 0); the seeds' max_gen_len
  std::vector<int64_t> eos_token_ids;   // tokens that end generation (kept in the output)
  std::optional<uint64_t> seed;         // seed of the sampling generator; unset: nondeterministic
  bool use_cache = true;                // false recomputes the whole sequence at every forward
  StepCallback on_step;                 // called after every step; empty: not called
  int64_t gamma = 5;                    // drafts per step (>= 1); fewer near the length limit
  bool first_target = true;             // the first token comes from the target alone (seed 002)
  bool skip_sample_adjustment = false;  // after a rejection sample from p instead of the residual
                                        // max(0, p - q): biased, for experiments only (seed 002)
};

// Options of ngram_assisted_generate (seed 000, NASD).
struct NGramAssistedOptions {
  int64_t max_new_tokens = 40;          // most tokens to generate (>= 0)
  std::vector<int64_t> eos_token_ids;   // tokens that end generation (kept in the output)
  std::optional<uint64_t> seed;         // seed of the sampling generator; unset: nondeterministic
  bool use_cache = true;                // false recomputes the whole sequence at every forward
  StepCallback on_step;                 // called after every step; empty: not called
  int64_t gamma = 5;                    // most drafts per step (>= 1)
  int64_t filler_top_k = 3;             // after verification, also teach the storage the target's
                                        // top-k tokens at every verified position (>= 1; 1: only
                                        // the emitted tokens, NAPD-style)
  bool stop_if_unknown = false;         // stop drafting at a context the storage does not know;
                                        // false drafts the context's last token again there
  bool first_target = true;             // the first token comes from the target alone
};

}  // namespace specdec
