// Parallel drafting (PARD, An et al. 2025, arXiv 2504.18583): a drafter model adapted to read mask
// tokens proposes every draft of a step in one forward. It is fed the verified sequence followed
// by gamma - 1 copies of its mask token, at the positions that follow; the logits at the
// sequence's last token give the first draft and those at the k-th mask the (k + 1)-th, each
// predicted without the drafts before it. So a step costs one drafter forward instead of gamma,
// and the drafter's cache keeps only verified positions: the mask positions are written by the
// forward and dropped at once, and the next step feeds what verification accepted.
//
// The drafts are exact speculative decoding: under sampling draft k is drawn from the processed
// distribution at its position, q_k, which does not depend on the drafts before it, and
// verification accepts it against q_k (any q a draft was actually drawn from is exact).
//
// The mask token is one of the drafter's ids that drafts never propose: the row the adaptation
// added after the target's vocabulary (drafter vocabulary = the target's + 1, mask id = the
// target's vocabulary size), or an id inside a shared vocabulary that the target does not emit in
// practice (the published PARD checkpoints use a reserved token of the family's vocabulary; their
// configuration names it `pard_token`). Its logit is removed before any draft is chosen.
//
// Draft-length policies: the fixed gamma and the success schedule set how many rows the forward
// computes; EGAG (from the first row's entropy) and the confidence stop cut the step's drafts from
// those rows, as they would have stopped a drafter drafting one token at a time.
#pragma once

#include <algorithm>
#include <cmath>
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
#include "specdec/draft_source.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/verification.hpp"

namespace specdec {

// What a parallel drafter needs beside its weights: its mask token, and the target's vocabulary
// (the drafts' ids; the drafter's is the same, or one larger when the mask is an added row).
struct ParallelDraftOptions {
  int64_t mask_token = -1;  // in [0, the drafter's vocab_size)
  int64_t vocab_size = -1;  // the target's: the drafter's, or the drafter's - 1 with mask_token == vocab_size
};

namespace detail {

// Throws std::invalid_argument naming the field when a drafter of `drafter_vocab` ids cannot draft
// for a target of options.vocab_size with options.mask_token.
inline void check_parallel_draft_options(const ParallelDraftOptions& options, int64_t drafter_vocab) {
  if (options.mask_token < 0 || options.mask_token >= drafter_vocab) {
    throw_invalid_message("mask_token must be in [0, ", drafter_vocab, "), the drafter's vocabulary, got ",
                          options.mask_token);
  }
  if (options.vocab_size == drafter_vocab) return;
  if (options.vocab_size == drafter_vocab - 1) {
    if (options.mask_token != options.vocab_size) {
      throw_invalid_message("mask_token must be ", options.vocab_size,
                            " (the row the drafter has beyond the target's vocabulary), got ", options.mask_token);
    }
    return;
  }
  throw_invalid_message("vocab_size must be the drafter's vocabulary ", drafter_vocab, " or one less (a mask row ",
                        "added), got ", options.vocab_size);
}

}  // namespace detail

// Drafts a chain from one forward of a parallel drafter per step (a DraftSource for
// generate_with, sessions and batches of sources). The drafter's cache is the source's own or the
// caller's and lives across generations, as ModelDraftSource's does.
//
// Requires: D models Drafter. Throws std::invalid_argument (check_parallel_draft_options) for a
// mask token outside the drafter's vocabulary or a target vocabulary that is neither the
// drafter's nor one less with the mask as the extra row; draft() throws when a draft-length option
// is out of range (check_draft_length_options).
template <Drafter D>
class ParallelDraftSource : public detail::DrafterModelState<D> {
  using State = detail::DrafterModelState<D>;
  using State::policy_;
  using State::runner_;

 public:
  // A source with a cache of its own (use_cache false recomputes the sequence at every forward).
  ParallelDraftSource(D& drafter, const ParallelDraftOptions& options, bool use_cache = true)
      : State(drafter, use_cache), options_(options) {
    detail::check_parallel_draft_options(options, static_cast<int64_t>(drafter.vocab_size()));
  }
  // A source on the caller's cache (which must outlive it).
  ParallelDraftSource(D& drafter, typename D::cache_type& cache, const ParallelDraftOptions& options)
      : State(drafter, cache), options_(options) {
    detail::check_parallel_draft_options(options, static_cast<int64_t>(drafter.vocab_size()));
  }

