// The remote verifier's batching, apart from gRPC: the verification steps of many sessions, each
// with a cache of its own, served in one target forward where they fit together.
//
//   specdec::remote::SessionBatcher<Model> batcher(target);
//   specdec::remote::SessionStep<Model> step{.session = &session, .cache = &cache,
//                                            .processor = &processor, .drafts = {5, 9}};
//   std::array<specdec::remote::SessionStep<Model>*, 1> steps{&step};
//   batcher.run(steps);  // step.accepted, step.token, or step.error and step.message
//
// A step is a session whose tokens hold the step's context (its cache holds what it computed of
// them), the client's drafts with their q, and the session's processor, seed and verification
// mode. run() joins the sessions' caches into one batched cache (JoinableKVCache::join_rows) and
// runs one step of batch generation over it: the step the Engine and *_generate_batch run
// (detail::BatchCore::step_rows), the clients' drafts as its drafting. Its one forward feeds
// every row its uncached tokens and its drafts (each row's tokens first, then the drafts, padded
// to the widest row), after the longest cached row. Each row is verified by the step core's
// verify_chain with its own processor, generator (seeded by the step's options) and mode; the
// whole batch costs one device-to-host copy; each row's cache keeps its context and accepted
// drafts (copied back into the session's cache by split_row_into where the cache has it, else
// split_row) and its session records the drafts it accepted and the target's token. A row's
// result is the one it would get alone, up to the rounding of a batched product.
//
// The joined forward must fit under the target's limit as a whole: while it does not, the step
// whose session caches the most (the one nearest the limit) is served alone first; so is a step
// whose drafts and token would take its session past the limit (its session refuses it). A step
// alone runs through the session's own generate(), as a Session does. A target whose cache is
// not a JoinableKVCache serves each step alone.
//
// Errors touch only the steps they belong to: a bad q (std::invalid_argument from the
// verification) fails its own row with StepError::invalid; a forward that fails fails the steps
// it served with StepError::internal. run() itself never throws.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "specdec/batch.hpp"
#include "specdec/concepts.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/kv_cache.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/remote/processors.hpp"
#include "specdec/session.hpp"
#include "specdec/step.hpp"

namespace specdec::remote {

// Why a step failed: its own input (the server answers INVALID_ARGUMENT), or the forward or
// verification that served it (INTERNAL).
enum class StepError { none, invalid, internal };

// One session's verification step: its input, then its outcome (written by run()).
template <Target T>
struct SessionStep {
  Session<T>* session = nullptr;            // its tokens hold the step's context
  typename T::cache_type* cache = nullptr;  // the cache the session computes into
  const AnyProcessor* processor = nullptr;
  std::vector<int64_t> drafts{};
  at::Tensor q{};  // [k, vocab] float, or undefined where verification needs none
  // Its seed and verification (rejection, or threshold with options.threshold as tau): a step
  // joined or alone reads the mode from here alone.
  SpeculativeOptions options{};
  // The outcome: the leading drafts accepted and the target's token after them (the session now
  // ends with both), the forward's seconds; or the error and what it says.
  int64_t accepted = 0, token = 0;
  double seconds = 0;
  StepError error = StepError::none;
  std::string message{};
};

namespace detail {

// The client's drafts as a DraftSource: handed to the step once.
struct ClientDrafts {
  at::Tensor tokens, probs;
  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& /*request*/, const P& /*processor*/, at::Generator& /*gen*/) {
    Drafts drafts{.tokens = std::move(tokens), .probs = std::move(probs)};
    tokens = at::Tensor(), probs = at::Tensor();
    return drafts;
  }
  void verified(const VerifiedDrafts& /*verified*/) const noexcept {}
};

// The clients' drafts of a joined forward as batch drafting: tokens [b, k] (row r's counts[r]
// first, zeros after), handed to the step as they are.
struct ClientBatchDrafts {
  at::Tensor tokens{};
  std::vector<int64_t> counts{};
  template <LogitsProcessor P>
  specdec::detail::BatchDrafts draft(const std::vector<std::span<const int64_t>>& /*sequences*/,
                                     std::span<const int64_t> rooms, int64_t k, const P& /*processor*/,
                                     at::Generator& /*gen*/, GenerationStats& /*shared*/) const {
    // run() joins only steps whose drafts fit, beside each other and under the limit.
    for (size_t r = 0; r < counts.size(); ++r) {
      if (rooms[r] != counts[r] || k != tokens.size(1)) {
        throw std::logic_error("SessionBatcher: a joined forward had no room for a client's drafts");
      }
    }
    return {.tokens = tokens, .valid = counts};
  }
  void after(const specdec::detail::BatchStep& /*step*/) const noexcept {}
  void select(std::span<const int64_t> /*rows*/) const noexcept {}
};

}  // namespace detail

