// Static draft trees from a drafter model: the drafter proposes a whole tree of a fixed shape
// (a TreeTemplate, e.g. from Medusa-style path lists) instead of one chain, the target scores
// every node in one tree-attention forward, and recursive rejection sampling over siblings picks
// the accepted path, so one early mismatch no longer wastes every later draft.
//
// Children of a node are either its drafter's top-k tokens (deterministic) or tokens drawn from
// the drafter's distribution without replacement (sampled, by Gumbel-top-k). Each has its own
// exact verification (Jeon et al. 2024, arXiv 2402.14160; SpecTr, Sun et al. 2023): at a
// position with target distribution r = p, the children x_1, x_2, ... are tried in order;
//   deterministic: accept x_j with probability r(x_j), else r <- normalise(r with x_j zeroed)
//                  (q one-hot at x_j);
//   sampled:       accept x_j with probability min(1, r(x_j) / q_j(x_j)), else
//                  r <- normalise(max(r - q_j, 0)), where q_j is the drafter's q without
//                  x_1 .. x_{j-1}, renormalised (the distribution x_j was drawn from).
// With no child accepted, the token is drawn from r. (The deterministic rule is exact for sampled
// children too, only it accepts less; mixing the two, the sampled acceptance with the
// deterministic residual, is not.) Either way the output is distributed
// exactly as the target's; under greedy decoding it is the target's argmax path (the first
// maximal token id on ties, as at::argmax), token for token autoregressive decoding.
//
// The whole step stays on the device: the tree's tokens never visit the host, the acceptance of
// every child and a residual token for every position are computed there, and the step's one
// device-to-host copy brings them back with the tokens; the host walks the tree.
//
// Why static shapes for sampled children: the exactness of sampled children needs each child's
// inclusion to depend only on its ancestors and earlier siblings. A shape chosen by the drafted
// tokens' scores (a dynamic tree) makes it depend on the child itself, which biases the output.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/model_runner.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/step.hpp"
#include "specdec/tree.hpp"

namespace specdec {

// How a node's children are drafted.
enum class TreeChildren {
  top_k,    // the drafter's most probable tokens, in order (deterministic; q one-hot)
  sampled,  // drawn from the drafter's distribution without replacement (q matters)
};

namespace detail {

// Verification rules for model trees; the biased ones exist for tests that must tell them apart
// from the exact one.
enum class ModelTreeRule {
  exact,               // the rule of the children's kind
  residual_ignores_q,  // sampled children accepted by r / q_j, but the residual of a rejected
                       // one is r without x_j, as for deterministic children
  with_replacement,    // sampled children verified as if drawn with replacement
  no_residual,         // a rejected child leaves r as it was (it may be drawn after all)
};

// A TreeTemplate renumbered breadth-first (parents before children, each level contiguous), and
// the layout of its first `nodes` nodes: which positions have which children. Position 0 is the
// root (the sequence's last token), position i + 1 is node i.
class BreadthFirstTree {
 public:
  explicit BreadthFirstTree(const TreeTemplate& shape) {
    const int64_t size = shape.size();
    std::vector<int64_t> order(static_cast<size_t>(size));
    for (int64_t i = 0; i < size; ++i) order[static_cast<size_t>(i)] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return shape.depth(a) < shape.depth(b); });
    std::vector<int64_t> index(static_cast<size_t>(size));
    for (int64_t i = 0; i < size; ++i)
      index[static_cast<size_t>(order[static_cast<size_t>(i)])] = i;
    for (const int64_t node : order) {
      const int64_t parent = shape.parent(node);
      parents_.push_back(parent < 0 ? -1 : index[static_cast<size_t>(parent)]);
      depth_.push_back(shape.depth(node));
      rank_.push_back(shape.rank(node));
    }
  }

  [[nodiscard]] int64_t size() const noexcept { return static_cast<int64_t>(parents_.size()); }
  [[nodiscard]] std::span<const int64_t> parents(int64_t nodes) const {
    return std::span<const int64_t>(parents_).first(static_cast<size_t>(nodes));
  }
  [[nodiscard]] int64_t depth(int64_t node) const { return depth_[static_cast<size_t>(node)]; }
  [[nodiscard]] int64_t rank(int64_t node) const { return rank_[static_cast<size_t>(node)]; }
  [[nodiscard]] int64_t max_depth() const { return depth_.empty() ? 0 : depth_.back(); }