  // The target's vocabulary, which the drafts are ids of.
  [[nodiscard]] int64_t vocab_size() const noexcept { return options_.vocab_size; }
  [[nodiscard]] const ParallelDraftOptions& options() const noexcept { return options_; }
  // (max_sequence_length(): drafting k tokens feeds the drafter the sequence and k - 1 mask
  // tokens, as a chain of k feeds it k - 1 drafts; start(), verified() and finish() as
  // ModelDraftSource's.)

  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& processor, at::Generator& gen) {
    Drafts result;
    const int64_t rows = this->policy(request.gamma).limit(request.room);
    if (rows <= 0) return result;
    const auto length = static_cast<int64_t>(request.sequence.size());
    runner_.set_counters({.calls = &result.calls});
    runner_.truncate(length - 1);  // the sequence's last token is always fed: it predicts the first draft
    const at::Tensor logits = runner_.forward(request.sequence, rows > 1 ? masks(rows - 1) : at::Tensor());
    runner_.set_counters({});
    runner_.truncate(length);  // the mask positions go; the cache holds the verified sequence
    const at::Tensor drafter_rows = logits.narrow(0, logits.size(0) - rows, rows);
    // Greedy drafts from fp32 logits on the CPU are read where the logits lie.
    if constexpr (std::is_same_v<P, GreedyProcessor>) {
      if (detail::host_readable(drafter_rows) && !policy_->needs_signal(0)) {
        draft_on_host(drafter_rows, result);
        return result;
      }
    }
    const at::Tensor proposals = proposable(drafter_rows);  // [rows, vocab]
    const int64_t count = chosen_length(proposals, request.room, result);
    if (count == 0) return result;
    const at::Tensor kept = proposals.narrow(0, 0, count);
    if constexpr (std::is_same_v<P, GreedyProcessor>) {
      result.tokens = kept.argmax(-1);
      result.finite = at::isfinite(kept.amax(-1)).all();
    } else {
      result.probs = processor(kept);
      result.tokens = processor.sample(result.probs, gen).view({count});
    }
    return result;
  }

 private:
  // `count` mask tokens [1, count] on the drafter's device, made once for the largest count asked.
  at::Tensor masks(int64_t count) {
    if (!masks_.defined() || masks_.size(1) < count) {
      masks_ = at::full({1, count}, options_.mask_token,
                        at::TensorOptions().dtype(at::kLong).device(runner_.device()));
    }
    return masks_.narrow(1, 0, count);
  }

  // The drafter's rows over the target's vocabulary, the mask token's logit set to -inf in place
  // (the rows are this step's own logits: no copy, no index tensor).
  [[nodiscard]] at::Tensor proposable(const at::Tensor& rows) const {
    const int64_t vocab = options_.vocab_size;
    at::Tensor out = rows.narrow(1, 0, vocab);
    if (options_.mask_token < vocab) {
      out.narrow(1, options_.mask_token, 1).fill_(-std::numeric_limits<double>::infinity());
    }
    return out;
  }

  // How many of the rows the step drafts: all of them, or fewer where EGAG (from the first row's
  // entropy) or the confidence stop ends the step. Sets result.gamma and result.entropy.
  int64_t chosen_length(const at::Tensor& proposals, int64_t room, Drafts& result) {
    int64_t count = proposals.size(0);
    for (int64_t i = 0; i < count; ++i) {
      if (!policy_->needs_signal(i)) continue;
      const detail::DrafterSignal signal = detail::drafter_signal(proposals.narrow(0, i, 1));
      if (i == 0 && policy_->uses_entropy()) {
        count = std::min(count, policy_->choose(signal, room));
        result.entropy = policy_->smoothed_entropy();
      }
      if (i < count && policy_->stop(signal)) count = i;
    }
    result.gamma = count;
    return count;
  }

  // draft() under greedy decoding, fp32 logits on the CPU and a fixed or scheduled length: each
  // draft the first maximum of its row among the proposable ids, read by the host.
  void draft_on_host(const at::Tensor& rows, Drafts& result) const {
    const int64_t count = rows.size(0), vocab = options_.vocab_size, mask = options_.mask_token;
    at::Tensor tokens = at::empty({count}, at::TensorOptions().dtype(at::kLong));
    int64_t* out = tokens.data_ptr<int64_t>();
    bool finite = true;
    for (int64_t i = 0; i < count; ++i) {
      const detail::RowMax best =
          detail::row_max(rows.data_ptr<float>() + i * rows.stride(0), vocab, rows.stride(1), mask);
      out[i] = best.index;
      finite = finite && best.finite;
    }
    result.gamma = count;
    result.tokens = tokens;
    result.finite = at::scalar_tensor(finite, at::TensorOptions().dtype(at::kBool));
  }

  ParallelDraftOptions options_;
  at::Tensor masks_;
};

}  // namespace specdec
