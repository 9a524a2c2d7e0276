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
// is the deterministic rule of drafting/tree_verification.hpp and exact under any sampling. Sampled
// children are not offered here: a shape chosen by the drawn tokens' own scores makes a child's
// presence depend on the child, which biases the output (static trees take sampled children).
//
// Defaults, scaled to a small CPU: depth 5, top_k 4, total_tokens 16. For reference, SGLang runs
// EAGLE with 5 steps, top-k 4 and 8 draft tokens; EAGLE's own code 60 nodes, depth 7
// (`total_token`, `depth`), top-k 10.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <span>
#include <string_view>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/drafting/model_tree.hpp"
#include "specdec/drafting/tree_verification.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/step.hpp"

namespace specdec {

// The shape bounds of a dynamic tree.
struct DynamicTreeOptions {
  int64_t depth = 5;          // rounds of expansion: the deepest draft (>= 1)
  int64_t top_k = 4;          // children per expanded node, and the frontier's width (>= 1)
  int64_t total_tokens = 16;  // draft nodes the target verifies (>= 1)
  // Divides the drafter's logits before paths are scored (finite, > 0). It changes only the
  // tree's shape: below 1 trusts a drafter whose probabilities understate how often the target
  // agrees (the tree grows deeper), above 1 spreads the nodes over more siblings. The children
  // stay each node's top_k tokens and verification does not read their probabilities, so the
  // output distribution is the same at every value.
  double score_temperature = 1.0;

  friend std::ostream& operator<<(std::ostream& out, const DynamicTreeOptions& o) {
    return out << "DynamicTreeOptions{depth=" << o.depth << ", top_k=" << o.top_k
               << ", total_tokens=" << o.total_tokens
               << ", score_temperature=" << o.score_temperature << "}";
  }
};

namespace detail {

// Throws std::invalid_argument naming the first bad option.
inline void check_dynamic_tree_options(const DynamicTreeOptions& options, int64_t vocab) {
  if (options.depth < 1) throw_invalid("depth", "be >= 1", options.depth);
  if (options.top_k < 1) throw_invalid("top_k", "be >= 1", options.top_k);
  if (options.total_tokens < 1) throw_invalid("total_tokens", "be >= 1", options.total_tokens);
  if (!(std::isfinite(options.score_temperature) && options.score_temperature > 0.0)) {
    throw_invalid("score_temperature", "be finite and > 0", options.score_temperature);
  }
  if (options.top_k > vocab) {
    throw_invalid_message("top_k must be at most the drafter's vocab_size ", vocab, ", got ",
                          options.top_k);
  }
}

}  // namespace detail

namespace detail {

// The drafter-independent part of a dynamic tree: the candidates, the frontier and the final
// selection, verified as every tree is (TreeVerifier). A source supplies the drafter's logits:
// build() takes the root's row (scored at options.score_temperature) and calls expand(round,
// tokens, parent_rows) for rounds 2 .. depth, which returns the logits [top_k, V] after each
// frontier node; tokens [top_k] holds the frontier's tokens (the nodes at depth round - 1) and
// parent_rows [top_k] which row of the round before each node's parent was. Everything stays on
// the device.
//
// The library's own work is a fixed handful of ATen calls per round (a log-softmax, two top-k
// selections, the path scores and the next frontier: 11 calls) and about 20 for the selection;
// what the selection needs of every round (each candidate's parent and rank) is worked out from
// the candidates' numbering at the end instead of being built round by round. Constant index
// tensors are kept between steps.
class DeviceDraftTree : public TreeVerifier {
 public:
  // The most candidates a tree of `depth` rounds of `top_k` has.
  static int64_t candidates(int64_t depth, int64_t top_k) {
    return depth < 1 ? 0 : top_k + (depth - 1) * top_k * top_k;
  }

  // An empty tree (nothing to draft this step).
  void clear(int64_t top_k, const at::Device& device) {
    depth_ = 0;
    start();
    const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
    parents_ = at::empty({0}, longs);
    set(at::empty({0}, longs), at::full({1, top_k}, -1, longs));
  }

