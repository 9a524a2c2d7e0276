// Byte-pair merging and byte-fallback pieces, shared by the llama2.c tokenizer (merges by
// vocabulary score) and the Hugging Face tokenizer.json reader (merges by rank). Plain C++.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <queue>
#include <string_view>
#include <vector>

namespace specdec::io::detail {

// The byte of a "<0xXX>" piece (upper-case hex digits, as SentencePiece writes them).
inline std::optional<int> byte_of(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return std::nullopt;
  int value = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = piece[i];
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (digit < 0) return std::nullopt;
    value = value * 16 + digit;
  }
  return value;
}

// What merging an adjacent pair gives: the merged token, and the pair's priority (the highest
// merges first).
struct PairMerge {
  double priority{};
  int64_t merged{};
};

// Merges tokens[first..] in place: repeatedly the adjacent pair of highest priority, the leftmost
// on ties, while `lookup(left, right)` (-> std::optional<PairMerge>) knows a merge. A max-heap of
// candidate pairs over a linked list makes it O(n log n); a popped pair whose symbols have changed
// since it was pushed is stale and skipped.
template <class Lookup>
void merge_pairs(std::vector<int64_t>& tokens, size_t first, Lookup&& lookup) {
  const size_t n = tokens.size();
  if (n < first + 2) return;
  std::vector<size_t> next(n), previous(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) next[i] = i + 1, previous[i] = i == 0 ? n : i - 1;
  struct Candidate {
    double priority{};
    size_t left, right;
    int64_t left_token, right_token, merged;
    bool operator<(const Candidate& other) const {  // the heap's top: highest priority, then leftmost
      return priority != other.priority ? priority < other.priority : left > other.left;
    }
  };
  std::priority_queue<Candidate> heap;
  const auto consider = [&](size_t left, size_t right) {
    if (left < first || left >= n || right >= n) return;
    if (const std::optional<PairMerge> m = lookup(tokens[left], tokens[right])) {
      heap.push({m->priority, left, right, tokens[left], tokens[right], m->merged});
    }
  };
  for (size_t i = first; i + 1 < n; ++i) consider(i, i + 1);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (!alive[c.left] || !alive[c.right] || next[c.left] != c.right || tokens[c.left] != c.left_token ||
        tokens[c.right] != c.right_token) {
      continue;  // stale
    }
    tokens[c.left] = c.merged;
    alive[c.right] = false;
    next[c.left] = next[c.right];
    if (next[c.right] < n) previous[next[c.right]] = c.left;
    consider(previous[c.left], c.left);
    consider(c.left, next[c.left]);
  }
  size_t kept = first;
  for (size_t i = first; i < n; ++i) {
    if (alive[i]) tokens[kept++] = tokens[i];
  }
  tokens.resize(kept);
}

}  // namespace specdec::io::detail
