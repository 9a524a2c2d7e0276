// The verification of a draft tree, whatever drafted it: the tree layouts (BreadthFirstTree,
// TreeLayout), the exact rules over siblings, and TreeVerifier, which scores a step's tree on the
// device and walks the step's one host copy. Every tree source of the drafting room verifies
// through it (static trees from a drafter model, dynamic trees, the EAGLE and Medusa heads' trees,
// suffix trees) by deriving from VerifiesTree; STAND walks its trees on the host with the
// drafter's statistics (drafting/stand.hpp) and implements TreeDraftSource's score_tree and
// walk_tree itself.
//
// At a position with target distribution r = p, the children x_1, x_2, ... are tried in order
// (Jeon et al. 2024, arXiv 2402.14160; SpecTr, Sun et al. 2023):
//   deterministic children (a drafter's top-k, a head's ranks, a suffix tree's followers):
//                  accept x_j with probability r(x_j), else r <- normalise(r with x_j zeroed)
//                  (q one-hot at x_j);
//   sampled children (drawn from the drafter's q without replacement):
//                  accept x_j with probability min(1, r(x_j) / q_j(x_j)), else
//                  r <- normalise(max(r - q_j, 0)), where q_j is q without x_1 .. x_{j-1},
//                  renormalised (the distribution x_j was drawn from).
// With no child accepted, the token is drawn from r. (The deterministic rule is exact for sampled
// children too, only it accepts less; mixing the two, the sampled acceptance with the
// deterministic residual, is not.) Either way the output is distributed exactly as the target's;
// under greedy decoding it is the target's argmax path (the first maximal token id on ties, as
// at::argmax), token for token autoregressive decoding.
//
// The tree's tokens and layout stay on the device: the acceptance of every child and a residual
// token for every position are computed there, and the step's one device-to-host copy brings them
// back with the tokens and the layout; the host walks the tree.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/step.hpp"
#include "specdec/tree.hpp"
#include "specdec/verification.hpp"

namespace specdec::detail {

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
//
// Deterministic children are verified in closed form, in a fixed handful of operations over the
// whole tree: a position's children are distinct tokens, so once x_1 .. x_{j-1} are rejected, r is
// p without them and x_j is accepted with probability p(x_j) / (1 - p(x_1) - ... - p(x_{j-1})),
// and the residual after all of them is p without every child. (The loop over siblings below,
// which sampled children need, computes the same in a dozen operations per sibling.)
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
  if (!sampled && width > 0) {
    const at::Tensor total = p.sum(1, /*keepdim=*/true);
    const at::Tensor px = p.gather(1, child_tokens) * valid;  // 0 where no child
    // The mass left before each child: all of it when a rejection leaves r as it was.
    const at::Tensor left = rule == ModelTreeRule::no_residual ? total : total - (px.cumsum(1) - px);
    const at::Tensor accept = uniform.lt(px / left.clamp_min(1e-30)).logical_and(valid);
    at::Tensor r = p;
    if (rule != ModelTreeRule::no_residual) {
      // Each valid child's probability taken away exactly (distinct tokens, so once each). A
      // position whose children held all of r accepts one of them surely; it keeps p.
      const at::Tensor rest = p - at::zeros_like(p).scatter_add(1, child_tokens, px);
      r = at::where(rest.sum(1, /*keepdim=*/true) > 0, rest, p);
    }
    const at::Tensor token =
        processor.sample(r / r.sum(1, /*keepdim=*/true).clamp_min(1e-30), gen).view({positions});
    return {accept, token};
  }
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

// One step's draft tree as the target verifies it: node i is token ids[i] (int64 [n], on the
// device), children[pos][j] the node of rank j below position pos (int64 [n + 1, width], -1:
// none; position 0 is the root, the sequence's last token, and position i + 1 is node i). For
// sampled children also which nodes may be drawn and q at every position (the drafter's
// distribution the position's children were drawn from). score() and walk() are
// TreeDraftSource's score_tree and walk_tree.
class TreeVerifier {
 public:
  [[nodiscard]] const at::Tensor& ids() const noexcept { return ids_; }
  [[nodiscard]] std::span<const int64_t> path() const noexcept { return path_; }