  // A tree of n nodes (1 <= n <= candidates(depth, top_k)) from the root's logits [1, V].
  //
  // Candidates are numbered in the order they are proposed: the root's top_k children 0 .. k - 1,
  // then round r's k * k children from k + (r - 2) k^2 on, child j of frontier row i at offset
  // i * k + j. So a candidate's rank among its siblings is its number mod k, and its parent is
  // row (c - k) / k of the frontiers of rounds 2 .. depth laid end to end.
  template <class Expand>
  void build(const at::Tensor& root, int64_t depth, const DynamicTreeOptions& options, int64_t n,
             Expand expand) {
    const int64_t k = options.top_k;
    start();
    depth_ = depth;
    temperature_ = options.score_temperature;
    const Constants& constants = constants_for(k, depth, n, root.device());
    auto [root_scores, root_tokens] = log_probs(root).topk(k, -1);  // [1, k]
    at::Tensor frontier_tokens = root_tokens.view({k});
    std::vector<at::Tensor> tokens{frontier_tokens}, scores{root_scores.view({k}) - kStep};
    // The candidate number of every round's frontier, after -1 (the root) and the root's children.
    std::vector<at::Tensor> frontiers{constants.root_parent, constants.first_frontier};
    at::Tensor frontier_scores = scores.back();
    at::Tensor parent_rows = constants.first_parent_rows;
    int64_t total = k;
    for (int64_t round = 2; round <= depth; ++round) {
      const at::Tensor logits = expand(round, frontier_tokens, parent_rows);
      const auto [child_scores, child_tokens] = log_probs(logits).topk(k, -1);  // [k, k]
      const at::Tensor path_scores = (frontier_scores.view({k, 1}) + child_scores - kStep).view({k * k});
      const at::Tensor children = child_tokens.view({k * k});
      tokens.push_back(children);
      scores.push_back(path_scores);
      const auto [best, index] = path_scores.topk(k);
      frontier_scores = best;
      parent_rows = at::floor_divide(index, k);
      frontier_tokens = children.index_select(0, index);
      if (round < depth) frontiers.push_back(index + total);
      total += k * k;
    }
    const at::Tensor all_scores = at::cat(scores);
    // Log-probabilities are never NaN for finite logits; a NaN or +inf logit, or a row of only
    // -inf, makes its row's log-softmax NaN, and top-k ranks NaN first.
    record_finite(all_scores.isnan().any().logical_not());
    // The n best candidates, in candidate order (parents before children), renumbered.
    const at::Tensor chosen = std::get<0>(std::get<1>(all_scores.topk(n)).sort());
    const at::Tensor parent_candidate =
        at::cat(frontiers).index_select(0, constants.parent_slot.index_select(0, chosen));
    // number[c + 1] is candidate c's node number, number[0] the root's -1.
    const at::Tensor number = constants.unnumbered.scatter(0, chosen + 1, constants.nodes);
    parents_ = number.index_select(0, parent_candidate + 1);
    const at::Tensor place = (parents_ + 1) * k + chosen.remainder(k);
    set(at::cat(tokens).index_select(0, chosen),
        constants.no_children.scatter(0, place, constants.nodes).view({n + 1, k}));
  }

  // A tree of a static shape whose tokens are on the device: ids int64 [n], node i of rank
  // ranks[i] below parents[i] (parents[i] < i, -1: the root), no node deeper than depth.
  void assign(const at::Tensor& ids, std::span<const int64_t> parents,
              std::span<const int64_t> ranks, int64_t depth) {
    TreeLayout layout;
    layout.build(parents, ranks);
    const int64_t width = std::max<int64_t>(1, layout.width);
    const int64_t n = ids.numel();
    start();
    depth_ = depth;
    set(ids, to_device<int64_t>(layout.children, {n + 1, width}, ids.device()));
    parents_ = to_device<int64_t>(parents, {n}, ids.device());
  }

  // The step's drafts for the target on `device`.
  [[nodiscard]] TreeDrafts drafts(const at::Device& device, int64_t calls) const {
    return TreeDrafts{.calls = calls,
                      .ids = ids().to(device),
                      .device_parents = parents_.to(device),
                      .depth = depth_};
  }


