// Generation functions: the autoregressive baseline and speculative decoding with a model drafter.
// Both run on the verification core of verification.hpp; they differ only in where drafts come
// from.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/draft_length.hpp"
#include "specdec/detail/generation_state.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/ngram_storage.hpp"
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
  state.emit({.token = step.token});
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
  const auto vocab = static_cast<int64_t>(target.vocab_size());
  if (static_cast<int64_t>(drafter.vocab_size()) != vocab) {
    detail::throw_invalid_message("drafter.vocab_size() must equal target.vocab_size() = ", vocab,
                                  ", got ", drafter.vocab_size());
  }
  detail::check_draft_length_options(options);
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
  detail::DraftLength draft_length(options);

  if (options.first_target && !state.finished()) {
    detail::target_step(target_runner, state, processor, gen);
  }
  std::vector<at::Tensor> draft_probs;
  while (!state.finished()) {
    // Leave room for the token the target adds after the drafts.
    const int64_t room = state.room() - 1;
    int64_t gamma = draft_length.limit(room);
    double entropy = std::numeric_limits<double>::quiet_NaN();
    draft_probs.clear();
    at::Tensor drafts = at::empty({1, 0}, at::TensorOptions().dtype(at::kLong).device(drafter_runner.device()));
    for (int64_t i = 0; i < gamma; ++i) {
      const at::Tensor logits = drafter_runner.forward(state.sequence(), drafts);
      const at::Tensor last = logits.narrow(0, logits.size(0) - 1, 1);
      if (draft_length.needs_signal(i)) {
        const detail::DrafterSignal signal = detail::drafter_signal(last);
        if (i == 0 && draft_length.uses_entropy()) {
          gamma = draft_length.choose(signal, room);
          entropy = draft_length.smoothed_entropy();
        }
        if (draft_length.stop(signal)) break;
      }
      const at::Tensor q = processor(last);
      drafts = at::cat({drafts, processor.sample(q, gen).view({1, 1})}, 1);
      draft_probs.push_back(q);
    }
    const auto drafted = static_cast<int64_t>(draft_probs.size());
    const at::Tensor target_drafts = drafts.to(target_runner.device()).view({drafted});
    const at::Tensor logits = target_runner.forward(state.sequence(), target_drafts.view({1, drafted}));
    const at::Tensor p = processor(logits.narrow(0, logits.size(0) - drafted - 1, drafted + 1));
    VerifiedStep step;
    if (options.verification == Verification::threshold) {
      step = verify_threshold(p, target_drafts, options.threshold, processor, gen);
    } else {
      const at::Tensor q = drafted > 0 ? at::cat(draft_probs, 0).to(p.device()) : at::Tensor();
      step = verify_drafts(p, q, target_drafts, processor, gen, verify);
    }

    const int64_t accepted_length = state.length() + step.accepted;
    target_runner.truncate(accepted_length);
    drafter_runner.truncate(accepted_length);
    draft_length.after(drafted, step.accepted);
    state.emit({.drafts = step.drafts, .accepted = step.accepted, .token = step.token, .gamma = gamma, .entropy = entropy});
  }
  return std::move(state).finish();
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
  if (options.filler_top_k < 1) detail::throw_invalid("filler_top_k", "be >= 1", options.filler_top_k);
  const auto vocab = static_cast<int64_t>(target.vocab_size());
  const int64_t limit = detail::sequence_limit(target);
  detail::check_common(options, prompt, vocab, limit);

  detail::GenerationState state(prompt, options, limit);
  GenerationStats& stats = state.stats();
  at::Generator gen = detail::make_generator(options.seed);
  detail::ModelRunner<T> runner(target, "target", options.use_cache, {&stats.target_calls, &stats.target_seconds});
  const int64_t filler = std::min(options.filler_top_k, vocab);
  const auto start = std::chrono::steady_clock::now();
  storage.initialize(prompt);
  stats.drafter_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Teaches the storage the emitted tokens and the target's top-k at each verified position.
  const auto learn = [&](int64_t first_position, const at::Tensor& top_k) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto sequence = state.sequence();
    for (int64_t position = first_position; position < static_cast<int64_t>(sequence.size()); ++position) {
      const auto context = sequence.first(static_cast<size_t>(position));
      storage.update(context, sequence.subspan(static_cast<size_t>(position), 1));
      const int64_t row = position - first_position;
      if (filler > 1 && row < top_k.size(0)) {
        storage.update(context, std::span<const int64_t>(top_k[row].data_ptr<int64_t>(), static_cast<size_t>(filler)));
      }
    }
    stats.drafter_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  const auto top_k_of = [&](const at::Tensor& logits) {
    return filler > 1 ? std::get<1>(logits.topk(filler, -1)).cpu() : at::Tensor();
  };

  if (options.first_target && !state.finished()) {
    const int64_t position = state.length();
    const at::Tensor logits = runner.forward(state.sequence(), at::Tensor());
    const at::Tensor last = logits.narrow(0, logits.size(0) - 1, 1);
    const VerifiedStep step = verify_drafts(processor(last), at::Tensor(),
                                            at::empty({0}, at::TensorOptions().dtype(at::kLong).device(runner.device())),
                                            processor, gen);
    state.emit({.token = step.token});
    learn(position, top_k_of(last));
  }
  // The sequence followed by this step's drafts; kept across steps and brought up to date by
  // dropping the last drafts and appending what was emitted, so no step copies the sequence.
  std::vector<int64_t> context(state.sequence().begin(), state.sequence().end());
  std::vector<int64_t> drafts;
  while (!state.finished()) {
    const int64_t gamma = std::min(options.gamma, state.room() - 1);
    const auto t0 = std::chrono::steady_clock::now();
    const auto sequence = state.sequence();
    context.resize(context.size() - drafts.size());
    context.insert(context.end(), sequence.begin() + static_cast<std::ptrdiff_t>(context.size()), sequence.end());
    drafts.clear();
    for (int64_t i = 0; i < gamma; ++i) {
      std::optional<int64_t> next = storage.next_token(context);
      ++stats.drafter_calls;
      if (!next) {
        if (options.stop_if_unknown) break;
        next = context.back();
      }
      drafts.push_back(*next);
      context.push_back(*next);
    }
    stats.drafter_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto drafted = static_cast<int64_t>(drafts.size());
    const int64_t position = state.length();
    const at::Tensor draft_ids = detail::host_ids(drafts, runner.device());
    const at::Tensor logits = runner.forward(state.sequence(), draft_ids);
    const at::Tensor verified = logits.narrow(0, logits.size(0) - drafted - 1, drafted + 1);
    const VerifiedStep step = verify_drafts(processor(verified), at::Tensor(), draft_ids.view({drafted}), processor, gen);
    runner.truncate(position + step.accepted);
    state.emit({.drafts = step.drafts, .accepted = step.accepted, .token = step.token});
    learn(position, top_k_of(verified));
  }
  return std::move(state).finish();
}

}  // namespace specdec
