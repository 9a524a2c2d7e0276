// Draft trees: the attention layout of a tree of tokens scored in one forward (tree_attention),
// and the static templates that bound the shape of STAND's draft trees (TreeTemplate).
//
// A tree is given by parent indices: node i hangs below node parents[i] < i, or below the root
// (the last token of the sequence) when parents[i] == -1. Children of one parent are ranked in
// index order; a node's depth is 1 + its parent's depth, with the root's children at depth 1.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <ostream>
#include <queue>
#include <span>
#include <utility>
#include <vector>

#include "specdec/detail/check.hpp"
#include "specdec/detail/torch_compat.hpp"
#include "specdec/device.hpp"

namespace specdec {

namespace detail {

inline void check_parents(std::span<const int64_t> parents) {
  for (size_t i = 0; i < parents.size(); ++i) {
    if (parents[i] < -1 || parents[i] >= static_cast<int64_t>(i)) {
      throw_invalid_message("parents[", i, "] must be in [-1, ", i, "), got ", parents[i]);
    }
  }
}

}  // namespace detail

// What a tree-attention forward needs for T new tokens: depth [T] (int64; 0 for tokens directly
// below the cached positions) and visible [T, T] (bool; visible[i][j] when j is i or one of its
// ancestors), both on the host.
struct TreeAttention {
  at::Tensor depth{};
  at::Tensor visible{};
};

// The tree-attention layout of `parents` (parents[i] in [-1, i)); `count` must equal
// parents.size(). Throws std::invalid_argument naming the first bad entry.
inline TreeAttention tree_attention(std::span<const int64_t> parents, int64_t count) {
  if (static_cast<int64_t>(parents.size()) != count) {
    detail::throw_invalid_message("parents must have one entry per token (", count, "), got ", parents.size());
  }
  detail::check_parents(parents);
  at::Tensor depth = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  at::Tensor visible = at::zeros({count, count}, at::TensorOptions().dtype(at::kBool));
  int64_t* d = depth.data_ptr<int64_t>();
  bool* v = visible.data_ptr<bool>();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t parent = parents[static_cast<size_t>(i)];
    d[i] = parent < 0 ? 0 : d[parent] + 1;
    if (parent >= 0) std::memcpy(v + i * count, v + parent * count, static_cast<size_t>(parent + 1));
    v[i * count + i] = true;
  }
  return {depth, visible};
}

// The tree-attention layout of `parents` on `device`. Off the CPU it is built there: the parent
// indices and depths (host integers, O(count)) go up without blocking, and the visibility of
// each node's ancestors is filled by following parent pointers depth + 1 times, so that no
// [count, count] mask crosses to the device.
inline TreeAttention tree_attention(std::span<const int64_t> parents, int64_t count, const at::Device& device) {
  if (device.is_cpu()) return tree_attention(parents, count);
  if (static_cast<int64_t>(parents.size()) != count) {
    detail::throw_invalid_message("parents must have one entry per token (", count, "), got ", parents.size());
  }
  detail::check_parents(parents);
  std::vector<int64_t> depth(static_cast<size_t>(count));
  std::vector<int64_t> up(static_cast<size_t>(count));  // parent, or the node itself at depth 0
  int64_t deepest = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t parent = parents[static_cast<size_t>(i)];
    depth[static_cast<size_t>(i)] = parent < 0 ? 0 : depth[static_cast<size_t>(parent)] + 1;
    up[static_cast<size_t>(i)] = parent < 0 ? i : parent;
    deepest = std::max(deepest, depth[static_cast<size_t>(i)]);
  }
  const at::Tensor device_depth = detail::to_device<int64_t>(depth, {count}, device);
  const at::Tensor device_up = detail::to_device<int64_t>(up, {count}, device);
  at::Tensor visible = at::zeros({count, count}, at::TensorOptions().dtype(at::kBool).device(device));
  at::Tensor ancestor = at::arange(count, at::TensorOptions().dtype(at::kLong).device(device));
  for (int64_t k = 0; k <= deepest; ++k) {
    visible.scatter_(1, ancestor.view({count, 1}), true);
    ancestor = device_up.index_select(0, ancestor);
  }
  return {device_depth, visible};
}

// The shape bound of a draft tree: every draft tree is a subtree of its template, node i of the
// draft filling node i of the template. Immutable once built.
class TreeTemplate {
 public:
  // Requires: parents non-empty, parents[i] in [-1, i).
  explicit TreeTemplate(std::vector<int64_t> parents) : parents_(std::move(parents)) {
    if (parents_.empty()) throw std::invalid_argument("a tree template needs at least one node");
    detail::check_parents(parents_);
    children_.resize(parents_.size() + 1);
    depth_.resize(parents_.size());
    rank_.resize(parents_.size());
    for (size_t i = 0; i < parents_.size(); ++i) {
      const int64_t parent = parents_[i];
      auto& siblings = children_[static_cast<size_t>(parent + 1)];
      rank_[i] = static_cast<int64_t>(siblings.size());
      siblings.push_back(static_cast<int64_t>(i));
      depth_[i] = parent < 0 ? 1 : depth_[static_cast<size_t>(parent)] + 1;
    }
  }