 private:
  // Each level's score falls by this much more than its log-probability, so that a child never
  // ties with its parent (a drafter certain of a token) and the selection stays connected.
  static constexpr double kStep = 1e-9;

  // The index tensors of a tree shape (top_k, depth, n on a device), made once and kept while
  // the shape stays.
  struct Constants {
    int64_t k = 0, depth = 0, n = 0;
    at::Device device = at::kCPU;
    at::Tensor root_parent;        // [1]: -1
    at::Tensor first_frontier;     // [k]: 0 .. k - 1, the root's children
    at::Tensor first_parent_rows;  // [k]: zeros, the root's row
    at::Tensor parent_slot;        // [candidates]: where candidate c's parent is in the frontiers
    at::Tensor unnumbered;         // [candidates + 1]: -1
    at::Tensor no_children;        // [(n + 1) k]: -1
    at::Tensor nodes;              // [n]: 0 .. n - 1
  };

  const Constants& constants_for(int64_t k, int64_t depth, int64_t n, const at::Device& device) {
    Constants& c = constants_;
    if (c.k == k && c.depth == depth && c.n == n && c.device == device) return c;
    const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
    const int64_t total = candidates(depth, k);
    std::vector<int64_t> slot(static_cast<size_t>(total));
    for (int64_t i = 0; i < total; ++i) slot[static_cast<size_t>(i)] = i < k ? 0 : 1 + (i - k) / k;
    c = Constants{.k = k, .depth = depth, .n = n, .device = device,
                  .root_parent = at::full({1}, -1, longs),
                  .first_frontier = at::arange(k, longs),
                  .first_parent_rows = at::zeros({k}, longs),
                  .parent_slot = to_device<int64_t>(slot, {total}, device),
                  .unnumbered = at::full({total + 1}, -1, longs),
                  .no_children = at::full({(n + 1) * k}, -1, longs),
                  .nodes = at::arange(n, longs)};
    return c;
  }

  // Log-probabilities of logits rows [r, V] / temperature_ in float64.
  [[nodiscard]] at::Tensor log_probs(const at::Tensor& rows) const {
    return temperature_ == 1.0 ? at::log_softmax(rows, -1, at::kDouble)
                               : at::log_softmax(rows.to(at::kDouble) / temperature_, -1);
  }

  int64_t depth_ = 0;
  double temperature_ = 1.0;
  at::Tensor parents_;
  Constants constants_;
};

// The verification half of the sources whose step tree is a DeviceDraftTree (the dynamic trees,
// the heads' trees, suffix trees).
using DeviceTreeVerifier = VerifiesTree<DeviceDraftTree>;

// A static shape whose level d takes its tokens from row d - 1 of one logits table [depth, V]: the
// levels do not depend on the nodes above them (Medusa's heads, a parallel drafter's positions),
// so node (r_1, ..., r_d) is the rank-r_d token of row d - 1. Keeps its index tensor between steps.
class RankedLevelTree {
 public:
  explicit RankedLevelTree(const TreeTemplate& shape) : shape_(shape) {
    for (int64_t i = 0; i < shape_.size(); ++i) width_ = std::max(width_, shape_.rank(i) + 1);
  }

  [[nodiscard]] const BreadthFirstTree& shape() const noexcept { return shape_; }
  // The most children of a node: the top-k each row gives.
  [[nodiscard]] int64_t width() const noexcept { return width_; }

  // Lays the shape's first n nodes into `tree` from `logits` [depth(n - 1), V] and records their
  // finiteness for the walk.
  void assign(DeviceDraftTree& tree, const at::Tensor& logits, int64_t n, const at::Device& device) {
    const int64_t depth = shape_.depth(n - 1);
    const at::Tensor top = std::get<1>(logits.topk(width_, -1)).flatten();  // [depth * width]
    const at::Tensor ids = top.index_select(0, picks(n, top.device()));
    tree.assign(ids.to(device), shape_.parents(n), ranks_, depth);
    tree.check_finite(logits);
  }

