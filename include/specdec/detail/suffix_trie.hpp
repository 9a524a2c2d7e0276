// The tree behind suffix decoding (drafting/suffix.hpp): the substrings of texts up to max_depth tokens,
// each counting how often it occurs and how often a token followed it, with its most frequent
// follower (ties: the smallest token id), so a greedy walk reads one node per drafted token.
//
// Substrings seen once are not stored token by token: a node is made for a substring only when
// what it extends (the substring less its last token) was seen at least twice, or when it is one
// token long. A substring seen once is its node (its first tokens' node, seen once) followed by
// the text after that node's one occurrence, which the tree keeps (every text it learned, each
// ended by kSeparator). So new text costs a node or two per token, not one per suffix; a
// repeated span costs one node per suffix it repeats, up to max_depth. When a substring seen once
// is seen again, the node of its earlier occurrence's next token is made from the kept text.
//
// A text is learned token by token through a Path: the nodes of its suffixes by length (the root,
// length 0, first), as far as they are nodes. extend() learns a token after the text. A Position
// walks a text the tree does not hold (the current request against the cache of earlier
// responses): its longest suffix that is a node, and the longest suffix matched past the nodes as
// an offset into the kept text. Every node links to the node of its substring less the first
// token (the nodes' substrings are closed under that: a substring's count is at most its
// suffixes'), so a Position moves along a text with about one look-up a token, and the shorter
// suffixes are read down the links. The edges are one detail::FlatTable keyed by (node, token);
// nodes are never removed (the cache rebuilds).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "specdec/detail/flat_table.hpp"

namespace specdec::detail {

class SuffixTrie {
 public:
  static constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
  static constexpr int64_t kMaxDepth = 1024;
  static constexpr int32_t kSeparator = -1;
  static constexpr int64_t kUnknown = std::numeric_limits<int64_t>::min();  // extend()'s `next` unknown

  struct Node {
    uint32_t count = 0;      // occurrences of the node's substring
    uint32_t continued = 0;  // of those, how many a token followed (the children's counts' sum),
                             // kept from the second occurrence on (a node seen once has no children)
    uint32_t best = kNone;   // the child with the highest count (ties: smallest token); kNone: none
    int32_t token = -1;      // the last token of the substring (-1 at the root)
    uint32_t end = 0;        // offset in text() just past its latest occurrence
    uint32_t sibling = kNone;  // the next child of the same parent, in a circle through them all
                               // (entered at the parent's `best`)
    uint32_t link = 0;         // the node of the substring less its first token (the root for one
                               // token long)
  };
  // The nodes of a text's suffixes, by length: [0] the root, [i] the last i tokens.
  using Path = std::vector<uint32_t>;
  // Where a text stands in this tree: its longest suffix that is a node (depth tokens long, at
  // most max_depth - 1; the root: none), and the longest suffix matched beyond the nodes (a
  // substring seen once: `length` tokens ending just before text()[end]; end kNone: none).
  struct Position {
    uint32_t node = 0;
    int64_t depth = 0;
    uint32_t end = kNone;
    int64_t length = 0;
  };

  // Requires 2 <= max_depth <= kMaxDepth (checked by the callers, which name their option).
  explicit SuffixTrie(int64_t max_depth) : max_depth_(static_cast<uint32_t>(max_depth)) { clear(); }

  [[nodiscard]] int64_t max_depth() const noexcept { return max_depth_; }
  [[nodiscard]] const Node& node(uint32_t id) const noexcept { return nodes_[id]; }
  [[nodiscard]] size_t nodes() const noexcept { return nodes_.size(); }
  [[nodiscard]] std::span<const int32_t> text() const noexcept { return text_; }
  // The bytes the nodes, edges and kept text hold (their arrays' capacity).
  [[nodiscard]] size_t memory_bytes() const noexcept {
    return nodes_.capacity() * sizeof(Node) + edges_.memory_bytes() + text_.capacity() * sizeof(int32_t);
  }
  // The token at `offset` of the kept text, or -1 past a text's end.
  [[nodiscard]] int64_t token_at(uint32_t offset) const noexcept {
    return offset < text_.size() ? text_[offset] : kSeparator;
  }

