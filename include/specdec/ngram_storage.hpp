// N-gram storages: model-free drafters built from n-gram statistics of the prompt and of the text
// generated so far (seed 000, NASD), and prompt lookup.
//
// Every n-gram is packed exactly (no hashing collisions) into a 128-bit key: the tokens at
// ceil(log2(vocab)) bits each. Two flat hash tables hold the counts of (context, follower) pairs
// and, per context, the current best follower, so that next_token() is one look-up per context
// length and allocates nothing. The best follower follows seed 000: the first token to reach the
// highest count keeps the lead until another strictly exceeds it.
//
// The tables are tsl::hopscotch_map (Debian's libtsl-hopscotch-map-dev, header-only) when it is
// available, std::unordered_map otherwise.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#if __has_include(<tsl/hopscotch_map.h>)
#include <tsl/hopscotch_map.h>
#define SPECDEC_NGRAM_TABLE_TSL 1
#else
#include <unordered_map>
#endif

#include "specdec/detail/check.hpp"
#include "specdec/io/atomic_file.hpp"
#include "specdec/io/binary_reader.hpp"
#include "specdec/io/errors.hpp"

namespace specdec {
namespace detail {

__extension__ typedef unsigned __int128 NGramKey;  // GCC and clang; __extension__ keeps -Wpedantic quiet

struct NGramKeyHash {
  static uint64_t mix(uint64_t x) noexcept {  // splitmix64 finaliser
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  }
  size_t operator()(NGramKey key) const noexcept {
    return static_cast<size_t>(mix(static_cast<uint64_t>(key) ^ mix(static_cast<uint64_t>(key >> 64))));
  }
};

template <class Value>
#ifdef SPECDEC_NGRAM_TABLE_TSL
using NGramTable = tsl::hopscotch_map<NGramKey, Value, NGramKeyHash>;
#else
using NGramTable = std::unordered_map<NGramKey, Value, NGramKeyHash>;
#endif

// Bytes a table holds in its allocations. For tsl::hopscotch_map it is exact: the bucket array
// (bucket_count() + NeighborhoodSize - 1 buckets of the library's own bucket type, whose size
// includes the neighbourhood bitmap and alignment padding) plus the overflow list's nodes. For
// std::unordered_map it counts nodes and the bucket array but not the allocator's per-node
// overhead.
template <class Value>
size_t table_bytes(const NGramTable<Value>& table) noexcept {
#ifdef SPECDEC_NGRAM_TABLE_TSL
  using Pair = std::pair<NGramKey, Value>;
  constexpr unsigned kNeighborhood = 62;  // tsl::hopscotch_map's default NeighborhoodSize
  using Bucket = tsl::detail_hopscotch_hash::hopscotch_bucket<Pair, kNeighborhood, false>;
  struct ListNode {  // std::list's node: two links and the value
    void* links[2];
    Pair value;
  };
  const size_t buckets = table.bucket_count() == 0 ? 0 : table.bucket_count() + kNeighborhood - 1;
  return buckets * sizeof(Bucket) + table.overflow_size() * sizeof(ListNode);
#else
  struct Node {
    void* next;
    std::pair<const NGramKey, Value> value;
  };
  return table.size() * sizeof(Node) + table.bucket_count() * sizeof(void*);
#endif
}

// Bits per token in a packed key for `vocab_size` tokens (validated: [1, 2^31]).
inline int token_bits(int64_t vocab_size) {
  if (vocab_size < 1 || vocab_size > (int64_t{1} << 31)) throw_invalid("vocab_size", "be in [1, 2^31]", vocab_size);
  return std::max(1, static_cast<int>(std::bit_width(static_cast<uint64_t>(vocab_size - 1))));
}

// The key of a token sequence: its length in the top 4 bits, then the tokens at `bits` each.
inline NGramKey pack_tokens(std::span<const int64_t> tokens, int bits) noexcept {
  NGramKey key = static_cast<NGramKey>(tokens.size()) << 124;
  for (size_t i = 0; i < tokens.size(); ++i) key |= static_cast<NGramKey>(tokens[i]) << (bits * static_cast<int>(i));
  return key;
}

inline int64_t key_length(NGramKey key) noexcept { return static_cast<int64_t>(key >> 124); }

// Whether the key's tokens are all below vocab_size with no stray bits past its length (keys read
// from files are untrusted).
inline bool key_tokens_valid(NGramKey key, int bits, int64_t vocab_size) noexcept {
  NGramKey tokens = key & ((NGramKey{1} << 124) - 1);
  const NGramKey mask = (NGramKey{1} << bits) - 1;
  for (int64_t i = 0; i < key_length(key); ++i, tokens >>= bits) {
    if (static_cast<uint64_t>(tokens & mask) >= static_cast<uint64_t>(vocab_size)) return false;
  }
  return tokens == 0;
}

struct BestFollower {
  uint32_t token = 0;
  uint32_t count = 0;  // 0: no follower yet
};

// Counts and best followers for contexts of the lengths in [min_context, max_context].
class NGramCounts {
 public:
  static constexpr uint32_t kFileVersion = 2;  // 2: with a checksum trailer; 1 still loads

