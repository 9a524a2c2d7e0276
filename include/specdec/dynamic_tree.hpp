// Dynamic draft trees from a drafter model (EAGLE-2's procedure, Li et al. 2024, arXiv
// 2406.16858): the tree's shape follows the drafter's confidence in this context instead of a
// fixed template. For `depth` rounds the drafter scores the whole frontier in one forward, each
// frontier node proposes its top_k children, every candidate is scored by its path's cumulative
// log-probability under the drafter, and the top_k best new candidates form the next frontier.
// The total_tokens best candidates overall, a connected subtree (a child never outscores its
// parent), go to the target in one tree-attention forward.
//
// Everything is decided on the device: the frontier, the final selection, the tree's parents,
// depths and attention mask. The step keeps its one device-to-host copy, which brings back the
// accepted children, the tree's tokens and its layout for the host walk.
//
// The children are the drafter's top-k tokens: deterministic given the context, so verification
// is the deterministic rule of model_tree.hpp and exact under any sampling. Sampled children are
// not offered here: a shape chosen by the drawn tokens' own scores makes a child's presence
// depend on the child, which biases the output (static trees take sampled children).
//
// Defaults, scaled to a small CPU: depth 5, top_k 4, total_tokens 16. For reference, SGLang runs
// EAGLE with 5 steps, top-k 4 and 8 draft tokens; EAGLE's own code 60 nodes, depth 7
// (`total_token`, `depth`), top-k 10.
#pragma once

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/model_tree.hpp"
#include "specdec/options.hpp"
#include "specdec/step.hpp"

namespace specdec {

// The shape bounds of a dynamic tree.
struct DynamicTreeOptions {
  int64_t depth = 5;          // rounds of expansion: the deepest draft (>= 1)
  int64_t top_k = 4;          // children per expanded node, and the frontier's width (>= 1)
  int64_t total_tokens = 16;  // draft nodes the target verifies (>= 1)

  friend std::ostream& operator<<(std::ostream& out, const DynamicTreeOptions& o) {
    return out << "DynamicTreeOptions{depth=" << o.depth << ", top_k=" << o.top_k
               << ", total_tokens=" << o.total_tokens << "}";
  }
};

// Draws a dynamic tree per step from a drafter model, for generate_with and sessions (a
// TreeDraftSource). Round r feeds the drafter the paths of the top_k frontier nodes, as top_k
// chains of r - 1 tokens below the context (a TreeTarget attends to every cached position, so the
// frontier's branches cannot stay cached side by side): a tree of depth D costs D drafter forwards
// of at most top_k (D - 1) tokens each. Afterwards the drafter's cache holds the context; the
// accepted tokens are fed with the next step's first forward.
//
// Near the end of the sequence the tree is cut (fewer rounds and nodes): an ordinary end.
//
// Requires: D models TreeTarget; the target models MaskedTreeTarget (the tree's mask is built on
// the device); the vocabularies are equal.
// Throws: std::invalid_argument naming the option and value (depth, top_k or total_tokens < 1,
// top_k above the vocabulary), or when the drafter's logits are not finite.
template <TreeTarget D>
class DynamicTreeSource {
 public:
  DynamicTreeSource(D& drafter, const DynamicTreeOptions& options = {}, bool use_cache = true)
      : runner_(drafter, "drafter", use_cache), options_(options) {
    if (options.depth < 1) detail::throw_invalid("depth", "be >= 1", options.depth);
    if (options.top_k < 1) detail::throw_invalid("top_k", "be >= 1", options.top_k);
    if (options.total_tokens < 1) detail::throw_invalid("total_tokens", "be >= 1", options.total_tokens);
    if (options.top_k > vocab_size()) {
      detail::throw_invalid_message("top_k must be at most the drafter's vocab_size ", vocab_size(), ", got ",
                                    options.top_k);
    }
  }

  [[nodiscard]] int64_t vocab_size() const { return static_cast<int64_t>(runner_.model().vocab_size()); }
  [[nodiscard]] const DynamicTreeOptions& options() const noexcept { return options_; }

