// The compact n-gram counts behind NGramStorage and OneLevelNGramStorage.
//
// Every n-gram is packed exactly (no hashing collisions) into a key: its length in the top 4 bits,
// then its tokens at ceil(log2(vocab)) bits each, first token lowest. The key is 64 bits when the
// longest n-gram fits 60 bits (n = 4 at a 32000-token vocabulary) and 128 otherwise. Two flat tables
// (detail::FlatTable) hold the counts:
//   - contexts_: one 24-byte slot per context (32 with 128-bit keys): its best follower, that
//     follower's count and the context's total count;
//   - followers_: a count per (context, follower) pair, only for contexts that have seen more than
//     one follower (most contexts of text have exactly one).
// A look-up is one probe per context length; counting a token is one probe per context length,
// plus one in followers_ for contexts with several followers.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <ostream>
#include <span>
#include <tuple>
#include <vector>

#include "specdec/detail/check.hpp"
#include "specdec/detail/flat_table.hpp"
#include "specdec/io/atomic_file.hpp"
#include "specdec/io/binary_reader.hpp"
#include "specdec/io/errors.hpp"
#include "specdec/ngram_options.hpp"

namespace specdec {

namespace detail {

// Bits per token in a packed key for `vocab_size` tokens (validated: [1, 2^31]).
inline int token_bits(int64_t vocab_size) {
  if (vocab_size < 1 || vocab_size > (int64_t{1} << 31)) throw_invalid("vocab_size", "be in [1, 2^31]", vocab_size);
  return std::max(1, static_cast<int>(std::bit_width(static_cast<uint64_t>(vocab_size - 1))));
}

// Packed keys: the length in the top 4 bits, the tokens below.
template <class Key>
inline constexpr int kKeyTokenBits = 0;
template <>
inline constexpr int kKeyTokenBits<uint64_t> = 60;
template <>
inline constexpr int kKeyTokenBits<Key128> = 124;

inline constexpr uint64_t kLow60 = (uint64_t{1} << 60) - 1;

inline int64_t key_length(uint64_t key) noexcept { return static_cast<int64_t>(key >> 60); }
inline int64_t key_length(const Key128& key) noexcept { return static_cast<int64_t>(key.high >> 60); }
inline void set_key_length(uint64_t& key, int64_t length) noexcept {
  key = (key & kLow60) | static_cast<uint64_t>(length) << 60;
}
inline void set_key_length(Key128& key, int64_t length) noexcept {
  key.high = (key.high & kLow60) | static_cast<uint64_t>(length) << 60;
}
inline void put_key_token(uint64_t& key, uint64_t token, int shift) noexcept { key |= token << shift; }
inline void put_key_token(Key128& key, uint64_t token, int shift) noexcept {
  if (shift >= 64) {
    key.high |= token << (shift - 64);
    return;
  }
  key.low |= token << shift;
  if (shift > 0) key.high |= token >> (64 - shift);  // the bits that cross into the high word
}
inline uint64_t key_token(uint64_t key, int shift, int bits) noexcept {
  return (key >> shift) & ((uint64_t{1} << bits) - 1);
}
inline uint64_t key_token(const Key128& key, int shift, int bits) noexcept {
  uint64_t value = 0;
  if (shift >= 64) {
    value = key.high >> (shift - 64);
  } else {
    value = key.low >> shift;
    if (shift > 0) value |= key.high << (64 - shift);
  }
  return value & ((uint64_t{1} << bits) - 1);
}
inline bool key_less(uint64_t a, uint64_t b) noexcept { return a < b; }
inline bool key_less(const Key128& a, const Key128& b) noexcept {
  return a.high != b.high ? a.high < b.high : a.low < b.low;
}

template <class Key>
Key pack_key(std::span<const int64_t> tokens, int bits) noexcept {
  Key key{};
  set_key_length(key, static_cast<int64_t>(tokens.size()));
  for (size_t i = 0; i < tokens.size(); ++i) {
    put_key_token(key, static_cast<uint64_t>(tokens[i]), bits * static_cast<int>(i));
  }
  return key;
}

// Files hold keys in the 128-bit layout (length in bits 124..127) as two little-endian words.
inline Key128 file_key(uint64_t key) noexcept { return {key & kLow60, static_cast<uint64_t>(key_length(key)) << 60}; }
inline Key128 file_key(const Key128& key) noexcept { return key; }
// The key of a file's words, or nullopt where they do not fit the layout of Key.
template <class Key>
std::optional<Key> key_from_file(const Key128& words) noexcept {
  if constexpr (std::is_same_v<Key, Key128>) {
    return words;
  } else {
    if ((words.high & kLow60) != 0 || (words.low >> 60) != 0) return std::nullopt;
    return words.low | (words.high & ~kLow60);
  }
}

inline uint32_t saturating_add(uint32_t a, uint32_t b) noexcept {
  return a > std::numeric_limits<uint32_t>::max() - b ? std::numeric_limits<uint32_t>::max() : a + b;
}

// One context's slot.
struct ContextCounts {
  static constexpr uint32_t kSeveral = uint32_t{1} << 31;  // in `best`: several followers seen
  uint32_t best = 0;        // the best follower's token, with kSeveral
  uint32_t best_count = 0;  // its count
  uint32_t total = 0;       // the count of every follower together (saturating)