  NGramCounts(int64_t n, int64_t vocab_size, int64_t min_context, int kind)
      : n_(n), vocab_(vocab_size), min_context_(min_context), kind_(kind), bits_(token_bits(vocab_size)) {
    if (n < 2 || n * bits_ > 124) {
      throw_invalid_message("n must be in [2, ", 124 / bits_, "] for vocab_size ", vocab_size, ", got ", n);
    }
  }

  [[nodiscard]] int64_t n() const noexcept { return n_; }
  [[nodiscard]] int64_t vocab_size() const noexcept { return vocab_; }

  void check_tokens(std::span<const int64_t> tokens, const char* name) const {
    detail::check_tokens(name, tokens, vocab_);
  }

  // The best follower of the longest known context among the last max_context..min_context tokens.
  // Only the last n - 1 tokens are read (and checked): a call costs O(n), not O(tokens).
  [[nodiscard]] std::optional<int64_t> next_token(std::span<const int64_t> tokens) const {
    const auto longest = std::min<int64_t>(n_ - 1, static_cast<int64_t>(tokens.size()));
    check_tokens(tokens.last(static_cast<size_t>(longest)), "tokens (last n - 1)");
    for (int64_t length = longest; length >= min_context_; --length) {
      const auto it = best_.find(pack(tokens.last(static_cast<size_t>(length))));
      if (it != best_.end()) return static_cast<int64_t>(it->second.token);
    }
    return std::nullopt;
  }

  void update(std::span<const int64_t> tokens, std::span<const int64_t> next) {
    const auto longest = std::min<int64_t>(n_ - 1, static_cast<int64_t>(tokens.size()));
    check_tokens(tokens.last(static_cast<size_t>(longest)), "tokens (last n - 1)");
    check_tokens(next, "next");
    for (int64_t length = min_context_; length <= longest; ++length) {
      const auto context = tokens.last(static_cast<size_t>(length));
      for (const int64_t token : next) count(context, token, 1);
    }
  }

  void initialize(std::span<const int64_t> tokens) {
    check_tokens(tokens, "tokens");
    for (size_t i = 1; i < tokens.size(); ++i) {
      const auto longest = std::min<int64_t>(n_ - 1, static_cast<int64_t>(i));
      for (int64_t length = min_context_; length <= longest; ++length) {
        count(tokens.subspan(i - static_cast<size_t>(length), static_cast<size_t>(length)), tokens[i], 1);
      }
    }
  }

  void clear() {
    counts_.clear();
    best_.clear();
  }
  // Distinct (context, follower) n-grams stored.
  [[nodiscard]] size_t size() const noexcept { return counts_.size(); }
  // Distinct contexts stored.
  [[nodiscard]] size_t contexts() const noexcept { return best_.size(); }
  // Bytes the two tables hold in their allocations (see table_bytes).
  [[nodiscard]] size_t memory_bytes() const noexcept { return table_bytes(counts_) + table_bytes(best_); }

