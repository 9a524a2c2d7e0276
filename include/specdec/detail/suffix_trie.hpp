// The tree behind suffix decoding (suffix.hpp): every substring of a text up to max_depth tokens,
// as paths from a root, each node counting how often its substring occurs and how often it
// was followed by another token, and keeping its most frequent follower (ties: the smallest
// token id), so a greedy walk reads one node per drafted token.
//
// A text is read token by token through a Path: the nodes of its suffixes by length (the root,
// length 0, first), at most max_depth - 1 long. extend() learns a token after the text (one
// node per suffix, one hash look-up each); follow() only walks, for a text the tree does not
// hold (the current request against the cache of earlier responses). The edges are one
// detail::FlatTable keyed by (node, token); nodes are never removed (the cache rebuilds).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "specdec/detail/flat_table.hpp"

namespace specdec::detail {

class SuffixTrie {
 public:
  static constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  static constexpr int64_t kMaxDepth = 1024;

  struct Node {
    uint32_t count = 0;      // occurrences of the node's substring
    uint32_t continued = 0;  // of those, how many a token followed (the children's counts' sum)
    uint32_t best = kNone;   // the child with the highest count (ties: smallest token); kNone: leaf
    int32_t token = -1;      // the last token of the substring (-1 at the root)
    uint32_t depth = 0;      // the substring's length
  };
  // The nodes of a text's suffixes, by length: [0] the root, [i] the last i tokens.
  using Path = std::vector<uint32_t>;

  // Requires 2 <= max_depth <= kMaxDepth (checked by the callers, which name their option).
  explicit SuffixTrie(int64_t max_depth) : max_depth_(static_cast<uint32_t>(max_depth)) { clear(); }

  [[nodiscard]] int64_t max_depth() const noexcept { return max_depth_; }
  [[nodiscard]] const Node& node(uint32_t id) const noexcept { return nodes_[id]; }
  [[nodiscard]] size_t nodes() const noexcept { return nodes_.size(); }
  // The bytes the nodes and edges hold (their arrays' capacity).
  [[nodiscard]] size_t memory_bytes() const noexcept {
    return nodes_.capacity() * sizeof(Node) + edges_.memory_bytes();
  }
  [[nodiscard]] static Path root_path() { return Path{0}; }

  void clear() {
    nodes_.assign(1, Node{});
    nodes_.shrink_to_fit();
    edges_ = FlatTable<uint64_t, uint32_t>();
  }
  // Gives the node array's spare capacity back (after a rebuild).
  void shrink_to_fit() { nodes_.shrink_to_fit(); }

  [[nodiscard]] uint32_t child(uint32_t parent, int64_t token) const noexcept {
    const uint32_t* found = edges_.find(key(parent, token));
    return found == nullptr ? kNone : *found;
  }

  // Learns `token` after the text whose suffixes are `path`, and moves `path` to text + token.
  void extend(Path& path, int64_t token) {
    scratch_.assign(1, 0);
    for (const uint32_t parent : path) {
      const uint32_t made = add(parent, token);
      if (nodes_[made].depth < max_depth_) scratch_.push_back(made);
    }
    path.swap(scratch_);
  }
  // Moves `path` (this tree's nodes of a text's suffixes) to those of text + token, learning
  // nothing: the suffixes of text + token that this tree holds.
  void follow(Path& path, int64_t token) const {
    Path next{0};
    for (const uint32_t parent : path) {
      const uint32_t found = child(parent, token);
      if (found == kNone) break;  // a longer suffix is absent when a shorter one is
      if (nodes_[found].depth < max_depth_) next.push_back(found);
    }
    path.swap(next);
  }
  // The path of the last max_depth - 1 tokens of `text`, walked from the root.
  [[nodiscard]] Path path_of(std::span<const int64_t> text) const {
    const size_t keep = std::min(text.size(), static_cast<size_t>(max_depth_ - 1));
    Path path = root_path();
    for (const int64_t token : text.last(keep)) follow(path, token);
    return path;
  }

 private:
  static uint64_t key(uint32_t parent, int64_t token) noexcept {  // never 0: parent + 1 >= 1
    return (static_cast<uint64_t>(parent) + 1) << 32 | static_cast<uint32_t>(token);
  }

