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
// ParallelDraftSource drafts a chain: each position's top token (or a draw). ParallelTreeSource
// drafts a static tree from the same forward: each position's top-k tokens, below every node of
// the level above (the positions do not depend on the drafts before them, as Medusa's heads).
//
// Draft-length policies (chains): the fixed gamma and the success schedule set how many rows the forward
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
#include "specdec/drafting/dynamic_tree.hpp"
#include "specdec/drafting/model_tree.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/step.hpp"
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

namespace detail {

// What the chain and the tree sources of a parallel drafter share: the drafter with its cache and
// draft-length policy, its mask token, and the one forward of a step.
template <Drafter D>
class ParallelDrafterState : public DrafterModelState<D> {
  using State = DrafterModelState<D>;

 public:
  // The target's vocabulary, which the drafts are ids of.
  [[nodiscard]] int64_t vocab_size() const noexcept { return options_.vocab_size; }
  [[nodiscard]] const ParallelDraftOptions& options() const noexcept { return options_; }

 protected:
  ParallelDrafterState(D& drafter, const ParallelDraftOptions& options, bool use_cache)
      : State(drafter, use_cache), options_(options) {
    check_parallel_draft_options(options, static_cast<int64_t>(drafter.vocab_size()));
  }
  ParallelDrafterState(D& drafter, typename D::cache_type& cache, const ParallelDraftOptions& options)
      : State(drafter, cache), options_(options) {
    check_parallel_draft_options(options, static_cast<int64_t>(drafter.vocab_size()));
  }

  // The drafter's logits [rows, drafter vocab] for the `rows` tokens after `sequence`: one forward
  // of the sequence (what the cache lacks of it, always its last token) and rows - 1 mask tokens,
  // counted in *calls. Afterwards the cache holds the sequence and nothing of the masks.
  at::Tensor forward_rows(std::span<const int64_t> sequence, int64_t rows, int64_t* calls) {
    const auto length = static_cast<int64_t>(sequence.size());
    this->runner_.set_counters({.calls = calls});
    this->runner_.truncate(length - 1);  // the sequence's last token predicts the first draft
    const at::Tensor logits = this->runner_.forward(sequence, rows > 1 ? masks(rows - 1) : at::Tensor());
    this->runner_.set_counters({});
    this->runner_.truncate(length);  // the mask positions go; the cache holds the verified sequence
    return logits.narrow(0, logits.size(0) - rows, rows);
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

  // How many ids drafts may be: the target's vocabulary less the mask where it lies inside it.
  [[nodiscard]] int64_t proposable_ids() const noexcept {
    return options_.vocab_size - (options_.mask_token < options_.vocab_size ? 1 : 0);
  }

  ParallelDraftOptions options_;

 private:
  // `count` mask tokens [1, count] on the drafter's device, made once for the largest count asked.
  at::Tensor masks(int64_t count) {
    if (!masks_.defined() || masks_.size(1) < count) {
      masks_ = at::full({1, count}, options_.mask_token,
                        at::TensorOptions().dtype(at::kLong).device(this->runner_.device()));
    }
    return masks_.narrow(1, 0, count);
  }

  at::Tensor masks_;
};

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
class ParallelDraftSource : public detail::ParallelDrafterState<D> {
  using State = detail::ParallelDrafterState<D>;
  using State::options_;
  using State::policy_;

 public:
  // A source with a cache of its own (use_cache false recomputes the sequence at every forward).
  ParallelDraftSource(D& drafter, const ParallelDraftOptions& options, bool use_cache = true)
      : State(drafter, options, use_cache) {}
  // A source on the caller's cache (which must outlive it).
  ParallelDraftSource(D& drafter, typename D::cache_type& cache, const ParallelDraftOptions& options)
      : State(drafter, cache, options) {}

