// The generation step every method shares: a draft source proposes, the target scores the
// proposal in one forward, the verification core decides, the caches are pruned to the accepted
// prefix and the accepted tokens are emitted. Autoregressive decoding, speculative decoding with a
// drafter model, n-gram drafting, STAND's draft trees and sessions are all this loop with another
// draft source (draft_source.hpp, drafting/stand.hpp).
//
// A step costs exactly one device-to-host copy: verification's outcome, the finiteness check and
// whatever the source asked to learn from (the target's top-k, STAND's statistics) come back
// together. The documented extras are the EGAG and confidence-stop signals of ModelDraftSource
// (one small copy per signal).
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/cuda_graph.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/draft_length.hpp"
#include "specdec/detail/generation_state.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/result.hpp"
#include "specdec/verification.hpp"

namespace specdec {

// A draft tree, as a TreeDraftSource proposes it: node i is tokens[i], hanging below node
// parents[i] or, for -1, below the sequence's last token; parents[i] < i.
struct TreeDrafts {
  std::span<const int64_t> tokens{};
  std::span<const int64_t> parents{};
  int64_t calls = 0;  // look-ups or drafter forwards made, for stats
  at::Tensor ids{};   // when defined: the tokens as int64 [n] on the target's device, in place of
                      // `tokens` (a drafter model's tree never visits the host)
  at::Tensor device_parents{};  // when defined: the parents as int64 [n] on the target's device, in
                                // place of `parents`, for a tree shaped on the device (the target
                                // must model MaskedTreeTarget)
  int64_t depth = 0;            // with device_parents: no node is deeper