  // Adds other's counts. The best follower of each context is then the token with the highest
  // summed count; ties keep this storage's leader, then other's leader.
  void merge(const NGramCounts& other) {
    if (other.n_ != n_ || other.vocab_ != vocab_ || other.kind_ != kind_) {
      throw_invalid_message("merge needs storages of the same kind, n and vocab_size (", n_, ", ", vocab_,
                            ") vs (", other.n_, ", ", other.vocab_, ")");
    }
    for (const auto& [key, c] : other.counts_) counts_[key] = saturating_add(counts_[key], c);
    for (const auto& [context, theirs] : other.best_) {
      BestFollower& mine = best_[context];
      if (mine.count > 0) mine.count = counts_.at(follower_key(context, mine.token));
      const uint32_t their_count = counts_.at(follower_key(context, theirs.token));
      if (their_count > mine.count) mine = {theirs.token, their_count};
    }
    for (const auto& entry : other.counts_) {
      const NGramKey key = entry.first;
      BestFollower& best = best_[context_of(key)];
      const uint32_t merged = counts_.at(key);
      if (merged > best.count) best = {follower_of(key), merged};
    }
  }

  void save(const std::filesystem::path& path) const {
    io::detail::write_atomically_checksummed(path, [&](std::ofstream& out) {
      const auto put = [&](const auto& value) { io::detail::put(out, value); };
      out.write(kMagic, sizeof(kMagic));
      put(kFileVersion);
      put(static_cast<uint32_t>(kind_));
      put(static_cast<uint32_t>(n_));
      put(static_cast<uint32_t>(0));
      put(static_cast<uint64_t>(vocab_));
      put(static_cast<uint64_t>(counts_.size()));
      put(static_cast<uint64_t>(best_.size()));
      for (const auto& [key, c] : counts_) {
        put(static_cast<uint64_t>(key));
        put(static_cast<uint64_t>(key >> 64));
        put(c);
      }
      for (const auto& [key, best] : best_) {
        put(static_cast<uint64_t>(key));
        put(static_cast<uint64_t>(key >> 64));
        put(best.token);
        put(best.count);
      }
    });
  }

  // Reads a file written by save() for a storage of `kind`. Throws io::FormatError.
  static NGramCounts load(const std::filesystem::path& path, int kind) {
    io::detail::BinaryReader reader(path);
    char magic[sizeof(kMagic)];
    reader.read_bytes(magic, sizeof(magic), "magic");
    if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) io::detail::throw_format(path, "not an n-gram storage file (bad magic)");
    const auto version = reader.read<uint32_t>("version");
    if (version != kFileVersion && version != 1) {
      io::detail::throw_format(path, "unsupported n-gram storage version ", version);
    }
    if (version >= 2) reader.verify_checksum();
    const auto file_kind = reader.read<uint32_t>("kind");
    if (file_kind != static_cast<uint32_t>(kind)) {
      io::detail::throw_format(path, "holds a storage of kind ", file_kind, ", expected ", kind);
    }
    const auto n = reader.read<uint32_t>("n");
    (void)reader.read<uint32_t>("reserved");
    const auto vocab = reader.read<uint64_t>("vocab_size");
    const auto count_entries = reader.read<uint64_t>("count entries");
    const auto best_entries = reader.read<uint64_t>("context entries");
    if (vocab < 1 || vocab > (uint64_t{1} << 31)) io::detail::throw_format(path, "vocab_size ", vocab, " is out of range");
    std::optional<NGramCounts> made;
    try {
      const int64_t min_context = kind == 1 ? static_cast<int64_t>(n) - 1 : 1;  // one level: n - 1
      made.emplace(static_cast<int64_t>(n), static_cast<int64_t>(vocab), min_context, kind);
    } catch (const std::invalid_argument& e) {
      io::detail::throw_format(path, e.what());
    }
    NGramCounts& s = *made;
    constexpr uint64_t kCountBytes = 20, kBestBytes = 24;
    if (count_entries > reader.remaining() / kCountBytes || best_entries > reader.remaining() / kBestBytes ||
        count_entries * kCountBytes + best_entries * kBestBytes != reader.remaining()) {
      io::detail::throw_format(path, "truncated or oversized: ", count_entries, " n-grams and ", best_entries,
                               " contexts do not match the ", reader.remaining(), " bytes that follow the header");
    }
    const auto read_key = [&](const char* what) {
      const auto low = reader.read<uint64_t>(what);
      const auto high = reader.read<uint64_t>(what);
      return static_cast<NGramKey>(high) << 64 | low;
    };
    s.counts_.reserve(static_cast<size_t>(count_entries));
    for (uint64_t i = 0; i < count_entries; ++i) {
      const NGramKey key = read_key("n-gram");
      const auto c = reader.read<uint32_t>("count");
      if (!s.valid_key(key, 1) || c == 0) io::detail::throw_format(path, "n-gram entry ", i, " is invalid");
      s.counts_[key] = c;
    }
    s.best_.reserve(static_cast<size_t>(best_entries));
    for (uint64_t i = 0; i < best_entries; ++i) {
      const NGramKey key = read_key("context");
      const auto token = reader.read<uint32_t>("best token");
      const auto c = reader.read<uint32_t>("best count");
      const auto it = s.counts_.find(s.follower_key(key, token));
      if (!s.valid_key(key, 0) || token >= vocab || it == s.counts_.end() || it->second != c) {
        io::detail::throw_format(path, "context entry ", i, " is invalid or disagrees with the counts");
      }
      s.best_[key] = {token, c};
    }
    return s;
  }