  // Forgets the previous step's tree: what check_finite() recorded, sampled children.
  void start() {
    drawable_ = at::Tensor();
    q_ = at::Tensor();
    finite_.clear();
  }
  // The step's tree (after start()), its children deterministic unless set_sampled() follows.
  void set(const at::Tensor& ids, const at::Tensor& children) {
    ids_ = ids;
    children_ = children;
    n_ = ids.numel();
    width_ = children.size(1);
  }
  // After set(): the children were drawn from q ([n + 1, V], by position) without replacement,
  // and node i may be drawn where drawable[i] (bool [n]).
  void set_sampled(const at::Tensor& drawable, const at::Tensor& q) {
    drawable_ = drawable;
    q_ = q;
  }
  // The drafter logits [r, V] that chose this step's tokens must be finite (NaN or +inf anywhere,
  // or a row of only -inf, leaves its maximum non-finite); checked at walk().
  void check_finite(const at::Tensor& logits) { record_finite(at::isfinite(logits.amax(-1)).all()); }
  // Records a bool scalar saying whether the drafter's logits were finite, checked at walk().
  void record_finite(const at::Tensor& finite) { finite_.push_back(finite); }

  // The children's acceptance under `rule`, a residual token per position, the tree's tokens
  // and layout and the finiteness of both models, as one float64 tensor for the step's copy.
  // logits: the target's [uncached + n, V].
  template <LogitsProcessor P>
  at::Tensor score(const at::Tensor& logits, int64_t uncached, const P& processor,
                   at::Generator& gen, ModelTreeRule rule) const {
    if constexpr (std::is_same_v<P, GreedyProcessor>) return score_greedy(logits, uncached);
    const at::Device device = logits.device();
    const at::Tensor p = processor(logits.narrow(0, uncached - 1, n_ + 1));
    const DeviceTree tree = on_device(device);
    const at::Tensor q = q_.defined() ? q_.to(device, p.scalar_type()) : at::Tensor();
    const auto [accept, token] = verify_tree_children(p, tree.child_tokens, tree.valid, q, processor, gen, rule);
    return scores(tree, accept, token, at::isfinite(p).all());
  }

  // score() for GreedyProcessor, the same values without a distribution: p is one-hot at each
  // position's argmax (the first among ties), so under every rule a child is accepted exactly
  // where it may be drawn and is that argmax, and the residual's token is the argmax (a
  // position's children are distinct, or, drawn with replacement, the first copy is walked). No
  // uniform is drawn. Logits the host reads where they lie (fp32 on the CPU, the tree on the
  // CPU) are decoded in one pass over each row, as verify_greedy_on_host does for chains;
  // elsewhere by a few operations on the logits' device.
  at::Tensor score_greedy(const at::Tensor& logits, int64_t uncached) const {
    check_logits(logits);
    const int64_t n = n_, width = width_;
    const at::Tensor rows = logits.narrow(0, uncached - 1, n + 1);
    const bool on_host = host_readable(rows) && ids_.device().is_cpu() && children_.device().is_cpu() &&
                         (!drawable_.defined() || drawable_.device().is_cpu()) &&
                         std::ranges::all_of(finite_, [](const at::Tensor& f) {
                           return f.device().is_cpu() && f.scalar_type() == at::kBool;
                         });
    if (!on_host) {
      const DeviceTree tree = on_device(logits.device());
      const at::Tensor top = rows.argmax(1);  // [n + 1]
      return scores(tree, tree.child_tokens.eq(top.unsqueeze(1)).logical_and(tree.valid), top,
                    at::isfinite(rows.amax(1)).all());
    }
    at::Tensor out = at::empty({(n + 1) * width * 2 + (n + 1) + n + 2}, at::TensorOptions().dtype(at::kDouble));
    double* const accept = out.data_ptr<double>();
    double* const tokens = accept + (n + 1) * width;
    double* const ids = tokens + (n + 1);
    double* const children = ids + n;
    double* const finite = children + (n + 1) * width;
    const at::Tensor id_values = ids_.to(at::kLong).contiguous();
    const at::Tensor child_values = children_.to(at::kLong).contiguous();
    const at::Tensor drawable = drawable_.defined() ? drawable_.to(at::kBool).contiguous() : at::Tensor();
    const int64_t* const node_ids = id_values.data_ptr<int64_t>();
    const int64_t* const below = child_values.data_ptr<int64_t>();
    const bool* const may_draw = drawable.defined() ? drawable.data_ptr<bool>() : nullptr;
    bool target_finite = true;
    for (int64_t pos = 0; pos <= n; ++pos) {
      const RowMax best = row_max(rows.data_ptr<float>() + pos * rows.stride(0), rows.size(1), rows.stride(1));
      target_finite = target_finite && best.finite;
      tokens[pos] = static_cast<double>(best.index);
      for (int64_t j = 0; j < width; ++j) {
        const int64_t node = below[pos * width + j];
        const bool drawn = node >= 0 && (may_draw == nullptr || may_draw[node]);
        accept[pos * width + j] = drawn && node_ids[node] == best.index ? 1.0 : 0.0;
        children[pos * width + j] = static_cast<double>(node);
      }
    }
    for (int64_t i = 0; i < n; ++i) ids[i] = static_cast<double>(node_ids[i]);
    finite[0] = target_finite ? 1.0 : 0.0;
    // Each recorded finiteness is a bool scalar on the host here: read where it lies.
    finite[1] = std::ranges::all_of(finite_, [](const at::Tensor& f) { return *f.data_ptr<bool>(); }) ? 1.0 : 0.0;
    return out;
  }