template <Target T>
class SessionBatcher {
 public:
  using cache_type = typename T::cache_type;
  static constexpr bool kJoinable = JoinableKVCache<cache_type>;

  explicit SessionBatcher(T& target) : target_(target) {}

  // Serves `steps` (every step's session distinct), in one target forward where they fit; every
  // step gets its outcome. Never throws.
  void run(std::span<SessionStep<T>* const> steps) noexcept {
    try {
      if constexpr (kJoinable) {
        const int64_t limit = specdec::detail::sequence_limit(target_);
        // A step whose drafts and token would pass its session's limit (the target's, or its
        // cache's capacity where smaller) is its session's own to refuse: a joined row appends to
        // the session's tokens unchecked.
        std::vector<SessionStep<T>*> joined;
        for (SessionStep<T>* step : steps) {
          const int64_t own = specdec::detail::sequence_limit(target_, *step->cache);
          if (step->session->length() + static_cast<int64_t>(step->drafts.size()) < own) {
            joined.push_back(step);
          } else {
            serve({&step, 1}, [&] { run_alone(*step); });
          }
        }
        while (joined.size() > 1) {
          const std::optional<size_t> nearest = nearest_over(joined, limit);
          if (!nearest) break;
          serve({joined.begin() + static_cast<std::ptrdiff_t>(*nearest), 1}, [&] { run_alone(*joined[*nearest]); });
          joined.erase(joined.begin() + static_cast<std::ptrdiff_t>(*nearest));
        }
        if (joined.empty()) return;
        serve(joined, [&] { joined.size() == 1 ? run_alone(*joined.front()) : run_joined(joined, limit); });
      } else {
        for (SessionStep<T>* step : steps) serve({&step, 1}, [&] { run_alone(*step); });
      }
    } catch (const std::exception& e) {  // allocations of the batch's own lists
      for (SessionStep<T>* step : steps) fail(*step, StepError::internal, e.what());
    }
  }

  // Target forwards run so far (a joined forward counts once).
  [[nodiscard]] int64_t forwards() const noexcept { return forwards_; }

 private:
  // The positions of a session's cache that a joined forward keeps: all but its last token, which
  // is never cached between steps (after a rollback it may be, and is computed again).
  static int64_t joined_prefix(const SessionStep<T>& step) {
    return std::min<int64_t>(step.cache->length(), step.session->length() - 1);
  }

  // Where the joined forward of `steps` would pass `limit`: the step whose session caches the
  // most. Its padded input (the widest row of uncached tokens, then the most drafts, as
  // BatchRunner::forward lays it out) follows the longest cached row.
  static std::optional<size_t> nearest_over(std::span<SessionStep<T>* const> steps, int64_t limit) {
    int64_t longest = 0, uncached = 0, drafts = 0;
    size_t nearest = 0;
    for (size_t r = 0; r < steps.size(); ++r) {
      const SessionStep<T>& step = *steps[r];
      const int64_t keep = joined_prefix(step);
      uncached = std::max(uncached, step.session->length() - keep);
      drafts = std::max(drafts, static_cast<int64_t>(step.drafts.size()));
      if (keep > longest) {
        longest = keep;
        nearest = r;
      }
    }
    if (longest + uncached + drafts <= limit) return std::nullopt;
    return nearest;
  }

  static void fail(SessionStep<T>& step, StepError error, const char* what) noexcept {
    step.error = error;
    try {
      step.message = what;
    } catch (...) {  // no memory for the message: the error stands without it
    }
  }

  // Runs `serving`; if it throws, every step of `steps` gets the error.
  template <class F>
  static void serve(std::span<SessionStep<T>* const> steps, F&& serving) noexcept {
    try {
      serving();
    } catch (const std::invalid_argument& e) {
      for (SessionStep<T>* step : steps) fail(*step, StepError::invalid, e.what());
    } catch (const std::exception& e) {
      for (SessionStep<T>* step : steps) fail(*step, StepError::internal, e.what());
    }
  }

  // One session's step through the step core, with the client's drafts as its draft source.
  void run_alone(SessionStep<T>& step) {
    detail::ClientDrafts source;
    if (!step.drafts.empty()) source.tokens = at::tensor(step.drafts, at::kLong);
    source.probs = step.q;
    std::optional<StepInfo> info;
    SpeculativeOptions options = step.options;
    options.on_step = [&](const StepInfo& taken) {
      info = taken;
      return StepAction::stop;
    };
    ++forwards_;
    const GenerationResult result = std::visit(
        [&](const auto& processor) { return step.session->generate(source, options, processor); }, *step.processor);
    if (!info) {  // every step reports to on_step; a generation without one did not run
      fail(step, StepError::internal, "the step did not run");
      return;
    }
    step.accepted = info->accepted;
    step.token = info->token;
    step.seconds = result.stats.target_seconds;
  }