 private:
  // Where node i's token is in the flattened top-k table, on `on`, made again only when the
  // tree's size or device changes (a tree cut near the end of the context); ranks_ for assign().
  const at::Tensor& picks(int64_t n, const at::Device& on) {
    if (picks_.defined() && picks_.numel() == n && picks_.device() == on) return picks_;
    std::vector<int64_t> pick(static_cast<size_t>(n));
    ranks_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      ranks_[static_cast<size_t>(i)] = shape_.rank(i);
      pick[static_cast<size_t>(i)] = (shape_.depth(i) - 1) * width_ + shape_.rank(i);
    }
    picks_ = to_device<int64_t>(pick, {n}, on);
    return picks_;
  }

  BreadthFirstTree shape_;
  int64_t width_ = 1;
  std::vector<int64_t> ranks_;
  at::Tensor picks_;
};

// Throws std::invalid_argument when a tree of `nodes` draft nodes cannot follow even one token in
// the target's context of `limit` positions (a tree that merely outgrows the room left near the
// end is cut instead: an ordinary end).
inline void check_tree_fits_target(int64_t nodes, std::string_view name, int64_t limit) {
  if (nodes >= limit) {
    throw_invalid_message(name, " is ", nodes, "; the target's max_sequence_length ", limit,
                          " leaves no room for a context");
  }
}

}  // namespace detail

// Draws a dynamic tree per step from a drafter model, for generate_with and sessions (a
// TreeDraftSource). After the context's forward, round r feeds the drafter the top_k frontier
// nodes:
//   - a CachedMaskTreeModel keeps every round's nodes in its cache and feeds only the frontier,
//     top_k tokens at their own positions, each seeing the context and its own ancestors among the
//     earlier rounds' entries: a tree of depth D costs D - 1 forwards of top_k tokens;
//   - another TreeTarget attends to every cached position, so the frontier's branches cannot stay
//     cached side by side: round r feeds the frontier's paths again, as top_k chains of r - 1
//     tokens below the context, D - 1 forwards of up to top_k (D - 1) tokens.
// The trees are the same either way. The step's verified tokens are fed with the next step's
// first forward (the draft entries are cut off first).
//
// Near the end of the sequence the tree is cut (fewer rounds and nodes): an ordinary end.
//
// Requires: D models TreeTarget; the target models MaskedTreeTarget (the tree's mask is built on
// the device); the vocabularies are equal.
// Throws: std::invalid_argument naming the option and value (depth, top_k or total_tokens < 1,
// top_k above the vocabulary, a score_temperature not finite and positive, a depth and top_k
// whose rounds cannot fit the drafter's context beside one token), or when the drafter's logits
// are not finite.
template <TreeTarget D>
class DynamicTreeSource : public detail::DeviceTreeVerifier {
 public:
  DynamicTreeSource(D& drafter, const DynamicTreeOptions& options = {}, bool use_cache = true)
      : runner_(drafter, "drafter", use_cache), options_(options) {
    detail::check_dynamic_tree_options(options, vocab_size());
    // The last round feeds top_k (depth - 1) positions after the context.
    const int64_t limit = detail::sequence_limit(drafter, runner_.cache());
    if (options.depth - 1 > (limit - 1) / options.top_k) {
      detail::throw_invalid_message(
          "depth ", options.depth, " with top_k ", options.top_k, " feeds top_k * (depth - 1) ",
          "positions after the context; the drafter's max_sequence_length ", limit,
          " leaves no room for a context");
    }
  }

  [[nodiscard]] int64_t vocab_size() const {
    return static_cast<int64_t>(runner_.model().vocab_size());
  }
  [[nodiscard]] const DynamicTreeOptions& options() const noexcept { return options_; }

  void start(std::span<const int64_t> sequence, const SpeculativeOptions& options) {
    runner_.set_use_cache(options.use_cache);
    runner_.resume(sequence);
  }
  void finish(std::span<const int64_t> sequence) { runner_.record(sequence); }