  // Forgets every text and keeps the arrays' capacity (for a tree refilled to about its old size:
  // the next request's).
  void clear_keeping_capacity() noexcept {
    announced_ = kUnknown;
    nodes_.assign(1, Node{});
    edges_.clear_keeping_capacity();
    text_.clear();
  }
  void clear() {
    announced_ = kUnknown;
    nodes_.assign(1, Node{});
    nodes_.shrink_to_fit();
    edges_ = FlatTable<uint64_t, uint32_t>();
    text_.clear();
    text_.shrink_to_fit();
  }
  // Room for `tokens` more tokens of text, and nodes for about two each, growing at least by
  // doubling (so a cache that learns answer after answer does not copy its arrays every time).
  void reserve_for(size_t tokens) {
    const auto room = [](auto& array, size_t needed) {
      if (needed > array.capacity()) array.reserve(std::max(needed, 2 * array.capacity()));
    };
    room(text_, text_.size() + tokens + 1);
    room(nodes_, nodes_.size() + 2 * tokens);
    if ((edges_.size() + 2 * tokens) * 5 > edges_.capacity() * 4) edges_.reserve(2 * edges_.size() + 2 * tokens);
  }
  // Gives the arrays' spare capacity back (after a rebuild).
  void shrink_to_fit() {
    nodes_.shrink_to_fit();
    text_.shrink_to_fit();
  }

  // Calls visit(id) for each child of `parent` (none for a node seen once: its text goes on).
  template <class Visit>
  void for_each_child(uint32_t parent, Visit visit) const {
    const uint32_t first = nodes_[parent].best;
    if (first == kNone) return;
    uint32_t id = first;
    do {
      visit(id);
      id = nodes_[id].sibling;
    } while (id != first);
  }

  [[nodiscard]] uint32_t child(uint32_t parent, int64_t token) const noexcept {
    const uint32_t* found = edges_.find(key(parent, token));
    return found == nullptr ? kNone : *found;
  }

  // Starts a new text (ending the last one): `path` becomes the root's.
  void begin_text(Path& path) {
    if (!text_.empty() && text_.back() != kSeparator) text_.push_back(kSeparator);
    path.assign(1, 0);
  }
  // Learns `token` after the text whose suffixes are `path` (the last text begun), and moves
  // `path` to text + token. `next`, when known (else kUnknown), is the token the next call will
  // learn: the look-ups it will make are started now, a token ahead of their use.
  void extend(Path& path, int64_t token, int64_t next = kUnknown) {
    const auto at = static_cast<uint32_t>(text_.size());
    text_.push_back(static_cast<int32_t>(token));
    // Grow the edges by doubling, ahead of this token's at most 2 * path.size() new ones: a
    // repeated span adds a node per suffix, and growing by halves would rehash them twice as often.
    if ((edges_.size() + 2 * path.size()) * 5 > edges_.capacity() * 4) {
      edges_.reserve(2 * edges_.size() + 2 * path.size());
      announced_ = kUnknown;
    }
    if (announced_ != token) {
      for (const uint32_t parent : path) edges_.prefetch(key(parent, token));
    }
    announced_ = next;
    if (next != kUnknown) edges_.prefetch(key(0, next));
    scratch_.assign(1, 0);
    for (size_t length = 0; length < path.size(); ++length) {
      const uint32_t parent = path[length];
      if (length > 0 && nodes_[parent].count < 2) break;  // seen once: what follows it is its text
      const uint32_t made = add(parent, token);
      const uint32_t earlier = nodes_[made].end;
      nodes_[made].end = at + 1;
      nodes_[made].link = scratch_[length];  // this token's node one shorter (the root first)
      // Seen a second time: the earlier occurrence's next token becomes a node. (Where that is
      // this very token, the next suffix's step below counts it.) Its one shorter substring is
      // already a node: the link's count is at least two.
      if (nodes_[made].count == 2 && length + 2 <= max_depth_ && earlier < at && text_[earlier] != kSeparator) {
        const uint32_t next_node = add(made, text_[earlier]);
        nodes_[next_node].end = earlier + 1;
        nodes_[next_node].link = child(nodes_[made].link, text_[earlier]);
      }
      if (length + 1 < max_depth_) {
        scratch_.push_back(made);
        if (next != kUnknown) edges_.prefetch(key(made, next));
      }
    }
    path.swap(scratch_);
  }

