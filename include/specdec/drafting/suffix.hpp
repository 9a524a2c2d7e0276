// Suffix decoding (Oliaro et al., "SuffixDecoding", 2024): model-free drafting for agentic and
// repetitive workloads, where outputs repeat long spans of the prompt, of earlier turns and of
// earlier requests' responses.
//
// Two trees of substrings with counts (detail/suffix_trie.hpp): one per request, over its prompt
// and everything generated since, learned as tokens are accepted; and a SuffixCache of earlier
// requests' responses, shared by the requests of a server, bounded in bytes and responses
// (oldest evicted first), saved and loaded as the n-gram storages are (atomic, checksummed
// files). Each step drafts from both, anchored on the longest suffix of the text that was
// followed before, along the most frequent followers while the path's estimated probability
// stays above SuffixDraftRule::min_token_prob, and at most max_spec_factor times the match's
// length: a long match drafts far, a short one little. The tree whose draft scores higher (the
// sum of the path's probabilities) wins. Drafts are deterministic, so the step's verification
// keeps the output exactly the target's, under greedy decoding and sampling alike.
//
// Here: SuffixDraftRule, SuffixCacheLimits, SuffixCache, SuffixDraftSource (chains, for
// generate_with, sessions and batches), SuffixTreeSource (trees, for generate_with and sessions),
// SuffixDecodingOptions and suffix_generate.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <stdexcept>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/detail/check.hpp"
#include "specdec/detail/suffix_trie.hpp"
#include "specdec/draft_source.hpp"
#include "specdec/drafting/dynamic_tree.hpp"
#include "specdec/io/atomic_file.hpp"
#include "specdec/io/binary_reader.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/logits_processor.hpp"
#include "specdec/options.hpp"
#include "specdec/result.hpp"
#include "specdec/step.hpp"

namespace specdec {

// How a suffix draft is anchored, how far it goes and where it stops.
struct SuffixDraftRule {
  int64_t max_depth = 32;         // longest substring the request's tree keeps and matches, in
                                  // tokens (in [2, 1024]); the cache has its own (SuffixCacheLimits)
  double max_spec_factor = 1.0;   // a draft is at most floor(factor * match + offset) tokens,
                                  // match the length of the suffix it was anchored on (>= 0)
  double max_spec_offset = 0.0;   // (finite; negative: no draft from matches shorter than
                                  // -offset / factor)
  double min_token_prob = 0.1;    // drafting stops where the product of the drafted tokens'
                                  // shares of their contexts' followers falls below this, in
                                  // [0, 1] (0: off)
  int64_t min_match = 1;          // shortest suffix of the text a draft is anchored on (>= 1)

  void validate() const {
    if (max_depth < 2 || max_depth > detail::SuffixTrie::kMaxDepth) {
      detail::throw_invalid("suffix.max_depth", "be in [2, 1024]", max_depth);
    }
    if (!(max_spec_factor >= 0.0) || !std::isfinite(max_spec_factor)) {
      detail::throw_invalid("suffix.max_spec_factor", "be finite and >= 0", max_spec_factor);
    }
    if (!std::isfinite(max_spec_offset)) detail::throw_invalid("suffix.max_spec_offset", "be finite", max_spec_offset);
    if (!(min_token_prob >= 0.0 && min_token_prob <= 1.0)) {
      detail::throw_invalid("suffix.min_token_prob", "be in [0, 1]", min_token_prob);
    }
    if (min_match < 1) detail::throw_invalid("suffix.min_match", "be >= 1", min_match);
  }
  [[nodiscard]] detail::SuffixWalkRule walk() const noexcept {
    return {.max_spec_factor = max_spec_factor, .max_spec_offset = max_spec_offset,
            .min_token_prob = min_token_prob, .min_match = min_match};
  }

  friend std::ostream& operator<<(std::ostream& out, const SuffixDraftRule& rule) {
    return out << "SuffixDraftRule{max_depth=" << rule.max_depth << ", max_spec_factor=" << rule.max_spec_factor
               << ", max_spec_offset=" << rule.max_spec_offset << ", min_token_prob=" << rule.min_token_prob
               << ", min_match=" << rule.min_match << "}";
  }
};

// The bounds of a SuffixCache.
struct SuffixCacheLimits {
  int64_t max_depth = 32;                     // longest substring its tree keeps (in [2, 1024])
  int64_t max_responses = 100000;             // responses kept (>= 1)
  int64_t max_bytes = int64_t{256} << 20;     // memory of the responses and their tree together,
                                              // between calls (>= 1 MiB)