  void start(std::span<const int64_t> sequence, const SpeculativeOptions& options) {
    runner_.set_use_cache(options.use_cache);
    runner_.resume(sequence);
  }
  void finish(std::span<const int64_t> sequence) { runner_.record(sequence); }

  TreeDrafts draft_tree(const DraftRequest& request) {
    length_ = static_cast<int64_t>(request.sequence.size());
    const int64_t k = options_.top_k;
    // Round r feeds k (r - 1) positions after the context.
    const int64_t drafter_room = detail::sequence_limit(runner_.model(), runner_.cache()) - length_;
    int64_t depth = std::min(options_.depth, request.room);
    while (depth > 1 && k * (depth - 1) > drafter_room) --depth;
    const int64_t candidates = depth < 1 ? 0 : k + (depth - 1) * k * k;
    n_ = std::max<int64_t>(0, std::min({options_.total_tokens, candidates, request.capacity}));
    const at::Device device = runner_.device();
    const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
    calls_ = 0;
    finite_.clear();
    if (n_ == 0 || drafter_room < 0) {
      n_ = 0;
      ids_ = at::empty({0}, longs);
      children_ = at::full({1, k}, -1, longs);
      return TreeDrafts{.ids = ids_.to(request.device), .device_parents = ids_.to(request.device), .depth = 0};
    }
    // Round 1: the root's children, from the context's last row.
    int64_t uncached = 0;
    at::Tensor rows = forward(request.sequence, at::Tensor(), {}, &uncached);
    rows = rows.narrow(0, rows.size(0) - 1, 1);
    auto [root_scores, root_tokens] = log_probs(rows).topk(k, -1);  // [1, k]
    std::vector<at::Tensor> tokens{root_tokens.view({k})}, scores{root_scores.view({k}) - kStep},
        parents{at::full({k}, -1, longs)}, slots{at::arange(k, longs)};
    at::Tensor frontier = at::arange(k, longs);  // candidate indices
    at::Tensor frontier_scores = scores.back();
    at::Tensor paths = root_tokens.view({k, 1});  // the frontier's tokens, root to node
    int64_t total = k;
    for (int64_t round = 2; round <= depth; ++round) {
      const int64_t length = round - 1;
      chains_.resize(static_cast<size_t>(k * length));
      for (int64_t c = 0; c < k; ++c) {
        for (int64_t i = 0; i < length; ++i) chains_[static_cast<size_t>(c * length + i)] = i == 0 ? -1 : c * length + i - 1;
      }
      runner_.truncate(length_);
      const at::Tensor logits = forward(request.sequence, paths.flatten(), chains_, &uncached);
      const at::Tensor last = at::arange(k, longs) * length + (uncached + length - 1);
      const auto [child_scores, child_tokens] = log_probs(logits.index_select(0, last)).topk(k, -1);  // [k, k]
      const at::Tensor path_scores = (frontier_scores.view({k, 1}) + child_scores - kStep).flatten();
      tokens.push_back(child_tokens.flatten());
      scores.push_back(path_scores);
      parents.push_back(frontier.repeat_interleave(k));
      slots.push_back(at::arange(k, longs).repeat({k}));
      const auto [best, index] = path_scores.topk(k);
      frontier = index + total;
      frontier_scores = best;
      paths = at::cat({paths.index_select(0, at::floor_divide(index, k)), child_tokens.flatten().index_select(0, index).view({k, 1})}, 1);
      total += k * k;
    }
    // The n best candidates, in candidate order (parents before children), renumbered.
    const at::Tensor all_scores = at::cat(scores);
    const at::Tensor chosen = std::get<0>(std::get<1>(all_scores.topk(n_)).sort());
    const at::Tensor number = at::full({total}, -1, longs).scatter(0, chosen, at::arange(n_, longs));
    const at::Tensor parent_candidate = at::cat(parents).index_select(0, chosen);
    const at::Tensor parent = at::where(parent_candidate.ge(0), number.index_select(0, parent_candidate.clamp_min(0)),
                                        parent_candidate);
    ids_ = at::cat(tokens).index_select(0, chosen);
    const at::Tensor place = (parent + 1) * k + at::cat(slots).index_select(0, chosen);
    children_ = at::full({(n_ + 1) * k}, -1, longs).scatter(0, place, at::arange(n_, longs)).view({n_ + 1, k});
    return TreeDrafts{.calls = calls_, .ids = ids_.to(request.device), .device_parents = parent.to(request.device),
                      .depth = depth};
  }