 private:
  static constexpr char kMagic[8] = {'S', 'D', 'N', 'G', 'R', 'A', 'M', '\0'};

  [[nodiscard]] NGramKey pack(std::span<const int64_t> context) const noexcept { return pack_tokens(context, bits_); }
  [[nodiscard]] NGramKey token_mask() const noexcept { return (NGramKey{1} << bits_) - 1; }
  [[nodiscard]] static int64_t length_of(NGramKey key) noexcept { return key_length(key); }
  // (context, follower) key: the context's key with the follower after its tokens, length + 1.
  [[nodiscard]] NGramKey follower_key(NGramKey context, uint32_t token) const noexcept {
    const int64_t length = length_of(context);
    const NGramKey tokens = context & ((NGramKey{1} << 124) - 1);
    return static_cast<NGramKey>(length + 1) << 124 | tokens |
           static_cast<NGramKey>(token) << (bits_ * static_cast<int>(length));
  }
  [[nodiscard]] NGramKey context_of(NGramKey follower) const noexcept {
    const int64_t length = length_of(follower) - 1;
    const NGramKey tokens = follower & ((NGramKey{1} << (bits_ * static_cast<int>(length))) - 1);
    return static_cast<NGramKey>(length) << 124 | tokens;
  }
  [[nodiscard]] uint32_t follower_of(NGramKey key) const noexcept {
    return static_cast<uint32_t>(key >> (bits_ * static_cast<int>(length_of(key) - 1)) & token_mask());
  }
  // A context key (extra = 0) or follower key (extra = 1) of an allowed length with every token
  // below vocab_size and no stray bits.
  [[nodiscard]] bool valid_key(NGramKey key, int64_t extra) const noexcept {
    const int64_t length = length_of(key);
    if (length - extra < min_context_ || length - extra > n_ - 1) return false;
    return key_tokens_valid(key, bits_, vocab_);
  }

  static uint32_t saturating_add(uint32_t a, uint32_t b) noexcept {
    return a > std::numeric_limits<uint32_t>::max() - b ? std::numeric_limits<uint32_t>::max() : a + b;
  }

  void count(std::span<const int64_t> context, int64_t token, uint32_t times) {
    const NGramKey context_key = pack(context);
    const auto follower = static_cast<uint32_t>(token);
    uint32_t& c = counts_[follower_key(context_key, follower)];
    c = saturating_add(c, times);
    BestFollower& best = best_[context_key];
    if (best.count == 0 || c > best.count) best = {follower, c};
  }

  int64_t n_;
  int64_t vocab_;
  int64_t min_context_;
  int kind_;
  int bits_ = 1;
  NGramTable<uint32_t> counts_;
  NGramTable<BestFollower> best_;
};

}  // namespace detail

// The n-gram storages: one order (kOneLevel: the context is the last n - 1 tokens, seed 000's
// OneLevelNGramStorage; a sequence shorter than that has no context, so next_token returns nullopt
// and update does nothing) or every order from n down to 2 (kBackOff: contexts of n - 1 tokens down
// to one, looked up from the longest known to the shortest; seed 000's NGramStorage with the
// single-token contexts its text describes).
enum class NGramOrders { kOneLevel = 1, kBackOff = 2 };

template <NGramOrders Orders>
class BasicNGramStorage {
 public:
  // Requires 2 <= n and n * ceil(log2(vocab_size)) <= 124; 1 <= vocab_size <= 2^31.
  BasicNGramStorage(int64_t n, int64_t vocab_size)
      : counts_(n, vocab_size, Orders == NGramOrders::kOneLevel ? n - 1 : 1, kKind) {}

