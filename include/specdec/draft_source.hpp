// Draft sources: where a speculative step's drafts come from. The step itself (step.hpp) is the
// same for all of them: draft, verify in one target forward through the verification core,
// prune, emit. A new way of drafting is one new type that models DraftSource, and no edit to the
// loop (examples/custom_drafter.cpp drafts by repeating the text's last tokens).
//
// Here: NoDrafts (autoregressive decoding), ModelDraftSource (a drafter model, with the
// draft-length policies) and NGramDraftSource (n-gram storages and prompt lookup). STAND's tree
// drafts are in drafting/stand.hpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/draft_length.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/ngram_storage.hpp"
#include "specdec/options.hpp"
#include "specdec/result.hpp"
#include "specdec/verification.hpp"

namespace specdec {

// What the step asks a draft source for.
struct DraftRequest {
  std::span<const int64_t> sequence{};  // prompt and output so far: the drafts continue it
  int64_t gamma = 0;                    // drafts the options ask for (>= 1, within room)
  int64_t room = 0;                     // the most drafts this step can verify (>= gamma)
  at::Device device = at::kCPU;         // the target's device, where verification runs
  int64_t capacity = std::numeric_limits<int64_t>::max();  // tree steps: the most draft nodes the
                                        // target can score after sequence (its limit less the
                                        // sequence)
};

// A chain of drafts, as a draft source proposes them.
struct Drafts {
  at::Tensor tokens{};             // int64 [k], k in [0, room], on any device; undefined: k = 0
  at::Tensor probs{};              // [k, vocab]: the processed distributions the tokens were
                                   // sampled from (q); undefined: deterministic drafts (q one-hot)
  at::Tensor finite{};             // bool []: whether the drafter's logits behind deterministic
                                   // drafts were finite (verification reports a drafter error when
                                   // not); undefined: nothing to check
  int64_t calls = 0;               // drafter calls made (forwards, look-ups), for stats
  std::optional<int64_t> gamma{};  // the source's chosen length (StepInfo::gamma); default k
  double entropy = std::numeric_limits<double>::quiet_NaN();  // StepInfo::entropy

