// Generation functions: the autoregressive baseline and speculative decoding with a model drafter.
// Both run on the verification core of verification.hpp; they differ only in where drafts come
// from.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/generation_state.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/result.hpp"
#include "specdec/verification.hpp"

namespace specdec {
namespace detail {

// One step without drafts: sample the next token from the target (a verification of gamma = 0).
template <LanguageModel T, LogitsProcessor P>
void target_step(ModelRunner<T>& target, GenerationState& state, const P& processor,
                 at::Generator& gen) {
  const at::Tensor logits = target.forward(state.sequence(), at::Tensor());
  const at::Tensor probs = processor(logits.narrow(0, logits.size(0) - 1, 1));
  const at::Tensor no_drafts = at::empty({0}, at::TensorOptions().dtype(at::kLong).device(target.device()));
  const VerifiedStep step = verify_drafts(probs, at::Tensor(), no_drafts, processor, gen);
  state.emit({}, 0, step.token);
}

}  // namespace detail

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
  detail::GenerationState state(prompt, options, limit);
  at::Generator gen = detail::make_generator(options.seed);
  detail::ModelRunner<T> runner(target, "target", options.use_cache,
                                {&state.stats().target_calls, &state.stats().target_seconds});
  while (!state.finished()) detail::target_step(runner, state, processor, gen);
  return std::move(state).finish();
}

// Speculative decoding (seeds 001, 002): the drafter proposes gamma tokens, the target scores them
// in one forward, and rejection sampling keeps the output distributed exactly as the target's
// (token for token equal to autoregressive_generate with GreedyProcessor). After a rejection both
// caches are pruned to the accepted prefix.
//
// Requires: everything autoregressive_generate requires, and options.gamma >= 1,
//   drafter.vocab_size() == target.vocab_size(). Drafter and target may be on different devices.
// Returns: as autoregressive_generate; stats count drafts, acceptances and forward calls.
// Throws: std::invalid_argument naming the parameter and value on bad input or non-finite logits;
//   whatever a model's forward throws.
template <Drafter D, Target T, LogitsProcessor P = GreedyProcessor>
[[nodiscard]] GenerationResult speculative_generate(D& drafter, T& target,
                                                    std::span<const int64_t> prompt,
                                                    const SpeculativeOptions& options = {},
                                                    const P& processor = {}) {
  const auto vocab = static_cast<int64_t>(target.vocab_size());
  if (static_cast<int64_t>(drafter.vocab_size()) != vocab) {
    detail::throw_invalid_message("drafter.vocab_size() must equal target.vocab_size() = ", vocab,
                                  ", got ", drafter.vocab_size());
  }
  if (options.gamma < 1) detail::throw_invalid("gamma", "be >= 1", options.gamma);
  const int64_t limit = std::min(detail::sequence_limit(target), detail::sequence_limit(drafter));
  detail::check_common(options, prompt, vocab, limit);

  detail::GenerationState state(prompt, options, limit);
  GenerationStats& stats = state.stats();
  at::Generator gen = detail::make_generator(options.seed);
  detail::ModelRunner<T> target_runner(target, "target", options.use_cache,
                                       {&stats.target_calls, &stats.target_seconds});
  detail::ModelRunner<D> drafter_runner(drafter, "drafter", options.use_cache,
                                        {&stats.drafter_calls, &stats.drafter_seconds});
  const VerifyOptions verify{.skip_sample_adjustment = options.skip_sample_adjustment};

  if (options.first_target && !state.finished()) {
    detail::target_step(target_runner, state, processor, gen);
  }
  std::vector<at::Tensor> draft_probs;
  while (!state.finished()) {
    // Leave room for the token the target adds after the drafts.
    const int64_t gamma = std::min(options.gamma, state.room() - 1);
    draft_probs.clear();
    at::Tensor drafts = at::empty({1, 0}, at::TensorOptions().dtype(at::kLong).device(drafter_runner.device()));
    for (int64_t i = 0; i < gamma; ++i) {
      const at::Tensor logits = drafter_runner.forward(state.sequence(), drafts);
      const at::Tensor q = processor(logits.narrow(0, logits.size(0) - 1, 1));
      drafts = at::cat({drafts, processor.sample(q, gen).view({1, 1})}, 1);
      draft_probs.push_back(q);
    }
    const at::Tensor target_drafts = drafts.to(target_runner.device());
    const at::Tensor logits = target_runner.forward(state.sequence(), target_drafts);
    const at::Tensor p = processor(logits.narrow(0, logits.size(0) - gamma - 1, gamma + 1));
    const at::Tensor q = gamma > 0 ? at::cat(draft_probs, 0).to(p.device()) : at::Tensor();
    const VerifiedStep step = verify_drafts(p, q, target_drafts.view({gamma}), processor, gen, verify);

    const int64_t accepted_length = state.length() + step.accepted;
    target_runner.truncate(accepted_length);
    drafter_runner.truncate(accepted_length);
    state.emit(step.drafts, step.accepted, step.token);
  }
  return std::move(state).finish();
}

}  // namespace specdec