  [[nodiscard]] std::optional<int64_t> next_token(std::span<const int64_t> tokens) const {
    return counts_.next_token(tokens);
  }
  void update(std::span<const int64_t> tokens, std::span<const int64_t> next) { counts_.update(tokens, next); }
  void initialize(std::span<const int64_t> tokens) { counts_.initialize(tokens); }
  void clear() { counts_.clear(); }
  // Adds other's counts (see detail::NGramCounts::merge for ties).
  void merge(const BasicNGramStorage& other) { counts_.merge(other.counts_); }
  // A versioned binary file with a checksum trailer, written atomically; load() verifies the
  // checksum, then validates every entry.
  void save(const std::filesystem::path& path) const { counts_.save(path); }
  [[nodiscard]] static BasicNGramStorage load(const std::filesystem::path& path) {
    return BasicNGramStorage(detail::NGramCounts::load(path, kKind));
  }
  [[nodiscard]] int64_t n() const noexcept { return counts_.n(); }
  [[nodiscard]] int64_t vocab_size() const noexcept { return counts_.vocab_size(); }
  [[nodiscard]] size_t size() const noexcept { return counts_.size(); }
  // Distinct contexts stored (of every length the storage keeps).
  [[nodiscard]] size_t contexts() const noexcept { return counts_.contexts(); }
  [[nodiscard]] size_t memory_bytes() const noexcept { return counts_.memory_bytes(); }

  friend std::ostream& operator<<(std::ostream& out, const BasicNGramStorage& s) {
    return out << (Orders == NGramOrders::kOneLevel ? "OneLevelNGramStorage" : "NGramStorage") << "{n=" << s.n()
               << ", ngrams=" << s.size() << "}";
  }

 private:
  static constexpr int kKind = static_cast<int>(Orders);
  explicit BasicNGramStorage(detail::NGramCounts counts) : counts_(std::move(counts)) {}
  detail::NGramCounts counts_;
};

using OneLevelNGramStorage = BasicNGramStorage<NGramOrders::kOneLevel>;
using NGramStorage = BasicNGramStorage<NGramOrders::kBackOff>;

// Prompt lookup: the token that followed the most recent earlier occurrence of the longest suffix
// of max_ngram down to min_ngram tokens. It reads the context itself, so update and initialize
// learn nothing.
class PromptLookupDrafter {
 public:
  // Requires 1 <= min_ngram <= max_ngram.
  explicit PromptLookupDrafter(int64_t max_ngram = 3, int64_t min_ngram = 1)
      : max_ngram_(max_ngram), min_ngram_(min_ngram) {
    if (min_ngram < 1) detail::throw_invalid("min_ngram", "be >= 1", min_ngram);
    if (max_ngram < min_ngram) detail::throw_invalid_message("max_ngram must be >= min_ngram = ", min_ngram, ", got ", max_ngram);
  }

  [[nodiscard]] std::optional<int64_t> next_token(std::span<const int64_t> tokens) const {
    const auto size = static_cast<int64_t>(tokens.size());
    for (int64_t m = std::min(max_ngram_, size - 1); m >= min_ngram_; --m) {
      const auto suffix = tokens.last(static_cast<size_t>(m));
      for (int64_t start = size - m - 1; start >= 0; --start) {
        if (std::equal(suffix.begin(), suffix.end(), tokens.begin() + start)) return tokens[static_cast<size_t>(start + m)];
      }
    }
    return std::nullopt;
  }
  void update(std::span<const int64_t>, std::span<const int64_t>) noexcept {}
  void initialize(std::span<const int64_t>) noexcept {}

  friend std::ostream& operator<<(std::ostream& out, const PromptLookupDrafter& d) {
    return out << "PromptLookupDrafter{max_ngram=" << d.max_ngram_ << ", min_ngram=" << d.min_ngram_ << "}";
  }

 private:
  int64_t max_ngram_;
  int64_t min_ngram_;
};