  [[nodiscard]] uint32_t token() const noexcept { return best & ~kSeveral; }
  [[nodiscard]] bool several() const noexcept { return (best & kSeveral) != 0; }
};

// An estimate of how many distinct keys a stream holds (HyperLogLog, Flajolet et al. 2007, with
// its small-range correction): 4096 one-byte registers, about 1.6% standard error. It hashes and
// writes a register per key: no look-up in a table.
class DistinctKeys {
 public:
  template <class Key>
  void add(const Key& key) noexcept {
    const uint64_t h = hash_key(key);
    const auto rank = static_cast<uint8_t>(std::countl_zero((h << kBits) | (uint64_t{1} << (kBits - 1))) + 1);
    uint8_t& r = registers_[h >> (64 - kBits)];
    r = std::max(r, rank);
  }
  [[nodiscard]] size_t estimate() const noexcept {
    constexpr double m = kRegisters;
    double sum = 0;
    size_t zeros = 0;
    for (const uint8_t r : registers_) {
      sum += std::ldexp(1.0, -r);
      zeros += r == 0;
    }
    double e = 0.7213 / (1 + 1.079 / m) * m * m / sum;
    if (e <= 2.5 * m && zeros > 0) e = m * std::log(m / static_cast<double>(zeros));
    return static_cast<size_t>(e);
  }

 private:
  static constexpr int kBits = 12;
  static constexpr size_t kRegisters = size_t{1} << kBits;
  std::array<uint8_t, kRegisters> registers_{};
};

static_assert(sizeof(FlatTable<uint64_t, ContextCounts>::Slot) == 20);
static_assert(sizeof(FlatTable<uint64_t, uint32_t>::Slot) == 12);
static_assert(sizeof(FlatTable<Key128, ContextCounts>::Slot) == 28);

// Counts of (context, follower) n-grams for context lengths [min_context, n - 1], keyed by Key.
template <class Key>
class CompactNGramCounts {
 public:
  // Requires (checked by the caller): 2 <= n, n * bits <= kKeyTokenBits<Key>.
  CompactNGramCounts(int64_t n, int64_t vocab_size, int64_t min_context, NGramTies ties)
      : n_(n), vocab_(vocab_size), min_context_(min_context), ties_(ties), bits_(token_bits(vocab_size)) {}

  [[nodiscard]] int64_t n() const noexcept { return n_; }
  [[nodiscard]] int64_t vocab_size() const noexcept { return vocab_; }
  [[nodiscard]] NGramTies ties() const noexcept { return ties_; }
  [[nodiscard]] size_t size() const noexcept { return singles_ + followers_.size(); }
  [[nodiscard]] size_t contexts() const noexcept { return contexts_.size(); }
  [[nodiscard]] size_t memory_bytes() const noexcept { return contexts_.memory_bytes() + followers_.memory_bytes(); }

  [[nodiscard]] std::optional<int64_t> next_token(std::span<const int64_t> tokens) const {
    const auto longest = std::min<int64_t>(n_ - 1, static_cast<int64_t>(tokens.size()));
    check_tokens("tokens (last n - 1)", tokens.last(static_cast<size_t>(longest)), vocab_);
    for (int64_t length = longest; length >= min_context_; --length) {
      if (const ContextCounts* c = contexts_.find(pack(tokens.last(static_cast<size_t>(length))))) return c->token();
    }
    return std::nullopt;
  }