  void validate() const {
    if (max_depth < 2 || max_depth > detail::SuffixTrie::kMaxDepth) {
      detail::throw_invalid("cache.max_depth", "be in [2, 1024]", max_depth);
    }
    if (max_responses < 1) detail::throw_invalid("cache.max_responses", "be >= 1", max_responses);
    if (max_bytes < (int64_t{1} << 20)) detail::throw_invalid("cache.max_bytes", "be >= 1048576 (1 MiB)", max_bytes);
  }
  friend std::ostream& operator<<(std::ostream& out, const SuffixCacheLimits& limits) {
    return out << "SuffixCacheLimits{max_depth=" << limits.max_depth << ", max_responses=" << limits.max_responses
               << ", max_bytes=" << limits.max_bytes << "}";
  }
};

namespace detail {

class SuffixMatcher;

// The arrays of a finished request's tree, kept for the next request drawing from the same cache
// (its source refills memory already grown and touched, instead of growing new arrays token by
// token). Shared by the cache and its sources, so a source may outlive its cache.
struct SpareSuffixTrie {
  std::optional<SuffixTrie> trie;
};

}  // namespace detail

// Earlier requests' responses and the tree of their substrings, shared by the requests that draft
// from it (borrowed by SuffixDraftSource; not thread-safe: one thread at a time). Past a limit
// the oldest responses go, down to three quarters of it, and the tree is rebuilt from those that
// stay: each token added costs at most a few insertions over the cache's life.
class SuffixCache {
 public:
  static constexpr uint32_t kFileVersion = 1;

  // Requires 1 <= vocab_size <= 2^31 and valid limits.
  explicit SuffixCache(int64_t vocab_size, SuffixCacheLimits limits = {})
      : vocab_(vocab_size), limits_(limits), trie_((limits.validate(), limits.max_depth)) {
    if (vocab_size < 1 || vocab_size > (int64_t{1} << 31)) detail::throw_invalid("vocab_size", "be in [1, 2^31]", vocab_size);
  }

  // Adds a finished response (its tokens in [0, vocab_size)); one longer than the cache can hold
  // keeps its last tokens. An empty response adds nothing.
  void add(std::span<const int64_t> response) {
    detail::check_tokens("response", response, vocab_);
    if (response.empty()) return;
    const size_t most = static_cast<size_t>(limits_.max_bytes) / per_token_floor();
    learn(response.last(std::min(response.size(), std::max<size_t>(most, 1))));
    ++version_;
    if (over(1.0)) shrink();
  }

  void clear() {
    lengths_.clear();
    tokens_ = 0;
    trie_.clear();
    ++version_;
  }

  [[nodiscard]] int64_t vocab_size() const noexcept { return vocab_; }
  [[nodiscard]] const SuffixCacheLimits& limits() const noexcept { return limits_; }
  [[nodiscard]] int64_t responses() const noexcept { return static_cast<int64_t>(lengths_.size()); }
  [[nodiscard]] int64_t tokens() const noexcept { return static_cast<int64_t>(tokens_); }
  [[nodiscard]] int64_t evicted() const noexcept { return evicted_; }
  // The bytes the tree holds (its arrays' capacity), the responses' text among them.
  [[nodiscard]] size_t memory_bytes() const noexcept { return trie_.memory_bytes(); }
  // Changes with every add, eviction, clear and load: a source re-walks its path when it moved.
  [[nodiscard]] uint64_t version() const noexcept { return version_; }
  [[nodiscard]] const detail::SuffixTrie& trie() const noexcept { return trie_; }