  [[nodiscard]] int64_t size() const {
    return device_parents.defined() ? device_parents.numel() : static_cast<int64_t>(parents.size());
  }
};

// What walking a scored tree decided, on the host.
struct TreeVerdict {
  std::span<const int64_t> path{};    // accepted nodes, root to leaf
  std::span<const int64_t> drafts{};  // what StepInfo::drafts reports (the accepted path's tokens
                                      // and the first rejected sibling after it)
  int64_t token = 0;                  // the token sampled after the path
};

// TreeDraftSource: proposes a draft tree per step and verifies it exactly (STAND).
//
// A type S satisfies TreeDraftSource<S, P> if, for `s` an S:
//   1. `s.draft_tree(request)` or `s.draft_tree(request, processor, gen)` (a source that samples
//      its drafts; preferred when both exist) returns TreeDrafts no deeper than request.room,
//      with no more than request.capacity nodes.
//   2. `s.score_tree(logits, uncached, processor, gen)` takes the target's logits [u + n, vocab]
//      (u rows for the uncached context, then one per node) and returns a 1-D float64 tensor on
//      the target's device: everything the host walk needs, fetched in the step's one copy.
//   3. `s.walk_tree(values)` reads that tensor's host copy and returns the TreeVerdict.
//   4. `s.verified_tree(sequence, position)`, or `s.verified_tree(verified)` with VerifiedDrafts
//      (a source with feature_taps(): the target's hidden states at the context it fed and the
//      accepted path, in order), runs after the verdict is emitted (learning, pruning).
template <class S, class P>
concept TreeDraftSource =
    LogitsProcessor<P> &&
    requires(S& s, const DraftRequest& request, const at::Tensor& logits, int64_t uncached, const P& processor,
             at::Generator& gen, const double* values, std::span<const int64_t> sequence, int64_t position) {
      requires requires { { s.draft_tree(request) } -> std::same_as<TreeDrafts>; } ||
                   requires { { s.draft_tree(request, processor, gen) } -> std::same_as<TreeDrafts>; };
      { s.score_tree(logits, uncached, processor, gen) } -> std::convertible_to<at::Tensor>;
      { s.walk_tree(values) } -> std::same_as<TreeVerdict>;
      requires requires { s.verified_tree(sequence, position); } ||
                   requires(const VerifiedDrafts& verified) { s.verified_tree(verified); };
    };

namespace detail {

template <class S>
int64_t source_top_k(const S& source) {
  if constexpr (HasTargetTopK<S>) {
    return static_cast<int64_t>(source.target_top_k());
  } else {
    return 0;
  }
}

// The most drafts a source can propose after `length` tokens: unbounded, or what its
// max_sequence_length() leaves (drafting k tokens feeds it length + k - 1 positions).
template <class S>
int64_t source_room(const S& source, int64_t length) {
  if constexpr (HasMaxSequenceLength<S>) {
    return std::max<int64_t>(0, static_cast<int64_t>(source.max_sequence_length()) - length + 1);
  } else {
    return std::numeric_limits<int64_t>::max();
  }
}

// The verification core of a chain step, without its host copy: the target's logits rows
// [k + 1, vocab] over the drafts draft_ids [k] and their q [k, vocab] (undefined: deterministic
// drafts). Greedy decoding takes the argmax fast path (no distributions); `threshold` selects
// threshold verification at options.threshold, otherwise exact rejection sampling.
// `drafter_finite`: Drafts::finite of deterministic drafts (may be undefined).
template <LogitsProcessor P>
PendingStep verify_chain(const at::Tensor& rows, const at::Tensor& q, const at::Tensor& draft_ids, const P& processor,
                         at::Generator& gen, const SpeculativeOptions& options, bool threshold,
                         const at::Tensor& drafter_finite = {}) {
  if constexpr (std::is_same_v<P, GreedyProcessor>) {
    if (!threshold) return verify_greedy_pending(rows, q, draft_ids, drafter_finite);
  }
  const at::Tensor p = processor(rows);
  return threshold ? verify_threshold_pending(p, draft_ids, options.threshold, processor, gen)
                   : verify_drafts_pending(p, q, draft_ids, processor, gen, options.skip_sample_adjustment);
}

// One step of chain drafting. target_only: the step drafts nothing (a first target step, or
// autoregressive decoding).
template <LanguageModel T, class S, LogitsProcessor P>
void chain_step(ModelRunner<T>& target, GenerationState& state, S& source, const P& processor, at::Generator& gen,
                const SpeculativeOptions& options, bool target_only, int64_t vocab) {
  GenerationStats& stats = state.stats();
  const int64_t position = state.length();
  // The target's own token comes after the drafts.
  const int64_t room = std::min(state.room() - 1, source_room(source, position));
  Drafts drafts;
  if (!target_only && room > 0) {
    ScopedTimer timer(stats.drafter_seconds);
    drafts = source.draft(DraftRequest{.sequence = state.sequence(),
                                       .gamma = std::min(options.gamma, room),
                                       .room = room,
                                       .device = target.device()},
                          processor, gen);
  }
  stats.drafter_calls += drafts.calls;
  const int64_t k = drafts.size();
  if (k > room) throw_invalid_message("the draft source proposed ", k, " drafts, more than room = ", room);
  const at::Tensor draft_ids = k > 0 ? drafts.tokens.to(target.device()).view({k})
                                     : at::empty({0}, at::TensorOptions().dtype(at::kLong).device(target.device()));
  if constexpr (HasFeatureTaps<S>) {
    static_assert(FeatureTarget<T>, "a draft source with feature_taps() needs a target that models FeatureTarget");
    target.set_taps(source.feature_taps());
  }
  const at::Tensor logits = target.forward(state.sequence(), k > 0 ? draft_ids.view({1, k}) : at::Tensor());
  const at::Tensor rows = logits.narrow(0, logits.size(0) - k - 1, k + 1);
  const at::Tensor q = k > 0 && drafts.probs.defined() ? drafts.probs.to(target.device()) : at::Tensor();
  const bool threshold = options.verification == Verification::threshold && !target_only;
  const PendingStep pending =
      verify_chain(rows, q, draft_ids, processor, gen, options, threshold, k > 0 ? drafts.finite : at::Tensor());
  const int64_t top_k = std::min(source_top_k(source), vocab);
  const at::Tensor packed =
      top_k > 0 ? at::cat({pending.packed, std::get<1>(rows.topk(top_k, -1)).flatten()}) : pending.packed;
  const at::Tensor host = to_host(packed);
  const int64_t* values = host.data_ptr<int64_t>();
  const VerifiedStep step = read_step(pending, values, rows);

  target.truncate(position + step.accepted);
  EmittedStep emitted{.drafts = step.drafts, .accepted = step.accepted, .token = step.token, .entropy = drafts.entropy};
  if (!target_only) emitted.gamma = drafts.gamma.value_or(-1);
  state.emit(emitted, [&] {
    ScopedTimer timer(stats.drafter_seconds);
    VerifiedDrafts verified{
        .sequence = state.sequence(),
        .position = position,
        .drafted = k,
        .accepted = step.accepted,
        .target_top_k = top_k > 0 ? std::span<const int64_t>(values + pending.size(), static_cast<size_t>((k + 1) * top_k))
                                  : std::span<const int64_t>(),
        .top_k = top_k};
    if constexpr (HasFeatureTaps<S>) {
      // The forward fed the uncached context (from `cached` on; all of it without a cache) and
      // the drafts: its rows up to the last accepted draft.
      const int64_t fed = logits.size(0) - k;
      verified.features_from = position - fed;
      verified.features = target.features().narrow(0, 0, fed + step.accepted);
    }
    source.verified(verified);
  });
}

// Whether a generation with target T, source S and processor P can replay its steps from a CUDA
// graph (cuda_graph.hpp): a ModelDraftSource whose drafter and the target model
// StaticForwardModel, under greedy decoding.
struct NoStaticStep {};
template <class T, class S, class P>
struct GraphableChain : std::false_type {
  using Step = NoStaticStep;
};
template <StaticForwardModel T, StaticForwardModel D>
struct GraphableChain<T, ModelDraftSource<D>, GreedyProcessor> : std::true_type {
  using Step = StaticChainStep<D, T>;
};

// One chain step of options.gamma drafts in static shapes (StaticChainStep): replayed from its
// CUDA graph on a CUDA device, run eagerly elsewhere. Returns false, having done nothing, where
// the step does not apply (the eager chain_step then runs): near the length limit, or caches not
// in the expected state.
template <StaticForwardModel T, StaticForwardModel D>
bool static_chain_step(ModelRunner<T>& target, GenerationState& state, ModelDraftSource<D>& source,
                       StaticChainStep<D, T>& graph, const SpeculativeOptions& options) {
  const int64_t position = state.length();
  const int64_t room = std::min(state.room() - 1, source_room(source, position));
  if (std::min(options.gamma, room) != graph.gamma() || !graph.applies(source.runner(), target, state.sequence())) {
    return false;
  }
  GenerationStats& stats = state.stats();
  const int64_t gamma = graph.gamma();
  GraphedOutcome outcome;
  {
    ScopedTimer timer(stats.target_seconds);
    outcome = graph.run(source.runner(), target, state.sequence());
  }
  stats.target_calls += 1;
  stats.drafter_calls += gamma;
  stats.target_positions += gamma + 1;
  ++stats.graph_steps;
  const int64_t accepted = outcome.step.accepted;
  state.emit({.drafts = outcome.drafts, .accepted = accepted, .token = outcome.step.token, .gamma = gamma}, [&] {
    ScopedTimer timer(stats.drafter_seconds);
    source.verified(VerifiedDrafts{.sequence = state.sequence(), .position = position, .drafted = gamma,
                                   .accepted = accepted});
  });
  return true;
}

// One step of tree drafting.
template <TreeTarget T, class S, LogitsProcessor P>
void tree_step(ModelRunner<T>& target, GenerationState& state, S& source, const P& processor, at::Generator& gen,
               const SpeculativeOptions& options) {
  GenerationStats& stats = state.stats();
  const int64_t position = state.length();
  const int64_t room = state.room() - 1;
  TreeDrafts tree;
  {
    ScopedTimer timer(stats.drafter_seconds);
    const DraftRequest request{.sequence = state.sequence(),
                               .gamma = std::min(options.gamma, room),
                               .room = room,
                               .device = target.device(),
                               .capacity = state.limit() - position};
    if constexpr (requires { source.draft_tree(request, processor, gen); }) {
      tree = source.draft_tree(request, processor, gen);
    } else {
      tree = source.draft_tree(request);
    }
  }
  stats.drafter_calls += tree.calls;
  const int64_t n = tree.size();
  if constexpr (HasFeatureTaps<S>) {
    static_assert(MaskedFeatureTreeTarget<T>,
                  "a tree source with feature_taps() (the EAGLE and Medusa heads' trees) needs a target that models "
                  "MaskedFeatureTreeTarget (forward_with_mask_features)");
    if (!tree.device_parents.defined()) {
      throw std::logic_error("a tree source with feature_taps() must give its tree as device_parents");
    }
    target.set_taps(source.feature_taps());
  }
  int64_t uncached = 0;
  at::Tensor logits;
  if (tree.device_parents.defined()) {
    if constexpr (MaskedTreeTarget<T>) {
      logits = target.forward_tree(state.sequence(), tree.ids, tree.device_parents, tree.depth, &uncached);
    } else {
      throw std::invalid_argument("a tree shaped on the device (DynamicTreeSource) needs a target that models "
                                  "MaskedTreeTarget (forward_with_mask)");
    }
  } else if (tree.ids.defined()) {
    logits = target.forward_tree(state.sequence(), tree.ids, tree.parents, &uncached);
  } else {
    logits = target.forward_tree(state.sequence(), tree.tokens, tree.parents, &uncached);
  }
  const at::Tensor host = to_host(source.score_tree(logits, uncached, processor, gen));
  const TreeVerdict verdict = source.walk_tree(host.data_ptr<double>());
  const auto accepted = static_cast<int64_t>(verdict.path.size());
  target.keep_tree(position, verdict.path);
  state.emit({.drafts = verdict.drafts, .accepted = accepted, .token = verdict.token, .gamma = n, .verified = n}, [&] {
    ScopedTimer timer(stats.drafter_seconds);
    if constexpr (requires { source.verified_tree(state.sequence(), position); }) {
      source.verified_tree(state.sequence(), position);
    } else {
      VerifiedDrafts verified{.sequence = state.sequence(), .position = position, .drafted = n, .accepted = accepted};
      if constexpr (HasFeatureTaps<S>) {
        // Rows of the forward: the uncached context, then the accepted path's nodes.
        std::vector<int64_t> rows(static_cast<size_t>(uncached + accepted));
        for (int64_t j = 0; j < uncached; ++j) rows[static_cast<size_t>(j)] = j;
        for (int64_t d = 0; d < accepted; ++d) {
          rows[static_cast<size_t>(uncached + d)] = uncached + verdict.path[static_cast<size_t>(d)];
        }
        verified.features = target.features().index_select(0, to_device<int64_t>(rows, {uncached + accepted}, target.device()));
        verified.features_from = position - uncached;
      }
      source.verified_tree(verified);
    }
  });
}

// The whole generation loop over `sequence` (the prompt, extended in place), on a target runner
// that may hold a cache from earlier calls. draft: false runs target-only steps (autoregressive).
template <LanguageModel T, class S, LogitsProcessor P>
GenerationResult run_generation(ModelRunner<T>& target, std::vector<int64_t>& sequence, S& source,
                                const SpeculativeOptions& options, const P& processor, int64_t limit, bool draft) {
  // No autograd anywhere in the loop: every ATen call skips the autograd kernels (about a third of
  // a small op's cost). Tensors made here are inference tensors; caches stay usable across calls.
  const c10::InferenceMode inference;
  GenerationState state(sequence, options, limit);
  GenerationStats& stats = state.stats();
  target.set_counters({.calls = &stats.target_calls, .seconds = &stats.target_seconds,
                       .positions = &stats.target_positions});
  target.set_use_cache(options.use_cache);
  target.resume(sequence);
  if constexpr (HasStartHook<S>) {
    ScopedTimer timer(stats.drafter_seconds);
    source.start(std::span<const int64_t>(sequence), options);
  }
  at::Generator gen = make_generator(options.seed, target.device());
  const auto vocab = static_cast<int64_t>(target.model().vocab_size());
  // Steps of options.gamma drafts in static shapes, where the options ask for CUDA graphs:
  // replayed from a graph on CUDA, run eagerly elsewhere (the same computation, for tests).
  using Graphable = GraphableChain<T, S, P>;
  std::optional<typename Graphable::Step> graph;
  if constexpr (Graphable::value) {
    if (draft && graph_options(options)) {
      graph.emplace(options.gamma, target.device());
    }
  }
  bool first = true;
  while (!state.finished()) {
    if constexpr (TreeDraftSource<S, P>) {
      if constexpr (TreeTarget<T>) tree_step(target, state, source, processor, gen, options);
    } else {
      const bool target_only = !draft || (first && options.first_target);
      bool done = false;
      if constexpr (Graphable::value) {
        done = graph && !target_only && static_chain_step(target, state, source, *graph, options);
      }
      if (!done) chain_step(target, state, source, processor, gen, options, target_only, vocab);
    }
    first = false;
  }
  target.record(sequence);
  target.set_counters({});
  if constexpr (HasFinishHook<S>) {
    source.finish(std::span<const int64_t>(sequence));
  }
  return std::move(state).finish();
}

// The step options of a generation with no drafts, or of n-gram drafting: the common fields of
// `options` and the step's defaults otherwise.
template <class Options>
SpeculativeOptions step_options(const Options& options) {
  SpeculativeOptions step{.max_new_tokens = options.max_new_tokens,
                          .eos_token_ids = options.eos_token_ids,
                          .stop_sequences = options.stop_sequences,
                          .seed = options.seed,
                          .use_cache = options.use_cache,
                          .on_step = options.on_step};
  if constexpr (requires { options.gamma; }) step.gamma = options.gamma;
  if constexpr (requires { options.first_target; }) step.first_target = options.first_target;
  return step;
}

// Validates a draft source against the target (vocabulary) and the options.
template <class S>
void check_source(const S& source, int64_t vocab, const SpeculativeOptions& options) {
  if constexpr (HasVocabSize<S>) {
    if (static_cast<int64_t>(source.vocab_size()) != vocab) {
      throw_invalid_message("drafter.vocab_size() must equal target.vocab_size() = ", vocab, ", got ",
                            source.vocab_size());
    }
  }
  check_draft_length_options(options);
}

}  // namespace detail

// Speculative decoding from any draft source: the drafts come from `source`, the target verifies
// them (exact rejection sampling, or threshold verification when options.verification says so),
// and the output is distributed exactly as the target's (token for token equal to
// autoregressive_generate under greedy decoding). speculative_generate and
// ngram_assisted_generate are this function with their sources.
//
// Requires: everything speculative_generate requires of prompt and options; source models
//   DraftSource<S, P> (or TreeDraftSource<S, P> with a TreeTarget).
// Returns: the generated tokens, stats and stop reason.
// Throws: std::invalid_argument naming the parameter and value on bad input or non-finite logits;
//   whatever the model or the source throws.
template <Target T, class S, LogitsProcessor P = GreedyProcessor>
  requires DraftSource<S, P> || (TreeDraftSource<S, P> && TreeTarget<T>)
[[nodiscard]] GenerationResult generate_with(S& source, T& target, std::span<const int64_t> prompt,
                                             const SpeculativeOptions& options = {}, const P& processor = {}) {
  const auto vocab = static_cast<int64_t>(target.vocab_size());
  detail::check_source(source, vocab, options);
  // The target's limit: a source with a shorter context drafts less near its end and nothing
  // beyond it (source_room), so it never cuts a generation short.
  const int64_t limit = detail::sequence_limit(target);
  detail::check_common(options, prompt, vocab, limit);
  std::vector<int64_t> sequence(prompt.begin(), prompt.end());
  detail::ModelRunner<T> runner(target, "target", options.use_cache);
  return detail::run_generation(runner, sequence, source, options, processor, limit, /*draft=*/true);
}

}  // namespace specdec