  // Writes up to out.size() drafted tokens after `tokens` under `rule`; returns how many.
  int64_t draft(std::span<const int64_t> tokens, std::span<int64_t> out, const NGramDraftRule& rule) const {
    const int64_t context = n_ - 1;
    auto have = std::min<int64_t>(context, static_cast<int64_t>(tokens.size()));
    check_tokens("tokens (last n - 1)", tokens.last(static_cast<size_t>(have)), vocab_);
    std::array<int64_t, 2 * kMaxContext> window{};  // the last tokens, drafts appended
    std::copy(tokens.end() - have, tokens.end(), window.begin());
    const int64_t shortest = std::max(min_context_, std::min(rule.min_context, context));
    int64_t written = 0;
    while (written < static_cast<int64_t>(out.size())) {
      const ContextCounts* found = nullptr;
      for (int64_t length = std::min(context, have); length >= shortest && found == nullptr; --length) {
        found = contexts_.find(pack(std::span<const int64_t>(window.data() + have - length, static_cast<size_t>(length))));
      }
      if (found == nullptr || found->best_count < rule.min_count ||
          static_cast<double>(found->best_count) < rule.min_share * static_cast<double>(found->total)) {
        break;
      }
      out[static_cast<size_t>(written++)] = found->token();
      if (have == static_cast<int64_t>(window.size())) {  // keep the last n - 1 tokens, at the front
        std::copy(window.end() - context, window.end(), window.begin());
        have = context;
      }
      window[static_cast<size_t>(have++)] = found->token();
    }
    return written;
  }

  // The count of `follower` after exactly `context` (0 when never seen).
  [[nodiscard]] uint32_t count(std::span<const int64_t> context, int64_t follower) const {
    if (static_cast<int64_t>(context.size()) < min_context_ || static_cast<int64_t>(context.size()) > n_ - 1) {
      throw_invalid_message("context must have ", min_context_, " to n - 1 = ", n_ - 1, " tokens, got ", context.size());
    }
    check_tokens("context", context, vocab_);
    check_tokens("follower", std::span<const int64_t>(&follower, 1), vocab_);
    return stored_count(pack(context), static_cast<uint32_t>(follower));
  }

  void update(std::span<const int64_t> tokens, std::span<const int64_t> next) {
    const auto longest = std::min<int64_t>(n_ - 1, static_cast<int64_t>(tokens.size()));
    check_tokens("tokens (last n - 1)", tokens.last(static_cast<size_t>(longest)), vocab_);
    check_tokens("next", next, vocab_);
    std::array<Key, kMaxContext> keys{};
    for (int64_t length = min_context_; length <= longest; ++length) {
      keys[static_cast<size_t>(length)] = pack(tokens.last(static_cast<size_t>(length)));
      contexts_.prefetch(keys[static_cast<size_t>(length)]);
    }
    for (int64_t length = min_context_; length <= longest; ++length) {
      for (const int64_t token : next) add(keys[static_cast<size_t>(length)], static_cast<uint32_t>(token), 1);
    }
  }

  // Counts every n-gram of `tokens`, prefetching the slots of the position kAhead tokens on.
  // Into empty tables it first estimates how many distinct contexts and n-grams the tokens hold
  // and reserves for them, so that the tables do not grow during the build.
  void initialize(std::span<const int64_t> tokens) {
    check_tokens("tokens", tokens, vocab_);
    constexpr size_t kAhead = 8;
    const auto contexts_at = [&](size_t i, auto&& f) {  // f(key) for each context ending before i
      const auto longest = std::min<int64_t>(n_ - 1, static_cast<int64_t>(i));
      for (int64_t length = min_context_; length <= longest; ++length) {
        f(pack(tokens.subspan(i - static_cast<size_t>(length), static_cast<size_t>(length))));
      }
    };
    if (contexts_.size() == 0 && tokens.size() >= kReserveFrom) {
      DistinctKeys contexts, ngrams;
      for (size_t i = 1; i < tokens.size(); ++i) {
        contexts_at(i, [&](const Key& key) {
          contexts.add(key);
          ngrams.add(follower_key(key, static_cast<uint32_t>(tokens[i])));
        });
      }
      // Contexts with one follower keep no follower entry: at least ngrams - contexts have one.
      const size_t distinct_contexts = contexts.estimate() * 41 / 40, distinct_ngrams = ngrams.estimate();
      contexts_.reserve(distinct_contexts);
      followers_.reserve(distinct_ngrams > distinct_contexts ? (distinct_ngrams - distinct_contexts) * 41 / 40 : 0);
    }
    for (size_t i = 1; i < tokens.size(); ++i) {
      if (i + kAhead < tokens.size()) {
        contexts_at(i + kAhead, [&](const Key& key) {
          contexts_.prefetch(key);
          followers_.prefetch(follower_key(key, static_cast<uint32_t>(tokens[i + kAhead])));
        });
      }
      contexts_at(i, [&](const Key& key) { add(key, static_cast<uint32_t>(tokens[i]), 1); });
    }
  }

