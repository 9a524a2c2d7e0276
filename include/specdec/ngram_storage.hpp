// N-gram storages: model-free drafters built from n-gram statistics of the prompt and of the text
// generated so far (seed 000, NASD), and prompt lookup.
//
// NGramStorage and OneLevelNGramStorage count every (context, follower) n-gram exactly in the
// compact layout of detail/ngram_counts.hpp: 64-bit keys whenever the n-grams fit (n = 4 at a
// 32000-token vocabulary), one slot per context with its best follower and counts, and per-follower
// counts only for contexts with several followers. next_token() is one look-up per context length
// and allocates nothing; draft() proposes several tokens and stops where the counts are not
// confident (NGramDraftRule). The tables are detail::FlatTable, this library's own open-addressing
// table (see bench_ngram's BM_Table for why).
#pragma once

#include <algorithm>
#include <array>
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
#include <variant>
#include <vector>

#include "specdec/detail/check.hpp"
#include "specdec/detail/flat_table.hpp"
#include "specdec/detail/ngram_counts.hpp"
#include "specdec/io/atomic_file.hpp"
#include "specdec/io/binary_reader.hpp"
#include "specdec/io/errors.hpp"

namespace specdec {

// The n-gram storages: one order (kOneLevel: the context is the last n - 1 tokens, seed 000's
// OneLevelNGramStorage; a sequence shorter than that has no context, so next_token returns nullopt
// and update does nothing) or every order from n down to 2 (kBackOff: contexts of n - 1 tokens down
// to one, looked up from the longest known to the shortest; seed 000's NGramStorage with the
// single-token contexts its text describes).
enum class NGramOrders { kOneLevel = 1, kBackOff = 2 };

template <NGramOrders Orders>
class BasicNGramStorage {
 public:
  static constexpr uint32_t kFileVersion = 2;  // 2: with a checksum trailer; 1 still loads

  // Requires 2 <= n and n * ceil(log2(vocab_size)) <= 124; 1 <= vocab_size <= 2^31.
  BasicNGramStorage(int64_t n, int64_t vocab_size, NGramTies ties = NGramTies::first_to_reach)
      : counts_(make_counts(n, vocab_size, ties)) {}

  [[nodiscard]] std::optional<int64_t> next_token(std::span<const int64_t> tokens) const {
    return visit([&](const auto& c) { return c.next_token(tokens); });
  }
  // Confident drafting: writes up to out.size() tokens that follow `tokens`, each the best
  // follower of the longest known context (backing off to rule.min_context tokens), and stops
  // where none is known or the rule finds its counts not confident. Returns how many it wrote.
  // Reads only the last n - 1 tokens; allocates nothing.
  int64_t draft(std::span<const int64_t> tokens, std::span<int64_t> out, const NGramDraftRule& rule = {}) const {
    rule.validate();
    return visit([&](const auto& c) { return c.draft(tokens, out, rule); });
  }
  // How often `follower` was seen after exactly `context` (of min_context to n - 1 tokens).
  [[nodiscard]] uint32_t count(std::span<const int64_t> context, int64_t follower) const {
    return visit([&](const auto& c) { return c.count(context, follower); });
  }
  void update(std::span<const int64_t> tokens, std::span<const int64_t> next) {
    visit([&](auto& c) { c.update(tokens, next); });
  }
  void initialize(std::span<const int64_t> tokens) {
    visit([&](auto& c) { c.initialize(tokens); });
  }
  void clear() {
    visit([](auto& c) { c.clear(); });
  }
  // Adds other's counts (of a storage with the same n and vocab_size). Under
  // NGramTies::smallest_token the result equals one storage that learned both texts; under
  // first_to_reach a tie keeps this storage's leader, then other's.
  void merge(const BasicNGramStorage& other) {
    if (other.n() != n() || other.vocab_size() != vocab_size()) {
      detail::throw_invalid_message("merge needs storages of the same kind, n and vocab_size (", n(), ", ",
                                    vocab_size(), ") vs (", other.n(), ", ", other.vocab_size(), ")");
    }
    visit([&](auto& mine) { mine.merge(std::get<std::decay_t<decltype(mine)>>(other.counts_)); });
  }
  // A versioned binary file with a checksum trailer, written atomically; load() verifies the
  // checksum, then validates every entry.
  void save(const std::filesystem::path& path) const {
    io::detail::write_atomically_checksummed(path, [&](std::ofstream& out) {
      const auto put = [&](const auto& value) { io::detail::put(out, value); };
      out.write(kMagic, sizeof(kMagic));
      put(kFileVersion);
      put(static_cast<uint32_t>(kKind));
      put(static_cast<uint32_t>(n()));
      put(static_cast<uint32_t>(ties()));
      put(static_cast<uint64_t>(vocab_size()));
      visit([&](const auto& c) { c.save_entries(out); });
    });
  }
  // Reads a file written by save() for a storage of this kind. Throws io::FormatError.
  [[nodiscard]] static BasicNGramStorage load(const std::filesystem::path& path) {
    io::detail::BinaryReader reader(path);
    char magic[sizeof(kMagic)];
    reader.read_bytes(magic, sizeof(magic), "magic");
    if (std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) io::detail::throw_format(path, "not an n-gram storage file (bad magic)");
    const auto version = reader.read<uint32_t>("version");
    if (version != kFileVersion && version != 1) io::detail::throw_format(path, "unsupported n-gram storage version ", version);
    if (version >= 2) reader.verify_checksum();
    const auto kind = reader.read<uint32_t>("kind");
    if (kind != static_cast<uint32_t>(kKind)) io::detail::throw_format(path, "holds a storage of kind ", kind, ", expected ", kKind);
    const auto n = reader.read<uint32_t>("n");
    const auto ties = reader.read<uint32_t>("ties");
    const auto vocab = reader.read<uint64_t>("vocab_size");
    if (ties > 1) io::detail::throw_format(path, "tie rule ", ties, " is unknown");
    if (vocab < 1 || vocab > (uint64_t{1} << 31)) io::detail::throw_format(path, "vocab_size ", vocab, " is out of range");
    std::optional<BasicNGramStorage> made;
    try {
      made.emplace(static_cast<int64_t>(n), static_cast<int64_t>(vocab), static_cast<NGramTies>(ties));
    } catch (const std::invalid_argument& e) {
      io::detail::throw_format(path, e.what());
    }
    made->visit([&](auto& c) { c.load_entries(reader, path); });
    return std::move(*made);
  }

