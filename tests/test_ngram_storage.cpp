// N-gram storages and n-gram assisted generation: storage semantics, persistence, merging,
// prompt lookup, greedy equality with autoregressive decoding and exact sampled distributions.
#include <gtest/gtest.h>

#include <fstream>
#include <iostream>
#include <map>
#include <random>

#include "specdec/generate.hpp"
#include "specdec/text/token_stream.hpp"
#include "support/markov_fixtures.hpp"
#include "support/statistics.hpp"
#include "support/toy_models.hpp"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

// One namespace a file: specdec_tests is compiled as a unity build (tests/CMakeLists.txt).
namespace test_ngram_storage {

namespace {

using namespace specdec;
using Tokens = std::vector<int64_t>;

TEST(NGramStorage, BacksOffFromTheLongestKnownContext) {
  NGramStorage storage(3, 10);
  storage.initialize(Tokens{1, 2, 3, 4, 2, 5});
  EXPECT_EQ(storage.next_token(Tokens{1, 2}), 3);   // (1, 2) -> 3
  EXPECT_EQ(storage.next_token(Tokens{4, 2}), 5);   // (4, 2) -> 5
  EXPECT_EQ(storage.next_token(Tokens{9, 2}), 3);   // unknown (9, 2): back off to (2) -> 3 first
  EXPECT_EQ(storage.next_token(Tokens{3}), 4);
  EXPECT_EQ(storage.next_token(Tokens{9}), std::nullopt);
  EXPECT_EQ(storage.next_token(Tokens{}), std::nullopt);
}

TEST(OneLevelNGramStorage, UsesOnlyTheFullContext) {
  OneLevelNGramStorage storage(3, 10);
  storage.initialize(Tokens{1, 2, 3, 4, 2, 5});
  EXPECT_EQ(storage.next_token(Tokens{1, 2}), 3);
  EXPECT_EQ(storage.next_token(Tokens{9, 2}), std::nullopt);
  EXPECT_EQ(storage.next_token(Tokens{2}), std::nullopt);
  storage.update(Tokens{7}, Tokens{8});  // shorter than the context: nothing to learn
  EXPECT_EQ(storage.size(), 4u);
}

TEST(NGramStorage, FirstTokenToReachTheTopCountKeepsTheLead) {
  NGramStorage storage(2, 10);
  storage.update(Tokens{1}, Tokens{4});
  storage.update(Tokens{1}, Tokens{6});
  EXPECT_EQ(storage.next_token(Tokens{1}), 4);  // tie 1:1, 4 came first
  storage.update(Tokens{1}, Tokens{6, 6});      // several next tokens: 6 now 3:1
  EXPECT_EQ(storage.next_token(Tokens{1}), 6);
  storage.update(Tokens{1}, Tokens{4, 4});      // 3:3 tie: 6 keeps the lead
  EXPECT_EQ(storage.next_token(Tokens{1}), 6);
  storage.update(Tokens{1}, Tokens{4});
  EXPECT_EQ(storage.next_token(Tokens{1}), 4);
  storage.clear();
  EXPECT_EQ(storage.size(), 0u);
  EXPECT_EQ(storage.next_token(Tokens{1}), std::nullopt);
}

TEST(NGramStorage, RejectsBadArgumentsNamingThem) {
  EXPECT_THROW(NGramStorage(1, 10), std::invalid_argument);
  EXPECT_THROW(NGramStorage(9, 32000), std::invalid_argument);  // 9 x 15 bits do not fit a key
  EXPECT_NO_THROW(NGramStorage(8, 32000));
  NGramStorage storage(3, 10);
  try {
    storage.update(Tokens{1, 10}, Tokens{2});
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tokens (last n - 1)[1] must be in [0, vocab_size = 10), got 10"), std::string::npos) << e.what();
  }
  EXPECT_THROW(storage.initialize(Tokens{-1}), std::invalid_argument);
  EXPECT_THROW(PromptLookupDrafter(2, 3), std::invalid_argument);
}

Tokens random_tokens(size_t count, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Tokens tokens(count);
  for (auto& t : tokens) t = static_cast<int64_t>(rng() % static_cast<uint64_t>(vocab));
  return tokens;
}

template <class S>
void expect_same_predictions(const S& a, const S& b, const Tokens& probe) {
  EXPECT_EQ(a.size(), b.size());
  for (size_t end = 0; end <= probe.size(); ++end) {
    EXPECT_EQ(a.next_token(std::span(probe).first(end)), b.next_token(std::span(probe).first(end))) << end;
  }
}

std::filesystem::path temp_file(const std::string& name) {
  return std::filesystem::temp_directory_path() / ("specdec_" + name + "_" + std::to_string(std::random_device{}()));
}

// Bytes the allocator reports in use (glibc's own accounting: small blocks and mapped ones), or 0
// where it keeps none (another C library, or a sanitizer's allocator).
size_t allocated_bytes() {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  const struct mallinfo2 info = mallinfo2();
  return info.uordblks + info.hblkhd;
#else
  return 0;
#endif
}

// memory_bytes() against the allocator's own accounting of what building the storage took.
template <class Build>
void expect_memory_bytes_exact(Build build) {
  const size_t before = allocated_bytes();
  const auto storage = build();
  const size_t after = allocated_bytes();
  if (before == 0 || after <= before) GTEST_SKIP() << "this allocator keeps no accounting (mallinfo2)";
  const auto held = static_cast<double>(after - before);
  const auto reported = static_cast<double>(storage.memory_bytes());
  std::cout << "memory_bytes " << reported << ", allocator " << held << " bytes\n";
  // The tables are a few large blocks; the storage object and chunk headers add a few hundred bytes.
  EXPECT_NEAR(reported, held, 0.002 * held + 4096);
}

TEST(NGramStorage, MemoryBytesEqualsTheAllocatorsAccounting) {
  const Tokens text = random_tokens(200000, 32000, 9);
  expect_memory_bytes_exact([&] {
    NGramStorage storage(4, 32000);
    storage.initialize(text);
    return storage;
  });
}

TEST(ProbabilisticNGramStorage, MemoryBytesEqualsTheAllocatorsAccounting) {
  expect_memory_bytes_exact([&] {
    ProbabilisticNGramStorage memory(1000, 3);
    std::mt19937 rng(3);
    for (int i = 0; i < 20000; ++i) {
      const std::vector<int64_t> context{static_cast<int64_t>(rng() % 1000), static_cast<int64_t>(rng() % 1000)};
      memory.update(context, std::vector<int64_t>{static_cast<int64_t>(rng() % 1000)}, std::vector<float>{1.0F});
    }
    return memory;
  });
}

// A plain count of every (context, follower) pair of lengths 1 .. n - 1, as initialize() learns them.
using ReferenceCounts = std::map<Tokens, std::map<int64_t, uint32_t>>;
ReferenceCounts reference_counts(const std::vector<Tokens>& texts, int64_t n) {
  ReferenceCounts counts;
  for (const Tokens& text : texts) {
    for (size_t i = 1; i < text.size(); ++i) {
      for (size_t length = 1; length <= std::min<size_t>(static_cast<size_t>(n - 1), i); ++length) {
        ++counts[Tokens(text.begin() + static_cast<long>(i - length), text.begin() + static_cast<long>(i))][text[i]];
      }
    }
  }
  return counts;
}

// The compact layout (one slot per context, follower counts only for contexts with several) holds
// exactly the plain counts, with 64-bit keys (n = 4 at vocabulary 32000: 60 bits) and 128-bit keys.
TEST(NGramStorage, CompactCountsEqualAPlainCount) {
  struct Case {
    int64_t n, vocab, alphabet;
    bool compact;
  };
  for (const Case c : {Case{4, 32000, 40, true}, Case{5, 32000, 40, false}, Case{2, 10, 10, true}, Case{8, 5000, 6, false}}) {
    const Tokens text = random_tokens(20000, c.alphabet, static_cast<uint64_t>(c.n));
    NGramStorage storage(c.n, c.vocab, NGramTies::smallest_token);
    storage.initialize(text);
    EXPECT_EQ(storage.compact_keys(), c.compact) << c.n;
    const ReferenceCounts reference = reference_counts({text}, c.n);
    size_t ngrams = 0, mismatches = 0;
    for (const auto& [context, followers] : reference) {
      int64_t best = -1;
      uint32_t best_count = 0;
      for (const auto& [follower, count] : followers) {
        ++ngrams;
        mismatches += storage.count(context, follower) != count;
        if (count > best_count) best = follower, best_count = count;  // ascending: ties keep the smallest
      }
      mismatches += storage.count(context, (best + 1) % c.vocab) != (followers.count((best + 1) % c.vocab) ? followers.at((best + 1) % c.vocab) : 0u);
      if (static_cast<int64_t>(context.size()) == c.n - 1) mismatches += storage.next_token(context) != best;
    }
    EXPECT_EQ(mismatches, 0u) << c.n;
    EXPECT_EQ(storage.size(), ngrams);
    EXPECT_EQ(storage.contexts(), reference.size());
    const NGramStorage copy = storage;  // the flat tables copy whole
    expect_same_predictions(storage, copy, random_tokens(300, c.alphabet, 77));
  }
}

// Under NGramTies::smallest_token the best follower depends only on the counts: storages built
// on parts and merged equal one storage that learned every part, prediction for prediction and
// draft for draft. Under first_to_reach the order shows (which this data is chosen to show).
TEST(NGramStorage, SmallestTokenTiesMakeAMergeEqualOneBuild) {
  const std::vector<Tokens> parts{random_tokens(3000, 6, 11), random_tokens(3000, 6, 12), random_tokens(3000, 6, 13)};
  const Tokens probe = random_tokens(2000, 6, 14);
  const auto differences = [&](NGramTies ties) {
    NGramStorage merged(3, 6, ties), other(3, 6, ties), single(3, 6, ties);
    for (size_t i = parts.size(); i-- > 0;) single.initialize(parts[i]);  // the other order
    merged.initialize(parts[0]);
    for (size_t i = 1; i < parts.size(); ++i) {
      NGramStorage part(3, 6, ties);
      part.initialize(parts[i]);
      merged.merge(part);
    }
    EXPECT_EQ(merged.size(), single.size());
    int64_t differ = 0;
    std::vector<int64_t> a(8), b(8);
    const NGramDraftRule rule{.min_share = 0.3};
    for (size_t end = 1; end <= probe.size(); ++end) {
      const auto context = std::span(probe).first(end);
      differ += merged.next_token(context) != single.next_token(context);
      const int64_t ka = merged.draft(context, a, rule), kb = single.draft(context, b, rule);
      differ += ka != kb || !std::equal(a.begin(), a.begin() + ka, b.begin());
    }
    return differ;
  };
  EXPECT_EQ(differences(NGramTies::smallest_token), 0);
  EXPECT_GT(differences(NGramTies::first_to_reach), 0);
}

TEST(NGramStorage, SmallestTokenWinsATie) {
  NGramStorage storage(2, 10, NGramTies::smallest_token);
  storage.update(Tokens{1}, Tokens{6});
  storage.update(Tokens{1}, Tokens{4});
  EXPECT_EQ(storage.next_token(Tokens{1}), 4);  // tie 1:1, 4 is smaller
  storage.update(Tokens{1}, Tokens{6});
  EXPECT_EQ(storage.next_token(Tokens{1}), 6);  // 2:1
  storage.update(Tokens{1}, Tokens{4});
  EXPECT_EQ(storage.next_token(Tokens{1}), 4);  // 2:2
  EXPECT_EQ(storage.count(Tokens{1}, 6), 2u);
  EXPECT_EQ(storage.count(Tokens{1}, 5), 0u);
  EXPECT_EQ(storage.count(Tokens{3}, 5), 0u);
  EXPECT_THROW((void)storage.count(Tokens{1, 2}, 5), std::invalid_argument);
  EXPECT_THROW(NGramStorage(3, 10, static_cast<NGramTies>(7)), std::invalid_argument);
}

// draft() stops at the first position whose longest known context is not confident.
TEST(NGramStorage, DraftStopsWhereTheCountsAreNotConfident) {
  NGramStorage storage(3, 10);
  storage.initialize(Tokens{1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 7});  // (1, 2) -> 3 twice, 7 once
  std::vector<int64_t> out(6);
  const auto draft = [&](const Tokens& context, const NGramDraftRule& rule, size_t room = 6) {
    const int64_t k = storage.draft(context, std::span(out).first(room), rule);
    return Tokens(out.begin(), out.begin() + k);
  };
  EXPECT_EQ(draft({1, 2}, {}), (Tokens{3, 4, 5, 1, 2, 3}));                         // neutral: as far as known
  EXPECT_EQ(draft({1, 2}, {}, 2), (Tokens{3, 4}));                                  // out's size bounds it
  EXPECT_EQ(draft({1, 2}, {.min_share = 0.6}), (Tokens{3, 4, 5, 1, 2, 3}));          // 2 of 3 passes 0.6
  EXPECT_EQ(draft({1, 2}, {.min_share = 0.7}), Tokens{});                           // ... but not 0.7
  EXPECT_EQ(draft({3, 4}, {.min_share = 0.7}), (Tokens{5, 1, 2}));                  // stops at (1, 2)
  EXPECT_EQ(draft({1, 2}, {.min_count = 2}), (Tokens{3, 4, 5, 1, 2, 3}));
  EXPECT_EQ(draft({4, 5}, {.min_count = 3}), Tokens{});
  EXPECT_EQ(draft({9, 3}, {}), (Tokens{4, 5, 1, 2, 3, 4}));                         // backs off to (3)
  EXPECT_EQ(draft({9, 3}, {.min_context = 2}), Tokens{});                           // longest only
  EXPECT_EQ(draft({9, 3}, {.min_context = 99}), Tokens{});                          // clamped to n - 1
  EXPECT_EQ(draft({9, 9}, {}), Tokens{});
  EXPECT_EQ(draft({}, {}), Tokens{});
  const auto message = [&](const NGramDraftRule& rule) {
    try {
      (void)storage.draft(Tokens{1}, out, rule);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message({.min_share = 1.5}), "draft_rule.min_share must be in [0, 1], got 1.5");
  EXPECT_EQ(message({.min_count = 0}), "draft_rule.min_count must be in [1, 2^32 - 1], got 0");
  EXPECT_EQ(message({.min_context = 0}), "draft_rule.min_context must be >= 1, got 0");
}

// Under the neutral rule draft() is next_token() applied to its own output until a context is
// unknown, for both key widths and both storage kinds.
TEST(NGramStorage, NeutralDraftEqualsRepeatedNextToken) {
  const Tokens text = random_tokens(5000, 30, 21);
  const Tokens probe = random_tokens(500, 30, 22);
  const auto check = [&](const auto& storage) {
    std::vector<int64_t> out(5);
    for (size_t end = 0; end <= probe.size(); ++end) {
      Tokens context(probe.begin(), probe.begin() + static_cast<long>(end)), expected;
      while (expected.size() < out.size()) {
        const auto next = storage.next_token(context);
        if (!next) break;
        expected.push_back(*next);
        context.push_back(*next);
      }
      const int64_t k = storage.draft(std::span(probe).first(end), out);
      ASSERT_EQ(Tokens(out.begin(), out.begin() + k), expected) << storage << " at " << end;
    }
  };
  for (const int64_t n : {3, 4, 6}) {
    NGramStorage storage(n, 30);
    storage.initialize(text);
    check(storage);
    OneLevelNGramStorage one(n, 30);
    one.initialize(text);
    check(one);
  }
}

// The distinct-key estimate initialize() reserves from: HyperLogLog with 4096 registers has a
// standard error of about 1.6%, so 5% is over three standard errors.
TEST(NGramStorage, DistinctKeyEstimateIsWithinFivePercent) {
  for (const uint64_t distinct : {0ULL, 10ULL, 1000ULL, 100000ULL, 1000000ULL}) {
    specdec::detail::DistinctKeys keys;
    for (uint64_t i = 0; i < distinct; ++i) {
      keys.add(i + 1);
      keys.add(i + 1);  // repeats do not count
    }
    EXPECT_NEAR(static_cast<double>(keys.estimate()), static_cast<double>(distinct), 0.05 * static_cast<double>(distinct) + 1)
        << distinct;
  }
}

TEST(TokenStream, IsSeededZipfWithCopiedSpans) {
  const text::TokenStreamOptions options{.tokens = 200000, .vocab_size = 1000};
  const text::TokenStream a = text::make_token_stream(options), b = text::make_token_stream(options);
  EXPECT_EQ(a.tokens, b.tokens);
  ASSERT_EQ(a.tokens.size(), 200000u);
  EXPECT_NEAR(static_cast<double>(a.copied) / 200000.0, 0.3, 0.03);
  EXPECT_TRUE(std::all_of(a.tokens.begin(), a.tokens.end(), [](int64_t t) { return t >= 0 && t < 1000; }));
  const auto zeros = std::count(a.tokens.begin(), a.tokens.end(), 0);  // Zipf 1.1 over 1000: p(0) ~ 0.16
  EXPECT_GT(zeros, 200000 / 10);
  EXPECT_NE(text::make_token_stream({.tokens = 1000, .seed = 1}).tokens, text::make_token_stream({.tokens = 1000, .seed = 2}).tokens);
  EXPECT_THROW((void)text::make_token_stream({.copied_share = 1.0}), std::invalid_argument);
  EXPECT_THROW((void)text::make_token_stream({.min_span = 5, .max_span = 4}), std::invalid_argument);
}

TEST(NGramStorage, SaveAndLoadRoundTrip) {
  const Tokens text = random_tokens(3000, 50, 1);
  NGramStorage storage(4, 50);
  storage.initialize(text);
  storage.update(Tokens{1, 2, 3}, Tokens{4, 4, 9});
  const auto path = temp_file("ngram");
  storage.save(path);
  const NGramStorage loaded = NGramStorage::load(path);
  expect_same_predictions(storage, loaded, random_tokens(400, 50, 2));
  OneLevelNGramStorage one(3, 50);
  one.initialize(text);
  one.save(path);
  expect_same_predictions(one, OneLevelNGramStorage::load(path), random_tokens(400, 50, 3));
  EXPECT_THROW((void)NGramStorage::load(path), io::FormatError);  // a one-level file
  // The tie rule travels with the file; 128-bit keys save and load too.
  NGramStorage ties(6, 50000, NGramTies::smallest_token);
  ties.initialize(random_tokens(3000, 7, 4));
  ties.save(path);
  const NGramStorage loaded_ties = NGramStorage::load(path);
  EXPECT_EQ(loaded_ties.ties(), NGramTies::smallest_token);
  EXPECT_FALSE(loaded_ties.compact_keys());
  expect_same_predictions(ties, loaded_ties, random_tokens(400, 7, 5));
  std::filesystem::remove(path);
}

TEST(NGramStorage, RejectsCorruptFiles) {
  NGramStorage storage(3, 20);
  storage.initialize(random_tokens(200, 20, 4));
  const auto path = temp_file("ngram_corrupt");
  storage.save(path);
  std::ifstream in(path, std::ios::binary);
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  in.close();
  const auto expect_error = [&](const std::string& content, const std::string& problem) {
    std::ofstream(path, std::ios::binary | std::ios::trunc).write(content.data(), static_cast<std::streamsize>(content.size()));
    try {
      (void)NGramStorage::load(path);
      FAIL() << "loaded a corrupt file: " << problem;
    } catch (const io::FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(problem), std::string::npos) << e.what();
    }
  };
  // Any change to a saved file fails its checksum: every single byte changed in turn.
  expect_error(bytes.substr(0, bytes.size() - 5), "no checksum trailer");
  expect_error(bytes + "x", "no checksum trailer");
  for (size_t i = 8 + 4; i < bytes.size() - 16; ++i) {
    std::string flipped = bytes;
    flipped[i] = static_cast<char>(flipped[i] ^ (1 << (i % 8)));
    expect_error(flipped, "checksum mismatch");
  }
  // Version 1 files (before checksums) still load; their parser checks every entry.
  std::string version1 = bytes.substr(0, bytes.size() - 16);
  version1[8] = 1;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(version1.data(), static_cast<std::streamsize>(version1.size()));
  expect_same_predictions(storage, NGramStorage::load(path), random_tokens(200, 20, 5));
  expect_error(version1.substr(0, version1.size() - 5), "truncated or oversized");
  expect_error(version1 + "x", "truncated or oversized");
  expect_error("XX" + version1.substr(2), "bad magic");
  std::string wrong_token = version1;
  wrong_token[48] = static_cast<char>(0xff);  // the first n-gram's first token becomes >= 20
  expect_error(wrong_token, "invalid");
  std::string unknown_ties = version1;
  unknown_ties[20] = 7;  // the tie rule field
  expect_error(unknown_ties, "tie rule 7 is unknown");
  std::string repeated = version1;  // the second n-gram entry (20 bytes each) made a copy of the first
  repeated.replace(68, 20, version1.substr(48, 20));
  expect_error(repeated, "n-gram entry 1 is invalid (repeated)");
  expect_error(version1.substr(0, 10), "truncated");
  std::filesystem::remove(path);
}

TEST(NGramStorage, MergeEqualsLearningBothSequences) {
  // Two texts whose n-grams do not tie across them: merging equals learning one after the other.
  const Tokens first{1, 2, 3, 1, 2, 3, 1, 2, 4, 5, 6};
  const Tokens second{7, 8, 9, 7, 8, 9, 2, 3, 1, 2, 3};
  NGramStorage a(3, 10), b(3, 10), both(3, 10);
  a.initialize(first);
  b.initialize(second);
  both.initialize(first);
  both.initialize(second);
  a.merge(b);
  expect_same_predictions(a, both, Tokens{1, 2, 3, 7, 8, 9, 2, 3, 1, 4, 5, 6, 8});
  // A tie keeps this storage's leader.
  NGramStorage x(2, 10), y(2, 10);
  x.update(Tokens{1}, Tokens{5});
  y.update(Tokens{1}, Tokens{6});
  x.merge(y);
  EXPECT_EQ(x.next_token(Tokens{1}), 5);
  y.update(Tokens{1}, Tokens{6});
  x.merge(y);  // 6 now leads 3:1
  EXPECT_EQ(x.next_token(Tokens{1}), 6);
  EXPECT_THROW(x.merge(NGramStorage(3, 10)), std::invalid_argument);
}

TEST(PromptLookupDrafter, ProposesWhatFollowedTheLatestMatch) {
  const PromptLookupDrafter lookup(3, 1);
  EXPECT_EQ(lookup.next_token(Tokens{5, 6, 7, 1, 5, 6}), 7);          // (5, 6) -> 7
  EXPECT_EQ(lookup.next_token(Tokens{1, 2, 9, 3, 2, 8, 4, 2}), 8);    // latest (2) -> 8
  EXPECT_EQ(lookup.next_token(Tokens{1, 2, 3, 4}), std::nullopt);
  EXPECT_EQ(lookup.next_token(Tokens{}), std::nullopt);
  EXPECT_EQ(PromptLookupDrafter(3, 2).next_token(Tokens{1, 2, 9, 3, 2}), std::nullopt);
}

// A target that follows a pattern most of the time: a Markov chain whose successor of t is
// A pattern target whose greedy continuation is not a single cycle: a prefix-hash model mixed in.
TEST(NGramAssistedGenerate, GreedyEqualsAutoregressive) {
  test::PrefixHashModel target(12, 5);
  const Tokens prompt{1, 2, 3, 4, 1, 2, 3, 4, 5};
  const auto reference = autoregressive_generate(target, prompt, {.max_new_tokens = 60});
  int64_t accepted = 0, drafted = 0;
  for (int64_t gamma = 1; gamma <= 8; ++gamma) {
    for (bool stop_if_unknown : {false, true}) {
      for (int64_t filler : {1, 3}) {
        NGramStorage storage(3, 12);
        const NGramAssistedOptions options{.max_new_tokens = 60, .gamma = gamma, .filler_top_k = filler,
                                           .stop_if_unknown = stop_if_unknown, .first_target = gamma % 2 == 0};
        const auto result = ngram_assisted_generate(storage, target, prompt, options);
        EXPECT_EQ(result.tokens, reference.tokens) << gamma << " " << stop_if_unknown << " " << filler;
        accepted += result.stats.accepted;
        drafted += result.stats.drafted;
        PromptLookupDrafter lookup;
        EXPECT_EQ(ngram_assisted_generate(lookup, target, prompt, options).tokens, reference.tokens);
        OneLevelNGramStorage one(2, 12);
        EXPECT_EQ(ngram_assisted_generate(one, target, prompt, options).tokens, reference.tokens);
      }
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_LT(accepted, drafted);
}

// Confident drafting changes what is drafted, never what is generated.
TEST(NGramAssistedGenerate, ConfidentDraftingStaysExactAndDraftsLess) {
  test::PrefixHashModel target(12, 5);
  const Tokens prompt{1, 2, 3, 4, 1, 2, 3, 4, 5};
  const auto reference = autoregressive_generate(target, prompt, {.max_new_tokens = 60});
  const std::vector<NGramDraftRule> rules{NGramDraftRule{}, NGramDraftRule{.min_share = 0.9, .min_context = 2},
                                          NGramDraftRule{.min_count = 2, .min_share = 0.5}};
  std::vector<int64_t> drafted(rules.size(), 0);
  for (int64_t gamma = 1; gamma <= 8; ++gamma) {
    for (size_t i = 0; i < rules.size(); ++i) {
      NGramStorage storage(3, 12);
      const auto result = ngram_assisted_generate(storage, target, prompt,
                                                  {.max_new_tokens = 60, .gamma = gamma, .draft_rule = rules[i]});
      EXPECT_EQ(result.tokens, reference.tokens) << gamma << " " << rules[i];
      drafted[i] += result.stats.drafted;
    }
  }
  EXPECT_LT(drafted[1], drafted[0]);
  EXPECT_LT(drafted[2], drafted[0]);
  PromptLookupDrafter lookup;
  try {
    (void)ngram_assisted_generate(lookup, target, prompt, {.draft_rule = {.min_share = 0.5}});
    FAIL() << "a rule for a drafter without counts";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("draft_rule needs a storage with counts"), std::string::npos) << e.what();
  }
  NGramStorage storage(3, 12);
  EXPECT_THROW((void)ngram_assisted_generate(storage, target, prompt, {.draft_rule = {.min_count = 0}}),
               std::invalid_argument);
}

TEST(NGramAssistedGenerate, LearnsRepeatedTextAndCutsTargetCalls) {
  test::MarkovModel target(test::pattern_chain(8));
  NGramStorage storage(3, 8);
  const auto result = ngram_assisted_generate(storage, target, Tokens{0, 1, 2, 3}, {.max_new_tokens = 64, .gamma = 6});
  EXPECT_GT(result.stats.acceptance_rate(), 0.6);
  EXPECT_GT(result.stats.tokens_per_target_call(), 3.0);
  EXPECT_GT(storage.size(), 0u);
}

TEST(NGramAssistedGenerate, RejectsBadInput) {
  test::MarkovModel target(test::pattern_chain(8));
  NGramStorage storage(3, 8);
  EXPECT_THROW((void)ngram_assisted_generate(storage, target, Tokens{1}, {.gamma = 0}), std::invalid_argument);
  EXPECT_THROW((void)ngram_assisted_generate(storage, target, Tokens{1}, {.filler_top_k = 0}), std::invalid_argument);
  EXPECT_THROW((void)ngram_assisted_generate(storage, target, Tokens{9}), std::invalid_argument);
  EXPECT_THROW((void)ngram_assisted_generate(storage, target, Tokens{}), std::invalid_argument);
}

// Sequences of 3 tokens after prompt {0} with a fresh storage that learned `history`.
const at::Tensor& noisy_chain() {
  static const at::Tensor t = [] {
    std::vector<at::Tensor> rows;
    for (const auto& row : std::vector<std::vector<double>>{{.1, .5, .2, .2}, {.15, .15, .5, .2}, {.2, .2, .1, .5}, {.5, .2, .2, .1}}) {
      rows.push_back(at::tensor(row, at::kDouble));
    }
    return at::stack(rows);
  }();
  return t;
}

// The seed's verifier, deliberately biased: sample x from p; keep the draft when x equals it,
// otherwise sample a fresh token from p. P(draft) becomes p(2 - p).
template <class P>
Tokens biased_generate(test::MarkovModel& target, NGramStorage& storage, const Tokens& prompt, const P& processor,
                       at::Generator& gen) {
  Tokens sequence = prompt;
  storage.initialize(prompt);
  const at::Tensor probs = processor(target.logits());
  while (sequence.size() < prompt.size() + 3) {
    const auto draft = storage.next_token(sequence).value_or(sequence.back());
    const at::Tensor row = probs[sequence.back()].unsqueeze(0);
    int64_t x = processor.sample(row, gen).template item<int64_t>();
    if (x != draft) x = processor.sample(row, gen).template item<int64_t>();
    storage.update(sequence, Tokens{x});
    sequence.push_back(x);
  }
  return Tokens(sequence.begin() + static_cast<long>(prompt.size()), sequence.end());
}

template <class P>
test::ChiSquare fit(const P& processor, bool biased, int64_t samples, const NGramDraftRule& rule = {}) {
  test::MarkovModel target(noisy_chain());
  const Tokens prompt{0, 1, 2, 3, 0};
  std::map<Tokens, int64_t> observed;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  for (int64_t i = 0; i < samples; ++i) {
    NGramStorage storage(3, 4);
    const Tokens tokens = biased ? biased_generate(target, storage, prompt, processor, gen)
                                 : ngram_assisted_generate(storage, target, prompt,
                                                           {.max_new_tokens = 3, .seed = static_cast<uint64_t>(i),
                                                            .gamma = 3, .draft_rule = rule, .first_target = false},
                                                           processor).tokens;
    ++observed[tokens];
  }
  const at::Tensor step = processor(target.logits()).to(at::kDouble);
  std::map<Tokens, double> expected;
  for (int64_t a = 0; a < 4; ++a) {
    for (int64_t b = 0; b < 4; ++b) {
      for (int64_t c = 0; c < 4; ++c) expected[{a, b, c}] = (step[0][a] * step[a][b] * step[b][c]).template item<double>();
    }
  }
  return test::chi_square(observed, expected, samples);
}

template <class P>
void expect_exact_and_detectable(const P& processor) {
  const auto exact = fit(processor, false, 8000);
  EXPECT_EQ(exact.outside_support, 0);
  EXPECT_LT(exact.statistic, test::chi_square_quantile(exact.dof, 4.75)) << processor;
  const auto biased = fit(processor, true, 8000);
  EXPECT_GT(biased.statistic, test::chi_square_quantile(biased.dof, 4.75)) << processor;
}

TEST(NGramAssistedDistribution, MultinomialEqualsTarget) { expect_exact_and_detectable(MultinomialProcessor{1.0}); }
TEST(NGramAssistedDistribution, TopKEqualsTarget) { expect_exact_and_detectable(TopKProcessor{3}); }
TEST(NGramAssistedDistribution, ConfidentDraftsEqualTarget) {
  const auto exact = fit(MultinomialProcessor{1.0}, false, 8000, {.min_share = 0.5});
  EXPECT_EQ(exact.outside_support, 0);
  EXPECT_LT(exact.statistic, test::chi_square_quantile(exact.dof, 4.75));
}

}  // namespace

}  // namespace test_ngram_storage