  // Moves `position` (a text's place in this tree) to that of text + token, learning nothing:
  // from the longest suffix that is a node down the links to the longest that goes on with
  // `token` (a node seen once has no children).
  void follow(Position& position, int64_t token) const {
    uint32_t at = position.node;
    int64_t depth = position.depth;
    while (true) {
      if (depth == 0 || nodes_[at].count >= 2) {
        if (const uint32_t found = child(at, token); found != kNone) {
          at = found;
          ++depth;
          break;
        }
        if (depth == 0) break;
      }
      at = nodes_[at].link;
      --depth;
    }
    if (depth >= static_cast<int64_t>(max_depth_)) {  // a Position keeps max_depth - 1 tokens
      at = nodes_[at].link;
      --depth;
    }
    position.node = at;
    position.depth = depth;
    // The match past the nodes goes on while the kept text does; else the deepest node seen once
    // starts one (its one occurrence is where the text continues).
    if (position.end != kNone && token_at(position.end) == token) {
      ++position.end;
      position.length = std::min<int64_t>(position.length + 1, max_depth_ - 1);
    } else {
      position.end = kNone;
      position.length = 0;
    }
    if (depth > position.length && nodes_[at].count == 1) {
      position.end = nodes_[at].end;
      position.length = depth;
    }
  }
  // The position of a text learned through `path`.
  [[nodiscard]] static Position position_at(const Path& path) noexcept {
    return {.node = path.back(), .depth = static_cast<int64_t>(path.size()) - 1};
  }
  // The position of the last max_depth - 1 tokens of `text`, walked from the root.
  [[nodiscard]] Position position_of(std::span<const int64_t> text) const {
    const size_t keep = std::min(text.size(), static_cast<size_t>(max_depth_ - 1));
    Position position;
    for (const int64_t token : text.last(keep)) follow(position, token);
    return position;
  }

 private:
  static uint64_t key(uint32_t parent, int64_t token) noexcept {  // never 0: parent + 1 >= 1
    return (static_cast<uint64_t>(parent) + 1) << 32 | static_cast<uint32_t>(token);
  }