  // Many sessions' steps in one forward (see the top of this file): batch generation's step
  // (detail::BatchCore::step_rows) over their joined caches, each row verified by verify_chain
  // with its own session's processor, generator and mode.
  void run_joined(std::span<SessionStep<T>* const> steps, int64_t limit)
    requires kJoinable
  {
    const c10::InferenceMode inference;
    const auto b = static_cast<int64_t>(steps.size());
    const at::Device device = target_.device();
    std::vector<const cache_type*> parts;
    std::vector<int64_t> cached;
    detail::ClientBatchDrafts drafts;
    int64_t k = 0;
    for (SessionStep<T>* step : steps) {
      const int64_t keep = joined_prefix(*step);
      prune_cache(*step->cache, step->cache->length() - keep);
      parts.push_back(step->cache);
      cached.push_back(keep);
      drafts.counts.push_back(static_cast<int64_t>(step->drafts.size()));
      k = std::max(k, drafts.counts.back());
    }
    if (k > 0) {
      std::vector<int64_t> padded(static_cast<size_t>(b * k), 0);
      for (int64_t r = 0; r < b; ++r) {
        const std::vector<int64_t>& mine = steps[static_cast<size_t>(r)]->drafts;
        std::copy(mine.begin(), mine.end(), padded.begin() + r * k);
      }
      drafts.tokens = specdec::detail::to_device<int64_t>(padded, {b, k}, device);
    }
    specdec::detail::BatchCore<T> core(target_, cache_type::join_rows(parts), std::move(cached), limit);
    // A session's row generates onto the session's own tokens and never ends inside the step but
    // at the target's limit (run() serves alone the steps that would pass it): no end tokens, no
    // stop sequences.
    const GenerationOptions rows{.max_new_tokens = limit};
    for (int64_t r = 0; r < b; ++r) {
      Session<T>& session = *steps[static_cast<size_t>(r)]->session;
      if (core.add_onto(r, specdec::detail::SessionTokens::of(session), rows, drafts.counts[static_cast<size_t>(r)])) {
        throw std::logic_error("SessionBatcher: a joined session had no room for its step");
      }
    }
    const auto verify = [&](int64_t r, const at::Tensor& logits, const at::Tensor& draft_ids) {
      const SessionStep<T>& step = *steps[static_cast<size_t>(r)];
      const at::Tensor q = step.q.defined() ? step.q.to(device) : at::Tensor();
      at::Generator gen = specdec::detail::make_generator(step.options.seed, device);
      return std::visit(
          [&](const auto& processor) {
            return specdec::detail::verify_chain(logits, q, draft_ids, processor, gen, step.options,
                                                 step.options.verification == Verification::threshold);
          },
          *step.processor);
    };
    ++forwards_;
    std::vector<specdec::detail::RowOutcome> outcomes;
    core.step_rows(drafts, verify, outcomes);
    // Each session's tokens now end with what its row accepted and the target's token. The rows
    // still in the batch hold their caches, each pruned to its row's kept positions: copied into
    // the session's own storage where the cache type can (split_row_into), else split and moved
    // in at once, so that the cache it replaces is freed before the next is split. A row that
    // reached the limit left the batch, and its session keeps the cache it had (the next step
    // computes the rest again); a row whose verification failed keeps its session as it was.
    std::vector<const specdec::detail::RowOutcome*> outcome_of(static_cast<size_t>(b));
    for (const specdec::detail::RowOutcome& outcome : outcomes) outcome_of[static_cast<size_t>(outcome.tag)] = &outcome;
    const auto rows_left = core.rows();
    for (size_t j = 0; j < rows_left.size(); ++j) {
      SessionStep<T>& step = *steps[static_cast<size_t>(rows_left[j].tag)];
      if (outcome_of[static_cast<size_t>(rows_left[j].tag)]->error) continue;
      const auto row = static_cast<int64_t>(j);
      if constexpr (requires { core.cache().split_row_into(row, *step.cache); }) {
        core.cache().split_row_into(row, *step.cache);  // no allocation (StaticKVCache)
      } else {
        *step.cache = core.cache().split_row(row);
      }
    }
    for (const specdec::detail::RowOutcome& outcome : outcomes) {
      SessionStep<T>& step = *steps[static_cast<size_t>(outcome.tag)];
      if (outcome.error) {
        try {
          std::rethrow_exception(outcome.error);
        } catch (const std::exception& e) {
          fail(step, StepError::invalid, e.what());
        }
        continue;
      }
      step.session->rollback(step.session->length());  // records what the cache now holds
      step.accepted = outcome.accepted;
      step.token = step.session->tokens().back();
      step.seconds = core.shared().target_seconds;
    }
  }

  T& target_;
  int64_t forwards_ = 0;
};

}  // namespace specdec::remote