  // Deterministic drafts from host tokens, on `device` without blocking the host.
  [[nodiscard]] static Drafts from_host(std::span<const int64_t> tokens, const at::Device& device,
                                        int64_t calls = 0) {
    return Drafts{.tokens = detail::to_device(tokens, {static_cast<int64_t>(tokens.size())}, device),
                  .calls = calls};
  }
  [[nodiscard]] int64_t size() const { return tokens.defined() ? tokens.numel() : 0; }
};

// What verification decided, for the source to learn from and to prune its own state.
struct VerifiedDrafts {
  std::span<const int64_t> sequence{};      // the sequence after the step
  int64_t position = 0;                     // position of the step's first draft (= its first
                                            // emitted token)
  int64_t drafted = 0;                      // drafts verified
  int64_t accepted = 0;                     // leading drafts accepted
  std::span<const int64_t> target_top_k{};  // [drafted + 1, top_k] row-major: the target's most
                                            // probable tokens at each verified position, when
                                            // the source asked for them (target_top_k())
  int64_t top_k = 0;                        // min(target_top_k(), vocab); 0: not asked for
  // The target's hidden states the source asked for (feature_taps(); FeatureTarget), on the
  // target's device, never copied to the host: [n, taps * hidden] at sequence positions
  // [features_from, features_from + n), every position the step fed the target up to its last
  // accepted draft (the sequence's last token, sampled by the target, is fed by the next step).
  // Undefined when not asked for.
  at::Tensor features{};
  int64_t features_from = 0;
};

// DraftSource: proposes a chain of drafts for each speculative step.
//
// A type S satisfies DraftSource<S, P> for a LogitsProcessor P if, for `s` an S:
//   1. `s.draft(request, processor, gen)` returns Drafts continuing request.sequence: at most
//      request.room tokens; with probs, drawn from probs using `gen` (verification is then exact
//      rejection sampling against q = probs); without, q is one-hot at each token.
//   2. `s.verified(verified)` takes the outcome of each step (also steps that drafted nothing).
// Optional members, used when present (each is a concept below, which is exactly what the step
// checks):
//   `s.start(sequence, options)`: before a generation's first step (options: SpeculativeOptions);
//   `s.finish(sequence)`: after its last; `cs.target_top_k()`: how many of the target's top
//   tokens per verified position verified() should see (one extra host copy costs nothing: they
//   travel in the step's one copy); `cs.vocab_size()`, checked against the target's;
//   `cs.max_sequence_length()`: the step asks for no more drafts than fit in it, and none once
//   the sequence is longer (the target then goes on alone to its own limit);
//   `cs.feature_taps()`: which of the target's hidden states (FeatureTarget's numbering)
//   verified() should see as VerifiedDrafts::features (the target must be a FeatureTarget; chain
//   steps of one sequence).
// Not required: copyability, thread safety.
template <class S, class P>
concept DraftSource =
    LogitsProcessor<P> &&
    requires(S& s, const DraftRequest& request, const VerifiedDrafts& verified, const P& processor,
             at::Generator& gen) {
      { s.draft(request, processor, gen) } -> std::same_as<Drafts>;
      s.verified(verified);
    };

// The optional members of a draft source, one concept each. The step calls a hook exactly when
// its concept holds, so a hook with a misspelled name or a wrong signature is silently never
// called; state the hooks a source means to have and the compiler checks them:
//   static_assert(specdec::HasStartHook<MySource> && specdec::HasFinishHook<MySource>);
template <class S>
concept HasStartHook = requires(S& s, std::span<const int64_t> sequence, const SpeculativeOptions& options) {
  s.start(sequence, options);
};
template <class S>
concept HasFinishHook = requires(S& s, std::span<const int64_t> sequence) { s.finish(sequence); };
template <class S>
concept HasTargetTopK = requires(const S& cs) {
  { cs.target_top_k() } -> std::convertible_to<int64_t>;
};
template <class S>
concept HasVocabSize = requires(const S& cs) {
  { cs.vocab_size() } -> std::convertible_to<int64_t>;
};
template <class S>
concept HasFeatureTaps = requires(const S& cs) {
  { cs.feature_taps() } -> std::convertible_to<std::span<const int64_t>>;
};
// `cs.max_sequence_length()`: HasMaxSequenceLength (concepts.hpp), as for models.

// Drafts nothing: every step samples from the target alone (autoregressive decoding).
struct NoDrafts {
  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& /*request*/, const P& /*processor*/, at::Generator& /*gen*/) const {
    return {};
  }
  void verified(const VerifiedDrafts& /*verified*/) const noexcept {}
};
static_assert(DraftSource<NoDrafts, GreedyProcessor>);

namespace detail {

// What the sources that draft with a drafter model share: the model with its cache (the source's
// own or the caller's, living across generations: a session's next turn feeds the drafter only
// what it has not seen), the draft-length policy of the generation, and the hooks that keep both:
// start() resumes the cache and takes the options' policy, verified() prunes the cache to the
// accepted prefix and tells the policy, finish() records what the cache holds.
template <Drafter D>
class DrafterModelState {
 public:
  // The drafter's limit, or its cache's capacity where that is smaller.
  [[nodiscard]] int64_t max_sequence_length() const { return sequence_limit(runner_.model(), runner_.cache()); }
  [[nodiscard]] const typename D::cache_type& cache() const noexcept { return runner_.cache(); }

  void start(std::span<const int64_t> sequence, const SpeculativeOptions& options) {
    check_draft_length_options(options);
    policy_.emplace(options);
    runner_.set_use_cache(options.use_cache);
    runner_.resume(sequence);
  }
  void verified(const VerifiedDrafts& verified) {
    runner_.truncate(verified.position + verified.accepted);
    if (policy_) policy_->after(verified.drafted, verified.accepted);
  }
  void finish(std::span<const int64_t> sequence) { runner_.record(sequence); }

 protected:
  DrafterModelState(D& drafter, bool use_cache) : runner_(drafter, "drafter", use_cache) {}
  DrafterModelState(D& drafter, typename D::cache_type& cache) : runner_(drafter, "drafter", cache) {}