  // How many of the first nodes lie within `depth` levels: a prefix, closed under ancestors,
  // keeping the first children of every parent.
  [[nodiscard]] int64_t within(int64_t depth) const {
    return static_cast<int64_t>(std::upper_bound(depth_.begin(), depth_.end(), depth) -
                                depth_.begin());
  }

 private:
  std::vector<int64_t> parents_, depth_, rank_;
};

// The children of every position of a tree of n nodes: children[pos * width + j] is the node of
// rank j below position pos, or -1. Positions are in [0, n]; width is the most children of one.
struct TreeLayout {
  std::vector<int64_t> children;
  int64_t width = 0;

  void build(std::span<const int64_t> parents, std::span<const int64_t> ranks) {
    const auto n = static_cast<int64_t>(parents.size());
    width = 0;
    for (const int64_t r : ranks) width = std::max(width, r + 1);
    children.assign(static_cast<size_t>((n + 1) * std::max<int64_t>(width, 1)), -1);
    for (int64_t i = 0; i < n; ++i) {
      children[static_cast<size_t>((parents[static_cast<size_t>(i)] + 1) * width +
                                   ranks[static_cast<size_t>(i)])] = i;
    }
  }
};

// The device part of model-tree verification, for positions [P] = tree positions, children
// `width` wide. p: the target's processed rows [P, V]; child_tokens, valid: [P, width] (valid:
// bool, a child exists and may be drawn); q: the drafter's processed rows [P, V] for sampled
// children (undefined for deterministic). Returns (accept [P, width] bool, token [P] int64): for
// each child whether it is accepted, given its earlier siblings were rejected, and the token
// drawn from the residual after every child of the position is rejected.
template <LogitsProcessor P>
std::pair<at::Tensor, at::Tensor> verify_tree_children(const at::Tensor& p,
                                                       const at::Tensor& child_tokens,
                                                       const at::Tensor& valid, const at::Tensor& q,
                                                       const P& processor, at::Generator& gen,
                                                       ModelTreeRule rule) {
  const int64_t positions = p.size(0);
  const int64_t width = child_tokens.size(1);
  const bool sampled = q.defined();
  const at::Tensor uniform = at::rand({positions, std::max<int64_t>(width, 1)}, gen, p.options());
  at::Tensor r = p;
  at::Tensor left = sampled ? q : at::Tensor();  // q without the children tried so far
  std::vector<at::Tensor> accepted;
  for (int64_t j = 0; j < width; ++j) {
    const at::Tensor x = child_tokens.narrow(1, j, 1);
    const at::Tensor v = valid.narrow(1, j, 1);
    const at::Tensor rn = r / r.sum(1, /*keepdim=*/true).clamp_min(1e-30);
    const at::Tensor rx = rn.gather(1, x);
    at::Tensor chance, next;
    if (sampled) {
      const at::Tensor qj = left / left.sum(1, /*keepdim=*/true).clamp_min(1e-30);
      const at::Tensor qx = qj.gather(1, x);
      chance = at::where(qx > 0, (rx / qx.clamp_min(1e-30)).clamp_max(1.0), at::zeros_like(qx));
      next = rule == ModelTreeRule::residual_ignores_q ? rn.scatter(1, x, 0.0)
                                                       : (rn - qj).clamp_min(0.0);
      if (rule != ModelTreeRule::with_replacement)
        left = at::where(v, left.scatter(1, x, 0.0), left);
    } else {
      chance = rx;
      next = rn.scatter(1, x, 0.0);
    }
    // A rejection leaves r unchanged where the child does not exist, and where nothing would be
    // left of it (r == q_j exactly cannot reject: guards rounding).
    const at::Tensor keep = v.logical_and(next.sum(1, /*keepdim=*/true) > 0);
    r = rule == ModelTreeRule::no_residual ? rn : at::where(keep, next, rn);
    accepted.push_back(uniform.narrow(1, j, 1).lt(chance).logical_and(v));
  }
  const at::Tensor token =
      processor.sample(r / r.sum(1, /*keepdim=*/true).clamp_min(1e-30), gen).view({positions});
  const at::Tensor accept =
      width > 0 ? at::cat(accepted, 1) : at::zeros({positions, 0}, valid.options());
  return {accept, token};
}

