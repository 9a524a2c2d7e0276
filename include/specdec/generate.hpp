// Generation functions: the autoregressive baseline, speculative decoding with a drafter model
// and n-gram assisted decoding. Each is the shared step loop of step.hpp with its draft source.
//
// Where to find the rest of generation: a draft source of your own runs through
// generate_with(source, target, prompt, options, processor) (step.hpp, included here); the
// options and StopReason are in options.hpp, the result and its GenerationStats in result.hpp,
// both included here. Beam search is beam_search.hpp, STAND drafting/stand.hpp, batches batch.hpp,
// multi-turn sessions session.hpp; specdec.hpp includes them all.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/generation_state.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/ngram_storage.hpp"
#include "specdec/options.hpp"
#include "specdec/result.hpp"
#include "specdec/step.hpp"
#include "specdec/verification.hpp"

namespace specdec {
// Samples from the target one token per forward: the baseline every speculative method equals.
//
// Requires: prompt non-empty with ids in [0, target.vocab_size()); options.max_new_tokens >= 0;
//   eos_token_ids in [0, vocab); prompt no longer than target.max_sequence_length() if it has one.
// Returns: the generated tokens (at most max_new_tokens, ending at the first end token, which is
//   included; fewer when the model's max_sequence_length is reached) and the stats.
// Throws: std::invalid_argument naming the parameter and value on bad input or non-finite logits;
//   whatever the model's forward throws.
template <Target T, LogitsProcessor P = GreedyProcessor>
[[nodiscard]] GenerationResult autoregressive_generate(T& target, std::span<const int64_t> prompt,
                                                       const GenerationOptions& options = {},
                                                       const P& processor = {}) {
  const int64_t limit = detail::sequence_limit(target);
  detail::check_common(options, prompt, static_cast<int64_t>(target.vocab_size()), limit);
  std::vector<int64_t> sequence(prompt.begin(), prompt.end());
  detail::ModelRunner<T> runner(target, "target", options.use_cache);
  NoDrafts none;
  return detail::run_generation(runner, sequence, none, detail::step_options(options), processor, limit,
                                /*draft=*/false);
}

// Speculative decoding (seeds 001, 002): the drafter proposes gamma tokens, the target scores them
// in one forward, and rejection sampling keeps the output distributed exactly as the target's
// (token for token equal to autoregressive_generate with GreedyProcessor). After a rejection both
// caches are pruned to the accepted prefix.
//
// The number of drafts per step follows options.gamma_policy (fixed, EGAG, success schedule) and
// the confidence stop (p_min, entropy_gate); every policy keeps the output exact, since it only
// decides how much to draft from what is already known. The drafter signals these read cost one
// small device-to-host copy each (EGAG: one per step; the confidence stop: one per draft).
// Verification::threshold replaces rejection sampling by seed 003's lossy threshold acceptance.
//
// Requires: everything autoregressive_generate requires; options.gamma >= 1, 1 <= gamma_min <=
//   gamma_max, egag_ema_beta in [0, 1), p_min and entropy_gate in [0, 1], finite threshold >= 0;
//   drafter.vocab_size() == target.vocab_size(). Drafter and target may be on different devices.
// Returns: as autoregressive_generate; stats count drafts, acceptances and forward calls, and
//   on_step sees each step's gamma, entropy and forward times.
// Throws: std::invalid_argument naming the parameter and value on bad input or non-finite logits;
//   whatever a model's forward throws.
template <Drafter D, Target T, LogitsProcessor P = GreedyProcessor>
[[nodiscard]] GenerationResult speculative_generate(D& drafter, T& target,
                                                    std::span<const int64_t> prompt,
                                                    const SpeculativeOptions& options = {},
                                                    const P& processor = {}) {
  ModelDraftSource<D> source(drafter, options.use_cache);
  return generate_with(source, target, prompt, options, processor);
}

// N-gram assisted speculative decoding (seed 000, NASD) and prompt lookup: a model-free drafter
// proposes up to gamma tokens from n-gram statistics, the target verifies them in one forward
// with the same rejection sampling as speculative_generate (q one-hot at each draft), so the
// output is distributed exactly as the target's (token for token equal under greedy decoding).
// The storage learns the prompt, every emitted token and, with filler_top_k > 1, the target's
// top-k tokens at every verified position.
//
// At a context the storage does not know, drafting stops with stop_if_unknown; otherwise the
// context's last token is drafted again (deterministic, and right for runs such as indentation or
// repeated punctuation; a wrong draft costs one verified position, never correctness).
//
// Requires: everything autoregressive_generate requires; gamma >= 1; filler_top_k >= 1.
// Returns: as autoregressive_generate; drafter_calls counts storage look-ups.
// Throws: std::invalid_argument naming the parameter and value; whatever the model throws.
template <NGramDrafter S, Target T, LogitsProcessor P = GreedyProcessor>
[[nodiscard]] GenerationResult ngram_assisted_generate(S& storage, T& target, std::span<const int64_t> prompt,
                                                       const NGramAssistedOptions& options = {},
                                                       const P& processor = {}) {
  if (options.gamma < 1) detail::throw_invalid("gamma", "be >= 1", options.gamma);
  NGramDraftSource<S> source(storage, {.filler_top_k = options.filler_top_k,
                                       .stop_if_unknown = options.stop_if_unknown,
                                       .draft_rule = options.draft_rule});
  return generate_with(source, target, prompt, detail::step_options(options), processor);
}

}  // namespace specdec