  // The generation's policy; a fixed gamma where the source is driven without start().
  DraftLength& policy(int64_t gamma) {
    if (!policy_) policy_.emplace(SpeculativeOptions{.gamma = gamma});
    return *policy_;
  }

  ModelRunner<D> runner_;
  std::optional<DraftLength> policy_;
};

}  // namespace detail

// Drafts from a drafter model (seeds 001, 002): gamma tokens sampled one by one through the
// processor, with the draft-length policies of SpeculativeOptions (fixed, EGAG, schedule, the
// confidence stop). The drafter's cache is the source's own or the caller's, and lives across
// generations: a session's next turn feeds the drafter only what it has not seen.
template <Drafter D>
class ModelDraftSource : public detail::DrafterModelState<D> {
  using State = detail::DrafterModelState<D>;
  using State::policy_;
  using State::runner_;

 public:
  // A source with a cache of its own (use_cache false recomputes the sequence at every forward).
  explicit ModelDraftSource(D& drafter, bool use_cache = true) : State(drafter, use_cache) {}
  // A source on the caller's cache (which must outlive it).
  ModelDraftSource(D& drafter, typename D::cache_type& cache) : State(drafter, cache) {}

  [[nodiscard]] int64_t vocab_size() const { return static_cast<int64_t>(runner_.model().vocab_size()); }
  // The drafter with its cache, for a step that runs the drafter itself (a CUDA graph step).
  [[nodiscard]] detail::ModelRunner<D>& runner() noexcept { return runner_; }

  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& processor, at::Generator& gen) {
    this->policy(request.gamma);
    Drafts result;
    const ForwardCounters counters{.calls = &result.calls};
    runner_.set_counters(counters);
    int64_t gamma = policy_->limit(request.room);
    probs_.clear();
    // Greedy drafts from fp32 logits on the CPU are decoded where the logits lie, into a host
    // buffer of tokens the next forward reads: no small ATen call per draft.
    if constexpr (std::is_same_v<P, GreedyProcessor>) {
      if (runner_.device().is_cpu() && !policy_->needs_signal(0) && gamma > 0) {
        draft_on_host(request, gamma, result);
        return result;
      }
    }
    at::Tensor drafts = at::empty({1, 0}, at::TensorOptions().dtype(at::kLong).device(runner_.device()));
    for (int64_t i = 0; i < gamma; ++i) {
      const at::Tensor logits = runner_.forward(request.sequence, drafts);
      const at::Tensor last = logits.narrow(0, logits.size(0) - 1, 1);
      if (policy_->needs_signal(i)) {
        const detail::DrafterSignal signal = detail::drafter_signal(last);
        if (i == 0 && policy_->uses_entropy()) {
          gamma = policy_->choose(signal, request.room);
          result.entropy = policy_->smoothed_entropy();
        }
        if (policy_->stop(signal)) break;
      }
      if constexpr (std::is_same_v<P, GreedyProcessor>) {
        // A greedy draft is the argmax, its q one-hot there: the drafts are deterministic and no
        // distribution is built. The row's maximum is kept to report a non-finite drafter (NaN,
        // +inf, or only -inf) as GreedyProcessor's NaN would.
        drafts = at::cat({drafts, last.argmax(-1, /*keepdim=*/true)}, 1);
        probs_.push_back(last.amax(-1));
      } else {
        const at::Tensor q = processor(last);
        drafts = at::cat({drafts, processor.sample(q, gen).view({1, 1})}, 1);
        probs_.push_back(q);
      }
    }
    runner_.set_counters({});
    result.gamma = gamma;
    if (!probs_.empty()) {
      result.tokens = drafts.view({drafts.size(1)});
      if constexpr (std::is_same_v<P, GreedyProcessor>) {
        result.finite = at::isfinite(at::cat(probs_)).all();
      } else {
        result.probs = at::cat(probs_, 0);
      }
    }
    return result;
  }

 private:
  // draft() under greedy decoding on the CPU, with a fixed draft length (no policy signal): the
  // same drafts, each the first maximum of its logits row, read by the host.
  void draft_on_host(const DraftRequest& request, int64_t gamma, Drafts& result) {
    at::Tensor drafts = at::empty({1, gamma}, at::TensorOptions().dtype(at::kLong));
    int64_t* tokens = drafts.data_ptr<int64_t>();
    bool finite = true;
    for (int64_t i = 0; i < gamma; ++i) {
      const at::Tensor logits = runner_.forward(request.sequence, i == 0 ? at::Tensor() : drafts.narrow(1, 0, i));
      const int64_t last = logits.size(0) - 1;
      if (detail::host_readable(logits)) {
        const detail::RowMax best =
            detail::row_max(logits.data_ptr<float>() + last * logits.stride(0), logits.size(1), logits.stride(1));
        tokens[i] = best.index;
        finite = finite && best.finite;
      } else {  // another dtype: ATen's argmax and maximum, read at once (no device to wait for)
        const at::Tensor row = logits[last];
        tokens[i] = row.argmax().item<int64_t>();
        finite = finite && std::isfinite(row.amax().item<double>());
      }
    }
    runner_.set_counters({});
    result.gamma = gamma;
    result.tokens = drafts.view({gamma});
    result.finite = at::scalar_tensor(finite, at::TensorOptions().dtype(at::kBool));
  }

  using ForwardCounters = detail::ForwardCounters;
  std::vector<at::Tensor> probs_;  // each draft's q, or under greedy decoding its logits' maximum
};