  // A versioned binary file with a checksum trailer, written atomically: the limits and the
  // responses, oldest first (the tree is rebuilt on load).
  void save(const std::filesystem::path& path) const {
    io::detail::write_atomically_checksummed(path, [&](std::ofstream& out) {
      const auto put = [&](const auto& value) { io::detail::put(out, value); };
      out.write(kMagic, sizeof(kMagic));
      put(kFileVersion);
      put(static_cast<uint64_t>(vocab_));
      put(static_cast<uint32_t>(limits_.max_depth));
      put(static_cast<uint64_t>(limits_.max_responses));
      put(static_cast<uint64_t>(limits_.max_bytes));
      put(static_cast<uint64_t>(lengths_.size()));
      const std::span<const int32_t> text = trie_.text();  // the responses, each ended by a separator
      size_t offset = 0;
      for (const size_t length : lengths_) {
        put(static_cast<uint64_t>(length));
        out.write(reinterpret_cast<const char*>(text.data() + offset), static_cast<std::streamsize>(length * sizeof(int32_t)));
        offset += length + 1;
      }
    });
  }
  // Reads a file written by save(). `vocab_size`, when given, must equal the file's. Throws
  // io::FormatError naming the file and the field.
  [[nodiscard]] static SuffixCache load(const std::filesystem::path& path, std::optional<int64_t> vocab_size = {}) {
    io::detail::BinaryReader reader(path);
    char magic[sizeof(kMagic)];
    reader.read_bytes(magic, sizeof(magic), "magic");
    if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) io::detail::throw_format(path, "not a suffix cache file (bad magic)");
    const auto version = reader.read<uint32_t>("version");
    if (version != kFileVersion) io::detail::throw_format(path, "unsupported suffix cache version ", version);
    reader.verify_checksum();
    const auto vocab = reader.read<uint64_t>("vocab_size");
    if (vocab < 1 || vocab > (uint64_t{1} << 31)) io::detail::throw_format(path, "vocab_size ", vocab, " is out of range");
    if (vocab_size && static_cast<uint64_t>(*vocab_size) != vocab) {
      io::detail::throw_format(path, "holds a cache for vocab_size ", vocab, ", expected ", *vocab_size);
    }
    SuffixCacheLimits limits;
    limits.max_depth = reader.read<uint32_t>("max_depth");
    const auto max_responses = reader.read<uint64_t>("max_responses");
    const auto max_bytes = reader.read<uint64_t>("max_bytes");
    if (max_responses > uint64_t{1} << 40 || max_bytes > uint64_t{1} << 50) {
      io::detail::throw_format(path, "limits max_responses ", max_responses, " or max_bytes ", max_bytes, " out of range");
    }
    limits.max_responses = static_cast<int64_t>(max_responses);
    limits.max_bytes = static_cast<int64_t>(max_bytes);
    std::optional<SuffixCache> made;
    try {
      made.emplace(static_cast<int64_t>(vocab), limits);
    } catch (const std::invalid_argument& e) {
      io::detail::throw_format(path, e.what());
    }
    const auto count = reader.read<uint64_t>("response count");
    if (count > reader.remaining() / sizeof(uint64_t)) {
      io::detail::throw_format(path, count, " responses cannot fit in the ", reader.remaining(), " bytes that follow");
    }
    for (uint64_t i = 0; i < count; ++i) {
      const auto length = reader.read<uint64_t>("response length");
      if (length == 0 || length > reader.remaining() / sizeof(int32_t)) {
        io::detail::throw_format(path, "response ", i, " has length ", length, ", with ", reader.remaining(),
                                 " bytes left");
      }
      std::vector<int32_t> tokens(static_cast<size_t>(length));
      reader.read_bytes(tokens.data(), length * sizeof(int32_t), "response tokens");
      for (size_t j = 0; j < tokens.size(); ++j) {
        if (tokens[j] < 0 || static_cast<uint64_t>(tokens[j]) >= vocab) {
          io::detail::throw_format(path, "response ", i, " token ", j, " is ", tokens[j], ", outside [0, ", vocab, ")");
        }
      }
      made->learn(std::span<const int32_t>(tokens));
    }
    if (reader.remaining() != 0) io::detail::throw_format(path, reader.remaining(), " bytes follow the last response");
    if (made->over(1.0)) made->shrink();
    return std::move(*made);
  }

  friend std::ostream& operator<<(std::ostream& out, const SuffixCache& cache) {
    return out << "SuffixCache{vocab_size=" << cache.vocab_ << ", responses=" << cache.responses()
               << ", tokens=" << cache.tokens_ << ", bytes=" << cache.memory_bytes() << ", " << cache.limits_ << "}";
  }

 private:
  static constexpr char kMagic[8] = {'S', 'P', 'D', 'S', 'U', 'F', 'F', 'X'};