  [[nodiscard]] int64_t n() const noexcept { return visit([](const auto& c) { return c.n(); }); }
  [[nodiscard]] int64_t vocab_size() const noexcept { return visit([](const auto& c) { return c.vocab_size(); }); }
  [[nodiscard]] NGramTies ties() const noexcept { return visit([](const auto& c) { return c.ties(); }); }
  // Distinct (context, follower) n-grams stored.
  [[nodiscard]] size_t size() const noexcept { return visit([](const auto& c) { return c.size(); }); }
  // Distinct contexts stored (of every length the storage keeps).
  [[nodiscard]] size_t contexts() const noexcept { return visit([](const auto& c) { return c.contexts(); }); }
  // Exactly the bytes the tables hold (their slot arrays).
  [[nodiscard]] size_t memory_bytes() const noexcept { return visit([](const auto& c) { return c.memory_bytes(); }); }
  // Whether the keys are 64-bit (n * ceil(log2(vocab_size)) <= 60) rather than 128-bit.
  [[nodiscard]] bool compact_keys() const noexcept { return counts_.index() == 0; }

  friend std::ostream& operator<<(std::ostream& out, const BasicNGramStorage& s) {
    return out << (Orders == NGramOrders::kOneLevel ? "OneLevelNGramStorage" : "NGramStorage") << "{n=" << s.n()
               << ", ngrams=" << s.size() << ", ties=" << s.ties() << "}";
  }

 private:
  static constexpr int kKind = static_cast<int>(Orders);
  static constexpr char kMagic[8] = {'S', 'D', 'N', 'G', 'R', 'A', 'M', '\0'};
  using Counts = std::variant<detail::CompactNGramCounts<uint64_t>, detail::CompactNGramCounts<detail::Key128>>;

  static Counts make_counts(int64_t n, int64_t vocab_size, NGramTies ties) {
    const int bits = detail::token_bits(vocab_size);
    if (n < 2 || n * bits > detail::kKeyTokenBits<detail::Key128>) {
      detail::throw_invalid_message("n must be in [2, ", detail::kKeyTokenBits<detail::Key128> / bits,
                                    "] for vocab_size ", vocab_size, ", got ", n);
    }
    if (ties != NGramTies::first_to_reach && ties != NGramTies::smallest_token) {
      detail::throw_invalid("ties", "be first_to_reach or smallest_token", static_cast<int>(ties));
    }
    const int64_t min_context = Orders == NGramOrders::kOneLevel ? n - 1 : 1;
    if (n * bits <= detail::kKeyTokenBits<uint64_t>) {
      return detail::CompactNGramCounts<uint64_t>(n, vocab_size, min_context, ties);
    }
    return detail::CompactNGramCounts<detail::Key128>(n, vocab_size, min_context, ties);
  }
  template <class F>
  decltype(auto) visit(F&& f) const {
    return std::visit(std::forward<F>(f), counts_);
  }
  template <class F>
  decltype(auto) visit(F&& f) {
    return std::visit(std::forward<F>(f), counts_);
  }