  // The tree on `device`: children [n + 1, width], the nodes' ids [n], each child's token (0
  // where none) and whether it exists and, for sampled children, may be drawn.
  struct DeviceTree {
    at::Tensor children, ids, child_tokens, valid;
  };
  [[nodiscard]] DeviceTree on_device(const at::Device& device) const {
    const at::Tensor children = children_.to(device), ids = ids_.to(device);
    const at::Tensor flat = children.clamp_min(0).flatten();
    const at::IntArrayRef sizes = children.sizes();
    at::Tensor valid = children.ge(0);
    if (drawable_.defined() && n_ > 0) valid = valid.logical_and(drawable_.to(device).index_select(0, flat).view(sizes));
    return DeviceTree{.children = children,
                      .ids = ids,
                      .child_tokens = n_ > 0 ? ids.index_select(0, flat).view(sizes) : at::zeros_like(children),
                      .valid = valid};
  }

  // score()'s values as one float64 tensor for the step's copy (walk() reads them): each child's
  // acceptance [n + 1, width], each position's residual token [n + 1], the tree's ids and
  // children, whether the target's and the drafter's logits were finite.
  [[nodiscard]] at::Tensor scores(const DeviceTree& tree, const at::Tensor& accept, const at::Tensor& token,
                                  const at::Tensor& target_finite) const {
    const at::Device device = tree.children.device();
    const at::Tensor drafter_finite =
        finite_.empty() ? at::ones({1}, at::TensorOptions().dtype(at::kBool).device(device))
                        : at::stack(finite_).all().view({1}).to(device);
    return at::cat({accept.to(at::kDouble).flatten(), token.to(at::kDouble), tree.ids.to(at::kDouble),
                    tree.children.to(at::kDouble).flatten(), target_finite.to(at::kDouble).view({1}),
                    drafter_finite.to(at::kDouble)});
  }

  // Walks score()'s host copy from the root along the first accepted child of every position.
  // Throws std::invalid_argument when the target's or the drafter's logits were not finite.
  TreeVerdict walk(const double* values) {
    const int64_t n = n_;
    const int64_t width = width_;
    const double* tokens = values + (n + 1) * width;
    const double* ids = tokens + (n + 1);
    const double* children = ids + n;
    const double* finite = children + (n + 1) * width;
    if (finite[0] == 0.0) throw_non_finite("generate_with", "target");
    if (finite[1] == 0.0)
      throw_invalid_message("generate_with: the drafter's logits are not finite");
    const auto [position, rejected] = walk_accepted(
        values, width,
        [&](int64_t pos, int64_t j) { return static_cast<int64_t>(children[pos * width + j]); },
        path_);
    drafts_.clear();
    for (const int64_t node : path_) drafts_.push_back(static_cast<int64_t>(ids[node]));
    if (rejected >= 0) drafts_.push_back(static_cast<int64_t>(ids[rejected]));
    return TreeVerdict{
        .path = path_, .drafts = drafts_, .token = static_cast<int64_t>(tokens[position])};
  }

 private:
  int64_t n_ = 0, width_ = 1;
  at::Tensor ids_, children_, drawable_, q_;
  std::vector<at::Tensor> finite_;
  std::vector<int64_t> path_, drafts_;
};

// The verification half of a TreeDraftSource whose step tree is a TreeVerifier (or a type
// derived from it, such as the dynamic trees' DeviceDraftTree): score_tree under the exact rule,
// walk_tree of its copy. A source derives from it and fills tree_ in draft_tree.
template <class Tree = TreeVerifier>
class VerifiesTree {
 public:
  template <LogitsProcessor P>
  at::Tensor score_tree(const at::Tensor& logits, int64_t uncached, const P& processor,
                        at::Generator& gen) {
    return tree_.score(logits, uncached, processor, gen, ModelTreeRule::exact);
  }
  // score_tree() under a chosen rule (tests).
  template <LogitsProcessor P>
  at::Tensor score(const at::Tensor& logits, int64_t uncached, const P& processor,
                   at::Generator& gen, ModelTreeRule rule) {
    return tree_.score(logits, uncached, processor, gen, rule);
  }
  TreeVerdict walk_tree(const double* values) { return tree_.walk(values); }

 protected:
  Tree tree_;
};

}  // namespace specdec::detail