// ConfidentNGramDrafter: an NGramDrafter that drafts several tokens at once and stops by its
// counts.
//
// A type S satisfies ConfidentNGramDrafter if it satisfies NGramDrafter and, for `cs` a const S,
// `tokens` a span of token ids, `out` a span of int64 and `rule` an NGramDraftRule:
//   1. `cs.draft(tokens, out, rule)` writes at most out.size() tokens that it predicts after
//      `tokens` and returns how many, stopping where `rule` finds its statistics not confident.
// Not required: that draft() agrees with next_token() beyond the first token.
template <class S>
concept ConfidentNGramDrafter =
    NGramDrafter<S> && requires(const S& cs, std::span<const int64_t> tokens, std::span<int64_t> out,
                                const NGramDraftRule& rule) {
      { cs.draft(tokens, out, rule) } -> std::convertible_to<int64_t>;
    };

static_assert(ConfidentNGramDrafter<OneLevelNGramStorage>);
static_assert(ConfidentNGramDrafter<NGramStorage>);
static_assert(NGramDrafter<PromptLookupDrafter>);

// Settings of NGramDraftSource (the n-gram fields of NGramAssistedOptions).
struct NGramDraftSettings {
  int64_t filler_top_k = 3;       // teach the storage the target's top-k at every verified
                                  // position (>= 1; 1: only the emitted tokens)
  bool stop_if_unknown = false;   // stop drafting at an unknown context; false drafts the
                                  // context's last token again there
  NGramDraftRule draft_rule{};    // when a storage's draft stops by its counts (needs a
                                  // ConfidentNGramDrafter unless neutral)
};

namespace detail {

// Drafts up to out.size() tokens after `context` into `out`, appending them to `context`:
// a ConfidentNGramDrafter's draft() under `rule`, otherwise next_token() per token. Where no
// context at all is known, stop_if_unknown ends the draft and otherwise drafts the context's last
// token again and goes on; a stop by the rule's confidence ends it. Returns how many tokens it
// drafted; `calls` counts the storage's calls.
template <NGramDrafter S>
int64_t draft_ngrams(const S& storage, std::vector<int64_t>& context, std::span<int64_t> out,
                     const NGramDraftRule& rule, bool stop_if_unknown, int64_t& calls) {
  const auto k = static_cast<int64_t>(out.size());
  int64_t made = 0;
  while (made < k) {
    std::optional<int64_t> next;
    if constexpr (ConfidentNGramDrafter<S>) {
      const int64_t drafted = storage.draft(context, out.subspan(static_cast<size_t>(made)), rule);
      ++calls;
      context.insert(context.end(), out.begin() + made, out.begin() + made + drafted);
      made += drafted;
      if (made == k) break;
      if (storage.next_token(context)) break;  // known but not confident: the rule stops here
    } else {
      next = storage.next_token(context);
      ++calls;
    }
    if (!next) {
      if (stop_if_unknown || context.empty()) break;
      next = context.back();
    }
    out[static_cast<size_t>(made++)] = *next;
    context.push_back(*next);
  }
  return made;
}

template <NGramDrafter S>
void check_draft_rule(const NGramDraftRule& rule) {
  rule.validate();
  if (!ConfidentNGramDrafter<S> && !rule.neutral()) {
    throw std::invalid_argument(
        "draft_rule needs a storage with counts (NGramStorage, OneLevelNGramStorage): this drafter has no draft()");
  }
}

}  // namespace detail