// Walks a verified tree from the root: at each position to its first accepted child (accept[pos *
// width + j] != 0 for the child of rank j), until a position accepts none. child(pos, j) is the
// node of rank j below position pos, or -1. Fills `path` (nodes, root to leaf); returns the last
// position and the first rejected child there (-1: none).
template <class Child>
std::pair<int64_t, int64_t> walk_accepted(const double* accept, int64_t width, Child child,
                                          std::vector<int64_t>& path) {
  path.clear();
  int64_t position = 0;
  while (true) {
    int64_t next = -1, rejected = -1;
    for (int64_t j = 0; j < width; ++j) {
      const int64_t node = child(position, j);
      if (node < 0) continue;
      if (accept[position * width + j] != 0.0) {
        next = node;
        break;
      }
      if (rejected < 0) rejected = node;
    }
    if (next < 0) return {position, rejected};
    path.push_back(next);
    position = next + 1;
  }
}

}  // namespace detail

// Drafts a static tree from a drafter model per step, for generate_with (a TreeDraftSource):
// level by level, the drafter scores every node of the tree so far in one tree-attention forward
// and each node of the level below takes its rank among its parent's top-k tokens or draws.
// Every level re-feeds the tree above it (a TreeTarget attends to every cached position, so
// nodes of other branches cannot stay cached while a level is scored); the drafter's cache keeps
// the accepted path afterwards. A tree of depth D costs D drafter forwards and one target
// forward per step.
//
// Near the end of the sequence the tree is cut to the levels and nodes that fit (an ordinary
// end, never an error). Under GreedyProcessor the children are always the top-k (a greedy
// drafter has one token with mass).
//
// Requires: D models TreeTarget (tree attention); the drafter's vocabulary equals the target's.
// Throws: std::invalid_argument when the tree does not fit the drafter's context at all, or the
// drafter's logits are not finite.
template <TreeTarget D>
class ModelTreeSource {
 public:
  // A source with a cache of its own (use_cache false recomputes the sequence at every forward).
  ModelTreeSource(D& drafter, const TreeTemplate& shape,
                  TreeChildren children = TreeChildren::top_k, bool use_cache = true)
      : runner_(drafter, "drafter", use_cache), tree_(shape), children_(children) {
    const int64_t limit = detail::sequence_limit(drafter, runner_.cache());
    int64_t widest = 0;
    for (int64_t i = 0; i < shape.size(); ++i) widest = std::max(widest, shape.rank(i) + 1);
    if (widest > vocab_size()) {
      detail::throw_invalid_message("shape has a node with ", widest,
                                    " children, more than the drafter's vocab_size ", vocab_size());
    }
    if (tree_.size() >= limit) {
      detail::throw_invalid_message("shape has ", tree_.size(),
                                    " nodes; the drafter's max_sequence_length ", limit,
                                    " leaves no room for a context");
    }
  }

  [[nodiscard]] int64_t vocab_size() const {
    return static_cast<int64_t>(runner_.model().vocab_size());
  }
  [[nodiscard]] TreeChildren children() const noexcept { return children_; }
  [[nodiscard]] const typename D::cache_type& cache() const noexcept { return runner_.cache(); }

  void start(std::span<const int64_t> sequence, const SpeculativeOptions& options) {
    runner_.set_use_cache(options.use_cache);
    runner_.resume(sequence);
  }
  void finish(std::span<const int64_t> sequence) { runner_.record(sequence); }