  Counts counts_;
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
      Entry& entry = *table_.insert(pack(context.last(static_cast<size_t>(length)))).first;
      merge_into(entry, tokens, probabilities, 1);
    }
  }

  // The entry of the longest known context among the last max_context .. 1 tokens; nullptr when
  // none is known. The pointer is valid until the next update, merge, clear or load.
  [[nodiscard]] const Entry* find(std::span<const int64_t> context) const {
    const auto longest = std::min<int64_t>(max_context_, static_cast<int64_t>(context.size()));
    check_tokens(context.last(static_cast<size_t>(longest)), "context (last max_context)");
    for (int64_t length = longest; length >= 1; --length) {
      if (const Entry* entry = table_.find(pack(context.last(static_cast<size_t>(length))))) return entry;
    }
    return nullptr;
  }

  // The entry of exactly this context (1 .. max_context tokens), nullptr when unknown.
  [[nodiscard]] const Entry* find_exact(std::span<const int64_t> context) const {
    if (context.empty() || static_cast<int64_t>(context.size()) > max_context_) {
      detail::throw_invalid_message("context must have 1 to max_context = ", max_context_, " tokens, got ", context.size());
    }
    check_tokens(context, "context");
    return table_.find(pack(context));
  }

  // Adds other's observations: each context's distribution becomes the observation-weighted
  // mean of both, truncated to kTopTokens, and the counts add.
  void merge(const ProbabilisticNGramStorage& other) {
    if (other.vocab_ != vocab_ || other.max_context_ != max_context_) {
      detail::throw_invalid_message("merge needs storages of the same vocab_size and max_context (", vocab_, ", ",
                                    max_context_, ") vs (", other.vocab_, ", ", other.max_context_, ")");
    }
    other.table_.for_each([&](const detail::Key128& key, const Entry& theirs) {
      std::array<int64_t, kTopTokens> tokens{};
      for (uint32_t i = 0; i < theirs.size; ++i) tokens[i] = theirs.tokens[i];
      merge_into(*table_.insert(key).first, std::span<const int64_t>(tokens.data(), theirs.size),
                 theirs.probability_span(), theirs.observations);
    });
  }

  void clear() { table_.clear(); }
  // Contexts stored.
  [[nodiscard]] size_t size() const noexcept { return table_.size(); }
  // Exactly the bytes the table holds (its slot array).
  [[nodiscard]] size_t memory_bytes() const noexcept { return table_.memory_bytes(); }

  // Writes the storage atomically (a temporary file renamed over `path`), with a checksum trailer.
  void save(const std::filesystem::path& path) const {
    io::detail::write_atomically_checksummed(path, [&](std::ofstream& out) {
      const auto put = [&](const auto& value) { io::detail::put(out, value); };
      out.write(kMagic, sizeof(kMagic));
      put(kFileVersion);
      put(static_cast<uint32_t>(max_context_));
      put(static_cast<uint64_t>(vocab_));
      put(static_cast<uint64_t>(table_.size()));
      table_.for_each([&](const detail::Key128& key, const Entry& entry) {
        put(key.low);
        put(key.high);
        put(entry.observations);
        put(entry.size);
        for (int64_t i = 0; i < kTopTokens; ++i) {
          put(entry.tokens[static_cast<size_t>(i)]);
          put(entry.probabilities[static_cast<size_t>(i)]);
        }
      });
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
      const detail::Key128 key{low, high};
      Entry entry;
      entry.observations = reader.read<uint32_t>("observations");
      entry.size = reader.read<uint32_t>("size");
      for (int64_t j = 0; j < kTopTokens; ++j) {
        entry.tokens[static_cast<size_t>(j)] = reader.read<int32_t>("token");
        entry.probabilities[static_cast<size_t>(j)] = reader.read<float>("probability");
      }
      if (!s.valid_key(key) || !s.valid_entry(entry) || s.table_.find(key) != nullptr) {
        io::detail::throw_format(path, "entry ", i, " is invalid (context, tokens, probabilities or count)");
      }
      *s.table_.insert(key).first = entry;
    }
    return s;
  }

 private:
  static constexpr char kMagic[8] = {'S', 'D', 'P', 'N', 'G', 'R', 'A', 'M'};

  void check_tokens(std::span<const int64_t> tokens, const char* name) const {
    detail::check_tokens(name, tokens, vocab_);
  }
  [[nodiscard]] detail::Key128 pack(std::span<const int64_t> context) const noexcept {
    return detail::pack_key<detail::Key128>(context, bits_);
  }
  // A key of 1 .. max_context tokens, each below vocab_size, with no stray bits.
  [[nodiscard]] bool valid_key(const detail::Key128& key) const noexcept {
    const int64_t length = detail::key_length(key);
    if (length < 1 || length > max_context_) return false;
    std::array<int64_t, 128> tokens{};
    for (int64_t i = 0; i < length; ++i) {
      tokens[static_cast<size_t>(i)] = static_cast<int64_t>(detail::key_token(key, bits_ * static_cast<int>(i), bits_));
      if (tokens[static_cast<size_t>(i)] >= vocab_) return false;
    }
    return pack(std::span<const int64_t>(tokens.data(), static_cast<size_t>(length))) == key;
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
  detail::FlatTable<detail::Key128, Entry> table_;
  std::vector<std::pair<int64_t, double>> merged_;  // merge_into's scratch
};

}  // namespace specdec