  // The least tree bytes a token adds (its text, a node and an edge at the table's fullest): only
  // to cut a response that could never fit.
  [[nodiscard]] static constexpr size_t per_token_floor() noexcept {
    return sizeof(int32_t) + sizeof(detail::SuffixTrie::Node) + sizeof(uint64_t) + sizeof(uint32_t);
  }
  [[nodiscard]] bool over(double share) const noexcept {
    return static_cast<double>(lengths_.size()) > share * static_cast<double>(limits_.max_responses) ||
           static_cast<double>(memory_bytes()) > share * static_cast<double>(limits_.max_bytes);
  }
  // Learns a response as a text of its own.
  template <class Token>
  void learn(std::span<const Token> response) {
    detail::SuffixTrie::Path path;
    trie_.begin_text(path);
    trie_.reserve_for(response.size());
    for (size_t i = 0; i < response.size(); ++i) {
      trie_.extend(path, response[i], i + 1 < response.size() ? int64_t{response[i + 1]} : detail::SuffixTrie::kUnknown);
    }
    lengths_.push_back(response.size());
    tokens_ += response.size();
  }
  // Evicts the oldest responses down to three quarters of the limits (bytes estimated from the
  // tree's bytes per token, then checked after the rebuild).
  void shrink() {
    while (!lengths_.empty() && over(0.75)) {
      const double per_token = static_cast<double>(memory_bytes()) / static_cast<double>(std::max<size_t>(tokens_, 1));
      const double keep_tokens = 0.75 * static_cast<double>(limits_.max_bytes) / per_token;
      const auto keep_responses = static_cast<size_t>(0.75 * static_cast<double>(limits_.max_responses));
      size_t from = 0;  // offset in the kept text of the first response that stays
      bool first = true;  // at least one goes each round, whatever the estimate says
      while (!lengths_.empty() && (first || static_cast<double>(tokens_) > keep_tokens ||
                                   lengths_.size() > keep_responses)) {
        first = false;
        from += lengths_.front() + 1;
        tokens_ -= lengths_.front();
        lengths_.pop_front();
        ++evicted_;
      }
      // The tree is rebuilt from the responses that stay, read from its own kept text.
      const std::span<const int32_t> text = trie_.text();
      const std::vector<int32_t> staying(text.begin() + static_cast<std::ptrdiff_t>(std::min(from, text.size())), text.end());
      const std::deque<size_t> lengths = std::move(lengths_);
      lengths_.clear();
      tokens_ = 0;
      trie_.clear();
      size_t offset = 0;
      for (const size_t length : lengths) {
        learn(std::span<const int32_t>(staying).subspan(offset, length));
        offset += length + 1;
      }
      trie_.shrink_to_fit();
    }
    ++version_;
  }

  friend class detail::SuffixMatcher;

  int64_t vocab_;
  SuffixCacheLimits limits_;
  detail::SuffixTrie trie_;
  std::deque<size_t> lengths_;  // of the responses kept, oldest first (their text is the tree's)
  size_t tokens_ = 0;
  int64_t evicted_ = 0;
  uint64_t version_ = 0;
  // One request tree's arrays between requests, outside memory_bytes() (at most max_bytes).
  std::shared_ptr<detail::SpareSuffixTrie> spare_ = std::make_shared<detail::SpareSuffixTrie>();
};

namespace detail {

// What both suffix sources share: the request's own tree over its text (one session's turns feed
// the same tree), its place in the borrowed cache's tree, and the cache's new responses.
class SuffixMatcher {
 public:
  SuffixMatcher(const SuffixDraftRule& rule, SuffixCache* cache)
      : rule_((rule.validate(), rule)), trie_(rule.max_depth), cache_(cache),
        spare_(cache != nullptr ? cache->spare_ : nullptr) {}
  SuffixMatcher(const SuffixMatcher&) = default;
  SuffixMatcher(SuffixMatcher&&) noexcept = default;
  SuffixMatcher& operator=(const SuffixMatcher&) = default;
  SuffixMatcher& operator=(SuffixMatcher&&) noexcept = default;
  // Leaves the request tree's arrays to the next request drawing from the same cache (the
  // largest one, within the cache's byte bound).
  ~SuffixMatcher() {
    if (spare_ == nullptr || cache_ == nullptr) return;
    const size_t bytes = trie_.memory_bytes();
    if (bytes == 0 || bytes > static_cast<size_t>(cache_limit_bytes_)) return;
    if (spare_->trie && spare_->trie->memory_bytes() >= bytes) return;
    trie_.clear_keeping_capacity();
    spare_->trie.emplace(std::move(trie_));
  }