  // Drafts the tree below request.sequence: at most request.room levels, request.capacity nodes.
  // Sampled children are drawn through `processor` with `gen`.
  template <LogitsProcessor P>
  TreeDrafts draft_tree(const DraftRequest& request, const P& processor, at::Generator& gen) {
    length_ = static_cast<int64_t>(request.sequence.size());
    const int64_t drafter_room = detail::sequence_limit(runner_.model(), runner_.cache()) - length_;
    int64_t n = tree_.within(std::max<int64_t>(0, request.room));
    n = std::clamp<int64_t>(std::min({n, request.capacity, drafter_room}), 0, tree_.size());
    if (drafter_room < 1) n = 0;  // the context alone fills the drafter: the target goes on alone
    n_ = n;
    fed_ = 0;
    ranks_.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) ranks_[static_cast<size_t>(i)] = tree_.rank(i);
    const std::span<const int64_t> parents = tree_.parents(n);
    layout_.build(parents, ranks_);
    calls_ = 0;
    const at::Device device = runner_.device();
    const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
    ids_ = at::empty({0}, longs);
    valid_ = at::ones({n}, longs.dtype(at::kBool));
    q_rows_.clear();
    finite_.clear();
    if (n == 0) {  // nothing to draft: no drafter forward (the context may not even fit it)
      ids_ = at::empty({0}, longs);
      return TreeDrafts{.parents = parents, .calls = 0, .ids = ids_.to(request.device)};
    }
    // Level 0: the context (what the drafter has not seen of it); its last row is the root's.
    int64_t uncached = 0;
    at::Tensor level_logits = drafter_forward(request.sequence, at::Tensor(), {}, &uncached);
    level_logits = level_logits.narrow(0, level_logits.size(0) - 1, 1);
    int64_t level_begin = -1, level_end = 0;  // positions of the level above, as nodes (root: -1)
    for (int64_t depth = 1; level_end < n; ++depth) {
      const int64_t begin = level_end;
      const int64_t end = std::min(n, tree_.within(depth));
      // Children of the level above: the top-k or draws of each of its positions.
      int64_t width = 0;
      for (int64_t i = begin; i < end; ++i) width = std::max(width, tree_.rank(i) + 1);
      const at::Tensor candidates = children_of(level_logits, width, sampling<P>(), processor, gen);
      // Node i of this level is candidate (parent - first parent of the level, rank).
      pick_.resize(static_cast<size_t>(end - begin));
      const int64_t first_parent = level_begin < 0 ? -1 : level_begin;
      for (int64_t i = begin; i < end; ++i) {
        pick_[static_cast<size_t>(i - begin)] =
            (parents[static_cast<size_t>(i)] - first_parent) * width + tree_.rank(i);
      }
      const at::Tensor pick = detail::to_device<int64_t>(pick_, {end - begin}, device);
      ids_ = at::cat({ids_, candidates.flatten().index_select(0, pick)});
      if (drawn_valid_.defined())
        valid_.narrow(0, begin, end - begin).copy_(drawn_valid_.flatten().index_select(0, pick));
      level_begin = begin;
      level_end = end;
      if (end >= n) break;
      // The next level's parents: score this level (and the tree above it) with the drafter.
      runner_.truncate(length_);
      const at::Tensor logits =
          drafter_forward(request.sequence, ids_, tree_.parents(end), &uncached);
      fed_ = end;
      level_logits = logits.narrow(0, uncached + begin, end - begin);
    }
    return TreeDrafts{.parents = parents, .calls = calls_, .ids = ids_.to(request.device)};
  }

  template <LogitsProcessor P>
  at::Tensor score_tree(const at::Tensor& logits, int64_t uncached, const P& processor,
                        at::Generator& gen) {
    return score(logits, uncached, processor, gen, detail::ModelTreeRule::exact);
  }

  // score_tree() under a chosen rule (tests).
  template <LogitsProcessor P>
  at::Tensor score(const at::Tensor& logits, int64_t uncached, const P& processor,
                   at::Generator& gen, detail::ModelTreeRule rule) {
    const int64_t n = n_;
    const at::Device device = logits.device();
    const at::Tensor rows = logits.narrow(0, uncached - 1, n + 1);
    const at::Tensor p = processor(rows);
    const int64_t width = layout_.width;
    const at::Tensor child_nodes =
        detail::to_device<int64_t>(layout_.children, {n + 1, std::max<int64_t>(width, 1)}, device)
            .narrow(1, 0, width);
    const at::Tensor ids = ids_.to(device);
    const at::Tensor exists = child_nodes.ge(0);
    const at::Tensor safe = child_nodes.clamp_min(0);
    const at::Tensor child_tokens = n > 0 ? ids.index_select(0, safe.flatten()).view({n + 1, width})
                                          : at::zeros({1, width}, safe.options());
    at::Tensor valid = exists;
    at::Tensor q;
    if (sampling<P>()) {
      valid =
          valid.logical_and(valid_.to(device).index_select(0, safe.flatten()).view({n + 1, width}));
      q = position_q(n, device, p.scalar_type());
    }
    const auto [accept, token] =
        detail::verify_tree_children(p, child_tokens, valid, q, processor, gen, rule);
    std::vector<at::Tensor> parts{accept.to(at::kDouble).flatten(), token.to(at::kDouble),
                                  ids.to(at::kDouble),
                                  at::isfinite(p).all().to(at::kDouble).view({1})};
    parts.push_back(finite_.empty()
                        ? at::ones({1}, p.options().dtype(at::kDouble))
                        : at::stack(finite_).all().to(at::kDouble).view({1}).to(device));
    return at::cat(parts);
  }

  TreeVerdict walk_tree(const double* values) {
    const int64_t n = n_;
    const int64_t width = layout_.width;
    const double* tokens = values + (n + 1) * width;
    const double* ids = tokens + (n + 1);
    if (ids[n] == 0.0) detail::throw_non_finite("generate_with", "target");
    if (ids[n + 1] == 0.0)
      detail::throw_invalid_message("generate_with: the drafter's logits are not finite");
    const auto [position, rejected] = detail::walk_accepted(
        values, width,
        [&](int64_t pos, int64_t j) {
          return layout_.children[static_cast<size_t>(pos * width + j)];
        },
        path_);
    drafts_.clear();
    for (const int64_t node : path_) drafts_.push_back(static_cast<int64_t>(ids[node]));
    if (rejected >= 0) drafts_.push_back(static_cast<int64_t>(ids[rejected]));
    return TreeVerdict{
        .path = path_, .drafts = drafts_, .token = static_cast<int64_t>(tokens[position])};
  }

  // Keeps in the drafter's cache the context and the accepted nodes it scored.
  void verified_tree(std::span<const int64_t> /*sequence*/, int64_t position) {
    kept_.clear();
    for (const int64_t node : path_) {
      if (node >= fed_) break;
      kept_.push_back(node);
    }
    // A step that drafted nothing fed the drafter nothing: it may hold less than `position`.
    if (kept_.empty()) {
      runner_.truncate(position);
    } else {
      runner_.keep_tree(position, kept_);
    }
  }

 private:
  template <class P>
  [[nodiscard]] bool sampling() const {
    return children_ == TreeChildren::sampled && !std::is_same_v<P, GreedyProcessor>;
  }

  at::Tensor drafter_forward(std::span<const int64_t> context, const at::Tensor& ids,
                             std::span<const int64_t> parents, int64_t* uncached) {
    ++calls_;
    const at::Tensor logits = runner_.forward_tree(context, ids, parents, uncached);
    return logits;
  }

  // The children of each row of `logits` [parents, V]: [parents, width] tokens, the top-k or
  // (sampled) drawn without replacement from processor(logits).
  template <LogitsProcessor P>
  at::Tensor children_of(const at::Tensor& logits, int64_t width, bool sampled, const P& processor,
                         at::Generator& gen) {
    // NaN or +inf anywhere, or a row of only -inf, leaves its maximum non-finite.
    finite_.push_back(at::isfinite(logits.amax(-1)).all());
    drawn_valid_ = at::Tensor();
    if (!sampled) return std::get<1>(logits.topk(width, -1));
    const at::Tensor q = processor(logits);
    q_rows_.push_back(q);
    // Gumbel-top-k: the order of log q + Gumbel noise is a draw without replacement.
    const at::Tensor u =
        at::rand(q.sizes(), gen, q.options()).clamp_min(std::numeric_limits<float>::min());
    const at::Tensor keys = q.log() - (-u.log()).log();
    const auto [values, tokens] = keys.topk(width, -1);
    drawn_valid_ = values.isfinite();
    return tokens;
  }

  // q at every position, [n + 1, V]: the drafter's distribution the position's children were
  // drawn from (zeros at leaves).
  at::Tensor position_q(int64_t n, const at::Device& device, at::ScalarType type) {
    std::vector<at::Tensor> rows;
    int64_t have = 0;
    for (const at::Tensor& level : q_rows_) {
      rows.push_back(level.to(device, type));
      have += level.size(0);
    }
    const int64_t vocab = vocab_size();
    if (have < n + 1)
      rows.push_back(
          at::zeros({n + 1 - have, vocab}, at::TensorOptions().dtype(type).device(device)));
    return at::cat(rows).narrow(0, 0, n + 1);
  }

  detail::ModelRunner<D> runner_;
  detail::BreadthFirstTree tree_;
  TreeChildren children_;
  detail::TreeLayout layout_;
  std::vector<int64_t> ranks_, pick_, path_, drafts_, kept_;
  std::vector<at::Tensor> q_rows_, finite_;
  at::Tensor ids_, valid_, drawn_valid_;
  int64_t length_ = 0, n_ = 0, fed_ = 0, calls_ = 0;
};

}  // namespace specdec