// Drafts from an n-gram storage or prompt lookup (seed 000, NASD): deterministic drafts from the
// storage's statistics, which learn the sequence and the target's top-k online. Host-side work
// on plain integers; the storage is borrowed and keeps what it learned.
template <NGramDrafter S>
class NGramDraftSource {
 public:
  // Requires settings.filler_top_k >= 1.
  explicit NGramDraftSource(S& storage, NGramDraftSettings settings = {})
      : storage_(storage), settings_(settings) {
    if (settings.filler_top_k < 1) detail::throw_invalid("filler_top_k", "be >= 1", settings.filler_top_k);
    detail::check_draft_rule<S>(settings.draft_rule);
  }

  [[nodiscard]] int64_t target_top_k() const noexcept { return settings_.filler_top_k > 1 ? settings_.filler_top_k : 0; }

  // Learns the prompt: all of it the first time, afterwards what follows what it has seen.
  void start(std::span<const int64_t> sequence, const SpeculativeOptions& /*options*/) {
    if (!initialized_) {
      storage_.initialize(sequence);
      initialized_ = true;
    } else {
      for (auto position = static_cast<int64_t>(learned_); position < static_cast<int64_t>(sequence.size()); ++position) {
        learn_position(sequence, position);
      }
    }
    learned_ = sequence.size();
    context_.assign(sequence.begin(), sequence.end());
    drafts_.clear();
  }

  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& /*processor*/, at::Generator& /*gen*/) {
    // context_ is the sequence followed by the last step's drafts: brought up to date by dropping
    // those drafts and appending what was emitted, so no step copies the sequence.
    const auto sequence = request.sequence;
    context_.resize(std::min(context_.size() - drafts_.size(), sequence.size()));
    context_.insert(context_.end(), sequence.begin() + static_cast<std::ptrdiff_t>(context_.size()), sequence.end());
    drafts_.resize(static_cast<size_t>(request.gamma));
    int64_t calls = 0;
    drafts_.resize(static_cast<size_t>(
        detail::draft_ngrams(storage_, context_, drafts_, settings_.draft_rule, settings_.stop_if_unknown, calls)));
    return Drafts::from_host(drafts_, request.device, calls);
  }

  // Teaches the storage the emitted tokens and the target's top-k at each verified position.
  void verified(const VerifiedDrafts& verified) {
    const int64_t filler = verified.top_k > 1 ? verified.top_k : 0;
    for (int64_t position = verified.position; position < static_cast<int64_t>(verified.sequence.size()); ++position) {
      learn_position(verified.sequence, position);
      const int64_t row = position - verified.position;
      if (filler > 0 && row <= verified.drafted) {
        storage_.update(verified.sequence.first(static_cast<size_t>(position)),
                        verified.target_top_k.subspan(static_cast<size_t>(row * filler), static_cast<size_t>(filler)));
      }
    }
    learned_ = verified.sequence.size();
  }

 private:
  void learn_position(std::span<const int64_t> sequence, int64_t position) {
    storage_.update(sequence.first(static_cast<size_t>(position)), sequence.subspan(static_cast<size_t>(position), 1));
  }

  S& storage_;
  NGramDraftSettings settings_;
  bool initialized_ = false;
  size_t learned_ = 0;                    // positions of the sequence the storage has learned
  std::vector<int64_t> context_, drafts_;
};

}  // namespace specdec