  uint32_t add(uint32_t parent, int64_t token) {
    auto [slot, inserted] = edges_.insert(key(parent, token));
    if (inserted) {
      *slot = static_cast<uint32_t>(nodes_.size());
      nodes_.push_back(Node{.token = static_cast<int32_t>(token), .depth = nodes_[parent].depth + 1});
    }
    const uint32_t made = *slot;
    Node& child_node = nodes_[made];
    ++child_node.count;
    Node& up = nodes_[parent];
    ++up.continued;
    if (up.best == kNone || up.best == made) {
      up.best = made;
    } else {
      const Node& leader = nodes_[up.best];
      if (child_node.count > leader.count || (child_node.count == leader.count && child_node.token < leader.token)) {
        up.best = made;
      }
    }
    return made;
  }

  uint32_t max_depth_;
  std::vector<Node> nodes_;
  FlatTable<uint64_t, uint32_t> edges_;
  Path scratch_;
};

// What a walk of one tree proposes: the tokens, and their score (the sum over drafted tokens of
// the path's estimated probability, i.e. the expected number accepted if the counts are right).
struct SuffixWalk {
  std::vector<int64_t> tokens;
  double score = 0.0;
  int64_t match = 0;  // length of the suffix the draft was anchored on (0: no draft)
};

// The rule of a walk (SuffixDraftRule's fields, validated there).
struct SuffixWalkRule {
  double max_spec_factor = 1.0;
  double max_spec_offset = 0.0;
  double min_token_prob = 0.1;
  int64_t min_match = 1;
};

// Drafts from `trie` after a text whose suffixes in it are `path`: anchored on the longest suffix
// of at least rule.min_match tokens that was followed before, then greedy along the most
// frequent followers while the product of their shares stays at least rule.min_token_prob, at
// most min(cap, floor(factor * match + offset)) tokens. Where the walk reaches a node that was
// never followed (a leaf, or the tree's depth), it re-anchors on the longest followed suffix of
// the text and the drafts so far.
inline void walk_suffixes(const SuffixTrie& trie, const SuffixTrie::Path& path, const SuffixWalkRule& rule,
                          int64_t cap, SuffixWalk& out) {
  out.tokens.clear();
  out.score = 0.0;
  out.match = 0;
  const auto anchor = [&](const SuffixTrie::Path& suffixes) -> uint32_t {
    for (auto length = static_cast<int64_t>(suffixes.size()) - 1; length >= rule.min_match; --length) {
      if (trie.node(suffixes[static_cast<size_t>(length)]).best != SuffixTrie::kNone) {
        return suffixes[static_cast<size_t>(length)];
      }
    }
    return SuffixTrie::kNone;
  };
  uint32_t at = anchor(path);
  if (at == SuffixTrie::kNone) return;
  out.match = trie.node(at).depth;
  const double by_match = std::floor(rule.max_spec_factor * static_cast<double>(out.match) + rule.max_spec_offset);
  const int64_t limit = std::min(cap, by_match < 0.0 ? int64_t{0} : static_cast<int64_t>(std::min(by_match, 1e9)));
  SuffixTrie::Path walked;  // the path of text + drafts, made only to re-anchor
  size_t walked_to = 0;     // drafts `walked` has followed
  double probability = 1.0;
  while (static_cast<int64_t>(out.tokens.size()) < limit) {
    if (trie.node(at).best == SuffixTrie::kNone) {
      if (walked_to == 0) walked = path;
      for (; walked_to < out.tokens.size(); ++walked_to) trie.follow(walked, out.tokens[walked_to]);
      at = anchor(walked);
      if (at == SuffixTrie::kNone) break;
    }
    const SuffixTrie::Node& parent = trie.node(at);
    const SuffixTrie::Node& next = trie.node(parent.best);
    probability *= static_cast<double>(next.count) / static_cast<double>(parent.continued);
    if (probability < rule.min_token_prob) break;
    out.tokens.push_back(next.token);
    out.score += probability;
    at = parent.best;
  }
}

}  // namespace specdec::detail