  uint32_t add(uint32_t parent, int64_t token) {
    auto [slot, inserted] = edges_.insert(key(parent, token));
    if (inserted) {
      const auto id = static_cast<uint32_t>(nodes_.size());
      *slot = id;
      nodes_.push_back(Node{.token = static_cast<int32_t>(token)});
      // Into the circle of the parent's children, after the entry (the best child).
      const uint32_t entry = nodes_[parent].best;
      nodes_[id].sibling = entry == kNone ? id : std::exchange(nodes_[entry].sibling, id);
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
  std::vector<int32_t> text_;
  Path scratch_;
  int64_t announced_ = kUnknown;  // the `next` of the last extend(): its look-ups are under way
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

// Where a draft starts: a node with a follower, or an offset into the kept text (node kNone), and
// the length of the text's suffix it matched (0: none).
struct SuffixAnchor {
  uint32_t node = SuffixTrie::kNone;
  uint32_t end = SuffixTrie::kNone;
  int64_t length = 0;
};

// The longest suffix (at least rule.min_match tokens) of a text standing at `at` that was followed
// before.
inline SuffixAnchor suffix_anchor(const SuffixTrie& trie, const SuffixTrie::Position& at, const SuffixWalkRule& rule) {
  SuffixAnchor found;
  uint32_t id = at.node;
  for (int64_t length = at.depth; length >= rule.min_match; --length, id = trie.node(id).link) {
    const SuffixTrie::Node& n = trie.node(id);
    if (n.best != SuffixTrie::kNone) {
      found = {.node = id, .length = length};
      break;
    }
    if (n.count == 1 && trie.token_at(n.end) != SuffixTrie::kSeparator) {
      found = {.end = n.end, .length = length};
      break;
    }
  }
  if (at.end != SuffixTrie::kNone && at.length > found.length && at.length >= rule.min_match &&
      trie.token_at(at.end) != SuffixTrie::kSeparator) {
    found = {.end = at.end, .length = at.length};
  }
  return found;
}

// The most drafts a match of `match` tokens allows: min(cap, floor(factor * match + offset)).
inline int64_t suffix_draft_limit(const SuffixWalkRule& rule, int64_t match, int64_t cap) {
  const double by_match = std::floor(rule.max_spec_factor * static_cast<double>(match) + rule.max_spec_offset);
  return std::min(cap, by_match < 0.0 ? int64_t{0} : static_cast<int64_t>(std::min(by_match, 1e9)));
}

// Drafts from `trie` after a text standing at `position` in it: anchored on the longest suffix of
// at least rule.min_match tokens that was followed before, then along the most frequent
// followers while the product of their shares stays at least rule.min_token_prob (a substring
// seen once is followed by its one occurrence's text, each token a share of 1), at most
// min(cap, floor(factor * match + offset)) tokens. Where a walk stops short (a node at the tree's
// depth, the end of a kept text), it re-anchors on the longest followed suffix of the text and
// the drafts so far.
inline void walk_suffixes(const SuffixTrie& trie, const SuffixTrie::Position& position, const SuffixWalkRule& rule,
                          int64_t cap, SuffixWalk& out) {
  out.tokens.clear();
  out.score = 0.0;
  out.match = 0;
  const auto anchor = [&](const SuffixTrie::Position& at) { return suffix_anchor(trie, at, rule); };
  SuffixAnchor at = anchor(position);
  if (at.length == 0) return;
  out.match = at.length;
  const int64_t limit = suffix_draft_limit(rule, out.match, cap);
  SuffixTrie::Position walked;  // the position of text + drafts, made only to re-anchor
  size_t walked_to = 0;         // drafts `walked` has followed
  bool walking = false;
  double probability = 1.0;
  while (static_cast<int64_t>(out.tokens.size()) < limit) {
    int64_t token = SuffixTrie::kSeparator;
    if (at.node == SuffixTrie::kNone) {  // in the kept text
      token = trie.token_at(at.end);
      ++at.end;
    } else if (const SuffixTrie::Node& parent = trie.node(at.node); parent.best != SuffixTrie::kNone) {
      const SuffixTrie::Node& next = trie.node(parent.best);
      probability *= static_cast<double>(next.count) / static_cast<double>(parent.continued);
      if (probability < rule.min_token_prob) break;
      token = next.token;
      at.node = parent.best;
      if (next.count == 1) at = {.end = next.end};  // seen once: its text goes on
    } else if (parent.count == 1) {
      at = {.end = parent.end};
      continue;
    }
    if (token == SuffixTrie::kSeparator) {  // stopped short: re-anchor
      if (!walking) walked = position, walking = true;
      for (; walked_to < out.tokens.size(); ++walked_to) trie.follow(walked, out.tokens[walked_to]);
      at = anchor(walked);
      if (at.length == 0) break;
      // The same anchor again would stop at the same place.
      if (at.node != SuffixTrie::kNone && trie.node(at.node).best == SuffixTrie::kNone) break;
      if (at.node == SuffixTrie::kNone && trie.token_at(at.end) == SuffixTrie::kSeparator) break;
      continue;
    }
    out.tokens.push_back(token);
    out.score += probability;
  }
}

// What a tree grown from one trie proposes: node i is tokens[i], below node parents[i] (-1: below
// the text's last token), the ranks[i]-th child of its parent chosen; no node deeper than depth.
// score is the sum of the nodes' estimated path probabilities (the expected number accepted if
// the counts are right); match the length of the suffix the tree was anchored on (0: no tree).
struct SuffixTreeDraft {
  std::vector<int64_t> tokens, parents, ranks;
  int64_t depth = 0;
  double score = 0.0;
  int64_t match = 0;

  [[nodiscard]] int64_t size() const noexcept { return static_cast<int64_t>(tokens.size()); }
};

// Grows a draft tree from `trie` after a text standing at `position` in it, best first: from the
// anchor of walk_suffixes, a node's children are its substring's followers, each with its path's
// probability (the product of the shares of their contexts' followers; a substring seen once is
// followed by its one occurrence's text, a share of 1). The most probable candidate joins next,
// while it is at least rule.min_token_prob, until the tree has min(max_nodes, floor(factor *
// match + offset)) nodes; no node deeper than max_depth. Where a branch stops short (a node at
// the trie's depth, the end of a kept text) it re-anchors as walk_suffixes does. Ties go to the candidate offered first (siblings by count order, then token).
// Deterministic: the same text, trie and rule give the same tree.
class SuffixTreeGrower {
 public:
  // At most `max_reanchors` re-anchored branches per tree (0: a branch that stops short ends;
  // each drafted node re-anchors at most once, so the tree's size bounds them anyway).
  explicit SuffixTreeGrower(int64_t max_reanchors = std::numeric_limits<int64_t>::max())
      : max_reanchors_(max_reanchors) {}

  void grow(const SuffixTrie& trie, const SuffixTrie::Position& position, const SuffixWalkRule& rule,
            int64_t max_nodes, int64_t max_depth, SuffixTreeDraft& out) {
    out.tokens.clear();
    out.parents.clear();
    out.ranks.clear();
    out.depth = 0;
    out.score = 0.0;
    out.match = 0;
    heap_.clear();
    children_.clear();
    offered_ = 0;
    reanchors_ = 0;
    root_children_ = 0;
    walked_node_ = -1;
    walked_set_ = false;
    const SuffixAnchor anchor = suffix_anchor(trie, position, rule);
    if (anchor.length == 0 || max_depth < 1) return;
    out.match = anchor.length;
    const int64_t limit = suffix_draft_limit(rule, out.match, max_nodes);
    offer(trie, rule, {.node = anchor.node, .end = anchor.end}, 1.0, -1, 0);
    while (out.size() < limit && !heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end());
      const Candidate c = heap_.back();
      heap_.pop_back();
      const auto index = out.size();
      out.tokens.push_back(c.token);
      out.parents.push_back(c.parent);
      out.ranks.push_back(c.parent < 0 ? root_children_++ : children_[static_cast<size_t>(c.parent)]++);
      children_.push_back(0);
      out.depth = std::max(out.depth, c.depth);
      out.score += c.probability;
      if (c.depth < max_depth) offer(trie, rule, c.cursor, c.probability, index, c.depth, &position, &out);
    }
  }

 private:
  struct Cursor {  // where a drafted token stands: a node, or an offset into the kept text
    uint32_t node = SuffixTrie::kNone;
    uint32_t end = SuffixTrie::kNone;
  };
  struct Candidate {
    double probability = 0.0;
    int64_t order = 0;  // offered order: earlier wins a tie
    int64_t token = 0;
    int64_t parent = -1;
    int64_t depth = 0;
    Cursor cursor;
    bool operator<(const Candidate& other) const {  // a max-heap: most probable, then first offered
      return probability != other.probability ? probability < other.probability : order > other.order;
    }
  };
  // Offers the followers of a drafted token (node `parent`, -1: the anchor) at `cursor`.
  void offer(const SuffixTrie& trie, const SuffixWalkRule& rule, Cursor cursor, double probability, int64_t parent,
             int64_t depth, const SuffixTrie::Position* position = nullptr, const SuffixTreeDraft* out = nullptr) {
    const auto push = [&](double p, int64_t token, Cursor next) {
      if (p < rule.min_token_prob) return;
      heap_.push_back({.probability = p, .order = offered_++, .token = token, .parent = parent, .depth = depth + 1,
                       .cursor = next});
      std::push_heap(heap_.begin(), heap_.end());
    };
    if (cursor.node != SuffixTrie::kNone) {
      const SuffixTrie::Node& n = trie.node(cursor.node);
      if (n.best != SuffixTrie::kNone) {
        // Only children whose probability passes the rule are offered. The others than the best
        // share what the best leaves: where that cannot pass, none of them can, and a context
        // with many followers is not listed at all.
        const auto chance = [&](uint32_t count) {
          return probability * static_cast<double>(count) / static_cast<double>(n.continued);
        };
        siblings_.clear();
        if (chance(n.continued - trie.node(n.best).count) >= rule.min_token_prob) {
          trie.for_each_child(cursor.node, [&](uint32_t id) {
            if (chance(trie.node(id).count) >= rule.min_token_prob) siblings_.push_back(id);
          });
        } else {
          siblings_.push_back(n.best);
        }
        // The circle lists them in no order: by count, then token.
        std::sort(siblings_.begin(), siblings_.end(), [&](uint32_t a, uint32_t b) {
          const SuffixTrie::Node& x = trie.node(a);
          const SuffixTrie::Node& y = trie.node(b);
          return x.count != y.count ? x.count > y.count : x.token < y.token;
        });
        for (const uint32_t id : siblings_) {
          const SuffixTrie::Node& c = trie.node(id);
          const Cursor next = c.count == 1 ? Cursor{.end = c.end} : Cursor{.node = id};
          push(chance(c.count), c.token, next);
        }
        return;
      }
      if (n.count == 1) cursor = {.end = n.end};  // seen once: its text goes on
    }
    if (cursor.node == SuffixTrie::kNone && cursor.end != SuffixTrie::kNone) {
      const int64_t token = trie.token_at(cursor.end);
      if (token != SuffixTrie::kSeparator) {
        push(probability, token, {.end = cursor.end + 1});
        return;
      }
    }
    // Stopped short: re-anchor on the text and this branch's drafts.
    if (position == nullptr || out == nullptr || parent < 0 || reanchors_ >= max_reanchors_) return;
    ++reanchors_;
    // The position of the text and this branch: followed on from the last re-anchored node when
    // that is an ancestor (a long repeat re-anchors node after node along one branch), else from
    // the text's.
    branch_.clear();
    int64_t from = parent;
    for (; from >= 0 && from != walked_node_; from = out->parents[static_cast<size_t>(from)]) {
      branch_.push_back(out->tokens[static_cast<size_t>(from)]);
    }
    if (from != walked_node_ || !walked_set_) {  // not below the last one: branch_ is the whole branch
      walked_ = *position;
      walked_set_ = true;
    }
    for (auto token = branch_.rbegin(); token != branch_.rend(); ++token) trie.follow(walked_, *token);
    walked_node_ = parent;
    const SuffixAnchor again = suffix_anchor(trie, walked_, rule);
    if (again.length == 0) return;
    const Cursor next{.node = again.node, .end = again.end};
    // The same place again would stop at once.
    if (next.node != SuffixTrie::kNone && trie.node(next.node).best == SuffixTrie::kNone) return;
    if (next.node == SuffixTrie::kNone && trie.token_at(next.end) == SuffixTrie::kSeparator) return;
    offer(trie, rule, next, probability, parent, depth);
  }

  std::vector<Candidate> heap_;
  std::vector<int64_t> children_;  // per drafted node: children chosen so far
  std::vector<uint32_t> siblings_;
  std::vector<int64_t> branch_;
  SuffixTrie::Position walked_;  // of the text and the branch down to walked_node_ (-1: the text)
  int64_t walked_node_ = -1;
  bool walked_set_ = false;
  int64_t max_reanchors_;
  int64_t root_children_ = 0, offered_ = 0, reanchors_ = 0;
};

}  // namespace specdec::detail