  [[nodiscard]] const SuffixDraftRule& rule() const noexcept { return rule_; }
  [[nodiscard]] const SuffixTrie& request_tree() const noexcept { return trie_; }
  [[nodiscard]] size_t memory_bytes() const noexcept { return trie_.memory_bytes(); }
  [[nodiscard]] int64_t drafts_from_cache() const noexcept { return from_cache_; }
  [[nodiscard]] int64_t drafts_from_request() const noexcept { return from_request_; }
  // Trees a draft reads: the request's, and the cache's when it holds a response.
  [[nodiscard]] int64_t trees() const noexcept { return cache_ != nullptr && cache_->responses() > 0 ? 2 : 1; }

  // Learns what of `sequence` it has not seen (all of it the first time; a session's next turn:
  // the turn's new tokens), and marks where this generation's response begins.
  void start(std::span<const int64_t> sequence) {
    if (cache_ != nullptr) {
      check_tokens("prompt", sequence, cache_->vocab_size());
      cache_limit_bytes_ = cache_->limits().max_bytes;
    }
    const auto learned = trie_.text();  // what it learned: the request's tree keeps one text
    if (sequence.size() < learned.size() || !std::equal(learned.begin(), learned.end(), sequence.begin())) {
      restart();  // not a continuation of what it learned: another conversation
    }
    // A new tree takes the arrays an earlier request left.
    if (trie_.text().empty() && spare_ != nullptr && spare_->trie && spare_->trie->max_depth() == trie_.max_depth() &&
        spare_->trie->memory_bytes() > trie_.memory_bytes()) {
      trie_ = std::move(*spare_->trie);
      spare_->trie.reset();
    }
    trie_.reserve_for(sequence.size() - trie_.text().size());
    learn(sequence);
    response_from_ = sequence.size();
  }

  // Learns `sequence`, then fills `mine` and `theirs` by grow(trie, position, draft) from the
  // request's tree and the cache's, and returns the one of higher score (the request's on a tie).
  template <class Draft, class Grow>
  const Draft& choose(std::span<const int64_t> sequence, Draft& mine, Draft& theirs, Grow grow) {
    learn(sequence);
    grow(trie_, SuffixTrie::position_at(path_), mine);
    const Draft* chosen = &mine;
    if (cache_ != nullptr && cache_->responses() > 0) {
      if (cache_version_ != cache_->version()) {
        cache_position_ = cache_->trie().position_of(sequence);
        cache_version_ = cache_->version();
      }
      grow(cache_->trie(), cache_position_, theirs);
      if (theirs.score > mine.score) chosen = &theirs;
    }
    if (!chosen->tokens.empty()) ++(chosen == &mine ? from_request_ : from_cache_);
    return *chosen;
  }

  // Adds this generation's response to the cache.
  void finish(std::span<const int64_t> sequence) {
    learn(sequence);
    if (cache_ != nullptr && response_from_ < sequence.size()) cache_->add(sequence.subspan(response_from_));
    response_from_ = sequence.size();
  }

  // Feeds the request's tree (and the walk in the cache's) the tokens of `sequence` past those
  // learned; within a generation the sequence only grows.
  void learn(std::span<const int64_t> sequence) {
    for (size_t i = trie_.text().size(); i < sequence.size(); ++i) {
      trie_.extend(path_, sequence[i], i + 1 < sequence.size() ? sequence[i + 1] : SuffixTrie::kUnknown);
      if (cache_ != nullptr && cache_version_ == cache_->version()) cache_->trie().follow(cache_position_, sequence[i]);
    }
  }

 private:
  void restart() {
    trie_.clear_keeping_capacity();  // a source reused for another request refills it
    path_.assign(1, 0);
    cache_version_ = std::numeric_limits<uint64_t>::max();
  }