  void clear() noexcept {
    contexts_.clear();
    followers_.clear();
    singles_ = 0;
  }

  // Adds other's counts, context by context: under first_to_reach, ties keep this storage's
  // leader, then other's leader, then the follower with the higher count in other, then the
  // smaller token.
  void merge(const CompactNGramCounts& other) {
    struct Entry {
      Key context{};
      uint32_t follower, count;
      bool leader{};
    };
    std::vector<Entry> entries;
    entries.reserve(other.size());
    other.for_each_ngram([&](const Key& context, uint32_t follower, uint32_t c, bool leader) {
      entries.push_back({context, follower, c, leader});
    });
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      if (!(a.context == b.context)) return key_less(a.context, b.context);
      return std::tuple(!a.leader, -static_cast<int64_t>(a.count), a.follower) <
             std::tuple(!b.leader, -static_cast<int64_t>(b.count), b.follower);
    });
    for (const Entry& e : entries) add(e.context, e.follower, e.count);
  }

  // The file body of format version 2: the n-grams with their counts, then every context with
  // its best follower and that follower's count; keys in the 128-bit layout.
  void save_entries(std::ofstream& out) const {
    const auto put = [&](const auto& value) { io::detail::put(out, value); };
    const auto put_key = [&](const Key& key) {
      const Key128 words = file_key(key);
      put(words.low);
      put(words.high);
    };
    put(static_cast<uint64_t>(size()));
    put(static_cast<uint64_t>(contexts()));
    for_each_ngram([&](const Key& context, uint32_t follower, uint32_t c, bool) {
      put_key(follower_key(context, follower));
      put(c);
    });
    contexts_.for_each([&](const Key& context, const ContextCounts& c) {
      put_key(context);
      put(c.token());
      put(c.best_count);
    });
  }

  // Reads what save_entries wrote, checking every entry. Throws io::FormatError.
  void load_entries(io::detail::BinaryReader& reader, const std::filesystem::path& path) {
    const auto ngram_entries = reader.read<uint64_t>("count entries");
    const auto context_entries = reader.read<uint64_t>("context entries");
    constexpr uint64_t kNGramBytes = 20, kContextBytes = 24;
    if (ngram_entries > reader.remaining() / kNGramBytes || context_entries > reader.remaining() / kContextBytes ||
        ngram_entries * kNGramBytes + context_entries * kContextBytes != reader.remaining()) {
      io::detail::throw_format(path, "truncated or oversized: ", ngram_entries, " n-grams and ", context_entries,
                               " contexts do not match the ", reader.remaining(), " bytes that follow the header");
    }
    const auto read_key = [&](const char* what) -> std::optional<Key> {
      Key128 words;
      words.low = reader.read<uint64_t>(what);
      words.high = reader.read<uint64_t>(what);
      return key_from_file<Key>(words);
    };
    contexts_.reserve(static_cast<size_t>(context_entries));
    for (uint64_t i = 0; i < ngram_entries; ++i) {
      const std::optional<Key> key = read_key("n-gram");
      const auto c = reader.read<uint32_t>("count");
      if (!key || !valid_key(*key, 1) || c == 0) io::detail::throw_format(path, "n-gram entry ", i, " is invalid");
      const Key context = context_of(*key);
      const uint32_t follower = follower_of(*key);
      if (stored_count(context, follower) != 0) io::detail::throw_format(path, "n-gram entry ", i, " is invalid (repeated)");
      add(context, follower, c);
    }
    FlatTable<Key, uint32_t> seen;  // contexts whose entry has been read
    seen.reserve(static_cast<size_t>(context_entries));
    for (uint64_t i = 0; i < context_entries; ++i) {
      const std::optional<Key> key = read_key("context");
      const auto token = reader.read<uint32_t>("best token");
      const auto c = reader.read<uint32_t>("best count");
      ContextCounts* counts = key && valid_key(*key, 0) ? contexts_.find(*key) : nullptr;
      if (counts == nullptr || token >= vocab_ || !seen.insert(*key).second || stored_count(*key, token) != c ||
          c != counts->best_count || (ties_ == NGramTies::smallest_token && token != counts->token())) {
        io::detail::throw_format(path, "context entry ", i, " is invalid or disagrees with the counts");
      }
      counts->best = token | (counts->best & ContextCounts::kSeveral);  // the saved leader of a tie
    }
    if (seen.size() != contexts_.size()) {
      io::detail::throw_format(path, "lists ", seen.size(), " contexts but its n-grams have ", contexts_.size());
    }
  }