  // A single path of `depth` nodes: linear drafting.
  static TreeTemplate chain(int64_t depth) {
    if (depth < 1) detail::throw_invalid("depth", "be >= 1", depth);
    std::vector<int64_t> parents(static_cast<size_t>(depth));
    for (int64_t i = 0; i < depth; ++i) parents[static_cast<size_t>(i)] = i - 1;
    return TreeTemplate(std::move(parents));
  }

  // Every node has `branching` children down to `depth`: branching + ... + branching^depth nodes.
  // A large template to learn a compact one from (5 and 4 give 780 nodes).
  static TreeTemplate full(int64_t branching, int64_t depth) {
    if (branching < 1) detail::throw_invalid("branching", "be >= 1", branching);
    if (depth < 1) detail::throw_invalid("depth", "be >= 1", depth);
    std::vector<int64_t> parents;
    std::vector<int64_t> level{-1};
    for (int64_t d = 0; d < depth; ++d) {
      std::vector<int64_t> next;
      for (const int64_t parent : level) {
        for (int64_t b = 0; b < branching; ++b) {
          if (parents.size() >= 100000) throw std::invalid_argument("tree template: more than 100000 nodes");
          next.push_back(static_cast<int64_t>(parents.size()));
          parents.push_back(parent);
        }
      }
      level = std::move(next);
    }
    return TreeTemplate(std::move(parents));
  }

  // The `nodes` nodes of highest path score, where a node's score is the product over its path
  // of rank_acceptance[rank] (the chance that the child of that rank is the accepted one): the
  // best static tree under that model, closed under ancestors, deep along rank 0. Depth is at
  // most max_depth.
  static TreeTemplate best_first(int64_t nodes, std::span<const double> rank_acceptance,
                                 int64_t max_depth = std::numeric_limits<int64_t>::max()) {
    if (nodes < 1) detail::throw_invalid("nodes", "be >= 1", nodes);
    if (max_depth < 1) detail::throw_invalid("max_depth", "be >= 1", max_depth);
    if (rank_acceptance.empty()) throw std::invalid_argument("rank_acceptance must not be empty");
    for (size_t r = 0; r < rank_acceptance.size(); ++r) {
      if (!(rank_acceptance[r] > 0.0 && rank_acceptance[r] <= 1.0)) {
        detail::throw_invalid_message("rank_acceptance[", r, "] must be in (0, 1], got ", rank_acceptance[r]);
      }
    }
    struct Candidate {
      double score{};
      int64_t parent, rank, depth, order;
      bool operator<(const Candidate& other) const {  // max-heap on score, then first pushed
        return score != other.score ? score < other.score : order > other.order;
      }
    };
    std::priority_queue<Candidate> frontier;
    int64_t pushed = 0;
    frontier.push({rank_acceptance[0], -1, 0, 1, pushed++});
    std::vector<int64_t> parents;
    std::vector<double> scores;
    while (static_cast<int64_t>(parents.size()) < nodes && !frontier.empty()) {
      const Candidate c = frontier.top();
      frontier.pop();
      const auto index = static_cast<int64_t>(parents.size());
      parents.push_back(c.parent);
      const double parent_score = c.parent < 0 ? 1.0 : scores[static_cast<size_t>(c.parent)];
      scores.push_back(c.score);
      if (c.rank + 1 < static_cast<int64_t>(rank_acceptance.size())) {  // the next sibling
        frontier.push({parent_score * rank_acceptance[static_cast<size_t>(c.rank + 1)], c.parent, c.rank + 1,
                       c.depth, pushed++});
      }
      if (c.depth < max_depth) frontier.push({c.score * rank_acceptance[0], index, 0, c.depth + 1, pushed++});
    }
    return TreeTemplate(std::move(parents));
  }