  SuffixDraftRule rule_;
  SuffixTrie trie_;
  SuffixTrie::Path path_{0};  // of the request's text in its own tree
  SuffixCache* cache_ = nullptr;
  std::shared_ptr<SpareSuffixTrie> spare_;  // the cache's (null without one)
  int64_t cache_limit_bytes_ = 0;           // the cache's max_bytes, read while it is there
  SuffixTrie::Position cache_position_;
  uint64_t cache_version_ = std::numeric_limits<uint64_t>::max();
  size_t response_from_ = 0;
  int64_t from_cache_ = 0, from_request_ = 0;
};

// What both suffix sources offer around their SuffixMatcher: the rule, the request's tree and its
// memory, where drafts came from, and the start and finish hooks.
class SuffixSourceBase {
 public:
  [[nodiscard]] const SuffixDraftRule& rule() const noexcept { return matcher_.rule(); }
  [[nodiscard]] const SuffixTrie& request_tree() const noexcept { return matcher_.request_tree(); }
  [[nodiscard]] size_t memory_bytes() const noexcept { return matcher_.memory_bytes(); }
  // Drafts taken from the cache, and from the request's own tree, so far.
  [[nodiscard]] int64_t drafts_from_cache() const noexcept { return matcher_.drafts_from_cache(); }
  [[nodiscard]] int64_t drafts_from_request() const noexcept { return matcher_.drafts_from_request(); }

  // Learns the prompt (a session's next turn: what is new of it).
  void start(std::span<const int64_t> sequence, const SpeculativeOptions& /*options*/) { matcher_.start(sequence); }
  // Adds this generation's response to the cache.
  void finish(std::span<const int64_t> sequence) { matcher_.finish(sequence); }

 protected:
  SuffixSourceBase(const SuffixDraftRule& rule, SuffixCache* cache) : matcher_(rule, cache) {}

  SuffixMatcher matcher_;
};

}  // namespace detail

// Drafts a chain by suffix decoding for one request (or one session: its turns go on feeding the
// same tree): from its own tree over the sequence and from the borrowed cache of earlier
// responses, to which finish() adds this generation's output. Host-side work on plain integers.
class SuffixDraftSource : public detail::SuffixSourceBase {
 public:
  // Without a cache: the request's own tree only.
  explicit SuffixDraftSource(SuffixDraftRule rule = {}) : SuffixSourceBase(rule, nullptr) {}
  // With a cache of earlier responses (which must outlive the source).
  explicit SuffixDraftSource(SuffixCache& cache, SuffixDraftRule rule = {}) : SuffixSourceBase(rule, &cache) {}

  template <LogitsProcessor P>
  Drafts draft(const DraftRequest& request, const P& /*processor*/, at::Generator& /*gen*/) {
    const int64_t walks = matcher_.trees();
    return Drafts::from_host(propose(request.sequence, std::min(request.gamma, request.room)), request.device, walks);
  }

  void verified(const VerifiedDrafts& verified) { matcher_.learn(verified.sequence); }

  // The drafting itself, on the host: at most `cap` tokens to follow `sequence` (which extends
  // what the source learned), valid until the next call. draft() is this, copied to the device.
  [[nodiscard]] std::span<const int64_t> propose(std::span<const int64_t> sequence, int64_t cap) {
    const detail::SuffixWalkRule walk = matcher_.rule().walk();
    return matcher_
        .choose(sequence, mine_, theirs_,
                [&](const detail::SuffixTrie& trie, const detail::SuffixTrie::Position& position,
                    detail::SuffixWalk& out) { detail::walk_suffixes(trie, position, walk, cap, out); })
        .tokens;
  }

 private:
  detail::SuffixWalk mine_, theirs_;
};
static_assert(DraftSource<SuffixDraftSource, GreedyProcessor>);
static_assert(HasStartHook<SuffixDraftSource> && HasFinishHook<SuffixDraftSource>);

// Drafts a tree by suffix decoding (SuffixDecoding's tree speculation): the same trees and rule as
// SuffixDraftSource, but where a context was followed by several tokens, each of them may open a
// branch, most probable first (detail::SuffixTreeGrower), so a draft survives the target taking
// the second most frequent continuation. The step's gamma bounds the nodes, its room the depth.
// The tree is a deterministic function of the text, verified by the deterministic rule of
// model_tree.hpp: the output is the target's distribution under any sampling, and under greedy
// decoding autoregressive decoding token for token. A TreeDraftSource for generate_with and
// sessions (the target models TreeTarget); batches take SuffixDraftSource.
class SuffixTreeSource : public detail::SuffixSourceBase, public detail::DeviceTreeVerifier {
 public:
  explicit SuffixTreeSource(SuffixDraftRule rule = {}) : SuffixSourceBase(rule, nullptr) {}
  explicit SuffixTreeSource(SuffixCache& cache, SuffixDraftRule rule = {}) : SuffixSourceBase(rule, &cache) {}