  template <LogitsProcessor P>
  at::Tensor score_tree(const at::Tensor& logits, int64_t uncached, const P& processor, at::Generator& gen) {
    return score(logits, uncached, processor, gen, detail::ModelTreeRule::exact);
  }

  // score_tree() under a chosen rule (tests).
  template <LogitsProcessor P>
  at::Tensor score(const at::Tensor& logits, int64_t uncached, const P& processor, at::Generator& gen,
                   detail::ModelTreeRule rule) {
    const at::Device device = logits.device();
    const int64_t n = n_;
    const at::Tensor p = processor(logits.narrow(0, uncached - 1, n + 1));
    const at::Tensor children = children_.to(device);
    const at::Tensor ids = ids_.to(device);
    const at::Tensor valid = children.ge(0);
    const at::Tensor child_tokens =
        n > 0 ? ids.index_select(0, children.clamp_min(0).flatten()).view(children.sizes()) : at::zeros_like(children);
    const auto [accept, token] = detail::verify_tree_children(p, child_tokens, valid, at::Tensor(), processor, gen, rule);
    const at::Tensor drafter_finite = finite_.empty() ? at::ones({1}, at::TensorOptions().dtype(at::kBool).device(device))
                                                      : at::stack(finite_).all().view({1}).to(device);
    return at::cat({accept.to(at::kDouble).flatten(), token.to(at::kDouble), ids.to(at::kDouble),
                    children.to(at::kDouble).flatten(), at::isfinite(p).all().to(at::kDouble).view({1}),
                    drafter_finite.to(at::kDouble)});
  }

  TreeVerdict walk_tree(const double* values) {
    const int64_t n = n_;
    const int64_t k = options_.top_k;
    const double* tokens = values + (n + 1) * k;
    const double* ids = tokens + (n + 1);
    const double* children = ids + n;
    const double* finite = children + (n + 1) * k;
    if (finite[0] == 0.0) detail::throw_non_finite("generate_with", "target");
    if (finite[1] == 0.0) detail::throw_invalid_message("generate_with: the drafter's logits are not finite");
    const auto [position, rejected] = detail::walk_accepted(
        values, k, [&](int64_t pos, int64_t j) { return static_cast<int64_t>(children[pos * k + j]); }, path_);
    drafts_.clear();
    for (const int64_t node : path_) drafts_.push_back(static_cast<int64_t>(ids[node]));
    if (rejected >= 0) drafts_.push_back(static_cast<int64_t>(ids[rejected]));
    return TreeVerdict{.path = path_, .drafts = drafts_, .token = static_cast<int64_t>(tokens[position])};
  }

  void verified_tree(std::span<const int64_t> /*sequence*/, int64_t position) { runner_.truncate(position); }

 private:
  // Each level's score falls by this much more than its log-probability, so that a child never
  // ties with its parent (a drafter certain of a token) and the selection stays connected.
  static constexpr double kStep = 1e-9;

  at::Tensor forward(std::span<const int64_t> context, const at::Tensor& ids, std::span<const int64_t> parents,
                     int64_t* uncached) {
    ++calls_;
    return runner_.forward_tree(context, ids, parents, uncached);
  }

  // The drafter's log-probabilities of rows [r, V], in float64; remembers whether they are finite
  // (NaN or +inf anywhere, or a row of only -inf, leaves a row maximum non-finite).
  at::Tensor log_probs(const at::Tensor& rows) {
    finite_.push_back(at::isfinite(rows.amax(-1)).all());
    return at::log_softmax(rows.to(at::kDouble), -1);
  }

  detail::ModelRunner<D> runner_;
  DynamicTreeOptions options_;
  std::vector<int64_t> chains_, path_, drafts_;
  std::vector<at::Tensor> finite_;
  at::Tensor ids_, children_;
  int64_t length_ = 0, n_ = 0, calls_ = 0;
};

}  // namespace specdec