  TreeDrafts draft_tree(const DraftRequest& request) {
    const auto length = static_cast<int64_t>(request.sequence.size());
    const int64_t k = options_.top_k;
    // Round r feeds k (r - 1) positions after the context.
    const int64_t drafter_room = detail::sequence_limit(runner_.model(), runner_.cache()) - length;
    int64_t depth = std::min(options_.depth, request.room);
    while (depth > 1 && k * (depth - 1) > drafter_room) --depth;
    const int64_t n = std::min(
        {options_.total_tokens, detail::DeviceDraftTree::candidates(depth, k), request.capacity});
    calls_ = 0;
    if (n <= 0 || drafter_room < 0) {
      tree_.clear(k, runner_.device());
      return tree_.drafts(request.device, 0);
    }
    int64_t uncached = 0;
    const at::Tensor context = forward(request.sequence, at::Tensor(), {}, &uncached);
    if constexpr (CachedMaskTreeModel<D>) {
      // (Without a cache every forward starts empty: the rounds' entries would be gone.)
      if (runner_.uses_cache() && runner_.model().cached_mask_applies(length + k * (depth - 1))) {
        grow_in_cache(context, length, depth, n);
        return tree_.drafts(request.device, calls_);
      }
    }
    at::Tensor paths;  // [k, round - 1]: the frontier's tokens, root to node
    tree_.build(
        context.narrow(0, context.size(0) - 1, 1), depth, options_, n,
        [&](int64_t round, const at::Tensor& tokens, const at::Tensor& parent_rows) {
          paths = round == 2 ? tokens.view({k, 1})
                             : at::cat({paths.index_select(0, parent_rows), tokens.view({k, 1})}, 1);
          const int64_t chain = round - 1;
          chains_.resize(static_cast<size_t>(k * chain));
          for (int64_t c = 0; c < k; ++c) {
            for (int64_t i = 0; i < chain; ++i) {
              chains_[static_cast<size_t>(c * chain + i)] = i == 0 ? -1 : c * chain + i - 1;
            }
          }
          runner_.truncate(length);
          const at::Tensor logits = forward(request.sequence, paths.flatten(), chains_, &uncached);
          const at::Tensor last = at::arange(k, paths.options()) * chain + (uncached + chain - 1);
          return logits.index_select(0, last);
        });
    return tree_.drafts(request.device, calls_);
  }

  void verified_tree(std::span<const int64_t> /*sequence*/, int64_t position) {
    runner_.truncate(position);
  }

 private:
  // The rounds of a CachedMaskTreeModel: the frontier of round r (its nodes at depth r - 1, at
  // position length + r - 2) attends to the context and, among the k (r - 2) entries of the rounds
  // before, to its ancestors; the cache keeps every round. (Called for a CachedMaskTreeModel only.)
  void grow_in_cache(const at::Tensor& context, int64_t length, int64_t depth, int64_t n) {
    const int64_t k = options_.top_k;
    const auto longs = at::TensorOptions().dtype(at::kLong).device(runner_.device());
    const at::Tensor own = at::eye(k, longs.dtype(at::kBool));
    // [k, entries]: each frontier node's ancestors among the draft entries, and itself.
    at::Tensor lineage;
    tree_.build(
        context.narrow(0, context.size(0) - 1, 1), depth, options_, n,
        [&](int64_t round, const at::Tensor& tokens, const at::Tensor& parent_rows) {
          lineage = round == 2 ? own : at::cat({lineage.index_select(0, parent_rows), own}, 1);
          ++calls_;
          return runner_.forward_cached_mask(tokens, at::full({k}, length + round - 2, longs),
                                             lineage);
        });
  }

  at::Tensor forward(std::span<const int64_t> context, const at::Tensor& ids,
                     std::span<const int64_t> parents, int64_t* uncached) {
    ++calls_;
    return runner_.forward_tree(context, ids, parents, uncached);
  }

  detail::ModelRunner<D> runner_;
  DynamicTreeOptions options_;
  std::vector<int64_t> chains_;
  int64_t calls_ = 0;
};

}  // namespace specdec