  TreeDrafts draft_tree(const DraftRequest& request) {
    const detail::SuffixTreeDraft& tree =
        propose(request.sequence, std::min(request.gamma, request.capacity), request.room);
    const at::Tensor ids = detail::to_device<int64_t>(tree.tokens, {tree.size()}, request.device);
    tree_.assign(ids, tree.parents, tree.ranks, tree.depth);
    return TreeDrafts{.parents = tree.parents, .calls = matcher_.trees(), .ids = ids};
  }

  void verified_tree(std::span<const int64_t> sequence, int64_t /*position*/) { matcher_.learn(sequence); }

  // The drafting itself, on the host: a tree of at most `max_nodes` nodes, `max_depth` deep, to
  // follow `sequence` (which extends what the source learned), valid until the next call.
  [[nodiscard]] const detail::SuffixTreeDraft& propose(std::span<const int64_t> sequence, int64_t max_nodes,
                                                       int64_t max_depth) {
    const detail::SuffixWalkRule walk = matcher_.rule().walk();
    return matcher_.choose(sequence, mine_, theirs_,
                           [&](const detail::SuffixTrie& trie, const detail::SuffixTrie::Position& position,
                               detail::SuffixTreeDraft& out) {
                             grower_.grow(trie, position, walk, max_nodes, max_depth, out);
                           });
  }

 private:
  detail::SuffixTreeGrower grower_;
  detail::SuffixTreeDraft mine_, theirs_;
};
static_assert(TreeDraftSource<SuffixTreeSource, GreedyProcessor>);
static_assert(HasStartHook<SuffixTreeSource> && HasFinishHook<SuffixTreeSource>);

// Options of suffix_generate.
struct SuffixDecodingOptions {
  int64_t max_new_tokens = 40;           // most tokens to generate (>= 0)
  std::vector<int64_t> eos_token_ids{};  // tokens that end generation (kept in the output)
  std::vector<std::vector<int64_t>> stop_sequences{};  // token sequences that end generation when
                                         // generated (kept in the output)
  std::optional<uint64_t> seed{};        // seed of the sampling generator; unset: nondeterministic
  bool use_cache = true;                 // false recomputes the whole sequence at every forward
  StepCallback on_step{};                // called after every step (may stop); empty: not called
  int64_t gamma = 16;                    // most drafts per step (>= 1); the rule's match length
                                         // sizes each draft below it
  SuffixDraftRule rule{};                // anchoring, length and confidence of the drafts
  bool first_target = true;              // the first token comes from the target alone
  bool tree = false;                     // draft trees of at most gamma nodes (SuffixTreeSource)
                                         // instead of chains; the target must model TreeTarget
};

// Suffix decoding: drafts from the request's own text and from `cache` (earlier responses, to
// which this generation's output is added at the end), verified by the target in one forward
// per step with the same rejection sampling as speculative_generate (q one-hot at each draft), or
// with options.tree by the deterministic tree rule: the output is distributed exactly as the
// target's (token for token equal to autoregressive_generate under greedy decoding).
//
// Requires: everything autoregressive_generate requires; gamma >= 1; a valid rule;
//   cache.vocab_size() == target.vocab_size(); with options.tree, a target that models TreeTarget.
// Returns: as autoregressive_generate; drafter_calls counts tree walks.
// Throws: std::invalid_argument naming the parameter and value; whatever the model throws.
template <Target T, LogitsProcessor P = GreedyProcessor>
[[nodiscard]] GenerationResult suffix_generate(SuffixCache& cache, T& target, std::span<const int64_t> prompt,
                                               const SuffixDecodingOptions& options = {}, const P& processor = {}) {
  if (options.gamma < 1) detail::throw_invalid("gamma", "be >= 1", options.gamma);
  if (cache.vocab_size() != static_cast<int64_t>(target.vocab_size())) {
    detail::throw_invalid_message("cache.vocab_size() must equal target.vocab_size() = ", target.vocab_size(),
                                  ", got ", cache.vocab_size());
  }
  if (options.tree) {
    if constexpr (TreeTarget<T>) {
      SuffixTreeSource source(cache, options.rule);
      return generate_with(source, target, prompt, detail::step_options(options), processor);
    } else {
      throw std::invalid_argument("tree: suffix trees need a target that models TreeTarget (forward_tree)");
    }
  }
  SuffixDraftSource source(cache, options.rule);
  return generate_with(source, target, prompt, detail::step_options(options), processor);
}

}  // namespace specdec