// STAND's memory (seed 004): for every context of 1..max_context tokens, the target's
// next-token distribution after it, truncated to its kTopTokens most probable (token,
// probability) pairs, and the number of observations c. A new observation merges as the exact
// running mean, new[t] = c/(c+1) old[t] + 1/(c+1) obs[t] (absent tokens count as 0), c <- c+1,
// then truncation to the kTopTokens most probable; seed 004's "I am" example: (Bob .7, Mary .2,
// Tom .05) then (Bob .3, Mary .6, Sue .05) give Bob .5, Mary .4, Tom .025, Sue .025.
// Probabilities are stored as observed (not renormalised after truncation); drafting renormalises.
class ProbabilisticNGramStorage {
 public:
  static constexpr int64_t kTopTokens = 10;
  static constexpr uint32_t kFileVersion = 2;  // 2: with a checksum trailer; 1 still loads

  // One context's distribution: size() pairs, most probable first.
  struct Entry {
    std::array<int32_t, kTopTokens> tokens{};
    std::array<float, kTopTokens> probabilities{};
    uint32_t size = 0;
    uint32_t observations = 0;

    [[nodiscard]] std::span<const int32_t> token_span() const noexcept { return {tokens.data(), size}; }
    [[nodiscard]] std::span<const float> probability_span() const noexcept { return {probabilities.data(), size}; }
    // The stored probability of `token`, 0 when absent.
    [[nodiscard]] double probability(int64_t token) const noexcept {
      for (uint32_t i = 0; i < size; ++i) {
        if (tokens[i] == token) return probabilities[i];
      }
      return 0.0;
    }
  };

  // Requires: vocab_size in [1, 2^31]; max_context >= 1 with max_context tokens fitting in 124
  // bits (ceil(log2(vocab_size)) bits each: at most 8 at vocabulary 32000).
  explicit ProbabilisticNGramStorage(int64_t vocab_size, int64_t max_context = 3)
      : vocab_(vocab_size), max_context_(max_context), bits_(detail::token_bits(vocab_size)) {
    if (max_context < 1 || max_context * bits_ > 124) {
      detail::throw_invalid_message("max_context must be in [1, ", 124 / bits_, "] for vocab_size ", vocab_size,
                                    ", got ", max_context);
    }
  }

  [[nodiscard]] int64_t vocab_size() const noexcept { return vocab_; }
  [[nodiscard]] int64_t max_context() const noexcept { return max_context_; }