 private:
  static constexpr size_t kMaxContext = 128;  // n - 1 < 124
  static constexpr size_t kReserveFrom = 4096;  // shorter inputs are not worth the estimate

  [[nodiscard]] Key pack(std::span<const int64_t> tokens) const noexcept { return pack_key<Key>(tokens, bits_); }
  [[nodiscard]] Key follower_key(const Key& context, uint32_t follower) const noexcept {
    Key key = context;
    const int64_t length = key_length(context);
    set_key_length(key, length + 1);
    put_key_token(key, follower, bits_ * static_cast<int>(length));
    return key;
  }
  // The key of the first `length` tokens of `key`.
  [[nodiscard]] Key prefix(const Key& key, int64_t length) const noexcept {
    Key result{};
    set_key_length(result, length);
    for (int64_t i = 0; i < length; ++i) {
      const int shift = bits_ * static_cast<int>(i);
      put_key_token(result, key_token(key, shift, bits_), shift);
    }
    return result;
  }
  [[nodiscard]] Key context_of(const Key& ngram) const noexcept { return prefix(ngram, key_length(ngram) - 1); }
  [[nodiscard]] uint32_t follower_of(const Key& ngram) const noexcept {
    return static_cast<uint32_t>(key_token(ngram, bits_ * static_cast<int>(key_length(ngram) - 1), bits_));
  }
  // A context key (extra = 0) or n-gram key (extra = 1) of an allowed length, every token below
  // vocab_size and no stray bits (keys from files are untrusted).
  [[nodiscard]] bool valid_key(const Key& key, int64_t extra) const noexcept {
    const int64_t length = key_length(key);
    if (length - extra < min_context_ || length - extra > n_ - 1) return false;
    for (int64_t i = 0; i < length; ++i) {
      if (key_token(key, bits_ * static_cast<int>(i), bits_) >= static_cast<uint64_t>(vocab_)) return false;
    }
    return prefix(key, length) == key;  // no stray bits beyond the tokens
  }

  [[nodiscard]] uint32_t stored_count(const Key& context, uint32_t follower) const noexcept {
    const ContextCounts* c = contexts_.find(context);
    if (c == nullptr) return 0;
    if (!c->several()) return c->token() == follower ? c->best_count : 0;
    const uint32_t* f = followers_.find(follower_key(context, follower));
    return f == nullptr ? 0 : *f;
  }

  // Calls f(context, follower, count, is the context's best) for every stored n-gram.
  template <class F>
  void for_each_ngram(F&& f) const {
    contexts_.for_each([&](const Key& context, const ContextCounts& c) {
      if (!c.several()) f(context, c.token(), c.best_count, true);
    });
    followers_.for_each([&](const Key& ngram, uint32_t c) {
      const Key context = context_of(ngram);
      const uint32_t follower = follower_of(ngram);
      f(context, follower, c, contexts_.find(context)->token() == follower);
    });
  }

  // Counts `times` observations of `follower` after `context`, keeping the best follower by the
  // tie rule: only the follower's own count changes, so only it can take the lead.
  void add(const Key& context, uint32_t follower, uint32_t times) {
    auto [c, inserted] = contexts_.insert(context);
    if (inserted) {
      *c = {follower, times, times};
      ++singles_;
      return;
    }
    c->total = saturating_add(c->total, times);
    if (!c->several()) {
      if (follower == c->best) {
        c->best_count = saturating_add(c->best_count, times);
        return;
      }
      *followers_.insert(follower_key(context, c->best)).first = c->best_count;  // a second follower
      c->best |= ContextCounts::kSeveral;
      --singles_;
    }
    uint32_t& count = *followers_.insert(follower_key(context, follower)).first;
    count = saturating_add(count, times);
    const uint32_t best = c->token();
    if (follower == best) {
      c->best_count = count;
    } else if (count > c->best_count ||
               (ties_ == NGramTies::smallest_token && count == c->best_count && follower < best)) {
      c->best = follower | ContextCounts::kSeveral;
      c->best_count = count;
    }
  }

  int64_t n_;
  int64_t vocab_;
  int64_t min_context_;
  NGramTies ties_;
  int bits_;
  FlatTable<Key, ContextCounts> contexts_;
  FlatTable<Key, uint32_t> followers_;
  size_t singles_ = 0;  // contexts with exactly one follower
};

}  // namespace detail
}  // namespace specdec