  // A static tree given as paths of child ranks from the root, in the format of Medusa's tree
  // choices: {0} is the root's first child, {0, 1} that node's second child. Requires every path
  // non-empty with ranks >= 0, no path twice, every proper prefix of a path also listed, and
  // below each parent the ranks 0 .. c - 1 with no gap (a node of rank r > 0 needs its sibling of
  // rank r - 1). Nodes are numbered breadth-first: by depth, then by path. Throws
  // std::invalid_argument naming the offending paths[i].
  static TreeTemplate from_paths(const std::vector<std::vector<int64_t>>& paths) {
    if (paths.empty()) throw std::invalid_argument("paths must not be empty");
    if (paths.size() > 100000) detail::throw_invalid_message("paths must hold at most 100000 paths, got ", paths.size());
    std::vector<size_t> order(paths.size());
    for (size_t i = 0; i < paths.size(); ++i) {
      order[i] = i;
      if (paths[i].empty()) detail::throw_invalid_message("paths[", i, "] must not be empty");
      for (const int64_t rank : paths[i]) {
        if (rank < 0) detail::throw_invalid_message("paths[", i, "] must hold ranks >= 0, got ", rank);
      }
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return paths[a].size() != paths[b].size() ? paths[a].size() < paths[b].size() : paths[a] < paths[b];
    });
    std::map<std::vector<int64_t>, int64_t> index;  // path -> node
    std::vector<int64_t> parents;
    for (const size_t i : order) {
      const std::vector<int64_t>& path = paths[i];
      if (index.contains(path)) detail::throw_invalid_message("paths[", i, "] is listed twice");
      std::vector<int64_t> prefix(path.begin(), path.end() - 1);
      int64_t parent = -1;
      if (!prefix.empty()) {
        const auto found = index.find(prefix);
        if (found == index.end()) {
          detail::throw_invalid_message("paths[", i, "] needs its prefix listed too (paths must be prefix-closed)");
        }
        parent = found->second;
      }
      if (path.back() > 0) {
        std::vector<int64_t> sibling = path;
        --sibling.back();
        if (!index.contains(sibling)) {
          detail::throw_invalid_message("paths[", i, "] has rank ", path.back(), " but its sibling of rank ",
                                        path.back() - 1, " is not listed (ranks below a parent must run 0, 1, ...)");
        }
      }
      index.emplace(path, static_cast<int64_t>(parents.size()));
      parents.push_back(parent);
    }
    return TreeTemplate(std::move(parents));
  }

  // The default: `nodes` (64) nodes best-first under rank acceptances 0.55, 0.2, 0.1, 0.06, 0.04,
  // 0.03, 0.02, 0.015, 0.01, 0.01, at most max_depth (12) deep.
  static TreeTemplate default_tree(int64_t nodes = 64, int64_t max_depth = 12) {
    static const std::vector<double> kRankAcceptance{0.55, 0.2, 0.1, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01, 0.01};
    return best_first(nodes, kRankAcceptance, max_depth);
  }

  // The `nodes` nodes accepted most often (accepted_counts[i] for node i, e.g. from
  // StandOptions::node_acceptances), closed under ancestors: chosen best-first from the root, so
  // a node enters only after its parent; ties go to the lower index. Nodes keep their relative
  // order. Requires accepted_counts.size() == size() and 1 <= nodes <= size().
  [[nodiscard]] TreeTemplate learned(std::span<const int64_t> accepted_counts, int64_t nodes) const {
    if (accepted_counts.size() != parents_.size()) {
      detail::throw_invalid_message("accepted_counts must have size() = ", parents_.size(), " entries, got ",
                                    accepted_counts.size());
    }
    if (nodes < 1 || nodes > size()) {
      detail::throw_invalid_message("nodes must be in [1, ", size(), "], got ", nodes);
    }
    using Candidate = std::pair<int64_t, int64_t>;  // (count, -index): max-heap on count, then low index
    std::priority_queue<Candidate> frontier;
    for (const int64_t child : children(-1)) frontier.push({accepted_counts[static_cast<size_t>(child)], -child});
    std::vector<int64_t> chosen;
    while (static_cast<int64_t>(chosen.size()) < nodes) {
      const int64_t node = -frontier.top().second;
      frontier.pop();
      chosen.push_back(node);
      for (const int64_t child : children(node)) frontier.push({accepted_counts[static_cast<size_t>(child)], -child});
    }
    std::sort(chosen.begin(), chosen.end());
    std::vector<int64_t> index(parents_.size(), -1);
    std::vector<int64_t> parents;
    for (const int64_t node : chosen) {
      index[static_cast<size_t>(node)] = static_cast<int64_t>(parents.size());
      const int64_t parent = parents_[static_cast<size_t>(node)];
      parents.push_back(parent < 0 ? -1 : index[static_cast<size_t>(parent)]);
    }
    return TreeTemplate(std::move(parents));
  }

  [[nodiscard]] int64_t size() const noexcept { return static_cast<int64_t>(parents_.size()); }
  [[nodiscard]] std::span<const int64_t> parents() const noexcept { return parents_; }
  [[nodiscard]] int64_t parent(int64_t node) const { return parents_.at(static_cast<size_t>(node)); }
  [[nodiscard]] int64_t depth(int64_t node) const { return depth_.at(static_cast<size_t>(node)); }
  [[nodiscard]] int64_t rank(int64_t node) const { return rank_.at(static_cast<size_t>(node)); }
  // The children of `node` in rank order; node -1 is the root.
  [[nodiscard]] std::span<const int64_t> children(int64_t node) const {
    return children_.at(static_cast<size_t>(node + 1));
  }
  [[nodiscard]] int64_t max_depth() const { return *std::max_element(depth_.begin(), depth_.end()); }

  friend std::ostream& operator<<(std::ostream& out, const TreeTemplate& t) {
    return out << "TreeTemplate{nodes=" << t.size() << ", depth=" << t.max_depth()
               << ", root_children=" << t.children(-1).size() << "}";
  }

 private:
  std::vector<int64_t> parents_;
  std::vector<std::vector<int64_t>> children_;  // [node + 1]
  std::vector<int64_t> depth_;
  std::vector<int64_t> rank_;
};

}  // namespace specdec