  // Merges one observation of the distribution after `context` into the entries of its last 1 ..
  // max_context tokens. tokens and probabilities are pairs (any number, each token once,
  // probabilities in [0, 1]); only the last max_context tokens of context are read.
  void update(std::span<const int64_t> context, std::span<const int64_t> tokens, std::span<const float> probabilities) {
    if (context.empty()) throw std::invalid_argument("context must not be empty");
    if (tokens.size() != probabilities.size()) {
      detail::throw_invalid_message("tokens and probabilities must have the same size, got ", tokens.size(), " and ",
                                    probabilities.size());
    }
    const auto longest = std::min<int64_t>(max_context_, static_cast<int64_t>(context.size()));
    check_tokens(context.last(static_cast<size_t>(longest)), "context (last max_context)");
    check_tokens(tokens, "tokens");
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (!(probabilities[i] >= 0.0F && probabilities[i] <= 1.0F)) {
        detail::throw_invalid_message("probabilities[", i, "] must be in [0, 1], got ", probabilities[i]);
      }
      for (size_t j = 0; j < i; ++j) {
        if (tokens[j] == tokens[i]) detail::throw_invalid_message("tokens[", i, "] = ", tokens[i], " repeats tokens[", j, "]");
      }
    }
    for (int64_t length = 1; length <= longest; ++length) {
      Entry& entry = table_[pack(context.last(static_cast<size_t>(length)))];
      merge_into(entry, tokens, probabilities, 1);
    }
  }

  // The entry of the longest known context among the last max_context .. 1 tokens; nullptr when
  // none is known. The pointer is valid until the next update, merge, clear or load.
  [[nodiscard]] const Entry* find(std::span<const int64_t> context) const {
    const auto longest = std::min<int64_t>(max_context_, static_cast<int64_t>(context.size()));
    check_tokens(context.last(static_cast<size_t>(longest)), "context (last max_context)");
    for (int64_t length = longest; length >= 1; --length) {
      const auto it = table_.find(pack(context.last(static_cast<size_t>(length))));
      if (it != table_.end()) return &it->second;
    }
    return nullptr;
  }

  // The entry of exactly this context (1 .. max_context tokens), nullptr when unknown.
  [[nodiscard]] const Entry* find_exact(std::span<const int64_t> context) const {
    if (context.empty() || static_cast<int64_t>(context.size()) > max_context_) {
      detail::throw_invalid_message("context must have 1 to max_context = ", max_context_, " tokens, got ", context.size());
    }
    check_tokens(context, "context");
    const auto it = table_.find(pack(context));
    return it == table_.end() ? nullptr : &it->second;
  }

  // Adds other's observations: each context's distribution becomes the observation-weighted
  // mean of both, truncated to kTopTokens, and the counts add.
  void merge(const ProbabilisticNGramStorage& other) {
    if (other.vocab_ != vocab_ || other.max_context_ != max_context_) {
      detail::throw_invalid_message("merge needs storages of the same vocab_size and max_context (", vocab_, ", ",
                                    max_context_, ") vs (", other.vocab_, ", ", other.max_context_, ")");
    }
    for (const auto& [key, theirs] : other.table_) {
      std::array<int64_t, kTopTokens> tokens{};
      for (uint32_t i = 0; i < theirs.size; ++i) tokens[i] = theirs.tokens[i];
      merge_into(table_[key], std::span<const int64_t>(tokens.data(), theirs.size), theirs.probability_span(),
                 theirs.observations);
    }
  }

  void clear() { table_.clear(); }
  // Contexts stored.
  [[nodiscard]] size_t size() const noexcept { return table_.size(); }
  // Bytes the table holds in its allocations (see detail::table_bytes).
  [[nodiscard]] size_t memory_bytes() const noexcept { return detail::table_bytes(table_); }

  // Writes the storage atomically (a temporary file renamed over `path`), with a checksum trailer.
  void save(const std::filesystem::path& path) const {
    io::detail::write_atomically_checksummed(path, [&](std::ofstream& out) {
      const auto put = [&](const auto& value) { io::detail::put(out, value); };
      out.write(kMagic, sizeof(kMagic));
      put(kFileVersion);
      put(static_cast<uint32_t>(max_context_));
      put(static_cast<uint64_t>(vocab_));
      put(static_cast<uint64_t>(table_.size()));
      for (const auto& [key, entry] : table_) {
        put(static_cast<uint64_t>(key));
        put(static_cast<uint64_t>(key >> 64));
        put(entry.observations);
        put(entry.size);
        for (int64_t i = 0; i < kTopTokens; ++i) {
          put(entry.tokens[static_cast<size_t>(i)]);
          put(entry.probabilities[static_cast<size_t>(i)]);
        }
      }
    });
  }

  // Reads a file written by save(), checking every field. Throws io::FormatError.
  static ProbabilisticNGramStorage load(const std::filesystem::path& path) {
    io::detail::BinaryReader reader(path);
    char magic[sizeof(kMagic)];
    reader.read_bytes(magic, sizeof(magic), "magic");
    if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
      io::detail::throw_format(path, "not a probabilistic n-gram storage file (bad magic)");
    }
    const auto version = reader.read<uint32_t>("version");
    if (version != kFileVersion && version != 1) io::detail::throw_format(path, "unsupported storage version ", version);
    if (version >= 2) reader.verify_checksum();
    const auto max_context = reader.read<uint32_t>("max_context");
    const auto vocab = reader.read<uint64_t>("vocab_size");
    const auto entries = reader.read<uint64_t>("entries");
    if (vocab < 1 || vocab > (uint64_t{1} << 31)) io::detail::throw_format(path, "vocab_size ", vocab, " is out of range");
    std::optional<ProbabilisticNGramStorage> made;
    try {
      made.emplace(static_cast<int64_t>(vocab), static_cast<int64_t>(max_context));
    } catch (const std::invalid_argument& e) {
      io::detail::throw_format(path, e.what());
    }
    ProbabilisticNGramStorage& s = *made;
    constexpr uint64_t kEntryBytes = 16 + 8 + kTopTokens * 8;
    if (entries > reader.remaining() / kEntryBytes || entries * kEntryBytes != reader.remaining()) {
      io::detail::throw_format(path, "truncated or oversized: ", entries, " entries do not match the ",
                               reader.remaining(), " bytes that follow the header");
    }
    s.table_.reserve(static_cast<size_t>(entries));
    for (uint64_t i = 0; i < entries; ++i) {
      const auto low = reader.read<uint64_t>("context");
      const auto high = reader.read<uint64_t>("context");
      const detail::NGramKey key = static_cast<detail::NGramKey>(high) << 64 | low;
      Entry entry;
      entry.observations = reader.read<uint32_t>("observations");
      entry.size = reader.read<uint32_t>("size");
      for (int64_t j = 0; j < kTopTokens; ++j) {
        entry.tokens[static_cast<size_t>(j)] = reader.read<int32_t>("token");
        entry.probabilities[static_cast<size_t>(j)] = reader.read<float>("probability");
      }
      if (!s.valid_key(key) || !s.valid_entry(entry) || s.table_.count(key) != 0) {
        io::detail::throw_format(path, "entry ", i, " is invalid (context, tokens, probabilities or count)");
      }
      s.table_[key] = entry;
    }
    return s;
  }

 private:
  static constexpr char kMagic[8] = {'S', 'D', 'P', 'N', 'G', 'R', 'A', 'M'};

  void check_tokens(std::span<const int64_t> tokens, const char* name) const {
    detail::check_tokens(name, tokens, vocab_);
  }
  [[nodiscard]] detail::NGramKey pack(std::span<const int64_t> context) const noexcept {
    return detail::pack_tokens(context, bits_);
  }
  [[nodiscard]] bool valid_key(detail::NGramKey key) const noexcept {
    const int64_t length = detail::key_length(key);
    return length >= 1 && length <= max_context_ && detail::key_tokens_valid(key, bits_, vocab_);
  }

  [[nodiscard]] bool valid_entry(const Entry& entry) const noexcept {
    if (entry.observations == 0 || entry.size > kTopTokens) return false;
    double sum = 0;
    for (uint32_t i = 0; i < entry.size; ++i) {
      const float p = entry.probabilities[i];
      if (entry.tokens[i] < 0 || entry.tokens[i] >= vocab_ || !(p >= 0.0F && p <= 1.0F)) return false;
      if (i > 0 && p > entry.probabilities[i - 1]) return false;
      for (uint32_t j = 0; j < i; ++j) {
        if (entry.tokens[j] == entry.tokens[i]) return false;
      }
      sum += p;
    }
    return sum <= 1.0 + 1e-3;
  }

  // entry <- (c entry + weight obs) / (c + weight), truncated to the kTopTokens most probable
  // (ties keep the earlier: entry's order, then the observation's). Observation tokens are
  // distinct. Reuses merged_ as scratch: no allocation once it has grown.
  void merge_into(Entry& entry, std::span<const int64_t> tokens, std::span<const float> probabilities,
                  uint32_t weight) {
    const double c = entry.observations;
    const double total = c + weight;
    merged_.clear();
    for (uint32_t i = 0; i < entry.size; ++i) merged_.emplace_back(entry.tokens[i], c / total * entry.probabilities[i]);
    for (size_t i = 0; i < tokens.size(); ++i) {
      const double add = weight / total * probabilities[i];
      const auto known = std::find_if(merged_.begin(), merged_.begin() + entry.size,
                                      [&](const auto& pair) { return pair.first == tokens[i]; });
      if (known != merged_.begin() + entry.size) {
        known->second += add;
      } else {
        merged_.emplace_back(tokens[i], add);
      }
    }
    std::stable_sort(merged_.begin(), merged_.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    entry.size = static_cast<uint32_t>(std::min<size_t>(merged_.size(), kTopTokens));
    entry.tokens.fill(0);
    entry.probabilities.fill(0.0F);
    for (uint32_t i = 0; i < entry.size; ++i) {
      entry.tokens[i] = static_cast<int32_t>(merged_[i].first);
      entry.probabilities[i] = static_cast<float>(merged_[i].second);
    }
    entry.observations = entry.observations > std::numeric_limits<uint32_t>::max() - weight
                             ? std::numeric_limits<uint32_t>::max()
                             : entry.observations + weight;
  }

  int64_t vocab_;
  int64_t max_context_;
  int bits_ = 1;
  detail::NGramTable<Entry> table_;
  std::vector<std::pair<int64_t, double>> merged_;  // merge_into's scratch
};

}  // namespace specdec