  // (vocab_size() and options() as ParallelDrafterState's; max_sequence_length(): drafting k
  // tokens feeds the drafter the sequence and k - 1 mask tokens, as a chain of k feeds it k - 1
  // drafts; start(), verified() and finish() as ModelDraftSource's.)

  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& processor, at::Generator& gen) {
    Drafts result;
    const int64_t rows = this->policy(request.gamma).limit(request.room);
    if (rows <= 0) return result;
    const at::Tensor drafter_rows = this->forward_rows(request.sequence, rows, &result.calls);
    // Greedy drafts from fp32 logits on the CPU are read where the logits lie.
    if constexpr (std::is_same_v<P, GreedyProcessor>) {
      if (detail::host_readable(drafter_rows) && !policy_->needs_signal(0)) {
        draft_on_host(drafter_rows, result);
        return result;
      }
    }
    const at::Tensor proposals = this->proposable(drafter_rows);  // [rows, vocab]
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
};

// Static draft trees from one forward of a parallel drafter per step (a TreeDraftSource for
// generate_with and sessions): node (r_1, ..., r_d) of the shape (a TreeTemplate, e.g.
// TreeTemplate::from_paths of Medusa-style choices) is the rank-r_d proposable token at the d-th
// drafted position. The positions are predicted without the drafts before them, so one forward
// of the sequence and depth - 1 mask tokens gives every level, as Medusa's heads do; the children
// are deterministic (top-k), verified by the deterministic rule of drafting/model_tree.hpp: the
// output is the target's distribution under any sampling, and autoregressive decoding token for
// token under greedy decoding. The drafter's cache keeps only verified positions, as the chain's.
//
// Near the end of either model's context the tree is cut to the levels and nodes that fit (an
// ordinary end); a sequence the drafter cannot hold drafts nothing and the target goes on alone.
//
// Requires: D models Drafter; the target models MaskedTreeTarget (the tree is laid out on the
// device). Throws std::invalid_argument as ParallelDraftSource, and when a node of the shape has
// more children than there are proposable ids; the step reports non-finite drafter logits.
template <Drafter D>
class ParallelTreeSource : public detail::ParallelDrafterState<D>, public detail::DeviceTreeVerifier {
  using State = detail::ParallelDrafterState<D>;

 public:
  // A source with a cache of its own (use_cache false recomputes the sequence at every forward).
  ParallelTreeSource(D& drafter, const ParallelDraftOptions& options, const TreeTemplate& shape,
                     bool use_cache = true)
      : State(drafter, options, use_cache), tree_shape_(shape) {
    check_shape();
  }
  // A source on the caller's cache (which must outlive it).
  ParallelTreeSource(D& drafter, typename D::cache_type& cache, const ParallelDraftOptions& options,
                     const TreeTemplate& shape)
      : State(drafter, cache, options), tree_shape_(shape) {
    check_shape();
  }

  TreeDrafts draft_tree(const DraftRequest& request) {
    const auto length = static_cast<int64_t>(request.sequence.size());
    // A tree of depth d feeds the drafter length + d - 1 positions, as a chain of d drafts does.
    const int64_t levels = std::min(request.room, detail::source_room(*this, length));
    const detail::BreadthFirstTree& shape = tree_shape_.shape();
    const int64_t n = std::min(shape.within(std::max<int64_t>(0, levels)), request.capacity);
    if (n <= 0) {
      tree_.clear(1, request.device);
      return tree_.drafts(request.device, 0);
    }
    int64_t calls = 0;
    const at::Tensor rows = this->forward_rows(request.sequence, shape.depth(n - 1), &calls);
    tree_shape_.assign(tree_, this->proposable(rows), n, request.device);
    return tree_.drafts(request.device, calls);
  }

  // The drafter's cache already holds only the verified sequence before the step; the accepted
  // tokens are fed with the next step's forward.
  void verified_tree(std::span<const int64_t> /*sequence*/, int64_t position) { this->runner_.truncate(position); }

 private:
  void check_shape() const {
    if (tree_shape_.width() > this->proposable_ids()) {
      detail::throw_invalid_message("shape has a node with ", tree_shape_.width(), " children, more than the ",
                                    this->proposable_ids(), " ids a draft may be");
    }
  }

  detail::RankedLevelTree tree_shape_;
};

}  // namespace specdec
