// Sessions: a conversation with a target whose tokens and KV cache live across generation calls.
// A chat engine appends each user turn and generates the answer; only the new turn's tokens are
// prefilled, never the conversation again. The cache is the session's own or the engine's
// (e.g. preallocated for its maximum length), used as it is: never reallocated or cleared.
//
//   specdec::Session session(target);
//   specdec::ModelDraftSource drafts(drafter);          // the drafter's cache lives across turns too
//   session.append(first_turn);
//   auto answer = session.generate(drafts, {.max_new_tokens = 128, .gamma = 4});
//   session.append(second_turn);
//   answer = session.generate(drafts, {.max_new_tokens = 128, .gamma = 4});
//   session.rollback(n);                               // drop everything after the first n tokens
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/generation_state.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/result.hpp"
#include "specdec/step.hpp"

namespace specdec {

namespace detail {
struct SessionTokens;
}  // namespace detail

// The tokens of a conversation and the target's cache over them. Between calls the cache holds
// every token but the last (the next forward needs one uncached token to predict from).
template <Target T>
class Session {
 public:
  using cache_type = typename T::cache_type;

  // A session with a cache of its own, made by target.make_cache(1).
  explicit Session(T& target) : runner_(target, "target", /*use_cache=*/true) {}

  // A session on the caller's cache (which must outlive it). `cached_tokens` are the tokens the
  // cache already holds (cache.length() of them; empty for an empty cache): they start the
  // session's tokens and are not computed again.
  // Throws std::invalid_argument when their number differs from cache.length() or a token is
  // outside the vocabulary.
  Session(T& target, cache_type& cache, std::span<const int64_t> cached_tokens = {})
      : runner_(target, "target", cache) {
    if (static_cast<int64_t>(cached_tokens.size()) != static_cast<int64_t>(cache.length())) {
      detail::throw_invalid_message("cached_tokens must hold cache.length() = ", cache.length(), " tokens, got ",
                                    cached_tokens.size());
    }
    detail::check_tokens("cached_tokens", cached_tokens, vocab());
    tokens_.assign(cached_tokens.begin(), cached_tokens.end());
    runner_.record(tokens_);
  }

  // The conversation so far: every appended and generated token.
  [[nodiscard]] std::span<const int64_t> tokens() const noexcept { return tokens_; }
  [[nodiscard]] int64_t length() const noexcept { return static_cast<int64_t>(tokens_.size()); }
  [[nodiscard]] const cache_type& cache() const noexcept { return runner_.cache(); }

  // Appends tokens (a new turn). They are computed by the next prefill() or generate().
  // Throws std::invalid_argument for a token outside the vocabulary or a conversation longer than
  // the target's max_sequence_length() (or the capacity of a caller's smaller cache); the session
  // is then unchanged. Generation ends at the same limit with StopReason::sequence_limit.
  void append(std::span<const int64_t> tokens) {
    detail::check_tokens("tokens", tokens, vocab());
    const int64_t limit = this->limit();
    if (static_cast<int64_t>(tokens.size()) > limit - length()) {
      if (limit < detail::sequence_limit(runner_.model())) {
        detail::throw_invalid_message("session length ", length(), " + ", tokens.size(),
                                      " appended tokens must not exceed the cache's capacity ", limit);
      }
      detail::throw_invalid_message("session length ", length(), " + ", tokens.size(),
                                    " appended tokens must not exceed the target's max_sequence_length ", limit);
    }
    tokens_.insert(tokens_.end(), tokens.begin(), tokens.end());
  }

  // Keeps the first `length` tokens and drops the rest, with their cached positions.
  // Throws std::invalid_argument unless 0 <= length <= length().
  void rollback(int64_t length) {
    if (length < 0 || length > this->length()) {
      detail::throw_invalid_message("rollback length must be in [0, ", this->length(), "], got ", length);
    }
    tokens_.resize(static_cast<size_t>(length));
    runner_.record(tokens_);
  }

  // Computes every token but the last now (e.g. while the user is still reading), so that the
  // next generate() starts at once. Returns the number of positions computed.
  int64_t prefill() {
    runner_.resume(tokens_);
    const int64_t missing = length() - 1 - runner_.cached();
    if (missing <= 0) return 0;
    const std::span<const int64_t> head = std::span<const int64_t>(tokens_).first(static_cast<size_t>(length() - 1));
    (void)runner_.forward(head, at::Tensor());
    runner_.record(tokens_);
    return missing;
  }

  // Generates autoregressively after the session's tokens and appends the output to them.
  // Requires: a non-empty session; options as autoregressive_generate. Returns its result.
  template <LogitsProcessor P = GreedyProcessor>
  GenerationResult generate(const GenerationOptions& options = {}, const P& processor = {}) {
    NoDrafts none;
    return run(none, detail::step_options(options), processor, /*draft=*/false);
  }

  // Generates with drafts from `source` (ModelDraftSource, NGramDraftSource, a tree source such
  // as ModelTreeSource with a TreeTarget, or your own) and appends the output. Requires: a
  // non-empty session; options as speculative_generate.
  template <class S, LogitsProcessor P = GreedyProcessor>
    requires DraftSource<S, P> || (TreeDraftSource<S, P> && TreeTarget<T>)
  GenerationResult generate(S& source, const SpeculativeOptions& options = {}, const P& processor = {}) {
    return run(source, options, processor, /*draft=*/true);
  }

 private:
  [[nodiscard]] int64_t vocab() const { return static_cast<int64_t>(runner_.model().vocab_size()); }
  // The target's limit, or the cache's capacity where that is smaller.
  [[nodiscard]] int64_t limit() const { return detail::sequence_limit(runner_.model(), runner_.cache()); }

  template <class S, LogitsProcessor P>
  GenerationResult run(S& source, const SpeculativeOptions& options, const P& processor, bool draft) {
    detail::check_source(source, vocab(), options);
    const int64_t limit = this->limit();  // sources bound only their drafts
    detail::check_common(options, tokens_, vocab(), limit);
    return detail::run_generation(runner_, tokens_, source, options, processor, limit, draft);
  }

  friend struct detail::SessionTokens;

  detail::ModelRunner<T> runner_;
  std::vector<int64_t> tokens_;
};

namespace detail {

// A session's tokens, for the remote verifier's joined steps (remote/session_batch.hpp), which
// append a step's tokens to them in place and then record the cache with rollback(length()).
struct SessionTokens {
  template <Target T>
  static std::vector<int64_t>& of(Session<T>& session) noexcept {
    return session.tokens_;
  }
};

}  // namespace detail

}  // namespace specdec
